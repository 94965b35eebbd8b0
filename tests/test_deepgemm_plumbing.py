"""The DeepGEMM pipeline's plumbing on CPU: a torch stand-in for ``deep_gemm`` checks what DeepGEMM would check.

The stand-in computes the masked GEMMs in fp32 from the fp8 codes and scales it is handed, and
asserts the layouts DeepGEMM needs (K-major operands, MN-major TMA-aligned activation scales,
contiguous 128x128 weight scales, bf16 row-major output, max_m a multiple of 256, expected_m per
DESIGN.md). Permute, activation and unpermute are the real Triton kernels under the interpreter, and
the GEMMs go through the extern op ``moe_fx_kernels::deepgemm_masked_gemm``. So this checks
everything of the DeepGEMM path except DeepGEMM itself, which the GPU tests cover.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

from moe_fx.lowering import layouts as L
from moe_fx.lowering.masked_experts.deepgemm import MASKED_M_ALIGN
from moe_fx.lowering.quant import quantize_fp8_per_token_group
from moe_fx.ops import dequantize_blockwise, experts_reference

pytest.importorskip("triton")


class FakeDeepGemm(types.ModuleType):
    def __init__(self):
        super().__init__("deep_gemm")
        self.calls: list[tuple] = []

    @staticmethod
    def _check_common(a, b, d, masked_m):
        g, m, k = a.shape
        assert a.stride(-1) == 1 and a.stride(0) == m * k, "a must be K-major with groups packed"
        assert b.is_contiguous() and b.shape[0] == g and b.shape[2] == k, "b must be K-major [G, N, K]"
        assert d.dtype == torch.bfloat16 and d.is_contiguous() and d.shape == (g, m, b.shape[1])
        assert masked_m.dtype == torch.int32 and masked_m.is_contiguous() and masked_m.shape == (g,)
        assert m % MASKED_M_ALIGN == 0, "whole-tile stores need max_m % 256 == 0"

    def m_grouped_fp8_gemm_nt_masked(self, a, b, d, masked_m, expected_m, **kw):
        (x, sx), (w, sw) = a, b
        self._check_common(x, w, d, masked_m)
        assert x.dtype == w.dtype == torch.float8_e4m3fn
        assert L.is_mn_major_tma_aligned(sx), f"sfa strides {sx.stride()} are not MN-major TMA-aligned"
        assert sw.is_contiguous() and sw.dtype == torch.float32
        self.calls.append(("fp8", x.shape, w.shape, expected_m))
        for g in range(x.shape[0]):
            m = int(masked_m[g])
            xa = x[g, :m].float() * sx[g, :m].repeat_interleave(128, -1)[:, : x.shape[2]]
            d[g, :m] = (xa @ dequantize_blockwise(w[g], sw[g]).t()).bfloat16()

    def m_grouped_bf16_gemm_nt_masked(self, a, b, d, masked_m, expected_m, **kw):
        self._check_common(a, b, d, masked_m)
        assert a.dtype == b.dtype == torch.bfloat16
        self.calls.append(("bf16", a.shape, b.shape, expected_m))
        for g in range(a.shape[0]):
            m = int(masked_m[g])
            d[g, :m] = (a[g, :m].float() @ b[g].float().t()).bfloat16()


def deepgemm_experts(hidden, ids, w, w13, w2, activation="silu", weights_on_input=False, w13_scale=None,
                     w2_scale=None):
    """moe_fx::experts on the DeepGEMM pipeline, forced (selection would refuse CPU tensors)."""
    from torch._library.triton import set_wrap_triton_enabled

    from moe_fx.lowering.experts import ExpertsPlan, run_experts
    from moe_fx.lowering.masked_experts import deepgemm
    from moe_fx.lowering.select import Choice
    from moe_fx.ops.experts import bind_experts

    plan = ExpertsPlan(Choice("experts", "deepgemm", deepgemm), None, None)
    a = bind_experts(hidden, ids, w, w13, w2, activation, weights_on_input, w13_scale, w2_scale)
    with set_wrap_triton_enabled(False):
        return run_experts(a, plan)


@pytest.fixture
def fake_dg(monkeypatch):
    fake = FakeDeepGemm()
    monkeypatch.setitem(sys.modules, "deep_gemm", fake)
    return fake


def _problem(t=6, h=128, i=128, e=4, k=2, fp8=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(t, h, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).int()
    ids[0, 1] = -1  # a skipped slot
    w = torch.rand(t, k, generator=g)
    w13 = torch.randn(e, 2 * i, h, generator=g) / h**0.5
    w2 = torch.randn(e, h, i, generator=g) / i**0.5
    if fp8:
        from moe_fx.lowering.quant import quantize_fp8_blockwise

        (w13, s13), (w2, s2) = quantize_fp8_blockwise(w13), quantize_fp8_blockwise(w2)
        return hidden, ids, w, w13, w2, s13, s2
    return hidden, ids, w, w13.bfloat16(), w2.bfloat16(), None, None


def _emulate_fp8_recipe(hidden, ids, w, w13, w2, s13, s2, weights_on_input):
    """The DeepSeek-V3 fp8 recipe in torch: 1x128 activation quantisation before each GEMM, bf16 GEMM outputs."""
    out = torch.zeros(hidden.shape, dtype=torch.float32)
    q, s = quantize_fp8_per_token_group(hidden)
    for e in range(w13.shape[0]):
        tok, slot = torch.nonzero(ids.long() == e, as_tuple=True)
        if tok.numel() == 0:
            continue
        r = w[tok, slot].float().unsqueeze(-1)
        scale = s[tok] * r if weights_on_input else s[tok]
        x = q[tok].float() * scale.repeat_interleave(128, -1)
        gate_up = (x @ dequantize_blockwise(w13[e], s13[e]).t()).bfloat16().float()
        inter = gate_up.shape[1] // 2
        a = torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        qa, sa = quantize_fp8_per_token_group(a)
        a = qa.float() * sa.repeat_interleave(128, -1)
        y = (a @ dequantize_blockwise(w2[e], s2[e]).t()).bfloat16().float()
        out.index_add_(0, tok, y if weights_on_input else y * r)
    return out.bfloat16().float()


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("weights_on_input", [False, True])
def test_deepgemm_experts_plumbing_matches_reference(fake_dg, fp8, weights_on_input):
    hidden, ids, w, w13, w2, s13, s2 = _problem(fp8=fp8)
    out = deepgemm_experts(hidden, ids, w, w13, w2, "silu", weights_on_input, s13, s2)
    want = experts_reference(hidden, ids, w, w13, w2, "silu", weights_on_input, s13, s2)
    assert out.dtype == torch.bfloat16 and out.shape == hidden.shape and not out.isnan().any()
    if fp8:
        # fp8 activations cost a few percent against the fp32 reference (the torch emulation of the
        # recipe is ~4% off). Triton 3.9's *interpreter* rounds fp32 -> e4m3 wrongly when rounding
        # carries into the next binade (125.0 -> 64, -7.9 -> -4), which doubles the error of the
        # quantising kernels on CPU only; hence 15% here (GPU tests are tight). A wrong scale layout
        # or row mix-up gives errors near 100%.
        emulated = _emulate_fp8_recipe(hidden, ids, w, w13, w2, s13, s2, weights_on_input)
        assert (emulated - want.float()).norm() / want.float().norm() < 0.06
        rel = (out.float() - emulated).norm() / emulated.norm()
        assert rel < 0.15, rel
    else:
        torch.testing.assert_close(out.float(), want.float(), rtol=2e-2, atol=2e-2)
    # Two GEMMs, max_m = 256 rows, expected_m = ceil(6 * 2 / 4) = 3 -> 16.
    assert [c[0] for c in fake_dg.calls] == ["fp8" if fp8 else "bf16"] * 2
    assert fake_dg.calls[0][1][:2] == (4, 256) and {c[3] for c in fake_dg.calls} == {16}


def test_expected_m_slack_reaches_deepgemm_and_changes_no_value(fake_dg, monkeypatch):
    """``EXPECTED_M_SLACK`` (bench/fused_activation.py --switch dg_hint) is added to the hint DeepGEMM is handed, rounded
    to 16 and clamped to max_m; the GEMMs' values do not depend on it."""
    from moe_fx.lowering.masked_experts import deepgemm

    hidden, ids, w, w13, w2, s13, s2 = _problem(fp8=True)
    base = deepgemm_experts(hidden, ids, w, w13, w2, "silu", False, s13, s2)
    for slack, want in ((40, 48), (10_000, 256)):  # 3 + 40 -> 48; clamped to the 256 rows of max_m
        fake_dg.calls.clear()
        monkeypatch.setattr(deepgemm, "EXPECTED_M_SLACK", slack)
        out = deepgemm_experts(hidden, ids, w, w13, w2, "silu", False, s13, s2)
        assert {c[3] for c in fake_dg.calls} == {want} and len(fake_dg.calls) == 2
        assert torch.equal(out, base)


def test_missing_deep_gemm_warns_and_computes_with_triton(monkeypatch, caplog):
    """deep_gemm gone at run time (a graph compiled where it was): one warning naming the install
    doc, and the GEMMs still computed (by Triton, on the same operands)."""
    import logging

    from moe_fx.lowering import problem
    from moe_fx.lowering.masked_experts import deepgemm

    monkeypatch.setitem(sys.modules, "deep_gemm", None)
    monkeypatch.setattr(deepgemm, "_warned", False)
    monkeypatch.setattr(problem, "_runtime_unusable", {})
    caplog.set_level(logging.WARNING, logger="moe_fx.lowering")
    hidden, ids, w, w13, w2, _, _ = _problem()
    out = deepgemm_experts(hidden, ids, w, w13, w2)
    torch.testing.assert_close(out.float(), experts_reference(hidden, ids, w, w13, w2).float(), rtol=2e-2, atol=2e-2)
    assert [r.getMessage() for r in caplog.records if "docs/deepgemm.md" in r.getMessage()]
