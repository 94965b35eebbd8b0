"""Read an experts region's structure: prove that it computes ``moe_fx::experts``, or name the op that does not.

One recogniser, :func:`read_form`, for every way the experts are written (transformers' ``grouped_mm`` and
``batched_mm``, ``range(E)`` loops over an ``nn.ModuleList``, sort-and-split dispatch, dense ``bmm`` over every
expert, the loop over the experts a batch hits that :mod:`~moe_fx.capture.hit_loops` records). It walks the region's
nodes in graph order, as a pattern matcher consumes its match, and gives every value one abstract role:

* **routing plumbing**: integer and boolean values (ids, masks and counts computed from them, sort
  permutations, offsets, sizes) and floats computed from them alone (``histc`` of the ids). Which row meets which
  expert weight is plumbing: the numerical check (:mod:`~moe_fx.verify.check_numerics`) confirms it, on routing it draws;
* **routing weights**: the boundary ``[T, K]`` weights (or Llama 4's ``[T, E]`` scores) and their reshapes,
  gathers and permutations; a ``[T, E]`` matrix scattered from them into zeros;
* **expert weights**: the anchors (``w13``, ``w2``, per-expert ``gate`` / ``up`` / ``down``, biases) and their
  views, each axis named (expert, out, in), so that a product is read the right way round whatever the shapes;
* **data stages** of one routed row: hidden rows -> first product (+ w13 bias) -> gate / up (halves by
  ``chunk`` / ``split`` / slices, interleaved by ``::2``, or two products) -> clamps (``gate <= limit``,
  ``|up| <= limit``) -> ``up + c`` -> activation (``silu``, ``g * sigmoid(alpha * g)``, ``gelu``, ``relu``,
  ``relu^2``) -> ``act * up`` -> second product (+ w2 bias) -> times the routing weight (on the output, or on
  the hidden rows: ``weights_on_input``) -> combine (``index_add`` / ``scatter_add`` into zeros, a sum over the
  top-k or expert axis, adds of partial sums). Row gathers, permutations, splits, concatenations, row masks
  from plumbing and casts apply to any stage and keep it.

Any other op on a float value (a comparison, ``where`` / ``masked_fill`` with a mask computed from floats, an
extra scale, a division, a second activation, a reduction over the hidden axis, experts whose chains differ)
makes the region a near miss, and the reason names the op and its node. The activation
(:class:`~moe_fx.ops.ExpertActivation`), where the routing weights multiply, the biases and the identity
experts are *read* here; nothing is guessed. Slices with literal bounds of rows whose number is data-dependent
(a capacity ``tok[:4]`` of rows picked by ``where(ids == e)``) are refused.

Read-only; nothing here runs a region.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols, statically_known_true

from moe_fx.ops import ExpertActivation
from moe_fx.passes.graph_utils import is_factory, is_mutation, node_value, op_name, scalar_hint, tensor_value

if TYPE_CHECKING:
    from moe_fx.passes.recognize.extract_region import Region

__all__ = ["DATA_DEPENDENT_ROWS", "Boundary", "FormReading", "WeightView", "expert_id_bound", "read_form", "read_region",
           "region_boundary"]

#: Node meta key a recorder sets on tensors whose number of rows depends on the data (``nonzero`` and
#: what it indexes); Dynamo graphs say the same with unbacked sizes.
DATA_DEPENDENT_ROWS = "moe_fx_data_dependent_rows"

_CASTS = frozenset({"to", "float", "half", "bfloat16", "double", "type", "type_as", "contiguous", "clone", "detach",
                    "alias", "_to_copy"})
_SHAPE_READS = frozenset({"size", "sym_size", "sym_size.int", "dim", "numel", "sym_numel", "sym_stride", "stride",
                          "sym_storage_offset", "is_contiguous", "element_size"})
_PRODUCTS = frozenset({"linear", "matmul", "mm", "bmm", "_grouped_mm", "grouped_mm", "grouped_mm_fallback"})
_GROUPED = frozenset({"_grouped_mm", "grouped_mm", "grouped_mm_fallback"})
#: Expert products with fp8 weights and their 128x128 block scales: the kernels of transformers' fine-grained FP8
#: experts, as :mod:`~moe_fx.capture.fp8_modules` records them (each one node, read by its contract).
_FP8_PRODUCTS = frozenset({"fp8_block_linear", "fp8_block_grouped_mm", "fp8_block_batched_mm"})
#: In-place spellings that compute what the functional op computes (the base then holds the result).
_INPLACE = {"iadd": "add", "isub": "sub", "imul": "mul", "itruediv": "truediv"}

_STAGE_WORDS = {
    "x": "the hidden rows", "h1": "the first expert product", "gate": "the gate", "up": "the up projection",
    "scaled": "the scaled gate", "sig": "the sigmoid of the gate", "act": "the activation", "mid": "act(gate) * up",
    "y": "the expert output", "out": "the combined output",
}


# ------------------------------------------------------------------------------------------------
# What the caller says about the region's inputs, and what the reading says about the region


@dataclass(frozen=True)
class WeightView:
    """An expert weight (or bias) the region reads, and what its axes are.

    Attributes:
        role: ``"w13"`` (stacked gate+up or, non-gated, up), ``"gate"``, ``"up"`` (gate / up projections apart:
            per-expert linears, DBRX's ``w1`` / ``v1``), ``"w2"`` (down), ``"bias"`` (where it is added decides
            whether it is the w13 or the w2 bias) or ``"scale"`` (the fp32 128x128 block scales of the fp8 weight
            ``of``; its axes count blocks).
        axes: one name per dimension of the tensor: ``"e"`` experts, ``"o"`` the product's output features,
            ``"i"`` its input features; ``"e*o"`` / ``"e*i"`` for experts flattened into rows (DBRX's
            ``[E * I, H]``). ``[E, 2I, H]`` is ``("e", "o", "i")``, its transpose ``("e", "i", "o")``.
        expert: the expert index of a per-expert weight (one ``nn.Linear`` of a ``ModuleList``), else None.
        of: for a ``"scale"``, the fp8 weight it scales: every product of that weight must be an fp8 product
            with this scale, of the same experts.
    """

    role: str
    axes: tuple[str, ...]
    expert: int | None = None
    of: fx.Node | None = None


@dataclass(frozen=True)
class Boundary:
    """The region's inputs and their meaning.

    Attributes:
        hidden: the tokens ``[T, H]``.
        ids: the top-k ids ``[T, K]`` (plumbing), or None when the region does not read them.
        weights: the routing weights ``[T, K]``, or with ``dense_scores`` a ``[T, E]`` score matrix that is
            zero outside the top-k (proved by :func:`~moe_fx.passes.recognize.extract_region.sparse_support`).
        weights_of: every expert weight and bias the region reads, with its :class:`WeightView`.
        num_experts, top_k: E (routed experts; identity experts come after them) and K.
        gated: whether ``w13`` holds gate and up (``N1 = 2I``) or one up projection.
    """

    hidden: fx.Node
    ids: fx.Node | None
    weights: fx.Node
    dense_scores: bool
    weights_of: dict[fx.Node, WeightView]
    num_experts: int
    top_k: int
    gated: bool = True


@dataclass(frozen=True)
class FormReading:
    """What :func:`read_form` proved: the op's arguments beyond the tensors.

    Attributes:
        spec: the activation between the two products.
        weights_on_input: the routing weights scale the hidden rows (Llama 4), not the expert outputs.
        identity_experts: chains that return their (weighted) input: ids ``E .. E + Z - 1``.
        w13_bias, w2_bias: the bias nodes added to the first / second product, or None.
        counts: how many nodes each part of the form accounts for (``"routing plumbing"``, ``"first product"``,
            ``"activation"``, ...); every node of the region is in exactly one.
    """

    spec: ExpertActivation
    weights_on_input: bool
    identity_experts: int = 0
    w13_bias: fx.Node | None = None
    w2_bias: fx.Node | None = None
    counts: dict[str, int] = field(default_factory=dict)


class _NearMiss(Exception):
    """Raised while reading; the message is the near miss's reason."""


# ------------------------------------------------------------------------------------------------
# Abstract values


class _Plumb:
    """Routing plumbing: ints, bools, sizes, floats computed from the ids alone, Python values."""

    def __repr__(self) -> str:
        return "plumbing"


PLUMB = _Plumb()


@dataclass(frozen=True)
class _Const:
    value: float | None  # a tensor filled with one number (None: uninitialised, ``empty``)


@dataclass(frozen=True)
class _Routing:
    dense: bool  # a [T, E] matrix zero outside the top-k, else rows of the [T, K] weights


@dataclass(frozen=True)
class _Weight:
    role: str
    axes: tuple[str, ...]
    sel: object  # "all" | ("int", e) | ("node", n) | ("rows", n)
    anchor: fx.Node


@dataclass(frozen=True)
class _Tuple:
    items: tuple


@dataclass(frozen=True)
class _Term:
    """One contribution to the combined output."""

    spec: ExpertActivation | None  # None: an identity expert
    on_input: bool
    b13: fx.Node | None
    b2: fx.Node | None
    grid: bool  # every token through every expert (dense)


