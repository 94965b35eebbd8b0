"""Expert-parallel load balancing (EPLB) for every MoE layer ``split_ep`` splits: placement, counts, moves.

With ``MoEConfig(eplb=True, eplb_redundant_slots=r)`` each rank holds ``P = E / world + r`` *physical*
experts; a logical expert may have several physical copies (replicas) on different ranks.
``split_ep`` then inserts, before each layer's dispatch, plain torch ops (fused by Inductor, no
host sync) that

* count the step's tokens per logical expert into the layer's ``load`` (int64 ``[E + 1]``, on the
  device; the last entry collects ids that are no expert), and
* map every logical id to one of its replicas through ``log_to_phys [E, 1 + world * r]`` and
  ``replicas [E]``: the (token, k) pair number ``i`` takes replica ``i % replicas[e]``, which spreads
  a hot expert's tokens evenly over its copies.

Dispatch and combine then address ``world * P`` physical experts (rank ``p // P`` owns physical
expert ``p``), and the experts run on the rank's ``P`` physical weights.

:func:`rebalance` (``moe_fx.rebalance_experts()``: every rank calls it between steps, or
``MoEConfig.eplb_interval`` triggers it before every ``N``-th call of a compiled graph) sums the
loads over the group, computes a new placement (:func:`place_experts`: replicas to the experts with
the most tokens per copy, then the copies packed onto ranks, heaviest first, each to the rank
with the least load that has a free slot and no copy of it yet; copies that are already on a rank
keep their slot), moves the weights that change rank with one ``all_to_all_single`` per weight
tensor, rewrites the maps in place and zeroes the counts. Everything the compiled graphs read keeps
its storage, so nothing recompiles and CUDA graphs stay valid. No model-specific code: a layer is
whatever ``split_ep`` split, named by its module path. A layer's state is attached to one of its
model weights (a recompile for another shape finds it there, so every graph of a layer shares one
placement; a second model gets its own).

Weights: a layer whose weights ``split_ep`` may compact (Dynamo-lifted parameters) keeps its ``P``
physical experts in the first ``P`` rows of those parameters (no extra memory); other weights (fp8
buffers made by ``quantize_experts``, stacked per-expert weights) get a ``[P, ...]`` buffer of their
own, built once at compile time, while the originals stay (the price is ``P`` rows per weight).
"""

from __future__ import annotations

import heapq
import logging
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from moe_fx.ops.ep import ep_group_name, resolve_ep_group

__all__ = ["EPLBLayer", "IntervalTrigger", "attach_layer", "layer_of", "layers_of", "place_experts", "rank_loads",
           "rebalance"]

log = logging.getLogger("moe_fx.passes")


def _replica_counts(load: Sequence[float], slots: int, world: int) -> list[int]:
    """Copies per expert: one each, the rest one by one to the expert with the most load per copy."""
    e = len(load)
    counts = [1] * e
    heap = [(-float(load[i]), i) for i in range(e)]
    heapq.heapify(heap)
    for _ in range(slots - e):
        while heap:
            _, i = heapq.heappop(heap)
            if counts[i] < world:  # more copies than ranks would share a rank: no gain
                break
        else:  # every expert is on every rank already; cannot happen while slots <= E * world
            raise ValueError(f"moe_fx EPLB: {slots} physical slots for {e} experts on {world} ranks")
        counts[i] += 1
        heapq.heappush(heap, (-float(load[i]) / counts[i], i))
    return counts


#: A new placement is taken only when it lowers the most loaded rank's share by at least this much.
MIN_GAIN = 0.05


def rank_loads(load: Sequence[float], placement: Sequence[int], world: int) -> list[float]:
    """Tokens each rank computes under ``placement`` (an expert's load split evenly over its copies)."""
    copies = [0] * len(load)
    for i in placement:
        copies[i] += 1
    slots = len(placement) // world
    return [sum(load[i] / copies[i] for i in placement[r * slots : (r + 1) * slots]) for r in range(world)]


def place_experts(load: Sequence[float], world: int, slots_per_rank: int, current: Sequence[int]) -> list[int]:
    """A balanced placement: ``phys_to_log`` (length ``world * slots_per_rank``) for per-expert ``load``.

    Deterministic (every rank computes the same from the same loads). ``current`` is the placement
    in use: it is kept when the new one would not lower the most loaded rank's tokens by
    :data:`MIN_GAIN`; otherwise a copy that stays on its rank keeps its slot, so only copies that
    change rank move.
    """
    new = _balanced(load, world, slots_per_rank, current)
    if max(rank_loads(load, new, world)) > (1 - MIN_GAIN) * max(rank_loads(load, current, world)):
        return list(current)
    return new


