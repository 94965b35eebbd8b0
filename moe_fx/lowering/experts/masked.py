"""CUDA implementation of ``moe_fx::masked_experts`` (the experts step of expert parallelism).

Input is already in the masked layout (``x [E_local, M, H]``, ``masked_m [E_local]``) as
``moe_fx::ep_dispatch`` returns it, so this is GEMM1 -> activation -> GEMM2 on that layout:

* ``"deepgemm"``: ``deep_gemm.m_grouped_{fp8,bf16}_gemm_nt_masked`` with moe_fx's Triton activation
  between them (fp8: fused with the 1x128 quantisation, scales written MN-major for GEMM2). DeepEP's
  fp8 tokens and their MN-major scales go into GEMM1 as they are, without a copy. Only when M is a
  multiple of 256: DeepGEMM stores whole row tiles, which must not spill into the next expert's rows.
* ``"triton"``: moe_fx's Triton masked GEMMs (any M; MN-major scales read in place).
* ``"reference"``: :func:`moe_fx.ops.ep.masked_experts_reference`.

The kernel is chosen with the experts op's rule (:func:`moe_fx.lowering.select.choose_experts_kernel`,
logged once per shape) plus the M condition above. fp8 weights with bf16 tokens (dispatch without
fp8) quantise the tokens first; bf16 weights with fp8 tokens dequantise them.
"""

from __future__ import annotations

import torch

from moe_fx.ops.ep import check_masked_experts_inputs, masked_experts_reference
from moe_fx.ops.recipe import FP8_BLOCK

__all__ = ["masked_experts_cuda"]

_FP8 = torch.float8_e4m3fn
#: DeepGEMM's largest row tile on SM90; M must be a multiple of it (see module docstring).
_DEEPGEMM_M_ALIGN = 256


def _quantize_tokens(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 ``[E, M, H]`` -> fp8 ``[E, M, H]`` + fp32 MN-major ``[E, M, H/128]`` scales (1x128 groups)."""
    from moe_fx.lowering.layouts import to_mn_major_tma_aligned

    e, m, h = x.shape
    g = x.float().view(e, m, h // FP8_BLOCK, FP8_BLOCK)
    scale = g.abs().amax(dim=-1).clamp(min=1e-4) / 448.0
    q = (g / scale.unsqueeze(-1)).to(_FP8).view(e, m, h)
    return q, to_mn_major_tma_aligned(scale)


def masked_experts_cuda(
    x: torch.Tensor,
    masked_m: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    activation: str = "silu",
    x_scale: torch.Tensor | None = None,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    expected_m: int = 0,
    impl: str = "auto",
) -> torch.Tensor:
    """``moe_fx::masked_experts`` on CUDA: ``x [E, M, H]`` (bf16, or fp8 with ``x_scale``) -> bf16/x.dtype ``[E, M, H]``."""
    check_masked_experts_inputs(x, masked_m, w13, w2, activation, x_scale, w13_scale, w2_scale)
    from moe_fx.lowering.select import choose_experts_kernel

    e, m, h = x.shape
    inter = w2.shape[2]
    fp8_w = w13.dtype == _FP8
    act_dtype = torch.bfloat16 if x.dtype == _FP8 else x.dtype
    choice = choose_experts_kernel(
        device_type="cuda",
        dtype=act_dtype,
        hidden=h,
        intermediate=inter,
        num_experts=e,
        request=impl,
        fp8=fp8_w,
        activation=activation,
        device=x.device,
    )
    if choice.error is not None:
        raise RuntimeError(f"moe_fx.masked_experts: impl={impl!r} cannot run: {choice.error}")
    kernel = choice.kernel
    if kernel == "deepgemm" and m % _DEEPGEMM_M_ALIGN:
        kernel = "triton" if impl == "auto" else kernel
    if kernel == "reference" or e == 0 or m == 0:
        return masked_experts_reference(x, masked_m, w13, w2, activation, x_scale, w13_scale, w2_scale)
    if x.dtype == _FP8 and not fp8_w:
        from moe_fx.ops.ep import dequantize_activations

        x, x_scale = dequantize_activations(x, x_scale).to(w13.dtype), None
    elif fp8_w and x.dtype != _FP8:
        x, x_scale = _quantize_tokens(x)
    exp_m = max(1, min(expected_m or m, m))
    bound = e * m  # host-side bound on sum(masked_m) for the Triton grids
    from moe_fx.lowering.triton.activation import act_mul, silu_mul_quant_fp8

    if kernel == "deepgemm":
        from moe_fx.lowering.experts.deepgemm_experts import deepgemm_module
        from moe_fx.lowering.layouts import empty_mn_major_scales, is_mn_major_tma_aligned, to_mn_major_tma_aligned

        dg = deepgemm_module()
        gate_up = torch.empty(e, m, 2 * inter, dtype=torch.bfloat16, device=x.device)
        y = torch.empty(e, m, h, dtype=torch.bfloat16, device=x.device)
        if fp8_w:
            if not is_mn_major_tma_aligned(x_scale):
                x_scale = to_mn_major_tma_aligned(x_scale)
            dg.m_grouped_fp8_gemm_nt_masked((x, x_scale), (w13, w13_scale.contiguous()), gate_up, masked_m, exp_m)
            a2 = torch.empty(e, m, inter, dtype=_FP8, device=x.device)
            a2_scale = empty_mn_major_scales(e, m, inter, device=x.device)
            silu_mul_quant_fp8(gate_up, masked_m, a2, a2_scale, activation=activation, max_total_m=bound)
            dg.m_grouped_fp8_gemm_nt_masked((a2, a2_scale), (w2, w2_scale.contiguous()), y, masked_m, exp_m)
        else:
            dg.m_grouped_bf16_gemm_nt_masked(x, w13, gate_up, masked_m, exp_m)
            dg.m_grouped_bf16_gemm_nt_masked(
                act_mul(gate_up, masked_m, activation, max_total_m=bound), w2, y, masked_m, exp_m
            )
        return y.to(act_dtype)
    from moe_fx.lowering.triton.grouped_gemm import masked_gemm_bf16, masked_gemm_fp8

    if fp8_w:
        gate_up = masked_gemm_fp8(x, x_scale, w13, w13_scale, masked_m, expected_m=exp_m, max_total_m=bound)
        a2, a2_scale = silu_mul_quant_fp8(gate_up, masked_m, activation=activation, max_total_m=bound)
        return masked_gemm_fp8(a2, a2_scale, w2, w2_scale, masked_m, expected_m=exp_m, max_total_m=bound).to(act_dtype)
    gate_up = masked_gemm_bf16(x, w13, masked_m, expected_m=exp_m, max_total_m=bound)
    a2 = act_mul(gate_up, masked_m, activation, max_total_m=bound)
    return masked_gemm_bf16(a2, w2, masked_m, expected_m=exp_m, max_total_m=bound)


torch.library.register_kernel("moe_fx::masked_experts", "cuda", masked_experts_cuda)
