"""Cut the experts region of one MoE block out of a graph, given its expert weights.

The region is everything from the routing results to the combined output: it starts at three
boundary tensors that the model computes itself and keeps computing,

* ``hidden``   ``[T, H]`` float: the tokens the experts read,
* ``ids``      ``[T, K]`` int:   the top-k expert ids,
* ``weights``  ``[T, K]`` float: the top-k routing weights,

plus the expert weights (the anchors), and ends at one output ``[T, H]`` in the dtype of ``hidden``.
The output is the earliest node after the last expert product at which the region is *closed*:
no value computed inside is read outside except the output, nothing outside is mutated, and no
other graph input is read. Routing stays outside, untouched.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from moe_fx.passes.find_experts import ExpertWeights, _first_matmul
from moe_fx.passes.graph_utils import DataFlow, is_factory, is_matmul, node_value, op_name, tensor_value

__all__ = ["Region", "extract_region"]

log = logging.getLogger("moe_fx.passes")

_MAX_OUTPUT_CANDIDATES = 48
_MAX_BOUNDARY_RETRIES = 4
_SYMBOLIC_TAIL_OPS = frozenset(
    {"getitem", "sym_size", "sym_size.int", "ge", "le", "lt", "gt", "eq", "_assert_scalar", "_check_is_size",
     "sym_constrain_range_for_size"}
)


@dataclass
class Region:
    """One experts region: its boundary, its nodes and its output.

    Attributes:
        anchors: the expert weights.
        nodes: the nodes the rewrite removes (boundary and anchors excluded).
        output: the node whose value the op replaces.
        output_base: when ``output`` is an in-place op, the tensor it writes into; readers of that
            tensor after ``output`` read the op's result.
        hidden, ids, weights: the boundary tensors (see the module docstring).
        num_tokens, top_k: T and K (T may be symbolic).
    """

    anchors: ExpertWeights
    nodes: set[fx.Node]
    output: fx.Node
    output_base: fx.Node | None
    hidden: fx.Node
    ids: fx.Node
    weights: fx.Node
    num_tokens: object
    top_k: int
    ops: set[str] = field(default_factory=set)

    @property
    def form(self) -> str:
        """How the experts were written: ``expert_loop``, ``grouped_mm``, ``batched_mm`` or ``dense_bmm``."""
        if self.anchors.kind == "per_expert":
            return "expert_loop"
        if self.ops & {"_grouped_mm", "grouped_mm", "grouped_mm_fallback"}:
            return "grouped_mm"
        # batched_mm gathers each routed token's expert weights; a dense form runs every expert.
        weight_indexed = any(op_name(u) == "getitem" for w in self.anchors.nodes for u in w.users)
        return "batched_mm" if weight_indexed else "dense_bmm"

    def output_readers(self, flow: DataFlow) -> list[fx.Node]:
        """Nodes outside the region that read its output value."""
        readers = [u for u in self.output.users if u not in self.nodes]
        if self.output_base is not None:
            pos = flow.order[self.output]
            readers += [u for u in self.output_base.users if u not in self.nodes and flow.order[u] > pos]
        return readers


class _Reject(Exception):
    """Raised inside region building; the message is the reason reported to the user."""


def _same(a: object, b: object) -> bool:
    return bool(statically_known_true(a == b))


def _expert_products(flow: DataFlow, anchors: ExpertWeights) -> list[fx.Node]:
    mms = [_first_matmul(flow, w) for w in anchors.nodes]
    return [m for m in mms if m is not None]


def _output_candidates(flow: DataFlow, anchors: ExpertWeights, fwd: set[fx.Node]) -> list[fx.Node]:
    products = _expert_products(flow, anchors)
    if not products:
        return []
    start = max(flow.order[m] for m in products)
    out = []
    for n in sorted((n for n in fwd if flow.order[n] >= start), key=flow.order.__getitem__):
        v = tensor_value(n)
        if v is not None and v.dim() == 2 and v.dtype.is_floating_point and _same(v.shape[1], anchors.hidden):
            out.append(n)
            if len(out) >= _MAX_OUTPUT_CANDIDATES:
                break
    return out


class _Builder:
    """Builds the region ending at one output candidate, or raises :class:`_Reject`."""

    def __init__(self, flow: DataFlow, anchors: ExpertWeights, fwd: set[fx.Node], output: fx.Node) -> None:
        self.flow, self.anchors, self.fwd, self.output = flow, anchors, fwd, output
        self.anchor_set = set(anchors.nodes)
        self.num_tokens = tensor_value(output).shape[0]
        self.out_pos = flow.order[output]

    def _classify(self, n: fx.Node, walk_through: set[fx.Node]) -> str | None:
        """Boundary role of ``n`` (``hidden``/``ids``/``weights``/``extra``), or None to walk into it."""
        if n in self.fwd or n in walk_through or n is self.output:
            return None
        v = node_value(n)
        if not isinstance(v, torch.Tensor):
            # Tuples (topk, sort, where) are walked into; SymInts computed outside are plain inputs.
            # In-place ops that return None (setitem) are walked into too.
            return "extra" if isinstance(v, (int, float, bool, torch.SymInt, torch.SymFloat, torch.SymBool)) else None
        if is_factory(n) or v.dim() != 2 or not _same(v.shape[0], self.num_tokens):
            return None
        if v.dtype == torch.bool:
            return None  # a mask computed from the ids (``ids == e``) is routing plumbing inside the region
        if not v.dtype.is_floating_point:
            return "ids"
        return "hidden" if _same(v.shape[1], self.anchors.hidden) else "weights"

    def _walk(self, walk_through: set[fx.Node]) -> tuple[set[fx.Node], dict[str, set[fx.Node]]]:
        nodes: set[fx.Node] = set()
        found: dict[str, set[fx.Node]] = {"hidden": set(), "ids": set(), "weights": set(), "extra": set()}
        stack = [self.output]
        while stack:
            n = stack.pop()
            if n in nodes or n in self.anchor_set:
                continue
            role = self._classify(n, walk_through)
            if role is not None:
                found[role].add(n)
                continue
            if n.op in ("placeholder", "get_attr"):
                raise _Reject(f"the region reads {n.name}, which is neither an expert weight nor a routing result")
            if n.op == "output":
                raise _Reject("the region reaches the graph output")
            nodes.add(n)
            stack.extend(self.flow.deps(n))
            # In-place steps on a region tensor belong to the region even when nothing reads their
            # result later (transformers' `expert_ids_g.clamp_()` for EP sentinels).
            stack.extend(m for m in self.flow.mutators.get(n, ()) if self.flow.order[m] < self.out_pos)
        return nodes, found

    def _add_symbolic_tails(self, nodes: set[fx.Node], inputs: set[fx.Node]) -> None:
        # Data-dependent shapes (torch.where, nonzero) bring getitem -> sym_size -> _assert_scalar
        # chains that hang off region values and feed nothing else; they belong to the region.
        tails: set[fx.Node] = set()
        changed = True
        while changed:
            changed = False
            for n in list(nodes | tails):
                for u in n.users:
                    if u in nodes or u in tails or op_name(u) not in _SYMBOLIC_TAIL_OPS:
                        continue
                    if all(i in nodes or i in tails or i in inputs for i in u.all_input_nodes):
                        tails.add(u)
                        changed = True
        # Keep only tails whose every user is in the region or another kept tail.
        kept = set(tails)
        changed = True
        while changed:
            changed = False
            for t in list(kept):
                if any(u not in nodes and u not in kept for u in t.users):
                    kept.discard(t)
                    changed = True
        nodes |= kept

    def build(self) -> Region:
        walk_through: set[fx.Node] = set()
        for _ in range(_MAX_BOUNDARY_RETRIES):
            nodes, found = self._walk(walk_through)
            if not found["ids"] and found["weights"]:
                # A [T, E] tensor built from ids and weights (dense combine) is inside the region.
                walk_through |= found["weights"]
                continue
            for role in ("hidden", "ids", "weights"):
                if len(found[role]) != 1:
                    what = {"hidden": "hidden-state [T, H]", "ids": "top-k id [T, K]", "weights": "routing-weight [T, K]"}
                    raise _Reject(f"found {len(found[role])} {what[role]} inputs instead of one")
            ids = next(iter(found["ids"]))
            (rw,) = found["weights"]
            if tuple(tensor_value(rw).shape) == tuple(tensor_value(ids).shape):
                break
            # A [T, E] tensor built from ids and weights (dense combine) is inside the region.
            walk_through.add(rw)
        else:
            raise _Reject("routing weights and ids have different shapes")
        (hidden,) = found["hidden"]
        inputs = found["hidden"] | found["ids"] | found["weights"] | found["extra"] | self.anchor_set
        self._add_symbolic_tails(nodes, inputs)
        self._check(nodes, hidden)
        base = self.flow.base(self.output)
        return Region(
            anchors=self.anchors, nodes=nodes, output=self.output,
            output_base=base if base in nodes else None, hidden=hidden, ids=ids, weights=rw,
            num_tokens=self.num_tokens, top_k=int(tensor_value(ids).shape[1]), ops={op_name(n) for n in nodes},
        )

    def _check(self, nodes: set[fx.Node], hidden: fx.Node) -> None:
        missing = [w.name for w in self.anchors.nodes if not any(u in nodes for u in w.users)]
        if missing:
            raise _Reject(f"expert weights {missing} are not used between routing and output")
        for w in self.anchors.nodes:
            outside = [u.name for u in w.users if u not in nodes]
            if outside:
                raise _Reject(f"expert weight {w.name} is also used outside the MoE region (by {outside[0]})")
        if tensor_value(self.output).dtype != tensor_value(hidden).dtype:
            raise _Reject(
                f"output dtype {tensor_value(self.output).dtype} differs from hidden dtype {tensor_value(hidden).dtype}"
            )
        base = self.flow.base(self.output)
        pos = self.flow.order[self.output]
        for n in nodes:
            b = self.flow.base(n)
            if b is not None and b not in nodes:
                raise _Reject(f"{n.name} writes into {b.name}, which lives outside the MoE region")
            if n is self.output:
                continue
            for u in self.flow.users(n):
                if u in nodes:
                    continue
                if n is base and self.flow.order[u] > pos:
                    continue  # reads the finished output tensor
                if base is not None and self.flow.base(n) is base:
                    continue  # an earlier in-place step of the output tensor
                raise _Reject(f"intermediate value {n.name} is also used outside the MoE region (by {u.name})")
        if not any(is_matmul(n) for n in nodes):
            raise _Reject("no expert matrix product inside the region")


def extract_region(flow: DataFlow, anchors: ExpertWeights) -> Region | str:
    """The experts region anchored on ``anchors``, or the reason no closed region was found."""
    fwd = flow.forward_closure(anchors.nodes)
    candidates = _output_candidates(flow, anchors, fwd)
    if not candidates:
        return f"no [T, {anchors.hidden}] output after the expert products"
    reasons = []
    for cand in candidates:
        try:
            return _Builder(flow, anchors, fwd, cand).build()
        except _Reject as exc:
            log.debug("moe_fx: output candidate %s rejected: %s", cand.name, exc)
            reasons.append((cand, f"{cand.name}: {exc}"))
    return _best_reason(reasons, _expert_products(flow, anchors))


def _module_paths(node: fx.Node) -> list[str]:
    """The module paths of Dynamo's ``nn_module_stack`` of ``node``, outermost first."""
    stack = node.meta.get("nn_module_stack") or {}
    return [str(v[0]) if isinstance(v, tuple) else str(k) for k, v in stack.items()]


def _best_reason(reasons: list[tuple[fx.Node, str]], products: list[fx.Node]) -> str:
    """The reason to report among the rejected output candidates: the last candidate tried that lies
    deepest in the experts' own modules (later candidates can belong to later layers, whose reasons
    would name another layer's tensors)."""
    home = _module_paths(products[0]) if products else []

    def depth(cand: fx.Node) -> int:
        n = 0
        for a, b in zip(_module_paths(cand), home):
            if a != b:
                break
            n += 1
        return n

    best = max(depth(c) for c, _ in reasons)
    return [r for c, r in reasons if depth(c) == best][-1]
