"""The expert forms beyond plain SwiGLU: GPT-OSS, Llama 4, clamped, non-gated, hand-written sort dispatch, K = 1.

For each form: the graph the pass leaves (expect-inline), numerics against eager in fp32 and bf16, and the near
misses the op cannot express, which must stay exactly as the model wrote them. bf16 comparisons use one MoE layer
so that routing sees bit-identical inputs in eager and compiled runs (no top-k ties can flip).
"""

from __future__ import annotations

import re
import types

import pytest
import torch
from expecttest import TestCase
from helpers import ATTENTION_SAME_ON_EVERY_TORCH, capture_backend, logits, rel_err, run_captured

from moe_fx.backend import enable_capture
from moe_fx.config import MoEConfig
from moe_fx.testing.families import ClampedSwiGLUMoE, DenseScoresMoE, JetSortMoE, NonGatedMoE, tiny_family_model
from moe_fx.testing.models import tiny_hf_model

OP = "torch.ops.moe_fx.experts.default("
TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2}


def _short(code: str) -> str:
    """Graph code with Dynamo's parameter names shortened: ``l_self_modules_model_modules_layers_modules_0_modules_
    mlp_modules_experts_parameters_down_proj_`` -> ``mlp.experts.down_proj``."""

    def short(m: re.Match) -> str:
        name = re.sub(r"^l_self_", "", m.group(0)).rstrip("_")
        name = re.sub(r"^modules_model_modules_layers_modules_\d+_modules_", "", name)
        return re.sub(r"^(modules|parameters)_", "", name).replace("_modules_", ".").replace("_parameters_", ".")

    return re.sub(r"\bl_self_\w+", short, code)


def _slice(code: str, start: str, end: str = OP, after: int = 1) -> str:
    """The lines of ``code`` from the first containing ``start`` to ``after`` lines past the first with ``end``."""
    lines = [ln.split(";  ")[0].rstrip() for ln in code.splitlines()]
    first = next(i for i, ln in enumerate(lines) if start in ln)
    last = next(i for i, ln in enumerate(lines) if end in ln and i >= first)
    return "\n".join(lines[first : last + 1 + after])


def _tokens(n: int = 9, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 128, (1, n), generator=torch.Generator().manual_seed(seed))


