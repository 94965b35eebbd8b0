"""Kernel selection for the moe_fx ops (one place for the rule; see DESIGN.md "Choosing kernels").

Placeholder rule until the DeepGEMM/Triton selection lands: the torch reference everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["ExpertsChoice", "choose_experts_kernel"]


@dataclass(frozen=True)
class ExpertsChoice:
    """The kernel picked for an experts op, and why each other candidate was not taken."""

    kernel: str
    reasons: dict[str, str] = field(default_factory=dict)


def choose_experts_kernel(
    *, device_type: str, dtype: str, hidden: int, intermediate: int, num_experts: int, request: str = "auto"
) -> ExpertsChoice:
    """Pick the experts kernel for a problem described by plain values (no tensors, no library probing)."""
    return ExpertsChoice("reference", {"triton": "not available yet", "deepgemm": "not available yet"})
