"""DeepEP low-latency dispatch/combine behind the ``moe_fx::ep_dispatch`` / ``ep_combine`` contract.

One ``deep_ep.Buffer`` in low-latency mode per process group (keyed by its c10d name), sized with
``Buffer.get_low_latency_rdma_size_hint(max_tokens_per_rank, hidden, world, E)`` and
``num_qps_per_rank = E_local``, created on first use and reused by every MoE layer. A later layer
that needs more (a larger hidden size or more experts) replaces it; buffer creation is collective,
which is safe because every rank runs the same model and so asks in the same order.

* dispatch: ``low_latency_dispatch(x bf16 [T, H], topk_idx int64, max_tokens_per_rank, E,
  use_fp8=..., return_recv_hook=True)`` in :func:`dispatch_send`, its receive hook in
  :func:`dispatch_recv` (what runs in between overlaps the transfer). Its outputs are the masked layout as is: ``recv_x [E_local, M, H]`` (fp8 with fp32
  MN-major 1x128 scales when ``use_fp8``, ready for DeepGEMM without a copy), ``recv_count`` as
  ``masked_m``, and the handle's two tensors as ``src_info`` / ``layout_range``.
* combine: ``low_latency_combine(y bf16 [E_local, M, H], topk_idx, topk_weights fp32, handle)``, which
  applies the routing weights and sums over top-k.

Which problems it takes: :func:`supports` (used by :mod:`moe_fx.lowering.select`). A rank with more than
``max_tokens_per_rank`` tokens in one round raises here, before the collective; the other ranks then
wait in DeepEP's kernels until its own timeout (DeepEP has no count exchange to tell them). Steps
larger than that run in rounds agreed beforehand (:mod:`.rounds`), so ``split_ep``'s graphs never do.

**Hidden sizes DeepEP was not compiled for** (GPT-OSS's 2880, for instance): the LL kernels exist for
:data:`DEEPEP_LL_HIDDEN` only. Under ``kernel="auto"`` such a layer takes the fixed-size
torch.distributed exchange, unpadded (logged). Requested explicitly (``kernel="deepep"``) it is
padded with zero columns to the next compiled size, and says so once in the log: the wire then
carries ``H_pad / H`` times the bytes, dispatch copies the received layout down to H columns and
combine copies the experts' output up to ``H_pad`` (two copies of ``[E_local, M, H]``).
"""

from __future__ import annotations

import importlib
import logging
from typing import Any

import torch
import torch.distributed as dist

from moe_fx.lowering.problem import Capabilities, DispatchProblem

__all__ = [
    "DEEPEP_LL_HIDDEN",
    "DEEPEP_LL_MAX_TOPK",
    "NAME",
    "combine",
    "dispatch_recv",
    "dispatch_send",
    "get_buffer",
    "padded_hidden",
    "supports",
]

NAME = "deepep"
#: Hidden sizes the low-latency kernels of the DeepEP sources we build (V1 API, 2025-08) are compiled
#: for (their ``SWITCH_HIDDEN``); later versions add 3072.
DEEPEP_LL_HIDDEN: tuple[int, ...] = (2048, 2560, 4096, 5120, 6144, 7168, 8192)
#: Largest top-k of those sources' LL dispatch (``kNumMaxTopK = 9``; later versions allow 11).
DEEPEP_LL_MAX_TOPK = 9


def padded_hidden(hidden: int, supported_hidden: tuple[int, ...] = DEEPEP_LL_HIDDEN) -> int | None:
    """The compiled hidden size DeepEP runs ``hidden`` at: itself, the next larger one, or None."""
    fits = [s for s in supported_hidden if s >= hidden]
    return min(fits) if fits else None


