"""Small FX graphs for the unit tests of one pass or one recogniser (no Dynamo, no Inductor).

:func:`traced` symbolically traces a plain function of tensors: the graph is in Dynamo's vocabulary
(``call_function`` on torch functions and operators, ``call_method`` on tensors, one placeholder per input)
and every node carries its value on the example inputs in ``meta["example_value"]``, as Dynamo's graphs
carry fake ones. :func:`context` is the :class:`~moe_fx.passes.context.PassContext` the backend would make.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import fx

from moe_fx.config import MoEConfig
from moe_fx.passes.context import PassContext


class _Record(fx.Interpreter):
    """Runs the graph and writes each node's value into ``meta["example_value"]``."""

    def run_node(self, n: fx.Node) -> Any:
        out = super().run_node(n)
        n.meta["example_value"] = out
        return out


def traced(fn: Callable | torch.nn.Module, *inputs: torch.Tensor) -> fx.GraphModule:
    """``fn`` (a function, or a module: its parameters become get_attr nodes) as a GraphModule whose nodes
    carry their example values."""
    root = fn if isinstance(fn, torch.nn.Module) else torch.nn.Module()
    gm = fx.GraphModule(root, fx.Tracer().trace(fn))
    with torch.no_grad():
        _Record(gm).run(*inputs)
    return gm


def routed(fn: Callable, top_k: int) -> Callable:
    """``fn(h, ids, w, w13, w2)`` with its ids and weights made in the graph by a router's top-k of ``scores [T, E]``:
    ``routed(fn)(h, scores, w13, w2)``. Ids from a top-k are bounded to ``[0, E)``; ids that are a graph input could
    be ``-1`` or ``E``, which a region must skip as the op does to be rewritten."""

    def with_router(h, scores, w13, w2):
        w, ids = torch.topk(scores, top_k, dim=-1)
        return fn(h, ids, w, w13, w2)

    with_router.__name__ = getattr(fn, "__name__", "fn")
    return with_router


def context(gm: fx.GraphModule, inputs: list, **config: Any) -> PassContext:
    """The pass context the backend makes for ``gm`` called with ``inputs`` (bound to the graph)."""
    from moe_fx.lowering.weights import pack_experts_weights

    ctx = PassContext(config=MoEConfig(**config), example_inputs=list(inputs), pack_weights=pack_experts_weights)
    ctx.bind(gm)
    return ctx


def calls(gm: fx.GraphModule, target: object) -> int:
    """How many nodes call ``target`` (a function, an op overload, or a tensor method name)."""
    return sum(1 for n in gm.graph.nodes if n.target is target or (isinstance(target, str) and n.target == target))


def ops(gm: fx.GraphModule) -> list[str]:
    """The graph's calls in order, by name (``bmm``, ``moe_fx.experts.default``, ``sum``, ...)."""
    out = []
    for n in gm.graph.nodes:
        if n.op in ("call_function", "call_method"):
            target = n.target
            out.append(target if isinstance(target, str) else str(getattr(target, "__name__", target)))
    return out