@dataclass(frozen=True)
class _Data:
    """A float value on the way from the hidden rows to the combined output."""

    stage: str
    feat: int  # the feature axis, as a negative index
    src: int  # equal for values that differ by casts and layout only
    chain: tuple = ()  # which first product a gate / up / activation comes from
    sel13: object = None
    sel2: object = None
    on_input: str | None = None  # "sparse" / "dense": the routing weights that scaled the hidden rows
    on_output: str | None = None
    grid: bool = False
    b13: fx.Node | None = None
    b2: fx.Node | None = None
    gated: bool = True
    layout: str = "halves"
    limit: float | None = None
    offset: float = 0.0
    alpha: float = 1.0
    act: str = ""
    of: int = 0  # scaled gate / sigmoid: the src of the gate they come from
    spec: ExpertActivation | None = None
    terms: tuple = ()


def _words(v: object) -> str:
    if isinstance(v, _Data):
        return _STAGE_WORDS.get(v.stage, v.stage)
    if isinstance(v, _Routing):
        return "the routing weights"
    if isinstance(v, _Weight):
        return f"expert weight {v.anchor.name}"
    if isinstance(v, _Const):
        return "a constant tensor"
    return "routing plumbing"


# ------------------------------------------------------------------------------------------------
# Small helpers over shapes and arguments


def _eq(a: object, b: object) -> bool:
    return bool(statically_known_true(a == b))


def _one(a: object) -> bool:
    return _eq(a, 1)


def _shape(n: object) -> tuple | None:
    v = node_value(n) if isinstance(n, fx.Node) else None
    return tuple(v.shape) if isinstance(v, torch.Tensor) else None


def _arg(n: fx.Node, i: int, name: str, default: object = None) -> object:
    if len(n.args) > i:
        return n.args[i]
    return n.kwargs.get(name, default)


def _pos(feat: int, ndim: int) -> int:
    return ndim + feat


def _norm_dim(d: object, ndim: int) -> int:
    if not isinstance(d, int):
        raise _NearMiss(f"a dimension argument {d!r} that is not a literal")
    return d + ndim if d < 0 else d


def _data_dependent(n: object, axis: int = 0) -> bool:
    """True if ``n``'s size along ``axis`` depends on the data (an unbacked size, or a recorder's mark)."""
    if not isinstance(n, fx.Node):
        return False
    if axis == 0 and n.meta.get(DATA_DEPENDENT_ROWS):
        return True
    shape = _shape(n)
    if shape is None or axis >= len(shape):
        return False
    size = shape[axis]
    return isinstance(size, torch.SymInt) and bool(free_unbacked_symbols(size))


def _literal_bound(s: object) -> bool:
    return isinstance(s, slice) and any(isinstance(b, int) and not isinstance(b, bool) for b in (s.start, s.stop))


def _index_items(index: object) -> list:
    return list(index) if isinstance(index, (tuple, list)) else [index]


def _expand_ellipsis(items: list, ndim: int) -> list:
    """Index items with ``...`` replaced by full slices (``None`` adds no input axis)."""
    if not any(i is Ellipsis for i in items):
        used = sum(1 for i in items if i is not None)
        return items + [slice(None)] * max(ndim - used, 0)
    at = next(k for k, i in enumerate(items) if i is Ellipsis)
    used = sum(1 for i in items if i is not None and i is not Ellipsis)
    return items[:at] + [slice(None)] * max(ndim - used, 0) + items[at + 1 :]


def _item_text(i: object) -> str:
    if isinstance(i, slice):
        return ":".join("" if b is None else str(b) for b in (i.start, i.stop, i.step)).rstrip(":") or ":"
    return str(i)


def _full(s: object) -> bool:
    return isinstance(s, slice) and s.start is None and s.stop is None and s.step is None


# ------------------------------------------------------------------------------------------------
# The reader


