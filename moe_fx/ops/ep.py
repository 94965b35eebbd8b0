"""Expert-parallel ops: ``moe_fx::ep_dispatch`` -> ``moe_fx::masked_experts`` -> ``moe_fx::ep_combine``.

With expert parallelism (EP) every rank holds ``E_local = E / world`` of the E experts and runs the
same model on its own tokens. One ``moe_fx::experts`` call is then split into three ops, so that the
graph shows the communication and other work (a block's shared experts) can sit between dispatch and
combine (``masked_experts`` itself lives in :mod:`moe_fx.ops.masked_experts`):

``ep_dispatch(hidden [T, H], topk_ids [T, K], num_experts, max_tokens_per_rank, group_name, use_fp8, kernel_choice)``
    sends each (token, k) pair with ``0 <= topk_ids[t, k] < E`` to the rank owning expert
    ``topk_ids[t, k]`` (rank ``r`` owns experts ``r * E_local .. (r + 1) * E_local - 1``) and returns, on
    every rank, the **masked layout** of what it received, with ``M = max_tokens_per_rank * world``.
    One call is one *round*: ``T <= max_tokens_per_rank`` (larger steps run in several, see below).

    * ``recv_x``       ``[E_local, M, H]``: hidden's dtype, or ``float8_e4m3fn`` when ``use_fp8``;
      only the first ``masked_m[e]`` rows of expert ``e`` are valid, the rest are unspecified.
    * ``recv_scale``   ``use_fp8``: fp32 ``[E_local, M, H / 128]`` per-token 1x128 scales, MN-major
      (``stride == (M * H/128, 1, M)``, DeepEP's and DeepGEMM's layout); otherwise an empty fp32
      ``[E_local, M, 0]``.
    * ``masked_m``     int32 ``[E_local]``.
    * ``src_info``     int32 ``[E_local, M]`` and ``layout_range`` int64 ``[E_local, world]``: the
      handle ``ep_combine`` needs. Their meaning is private to the kernel that produced them (DeepEP:
      source token index and packed ``offset << 32 | count`` per source rank; torch.distributed: see
      :mod:`moe_fx.lowering.prepare_finalize`); only their shapes and dtypes are contract.

``ep_dispatch_send(<ep_dispatch's arguments>) -> ticket`` and ``ep_dispatch_recv(ticket, hidden, <the rest>)``
    ``ep_dispatch`` in two halves: the send returns at once with the tokens in flight (an int64 ``[1]``
    ticket stands for them), the receive waits for them and returns ``ep_dispatch``'s five outputs.
    What the graph runs in between (a block's shared experts, which ``split_ep`` places there)
    overlaps the transfer: DeepEP's receive hook, or an asynchronous collective. Each send must be
    received exactly once, in the same order on every rank.

``ep_combine(expert_out [E_local, M, H], topk_ids, topk_weights, src_info, layout_range, ...)``
    returns each processed row to the rank and token it came from and sums them weighted by
    ``topk_weights``: ``out[t] = sum_k topk_weights[t, k] * expert_out_row(t, k)`` as ``[T, H]`` in
    ``expert_out.dtype``. ``use_fp8`` and ``kernel_choice`` must be the dispatch's: the kernel is chosen
    from the same static values on both sides, so the pair always runs on one kernel.

**Steps of any size.** A step in which some rank has more than ``max_tokens_per_rank`` tokens runs in
``R`` rounds of at most ``max_tokens_per_rank`` tokens per rank, ``R`` the same on every rank:

``ep_agree_step(num_tokens, max_tokens_per_rank, group_name) -> R``
    collective (every rank of the group, once per step, before the step's EP ops). It runs on the host
    over a CPU (gloo) process group, so it never waits for the GPU: ``R = max(1, ceil(max_r
    num_tokens_r / max_tokens_per_rank))``. The group's ``ep_remaining_rounds`` calls use it until the
    next agreement. The graphs ``split_ep`` compiles call it before every call.
``ep_remaining_rounds(first_out, hidden, topk_ids, topk_weights, w13, w2, num_experts, max_tokens_per_rank, group_name, use_fp8, kernel_choice, *, <masked_experts arguments>, experts_kernel_choice)``
    ``first_out`` is round 0's combined output (tokens ``[0, min(T, max_tokens_per_rank))``). Runs
    rounds ``1 .. R - 1`` (dispatch -> masked_experts -> combine on tokens ``[r * max, (r + 1) * max)``,
    empty on a rank with fewer tokens) and returns all ``[T, H]``. With ``R == 1`` (every rank at most
    ``max_tokens_per_rank`` tokens) it runs no collective and only copies ``first_out``. ``R > 1`` cannot
    run inside a CUDA graph: once one was captured, such a step is a ``ValueError`` on every rank.
    ``kernel_choice`` is the dispatch/combine kernel (as for ``ep_dispatch``), ``experts_kernel_choice`` the
    ``masked_experts`` one.

``kernel_choice`` is the kernel choice on every op (``MoEConfig.kernel``; see :data:`~moe_fx.ops.checks.KERNELS`
for why the op argument is not called ``kernel``): ``"auto"`` or a name of :data:`~moe_fx.ops.checks.EP_KERNELS`
for the communication ops (``experts_kernel_choice``: of :data:`~moe_fx.ops.checks.KERNELS`).

Process groups cannot be op arguments; the ops take the group's c10d name (``group.group_name``, the
same registry torch's functional collectives use) and resolve it with :func:`resolve_ep_group`.

This module holds schemas and fake implementations (the input checks are in :mod:`moe_fx.ops.checks`)
and imports nothing from the lowering. The communication ops have no device-free reference: importing
:mod:`moe_fx.lowering` registers their implementations (torch.distributed on any backend it supports,
gloo on CPU and NCCL on GPU, and DeepEP's low-latency kernels where they fit).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from moe_fx.ops.checks import EP_KERNELS, check_combine, check_dispatch, check_remaining_rounds
from moe_fx.ops.recipe import FP8_BLOCK, FP8_DTYPE
from moe_fx.ops.signature import binder

__all__ = [
    "EP_KERNELS",
    "bind_combine",
    "bind_dispatch",
    "bind_dispatch_recv",
    "bind_dispatch_send",
    "bind_remaining_rounds",
    "dispatch_outputs",
    "ep_agree_step",
    "ep_combine",
    "ep_dispatch",
    "ep_dispatch_recv",
    "ep_dispatch_send",
    "ep_group_name",
    "ep_remaining_rounds",
    "group_size",
    "resolve_ep_group",
]


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



def group_size(group_name: str) -> int:
    """Ranks in the process group named ``group_name``."""
    return resolve_ep_group(group_name).size()


# --------------------------------------------------------------------------------------------------
# Schemas. torch.library.Library rather than custom_op: the kernels are reached straight from the C++
# dispatcher, without custom_op's Python autograd and dynamo-disable wrappers (~100 µs per
# dispatch+combine pair in eager mode, measured with a stubbed DeepEP). No autograd (inference only),
# like the other moe_fx ops. Implementations: moe_fx.lowering.
# --------------------------------------------------------------------------------------------------

_LIB = torch.library.Library("moe_fx", "FRAGMENT")
_LIB.define(
    "ep_dispatch(Tensor hidden, Tensor topk_ids, int num_experts, int max_tokens_per_rank, str group_name, "
    "bool use_fp8=False, str kernel_choice='auto') -> (Tensor, Tensor, Tensor, Tensor, Tensor)"
)
_LIB.define(
    "ep_combine(Tensor expert_out, Tensor topk_ids, Tensor topk_weights, Tensor src_info, Tensor layout_range, "
    "int num_experts, int max_tokens_per_rank, str group_name, bool use_fp8=False, str kernel_choice='auto') -> Tensor"
)
_LIB.define(
    "ep_dispatch_send(Tensor hidden, Tensor topk_ids, int num_experts, int max_tokens_per_rank, str group_name, "
    "bool use_fp8=False, str kernel_choice='auto') -> Tensor"
)
_LIB.define(
    "ep_dispatch_recv(Tensor ticket, Tensor hidden, int num_experts, int max_tokens_per_rank, str group_name, "
    "bool use_fp8=False, str kernel_choice='auto') -> (Tensor, Tensor, Tensor, Tensor, Tensor)"
)
_LIB.define("ep_agree_step(int num_tokens, int max_tokens_per_rank, str group_name) -> int")
_LIB.define(
    "ep_remaining_rounds(Tensor first_out, Tensor hidden, Tensor topk_ids, Tensor topk_weights, Tensor w13, "
    "Tensor w2, int num_experts, int max_tokens_per_rank, str group_name, bool use_fp8=False, "
    "str kernel_choice='auto', *, str activation='silu', Tensor? w13_scale=None, Tensor? w2_scale=None, "
    "Tensor? w13_bias=None, Tensor? w2_bias=None, bool gated=True, str gate_up_layout='halves', "
    "float alpha=1.0, float? limit=None, float up_offset=0.0, SymInt expected_m=0, str experts_kernel_choice='auto') -> Tensor"
)

#: The ops' arguments by name (each op's one signature is its schema above).
bind_dispatch = binder("moe_fx::ep_dispatch")
bind_combine = binder("moe_fx::ep_combine")
bind_dispatch_send = binder("moe_fx::ep_dispatch_send")
bind_dispatch_recv = binder("moe_fx::ep_dispatch_recv")
bind_remaining_rounds = binder("moe_fx::ep_remaining_rounds")

#: ``ep_dispatch(...)`` -> ``(recv_x, recv_scale, masked_m, src_info, layout_range)``. Collective.
ep_dispatch = torch.ops.moe_fx.ep_dispatch
#: ``ep_dispatch_send(...)`` -> ticket: ``ep_dispatch`` started (the tokens in flight). Collective.
ep_dispatch_send = torch.ops.moe_fx.ep_dispatch_send
#: ``ep_dispatch_recv(ticket, hidden, ...)`` -> ``ep_dispatch``'s five outputs, once the tokens arrived.
ep_dispatch_recv = torch.ops.moe_fx.ep_dispatch_recv
#: ``ep_combine(...)`` -> ``[T, H]``. Collective, after the matching ``ep_dispatch``.
ep_combine = torch.ops.moe_fx.ep_combine
#: ``ep_agree_step(num_tokens, max_tokens_per_rank, group_name)`` -> rounds of this step. Collective.
ep_agree_step = torch.ops.moe_fx.ep_agree_step
#: ``ep_remaining_rounds(first_out, ...)`` -> ``[T, H]``. Collective when the agreed rounds exceed 1.
ep_remaining_rounds = torch.ops.moe_fx.ep_remaining_rounds


def dispatch_outputs(
    hidden: torch.Tensor, e_local: int, m: int, h: int, world: int, use_fp8: bool, *, zero: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Allocate the five ``ep_dispatch`` outputs with the contract's shapes, dtypes and strides."""
    new = hidden.new_zeros if zero else hidden.new_empty
    recv_x = new((e_local, m, h), dtype=FP8_DTYPE if use_fp8 else hidden.dtype)
    if use_fp8:
        # MN-major scales: allocated [E, H/128, M] and viewed transposed (DeepEP's own layout).
        recv_scale = new((e_local, h // FP8_BLOCK, m), dtype=torch.float32).transpose(1, 2)
    else:
        recv_scale = new((e_local, m, 0), dtype=torch.float32)
    masked_m = new((e_local,), dtype=torch.int32)
    src_info = new((e_local, m), dtype=torch.int32)
    layout_range = new((e_local, world), dtype=torch.int64)
    return recv_x, recv_scale, masked_m, src_info, layout_range


@torch.library.register_fake("moe_fx::ep_dispatch")
def _ep_dispatch_fake(*args: object, **kwargs: object) -> tuple[torch.Tensor, ...]:
    return _received_fake(bind_dispatch(*args, **kwargs))


def _received_fake(a: dict[str, object]) -> tuple[torch.Tensor, ...]:
    """The received buffers of a dispatch (whole, or its receive half) from its bound arguments."""
    world = group_size(a["group_name"])
    e_local, m = check_dispatch(a, world)
    hidden = a["hidden"]
    return dispatch_outputs(hidden, e_local, m, hidden.shape[1], world, a["use_fp8"])


@torch.library.register_fake("moe_fx::ep_dispatch_send")
def _ep_dispatch_send_fake(*args: object, **kwargs: object) -> torch.Tensor:
    a = bind_dispatch_send(*args, **kwargs)
    check_dispatch(a, group_size(a["group_name"]))
    return a["hidden"].new_empty((1,), dtype=torch.int64)


@torch.library.register_fake("moe_fx::ep_dispatch_recv")
def _ep_dispatch_recv_fake(*args: object, **kwargs: object) -> tuple[torch.Tensor, ...]:
    return _received_fake(bind_dispatch_recv(*args, **kwargs))


@torch.library.register_fake("moe_fx::ep_combine")
def _ep_combine_fake(*args: object, **kwargs: object) -> torch.Tensor:
    a = bind_combine(*args, **kwargs)
    check_combine(a, group_size(a["group_name"]))
    return a["expert_out"].new_empty((a["topk_ids"].shape[0], a["expert_out"].shape[2]))


@torch.library.register_fake("moe_fx::ep_remaining_rounds")
def _ep_remaining_rounds_fake(*args: object, **kwargs: object) -> torch.Tensor:
    a = bind_remaining_rounds(*args, **kwargs)
    check_remaining_rounds(a, group_size(a["group_name"]))
    return a["first_out"].new_empty(a["hidden"].shape)
