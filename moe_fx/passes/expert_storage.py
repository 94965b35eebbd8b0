"""Expert weights stay the model's: one stacked copy of per-expert weights, re-synced at every call.

The ``moe_fx::experts`` op reads stacked weights ``w13 [E, 2I, H]`` and ``w2 [E, H, I]``. Stacked forms
(transformers 5.x, torchtitan, dense ``bmm``) pass the model's own parameters, which Dynamo hands the
compiled graph as inputs at every call: nothing to do. Two forms read a tensor made at rewrite time:

* **per-expert weights** (an ``nn.ModuleList`` of experts): the E gate/up/down matrices are stacked
  once into two buffers of the graph module and the module's parameters become views into them
  (:func:`stack_per_expert`, :func:`share_storage`), so in-place edits and in-place
  ``load_state_dict`` write into what the op reads. A recompile (new shapes) finds the parameters
  already viewing a stack and reuses it (:func:`existing_stacks`) instead of copying again, so every
  compiled graph reads one copy. Whatever re-points a parameter elsewhere (``load_state_dict(...,
  assign=True)``, ``module.to(...)`` and back, a new ``nn.Parameter``) is caught before the next call
  of the compiled graph by :class:`PerExpertSync`, which copies the parameter into the stack and makes
  it a view again.
* **fp8 weights made by** ``MoEConfig(quantize="fp8")``: :class:`SourceWatch` remembers the data
  pointer and version counter of the bf16 source parameters and re-quantises into the same fp8
  buffers before a call when either changed (an in-place edit, a load, a replaced parameter).

The checks run in Python before each call of the compiled graph: a data pointer (and for fp8 a
version counter) per watched parameter, about 70 ns each.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = ["PerExpertSync", "SourceWatch", "TensorRef", "existing_stacks", "share_storage", "stack_per_expert"]

log = logging.getLogger("moe_fx.passes")

#: Where a real tensor comes from at call time: the position of a graph input, or a fixed tensor.
TensorRef = int | torch.Tensor


def resolve(refs: Sequence[TensorRef], args: Sequence[Any]) -> list[torch.Tensor]:
    """The tensors behind ``refs`` for one call with graph inputs ``args``."""
    return [args[r] if isinstance(r, int) else r for r in refs]


def _stack_over(like: torch.Tensor, offset: int, shape: tuple[int, ...]) -> torch.Tensor:
    """A contiguous tensor of ``shape`` over ``like``'s storage, starting at element ``offset``."""
    stride = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
    return torch.empty(0, dtype=like.dtype, device=like.device).set_(like.untyped_storage(), offset, shape, stride)


def _is_view_at(p: torch.Tensor, stack: torch.Tensor, offset: int) -> bool:
    """True if ``p`` is the contiguous block of ``stack``'s storage starting ``offset`` elements into it."""
    return (p.dtype == stack.dtype and p.device == stack.device and p.is_contiguous()
            and p.untyped_storage().data_ptr() == stack.untyped_storage().data_ptr()
            and p.storage_offset() == stack.storage_offset() + offset)


def existing_stacks(
    gate: Sequence[torch.Tensor], up: Sequence[torch.Tensor], down: Sequence[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The ``(w13, w2)`` stacks the per-expert weights already are views of (an earlier compile made
    them), or None when they are not all laid out as :func:`share_storage` leaves them."""
    e = len(gate)
    inter, hidden = gate[0].shape
    w13 = _stack_over(gate[0], gate[0].storage_offset(), (e, 2 * inter, hidden))
    w2 = _stack_over(down[0], down[0].storage_offset(), (e, hidden, inter))
    for stack in (w13, w2):
        need = (stack.storage_offset() + stack.numel()) * stack.element_size()
        if stack.untyped_storage().nbytes() < need:
            return None
    block13, block2 = 2 * inter * hidden, hidden * inter
    for i in range(e):
        if not (_is_view_at(gate[i], w13, i * block13) and _is_view_at(up[i], w13, i * block13 + inter * hidden)
                and _is_view_at(down[i], w2, i * block2)):
            return None
    return w13, w2


def stack_per_expert(
    gate: Sequence[torch.Tensor], up: Sequence[torch.Tensor], down: Sequence[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """``w13 [E, 2I, H]`` (gate rows, then up rows) and ``w2 [E, H, I]`` for per-expert ``[I, H]`` /
    ``[H, I]`` weights: the stacks they already view if any (no copy), else new ones."""
    found = existing_stacks(gate, up, down)
    if found is not None:
        return found
    with torch.no_grad():
        w13 = torch.stack([torch.cat([g, u], dim=0) for g, u in zip(gate, up, strict=True)])
        w2 = torch.stack(list(down))
    return w13, w2


def share_storage(
    gate: Sequence[torch.Tensor], up: Sequence[torch.Tensor], down: Sequence[torch.Tensor],
    w13: torch.Tensor, w2: torch.Tensor,
) -> None:
    """Make the per-expert parameters views into the stacks (their values must already be there)."""
    inter = w2.shape[2]
    with torch.no_grad():
        for e, (g, u, d) in enumerate(zip(gate, up, down, strict=True)):
            g.data, u.data, d.data = w13[e, :inter], w13[e, inter:], w2[e]


class PerExpertSync:
    """Before a call: every per-expert parameter still views the stacks the op reads; if one does not
    (replaced, loaded with ``assign=True``, moved by ``.to()``), its values are copied into the stacks
    and it becomes a view again.

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
                p.data = view
        log.debug("moe_fx: per-expert parameters re-pointed into the stacked expert weights")


class SourceWatch:
    """Before a call: re-run ``refresh(sources)`` when a source tensor changed since the last time
    (its data pointer or its version counter: in-place edits, loads, replaced parameters).

    ``refresh`` rebuilds what was made from the sources (fp8 weights) in place, so the compiled graph
    keeps reading the same buffers.
    """

    def __init__(self, refs: Sequence[TensorRef], refresh: Callable[[list[torch.Tensor]], None]) -> None:
        self.refs, self.refresh = list(refs), refresh
        self.state: list[tuple[int, int]] | None = None

    def record(self, args: Sequence[Any]) -> None:
        """Remember the sources' current state (call when what was made from them is up to date)."""
        self.state = [(t.data_ptr(), t._version) for t in resolve(self.refs, args)]

    def __call__(self, args: Sequence[Any]) -> None:
        sources = resolve(self.refs, args)
        state = [(t.data_ptr(), t._version) for t in sources]
        if state == self.state:
            return
        with torch.no_grad():
            self.refresh(sources)
        self.state = [(t.data_ptr(), t._version) for t in sources]
        log.debug("moe_fx: expert weights changed since they were packed; packed again")