class _Reader:
    def __init__(self, boundary: Boundary, nodes: Sequence[fx.Node]) -> None:
        self.b = boundary
        self.nodes = list(nodes)
        self.order = {n: i for i, n in enumerate(self.nodes)}
        self.val: dict[fx.Node, object] = {}
        self.label: dict[fx.Node, str] = {}
        self.uses: dict[fx.Node, list] = {n: [] for n, w in boundary.weights_of.items()
                                          if w.role not in ("bias", "scale")}
        self.scale_of = {w.of: n for n, w in boundary.weights_of.items() if w.role == "scale"}
        self._src = itertools.count(1)
        self.inputs = {boundary.hidden, boundary.weights, *boundary.weights_of}
        if boundary.ids is not None:
            self.inputs.add(boundary.ids)
        self.val[boundary.hidden] = _Data("x", -1, self.new())
        if boundary.ids is not None:
            self.val[boundary.ids] = PLUMB
        self.val[boundary.weights] = _Routing(dense=boundary.dense_scores)
        for n, w in boundary.weights_of.items():
            sel = "all" if w.expert is None else ("int", w.expert)
            self.val[n] = _Weight(w.role, tuple(w.axes), sel, n)

    def new(self) -> int:
        return next(self._src)

    # -- values of arguments

    def value(self, a: object) -> object:
        if not isinstance(a, fx.Node):
            return a
        if a in self.val:
            return self.val[a]
        v = node_value(a)
        if isinstance(v, torch.Tensor) and v.dtype.is_floating_point:
            raise _NearMiss(f"the region reads {a.name}, a float tensor that is neither an expert weight nor a "
                            "routing input")
        return PLUMB  # sizes and scalars computed outside, integer tensors

    def tensor_inputs(self, n: fx.Node) -> list[object]:
        return [self.value(a) for a in n.all_input_nodes]

    # -- the walk

    def run(self, output: fx.Node) -> FormReading:
        for n in self.nodes:
            if n.op in ("placeholder", "get_attr", "output") or n in self.val:
                continue
            self.step(n)
        return self.finish(output)

    def step(self, n: fx.Node) -> None:
        name = op_name(n)
        base = n.args[0] if is_mutation(n) and n.args and isinstance(n.args[0], fx.Node) else None
        ins = self.tensor_inputs(n)
        roles = [v for v in ins if isinstance(v, (_Data, _Routing, _Weight))]
        if name == "getitem" and isinstance(self.value(n.args[0]), _Tuple):
            result, label = self.value(n.args[0]).items[n.args[1]], "layout"
        elif is_factory(n):
            result, label = self.factory(n), "routing plumbing"
        elif name in _SHAPE_READS:
            result, label = PLUMB, "routing plumbing"
        elif not roles:
            self.check_capacity_slice(n)
            result, label = PLUMB, "routing plumbing"
        else:
            result, label = self.dispatch(n, name)
        if base is not None and base in self.inputs:
            raise _NearMiss(f"{n.name} ({name}) writes into the region's input {base.name}")
        if base is not None and base in self.val:
            self.check_mutation(n, base, result)
            self.val[base] = result
        self.val[n] = result
        self.label[n] = label

    def factory(self, n: fx.Node) -> object:
        v = tensor_value(n)
        if v is None or not v.dtype.is_floating_point:
            return PLUMB
        name = op_name(n)
        if name.startswith("zeros") or name == "new_zeros":
            return _Const(0.0)
        if name.startswith("ones") or name == "new_ones":
            return _Const(1.0)
        if name in ("full", "full_like", "new_full"):
            pos = 2 if name == "new_full" else 1
            fill = scalar_hint(_arg(n, pos, "fill_value"))
            return _Const(None if fill is None else float(fill))
        return _Const(None)

    def check_capacity_slice(self, n: fx.Node) -> None:
        """Refuse a literal-bounded slice of rows whose number is data-dependent (a capacity)."""
        name = op_name(n)
        src = n.args[0] if n.args else None
        shape = _shape(src)
        if name == "getitem" and isinstance(src, fx.Node) and shape is not None:
            items = [i for i in _expand_ellipsis(_index_items(n.args[1]), len(shape)) if i is not None]
            for axis, item in enumerate(items):
                if _literal_bound(item) and _data_dependent(src, axis):
                    raise _NearMiss(self.capacity_reason(n, src, item))
        if name in ("narrow", "slice") and isinstance(src, fx.Node):
            dim = _arg(n, 1, "dim", 0)
            if isinstance(dim, int) and _data_dependent(src, dim):
                raise _NearMiss(self.capacity_reason(n, src, None))

    @staticmethod
    def capacity_reason(n: fx.Node, src: fx.Node, item: object) -> str:
        what = f"[{item.start or ''}:{item.stop if item.stop is not None else ''}]" if isinstance(item, slice) else ""
        return (f"{n.name} slices {src.name}{what} with a literal bound, and how many rows {src.name} has depends on "
                "the routing (a capacity: tokens past it are dropped); moe_fx::experts drops no token")

    def check_mutation(self, n: fx.Node, base: fx.Node, result: object) -> None:
        """An in-place step on a float value: no view of the old value may be read after it."""
        if not isinstance(self.val.get(base), (_Data, _Const)) and not isinstance(result, _Data):
            return
        pos = self.order.get(n, -1)
        for u in base.users:
            if u is n or self.order.get(u, math.inf) >= pos:
                continue
            view = op_name(u) in ("view", "reshape", "getitem", "transpose", "permute", "unsqueeze", "squeeze", "t",
                                  "expand", "narrow", "chunk", "split", "flatten", "as_strided", "unflatten")
            if view and any(self.order.get(r, -1) > pos for r in u.users):
                raise _NearMiss(f"{n.name} writes in place into {base.name} while a view of it ({u.name}) is "
                                "read later: the view would see the write")

    # -- dispatch on data-carrying ops

    def dispatch(self, n: fx.Node, name: str) -> tuple[object, str]:
        op = _INPLACE.get(name, name[:-1] if name.endswith("_") and not name.startswith("_") else name)
        handler = getattr(self, f"op_{op}", None)
        if op in _CASTS:
            handler = self.op_cast
        elif op in _PRODUCTS:
            handler = self.op_product
        elif op in _FP8_PRODUCTS:
            handler = self.op_fp8_product
        if handler is None:
            raise _NearMiss(self.unsupported(n, name))
        return handler(n)

    def unsupported(self, n: fx.Node, name: str) -> str:
        ins = [v for v in self.tensor_inputs(n) if not isinstance(v, (_Plumb, _Const))]
        what = _words(ins[0]) if ins else "routing values"
        return f"unsupported op {name!r} ({n.name}) on {what}: it is not part of moe_fx::experts"

    def refuse(self, n: fx.Node, why: str) -> _NearMiss:
        return _NearMiss(f"{op_name(n)} ({n.name}): {why}")

    # -- casts and layout: any stage

    def op_cast(self, n: fx.Node) -> tuple[object, str]:
        x = self.value(n.args[0])
        out = tensor_value(n)
        if isinstance(x, _Data) and out is not None and not out.dtype.is_floating_point:
            raise self.refuse(n, f"casts {_words(x)} to {out.dtype}")
        return x, self.layout_label(x)  # rounding only (the check runs in float32)

    def layout_label(self, v: object) -> str:
        if isinstance(v, _Weight):
            return "expert weights"
        if isinstance(v, _Routing):
            return "routing weights"
        if isinstance(v, _Data) and v.stage == "x":
            return "hidden rows"
        return "layout"

    def op_view(self, n: fx.Node) -> tuple[object, str]:
        x = self.value(n.args[0])
        old, new = _shape(n.args[0]), _shape(n)
        if isinstance(x, _Weight):
            return self.weight_view(n, x, old, new), "expert weights"
        if isinstance(x, _Routing):
            return x, "routing weights"
        if not isinstance(x, _Data) or old is None or new is None:
            raise _NearMiss(self.unsupported(n, op_name(n)))
        p = _pos(x.feat, len(old))
        size = old[p]
        if not all(_one(s) for s in old[p + 1 :]):
            raise self.refuse(n, f"reshapes {_words(x)} across its feature axis")
        prefix = math.prod(old[:p]) if p else 1
        for q in range(len(new) - 1, -1, -1):
            if all(_one(s) for s in new[q + 1 :]) and _eq(new[q], size) and _eq(math.prod(new[:q]) if q else 1, prefix):
                return dataclasses.replace(x, feat=q - len(new)), self.layout_label(x)
            if not _one(new[q]):
                break
        raise self.refuse(n, f"reshapes {_words(x)} across its feature axis ({list(old)} -> {list(new)})")

    op_reshape = op_view
    op_flatten = op_view
    op_unflatten = op_view
    op_squeeze = op_view
    op_unsqueeze = op_view

    def weight_view(self, n: fx.Node, w: _Weight, old: tuple | None, new: tuple | None) -> _Weight:
        if old is None or new is None:
            raise _NearMiss(self.unsupported(n, op_name(n)))
        if len(old) == len(new) and all(_eq(a, b) for a, b in zip(old, new, strict=True)):
            return w
        named = [(a, s) for a, s in zip(w.axes, old, strict=True) if not _one(s)]
        kept = [s for s in new if not _one(s)]
        if len(named) == len(kept) and all(_eq(s, k) for (_, s), k in zip(named, kept, strict=True)):
            names = iter(a for a, _ in named)  # only size-1 axes added or removed
            return dataclasses.replace(w, axes=tuple("1" if _one(s) else next(names) for s in new))
        if w.axes and w.axes[0] in ("e*o", "e*i") and len(new) == len(old) + 1 and _eq(new[0], self.b.num_experts) \
                and _eq(new[0] * new[1], old[0]) and all(_eq(a, b) for a, b in zip(new[2:], old[1:], strict=True)):
            return dataclasses.replace(w, axes=("e", w.axes[0][2:], *w.axes[1:]))
        raise self.refuse(n, f"reshapes expert weight {w.anchor.name} ({list(old)} -> {list(new)}) in a way the "
                             "pass cannot follow")

    def op_transpose(self, n: fx.Node) -> tuple[object, str]:
        x = self.value(n.args[0])
        old = _shape(n.args[0])
        if old is None:
            raise _NearMiss(self.unsupported(n, op_name(n)))
        ndim = len(old)
        name = op_name(n)
        if name in ("t", "T") or (name == "mT"):
            a, b = (ndim - 2, ndim - 1) if ndim >= 2 else (0, 0)
            perm = list(range(ndim))
            perm[a], perm[b] = perm[b], perm[a]
        elif name == "permute":
            dims = n.args[1:] if len(n.args) > 2 or not isinstance(_arg(n, 1, "dims"), (list, tuple)) else n.args[1]
            perm = [_norm_dim(d, ndim) for d in dims]
        else:
            a, b = _norm_dim(_arg(n, 1, "dim0"), ndim), _norm_dim(_arg(n, 2, "dim1"), ndim)
            perm = list(range(ndim))
            perm[a], perm[b] = perm[b], perm[a]
        if isinstance(x, _Weight):
            return dataclasses.replace(x, axes=tuple(x.axes[p] for p in perm)), "expert weights"
        if isinstance(x, _Routing):
            return x, "routing weights"
        if isinstance(x, _Data):
            p = _pos(x.feat, ndim)
            return dataclasses.replace(x, feat=perm.index(p) - ndim), self.layout_label(x)
        raise _NearMiss(self.unsupported(n, name))

    op_t = op_transpose
    op_T = op_transpose
    op_mT = op_transpose
    op_permute = op_transpose
    op_swapaxes = op_transpose

    def op_expand(self, n: fx.Node) -> tuple[object, str]:
        x = self.value(n.args[0])
        old, new = _shape(n.args[0]), _shape(n)
        if isinstance(x, _Routing):
            return x, "routing weights"
        if isinstance(x, _Data) and old is not None and new is not None and _eq(new[x.feat], old[x.feat]):
            return x, self.layout_label(x)
        raise _NearMiss(self.unsupported(n, op_name(n)))

    op_expand_as = op_expand

    def op_repeat(self, n: fx.Node) -> tuple[object, str]:
        x = self.value(n.args[0])
        if isinstance(x, _Routing):
            return x, "routing weights"
        old, new = _shape(n.args[0]), _shape(n)
        if isinstance(x, _Data) and old is not None and new is not None and _eq(new[x.feat], old[x.feat]):
            return dataclasses.replace(x, src=self.new()), self.layout_label(x)
        raise self.refuse(n, f"repeats {_words(x)} along its feature axis")

    def op_repeat_interleave(self, n: fx.Node) -> tuple[object, str]:
        x = self.value(n.args[0])
        if isinstance(x, _Routing):
            return x, "routing weights"
        old = _shape(n.args[0])
        dim = _arg(n, 2, "dim")
        if isinstance(x, _Data) and old is not None and dim is not None and _norm_dim(dim, len(old)) != \
                _pos(x.feat, len(old)):
            return dataclasses.replace(x, src=self.new()), self.layout_label(x)
        raise self.refuse(n, f"repeats {_words(x)} along its feature axis")

    # -- rows: gathers, splits, concatenations, masks

    def op_getitem(self, n: fx.Node) -> tuple[object, str]:
        self.check_capacity_slice(n)
        x, index = self.value(n.args[0]), n.args[1]
        shape = _shape(n.args[0])
        if isinstance(x, _Weight):
            return self.weight_select(n, x, index), "expert weights"
        if isinstance(x, _Routing):
            dense = x.dense
            return _Routing(dense=dense), "routing weights"
        if not isinstance(x, _Data) or shape is None:
            raise _NearMiss(self.unsupported(n, "getitem"))
        items = _expand_ellipsis(_index_items(index), len(shape))
        axis, feat_item, seen, after = 0, None, False, 0
        p = _pos(x.feat, len(shape))
        for item in items:
            if item is None:
                after += seen
                continue
            if axis == p:
                feat_item, seen = item, True
            elif axis > p:
                if not _full(item):
                    raise self.refuse(n, f"indexes {_words(x)} after its feature axis")
                after += 1
            elif isinstance(item, fx.Node):
                if not isinstance(self.value(item), _Plumb):
                    raise self.refuse(n, f"indexes {_words(x)} with {_words(self.value(item))}")
            elif not _full(item):
                raise self.refuse(n, f"keeps the rows [{_item_text(item)}] of {_words(x)}: an index with literal "
                                     "bounds drops routed rows")
            axis += 1
        if feat_item is None or _full(feat_item):
            return dataclasses.replace(x, feat=-1 - after, src=self.new()), self.layout_label(x)
        if isinstance(feat_item, slice):
            return self.half(n, x, feat_item, -1 - after)
        raise self.refuse(n, f"indexes the feature axis of {_words(x)}")

    def weight_select(self, n: fx.Node, w: _Weight, index: object) -> _Weight:
        items = _index_items(index)
        if "e" not in w.axes:
            raise self.refuse(n, f"indexes expert weight {w.anchor.name} along a feature axis")
        e_axis = w.axes.index("e")
        items = _expand_ellipsis(items, len(w.axes))
        if len(items) != len(w.axes) or any(i is None for i in items):
            raise self.refuse(n, f"indexes expert weight {w.anchor.name} in a way the pass cannot follow")
        if any(not _full(i) for k, i in enumerate(items) if k != e_axis):
            raise self.refuse(n, f"slices the feature axes of expert weight {w.anchor.name}")
        item = items[e_axis]
        hint = scalar_hint(item) if not isinstance(item, slice) else None
        if isinstance(item, int) or (isinstance(item, fx.Node) and isinstance(hint, int)
                                     and not isinstance(node_value(item), torch.Tensor)):
            idx = item if isinstance(item, int) else hint
            sel = ("int", idx) if isinstance(item, int) else ("node", item)
            return dataclasses.replace(w, axes=w.axes[:e_axis] + w.axes[e_axis + 1 :], sel=sel)
        if isinstance(item, fx.Node) and isinstance(self.value(item), _Plumb):
            v = tensor_value(item)
            if v is not None and v.dim() == 0:
                return dataclasses.replace(w, axes=w.axes[:e_axis] + w.axes[e_axis + 1 :], sel=("node", item))
            if v is not None and v.dim() == 1:
                return dataclasses.replace(w, axes=w.axes[:e_axis] + ("r",) + w.axes[e_axis + 1 :], sel=("rows", item))
        if isinstance(item, slice) and item.step is None and item.start in (None, 0) and \
                isinstance(item.stop, int) and item.stop >= self.b.num_experts:
            return w  # the first E of E + Z rows (identity experts keep rows of their own)
        raise self.refuse(n, f"selects experts of {w.anchor.name} in a way the pass cannot follow")

    def half(self, n: fx.Node, x: _Data, s: slice, feat: int) -> tuple[object, str]:
        """``h[..., :I]`` / ``h[..., I:]`` (halves) and ``h[..., ::2]`` / ``h[..., 1::2]`` (interleaved)."""
        if x.stage != "h1" or not x.gated:
            raise self.refuse(n, f"slices the feature axis of {_words(x)}")
        size = _shape(n.args[0])[x.feat]
        half = size // 2 if isinstance(size, int) else None
        which = None
        if s.step == 2 and s.stop is None and s.start in (None, 0, 1):
            which, layout = ("gate" if s.start in (None, 0) else "up"), "interleaved"
        elif s.step in (None, 1) and half is not None:
            if s.start in (None, 0) and s.stop == half:
                which, layout = "gate", "halves"
            elif s.start == half and s.stop in (None, size):
                which, layout = "up", "halves"
        if which is None:
            raise self.refuse(n, f"takes columns {s.start}:{s.stop}:{s.step} of the first product, which are not "
                                 "its gate or up half")
        return self.split_half(x, which, layout, feat), "gate/up split"

    def split_half(self, x: _Data, which: str, layout: str, feat: int) -> _Data:
        return _Data(which, feat, self.new(), chain=("h1", x.src), sel13=x.sel13, on_input=x.on_input, grid=x.grid,
                     b13=x.b13, gated=True, layout=layout)

    def op_split(self, n: fx.Node) -> tuple[object, str]:
        x = self.value(n.args[0])
        shape = _shape(n.args[0])
        if not isinstance(x, _Data) or shape is None:
            raise _NearMiss(self.unsupported(n, op_name(n)))
        dim = _norm_dim(_arg(n, 2, "dim", 0), len(shape))
        parts = node_value(n)
        if dim == _pos(x.feat, len(shape)):
            sizes = [tuple(p.shape)[dim] for p in parts]
            if x.stage != "h1" or not x.gated or len(parts) != 2 or not _eq(sizes[0], sizes[1]):
                raise self.refuse(n, f"splits the feature axis of {_words(x)} into {len(parts)} parts")
            return _Tuple((self.split_half(x, "gate", "halves", x.feat),
                           self.split_half(x, "up", "halves", x.feat))), "gate/up split"
        sizes = _arg(n, 1, "split_size")
        if op_name(n) != "chunk" and _data_dependent(n.args[0], dim) and any(isinstance(s, int) for s in _index_items(sizes)):
            raise _NearMiss(self.capacity_reason(n, n.args[0], None))
        return _Tuple(tuple(dataclasses.replace(x, src=self.new()) for _ in parts)), self.layout_label(x)

    op_chunk = op_split  # chunk(h, 2, dim=-1): the halves; the same rules
    op_split_with_sizes = op_split
    op_tensor_split = op_split

    def op_unbind(self, n: fx.Node) -> tuple[object, str]:
        x = self.value(n.args[0])
        shape = _shape(n.args[0])
        if isinstance(x, _Data) and shape is not None:
            dim = _norm_dim(_arg(n, 1, "dim", 0), len(shape))
            if dim != _pos(x.feat, len(shape)):
                feat = x.feat if dim < _pos(x.feat, len(shape)) else x.feat + 1
                return _Tuple(tuple(dataclasses.replace(x, src=self.new(), feat=feat) for _ in node_value(n))), \
                    self.layout_label(x)
        raise _NearMiss(self.unsupported(n, op_name(n)))

    def op_narrow(self, n: fx.Node) -> tuple[object, str]:
        x = self.value(n.args[0])
        shape = _shape(n.args[0])
        if not isinstance(x, _Data) or shape is None:
            raise _NearMiss(self.unsupported(n, op_name(n)))
        dim = _norm_dim(_arg(n, 1, "dim"), len(shape))
        start, length = _arg(n, 2, "start"), _arg(n, 3, "length")
        if dim == _pos(x.feat, len(shape)) and isinstance(start, int) and isinstance(length, int):
            return self.half(n, x, slice(start, start + length), x.feat)
        raise self.refuse(n, f"narrows the rows of {_words(x)}")

    def op_index_select(self, n: fx.Node) -> tuple[object, str]:
        x = self.value(n.args[0])
        shape = _shape(n.args[0])
        if isinstance(x, _Routing):
            return x, "routing weights"
        if isinstance(x, _Data) and shape is not None:
            dim = _norm_dim(_arg(n, 1, "dim"), len(shape))
            if dim != _pos(x.feat, len(shape)):
                return dataclasses.replace(x, src=self.new()), self.layout_label(x)
        raise self.refuse(n, f"gathers {_words(x)} along its feature axis")

    def op_gather(self, n: fx.Node) -> tuple[object, str]:
        x = self.value(n.args[0])
        if isinstance(x, _Routing):
            return _Routing(dense=False), "routing weights"  # scores.gather(1, ids): top-k weights of [T, E]
        return self.op_index_select(n)

    def op_scatter(self, n: fx.Node) -> tuple[object, str]:
        base, dim, src = self.value(n.args[0]), _arg(n, 1, "dim"), self.value(_arg(n, 3, "src", _arg(n, 3, "value")))
        if isinstance(base, _Const) and base.value == 0.0 and dim in (1, -1) and isinstance(src, _Routing) \
                and not src.dense and n.kwargs.get("reduce") is None:
            index = _arg(n, 2, "index")
            if not (isinstance(index, fx.Node) and distinct_row_ids(index)):
                # scatter keeps one weight where a row's ids repeat; the op sums every slot
                raise _NearMiss(f"{n.name}: scatters the routing weights into a [T, E] matrix (the last write wins "
                                "where a token's ids repeat) by ids that are not a top-k's, so they may repeat")
            return _Routing(dense=True), "routing weights"  # zeros.scatter(1, ids, weights): dense [T, E]
        raise _NearMiss(self.unsupported(n, op_name(n)))

    def op_cat(self, n: fx.Node) -> tuple[object, str]:
        parts = [self.value(p) for p in n.args[0]]
        shape = _shape(n)
        if not parts or not all(isinstance(p, _Data) for p in parts) or shape is None:
            raise _NearMiss(self.unsupported(n, op_name(n)))
        dim = _norm_dim(_arg(n, 1, "dim", 0), len(shape))
        first = parts[0]
        if dim == _pos(first.feat, len(shape)):
            raise self.refuse(n, f"concatenates {_words(first)} along its feature axis")
        merged = self.merge(n, parts)
        return merged, self.layout_label(merged)

    def merge(self, n: fx.Node, parts: list[_Data]) -> _Data:
        """Rows of several chains in one tensor (JetMoE's per-expert products concatenated)."""
        def key(p: _Data) -> _Data:
            return dataclasses.replace(p, src=0, chain=(), sel13=None, sel2=None, terms=())

        if any(key(p) != key(parts[0]) for p in parts[1:]):
            raise self.refuse(n, "concatenates rows that went through different computations")
        sel13 = _merge_sel([p.sel13 for p in parts])
        sel2 = _merge_sel([p.sel2 for p in parts])
        return dataclasses.replace(parts[0], src=self.new(), sel13=sel13, sel2=sel2, chain=())

    def op_stack(self, n: fx.Node) -> tuple[object, str]:
        parts = [self.value(p) for p in n.args[0]]
        shape = _shape(n)
        if not parts or not all(isinstance(p, _Data) for p in parts) or shape is None:
            raise _NearMiss(self.unsupported(n, op_name(n)))
        dim = _norm_dim(_arg(n, 1, "dim", 0), len(shape))
        merged = self.merge(n, parts)
        p = _pos(merged.feat, len(shape) - 1)
        feat = merged.feat - 1 if dim > p else merged.feat
        return dataclasses.replace(merged, feat=feat), self.layout_label(merged)

    def op_masked_fill(self, n: fx.Node) -> tuple[object, str]:
        """``x.masked_fill(mask, 0)`` with a mask from the ids that is constant along the feature axis: a row mask."""
        x, mask, value = self.value(n.args[0]), n.args[1], scalar_hint(_arg(n, 2, "value"))
        self.row_mask(n, x, mask)
        if value != 0:
            raise self.refuse(n, f"fills rows of {_words(x)} with {value} instead of 0")
        return x, self.layout_label(x)

    def row_mask(self, n: fx.Node, x: object, mask: object) -> None:
        if not isinstance(x, _Data):
            raise _NearMiss(self.unsupported(n, op_name(n)))
        if not isinstance(mask, fx.Node) or not isinstance(self.value(mask), _Plumb):
            raise self.refuse(n, f"masks {_words(x)} with a mask computed from float values")
        ms, xs = _shape(mask), _shape(n.args[0]) if isinstance(n.args[0], fx.Node) else None
        if ms is None or xs is None:
            raise _NearMiss(self.unsupported(n, op_name(n)))
        at = len(ms) - (len(xs) - _pos(x.feat, len(xs)))
        if at >= 0 and not _one(ms[at]):
            raise self.refuse(n, f"masks single features of {_words(x)}, not whole rows")

    def op_where(self, n: fx.Node) -> tuple[object, str]:
        if len(n.args) < 3:
            raise _NearMiss(self.unsupported(n, "where"))
        mask, a, b = n.args[0], self.value(n.args[1]), self.value(n.args[2])
        zero_b = b == 0 or b == 0.0 or (isinstance(b, _Const) and b.value == 0.0)
        zero_a = a == 0 or a == 0.0 or (isinstance(a, _Const) and a.value == 0.0)
        data = a if isinstance(a, _Data) and zero_b else b if isinstance(b, _Data) and zero_a else None
        if data is None:
            raise _NearMiss(self.unsupported(n, "where"))
        if not isinstance(mask, fx.Node) or not isinstance(self.value(mask), _Plumb):
            raise self.refuse(n, f"selects between {_words(data)} and 0 with a mask computed from float values")
        return data, self.layout_label(data)

    def op_index_copy(self, n: fx.Node) -> tuple[object, str]:
        base, dim, src = self.value(n.args[0]), _arg(n, 1, "dim"), self.value(_arg(n, 3, "source", _arg(n, 3, "src")))
        if isinstance(base, _Const) and base.value == 0.0 and isinstance(src, _Data) and dim in (0, -len(_shape(n))):
            return dataclasses.replace(src, src=self.new()), self.layout_label(src)  # rows put in another order
        raise _NearMiss(self.unsupported(n, op_name(n)))

    # -- the products

    def op_product(self, n: fx.Node) -> tuple[object, str]:
        name = op_name(n)
        ops = [a for a in n.args if isinstance(a, fx.Node)][:2]
        vals = [self.value(a) for a in ops]
        if len(vals) != 2:
            raise _NearMiss(self.unsupported(n, name))
        if name in _GROUPED:
            if n.kwargs.get("bias") is not None:
                raise self.refuse(n, "a grouped product with a bias argument")
            d, w = vals
            if not isinstance(d, _Data) or not isinstance(w, _Weight) or w.axes != ("e", "i", "o"):
                raise self.refuse(n, f"multiplies {_words(vals[0])} by {_words(vals[1])} in a way that is not an "
                                     "expert product")
            return self.product(n, d, w, feat=-1, grid=False)
        if name == "linear":
            d, w = vals
            bias = _arg(n, 2, "bias")
            if bias is not None:
                raise self.refuse(n, "an expert linear with a bias argument")
            if isinstance(d, _Data) and isinstance(w, _Weight) and len(w.axes) == 2 and w.axes[1] == "i" and \
                    d.feat == -1:
                return self.product(n, d, dataclasses.replace(w, axes=(w.axes[1], w.axes[0])), feat=-1, grid=False)
            raise self.refuse(n, f"applies {_words(w)} to {_words(d)} the wrong way round")
        a, b = vals
        if isinstance(a, _Data) and isinstance(b, _Weight) and a.feat == -1 and b.axes[-2:] == ("i", "o"):
            return self.product(n, a, b, feat=-1, grid="e" in b.axes)  # rows @ W
        if isinstance(a, _Weight) and isinstance(b, _Data) and b.feat == -2 and a.axes[-2:] == ("o", "i"):
            return self.product(n, b, a, feat=-2, grid="e" in a.axes)  # W @ rows[..., None]
        raise self.refuse(n, f"multiplies {_words(a)} by {_words(b)}, which is not an expert product (a product "
                             "over the wrong axis or of two activations)")

    def op_fp8_product(self, n: fx.Node) -> tuple[object, str]:
        """``fp8_block_linear(x, w[e], s[e])``, ``fp8_block_grouped_mm(x, w, s, offsets)``,
        ``fp8_block_batched_mm(x, w, s, ids)``: rows times the fp8 weight dequantised by its block scale (``x @
        (w * s).T`` per 128x128 block), the weight stored ``[E, N, K]`` as the kernels read it."""
        name = op_name(n)
        if len(n.args) < 3 or n.kwargs:
            raise _NearMiss(self.unsupported(n, name))
        d, w, s = (self.value(a) for a in n.args[:3])
        if not isinstance(d, _Data) or not isinstance(w, _Weight) or d.feat != -1:
            raise self.refuse(n, f"multiplies {_words(d)} by {_words(w)} in a way that is not an expert product")
        scale = self.scale_of.get(w.anchor)
        if not isinstance(s, _Weight) or scale is None or s.anchor is not scale:
            raise self.refuse(n, f"scales fp8 weight {w.anchor.name} by {_words(s)}, not by its own block scales")
        if s.axes != w.axes or _sel_key(s.sel) != _sel_key(w.sel):
            raise self.refuse(n, f"reads other experts of the block scales {s.anchor.name} than of {w.anchor.name}")
        if name == "fp8_block_linear" and w.axes == ("o", "i"):
            return self.product(n, d, dataclasses.replace(w, axes=("i", "o")), feat=-1, grid=False, scaled=True)
        if name == "fp8_block_grouped_mm" and w.axes == ("e", "o", "i") and w.sel == "all":
            return self.product(n, d, dataclasses.replace(w, axes=("e", "i", "o")), feat=-1, grid=False, scaled=True)
        ids = n.args[3] if len(n.args) > 3 else None
        if name == "fp8_block_batched_mm" and w.axes == ("e", "o", "i") and w.sel == "all" and \
                isinstance(ids, fx.Node) and isinstance(self.value(ids), _Plumb):
            rows = dataclasses.replace(w, axes=("r", "i", "o"), sel=("rows", ids))
            return self.product(n, d, rows, feat=-1, grid=False, scaled=True)
        raise self.refuse(n, f"applies {_words(w)} {list(w.axes)} in a way the pass cannot follow")

    def product(self, n: fx.Node, d: _Data, w: _Weight, feat: int, grid: bool, scaled: bool = False
                ) -> tuple[object, str]:
        if w.anchor not in self.uses:
            raise self.refuse(n, f"multiplies {_words(d)} by {w.anchor.name}, which is not an expert weight")
        if w.anchor in self.scale_of and not scaled:
            raise self.refuse(n, f"multiplies by fp8 weight {w.anchor.name} without its block scales "
                                 f"({self.scale_of[w.anchor].name})")
        self.uses[w.anchor].append(w.sel)
        sel = w.sel
        if w.role in ("w13", "gate", "up"):
            if d.stage != "x":
                raise self.refuse(n, f"the first expert product reads {_words(d)}, not the hidden rows")
            common = dict(src=self.new(), sel13=sel, on_input=d.on_input, grid=grid or d.grid)
            if w.role == "w13" and self.b.gated:
                return _Data("h1", feat, **common), "first product"
            if w.role == "w13":  # non-gated: the whole product goes through the activation
                return _Data("gate", feat, chain=("h1", common["src"]), gated=False, **common), "first product"
            chain = ("x", d.src, _sel_key(sel))  # gate and up by two products (their op layout: the caller's)
            return _Data(w.role, feat, chain=chain, gated=True, layout="separate", **common), "first product"
        if w.role == "w2":
            ready = d.stage == "mid" or (d.stage == "act" and not d.gated)
            if not ready:
                raise self.refuse(n, f"the second expert product reads {_words(d)}, not the activation")
            single = (_sel_key(d.sel13), _sel_key(sel))
            if all(isinstance(s, tuple) and s[0] in ("int", "node", "rows") for s in single) and single[0] != single[1]:
                raise self.refuse(n, f"the second product uses another expert's weight than the first "
                                     f"({single[0]} vs {single[1]})")
            spec = d.spec
            if d.stage == "act":  # non-gated: the activation is the whole of it
                spec = ExpertActivation(d.act, False, "halves", d.alpha, d.limit, 0.0)
                if spec.problems():
                    raise self.refuse(n, "; ".join(spec.problems()))
            return dataclasses.replace(d, stage="y", feat=feat, src=self.new(), sel2=sel, grid=grid or d.grid,
                                       spec=spec), "second product"
        raise self.refuse(n, f"{_words(w)} is multiplied, not added")

    # -- arithmetic

    def operands(self, n: fx.Node, commutative: bool) -> tuple[object, object, object]:
        """``(data, other, other's raw argument)`` of a binary op whose first operand (either, when
        ``commutative``) is a data value."""
        raw = list(n.args[:2]) + [n.kwargs.get("other")] * (2 - len(n.args[:2]))
        a, b = (self.value(x) for x in raw)
        if commutative and isinstance(b, _Data) and not isinstance(a, _Data):
            return b, a, raw[0]
        if not isinstance(a, _Data):
            raise _NearMiss(self.unsupported(n, op_name(n)))
        return a, b, raw[1]

    def op_add(self, n: fx.Node) -> tuple[object, str]:
        subtract = op_name(n) in ("sub", "isub", "sub_")
        a, b, raw = self.operands(n, commutative=not subtract)
        if n.kwargs.get("alpha") not in (None, 1):
            raise self.refuse(n, "an add with alpha")
        if isinstance(b, _Weight) and not subtract:
            return self.bias(n, a, b)
        if a.stage == "out" and isinstance(b, _Data) and b.stage == "out" and not subtract:
            return dataclasses.replace(a, src=self.new(), terms=a.terms + b.terms), "combine"
        if isinstance(b, _Const) and b.value == 0.0:
            return a, self.layout_label(a)
        c = scalar_hint(raw) if not isinstance(b, (_Data, _Weight, _Routing, _Const)) else None
        if c is not None:
            c = -float(c) if subtract else float(c)
            if a.stage == "up" and a.offset == 0.0:
                return dataclasses.replace(a, src=self.new(), offset=c), "up offset"
            raise self.refuse(n, f"adds {c:g} to {_words(a)}")
        raise self.refuse(n, f"{'subtracts' if subtract else 'adds'} {_words(b)} and {_words(a)}")

    op_sub = op_add

    def bias(self, n: fx.Node, d: _Data, w: _Weight) -> tuple[object, str]:
        if w.role != "bias":
            raise self.refuse(n, f"adds expert weight {w.anchor.name} (not a bias) to {_words(d)}")
        shape, bshape = _shape(n.args[0] if self.value(n.args[0]) is d else n.args[1]), None
        for a in n.args[:2]:
            if isinstance(a, fx.Node) and self.value(a) is w:
                bshape = _shape(a)
        if shape is None or bshape is None:
            raise _NearMiss(self.unsupported(n, op_name(n)))
        at = len(w.axes) - (len(shape) - _pos(d.feat, len(shape)))
        if at < 0 or w.axes[at] != "o" or any(a not in ("e", "r", "1") for k, a in enumerate(w.axes) if k != at):
            raise self.refuse(n, f"adds bias {w.anchor.name} along an axis that is not the product's features")
        single = (_sel_key(w.sel), _sel_key(d.sel13 if d.stage in ("h1", "gate") else d.sel2))
        if all(isinstance(s, tuple) and s[0] in ("int", "node") for s in single) and single[0] != single[1]:
            raise self.refuse(n, f"adds another expert's bias ({single[0]} vs {single[1]})")
        if d.stage == "h1" or (d.stage == "gate" and not d.gated and d.limit is None and not d.of):
            if d.b13 is not None:
                raise self.refuse(n, "a second bias on the first product")
            return dataclasses.replace(d, src=self.new(), b13=w.anchor), "bias"
        if d.stage == "y" and d.b2 is None and d.on_output is None:
            return dataclasses.replace(d, src=self.new(), b2=w.anchor), "bias"
        if d.stage == "y" and d.on_output is not None:
            raise self.refuse(n, f"adds bias {w.anchor.name} after the routing weight (moe_fx::experts scales the "
                                 "biased expert output)")
        raise self.refuse(n, f"adds bias {w.anchor.name} to {_words(d)}")

    def op_mul(self, n: fx.Node) -> tuple[object, str]:
        a, b, raw = self.operands(n, commutative=True)
        if isinstance(b, _Routing):
            return self.weighting(n, a, b, raw)
        if isinstance(b, _Data):
            return self.product_of_stages(n, a, b)
        c = scalar_hint(raw)
        if c is None and isinstance(b, (_Plumb, _Const)):
            raise self.refuse(n, f"multiplies {_words(a)} by a value computed from the expert ids alone (a mask or "
                                 "count): moe_fx::experts has no such factor")
        if c == 1:
            return a, self.layout_label(a)  # a model's scale at 1 (a run-time float is guarded on its value)
        if c is not None and a.stage == "gate" and a.of == 0:
            return dataclasses.replace(a, stage="scaled", src=self.new(), alpha=float(c), of=a.src), "activation"
        if c is not None:
            raise self.refuse(n, f"scales {_words(a)} by {c:g}: moe_fx::experts has no such factor")
        raise self.refuse(n, f"multiplies {_words(a)} by {_words(b)}")

    def weighting(self, n: fx.Node, d: _Data, r: _Routing, rnode: object) -> tuple[object, str]:
        dnode = n.args[1] if n.args[0] is rnode else n.args[0]
        dshape, rshape = _shape(dnode), _shape(rnode)
        if dshape is None or rshape is None:
            raise _NearMiss(self.unsupported(n, "mul"))
        at = len(rshape) - (len(dshape) - _pos(d.feat, len(dshape)))
        if at >= 0 and not _one(rshape[at]):
            raise self.refuse(n, f"multiplies {_words(d)} by routing weights that vary along the feature axis")
        kind = "dense" if r.dense else "sparse"
        if d.on_input is not None or d.on_output is not None:
            raise self.refuse(n, "the routing weights scale this row a second time")
        if d.stage == "x":
            return dataclasses.replace(d, on_input=kind), "routing weight"
        if d.stage in ("mid", "y") or (d.stage == "act" and not d.gated):
            return dataclasses.replace(d, on_output=kind), "routing weight"
        raise self.refuse(n, f"the routing weights scale {_words(d)}, between the first product and the "
                             "activation (moe_fx::experts scales the hidden rows or the expert output)")

    def product_of_stages(self, n: fx.Node, a: _Data, b: _Data) -> tuple[object, str]:
        pair = {a.stage, b.stage}
        if pair == {"gate", "sig"}:
            gate, sig = (a, b) if a.stage == "gate" else (b, a)
            if sig.of == gate.src:
                return _act(self, gate, "silu", sig.alpha), "activation"
        if pair == {"act", "up"} or (a.stage == b.stage == "act" and a.src == b.src and a.act == "relu"):
            if a.stage == b.stage == "act":
                return dataclasses.replace(a, src=self.new(), act="relu2"), "activation"
            act, up = (a, b) if a.stage == "act" else (b, a)
            return self.gated_product(n, act, up)
        raise self.refuse(n, f"multiplies {_words(a)} by {_words(b)}")

    def gated_product(self, n: fx.Node, act: _Data, up: _Data) -> tuple[object, str]:
        if not act.gated:
            raise self.refuse(n, "multiplies a non-gated activation by another product")
        if act.chain != up.chain:
            raise self.refuse(n, "multiplies the activation of one product by the up half of another")
        if act.layout != up.layout:
            raise self.refuse(n, "gate and up halves taken in different layouts")
        if act.limit != up.limit:
            if up.limit is None:
                raise self.refuse(n, f"the gate is clamped at {act.limit:g} but the up half is not (moe_fx::experts "
                                     "clamps both with one limit)")
            if act.limit is None:
                raise self.refuse(n, f"the up half is clamped at {up.limit:g} but the gate is not")
            raise self.refuse(n, f"gate and up are clamped at different bounds ({act.limit:g} and {up.limit:g})")
        layout = "halves" if act.layout == "separate" else act.layout
        spec = ExpertActivation(act.act, True, layout, act.alpha, act.limit, up.offset)
        if spec.problems():
            raise self.refuse(n, "; ".join(spec.problems()))
        if act.on_input != up.on_input:
            raise self.refuse(n, "gate and up read differently weighted rows")
        b13 = act.b13 if act.b13 is not None else up.b13
        return dataclasses.replace(act, stage="mid", src=self.new(), spec=spec, b13=b13), "gated product"

    # -- activation, clamps

    def op_silu(self, n: fx.Node) -> tuple[object, str]:
        return self.activation(n, "silu")

    def op_relu(self, n: fx.Node) -> tuple[object, str]:
        return self.activation(n, "relu")

    def op_gelu(self, n: fx.Node) -> tuple[object, str]:
        approx = _arg(n, 1, "approximate", "none")
        return self.activation(n, "gelu_tanh" if approx == "tanh" else "gelu")

    def activation(self, n: fx.Node, name: str) -> tuple[object, str]:
        x = self.value(n.args[0])
        if not isinstance(x, _Data) or x.stage != "gate" or x.of:
            raise self.refuse(n, f"applies {name} to {_words(x)}" + (" (a second activation)" if isinstance(x, _Data)
                                                                      and x.stage in ("act", "mid") else ""))
        return _act(self, x, name, 1.0), "activation"

    def op_sigmoid(self, n: fx.Node) -> tuple[object, str]:
        x = self.value(n.args[0])
        if isinstance(x, _Data) and x.stage == "scaled":
            return dataclasses.replace(x, stage="sig", src=self.new()), "activation"
        if isinstance(x, _Data) and x.stage == "gate" and not x.of:
            return dataclasses.replace(x, stage="sig", src=self.new(), alpha=1.0, of=x.src), "activation"
        raise self.refuse(n, f"sigmoid of {_words(x)} (only g * sigmoid(alpha * g), SiLU, is part of moe_fx::experts)")

    def op_square(self, n: fx.Node) -> tuple[object, str]:
        x = self.value(n.args[0])
        if isinstance(x, _Data) and x.stage == "act" and x.act == "relu":
            return dataclasses.replace(x, src=self.new(), act="relu2"), "activation"
        raise self.refuse(n, f"squares {_words(x)} (only relu(h)^2 is part of moe_fx::experts)")

    def op_pow(self, n: fx.Node) -> tuple[object, str]:
        if scalar_hint(_arg(n, 1, "exponent")) != 2:
            raise self.refuse(n, f"raises {_words(self.value(n.args[0]))} to a power other than 2")
        return self.op_square(n)

    def op_clamp(self, n: fx.Node) -> tuple[object, str]:
        x = self.value(n.args[0])
        name = op_name(n).rstrip("_")
        if name == "clamp_min":
            raw = (_arg(n, 1, "min"), None)
        elif name == "clamp_max":
            raw = (None, _arg(n, 1, "max"))
        else:
            raw = (_arg(n, 1, "min"), _arg(n, 2, "max"))
        lo, hi = (None if r is None else scalar_hint(r) for r in raw)
        if any(r is not None and v is None for r, v in zip(raw, (lo, hi), strict=True)):
            raise self.refuse(n, "a clamp bound with no known value (a tensor, or a run-time value with no hint)")
        lo = None if lo is None or lo == -math.inf else float(lo)
        hi = None if hi is None or hi == math.inf else float(hi)
        if lo is None and hi is None and isinstance(x, _Data):
            return x, self.layout_label(x)  # clamp(max=inf): no bound at all
        if not isinstance(x, _Data) or x.stage not in ("gate", "up") or x.limit is not None or x.of or x.offset:
            raise self.refuse(n, f"clamps {_words(x)} (moe_fx::experts clamps only the gate and up halves before "
                                 "the activation)")
        if x.stage == "gate" and x.gated:
            if lo is not None or hi is None or not hi > 0:
                raise self.refuse(n, f"clamps the gate to [{lo}, {hi}] (moe_fx::experts clamps it from above only)")
            return dataclasses.replace(x, src=self.new(), limit=hi), "clamp"
        if lo is None or hi is None or lo != -hi or not hi > 0:
            raise self.refuse(n, f"clamps {_words(x)} to [{lo}, {hi}] (moe_fx::experts clamps it to [-limit, limit])")
        return dataclasses.replace(x, src=self.new(), limit=hi), "clamp"

    op_clamp_min = op_clamp
    op_clamp_max = op_clamp

    # -- combine

    def op_sum(self, n: fx.Node) -> tuple[object, str]:
        x = self.value(n.args[0])
        shape = _shape(n.args[0])
        dims = _arg(n, 1, "dim")
        if not isinstance(x, _Data) or shape is None:
            raise _NearMiss(self.unsupported(n, "sum"))
        if dims is None:
            raise self.refuse(n, f"sums {_words(x)} over every axis")
        dims = [_norm_dim(d, len(shape)) for d in _index_items(dims)]
        p = _pos(x.feat, len(shape))
        if p in dims:
            raise self.refuse(n, f"sums {_words(x)} over its feature axis")
        if _arg(n, 2, "keepdim", False):
            feat = x.feat
        else:
            feat = x.feat + sum(1 for d in dims if d > p)
        if x.stage == "out":
            raise self.refuse(n, "sums the combined output again")
        term = self.term(n, x)
        return _Data("out", feat, self.new(), terms=(term,)), "combine"

    def term(self, n: fx.Node, d: _Data) -> _Term:
        if d.on_input is None and d.on_output is None:
            raise self.refuse(n, f"adds {_words(d)} to the output without a routing weight")
        kind = d.on_input or d.on_output
        if d.stage == "x":
            if kind == "dense":
                raise self.refuse(n, "adds weighted hidden rows of every expert to the output")
            return _Term(None, True, None, None, False)
        if d.stage != "y":
            raise self.refuse(n, f"adds {_words(d)} to the output, before the second product")
        if (kind == "dense") != d.grid:
            raise self.refuse(n, "the routing weights' layout does not match the rows' (dense scores on routed rows, "
                                 "or top-k weights on every expert)")
        if d.grid and d.on_input and (d.b13 is not None or d.b2 is not None):
            raise self.refuse(n, "every expert runs on its weighted input and has a bias: experts not chosen add "
                                 "their bias, which moe_fx::experts does not")
        return _Term(d.spec, d.on_input is not None, d.b13, d.b2, d.grid)

    def accumulate(self, n: fx.Node, acc: object, src: object, dim: object) -> tuple[object, str]:
        shape = _shape(n)
        if not isinstance(src, _Data) or shape is None:
            raise _NearMiss(self.unsupported(n, op_name(n)))
        if not (isinstance(acc, _Const) and acc.value == 0.0) and not (isinstance(acc, _Data) and acc.stage == "out"):
            raise self.refuse(n, f"adds expert outputs into {_words(acc)}, not into zeros")
        feat = _pos(acc.feat, len(shape)) if isinstance(acc, _Data) else len(shape) - 1
        if not isinstance(dim, int) or _norm_dim(dim, len(shape)) == feat:
            raise self.refuse(n, "adds along the feature axis")
        terms = acc.terms if isinstance(acc, _Data) else ()
        return _Data("out", -1, self.new(), terms=terms + (self.term(n, src),)), "combine"

    def op_index_add(self, n: fx.Node) -> tuple[object, str]:
        if n.kwargs.get("alpha") not in (None, 1):
            raise self.refuse(n, "index_add with alpha")
        return self.accumulate(n, self.value(n.args[0]), self.value(_arg(n, 3, "source")), _arg(n, 1, "dim"))

    def op_scatter_add(self, n: fx.Node) -> tuple[object, str]:
        return self.accumulate(n, self.value(n.args[0]), self.value(_arg(n, 3, "src")), _arg(n, 1, "dim"))

    def op_index_put(self, n: fx.Node) -> tuple[object, str]:
        if not _arg(n, 3, "accumulate", False):
            raise self.refuse(n, "index_put without accumulate overwrites rows")
        return self.accumulate(n, self.value(n.args[0]), self.value(_arg(n, 2, "values")), 0)

    # -- the end

    def finish(self, output: fx.Node) -> FormReading:
        v = self.val.get(output)
        if isinstance(v, _Data) and v.stage == "y" and self.b.top_k == 1:
            v = _Data("out", v.feat, 0, terms=(self.term(output, v),))  # one expert per token: nothing to sum
        if not isinstance(v, _Data) or v.stage != "out":
            raise _NearMiss(f"the region's output {output.name} is {_words(v)}, not the combined expert outputs")
        routed = [t for t in v.terms if t.spec is not None]
        if not routed:
            raise _NearMiss("no routed expert reaches the output")
        first = routed[0]
        for t in routed[1:]:
            if t != first:
                raise _NearMiss(f"experts compute different things ({_describe(first)} and {_describe(t)})")
        self.check_coverage()
        counts: dict[str, int] = {}
        for label in self.label.values():
            counts[label] = counts.get(label, 0) + 1
        return FormReading(first.spec, first.on_input, len(v.terms) - len(routed), first.b13, first.b2, counts)

    def check_coverage(self) -> None:
        e = self.b.num_experts
        for anchor, uses in self.uses.items():
            w = self.b.weights_of[anchor]
            if not uses:
                raise _NearMiss(f"expert weight {anchor.name} is not used by an expert product")
            if w.expert is not None:
                if len(uses) != 1:
                    raise _NearMiss(f"expert weight {anchor.name} is used by {len(uses)} products")
                continue
            keys = [_sel_key(s) for s in uses]
            if any(k == "all" or k[0] == "rows" for k in keys):
                if len(keys) != 1:
                    raise _NearMiss(f"expert weight {anchor.name} is used by {len(keys)} products")
                continue
            ints = sorted(k[1] for k in keys if k[0] == "int")
            nodes = [k for k in keys if k[0] == "node"]
            if ints and nodes:
                raise _NearMiss(f"expert weight {anchor.name} is indexed both by literals and by tensors")
            if ints and ints != list(range(e)):
                raise _NearMiss(f"the products of {anchor.name} use experts {ints}, not each of 0..{e - 1} once")
            if nodes and len(nodes) != e:
                raise _NearMiss(f"{len(nodes)} products use expert weight {anchor.name}, which has {e} experts")


