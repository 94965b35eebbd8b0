"""The ``moe_fx::experts`` op on one Hopper GPU with DeepGEMM's masked grouped GEMMs.

Pipeline (no host synchronisation; the masked bound depends on the shape only):

    dispatch  hidden [T, H] -> x [E, max_m, H]            Triton (fp8: quantised 1x128 in the same kernel)
    GEMM1     x @ w13^T      -> [E, max_m, 2I] bf16       deep_gemm.m_grouped_{fp8,bf16}_gemm_nt_masked
    act       act(gate)*up   -> [E, max_m, I]             Triton (fp8: quantised, scales written straight
                                                          into DeepGEMM's MN-major TMA-aligned layout)
    GEMM2     @ w2^T         -> [E, max_m, H] bf16        deep_gemm.m_grouped_{fp8,bf16}_gemm_nt_masked
    combine   sum_k w_k * y  -> [T, H]                    Triton (fp32 accumulation)

``max_m`` is :func:`moe_fx.lowering.layouts.masked_rows` (``T`` rounded up to 256: DeepGEMM stores
whole tiles, and a tile must not spill into the next expert's rows). ``expected_m`` follows
DESIGN.md (:func:`moe_fx.lowering.layouts.expected_m`). Weights are read in the op contract's
layout, which is DeepGEMM's (K-major ``[E, N, K]``, contiguous fp32 128x128 block scales): the rewrite
prepares them once (:func:`moe_fx.lowering.layouts.prepare_expert_weights`); a weight that arrives
otherwise is made contiguous per call, with a one-time warning.
"""

from __future__ import annotations

import importlib
import logging
from types import ModuleType

import torch

from moe_fx.lowering.layouts import empty_mn_major_scales, expected_m, masked_rows

__all__ = ["deepgemm_experts", "deepgemm_module"]

log = logging.getLogger("moe_fx.lowering")
_FP8 = torch.float8_e4m3fn
_ALIGN = 128
_warned: set[str] = set()


def deepgemm_module() -> ModuleType:
    """``import deep_gemm`` (raises ImportError with the install hint when it is absent)."""
    try:
        return importlib.import_module("deep_gemm")
    except ImportError as e:
        raise ImportError(
            f"moe_fx: the DeepGEMM path needs the 'deep_gemm' package ({e}); see docs/deepgemm.md"
        ) from e


def _warn_once(key: str, msg: str, *args) -> None:
    if key not in _warned:
        _warned.add(key)
        log.warning(msg, *args)


def _k_major(name: str, w: torch.Tensor) -> torch.Tensor:
    if w.is_contiguous():
        return w
    _warn_once(
        f"layout:{name}",
        "moe_fx.experts (deepgemm): %s %s is not contiguous (K-major); copying it on every call. "
        "Prepare weights once with moe_fx.lowering.layouts.prepare_expert_weights.",
        name,
        list(w.shape),
    )
    return w.contiguous()


def _check(hidden, w13, w2, w13_scale, w2_scale) -> bool:
    fp8 = w13.dtype == _FP8
    if hidden.dtype != torch.bfloat16:
        raise TypeError(f"deepgemm_experts: hidden must be bfloat16, got {hidden.dtype}")
    if fp8 != (w2.dtype == _FP8) or (fp8 and (w13_scale is None or w2_scale is None)):
        raise ValueError("deepgemm_experts: w13 and w2 must both be fp8 with scales, or both bf16")
    if not fp8 and (w13.dtype != torch.bfloat16 or w2.dtype != torch.bfloat16):
        raise TypeError(f"deepgemm_experts: weights must be bf16 or fp8, got {w13.dtype} and {w2.dtype}")
    h, i = w13.shape[2], w2.shape[2]
    if h % _ALIGN or i % _ALIGN:
        raise ValueError(
            f"deepgemm_experts: H={h} and I={i} must be multiples of {_ALIGN} (N and K of both GEMMs); "
            "use the Triton kernel for other shapes"
        )
    return fp8


