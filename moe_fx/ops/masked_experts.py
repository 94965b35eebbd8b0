"""The ``moe_fx::masked_experts`` op: expert MLPs on the masked ("batched") layout.

``masked_experts(x [E, M, H], masked_m [E], w13, w2, activation, x_scale, w13_scale, w2_scale,
expected_m, kernel_choice, *, w13_bias, w2_bias, gated, gate_up_layout, alpha, limit, up_offset) -> [E, M, H]``
runs expert ``e``'s MLP on the first ``masked_m[e]`` rows of ``x[e]`` (DeepGEMM's masked grouped-GEMM
contract; what DeepEP's low-latency dispatch and moe_fx's ``ep_dispatch`` return). The weights,
biases and activation arguments mean what they mean for ``moe_fx::experts`` (see
:mod:`moe_fx.ops.experts`): every expert form the experts op takes runs here too. ``x`` is float, or
float8_e4m3fn with fp32 1x128 scales ``x_scale [E, M, ceil(H/128)]`` (any strides). The result is in
``x.dtype`` (bf16 when ``x`` is fp8); rows past ``masked_m[e]`` are unspecified. ``expected_m`` is a
load hint for DeepGEMM's heuristics (0: unknown), ``kernel_choice`` the kernel choice for the lowering
(:data:`~moe_fx.ops.checks.KERNELS`).

This module holds the schema, the fake implementation and the fp32 reference (the oracle, and what
runs on a device the lowering has no kernel for); :mod:`moe_fx.lowering` registers the kernels.
"""

from __future__ import annotations

import torch

from moe_fx.ops.activation import ExpertActivation
from moe_fx.ops.checks import check_masked_experts
from moe_fx.ops.experts import expert_mlp_fp32
from moe_fx.ops.recipe import FP8_BLOCK, FP8_DTYPE
from moe_fx.ops.signature import binder

__all__ = [
    "bind_masked_experts",
    "dequantize_activations",
    "masked_experts",
    "masked_experts_reference",
    "masked_output_dtype",
    "masked_reference_of",
]

_SCHEMA = (
    "(Tensor x, Tensor masked_m, Tensor w13, Tensor w2, str activation='silu', Tensor? x_scale=None, "
    "Tensor? w13_scale=None, Tensor? w2_scale=None, SymInt expected_m=0, str kernel_choice='auto', *, "
    "Tensor? w13_bias=None, Tensor? w2_bias=None, bool gated=True, str gate_up_layout='halves', "
    "float alpha=1.0, float? limit=None, float up_offset=0.0) -> Tensor"
)
# torch.library.Library rather than custom_op: an eager call reaches the kernel straight from the C++
# dispatcher, without custom_op's Python wrappers. No autograd (inference only), like every moe_fx op.
_LIB = torch.library.Library("moe_fx", "FRAGMENT")
_LIB.define("masked_experts" + _SCHEMA)

#: ``masked_experts(...)``'s arguments by name (the op's one signature is its schema above).
bind_masked_experts = binder("moe_fx::masked_experts")
def masked_output_dtype(x: torch.Tensor) -> torch.dtype:
    """``masked_experts`` returns bf16 for fp8 tokens, else the tokens' dtype."""
    return torch.bfloat16 if x.dtype == FP8_DTYPE else x.dtype


def dequantize_activations(x: torch.Tensor, x_scale: torch.Tensor) -> torch.Tensor:
    """fp8 ``[..., H]`` with fp32 1x128 scales ``[..., ceil(H/128)]`` -> fp32 ``[..., H]``."""
    h = x.shape[-1]
    return x.float() * x_scale.float().repeat_interleave(FP8_BLOCK, dim=-1)[..., :h]


def masked_experts_reference(*args: object, **kwargs: object) -> torch.Tensor:
    """fp32 computation of ``masked_experts`` (the oracle): expert ``e`` on the first ``masked_m[e]`` rows of ``x[e]``.

    Takes the op's arguments (its schema; ``expected_m`` and ``kernel_choice`` are hints, ignored). Returns
    ``[E, M, H]`` in ``x.dtype`` (bf16 for fp8 ``x``); rows past ``masked_m[e]`` are zero. Reads
    ``masked_m`` on the host (one sync on a GPU).
    """
    return masked_reference_of(bind_masked_experts(*args, **kwargs))


def masked_reference_of(a: dict) -> torch.Tensor:
    """:func:`masked_experts_reference` on the op's bound arguments (:data:`bind_masked_experts`)."""
    x, masked_m, w13, w2, x_scale = a["x"], a["masked_m"], a["w13"], a["w2"], a["x_scale"]
    spec = ExpertActivation.of(a)
    e_local, m, h = x.shape
    out = torch.zeros(e_local, m, h, dtype=masked_output_dtype(x), device=x.device)
    for e, n in enumerate(masked_m.tolist()):
        if n < 0 or n > m:
            raise ValueError(f"moe_fx.masked_experts: masked_m[{e}] = {n} is outside [0, M={m}]")
        if n == 0:
            continue
        xe = x[e, :n]
        xe = dequantize_activations(xe, x_scale[e, :n]) if x.dtype == FP8_DTYPE else xe.float()
        y = expert_mlp_fp32(xe, e, w13, w2, spec, a["w13_scale"], a["w2_scale"], a["w13_bias"], a["w2_bias"])
        out[e, :n] = y.to(out.dtype)
    return out


def _masked_experts_default(*args: object, **kwargs: object) -> torch.Tensor:
    """Implementation on devices without a kernel of the lowering: checks, then the reference."""
    a = bind_masked_experts(*args, **kwargs)
    check_masked_experts(a)
    return masked_reference_of(a)


_LIB.impl("masked_experts", _masked_experts_default, "CompositeExplicitAutograd")

#: The op: ``torch.ops.moe_fx.masked_experts`` (see the module docstring).
masked_experts = torch.ops.moe_fx.masked_experts


@torch.library.register_fake("moe_fx::masked_experts")
def _masked_experts_fake(*args: object, **kwargs: object) -> torch.Tensor:
    a = bind_masked_experts(*args, **kwargs)
    check_masked_experts(a)
    return a["x"].new_empty(a["x"].shape, dtype=masked_output_dtype(a["x"]))
