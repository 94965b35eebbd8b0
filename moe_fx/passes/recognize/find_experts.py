"""Find candidate expert weights in a Dynamo graph: the anchors every MoE region is built around.

Two shapes of expert storage are recognised:

* **stacked**: two 3-D weights ``w13`` ``[E, 2I, H]`` and ``w2`` ``[E, H, I]`` (transformers 5.x, dense
  ``bmm`` blocks), or their transposes ``[E, H, 2I]`` / ``[E, I, H]`` (torchtitan, GPT-OSS, Llama 4), where
  the product with ``w13`` flows into the product with ``w2``; non-gated experts have ``w13`` ``[E, I, H]``
  (Nemotron-H's ``up_proj``), told apart from its transpose by the width of the tokens that meet it;
* **per_expert**: E SwiGLU experts as separate 2-D linears ``down(act(gate(x)) * up(x))`` under an
  ``nn.ModuleList`` (transformers 4.x, OLMoE), grouped by their module path.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from moe_fx.passes.graph_utils import DataFlow, is_matmul, moe_fx_op, op_name, tensor_value

__all__ = ["ExpertAnchors", "find_expert_weights", "linear_weight"]

_PASS_THROUGH = frozenset({"to", "float", "type", "bfloat16", "half", "contiguous", "type_as"})
_ACTIVATIONS = frozenset({"silu", "gelu"})
# The expert index is the ModuleList index of the module that owns the linear:
# Dynamo: ..._experts_modules_3_modules_down_proj_parameters_weight_ ; get_attr: experts.3.down_proj.weight
_EXPERT_INDEX = (
    re.compile(r"^(?P<prefix>.*)_(?P<index>\d+)_modules_(?P<leaf>(?:(?!_modules_)\w)+?)_parameters_weight_?$"),
    re.compile(r"^(?P<prefix>.*)\.(?P<index>\d+)\.(?P<leaf>[^.]+)\.weight$"),
)


@dataclass
class ExpertAnchors:
    """Anchors of one candidate MoE region.

    Attributes:
        kind: ``"stacked"`` or ``"per_expert"``.
        nodes: every weight node of the region (placeholders or get_attr).
        num_experts, hidden, intermediate: E, H, I.
        w13, w2: the stacked weight nodes (stacked kind only).
        transposed: True when stacked weights are stored ``[E, H, 2I]`` / ``[E, I, H]``.
        gated: True when ``w13`` holds gate and up rows (``2I``), False for one up projection (``I``).
        gate, up, down: per-expert weight nodes in expert order (per_expert kind only).
        name: a readable name (the w2 / first down weight node's name).
        repeated: indices of experts whose weights the graph runs in more than one expert slot (the same
            module twice in a ``ModuleList``: Dynamo names its weights once, by the first slot).
    """

    kind: str
    nodes: list[fx.Node]
    num_experts: int
    hidden: int
    intermediate: int
    w13: fx.Node | None = None
    w2: fx.Node | None = None
    transposed: bool = False
    gated: bool = True
    gate: list[fx.Node] = field(default_factory=list)
    up: list[fx.Node] = field(default_factory=list)
    down: list[fx.Node] = field(default_factory=list)
    name: str = ""
    repeated: list[int] = field(default_factory=list)


def _weight_nodes(graph: fx.Graph, ndim: int) -> list[fx.Node]:
    out = []
    for n in graph.nodes:
        if n.op not in ("placeholder", "get_attr"):
            continue
        v = tensor_value(n)
        if v is not None and v.dim() == ndim and (v.dtype.is_floating_point or v.dtype == torch.float8_e4m3fn):
            out.append(n)
    return out


def _first_matmul(flow: DataFlow, weight: fx.Node, limit: int = 6) -> fx.Node | None:
    """The first matrix product reached from ``weight`` through a few layout ops (transpose, index...).

    A moe_fx op stops the search: weights it reads are experts already handled."""
    frontier, depth = [weight], 0
    while frontier and depth < limit:
        nxt = []
        for n in frontier:
            for u in n.users:
                if moe_fx_op(u) is not None:
                    continue
                if is_matmul(u):
                    return u
                nxt.append(u)
        frontier, depth = nxt, depth + 1
    return None


def _stacked_orientation(
    a: torch.Tensor, b: torch.Tensor, width: int | None = None
) -> tuple[bool, int, int, bool] | None:
    """``(transposed, H, I, gated)`` if ``a`` / ``b`` have the shapes of w13 / w2 in one orientation, else None.

    ``width`` is the contracted width of ``a``'s first product on the token side (H), when known: it tells
    a non-gated ``[E, I, H]`` up projection from a transposed ``[E, H, I]`` one.
    """
    if a.shape[0] != b.shape[0]:
        return None
    _, x, y = a.shape
    _, p, q = b.shape
    if x == 2 * q and y == p:
        return False, p, q, True
    if y == 2 * p and x == q:
        return True, q, p, True
    if x == q and y == p and x != y and width in (x, y):
        # Non-gated: a = [E, I, H] with b = [E, H, I], or transposed a = [E, H, I] with b = [E, I, H].
        return (False, y, x, False) if width == y else (True, x, y, False)
    return None


def _token_width(flow: DataFlow, mm: fx.Node, weight: fx.Node) -> int | None:
    """The contracted size on the token side of the product ``mm`` that ``weight`` reaches (H), or None."""
    args = [a for a in mm.args if isinstance(a, fx.Node)]
    if len(args) < 2 or op_name(mm) == "einsum":
        return None
    from_weight = [a is weight or weight in flow.backward_closure([a], limit=6) for a in args[:2]]
    if from_weight == [False, True]:
        v = tensor_value(args[0])
        return None if v is None else int(v.shape[-1])  # tokens @ weight, linear(tokens, weight)
    if from_weight == [True, False] and op_name(mm) != "linear":
        v = tensor_value(args[1])
        return None if v is None or v.dim() < 2 else int(v.shape[-2])  # weight @ tokens (batched_mm)
    return None


def _find_stacked(graph: fx.Graph, flow: DataFlow) -> list[ExpertAnchors]:
    weights = _weight_nodes(graph, 3)
    first_mm = {w: _first_matmul(flow, w) for w in weights}
    found: list[ExpertAnchors] = []
    used: set[fx.Node] = set()
    for a in weights:
        if first_mm[a] is None or a in used:
            continue
        width = _token_width(flow, first_mm[a], a)
        shaped = [
            b for b in weights
            if b is not a and b not in used and first_mm[b] is not None
            and _stacked_orientation(tensor_value(a), tensor_value(b), width) is not None
        ]
        if not shaped:
            continue
        reach = flow.forward_closure([first_mm[a]])
        # The partner is the shape-compatible weight whose product comes first after a's: later
        # layers' weights are reachable too.
        partners = [b for b in shaped if first_mm[b] in reach]
        for b in sorted(partners, key=lambda b: flow.order[first_mm[b]]):
            transposed, h, i, gated = _stacked_orientation(tensor_value(a), tensor_value(b), width)
            found.append(
                ExpertAnchors("stacked", [a, b], tensor_value(a).shape[0], h, i, w13=a, w2=b,
                              transposed=transposed, gated=gated, name=b.name)
            )
            used.update((a, b))
            break
    return found


def _strip_casts(node: object) -> object:
    while isinstance(node, fx.Node) and op_name(node) in _PASS_THROUGH:
        node = node.args[0]
    return node


def linear_weight(node: object) -> fx.Node | None:
    """The weight of ``node`` if it is ``F.linear(x, w, ...)`` with ``w`` a graph input or attribute, else None."""
    if isinstance(node, fx.Node) and op_name(node) == "linear" and len(node.args) >= 2:
        w = node.args[1]
        if isinstance(w, fx.Node) and w.op in ("placeholder", "get_attr"):
            return w
    return None


def _swiglu_triple(down_linear: fx.Node) -> tuple[fx.Node, fx.Node, fx.Node] | None:
    """(gate, up, down) weight nodes if ``down_linear`` computes ``down(act(gate(x)) * up(x))``."""
    wd = linear_weight(down_linear)
    prod = _strip_casts(down_linear.args[0])
    if wd is None or not isinstance(prod, fx.Node) or op_name(prod) != "mul" or len(prod.args) != 2:
        return None
    lhs, rhs = (_strip_casts(a) for a in prod.args)
    for act, lin in ((lhs, rhs), (rhs, lhs)):
        if isinstance(act, fx.Node) and op_name(act) in _ACTIVATIONS:
            wg, wu = linear_weight(_strip_casts(act.args[0])), linear_weight(lin)
            if wg is not None and wu is not None:
                return wg, wu, wd
    return None


def _find_per_expert(graph: fx.Graph) -> list[ExpertAnchors]:
    groups: dict[str, dict[int, tuple[fx.Node, fx.Node, fx.Node]]] = {}
    repeated: dict[str, set[int]] = {}
    for n in graph.nodes:
        if op_name(n) != "linear":
            continue
        triple = _swiglu_triple(n)
        if triple is None:
            continue
        name = str(triple[2].target) if triple[2].op == "get_attr" else triple[2].name
        m = next((m for m in (p.match(name) for p in _EXPERT_INDEX) if m), None)
        if m is None:
            continue
        key = f"{m['prefix']}.#.{m['leaf']}"
        if int(m["index"]) in groups.get(key, {}):  # a second SwiGLU on one expert's weights: a tied slot
            repeated.setdefault(key, set()).add(int(m["index"]))
        groups.setdefault(key, {})[int(m["index"])] = triple
    found = []
    for key, experts in groups.items():
        e = len(experts)
        if e < 2 or sorted(experts) != list(range(e)):
            continue
        gate, up, down = (list(x) for x in zip(*(experts[i] for i in range(e)), strict=True))
        h, i = tensor_value(down[0]).shape
        shapes_ok = all(
            tuple(tensor_value(g).shape) == (i, h) and tuple(tensor_value(u).shape) == (i, h)
            and tuple(tensor_value(d).shape) == (h, i) for g, u, d in zip(gate, up, down, strict=True)
        )
        if shapes_ok:
            found.append(ExpertAnchors("per_expert", gate + up + down, e, h, i, gate=gate, up=up, down=down,
                                       name=key, repeated=sorted(repeated.get(key, ()))))
    return found


def find_expert_weights(graph: fx.Graph, flow: DataFlow | None = None) -> list[ExpertAnchors]:
    """Every candidate group of expert weights in ``graph``, stacked groups first."""
    flow = flow or DataFlow(graph)
    return _find_stacked(graph, flow) + _find_per_expert(graph)
