"""Fine-grained FP8 checkpoints (transformers' FP8Experts): tiny model, recognizer, capture, CPU numerics."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from helpers import OpSpy  # noqa: E402

from moe_fx.capture.fp8_modules import capture_fp8_experts, match_fp8_experts, release_fp8_experts  # noqa: E402
from moe_fx.testing.fp8 import dequantized_copy, is_fp8_experts, tiny_fp8_hf_model  # noqa: E402


@pytest.fixture(scope="module")
def fp8_model():
    return tiny_fp8_hf_model("mixtral", num_layers=2, hidden=256, intermediate=128, num_experts=4, top_k=2)


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def test_tiny_fp8_model_has_transformers_fp8_experts(fp8_model):
    experts = [m for m in fp8_model.modules() if is_fp8_experts(m)]
    assert len(experts) == 2
    e = experts[0]
    assert e.gate_up_proj.dtype == torch.float8_e4m3fn and tuple(e.gate_up_proj.shape) == (4, 256, 256)
    assert e.down_proj.dtype == torch.float8_e4m3fn and tuple(e.down_proj.shape) == (4, 256, 128)
    assert e.gate_up_proj_scale_inv.dtype == torch.float32 and tuple(e.gate_up_proj_scale_inv.shape) == (4, 2, 2)
    assert tuple(e.down_proj_scale_inv.shape) == (4, 2, 1)
    assert list(e.block_size) == [128, 128] and e.activation_scheme == "dynamic"
    # The attention and router weights stay bf16.
    assert fp8_model.model.layers[0].self_attn.q_proj.weight.dtype == torch.bfloat16
    plain = dequantized_copy(fp8_model)
    assert not any(is_fp8_experts(m) for m in plain.modules())
    assert plain.model.layers[0].mlp.experts.gate_up_proj.dtype == torch.bfloat16


def test_recognizer_accepts_and_rejects(fp8_model):
    e = fp8_model.model.layers[0].mlp.experts
    m = match_fp8_experts(e)
    assert (m.num_experts, m.hidden, m.intermediate, m.activation) == (4, 256, 128, "silu")
    assert "no *_scale_inv" in match_fp8_experts(torch.nn.Linear(4, 4))
    plain = dequantized_copy(fp8_model).model.layers[0].mlp.experts
    assert "not an FP8 experts module" in match_fp8_experts(plain)
    for attr, value, why in [
        ("swiglu_limit", 7.0, "swiglu_limit"),
        ("activation_scheme", "static", "static"),
        ("block_size", [64, 64], "not 128x128"),
        ("_is_expert_parallel", True, "expert-parallel"),
    ]:
        old = getattr(e, attr)
        setattr(e, attr, value)
        try:
            assert why in match_fp8_experts(e)
        finally:
            setattr(e, attr, old)
    scale = e.down_proj_scale_inv
    e.down_proj_scale_inv = torch.nn.Parameter(scale.detach().to(torch.bfloat16), requires_grad=False)
    try:
        assert "down_proj_scale_inv is torch.bfloat16" in match_fp8_experts(e)
    finally:
        e.down_proj_scale_inv = scale


def test_capture_uses_fp8_weights_as_stored_and_matches_dequantized_eager(fp8_model):
    tokens = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    oracle = dequantized_copy(fp8_model)
    try:
        reports = capture_fp8_experts(fp8_model)
        assert [r.matched for r in reports] == [True, True]
        assert reports[0].layer == "model.layers.0.mlp.experts" and reports[0].fp8 and reports[0].dtype == "bfloat16"
        spy = OpSpy()
        with torch.no_grad():
            want = oracle(tokens).logits
            with spy:
                got = fp8_model(tokens).logits
        # One op call per layer, handed the module's own fp8 parameters and scales (same storage).
        assert len(spy.calls) == 2
        e = fp8_model.model.layers[0].mlp.experts
        args = spy.calls[0][0]
        w13, w2, s13, s2 = args[3], args[4], args[7], args[8]
        assert w13.dtype == torch.float8_e4m3fn and w13.data_ptr() == e.gate_up_proj.data_ptr()
        assert w2.data_ptr() == e.down_proj.data_ptr()
        assert s13.data_ptr() == e.gate_up_proj_scale_inv.data_ptr()
        assert s2.data_ptr() == e.down_proj_scale_inv.data_ptr()
        # CPU runs the reference (fp32 with the dequantised weights); the oracle holds them in bf16.
        assert _rel(got, want) < 2e-2
        assert capture_fp8_experts(fp8_model)[0].matched  # idempotent
    finally:
        assert release_fp8_experts(fp8_model) == 2
    assert "forward" not in vars(fp8_model.model.layers[0].mlp.experts)


def test_captured_fp8_model_compiles_to_one_op_per_layer(fp8_model):
    from moe_fx.backend import make_backend

    tokens = torch.randint(0, 128, (1, 9), generator=torch.Generator().manual_seed(1))
    graphs = []

    def spy_backend(gm, example_inputs):
        graphs.append(gm)
        return make_backend(inductor=False)(gm, example_inputs)

    torch._dynamo.reset()
    try:
        capture_fp8_experts(fp8_model)
        with torch.no_grad():
            want = fp8_model(tokens).logits
            got = torch.compile(fp8_model, backend=spy_backend, fullgraph=True)(tokens).logits
    finally:
        release_fp8_experts(fp8_model)
        torch._dynamo.reset()
    # Dynamo records the op packet (torch.ops.moe_fx.experts) or its overload.
    targets = (torch.ops.moe_fx.experts, torch.ops.moe_fx.experts.default)
    ops = [n for gm in graphs for n in gm.graph.nodes if n.target in targets]
    assert len(ops) == 2
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)
