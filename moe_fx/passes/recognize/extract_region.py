"""Cut the experts region of one MoE block out of a graph, given its expert weights.

The region is everything from the routing results to the combined output: it starts at three
boundary tensors that the model computes itself and keeps computing,

* ``hidden``   ``[T, H]`` float: the tokens the experts read,
* ``ids``      ``[T, K]`` int:   the top-k expert ids,
* ``weights``  ``[T, K]`` float: the top-k routing weights,

plus the expert weights (the anchors) and their optional per-expert biases (``[E, N1]`` added to the
first product, ``[E, H]`` to the second; GPT-OSS), and ends at one output ``[T, H]`` in the dtype of
``hidden``. Llama 4 has no ``[T, K]`` routing tensors: its experts read a dense score matrix ``[T, E]``
(zero for experts not chosen). Such a region is accepted only when the scores are provably zero
outside the router's top-k ids (a ``scatter`` of the top-k ids into a constant that the elementwise
steps after it map to 0); the rewrite then gathers the top-k weights from the scores.
The output is the earliest node after the last expert product at which the region is *closed*:
no value computed inside is read outside except the output, nothing outside is mutated, and no
other graph input is read. Routing stays outside, untouched.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from moe_fx.passes.graph_utils import DataFlow, is_factory, is_matmul, node_value, op_name, tensor_value
from moe_fx.passes.recognize.find_experts import ExpertAnchors, _first_matmul

__all__ = ["Region", "expert_products", "extract_region", "sparse_support"]

log = logging.getLogger("moe_fx.passes")

_MAX_OUTPUT_CANDIDATES = 48
_MAX_BOUNDARY_RETRIES = 4
_SYMBOLIC_TAIL_OPS = frozenset(
    {"getitem", "sym_size", "sym_size.int", "ge", "le", "lt", "gt", "eq", "_assert_scalar", "_check_is_size",
     "sym_constrain_range_for_size", "sym_sum"}
)
#: Elementwise one-input steps allowed between a dense score matrix and the scatter that builds it.
_SCORE_STEPS = frozenset({"to", "float", "half", "bfloat16", "type", "contiguous", "clone", "sigmoid"})
#: Factories with a constant fill, and where their fill value is.
_CONSTANT_FILL = {"full_like": 1, "full": 1, "new_full": 2, "zeros": None, "zeros_like": None, "new_zeros": None}


@dataclass
class Region:
    """One experts region: its boundary, its nodes and its output.

    Attributes:
        anchors: the expert weights.
        nodes: the nodes the rewrite removes (boundary and anchors excluded).
        output: the node whose value the op replaces.
        output_base: when ``output`` is an in-place op, the tensor it writes into; readers of that
            tensor after ``output`` read the op's result.
        hidden, ids, weights: the boundary tensors (see the module docstring). With ``dense_scores``,
            ``weights`` is the ``[T, E]`` score matrix (a region input) and ``ids`` the router's top-k
            ids ``[T, K]`` (not read by the region itself).
        num_tokens, top_k: T and K (T may be symbolic).
        w13_bias, w2_bias: per-expert bias parameters read by the region, or None.
        dense_scores: True when the region reads a ``[T, E]`` score matrix instead of top-k weights.
    """

    anchors: ExpertAnchors
    nodes: set[fx.Node]
    output: fx.Node
    output_base: fx.Node | None
    hidden: fx.Node
    ids: fx.Node
    weights: fx.Node
    num_tokens: object
    top_k: int
    ops: set[str] = field(default_factory=set)
    w13_bias: fx.Node | None = None
    w2_bias: fx.Node | None = None
    dense_scores: bool = False

    @property
    def biases(self) -> list[fx.Node]:
        """The bias parameters the region reads (w13's first)."""
        return [b for b in (self.w13_bias, self.w2_bias) if b is not None]

    @property
    def inputs(self) -> list[fx.Node]:
        """The region's boundary values in a fixed order: hidden, ids and weights (or scores), anchors, biases."""
        routing = [self.weights] if self.dense_scores else [self.ids, self.weights]
        return [self.hidden, *routing, *self.anchors.nodes, *self.biases]

    @property
    def form(self) -> str:
        """How the experts were written: ``expert_loop``, ``grouped_mm``, ``batched_mm`` or ``dense_bmm``."""
        if self.anchors.kind == "per_expert":
            return "expert_loop"
        if self.ops & {"_grouped_mm", "grouped_mm", "grouped_mm_fallback"}:
            return "grouped_mm"
        # batched_mm gathers each routed token's expert weights (a tensor index); a loop over experts
        # indexes them with constants (JetMoE's per-expert F.linear); a dense form runs every expert.
        indexes = [u.args[1] for w in self.anchors.nodes for u in w.users if op_name(u) == "getitem"]
        if any(isinstance(i, fx.Node) for i in indexes):
            return "batched_mm"
        return "expert_loop" if indexes else "dense_bmm"

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


def expert_products(flow: DataFlow, anchors: ExpertAnchors) -> list[fx.Node]:
    """The first matrix product each expert weight of ``anchors`` reaches."""
    mms = [_first_matmul(flow, w) for w in anchors.nodes]
    return [m for m in mms if m is not None]


def _output_candidates(
    flow: DataFlow, anchors: ExpertAnchors, fwd: set[fx.Node], before: fx.Node | None = None
) -> list[fx.Node]:
    products = expert_products(flow, anchors)
    if not products:
        return []
    start = max(flow.order[m] for m in products)
    stop = flow.order[before] if before is not None else len(flow.order)
    out = []
    for n in sorted((n for n in fwd if start <= flow.order[n] < stop), key=flow.order.__getitem__):
        v = tensor_value(n)
        if v is not None and v.dim() == 2 and v.dtype.is_floating_point and _same(v.shape[1], anchors.hidden):
            out.append(n)
            if len(out) >= _MAX_OUTPUT_CANDIDATES:
                break
    return out


class _Builder:
    """Builds the region ending at one output candidate, or raises :class:`_Reject`."""

    def __init__(self, flow: DataFlow, anchors: ExpertAnchors, fwd: set[fx.Node], output: fx.Node) -> None:
        self.flow, self.anchors, self.fwd, self.output = flow, anchors, fwd, output
        self.anchor_set = set(anchors.nodes)
        self.num_tokens = tensor_value(output).shape[0]
        self.out_pos = flow.order[output]

    def _classify(self, n: fx.Node, walk_through: set[fx.Node]) -> str | None:
        """Boundary role of ``n`` (``hidden``/``ids``/``weights``/``bias``/``extra``), or None to walk into it."""
        if n in self.fwd or n in walk_through or n is self.output:
            return None
        if self._is_bias(n):
            return "bias"
        v = node_value(n)
        if not isinstance(v, torch.Tensor):
            # Tuples (topk, sort, where) are walked into; SymInts computed outside are plain inputs,
            # except data-dependent ones (``.item()`` / ``.tolist()`` of routing counts, JetMoE's
            # split sizes): the region recomputes those from the ids. In-place ops that return None
            # (setitem) are walked into too.
            if op_name(n) == "item" and not isinstance(v, (float, torch.SymFloat)):
                return None  # a float .item() is a run-time scalar of the model, not a routing count
            return "extra" if isinstance(v, (int, float, bool, torch.SymInt, torch.SymFloat, torch.SymBool)) else None
        if is_factory(n) or v.dim() != 2 or not _same(v.shape[0], self.num_tokens):
            return None
        if v.dtype == torch.bool:
            return None  # a mask computed from the ids (``ids == e``) is routing plumbing inside the region
        if not v.dtype.is_floating_point:
            return "ids"
        return "hidden" if _same(v.shape[1], self.anchors.hidden) else "weights"

    def _is_bias(self, n: fx.Node) -> bool:
        """A model parameter shaped like a per-expert bias: ``[E, N1]`` (first product) or ``[E, H]`` (second)."""
        a = self.anchors
        if a.kind != "stacked" or n.op not in ("placeholder", "get_attr"):
            return False
        if n.op == "placeholder" and "_parameters_" not in n.name:
            return False  # a graph input that is not a module parameter (tokens, masks)
        v = tensor_value(n)
        n1 = 2 * a.intermediate if a.gated else a.intermediate
        if any(is_matmul(u) for u in n.users):
            return False  # multiplied, not added: a router weight [E, H], not a bias
        return (
            v is not None and v.dim() == 2 and v.dtype.is_floating_point and v.shape[0] == a.num_experts
            and v.shape[1] in (n1, a.hidden)
        )

    def _walk(self, walk_through: set[fx.Node]) -> tuple[set[fx.Node], dict[str, set[fx.Node]]]:
        nodes: set[fx.Node] = set()
        found: dict[str, set[fx.Node]] = {r: set() for r in ("hidden", "ids", "weights", "bias", "extra")}
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

    def _sparse_boundary(
        self, nodes: set[fx.Node], found: dict[str, set[fx.Node]], walk_through: set[fx.Node]
    ) -> tuple[set[fx.Node], dict[str, set[fx.Node]], fx.Node, fx.Node]:
        """The region bounded by top-k ids and weights ``[T, K]``: (nodes, found, ids, weights)."""
        walk_through = set(walk_through)
        for attempt in range(_MAX_BOUNDARY_RETRIES):
            if attempt:
                nodes, found = self._walk(walk_through)
            if not found["ids"] and found["weights"]:
                # A [T, E] tensor built from ids and weights (dense combine) is inside the region.
                walk_through |= found["weights"]
                continue
            per_expert = {
                n for role in ("ids", "weights") for n in found[role]
                if tensor_value(n).shape[1] == self.anchors.num_experts and len(found[role]) > 1
            }
            if per_expert and not (per_expert >= found["ids"] or per_expert >= found["weights"]):
                # A [T, E] one-hot built from the ids (JetMoE's per-expert counts) is inside too.
                walk_through |= per_expert
                continue
            for role in ("hidden", "ids", "weights"):
                if len(found[role]) != 1:
                    what = {"hidden": "hidden-state [T, H]", "ids": "top-k id [T, K]", "weights": "routing-weight [T, K]"}
                    raise _Reject(f"found {len(found[role])} {what[role]} inputs instead of one"
                                  + _named(found[role]))
            ids = next(iter(found["ids"]))
            (rw,) = found["weights"]
            if tuple(tensor_value(rw).shape) == tuple(tensor_value(ids).shape):
                return nodes, found, ids, rw
            # A [T, E] tensor built from ids and weights (dense combine) is inside the region.
            walk_through.add(rw)
        raise _Reject("routing weights and ids have different shapes")

    def _reads_scores(self, found: dict[str, set[fx.Node]]) -> bool:
        """True if the region's only routing input is one ``[T, E]`` float matrix (no top-k ids)."""
        if found["ids"] or len(found["weights"]) != 1:
            return False
        return tensor_value(next(iter(found["weights"]))).shape[1] == self.anchors.num_experts

    def _dense_scores(self, found: dict[str, set[fx.Node]]) -> tuple[fx.Node, fx.Node] | None:
        """``(scores [T, E], top-k ids [T, K])`` if the region reads a score matrix that is provably zero
        outside the router's top-k ids (Llama 4), else None."""
        if not self._reads_scores(found):
            return None
        (scores,) = found["weights"]
        if self.flow.mutators.get(scores):
            return None
        ids = sparse_support(self.flow, scores)
        return None if ids is None else (scores, ids)

    def build(self) -> Region:
        self._boundary: set[fx.Node] = set()
        try:
            return self._build(set())
        except _Reject as first:
            # With one expert per token (K = 1) a permuted copy of the tokens or weights ([T*K, H],
            # [T*K, 1]) looks like a boundary tensor: walk through boundary values that are indexed copies.
            indexed = {m for n in self._boundary for m in _indexed_copy(n)}
            if not indexed:
                raise
            try:
                return self._build(indexed)
            except _Reject:
                raise first from None

    def _build(self, walk_through: set[fx.Node]) -> Region:
        nodes, found = self._walk(walk_through)
        self._boundary = found["hidden"] | found["ids"] | found["weights"]
        dense = self._dense_scores(found)
        try:
            nodes, found, ids, rw = self._sparse_boundary(nodes, found, walk_through)
        except _Reject:
            if dense is None and self._reads_scores(found):
                (scores,) = found["weights"]
                raise _Reject(
                    f"the experts read a dense {list(tensor_value(scores).shape)} score matrix ({scores.name}) "
                    "that the graph does not prove zero outside the router's top-k ids; reducing it to a "
                    "top-k could drop experts"
                ) from None
            if dense is None:
                raise
            # Llama 4: the first walk's boundary is (hidden, scores); the ids come from the router.
            rw, ids = dense
            if len(found["hidden"]) != 1:
                raise _Reject(f"found {len(found['hidden'])} hidden-state [T, H] inputs instead of one"
                              + _named(found["hidden"])) from None
        (hidden,) = found["hidden"]
        w13_bias, w2_bias = self._bias_roles(found["bias"])
        inputs = found["hidden"] | found["ids"] | found["weights"] | found["extra"] | found["bias"] | self.anchor_set
        self._add_symbolic_tails(nodes, inputs)
        self._check(nodes, hidden, found["bias"])
        base = self.flow.base(self.output)
        return Region(
            anchors=self.anchors, nodes=nodes, output=self.output,
            output_base=base if base in nodes else None, hidden=hidden, ids=ids, weights=rw,
            num_tokens=self.num_tokens, top_k=int(tensor_value(ids).shape[1]), ops={op_name(n) for n in nodes},
            w13_bias=w13_bias, w2_bias=w2_bias, dense_scores=dense is not None and rw is dense[0],
        )

    def _bias_roles(self, biases: set[fx.Node]) -> tuple[fx.Node | None, fx.Node | None]:
        """Which bias is added to the first product (it reaches the second) and which to the second."""
        a = self.anchors
        second = _first_matmul(self.flow, a.w2) if a.w2 is not None else None
        roles: dict[str, list[fx.Node]] = {"w13": [], "w2": []}
        for b in sorted(biases, key=lambda n: n.name):
            role = "w13" if second is not None and second in self.flow.forward_closure([b]) else "w2"
            want = (2 * a.intermediate if a.gated else a.intermediate) if role == "w13" else a.hidden
            if tensor_value(b).shape[1] != want:
                raise _Reject(f"bias {b.name} {list(tensor_value(b).shape)} is added to the {role} product, "
                              f"whose width is {want}")
            roles[role].append(b)
        for role, found in roles.items():
            if len(found) > 1:
                raise _Reject(f"{len(found)} biases on the {role} product ({', '.join(n.name for n in found)})")
        return (roles["w13"] or [None])[0], (roles["w2"] or [None])[0]

    def _check(self, nodes: set[fx.Node], hidden: fx.Node, biases: set[fx.Node]) -> None:
        missing = [w.name for w in self.anchors.nodes if not any(u in nodes for u in w.users)]
        if missing:
            raise _Reject(f"expert weights {missing} are not used between routing and output")
        for w in [*self.anchors.nodes, *sorted(biases, key=lambda n: n.name)]:
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


def _indexed_copy(node: fx.Node) -> list[fx.Node]:
    """``node`` and the steps before it, if it is rows of another tensor picked by a tensor index
    (``x[perm]``, possibly cast or reshaped); else an empty list."""
    chain = [node]
    while op_name(node) in ("unsqueeze", "view", "reshape", "to", "float"):
        if not isinstance(node.args[0], fx.Node):
            return []
        node = node.args[0]
        chain.append(node)
    if op_name(node) in ("index_select", "gather"):
        return chain
    indexed = op_name(node) == "getitem" and len(node.args) > 1 and isinstance(node.args[1], fx.Node)
    return chain if indexed and tensor_value(node.args[1]) is not None else []


def sparse_support(flow: DataFlow, scores: fx.Node) -> fx.Node | None:
    """The top-k ids ``[T, K]`` outside which ``scores [T, E]`` is zero, if the graph proves it, else None.

    Proof: ``scores`` is ``f(scatter(c, 1, ids, values))`` where ``c`` is a constant-filled tensor, the
    scatter writes along the expert dimension, and the elementwise steps ``f`` map ``c`` to exactly 0
    (Llama 4: ``sigmoid(full_like(logits, -inf).scatter_(1, ids, top_values))``).
    """
    steps: list[fx.Node] = []
    n = scores
    while op_name(n) in _SCORE_STEPS:
        if any(isinstance(a, fx.Node) for a in (*n.args[1:], *n.kwargs.values())) or not isinstance(n.args[0], fx.Node):
            return None
        steps.append(n)
        n = n.args[0]
    if op_name(n) not in ("scatter", "scatter_") or len(n.args) < 4 or n.kwargs.get("reduce") is not None:
        return None
    base, dim, ids = n.args[0], n.args[1], n.args[2]
    ids_v = tensor_value(ids)
    if not isinstance(base, fx.Node) or dim not in (1, -1):
        return None
    if ids_v is None or ids_v.dim() != 2 or ids_v.dtype.is_floating_point:
        return None
    if op_name(n) == "scatter_" and flow.mutators.get(base, []) != [n]:
        return None  # another in-place write into the constant tensor
    if any(flow.mutators.get(step) for step in [n, *steps]):
        return None  # an in-place write after the scatter (``scores[:, 0] = 1``) could make other entries non-zero
    fill = _constant_fill(base)
    if fill is None:
        return None
    probe = torch.full((1,), fill, dtype=tensor_value(base).dtype)
    try:
        for step in reversed(steps):
            fn = getattr(probe, str(step.target)) if step.op == "call_method" else functools.partial(step.target, probe)
            probe = fn(*step.args[1:], **step.kwargs)
    except (RuntimeError, TypeError, ValueError):
        return None
    return ids if isinstance(probe, torch.Tensor) and bool((probe == 0).all()) else None


def _constant_fill(node: fx.Node) -> float | None:
    """The fill value of a constant-filled factory node (``full_like(x, -inf)``, ``zeros(...)``), else None."""
    name = op_name(node)
    if name not in _CONSTANT_FILL:
        return None
    pos = _CONSTANT_FILL[name]
    if pos is None:
        return 0.0
    value = node.kwargs.get("fill_value", node.args[pos] if len(node.args) > pos else None)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def extract_region(flow: DataFlow, anchors: ExpertAnchors, before: fx.Node | None = None) -> Region | str:
    """The experts region anchored on ``anchors``, or the reason no closed region was found.

    ``before``: the first expert product of the next MoE layer, if any; a region ends before it (this
    keeps the reason of a layer left alone about that layer, not about the next one).
    """
    fwd = flow.forward_closure(anchors.nodes)
    candidates = _output_candidates(flow, anchors, fwd, before)
    if not candidates:
        return f"no [T, {anchors.hidden}] output after the expert products"
    reasons = []
    for cand in candidates:
        try:
            return _Builder(flow, anchors, fwd, cand).build()
        except _Reject as exc:
            log.debug("moe_fx: output candidate %s rejected: %s", cand.name, exc)
            reasons.append((cand, f"{cand.name}: {exc}"))
    # The most informative reason is usually the one of the last [T, H] candidate tried inside the
    # experts' own module (later candidates belong to the next layer's attention or router).
    owner = _module_paths(next(iter(anchors.nodes[-1].users), anchors.nodes[-1]))[-1:]
    inside = [r for c, r in reasons if owner and owner[0] in _module_paths(c)]
    return (inside or [r for _, r in reasons])[-1]


def _module_paths(node: fx.Node) -> list[str]:
    """The paths of the modules around ``node`` (Dynamo's ``nn_module_stack``), outermost first."""
    stack = node.meta.get("nn_module_stack") or {}
    return [str(v[0]) if isinstance(v, tuple) else str(k) for k, v in stack.items()]


def _named(nodes: set[fx.Node]) -> str:
    """`` (a, b): ...`` naming the boundary tensors of one role, for a refusal that found several: each is a
    separate value the experts read (an in-place edit of the input, or a copy, makes a second one)."""
    if not nodes:
        return ""
    return f" ({', '.join(sorted(n.name for n in nodes))}: the experts read each of them as a separate value)"
