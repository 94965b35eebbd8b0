"""Input validation shared by the moe_fx ops' fake and real implementations.

Errors are raised as ``ValueError`` / ``TypeError`` with the offending shapes and dtypes, at trace time
(fake implementation) and at run time (eager calls), never with ``assert``.
"""

from __future__ import annotations

import torch

__all__ = ["FLOAT_DTYPES", "ID_DTYPES", "KERNELS", "check_experts_inputs"]

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
ID_DTYPES = (torch.int32, torch.int64)
FP8_DTYPES = (torch.float8_e4m3fn,)
#: Kernel requests the op accepts; the lowering decides what each means on a device.
KERNELS = ("auto", "reference", "triton", "deepgemm")


def _shape(t: torch.Tensor) -> tuple:
    return tuple(t.shape)


def _check_scale(name: str, w: torch.Tensor, scale: torch.Tensor | None, block: int = 128) -> None:
    if w.dtype in FP8_DTYPES:
        if scale is None:
            raise ValueError(f"moe_fx.experts: {name} is {w.dtype} but no {name}_scale was given")
        e, n, k = w.shape
        want = (e, -(-n // block), -(-k // block))
        if _shape(scale) != want or scale.dtype != torch.float32:
            raise ValueError(
                f"moe_fx.experts: {name}_scale must be float32 {list(want)} (128x128 blocks of {name} "
                f"{list(w.shape)}), got {scale.dtype} {list(scale.shape)}"
            )
    elif scale is not None:
        raise ValueError(f"moe_fx.experts: {name}_scale given but {name} is {w.dtype}, not fp8")


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
) -> None:
    """Raise a clear error if the inputs break the ``moe_fx::experts`` contract (see ``ops/experts.py``)."""
    from moe_fx.ops.experts import ACTIVATIONS  # local: experts.py imports this module

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
    if w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(
            f"moe_fx.experts: w13 must be [E, 2I, H] and w2 [E, H, I], got {list(w13.shape)} and {list(w2.shape)}"
        )
    e, two_i, h = w13.shape
    if two_i % 2 or _shape(w2) != (e, h, two_i // 2) or hidden.shape[1] != h:
        raise ValueError(
            f"moe_fx.experts: inconsistent shapes: hidden {list(hidden.shape)}, w13 {list(w13.shape)} "
            f"(want [E, 2I, H]), w2 {list(w2.shape)} (want [E, H, I])"
        )
    for name, w in (("w13", w13), ("w2", w2)):
        if w.dtype not in FP8_DTYPES and w.dtype != hidden.dtype:
            raise TypeError(f"moe_fx.experts: {name} is {w.dtype} but hidden is {hidden.dtype}; they must match")
    if (w13.dtype in FP8_DTYPES) != (w2.dtype in FP8_DTYPES):
        raise TypeError("moe_fx.experts: w13 and w2 must both be fp8 or both not")
    _check_scale("w13", w13, w13_scale)
    _check_scale("w2", w2, w2_scale)
    if activation not in ACTIVATIONS:
        raise ValueError(f"moe_fx.experts: unknown activation {activation!r}; known: {sorted(ACTIVATIONS)}")
    if impl not in KERNELS:
        raise ValueError(f"moe_fx.experts: unknown impl {impl!r}; known: {KERNELS}")
    devices = {t.device for t in (hidden, topk_ids, topk_weights, w13, w2)}
    if len(devices) != 1:
        raise ValueError(f"moe_fx.experts: all tensors must be on one device, got {sorted(map(str, devices))}")
