"""The split_ep graph rewrite, in one process with torch's fake process group (no communication runs).

Dynamo captures a small MoE block that calls ``moe_fx::experts`` and has a shared expert; the moe_fx
passes run with ``MoEConfig(ep_group=...)`` and the rewritten graph is checked: dispatch, experts,
combine and the step's remaining rounds are separate ops with the shared expert between dispatch and
combine, fake values are right, the weights (and biases) are narrowed to the rank's experts and their
storage shrunk to them; every form of the experts op is split; a symbolic token count narrows round 0
with ``min(T, max_tokens_per_rank)``; EPLB adds its map, counts and physical weights.
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


_SPLIT = ["ep_dispatch_send.default", "ep_dispatch_recv.default", "masked_experts.default", "ep_combine.default",
          "ep_remaining_rounds.default"]


def _capture(model, x, config, dynamic=False, sink=None):
    """Compile ``model`` with the moe_fx passes; return the rewritten graph (the graph is not run). ``sink``
    collects the pass reports."""
    graphs = []
    inner = make_backend(config, sink=sink, inductor=False)

    def backend(gm, example_inputs):
        inner(gm, example_inputs)
        graphs.append(gm)

        def stop(*args):
            raise _Stop

        return stop

    torch._dynamo.reset()
    with torch.no_grad(), pytest.raises(_Stop):
        fn = torch.compile(model, backend=backend, dynamic=dynamic)
        fn(*x) if isinstance(x, tuple) else fn(x)
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
    assert _ops(gm) == _SPLIT
    nodes = list(gm.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    send = next(n for n in nodes if n.target is torch.ops.moe_fx.ep_dispatch_send.default)
    disp = next(n for n in nodes if n.target is torch.ops.moe_fx.ep_dispatch_recv.default)
    experts = next(n for n in nodes if n.target is torch.ops.moe_fx.masked_experts.default)
    combine = next(n for n in nodes if n.target is torch.ops.moe_fx.ep_combine.default)
    # The shared expert (its two linears) sits between dispatch's send and receive: it overlaps the transfer.
    shared = [
        n for n in nodes if n.op == "call_function" and "linear" in str(n.target) and pos[send] < pos[n] < pos[disp]
    ]
    assert len(shared) == 2 and disp.args[0] is send
    assert pos[send] < pos[disp] < pos[experts] < pos[combine]
    # Fake values: [E_local, M, H] layout with M = max_tokens_per_rank * world.
    recv_x, _recv_scale, masked_m, src_info, layout_range = disp.meta["example_value"]
    assert tuple(recv_x.shape) == (4, 16, 32) and tuple(masked_m.shape) == (4,) and masked_m.dtype == torch.int32
    assert tuple(src_info.shape) == (4, 16) and tuple(layout_range.shape) == (4, 2)
    assert tuple(experts.meta["val"].shape) == (4, 16, 32) and tuple(combine.meta["val"].shape) == (6, 32)
    rounds = next(n for n in nodes if n.target is torch.ops.moe_fx.ep_remaining_rounds.default)
    assert rounds.args[0] is combine and pos[combine] < pos[rounds] and tuple(rounds.meta["val"].shape) == (6, 32)
    assert send.args[0].op == "placeholder"  # 6 tokens <= max_tokens_per_rank: round 0 is all of them
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
    from moe_fx.testing.models import tiny_hf_model

    model = tiny_hf_model("deepseek_v3", num_layers=1)
    experts = model.model.layers[0].mlp.experts
    full = experts.gate_up_proj.detach().clone()
    gm = _capture(model, torch.randint(0, 128, (1, 6)), MoEConfig(ep_group="default", max_tokens_per_rank=8))
    assert _ops(gm) == _SPLIT
    nodes = list(gm.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    disp = next(n for n in nodes if n.target is torch.ops.moe_fx.ep_dispatch_send.default)
    recv = next(n for n in nodes if n.target is torch.ops.moe_fx.ep_dispatch_recv.default)

    def module(n):
        stack = n.meta.get("nn_module_stack") or {}
        return list(stack.values())[-1][0] if stack else ""

    shared = [n for n in nodes if n.op == "call_function" and "shared_experts" in module(n)]
    assert len(shared) >= 3  # gate, up, down projections (and the activation, product)
    assert all(pos[disp] < pos[n] < pos[recv] for n in shared)
    # Rank 1 keeps experts 4..7, compacted into the parameter's first rows.
    assert ep_weights_freed(experts.gate_up_proj) and ep_weights_freed(experts.down_proj)
    assert torch.equal(experts.gate_up_proj.detach()[:4], full[4:8])


@pytest.mark.parametrize("fake_group", [(1, 2)], indirect=True)
def test_split_ep_splits_gpt_oss_with_its_biases_and_activation(fake_group):
    """GPT-OSS's experts (biases, clamped interleaved SwiGLU) are split with every argument kept and the
    biases narrowed to the rank's experts like the weights."""
    from moe_fx.testing.models import tiny_hf_model

    model = tiny_hf_model("gpt_oss", num_layers=1, num_experts=4)
    experts_mod = model.model.layers[0].mlp.experts
    bias = experts_mod.gate_up_proj_bias.detach().clone()
    gate_up = experts_mod.gate_up_proj.detach().clone()
    gm = _capture(model, torch.randint(0, 128, (1, 6)), MoEConfig(ep_group="default", max_tokens_per_rank=8))
    assert _ops(gm) == _SPLIT
    node = next(n for n in gm.graph.nodes if n.target is torch.ops.moe_fx.masked_experts.default)
    kw = node.kwargs
    assert kw["gate_up_layout"] == "interleaved" and kw["limit"] == 7.0 and kw["alpha"] == 1.702 and kw["up_offset"] == 1.0
    for name in ("w13_bias", "w2_bias"):
        assert kw[name].target is torch.narrow and kw[name].meta["val"].shape[0] == 2
    rounds = next(n for n in gm.graph.nodes if n.target is torch.ops.moe_fx.ep_remaining_rounds.default)
    assert all(rounds.kwargs[k] == kw[k] for k in ("gate_up_layout", "limit", "alpha", "up_offset", "w13_bias"))
    # rank 1 keeps experts 2, 3 (of 4) of the bias as well, compacted to the parameter's first rows; the
    # weights, which the op reads through a transpose ([E, H, 2I] stored), are compacted through it
    assert ep_weights_freed(experts_mod.gate_up_proj_bias)
    assert torch.equal(experts_mod.gate_up_proj_bias.detach()[:2], bias[2:4])
    assert ep_weights_freed(experts_mod.gate_up_proj) and ep_weights_freed(experts_mod.down_proj)
    assert torch.equal(experts_mod.gate_up_proj.detach()[:2], gate_up[2:4])
    # narrowed before the transpose (a view of all 4 experts would reach past the shrunk storage)
    w13 = node.args[2]
    assert w13.target is torch.transpose and w13.args[0].target is torch.narrow and w13.args[0].args[1:] == (0, 0, 2)
    assert w13.args[0].args[0].op == "placeholder"
    assert not [n for n in gm.graph.nodes if n.op == "call_method" and n.target == "transpose" and not n.users]


