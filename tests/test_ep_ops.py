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
