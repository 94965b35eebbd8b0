"""GEMM1 with the expert activation in its epilogue (sorted layout, Triton interpreter, tiny shapes).

Each variant is checked against ``ExpertActivation.apply`` of the unfused product in fp32, outputs
poisoned with NaN so rows past the sorted total (never written) show; the whole op is then checked
against the torch reference with the epilogue on and off (the pipeline's ``FUSE_ACTIVATION``)."""

from __future__ import annotations

import pytest
import torch
from _triton_util import ACTIVATION_FORMS, rel_err

from moe_fx.lowering.experts import plan_experts, run_experts
from moe_fx.lowering.masked_experts import pipeline
from moe_fx.lowering.quant import quantize_fp8_blockwise
from moe_fx.lowering.triton.configs import TileConfig
from moe_fx.lowering.triton.grouped_gemm import sorted_gemm
from moe_fx.lowering.triton.sort import sort_by_expert
from moe_fx.ops import ExpertActivation, dequantize_blockwise
from moe_fx.ops.experts import bind_experts, reference_of

SPECS = ACTIVATION_FORMS
#: (tile, why): the CPU default, K steps that leave a tail (no EVEN_K), swapped tiles, device descriptors
TILES = {
    "default": None,
    "k_tail": TileConfig(16, 32, 64, 1, 4, 1, 1),
    "swap_ab": TileConfig(16, 64, 128, 1, 4, 1, 1, swap_ab=True),
    "tma": TileConfig(16, 64, 128, 1, 4, 1, 1, tma=True),
}


#: (form, PAIR_GATE_UP): gate/up halves both ways (one tile of gate and up rows, two accumulators); the switch
#: changes nothing else
FORM_PAIRS = [(f, True) for f in SPECS] + [(f, False) for f, s in SPECS.items()
                                           if s.gated and s.gate_up_layout == "halves"]


@pytest.mark.parametrize("tile", list(TILES))
@pytest.mark.parametrize("form,pair", FORM_PAIRS)
@pytest.mark.parametrize("weights", ["fp32", "fp8"])
def test_epilogue_is_the_activation_of_the_product(form, pair, tile, weights, monkeypatch):
    """fp32 weights (exact products under the interpreter), and fp8 weights with bf16 activations (W8A16:
    the weight tiles dequantised in the kernel), each against the activation of its own unfused product."""
    from moe_fx.lowering.triton import grouped_gemm

    monkeypatch.setattr(grouped_gemm, "PAIR_GATE_UP", pair)
    spec = SPECS[form]
    gen = torch.Generator().manual_seed(len(form) * 10 + len(tile))
    t, k, e, h, i = 7, 3, 4, 160, 40  # i: a column tile's tail (40 of 64); h = 160: a K tail for 64-wide steps
    ids = torch.randint(0, e, (t, k), generator=gen)
    ids[torch.rand(t, k, generator=gen) < 0.2] = -1
    rows = sort_by_expert(ids, e)
    n1 = spec.columns(i)
    x = torch.randn(t, h, generator=gen)
    w13 = torch.randn(e, n1, h, generator=gen) / h**0.5
    b13 = torch.randn(e, n1, generator=gen) * 0.3
    rw = torch.rand(t, k, generator=gen) + 0.5
    scale, tol = None, 1e-4
    if weights == "fp8":
        (w13, scale), x, tol = quantize_fp8_blockwise(w13), x.bfloat16(), 1e-2  # bf16 outputs
    cfg = TILES[tile]
    out = torch.full((1, t * k, i), float("nan"), dtype=x.dtype)
    sorted_gemm(x, w13, rows, out, b_scale=scale, gather=True, route_weights=rw, bias=b13, activation=spec, config=cfg)
    product = sorted_gemm(x.float(), w13.float() if scale is None else dequantize_blockwise(w13, scale), rows,
                          gather=True, route_weights=rw, bias=b13)  # unfused, fp32
    total = rows.total.item()
    want = spec.apply(product[0, :total])
    torch.testing.assert_close(out[0, :total].float(), want, rtol=tol, atol=tol)
    assert torch.isnan(out[0, total:].float()).all()  # rows past the total are never written


