"""permute_to_masked / unpermute_from_masked (Triton) against torch: ragged loads, -1 and repeated ids,
weights on the input, fp8 rows and scales in a given layout, identity experts, edge cases."""

from __future__ import annotations

import pytest
import torch
from _triton_util import devices, ragged_ids

from moe_fx.lowering.quant import quantize_fp8_per_token_group
from moe_fx.lowering.triton.permute import masked_rows_needed, permute_to_masked, unpermute_from_masked

# (T, H, E, K) per device: tiny under the CPU interpreter, real sizes on the GPU.
SHAPES = {"cpu": [(7, 200, 6, 3)], "cuda": [(300, 2880, 60, 6), (4096, 7168, 32, 8), (1, 4096, 8, 2)]}
KINDS = ["random", "skewed", "hot", "holes"]


def _rows_of(batch, max_m):
    """(expert, row) of every slot from slot_pos; -1 where the slot sent no row."""
    pos = batch.slot_pos.long().cpu()
    return torch.where(pos >= 0, pos // max_m, -1), torch.where(pos >= 0, pos % max_m, -1)


def _check_layout(hidden, ids, batch, e, max_m, scale=None, dedupe=True):
    t, k = ids.shape
    flat = ids.reshape(-1).long().cpu()
    expert, row = _rows_of(batch, max_m)
    valid = (flat >= 0) & (flat < e)
    assert torch.equal(expert[valid], flat[valid]) and (expert[~valid] == -1).all()
    mm = batch.masked_m.cpu()
    x = batch.x.cpu()
    for i in range(e):
        slots = torch.nonzero(flat == i).flatten()
        distinct = {(int(s) // k) if dedupe else int(s) for s in slots}
        assert int(mm[i]) == len(distinct), (i, int(mm[i]), len(distinct))
        used = {int(row[s]) for s in slots}
        assert used == set(range(int(mm[i]))), "rows 0..masked_m-1, each used"
        for s in slots.tolist():
            want = hidden[s // k].float().cpu()
            if scale is not None:
                want = want * scale[s].cpu()
            got = x[i, row[s]].float()
            if scale is None:
                assert torch.equal(got, want.to(x.dtype).float())
            else:
                torch.testing.assert_close(got, want.to(x.dtype).float(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("kind", KINDS)
def test_permute_unpermute_roundtrip(device, kind):
    gen = torch.Generator().manual_seed(hash(kind) % 1000)
    for t, h, e, k in SHAPES[device]:
        hidden = torch.randn(t, h, generator=gen).to(torch.bfloat16).to(device)
        ids = ragged_ids(t, k, e, kind, gen).to(device)
        w = torch.rand(t, k, generator=gen).to(device)
        batch = permute_to_masked(hidden, ids, e, t)
        assert batch.x.shape == (e, t, h) and batch.masked_m.dtype == torch.int32
        _check_layout(hidden, ids, batch, e, t)
        # unpermute against a dense torch sum over the rows each slot points at
        y = torch.randn(e, t, h, generator=gen).to(torch.bfloat16).to(device)
        pos = batch.slot_pos.view(t, k)
        gathered = y.reshape(e * t, h)[pos.clamp(min=0)].float() * (pos >= 0).unsqueeze(-1)
        ref = (gathered * w.unsqueeze(-1)).sum(1)
        out = unpermute_from_masked(y, batch.slot_pos, w)
        torch.testing.assert_close(out.float(), ref, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("device", devices())
def test_repeated_ids_share_one_row(device):
    """A token naming one expert twice sends one row (weights after the expert) and both slots point at it;
    with weights on the input every slot gets its own row, in a layout of T * K rows."""
    gen = torch.Generator().manual_seed(4)
    t, h, e, k = 5, 64, 2, 4  # K > E: every token repeats experts
    hidden = torch.randn(t, h, generator=gen).to(device)
    ids = torch.randint(0, e, (t, k), generator=gen).to(device)
    ids[0] = torch.tensor([1, 1, 1, 1])
    w = torch.rand(t, k, generator=gen).to(device)
    batch = permute_to_masked(hidden, ids, e, masked_rows_needed(t, k, False))
    _check_layout(hidden, ids, batch, e, t)
    assert int(batch.masked_m.sum()) <= t * e
    rows = masked_rows_needed(t, k, True)
    assert rows == t * k
    batch = permute_to_masked(hidden, ids, e, rows, w, weights_on_input=True)
    _check_layout(hidden, ids, batch, e, rows, scale=w.reshape(-1), dedupe=False)


@pytest.mark.parametrize("device", devices())
def test_weights_on_input_and_fp8(device):
    gen = torch.Generator().manual_seed(3)
    t, h, e, k = SHAPES[device][0]
    hidden = torch.randn(t, h, generator=gen).to(torch.bfloat16).to(device)
    ids = ragged_ids(t, k, e, "holes", gen).to(device)
    w = torch.rand(t, k, generator=gen).to(device)
    batch = permute_to_masked(hidden, ids, e, t, w, weights_on_input=True)
    _check_layout(hidden, ids, batch, e, t, scale=w.reshape(-1), dedupe=False)
    # unweighted unpermute sums the rows
    y = torch.randn(e, t, h, generator=gen).to(torch.bfloat16).to(device)
    unweighted = unpermute_from_masked(y, batch.slot_pos, w, weights_on_output=False)
    weighted1 = unpermute_from_masked(y, batch.slot_pos, torch.ones_like(w))
    torch.testing.assert_close(unweighted, weighted1, rtol=0, atol=0)
    # fp8: codes and 1x128 scales of the token (times the weight on input)
    q_ref, s_ref = quantize_fp8_per_token_group(hidden.float())
    for woi in (False, True):
        b = permute_to_masked(hidden, ids, e, t, w, weights_on_input=woi, quant_fp8=True)
        expert, row = _rows_of(b, t)
        for s in torch.nonzero(expert >= 0).flatten().tolist():
            tok, i, r = s // k, int(expert[s]), int(row[s])
            scale = s_ref[tok] * (w.reshape(-1)[s] if woi else 1)
            torch.testing.assert_close(b.x_scale[i, r], scale, rtol=1e-6, atol=0)
            back = b.x[i, r].float() * b.x_scale[i, r].repeat_interleave(128, -1)[:h]
            want = q_ref[tok].float() * scale.repeat_interleave(128, -1)[:h]
            torch.testing.assert_close(back, want, rtol=2**-3, atol=float(scale.max()) * 2**-9)


@pytest.mark.parametrize("device", devices())
def test_fp8_permute_writes_scales_in_a_given_layout(device):
    """The scales land, unchanged, in a caller's MN-major TMA-aligned tensor (DeepGEMM's), with no copy."""
    from moe_fx.lowering.layouts import empty_mn_major_scales, is_mn_major_tma_aligned

    gen = torch.Generator().manual_seed(6)
    t, h, e, k = SHAPES[device][0]
    hidden = torch.randn(t, h, generator=gen).to(torch.bfloat16).to(device)
    ids = ragged_ids(t, k, e, "random", gen).to(device)
    given = empty_mn_major_scales(e, t, h, device=device).fill_(float("nan"))
    assert is_mn_major_tma_aligned(given)
    b = permute_to_masked(hidden, ids, e, t, quant_fp8=True, x_scale=given)
    assert b.x_scale is given
    b2 = permute_to_masked(hidden, ids, e, t, quant_fp8=True)
    expert, row = _rows_of(b, t)
    expert2, row2 = _rows_of(b2, t)
    assert torch.equal(expert, expert2)
    for s in torch.nonzero(expert >= 0).flatten().tolist():
        i = int(expert[s])
        torch.testing.assert_close(b.x_scale[i, row[s]], b2.x_scale[i, row2[s]], rtol=0, atol=0)
        assert torch.equal(b.x[i, row[s]].view(torch.uint8), b2.x[i, row2[s]].view(torch.uint8))
    for i in range(e):
        assert torch.isnan(b.x_scale[i, int(b.masked_m[i]):]).all(), "rows past masked_m stay unwritten"
    with pytest.raises(ValueError, match="x_scale"):
        permute_to_masked(hidden, ids, e, t, quant_fp8=True, x_scale=given[:, :-1])


@pytest.mark.parametrize("device", devices())
def test_identity_experts_and_edge_cases(device):
    h = 64
    hidden = torch.randn(3, h).to(device)
    # 5 is an identity expert (E=3, 3 identity experts); 7 is out of range: the GPU rule skips it
    ids = torch.tensor([[-1, -1], [1, 7], [1, 5]], dtype=torch.int64, device=device)
    w = torch.tensor([[1.0, 1.0], [0.5, 2.0], [0.25, 3.0]], device=device)
    b = permute_to_masked(hidden, ids, 3, 3)
    assert b.masked_m.tolist() == [0, 2, 0]
    y = b.x.clone()
    out = unpermute_from_masked(y, b.slot_pos, w, topk_ids=ids, hidden=hidden, num_experts=3, identity_experts=3)
    assert (out[0] == 0).all()
    torch.testing.assert_close(out[1], 0.5 * hidden[1])
    torch.testing.assert_close(out[2], 0.25 * hidden[2] + 3.0 * hidden[2])
    # T = 0
    b = permute_to_masked(hidden[:0], ids[:0], 3, 0)
    assert b.x.shape == (3, 0, h) and b.masked_m.tolist() == [0, 0, 0]
    assert unpermute_from_masked(b.x, b.slot_pos, w[:0]).shape == (0, h)
    with pytest.raises(ValueError):
        permute_to_masked(hidden, ids[:2], 3, 3)


def test_combine_block_fills_the_gpu_at_static_decode_sizes():
    """A static token count splits rows into narrower blocks until the grid has about one program per SM (T=1 on
    2048-wide rows: 16 programs, not 2); a symbolic one keeps 1024 (its grid is a constant of the graph)."""
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from moe_fx.lowering.triton.permute import COMBINE_MIN_BLOCK, combine_block

    assert combine_block(1, 2048) == COMBINE_MIN_BLOCK == 128
    assert combine_block(16, 2048) == 128 and combine_block(64, 2048) == 512
    assert combine_block(4096, 2048) == 1024 and combine_block(4096, 7168) == 1024
    assert combine_block(1, 100) == 128  # never below the narrowest block
    env = ShapeEnv()
    sym_t = env.create_unbacked_symint()
    assert combine_block(sym_t, 2048) == 1024


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("weights_on_output", [True, False])
def test_combine_as_torch_ops_matches_the_kernel(device, weights_on_output):
    """``combine_rows`` (the combine Inductor may fuse, ``pipeline.COMBINE_IN_GRAPH``) against ``unpermute_kernel`` on
    the same rows, for rows in slot order and for rows a permute placed (``slot_pos``; a repeated id shares a row):
    rows of slots without an expert are never read (NaN here), identity experts add w * hidden, weights applied or
    not; fp32 sums, so the two agree to rounding."""
    from moe_fx.lowering.triton.permute import combine_rows

    gen = torch.Generator().manual_seed(7)
    t, k, h, e = 2, 4, 96, 6
    # 7, 8: identity experts; 9: outside; expert 2 twice in token 1 (one shared row in the masked layout)
    ids = torch.tensor([[0, 3, -1, 7], [5, 2, 9, 2]], dtype=torch.int64)
    w = torch.rand(t, k, generator=gen)
    hidden = torch.randn(t, h, generator=gen).to(torch.bfloat16)
    slot_y = torch.randn(1, t * k, h, generator=gen).to(torch.bfloat16)  # GEMM2's rows in slot order
    valid = ((ids >= 0) & (ids < e)).reshape(-1)
    slot_y[0, ~valid] = float("nan")  # rows the GEMMs never wrote
    ids, w, hidden, slot_y = ids.to(device), w.to(device), hidden.to(device), slot_y.to(device)
    batch = permute_to_masked(hidden, ids, e, masked_rows_needed(t, k, not weights_on_output), w,
                              weights_on_input=not weights_on_output)
    masked_y = batch.x.clone()
    masked_y[batch.masked_m.unsqueeze(1) <= torch.arange(masked_y.shape[1], device=device)] = float("nan")
    kw = {"weights_on_output": weights_on_output, "hidden": hidden, "identity_experts": 3}
    for y, pos, slot_rows in ((slot_y, None, True), (masked_y, batch.slot_pos, False)):
        got = combine_rows(y, pos, w, ids, e, out_dtype=torch.float32, **kw)
        want = unpermute_from_masked(y, pos, w, topk_ids=ids, num_experts=e, out_dtype=torch.float32,
                                     slot_rows=slot_rows, **kw)
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # by hand, token 0 in slot order: experts 0 and 3 (rows 0 and 1), identity expert 7 (slot 3)
    got = combine_rows(slot_y, None, w, ids, e, out_dtype=torch.float32, **kw)
    scale = w[0, :2] if weights_on_output else torch.ones(2, device=device)
    by_hand = (slot_y[0, :2].float() * scale[:, None]).sum(0) + w[0, 3] * hidden[0].float()
    torch.testing.assert_close(got[0], by_hand, rtol=1e-5, atol=1e-5)
    assert combine_rows(slot_y, None, w, ids, e, out_dtype=torch.bfloat16, **kw).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="slot rows"):
        combine_rows(slot_y[:, :-1], None, w, ids, e, out_dtype=torch.float32, **kw)
