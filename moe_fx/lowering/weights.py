"""Weight packing for the experts op, done once at rewrite time (called by the passes through the backend)."""

from __future__ import annotations

import torch

from moe_fx.lowering.quant import quantize_fp8_blockwise

__all__ = ["RECIPES", "pack_experts_weights"]

#: Weight recipes :func:`pack_experts_weights` knows.
RECIPES = ("fp8",)


def pack_experts_weights(
    w13: torch.Tensor, w2: torch.Tensor, recipe: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pack ``w13 [E, 2I, H]`` and ``w2 [E, H, I]`` for ``recipe``.

    ``"fp8"``: float8_e4m3fn weights (contiguous, K-major as DeepGEMM and the Triton kernels read them)
    with fp32 128x128 block scales ``[E, ceil(N/128), ceil(K/128)]``.

    Returns ``(w13', w13_scale, w2', w2_scale)``.
    """
    if recipe != "fp8":
        raise ValueError(f"moe_fx: unknown weight recipe {recipe!r}; known: {RECIPES}")
    q13, s13 = quantize_fp8_blockwise(w13.contiguous())
    q2, s2 = quantize_fp8_blockwise(w2.contiguous())
    return q13.contiguous(), s13, q2.contiguous(), s2