def _balanced(load: Sequence[float], world: int, slots_per_rank: int, current: Sequence[int]) -> list[int]:
    e = len(load)
    if world * slots_per_rank < e or slots_per_rank > e:
        raise ValueError(f"moe_fx EPLB: {slots_per_rank} slots per rank on {world} ranks cannot hold {e} experts")
    counts = _replica_counts(load, world * slots_per_rank, world)
    items = sorted(((float(load[i]) / counts[i], i) for i in range(e) for _ in range(counts[i])),
                   key=lambda it: (-it[0], it[1]))
    held: list[list[int]] = [[] for _ in range(world)]
    rank_load = [0.0] * world
    for w, i in items:
        free = [r for r in range(world) if len(held[r]) < slots_per_rank]
        fresh = [r for r in free if i not in held[r]] or free
        r = min(fresh, key=lambda q: (rank_load[q], q))
        held[r].append(i)
        rank_load[r] += w
    out = [-1] * (world * slots_per_rank)
    for r in range(world):
        base = r * slots_per_rank
        todo = list(held[r])
        for j in range(slots_per_rank):  # copies already here keep their slot
            if current[base + j] in todo:
                out[base + j] = current[base + j]
                todo.remove(current[base + j])
        for j in range(slots_per_rank):
            if out[base + j] < 0:
                out[base + j] = todo.pop(0)
    return out


def initial_placement(num_experts: int, world: int, slots_per_rank: int) -> list[int]:
    """Before any count: rank ``r`` holds its ``E / world`` experts, then copies of the next ranks' ones."""
    e_local = num_experts // world
    out = []
    for r in range(world):
        out += list(range(r * e_local, (r + 1) * e_local))
        out += [((r + 1) * e_local + j) % num_experts for j in range(slots_per_rank - e_local)]
    return out


@dataclass(eq=False)
class EPLBLayer:
    """The placement state of one expert-parallel layer on this rank (what the compiled graphs read).

    Attributes:
        key: the layer's name (module path), the same on every rank.
        group_name: the EP group's c10d name.
        num_experts: logical experts E. world: ranks. slots: physical experts per rank P.
        phys_to_log: the placement (host), ``world * P`` logical ids.
        log_to_phys: int64 ``[E, 1 + world * r]`` physical ids of each expert's copies (device).
        replicas: int64 ``[E]`` copies per expert (device).
        load: int64 ``[E + 1]`` tokens routed to each expert since the last rebalance (device;
            the last entry counts ids that are no expert).
        weights: this rank's physical weight tensors ``[P, ...]`` (w13, w2 and any scales and biases),
            written in place by :func:`rebalance`.
    """

    key: str
    group_name: str
    num_experts: int
    world: int
    slots: int
    phys_to_log: list[int]
    log_to_phys: torch.Tensor
    replicas: torch.Tensor
    load: torch.Tensor
    weights: dict[str, torch.Tensor] = field(default_factory=dict)

    @classmethod
    def create(cls, key: str, group_name: str, num_experts: int, world: int, slots: int,
               device: torch.device) -> EPLBLayer:
        """A layer with the initial placement and zero counts."""
        e = num_experts
        width = 1 + world * slots - e
        layer = cls(key, group_name, e, world, slots, initial_placement(e, world, slots),
                    torch.zeros(e, width, dtype=torch.int64, device=device),
                    torch.zeros(e, dtype=torch.int64, device=device),
                    torch.zeros(e + 1, dtype=torch.int64, device=device))
        layer._write_maps()
        return layer

    def _write_maps(self) -> None:
        copies: list[list[int]] = [[] for _ in range(self.num_experts)]
        for p, i in enumerate(self.phys_to_log):
            copies[i].append(p)
        width = self.log_to_phys.shape[1]
        table = [[c[j % len(c)] for j in range(width)] for c in copies]
        self.log_to_phys.copy_(torch.tensor(table, dtype=torch.int64))
        self.replicas.copy_(torch.tensor([len(c) for c in copies], dtype=torch.int64))

    def rows_of(self, rank: int) -> list[int]:
        """The logical experts in ``rank``'s physical slots, in slot order."""
        return self.phys_to_log[rank * self.slots : (rank + 1) * self.slots]

    def apply(self, new: list[int], group: dist.ProcessGroup) -> int:
        """Move to placement ``new`` (collective): weights between ranks, maps in place; returns copies moved."""
        rank, world, p = group.rank(), self.world, self.slots
        old = self.phys_to_log
        holder = {}  # logical expert -> (rank, slot) of its first old copy
        for q, i in enumerate(old):
            holder.setdefault(i, divmod(q, p))
        # (source rank, dst rank, dst slot, source slot) for every slot whose expert is new on its rank
        moves = []
        for q, i in enumerate(new):
            d, j = divmod(q, p)
            if i not in old[d * p : (d + 1) * p]:
                s, sj = holder[i]
                moves.append((s, d, j, sj))
        local = [(j, old[rank * p : (rank + 1) * p].index(i)) for j, i in enumerate(new[rank * p : (rank + 1) * p])
                 if i in old[rank * p : (rank + 1) * p]]
        send = sorted((d, j, sj) for s, d, j, sj in moves if s == rank)
        recv = sorted((s, j) for s, d, j, sj in moves if d == rank)
        send_splits = [sum(1 for d, _, _ in send if d == r) for r in range(world)]
        recv_splits = [sum(1 for s, _ in recv if s == r) for r in range(world)]
        for w in self.weights.values():
            rows = w.reshape(p, -1).view(torch.uint8)
            out_rows = rows.new_empty((len(recv), rows.shape[1]))
            payload = rows[[sj for _, _, sj in send]] if send else rows[:0]
            if world > 1:
                dist.all_to_all_single(out_rows, payload.contiguous(), recv_splits, send_splits, group=group)
            else:
                out_rows.copy_(payload)
            kept = rows[[sj for _, sj in local]] if local else rows[:0]  # gathered before anything is overwritten
            if local:
                rows[[j for j, _ in local]] = kept
            if recv:
                rows[[j for _, j in recv]] = out_rows
        self.phys_to_log = list(new)
        self._write_maps()
        return len(moves)


