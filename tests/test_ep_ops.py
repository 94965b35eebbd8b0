"""Expert-parallel ops and the split_ep graph rewrite, in one process (backend selection: test_select.py).

Numerics use a one-rank gloo group (the torch.distributed code path without collectives); the graph
rewrite uses torch's fake process group of 2 or 4 ranks (no communication happens, only the pass and
fake implementations run). Multi-process numerics are in test_ep_gloo.py.
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist

import moe_fx  # noqa: F401
from moe_fx.config import MoEConfig
from moe_fx.lowering.prepare_finalize.torch_dist import receive_slots
from moe_fx.ops import experts_reference
from moe_fx.ops.ep import ep_group_name
from moe_fx.ops.masked_experts import masked_experts_reference

ops = torch.ops.moe_fx


# ------------------------------------------------------------------------------------------------
# numerics with one rank (gloo)
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def one_rank():
    if dist.is_initialized():
        pytest.skip("a default process group already exists in this process")
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(tmp, 's')}", rank=0, world_size=1)
        try:
            yield ep_group_name("default")
        finally:
            dist.destroy_process_group()


def _routing(t, e, k, gen, holes=True):
    ids = (
        torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])
        if t
        else torch.empty(0, k, dtype=torch.long)
    )
    if holes and t > 2:
        ids[1, 0] = -1
    weights = torch.rand(t, k, generator=gen)
    return ids, weights


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t", [0, 1, 13])
def test_ep_ops_one_rank_match_experts_op(one_rank, dtype, t):
    gen = torch.Generator().manual_seed(t)
    e, h, i, k, max_tok = 8, 64, 32, 3, 16
    x = torch.randn(t, h, generator=gen).to(dtype)
    ids, weights = _routing(t, e, k, gen)
    w13 = (torch.randn(e, 2 * i, h, generator=gen) * 0.2).to(dtype)
    w2 = (torch.randn(e, h, i, generator=gen) * 0.2).to(dtype)
    recv_x, recv_scale, masked_m, src_info, layout_range = ops.ep_dispatch(x, ids, e, max_tok, one_rank)
    assert recv_x.shape == (e, max_tok, h) and recv_scale.shape == (e, max_tok, 0)
    assert masked_m.tolist() == torch.bincount(ids[ids >= 0], minlength=e).tolist()
    y = ops.masked_experts(recv_x, masked_m, w13, w2)
    # Rows past masked_m are not part of the contract: poison them, combine must not read them.
    poisoned = y.clone()
    for ex, n in enumerate(masked_m.tolist()):
        poisoned[ex, n:] = float("nan")
    out = ops.ep_combine(poisoned, ids, weights, src_info, layout_range, e, max_tok, one_rank)
    ref = experts_reference(x, ids, weights, w13, w2)
    assert out.shape == (t, h) and out.dtype == dtype and not out.isnan().any()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)


def test_fp8_dispatch_one_rank(one_rank):
    gen = torch.Generator().manual_seed(1)
    e, h, i, k, t = 4, 256, 64, 2, 9
    x = torch.randn(t, h, generator=gen).bfloat16()
    ids, weights = _routing(t, e, k, gen)
    w13 = (torch.randn(e, 2 * i, h, generator=gen) * 0.1).bfloat16()
    w2 = (torch.randn(e, h, i, generator=gen) * 0.1).bfloat16()
    recv_x, recv_scale, masked_m, src_info, layout_range = ops.ep_dispatch(x, ids, e, 12, one_rank, True)
    assert recv_x.dtype == torch.float8_e4m3fn and recv_scale.shape == (e, 12, h // 128)
    assert recv_scale.stride() == (12 * h // 128, 1, 12)  # MN-major, as DeepEP and DeepGEMM lay it out
    y = ops.masked_experts(recv_x, masked_m, w13, w2, "silu", recv_scale)
    assert y.dtype == torch.bfloat16
    out = ops.ep_combine(y, ids, weights, src_info, layout_range, e, 12, one_rank, True)
    ref = experts_reference(x, ids, weights, w13, w2).float()
    assert ((out.float() - ref).norm() / ref.norm()) < 0.05


def test_receive_slots_layout():
    # 2 local experts, 3 source ranks: counts[e, r].
    counts = torch.tensor([[2, 0, 1], [1, 3, 0]])
    e_idx, j_idx = receive_slots(counts, torch.device("cpu"))
    # receive order: rank 0 (expert 0 x2, expert 1 x1), rank 1 (expert 1 x3), rank 2 (expert 0 x1)
    assert e_idx.tolist() == [0, 0, 1, 1, 1, 1, 0]
    assert j_idx.tolist() == [0, 1, 0, 1, 2, 3, 2]


def test_ep_errors(one_rank):
    x = torch.randn(5, 16)
    ids = torch.zeros(5, 2, dtype=torch.long)
    ids[:, 1] = 1
    with pytest.raises(ValueError, match="max_tokens_per_rank=4"):
        ops.ep_dispatch(x, ids, 4, 4, one_rank)
    dup = ids.clone()
    dup[0, 1] = 0
    with pytest.raises(ValueError, match="same expert twice"):
        ops.ep_dispatch(x, dup, 4, 8, one_rank)
    with pytest.raises(ValueError, match="out of range"):
        ops.ep_dispatch(x, ids + 5, 4, 8, one_rank)
    with pytest.raises(ValueError, match="no process group named"):
        ops.ep_dispatch(x, ids, 4, 8, "no-such-group")
    with pytest.raises(ValueError, match="masked_m must be int32"):
        ops.masked_experts(
            torch.randn(2, 4, 16), torch.zeros(2, dtype=torch.int64), torch.randn(2, 8, 16), torch.randn(2, 16, 4)
        )
    with pytest.raises(ValueError, match="x_scale"):
        ops.masked_experts(
            torch.randn(2, 4, 128).to(torch.float8_e4m3fn),
            torch.zeros(2, dtype=torch.int32),
            torch.randn(2, 8, 128).bfloat16(),
            torch.randn(2, 128, 4).bfloat16(),
        )


def test_masked_experts_reference_ignores_rows_past_masked_m():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(3, 6, 16, generator=gen)
    masked_m = torch.tensor([0, 6, 2], dtype=torch.int32)
    x[2, 2:] = float("nan")
    w13, w2 = torch.randn(3, 8, 16, generator=gen), torch.randn(3, 16, 4, generator=gen)
    y = masked_experts_reference(x, masked_m, w13, w2)
    assert not y.isnan().any() and (y[0] == 0).all() and (y[2, 2:] == 0).all()
    want = (torch.nn.functional.silu(x[1] @ w13[1, :4].t()) * (x[1] @ w13[1, 4:].t())) @ w2[1].t()
    torch.testing.assert_close(y[1], want, atol=1e-5, rtol=1e-5)


def test_config_ep_group_validation():
    assert MoEConfig(ep_group="default").ep_group == "default"
    with pytest.raises((TypeError, ValueError)):
        MoEConfig(ep_group=3)


# ------------------------------------------------------------------------------------------------
# issue 18: rounds, the fixed-size exchange, bound signatures, EPLB placement (one process)
# ------------------------------------------------------------------------------------------------


def _weights(e, h, i, gen, dtype=torch.float32):
    return (torch.randn(e, 2 * i, h, generator=gen) * h**-0.5).to(dtype), (torch.randn(e, h, i, generator=gen) * i**-0.5).to(dtype)


@pytest.mark.parametrize("kernel", ["torch_dist", "torch_dist_fixed"])
def test_rounds_one_rank(one_rank, kernel, monkeypatch):
    from moe_fx.lowering.prepare_finalize import rounds

    gen = torch.Generator().manual_seed(4)
    e, h, i, k, mt, t = 4, 32, 16, 2, 4, 11
    x = torch.randn(t, h, generator=gen)
    ids, weights = _routing(t, e, k, gen)
    w13, w2 = _weights(e, h, i, gen)
    monkeypatch.setattr(rounds, "_AGREED", {})
    d = ops.ep_dispatch(x[:mt], ids[:mt], e, mt, one_rank, False, kernel)
    first = ops.ep_combine(ops.masked_experts(d[0], d[2], w13, w2), ids[:mt], weights[:mt], d[3], d[4], e, mt,
                           one_rank, False, kernel)
    with pytest.raises(ValueError, match="no step agreed"):
        ops.ep_remaining_rounds(first, x, ids, weights, w13, w2, e, mt, one_rank, False, kernel)
    assert ops.ep_agree_step(t, mt, one_rank) == 3  # ceil(11 / 4)
    out = ops.ep_remaining_rounds(first, x, ids, weights, w13, w2, e, mt, one_rank, False, kernel)
    torch.testing.assert_close(out, experts_reference(x, ids, weights, w13, w2), atol=1e-5, rtol=1e-5)
    # one round: only round 0's output, copied
    assert ops.ep_agree_step(3, mt, one_rank) == 1
    again = ops.ep_remaining_rounds(first[:3], x[:3], ids[:3], weights[:3], w13, w2, e, mt, one_rank, False, kernel)
    assert torch.equal(again, first[:3])
    with pytest.raises(ValueError, match="first_out must be the first round"):
        ops.ep_remaining_rounds(first[:2], x, ids, weights, w13, w2, e, mt, one_rank, False, kernel)


def test_fixed_exchange_one_rank_duplicates_bad_ids_and_fp8(one_rank):
    gen = torch.Generator().manual_seed(5)
    e, h, i, k, mt, t = 4, 128, 32, 3, 8, 7
    x = torch.randn(t, h, generator=gen).bfloat16()
    ids, weights = _routing(t, e, k, gen)
    ids[2, 2] = ids[2, 0]  # one expert twice: one row, both slots count
    ids[3, 1] = e + 3  # no expert: skipped (the GPU rule; the synced exchange raises instead)
    w13, w2 = _weights(e, h, i, gen, torch.bfloat16)
    recv_x, recv_scale, masked_m, src_info, layout_range = ops.ep_dispatch(x, ids, e, mt, one_rank, True,
                                                                            "torch_dist_fixed")
    assert recv_x.dtype == torch.float8_e4m3fn and recv_scale.stride() == (mt * h // 128, 1, mt)
    clean = torch.where((ids >= 0) & (ids < e), ids, -1)
    distinct = [len({int(v) for v in row if v >= 0}) for row in clean]
    assert int(masked_m.sum()) == sum(distinct)
    assert int((src_info >= 0).sum()) == sum(distinct)  # every written row knows its token
    y = ops.masked_experts(recv_x, masked_m, w13, w2, "silu", recv_scale)
    out = ops.ep_combine(y, ids, weights, src_info, layout_range, e, mt, one_rank, True, "torch_dist_fixed")
    ref = experts_reference(x, clean, weights, w13, w2).float()
    assert ((out.float() - ref).norm() / ref.norm()) < 0.06
    with pytest.raises(ValueError, match="more than max_tokens_per_rank=4 .* runs in rounds"):
        ops.ep_dispatch(x, ids, e, 4, one_rank, False, "torch_dist_fixed")


def test_ep_op_checks(one_rank):
    x, ids = torch.randn(3, 192).bfloat16(), torch.zeros(3, 2, dtype=torch.long)
    with pytest.raises(ValueError, match="hidden size 192 is not a multiple of 128"):
        ops.ep_dispatch(x, ids, 4, 8, one_rank, True)
    with pytest.raises(ValueError, match="unknown kernel_choice 'nccl'"):
        ops.ep_dispatch(x, ids, 4, 8, one_rank, False, "nccl")
    with pytest.raises(TypeError, match="unexpected argument"):
        from moe_fx.ops.ep import bind_dispatch

        bind_dispatch(x, ids, 4, 8, one_rank, bogus=True)


def test_schema_binder():
    from moe_fx.ops.signature import binder

    bind = binder("moe_fx::ep_dispatch")
    a = bind("h", "ids", 4, 8, "g", kernel_choice="deepep")
    assert a == {"hidden": "h", "topk_ids": "ids", "num_experts": 4, "max_tokens_per_rank": 8, "group_name": "g",
                 "use_fp8": False, "kernel_choice": "deepep"}
    assert bind(*bind.call_args(a)[0], **bind.call_args(a)[1]) == a
    with pytest.raises(TypeError, match="missing required"):
        bind("h", "ids")
    with pytest.raises(TypeError, match="both by position and by name"):
        bind("h", "ids", 4, 8, "g", hidden="x")
    with pytest.raises(TypeError, match="positional arguments"):
        bind("h", "ids", 4, 8, "g", False, "auto", "extra")
    masked = binder("moe_fx::masked_experts")
    assert "w13_bias" not in masked.positional and masked("x", "m", "a", "b")["gate_up_layout"] == "halves"


def test_place_experts():
    from moe_fx.passes.eplb import initial_placement, place_experts, rank_loads

    start = initial_placement(8, 2, 5)  # 4 experts per rank + a copy of the next rank's first
    assert start == [0, 1, 2, 3, 4, 4, 5, 6, 7, 0]
    hot = [100, 90, 1, 1, 1, 1, 1, 1]
    new = place_experts(hot, 2, 5, start)
    assert new == place_experts(hot, 2, 5, start)  # deterministic: every rank computes the same
    assert all(i in new[:5] and i in new[5:] for i in (0, 1))  # the hot experts get a copy on each rank
    assert max(rank_loads(hot, new, 2)) < max(rank_loads(hot, start, 2))
    kept = sum(new[r * 5 + j] == start[r * 5 + j] for r in range(2) for j in range(5))
    assert kept >= 6  # copies that stay on their rank keep their slot
    # even loads: no gain worth a move, the placement stays
    assert place_experts([5] * 8, 2, 4, initial_placement(8, 2, 4)) == initial_placement(8, 2, 4)
    skew = [10, 10, 10, 10, 0, 0, 0, 0]
    moved = place_experts(skew, 2, 4, initial_placement(8, 2, 4))
    assert rank_loads(skew, moved, 2) == [20.0, 20.0]
    with pytest.raises(ValueError, match="cannot hold"):
        place_experts([1] * 8, 2, 3, [0] * 6)


def test_eplb_layer_moves_weights_one_rank(one_rank):
    from moe_fx.passes.eplb import EPLBLayer

    layer = EPLBLayer.create("layer", one_rank, 4, 1, 6, torch.device("cpu"))
    assert layer.phys_to_log == [0, 1, 2, 3, 0, 1]
    full = torch.arange(4 * 3, dtype=torch.float32).view(4, 3)
    layer.weights["w"] = full[layer.phys_to_log].clone()
    assert layer.replicas.tolist() == [2, 2, 1, 1] and layer.log_to_phys[0].tolist()[:2] == [0, 4]
    moved = layer.apply([3, 1, 2, 3, 0, 2], dist.group.WORLD)
    assert moved == 0  # one rank: every expert is already here, slots are only rearranged
    assert torch.equal(layer.weights["w"], full[[3, 1, 2, 3, 0, 2]])
    assert layer.replicas.tolist() == [1, 1, 2, 2] and sorted(layer.log_to_phys[3].tolist()[:2]) == [0, 3]


def test_config_eplb_validation():
    assert MoEConfig(eplb=True, eplb_redundant_slots=2, eplb_interval=100).eplb_interval == 100
    with pytest.raises(ValueError, match="eplb_redundant_slots=1 needs eplb=True"):
        MoEConfig(eplb_redundant_slots=1)
    with pytest.raises(ValueError, match="MoEConfig.eplb_interval must be an int >= 0"):
        MoEConfig(eplb=True, eplb_interval=-1)
    with pytest.raises(TypeError, match="MoEConfig.eplb must be a bool"):
        MoEConfig(eplb="yes")