def supports(
    problem: DispatchProblem,
    caps: Capabilities,
    *,
    supported_hidden: tuple[int, ...] = DEEPEP_LL_HIDDEN,
    max_top_k: int = DEEPEP_LL_MAX_TOPK,
) -> tuple[bool, str]:
    """Can DeepEP's low-latency dispatch/combine run ``problem``? ``(True, "")`` or ``(False, reason)``."""
    if not problem.expert_parallel:
        return False, "not expert-parallel (one device: the local permute)"
    if caps.deep_ep_error is not None:
        return False, caps.deep_ep_error
    if problem.device_type != "cuda":
        return False, f"needs CUDA tensors, got {problem.device_type}"
    if problem.dtype != "bfloat16":
        return False, f"needs bfloat16 activations, got {problem.dtype}"
    padded = padded_hidden(problem.hidden, supported_hidden)
    if padded is None:
        return False, f"hidden size {problem.hidden} not compiled into its LL kernels (supported: {supported_hidden})"
    if problem.top_k > max_top_k:
        return False, f"top-k {problem.top_k} above its limit {max_top_k}"
    if problem.num_experts % problem.world_size:
        return False, f"{problem.num_experts} experts not divisible by {problem.world_size} ranks"
    if (problem.max_tokens_per_rank * problem.world_size) % 4:
        return False, (
            f"max_tokens_per_rank * world = {problem.max_tokens_per_rank * problem.world_size} is not a multiple "
            "of 4 (its TMA rule)"
        )
    if problem.use_fp8 and padded % 512:
        return False, f"fp8 dispatch needs hidden % 512 == 0, got {padded}"
    return True, ""


def prefer(problem: DispatchProblem, caps: Capabilities) -> str | None:
    """Under ``auto``: not with one rank (nothing to communicate), and not when it would pad the hidden size."""
    if problem.world_size == 1:
        return "one rank: no communication needed"
    padded = padded_hidden(problem.hidden)
    if padded != problem.hidden:
        return (
            f"hidden size {problem.hidden} not compiled into its LL kernels; it would be padded to {padded} "
            f"(+{100 * (padded - problem.hidden) / problem.hidden:.0f}% bytes, two copies of the masked layout): "
            "request kernel='deepep' for that"
        )
    return None

log = logging.getLogger("moe_fx.lowering")

_BUFFERS: dict[str, Any] = {}
#: (group name, max tokens, hidden, experts) -> buffer: the per-call fast path.
_FITS: dict[tuple, Any] = {}


def get_buffer(group: dist.ProcessGroup, *, max_tokens_per_rank: int, hidden: int, num_experts: int) -> Any:
    """The group's cached low-latency ``deep_ep.Buffer``, created or enlarged so that it fits this problem."""
    key = (group.group_name, max_tokens_per_rank, hidden, num_experts)
    buf = _FITS.get(key)
    if buf is None:
        buf = _FITS[key] = _get_buffer(
            group, max_tokens_per_rank=max_tokens_per_rank, hidden=hidden, num_experts=num_experts
        )
    return buf


def _get_buffer(group: dist.ProcessGroup, *, max_tokens_per_rank: int, hidden: int, num_experts: int) -> Any:
    deep_ep = importlib.import_module("deep_ep")
    world = group.size()
    need = deep_ep.Buffer.get_low_latency_rdma_size_hint(max_tokens_per_rank, hidden, world, num_experts)
    qps = num_experts // world
    name = group.group_name
    entry = _BUFFERS.get(name)
    if entry is not None and entry[1] >= need and entry[2] >= qps and entry[3] == max_tokens_per_rank:
        return entry[0]
    if entry is not None:
        log.info("moe_fx EP: replacing DeepEP buffer of group %s (%d -> %d RDMA bytes)", name, entry[1], need)
        need, qps = max(need, entry[1]), max(qps, entry[2])
        _BUFFERS.pop(name)
        for k in [k for k in _FITS if k[0] == name]:
            del _FITS[k]
        del entry
    buf = deep_ep.Buffer(group, 0, need, low_latency_mode=True, num_qps_per_rank=qps)
    _BUFFERS[name] = (buf, need, qps, max_tokens_per_rank)
    log.info("moe_fx EP: DeepEP low-latency buffer for group %s: %.1f MiB, %d QPs/rank", name, need / 2**20, qps)
    return buf


