"""local_dispatch / local_combine (Triton) against torch: ragged loads, -1 ids, weights on input, fp8."""

from __future__ import annotations

import pytest
import torch
from _triton_util import devices, ragged_ids

from moe_fx.lowering.quant import quantize_fp8_per_token_group
from moe_fx.lowering.triton.dispatch import dispatch_rows, local_combine, local_dispatch

# (T, H, E, K) per device: tiny under the CPU interpreter, real sizes on the GPU.
SHAPES = {"cpu": [(7, 200, 6, 3)], "cuda": [(300, 2880, 60, 6), (4096, 7168, 32, 8), (1, 4096, 8, 2)]}
KINDS = ["random", "skewed", "hot", "holes"]


def _check_layout(hidden, ids, x, masked_m, slot_index, e, max_m, scale=None):
    k = ids.shape[1]
    flat = ids.reshape(-1).long()
    counts = torch.stack([(flat == i).sum() for i in range(e)]).to(torch.int32)
    assert torch.equal(masked_m.cpu(), counts.cpu().clamp(max=max_m))
    for i in range(e):
        m = int(masked_m[i])
        slots = slot_index[i, :m].long()
        assert (slot_index[i, m:] == -1).all()
        assert sorted(slots.tolist()) == torch.nonzero(flat == i).flatten().tolist()
        want = hidden[slots // k].float() if scale is None else hidden[slots // k].float() * scale[slots].unsqueeze(-1)
        got = x[i, :m].float()
        if x.dtype == torch.float32 or scale is None:
            assert torch.equal(got, want.to(x.dtype).float())
        else:
            torch.testing.assert_close(got, want.to(x.dtype).float(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("kind", KINDS)
def test_dispatch_combine_roundtrip(device, kind):
    gen = torch.Generator().manual_seed(hash(kind) % 1000)
    for t, h, e, k in SHAPES[device]:
        hidden = torch.randn(t, h, generator=gen).to(torch.bfloat16).to(device)
        ids = ragged_ids(t, k, e, kind, gen).to(device)
        w = torch.rand(t, k, generator=gen).to(device)
        x, masked_m, slot_index = local_dispatch(hidden, ids, e, t)
        assert x.shape == (e, t, h) and masked_m.dtype == torch.int32 and slot_index.dtype == torch.int32
        _check_layout(hidden, ids, x, masked_m, slot_index, e, t)
        # combine (slot_index path and the slot_pos fast path) against a dense torch sum
        y = torch.randn(e, t, h, generator=gen).to(torch.bfloat16).to(device)
        valid = ids >= 0
        rows = torch.zeros(t, k, dtype=torch.long, device=device)
        for i in range(e):
            m = int(masked_m[i])
            s = slot_index[i, :m].long()
            rows.view(-1)[s] = i * t + torch.arange(m, device=device)
        gathered = y.reshape(e * t, h)[rows.view(-1)].view(t, k, h).float()
        ref = (gathered * (w * valid).unsqueeze(-1)).sum(1)
        out = local_combine(y, slot_index, masked_m, w, t)
        torch.testing.assert_close(out.float(), ref, rtol=1e-2, atol=1e-2)
        _, _, mm2, si2, pos = dispatch_rows(hidden, ids, e, t)
        out2 = local_combine(y, si2, mm2, w, t, slot_pos=pos)
        ref2 = local_combine(y, si2, mm2, w, t)
        assert torch.equal(out2, ref2)


@pytest.mark.parametrize("device", devices())
def test_dispatch_weights_on_input_and_fp8(device):
    gen = torch.Generator().manual_seed(3)
    t, h, e, k = SHAPES[device][0]
    hidden = torch.randn(t, h, generator=gen).to(torch.bfloat16).to(device)
    ids = ragged_ids(t, k, e, "holes", gen).to(device)
    w = torch.rand(t, k, generator=gen).to(device)
    x, masked_m, slot_index = local_dispatch(hidden, ids, e, t, topk_weights=w, weights_on_input=True)
    _check_layout(hidden, ids, x, masked_m, slot_index, e, t, scale=w.reshape(-1))
    # combine without weights sums the rows
    y = torch.randn(e, t, h, generator=gen).to(torch.bfloat16).to(device)
    _, _, mm, si, pos = dispatch_rows(hidden, ids, e, t)
    unweighted = local_combine(y, si, mm, None, t, slot_pos=pos)
    weighted1 = local_combine(y, si, mm, torch.ones_like(w), t, slot_pos=pos)
    torch.testing.assert_close(unweighted, weighted1, rtol=0, atol=0)
    # fp8 dispatch: codes and 1x128 scales of the token (times the weight on input)
    for woi in (False, True):
        xq, xs, mm, si, _ = dispatch_rows(hidden, ids, e, t, w, woi, quant_fp8=True)
        q_ref, s_ref = quantize_fp8_per_token_group(hidden.float())
        for i in range(e):
            m = int(mm[i])
            if m == 0:
                continue
            s = si[i, :m].long()
            tok = s // k
            scale = s_ref[tok] * (w.reshape(-1)[s].unsqueeze(-1) if woi else 1)
            torch.testing.assert_close(xs[i, :m], scale, rtol=1e-6, atol=0)
            # a code may differ by one step where the division rounds differently; compare values
            back = xq[i, :m].float() * xs[i, :m].repeat_interleave(128, -1)[:, :h]
            want = q_ref[tok].float() * scale.repeat_interleave(128, -1)[:, :h]
            torch.testing.assert_close(back, want, rtol=2**-3, atol=float(scale.max()) * 2**-9)


@pytest.mark.parametrize("device", devices())
def test_fp8_dispatch_writes_scales_in_a_given_layout(device):
    """The scales land, unchanged, in a caller's MN-major TMA-aligned tensor (DeepGEMM's), with no copy."""
    from moe_fx.lowering.layouts import empty_mn_major_scales, is_mn_major_tma_aligned

    gen = torch.Generator().manual_seed(6)
    t, h, e, k = SHAPES[device][0]
    hidden = torch.randn(t, h, generator=gen).to(torch.bfloat16).to(device)
    ids = ragged_ids(t, k, e, "random", gen).to(device)
    given = empty_mn_major_scales(e, t, h, device=device).fill_(float("nan"))
    assert is_mn_major_tma_aligned(given)
    xq, xs, mm, si, _ = dispatch_rows(hidden, ids, e, t, quant_fp8=True, x_scale=given)
    assert xs is given
    xq2, xs2, mm2, si2, _ = dispatch_rows(hidden, ids, e, t, quant_fp8=True)
    for i in range(e):
        m = int(mm[i])
        # row order inside an expert follows atomics: compare rows by the slot each holds
        order, order2 = si[i, :m].argsort(), si2[i, :m].argsort()
        torch.testing.assert_close(xs[i, :m][order], xs2[i, :m][order2], rtol=0, atol=0)
        assert torch.equal(xq[i, :m][order].view(torch.uint8), xq2[i, :m][order2].view(torch.uint8))
        assert torch.isnan(xs[i, m:]).all(), "rows past masked_m stay unwritten"
    with pytest.raises(ValueError, match="x_scale"):
        dispatch_rows(hidden, ids, e, t, quant_fp8=True, x_scale=given[:, :-1])


@pytest.mark.parametrize("device", devices())
def test_dispatch_edge_cases(device):
    h = 64
    hidden = torch.randn(3, h).to(device)
    ids = torch.tensor([[-1, -1], [1, -1], [1, 5]], dtype=torch.int64, device=device)  # 5 >= E: skipped
    x, mm, si = local_dispatch(hidden, ids, 3, 3)
    assert mm.tolist() == [0, 2, 0]
    torch.testing.assert_close(x[1, :2].sort(0).values, hidden[1:3].sort(0).values, rtol=0, atol=0)
    out = local_combine(x, si, mm, torch.ones(3, 2, device=device), 3)
    assert (out[0] == 0).all()
    torch.testing.assert_close(out[1:], hidden[1:], rtol=0, atol=0)
    # max_m smaller than the load: rows beyond it are dropped, masked_m clamps
    x, mm, si = local_dispatch(hidden, torch.ones(3, 1, dtype=torch.int32, device=device), 2, 2)
    assert mm.tolist() == [0, 2]
    # T = 0
    x, mm, si = local_dispatch(hidden[:0], ids[:0], 3, 0)
    assert x.shape == (3, 0, h) and mm.tolist() == [0, 0, 0]
    with pytest.raises(ValueError):
        local_dispatch(hidden, ids[:2], 3, 3)
