"""Input validation of the moe_fx ops, run by their fake implementations (at trace time) and by their
eager CPU implementations. Compiled GPU code does not repeat it per call: a compiled graph only ever
sees inputs whose fake values passed these checks.

Errors are ``ValueError`` / ``TypeError`` with the offending shapes and dtypes, never ``assert``.
"""

from __future__ import annotations

import torch

from moe_fx.ops.activation import ExpertActivation
from moe_fx.ops.recipe import FP8_BLOCK, FP8_DTYPE, cdiv

__all__ = [
    "EP_KERNELS",
    "FLOAT_DTYPES",
    "FP8_DTYPES",
    "ID_DTYPES",
    "KERNELS",
    "check_combine",
    "check_dispatch",
    "check_experts",
    "check_masked_experts",
    "check_remaining_rounds",
    "check_weight_scale",
]

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
ID_DTYPES = (torch.int32, torch.int64)
FP8_DTYPES = (FP8_DTYPE,)
#: The kernel choice of ``moe_fx::experts`` and ``masked_experts`` (``MoEConfig.kernel``, the ops'
#: ``kernel_choice`` argument): ``"auto"`` lets the lowering pick, every other name is one of its experts
#: implementations (the one home of these names: :mod:`moe_fx.lowering.select` checks its candidates against
#: them). The op argument is ``kernel_choice``, not ``kernel``: Inductor's lowering of an opaque op calls
#: ``FallbackKernel.create(kernel, *args, **kwargs)``, so an op argument named ``kernel`` cannot be compiled.
KERNELS = ("auto", "reference", "triton", "deepgemm")
#: The kernel choice of the expert-parallel ops (dispatch and combine, their ``kernel_choice``): ``"auto"`` or
#: one of the lowering's expert-parallel prepare/finalize implementations (see docs/ep.md).
EP_KERNELS = ("auto", "deepep", "torch_dist_fixed", "torch_dist")


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


def check_activation(where: str, a: dict) -> None:
    """Raise ``ValueError`` for bound activation arguments the op does not define (see ``ExpertActivation``)."""
    bad = ExpertActivation.of(a).problems()
    if bad:
        raise ValueError(f"moe_fx.{where}: {'; '.join(bad)}")


def _check_kernel(where: str, kernel: object, known: tuple[str, ...]) -> None:
    if kernel not in known:
        raise ValueError(f"moe_fx.{where}: unknown kernel_choice {kernel!r}; known: {known}")


def check_experts(a: dict) -> None:
    """Raise a clear error if bound ``moe_fx::experts`` arguments break its contract (see ``ops/experts.py``).

    Checks shapes, dtypes, devices and arguments only; ids are data, never checked (an id that names no
    expert contributes nothing).
    """
    hidden, topk_ids, topk_weights, w13, w2 = a["hidden"], a["topk_ids"], a["topk_weights"], a["w13"], a["w2"]
    gated, w13_bias, w2_bias = a["gated"], a["w13_bias"], a["w2_bias"]
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
    check_activation("experts", a)
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
    check_weight_scale("experts", "w13", w13, a["w13_scale"])
    check_weight_scale("experts", "w2", w2, a["w2_scale"])
    _check_bias("experts", "w13_bias", w13_bias, (e, n1))
    _check_bias("experts", "w2_bias", w2_bias, (e, h))
    if a["identity_experts"] < 0:
        raise ValueError(f"moe_fx.experts: identity_experts must be >= 0, got {a['identity_experts']}")
    _check_kernel("experts", a["kernel_choice"], KERNELS)
    tensors = [hidden, topk_ids, topk_weights, w13, w2] + [t for t in (w13_bias, w2_bias) if t is not None]
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"moe_fx.experts: all tensors must be on one device, got {sorted(map(str, devices))}")


# --------------------------------------------------------------------------------------------------
# Expert-parallel ops (moe_fx/ops/ep.py, moe_fx/ops/masked_experts.py). Each check takes the op's
# arguments bound by name (moe_fx.ops.signature) and the group's size where the layout needs it.
# --------------------------------------------------------------------------------------------------


def check_ep_layout(num_experts: int, max_tokens_per_rank: int, world: int, where: str) -> tuple[int, int]:
    """``(E_local, M)`` of the masked layout; ``ValueError`` for sizes expert parallelism cannot split."""
    if num_experts <= 0 or max_tokens_per_rank <= 0:
        raise ValueError(
            f"moe_fx.{where}: num_experts and max_tokens_per_rank must be positive, got "
            f"{num_experts} and {max_tokens_per_rank}"
        )
    if num_experts % world:
        raise ValueError(
            f"moe_fx.{where}: {num_experts} experts cannot be split evenly over {world} ranks "
            f"(expert parallelism needs E % world_size == 0)"
        )
    return num_experts // world, max_tokens_per_rank * world


