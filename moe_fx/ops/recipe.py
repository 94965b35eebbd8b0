"""The fp8 recipe moe_fx uses everywhere: its one home (ops, lowering and passes import it from here).

DeepSeek-V3 / transformers fine-grained FP8, as DeepGEMM and DeepEP read it:

* weights: float8_e4m3fn with one fp32 scale per 128x128 block, ``[E, ceil(N/128), ceil(K/128)]``;
* activations: float8_e4m3fn with one fp32 scale per 1x128 group of a row, ``[..., ceil(K/128)]``;
* ``scale = max(amax, FP8_SCALE_FLOOR) / FP8_E4M3_MAX`` (the floor keeps all-zero groups finite; it
  is DeepEP's and DeepGEMM's ``per_token_cast_to_fp8`` floor, so every path quantises alike).
"""

from __future__ import annotations

import torch

__all__ = ["FP8_BLOCK", "FP8_DTYPE", "FP8_E4M3_MAX", "FP8_SCALE_FLOOR", "cdiv"]

#: The fp8 storage dtype of weights and quantised activations.
FP8_DTYPE = torch.float8_e4m3fn
#: Block edge of the recipe: 128x128 weight blocks, 1x128 activation groups.
FP8_BLOCK = 128
#: Largest finite float8_e4m3fn value.
FP8_E4M3_MAX = 448.0
#: Floor of a group's (or block's) amax before it becomes a scale.
FP8_SCALE_FLOOR = 1e-4


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for non-negative ints (also SymInts: no guard is added)."""
    return (a + b - 1) // b