def _act(r: _Reader, gate: _Data, name: str, alpha: float) -> _Data:
    return dataclasses.replace(gate, stage="act", src=r.new(), act=name, alpha=alpha, of=0)


def _sel_key(sel: object) -> object:
    if isinstance(sel, tuple) and sel[0] == "node":
        return ("node", sel[1].name)
    if isinstance(sel, tuple) and sel[0] == "rows":
        return ("rows", sel[1].name)
    return sel


def _merge_sel(sels: list) -> object:
    if all(s is None for s in sels):
        return None
    ints = [s[1] for s in sels if isinstance(s, tuple) and s[0] == "int"]
    if len(ints) == len(sels):
        return ("set", frozenset(ints))
    return "all" if all(s == "all" for s in sels) else ("merged", len(sels))


def _describe(t: _Term) -> str:
    parts = [t.spec.describe() if t.spec is not None else "identity"]
    if t.on_input:
        parts.append("weights on input")
    parts += [f"bias {b.name}" for b in (t.b13, t.b2) if b is not None]
    return ", ".join(parts)


def read_form(nodes: Iterable[fx.Node], output: fx.Node, boundary: Boundary) -> FormReading | str:
    """Prove that ``nodes`` (a region, in graph order) compute ``moe_fx::experts`` from ``boundary`` up to
    ``output``; returns what was read, or the near miss's reason (naming the op that is not accounted for)."""
    try:
        return _Reader(boundary, list(nodes)).run(output)
    except _NearMiss as exc:
        return str(exc)


