"""The ``moe_fx::experts`` op on one GPU with moe_fx's Triton kernels (also runs on CPU under the interpreter).

Pipeline, five kernels, no host synchronisation (CUDA-graph safe):

    dispatch  hidden [T, H] -> x [E, max_m, H] (+ fp8 1x128 quantisation when the weights are fp8)
    GEMM1     x @ w13^T      -> [E, max_m, 2I]  (masked: only rows < masked_m[e])
    act       silu(gate)*up  -> [E, max_m, I]   (+ fp8 quantisation, fused)
    GEMM2     @ w2^T         -> [E, max_m, H]
    combine   sum_k w_k * y  -> [T, H]          (fp32 accumulation)

``max_m = T``: every expert can receive each token at most once when a token's top-k ids are
distinct (top-k routing), so no row is ever dropped and the bound is static (it depends on the
shape only). A token naming the same expert twice is still correct as long as no expert gets
more than T rows in total; beyond that, rows are dropped (documented limitation, not reachable
from top-k). Padding rows cost memory only: every kernel visits valid rows alone.
"""

from __future__ import annotations

import torch

from moe_fx.lowering.triton.activation import ACT_CODES, act_mul, silu_mul_quant_fp8
from moe_fx.lowering.triton.dispatch import dispatch_rows, local_combine
from moe_fx.lowering.triton.grouped_gemm import masked_gemm_bf16, masked_gemm_fp8

__all__ = ["expected_rows", "triton_experts"]

_FP8 = torch.float8_e4m3fn


def expected_rows(num_tokens: int, top_k: int, num_experts: int) -> int:
    """Uniform-load estimate of rows per expert, ``ceil(T * K / E)`` (a tile-bucket hint, host side)."""
    return max(1, -(-num_tokens * top_k // max(num_experts, 1)))


def triton_experts(
    hidden: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    activation: str = "silu",
    weights_on_input: bool = False,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """The experts op with Triton kernels; same contract as :func:`moe_fx.ops.experts_reference`.

    Args:
        hidden: ``[T, H]`` bf16/fp16/fp32.
        topk_ids: ``[T, K]`` int32/int64, ``-1`` skipped.
        topk_weights: ``[T, K]`` float routing weights.
        w13: ``[E, 2I, H]`` (gate rows first) in hidden's dtype, or float8_e4m3fn with ``w13_scale``.
        w2: ``[E, H, I]``, same dtype rule.
        activation: ``"silu"`` (SwiGLU), ``"gelu"`` or ``"gelu_tanh"``.
        weights_on_input: scale each token by its routing weight before the expert (Llama 4).
        w13_scale, w2_scale: fp32 ``[E, ceil(N/128), ceil(K/128)]`` block scales for fp8 weights.

    Returns:
        ``[T, H]`` in ``hidden.dtype``. With fp8 weights the activations are quantised to fp8
        (1x128 groups) before each GEMM; outputs of the GEMMs are bf16.
    """
    if activation not in ACT_CODES:
        raise ValueError(f"triton_experts: unknown activation {activation!r}; known: {sorted(ACT_CODES)}")
    fp8 = w13.dtype == _FP8
    if fp8 != (w2.dtype == _FP8) or (fp8 and (w13_scale is None or w2_scale is None)):
        raise ValueError("triton_experts: w13 and w2 must both be fp8 with scales, or both not fp8")
    if not fp8 and (w13.dtype != hidden.dtype or w2.dtype != hidden.dtype):
        raise TypeError(f"triton_experts: weights {w13.dtype}/{w2.dtype} must match hidden {hidden.dtype}")
    t = hidden.shape[0]
    e = w13.shape[0]
    k = topk_ids.shape[1]
    max_m = t
    exp_m = expected_rows(t, k, e)
    bound = t * k
    # host-side hints for tile choice and grid size (never read from masked_m, which stays on device)
    hints = {"expected_m": exp_m, "max_total_m": bound, "active_groups": min(e, bound)}
    x, x_scale, masked_m, _, slot_pos = dispatch_rows(
        hidden, topk_ids, e, max_m, topk_weights, weights_on_input, quant_fp8=fp8, with_slot_index=False, clamp=False
    )
    if fp8:
        gate_up = masked_gemm_fp8(x, x_scale, w13, w13_scale, masked_m, **hints)
        a2, a2_scale = silu_mul_quant_fp8(gate_up, masked_m, activation=activation, max_total_m=bound)
        y = masked_gemm_fp8(a2, a2_scale, w2, w2_scale, masked_m, **hints)
    else:
        gate_up = masked_gemm_bf16(x, w13, masked_m, **hints)
        a2 = act_mul(gate_up, masked_m, activation, max_total_m=bound)
        y = masked_gemm_bf16(a2, w2, masked_m, **hints)
    out = local_combine(y, None, masked_m, None if weights_on_input else topk_weights, t, slot_pos=slot_pos)
    return out.to(hidden.dtype)
