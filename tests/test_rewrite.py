"""Graph-rewrite tests: what the moe_fx pass leaves in Dynamo's graph, for every form, and near misses."""

from __future__ import annotations

import logging
import re

import pytest
import torch
from expecttest import TestCase
from helpers import ATTENTION_SAME_ON_EVERY_TORCH, experts_in_one_copy, run_captured

from moe_fx.config import MoEConfig
from moe_fx.testing.models import DENSE_VARIANTS, HF_FAMILIES, DenseBmmMoE, LoopMoE, TitanGroupedMoE, tiny_hf_model

OP = "torch.ops.moe_fx.experts.default("


def _body(code: str) -> str:
    """The graph code from the first non-placeholder line on, with long parameter names shortened."""
    lines = [ln for ln in code.strip().splitlines() if ln.strip()]
    start = next(i for i, ln in enumerate(lines) if "=" in ln and not re.match(r"\s+l_\w+ = L_\w+$", ln) and "def forward" not in ln)
    body = "\n".join(lines[start:])
    return re.sub(r"l_self_(?:modules_|parameters_)?(\w+?)_?(?=[,;)\s])", r"\1", body)


class TestExpectedGraphs(TestCase):
    """The graph after the pass, printed, for the user-written forms."""

    def _hf_moe_slice(self, impl: str) -> str:
        """The graph lines from the router to the line after the op, for a 1-layer tiny Qwen3-MoE (eager
        attention: see ``ATTENTION_SAME_ON_EVERY_TORCH``)."""
        model = tiny_hf_model(
            "qwen3_moe", num_layers=1, experts_implementation=impl, dtype=torch.bfloat16, **ATTENTION_SAME_ON_EVERY_TORCH
        )
        _, cap = run_captured(model, torch.randint(0, 128, (1, 5)))
        lines = _body(cap.code).splitlines()
        start = next(i for i, ln in enumerate(lines) if "router_logits = " in ln)
        end = next(i for i, ln in enumerate(lines) if OP in ln)
        return "\n".join(lines[start : end + 2])

    def test_hf_grouped_mm_and_batched_mm(self):
        # Both transformers experts implementations leave the same graph: routing, then one op.
        grouped = self._hf_moe_slice("grouped_mm")
        self.assertEqual(self._hf_moe_slice("batched_mm"), grouped)
        self.assertExpectedInline(grouped, """\
    router_logits = torch._C._nn.linear(hidden_states_13, model_modules_layers_modules_0_modules_mlp_modules_gate_parameters_weight);  hidden_states_13 = model_modules_layers_modules_0_modules_mlp_modules_gate_parameters_weight = None
    router_probs = torch.nn.functional.softmax(router_logits, dtype = torch.float32, dim = -1);  router_logits = None
    topk = torch.topk(router_probs, 2, dim = -1);  router_probs = None
    router_top_value = topk[0]
    router_indices = topk[1];  topk = None
    sum_1 = router_top_value.sum(dim = -1, keepdim = True)
    router_top_value /= sum_1;  router_top_value_1 = router_top_value;  router_top_value = sum_1 = None
    router_top_value_2 = router_top_value_1.to(torch.bfloat16);  router_top_value_1 = None
    experts_default = torch.ops.moe_fx.experts.default(hidden_states_reshaped, router_indices, router_top_value_2, model_modules_layers_modules_0_modules_mlp_modules_experts_parameters_gate_up_proj, model_modules_layers_modules_0_modules_mlp_modules_experts_parameters_down_proj, activation = 'silu', weights_on_input = False, kernel_choice = 'auto');  hidden_states_reshaped = router_indices = router_top_value_2 = model_modules_layers_modules_0_modules_mlp_modules_experts_parameters_gate_up_proj = model_modules_layers_modules_0_modules_mlp_modules_experts_parameters_down_proj = None
    final_hidden_states_1 = experts_default.to(torch.bfloat16);  experts_default = None""")

    def test_titan_grouped_mm(self):
        torch.manual_seed(0)
        _, cap = run_captured(TitanGroupedMoE().bfloat16(), torch.randn(6, 32, dtype=torch.bfloat16))
        self.assertExpectedInline(_body(cap.code), """\
    x = l_x_.reshape(-1, 32);  l_x_ = None
    linear = torch._C._nn.linear(x, router_parameters_weight, None);  router_parameters_weight = None
    probs = torch.nn.functional.softmax(linear, dim = -1, dtype = torch.float32);  linear = None
    topk = torch.topk(probs, 2, dim = -1);  probs = None
    weights = topk[0]
    ids = topk[1];  topk = None
    sum_1 = weights.sum(dim = -1, keepdim = True)
    weights_1 = weights / sum_1;  weights = sum_1 = None
    weights_2 = weights_1.to(torch.bfloat16);  weights_1 = None
    transpose = l_self_parameters_w13_.transpose(1, 2);  w13 = None
    transpose_1 = l_self_parameters_w2_.transpose(1, 2);  w2 = None
    experts_default = torch.ops.moe_fx.experts.default(x, ids, weights_2, transpose, transpose_1, activation = 'silu', weights_on_input = False, kernel_choice = 'auto');  x = ids = weights_2 = transpose = transpose_1 = None
    reshape_3 = experts_default.reshape((6, 32));  experts_default = None
    return (reshape_3,)""")

    def test_dense_bmm(self):
        torch.manual_seed(0)
        _, cap = run_captured(DenseBmmMoE(), torch.randn(6, 32))
        self.assertExpectedInline(_body(cap.code), """\
    x = l_x_.reshape(-1, 32);  l_x_ = None
    linear = torch._C._nn.linear(x, router_parameters_weight, None);  router_parameters_weight = None
    probs = torch.nn.functional.softmax(linear, dim = -1, dtype = torch.float32);  linear = None
    topk = torch.topk(probs, 2, dim = -1);  probs = None
    weights = topk[0]
    ids = topk[1];  topk = None
    sum_1 = weights.sum(dim = -1, keepdim = True)
    weights_1 = weights / sum_1;  weights = sum_1 = None
    weights_2 = weights_1.to(torch.float32);  weights_1 = None
    experts_default = torch.ops.moe_fx.experts.default(x, ids, weights_2, gate_up, down, activation = 'silu', weights_on_input = False, kernel_choice = 'auto');  x = ids = weights_2 = gate_up = down = None
    reshape_1 = experts_default.reshape((6, 32));  experts_default = None
    return (reshape_1,)""")

    def test_expert_loop(self):
        torch.manual_seed(0)
        _, cap = run_captured(LoopMoE(num_experts=4), torch.randn(6, 32))
        self.assertExpectedInline(_body(cap.code), """\
    x = l_x_.reshape(-1, 32);  l_x_ = None
    linear = torch._C._nn.linear(x, router_parameters_weight, None);  router_parameters_weight = None
    probs = torch.nn.functional.softmax(linear, dim = -1, dtype = torch.float32);  linear = None
    topk = torch.topk(probs, 2, dim = -1);  probs = None
    weights = topk[0]
    ids = topk[1];  topk = None
    sum_1 = weights.sum(dim = -1, keepdim = True)
    weights_1 = weights / sum_1;  weights = sum_1 = None
    weights_2 = weights_1.to(torch.float32);  weights_1 = None
    moe_fx_w13_0 = self.moe_fx_w13_0
    moe_fx_w2_0 = self.moe_fx_w2_0
    experts_default = torch.ops.moe_fx.experts.default(x, ids, weights_2, moe_fx_w13_0, moe_fx_w2_0, activation = 'silu', weights_on_input = False, kernel_choice = 'auto');  x = ids = weights_2 = moe_fx_w13_0 = moe_fx_w2_0 = None
    reshape_1 = experts_default.reshape((6, 32));  experts_default = None
    return (reshape_1,)""")


