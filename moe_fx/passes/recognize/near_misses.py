"""Why an ``nn.ModuleList`` of experts was not recognised: a report instead of silence.

:mod:`find_experts` anchors a per-expert region only on E bias-free ``down(act(gate(x)) * up(x))``
experts (``act`` SiLU or GELU) of one size under one ``ModuleList``. A list of experts that misses
one of these conditions yields no anchors at all, so without this module explain would say
"0 of 0 regions". :func:`per_expert_near_misses` finds the linears that live under an indexed module
of a ``ModuleList`` whose path names "expert" and that no anchor group claimed, and says for each such
list what is wrong: one module instance shared by every index, experts of different sizes, an
activation other than SiLU/GELU (ReLU, a sigmoid GLU, a hand-written ``x * sigmoid(x)``), a clamp,
a bias, an ungated expert. Read-only: nothing in the graph changes.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch.fx as fx

from moe_fx.passes.graph_utils import op_name, tensor_value
from moe_fx.passes.recognize.find_experts import linear_weight
from moe_fx.passes.report import RegionReport

__all__ = ["per_expert_near_misses"]

# Dynamo: <prefix>_modules_<index>_modules_<leaf>_parameters_weight_ ; get_attr: <prefix>.<index>.<leaf>.weight
_INDEXED_LINEAR = (
    re.compile(r"^(?P<prefix>.*)_modules_(?P<index>\d+)_modules_(?P<leaf>(?:(?!_modules_)\w)+?)_parameters_weight_?$"),
    re.compile(r"^(?P<prefix>.*)\.(?P<index>\d+)\.(?P<leaf>[^.]+)\.weight$"),
)
#: Ops between an expert's first linears and its last one that the recognised form has.
_GATED_FORM_OPS = frozenset({"silu", "gelu", "mul", "to", "float", "type", "bfloat16", "half", "contiguous", "type_as"})
_CASTS = frozenset({"to", "float", "type", "bfloat16", "half", "contiguous", "type_as", "mul"})


def _weight_name(node: fx.Node) -> str:
    return str(node.target) if node.op == "get_attr" else node.name


def _clean(prefix: str) -> str:
    """``l_self_modules_moe_modules_experts`` -> ``moe.experts``; dotted paths stay."""
    name = re.sub(r"^[lL]_self_(modules_)?", "", prefix)
    return name.replace("_modules_", ".")


def _has_bias(node: fx.Node) -> bool:
    bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
    return isinstance(bias, fx.Node)


def _between(last: fx.Node, firsts: set[fx.Node]) -> set[fx.Node]:
    """Nodes on the way from the expert's first linears to the input of its last one."""
    out: set[fx.Node] = set()
    stack = [a for a in last.all_input_nodes if a is not last.args[1]]
    while stack:
        n = stack.pop()
        if n in out or n in firsts or n.op in ("placeholder", "get_attr"):
            continue
        out.add(n)
        stack.extend(n.all_input_nodes)
    return out


def _structure_reason(calls: list[fx.Node]) -> str:
    """What keeps one expert (its linear calls, in graph order) from being ``down(act(gate(x)) * up(x))``."""
    if any(_has_bias(c) for c in calls):
        return "its linears have a bias"
    last, firsts = calls[-1], set(calls[:-1])
    if len(calls) == 2:
        ops = sorted({op_name(n) for n in _between(last, firsts)} - _CASTS)
        return f"it is not gated (down({', '.join(ops) or 'identity'}(up(x))), no gate projection)"
    if len(calls) != 3:
        return f"it has {len(calls)} linears, not gate, up and down"
    ops = {op_name(n) for n in _between(last, firsts)}
    odd = sorted(ops - _GATED_FORM_OPS)
    if any(o.startswith("clamp") for o in odd):
        return "its activation is clamped (GPT-OSS style)"
    if odd == ["sigmoid"] or ("sigmoid" in odd and "silu" not in ops):
        return ("it computes sigmoid(...) * ... between its linears (a sigmoid GLU or a hand-written "
                "x * sigmoid(x)); write SiLU as F.silu to have it recognised")
    if odd:
        return f"its activation is {odd[0]!r}, not SiLU or GELU" + (f" (also {odd[1:]})" if len(odd) > 1 else "")
    return "its linears are not wired as down(act(gate(x)) * up(x))"


def _reason(experts: dict[int, list[fx.Node]]) -> str:
    indices = sorted(experts)
    shapes = {i: tuple(tuple(tensor_value(c.args[1]).shape) for c in experts[i]) for i in indices}
    if len(indices) == 1:
        calls = experts[indices[0]]
        uses = max(sum(1 for c in calls if c.args[1] is w) for w in {c.args[1] for c in calls})
        if uses > 1:
            return (f"one expert module instance serves every expert (expert {indices[0]}'s weights are used "
                    f"{uses} times); moe_fx needs weights per expert")
        return "only one expert of the list runs in the traced graph"
    if indices != list(range(len(indices))):
        return f"the traced graph runs experts {indices}, not 0..{len(indices) - 1}"
    if len(set(shapes.values())) > 1:
        sizes = ", ".join(f"expert {i}: {list(s[0]) if s else []}" for i, s in shapes.items())
        return f"the experts have different sizes ({sizes})"
    return f"expert {indices[0]}: {_structure_reason(experts[indices[0]])}"


def per_expert_near_misses(graph: fx.Graph, claimed: Iterable[fx.Node]) -> list[RegionReport]:
    """One report per ``ModuleList`` of experts in ``graph`` that no anchor group in ``claimed`` covers.

    Only lists whose path names "expert" are considered (``experts``, ``moe.expert_list``, ...), so
    other lists of linears (a stack of layers) are not reported.
    """
    claimed = set(claimed)
    groups: dict[str, dict[int, list[fx.Node]]] = {}
    for n in graph.nodes:
        w = linear_weight(n)
        if w is None or w in claimed:
            continue
        m = next((m for m in (p.match(_weight_name(w)) for p in _INDEXED_LINEAR) if m), None)
        if m is None or "expert" not in m["prefix"].lower():
            continue
        groups.setdefault(m["prefix"], {}).setdefault(int(m["index"]), []).append(n)
    reports = []
    for prefix, experts in groups.items():
        first = experts[min(experts)]
        down = tensor_value(first[-1].args[1])
        hidden, inter = (int(down.shape[0]), int(down.shape[1])) if down is not None and down.dim() == 2 else (0, 0)
        reports.append(RegionReport(
            layer=_clean(prefix), form="expert_loop", num_experts=len(experts), hidden=hidden, intermediate=inter,
            reason=f"ModuleList experts not recognised: {_reason(experts)}",
        ))
    return reports
