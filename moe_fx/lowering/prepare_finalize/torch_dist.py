"""Expert-parallel dispatch/combine on ``torch.distributed.all_to_all_single``, counts read on the host.

The *synced* torch.distributed backend: it sends only the rows each rank needs, at the price of one
host synchronisation per op (the split sizes). That costs nothing on CPU (gloo), where it is the
default; on a GPU it stalls the host and cannot be captured in a CUDA graph, so there
:mod:`.torch_dist_fixed` (a fixed-size exchange, counts in the data) is taken instead unless this
one is requested (``kernel="torch_dist"``).

Same masked layout and op interface as DeepEP's low-latency path (see :mod:`moe_fx.ops.ep`):

dispatch
    1. Each rank orders its valid (token, k) pairs by global expert id (stable, so tokens ascend
       within an expert); rank ``d`` owns experts ``d * E_local .. (d + 1) * E_local - 1``, so this
       also groups the rows by destination rank.
    2. Counts first: one ``all_to_all_single`` of an int64 ``[world, E_local + 2]`` matrix: per
       destination, the rows for each of its experts, plus this rank's token count and an error flag.
       Every rank thus learns every rank's T and can raise the same error (no rank is left waiting in
       a collective the others skipped).
    3. The rows (fp8 bytes and fp32 scales when ``use_fp8``) in one ``all_to_all_single`` each.
    4. The receiver writes row ``i`` from rank ``r`` for its expert ``e`` to slot
       ``(e, offset[e, r] + i)``, with ``offset[e, r] = sum_{r' < r} count[e, r']``.

    Handle: ``layout_range[e, r] = offset[e, r] << 32 | count[e, r]`` (DeepEP's packing) and
    ``src_info[e, j]`` = the row's index in the receive buffer (``-1`` for empty slots).

combine
    The inverse: rows are gathered from the slots in receive order, sent back with the split sizes
    swapped (the sender recomputes its own from ``topk_ids``, no count exchange), multiplied by their
    routing weights in fp32 and summed per token with ``index_add_``.

With one rank no collective runs. Counts are read on the host (one sync per dispatch and combine).
Ids out of range and a token naming one expert twice are errors here, raised on every rank together
(the flags travel with the counts).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from moe_fx.lowering.problem import Capabilities, DispatchProblem
from moe_fx.lowering.quant import quantize_fp8_per_token_group
from moe_fx.ops.ep import dispatch_outputs

__all__ = ["NAME", "combine", "dispatch", "dispatch_recv", "dispatch_send", "receive_slots", "supports"]

NAME = "torch_dist"
_FLAG_BAD_ID = 1
_FLAG_DUPLICATE_ID = 2


def supports(problem: DispatchProblem, caps: Capabilities) -> tuple[bool, str]:
    """Runs any expert-parallel problem on any torch.distributed backend (gloo on CPU, NCCL on GPU)."""
    if not problem.expert_parallel:
        return False, "not expert-parallel (one device: the local permute)"
    return True, ""


def receive_slots(counts: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked-layout slots of the rows in receive order.

    ``counts`` int64 ``[E_local, world]`` (CPU): rows expert ``e`` receives from rank ``r``. The receive
    buffer holds rank 0's rows (expert 0's, then expert 1's, ...), then rank 1's, and so on. Returns
    ``(expert_index, row_index)`` int64 ``[N]`` for the ``N`` received rows.
    """
    e_local, _world = counts.shape
    offsets = counts.cumsum(1) - counts  # where rank r's rows start in expert e's rows
    per_block = counts.t().reshape(-1)  # blocks in receive order: (rank, expert)
    block_end = per_block.cumsum(0)
    n = int(block_end[-1]) if block_end.numel() else 0
    pos = torch.arange(n)
    # Block of each received row by binary search (repeat_interleave was ~4 ms per call here).
    block = torch.searchsorted(block_end, pos, right=True)
    within = pos - (block_end - per_block)[block]
    expert_index = block % e_local
    row_index = offsets.t().reshape(-1)[block] + within
    both = torch.stack([expert_index, row_index]).to(device)  # one host-to-device copy
    return both[0], both[1]


