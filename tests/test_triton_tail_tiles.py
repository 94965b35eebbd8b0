"""Half-height tail tiles of the GEMM kernels (``grouped_gemm.TAIL_TILES_MIN_BLOCK_M``; the kernels' TAIL).

An expert whose rows leave at most half a tile after its whole tiles computes those rows in a second loop of
half-height tiles. Every expert below has a row count at one of the boundaries (empty, one row, half a tile and
one either side, a whole tile and one past, one and a half tiles and one past, several tiles), so a row that
neither loop covers stays NaN and a row that both cover or that lands in the wrong tile gives a wrong product.
The reference is torch on each slot's token and expert. CPU: the Triton interpreter with 32-row tiles (16-row
tails); GPU: 128-row tiles, the shipped prefill height.
"""

from __future__ import annotations

import pytest
import torch
from _triton_util import devices, rel_err

from moe_fx.lowering.quant import quantize_fp8_blockwise
from moe_fx.lowering.triton import grouped_gemm
from moe_fx.lowering.triton.configs import TileConfig
from moe_fx.lowering.triton.grouped_gemm import sorted_gemm
from moe_fx.lowering.triton.sort import quantize_rows, sort_by_expert
from moe_fx.ops import ExpertActivation, dequantize_blockwise


def _counts(bm: int) -> list[int]:
    """Row counts of the experts: every boundary of a ``bm``-row tile and its half-height tail."""
    half = bm // 2
    return [0, 1, half - 1, half, half + 1, bm, bm + 1, bm + half, bm + half + 1, 2 * bm + 3]


def _routing(counts: list[int], k: int, gen: torch.Generator) -> torch.Tensor:
    """Top-k ids ``[T, K]`` giving expert ``x`` exactly ``counts[x]`` slots, in a random order (a token may name
    an expert twice: each slot is its own row)."""
    slots = torch.cat([torch.full((c,), x, dtype=torch.int32) for x, c in enumerate(counts)])
    slots = slots[torch.randperm(len(slots), generator=gen)]
    t = len(slots) // k
    return slots[: t * k].view(t, k)


