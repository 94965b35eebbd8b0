"""The aligned contiguous layout as a prepare/finalize candidate: ``moe_fx::experts`` on one device, for GEMMs
that need each expert's rows in whole blocks (DeepGEMM's m-grouped contiguous GEMMs: 128-row blocks).

Prepare is the sort of the sorted layout (:func:`moe_fx.lowering.triton.sort.sort_by_expert`) and one
copy of the tokens into their experts' aligned segments
(:func:`~moe_fx.lowering.triton.sort.contiguous_rows`: ``T * K + E * 127`` rows at most, each expert's
padding rows marked -1 for the GEMMs to skip); finalize is the same gather-and-sum kernel as the other
local layouts. No ``[E, max_m, H]`` buffer.

Under ``auto`` it is taken for DeepGEMM from the top rows-per-expert regime on (:func:`prefer`): there
the masked layout's ``[E, max_m = T, H]`` buffers hold at least ``E / (1.5 K)`` times this layout's rows
(26 GB per call for Qwen3-30B-A3B at T = 16384), for about the same time; below it the masked layout
measured faster (bench/results/layouts_2026-12-03_s1.md, layouts_2026-12-03_s2.md).
"""

from __future__ import annotations

from moe_fx.lowering.prepare_finalize import local_permute
from moe_fx.lowering.problem import ROW_REGIMES, Capabilities, DispatchProblem

__all__ = ["NAME", "prefer", "supports"]

NAME = "local_contiguous"


def supports(problem: DispatchProblem, caps: Capabilities) -> tuple[bool, str]:
    """What the local permute needs (one device, Triton), and an experts kernel that reads this layout."""
    return local_permute.supports_reading(problem, caps, "contiguous", "aligned contiguous")


def prefer(problem: DispatchProblem, caps: Capabilities) -> str | None:
    """Under ``auto``: from the top rows-per-expert regime on, where the masked layout's buffers are several
    times this layout's bound; below it the masked layout (faster there, in bench/layouts.py on the H200)."""
    if problem.regime != len(ROW_REGIMES):
        bound = ROW_REGIMES[-1]
        return (f"the masked layout measured faster at <= {bound} rows per expert; this one is taken above "
                f"{bound} (bench/layouts.py)")
    if problem.num_experts < 2 * problem.top_k:
        return (f"E={problem.num_experts} < 2K: the masked layout's [E, T, H] buffers are no larger than this "
                "layout's T*K + 127E rows")
    return None