#: Ops through which the top-k ids keep their values (a cast, a layout change, a subset of slots).
_ID_KEEPS = frozenset({"to", "long", "int", "type", "contiguous", "clone", "detach", "view", "reshape", "flatten",
                       "unsqueeze", "squeeze", "expand", "getitem", "narrow"})
#: Ops whose ids are positions along their input's ``dim``: the argument position of ``dim``, its default.
_ID_SOURCES = {"topk": (2, -1), "argmax": (1, None), "max": (1, None), "sort": (1, -1), "argsort": (1, -1)}


#: Ops through which each row of ids keeps its values in place (casts and copies).
_ID_CASTS = frozenset({"to", "long", "int", "type", "contiguous", "clone", "detach"})


def distinct_row_ids(ids: fx.Node) -> bool:
    """Whether the graph proves each row of ``ids`` holds distinct values: the indices of a ``topk``, ``sort`` or
    ``argsort`` along the last axis, through casts and copies only."""
    n = ids
    while op_name(n) in _ID_CASTS and n.args and isinstance(n.args[0], fx.Node):
        n = n.args[0]
    if op_name(n) == "getitem" and isinstance(n.args[0], fx.Node) and n.args[1] == 1:
        n = n.args[0]
    elif op_name(n) != "argsort":
        return False
    if op_name(n) not in ("topk", "sort", "argsort"):
        return False
    pos, default = _ID_SOURCES[op_name(n)]
    src = _shape(n.args[0]) if n.args and isinstance(n.args[0], fx.Node) else None
    dim = _arg(n, pos, "dim", default)
    return src is not None and isinstance(dim, int) and dim in (-1, len(src) - 1)


