"""Expert-parallel dispatch/combine over torch.distributed with a fixed-size exchange: no host sync.

Every message has a size that depends on static values only (``max_tokens_per_rank``, H, K, the
group's size), and counts travel inside the data, so nothing is read on the host: the path runs
under CUDA graphs (NCCL collectives are capturable) and inside compiled graphs, like DeepEP's
low-latency kernels, on any torch.distributed backend (NCCL on GPU, gloo on CPU).

dispatch (``N = world * max_tokens_per_rank`` = M)
    1. Each rank packs its tokens, padded to ``max_tokens_per_rank`` rows, and its ``topk_ids``
       (padded with ``-1``) into one byte block ``[max_tokens_per_rank, H * itemsize + 4K]``.
    2. One ``all_gather``: every rank receives every rank's block, ``[N, ...]`` (a token is sent once
       to every rank, whatever its experts: the padded block per peer the fixed size needs). It is
       started asynchronously (:func:`dispatch_send`) and waited for in :func:`dispatch_recv`, so what
       the graph runs in between overlaps it.
    3. Each rank keeps the (token, k) pairs whose expert it owns (ids shifted by ``rank * E_local``;
       the rest fall outside ``[0, E_local)``) and scatters them into the masked layout with the
       local permute kernel (:func:`moe_fx.lowering.triton.permute.permute_to_masked`, quantising to
       fp8 when ``use_fp8``). A token naming one of its experts twice sends one row (both slots
       count at the combine); ids outside ``[0, E)`` send none (the experts op's GPU rule).

    Handle: ``src_info[e, j]`` = the gathered index ``i = src_rank * max_tokens_per_rank + t`` of row
    ``j`` of local expert ``e`` (``-1`` for rows not written); ``layout_range`` is unused (zeros).

combine
    1. One small ``all_gather`` of every rank's ``topk_ids`` and fp32 ``topk_weights`` (padded).
    2. Each rank rebuilds, from ``src_info`` and the gathered ids, where every gathered (token, k)
       pair's row is, and reduces its own experts' rows per gathered token, weighted, in fp32 (the
       local unpermute kernel, :func:`~moe_fx.lowering.triton.permute.unpermute_from_masked`):
       ``partial [N, H]`` in ``expert_out.dtype``, zero for tokens with no expert here.
    3. One ``all_to_all_single`` with equal splits returns block ``r`` of ``partial`` to rank ``r``,
       which sums the ``world`` partials of each of its tokens in fp32.

Cost against the synced backend (:mod:`.torch_dist`): bytes on the wire are those of the worst case,
``world * max_tokens_per_rank * H`` per rank and direction (whatever the routing; the synced one
sends ``T * K'`` rows, ``K'`` the distinct ranks of a token's experts), plus the scatter and gather
kernels over the padded blocks. fp8 dispatch quantises on the receiver (the wire carries the
activations' dtype). On CPU both kernels run under Triton's interpreter: correct, slow, for tests.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch._library.triton import set_wrap_triton_enabled

from moe_fx.lowering.problem import Capabilities, DispatchProblem
from moe_fx.ops.recipe import FP8_BLOCK

__all__ = ["NAME", "combine", "dispatch_recv", "dispatch_send", "supports"]

NAME = "torch_dist_fixed"

#: torch 2.13 renamed ``all_gather_into_tensor``; the GPU machine's torch 2.11 has only the old name.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def supports(problem: DispatchProblem, caps: Capabilities) -> tuple[bool, str]:
    """Any expert-parallel problem where moe_fx's Triton permute kernels run (compiled on CUDA, interpreted on CPU)."""
    if not problem.expert_parallel:
        return False, "not expert-parallel (one device: the local permute)"
    if caps.triton_error is not None:
        return False, f"needs the Triton permute kernels: {caps.triton_error}"
    if problem.device_type not in ("cuda", "cpu"):
        return False, f"needs CUDA (or CPU, interpreted) tensors, got {problem.device_type}"
    return True, ""


def prefer(problem: DispatchProblem, caps: Capabilities) -> str | None:
    """Under ``auto``: on CPU the synced exchange wins (host syncs cost nothing there, it sends less
    and its kernels are not interpreted)."""
    if problem.device_type == "cpu":
        return "torch_dist preferred on CPU (host syncs are free there; this one's kernels are interpreted)"
    return None


def _pad_rows(x: torch.Tensor, rows: int, fill: float) -> torch.Tensor:
    """``x [T, ...]`` as ``[rows, ...]``: its rows first, then ``fill``."""
    out = x.new_full((rows, *x.shape[1:]), fill)
    out[: x.shape[0]] = x
    return out


