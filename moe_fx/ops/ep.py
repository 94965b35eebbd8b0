"""Expert-parallel ops: ``moe_fx::ep_dispatch`` -> ``moe_fx::masked_experts`` -> ``moe_fx::ep_combine``.

With expert parallelism (EP) every rank holds ``E_local = E / world`` of the E experts and runs the
same model on its own tokens. One ``moe_fx::experts`` call is then split into three ops, so that the
graph shows the communication and other work (a block's shared experts) can sit between dispatch and
combine:

``ep_dispatch(hidden [T, H], topk_ids [T, K], num_experts, max_tokens_per_rank, group_name, use_fp8, backend)``
    sends each (token, k) pair with ``topk_ids[t, k] >= 0`` to the rank owning expert ``topk_ids[t, k]``
    (rank ``r`` owns experts ``r * E_local .. (r + 1) * E_local - 1``) and returns, on every rank, the
    **masked layout** of what it received, with ``M = max_tokens_per_rank * world``:

    * ``recv_x``       ``[E_local, M, H]``: hidden's dtype, or ``float8_e4m3fn`` when ``use_fp8``;
      only the first ``masked_m[e]`` rows of expert ``e`` are valid, the rest are unspecified.
    * ``recv_scale``   ``use_fp8``: fp32 ``[E_local, M, H / 128]`` per-token 1x128 scales, MN-major
      (``stride == (M * H/128, 1, M)``, DeepEP's and DeepGEMM's layout); otherwise an empty fp32
      ``[E_local, M, 0]``.
    * ``masked_m``     int32 ``[E_local]``.
    * ``src_info``     int32 ``[E_local, M]`` and ``layout_range`` int64 ``[E_local, world]``: the
      handle ``ep_combine`` needs. Their meaning is private to the backend that produced them (DeepEP:
      source token index and packed ``offset << 32 | count`` per source rank; torch.distributed: see
      :mod:`moe_fx.lowering.prepare_finalize.torch_dist`); only their shapes and dtypes are contract.

``masked_experts(x [E_local, M, H], masked_m [E_local], w13 [E_local, 2I, H], w2 [E_local, H, I], ...)``
    runs expert ``e``'s gated MLP on the first ``masked_m[e]`` rows of ``x[e]`` (DeepGEMM's masked
    grouped-GEMM contract). Returns ``[E_local, M, H]`` in ``x.dtype`` (bf16 when ``x`` is fp8, which
    then needs ``x_scale``); rows past ``masked_m[e]`` are unspecified.

``ep_combine(expert_out [E_local, M, H], topk_ids, topk_weights, src_info, layout_range, ...)``
    returns each processed row to the rank and token it came from and sums them weighted by
    ``topk_weights``: ``out[t] = sum_k topk_weights[t, k] * expert_out_row(t, k)`` as ``[T, H]`` in
    ``expert_out.dtype``. ``use_fp8`` must be the dispatch's: the backend is chosen from the same
    static values on both sides, so the pair always runs on one backend.

Process groups cannot be op arguments; the ops take the group's c10d name (``group.group_name``, the
same registry torch's functional collectives use) and resolve it with :func:`resolve_ep_group`.

Limits: a rank with more than ``max_tokens_per_rank`` tokens is an error on every rank (see
:mod:`moe_fx.lowering.prepare_finalize.ep`, which explains why this is not chunked). ``T = 0`` works.

This module holds schemas, fake implementations, the masked-experts reference and input checks, and
imports nothing from the lowering. The communication ops have no device-free reference: importing
:mod:`moe_fx.lowering` registers their implementations (torch.distributed on any backend it supports,
gloo on CPU and NCCL on GPU, and DeepEP's low-latency kernels where they fit).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from moe_fx.ops.checks import FLOAT_DTYPES, ID_DTYPES, check_activation, check_weight_scale
from moe_fx.ops.experts import ExpertActivation, dequantize_blockwise
from moe_fx.ops.recipe import FP8_BLOCK, FP8_DTYPE, cdiv

__all__ = [
    "EP_BACKENDS",
    "dequantize_activations",
    "ep_combine",
    "ep_dispatch",
    "ep_group_name",
    "masked_experts",
    "masked_experts_reference",
    "resolve_ep_group",
]

#: Backend requests the EP ops accept: ``"auto"`` lets the lowering pick.
EP_BACKENDS = ("auto", "torch_dist", "deepep")
_FP8 = FP8_DTYPE


# --------------------------------------------------------------------------------------------------
# Process groups by name
# --------------------------------------------------------------------------------------------------


def ep_group_name(group: object) -> str:
    """The c10d name of an EP process group, for the ops' ``group_name`` argument.

    ``group`` may be a ``ProcessGroup``, ``"default"`` (or ``None``) for the default group, or the
    c10d name of a group. Raises ``ValueError`` when torch.distributed is not initialised or the name
    is unknown.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(
            "moe_fx expert parallelism needs an initialised torch.distributed process group "
            "(call torch.distributed.init_process_group first)"
        )
    if group is None or group == "default":
        group = dist.group.WORLD
    if isinstance(group, str):
        resolve_ep_group(group)
        return group
    name = getattr(group, "group_name", None)
    if not isinstance(name, str):
        raise TypeError(f"moe_fx: ep_group must be a ProcessGroup, 'default' or a group name, got {type(group)}")
    return name


