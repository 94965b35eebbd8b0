"""The pass ``quantize_experts``: ``MoEConfig(quantize="fp8")`` turns bf16 expert weights into fp8 once.

Runs after ``rewrite_moe_regions``. For every ``moe_fx::experts`` node whose weights are not fp8 yet, it
quantises the real weights once, at rewrite time, into fp8 e4m3 with 128x128 fp32 block scales (the
packing function comes from the lowering through ``PassContext.pack_weights``, so this pass knows no
kernel), stores them as buffers of the GraphModule and points the op at them. The model's own bf16
parameters are untouched (they stay the source of truth for eager use and for recompiles).
"""

from __future__ import annotations

import logging

import torch
import torch.fx as fx

from moe_fx.passes.graph_utils import add_weight_buffer, tensor_value
from moe_fx.passes.manager import PassContext

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


def quantize_experts(gm: fx.GraphModule, ctx: PassContext) -> int:
    """Quantise the weights of every bf16 ``moe_fx::experts`` node to fp8 blocks; return how many."""
    if ctx.config.quantize != "fp8" or ctx.pack_weights is None:
        return 0
    count = 0
    g = gm.graph
    for node in list(g.nodes):
        if node.target is not torch.ops.moe_fx.experts.default:
            continue
        hidden, _, _, w13_node, w2_node = node.args[:5]
        w13, w2 = _real_weight(w13_node, ctx), _real_weight(w2_node, ctx)
        if w13 is None or w2 is None or w13.dtype == torch.float8_e4m3fn:
            continue
        if tensor_value(hidden).dtype != torch.bfloat16:
            log.info("moe_fx: fp8 weights need bf16 activations; %s stays %s", node.name, tensor_value(hidden).dtype)
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
        report_index = node.meta.get("moe_fx", {}).get("report_index")
        if report_index is not None:
            ctx.report[report_index].fp8 = True
        count += 1
    return count
