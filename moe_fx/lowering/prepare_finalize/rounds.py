"""Steps larger than ``max_tokens_per_rank``: rounds every rank agrees on (``ep_agree_step``,
``ep_remaining_rounds``; contract in :mod:`moe_fx.ops.ep`).

Why rounds, and why agreed on the host. Every expert-parallel kernel exchanges a masked layout of
static size (``M = max_tokens_per_rank * world`` rows per expert): DeepEP's registered buffer, the
fixed-size exchange and DeepGEMM's masked GEMMs all need it, and it is what keeps decode steps free
of host syncs and capturable. A longer step (a prompt) is therefore cut into rounds of at most
``max_tokens_per_rank`` tokens per rank; all ranks must run the same number of rounds, because each
round is a collective, and a rank with few tokens cannot know that another has many. DeepEP's
normal (high-throughput) mode would avoid the rounds, but it has its own buffers and layout, syncs
the host per call as well, and could not be built or measured here.

So once per step (per call of a compiled graph, :func:`agree_step`) the ranks all-reduce their token
counts over a CPU (gloo) group: the host's own numbers, so the GPU's stream is never waited for (the
group itself when it already is gloo, else a gloo group of the same ranks made once). Round 0 of
each layer is the graph's own dispatch -> masked_experts -> combine; :func:`remaining_rounds` runs
the others. With one round (every step within ``max_tokens_per_rank`` on every rank) it only copies
round 0's output. More than one round cannot be replayed from a CUDA graph (the rounds are host
decisions), so once this process captured one, the agreement refuses such a step on every rank
together (the flag is part of what is all-reduced) instead of letting ranks fall out of step.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from moe_fx.ops.checks import check_remaining_rounds
from moe_fx.ops.ep import bind_remaining_rounds, resolve_ep_group

__all__ = ["agree_step", "agreed_rounds", "remaining_rounds"]

#: group name -> rounds agreed for the current step.
_AGREED: dict[str, int] = {}
#: groups whose remaining-rounds op was recorded into a CUDA graph in this process.
_CAPTURED: set[str] = set()
_CPU_GROUPS: dict[str, dist.ProcessGroup] = {}


def _cpu_group(group: dist.ProcessGroup) -> dist.ProcessGroup:
    """A gloo group with ``group``'s ranks (``group`` itself when it already runs gloo), made once."""
    name = group.group_name
    cpu = _CPU_GROUPS.get(name)
    if cpu is None:
        if "gloo" in str(dist.get_backend(group)):
            cpu = group
        else:
            ranks = dist.get_process_group_ranks(group)
            cpu = dist.new_group(ranks=ranks, backend="gloo", use_local_synchronization=True)
        _CPU_GROUPS[name] = cpu
    return cpu


def agree_step(num_tokens: int, max_tokens_per_rank: int, group_name: str) -> int:
    """``moe_fx::ep_agree_step``: the rounds of this step, the same on every rank (a host collective)."""
    if num_tokens < 0 or max_tokens_per_rank <= 0:
        raise ValueError(
            f"moe_fx.ep_agree_step: want num_tokens >= 0 and max_tokens_per_rank > 0, got {num_tokens} and "
            f"{max_tokens_per_rank}"
        )
    group = resolve_ep_group(group_name)
    facts = torch.tensor([num_tokens, int(group_name in _CAPTURED)], dtype=torch.int64)
    if group.size() > 1:
        dist.all_reduce(facts, op=dist.ReduceOp.MAX, group=_cpu_group(group))
    most, captured = (int(v) for v in facts.tolist())
    rounds = max(1, -(-most // max_tokens_per_rank))
    if rounds > 1 and captured:
        _AGREED.pop(group_name, None)
        raise ValueError(
            f"moe_fx EP: a rank has {most} tokens this step, more than max_tokens_per_rank={max_tokens_per_rank}, "
            f"which needs {rounds} rounds; this process replays expert-parallel layers from CUDA graphs, where "
            "only one round can run (raised on every rank). Raise MoEConfig.max_tokens_per_rank, or run such "
            "steps without CUDA graphs."
        )
    _AGREED[group_name] = rounds
    return rounds


def agreed_rounds(group_name: str) -> int:
    """The rounds :func:`agree_step` last agreed for the group; ``ValueError`` if it never ran."""
    rounds = _AGREED.get(group_name)
    if rounds is None:
        raise ValueError(
            f"moe_fx.ep_remaining_rounds: no step agreed for group {group_name!r}: call "
            "torch.ops.moe_fx.ep_agree_step(num_tokens, max_tokens_per_rank, group_name) on every rank first "
            "(graphs compiled by moe_fx do it before every call)"
        )
    return rounds


def remaining_rounds(*args: object, **kwargs: object) -> torch.Tensor:
    """``moe_fx::ep_remaining_rounds``: round 0's output followed by rounds ``1 .. R - 1`` (``[T, H]``)."""
    a = bind_remaining_rounds(*args, **kwargs)
    group_name = a["group_name"]
    check_remaining_rounds(a, resolve_ep_group(group_name).size())
    rounds = agreed_rounds(group_name)
    first, hidden = a["first_out"], a["hidden"]
    if hidden.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        _CAPTURED.add(group_name)
        if rounds > 1:
            raise ValueError(f"moe_fx EP: a step of {rounds} rounds cannot be captured in a CUDA graph")
    t, mt = hidden.shape[0], a["max_tokens_per_rank"]
    out = first.new_empty((t, first.shape[1]))
    out[: first.shape[0]] = first
    ops = torch.ops.moe_fx
    experts_kwargs = {k: a[k] for k in ("w13_bias", "w2_bias", "gated", "gate_up_layout", "alpha", "limit", "up_offset")}
    common = (a["num_experts"], mt, group_name, a["use_fp8"], a["kernel_choice"])
    for r in range(1, rounds):
        lo, hi = min(r * mt, t), min((r + 1) * mt, t)
        ids, weights = a["topk_ids"][lo:hi], a["topk_weights"][lo:hi]
        recv_x, recv_scale, masked_m, src_info, layout_range = ops.ep_dispatch(hidden[lo:hi], ids, *common)
        y = ops.masked_experts(
            recv_x, masked_m, a["w13"], a["w2"], a["activation"], recv_scale if a["use_fp8"] else None,
            a["w13_scale"], a["w2_scale"], a["expected_m"], a["experts_kernel_choice"], **experts_kwargs,
        )  # fmt: skip
        out[lo:hi] = ops.ep_combine(y, ids, weights, src_info, layout_range, *common)
    return out
