"""``rewrite_moe_regions`` on hand-built graphs: exact op counts and graph text, positives and near misses.

In the style of Inductor's test_pattern_matcher: one pass applied to a small graph, the rewrite count it
returns, the graph's code after it, and for every near miss ``0`` rewrites with the graph exactly as it was.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from graphs import context, ops, routed, traced

from moe_fx.passes.rewrite_moe import rewrite_moe_regions

T, K, E, H, I = 6, 2, 4, 8, 4
EXPERTS = torch.ops.moe_fx.experts.default


def _inputs(transposed=False):
    g = torch.Generator().manual_seed(0)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    w13 = torch.randn(E, H, 2 * I, generator=g) if transposed else torch.randn(E, 2 * I, H, generator=g)
    w2 = torch.randn(E, I, H, generator=g) if transposed else torch.randn(E, H, I, generator=g)
    return [torch.randn(T, H, generator=g), ids, torch.rand(T, K, generator=g), w13, w2]


def _routed_inputs(transposed=False):
    """Inputs of :func:`graphs.routed` forms: ``h, scores [T, E], w13, w2`` (top-k ids without ties)."""
    h, _, _, w13, w2 = _inputs(transposed)
    return [h, torch.randperm(T * E, generator=torch.Generator().manual_seed(1)).float().view(T, E) / (T * E), w13, w2]


def make_batched(act=F.silu, after=None, rows=None, out=None):
    """transformers' batched_mm experts (each routed token gathers its expert's weights), with hooks: ``after``
    the activation, on the expert ``rows`` before their routing weight, ``out`` on the combined output."""

    def batched(h, ids, w, w13, w2):
        flat = ids.reshape(-1)
        x = h.repeat_interleave(K, dim=0)
        h1 = torch.bmm(w13[flat], x.unsqueeze(-1)).squeeze(-1)
        g, u = h1.chunk(2, dim=-1)
        a = act(g) if after is None else after(act(g))
        y = torch.bmm(w2[flat], (a * u).unsqueeze(-1)).squeeze(-1)
        y = y if rows is None else rows(y)
        y = (y * w.reshape(-1, 1)).view(-1, K, H).sum(dim=1)
        return y if out is None else out(y)

    return batched


batched = make_batched()


def dense_transposed(h, ids, w, w13, w2):
    """torchtitan-style stacked weights stored [E, H, 2I] / [E, I, H]: every expert on every token, x @ w."""
    dense = w.new_zeros(T, E).scatter(1, ids, w)
    h1 = torch.bmm(h.unsqueeze(0).expand(E, -1, -1), w13)
    g, u = h1.chunk(2, dim=-1)
    y = torch.bmm(F.silu(g) * u, w2) * dense.t().unsqueeze(-1)
    return y.sum(dim=0)


def _rewrite(fn, inputs, **config):
    gm = traced(fn, *inputs)
    before = gm.code
    ctx = context(gm, inputs, **config)
    count = rewrite_moe_regions(gm, ctx)
    gm.recompile()
    return gm, before, count, ctx.report


def test_batched_experts_become_one_op():
    inputs = _routed_inputs()
    fn = routed(batched, K)
    gm, _, count, (report,) = _rewrite(fn, inputs)
    assert count == 1 and ops(gm) == ["topk", "getitem", "getitem", "experts.default"]
    assert gm.code.strip().splitlines()[4].strip() == (
        "experts_default = torch.ops.moe_fx.experts.default(h, getitem_1, getitem, w13, w2, activation = 'silu', "
        "weights_on_input = False, kernel_choice = 'auto');  h = getitem_1 = getitem = w13 = w2 = None")
    assert (report.matched, report.form, report.num_experts, report.top_k, report.verified) == (
        True, "batched_mm", E, K, "numerics")
    assert gm.graph.find_nodes(op="call_function", target=EXPERTS)[0].meta["example_value"].shape == (T, H)
    torch.testing.assert_close(gm(*inputs), fn(*inputs))


def test_ids_that_are_a_graph_input_must_be_skipped_as_the_op_skips_them():
    """Nothing bounds graph-input ids: the batched gather ``w13[-1]`` reads the last expert where the op skips the
    slot, so the region is left as written, with the reason."""
    inputs = _inputs()
    gm, before, count, (report,) = _rewrite(batched, inputs)
    assert count == 0 and gm.code == before
    assert "the region does not skip id -1 as moe_fx::experts does" in report.reason, report.reason


def test_transposed_stacked_weights_are_passed_as_views():
    inputs = _routed_inputs(transposed=True)
    fn = routed(dense_transposed, K)
    gm, _, count, (report,) = _rewrite(fn, inputs)
    assert count == 1 and report.form == "dense_bmm"
    # views of the weights, never a copy
    assert ops(gm) == ["topk", "getitem", "getitem", "transpose", "transpose", "experts.default"]
    torch.testing.assert_close(gm(*inputs), fn(*inputs), rtol=1e-4, atol=1e-5)


def test_dense_scatter_of_graph_input_ids_is_left_as_written():
    """The dense matrix's ``scatter`` keeps one weight where a token's ids repeat and the op sums every slot: ids
    that are a graph input are not proven distinct, so the region stays as written."""
    inputs = _inputs(transposed=True)
    gm, before, count, (report,) = _rewrite(dense_transposed, inputs)
    assert count == 0 and gm.code == before
    assert "not a top-k's, so they may repeat" in report.reason, report.reason


def test_what_follows_the_combine_stays_outside_the_region():
    inputs = _routed_inputs()
    fn = routed(make_batched(out=lambda y: torch.tanh(y) + 1.0), K)
    gm, _, count, _ = _rewrite(fn, inputs)
    assert count == 1 and ops(gm) == ["topk", "getitem", "getitem", "experts.default", "tanh", "add"]
    torch.testing.assert_close(gm(*inputs), fn(*inputs))


def test_without_a_numerical_check_the_report_says_unverified():
    _, _, count, (report,) = _rewrite(batched, _inputs(), verify="never")
    assert count == 1 and report.verified == "unverified" and any("without a numerical check" in w
                                                                  for w in report.warnings)


@pytest.mark.parametrize("name, fn, why", [
    ("clamp after the activation", make_batched(after=lambda x: x.clamp(max=2.0)), "clamp"),
    ("sigmoid gate", make_batched(act=torch.sigmoid), "sigmoid"),
    ("expert rows shifted before their weight", make_batched(rows=lambda y: y + 1.0), "add"),
])
def test_near_misses_are_left_exactly_as_written(name, fn, why):
    inputs = _inputs()
    gm, before, count, reports = _rewrite(fn, inputs)
    assert count == 0 and gm.code == before, name
    assert EXPERTS not in [n.target for n in gm.graph.nodes]
    assert all(not r.matched for r in reports) and all(r.reason for r in reports)
    assert why in " ".join(r.reason for r in reports)
    torch.testing.assert_close(gm(*inputs), fn(*inputs))


def test_disabled_config_rewrites_nothing():
    gm, before, count, reports = _rewrite(batched, _inputs(), enabled=False)
    assert (count, reports, gm.code) == (0, [], before)
