"""The split_ep graph rewrite, in one process with torch's fake process group (no communication runs).

Dynamo captures a small MoE block that calls ``moe_fx::experts`` and has a shared expert; the moe_fx
passes run with ``MoEConfig(ep_group=...)`` and the rewritten graph is checked: dispatch, experts and
combine are separate ops with the shared expert between them, fake values are right, the weights are
narrowed to the rank's experts and their storage shrunk to them.
"""

from __future__ import annotations

import operator

import pytest
import torch
import torch.distributed as dist
from ep_workers import EPMoE

import moe_fx  # noqa: F401
from moe_fx.backend import make_backend
from moe_fx.config import MoEConfig
from moe_fx.passes.split_ep import ep_weights_freed

fake_pg = pytest.importorskip("torch.testing._internal.distributed.fake_pg")


class _Stop(Exception):
    pass


@pytest.fixture
def fake_group(request):
    rank, world = request.param
    if dist.is_initialized():
        pytest.skip("a default process group already exists in this process")
    dist.init_process_group("fake", store=fake_pg.FakeStore(), rank=rank, world_size=world)
    try:
        yield rank, world
    finally:
        dist.destroy_process_group()


def _capture(model, x, config):
    """Compile ``model`` with the moe_fx passes; return the rewritten graph (the graph is not run)."""
    graphs = []
    inner = make_backend(config, inductor=False)

    def backend(gm, example_inputs):
        inner(gm, example_inputs)
        graphs.append(gm)

        def stop(*args):
            raise _Stop

        return stop

    torch._dynamo.reset()
    with torch.no_grad(), pytest.raises(_Stop):
        torch.compile(model, backend=backend, dynamic=False)(x)
    return graphs[0]


def _ops(gm):
    return [
        str(n.target).replace("moe_fx.", "")
        for n in gm.graph.nodes
        if n.op == "call_function" and "moe_fx" in str(n.target)
    ]


