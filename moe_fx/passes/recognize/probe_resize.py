"""A reduced probe of a region subgraph: the region's token count T made another one, in its literals or its symbols.

:mod:`moe_fx.verify.probe_plan` decides that a probe runs at another T than the region was traced with (a
*reduced* probe); this module makes the region's standalone subgraph compute at that T. A static graph has T baked
in as integer literals (``view(T, K, H)``, ``arange(T * K)``): :func:`resize_literals` replaces them, or says
why that would not be sound. A symbolic graph reads SymInts: :func:`symbolic_value` evaluates each at the new T.
Graph side only (the probe's sizes and routing are the verification toolkit's, :mod:`moe_fx.verify`).
"""

from __future__ import annotations

import sympy
import torch
from torch import fx

from moe_fx.passes.graph_utils import op_name

__all__ = ["resize_literals", "symbolic_value", "unexplained_literals"]


#: Comparison ops: a literal compared with (a capacity, a threshold) may be a function of T.
_COMPARISONS = frozenset({"lt", "le", "gt", "ge", "eq", "ne", "clamp", "clamp_", "clamp_min", "clamp_max"})


def _literals(n: fx.Node) -> list[tuple[object, bool]]:
    """``(literal, is_getitem_index)`` for every int/float literal in ``n``'s arguments."""
    found: list[tuple[object, bool]] = []
    index_arg = n.args[1] if op_name(n) == "getitem" and len(n.args) > 1 else None

    def visit(a: object) -> object:
        if type(a) in (int, float):
            found.append((a, a is index_arg))
        return a

    fx.node.map_aggregate(n.args, visit)
    fx.node.map_aggregate(n.kwargs, visit)
    return found


def unexplained_literals(
    gm: fx.GraphModule, traced: int, top_k: int, num_experts: int, sizes: set[int]
) -> list[str]:
    """Literals of a static region subgraph that may be functions of its token count T.

    A literal is explained when it is T or T*K (resized), a size of the experts (``sizes``: E, K, H,
    I, ...), a small constant (a dim, a chunk count: ``|v| <= 3``), an expert index (``mask[e]``),
    or a float not compared with anything. Anything else (a capacity ``int(1.25 * T * K / E)``, a
    threshold) might change with T, and a probe at another T would not see what it does at T.
    """
    known = {traced, traced * top_k} | sizes
    out = []
    for n in gm.graph.nodes:
        comparison = op_name(n) in _COMPARISONS
        for v, is_index in _literals(n):
            if abs(v) <= 3 or (type(v) is int and (v in known or (is_index and 0 <= v < num_experts))):
                continue
            if type(v) is float and not comparison:
                continue
            out.append(f"{v!r} in {n.name}")
    return out


def resize_literals(gm: fx.GraphModule, traced: int, tokens: int, top_k: int, num_experts: int,
                    sizes: set[int]) -> str | None:
    """Replace the integer literals T and T*K of a static region subgraph by ``tokens`` and ``tokens*K``.

    ``sizes`` are the other sizes the region knows (E, K, H, I, ...). Nothing is changed, and the
    reason is returned, when T or T*K equals one of them (a literal could not be told apart) or when
    the region holds literals that may depend on T (:func:`unexplained_literals`). None on success.
    """
    mapping = {traced: tokens, traced * top_k: tokens * top_k}
    ambiguous = sorted(k for k in mapping if k in sizes | {-1, 0, 1, 2, 3})
    if ambiguous:
        return (f"the traced token count {traced} (T*K = {traced * top_k}) equals another size of the region "
                f"({ambiguous[0]}), so T cannot be told apart in the graph's integer literals")
    odd = unexplained_literals(gm, traced, top_k, num_experts, sizes)
    if odd:
        return f"the region holds literals that may depend on T ({', '.join(odd[:3])})"

    def swap(a: object) -> object:
        return mapping[a] if type(a) is int and a in mapping else a

    for n in gm.graph.nodes:
        n.args = fx.node.map_aggregate(n.args, swap)
        n.kwargs = fx.node.map_aggregate(n.kwargs, swap)
    gm.recompile()
    return None


def symbolic_value(value: torch.SymInt, tokens_expr: object, tokens: int) -> int:
    """The value of a SymInt read by a region when its token count ``tokens_expr`` takes the value ``tokens``.

    Values that do not depend on T's symbols keep their traced value; values that are a constant
    multiple of T scale with it. Anything else raises ``ValueError`` (the probe cannot be resized).
    """
    expr = value.node.expr
    t_expr = sympy.sympify(tokens_expr)
    if not (expr.free_symbols & t_expr.free_symbols):
        hint = value.node.hint
        if hint is None:
            raise ValueError(f"no concrete value known for {expr}")
        return int(hint)
    ratio = sympy.simplify(expr / t_expr)
    if not ratio.is_Rational:
        raise ValueError(f"{expr} is not a constant multiple of the token count {t_expr}")
    scaled = ratio * tokens
    if not scaled.is_Integer:
        raise ValueError(f"{expr} is not an integer at T={tokens}")
    return int(scaled)
