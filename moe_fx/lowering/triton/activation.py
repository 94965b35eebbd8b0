"""The expert activation between the two GEMMs, on the masked layout, optionally fused with fp8 quantisation.

One kernel for every :class:`moe_fx.ops.ExpertActivation`: gated (``act(gate) * (up + up_offset)``,
gate/up as halves or interleaved) or not (``act(h)``), ``silu`` with ``alpha``, a clamp ``limit``, and
the first GEMM's bias added on the way in. The fp8 variant writes float8_e4m3fn values with one fp32
scale per 1x128 group of each row (``scale = max(amax, floor) / 448``), the activation recipe of
:func:`~moe_fx.lowering.triton.grouped_gemm.masked_gemm_fp8` and DeepGEMM. Only valid rows
(``< masked_m[g]``) are read and written; nothing synchronises with the host.
"""

from __future__ import annotations

import torch

from moe_fx.lowering.triton._loader import launch
from moe_fx.lowering.triton.act_args import epilogue_args
from moe_fx.lowering.triton.configs import TileConfig
from moe_fx.lowering.triton.grouped_gemm import _check_masked, _known_empty, _out, _pow2, check_offsets, num_programs
from moe_fx.ops import ExpertActivation
from moe_fx.ops.recipe import FP8_BLOCK, FP8_DTYPE, cdiv

__all__ = ["expert_activation"]

#: Rows per tile of the activation kernel (it streams; the row tile only bounds the padding visited).
_BLOCK_M = 16


def expert_activation(
    x: torch.Tensor,
    masked_m: torch.Tensor,
    spec: ExpertActivation = ExpertActivation(),
    *,
    bias: torch.Tensor | None = None,
    quant_fp8: bool = False,
    out: torch.Tensor | None = None,
    out_scale: torch.Tensor | None = None,
    max_total_m: object = None,
    masked_m_offset: int = 0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``spec`` applied to the first GEMM's output ``x [G, M, N1]`` for rows ``r < masked_m[g]``, in fp32.

    Args:
        x: ``[G, M, N1]`` bf16/fp16/fp32 (``N1 = 2I`` gated, ``I`` not), any strides.
        masked_m: ``[G]`` int32 valid rows.
        spec: the activation (see :class:`moe_fx.ops.ExpertActivation`).
        bias: optional float ``[G, N1]``, added to ``x`` before the activation.
        quant_fp8: write fp8 with 1x128 group scales instead of ``x.dtype``.
        out: optional output ``[G, M, I]`` (``x.dtype``, or float8_e4m3fn with ``quant_fp8``).
        out_scale: optional fp32 ``[G, M, ceil(I/128)]`` of ANY strides (an MN-major, TMA-aligned view
            for DeepGEMM is written in place).
        max_total_m: host-side bound on ``sum(masked_m)`` to size the grid (may be symbolic).
        masked_m_offset: the counts start at this element of ``masked_m`` (a longer int32 buffer, e.g.
            the sorted layout's scratch, whose element E is the total of rows).

    Returns:
        ``(y, scale)``: ``[G, M, I]`` (rows past ``masked_m`` unwritten) and, with ``quant_fp8``, the fp32
        scales (``None`` otherwise).
    """
    if x.dim() != 3 or x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"expert_activation: x must be a bf16/fp16/fp32 [G, M, N1] tensor, got {x.dtype} {list(x.shape)}")
    act = epilogue_args(spec)
    g, m, n1 = x.shape
    if spec.gated and n1 % 2:
        raise ValueError(f"expert_activation: a gated activation needs an even N1 = 2I, got {n1}")
    i = n1 // 2 if spec.gated else n1
    if masked_m_offset:
        if masked_m.dtype != torch.int32 or masked_m.dim() != 1 or masked_m.shape[0] < masked_m_offset + g:
            raise ValueError(f"expert_activation: masked_m must be int32 with {masked_m_offset + g}+ entries, "
                             f"got {masked_m.dtype} {list(masked_m.shape)}")
    else:
        _check_masked("expert_activation", masked_m, g, x.device)
    if bias is not None and (tuple(bias.shape) != (g, n1) or not bias.dtype.is_floating_point):
        raise ValueError(f"expert_activation: bias must be float [{g}, {n1}], got {bias.dtype} {list(bias.shape)}")
    out = _out("expert_activation", out, (g, m, i), FP8_DTYPE if quant_fp8 else x.dtype, x.device)
    if quant_fp8:
        out_scale = _out("expert_activation", out_scale, (g, m, cdiv(i, FP8_BLOCK)), torch.float32, x.device)
    elif out_scale is not None:
        raise ValueError("expert_activation: out_scale given without quant_fp8")
    if _known_empty(g, m, i):
        return out, out_scale
    check_offsets("expert_activation", x, out, out_scale)
    block_n = FP8_BLOCK if quant_fp8 else min(128, _pow2(max(i, 16)))
    cfg = TileConfig(_BLOCK_M, block_n, 0, 1, 4, 1, 4)
    tiles_m = g * cdiv(m, _BLOCK_M)
    if max_total_m is not None:
        tiles_m = torch.sym_min(tiles_m, cdiv(max_total_m, _BLOCK_M) + g)
    nprog = num_programs(x.device, cfg, tiles_m * cdiv(i, block_n))
    # Unused pointers are None (a constexpr to Triton): nothing aliases what the kernel writes.
    sstride = out_scale.stride() if quant_fp8 else (0, 0, 0)
    bstride = bias.stride() if bias is not None else (0, 0)
    launch(
        "activation_kernel", x.device, (nprog,),
        x, out, out_scale, masked_m, bias,
        g, m, i,
        *x.stride(), *out.stride(), *sstride, *bstride,
        act["alpha"], act["limit"], act["up_offset"],
        masked_m_offset, ACT=act["ACT"], GATED=act["GATED"], INTERLEAVED=act["INTERLEAVED"],
        HAS_LIMIT=act["HAS_LIMIT"], HAS_BIAS=bias is not None, QUANT=quant_fp8,
        INTERP=x.device.type == "cpu", BLOCK_M=_BLOCK_M, BLOCK_N=block_n, E_POW2=_pow2(g),
        num_warps=4,
    )  # fmt: skip
    return out, out_scale
