"""The torch reference as a masked-experts candidate: runs anywhere, never fast.

It is not a GEMM implementation of the pipeline: choosing it means the whole op runs its reference
(:func:`moe_fx.ops.experts_reference` / :func:`moe_fx.ops.ep.masked_experts_reference`) as an opaque
call, in eager code and in compiled graphs alike.
"""

from __future__ import annotations

from moe_fx.lowering.problem import Capabilities, ExpertsProblem

__all__ = ["NAME", "supports"]

NAME = "reference"


def supports(problem: ExpertsProblem, caps: Capabilities) -> tuple[bool, str]:
    """Always ``(True, "")``: the reference computes every input the op contract accepts."""
    return True, ""