#: group name -> the group's layers (weak: a layer lives as long as the model weight it is attached
#: to), in the order they were first compiled, which is the same on every rank.
_LAYERS: dict[str, list[weakref.ref]] = {}
#: group name -> calls of compiled graphs with EPLB layers of the group (for ``eplb_interval``).
_CALLS: dict[str, int] = {}
_ATTR = "_moe_fx_eplb"


def layer_of(anchor: torch.Tensor) -> EPLBLayer | None:
    """The layer attached to a model weight by :func:`attach_layer` (a recompile finds it again), or None."""
    return getattr(anchor, _ATTR, None)


def attach_layer(anchor: torch.Tensor, layer: EPLBLayer) -> EPLBLayer:
    """Attach ``layer`` to the model weight ``anchor`` (which keeps it alive) and register it for :func:`rebalance`."""
    setattr(anchor, _ATTR, layer)
    _LAYERS.setdefault(layer.group_name, []).append(weakref.ref(layer))
    return layer


def layers_of(group_name: str | None = None) -> list[EPLBLayer]:
    """The live EPLB layers (of one group, or of all), in the order they were first compiled."""
    groups = [group_name] if group_name is not None else list(_LAYERS)
    out = []
    for g in groups:
        refs = [r for r in _LAYERS.get(g, []) if r() is not None]
        _LAYERS[g] = refs
        out += [r() for r in refs]
    return out


def rebalance(group: object = None) -> dict[str, dict]:
    """Rebalance every EPLB layer of the group (``None``: of every group); collective, between steps.

    Returns ``{layer key: {"load": per-expert tokens summed over ranks since the last rebalance,
    "moved": expert copies that changed rank, "placement": the new phys_to_log}}``.
    """
    names = list(_LAYERS) if group is None else [ep_group_name(group)]
    report: dict[str, dict] = {}
    for name in names:
        pg = resolve_ep_group(name)
        layers = layers_of(name)
        if not layers:
            continue
        loads = torch.stack([layer.load[: layer.num_experts] for layer in layers])
        if pg.size() > 1:
            dist.all_reduce(loads, group=pg)
        for layer, load in zip(layers, loads.cpu().tolist(), strict=True):
            new = place_experts(load, layer.world, layer.slots, layer.phys_to_log)
            moved = layer.apply(new, pg)
            layer.load.zero_()
            report[layer.key] = {"load": load, "moved": moved, "placement": list(new)}
            log.info("moe_fx EPLB %s: rebalanced (max/mean load per rank %.2f), %d expert copies moved",
                     layer.key, _imbalance(load, new, layer), moved)
    return report


def _imbalance(load: list[int], placement: list[int], layer: EPLBLayer) -> float:
    per_rank = rank_loads(load, placement, layer.world)
    mean = sum(per_rank) / len(per_rank)
    return max(per_rank) / mean if mean else 1.0


class IntervalTrigger:
    """A call check: before every ``interval``-th call of a graph with EPLB layers of the group, rebalance.

    The count is per group, over every compiled graph of the group, so every rank (running the same
    model, hence the same sequence of graph calls) rebalances at the same call.
    """

    def __init__(self, group_name: str, interval: int) -> None:
        self.group_name, self.interval = group_name, interval

    def __call__(self, args: Sequence[object]) -> None:
        n = _CALLS.get(self.group_name, 0) + 1
        _CALLS[self.group_name] = n
        if n % self.interval == 0:
            rebalance(self.group_name)


def check_fits(layer: EPLBLayer, group_name: str, num_experts: int, world: int, slots: int) -> None:
    """A layer found again (a recompile) must have the same group and sizes."""
    if (layer.group_name, layer.num_experts, layer.world, layer.slots) != (group_name, num_experts, world, slots):
        raise ValueError(
            f"moe_fx EPLB: layer {layer.key} was compiled for group {layer.group_name} with E={layer.num_experts}, "
            f"world={layer.world}, {layer.slots} slots per rank; this compilation wants {group_name}, {num_experts}, "
            f"{world}, {slots}. Recompile from a freshly loaded model."
        )


def slots_per_rank(num_experts: int, world: int, redundant: int) -> int:
    """``E / world + redundant``, at most E (more copies than experts on one rank would be pointless)."""
    return min(num_experts, num_experts // world + redundant)

