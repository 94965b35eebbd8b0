"""FP8 quantisation in plain torch: 128x128 weight blocks and 1x128 activation groups (DeepSeek-V3 recipe).

Used once per model (weights, at rewrite time) and as the reference of the Triton kernels that
quantise activations. ``dequantize_blockwise`` of :mod:`moe_fx.ops` is the inverse of
:func:`quantize_fp8_blockwise`.
"""

from __future__ import annotations

import torch

__all__ = ["FP8_MAX", "quantize_fp8_blockwise", "quantize_fp8_per_token_group"]

FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448
_EPS = 1e-10  # the scale floor the Triton kernels use too: all-zero blocks get a tiny, finite scale


def quantize_fp8_blockwise(w: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise weights ``[E, N, K]`` (or ``[N, K]``) to float8_e4m3fn with one fp32 scale per block.

    ``scale = max|w_block| / 448`` so the largest value of each block maps to the largest fp8 value;
    tails (N or K not multiples of ``block``) form partial blocks.

    Args:
        w: ``[..., N, K]`` bf16/fp16/fp32 weights.
        block: block edge (128 for the recipe DeepGEMM and the Triton kernels use).

    Returns:
        ``(w_fp8 [..., N, K] float8_e4m3fn, scale [..., ceil(N/block), ceil(K/block)] float32)``
        with ``w ~= moe_fx.ops.dequantize_blockwise(w_fp8, scale)``.
    """
    if w.dim() < 2 or not w.dtype.is_floating_point or w.dtype == torch.float8_e4m3fn:
        raise TypeError(f"quantize_fp8_blockwise: want a floating [..., N, K] tensor, got {w.dtype} {list(w.shape)}")
    *lead, n, k = w.shape
    nb, kb = -(-n // block), -(-k // block)
    w32 = w.float()
    padded = torch.nn.functional.pad(w32, (0, kb * block - k, 0, nb * block - n))
    blocks = padded.reshape(*lead, nb, block, kb, block)
    amax = blocks.abs().amax(dim=(-3, -1))  # [..., nb, kb]
    scale = amax.clamp(min=_EPS) / FP8_MAX
    q = (blocks / scale.unsqueeze(-1).unsqueeze(-3)).clamp(-FP8_MAX, FP8_MAX)
    q = q.reshape(*lead, nb * block, kb * block)[..., :n, :k].to(torch.float8_e4m3fn)
    return q.contiguous(), scale.contiguous()


def quantize_fp8_per_token_group(x: torch.Tensor, group: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise activations ``[..., K]`` to float8_e4m3fn with one fp32 scale per 1x``group`` slice.

    Returns ``(q [..., K], scale [..., ceil(K/group)])`` with ``x ~= q * scale`` (repeated per group).
    """
    if not x.dtype.is_floating_point or x.dtype == torch.float8_e4m3fn:
        raise TypeError(f"quantize_fp8_per_token_group: want a floating tensor, got {x.dtype}")
    *lead, k = x.shape
    kb = -(-k // group)
    padded = torch.nn.functional.pad(x.float(), (0, kb * group - k)).reshape(*lead, kb, group)
    scale = padded.abs().amax(dim=-1).clamp(min=_EPS) / FP8_MAX
    q = (padded / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).reshape(*lead, kb * group)[..., :k]
    return q.to(torch.float8_e4m3fn), scale
