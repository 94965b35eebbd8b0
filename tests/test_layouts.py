"""DeepGEMM layouts (moe_fx.lowering.layouts) against straightforward torch implementations, on CPU."""

from __future__ import annotations

import pytest
import torch

from moe_fx.lowering import layouts as L
from moe_fx.ops import dequantize_blockwise


def _reference_mn_major_storage(sf: torch.Tensor) -> torch.Tensor:
    """DeepGEMM's rule written out element by element: flat fp32 buffer, (g, m, k) at g*A*sf_k + k*A + m."""
    g_, mn, sf_k = sf.shape
    a = -(-mn // 4) * 4  # 16-byte TMA alignment of fp32 rows
    flat = torch.full((g_ * sf_k * a,), float("nan"))
    for g in range(g_):
        for m in range(mn):
            for k in range(sf_k):
                flat[g * a * sf_k + k * a + m] = sf[g, m, k]
    return flat


@pytest.mark.parametrize("g, mn, k", [(1, 1, 128), (3, 5, 384), (2, 8, 1000), (4, 17, 256)])
def test_empty_mn_major_scales_matches_deepgemm_rule(g, mn, k):
    sf_k = -(-k // 128)
    a = L.tma_aligned_size(mn, 4)
    out = L.empty_mn_major_scales(g, mn, k)
    assert out.shape == (g, mn, sf_k) and out.dtype == torch.float32
    assert out.stride() == (a * sf_k, 1, a)
    assert L.is_mn_major_tma_aligned(out)
    # Writing through the view lands every value where DeepGEMM reads it.
    vals = torch.randn(g, mn, sf_k)
    out.copy_(vals)
    storage = torch.as_strided(out, (g * sf_k * a,), (1,))
    want = _reference_mn_major_storage(vals)
    written = ~torch.isnan(want)
    torch.testing.assert_close(storage[written], want[written], rtol=0, atol=0)


def test_tma_aligned_size():
    assert [L.tma_aligned_size(x, 4) for x in (1, 4, 5, 8, 9)] == [4, 4, 8, 8, 12]
    assert L.tma_aligned_size(7, 2) == 8 and L.tma_aligned_size(17, 1) == 32
    with pytest.raises(ValueError):
        L.tma_aligned_size(3, 3)


def test_to_mn_major_tma_aligned_copies_only_when_needed():
    sf = torch.randn(3, 10, 4)  # contiguous: K-major, not what DeepGEMM reads
    assert not L.is_mn_major_tma_aligned(sf)
    out = L.to_mn_major_tma_aligned(sf)
    assert L.is_mn_major_tma_aligned(out)
    torch.testing.assert_close(out, sf, rtol=0, atol=0)
    assert L.to_mn_major_tma_aligned(out) is out
    two_d = L.to_mn_major_tma_aligned(sf[0])
    assert two_d.stride() == (1, 12) and torch.equal(two_d, sf[0])


def test_per_token_group_quant_reference_roundtrip():
    x = torch.randn(2, 7, 320) * torch.logspace(-3, 3, 7).view(1, 7, 1)
    q, s = L.per_token_group_quant_fp8_reference(x)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (2, 7, 3)
    # Each group's largest magnitude maps to 448 exactly.
    for j in range(3):
        group = q.float()[..., j * 128 : (j + 1) * 128]
        torch.testing.assert_close(group.abs().amax(-1), torch.full((2, 7), 448.0))
    deq = q.float() * s.repeat_interleave(128, -1)[..., :320]
    torch.testing.assert_close(deq, x, rtol=0.07, atol=1e-6)


def test_prepare_deepgemm_weights_keeps_contract_layout_and_fixes_others():
    e, n, k = 2, 256, 384
    w = torch.randn(e, n, k).to(torch.float8_e4m3fn)
    s = torch.rand(e, 2, 3) + 0.5
    w_out, s_out = L.prepare_deepgemm_weights(w, s)
    assert w_out is w and s_out is s  # already what DeepGEMM reads: nothing copied
    # A transposed (N-major) weight and non-contiguous scales are made K-major / contiguous.
    w_t = torch.empty(e, k, n, dtype=torch.float8_e4m3fn).copy_(w.transpose(1, 2)).transpose(1, 2)
    s_t = s.transpose(1, 2).contiguous().transpose(1, 2)
    w_out, s_out = L.prepare_deepgemm_weights(w_t, s_t)
    assert w_out.is_contiguous() and s_out.is_contiguous()
    torch.testing.assert_close(dequantize_blockwise(w_out, s_out), dequantize_blockwise(w, s), rtol=0, atol=0)
    with pytest.raises(ValueError, match="needs float32 block scales"):
        L.prepare_deepgemm_weights(w, s[:, :1])
    with pytest.raises(TypeError, match="bfloat16 or float8"):
        L.prepare_deepgemm_weights(torch.randn(e, n, k))
    w13, w2 = torch.randn(2, 256, 128).bfloat16(), torch.randn(2, 128, 128).bfloat16()
    b13, b2, s13, s2 = L.prepare_expert_weights(w13, w2)
    assert s13 is None and s2 is None and b13.shape == (2, 256, 128)


def test_expected_m_follows_design():
    # ceil(T*K/E) rounded up to 16, clamped to [16, max_m]
    assert L.expected_m(4096, 8, 32, 4096) == 1024
    assert L.expected_m(1, 8, 256, 256) == 16
    assert L.expected_m(100, 2, 8, 256) == 32  # ceil(200/8) = 25 -> 32
    assert L.expected_m(100000, 2, 2, 512) == 512
    assert L.expected_m(0, 2, 8, 256) == 16


def test_masked_rows():
    assert [L.masked_rows(t) for t in (0, 1, 256, 257, 4096, 5000)] == [256, 256, 256, 512, 4096, 5120]
