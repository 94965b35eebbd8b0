"""The aligned contiguous layout (``local_contiguous``: DeepGEMM's m-grouped contiguous GEMMs) on CPU.

A torch stand-in for ``deep_gemm`` asserts what DeepGEMM's contiguous GEMMs need (K-major ``a [M, K]``,
``b [G, N, K]``, bf16 row-major ``d [M, N]``, int32 ``m_indices [M]``, M a multiple of 128, every 128-row
block of one expert whose first row is a real one, -1 only on padding, MN-major TMA-aligned fp8 scales),
computes the rows of each expert in fp32, and writes NaN into every padding row: whatever reads one shows.
The sort, the copy into the layout, the activation and the combine are the real Triton kernels under the
interpreter. The selection: under ``auto`` in the top rows-per-expert regime (DeepGEMM, E >= 2K), on request,
never with biases.
"""

from __future__ import annotations

import dataclasses
import sys
import types

import pytest
import torch
from _triton_util import gpu
from test_deepgemm_plumbing import _emulate_fp8_recipe, _problem

from moe_fx.lowering import layouts as L
from moe_fx.lowering.masked_experts.deepgemm import CONTIGUOUS_M_ALIGN
from moe_fx.ops import dequantize_blockwise, experts_reference

pytest.importorskip("triton")


class FakeContiguousDeepGemm(types.ModuleType):
    def __init__(self):
        super().__init__("deep_gemm")
        self.calls: list[tuple] = []

    @staticmethod
    def _check(a, b, d, m_indices):
        m, k = a.shape
        assert a.stride(-1) == 1 and a.stride(0) == k, "a must be K-major [M, K]"
        assert b.is_contiguous() and b.shape[2] == k, "b must be K-major [G, N, K]"
        assert d.dtype == torch.bfloat16 and d.is_contiguous() and d.shape == (m, b.shape[1])
        assert m_indices.dtype == torch.int32 and m_indices.is_contiguous() and m_indices.shape == (m,)
        assert m % CONTIGUOUS_M_ALIGN == 0, "whole 128-row blocks"
        for block in m_indices.view(-1, CONTIGUOUS_M_ALIGN):
            real = block[block >= 0]
            assert real.numel() == 0 or (block[0] >= 0 and (real == block[0]).all()), \
                "a block must start with a row of its one expert (DeepGEMM reads the group of its first row)"
            assert ((block >= 0).int().diff() <= 0).all(), "padding rows must follow the expert's rows"
            assert real.numel() == 0 or int(real.max()) < b.shape[0]

    def _rows(self, a, b, d, m_indices):
        d.fill_(float("nan"))  # padding rows: never read downstream
        for e in torch.unique(m_indices[m_indices >= 0]).tolist():
            rows = m_indices == e
            d[rows] = (a[rows] @ b[e].t()).bfloat16()

    def m_grouped_bf16_gemm_nt_contiguous(self, a, b, d, m_indices, **kw):
        self._check(a, b, d, m_indices)
        assert a.dtype == b.dtype == torch.bfloat16
        self.calls.append(("bf16", tuple(a.shape), tuple(b.shape)))
        self._rows(a.float(), b.float(), d, m_indices)

    def m_grouped_fp8_gemm_nt_contiguous(self, a, b, d, m_indices, **kw):
        (x, sx), (w, sw) = a, b
        self._check(x, w, d, m_indices)
        assert x.dtype == w.dtype == torch.float8_e4m3fn
        assert L.is_mn_major_tma_aligned(sx), f"sfa strides {sx.stride()} are not MN-major TMA-aligned"
        assert sw.is_contiguous() and sw.dtype == torch.float32
        self.calls.append(("fp8", tuple(x.shape), tuple(w.shape)))
        xa = x.float() * sx.repeat_interleave(128, -1)[:, : x.shape[1]]
        wd = torch.stack([dequantize_blockwise(w[e], sw[e]) for e in range(w.shape[0])])
        self._rows(xa, wd, d, m_indices)


@pytest.fixture
def fake_dg(monkeypatch):
    fake = FakeContiguousDeepGemm()
    monkeypatch.setitem(sys.modules, "deep_gemm", fake)
    return fake