def resolve_ep_group(group_name: str) -> dist.ProcessGroup:
    """The ``ProcessGroup`` registered under ``group_name`` (c10d's registry); ``ValueError`` if none."""
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(f"moe_fx: process group {group_name!r} asked for, but torch.distributed is not initialised")
    from torch.distributed.distributed_c10d import _resolve_process_group

    try:
        return _resolve_process_group(group_name)
    except (ValueError, RuntimeError, KeyError) as e:
        raise ValueError(f"moe_fx: no process group named {group_name!r} ({e})") from e


def _world(group_name: str) -> tuple[int, int]:
    g = resolve_ep_group(group_name)
    return g.size(), g.rank()


# --------------------------------------------------------------------------------------------------
# Checks (ValueError / TypeError with shapes and dtypes; used by fake and real implementations)
# --------------------------------------------------------------------------------------------------


def _check_layout_sizes(num_experts: int, max_tokens_per_rank: int, world: int, where: str) -> tuple[int, int]:
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


def _check_backend(backend: str, where: str) -> None:
    if backend not in EP_BACKENDS:
        raise ValueError(f"moe_fx.{where}: unknown backend {backend!r}; known: {EP_BACKENDS}")


def check_dispatch_inputs(
    hidden: torch.Tensor,
    topk_ids: torch.Tensor,
    num_experts: int,
    max_tokens_per_rank: int,
    world: int,
    use_fp8: bool,
    backend: str,
) -> tuple[int, int]:
    """Validate ``ep_dispatch`` inputs; return ``(E_local, M)``."""
    if hidden.dim() != 2 or hidden.dtype not in FLOAT_DTYPES:
        raise ValueError(
            f"moe_fx.ep_dispatch: hidden must be a 2-D [T, H] tensor of {FLOAT_DTYPES}, got {hidden.dtype} "
            f"{list(hidden.shape)}"
        )
    if topk_ids.dtype not in ID_DTYPES or topk_ids.dim() != 2 or topk_ids.shape[0] != hidden.shape[0]:
        raise ValueError(
            f"moe_fx.ep_dispatch: topk_ids must be int32/int64 [T, K] with T = {hidden.shape[0]}, got "
            f"{topk_ids.dtype} {list(topk_ids.shape)}"
        )
    if use_fp8 and hidden.shape[1] % FP8_BLOCK:
        raise ValueError(
            f"moe_fx.ep_dispatch: fp8 dispatch quantises 1x{FP8_BLOCK} groups; hidden size {hidden.shape[1]} "
            f"is not a multiple of {FP8_BLOCK}"
        )
    _check_backend(backend, "ep_dispatch")
    return _check_layout_sizes(num_experts, max_tokens_per_rank, world, "ep_dispatch")


def check_combine_inputs(
    expert_out: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    src_info: torch.Tensor,
    layout_range: torch.Tensor,
    num_experts: int,
    max_tokens_per_rank: int,
    world: int,
    backend: str,
) -> None:
    """Validate ``ep_combine`` inputs against the layout ``ep_dispatch`` produced."""
    e_local, m = _check_layout_sizes(num_experts, max_tokens_per_rank, world, "ep_combine")
    if expert_out.dim() != 3 or tuple(expert_out.shape[:2]) != (e_local, m) or expert_out.dtype not in FLOAT_DTYPES:
        raise ValueError(
            f"moe_fx.ep_combine: expert_out must be a float [E_local={e_local}, M={m}, H] tensor, got "
            f"{expert_out.dtype} {list(expert_out.shape)}"
        )
    if topk_ids.dtype not in ID_DTYPES or topk_ids.dim() != 2:
        raise ValueError(
            f"moe_fx.ep_combine: topk_ids must be int32/int64 [T, K], got {topk_ids.dtype} {list(topk_ids.shape)}"
        )
    if tuple(topk_weights.shape) != tuple(topk_ids.shape) or not topk_weights.dtype.is_floating_point:
        raise ValueError(
            f"moe_fx.ep_combine: topk_weights must be float {list(topk_ids.shape)}, got {topk_weights.dtype} "
            f"{list(topk_weights.shape)}"
        )
    if tuple(src_info.shape) != (e_local, m) or src_info.dtype != torch.int32:
        raise ValueError(
            f"moe_fx.ep_combine: src_info must be int32 [{e_local}, {m}], got {src_info.dtype} {list(src_info.shape)}"
        )
    if tuple(layout_range.shape) != (e_local, world) or layout_range.dtype != torch.int64:
        raise ValueError(
            f"moe_fx.ep_combine: layout_range must be int64 [{e_local}, {world}], got {layout_range.dtype} "
            f"{list(layout_range.shape)}"
        )
    _check_backend(backend, "ep_combine")


