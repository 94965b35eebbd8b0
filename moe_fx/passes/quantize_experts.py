"""The pass ``quantize_experts``: ``MoEConfig(quantize="fp8")`` turns bf16 expert weights into fp8 once.

Runs after ``rewrite_moe_regions``. For every ``moe_fx::experts`` node whose weights are not fp8 yet, it
quantises the real weights once, at rewrite time, into fp8 e4m3 with 128x128 fp32 block scales (the
packing function comes from the lowering through ``PassContext.pack_weights``, so this pass knows no
kernel), stores them as buffers of the GraphModule and points the op at them. The model's own bf16
parameters are untouched (they stay the source of truth for eager use and for recompiles), and are
watched: when they change, the fp8 buffers are quantised again before the next call. In-place edits,
``load_state_dict`` (in place or ``assign=True``), ``.to()`` and back are seen exactly; writes that bypass
the parameter's version counter (``p.data.mul_(2)``, ``p.data.copy_(w)``) are seen through the bits of
sampled elements of every expert (:class:`~moe_fx.passes.expert_storage.SourceWatch` says exactly what
is and is not seen). A layer that is not bf16 keeps its weights, with a warning in the report and the log.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch
import torch.fx as fx

from moe_fx.passes.context import PassContext
from moe_fx.passes.expert_storage import SourceWatch, WeightSources
from moe_fx.passes.graph_utils import add_weight_buffer, tensor_value
from moe_fx.passes.report import RegionReport

__all__ = ["quantize_experts"]

log = logging.getLogger("moe_fx.passes")


def _real_weight(node: fx.Node, ctx: PassContext) -> torch.Tensor | None:
    """The real tensor behind a weight argument: a graph input, a buffer, or a transpose of either."""
    if node.op in ("placeholder", "get_attr"):
        value = ctx.real_value(node)
        return value if isinstance(value, torch.Tensor) else None
    if node.op == "call_method" and node.target == "transpose" and isinstance(node.args[0], fx.Node):
        base = _real_weight(node.args[0], ctx)
        return None if base is None else base.transpose(*node.args[1:])
    return None


class _Requantize:
    """``refresh`` of a :class:`~moe_fx.passes.expert_storage.SourceWatch`: quantise the model's weights
    again into the same fp8 buffers. Holds the buffers and the packing function only (no pass context,
    no graph input)."""

    def __init__(self, packed: tuple[torch.Tensor, ...], sources: WeightSources, pack: Callable[..., tuple]) -> None:
        self.packed, self.build, self.pack = packed, sources.build, pack

    def __call__(self, tensors: list[torch.Tensor]) -> None:
        w13, w2 = self.build(tensors)
        for buf, new in zip(self.packed, self.pack(w13, w2, "fp8"), strict=True):
            buf.copy_(new)


def _repack_on_change(
    node: fx.Node, ctx: PassContext, packed: tuple[torch.Tensor, ...], report: RegionReport | None,
    watch: SourceWatch,
) -> None:
    """Quantise again, into the same buffers, whenever the model's weights change (checked before
    every call, :class:`~moe_fx.passes.expert_storage.SourceWatch`); warn when the sources are unknown."""
    report_index = node.meta.get("moe_fx", {}).get("report_index")
    sources = ctx.weight_sources.get(report_index) if report_index is not None else None
    if sources is None or any(r is None for r in sources.refs + sources.sampled):
        if report is not None:
            report.warnings.append("fp8 weights were quantised at compile time from weights the pass cannot "
                                   "find again at call time: later changes of the model's weights are not seen")
        return
    watch.add(sources, _Requantize(packed, sources, ctx.pack_weights))


def quantize_experts(gm: fx.GraphModule, ctx: PassContext) -> int:
    """Quantise the weights of every bf16 ``moe_fx::experts`` node to fp8 blocks; return how many."""
    if ctx.config.quantize != "fp8" or ctx.pack_weights is None:
        return 0
    count = 0
    g = gm.graph
    watch = SourceWatch()
    for node in list(g.nodes):
        if node.target is not torch.ops.moe_fx.experts.default:
            continue
        hidden, _, _, w13_node, w2_node = node.args[:5]
        w13, w2 = _real_weight(w13_node, ctx), _real_weight(w2_node, ctx)
        if w13 is None or w2 is None or w13.dtype == torch.float8_e4m3fn:
            continue
        report_index = node.meta.get("moe_fx", {}).get("report_index")
        report = ctx.report[report_index] if report_index is not None else None
        if tensor_value(hidden).dtype != torch.bfloat16:
            dtype = str(tensor_value(hidden).dtype).replace("torch.", "")
            why = f"quantize='fp8' not applied: fp8 expert weights need bfloat16 activations, this layer is {dtype}"
            log.warning("moe_fx: %s: %s", report.layer if report else node.name, why)
            if report is not None:
                report.warnings.append(why)
            continue
        with torch.no_grad():
            q13, s13, q2, s2 = ctx.pack_weights(w13, w2, "fp8")
        suffixes = ("w13", "w13_scale", "w2", "w2_scale")
        with g.inserting_before(node):
            q13_n, s13_n, q2_n, s2_n = (
                add_weight_buffer(gm, f"moe_fx_fp8_{count}_{suffix}", value, hidden)
                for suffix, value in zip(suffixes, (q13, s13, q2, s2), strict=True)
            )
        node.args = (*node.args[:3], q13_n, q2_n, *node.args[5:])
        node.kwargs = {**node.kwargs, "w13_scale": s13_n, "w2_scale": s2_n}
        _repack_on_change(node, ctx, (q13, s13, q2, s2), report, watch)
        if report is not None:
            report.fp8 = True
        count += 1
    if watch:
        # One check per graph call for every layer (one comparison of all samples); the state is read
        # after compiling (AOTAutograd re-reads the inputs while compiling). partial, not a lambda over
        # ctx: nothing of the pass context outlives the compile.
        ctx.call_checks.append(watch)
        ctx.after_compile.append(functools.partial(watch.record, ctx.example_inputs))
    return count
