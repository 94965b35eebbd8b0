"""The capture step for experts that loop over the experts a batch hits (data-dependent loops Dynamo cannot
trace as one graph): transformers' ``eager`` implementation, GPT-OSS, LongCat-Flash (identity experts),
Step-3.7, DBRX; and explain listing every MoE layer with the right name."""

from __future__ import annotations

import re

import pytest
import torch
from expecttest import TestCase
from helpers import OpSpy, capture_backend, logits, rel_err

import moe_fx
from moe_fx.backend import enable_capture
from moe_fx.capture.hit_loops import (
    capture_expert_loops,
    loop_experts_candidates,
    match_loop_experts,
    release_expert_loops,
)
from moe_fx.ops import ExpertActivation
from moe_fx.testing.families import HitLoopExperts, HitLoopMoE, tiny_family_model

OP = "torch.ops.moe_fx.experts("  # the captured forward calls the op packet; Dynamo records it as such
TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2}


def _routing(t: int, slots: int, k: int = 2, dtype=torch.float32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(t, 32, generator=g) * 3).to(dtype)  # scale 3: reaches the clamp bounds below
    ids = torch.stack([torch.randperm(slots, generator=g)[:k] for _ in range(t)])
    weights = (torch.rand(t, k, generator=g) + 0.1).to(dtype)
    return hidden, ids, weights


VARIANTS = {
    "swiglu": ({}, ExpertActivation("silu")),
    "gelu": ({"activation": "gelu"}, ExpertActivation("gelu")),
    "gpt_oss": (
        {"bias": True, "limit": 1.0, "alpha": 1.702, "up_offset": 1.0, "interleaved": True, "transposed": True},
        ExpertActivation("silu", True, "interleaved", 1.702, 1.0, 1.0),
    ),
    "identity_item": ({"identity_experts": 2, "item": True}, ExpertActivation("silu")),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_captured_loop_equals_its_own_forward(variant, dtype):
    options, spec = VARIANTS[variant]
    torch.manual_seed(0)
    experts = HitLoopExperts(**options).to(dtype)
    m = match_loop_experts(experts)
    assert not isinstance(m, str), m
    assert m.spec == spec and m.num_experts == 8 and m.identity_experts == options.get("identity_experts", 0)
    assert m.transposed == options.get("transposed", False)
    assert (m.w13_bias, m.w2_bias) == (("gate_up_proj_bias", "down_proj_bias") if options.get("bias") else (None, None))
    hidden, ids, weights = _routing(13, 8 + m.identity_experts, dtype=dtype, seed=5)
    with torch.no_grad():
        want = experts(hidden, ids, weights)
        (report,) = capture_expert_loops(experts)
        got = experts(hidden, ids, weights)
    assert report.matched and report.form == "hit_loop" and report.verified.startswith("numerics")
    assert rel_err(got, want) < TOL[dtype]


class TestCapturedGraph(TestCase):
    def test_identity_experts_graph(self):
        """LongCat-Flash-like experts (a loop with .item(), identity experts, transposed storage, biases): one
        graph whose experts are one op on views of the module's parameters (w13 holds extra identity rows)."""
        torch.manual_seed(0)
        model = HitLoopMoE(identity_experts=2, item=True, transposed=True, bias=True)
        with torch.no_grad():  # LongCat keeps gate_up rows for its identity experts too: give w13 E+Z rows
            model.experts.gate_up_proj = torch.nn.Parameter(torch.randn(10, 32, 32) * 0.2)
        x = torch.randn(6, 32)
        with torch.no_grad():
            want = model(x)
        got, cap, reports = _compile_captured(model, x, torch.float32)
        assert reports[0].matched and reports[0].details.endswith("2 identity experts")
        assert cap.compiles == 1 and rel_err(got, want) < 1e-5
        code = re.sub(r"\bl_self_modules_experts_parameters_(\w+?)_\b", r"experts.\1", cap.code)
        lines = [ln.split(";  ")[0] for ln in code.splitlines()]
        first = next(i for i, ln in enumerate(lines) if ".transpose(1, 2)" in ln)
        last = next(i for i, ln in enumerate(lines) if "torch.ops.moe_fx.experts(" in ln)
        self.assertExpectedInline("\n".join(lines[first : last + 2]), """\
    w13 = experts.gate_up_proj.transpose(1, 2)
    w2 = experts.down_proj.transpose(1, 2)
    t = w13[slice(None, 8, None)]
    out = torch.ops.moe_fx.experts(x, ids, weights_1, t, w2, 'silu', False, None, None, 'auto', w13_bias = experts.gate_up_proj_bias, w2_bias = experts.down_proj_bias, gated = True, gate_up_layout = 'halves', alpha = 1.0, limit = None, up_offset = 0.0, identity_experts = 2)
    reshape_1 = out.reshape((6, 32))""")


def test_captured_forward_reads_views_of_the_parameters():
    """The op gets the module's own storage (a transposed view, never a copy), biases included."""
    experts = HitLoopExperts(**VARIANTS["gpt_oss"][0])
    capture_expert_loops(experts)
    spy = OpSpy()
    with torch.no_grad(), spy:
        experts(*_routing(5, 8))
    ((args, kwargs),) = spy.calls
    w13, w2 = args[3], args[4]
    assert w13.data_ptr() == experts.gate_up_proj.data_ptr() and tuple(w13.shape) == (8, 32, 32)
    assert w2.data_ptr() == experts.down_proj.data_ptr() and tuple(w2.shape) == (8, 32, 16)
    assert kwargs["w13_bias"].data_ptr() == experts.gate_up_proj_bias.data_ptr()
    assert (kwargs["gate_up_layout"], kwargs["limit"], kwargs["up_offset"]) == ("interleaved", 1.0, 1.0)
    assert release_expert_loops(experts) == 1 and "forward" not in vars(experts)


def test_training_runs_the_modules_own_forward():
    """The op has no backward: with grad on and weights that require grad, the captured module falls back."""
    experts = HitLoopExperts()
    capture_expert_loops(experts)
    hidden, ids, weights = _routing(6, 8)
    spy = OpSpy()
    with spy:
        experts(hidden, ids, weights).sum().backward()
    assert spy.calls == [] and experts.gate_up_proj.grad is not None
    with torch.no_grad(), spy:
        experts(hidden, ids, weights)
    assert len(spy.calls) == 1


def test_near_miss_keeps_its_forward():
    """Step-3.7's clamp after the activation: the recorded forward is read, the clamp named, the module keeps
    its own forward."""
    experts = HitLoopExperts(limit=1.0, clamp_after_act=True)
    (report,) = capture_expert_loops(experts)
    assert not report.matched and "clamps the activation" in report.reason
    assert "forward" not in vars(experts)


def test_numerics_are_required():
    (report,) = capture_expert_loops(HitLoopExperts(), moe_fx.MoEConfig(verify="never"))
    assert not report.matched and "verify='never'" in report.reason


def test_dtype_the_op_does_not_take_keeps_its_forward():
    """float64 experts (the numerical check runs in float32 and would pass) keep their own forward, with the dtype
    as the reason, instead of an op call that fails when Dynamo traces it."""
    experts = HitLoopExperts().double()
    (report,) = capture_expert_loops(experts)
    assert not report.matched and report.reason == (
        "expert weights are float64: moe_fx::experts takes float32/bfloat16/float16")
    assert "forward" not in vars(experts)
    (report,) = capture_expert_loops(HitLoopExperts())
    assert report.matched


def test_traceable_transformers_experts_are_left_to_the_graph_pass():
    grouped = tiny_family_model("mixtral", experts_implementation="grouped_mm")
    assert list(loop_experts_candidates(grouped)) == []
    eager = tiny_family_model("mixtral", experts_implementation="eager")
    names = [n for n, _ in loop_experts_candidates(eager)]
    assert names == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]