def _gather(block: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``[world * rows, ...]``: every rank's ``block [rows, ...]``, in rank order."""
    out = block.new_empty((group.size() * block.shape[0], *block.shape[1:]))
    _all_gather(out, block.contiguous(), group=group)
    return out


def _bytes(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.uint8).reshape(x.shape[0], -1)


def dispatch_send(
    hidden: torch.Tensor,
    topk_ids: torch.Tensor,
    num_experts: int,
    max_tokens_per_rank: int,
    group: dist.ProcessGroup,
    use_fp8: bool = False,
) -> tuple:
    """Start the all_gather of the padded blocks (asynchronously: on NCCL's stream on a GPU).

    Work launched before :func:`dispatch_recv` (a block's shared experts) overlaps it.
    """
    t, h = hidden.shape
    if t > max_tokens_per_rank:
        raise ValueError(
            f"moe_fx.ep_dispatch: {t} tokens in one round, more than max_tokens_per_rank={max_tokens_per_rank} "
            "(a larger step runs in rounds: moe_fx.ops.ep.ep_remaining_rounds)"
        )
    k = topk_ids.shape[1]
    rows = _pad_rows(hidden, max_tokens_per_rank, 0)
    ids = _pad_rows(topk_ids.to(torch.int32), max_tokens_per_rank, -1)
    # ids first: the tokens' byte offset 4K keeps both views aligned for every dtype and H
    block = torch.cat([_bytes(ids), _bytes(rows)], dim=1)
    got = block.new_empty((group.size() * max_tokens_per_rank, block.shape[1]))
    work = _all_gather(got, block, group=group, async_op=True)
    return work, got, hidden.dtype, h, k, num_experts, max_tokens_per_rank, group, use_fp8


def dispatch_recv(state: tuple) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Finish a :func:`dispatch_send`: wait for the blocks, scatter this rank's pairs into the masked layout."""
    from moe_fx.lowering.triton.permute import permute_to_masked

    work, got, dtype, h, k, num_experts, max_tokens_per_rank, group, use_fp8 = state
    work.wait()
    world, rank = group.size(), group.rank()
    e_local, m = num_experts // world, max_tokens_per_rank * world
    # Shifted ids: this rank's experts land in [0, E_local); every other id falls outside and sends no row.
    local_ids = got[:, : 4 * k].view(torch.int32) - rank * e_local
    tokens = got[:, 4 * k :].view(dtype)
    dev = got.device
    # MN-major fp8 scales, as the contract (and DeepGEMM) lay them out; the permute writes through any strides.
    scale = (torch.empty(e_local, h // FP8_BLOCK, m, dtype=torch.float32, device=dev).transpose(1, 2) if use_fp8
             else torch.empty(e_local, m, 0, dtype=torch.float32, device=dev))
    with set_wrap_triton_enabled(False):
        batch = permute_to_masked(
            tokens, local_ids, e_local, m, quant_fp8=use_fp8, x_scale=scale if use_fp8 else None
        )
    # src_info: every written row's gathered token; slots without a row are sent to a spare last entry.
    src = torch.full((e_local * m + 1,), -1, dtype=torch.int32, device=dev)
    pos = batch.slot_pos
    token_of_slot = torch.arange(pos.numel(), device=dev, dtype=torch.int64).div_(k, rounding_mode="floor")
    src.scatter_(0, torch.where(pos >= 0, pos, e_local * m), token_of_slot.to(torch.int32))
    layout_range = torch.zeros(e_local, world, dtype=torch.int64, device=dev)
    return batch.x, scale, batch.masked_m, src[: e_local * m].view(e_local, m), layout_range


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
    """``moe_fx::ep_combine`` as a small all_gather and one all_to_all of fixed size: ``[T, H]``."""
    from moe_fx.lowering.triton.permute import unpermute_from_masked

    world, rank = group.size(), group.rank()
    t, k = topk_ids.shape
    h = expert_out.shape[2]
    e_local, m = num_experts // world, max_tokens_per_rank * world
    n = world * max_tokens_per_rank
    dev = expert_out.device
    ids = _pad_rows(topk_ids.to(torch.int32), max_tokens_per_rank, -1)
    weights = _pad_rows(topk_weights.float(), max_tokens_per_rank, 0.0).view(torch.int32)
    got = _gather(torch.cat([ids, weights], dim=1), group)
    local_ids = got[:, :k].long() - rank * e_local
    gathered_w = got[:, k:].view(torch.float32)
    # Where each gathered (token, local expert) pair's row is: inverse of src_info.
    row = torch.arange(e_local * m, device=dev)
    src = src_info.reshape(-1).long()
    spare = n * e_local
    inverse = torch.full((spare + 1,), -1, dtype=torch.int64, device=dev)
    inverse.scatter_(0, torch.where(src >= 0, src * e_local + row.div(m, rounding_mode="floor"), spare), row)
    mine = (local_ids >= 0) & (local_ids < e_local)
    key = torch.arange(n, device=dev).unsqueeze(1) * e_local + local_ids.clamp(0, e_local - 1)
    slot_pos = torch.where(mine, inverse[key], -1).reshape(-1)
    with set_wrap_triton_enabled(False):
        partial = unpermute_from_masked(expert_out, slot_pos, gathered_w, out_dtype=expert_out.dtype)
    back = torch.empty_like(partial)
    dist.all_to_all_single(back, partial, group=group)
    out = back.view(world, max_tokens_per_rank, h).float().sum(0)[:t]
    return out.to(expert_out.dtype)
