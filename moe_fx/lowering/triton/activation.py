"""Gated activation on the masked layout: ``act(x[..., :I]) * x[..., I:]``, optionally fused with fp8 quantisation.

The fp8 variant writes float8_e4m3fn values with one fp32 scale per 1x128 group of each row
(``scale = max|v| / 448``), the activation recipe of :func:`masked_gemm_fp8` and DeepGEMM. Only the
valid rows (``< masked_m[g]``) are read and written; nothing synchronises with the host.
"""

from __future__ import annotations

import torch

from moe_fx.lowering.triton._loader import kernels
from moe_fx.lowering.triton.configs import TileConfig
from moe_fx.lowering.triton.grouped_gemm import _check_masked, _out, _pow2, check_offsets, num_programs

__all__ = ["ACT_CODES", "act_mul", "silu_mul", "silu_mul_quant_fp8"]

#: Activation names (those of :data:`moe_fx.ops.ACTIVATIONS`) to the kernel's code.
ACT_CODES = {"silu": 0, "gelu": 1, "gelu_tanh": 2}
_GROUP = 128


def _check_x(name: str, x: torch.Tensor, masked_m: torch.Tensor, activation: str) -> tuple[int, int, int]:
    if x.dim() != 3 or x.shape[2] % 2:
        raise ValueError(f"{name}: x must be [G, M, 2I], got {list(x.shape)}")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"{name}: x must be bf16/fp16/fp32, got {x.dtype}")
    if activation not in ACT_CODES:
        raise ValueError(f"{name}: unknown activation {activation!r}; known: {sorted(ACT_CODES)}")
    g, m, two_i = x.shape
    _check_masked(name, masked_m, g, x.device)
    return g, m, two_i // 2


def _launch(x, y, ys, masked_m, g, m, i, act, quant, block_m, max_total_m):
    check_offsets("act_mul", x, y, ys)
    block_n = _GROUP if quant else min(128, _pow2(max(i, 16)))
    cfg = TileConfig(block_m, block_n, 0, 1, 4, 1, 4)
    tiles_m = g * -(-m // block_m)
    if max_total_m is not None:
        tiles_m = min(tiles_m, -(-max_total_m // block_m) + g)
    nprog = num_programs(x.device, cfg, tiles_m * -(-i // block_n))
    sstride = ys.stride() if quant else (0, 0, 0)
    kernels(x.device).act_mul_kernel[(nprog,)](
        x, y, ys if quant else y, masked_m,
        g, m, i,
        *x.stride(), *y.stride(), *sstride,
        ACT=ACT_CODES[act], QUANT=quant,
        INTERP=x.device.type == "cpu", BLOCK_M=block_m, BLOCK_N=block_n, E_POW2=_pow2(g),
        num_warps=4,
    )  # fmt: skip


def act_mul(
    x: torch.Tensor,
    masked_m: torch.Tensor,
    activation: str = "silu",
    out: torch.Tensor | None = None,
    *,
    max_total_m: int | None = None,
) -> torch.Tensor:
    """``act(x[g, r, :I]) * x[g, r, I:]`` for rows ``r < masked_m[g]``, computed in fp32.

    Args:
        x: ``[G, M, 2I]`` bf16/fp16/fp32 (gate columns first), any strides.
        masked_m: ``[G]`` int32 valid rows.
        activation: ``"silu"``, ``"gelu"`` or ``"gelu_tanh"``.
        out: optional ``[G, M, I]`` in ``x.dtype``.
        max_total_m: host-side bound on ``sum(masked_m)`` to size the grid.

    Returns:
        ``[G, M, I]`` in ``x.dtype`` (rows past ``masked_m`` unwritten).
    """
    g, m, i = _check_x("act_mul", x, masked_m, activation)
    out = _out("act_mul", out, (g, m, i), x.dtype, x.device)
    if g and m and i:
        _launch(x, out, None, masked_m, g, m, i, activation, False, 16, max_total_m)
    return out


def silu_mul(x: torch.Tensor, masked_m: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """SwiGLU on the masked layout: ``silu(x[..., :I]) * x[..., I:]``; ``x [G, M, 2I]`` -> ``[G, M, I]``."""
    return act_mul(x, masked_m, "silu", out)


def silu_mul_quant_fp8(
    x: torch.Tensor,
    masked_m: torch.Tensor,
    out: torch.Tensor | None = None,
    out_scale: torch.Tensor | None = None,
    *,
    activation: str = "silu",
    max_total_m: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """SwiGLU fused with the per-token-group fp8 quantisation of its result, in one kernel.

    Args:
        x: ``[G, M, 2I]`` bf16/fp16/fp32.
        masked_m: ``[G]`` int32 valid rows.
        out: optional float8_e4m3fn ``[G, M, I]``.
        out_scale: optional fp32 ``[G, M, ceil(I/128)]``, ANY strides (an MN-major, TMA-aligned
            view for DeepGEMM is written in place).
        activation: gated activation name (default SwiGLU).
        max_total_m: host-side bound on ``sum(masked_m)`` to size the grid.

    Returns:
        ``(q, scale)``: fp8 ``[G, M, I]`` and fp32 ``[G, M, ceil(I/128)]`` with
        ``q * scale ~= act(gate) * up`` (1x128 groups along I).
    """
    g, m, i = _check_x("silu_mul_quant_fp8", x, masked_m, activation)
    out = _out("silu_mul_quant_fp8", out, (g, m, i), torch.float8_e4m3fn, x.device)
    out_scale = _out("silu_mul_quant_fp8", out_scale, (g, m, -(-i // _GROUP)), torch.float32, x.device)
    if g and m and i:
        _launch(x, out, out_scale, masked_m, g, m, i, activation, True, 16, max_total_m)
    return out, out_scale
