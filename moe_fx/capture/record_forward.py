"""Record what a module's forward computed on real inputs as a straight-line FX graph (torch-level ops).

The capture step (:mod:`~moe_fx.capture.hit_loops`) must prove what a loop over the experts a batch hits computes,
and Dynamo cannot trace such a loop as one graph. :func:`record_forward` runs the forward once on real inputs
under a ``TorchFunctionMode`` and writes down every torch call it makes, with the loop unrolled the way it ran
(every expert hit, so every expert's chain is in the graph). The graph uses the vocabulary of Dynamo's graphs
(``call_function`` on torch functions and ``operator`` functions, ``call_method`` on tensor methods), so that
:func:`~moe_fx.passes.recognize.read_form.read_form` reads it with the same rules; each node's ``meta["example_value"]``
is the real value, and tensors whose number of rows depends on the data (``nonzero``, ``where(mask)`` and what
they index) carry :data:`~moe_fx.passes.recognize.read_form.DATA_DEPENDENT_ROWS`.

Python control flow on tensor values (``if expert_idx == E``) is recorded as the comparison that fed it; the
branch is the one taken (the trace is of this run).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch.overrides import TorchFunctionMode

from moe_fx.passes.recognize.read_form import DATA_DEPENDENT_ROWS

__all__ = ["RecordedForward", "record_forward"]

#: Tensor dunders spelled as ``operator`` functions (Dynamo's spelling), and whether the operands swap.
_OPERATORS = {
    "__getitem__": (operator.getitem, False), "__setitem__": (operator.setitem, False),
    "__add__": (operator.add, False), "__radd__": (operator.add, True), "__iadd__": (operator.iadd, False),
    "__sub__": (operator.sub, False), "__rsub__": (operator.sub, True), "__isub__": (operator.isub, False),
    "__mul__": (operator.mul, False), "__rmul__": (operator.mul, True), "__imul__": (operator.imul, False),
    "__truediv__": (operator.truediv, False), "__rtruediv__": (operator.truediv, True),
    "__itruediv__": (operator.itruediv, False), "__floordiv__": (operator.floordiv, False),
    "__matmul__": (operator.matmul, False), "__rmatmul__": (operator.matmul, True),
    "__pow__": (operator.pow, False), "__rpow__": (operator.pow, True), "__neg__": (operator.neg, False),
    "__eq__": (operator.eq, False), "__ne__": (operator.ne, False), "__lt__": (operator.lt, False),
    "__le__": (operator.le, False), "__gt__": (operator.gt, False), "__ge__": (operator.ge, False),
    "__and__": (operator.and_, False), "__or__": (operator.or_, False), "__invert__": (operator.invert, False),
    "__mod__": (operator.mod, False),
}  # fmt: skip
#: Calls that only turn a tensor into Python control flow or text: nothing to record.
_SKIP = frozenset({"__bool__", "__int__", "__float__", "__index__", "__len__", "__iter__", "__format__", "__repr__",
                   "__hash__", "__contains__", "__array__", "__reversed__"})
#: Ops whose result has as many rows as the data says.
_DATA_DEPENDENT = frozenset({"nonzero", "argwhere", "masked_select", "unique", "unique_consecutive", "nonzero_static"})


@dataclass
class RecordedForward:
    """A recorded forward: the graph, its input placeholders, one placeholder per parameter read, the output."""

    graph: fx.Graph
    inputs: list[fx.Node]
    params: dict[str, fx.Node]
    output: fx.Node | None
    value: object


def _method_name(func: Callable) -> str | None:
    """The tensor method or property ``func`` is (``"chunk"``, ``"__getitem__"``, ``"T"``), or None."""
    owner = getattr(func, "__objclass__", None)
    if owner is not None and issubclass(owner, torch._C.TensorBase):
        return func.__name__
    qual = getattr(func, "__qualname__", "")
    if qual.startswith(("TensorBase.", "Tensor.")):
        return qual.split(".", 1)[1]
    if qual == "getset_descriptor.__get__":
        return getattr(getattr(func, "__self__", None), "__name__", None)
    return None


class _Recorder(TorchFunctionMode):
    def __init__(self, graph: fx.Graph, env: dict[int, fx.Node], keep: list) -> None:
        super().__init__()
        self.graph, self.env, self.keep = graph, env, keep
        self.extra = 0

    def node_of(self, t: torch.Tensor) -> fx.Node:
        node = self.env.get(id(t))
        if node is None:  # a tensor made outside the forward and not a parameter (a buffer, a constant)
            self.extra += 1
            node = self.graph.placeholder(f"outside_{self.extra}")
            node.meta["example_value"] = t
            self.env[id(t)] = node
            self.keep.append(t)
        return node

    def arg(self, a: object) -> object:
        if isinstance(a, torch.Tensor):
            return self.node_of(a)
        if isinstance(a, (list, tuple)):
            mapped = [self.arg(x) for x in a]
            return type(a)(mapped) if isinstance(a, tuple) else mapped
        if isinstance(a, dict):
            return {k: self.arg(v) for k, v in a.items()}
        if isinstance(a, slice):
            return slice(self.arg(a.start), self.arg(a.stop), self.arg(a.step))
        return a

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = _method_name(func)
        if name in _SKIP:
            return out
        has_tensor = any(isinstance(a, torch.Tensor) for a in torch.utils._pytree.tree_leaves((args, kwargs)))
        if not has_tensor and not isinstance(out, torch.Tensor):
            return out  # grad-mode switches and other calls that touch no tensor
        if name is not None and not isinstance(out, torch.Tensor) and name in ("dtype", "shape", "device",
                                                                                "is_cuda", "ndim", "layout"):
            return out  # metadata read as a Python value: a constant of this run
        node = self.record(func, name, args, kwargs)
        node.meta["example_value"] = out if not isinstance(out, list) else tuple(out)
        if isinstance(out, torch.Tensor) and (name or getattr(func, "__name__", "")) in _DATA_DEPENDENT:
            node.meta[DATA_DEPENDENT_ROWS] = True
        self.bind(node, out)
        return out

    def record(self, func: Callable, name: str | None, args: tuple, kwargs: dict) -> fx.Node:
        args, kwargs = self.arg(tuple(args)), self.arg(kwargs)
        if name in _OPERATORS:
            target, swap = _OPERATORS[name]
            if swap:
                args = (args[1], args[0], *args[2:])
            return self.graph.call_function(target, args, kwargs)
        if name is not None:
            return self.graph.call_method(name, args, kwargs)
        if func is torch.where and len(args) == 1 and not kwargs:
            node = self.graph.call_function(func, args, kwargs)
            node.meta[DATA_DEPENDENT_ROWS] = True
            return node
        return self.graph.call_function(func, args, kwargs)

    def bind(self, node: fx.Node, out: object) -> None:
        """Map the tensors ``out`` holds to ``node`` (or to ``getitem`` nodes of it)."""
        if isinstance(out, torch.Tensor):
            if id(out) not in self.env:  # an in-place op returns its base: later readers keep reading the base
                self.env[id(out)] = node
                self.keep.append(out)
            if _inputs_data_dependent(node) and out.dim() and _same_rows(node, out):
                node.meta[DATA_DEPENDENT_ROWS] = True
            return
        if isinstance(out, (tuple, list)):
            for i, item in enumerate(out):
                if isinstance(item, torch.Tensor) and id(item) not in self.env:
                    g = self.graph.call_function(operator.getitem, (node, i))
                    g.meta["example_value"] = item
                    if node.meta.get(DATA_DEPENDENT_ROWS):
                        g.meta[DATA_DEPENDENT_ROWS] = True
                    self.env[id(item)] = g
                    self.keep.append(item)


def _inputs_data_dependent(node: fx.Node) -> bool:
    return any(i.meta.get(DATA_DEPENDENT_ROWS) for i in node.all_input_nodes)


def _same_rows(node: fx.Node, out: torch.Tensor) -> bool:
    """True if ``out`` has as many rows as a data-dependent input of ``node`` (rows indexed by it, or kept)."""
    for i in node.all_input_nodes:
        v = i.meta.get("example_value")
        if i.meta.get(DATA_DEPENDENT_ROWS) and isinstance(v, torch.Tensor) and v.dim() and v.shape[0] == out.shape[0]:
            return True
    return False


def record_forward(fn: Callable[..., object], inputs: Sequence[torch.Tensor], params: dict[str, torch.Tensor]
                   ) -> RecordedForward:
    """Run ``fn(*inputs)`` and record every torch call it makes (see the module docstring).

    ``params`` (name -> tensor) are the tensors ``fn`` reads besides its inputs (a module's parameters); each
    one read becomes a placeholder named after it. Returns the graph, whose output is the node of the tensor
    ``fn`` returned (None when it returned something else or a tensor it did not compute).
    """
    graph = fx.Graph()
    env: dict[int, fx.Node] = {}
    keep: list[object] = [*inputs, *params.values()]
    placeholders = []
    for i, t in enumerate(inputs):
        p = graph.placeholder(f"input_{i}")
        p.meta["example_value"] = t
        env[id(t)] = p
        placeholders.append(p)
    by_param: dict[str, fx.Node] = {}
    for name, t in params.items():
        p = graph.placeholder("param_" + name.replace(".", "_"))
        p.meta["example_value"] = t
        p.meta["moe_fx_param"] = name
        env[id(t)] = p
        by_param[name] = p
    with _Recorder(graph, env, keep):
        value = fn(*inputs)
    out = env.get(id(value)) if isinstance(value, torch.Tensor) else None
    graph.output(out)
    used = {i for n in graph.nodes for i in n.all_input_nodes}
    for name, p in list(by_param.items()):
        if p not in used:
            graph.erase_node(p)
            del by_param[name]
    return RecordedForward(graph, placeholders, by_param, out, value)
