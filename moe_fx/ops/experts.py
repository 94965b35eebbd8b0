"""The ``moe_fx::experts`` op: the expert part of an MoE block, from routed tokens to combined output.

Contract (shapes use T tokens, K top-k, E experts, H hidden, I intermediate; ``N1 = 2I`` for gated
experts, ``I`` for non-gated ones):

* ``hidden``        ``[T, H]`` float32 / bfloat16 / float16.
* ``topk_ids``      ``[T, K]`` int32 or int64. ``0 <= id < E`` an expert; ``E <= id < E +
                    identity_experts`` an identity (zero-computation) expert whose output is its input.
                    Any other id (``-1`` "no expert", ``id < -1``, ``id >= E + identity_experts``)
                    names no expert: that slot contributes nothing, on every device (the reference,
                    the Triton and DeepGEMM pipelines alike), as a model's own ``for e in range(E)``
                    loop skips it; ids are data, so this costs no check and no host sync. A token may
                    name an expert more than once (each slot counts); K may exceed E.
* ``topk_weights``  ``[T, K]`` floating point (any float dtype; fp32 routing weights are common).
* ``w13``           ``[E, N1, H]``: the first GEMM. Gated: gate and up rows, either as two halves
                    (``gate_up_layout="halves"``: gate rows ``[0, I)``, up rows ``[I, 2I)``) or interleaved
                    (``"interleaved"``: gate at even rows, up at odd rows, GPT-OSS). Any strides (a
                    transposed view of a model's ``[E, H, N1]`` weight is taken as is, never copied).
                    Same dtype as ``hidden``, or ``float8_e4m3fn`` with ``w13_scale``.
* ``w2``            ``[E, H, I]``. Same dtype rules as ``w13``.
* ``activation``    a key of :data:`ACTIVATIONS`. Gated: ``act(gate) * (up + up_offset)``; non-gated
                    (``gated=False``): ``act(h)``. ``alpha`` scales the sigmoid argument of ``"silu"``
                    (``g * sigmoid(alpha * g)``; GPT-OSS uses 1.702) and must be 1 for the others.
                    ``limit`` clamps before the activation: ``gate <= limit``, ``-limit <= up <= limit``
                    (non-gated: ``-limit <= h <= limit``).
* ``weights_on_input``  ``False``: ``out = sum_k w_k * expert_k(x)`` (usual).
                    ``True``: ``out = sum_k expert_k(w_k * x)`` (Llama 4 style).
* ``w13_scale``, ``w2_scale``  fp32 block scales ``[E, ceil(N/128), ceil(K/128)]`` for fp8 weights
                    (128x128 blocks, DeepSeek/transformers fine-grained FP8 recipe); ``None`` otherwise.
* ``w13_bias``      ``[E, N1]`` (rows in ``w13``'s order) added to the first GEMM's output;
  ``w2_bias``       ``[E, H]`` added to the expert's output (before its routing weight). Float, or None.
* ``kernel_choice`` the kernel choice passed to the lowering (``MoEConfig.kernel``): ``"auto"`` or a
                    name of :data:`~moe_fx.ops.checks.KERNELS` (``"reference"``, ``"triton"``, ``"deepgemm"``;
                    why the argument is not called ``kernel``: there); the reference ignores it.

Returns ``[T, H]`` in ``hidden.dtype``. ``T = 0`` is allowed.

This module holds the schema, the fake (meta) implementation and the reference implementation only;
kernels are registered by :mod:`moe_fx.lowering`. The schema string is the op's one signature: every
implementation, the checks (:func:`~moe_fx.ops.checks.check_experts`) and the reference take the op's
arguments bound by name from it (:data:`bind_experts`, :mod:`moe_fx.ops.signature`).
"""

from __future__ import annotations

import torch

from moe_fx.ops.activation import ACTIVATIONS, GATE_UP_LAYOUTS, ExpertActivation
from moe_fx.ops.checks import check_experts
from moe_fx.ops.recipe import FP8_BLOCK
from moe_fx.ops.signature import binder

__all__ = [
    "ACTIVATIONS",
    "GATE_UP_LAYOUTS",
    "ExpertActivation",
    "bind_experts",
    "dequantize_blockwise",
    "expert_mlp_fp32",
    "experts",
    "experts_reference",
    "reference_of",
]

def dequantize_blockwise(w: torch.Tensor, scale: torch.Tensor, block: int = FP8_BLOCK) -> torch.Tensor:
    """Dequantise fp8 weights ``[E, N, K]`` with block scales ``[E, ceil(N/b), ceil(K/b)]`` to fp32."""
    n, k = w.shape[-2], w.shape[-1]
    s = scale.float().repeat_interleave(block, dim=-2)[..., :n, :]
    s = s.repeat_interleave(block, dim=-1)[..., :k]
    return w.float() * s