def expert_id_bound(ids: fx.Node) -> tuple[int | None, str]:
    """How many experts the top-k ids ``ids`` can name, read from where they come from: ``(bound, where)``, the ids
    then lie in ``[0, bound)`` (``topk`` / ``sort`` / ``max`` / ``argmax`` over a ``[T, bound]`` tensor, through
    casts, reshapes and slices, and concatenations of such ids); or ``(None, why not)`` when the graph gives no
    bound (the ids are a graph input, or computed by other ops)."""
    n: object = ids
    while isinstance(n, fx.Node):
        name = op_name(n)
        if name in ("cat", "concat", "stack") and n.args and isinstance(n.args[0], (list, tuple)):
            parts = [expert_id_bound(p) if isinstance(p, fx.Node) else (None, "a constant") for p in n.args[0]]
            unbounded = next((why for b, why in parts if b is None), None)
            if unbounded is not None or not parts:
                return None, unbounded or f"the expert ids are an empty {name}"
            return max(b for b, _ in parts), f"{name} ({n.name}) of " + ", ".join(why for _, why in parts)
        if name == "getitem" and isinstance(n.args[0], fx.Node) and op_name(n.args[0]) in _ID_SOURCES and \
                n.args[1] == 1:
            n = n.args[0]  # the indices of (values, indices)
            break
        if name in _ID_SOURCES and isinstance(tensor_value(n), torch.Tensor):
            break  # argmax / argsort return the indices themselves
        if name in ("masked_fill", "where"):
            return _filled_id_bound(n)
        if name not in _ID_KEEPS or not n.args or not isinstance(n.args[0], fx.Node):
            what = "a graph input" if n.op == "placeholder" else f"computed by {name} ({n.name})"
            return None, f"the expert ids are {what}"
        n = n.args[0]
    if not isinstance(n, fx.Node):
        return None, "the expert ids are not computed in the graph"
    pos, default = _ID_SOURCES[op_name(n)]
    src = _shape(n.args[0]) if n.args and isinstance(n.args[0], fx.Node) else None
    dim = _arg(n, pos, "dim", default)
    if src is None or dim is None or not isinstance(dim, int) or not src:
        return None, f"the expert ids come from {op_name(n)} ({n.name}) over an axis the pass cannot tell"
    size = src[dim]
    if not isinstance(size, int):
        return None, f"the expert ids come from {op_name(n)} ({n.name}) over a symbolic axis ({size})"
    return size, f"{op_name(n)} over {list(src)} at {n.name}"