def _check_routing(where: str, hidden: torch.Tensor, topk_ids: torch.Tensor) -> None:
    if hidden.dim() != 2 or hidden.dtype not in FLOAT_DTYPES:
        raise ValueError(
            f"moe_fx.{where}: hidden must be a 2-D [T, H] tensor of {FLOAT_DTYPES}, got {hidden.dtype} "
            f"{list(hidden.shape)}"
        )
    if topk_ids.dtype not in ID_DTYPES or topk_ids.dim() != 2 or topk_ids.shape[0] != hidden.shape[0]:
        raise ValueError(
            f"moe_fx.{where}: topk_ids must be int32/int64 [T, K] with T = {hidden.shape[0]}, got "
            f"{topk_ids.dtype} {list(topk_ids.shape)}"
        )


def _check_topk_weights(where: str, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> None:
    if _shape(topk_weights) != _shape(topk_ids) or not topk_weights.dtype.is_floating_point \
            or topk_weights.dtype in FP8_DTYPES:
        raise ValueError(
            f"moe_fx.{where}: topk_weights must be float {list(topk_ids.shape)}, got {topk_weights.dtype} "
            f"{list(topk_weights.shape)}"
        )


def check_dispatch(a: dict, world: int) -> tuple[int, int]:
    """Validate bound ``ep_dispatch`` (or ``ep_dispatch_send`` / ``_recv``) arguments; return ``(E_local, M)``."""
    hidden = a["hidden"]
    if "topk_ids" in a:
        _check_routing("ep_dispatch", hidden, a["topk_ids"])
    elif hidden.dim() != 2:
        raise ValueError(f"moe_fx.ep_dispatch_recv: hidden must be the send's [T, H], got {list(hidden.shape)}")
    if "ticket" in a and (a["ticket"].dtype != torch.int64 or _shape(a["ticket"]) != (1,)):
        raise ValueError(f"moe_fx.ep_dispatch_recv: ticket must be ep_dispatch_send's int64 [1], got "
                         f"{a['ticket'].dtype} {list(a['ticket'].shape)}")
    if a["use_fp8"] and hidden.shape[1] % FP8_BLOCK:
        raise ValueError(
            f"moe_fx.ep_dispatch: fp8 dispatch quantises 1x{FP8_BLOCK} groups; hidden size {hidden.shape[1]} "
            f"is not a multiple of {FP8_BLOCK} (dispatch it in {hidden.dtype} instead: use_fp8=False)"
        )
    _check_kernel("ep_dispatch", a["kernel_choice"], EP_KERNELS)
    return check_ep_layout(a["num_experts"], a["max_tokens_per_rank"], world, "ep_dispatch")


def check_combine(a: dict, world: int) -> None:
    """Validate bound ``ep_combine`` arguments against the layout ``ep_dispatch`` produced."""
    e_local, m = check_ep_layout(a["num_experts"], a["max_tokens_per_rank"], world, "ep_combine")
    expert_out, topk_ids = a["expert_out"], a["topk_ids"]
    if expert_out.dim() != 3 or _shape(expert_out)[:2] != (e_local, m) or expert_out.dtype not in FLOAT_DTYPES:
        raise ValueError(
            f"moe_fx.ep_combine: expert_out must be a float [E_local={e_local}, M={m}, H] tensor, got "
            f"{expert_out.dtype} {list(expert_out.shape)}"
        )
    if topk_ids.dtype not in ID_DTYPES or topk_ids.dim() != 2:
        raise ValueError(
            f"moe_fx.ep_combine: topk_ids must be int32/int64 [T, K], got {topk_ids.dtype} {list(topk_ids.shape)}"
        )
    _check_topk_weights("ep_combine", topk_ids, a["topk_weights"])
    src_info, layout_range = a["src_info"], a["layout_range"]
    if _shape(src_info) != (e_local, m) or src_info.dtype != torch.int32:
        raise ValueError(
            f"moe_fx.ep_combine: src_info must be int32 [{e_local}, {m}], got {src_info.dtype} {list(src_info.shape)}"
        )
    if _shape(layout_range) != (e_local, world) or layout_range.dtype != torch.int64:
        raise ValueError(
            f"moe_fx.ep_combine: layout_range must be int64 [{e_local}, {world}], got {layout_range.dtype} "
            f"{list(layout_range.shape)}"
        )
    _check_kernel("ep_combine", a["kernel_choice"], EP_KERNELS)


def check_masked_experts(a: dict, where: str = "masked_experts") -> None:
    """Validate bound ``masked_experts`` arguments (masked layout + the experts op's weight contract)."""
    x, masked_m = a["x"], a["masked_m"]
    if x.dim() != 3 or (x.dtype not in FLOAT_DTYPES and x.dtype not in FP8_DTYPES):
        raise ValueError(
            f"moe_fx.{where}: x must be a 3-D [E, M, H] float or fp8 tensor, got {x.dtype} {list(x.shape)}"
        )
    e, _, h = x.shape
    if masked_m.dtype != torch.int32 or _shape(masked_m) != (e,):
        raise ValueError(f"moe_fx.{where}: masked_m must be int32 [{e}], got {masked_m.dtype} {list(masked_m.shape)}")
    _check_weights_of_layout(where, a, e, h)
    x_scale = a["x_scale"]
    if x.dtype in FP8_DTYPES:
        want = (e, x.shape[1], cdiv(h, FP8_BLOCK))
        if x_scale is None or _shape(x_scale) != want or x_scale.dtype != torch.float32:
            got = None if x_scale is None else f"{x_scale.dtype} {list(x_scale.shape)}"
            raise ValueError(f"moe_fx.{where}: fp8 x needs float32 x_scale {list(want)}, got {got}")
    elif x_scale is not None:
        raise ValueError(f"moe_fx.{where}: x_scale given but x is {x.dtype}, not fp8")
    for name in ("w13", "w2"):
        w = a[name]
        if w.dtype not in FP8_DTYPES and x.dtype not in FP8_DTYPES and w.dtype != x.dtype:
            raise TypeError(f"moe_fx.{where}: {name} is {w.dtype} but x is {x.dtype}; they must match")


def _check_weights_of_layout(where: str, a: dict, e: int, h: int) -> None:
    """The expert weights, scales, biases and activation of a masked-layout op with ``e`` experts of width ``h``."""
    w13, w2, gated = a["w13"], a["w2"], a["gated"]
    check_activation(where, a)
    if w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(f"moe_fx.{where}: w13 and w2 must be 3-D, got {list(w13.shape)} and {list(w2.shape)}")
    inter = w2.shape[2]
    n1 = 2 * inter if gated else inter
    if _shape(w13) != (e, n1, h) or _shape(w2) != (e, h, inter):
        raise ValueError(
            f"moe_fx.{where}: want w13 [E={e}, N1, H={h}] (N1 = {'2I' if gated else 'I'}) and w2 [E, H, I], "
            f"got {list(w13.shape)} and {list(w2.shape)}"
        )
    check_weight_scale(where, "w13", w13, a["w13_scale"])
    check_weight_scale(where, "w2", w2, a["w2_scale"])
    _check_bias(where, "w13_bias", a["w13_bias"], (e, n1))
    _check_bias(where, "w2_bias", a["w2_bias"], (e, h))
    _check_kernel(where, a["experts_kernel_choice" if "experts_kernel_choice" in a else "kernel_choice"], KERNELS)


def check_remaining_rounds(a: dict, world: int) -> tuple[int, int]:
    """Validate bound ``ep_remaining_rounds`` arguments; return ``(E_local, M)``."""
    where = "ep_remaining_rounds"
    hidden, topk_ids, first = a["hidden"], a["topk_ids"], a["first_out"]
    _check_routing(where, hidden, topk_ids)
    _check_topk_weights(where, topk_ids, a["topk_weights"])
    e_local, m = check_ep_layout(a["num_experts"], a["max_tokens_per_rank"], world, where)
    t, h = hidden.shape
    want = min(t, a["max_tokens_per_rank"]) if isinstance(t, int) else None
    if first.dim() != 2 or first.shape[1] != h or (want is not None and first.shape[0] != want) \
            or first.dtype not in FLOAT_DTYPES:
        raise ValueError(
            f"moe_fx.{where}: first_out must be the first round's float [min(T, max_tokens_per_rank), H={h}] "
            f"output, got {first.dtype} {list(first.shape)}"
        )
    _check_weights_of_layout(where, a, e_local, h)
    _check_kernel(where, a["kernel_choice"], EP_KERNELS)
    return e_local, m
