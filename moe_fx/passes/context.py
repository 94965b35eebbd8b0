"""What a moe_fx graph pass may read besides the graph (:class:`PassContext`) and a pass's signature (:data:`Pass`).

Apart from :mod:`moe_fx.passes.manager` (the pass list) so that every pass can import it without an
import circle.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx

from moe_fx.config import MoEConfig
from moe_fx.passes.expert_storage import WeightSources
from moe_fx.passes.report import RegionReport

__all__ = ["Pass", "PassContext"]


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