def _filled_id_bound(n: fx.Node) -> tuple[int | None, str]:
    """:func:`expert_id_bound` of ``ids.masked_fill(mask, v)`` / ``where(mask, ids, v)`` / ``where(mask, v, ids)``
    with a literal ``v``: the ids' bound, widened to hold ``v``; a mask ``ids == bound - 1`` (Zaya's skip expert
    sent to expert 0) removes the top id. A negative ``v`` (``-1`` for "no expert") is outside any bound."""
    name = op_name(n)
    if name == "masked_fill" and len(n.args) >= 3:
        mask, ids, fill, replaced_when = n.args[1], n.args[0], n.args[2], True
    elif name == "where" and len(n.args) == 3 and isinstance(n.args[1], fx.Node) != isinstance(n.args[2], fx.Node):
        mask = n.args[0]
        ids, fill, replaced_when = (n.args[1], n.args[2], False) if isinstance(n.args[1], fx.Node) else \
            (n.args[2], n.args[1], True)
    else:
        return None, f"the expert ids are computed by {name} ({n.name})"
    value = fill if isinstance(fill, (int, float)) and not isinstance(fill, bool) else None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(ids, fx.Node) or not isinstance(value, int):
        return None, f"the expert ids are computed by {name} ({n.name}) with a fill that is not a literal"
    if value < 0:
        return None, f"the expert ids can be {value} ({name} at {n.name})"
    bound, where = expert_id_bound(ids)
    if bound is None:
        return None, where
    top_removed = replaced_when and isinstance(mask, fx.Node) and op_name(mask) == "eq" and \
        mask.args[0] is ids and scalar_hint(mask.args[1]) == bound - 1
    kept = bound - 1 if top_removed else bound
    if value >= kept:
        # A sentinel past every expert the router names ("no expert", as -1 is): no bound in [0, E), so the
        # probe checks that the region skips such ids as moe_fx::experts does.
        return None, f"the expert ids can be {value} ({name} at {n.name}, past the {kept} the router chooses among)"
    return kept, f"{where}, then {name} ({n.name}) with {value}"