def _launches(monkeypatch) -> list[dict]:
    """The keyword arguments of every GEMM kernel launch from here on."""
    seen: list[dict] = []
    real = grouped_gemm.launch

    def spy(name, device, grid, *args, **kwargs):
        if name.startswith("masked_gemm"):
            seen.append(kwargs)
        return real(name, device, grid, *args, **kwargs)

    monkeypatch.setattr(grouped_gemm, "launch", spy)
    return seen


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("tma", [False, True])
@pytest.mark.parametrize("fp8", [False, True])
def test_tail_tiles_compute_every_row_once(fp8, tma, device, monkeypatch):
    """GEMM1 (tokens gathered, routing weights, bias) and GEMM2 (sorted rows) with tail tiles on: each slot's row is
    its token times its expert's weights, rows past the total are never written, and the launches ran TAIL."""
    bm = 128 if device == "cuda" else 32
    gen = torch.Generator().manual_seed(21 + fp8 + 2 * tma)
    k, h, n = 2, 256, 192
    counts = _counts(bm)
    ids = _routing(counts, k, gen)
    assert torch.bincount(ids.flatten().long(), minlength=len(counts)).tolist() == counts
    e, t = len(counts), ids.shape[0]
    x = torch.randn(t, h, generator=gen)
    a2 = torch.randn(1, t * k, h, generator=gen)
    w = torch.randn(e, n, h, generator=gen) / h**0.5
    rw, bias = torch.rand(t, k, generator=gen) + 0.5, torch.randn(e, n, generator=gen)
    cfg = TileConfig(bm, 64, 128 if fp8 else 64, 1, 4, 3 if device == "cuda" else 1, 1, tma=tma)
    ids, x, a2, w, rw, bias = (v.to(device) for v in (ids, x, a2, w, rw, bias))
    rows = sort_by_expert(ids, e)
    monkeypatch.setattr(grouped_gemm, "TAIL_TILES_MIN_BLOCK_M", bm)
    seen = _launches(monkeypatch)
    poison = torch.full((1, t * k, n), float("nan"), dtype=torch.bfloat16 if fp8 or device == "cuda" else torch.float32,
                        device=device)
    if fp8:
        wq, ws = quantize_fp8_blockwise(w)
        xq, xs = quantize_rows(x.bfloat16())
        aq, as_ = quantize_rows(a2[0].bfloat16())
        out1 = sorted_gemm(xq, wq, rows, poison.clone(), a_scale=xs, b_scale=ws, gather=True, route_weights=rw,
                           bias=bias, config=cfg)[0]
        out2 = sorted_gemm(aq[None], wq, rows, poison.clone(), a_scale=as_[None], b_scale=ws, config=cfg)[0]
        x32, a32 = xq.float() * xs.repeat_interleave(128, -1), aq.float() * as_.repeat_interleave(128, -1)
        w32, tol = dequantize_blockwise(wq, ws), 2e-2
    else:
        dt = poison.dtype
        out1 = sorted_gemm(x.to(dt), w.to(dt), rows, poison.clone(), gather=True, route_weights=rw, bias=bias,
                           config=cfg)[0]
        out2 = sorted_gemm(a2.to(dt), w.to(dt), rows, poison.clone(), config=cfg)[0]
        x32, a32, w32 = x.to(dt).float(), a2[0].to(dt).float(), w.to(dt).float()
        tol = 1e-2 if dt == torch.bfloat16 else 1e-5
    assert len(seen) == 2 and all(kw["TAIL"] for kw in seen)
    flat, pos = ids.flatten().long(), rows.slot_pos.long()
    tok = torch.arange(t * k, device=device) // k
    want1 = torch.einsum("sh,snh->sn", x32[tok], w32[flat]) * rw.flatten()[:, None] + bias[flat]
    want2 = torch.einsum("sh,snh->sn", a32[pos], w32[flat])
    assert rel_err(out1[pos].float(), want1) < tol and rel_err(out2[pos].float(), want2) < tol
    for out, want in ((out1, want1), (out2, want2)):  # row by row: a wrong row must not hide in the norm
        worst = ((out[pos].float() - want).abs().amax(1) / want.abs().amax(1).clamp_min(1e-6)).max()
        assert worst < 10 * tol, float(worst)
    total = rows.total.item()
    assert total == t * k and torch.isfinite(out1.float()).all() and torch.isfinite(out2.float()).all()


@pytest.mark.parametrize("device", devices())
def test_tail_tiles_leave_padding_rows_unwritten(device, monkeypatch):
    """Slots with no expert (-1) have no row: the rows past the sorted total stay as they were with tails on."""
    bm = 128 if device == "cuda" else 32
    gen = torch.Generator().manual_seed(4)
    ids = _routing(_counts(bm), 2, gen)
    ids[torch.rand(ids.shape, generator=gen) < 0.2] = -1
    e, (t, k), h, n = len(_counts(bm)), ids.shape, 128, 64
    dt = torch.bfloat16 if device == "cuda" else torch.float32
    x = torch.randn(t, h, generator=gen).to(device, dt)
    w = (torch.randn(e, n, h, generator=gen) / h**0.5).to(device, dt)
    rows = sort_by_expert(ids.to(device), e)
    monkeypatch.setattr(grouped_gemm, "TAIL_TILES_MIN_BLOCK_M", bm)
    cfg = TileConfig(bm, 64, 64, 1, 4, 3 if device == "cuda" else 1, 1)
    out = sorted_gemm(x, w, rows, torch.full((1, t * k, n), float("nan"), dtype=dt, device=device), gather=True,
                      config=cfg)[0]
    total = rows.total.item()
    assert total < t * k and torch.isnan(out[total:].float()).all() and torch.isfinite(out[:total].float()).all()
    flat, pos = ids.flatten().long().to(device), rows.slot_pos.long()
    valid = flat >= 0
    tok = torch.arange(t * k, device=device)[valid] // k
    want = torch.einsum("sh,snh->sn", x[tok].float(), w[flat[valid]].float())
    assert rel_err(out[pos[valid]].float(), want) < (1e-2 if dt == torch.bfloat16 else 1e-5)


