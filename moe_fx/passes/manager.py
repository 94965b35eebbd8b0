"""The ordered list of moe_fx graph passes and the loop that runs them (their context: :mod:`.context`).

What every pass may assume and must keep (fake values, no mutation or aliasing, weights never copied,
regions left exactly as written, counts only when rewritten) is written down in ``moe_fx/passes/README.md``,
after Inductor's ``fx_passes/README.md``.
"""

from __future__ import annotations

import logging
import time

import torch
from torch import fx

from moe_fx.passes.context import Pass, PassContext
from moe_fx.passes.quantize_experts import quantize_experts
from moe_fx.passes.rewrite_moe import rewrite_moe_regions
from moe_fx.passes.split_ep import split_ep

__all__ = ["PASSES", "Pass", "PassContext", "describe_passes", "run_passes"]

log = logging.getLogger("moe_fx.passes")


#: The pass order, as (name, pass) pairs: data, printable (:func:`describe_passes`), each pass
#: observable by name in the timings and the ``moe_fx.passes`` log.
PASSES: list[tuple[str, Pass]] = [
    ("rewrite_moe_regions", rewrite_moe_regions),
    ("quantize_experts", quantize_experts),
    ("split_ep", split_ep),
]


def describe_passes() -> str:
    """The pass pipeline, one line per pass, in order."""
    return "\n".join(f"{i}. {name}" for i, (name, _) in enumerate(PASSES, 1))


def run_passes(gm: fx.GraphModule, ctx: PassContext) -> int:
    """Run every pass of :data:`PASSES` on ``gm`` in order; return the total rewrite count."""
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
