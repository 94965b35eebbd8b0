"""Tail rows absorbed by an expert's last whole tile (``grouped_gemm.TAIL_ROWS``, ``masked_gemm_kernel``'s TAIL_M).

An expert whose rows run 1 to ``TAIL_ROWS`` past a whole tile gets no tile for them: its last tile multiplies them
by the weight tile it already holds, in a second (swapped) MMA. Checked against torch on each slot's token and
expert (CPU: the Triton interpreter, 64-row tiles and 16-row tails; GPU: the 128-row prefill tile and 32-row tails),
for both GEMMs of the sorted layout and the activation epilogue's forms, outputs poisoned with NaN so rows never
written show; which launches take a tail (:func:`grouped_gemm._with_tail`) is checked on its own.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from _triton_util import ACTIVATION_FORMS, devices

from moe_fx.lowering.triton import grouped_gemm
from moe_fx.lowering.triton.configs import SMEM_BUDGET, TileConfig
from moe_fx.lowering.triton.grouped_gemm import SortedRows, _with_tail, sorted_gemm
from moe_fx.lowering.triton.sort import sort_by_expert

#: (tile rows, tail rows) per device: the smallest tile the tail applies to on CPU, the prefill tile on the GPU
TILE = {"cpu": (64, 16), "cuda": (128, 32)}


def _counts(bm: int, tail: int) -> list[int]:
    """Rows per expert around every edge of the rule: 1 and ``tail`` past a whole tile (absorbed), ``tail + 1`` past
    (a tile of its own), a tail after two tiles, none, fewer rows than a tile (no whole tile to absorb into), one
    whole tile exactly."""
    return [bm + 1, bm + tail, bm + tail + 1, 2 * bm + tail // 2, 0, 5, bm]


def _ids(counts: list[int], k: int, gen: torch.Generator) -> torch.Tensor:
    """``[T, K]`` ids with ``counts[e]`` slots of expert ``e`` in random order (repeats inside a token included),
    padded with -1 slots (no row) to a whole number of tokens."""
    flat = torch.cat([torch.full((c,), e) for e, c in enumerate(counts)] + [torch.full((-sum(counts) % k + k,), -1)])
    return flat[torch.randperm(flat.numel(), generator=gen)].reshape(-1, k).to(torch.int32)


def _recorded_tails(monkeypatch) -> list[int]:
    """The TAIL_M of every GEMM launch from now on."""
    seen: list[int] = []
    real = grouped_gemm.launch

    def spy(name, device, grid, *args, **kw):
        if name == "masked_gemm_kernel":
            seen.append(kw["TAIL_M"])
        return real(name, device, grid, *args, **kw)

    monkeypatch.setattr(grouped_gemm, "launch", spy)
    return seen


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("tma", [False, True])
def test_tail_rows_gemms_match_torch(tma, device, monkeypatch):
    """GEMM1 (tokens gathered, routing weights, bias) and GEMM2 (sorted rows; device-made descriptors with ``tma``,
    the tail through a box of its own height) with tails absorbed equal torch's products, every row written once."""
    bm, tail = TILE[device]
    monkeypatch.setattr(grouped_gemm, "TAIL_ROWS", tail)
    tails = _recorded_tails(monkeypatch)
    gen = torch.Generator().manual_seed(21)
    counts = _counts(bm, tail)
    e, k, h, n = len(counts), 2, (96 if device == "cpu" else 1088), (72 if device == "cpu" else 600)  # K, N tails
    ids = _ids(counts, k, gen)
    t = ids.shape[0]
    rows = sort_by_expert(ids.to(device), e)
    assert rows.counts.tolist() == counts
    dtype = torch.float32 if device == "cpu" else torch.bfloat16  # fp32: exact products under the interpreter
    x = torch.randn(t, h, generator=gen).to(device, dtype)
    a2 = torch.randn(1, t * k, h, generator=gen).to(device, dtype)
    w = (torch.randn(e, n, h, generator=gen) / h**0.5).to(device, dtype)
    bias = torch.randn(e, n, generator=gen).to(device)
    rw = (torch.rand(t, k, generator=gen) + 0.5).to(device)
    cfg = TileConfig(bm, 64, 64, 1, 8 if device == "cuda" else 4, 3, 1, tma=tma)
    out1 = torch.full((1, t * k, n), float("nan"), dtype=dtype, device=device)
    out2 = torch.full((1, t * k, n), float("nan"), dtype=dtype, device=device)
    sorted_gemm(x, w, rows, out1, gather=True, route_weights=rw, bias=bias, config=cfg)
    sorted_gemm(a2, w, rows, out2, config=cfg)
    assert tails == [tail, tail]
    slots = (rows.slot_pos >= 0).nonzero()[:, 0]
    pos, experts = rows.slot_pos[slots].long(), ids.flatten().to(device)[slots].long()
    xf, af, wf = x.float(), a2[0].float(), w.float()
    ref1 = torch.einsum("sh,snh->sn", xf[slots // k], wf[experts]) * rw.flatten()[slots, None] + bias[experts]
    ref2 = torch.einsum("sh,snh->sn", af[pos], wf[experts])
    tol = 1e-4 if device == "cpu" else 2e-2
    torch.testing.assert_close(out1[0, pos].float(), ref1, rtol=tol, atol=tol)
    torch.testing.assert_close(out2[0, pos].float(), ref2, rtol=tol, atol=tol)
    total = sum(counts)
    assert torch.isnan(out1[0, total:].float()).all() and torch.isnan(out2[0, total:].float()).all()


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("form", ["silu", "gpt_oss", "relu2_not_gated"])
def test_tail_rows_through_the_activation_epilogue(form, device, monkeypatch):
    """GEMM1 with the activation in its epilogue (gate/up rows paired in one tile, interleaved, not gated): the tail's
    rows take the same epilogue as the tile's, against the activation of torch's product."""
    bm, tail = TILE[device]
    monkeypatch.setattr(grouped_gemm, "TAIL_ROWS", tail)
    monkeypatch.setattr(grouped_gemm, "PAIR_GATE_UP", True)
    tails = _recorded_tails(monkeypatch)
    spec = ACTIVATION_FORMS[form]
    gen = torch.Generator().manual_seed(len(form))
    counts = _counts(bm, tail)
    e, k, h, i = len(counts), 2, (64 if device == "cpu" else 1024), (40 if device == "cpu" else 320)
    ids = _ids(counts, k, gen)
    t = ids.shape[0]
    rows = sort_by_expert(ids.to(device), e)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    n1 = spec.columns(i)
    x = torch.randn(t, h, generator=gen).to(device, dtype)
    w13 = (torch.randn(e, n1, h, generator=gen) / h**0.5).to(device, dtype)
    b13 = (torch.randn(e, n1, generator=gen) * 0.3).to(device)
    rw = (torch.rand(t, k, generator=gen) + 0.5).to(device)
    out = torch.full((1, t * k, i), float("nan"), dtype=dtype, device=device)
    cfg = TileConfig(bm, 64, 64, 1, 8 if device == "cuda" else 4, 3, 1)
    sorted_gemm(x, w13, rows, out, gather=True, route_weights=rw, bias=b13, activation=spec, config=cfg)
    assert tails == [tail]
    slots = (rows.slot_pos >= 0).nonzero()[:, 0]
    pos, experts = rows.slot_pos[slots].long(), ids.flatten().to(device)[slots].long()
    product = torch.einsum("sh,snh->sn", x.float()[slots // k], w13.float()[experts])
    want = spec.apply(product * rw.flatten()[slots, None] + b13[experts])
    tol = 1e-4 if device == "cpu" else 3e-2
    torch.testing.assert_close(out[0, pos].float(), want, rtol=tol, atol=tol)
    assert torch.isnan(out[0, sum(counts):].float()).all()


def test_which_launches_take_a_tail(monkeypatch):
    """Sorted bf16 launches of unswapped 64+ row tiles take :data:`grouped_gemm.TAIL_ROWS` (loop not flattened, stages
    fitted with the tail's rows); fp8 kernels, slot-order rows, swapped tiles, short tiles and gate/up halves in two
    accumulators do not; a tail that is not a power of two of at least 16 is refused."""
    rows = SortedRows(torch.zeros(9, dtype=torch.int32), torch.zeros(8, dtype=torch.int32),
                      torch.zeros(8, dtype=torch.int64), 2, 8, 4)
    prefill = TileConfig(128, 256, 64, 8, 8, 4, 1, tma=True, flatten=True)
    monkeypatch.setattr(grouped_gemm, "TAIL_ROWS", 0)
    assert _with_tail(prefill, "bf16", rows, None, 2) == prefill
    monkeypatch.setattr(grouped_gemm, "TAIL_ROWS", 32)
    got = _with_tail(prefill, "bf16", rows, None, 2)
    assert got == replace(prefill, tail_m=32, flatten=False) and got.smem_bytes(2) <= SMEM_BUDGET
    fp32 = _with_tail(prefill, "bf16", rows, None, 4)  # fp32 operands: the tail's rows cost stages
    assert fp32.tail_m == 32 and fp32.smem_bytes(4) <= SMEM_BUDGET and fp32.num_stages < prefill.num_stages
    halves = {"GATED": True, "INTERLEAVED": False, "PAIR_HALVES": False}
    for cfg, kind, layout, epilogue in ((prefill, "fp8", rows, None), (prefill, "w8a16", rows, None),
                                        (prefill, "bf16", None, None), (prefill, "bf16", rows, halves),
                                        (replace(prefill, swap_ab=True), "bf16", rows, None),
                                        (replace(prefill, block_m=32), "bf16", rows, None)):
        assert _with_tail(cfg, kind, layout, epilogue, 2).tail_m == 0, (cfg, kind, layout, epilogue)
    assert _with_tail(prefill, "bf16", rows, {**halves, "PAIR_HALVES": True}, 2).tail_m == 32
    assert _with_tail(replace(prefill, block_m=64), "bf16", rows, None, 2).tail_m == 32
    for bad in (24, 8):
        monkeypatch.setattr(grouped_gemm, "TAIL_ROWS", bad)
        with pytest.raises(ValueError, match="TAIL_ROWS"):
            _with_tail(prefill, "bf16", rows, None, 2)
