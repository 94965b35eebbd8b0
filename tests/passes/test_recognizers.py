"""The graph pass's recognisers and guards, each applied alone to a hand-built graph: what it finds (exact
counts) and, for every one, a near miss it refuses (``None``, ``[]`` or a reason) — nothing here changes a graph.

find_experts, extract_region (and sparse_support), autocast_guard, near_misses, verify_region (probe_region) and
probe_resize; read_form has its own file (test_read_form.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from graphs import routed, traced
from torch import fx, nn

from moe_fx.passes.graph_utils import DataFlow
from moe_fx.passes.recognize.autocast_guard import check_autocast
from moe_fx.passes.recognize.extract_region import Region, extract_region, sparse_support
from moe_fx.passes.recognize.find_experts import find_expert_weights
from moe_fx.passes.recognize.near_misses import per_expert_near_misses
from moe_fx.passes.recognize.probe_resize import resize_literals
from moe_fx.passes.recognize.read_form import read_region
from moe_fx.passes.recognize.verify_region import probe_region
from moe_fx.verify.probe_plan import plan_probe

T, K, E, H, I = 6, 2, 4, 8, 4


def _inputs(transposed=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    w13 = torch.randn(E, H, 2 * I, generator=g) if transposed else torch.randn(E, 2 * I, H, generator=g)
    w2 = torch.randn(E, I, H, generator=g) if transposed else torch.randn(E, H, I, generator=g)
    return [torch.randn(T, H, generator=g), ids, torch.rand(T, K, generator=g), w13, w2]


def make_batched(shift=0, leak=False):
    """batched_mm experts; ``shift`` gathers the weights of expert ``(id + shift) % E`` (wrong plumbing), ``leak``
    also returns an intermediate value (read outside the region)."""

    def batched(h, ids, w, w13, w2):
        flat = ids.reshape(-1) if not shift else (ids.reshape(-1) + shift) % E
        x = h.repeat_interleave(K, dim=0)
        h1 = torch.bmm(w13[flat], x.unsqueeze(-1)).squeeze(-1)
        g, u = h1.chunk(2, dim=-1)
        y = torch.bmm(w2[flat], (F.silu(g) * u).unsqueeze(-1)).squeeze(-1)
        out = (y * w.reshape(-1, 1)).view(-1, K, H).sum(dim=1)
        return (out, h1) if leak else out

    return batched


def _region(fn, inputs) -> tuple[fx.GraphModule, DataFlow, Region | str]:
    gm = traced(fn, *inputs)
    flow = DataFlow(gm.graph)
    (anchors,) = find_expert_weights(gm.graph, flow)
    return gm, flow, extract_region(flow, anchors)


# --- find_experts ---------------------------------------------------------------------------------


def test_find_experts_stacked_in_both_orientations():
    gm = traced(make_batched(), *_inputs())
    (a,) = find_expert_weights(gm.graph)
    assert (a.kind, a.num_experts, a.hidden, a.intermediate, a.transposed, a.gated) == ("stacked", E, H, I, False, True)
    assert [n.name for n in a.nodes] == ["w13", "w2"]

    def titan(h, ids, w, w13, w2):  # [E, H, 2I] / [E, I, H]: x @ w
        h1 = torch.bmm(h.unsqueeze(0).expand(E, -1, -1), w13)
        g, u = h1.chunk(2, dim=-1)
        return torch.bmm(F.silu(g) * u, w2).sum(0)

    (a,) = find_expert_weights(traced(titan, *_inputs(transposed=True)).graph)
    assert (a.transposed, a.hidden, a.intermediate) == (True, H, I)


def test_find_experts_per_expert_linears_of_a_module_list():
    class Experts(nn.Module):
        def __init__(self, act=F.silu):
            super().__init__()
            self.act = act
            self.experts = nn.ModuleList(
                nn.ModuleDict({n: nn.Linear(*s, bias=False) for n, s in (("gate_proj", (H, I)), ("up_proj", (H, I)),
                                                                          ("down_proj", (I, H)))}) for _ in range(E))

        def forward(self, x):
            out = x
            for e in self.experts:
                out = out + F.linear(self.act(F.linear(x, e["gate_proj"].weight)) * F.linear(x, e["up_proj"].weight),
                                     e["down_proj"].weight)
            return out

    m = Experts()
    gm = traced(m, torch.randn(T, H))
    (a,) = find_expert_weights(gm.graph)
    assert (a.kind, a.num_experts, a.hidden, a.intermediate) == ("per_expert", E, H, I)
    assert [str(n.target) for n in a.gate] == [f"experts.{e}.gate_proj.weight" for e in range(E)]
    relu = Experts(act=F.relu)
    gm = traced(relu, torch.randn(T, H))
    assert find_expert_weights(gm.graph) == []  # near miss: no SiLU/GELU between the linears
    (report,) = per_expert_near_misses(gm.graph, [])
    assert report.reason == "ModuleList experts not recognised: expert 0: its activation is 'relu', not SiLU or GELU"
    assert (report.layer, report.num_experts, report.hidden, report.intermediate) == ("experts", E, H, I)
    # claimed (recognised) experts are not near misses
    gm = traced(m, torch.randn(T, H))
    assert per_expert_near_misses(gm.graph, find_expert_weights(gm.graph)[0].nodes) == []


def test_find_experts_needs_a_partner_of_the_right_shape():
    def lonely(h, ids, w, w13, w2):  # w2 [E, H, 2I + 1] is no w2 of w13 [E, 2I, H]: no (w13, w2) pair
        h1 = torch.bmm(w13[ids.reshape(-1)], h.repeat_interleave(K, 0).unsqueeze(-1)).squeeze(-1)
        return h1.sum(-1, keepdim=True) * w2[0, 0, 0]

    inputs = _inputs()
    inputs[4] = torch.randn(E, H, 2 * I + 1)
    assert find_expert_weights(traced(lonely, *inputs).graph) == []


# --- extract_region -------------------------------------------------------------------------------


def test_extract_region_finds_the_boundary_and_the_nodes():
    gm, _, region = _region(make_batched(), _inputs())
    assert isinstance(region, Region), region
    assert (region.hidden.name, region.ids.name, region.weights.name) == ("h", "ids", "w")
    assert (region.form, region.top_k, region.num_tokens, region.output.name) == ("batched_mm", K, T, "sum_1")
    calls = [n for n in gm.graph.nodes if n.op in ("call_function", "call_method")]
    assert region.nodes == set(calls) and len(calls) == 19  # every op from routing results to the output
    assert not region.dense_scores and region.biases == []


def test_extract_region_refuses_a_region_read_outside():
    _, _, why = _region(make_batched(leak=True), _inputs())
    assert isinstance(why, str) and "also used outside the MoE region" in why


def _topk_sigmoid_scores(logits, ids_unused, w, w13, w2):
    """Llama 4: sigmoid of the top-k logits scattered into -inf, so exactly 0 outside the top-k."""
    top, ids = torch.topk(logits, K, dim=1)
    return torch.sigmoid(torch.full_like(logits, float("-inf")).scatter_(1, ids, top))


def _softmax_scores(logits, ids_unused, w, w13, w2):
    """Non-zero everywhere: reducing it to a top-k would drop experts."""
    return torch.softmax(logits, dim=-1)


def test_sparse_support_proves_top_k_scores_or_says_nothing():
    for fn, proved in ((_topk_sigmoid_scores, True), (_softmax_scores, False)):
        gm = traced(fn, torch.randn(T, E), *_inputs()[1:])
        ids = sparse_support(DataFlow(gm.graph), gm.graph.output_node().args[0])
        assert (ids is not None) == proved, fn.__name__
        if proved:  # the router's own top-k ids
            assert ids.op == "call_function" and ids.args[0].target is torch.topk


# --- autocast_guard -------------------------------------------------------------------------------


def test_autocast_guard_refuses_products_recast_by_autocast():
    _, _, region = _region(make_batched(), _inputs())
    assert check_autocast(region) is None
    bmm = next(n for n in region.nodes if n.target is torch.bmm)
    bmm.meta["example_value"] = bmm.meta["example_value"].bfloat16()  # what Dynamo records under bf16 autocast
    why = check_autocast(region)
    assert why is not None and why.startswith(f"autocast: the expert product {bmm.name} computes in bfloat16 from "
                                              "float32 inputs")


# --- verify_region --------------------------------------------------------------------------------


def _probe(fn, bounded=True):
    """``fn`` (a batched form) probed as a region; ``bounded``: its ids from a top-k in the graph (else an input)."""
    inputs = _inputs()
    if bounded:
        fn, inputs = routed(fn, K), [inputs[0], torch.randn(T, E, generator=torch.Generator().manual_seed(3)),
                                     *inputs[3:]]
    gm, flow, region = _region(fn, inputs)
    reading = read_region(region)
    real = dict(zip((n for n in gm.graph.nodes if n.op == "placeholder"), inputs, strict=False))
    plan = plan_probe(T, K, E, K, H, I, 2e10, "auto")
    return reading, probe_region(region, flow, real.get, reading, plan, lambda ts: (ts[0], ts[1]))


def test_verify_region_confirms_a_region_and_catches_wrong_plumbing():
    reading, result = _probe(make_batched())
    assert result.ok and result.activation == "silu" and result.error < 1e-4 and "T=6 x3" in result.probe
    assert "ids -1" not in result.probe  # the top-k bounds them
    # the structure reads the same form whichever rows the weights are gathered with (plumbing); the probe sees it
    reading, result = _probe(make_batched(shift=1))
    assert not isinstance(reading, str) and reading.spec.name == "silu"
    assert not result.ok and result.reason.startswith("numerical check failed (T=6 x3): a token's error")


def test_verify_region_runs_ids_outside_the_experts_when_nothing_bounds_them():
    """Graph-input ids: the probe also runs ids -1 and E; the gather ``w13[-1]`` reads expert E - 1 (the op skips
    the slot), ``w13[E]`` raises (no answer to contradict)."""
    reading, result = _probe(make_batched(), bounded=False)
    assert f"ids -1 and {E} in some slots" in result.probe
    assert not result.ok and "id -1 in some slots" in result.reason and "does not skip id -1" in result.reason


# --- probe_resize ---------------------------------------------------------------------------------


def test_probe_resize_rewrites_the_token_count_or_says_why_not():
    def static(h, ids, w, w13, w2):
        y = torch.bmm(w13[ids.reshape(-1)], h.repeat_interleave(K, 0).unsqueeze(-1)).squeeze(-1)
        return y.reshape(6, K, 2 * I).sum(1)

    gm = traced(static, *_inputs())
    assert resize_literals(gm, 6, 3, K, E, {E, K, H, I, 2 * I}) is None
    assert "reshape(sum_1, (3, 2, 8))" in gm.code or "(3, 2, 8)" in gm.code
    gm = traced(static, *_inputs())
    why = resize_literals(gm, 6, 3, K, E, {E, K, H, I, 6})
    assert why is not None and "equals another size of the region" in why and "(3, 2, 8)" not in gm.code
