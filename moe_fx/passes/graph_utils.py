"""Small read-only helpers over Dynamo FX graphs: node values, op names, in-place ops, data flow.

Dynamo's graphs are torch-level (``call_function`` on torch functions and operators, ``call_method``
on tensors), and they keep in-place ops such as ``out.index_add_(...)`` whose later readers use the
mutated node itself. :class:`DataFlow` adds those hidden edges (mutator -> later readers) so region
analysis sees where values really flow.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Iterable

import torch
import torch.fx as fx

__all__ = [
    "DataFlow", "add_weight_buffer", "bound_op_args", "clean_module_path", "experts_module_of", "fake_mode_of", "is_factory",
    "is_matmul", "is_mutation", "module_stack", "moe_fx_op", "node_value", "op_name", "scalar_hint", "tensor_value",
]

_FACTORIES = frozenset(
    {"zeros", "zeros_like", "empty", "empty_like", "new_zeros", "new_empty", "full", "full_like",
     "ones", "ones_like", "new_full", "new_ones", "arange"}
)
_MATMULS = frozenset({"linear", "_grouped_mm", "grouped_mm", "grouped_mm_fallback", "bmm", "matmul", "mm", "einsum"})
_INPLACE_OPERATORS = {
    operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv, operator.setitem,
}


def node_value(node: fx.Node):
    """The example value Dynamo (``example_value``) or AOT (``val``) recorded for ``node``, or None."""
    meta = node.meta
    return meta.get("example_value", meta.get("val"))


def tensor_value(node: object) -> torch.Tensor | None:
    """The (fake) tensor value of ``node`` if it is an FX node producing one tensor, else None."""
    if not isinstance(node, fx.Node):
        return None
    v = node_value(node)
    return v if isinstance(v, torch.Tensor) else None


def scalar_hint(a: object) -> float | int | None:
    """``a`` as a Python number: a literal, or a node computing a backed SymFloat / SymInt (a model float
    Dynamo made an input under ``dynamic=True``) at the value it was traced with; else None (bools too)."""
    if isinstance(a, bool):
        return None
    if isinstance(a, (int, float)):
        return a
    if not isinstance(a, fx.Node):
        return None
    v = node_value(a)
    if isinstance(v, (torch.SymFloat, torch.SymInt, torch.SymBool)):
        hint = v.node.hint
        return None if hint is None or isinstance(hint, bool) else hint
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return v  # a Python number recorded as a node's value (a traced forward's .item())
    return None


def moe_fx_op(node: fx.Node) -> str | None:
    """The name of the moe_fx op ``node`` calls (``"experts"``, ``"masked_experts"``, ...), or None.

    Both spellings count: an overload (``torch.ops.moe_fx.experts.default``, what the passes insert) and the
    packet (``torch.ops.moe_fx.experts``, what Dynamo records for a captured module's forward)."""
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        target = target.overloadpacket
    if isinstance(target, torch._ops.OpOverloadPacket) and target._qualified_op_name.startswith("moe_fx::"):
        return target._qualified_op_name.removeprefix("moe_fx::")
    return None


def bound_op_args(node: fx.Node) -> dict:
    """The arguments of a moe_fx op call node by name, bound from the op's schema, each node argument replaced
    by its example value (fake tensors of the traced graph): what the op's implementations receive."""
    from moe_fx.ops.signature import binder

    name = moe_fx_op(node)
    if name is None:
        raise ValueError(f"bound_op_args: {node.format_node()} does not call a moe_fx op")
    args = fx.node.map_arg(node.args, node_value)
    kwargs = fx.node.map_arg(node.kwargs, node_value)
    return binder(f"moe_fx::{name}")(*args, **kwargs)


def module_stack(node: fx.Node) -> list[tuple[str, str]]:
    """``(module path, class name)`` of every module around ``node``, outermost first (Dynamo's ``nn_module_stack``)."""
    stack = node.meta.get("nn_module_stack") or {}
    entries = []
    for key, value in stack.items():
        path, cls = value if isinstance(value, tuple) else (key, value)
        name = cls.__name__ if isinstance(cls, type) else str(cls).rsplit(".", 1)[-1].strip("'>")
        entries.append((str(path), name))
    return entries


def experts_module_of(node: fx.Node) -> tuple[str, str]:
    """(module path, class name) of the innermost ``*Experts`` module around ``node``, else the innermost."""
    entries = module_stack(node)
    if not entries:
        return "", ""
    for path, name in reversed(entries):
        if name.endswith("Experts"):
            return path, name
    return entries[-1]


def clean_module_path(path: str) -> str:
    """``model.layers.0.mlp`` from Dynamo's ``L['self'].model.layers[0].mlp``."""
    path = re.sub(r"^L\['self'\]\.?", "", path)
    return re.sub(r"\[(\d+)\]", r".\1", path)


def op_name(node: fx.Node) -> str:
    """A short name for what ``node`` computes: ``"linear"``, ``"index_add_"``, ``"getitem"``, ...

    ``call_function`` on torch functions, ``operator`` functions and ``torch.ops`` overloads, and
    ``call_method`` all map to the same vocabulary (``torch.sort(x)`` and ``x.sort()`` are both ``sort``).
    """
    if node.op == "call_method":
        return str(node.target)
    if node.op != "call_function":
        return node.op
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return target._opname
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target._qualified_op_name.split("::")[-1]
    return getattr(target, "__name__", str(target))


def is_mutation(node: fx.Node) -> bool:
    """True if ``node`` writes into its first argument (``x.add_()``, ``x[i] = v``, ``x /= y``)."""
    if node.op == "call_method":
        name = str(node.target)
        return name.endswith("_") and not name.endswith("__")
    if node.op == "call_function":
        if node.target in _INPLACE_OPERATORS:
            return True
        name = op_name(node)
        return name.endswith("_") and not name.startswith("_") and not name.endswith("__")
    return False


def is_factory(node: fx.Node) -> bool:
    """True if ``node`` creates a tensor from shapes alone (``zeros_like``, ``empty``, ``arange``, ...)."""
    return op_name(node) in _FACTORIES


def is_matmul(node: fx.Node) -> bool:
    """True if ``node`` is a matrix product (``linear``, ``bmm``, ``_grouped_mm``, ...)."""
    return op_name(node) in _MATMULS


def _input_nodes(node: fx.Node) -> list[fx.Node]:
    return list(node.all_input_nodes)


class DataFlow:
    """Data-flow view of a graph in which a reader of a mutated tensor also depends on its mutators."""

    def __init__(self, graph: fx.Graph) -> None:
        self.nodes: list[fx.Node] = list(graph.nodes)
        self.order: dict[fx.Node, int] = {n: i for i, n in enumerate(self.nodes)}
        self.mutators: dict[fx.Node, list[fx.Node]] = {}
        for n in self.nodes:
            if is_mutation(n) and n.args and isinstance(n.args[0], fx.Node):
                self.mutators.setdefault(n.args[0], []).append(n)

    def base(self, node: fx.Node) -> fx.Node | None:
        """The tensor a mutation node writes into, or None for a pure node."""
        if is_mutation(node) and node.args and isinstance(node.args[0], fx.Node):
            return node.args[0]
        return None

    def deps(self, node: fx.Node) -> list[fx.Node]:
        """Inputs of ``node`` plus the mutators of those inputs that run before ``node``."""
        out = _input_nodes(node)
        pos = self.order[node]
        for inp in list(out):
            out.extend(m for m in self.mutators.get(inp, ()) if self.order[m] < pos and m is not node)
        return out

    def users(self, node: fx.Node) -> list[fx.Node]:
        """Users of ``node``; for a mutation node also the later readers of the tensor it wrote."""
        out = list(node.users)
        base = self.base(node)
        if base is not None:
            pos = self.order[node]
            out.extend(u for u in base.users if self.order[u] > pos)
        return out

    def backward_closure(self, roots: Iterable[fx.Node], limit: int | None = None) -> set[fx.Node]:
        """Every node ``roots`` depend on, at most ``limit`` steps back (roots excluded; no limit: all)."""
        seen: set[fx.Node] = set()
        frontier, depth = list(roots), 0
        while frontier and (limit is None or depth < limit):
            nxt = []
            for n in frontier:
                for i in self.deps(n):
                    if i not in seen:
                        seen.add(i)
                        nxt.append(i)
            frontier, depth = nxt, depth + 1
        return seen

    def forward_closure(self, roots: Iterable[fx.Node]) -> set[fx.Node]:
        """Every node whose value depends on one of ``roots`` (roots excluded)."""
        seen: set[fx.Node] = set()
        stack = list(roots)
        while stack:
            n = stack.pop()
            for u in self.users(n):
                if u not in seen:
                    seen.add(u)
                    stack.append(u)
        return seen


def fake_mode_of(values: list[object]):
    """The fake mode Dynamo made the graph's example values with (not necessarily the ambient one)."""
    from torch._guards import detect_fake_mode
    from torch._subclasses.fake_tensor import FakeTensor

    for v in values:
        if isinstance(v, FakeTensor):
            return v.fake_mode
    return detect_fake_mode(values)


def add_weight_buffer(gm: fx.GraphModule, name: str, value: torch.Tensor, like: fx.Node) -> fx.Node:
    """Register ``value`` as a buffer of Dynamo's graph module and return a get_attr node reading it.

    Call it inside ``graph.inserting_before(...)``. The node's example value is a fake of ``value`` in the
    fake mode of ``like``'s value. Dynamo records where each parameter/buffer of its graph module came
    from (``_param_name_to_source``); AOTAutograd requires an entry for every one, so a buffer a pass
    adds gets a source of its own (and is then lifted as a static input).
    """
    from torch._dynamo.source import ConstantSource

    gm.register_buffer(name, value)
    sources = getattr(gm, "_param_name_to_source", None)
    if sources is not None:
        sources[name] = ConstantSource(f"moe_fx_{name}")
    node = gm.graph.get_attr(name)
    mode = fake_mode_of([tensor_value(like)])
    node.meta["example_value"] = mode.from_tensor(value, static_shapes=True) if mode is not None else value
    return node