def _send_order(topk_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pairs ordered by global expert: ``(order [T*K], token [T*K], counts int64 [E])``, on the ids' device.

    ``order`` lists the flat (token, k) indices of valid pairs first (by expert, tokens ascending) and
    invalid ones (``-1``, out of range) last; only the first ``counts.sum()`` entries are sent.
    No host synchronisation.
    """
    k = topk_ids.shape[1]
    flat = topk_ids.reshape(-1).long()
    valid = (flat >= 0) & (flat < num_experts)
    key = torch.where(valid, flat, torch.full_like(flat, num_experts))
    order = torch.argsort(key, stable=True)
    counts = torch.bincount(key, minlength=num_experts + 1)[:num_experts]
    return order, torch.div(order, k, rounding_mode="floor"), counts


def _id_flags(topk_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """int64 scalar tensor: bit 0 = an id out of range, bit 1 = a token picks one expert twice."""
    ids = topk_ids.long()
    bad = ((ids >= num_experts) | (ids < -1)).any()
    # A token that picks one expert twice could overflow that expert's M rows (each rank may send at
    # most max_tokens_per_rank rows per expert).
    s = ids.sort(dim=1).values
    dup = ((s[:, 1:] == s[:, :-1]) & (s[:, 1:] >= 0)).any() if s.shape[1] > 1 else torch.zeros((), dtype=torch.bool)
    return bad.long() * _FLAG_BAD_ID + dup.long().to(bad.device) * _FLAG_DUPLICATE_ID


def dispatch(
    hidden: torch.Tensor,
    topk_ids: torch.Tensor,
    num_experts: int,
    max_tokens_per_rank: int,
    group: dist.ProcessGroup,
    use_fp8: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``moe_fx::ep_dispatch`` over all_to_all_single; shapes as in :mod:`moe_fx.ops.ep`.

    One host synchronisation (the count matrix); two or three collectives (counts, rows, fp8 scales).
    """
    world, rank = group.size(), group.rank()
    t, h = hidden.shape
    e_local, m = num_experts // world, max_tokens_per_rank * world
    dev = hidden.device
    _order, token, counts = _send_order(topk_ids, num_experts)

    send_meta = torch.cat(
        [
            counts.view(world, e_local),
            torch.full((world, 1), t, dtype=torch.int64, device=dev),
            _id_flags(topk_ids, num_experts).view(1, 1).expand(world, 1),
        ],
        dim=1,
    )
    if world > 1:
        recv_meta = torch.empty_like(send_meta)
        dist.all_to_all_single(recv_meta, send_meta, group=group)
    else:
        recv_meta = send_meta
    send_meta, recv_meta = torch.stack([send_meta, recv_meta]).cpu().unbind(0)  # the one host sync
    _raise_on_bad_meta(recv_meta, e_local, max_tokens_per_rank, world, rank)

    send_splits = send_meta[:, :e_local].sum(1).tolist()
    recv_counts = recv_meta[:, :e_local].t().contiguous()  # [E_local, world]
    recv_splits = recv_counts.sum(0).tolist()
    sent = sum(send_splits)
    rows = hidden[token[:sent]]
    if use_fp8:
        q, s = quantize_fp8_per_token_group(rows)
        payloads = [q.view(torch.uint8), s]
    else:
        payloads = [rows]
    received = [_all_to_all(p, recv_splits, send_splits, group) for p in payloads]

    recv_x, recv_scale, masked_m, src_info, layout_range = dispatch_outputs(hidden, e_local, m, h, world, use_fp8)
    e_idx, j_idx = receive_slots(recv_counts, dev)
    if use_fp8:
        recv_x.view(torch.uint8)[e_idx, j_idx] = received[0]
        recv_scale[e_idx, j_idx] = received[1]
    else:
        recv_x[e_idx, j_idx] = received[0]
    masked_m.copy_(recv_counts.sum(1).to(torch.int32))
    offsets = recv_counts.cumsum(1) - recv_counts
    layout_range.copy_((offsets << 32) | recv_counts)
    src_info.fill_(-1)
    src_info[e_idx, j_idx] = torch.arange(e_idx.numel(), dtype=torch.int32, device=dev)
    return recv_x, recv_scale, masked_m, src_info, layout_range


def dispatch_send(*args: object) -> tuple:
    """The whole dispatch (its host sync leaves nothing to overlap); :func:`dispatch_recv` returns it."""
    return dispatch(*args)


def dispatch_recv(state: tuple) -> tuple:
    """The outputs :func:`dispatch_send` computed."""
    return state


def _all_to_all(
    x: torch.Tensor, recv_splits: list[int], send_splits: list[int], group: dist.ProcessGroup
) -> torch.Tensor:
    if group.size() == 1:
        return x
    out = x.new_empty((sum(recv_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), recv_splits, send_splits, group=group)
    return out


def _raise_on_bad_meta(meta: torch.Tensor, e_local: int, max_tokens: int, world: int, rank: int) -> None:
    tokens = meta[:, e_local].tolist()
    flags = meta[:, e_local + 1].tolist()
    over = [(r, n) for r, n in enumerate(tokens) if n > max_tokens]
    if over:
        who = ", ".join(f"rank {r}: {n}" for r, n in over)
        raise ValueError(
            f"moe_fx.ep_dispatch: more tokens than max_tokens_per_rank={max_tokens} on {who} (raised on every "
            f"rank, this is rank {rank}). The masked layout and DeepEP's buffers are sized for it; raise "
            "MoEConfig.max_tokens_per_rank or feed fewer tokens per step."
        )
    bad = [r for r, f in enumerate(flags) if f & _FLAG_BAD_ID]
    dup = [r for r, f in enumerate(flags) if f & _FLAG_DUPLICATE_ID]
    if bad or dup:
        raise ValueError(
            f"moe_fx.ep_dispatch: invalid topk_ids (expert id out of range on ranks {bad}; one token picks "
            f"the same expert twice on ranks {dup}); raised on every rank, this is rank {rank}"
        )


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
    """``moe_fx::ep_combine`` over all_to_all_single: ``[T, H]`` in ``expert_out.dtype``.

    One host synchronisation (own counts and the handle's), one collective.
    """
    world = group.size()
    e_local = num_experts // world
    t, h = topk_ids.shape[0], expert_out.shape[2]
    dev = expert_out.device
    order, token, counts = _send_order(topk_ids, num_experts)
    host = torch.cat([counts, (layout_range & 0xFFFFFFFF).reshape(-1)]).cpu()
    send_back = host[:num_experts].view(world, e_local).sum(1).tolist()  # rows this rank gets back, per rank
    recv_counts = host[num_experts:].view(e_local, world)
    e_idx, j_idx = receive_slots(recv_counts, dev)
    returned = _all_to_all(expert_out[e_idx, j_idx], send_back, recv_counts.sum(0).tolist(), group)
    n = sum(send_back)
    out = torch.zeros(t, h, dtype=torch.float32, device=dev)
    w = topk_weights.reshape(-1)[order[:n]].float().unsqueeze(-1)
    out.index_add_(0, token[:n], returned.float() * w)
    return out.to(expert_out.dtype)