def check_masked_experts_inputs(
    x: torch.Tensor,
    masked_m: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    activation: str,
    x_scale: torch.Tensor | None,
    w13_scale: torch.Tensor | None,
    w2_scale: torch.Tensor | None,
    *,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    gated: bool = True,
    gate_up_layout: str = "halves",
    alpha: float = 1.0,
    limit: float | None = None,
    up_offset: float = 0.0,
) -> None:
    """Validate ``masked_experts`` inputs (masked layout + experts-op weight contract)."""
    if x.dim() != 3 or (x.dtype not in FLOAT_DTYPES and x.dtype != _FP8):
        raise ValueError(
            f"moe_fx.masked_experts: x must be a 3-D [E, M, H] float or fp8 tensor, got {x.dtype} {list(x.shape)}"
        )
    e, _, h = x.shape
    if masked_m.dtype != torch.int32 or tuple(masked_m.shape) != (e,):
        raise ValueError(
            f"moe_fx.masked_experts: masked_m must be int32 [{e}], got {masked_m.dtype} {list(masked_m.shape)}"
        )
    check_activation("masked_experts", activation, gated, gate_up_layout, alpha, limit, up_offset)
    if w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(f"moe_fx.masked_experts: w13 and w2 must be 3-D, got {list(w13.shape)} and {list(w2.shape)}")
    inter = w2.shape[2]
    n1 = 2 * inter if gated else inter
    if tuple(w13.shape) != (e, n1, h) or tuple(w2.shape) != (e, h, inter):
        raise ValueError(
            f"moe_fx.masked_experts: want w13 [E={e}, N1, H={h}] (N1 = {'2I' if gated else 'I'}) and w2 [E, H, I], "
            f"got {list(w13.shape)} and {list(w2.shape)}"
        )
    if x.dtype == _FP8:
        want = (e, x.shape[1], cdiv(h, FP8_BLOCK))
        if x_scale is None or tuple(x_scale.shape) != want or x_scale.dtype != torch.float32:
            got = None if x_scale is None else f"{x_scale.dtype} {list(x_scale.shape)}"
            raise ValueError(f"moe_fx.masked_experts: fp8 x needs float32 x_scale {list(want)}, got {got}")
    elif x_scale is not None:
        raise ValueError(f"moe_fx.masked_experts: x_scale given but x is {x.dtype}, not fp8")
    for name, w, s in (("w13", w13, w13_scale), ("w2", w2, w2_scale)):
        check_weight_scale("masked_experts", name, w, s)
        if w.dtype != _FP8 and x.dtype != _FP8 and w.dtype != x.dtype:
            raise TypeError(f"moe_fx.masked_experts: {name} is {w.dtype} but x is {x.dtype}; they must match")
    for name, b, want in (("w13_bias", w13_bias, (e, n1)), ("w2_bias", w2_bias, (e, h))):
        if b is not None and (tuple(b.shape) != want or not b.dtype.is_floating_point or b.dtype == _FP8):
            raise ValueError(f"moe_fx.masked_experts: {name} must be a float {list(want)} tensor, got {b.dtype} "
                             f"{list(b.shape)}")


def masked_output_dtype(x: torch.Tensor) -> torch.dtype:
    """``masked_experts`` returns bf16 for fp8 tokens, else the tokens' dtype."""
    return torch.bfloat16 if x.dtype == _FP8 else x.dtype


# --------------------------------------------------------------------------------------------------
# The three ops are defined with torch.library.Library rather than custom_op: their kernels are
# reached straight from the C++ dispatcher, without custom_op's Python autograd and dynamo-disable
# wrappers (~100 µs per dispatch+combine pair in eager mode, measured with a stubbed DeepEP). They have
# no autograd (inference only), like the other moe_fx ops. Implementations: moe_fx.lowering.
# --------------------------------------------------------------------------------------------------

