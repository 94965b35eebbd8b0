"""DeepGEMM layouts (moe_fx.lowering.layouts, masked_experts.deepgemm) against straightforward torch, on CPU."""

from __future__ import annotations

import pytest
import torch

from moe_fx.lowering import layouts as L


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


def test_deepgemm_rows_and_expected_m_follow_design():
    from moe_fx.lowering.masked_experts.deepgemm import GEMMS, deepgemm_expected_m
    from moe_fx.lowering.problem import rows_per_expert

    assert [GEMMS.rows(t) for t in (1, 256, 257, 4096, 5000)] == [256, 256, 512, 4096, 5120]
    assert deepgemm_expected_m(rows_per_expert(4096, 8, 32), 4096) == 1024
    assert deepgemm_expected_m(rows_per_expert(1, 8, 256), 256) == 16
    assert deepgemm_expected_m(rows_per_expert(100, 2, 8), 256) == 32  # ceil(200/8) = 25 -> 32
    assert deepgemm_expected_m(rows_per_expert(100000, 2, 2), 512) == 512
