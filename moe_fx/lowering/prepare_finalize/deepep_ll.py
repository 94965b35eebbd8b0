"""DeepEP low-latency dispatch/combine behind the ``moe_fx::ep_dispatch`` / ``ep_combine`` contract.

One ``deep_ep.Buffer`` in low-latency mode per process group (keyed by its c10d name), sized with
``Buffer.get_low_latency_rdma_size_hint(max_tokens_per_rank, hidden, world, E)`` and
``num_qps_per_rank = E_local``, created on first use and reused by every MoE layer. A later layer
that needs more (a larger hidden size or more experts) replaces it; buffer creation is collective,
which is safe because every rank runs the same model and so asks in the same order.

* dispatch: ``low_latency_dispatch(x bf16 [T, H], topk_idx int64, max_tokens_per_rank, E,
  use_fp8=...)``. Its outputs are the masked layout as is: ``recv_x [E_local, M, H]`` (fp8 with fp32
  MN-major 1x128 scales when ``use_fp8``, ready for DeepGEMM without a copy), ``recv_count`` as
  ``masked_m``, and the handle's two tensors as ``src_info`` / ``layout_range``.
* combine: ``low_latency_combine(y bf16 [E_local, M, H], topk_idx, topk_weights fp32, handle)``, which
  applies the routing weights and sums over top-k.

Which problems it takes: :func:`supports` (used by :mod:`moe_fx.lowering.select`). A rank with more than
``max_tokens_per_rank`` tokens raises here, before the collective; the other ranks then wait in
DeepEP's kernels until its own timeout (DeepEP has no count exchange to tell them).
"""

from __future__ import annotations

import importlib
import logging
from typing import Any

import torch
import torch.distributed as dist

from moe_fx.lowering.problem import Capabilities, DispatchProblem

__all__ = ["DEEPEP_LL_HIDDEN", "DEEPEP_LL_MAX_TOPK", "NAME", "combine", "dispatch", "get_buffer", "supports"]

NAME = "deepep_ll"
#: Hidden sizes the low-latency kernels of the DeepEP sources we build (V1 API, 2025-08) are compiled
#: for (their ``SWITCH_HIDDEN``); later versions add 3072.
DEEPEP_LL_HIDDEN: tuple[int, ...] = (2048, 2560, 4096, 5120, 6144, 7168, 8192)
#: Largest top-k of those sources' LL dispatch (``kNumMaxTopK = 9``; later versions allow 11).
DEEPEP_LL_MAX_TOPK = 9


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
    if problem.hidden not in supported_hidden:
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
    if problem.use_fp8 and problem.hidden % 512:
        return False, f"fp8 dispatch needs hidden % 512 == 0, got {problem.hidden}"
    return True, ""


def prefer(problem: DispatchProblem, caps: Capabilities) -> str | None:
    """Under ``auto``: with one rank there is nothing to communicate (torch_dist runs no collective)."""
    if problem.world_size == 1:
        return "one rank: no communication needed"
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


def dispatch(
    hidden: torch.Tensor,
    topk_ids: torch.Tensor,
    num_experts: int,
    max_tokens_per_rank: int,
    group: dist.ProcessGroup,
    use_fp8: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``moe_fx::ep_dispatch`` through DeepEP's ``low_latency_dispatch`` (bf16 hidden on CUDA)."""
    t, h = hidden.shape
    _check_tokens(t, max_tokens_per_rank, group.rank())
    buf = get_buffer(group, max_tokens_per_rank=max_tokens_per_rank, hidden=h, num_experts=num_experts)
    recv, recv_count, handle, _event, _hook = buf.low_latency_dispatch(
        hidden.contiguous(),
        topk_ids.to(torch.int64).contiguous(),
        max_tokens_per_rank,
        num_experts,
        use_fp8=use_fp8,
        async_finish=False,
        return_recv_hook=False,
    )
    src_info, layout_range = handle[0], handle[1]
    if use_fp8:
        recv_x, recv_scale = recv
    else:
        recv_x = recv
        recv_scale = hidden.new_empty((recv_x.shape[0], recv_x.shape[1], 0), dtype=torch.float32)
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
    buf = get_buffer(group, max_tokens_per_rank=max_tokens_per_rank, hidden=h, num_experts=num_experts)
    handle = (src_info, layout_range, max_tokens_per_rank, h, num_experts)
    out, _event, _hook = buf.low_latency_combine(
        expert_out.contiguous(),
        topk_ids.to(torch.int64).contiguous(),
        topk_weights.float().contiguous(),
        handle,
        async_finish=False,
        return_recv_hook=False,
    )
    return out
