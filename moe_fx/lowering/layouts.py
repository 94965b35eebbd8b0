"""Memory layouts DeepGEMM's masked grouped GEMMs need, and the sizes that go with them.

DeepGEMM (v2.x, SM90 "1D2D" fp8 recipe) reads:

* activations ``a`` fp8 ``[G, M, K]`` K-major (row-major per group, ``stride(0) == M * K``) with fp32
  per-token-group scales ``sfa [G, M, ceil(K/128)]`` that are **MN-major and TMA-aligned**:
  ``sfa.stride() == (A * ceil(K/128), 1, A)`` where ``A = tma_aligned_size(M, 4)`` (M rounded up to a
  multiple of 16 bytes / 4 bytes = 4). Given any other layout DeepGEMM copies the scales into this one
  on every call; writing them there in the first place saves that copy.
* weights ``b`` fp8 (or bf16) ``[G, N, K]`` K-major and contiguous, with fp32 128x128 block scales
  ``sfb [G, ceil(N/128), ceil(K/128)]``, contiguous. This is exactly the layout of the
  ``moe_fx::experts`` contract (``w13 [E, 2I, H]``, ``w2 [E, H, I]`` and their scales) and of
  transformers' fine-grained FP8 checkpoints; other weight layouts (transposed views) are left to the
  Triton GEMMs, which read any strides (DeepGEMM's capability check says so).
* outputs ``d`` bf16 ``[G, M, N]`` row-major.

Everything here is plain torch and runs on CPU (and while traced, with symbolic sizes);
:mod:`moe_fx.lowering.masked_experts.deepgemm` uses it.
"""

from __future__ import annotations

import torch

from moe_fx.ops.recipe import FP8_BLOCK, cdiv

__all__ = [
    "empty_mn_major_scales",
    "is_mn_major_tma_aligned",
    "tma_aligned_size",
    "to_mn_major_tma_aligned",
]

#: TMA needs 16-byte aligned global strides.
TMA_ALIGN_BYTES = 16


def tma_aligned_size(x: int, element_size: int) -> int:
    """``x`` rounded up so that ``x * element_size`` is a multiple of 16 bytes (DeepGEMM's rule)."""
    if TMA_ALIGN_BYTES % element_size:
        raise ValueError(f"element size {element_size} does not divide {TMA_ALIGN_BYTES}")
    step = TMA_ALIGN_BYTES // element_size
    return cdiv(x, step) * step


def empty_mn_major_scales(
    num_groups: int,
    mn: int,
    k: int,
    *,
    block: int = FP8_BLOCK,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Allocate per-token-group scales ``[G, mn, ceil(k/block)]`` in DeepGEMM's MN-major TMA-aligned layout.

    The result is a view with strides ``(A * sf_k, 1, A)``, ``A = tma_aligned_size(mn, 4)``: scales of
    one K-group of consecutive rows are adjacent in memory. A kernel that writes element
    ``(g, m, kb)`` through these strides produces what DeepGEMM reads, with no transposing copy.
    """
    sf_k = cdiv(k, block)
    aligned = tma_aligned_size(mn, dtype.itemsize)
    storage = torch.empty(num_groups, sf_k, aligned, device=device, dtype=dtype)
    # narrow, not a slice: a graph traced on a CPU-only build cannot slice a fake CUDA tensor
    return storage.transpose(1, 2).narrow(1, 0, mn)


def is_mn_major_tma_aligned(sf: torch.Tensor) -> bool:
    """Whether ``sf [G, mn, sf_k]`` (or ``[mn, sf_k]``) is in the layout DeepGEMM takes without a copy."""
    if sf.dim() not in (2, 3):
        return False
    batched = sf if sf.dim() == 3 else sf.unsqueeze(0)
    _, mn, sf_k = batched.shape
    aligned = tma_aligned_size(mn, sf.element_size())
    group_ok = sf.dim() == 2 or batched.shape[0] == 1 or batched.stride(0) == aligned * sf_k
    return group_ok and (batched.stride(1) == 1 or mn == 1) and (batched.stride(2) == aligned or sf_k == 1)


def to_mn_major_tma_aligned(sf: torch.Tensor) -> torch.Tensor:
    """Return ``sf [G, mn, sf_k]`` in the MN-major TMA-aligned layout (no copy if it already is)."""
    if is_mn_major_tma_aligned(sf):
        return sf
    if sf.dim() not in (2, 3):
        raise ValueError(f"scales must be [mn, sf_k] or [G, mn, sf_k], got {list(sf.shape)}")
    batched = sf if sf.dim() == 3 else sf.unsqueeze(0)
    g, mn, sf_k = batched.shape
    out = empty_mn_major_scales(g, mn, sf_k, block=1, device=sf.device, dtype=sf.dtype)
    out.copy_(batched)
    return out if sf.dim() == 3 else out[0]