def _compile_captured(model, inputs, dtype):
    torch._dynamo.reset()
    enable_capture()
    reports = capture_expert_loops(model)
    backend, cap = capture_backend()
    with torch.no_grad():
        out = torch.compile(model, backend=backend)(inputs)
    return out, cap, reports


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", ["mixtral", "gpt_oss", "longcat_flash", "step3p7"])
def test_eager_loop_families_compile_to_one_graph(family, dtype):
    """transformers' eager experts (Mixtral, GPT-OSS), LongCat-Flash's identity experts, Step-3.7: one graph,
    one op per captured layer, equal to eager. Step-3.7's first layer (clamp after the activation) stays; in
    bf16 the layer after an uncaptured one sees bit-identical inputs, so no routing tie can flip."""
    layers = 2 if dtype == torch.float32 or family in ("longcat_flash", "step3p7") else 1
    extra = {"swiglu_limits": [2.0, 0.0]} if family == "step3p7" else {}
    model = tiny_family_model(family, dtype=dtype, experts_implementation="eager", num_layers=layers, **extra)
    ids = torch.randint(3, 128, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = logits(model(ids))
    try:
        got, cap, reports = _compile_captured(model, ids, dtype)
    finally:
        release_expert_loops(model)
    matched = [r for r in reports if r.matched]
    if family == "step3p7":
        assert [r.matched for r in reports] == [False, True]
        assert "clamps the activation" in reports[0].reason
    else:
        assert matched and len(matched) == len(reports)
        assert cap.compiles == 1, "the captured loops must not break the graph"
    assert cap.count(OP) == len(matched)
    if family == "longcat_flash":
        assert matched[0].details == "2 identity experts"
    if family == "gpt_oss":
        assert "alpha=1.702, limit=7, up+1, interleaved" in matched[0].details
    assert rel_err(logits(got), want) < TOL[dtype]


def test_dbrx_separate_gate_and_up_are_packed_into_one_copy_and_captured():
    """DBRX keeps gate and up in two flat [E * I, H] parameters: capture gives them one storage (rows
    interleaved, the parameters views of it), the op reads a view of that; equal to eager."""
    model = tiny_family_model("dbrx", num_layers=2)
    experts = [b.ffn.experts for b in model.transformer.blocks]
    before = sum(p.numel() for p in model.parameters())
    ids = torch.randint(3, 128, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = logits(model(ids))
    try:
        got, cap, reports = _compile_captured(model, ids, torch.float32)
        assert [r.matched for r in reports] == [True, True], [r.reason for r in reports]
        assert reports[0].details == "gated silu(interleaved)" and reports[0].probe_error < 1e-5
        assert cap.count(OP) == 2 and rel_err(logits(got), want) < 1e-5
        for ex in experts:
            w1, v1 = ex.mlp.w1, ex.mlp.v1
            assert w1.untyped_storage().data_ptr() == v1.untyped_storage().data_ptr()
            assert v1.data_ptr() == w1.data_ptr() + w1.shape[1] * w1.element_size()
        assert sum(p.numel() for p in model.parameters()) == before
        # In-place edits reach the packed storage; a replaced parameter makes the module run its own loop.
        with torch.no_grad():
            experts[0].mlp.v1.mul_(1.5)
            want = logits(model(ids))
        got, cap, _ = _compile_captured(model, ids, torch.float32)
        assert rel_err(logits(got), want) < 1e-5
        state = {k: v.clone().contiguous() * (1.2 if ".mlp." in k else 1.0) for k, v in model.state_dict().items()}
        model.load_state_dict(state, assign=True)
        assert experts[0].mlp.w1.stride() == (32, 1)  # no longer interleaved with v1
        release_expert_loops(model)
        with torch.no_grad():
            want = logits(model(ids))
        for r in capture_expert_loops(model):  # packs again
            assert r.matched
        torch._dynamo.reset()
        backend, cap = capture_backend()
        with torch.no_grad():
            experts[1].mlp.w1.data = experts[1].mlp.w1.detach().clone()  # replaced after packing: the loop runs
            got = torch.compile(model, backend=backend)(ids)
        assert cap.count(OP) == 1 and rel_err(logits(got), want) < 1e-5
    finally:
        release_expert_loops(model)


def test_captured_loops_see_data_edits():
    """The captured op reads views of the module's own parameters (DBRX: of the storage packing gave gate and
    up), so writes through ``.data`` (which bypass the parameter's version counter) reach the compiled graph."""
    model = tiny_family_model("dbrx", num_layers=1)
    ids = torch.randint(3, 128, (2, 9), generator=torch.Generator().manual_seed(0))
    try:
        torch._dynamo.reset()
        enable_capture()
        assert all(r.matched for r in capture_expert_loops(model))
        backend, cap = capture_backend()
        compiled = torch.compile(model, backend=backend)
        mlp = model.transformer.blocks[0].ffn.experts.mlp
        with torch.no_grad():
            compiled(ids)
            for edit in ("mul", "copy"):
                for p in (mlp.w1, mlp.v1, mlp.w2):
                    if edit == "mul":
                        p.data.mul_(-1.5)
                    else:
                        p.data.copy_(torch.randn_like(p) * 0.2)
                assert rel_err(logits(compiled(ids)), logits(model(ids))) < 1e-5, edit
        assert cap.compiles == 1 and cap.count(OP) == 1
    finally:
        release_expert_loops(model)


@pytest.mark.parametrize(
    "family, impl, layers",
    [
        ("gpt_oss", "grouped_mm", {"model.layers.0.mlp.experts": True}),
        ("gpt_oss", "eager", {"model.layers.0.mlp.experts": True}),
        ("llama4", None, {"model.layers.0.feed_forward.experts": True}),
        ("longcat_flash", None, {"model.layers.0.mlp.experts": True}),
        ("jetmoe", None, {"model.layers.0.mlp": True, "model.layers.0.self_attention.experts": False}),
        ("dbrx", None, {"transformer.blocks.0.ffn.experts": True}),
        ("doge", None, {"model.layers.0.mlp": False}),
    ],
)
def test_explain_lists_every_moe_layer(family, impl, layers):
    """Every MoE layer appears once under its own module path, matched or with a reason."""
    kwargs = {"num_hidden_layers": 2} if family == "longcat_flash" else {"num_layers": 1}
    model = tiny_family_model(family, experts_implementation=impl, **kwargs)
    torch._dynamo.reset()
    try:
        report = moe_fx.explain(model, torch.randint(3, 128, (1, 6)))
    finally:
        release_expert_loops(model)
    assert {r.layer: r.matched for r in report.regions} == layers, str(report)
    assert all(r.matched or r.reason for r in report.regions)
