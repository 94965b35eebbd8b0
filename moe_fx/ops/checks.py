"""Input validation of the moe_fx ops, run by their fake implementations (at trace time) and by their
eager CPU implementations. Compiled GPU code does not repeat it per call: a compiled graph only ever
sees inputs whose fake values passed these checks.

Errors are ``ValueError`` / ``TypeError`` with the offending shapes and dtypes, never ``assert``.
"""

from __future__ import annotations

import torch

from moe_fx.ops.activation import ExpertActivation
from moe_fx.ops.recipe import FP8_BLOCK, FP8_DTYPE, cdiv

__all__ = ["FLOAT_DTYPES", "FP8_DTYPES", "ID_DTYPES", "KERNELS", "check_experts_inputs", "check_weight_scale"]

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
ID_DTYPES = (torch.int32, torch.int64)
FP8_DTYPES = (FP8_DTYPE,)
#: Kernel requests the op accepts; the lowering decides what each means on a device.
KERNELS = ("auto", "reference", "triton", "deepgemm")


def _shape(t: torch.Tensor) -> tuple:
    return tuple(t.shape)


def check_weight_scale(where: str, name: str, w: torch.Tensor, scale: torch.Tensor | None) -> None:
    """fp8 weights ``[E, N, K]`` need fp32 ``[E, ceil(N/128), ceil(K/128)]`` scales; others none."""
    if w.dtype in FP8_DTYPES:
        if scale is None:
            raise ValueError(f"moe_fx.{where}: {name} is {w.dtype} but no {name}_scale was given")
        e, n, k = w.shape
        want = (e, cdiv(n, FP8_BLOCK), cdiv(k, FP8_BLOCK))
        if _shape(scale) != want or scale.dtype != torch.float32:
            raise ValueError(
                f"moe_fx.{where}: {name}_scale must be float32 {list(want)} ({FP8_BLOCK}x{FP8_BLOCK} blocks of "
                f"{name} {list(w.shape)}), got {scale.dtype} {list(scale.shape)}"
            )
    elif scale is not None:
        raise ValueError(f"moe_fx.{where}: {name}_scale given but {name} is {w.dtype}, not fp8")


def _check_bias(where: str, name: str, bias: torch.Tensor | None, want: tuple[int, int]) -> None:
    if bias is None:
        return
    if _shape(bias) != want or not bias.dtype.is_floating_point or bias.dtype in FP8_DTYPES:
        raise ValueError(
            f"moe_fx.{where}: {name} must be a float {list(want)} tensor, got {bias.dtype} {list(bias.shape)}"
        )


def check_activation(
    where: str, activation: str, gated: bool, gate_up_layout: str, alpha: float, limit: float | None,
    up_offset: float,
) -> None:
    """Raise ``ValueError`` for an activation spec the op does not define (see ``ExpertActivation``)."""
    bad = ExpertActivation(activation, gated, gate_up_layout, alpha, limit, up_offset).problems()
    if bad:
        raise ValueError(f"moe_fx.{where}: {'; '.join(bad)}")


def check_experts_inputs(
    hidden: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    activation: str,
    w13_scale: torch.Tensor | None,
    w2_scale: torch.Tensor | None,
    impl: str,
    *,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    gated: bool = True,
    gate_up_layout: str = "halves",
    alpha: float = 1.0,
    limit: float | None = None,
    up_offset: float = 0.0,
    identity_experts: int = 0,
) -> None:
    """Raise a clear error if the inputs break the ``moe_fx::experts`` contract (see ``ops/experts.py``).

    Checks shapes, dtypes, devices and arguments only; ids are data, never checked (an id that names no
    expert contributes nothing).
    """
    if hidden.dim() != 2 or hidden.dtype not in FLOAT_DTYPES:
        raise ValueError(
            f"moe_fx.experts: hidden must be a 2-D [T, H] tensor of {FLOAT_DTYPES}, got {hidden.dtype} "
            f"{list(hidden.shape)}"
        )
    if topk_ids.dtype not in ID_DTYPES:
        raise TypeError(f"moe_fx.experts: topk_ids must be int32 or int64, got {topk_ids.dtype}")
    if not topk_weights.dtype.is_floating_point or topk_weights.dtype in FP8_DTYPES:
        raise TypeError(f"moe_fx.experts: topk_weights must be float32/bfloat16/float16, got {topk_weights.dtype}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != hidden.shape[0]:
        raise ValueError(
            f"moe_fx.experts: topk_ids must be [T, K] with T = hidden.shape[0] = {hidden.shape[0]}, "
            f"got {list(topk_ids.shape)}"
        )
    if _shape(topk_weights) != _shape(topk_ids):
        raise ValueError(
            f"moe_fx.experts: topk_weights {list(topk_weights.shape)} must have the shape of topk_ids "
            f"{list(topk_ids.shape)}"
        )
    check_activation("experts", activation, gated, gate_up_layout, alpha, limit, up_offset)
    if w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(
            f"moe_fx.experts: w13 must be [E, N1, H] and w2 [E, H, I], got {list(w13.shape)} and {list(w2.shape)}"
        )
    e, n1, h = w13.shape
    inter = w2.shape[2]
    want_n1 = 2 * inter if gated else inter
    if n1 != want_n1 or _shape(w2) != (e, h, inter) or hidden.shape[1] != h:
        layout = "[E, 2I, H] (gated)" if gated else "[E, I, H] (not gated)"
        raise ValueError(
            f"moe_fx.experts: inconsistent shapes: hidden {list(hidden.shape)}, w13 {list(w13.shape)} "
            f"(want {layout}), w2 {list(w2.shape)} (want [E, H, I])"
        )
    for name, w in (("w13", w13), ("w2", w2)):
        if w.dtype not in FP8_DTYPES and w.dtype != hidden.dtype:
            raise TypeError(f"moe_fx.experts: {name} is {w.dtype} but hidden is {hidden.dtype}; they must match")
    if (w13.dtype in FP8_DTYPES) != (w2.dtype in FP8_DTYPES):
        raise TypeError("moe_fx.experts: w13 and w2 must both be fp8 or both not")
    check_weight_scale("experts", "w13", w13, w13_scale)
    check_weight_scale("experts", "w2", w2, w2_scale)
    _check_bias("experts", "w13_bias", w13_bias, (e, n1))
    _check_bias("experts", "w2_bias", w2_bias, (e, h))
    if identity_experts < 0:
        raise ValueError(f"moe_fx.experts: identity_experts must be >= 0, got {identity_experts}")
    if impl not in KERNELS:
        raise ValueError(f"moe_fx.experts: unknown impl {impl!r}; known: {KERNELS}")
    tensors = [hidden, topk_ids, topk_weights, w13, w2] + [t for t in (w13_bias, w2_bias) if t is not None]
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"moe_fx.experts: all tensors must be on one device, got {sorted(map(str, devices))}")