@pytest.mark.parametrize("fake_group", [(0, 2), (1, 2)], indirect=True)
def test_split_ep_graph(fake_group):
    rank, _world = fake_group
    model = EPMoE(hidden=32, inter=16, num_experts=8, top_k=2)
    full_w13, full_w2 = model.w13.detach().clone(), model.w2.detach().clone()
    gm = _capture(model, torch.randn(6, 32), MoEConfig(ep_group="default", max_tokens_per_rank=8))
    assert _ops(gm) == ["ep_dispatch.default", "masked_experts.default", "ep_combine.default"]
    nodes = list(gm.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    disp = next(n for n in nodes if n.target is torch.ops.moe_fx.ep_dispatch.default)
    experts = next(n for n in nodes if n.target is torch.ops.moe_fx.masked_experts.default)
    combine = next(n for n in nodes if n.target is torch.ops.moe_fx.ep_combine.default)
    # The shared expert (its two linears) sits between dispatch and combine: it can overlap the exchange.
    shared = [
        n for n in nodes if n.op == "call_function" and "linear" in str(n.target) and pos[disp] < pos[n] < pos[combine]
    ]
    assert len(shared) == 2
    assert pos[disp] < pos[experts] < pos[combine]
    # Fake values: [E_local, M, H] layout with M = max_tokens_per_rank * world.
    recv_x, _recv_scale, masked_m, src_info, layout_range = disp.meta["example_value"]
    assert tuple(recv_x.shape) == (4, 16, 32) and tuple(masked_m.shape) == (4,) and masked_m.dtype == torch.int32
    assert tuple(src_info.shape) == (4, 16) and tuple(layout_range.shape) == (4, 2)
    assert tuple(experts.meta["val"].shape) == (4, 16, 32) and tuple(combine.meta["val"].shape) == (6, 32)
    getitems = [n for n in nodes if n.target is operator.getitem and n.args[0] is disp]
    assert all("example_value" in n.meta for n in getitems)
    # Weights: narrowed to rows [0, 4) of parameters that now hold only this rank's experts.
    narrows = [n for n in nodes if n.target is torch.narrow]
    assert [n.args[1:] for n in narrows] == [(0, 0, 4), (0, 0, 4)]
    assert ep_weights_freed(model.w13) and ep_weights_freed(model.w2)
    assert model.w13.shape == (8, 32, 32)  # shape kept: Dynamo's guards still hold
    assert model.w13.untyped_storage().nbytes() == 4 * 32 * 32 * 4
    lo = 4 * rank
    assert torch.equal(model.w13.detach()[:4], full_w13[lo : lo + 4])
    assert torch.equal(model.w2.detach()[:4], full_w2[lo : lo + 4])


@pytest.mark.parametrize("fake_group", [(0, 3)], indirect=True)
def test_split_ep_uneven_experts_is_a_compile_error(fake_group):
    model = EPMoE(hidden=32, inter=16, num_experts=8, top_k=2)
    with pytest.raises(Exception, match="8 experts cannot be split evenly over 3 ranks"):
        _capture(model, torch.randn(4, 32), MoEConfig(ep_group="default"))
    assert not ep_weights_freed(model.w13)


@pytest.mark.parametrize("fake_group", [(0, 1)], indirect=True)
def test_split_ep_leaves_one_rank_and_no_group_alone(fake_group):
    model = EPMoE(hidden=32, inter=16, num_experts=8, top_k=2)
    gm = _capture(model, torch.randn(4, 32), MoEConfig(ep_group="default"))
    assert _ops(gm) == ["experts"]
    gm = _capture(model, torch.randn(4, 32), MoEConfig())
    assert _ops(gm) == ["experts"]
    assert not ep_weights_freed(model.w13)


@pytest.mark.parametrize("fake_group", [(1, 2)], indirect=True)
def test_split_ep_deepseek_shared_experts_between_dispatch_and_combine(fake_group):
    # transformers' DeepSeek-V3 block: routed experts (recognized and rewritten), then
    # `hidden.view(...)` and `+ shared_experts(residual)`. The combine is moved past the re-view so
    # that the whole shared expert sits between dispatch and combine.
    from moe_fx.testing import tiny_hf_model

    model = tiny_hf_model("deepseek_v3", num_layers=1)
    experts = model.model.layers[0].mlp.experts
    full = experts.gate_up_proj.detach().clone()
    gm = _capture(model, torch.randint(0, 128, (1, 6)), MoEConfig(ep_group="default", max_tokens_per_rank=8))
    assert _ops(gm) == ["ep_dispatch.default", "masked_experts.default", "ep_combine.default"]
    nodes = list(gm.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    disp = next(n for n in nodes if n.target is torch.ops.moe_fx.ep_dispatch.default)
    combine = next(n for n in nodes if n.target is torch.ops.moe_fx.ep_combine.default)

    def module(n):
        stack = n.meta.get("nn_module_stack") or {}
        return list(stack.values())[-1][0] if stack else ""

    shared = [n for n in nodes if n.op == "call_function" and "shared_experts" in module(n)]
    assert len(shared) >= 3  # gate, up, down projections (and the activation, product)
    assert all(pos[disp] < pos[n] < pos[combine] for n in shared)
    # Rank 1 keeps experts 4..7, compacted into the parameter's first rows.
    assert ep_weights_freed(experts.gate_up_proj) and ep_weights_freed(experts.down_proj)
    assert torch.equal(experts.gate_up_proj.detach()[:4], full[4:8])


@pytest.mark.parametrize("fake_group", [(0, 2)], indirect=True)
def test_split_ep_leaves_extended_forms_local(fake_group):
    """GPT-OSS's experts (biases, clamped interleaved SwiGLU) are rewritten but not split: the expert-parallel
    ops take none of those arguments, so splitting would drop them."""
    from moe_fx.testing import tiny_hf_model

    model = tiny_hf_model("gpt_oss", num_layers=1, num_experts=4)
    gm = _capture(model, torch.randint(0, 128, (1, 6)), MoEConfig(ep_group="default", max_tokens_per_rank=8))
    assert _ops(gm) == ["experts.default"]
    node = next(n for n in gm.graph.nodes if n.target is torch.ops.moe_fx.experts.default)
    assert node.kwargs["w13_bias"] is not None and node.kwargs["gate_up_layout"] == "interleaved"
    assert not ep_weights_freed(model.model.layers[0].mlp.experts.gate_up_proj)