def deepgemm_experts(
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
    """The experts op with DeepGEMM's masked grouped GEMMs; same contract as :func:`moe_fx.ops.experts_reference`.

    Args:
        hidden: ``[T, H]`` bfloat16, H a multiple of 128.
        topk_ids: ``[T, K]`` int32/int64, ``-1`` skipped.
        topk_weights: ``[T, K]`` float routing weights.
        w13: ``[E, 2I, H]`` bf16, or float8_e4m3fn with ``w13_scale`` fp32 ``[E, 2I/128, H/128]``.
        w2: ``[E, H, I]`` bf16, or float8_e4m3fn with ``w2_scale`` fp32 ``[E, H/128, I/128]``; I a multiple of 128.
        activation: ``"silu"`` (SwiGLU), ``"gelu"`` or ``"gelu_tanh"``.
        weights_on_input: scale each token by its routing weight before the expert (Llama 4).

    Returns:
        ``[T, H]`` bfloat16. With fp8 weights the activations are quantised to fp8 with 1x128 group
        scales before each GEMM (the DeepSeek-V3 recipe); GEMM outputs are bf16.
    """
    # Kernels around the GEMMs are helper modules of the Triton path (imported here, not at module
    # import, so that this module imports on machines without Triton).
    from moe_fx.lowering.triton.activation import act_mul, silu_mul_quant_fp8
    from moe_fx.lowering.triton.dispatch import dispatch_rows, local_combine

    fp8 = _check(hidden, w13, w2, w13_scale, w2_scale)
    dg = deepgemm_module()
    t, h = hidden.shape
    e, two_i, _ = w13.shape
    inter = two_i // 2
    k = topk_ids.shape[1]
    if t == 0:
        return hidden.new_zeros(hidden.shape)
    w13, w2 = _k_major("w13", w13), _k_major("w2", w2)
    max_m = masked_rows(t)
    exp_m = expected_m(t, k, e, max_m)
    bound = t * k  # host-side bound on sum(masked_m): sizes the Triton grids
    dev = hidden.device
    # fp8: the dispatch kernel quantises and writes its scales straight into DeepGEMM's MN-major
    # TMA-aligned layout (no transposing copy); the combine needs only slot_pos, not slot_index.
    x, x_scale, masked_m, _, slot_pos = dispatch_rows(
        hidden,
        topk_ids,
        e,
        max_m,
        topk_weights,
        weights_on_input,
        quant_fp8=fp8,
        with_slot_index=False,
        x_scale=empty_mn_major_scales(e, max_m, h, device=dev) if fp8 else None,
    )
    gate_up = torch.empty(e, max_m, two_i, dtype=torch.bfloat16, device=dev)
    y = torch.empty(e, max_m, h, dtype=torch.bfloat16, device=dev)
    if fp8:
        # SM100 would recast fp32 scales to UE8M0 (lossy) unless told not to; SM90 ignores the flag.
        sm100 = dev.type == "cuda" and torch.cuda.get_device_capability(dev)[0] >= 10
        extra = {"disable_ue8m0_cast": True} if sm100 else {}
        w13_scale, w2_scale = w13_scale.contiguous(), w2_scale.contiguous()
        dg.m_grouped_fp8_gemm_nt_masked((x, x_scale), (w13, w13_scale), gate_up, masked_m, exp_m, **extra)
        # The activation kernel quantises its output and writes the scales straight into DeepGEMM's
        # MN-major TMA-aligned layout: GEMM2 consumes them with no transposing copy.
        a2 = torch.empty(e, max_m, inter, dtype=_FP8, device=dev)
        a2_scale = empty_mn_major_scales(e, max_m, inter, device=dev)
        silu_mul_quant_fp8(gate_up, masked_m, a2, a2_scale, activation=activation, max_total_m=bound)
        dg.m_grouped_fp8_gemm_nt_masked((a2, a2_scale), (w2, w2_scale), y, masked_m, exp_m, **extra)
    else:
        dg.m_grouped_bf16_gemm_nt_masked(x, w13, gate_up, masked_m, exp_m)
        a2 = act_mul(gate_up, masked_m, activation, max_total_m=bound)
        dg.m_grouped_bf16_gemm_nt_masked(a2, w2, y, masked_m, exp_m)
    out = local_combine(y, None, masked_m, None if weights_on_input else topk_weights, t, slot_pos=slot_pos)
    return out.to(hidden.dtype)