@pytest.mark.parametrize("form", ["silu", "gpt_oss"])
def test_tail_tiles_with_the_activation_epilogue(form, monkeypatch):
    """GEMM1 with the activation in its epilogue (gate/up halves paired, interleaved) gives the same rows with tails
    on as off."""
    spec = ExpertActivation() if form == "silu" else ExpertActivation("silu", True, "interleaved", 1.702, 0.8, 1.0)
    gen = torch.Generator().manual_seed(9)
    ids = _routing(_counts(32), 2, gen)
    e, (t, k), h, i = len(_counts(32)), ids.shape, 128, 48
    x = torch.randn(t, h, generator=gen)
    w13 = torch.randn(e, spec.columns(i), h, generator=gen) / h**0.5
    rows = sort_by_expert(ids, e)
    cfg = TileConfig(32, 32, 64, 1, 4, 1, 1)
    outs = {}
    seen = _launches(monkeypatch)
    for least in (0, 32):
        monkeypatch.setattr(grouped_gemm, "TAIL_TILES_MIN_BLOCK_M", least)
        outs[least] = sorted_gemm(x, w13, rows, torch.full((1, t * k, i), float("nan")), gather=True,
                                  activation=spec, config=cfg)[0]
    assert [kw["TAIL"] for kw in seen] == [False, True]
    assert torch.isfinite(outs[32]).all()
    torch.testing.assert_close(outs[32], outs[0], rtol=1e-5, atol=1e-5)


def test_tail_tiles_only_where_they_apply(monkeypatch):
    """Tail tiles need a tile of the switch's height or more (and 32 rows at least: 16-row halves are the smallest
    MMA); never swapped tiles, rows in slot order or a host-made descriptor; off by default."""
    tail = grouped_gemm._tail_tiles
    big, small = TileConfig(128, 128, 64), TileConfig(64, 128, 64)
    monkeypatch.setattr(grouped_gemm, "TAIL_TILES_MIN_BLOCK_M", 0)
    assert not tail(big, slots=False, host_tma=False)
    monkeypatch.setattr(grouped_gemm, "TAIL_TILES_MIN_BLOCK_M", 128)
    assert tail(big, slots=False, host_tma=False) and not tail(small, slots=False, host_tma=False)
    assert not tail(TileConfig(128, 64, 128, swap_ab=True), slots=False, host_tma=False)
    assert not tail(big, slots=True, host_tma=False) and not tail(big, slots=False, host_tma=True)
    monkeypatch.setattr(grouped_gemm, "TAIL_TILES_MIN_BLOCK_M", 1)
    assert tail(TileConfig(32, 64, 64), slots=False, host_tma=False)
    assert not tail(TileConfig(16, 64, 64), slots=False, host_tma=False)


@pytest.mark.parametrize("device", devices())
def test_tail_tiles_on_the_masked_layout(device, monkeypatch):
    """The masked layout (``[G, M, K]`` groups, ``masked_m`` valid rows each: DeepEP's) with tail tiles: each group's
    valid rows are its product, the rows past ``masked_m`` stay as they were."""
    from moe_fx.lowering.triton.grouped_gemm import masked_gemm

    bm = 128 if device == "cuda" else 32
    counts = _counts(bm)
    gen = torch.Generator().manual_seed(7)
    g, m, h, n = len(counts), max(counts) + 5, 128, 64
    dt = torch.bfloat16 if device == "cuda" else torch.float32
    a = torch.randn(g, m, h, generator=gen).to(device, dt)
    w = (torch.randn(g, n, h, generator=gen) / h**0.5).to(device, dt)
    masked_m = torch.tensor(counts, dtype=torch.int32, device=device)
    monkeypatch.setattr(grouped_gemm, "TAIL_TILES_MIN_BLOCK_M", bm)
    seen = _launches(monkeypatch)
    out = masked_gemm(a, w, masked_m, torch.full((g, m, n), float("nan"), dtype=dt, device=device),
                      config=TileConfig(bm, 64, 64, 1, 4, 3 if device == "cuda" else 1, 1))
    assert [kw["TAIL"] for kw in seen] == [True]
    tol = 1e-2 if dt == torch.bfloat16 else 1e-5
    for x, c in enumerate(counts):
        assert torch.isnan(out[x, c:].float()).all(), x
        if c:
            assert rel_err(out[x, :c].float(), a[x, :c].float() @ w[x].float().T) < tol, x
