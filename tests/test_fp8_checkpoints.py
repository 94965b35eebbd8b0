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


@pytest.mark.parametrize("impl", ["grouped_mm", "batched_mm", "eager"])
def test_fp8_experts_are_proved_by_their_forward_and_checked(fp8_model, impl):
    """Each experts implementation's forward is recorded (transformers' fp8 kernels at their contract) and read,
    then checked numerically against the reference on the dequantised weights; the activation is read from the
    forward (a clamp the attributes do not announce is found), not taken from the config."""
    e = fp8_model.model.layers[0].mlp.experts
    old = e.config._experts_implementation
    e.config._experts_implementation = impl
    try:
        m = match_fp8_experts(e)
        assert not isinstance(m, str), m
        assert m.activation == "silu" and m.spec.is_plain and not m.weights_on_input
        assert m.error < 1e-4 and "real and random weights" in m.probe
        e.limit = 7.0  # FP8Experts._apply_gate then clamps gate and up (GPT-OSS style)
        clamped = match_fp8_experts(e)
        assert not isinstance(clamped, str), clamped
        assert clamped.spec.limit == 7.0 and clamped.op_kwargs()["limit"] == 7.0
    finally:
        e.limit = None
        e.config._experts_implementation = old


def _fp8_subclass(experts, forward=None, gate=None, linear=None):
    """``experts`` turned into an instance of a subclass of its class that overrides some methods."""
    body = {k: v for k, v in (("forward", forward), ("_apply_gate", gate), ("linear", linear)) if v is not None}
    experts.__class__ = type("Custom" + type(experts).__name__, (type(experts),), body)
    return experts


@pytest.mark.parametrize("impl", ["grouped_mm", "eager"])
def test_fp8_experts_that_compute_something_else_are_left_alone(impl):
    """Near misses, with the eager model as the reference: an extra scale after the experts, a softcapped gate,
    products without the block scales, shuffled routing (the check catches it). On attributes alone all of these
    were captured (or refused for the wrong reason); each now keeps its forward and says why."""
    import torch.nn.functional as F

    from moe_fx.capture.fp8_modules import modelled_fp8_kernels

    def scaled(self, h, i, w):
        return type(self).__mro__[1].forward(self, h, i, w) * 1.5

    def softcap(self, gate_up):
        g, u = gate_up.chunk(2, dim=-1)
        return torch.tanh(g) * u

    def no_scale(self, x, w, s, activation_scale=None):
        return F.linear(x, w.to(x.dtype))

    def shuffled(self, h, i, w):
        return type(self).__mro__[1].forward(self, h, (i + 1) % self.num_experts, w)

    cases = [({"forward": scaled}, "scales the combined output by 1.5"), ({"gate": softcap}, "'tanh'"),
             ({"forward": shuffled}, "numerical check failed")]
    if impl == "eager":
        cases.append(({"linear": no_scale}, "without its block scales"))
    tokens = torch.randint(0, 128, (1, 7), generator=torch.Generator().manual_seed(3))
    for override, why in cases:
        model = tiny_fp8_hf_model("mixtral", num_layers=1, hidden=256, intermediate=128, num_experts=4, top_k=2)
        experts = _fp8_subclass(model.model.layers[0].mlp.experts, **override)
        experts.config._experts_implementation = impl
        with torch.no_grad(), modelled_fp8_kernels():
            want = model(tokens).logits
        reports = capture_fp8_experts(model)
        assert [r.matched for r in reports] == [False] and why in reports[0].reason, (override, reports[0].reason)
        assert "forward" not in vars(experts)  # left exactly as written
        with torch.no_grad(), modelled_fp8_kernels():
            assert torch.equal(model(tokens).logits, want)


def test_capture_uses_fp8_weights_as_stored_and_matches_dequantized_eager(fp8_model):
    tokens = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    oracle = dequantized_copy(fp8_model)
    try:
        reports = capture_fp8_experts(fp8_model)
        assert [r.matched for r in reports] == [True, True]
        assert reports[0].layer == "model.layers.0.mlp.experts" and reports[0].fp8 and reports[0].dtype == "bfloat16"
        assert reports[0].verified == "numerics" and reports[0].probe_error < 1e-4
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