class _Form(torch.nn.Module):
    """A block calling moe_fx::experts with extra arguments (identity experts, weights on the input)."""

    def __init__(self, **kwargs):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.kwargs = kwargs
        self.w13 = torch.nn.Parameter(torch.randn(8, 32, 32, generator=g))
        self.w2 = torch.nn.Parameter(torch.randn(8, 32, 16, generator=g))

    def forward(self, x, ids, w):
        return torch.ops.moe_fx.experts(x, ids, w, self.w13, self.w2, **self.kwargs)


def _inputs(t, k=2):
    return torch.randn(t, 32), torch.randint(0, 8, (t, k)), torch.rand(t, k)


@pytest.mark.parametrize("fake_group", [(0, 2)], indirect=True)
def test_split_ep_identity_experts_stay_on_their_rank(fake_group):
    gm = _capture(_Form(identity_experts=2), _inputs(6), MoEConfig(ep_group="default", max_tokens_per_rank=8))
    assert _ops(gm) == _SPLIT
    disp = next(n for n in gm.graph.nodes if n.target is torch.ops.moe_fx.ep_dispatch_send.default)
    # the ids sent are the routed ones (identity ids set to -1); their w * x is added after the combine
    assert disp.args[1].target is torch.where and disp.args[2] == 8
    rounds = next(n for n in gm.graph.nodes if n.target is torch.ops.moe_fx.ep_remaining_rounds.default)
    assert any(u.target is torch.add for u in rounds.users) or any(
        u.target is torch.Tensor.float and any(v.target is torch.add for v in u.users) for u in rounds.users
    )


@pytest.mark.parametrize("fake_group", [(0, 2)], indirect=True)
def test_split_ep_weights_on_input_top2_sends_one_row_per_slot(fake_group):
    gm = _capture(_Form(weights_on_input=True), _inputs(6), MoEConfig(ep_group="default", max_tokens_per_rank=8))
    disp = next(n for n in gm.graph.nodes if n.target is torch.ops.moe_fx.ep_dispatch_send.default)
    # 6 tokens x top-2 = 12 rows of w_k * x, each with its own id; round 0 holds max_tokens_per_rank of them
    assert tuple(disp.args[0].meta["val"].shape) == (8, 32) and tuple(disp.args[1].meta["val"].shape) == (8, 1)
    rounds = next(n for n in gm.graph.nodes if n.target is torch.ops.moe_fx.ep_remaining_rounds.default)
    assert tuple(rounds.args[1].meta["val"].shape) == (12, 32) and tuple(rounds.meta["val"].shape) == (12, 32)