def test_epilogue_refuses_what_it_cannot_compute():
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 2, (3, 2), generator=gen)
    rows = sort_by_expert(ids, 2)
    x = torch.randn(3, 256, generator=gen).bfloat16()
    with pytest.raises(ValueError, match="even number"):
        sorted_gemm(x, torch.randn(2, 7, 256).bfloat16(), rows, gather=True, activation=ExpertActivation())
    wq, ws = quantize_fp8_blockwise(torch.randn(2, 256, 256))
    from moe_fx.lowering.triton.sort import quantize_rows

    xq, xs = quantize_rows(x)
    with pytest.raises(ValueError, match="not fp8"):
        sorted_gemm(xq, wq, rows, a_scale=xs, b_scale=ws, gather=True, activation=ExpertActivation())


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("form", ["silu", "gpt_oss", "relu2_not_gated"])
def test_op_on_the_sorted_layout_with_and_without_the_epilogue(form, fused, monkeypatch):
    monkeypatch.setattr(pipeline, "FUSE_ACTIVATION", fused)
    spec = SPECS[form]
    gen = torch.Generator().manual_seed(7)
    t, k, e, h, i = 6, 3, 4, 136, 72
    hidden = torch.randn(t, h, generator=gen).bfloat16()
    ids = torch.randint(0, e, (t, k), generator=gen)
    ids[0, 1] = -1
    w = torch.softmax(torch.randn(t, k, generator=gen), -1)
    w13 = (torch.randn(e, spec.columns(i), h, generator=gen) / h**0.5).bfloat16()
    w2 = (torch.randn(e, h, i, generator=gen) / i**0.5).bfloat16()
    b13 = (torch.randn(e, spec.columns(i), generator=gen) * 0.1).bfloat16()
    a = bind_experts(hidden, ids, w, w13, w2, spec.name, True, kernel_choice="triton", w13_bias=b13,
                     gated=spec.gated, gate_up_layout=spec.gate_up_layout, alpha=spec.alpha, limit=spec.limit,
                     up_offset=spec.up_offset)
    plan = plan_experts(a, layout="local_sorted")
    out = run_experts(a, plan)
    assert rel_err(out, reference_of(a)) < 4e-2, rel_err(out, reference_of(a))


def test_fuse_activation_is_the_measured_choice(monkeypatch):
    from moe_fx.lowering.masked_experts.pipeline import fuse_activation
    from moe_fx.lowering.problem import ROW_REGIMES, row_regime

    bf16, fp8 = False, True
    halves, interleaved = SPECS["silu"], SPECS["gpt_oss"]
    # shipped: the epilogue at every size, an unknown one included (it won at prefill too, 2026-12-06)
    assert pipeline.FUSE_HALVES_MAX_ROWS is None
    assert all(fuse_activation(s, bf16, r) for s in (halves, interleaved, SPECS["relu2_not_gated"])
               for r in (*range(len(ROW_REGIMES) + 1), None))
    # fp8 weights: never where GEMM2 needs its input quantised (the activation kernel's job: the shipped choice
    # at every size); where the activations stay bf16 (W8A16 at decode sizes, on request), as bf16 weights
    assert not any(fuse_activation(s, fp8, r) for s in SPECS.values() for r in (0, 1, 2, 3, 4, None))
    monkeypatch.setattr(pipeline, "W8A16_MAX_ROWS", 16)
    assert all(fuse_activation(s, fp8, r) for s in (interleaved, SPECS["relu2_not_gated"]) for r in (0, 1))
    assert not any(fuse_activation(s, fp8, r) for s in SPECS.values() for r in (2, 3, 4, None))
    # a bound (the old choice, what a bench A/B may set): halves fuse up to it, not above it nor at an unknown size;
    # interleaved and ungated forms fuse at every size whatever the bound
    monkeypatch.setattr(pipeline, "FUSE_HALVES_MAX_ROWS", 64)
    assert [fuse_activation(halves, bf16, r) for r in range(len(ROW_REGIMES) + 1)] == [True, True, True, False, False]
    assert fuse_activation(halves, bf16, row_regime(64)) and not fuse_activation(halves, bf16, row_regime(65))
    assert not fuse_activation(halves, bf16, None) and not fuse_activation(halves, fp8, 4)
    assert all(fuse_activation(s, bf16, r) for s in (interleaved, SPECS["relu2_not_gated"]) for r in (0, 4, None))
    monkeypatch.setattr(pipeline, "FUSE_ACTIVATION", False)
    assert not any(fuse_activation(s, bf16, 0) for s in (halves, interleaved))


def test_interleaved_epilogue_grid_covers_the_weight_rows(monkeypatch):
    """An interleaved epilogue's tiles walk b's 2I rows: the persistent grid is sized for them, not for the I
    output columns (a grid sized for half the tiles still computes every tile, with half the programs)."""
    from moe_fx.lowering.triton import grouped_gemm

    seen = []
    real = grouped_gemm.num_programs
    monkeypatch.setattr(grouped_gemm, "num_programs",
                        lambda dev, cfg, bound, per_sm=None: seen.append(bound) or real(dev, cfg, bound, per_sm))
    gen = torch.Generator().manual_seed(2)
    ids = torch.arange(4).reshape(4, 1) % 2
    rows = sort_by_expert(ids, 2)
    x = torch.randn(4, 64, generator=gen)
    cfg = TileConfig(16, 32, 64, 1, 4, 1, 16)  # many programs per SM: the bound decides the grid
    for spec, tiles_n in ((SPECS["gpt_oss"], 4), (SPECS["silu"], 4)):  # 2I = 128 rows, 32-row tiles
        sorted_gemm(x, torch.randn(2, 128, 64, generator=gen), rows, gather=True, activation=spec, config=cfg)
        assert seen[-1] == 2 * tiles_n, (spec, seen)  # 2 experts x 1 row tile x tiles_n