def _check_tokens(t: int, max_tokens_per_rank: int, rank: int) -> None:
    if t > max_tokens_per_rank:
        raise ValueError(
            f"moe_fx.ep_dispatch: rank {rank} has {t} tokens, more than max_tokens_per_rank={max_tokens_per_rank} "
            "(DeepEP's low-latency buffer is sized for it); raise MoEConfig.max_tokens_per_rank"
        )


_warned_padding: set[int] = set()


def _padding(h: int) -> int:
    """The hidden size DeepEP runs at (``h`` or padded), warning once per size when it pads."""
    hp = padded_hidden(h)
    if hp is None:
        raise ValueError(f"moe_fx EP: DeepEP has no low-latency kernels for hidden size {h} or more")
    if hp != h and h not in _warned_padding:
        _warned_padding.add(h)
        log.warning(
            "moe_fx EP: DeepEP low-latency kernels are not compiled for hidden size %d; padding it to %d "
            "(+%.0f%% bytes on the wire and two copies of the masked layout per layer)", h, hp, 100 * (hp - h) / h,
        )
    return hp


def dispatch_send(
    hidden: torch.Tensor,
    topk_ids: torch.Tensor,
    num_experts: int,
    max_tokens_per_rank: int,
    group: dist.ProcessGroup,
    use_fp8: bool = False,
) -> tuple:
    """Start ``low_latency_dispatch`` with its receive hook: the send kernels only (data in flight).

    Kernels launched between this and :func:`dispatch_recv` (a block's shared experts) run while the
    tokens travel. Returns the state :func:`dispatch_recv` finishes.
    """
    t, h = hidden.shape
    _check_tokens(t, max_tokens_per_rank, group.rank())
    hp = _padding(h)
    buf = get_buffer(group, max_tokens_per_rank=max_tokens_per_rank, hidden=hp, num_experts=num_experts)
    x = hidden.contiguous() if hp == h else torch.nn.functional.pad(hidden, (0, hp - h))
    recv, recv_count, handle, _event, hook = buf.low_latency_dispatch(
        x,
        topk_ids.to(torch.int64).contiguous(),
        max_tokens_per_rank,
        num_experts,
        use_fp8=use_fp8,
        async_finish=False,
        return_recv_hook=True,
    )
    return recv, recv_count, handle, hook, h, hp, use_fp8


def dispatch_recv(state: tuple) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Finish a :func:`dispatch_send`: DeepEP's receive hook, then the contract's five outputs."""
    recv, recv_count, handle, hook, h, hp, use_fp8 = state
    hook()
    src_info, layout_range = handle[0], handle[1]
    if use_fp8:
        recv_x, recv_scale = recv
    else:
        recv_x = recv
        recv_scale = recv_x.new_empty((recv_x.shape[0], recv_x.shape[1], 0), dtype=torch.float32)
    if hp != h:
        recv_x = recv_x[..., :h].contiguous()
        if use_fp8:  # back to the contract's MN-major [E, M, H/128] layout
            recv_scale = recv_scale[..., : h // 128].transpose(1, 2).contiguous().transpose(1, 2)
    return recv_x, recv_scale, recv_count, src_info, layout_range


def combine(
    expert_out: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    src_info: torch.Tensor,
    layout_range: torch.Tensor,
    num_experts: int,
    max_tokens_per_rank: int,
    group: dist.ProcessGroup,
) -> torch.Tensor:
    """``moe_fx::ep_combine`` through DeepEP's ``low_latency_combine``: ``[T, H]`` bf16."""
    h = expert_out.shape[2]
    hp = _padding(h)
    buf = get_buffer(group, max_tokens_per_rank=max_tokens_per_rank, hidden=hp, num_experts=num_experts)
    handle = (src_info, layout_range, max_tokens_per_rank, hp, num_experts)
    y = expert_out.contiguous() if hp == h else torch.nn.functional.pad(expert_out, (0, hp - h))
    out, _event, _hook = buf.low_latency_combine(
        y,
        topk_ids.to(torch.int64).contiguous(),
        topk_weights.float().contiguous(),
        handle,
        async_finish=False,
        return_recv_hook=False,
    )
    return out if hp == h else out[:, :h].contiguous()
