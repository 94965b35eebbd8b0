"""``split_ep`` on hand-built graphs: one ``moe_fx::experts`` node becomes dispatch -> masked experts -> combine ->
remaining rounds (exact op counts), the weights narrowed to the rank's experts; negatives leave the graph as it was.

No process group is made: the pass only reads the group's size and rank (a stand-in of two ranks here), and
nothing is run (the communication ops run in the multi-process tests, tests/test_ep_gloo.py).
"""

from __future__ import annotations

import pytest
import torch
from graphs import context, ops, traced

import moe_fx.passes.split_ep as split_ep_module
from moe_fx.passes.split_ep import split_ep

T, K, E, H, I = 4, 2, 4, 8, 4


class _Group:
    """What split_ep reads of a process group."""

    def __init__(self, world: int, rank: int) -> None:
        self.world, self._rank = world, rank

    def size(self) -> int:
        return self.world

    def rank(self) -> int:
        return self._rank


@pytest.fixture
def group(monkeypatch):
    def make(world: int, rank: int = 0) -> str:
        monkeypatch.setattr(split_ep_module, "ep_group_name", lambda g: "ep")
        monkeypatch.setattr(split_ep_module, "resolve_ep_group", lambda name: _Group(world, rank))
        return "ep"

    return make


def _inputs():
    g = torch.Generator().manual_seed(0)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    return [torch.randn(T, H, generator=g), ids, torch.rand(T, K, generator=g), torch.randn(E, 2 * I, H, generator=g),
            torch.randn(E, H, I, generator=g)]


def layer(h, ids, w, w13, w2):
    return torch.ops.moe_fx.experts.default(h, ids, w, w13, w2, kernel_choice="auto") * 2.0


def _split(world, rank, group):
    inputs = _inputs()
    gm = traced(layer, *inputs)
    before = gm.code
    ctx = context(gm, inputs, ep_group=group(world, rank), max_tokens_per_rank=8)
    count = split_ep(gm, ctx)
    return gm, before, count, ctx, inputs


def test_experts_node_becomes_the_expert_parallel_ops(group):
    gm, _, count, ctx, inputs = _split(2, 1, group)
    assert count == 1
    assert ops(gm) == ["narrow", "narrow", "ep_dispatch_send.default", "ep_dispatch_recv.default", "getitem",
                       "getitem", "getitem", "getitem", "getitem", "masked_experts.default", "ep_combine.default",
                       "ep_remaining_rounds.default", "mul"]
    dispatch = next(n for n in gm.graph.nodes if "ep_dispatch_send" in str(n.target))
    assert dispatch.args[2:] == (E, 8, "ep", False, "auto")  # all E experts, the round size, the group, bf16, kernel
    # rank 1 of 2 keeps experts 2 and 3: the weights (graph inputs owning their storage) compacted to those rows
    w13 = inputs[3]
    assert w13.untyped_storage().nbytes() == 2 * 2 * I * H * w13.element_size()
    assert len(ctx.call_checks) == 1  # the step agreement before every call


@pytest.mark.parametrize("case", ["no group", "one rank"])
def test_without_expert_parallelism_the_graph_is_unchanged(case, group):
    inputs = _inputs()
    gm = traced(layer, *inputs)
    before = gm.code
    config = {} if case == "no group" else {"ep_group": group(1)}
    assert split_ep(gm, context(gm, inputs, **config)) == 0 and gm.code == before


def test_experts_that_do_not_divide_over_the_ranks_are_an_error(group):
    with pytest.raises(ValueError, match="4 experts cannot be split evenly over 3 ranks"):
        _split(3, 0, group)