class TestFormGraphs(TestCase):
    """What the pass leaves in Dynamo's graph for each new form (routing untouched, one op per MoE layer)."""

    def test_gpt_oss(self):
        # Clamped SwiGLU with alpha and (up + 1), interleaved gate/up columns of a transposed [E, H, 2I]
        # weight (passed as a transposed view), biases on both products, router with a bias.
        model = tiny_hf_model("gpt_oss", num_layers=1, num_experts=4, dtype=torch.bfloat16)
        _, cap = run_captured(model, _tokens())
        self.assertExpectedInline(_short(_slice(cap.code, "router_logits = ")), """\
    router_logits = torch._C._nn.linear(hidden_states_9, mlp.router.weight, mlp.router.bias)
    topk = torch.topk(router_logits, 2, dim = -1)
    router_top_value = topk[0]
    router_indices = topk[1]
    router_scores = torch.nn.functional.softmax(router_top_value, dim = 1, dtype = torch.bfloat16)
    transpose_5 = mlp.experts.gate_up_proj.transpose(1, 2)
    transpose_6 = mlp.experts.down_proj.transpose(1, 2)
    experts_default = torch.ops.moe_fx.experts.default(hidden_states_9, router_indices, router_scores, transpose_5, transpose_6, activation = 'silu', weights_on_input = False, kernel_choice = 'auto', w13_bias = mlp.experts.gate_up_proj_bias, w2_bias = mlp.experts.down_proj_bias, gate_up_layout = 'interleaved', alpha = 1.702, limit = 7.0, up_offset = 1.0)
    hidden_states_10 = experts_default.to(torch.bfloat16)""")

    def test_llama4(self):
        # Dense sigmoid scores on the expert input: the op reads the router's own top-k ids and the scores
        # gathered at them (weights_on_input); the shared expert's in-place add stays.
        # Eager attention, so that Dynamo's names below are the same on every torch (see helpers).
        model = tiny_hf_model(
            "llama4", num_layers=1, num_experts=4, dtype=torch.bfloat16, **ATTENTION_SAME_ON_EVERY_TORCH
        )
        _, cap = run_captured(model, _tokens())
        self.assertExpectedInline(_short(_slice(cap.code, "router_logits = ", after=2)), """\
    router_logits = torch._C._nn.linear(hidden_states_5, feed_forward.router.weight, None)
    topk = torch.topk(router_logits, 1, dim = 1)
    router_top_value = topk[0]
    router_indices = topk[1]
    full_like = torch.full_like(router_logits, -inf)
    router_scores = full_like.scatter_(1, router_indices, router_top_value)
    float_8 = router_scores.float()
    sigmoid = torch.nn.functional.sigmoid(float_8)
    router_scores_1 = sigmoid.to(torch.bfloat16)
    linear_5 = torch._C._nn.linear(hidden_states_5, feed_forward.shared_expert.gate_proj.weight, None)
    silu_1 = torch.nn.functional.silu(linear_5)
    linear_6 = torch._C._nn.linear(hidden_states_5, feed_forward.shared_expert.up_proj.weight, None)
    down_proj = silu_1 * linear_6
    out = torch._C._nn.linear(down_proj, feed_forward.shared_expert.down_proj.weight, None)
    transpose_6 = feed_forward.experts.gate_up_proj.transpose(1, 2)
    transpose_7 = feed_forward.experts.down_proj.transpose(1, 2)
    gather = router_scores_1.gather(1, router_indices)
    experts_default = torch.ops.moe_fx.experts.default(hidden_states_5, router_indices, gather, transpose_6, transpose_7, activation = 'silu', weights_on_input = True, kernel_choice = 'auto')
    add_ = out.add_(experts_default)
    view_5 = out.view((1, 9, 32))""")

    def test_non_gated(self):
        torch.manual_seed(0)
        _, cap = run_captured(NonGatedMoE(), torch.randn(6, 32))
        self.assertExpectedInline(_short(_slice(cap.code, "linear = ")), """\
    linear = torch._C._nn.linear(x, router.weight)
    probs = torch.nn.functional.softmax(linear, dim = -1, dtype = torch.float32)
    topk = torch.topk(probs, 2, dim = -1)
    weights = topk[0]
    ids = topk[1]
    sum_1 = weights.sum(dim = -1, keepdim = True)
    truediv = weights / sum_1
    weights_1 = truediv.to(torch.float32)
    experts_default = torch.ops.moe_fx.experts.default(x, ids, weights_1, up_proj, down_proj, activation = 'relu2', weights_on_input = False, kernel_choice = 'auto', gated = False)
    reshape_3 = experts_default.reshape((6, 32))""")

    def test_clamped_swiglu(self):
        torch.manual_seed(0)
        _, cap = run_captured(ClampedSwiGLUMoE(bias="output"), torch.randn(6, 32))
        self.assertExpectedInline(_short(_slice(cap.code, "linear = ")), """\
    linear = torch._C._nn.linear(x, router.weight)
    probs = torch.nn.functional.softmax(linear, dim = -1, dtype = torch.float32)
    topk = torch.topk(probs, 2, dim = -1)
    weights = topk[0]
    ids = topk[1]
    sum_1 = weights.sum(dim = -1, keepdim = True)
    truediv = weights / sum_1
    weights_1 = truediv.to(torch.float32)
    experts_default = torch.ops.moe_fx.experts.default(x, ids, weights_1, gate_up, down, activation = 'silu', weights_on_input = False, kernel_choice = 'auto', w2_bias = down_bias, limit = 1.5)
    reshape_1 = experts_default.reshape((6, 32))""")

    def test_jetmoe_sort_dispatch(self):
        # The counts (.tolist()), the sort, the split and the per-expert loop are gone; the output bias stays.
        torch.manual_seed(0)
        _, cap = run_captured(JetSortMoE(), torch.randn(6, 32))
        self.assertExpectedInline(_short(_slice(cap.code, "topk = ", after=2)), """\
    topk = logits.topk(2, dim = 1)
    top_logits = topk[0]
    top_ids = topk[1]
    softmax = torch.softmax(top_logits, dim = 1)
    gates = softmax.type_as(x)
    experts_default = torch.ops.moe_fx.experts.default(x, top_ids, gates, input_linear, output_linear, activation = 'silu', weights_on_input = False, kernel_choice = 'auto')
    add = experts_default + bias
    reshape_1 = add.reshape((6, 32))""")


