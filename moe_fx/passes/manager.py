"""The ordered list of moe_fx graph passes, the context they share, and the loop that runs them.

Invariants every pass keeps (after Inductor's ``fx_passes/README.md``):

* every node it creates carries a correct fake value in ``meta["example_value"]``;
* it adds no mutation of graph inputs and creates no aliasing between inputs and outputs;
* it leaves anything it does not fully understand exactly as it was, and says why in the report;
* it counts a rewrite only when it happened (the pass returns that count).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.fx as fx

from moe_fx.config import MoEConfig
from moe_fx.passes.report import RegionReport

if TYPE_CHECKING:
    from moe_fx.passes.expert_storage import WeightSources

__all__ = ["PASSES", "Pass", "PassContext", "describe_passes", "run_passes"]

log = logging.getLogger("moe_fx.passes")


@dataclass
class PassContext:
    """What a pass may read besides the graph: the config, real inputs, and the report it adds to.

    Attributes:
        config: the user's :class:`~moe_fx.config.MoEConfig`.
        example_inputs: the real tensors Dynamo passes with the graph, in placeholder order.
        report: one :class:`RegionReport` per candidate MoE region, matched or not.
        timings: seconds spent in each pass, by name.
        pack_weights: ``(w13, w2, recipe) -> (w13', w13_scale, w2', w2_scale)``, the lowering's weight
            packing, handed in by the backend (passes never import kernels).
        after_compile: actions the backend runs once the graph is compiled (AOTAutograd re-reads the
            example inputs' metadata while compiling, so a pass must not change them before that).
        call_checks: callables the compiled graph runs before every call, with the call's graph inputs
            (they keep tensors made at rewrite time in step with the model's parameters:
            :mod:`moe_fx.passes.expert_storage`).
        weight_sources: per rewritten region (by its index in ``report``): the model's own weight
            tensors its op's weights come from and how to build them
            (:class:`~moe_fx.passes.expert_storage.WeightSources`; for passes that make new weights, e.g. fp8).
    """

    config: MoEConfig = field(default_factory=MoEConfig)
    example_inputs: list[Any] = field(default_factory=list)
    report: list[RegionReport] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    pack_weights: Callable[..., tuple] | None = None
    after_compile: list[Callable[[], None]] = field(default_factory=list)
    call_checks: list[Callable[[Sequence[Any]], None]] = field(default_factory=list)
    weight_sources: dict[int, WeightSources] = field(default_factory=dict)
    _placeholder_values: dict[str, Any] | None = None
    _placeholder_index: dict[str, int] = field(default_factory=dict)

    def bind(self, gm: fx.GraphModule) -> None:
        """Associate placeholders of ``gm`` with ``example_inputs`` (by position)."""
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        self._placeholder_values = {
            n.name: v for n, v in zip(placeholders, self.example_inputs, strict=False)
        }
        self._placeholder_index = {n.name: i for i, n in enumerate(placeholders[: len(self.example_inputs)])}
        self._gm = gm

    def input_ref(self, node: fx.Node) -> int | torch.Tensor | None:
        """How to find ``node``'s real tensor at call time: its graph input position (a placeholder),
        the tensor itself (a get_attr), or None."""
        if node.op == "placeholder":
            return self._placeholder_index.get(node.name)
        value = self.real_value(node)
        return value if isinstance(value, torch.Tensor) else None

    def real_value(self, node: fx.Node) -> Any:
        """The real value behind a placeholder or get_attr node, or None if unknown."""
        if node.op == "placeholder" and self._placeholder_values is not None:
            return self._placeholder_values.get(node.name)
        if node.op == "get_attr":
            obj: Any = getattr(self, "_gm", None)
            for part in str(node.target).split("."):
                obj = getattr(obj, part, None)
            return obj
        return None


#: A pass reads and rewrites a graph in place and returns how many regions it rewrote.
Pass = Callable[[fx.GraphModule, PassContext], int]


def _pass_list() -> list[tuple[str, Pass]]:
    # Imported lazily so that each pass module can import this one for PassContext.
    from moe_fx.passes.rewrite_moe import rewrite_moe_regions

    from moe_fx.passes.quantize_experts import quantize_experts

    passes: list[tuple[str, Pass]] = [
        ("rewrite_moe_regions", rewrite_moe_regions),
        ("quantize_experts", quantize_experts),
    ]
    try:
        from moe_fx.passes.split_ep import split_ep
    except ImportError:  # expert parallelism not built into this checkout
        return passes
    passes.append(("split_ep", split_ep))
    return passes


#: The pass order, as (name, pass) pairs; computed once on first use.
PASSES: list[tuple[str, Pass]] = []


def describe_passes() -> str:
    """The pass pipeline, one line per pass, in order."""
    if not PASSES:
        PASSES.extend(_pass_list())
    return "\n".join(f"{i}. {name}" for i, (name, _) in enumerate(PASSES, 1))


def run_passes(gm: fx.GraphModule, ctx: PassContext) -> int:
    """Run every pass of :data:`PASSES` on ``gm`` in order; return the total rewrite count."""
    if not PASSES:
        PASSES.extend(_pass_list())
    ctx.bind(gm)
    total = 0
    for name, fn in PASSES:
        start = time.perf_counter()
        count = fn(gm, ctx)
        ctx.timings[name] = ctx.timings.get(name, 0.0) + time.perf_counter() - start
        total += count
        log.debug("pass %s rewrote %d region(s) in %.1f ms", name, count, 1e3 * ctx.timings[name])
    if total:
        gm.graph.lint()
        gm.recompile()
    torch._logging.trace_structured(
        "artifact",
        metadata_fn=lambda: {"name": "moe_fx_pass_report", "encoding": "string"},
        payload_fn=lambda: "\n".join(r.one_line() for r in ctx.report),
    )
    return total
