"""The ``moe_fx::experts`` op: the expert part of an MoE block, from routed tokens to combined output.

Contract (shapes use T tokens, K top-k, E experts, H hidden, I intermediate):

* ``hidden``        ``[T, H]`` float32 / bfloat16 / float16.
* ``topk_ids``      ``[T, K]`` int32 or int64; ``-1`` means "no expert" (that slot contributes nothing).
* ``topk_weights``  ``[T, K]`` floating point (any float dtype; fp32 routing weights are common).
* ``w13``           ``[E, 2I, H]``: gate rows first, then up rows. Same dtype as ``hidden``, or
                    ``float8_e4m3fn`` with ``w13_scale``.
* ``w2``            ``[E, H, I]``. Same dtype rules as ``w13``.
* ``activation``    name of the gated activation, a key of :data:`ACTIVATIONS` (``"silu"`` = SwiGLU).
* ``weights_on_input``  ``False``: ``out = sum_k w_k * expert_k(x)`` (usual).
                    ``True``: ``out = sum_k expert_k(w_k * x)`` (Llama 4 style).
* ``w13_scale``, ``w2_scale``  fp32 block scales ``[E, ceil(N/128), ceil(K/128)]`` for fp8 weights
                    (128x128 blocks, DeepSeek/transformers fine-grained FP8 recipe); ``None`` otherwise.
* ``impl``          kernel request passed to the lowering (``"auto"``, ``"reference"``, ``"triton"``,
                    ``"deepgemm"``); the reference implementation ignores it.

Returns ``[T, H]`` in ``hidden.dtype``.

This module holds the schema, the fake (meta) implementation and the reference implementation only;
kernels are registered by :mod:`moe_fx.lowering`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from moe_fx.ops.checks import check_experts_inputs

__all__ = ["ACTIVATIONS", "FP8_BLOCK", "experts", "experts_reference", "dequantize_blockwise"]

#: Gated activations the op understands: ``act(gate) * up``.
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
}

#: Block edge of the fp8 weight-scale recipe (128x128 weight blocks, 1x128 activation groups).
FP8_BLOCK = 128


def dequantize_blockwise(w: torch.Tensor, scale: torch.Tensor, block: int = FP8_BLOCK) -> torch.Tensor:
    """Dequantise fp8 weights ``[E, N, K]`` with block scales ``[E, ceil(N/b), ceil(K/b)]`` to fp32."""
    n, k = w.shape[-2], w.shape[-1]
    s = scale.float().repeat_interleave(block, dim=-2)[..., :n, :]
    s = s.repeat_interleave(block, dim=-1)[..., :k]
    return w.float() * s


def _expert_weights_fp32(w: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    return w.float() if scale is None else dequantize_blockwise(w, scale)


def experts_reference(
    hidden: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    activation: str = "silu",
    weights_on_input: bool = False,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Straightforward fp32 computation of the experts op; the oracle every kernel is tested against.

    Loops over experts with tokens; correct on any device, for T = 0, ``-1`` ids and empty experts.
    """
    t, h = hidden.shape
    out = torch.zeros(t, h, dtype=torch.float32, device=hidden.device)
    if t == 0:
        return out.to(hidden.dtype)
    act = ACTIVATIONS[activation]
    num_experts = w13.shape[0]
    inter = w2.shape[-1]
    x32 = hidden.float()
    ids = topk_ids.long()
    rw = topk_weights.float()
    for e in range(num_experts):
        tok, slot = torch.nonzero(ids == e, as_tuple=True)
        if tok.numel() == 0:
            continue
        w13_e = _expert_weights_fp32(w13[e], None if w13_scale is None else w13_scale[e])
        w2_e = _expert_weights_fp32(w2[e], None if w2_scale is None else w2_scale[e])
        x = x32[tok]
        r = rw[tok, slot].unsqueeze(-1)
        if weights_on_input:
            x = x * r
        gate_up = x @ w13_e.t()
        y = (act(gate_up[:, :inter]) * gate_up[:, inter:]) @ w2_e.t()
        if not weights_on_input:
            y = y * r
        out.index_add_(0, tok, y)
    return out.to(hidden.dtype)


# The schema keeps room for later recipes (fp8 scales) and kernel requests without changing its
# positional prefix; expert parallelism adds separate dispatch / combine ops instead of arguments.
_SCHEMA = (
    "(Tensor hidden, Tensor topk_ids, Tensor topk_weights, Tensor w13, Tensor w2, "
    "str activation='silu', bool weights_on_input=False, Tensor? w13_scale=None, "
    "Tensor? w2_scale=None, str impl='auto') -> Tensor"
)


@torch.library.custom_op("moe_fx::experts", mutates_args=(), schema=_SCHEMA)
def experts(
    hidden: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    activation: str = "silu",
    weights_on_input: bool = False,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    impl: str = "auto",
) -> torch.Tensor:
    """Run the experts of one MoE block: ``[T, H]`` tokens routed by ``topk_ids`` / ``topk_weights``.

    See the module docstring for the full contract. The default (CPU and any device without a
    registered kernel) implementation is :func:`experts_reference`.
    """
    check_experts_inputs(hidden, topk_ids, topk_weights, w13, w2, activation, w13_scale, w2_scale, impl)
    return experts_reference(
        hidden, topk_ids, topk_weights, w13, w2, activation, weights_on_input, w13_scale, w2_scale
    )


@experts.register_fake
def _experts_fake(
    hidden: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    activation: str = "silu",
    weights_on_input: bool = False,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    impl: str = "auto",
) -> torch.Tensor:
    check_experts_inputs(hidden, topk_ids, topk_weights, w13, w2, activation, w13_scale, w2_scale, impl)
    return hidden.new_empty(hidden.shape)
