"""The contiguous ("sorted") layout as a prepare/finalize candidate: ``moe_fx::experts`` on one device.

Prepare is :func:`moe_fx.lowering.triton.sort.sort_by_expert` (two small Triton kernels: a histogram
of the expert ids, each slot's row); nothing is copied — GEMM1 reads the tokens where they are.
Finalize is the gather-and-sum kernel the masked layout uses too
(:func:`~moe_fx.lowering.triton.permute.unpermute_from_masked`): each token's K rows, weighted in
fp32, identity experts added. No ``[E, max_m, H]`` buffer: ``T * K`` rows of activations at most.
vLLM's "standard" experts format, without block padding (the GEMMs walk each expert's rows in tiles).
"""

from __future__ import annotations

from moe_fx.lowering.prepare_finalize import local_permute
from moe_fx.lowering.problem import Capabilities, DispatchProblem

__all__ = ["NAME", "prefer", "supports"]

NAME = "local_sorted"


def supports(problem: DispatchProblem, caps: Capabilities) -> tuple[bool, str]:
    """What the local permute needs (one device, Triton), and an experts kernel that reads the sorted layout."""
    return local_permute.supports_reading(problem, caps, "sorted", "sorted")


def prefer(problem: DispatchProblem, caps: Capabilities) -> str | None:
    """Under ``auto``: the masked layout where it measured faster (none so far: see docs/lowering.md)."""
    return None