def _expert_weights_fp32(w: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    return w.float() if scale is None else dequantize_blockwise(w, scale)


def expert_mlp_fp32(
    x: torch.Tensor,
    e: int,
    w13: torch.Tensor,
    w2: torch.Tensor,
    spec: ExpertActivation,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Expert ``e``'s MLP in fp32 on fp32 rows ``x [n, H]`` -> ``[n, H]`` (the references' one copy of it)."""
    w13_e = _expert_weights_fp32(w13[e], None if w13_scale is None else w13_scale[e])
    w2_e = _expert_weights_fp32(w2[e], None if w2_scale is None else w2_scale[e])
    h1 = x @ w13_e.t()
    if w13_bias is not None:
        h1 = h1 + w13_bias[e].float()
    y = spec.apply(h1) @ w2_e.t()
    if w2_bias is not None:
        y = y + w2_bias[e].float()
    return y


def experts_reference(*args: object, **kwargs: object) -> torch.Tensor:
    """Straightforward fp32 computation of the experts op; the oracle every kernel is tested against.

    Takes the op's arguments (its schema, positional or by name; ``kernel_choice`` is ignored). Loops over experts
    with tokens; correct on any device, for T = 0, duplicate ids and empty experts. A slot whose id names
    no expert or identity expert (``-1``, or any id outside ``[0, E + identity_experts)``) contributes
    nothing (see the module docstring). An ambient ``torch.autocast`` does not change it (the op computes
    in its inputs' dtypes).
    """
    return reference_of(bind_experts(*args, **kwargs))


def reference_of(a: dict) -> torch.Tensor:
    """:func:`experts_reference` on the op's bound arguments (:data:`bind_experts`)."""
    hidden = a["hidden"]
    device_type = hidden.device.type
    if device_type in ("cpu", "cuda") and torch.is_autocast_enabled(device_type):
        with torch.autocast(device_type, enabled=False):
            return reference_of(a)
    topk_ids, topk_weights, w13, w2 = a["topk_ids"], a["topk_weights"], a["w13"], a["w2"]
    w13_scale, w2_scale, w13_bias, w2_bias = a["w13_scale"], a["w2_scale"], a["w13_bias"], a["w2_bias"]
    weights_on_input, identity_experts = a["weights_on_input"], a["identity_experts"]
    spec = ExpertActivation.of(a)
    t, h = hidden.shape
    num_experts = w13.shape[0]
    out = torch.zeros(t, h, dtype=torch.float32, device=hidden.device)
    if t == 0:
        return out.to(hidden.dtype)
    x32 = hidden.float()
    ids = topk_ids.long()
    rw = topk_weights.float()
    for e in range(num_experts + identity_experts):
        tok, slot = torch.nonzero(ids == e, as_tuple=True)
        if tok.numel() == 0:
            continue
        x = x32[tok]
        r = rw[tok, slot].unsqueeze(-1)
        if weights_on_input:
            x = x * r
        if e >= num_experts:
            y = x  # identity (zero-computation) expert
        else:
            y = expert_mlp_fp32(x, e, w13, w2, spec, w13_scale, w2_scale, w13_bias, w2_bias)
        if not weights_on_input:
            y = y * r
        out.index_add_(0, tok, y)
    return out.to(hidden.dtype)


# The positional prefix is the one of earlier releases; arguments added since are keyword-only.
# Expert parallelism adds separate dispatch / combine ops instead of arguments.
_SCHEMA = (
    "(Tensor hidden, Tensor topk_ids, Tensor topk_weights, Tensor w13, Tensor w2, "
    "str activation='silu', bool weights_on_input=False, Tensor? w13_scale=None, "
    "Tensor? w2_scale=None, str kernel_choice='auto', *, Tensor? w13_bias=None, Tensor? w2_bias=None, "
    "bool gated=True, str gate_up_layout='halves', float alpha=1.0, float? limit=None, "
    "float up_offset=0.0, int identity_experts=0) -> Tensor"
)

# Defined with torch.library.Library, not custom_op: an eager call reaches the kernel straight from
# the C++ dispatcher, without custom_op's Python wrapper (measured at ~half of a decode-sized call's
# host time). No autograd: moe_fx rewrites inference graphs only.
_LIB = torch.library.Library("moe_fx", "FRAGMENT")
_LIB.define("experts" + _SCHEMA)


#: ``experts(...)``'s arguments by name (the op's one signature is its schema above).
bind_experts = binder("moe_fx::experts")


def _experts_default(*args: object, **kwargs: object) -> torch.Tensor:
    """Default implementation of ``moe_fx::experts`` (any device without a kernel of the lowering): the reference."""
    a = bind_experts(*args, **kwargs)
    check_experts(a)
    return reference_of(a)


_LIB.impl("experts", _experts_default, "CompositeExplicitAutograd")

#: The op itself: ``moe_fx.ops.experts(hidden, topk_ids, topk_weights, w13, w2, ...)`` runs on any
#: device (CPU: the reference; CUDA: the kernels :mod:`moe_fx.lowering` registers).
experts = torch.ops.moe_fx.experts


@torch.library.register_fake("moe_fx::experts")
def _experts_fake(*args: object, **kwargs: object) -> torch.Tensor:
    a = bind_experts(*args, **kwargs)
    check_experts(a)
    return a["hidden"].new_empty(a["hidden"].shape)
