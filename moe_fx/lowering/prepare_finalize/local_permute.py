"""The local permute as a prepare/finalize candidate: ``moe_fx::experts`` on one device.

Prepare is :func:`moe_fx.lowering.triton.permute.permute_to_masked` (one Triton kernel: tokens to
their experts' rows, fp8-quantised when the weights are fp8, routing weights applied when they go on
the input), finalize :func:`~moe_fx.lowering.triton.permute.unpermute_from_masked` (one Triton kernel:
rows back to tokens, weighted and summed in fp32, identity experts added). No collective, no host
synchronisation.
"""

from __future__ import annotations

from moe_fx.lowering.problem import Capabilities, DispatchProblem

__all__ = ["NAME", "supports", "supports_reading"]

NAME = "local_permute"


def supports(problem: DispatchProblem, caps: Capabilities) -> tuple[bool, str]:
    """One device, Triton present (compiled on CUDA, interpreted on CPU)."""
    if problem.expert_parallel:
        return False, "expert parallelism needs a communication backend"
    if caps.triton_error is not None:
        return False, caps.triton_error
    if problem.device_type not in ("cuda", "cpu"):
        return False, f"needs a CUDA GPU (or the CPU interpreter), device is {problem.device_type}"
    return True, ""


def supports_reading(problem: DispatchProblem, caps: Capabilities, layout: str, described: str) -> tuple[bool, str]:
    """:func:`supports`, and an experts kernel that reads ``layout`` (a name of its ``LAYOUTS``; ``described``
    names it in the reason): the rule of the local candidates of the other row layouts."""
    ok, why = supports(problem, caps)
    if not ok:
        return ok, why
    if layout not in problem.experts_layouts:
        return False, f"the experts kernel reads no {described} layout"
    return True, ""