@pytest.mark.parametrize("impl", ["grouped_mm", "batched_mm"])
@pytest.mark.parametrize("family", HF_FAMILIES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hf_families_rewritten(family, impl, dtype):
    model = tiny_hf_model(family, num_layers=2, experts_implementation=impl, dtype=dtype)
    _, cap = run_captured(model, torch.randint(0, 128, (1, 7)))
    assert cap.compiles == 1
    assert cap.count(OP) == 2, cap.code
    for gone in ("_grouped_mm", "grouped_mm_fallback", "torch.bmm", "torch.sort", "histc", "repeat_interleave"):
        assert gone not in cap.code, gone
    assert cap.count("torch.topk(") >= 2, "routing must stay as the model wrote it"
    matched = [r for r in cap.reports if r.matched]
    assert [r.layer for r in matched] == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    for r in matched:
        assert (r.form, r.num_experts, r.top_k, r.hidden, r.intermediate) == (impl, 8, 2, 32, 16)
        assert r.activation == "silu" and not r.weights_on_input
        assert r.family == {"mixtral": "Mixtral", "qwen3_moe": "Qwen3Moe", "deepseek_v3": "DeepseekV3"}[family]
    # The op reads the model's own stacked parameters (graph inputs), not copies.
    assert re.search(r"moe_fx\.experts\.default\(\w+, \w+, \w+, l_self_\w+gate_up_proj_, l_self_\w+down_proj_", cap.code)
    if family == "deepseek_v3":
        assert cap.count("shared_experts") > 0, "shared experts stay outside the op"
        assert "e_score_correction_bias" in cap.code, "grouped top-k routing stays"


@pytest.mark.parametrize("variant", [v for v in DENSE_VARIANTS if v != "ok"])
def test_near_misses_untouched(variant):
    torch.manual_seed(0)
    x = torch.randn(6, 32)
    model = DenseBmmMoE(variant=variant)
    out, cap = run_captured(model, x)
    ref_out, plain = run_captured(model, x, passes=False)
    assert cap.count(OP) == 0
    assert cap.code == plain.code, "an unmatched region must stay exactly as it was"
    assert torch.equal(out, ref_out)
    (report,) = cap.reports
    assert not report.matched and report.reason


class HashRoutedDense(torch.nn.Module):
    """A dense-bmm block whose ``[T, E]`` combine matrix is scattered from ids that are not a top-k's (hash
    routing: a token's ids may repeat). ``scatter`` keeps one weight per repeated id, ``scatter_add`` sums them."""

    def __init__(self, accumulate: bool, h: int = 32, i: int = 16, e: int = 4, k: int = 2):
        super().__init__()
        self.h, self.e, self.k, self.accumulate = h, e, k, accumulate
        self.router = torch.nn.Linear(h, e, bias=False)
        self.gate_up = torch.nn.Parameter(torch.randn(e, 2 * i, h) * 0.3)
        self.down = torch.nn.Parameter(torch.randn(e, h, i) * 0.3)

    def forward(self, x, tokens):
        probs = torch.softmax(self.router(x), -1)
        ids = torch.stack([(tokens * (j + 3)) % self.e for j in range(self.k)], -1)
        w = probs.gather(1, ids)
        zeros = torch.zeros(x.shape[0], self.e)
        dense = zeros.scatter_add(1, ids, w) if self.accumulate else zeros.scatter(1, ids, w)
        g, u = torch.bmm(x.unsqueeze(0).expand(self.e, -1, -1), self.gate_up.transpose(1, 2)).chunk(2, -1)
        y = torch.bmm(torch.nn.functional.silu(g) * u, self.down.transpose(1, 2))
        return (y * dense.t().unsqueeze(-1)).sum(0)


@pytest.mark.parametrize("accumulate", [False, True])
def test_dense_scatter_of_ids_that_may_repeat_untouched(accumulate):
    """A combine matrix scattered from ids the graph does not prove distinct per token (not a top-k's) is left as
    written: the op sums every slot, ``scatter`` keeps the last write where ids repeat (tokens 0 and 4 here)."""
    torch.manual_seed(0)
    x, tokens = torch.randn(8, 32), torch.arange(8)
    model = HashRoutedDense(accumulate)
    out, cap = run_captured(model, x, tokens)
    ref_out, plain = run_captured(model, x, tokens, passes=False)
    assert cap.count(OP) == 0
    assert cap.code == plain.code
    assert torch.equal(out, ref_out)
    (report,) = cap.reports
    assert not report.matched
    assert ("not a top-k's, so they may repeat" in report.reason) != accumulate


def test_titan_near_miss_activation_untouched():
    torch.manual_seed(0)
    x = torch.randn(6, 32, dtype=torch.bfloat16)
    _, cap = run_captured(TitanGroupedMoE(activation="gelu").bfloat16(), x)
    # gelu is a gated activation the op supports: matched with activation="gelu".
    assert cap.count(OP) == 1 and "activation = 'gelu'" in cap.code
    _, cap = run_captured(TitanGroupedMoE(weight_output=False).bfloat16(), x)
    assert cap.count(OP) == 0
    assert not cap.reports[0].matched and "routing-weight" in cap.reports[0].reason


def test_disabled_config_changes_nothing():
    model = tiny_hf_model("mixtral", num_layers=1)
    _, cap = run_captured(model, torch.randint(0, 128, (1, 5)), config=MoEConfig(enabled=False))
    assert cap.count(OP) == 0 and cap.reports == []


def test_expert_loop_weights_stacked_once_and_shared():
    torch.manual_seed(0)
    model = LoopMoE()
    before = sum(p.numel() for p in model.parameters())
    ptrs_before = {p.data_ptr() for p in model.parameters()}
    out_eager = model(torch.randn(5, 32))
    _, cap = run_captured(model, torch.randn(5, 32))

    assert cap.count(OP) == 1
    # Each expert's parameters now live inside the two stacked tensors the op reads.
    assert experts_in_one_copy(model.experts)
    assert sum(p.numel() for p in model.parameters()) == before
    assert ptrs_before != {p.data_ptr() for p in model.parameters()}
    # Writing a module parameter is seen by the stacked copy: there is only one copy.
    with torch.no_grad():
        model.experts[3].down_proj.weight.mul_(0.0)
    x = torch.randn(5, 32)
    with torch.no_grad():
        torch._dynamo.reset()
        got = run_captured(model, x)[0]
    torch.testing.assert_close(got, model(x), rtol=1e-5, atol=1e-5)
    assert out_eager.shape == (5, 32)


def test_logging_says_what_was_rewritten_and_why_not(caplog):
    with caplog.at_level(logging.INFO, logger="moe_fx.passes"):
        run_captured(DenseBmmMoE(), torch.randn(4, 32))
        run_captured(DenseBmmMoE(variant="tanh"), torch.randn(4, 32))
    text = caplog.text
    assert "rewrote down: matched -/dense_bmm" in text.replace("?/", "-/")
    assert "left down untouched: unsupported op 'tanh'" in text


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_routing_weights_on_input_detected(dtype):
    """Llama 4 style: routing weights scale the expert input; the probe finds weights_on_input=True."""
    torch.manual_seed(0)
    model = DenseBmmMoE(variant="on_input").to(dtype)
    x = torch.randn(7, 32, dtype=dtype)
    out, cap = run_captured(model, x)
    assert cap.count(OP) == 1 and "weights_on_input = True" in cap.code
    assert cap.reports[0].weights_on_input
    with torch.no_grad():
        torch.testing.assert_close(out, model(x), rtol=3e-2 if dtype == torch.bfloat16 else 1e-5,
                                   atol=3e-2 if dtype == torch.bfloat16 else 1e-5)


@pytest.mark.parametrize("family, matched", [("qwen2_moe", True), ("olmoe", True), ("gpt_oss", True), ("llama4", True)])
def test_other_hf_families(family, matched):
    """Qwen2-MoE, OLMoE, GPT-OSS (biased, clamped, interleaved experts) and Llama 4 (dense scores) match."""
    from helpers import logits, rel_err

    from moe_fx.testing.models import tiny_hf_model

    model = tiny_hf_model(family, num_layers=1, num_experts=4)
    ids = torch.randint(0, 128, (1, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = logits(model(ids))
    got, cap = run_captured(model, ids)
    assert cap.count(OP) == (1 if matched else 0)
    assert [r.matched for r in cap.reports] == [matched]
    if matched:
        assert rel_err(logits(got), want) < 1e-5
    else:
        _, plain = run_captured(model, ids, passes=False)
        assert cap.code == plain.code and cap.reports[0].reason


@pytest.mark.parametrize("tie", ["up_across_experts", "gate_is_up", "whole_expert_twice"])
def test_tied_expert_weights_left_as_written_with_the_reason(tie):
    """Experts sharing a Parameter (before: ``BackendCompilerFailed: SyntaxError: duplicate argument`` from
    the probe subgraph): the block stays as written, the reason names the tie, outputs equal eager's."""
    import moe_fx

    torch.manual_seed(0)
    model, x = LoopMoE(num_experts=4).eval(), torch.randn(9, 32)
    if tie == "up_across_experts":
        model.experts[1].up_proj.weight = model.experts[0].up_proj.weight
    elif tie == "gate_is_up":
        model.experts[2].up_proj.weight = model.experts[2].gate_proj.weight
    else:
        model.experts[3] = model.experts[1]
    with torch.no_grad():
        want = model(x)
    got, cap = run_captured(model, x)
    assert cap.count(OP) == 0 and torch.equal(got, want)
    (report,) = cap.reports
    assert not report.matched and report.reason.startswith("tied expert weights:"), report.reason
    # The same module twice: Dynamo names its weights once, by the first slot (before: rewritten with E=3,
    # expert 3's tokens then dropped).
    assert ("more than one expert slot" if tie == "whole_expert_twice" else "one parameter") in report.reason
    torch._dynamo.reset()
    with torch.no_grad():
        torch.testing.assert_close(moe_fx.compile(model)(x), want, rtol=1e-5, atol=1e-5)  # compiles (Inductor)
