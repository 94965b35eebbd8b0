"""moe_fx custom ops: the contract between the graph passes and the kernel lowering.

Importing this package registers every op with ``torch.library`` (schema, fake and reference
implementations). Kernels for devices are registered by :mod:`moe_fx.lowering`.
"""

from moe_fx.ops.checks import KERNELS
from moe_fx.ops.experts import ACTIVATIONS, FP8_BLOCK, dequantize_blockwise, experts, experts_reference
from moe_fx.ops import ep  # noqa: F401  (registers moe_fx::ep_dispatch / masked_experts / ep_combine)

__all__ = ["ACTIVATIONS", "FP8_BLOCK", "KERNELS", "dequantize_blockwise", "experts", "experts_reference"]