# ------------------------------------------------------------------------------------------------
# Numerics against eager: transformers families and user-written forms, fp32 and bf16.

FAMILY_FORMS = {
    # family: (form, activation details the report must name)
    "gpt_oss": ("grouped_mm", "gated silu(alpha=1.702, limit=7, up+1, interleaved); biases w13+w2"),
    "llama4": ("dense_bmm", "dense [T, E] scores reduced to the router's top-1"),
    "deepseek_v4": ("grouped_mm", "gated silu(limit=10)"),
    "nemotron_h": ("grouped_mm", "relu2 (not gated)"),
    "jetmoe": ("expert_loop", ""),
    "zaya": ("grouped_mm", ""),  # one expert per token (K = 1)
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", sorted(FAMILY_FORMS))
def test_family_matches_eager(family, dtype):
    model = tiny_family_model(family, dtype=dtype, num_layers=2 if dtype == torch.float32 else 1)
    ids = torch.randint(3, 128, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = logits(model(ids))
    got, cap = run_captured(model, ids)
    matched = [r for r in cap.reports if r.matched]
    moe_layers = sum(1 for r in cap.reports if r.layer != "<graph>")
    assert moe_layers >= 1 and len(matched) == moe_layers, [r.one_line() for r in cap.reports]
    assert cap.count(OP) == moe_layers
    form, details = FAMILY_FORMS[family]
    assert {r.form for r in matched} == {form}
    assert {r.details for r in matched} == {details}
    assert rel_err(logits(got), want) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "make",
    [lambda: NonGatedMoE(), lambda: NonGatedMoE(activation="gelu"), lambda: ClampedSwiGLUMoE(),
     lambda: ClampedSwiGLUMoE(bias="output"), lambda: DenseScoresMoE(top_k=2), lambda: JetSortMoE()],
    ids=["non_gated_relu2", "non_gated_gelu", "clamped", "clamped_bias", "dense_scores", "jet_sort"],
)
def test_user_forms_match_eager(make, dtype):
    torch.manual_seed(0)
    model = make().to(dtype)
    # Scale 3: activations reach the clamp bound (1.5) in the clamped forms.
    x = (torch.randn(11, 32, generator=torch.Generator().manual_seed(1)) * 3).to(dtype)
    with torch.no_grad():
        want = model(x)
    got, cap = run_captured(model, x)
    assert cap.count(OP) == 1, [r.one_line() for r in cap.reports]
    assert rel_err(got, want) < TOL[dtype]


# ------------------------------------------------------------------------------------------------
# Near misses: left exactly as written, with the reason.


def _untouched(model, x, why: str) -> None:
    out, cap = run_captured(model, x)
    ref, plain = run_captured(model, x, passes=False)
    assert cap.count(OP) == 0
    assert cap.code == plain.code, "an unmatched region must stay exactly as it was"
    assert torch.equal(logits(out), logits(ref))
    (report,) = [r for r in cap.reports if r.layer != "<graph>"]
    assert not report.matched and why in report.reason, report.reason


@pytest.mark.parametrize(
    "make, why",
    [
        (lambda: ClampedSwiGLUMoE(up_limit=3.0), "gate and up are clamped at different bounds (1.5 and 3)"),
        (lambda: ClampedSwiGLUMoE(clamp_after_act=True), "clamps the activation"),  # Step-3.7's clamp after silu
        (lambda: ClampedSwiGLUMoE(bias="after_weight"), "after the routing weight"),  # bias not scaled by the weight
        (lambda: DenseScoresMoE(scores="softmax"), "does not prove zero outside the router's top-k"),
    ],
    ids=["other_up_limit", "clamp_after_act", "bias_after_weight", "dense_softmax_scores"],
)
def test_user_near_misses_untouched(make, why):
    torch.manual_seed(0)
    _untouched(make(), torch.randn(6, 32) * 3, why)


def test_gpt_oss_with_another_up_clamp_is_untouched():
    """GPT-OSS itself with |up| clamped at 5 instead of its limit 7: the op's clamped SwiGLU cannot express it."""
    model = tiny_hf_model("gpt_oss", num_layers=1, num_experts=4)
    experts = model.model.layers[0].mlp.experts

    def other_clamp(self, gate_up):
        gate, up = gate_up[..., ::2], gate_up[..., 1::2]
        gate, up = gate.clamp(max=self.limit), up.clamp(-5.0, 5.0)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))

    experts._apply_gate = types.MethodType(other_clamp, experts)
    _untouched(model, _tokens(), "gate and up are clamped at different bounds (7 and 5)")


