"""moe_fx's Triton masked GEMMs as the experts pipeline's GEMMs (any shape; bf16/fp16/fp32, or fp8 1x128/128x128).

Persistent kernels that visit valid row tiles only (:mod:`moe_fx.lowering.triton.grouped_gemm`), a
bias epilogue, tile configurations from the tuned table chosen when the graph is compiled. On CPU
tensors the same kernels run under Triton's interpreter (tests; ``kernel="triton"`` on CPU).
"""

from __future__ import annotations

import torch

from moe_fx.lowering.masked_experts.pipeline import GemmHints
from moe_fx.lowering.problem import Capabilities, ExpertsProblem
from moe_fx.ops import ExpertActivation
from moe_fx.ops.recipe import FP8_BLOCK

__all__ = ["GEMMS", "LAYOUTS", "NAME", "TritonGemms", "prefer", "supports"]

NAME = "triton"
#: the row layouts its GEMMs read: masked (``gemm``) and contiguous (``sorted_gemm``) row layouts
LAYOUTS = ("masked", "sorted")
_DTYPES = ("bfloat16", "float16", "float32")
_ACTIVATIONS = ("silu", "gelu", "gelu_tanh", "relu", "relu2")


def supports(problem: ExpertsProblem, caps: Capabilities) -> tuple[bool, str]:
    """Can moe_fx's Triton kernels run ``problem`` on ``caps``? ``(True, "")`` or ``(False, reason)``."""
    if caps.triton_error is not None:
        return False, caps.triton_error
    if problem.device_type not in ("cuda", "cpu"):
        return False, f"needs a CUDA GPU (or the CPU interpreter), device is {problem.device_type}"
    if problem.activation.name not in _ACTIVATIONS:
        return False, f"activation {problem.activation.name!r} has no kernel; have: {', '.join(_ACTIVATIONS)}"
    if problem.fp8_block is not None:
        if tuple(problem.fp8_block) != (FP8_BLOCK, FP8_BLOCK):
            return False, f"fp8 weights need {FP8_BLOCK}x{FP8_BLOCK} blocks, got {problem.fp8_block[0]}x{problem.fp8_block[1]}"
        if problem.dtype != "bfloat16":
            return False, f"fp8 weights need bfloat16 activations, got {problem.dtype}"
        # Triton's e4m3 dot needs the fp8 tensor cores of Ada/Hopper (SM89+).
        if problem.device_type == "cuda" and (caps.capability is None or caps.capability < (8, 9)):
            cap = "unknown" if caps.capability is None else f"SM{caps.capability[0]}{caps.capability[1]}"
            return False, f"fp8 GEMMs need SM89 or newer, GPU is {cap}"
    elif problem.dtype not in _DTYPES:
        return False, f"unsupported activation dtype {problem.dtype}"
    return True, ""


def prefer(problem: ExpertsProblem, caps: Capabilities) -> str | None:
    """Under ``auto``: on CPU the interpreter is for tests, the reference runs instead."""
    if problem.device_type == "cpu":
        return "would run under Triton's interpreter on CPU (kernel='triton' asks for that); reference preferred"
    return None


class TritonGemms:
    """The two expert GEMMs of the pipeline on moe_fx's Triton kernels."""

    name = NAME
    #: activation scales may have any strides (the kernels read them through their strides)
    scale_layout = "any"
    #: GEMM2's bias is added in the GEMM's epilogue
    bias_epilogue = True
    layouts = LAYOUTS

    def rows(self, needed: object) -> object:
        """``max_m`` for ``needed`` rows per expert: exactly that (every kernel masks partial tiles)."""
        return needed

    def gemm(
        self,
        a: torch.Tensor,
        a_scale: torch.Tensor | None,
        w: torch.Tensor,
        w_scale: torch.Tensor | None,
        masked_m: torch.Tensor,
        *,
        bias: torch.Tensor | None,
        hints: GemmHints,
    ) -> torch.Tensor:
        """``[G, M, K] x [G, N, K]^T -> [G, M, N]`` on valid rows (bf16 out for fp8, else a's dtype)."""
        from moe_fx.lowering.triton.grouped_gemm import masked_gemm, masked_gemm_fp8

        kw = dict(bias=bias, expected_m=hints.expected_m, max_total_m=hints.max_total_m,
                  active_groups=hints.active_groups, regime=hints.regime)
        if w_scale is not None:
            return masked_gemm_fp8(a, a_scale, w, w_scale, masked_m, **kw)
        return masked_gemm(a, w, masked_m, **kw)

    def sorted_gemm(
        self,
        a: torch.Tensor,
        a_scale: torch.Tensor | None,
        w: torch.Tensor,
        w_scale: torch.Tensor | None,
        rows: object,
        *,
        bias: torch.Tensor | None,
        hints: GemmHints,
        gather: bool,
        route_weights: torch.Tensor | None,
        activation: ExpertActivation | None = None,
    ) -> torch.Tensor:
        """The contiguous layout's GEMM (:func:`~moe_fx.lowering.triton.grouped_gemm.sorted_gemm`): ``[T * K, N]``
        (``activation``: applied in the epilogue, ``[T * K, I]``)."""
        from moe_fx.lowering.triton.grouped_gemm import sorted_gemm

        return sorted_gemm(a, w, rows, a_scale=a_scale, b_scale=w_scale, gather=gather, route_weights=route_weights,
                           bias=bias, expected_m=hints.expected_m, active_groups=hints.active_groups,
                           regime=hints.regime, activation=activation)


GEMMS = TritonGemms()
