"""moe_fx custom ops: the contract between the graph passes and the kernel lowering.

Importing this package registers every op with ``torch.library`` (schema, fake and CPU reference
implementations). Kernels for devices are registered by :mod:`moe_fx.lowering`, which ``import moe_fx``
also imports.
"""

from moe_fx.ops import ep, masked_experts  # noqa: F401  (register the expert-parallel ops and masked_experts)
from moe_fx.ops.checks import EP_KERNELS, KERNELS
from moe_fx.ops.experts import (
    ACTIVATIONS,
    GATE_UP_LAYOUTS,
    ExpertActivation,
    dequantize_blockwise,
    experts,
    experts_reference,
)
from moe_fx.ops.recipe import FP8_BLOCK, FP8_DTYPE, FP8_E4M3_MAX, FP8_SCALE_FLOOR

__all__ = [
    "ACTIVATIONS",
    "EP_KERNELS",
    "FP8_BLOCK",
    "FP8_DTYPE",
    "FP8_E4M3_MAX",
    "FP8_SCALE_FLOOR",
    "GATE_UP_LAYOUTS",
    "KERNELS",
    "ExpertActivation",
    "dequantize_blockwise",
    "experts",
    "experts_reference",
]