def region_boundary(region: Region) -> Boundary:
    """The :class:`Boundary` of a region cut out of a Dynamo graph (:mod:`extract_region`)."""
    a = region.anchors
    views: dict[fx.Node, WeightView] = {}
    if a.kind == "stacked":
        axes = ("e", "i", "o") if a.transposed else ("e", "o", "i")
        views[a.w13], views[a.w2] = WeightView("w13", axes), WeightView("w2", axes)
    else:
        for role, nodes in (("gate", a.gate), ("up", a.up), ("w2", a.down)):
            for e, w in enumerate(nodes):
                views[w] = WeightView(role, ("o", "i"), e)
    for b in region.biases:
        views[b] = WeightView("bias", ("e", "o"))
    return Boundary(region.hidden, region.ids, region.weights, region.dense_scores, views, a.num_experts,
                    region.top_k, a.gated)


def read_region(region: Region) -> FormReading | str:
    """:func:`read_form` on a region of a Dynamo graph; the biases must be where the region found them."""
    order = {n: i for i, n in enumerate(region.output.graph.nodes)}
    reading = read_form(sorted(region.nodes, key=order.__getitem__), region.output, region_boundary(region))
    if isinstance(reading, FormReading) and (reading.w13_bias, reading.w2_bias) != (region.w13_bias, region.w2_bias):
        return "the biases are not added where their shapes say (w13's to the first product, w2's to the second)"
    if isinstance(reading, FormReading) and reading.identity_experts:
        return "the region adds weighted hidden states to its output (identity experts) inside a traced graph"
    bound, where = expert_id_bound(region.ids)
    if isinstance(reading, FormReading) and bound is not None and bound > region.anchors.num_experts:
        # The probe draws ids in [0, E): ids the router makes beyond them would meet code never checked.
        return (f"the router chooses among {bound} experts ({where}) but the expert weights hold "
                f"{region.anchors.num_experts}: ids past them would be skipped by moe_fx::experts, and what the "
                "region does with them is not proved")
    return reading