_LIB = torch.library.Library("moe_fx", "FRAGMENT")

_DISPATCH_SCHEMA = (
    "(Tensor hidden, Tensor topk_ids, int num_experts, int max_tokens_per_rank, str group_name, "
    "bool use_fp8=False, str backend='auto') -> (Tensor, Tensor, Tensor, Tensor, Tensor)"
)
_LIB.define("ep_dispatch" + _DISPATCH_SCHEMA)

#: ``ep_dispatch(hidden, topk_ids, num_experts, max_tokens_per_rank, group_name, use_fp8, backend)``:
#: send tokens to the ranks of their experts; returns ``(recv_x, recv_scale, masked_m, src_info,
#: layout_range)`` (see the module docstring). Collective: every rank of the group must call it.
ep_dispatch = torch.ops.moe_fx.ep_dispatch


@torch.library.register_fake("moe_fx::ep_dispatch")
def _ep_dispatch_fake(
    hidden: torch.Tensor,
    topk_ids: torch.Tensor,
    num_experts: int,
    max_tokens_per_rank: int,
    group_name: str,
    use_fp8: bool = False,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    world, _ = _world(group_name)
    e_local, m = check_dispatch_inputs(hidden, topk_ids, num_experts, max_tokens_per_rank, world, use_fp8, backend)
    h = hidden.shape[1]
    return dispatch_outputs(hidden, e_local, m, h, world, use_fp8)


def dispatch_outputs(
    hidden: torch.Tensor, e_local: int, m: int, h: int, world: int, use_fp8: bool, *, zero: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Allocate the five ``ep_dispatch`` outputs with the contract's shapes, dtypes and strides."""
    new = hidden.new_zeros if zero else hidden.new_empty
    recv_x = new((e_local, m, h), dtype=_FP8 if use_fp8 else hidden.dtype)
    if use_fp8:
        # MN-major scales: allocated [E, H/128, M] and viewed transposed (DeepEP's own layout).
        recv_scale = new((e_local, h // FP8_BLOCK, m), dtype=torch.float32).transpose(1, 2)
    else:
        recv_scale = new((e_local, m, 0), dtype=torch.float32)
    masked_m = new((e_local,), dtype=torch.int32)
    src_info = new((e_local, m), dtype=torch.int32)
    layout_range = new((e_local, world), dtype=torch.int64)
    return recv_x, recv_scale, masked_m, src_info, layout_range


# --------------------------------------------------------------------------------------------------
# masked_experts
# --------------------------------------------------------------------------------------------------

_MASKED_SCHEMA = (
    "(Tensor x, Tensor masked_m, Tensor w13, Tensor w2, str activation='silu', Tensor? x_scale=None, "
    "Tensor? w13_scale=None, Tensor? w2_scale=None, SymInt expected_m=0, str impl='auto', *, "
    "Tensor? w13_bias=None, Tensor? w2_bias=None, bool gated=True, str gate_up_layout='halves', "
    "float alpha=1.0, float? limit=None, float up_offset=0.0) -> Tensor"
)
_LIB.define("masked_experts" + _MASKED_SCHEMA)


def dequantize_activations(x: torch.Tensor, x_scale: torch.Tensor) -> torch.Tensor:
    """fp8 ``[..., H]`` with fp32 1x128 scales ``[..., ceil(H/128)]`` -> fp32 ``[..., H]``."""
    h = x.shape[-1]
    return x.float() * x_scale.float().repeat_interleave(FP8_BLOCK, dim=-1)[..., :h]


def masked_experts_reference(
    x: torch.Tensor,
    masked_m: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    activation: str = "silu",
    x_scale: torch.Tensor | None = None,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    *,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    gated: bool = True,
    gate_up_layout: str = "halves",
    alpha: float = 1.0,
    limit: float | None = None,
    up_offset: float = 0.0,
) -> torch.Tensor:
    """fp32 computation of ``masked_experts`` (the oracle): expert ``e`` on the first ``masked_m[e]`` rows of ``x[e]``.

    Returns ``[E, M, H]`` in ``x.dtype`` (bf16 for fp8 ``x``); rows past ``masked_m[e]`` are zero.
    """
    spec = ExpertActivation(activation, gated, gate_up_layout, alpha, limit, up_offset)
    e_local, m, h = x.shape
    out = torch.zeros(e_local, m, h, dtype=masked_output_dtype(x), device=x.device)
    counts = masked_m.tolist()
    for e, n in enumerate(counts):
        if n < 0 or n > m:
            raise ValueError(f"moe_fx.masked_experts: masked_m[{e}] = {n} is outside [0, M={m}]")
        if n == 0:
            continue
        xe = x[e, :n]
        xe = dequantize_activations(xe, x_scale[e, :n]) if x.dtype == _FP8 else xe.float()
        w13_e = w13[e].float() if w13_scale is None else dequantize_blockwise(w13[e], w13_scale[e])
        w2_e = w2[e].float() if w2_scale is None else dequantize_blockwise(w2[e], w2_scale[e])
        h1 = xe @ w13_e.t()
        if w13_bias is not None:
            h1 = h1 + w13_bias[e].float()
        y = spec.apply(h1) @ w2_e.t()
        if w2_bias is not None:
            y = y + w2_bias[e].float()
        out[e, :n] = y.to(out.dtype)
    return out


def masked_experts_args(
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
    *,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    gated: bool = True,
    gate_up_layout: str = "halves",
    alpha: float = 1.0,
    limit: float | None = None,
    up_offset: float = 0.0,
) -> dict:
    """``masked_experts``' arguments by name (the one Python copy of its signature; see ``experts_args``)."""
    return dict(locals())


def masked_check_call(a: dict) -> None:
    """:func:`check_masked_experts_inputs` on bound arguments (:func:`masked_experts_args`)."""
    check_masked_experts_inputs(**{k: v for k, v in a.items() if k not in ("expected_m", "impl")})


def masked_reference_of(a: dict) -> torch.Tensor:
    """:func:`masked_experts_reference` on bound arguments (``expected_m`` and ``impl`` are hints)."""
    return masked_experts_reference(**{k: v for k, v in a.items() if k not in ("expected_m", "impl")})


def _masked_experts_default(*args: object, **kwargs: object) -> torch.Tensor:
    """Default implementation of ``masked_experts`` (any device without a lowering kernel): the reference."""
    a = masked_experts_args(*args, **kwargs)
    masked_check_call(a)
    return masked_reference_of(a)


_LIB.impl("masked_experts", _masked_experts_default, "CompositeExplicitAutograd")

#: ``masked_experts(x [E, M, H], masked_m [E], w13, w2, activation, x_scale, w13_scale, w2_scale,
#: expected_m, impl, *, biases and activation parameters as in moe_fx::experts)``: expert MLPs on the
#: masked layout (first ``masked_m[e]`` rows of ``x[e]`` valid) -> ``[E, M, H]``. ``expected_m`` is a
#: load hint for DeepGEMM's heuristics (0: unknown); ``impl`` a kernel request for the lowering.
masked_experts = torch.ops.moe_fx.masked_experts


@torch.library.register_fake("moe_fx::masked_experts")
def _masked_experts_fake(*args: object, **kwargs: object) -> torch.Tensor:
    a = masked_experts_args(*args, **kwargs)
    masked_check_call(a)
    return a["x"].new_empty(a["x"].shape, dtype=masked_output_dtype(a["x"]))


# --------------------------------------------------------------------------------------------------
# ep_combine
# --------------------------------------------------------------------------------------------------

_COMBINE_SCHEMA = (
    "(Tensor expert_out, Tensor topk_ids, Tensor topk_weights, Tensor src_info, Tensor layout_range, "
    "int num_experts, int max_tokens_per_rank, str group_name, bool use_fp8=False, str backend='auto') -> Tensor"
)
_LIB.define("ep_combine" + _COMBINE_SCHEMA)

#: ``ep_combine(expert_out, topk_ids, topk_weights, src_info, layout_range, num_experts,
#: max_tokens_per_rank, group_name, use_fp8, backend)``: return processed rows to their tokens and sum
#: them weighted, ``[T, H]`` in ``expert_out.dtype``. Collective, after the matching ``ep_dispatch``.
ep_combine = torch.ops.moe_fx.ep_combine


@torch.library.register_fake("moe_fx::ep_combine")
def _ep_combine_fake(
    expert_out: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    src_info: torch.Tensor,
    layout_range: torch.Tensor,
    num_experts: int,
    max_tokens_per_rank: int,
    group_name: str,
    use_fp8: bool = False,
    backend: str = "auto",
) -> torch.Tensor:
    world, _ = _world(group_name)
    check_combine_inputs(
        expert_out, topk_ids, topk_weights, src_info, layout_range, num_experts, max_tokens_per_rank, world, backend
    )
    return expert_out.new_empty((topk_ids.shape[0], expert_out.shape[2]))
