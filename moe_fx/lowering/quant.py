"""FP8 quantisation in plain torch: 128x128 weight blocks and 1x128 activation groups (DeepSeek-V3 recipe).

Used once per model (weights, at rewrite time) and as the reference of the Triton kernels that
quantise activations. ``dequantize_blockwise`` of :mod:`moe_fx.ops` is the inverse of
:func:`quantize_fp8_blockwise`.
"""

from __future__ import annotations

import torch

from moe_fx.ops.recipe import FP8_BLOCK, FP8_DTYPE, FP8_E4M3_MAX, FP8_SCALE_FLOOR, cdiv

__all__ = ["quantize_fp8_blockwise", "quantize_fp8_per_token_group"]


def quantize_fp8_blockwise(w: torch.Tensor, block: int = FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise weights ``[E, N, K]`` (or ``[N, K]``) to float8_e4m3fn with one fp32 scale per block.

    ``scale = max(max|w_block|, floor) / 448`` (:mod:`moe_fx.ops.recipe`) so the largest value of each
    block maps to the largest fp8 value;
    tails (N or K not multiples of ``block``) form partial blocks.

    Args:
        w: ``[..., N, K]`` bf16/fp16/fp32 weights.
        block: block edge (128 for the recipe DeepGEMM and the Triton kernels use).

    Returns:
        ``(w_fp8 [..., N, K] float8_e4m3fn, scale [..., ceil(N/block), ceil(K/block)] float32)``
        with ``w ~= moe_fx.ops.dequantize_blockwise(w_fp8, scale)``.
    """
    if w.dim() < 2 or not w.dtype.is_floating_point or w.dtype == FP8_DTYPE:
        raise TypeError(f"quantize_fp8_blockwise: want a floating [..., N, K] tensor, got {w.dtype} {list(w.shape)}")
    *lead, n, k = w.shape
    nb, kb = cdiv(n, block), cdiv(k, block)
    w32 = w.float()
    padded = torch.nn.functional.pad(w32, (0, kb * block - k, 0, nb * block - n))
    blocks = padded.reshape(*lead, nb, block, kb, block)
    amax = blocks.abs().amax(dim=(-3, -1))  # [..., nb, kb]
    scale = amax.clamp(min=FP8_SCALE_FLOOR) / FP8_E4M3_MAX
    q = (blocks / scale.unsqueeze(-1).unsqueeze(-3)).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    q = q.reshape(*lead, nb * block, kb * block)[..., :n, :k].to(FP8_DTYPE)
    return q.contiguous(), scale.contiguous()


def quantize_fp8_per_token_group(x: torch.Tensor, group: int = FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise activations ``[..., K]`` to float8_e4m3fn with one fp32 scale per 1x``group`` slice.

    Returns ``(q [..., K], scale [..., ceil(K/group)])`` with ``x ~= q * scale`` (repeated per group).
    """
    if not x.dtype.is_floating_point or x.dtype == FP8_DTYPE:
        raise TypeError(f"quantize_fp8_per_token_group: want a floating tensor, got {x.dtype}")
    *lead, k = x.shape
    kb = cdiv(k, group)
    padded = torch.nn.functional.pad(x.float(), (0, kb * group - k)).reshape(*lead, kb, group)
    scale = padded.abs().amax(dim=-1).clamp(min=FP8_SCALE_FLOOR) / FP8_E4M3_MAX
    q = (padded / scale.unsqueeze(-1)).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).reshape(*lead, kb * group)[..., :k]
    return q.to(FP8_DTYPE), scale