@pytest.mark.parametrize("fake_group", [(1, 2)], indirect=True)
def test_split_ep_symbolic_tokens_narrow_round_zero(fake_group):
    model = EPMoE(hidden=32, inter=16, num_experts=8, top_k=2)
    x = torch.randn(20, 32)
    torch._dynamo.mark_dynamic(x, 0)
    gm = _capture(model, x, MoEConfig(ep_group="default", max_tokens_per_rank=8), dynamic=None)
    assert _ops(gm) == _SPLIT
    disp = next(n for n in gm.graph.nodes if n.target is torch.ops.moe_fx.ep_dispatch_send.default)
    assert disp.args[0].target is torch.narrow and disp.args[0].args[3].target is torch.sym_min
    first = disp.args[0].meta["val"].shape[0]
    assert isinstance(first, torch.SymInt) and "Min" in str(first)


@pytest.mark.parametrize("fake_group", [(0, 2)], indirect=True)
def test_split_ep_eplb_graph(fake_group):
    from moe_fx.passes import eplb

    model = EPMoE(hidden=32, inter=16, num_experts=8, top_k=2)
    full = model.w13.detach().clone()
    config = MoEConfig(ep_group="default", max_tokens_per_rank=8, eplb=True, eplb_redundant_slots=1)
    gm = _capture(model, torch.randn(6, 32), config)
    assert _ops(gm) == _SPLIT
    assert sum(n.target is torch.ops.aten.index_add_.default for n in gm.graph.nodes) == 1  # the load count
    disp = next(n for n in gm.graph.nodes if n.target is torch.ops.moe_fx.ep_dispatch_send.default)
    assert disp.args[2] == 10  # 2 ranks x (4 experts + 1 copy) physical experts
    buffers = sorted(n.target.split("_", 4)[-1] for n in gm.graph.nodes if n.op == "get_attr")
    assert buffers == ["load", "log_to_phys", "replicas"]
    layer = eplb.layer_of(model.w13)
    assert layer is not None and layer.rows_of(0) == [0, 1, 2, 3, 4] and layer.slots == 5
    # the parameter now holds the rank's 5 physical experts (its 4 and a copy of expert 4) in its first rows
    assert model.w13.untyped_storage().nbytes() == 5 * 32 * 32 * 4
    assert torch.equal(model.w13.detach()[:5], full[:5]) and torch.equal(layer.weights["w13"], full[:5])


class ShiftedRowsMoE(torch.nn.Module):
    """transformers' ``batched_mm`` shape over stacked weights; with ``shift`` set, every routed row reads the
    hidden state of a later token (plumbing the structure does not model; the numerical check sees it)."""

    shift = 0

    def __init__(self, hidden=32, inter=16, num_experts=8, top_k=2):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.router = torch.nn.Parameter(torch.randn(num_experts, hidden, generator=g) * 0.3)
        self.w13 = torch.nn.Parameter(torch.randn(num_experts, 2 * inter, hidden, generator=g) * 0.2)
        self.w2 = torch.nn.Parameter(torch.randn(num_experts, hidden, inter, generator=g) * 0.2)
        self.top_k = top_k

    def forward(self, x):
        weights, ids = torch.topk(torch.softmax(x @ self.router.t(), dim=-1), self.top_k, dim=-1)
        flat = ids.reshape(-1)
        rows = (torch.arange(x.shape[0] * self.top_k) // self.top_k + self.shift) % x.shape[0]
        h = torch.bmm(self.w13[flat], x[rows].unsqueeze(-1)).squeeze(-1)
        g, u = h.chunk(2, dim=-1)
        y = torch.bmm(self.w2[flat], (torch.nn.functional.silu(g) * u).unsqueeze(-1)).squeeze(-1)
        return (y * weights.reshape(-1, 1)).view(x.shape[0], self.top_k, x.shape[1]).sum(dim=1)


@pytest.mark.parametrize("fake_group", [(1, 2)], indirect=True)
def test_split_ep_recompile_checks_on_random_weights_of_the_full_shapes(fake_group):
    """After a compile under EP the expert weights hold only this rank's experts: a recompile must not read the
    real values, yet is checked: the structure proves the form and the probe runs on random weights of the full
    shapes (before: structure only, "unverified"). A recompile the check refuses cannot leave the block as
    written (it would read experts that are gone): it is an error that says why."""
    config = MoEConfig(ep_group="default", max_tokens_per_rank=8)
    model = ShiftedRowsMoE()
    first: list = []
    _capture(model, torch.randn(6, 32), config, sink=first)
    assert first[0].matched and "real and random weights" in first[0].probe
    assert ep_weights_freed(model.w13) and ep_weights_freed(model.w2)
    again: list = []
    gm = _capture(model, torch.randn(5, 32), config, sink=again)
    assert _ops(gm) == _SPLIT
    (report,) = again
    assert report.matched and report.verified == "numerics" and report.probe_error < 1e-4, report
    assert "random weights only (the real ones are split across ranks)" in report.probe
    assert "UNVERIFIED" not in report.verification() and not report.warnings
    model.shift = 1  # the recompile now sends every token's rows to the next token's experts
    with pytest.raises(Exception, match=r"cannot be rewritten \(numerical check failed.*split across ranks"):
        _capture(model, torch.randn(5, 32), config)
