"""The aligned contiguous layout as a prepare/finalize candidate: ``moe_fx::experts`` on one device, for GEMMs
that need each expert's rows in whole blocks (DeepGEMM's m-grouped contiguous GEMMs: 128-row blocks).

Prepare is the sort of the sorted layout (:func:`moe_fx.lowering.triton.sort.sort_by_expert`) and one
copy of the tokens into their experts' aligned segments
(:func:`~moe_fx.lowering.triton.sort.contiguous_rows`: ``T * K + E * 127`` rows at most, each expert's
padding rows marked -1 for the GEMMs to skip); finalize is the same gather-and-sum kernel as the other
local layouts. No ``[E, max_m, H]`` buffer.

Not measured on a GPU yet: under ``auto`` it is passed over (:func:`prefer`); ``layout="local_contiguous"``
(benchmarks) runs it.
"""

from __future__ import annotations

from moe_fx.lowering.prepare_finalize import local_permute
from moe_fx.lowering.problem import Capabilities, DispatchProblem

__all__ = ["NAME", "prefer", "supports"]

NAME = "local_contiguous"


def supports(problem: DispatchProblem, caps: Capabilities) -> tuple[bool, str]:
    """What the local permute needs (one device, Triton), and an experts kernel that reads this layout."""
    return local_permute.supports_reading(problem, caps, "contiguous", "aligned contiguous")


def prefer(problem: DispatchProblem, caps: Capabilities) -> str | None:
    """Under ``auto``: not yet (no GPU measurement against the masked layout)."""
    return "not measured against the masked layout on a GPU yet (bench/layouts.py requests it)"
