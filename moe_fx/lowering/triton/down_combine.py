"""GEMM2 with the combine, for rows in slot order (a static token count of one): one launch instead of two.

At T=1 the sorted layout runs three kernels: GEMM1 with the activation in its epilogue, GEMM2 (``[T * K, H]``
rows) and the combine (Qwen3-30B-A3B on the H200: 15.3 + 9.0 + 2.3 µs of kernels and 11 µs of gaps in a 37.5
µs layer, bench/results/kernel_breakdown_2026-12-05_sortab.md). :func:`down_combine` does the last two in one
kernel (:func:`~moe_fx.lowering.triton._kernels.down_combine_kernel`): each program owns ``BLOCK_H`` output
columns of a token and streams those rows of every slot's ``W2[e]``, with the routing weights and GEMM2's biases
applied in fp32, so the ``[T * K, H]`` rows are never stored. Whether the lowering runs it is
:func:`moe_fx.lowering.masked_experts.pipeline.down_combine` (off until measured on a GPU:
``bench/fused_activation.py --switch down_combine``).
"""

from __future__ import annotations

import torch

from moe_fx.lowering.triton._loader import launch
from moe_fx.lowering.triton.grouped_gemm import _known_empty, _pow2
from moe_fx.ops.recipe import cdiv

__all__ = ["DOWN_COMBINE_BLOCK_H", "DOWN_COMBINE_BLOCK_I", "down_combine"]

#: output columns per program: H=2048 gives 128 programs for one token, about one per SM of an H100/H200
DOWN_COMBINE_BLOCK_H = 16
#: GEMM2's K step (the expert intermediate size I): 16 x 256 bf16 weight tiles, 8 KB per load
DOWN_COMBINE_BLOCK_I = 256


def down_combine(
    a2: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w2: torch.Tensor,
    *,
    w2_bias: torch.Tensor | None = None,
    weights_on_output: bool = True,
    hidden: torch.Tensor | None = None,
    identity_experts: int = 0,
    out_dtype: torch.dtype | None = None,
    block_h: int = DOWN_COMBINE_BLOCK_H,
    block_i: int = DOWN_COMBINE_BLOCK_I,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``out[t] = sum_k w[t, k] * (a2[t * K + k] @ w2[e]^T + w2_bias[e])`` over the slots whose id ``e`` lies in
    ``[0, E)``, in fp32, as ``[T, H]``.

    Args:
        a2: the activations in slot order, ``[T * K, I]`` (or ``[1, T * K, I]``), slot ``(t, k)`` at row
            ``t * K + k``; rows of slots without an expert are not read.
        topk_ids: ``[T, K]`` expert ids. topk_weights: ``[T, K]`` routing weights.
        w2: ``[E, H, I]`` GEMM2 weights (bf16/fp16/fp32; fp8 weights are not supported here).
        w2_bias: ``[E, H]`` or None.
        weights_on_output: ``False``: the weights were applied to GEMM1's input, the slots are summed unweighted.
        hidden, identity_experts: identity experts (ids in ``[E, E + identity_experts)``) add ``w[t, k] *
            hidden[t]``.
        out_dtype: the result's dtype (default ``a2.dtype``).
        block_h, block_i: output columns per program and GEMM2's K step (powers of two, ``block_i >= 16``).
        out: a ``[T, H]`` buffer to write (every element is written); default a new one.
    """
    e, h, i = w2.shape
    if w2.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise ValueError("down_combine: fp8 weights are not supported (their block scales are GEMM2's job)")
    if topk_ids.dim() != 2 or tuple(topk_weights.shape) != tuple(topk_ids.shape):
        raise ValueError(f"down_combine: topk_ids and topk_weights must both be [T, K], got "
                         f"{list(topk_ids.shape)} and {list(topk_weights.shape)}")
    t, k = topk_ids.shape
    a2 = a2.reshape(-1, a2.shape[-1])
    if a2.shape[-1] != i or a2.shape[0] < t * k:
        raise ValueError(f"down_combine: a2 must hold T*K = {t * k} rows of I = {i}, got {list(a2.shape)}")
    identity = identity_experts > 0
    if identity and hidden is None:
        raise ValueError("down_combine: identity experts need hidden")
    if out is None:
        out = torch.empty(t, h, dtype=out_dtype or a2.dtype, device=a2.device)
    elif tuple(out.shape) != (t, h):
        raise ValueError(f"down_combine: out must be [T, H] = [{t}, {h}], got {list(out.shape)}")
    if _known_empty(t, h):
        return out
    bias = w2_bias if w2_bias is None or w2_bias.stride(-1) == 1 else w2_bias.contiguous()  # read along H
    hid = hidden if identity else None
    launch(
        "down_combine_kernel", a2.device, (cdiv(h, block_h), t),
        a2, w2, topk_ids, topk_weights, bias, hid, out,
        e, identity_experts, h, i,
        *a2.stride(), *w2.stride(), *topk_ids.stride(), *topk_weights.stride(),
        bias.stride(0) if bias is not None else 0, *(hidden.stride() if identity else (0, 0)), *out.stride(),
        TOPK=k, K_POW2=max(2, _pow2(k)), BLOCK_H=block_h, BLOCK_I=block_i, HAS_W=weights_on_output,
        HAS_BIAS=bias is not None, IDENTITY=identity, IEEE=a2.device.type == "cpu",
        num_warps=4, num_stages=4,
    )  # fmt: skip
    return out