def contiguous_experts(hidden, ids, w, w13, w2, activation="silu", weights_on_input=False, w13_scale=None,
                       w2_scale=None, identity_experts=0):
    """moe_fx::experts on DeepGEMM's contiguous layout, forced (selection would refuse CPU tensors)."""
    from torch._library.triton import set_wrap_triton_enabled

    from moe_fx.lowering.experts import ExpertsPlan, run_experts
    from moe_fx.lowering.masked_experts import deepgemm
    from moe_fx.lowering.prepare_finalize import local_contiguous
    from moe_fx.lowering.select import Choice
    from moe_fx.ops.experts import bind_experts

    plan = ExpertsPlan(Choice("experts", "deepgemm", deepgemm),
                       Choice("prepare_finalize", "local_contiguous", local_contiguous), None)
    assert plan.layout == "contiguous"
    a = bind_experts(hidden, ids, w, w13, w2, activation, weights_on_input, w13_scale, w2_scale,
                     identity_experts=identity_experts)
    with set_wrap_triton_enabled(False):
        return run_experts(a, plan)


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("weights_on_input", [False, True])
def test_contiguous_layout_matches_the_reference(fake_dg, fp8, weights_on_input):
    hidden, ids, w, w13, w2, s13, s2 = _problem(t=70, fp8=fp8)  # 140 slots on 4 experts: a 2-block expert
    out = contiguous_experts(hidden, ids, w, w13, w2, "silu", weights_on_input, s13, s2)
    want = experts_reference(hidden, ids, w, w13, w2, "silu", weights_on_input, s13, s2)
    assert out.dtype == torch.bfloat16 and out.shape == hidden.shape and not out.isnan().any()
    if fp8:  # the masked plumbing test's tolerance and reasons (the interpreter's e4m3 rounding)
        emulated = _emulate_fp8_recipe(hidden, ids, w, w13, w2, s13, s2, weights_on_input)
        assert (out.float() - emulated).norm() / emulated.norm() < 0.15
    else:
        torch.testing.assert_close(out.float(), want.float(), rtol=2e-2, atol=2e-2)
    # two GEMMs on the bound: cdiv(140 + 4 * 127, 128) * 128 = 768 rows
    assert [c[0] for c in fake_dg.calls] == ["fp8" if fp8 else "bf16"] * 2
    assert {c[1][0] for c in fake_dg.calls} == {768}


def test_identity_experts_duplicates_and_empty_experts(fake_dg):
    hidden, ids, w, w13, w2, _, _ = _problem(t=5, e=4, k=3)
    ids = ids.clone()
    ids[1] = torch.tensor([2, 2, 4])  # one expert twice (each slot counts) and an identity expert
    ids[2] = torch.tensor([4, -1, 2])
    ids[:, :][ids == 3] = 0  # expert 3 gets no token: an empty segment
    out = contiguous_experts(hidden, ids, w, w13, w2, identity_experts=1)
    want = experts_reference(hidden, ids, w, w13, w2, identity_experts=1)
    torch.testing.assert_close(out.float(), want.float(), rtol=2e-2, atol=2e-2)
    got0 = contiguous_experts(hidden[:0], ids[:0], w[:0], w13, w2)
    assert got0.shape == (0, hidden.shape[1])


