"""Expert weights stay the model's: one stacked copy of per-expert weights, re-synced at every call.

The ``moe_fx::experts`` op reads stacked weights ``w13 [E, 2I, H]`` and ``w2 [E, H, I]``. Stacked forms
(transformers 5.x, torchtitan, dense ``bmm``) pass the model's own parameters, which Dynamo hands the
compiled graph as inputs at every call: nothing to do. Two forms read a tensor made at rewrite time:

* **per-expert weights** (an ``nn.ModuleList`` of experts): the E gate/up/down matrices are stacked
  once into two buffers of the graph module and the module's parameters are then made to alias their
  slots (:func:`stack_per_expert`, :func:`share_storage`), so in-place edits (``.data`` ones included)
  and in-place ``load_state_dict`` write into what the op reads, and one copy of the experts stays in
  memory. Each parameter aliases its slot through a storage of its own that spans just its elements
  and keeps the stack alive (:func:`slot_alias`, DLPack), not as a view of the whole stack: so
  ``pickle.dumps(model)``, ``torch.save(expert.state_dict())`` and ``copy.deepcopy`` write or copy
  each parameter's own elements, as before compiling. A recompile (new shapes) finds the parameters
  already in a stack's slots and reuses it (:func:`existing_stacks`) instead of copying again, so
  every compiled graph reads one copy. Whatever re-points a parameter elsewhere (``load_state_dict(...,
  assign=True)``, ``module.to(...)`` and back, a new ``nn.Parameter``, ``p.data = t``) is caught before
  the next call of the compiled graph by :class:`PerExpertSync`, which copies the parameter into the
  stack and makes it alias its slot again.
* **fp8 weights made by** ``MoEConfig(quantize="fp8")``: :class:`SourceWatch` re-quantises into the same
  fp8 buffers before a call when the bf16 sources changed: exactly for writes through the parameters
  (version counters) and replaced or moved parameters (data pointers), by sampling for writes that
  bypass the version counter (``p.data.mul_(2)``); what is and is not seen is listed there.

The checks run before each call of the compiled graph: a data pointer (and for fp8 a version counter)
per watched parameter in Python, about 70 ns each, and for fp8 one comparison of sampled bits.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.dlpack import from_dlpack, to_dlpack

__all__ = [
    "SAMPLE_GRID", "PerExpertSync", "SourceWatch", "TensorRef", "WeightSources", "existing_stacks",
    "sample_view", "share_storage", "slot_alias", "stack_per_expert",
]

log = logging.getLogger("moe_fx.passes")

#: Where a real tensor comes from at call time: the position of a graph input, or a fixed tensor.
TensorRef = int | torch.Tensor


def resolve(refs: Sequence[TensorRef], args: Sequence[Any]) -> list[torch.Tensor]:
    """The tensors behind ``refs`` for one call with graph inputs ``args``."""
    return [args[r] if isinstance(r, int) else r for r in refs]


#: The stacks :func:`stack_per_expert` made, by (device, address of their first element), while alive.
_STACKS: weakref.WeakValueDictionary[tuple[str, int], torch.Tensor] = weakref.WeakValueDictionary()


def slot_alias(slot: torch.Tensor) -> torch.Tensor:
    """A tensor over ``slot``'s memory whose storage is just ``slot``'s elements and keeps ``slot``'s own
    storage (a stack) alive; ``slot`` itself where DLPack cannot express it (its dtype).

    A parameter made a plain view of a stack shares the stack's storage, and pickle, ``torch.save`` and
    ``state_dict`` copies then carry all E experts with every parameter (10.7x the model's pickle, 6.2x
    an expert's state dict, measured). The alias writes into the same memory, so edits still reach the
    op, and serialises as a tensor of its own.
    """
    try:
        return from_dlpack(to_dlpack(slot))
    except (RuntimeError, BufferError, TypeError):  # a dtype DLPack has no code for: a plain view
        return slot


def _slot_of(p: torch.Tensor, stack: torch.Tensor, offset: int) -> bool:
    """True if ``p`` lies exactly on the contiguous block of ``stack`` starting ``offset`` elements in."""
    return (p.dtype == stack.dtype and p.device == stack.device and p.is_contiguous()
            and p.data_ptr() == stack.data_ptr() + offset * stack.element_size())


def _known_stack(t: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor | None:
    stack = _STACKS.get((str(t.device), t.data_ptr()))
    if stack is None or tuple(stack.shape) != shape or stack.dtype != t.dtype or not stack.is_contiguous():
        return None
    return stack


def existing_stacks(
    gate: Sequence[torch.Tensor], up: Sequence[torch.Tensor], down: Sequence[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The ``(w13, w2)`` stacks whose slots the per-expert weights already are (an earlier compile made
    them, and they are alive), or None when they are not all laid out as :func:`share_storage` leaves
    them. Reads addresses only: it never touches the parameters' storages."""
    e = len(gate)
    inter, hidden = gate[0].shape
    w13 = _known_stack(gate[0], (e, 2 * inter, hidden))
    w2 = _known_stack(down[0], (e, hidden, inter))
    if w13 is None or w2 is None:
        return None
    block13, block2 = 2 * inter * hidden, hidden * inter
    for i in range(e):
        if not (_slot_of(gate[i], w13, i * block13) and _slot_of(up[i], w13, i * block13 + inter * hidden)
                and _slot_of(down[i], w2, i * block2)):
            return None
    return w13, w2


def stack_per_expert(
    gate: Sequence[torch.Tensor], up: Sequence[torch.Tensor], down: Sequence[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """``w13 [E, 2I, H]`` (gate rows, then up rows) and ``w2 [E, H, I]`` for per-expert ``[I, H]`` /
    ``[H, I]`` weights: the stacks they already lie in if any (no copy), else new ones."""
    found = existing_stacks(gate, up, down)
    if found is not None:
        return found
    with torch.no_grad():
        w13 = torch.stack([torch.cat([g, u], dim=0) for g, u in zip(gate, up, strict=True)])
        w2 = torch.stack(list(down))
    for stack in (w13, w2):
        _STACKS[(str(stack.device), stack.data_ptr())] = stack
    return w13, w2


def share_storage(
    gate: Sequence[torch.Tensor], up: Sequence[torch.Tensor], down: Sequence[torch.Tensor],
    w13: torch.Tensor, w2: torch.Tensor,
) -> None:
    """Make the per-expert parameters alias their slots of the stacks (their values must already be
    there), each through a storage of its own (:func:`slot_alias`)."""
    inter = w2.shape[2]
    with torch.no_grad():
        for e, (g, u, d) in enumerate(zip(gate, up, down, strict=True)):
            g.data, u.data, d.data = slot_alias(w13[e, :inter]), slot_alias(w13[e, inter:]), slot_alias(w2[e])


class PerExpertSync:
    """Before a call: every per-expert parameter still lies in its slot of the stacks the op reads; if one
    does not (replaced, loaded with ``assign=True``, moved by ``.to()``), its values are copied into the
    stacks and it aliases its slot again.

    ``refs`` lists the gate, up and down parameters of every expert (E each, in that order) as graph
    input positions or tensors.
    """

    def __init__(self, refs: Sequence[TensorRef], w13: torch.Tensor, w2: torch.Tensor) -> None:
        e, inter = w13.shape[0], w2.shape[2]
        if len(refs) != 3 * e:
            raise ValueError(f"PerExpertSync needs 3 * E = {3 * e} parameters, got {len(refs)}")
        self.refs, self.w13, self.w2 = list(refs), w13, w2
        self.views = [w13[i, :inter] for i in range(e)] + [w13[i, inter:] for i in range(e)] + list(w2.unbind(0))
        self.ptrs = [v.data_ptr() for v in self.views]

    def __call__(self, args: Sequence[Any]) -> None:
        params = resolve(self.refs, args)
        if [p.data_ptr() for p in params] == self.ptrs:
            return
        with torch.no_grad():
            for p, view, ptr in zip(params, self.views, self.ptrs, strict=True):
                if p.data_ptr() == ptr:
                    continue
                if p.shape != view.shape or p.dtype != view.dtype or p.device != view.device:
                    raise RuntimeError(
                        f"moe_fx: an expert parameter is now {p.dtype} {list(p.shape)} on {p.device}, but the "
                        f"compiled graph reads {view.dtype} {list(view.shape)} on {view.device}; recompile "
                        "(torch._dynamo.reset()) after changing expert parameters' shape, dtype or device"
                    )
                view.copy_(p)
                p.data = slot_alias(view)
        log.debug("moe_fx: per-expert parameters re-pointed into the stacked expert weights")


@dataclass
class WeightSources:
    """Where a rewritten region's op weights come from (for passes that make new weights from them: fp8).

    Attributes:
        refs: the model's own weight tensors (graph input positions or tensors, :data:`TensorRef`);
            their data pointers and version counters are tracked exactly.
        build: ``build(tensors) -> (w13, w2)``, the op's weights from the tensors behind ``refs``.
        sampled: the tensors whose contents are sampled (the same as ``refs`` for stacked weights; the
            stacks for per-expert weights, which their parameters view).
    """

    refs: list[TensorRef]
    build: Callable[[list[torch.Tensor]], tuple[torch.Tensor, torch.Tensor]]
    sampled: list[TensorRef]


#: Rows and columns of every expert's grid of sampled elements (SAMPLE_GRID ** 2 elements per expert).
SAMPLE_GRID = 8
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def sample_view(t: torch.Tensor) -> torch.Tensor:
    """A ``[E, a, b]`` view (no copy; ``a, b <= SAMPLE_GRID``) of a grid of elements of every expert of a
    3-D ``t`` (a 2-D ``t`` is one expert): rows and columns evenly spread, offset from the edges."""
    if t.dim() == 2:
        t = t.unsqueeze(0)
    _, n, k = t.shape
    a, b = min(SAMPLE_GRID, n), min(SAMPLE_GRID, k)
    rows, cols = n // a, k // b
    return t.detach()[:, rows // 2 :: rows, cols // 2 :: cols][:, :a, :b]


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s raw bits (so that NaN equals NaN and -0 differs from 0)."""
    return t.view(_BITS[t.element_size()])


@dataclass
class _Watched:
    sources: WeightSources
    refresh: Callable[[list[torch.Tensor]], None]
    state: list[tuple[int, int]] = field(default_factory=list)
    grids: dict[int, tuple[tuple, tuple]] = field(default_factory=dict)

    def exact_state(self, args: Sequence[Any]) -> list[tuple[int, int]]:
        return [(t.data_ptr(), t._version) for t in resolve(self.sources.refs, args)]

    def grid(self, i: int, t: torch.Tensor) -> torch.Tensor:
        """:func:`sample_view` of the ``i``-th sampled tensor, as one ``as_strided`` whose geometry is
        kept (no tensor is: the watch keeps no graph input alive) until ``t`` changes layout."""
        layout = (t.data_ptr(), tuple(t.shape), t.stride())
        cached = self.grids.get(i)
        if cached is None or cached[0] != layout:
            view = sample_view(t)
            cached = (layout, (tuple(view.shape), view.stride(), view.storage_offset()))
            self.grids[i] = cached
        return t.detach().as_strided(*cached[1])


class SourceWatch:
    """Before a call: rebuild what was made from the model's weights (fp8 copies) when they changed.

    What is tracked, per watched region (see :class:`WeightSources`):

    * exactly: every write through the parameter itself or a view of it (its version counter: in-place
      edits, ``load_state_dict``), and a parameter replaced or moved (its data pointer:
      ``load_state_dict(assign=True)``, ``.to()``, a new ``nn.Parameter``, ``p.data = t``);
    * by sampling: writes that bypass the version counter (``p.data.mul_(2)``, ``p.data.copy_(w)``: a
      ``.data`` alias has a version counter of its own; writes through another alias of the storage):
      the bits of a fixed grid of ``SAMPLE_GRID x SAMPLE_GRID`` elements of every expert (rows and
      columns evenly spread) are compared with those of the last quantisation. Rewriting whole experts or tensors (a new checkpoint, a scale) is seen; an
      edit of a few elements that misses every sampled one is not.

    ``add`` registers a region; ``record`` (after compiling) remembers the current state; a call checks
    every region at once: the exact states in Python, then one comparison of all regions' samples (the
    grids are views; one ``cat`` copies them all). On CPU that costs a few microseconds per layer
    (bench/weight_watch.py); on a GPU it is one ``cat`` and one ``torch.equal`` per call of the compiled
    graph whatever the number of layers, and the equal's answer is read on the host: one host sync per
    call (the only one moe_fx adds; none without ``quantize="fp8"``).
    """

    def __init__(self) -> None:
        self.watched: list[_Watched] = []
        self.samples: dict[tuple, torch.Tensor] = {}  # one tensor per (dtype, device, grid shape)

    def __len__(self) -> int:
        return len(self.watched)

    def add(self, sources: WeightSources, refresh: Callable[[list[torch.Tensor]], None]) -> None:
        """Watch ``sources``; ``refresh(tensors)`` rebuilds, in place, what was made from them."""
        self.watched.append(_Watched(sources, refresh))

    def _sample(self, args: Sequence[Any]) -> tuple[dict[tuple, torch.Tensor], list[list[tuple[tuple, int, int]]]]:
        """Every watched tensor's grid, concatenated per (dtype, device, grid shape): one copy kernel per
        group on a GPU, whatever the number of layers; and where each region's grids lie in them."""
        groups: dict[tuple, list[torch.Tensor]] = {}
        where: list[list[tuple[tuple, int, int]]] = []
        for w in self.watched:
            spots = []
            for i, t in enumerate(resolve(w.sources.sampled, args)):
                view = w.grid(i, t)
                key = (t.dtype, t.device, tuple(view.shape[1:]))
                group = groups.setdefault(key, [])
                start = sum(v.shape[0] for v in group)
                group.append(view)
                spots.append((key, start, view.shape[0]))
            where.append(spots)
        return {key: _bits(torch.cat(views)) for key, views in groups.items()}, where

    def record(self, args: Sequence[Any]) -> None:
        """Remember the sources' current state (call when what was made from them is up to date)."""
        for w in self.watched:
            w.state = w.exact_state(args)
        self.samples = self._sample(args)[0]

    def __call__(self, args: Sequence[Any]) -> None:
        moved = [w.exact_state(args) != w.state for w in self.watched]
        now, where = self._sample(args)
        same = now.keys() == self.samples.keys() and all(torch.equal(v, self.samples[k]) for k, v in now.items())
        if same and not any(moved):
            return
        with torch.no_grad():
            for w, was_moved, spots in zip(self.watched, moved, where, strict=True):
                unchanged = not was_moved and all(
                    key in self.samples and self.samples[key].shape == now[key].shape
                    and torch.equal(now[key][lo : lo + n], self.samples[key][lo : lo + n]) for key, lo, n in spots
                )
                if not unchanged:
                    w.refresh(resolve(w.sources.refs, args))
                    w.state = w.exact_state(args)
                    log.debug("moe_fx: expert weights changed since they were packed; packed again")
        self.samples = now
