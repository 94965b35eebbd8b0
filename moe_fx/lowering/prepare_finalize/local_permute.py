"""The local permute as a prepare/finalize candidate: ``moe_fx::experts`` on one device.

Prepare is :func:`moe_fx.lowering.triton.permute.permute_to_masked` (one Triton kernel: tokens to
their experts' rows, fp8-quantised when the weights are fp8, routing weights applied when they go on
the input), finalize :func:`~moe_fx.lowering.triton.permute.unpermute_from_masked` (one Triton kernel:
rows back to tokens, weighted and summed in fp32, identity experts added). No collective, no host
synchronisation.
"""

from __future__ import annotations

from moe_fx.lowering.problem import Capabilities, DispatchProblem

__all__ = ["NAME", "supports"]

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