def test_rows_and_indices_of_the_layout():
    from moe_fx.lowering.triton.sort import contiguous_rows, sort_by_expert

    ids = torch.tensor([[0, 2], [2, -1], [0, 2]], dtype=torch.int32)
    x = torch.arange(3 * 8, dtype=torch.float32).view(3, 8)
    rows = sort_by_expert(ids, 3)
    lay = contiguous_rows(rows, x, None, ids, align=4, route_weights=None)
    # expert 0: 2 rows -> block [0, 4); expert 1: none; expert 2: 3 rows -> block [4, 8); bound cdiv(6 + 9, 4) * 4
    assert lay.num_rows == 16 and lay.m_indices.tolist() == [0, 0, -1, -1, 2, 2, 2] + [-1] * 9
    pos = lay.slot_pos.tolist()
    assert pos[3] == -1 and sorted(p for p in pos if p >= 0) == [0, 1, 4, 5, 6]
    for slot, p in enumerate(pos):
        if p >= 0:
            assert torch.equal(lay.x[p], x[slot // 2])
    scaled = contiguous_rows(rows, x, None, ids, align=4, route_weights=torch.full((3, 2), 0.5))
    assert torch.equal(scaled.x[pos[0]], x[0] * 0.5)
    with pytest.raises(ValueError, match="power of two"):
        contiguous_rows(rows, x, None, ids, align=6)


_COPY_CASES = [  # (device, T, E, K, H): one step of 512 columns (masked) and two of 1024 (the second partial) under
    # the interpreter; DeepSeek-V3's and Qwen3's widths with their top-8 on a GPU
    pytest.param("cpu", 7, 5, 3, 384, id="cpu-h384"),
    pytest.param("cpu", 7, 5, 3, 1280, id="cpu-h1280"),
    pytest.param("cpu", 7, 5, 1, 256, id="cpu-top1"),
    pytest.param("cuda", 300, 32, 8, 7168, id="cuda-dsv3", marks=[pytest.mark.gpu, gpu]),
    pytest.param("cuda", 300, 128, 8, 2048, id="cuda-qwen3", marks=[pytest.mark.gpu, gpu]),
]


@pytest.mark.parametrize(("device", "t", "e", "k", "h"), _COPY_CASES)
@pytest.mark.parametrize("route", [False, True])
def test_quantising_copy_matches_quantize_rows_then_copy(device, t, e, k, h, route):
    """``contiguous_rows(quantize=True)`` writes the codes and scales that quantize_rows and the copy of its codes
    write, in every valid slot's row: top-3 on CPU (a padded slot lane) and top-1, a slot that sends no row, an expert
    with none, duplicate ids, tokens of magnitudes 1e-2 to 1e2."""
    from moe_fx.lowering.triton.sort import contiguous_rows, quantize_rows, sort_by_expert

    torch.manual_seed(0)
    ids = torch.stack([torch.randperm(e)[:k] for _ in range(t)]).to(torch.int32)
    ids[ids == 3] = 0  # expert 3 gets no row; duplicate ids in a token count once each
    ids[2, k - 1] = -1  # a slot without an expert
    x = torch.randn(t, h, dtype=torch.bfloat16) * torch.logspace(-2, 2, t).unsqueeze(1).to(torch.bfloat16)
    rw = torch.rand(t, k) + 0.5 if route else None
    ids, x = ids.to(device), x.to(device)
    rw = rw.to(device) if rw is not None else None
    rows = sort_by_expert(ids, e)
    codes, scales = quantize_rows(x)
    want = contiguous_rows(rows, codes, scales, ids, align=8, route_weights=rw)
    got = contiguous_rows(rows, x, None, ids, align=8, route_weights=rw, quantize=True)
    assert got.x.dtype == torch.float8_e4m3fn and got.x.shape == want.x.shape
    assert torch.equal(got.slot_pos, want.slot_pos) and torch.equal(got.m_indices, want.m_indices)
    valid = got.slot_pos[got.slot_pos >= 0]
    assert len(valid) == t * k - 1 and not got.x_scale[valid].isnan().any()
    assert torch.equal(got.x[valid].view(torch.uint8), want.x[valid].view(torch.uint8))
    torch.testing.assert_close(got.x_scale[valid], want.x_scale[valid], rtol=0, atol=0)
    # the scales through the row-major scratch and a copy: the same values, in DeepGEMM's MN-major layout
    for scratch in (contiguous_rows(rows, x, None, ids, align=8, route_weights=rw, quantize=True, scale_scratch=True),
                    contiguous_rows(rows, codes, scales, ids, align=8, route_weights=rw, scale_scratch=True)):
        assert scratch.x_scale.stride() == got.x_scale.stride() and scratch.x_scale.stride(0) == 1
        assert torch.equal(scratch.slot_pos, got.slot_pos)
        assert torch.equal(scratch.x[valid].view(torch.uint8), got.x[valid].view(torch.uint8))
        torch.testing.assert_close(scratch.x_scale[valid], got.x_scale[valid], rtol=0, atol=0)
    # the scale of a slot's row is its token's (times its routing weight)
    slot = int((got.slot_pos >= 0).nonzero()[4])
    expect = scales[slot // k] * (rw[slot // k, slot % k] if route else 1.0)
    torch.testing.assert_close(got.x_scale[got.slot_pos[slot]], expect, rtol=1e-6, atol=0)


def test_copy_writes_only_the_slots_rows():
    """Every row the layout's copy writes is a valid slot's: rows of padding keep what was there (the kernel
    stores through masks, one program per token)."""
    from unittest import mock

    from moe_fx.lowering.triton import sort
    from moe_fx.lowering.triton.sort import contiguous_rows, sort_by_expert

    ids = torch.tensor([[0, 2], [2, -1], [0, 2]], dtype=torch.int32)
    x = torch.randn(3, 8)
    real_empty = torch.empty
    with mock.patch.object(sort.torch, "empty", lambda *a, **kw: real_empty(*a, **kw).fill_(float("nan"))
                           if kw.get("dtype", torch.float32).is_floating_point else real_empty(*a, **kw)):
        lay = contiguous_rows(sort_by_expert(ids, 3), x, None, ids, align=4)
    written = ~lay.x.isnan().all(1)
    assert written.nonzero().flatten().tolist() == sorted(p for p in lay.slot_pos.tolist() if p >= 0)


def test_selection_takes_it_in_the_top_regime_or_on_request_and_never_with_biases():
    from moe_fx.lowering.experts import decide_experts_plan
    from moe_fx.lowering.problem import ROW_REGIMES, Capabilities, ExpertsProblem
    from moe_fx.ops import ExpertActivation

    h200_dg = Capabilities("cuda", (9, 0), None, None, "deep_ep is not installed", 132, "NVIDIA H200")
    problem = ExpertsProblem("cuda", "bfloat16", 8, 1024, 512, ExpertActivation(), None, False, False, True, 2, None)
    auto = decide_experts_plan(problem, 2, "deepgemm", caps=h200_dg)  # 17..64 rows per expert: masked (faster)
    assert auto.layout == "masked" and "measured faster" in auto.prepare.reasons["local_contiguous"]
    top = dataclasses.replace(problem, regime=len(ROW_REGIMES))  # > 256 rows per expert: no [E, T, H] buffers
    assert decide_experts_plan(top, 2, "deepgemm", caps=h200_dg).layout == "contiguous"
    assert decide_experts_plan(dataclasses.replace(top, fp8_block=(128, 128)), 2, "deepgemm", caps=h200_dg).layout == "contiguous"
    few = dataclasses.replace(top, num_experts=3)  # E < 2K: the masked buffers are no larger
    assert decide_experts_plan(few, 2, "deepgemm", caps=h200_dg).layout == "masked"
    assert decide_experts_plan(top, 2, "triton", caps=h200_dg).layout == "sorted"
    biased_top = dataclasses.replace(top, w13_bias=True)
    assert decide_experts_plan(biased_top, 2, "deepgemm", caps=h200_dg).layout == "masked"
    asked = decide_experts_plan(problem, 2, "deepgemm", layout="local_contiguous", caps=h200_dg)
    assert asked.layout == "contiguous" and asked.error is None
    assert asked.summary() == "deepgemm, contiguous layout"
    biased = ExpertsProblem("cuda", "bfloat16", 8, 1024, 512, ExpertActivation(), None, True, False, True, 2, None)
    refused = decide_experts_plan(biased, 2, "deepgemm", layout="local_contiguous", caps=h200_dg)
    assert refused.error is not None and "no aligned contiguous layout" in refused.error
    # Triton's GEMMs read no such layout
    triton_plan = decide_experts_plan(problem, 2, "triton", layout="local_contiguous", caps=h200_dg)
    assert triton_plan.error is not None


@pytest.mark.parametrize("fp8", [False, True])
def test_traced_graph_is_sort_copy_extern_gemms_and_combine(sm90, monkeypatch, fp8):
    """Where a graph would run it (``prefer`` lifted, as a measured choice would): the graph Inductor gets on an
    assumed H200 with DeepGEMM is Triton launches around two ``deepgemm_contiguous_gemm`` extern calls."""
    from test_lowered_graph import H200_DG, _experts, _experts_fp8, _inputs, _kernel_name, _launches, _trace
    from torch._subclasses.fake_tensor import FakeTensorMode

    from moe_fx.lowering.masked_experts import deepgemm
    from moe_fx.lowering.prepare_finalize import local_contiguous

    monkeypatch.setattr(local_contiguous, "prefer", lambda problem, caps: None)
    # DeepGEMM at this graph's 16 rows per expert
    monkeypatch.setattr(deepgemm, "LOCAL_FROM_REGIME", {False: 1, True: 1})
    gm = _trace(_experts_fp8 if fp8 else _experts, _inputs(FakeTensorMode(), t=64, fp8=fp8), caps=H200_DG)
    assert gm.code.count("moe_fx_kernels.deepgemm_contiguous_gemm") == 2 and "moe_fx.experts" not in gm.code
    names = [_kernel_name(n) for n in _launches(gm)]
    # fp8: the tokens are quantised in the copy's launch (no quantize_rows_kernel), their scales written row by row
    # and moved into DeepGEMM's MN-major layout by a second launch (sort.SCALE_SCRATCH)
    assert names == ["expert_counts_kernel", "sort_slots_kernel", "contiguous_rows_kernel",
                     *(["copy_scales_kernel"] if fp8 else []), "activation_kernel", "unpermute_kernel"]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, gpu])])
@pytest.mark.parametrize(("r", "g"), [(300, 70), (75, 3), (9, 1)])
def test_copy_scales_moves_every_scale_into_the_mn_major_layout(device, r, g):
    """Several row and group blocks (70 groups: two of 64), a partial row block, one group; the destination's
    storage poisoned with NaN so an unwritten scale shows, and its TMA padding rows left as they were."""
    from moe_fx.lowering.layouts import empty_mn_major_scales, is_mn_major_tma_aligned
    from moe_fx.lowering.triton.sort import copy_scales

    torch.manual_seed(0)
    src = torch.rand(r, g, device=device) + 0.1
    dst = empty_mn_major_scales(1, r, g, block=1, device=device).squeeze(0)
    storage = torch.as_strided(dst, (g, dst.stride(1)), (dst.stride(1), 1))
    storage.fill_(float("nan"))
    copy_scales(src, dst)
    assert is_mn_major_tma_aligned(dst) and torch.equal(dst, src)
    assert storage[:, r:].isnan().all()  # the padding past R is not written
    with pytest.raises(ValueError, match=r"\[R, G\]"):
        copy_scales(src, dst[:-1])