def test_clamp_placement_is_read_from_the_graph():
    """Where a clamp sits is read from the graph, not guessed from its constants: with no numerical check at
    all (verify='never') a clamped SwiGLU is rewritten (marked unverified) and a clamp after the activation
    is still refused; with the check, the clamped form is verified."""
    torch.manual_seed(0)
    model, x = ClampedSwiGLUMoE(), torch.randn(6, 32)
    _, cap = run_captured(model, x, config=MoEConfig(verify="never"))
    assert cap.count(OP) == 1 and cap.reports[0].verified == "unverified"
    assert cap.reports[0].details == "gated silu(limit=1.5)"
    _, cap = run_captured(ClampedSwiGLUMoE(clamp_after_act=True), x, config=MoEConfig(verify="never"))
    assert cap.count(OP) == 0 and "clamps the activation" in cap.reports[0].reason
    _, cap = run_captured(model, x)
    assert cap.count(OP) == 1 and cap.reports[0].verified.startswith("numerics")


@pytest.mark.parametrize("impl", ["grouped_mm", "batched_mm"])
def test_gpt_oss_dynamic_floats_are_specialised(impl):
    """With dynamic=True Dynamo makes GPT-OSS's alpha and limit graph inputs (run-time floats): the region
    is still rewritten, on their traced values, and the graph is guarded on them (a new limit recompiles
    and is probed again)."""
    model = tiny_family_model("gpt_oss", num_layers=1, experts_implementation=impl)
    ids = torch.randint(3, 128, (2, 9), generator=torch.Generator().manual_seed(0))
    experts = model.model.layers[0].mlp.experts
    torch._dynamo.reset()
    enable_capture()
    backend, cap = capture_backend()
    compiled = torch.compile(model, backend=backend, dynamic=True)
    with torch.no_grad():
        assert rel_err(logits(compiled(ids)), logits(model(ids))) < 1e-5
        assert cap.compiles == 1 and cap.reports[0].matched, cap.reports[0].reason
        assert "limit=7" in cap.reports[0].details
        experts.limit = 0.5
        assert rel_err(logits(compiled(ids)), logits(model(ids))) < 1e-5
    assert cap.compiles == 2 and cap.reports[-1].matched and "limit=0.5" in cap.reports[-1].details
