"""The decode path (measured, not chosen): each (token, k) slot runs its expert's whole MLP, sliced along
I, in one kernel, and one small kernel combines.

At decode sizes the sorted layout spends a third of a layer's time around its GEMMs (Qwen3-30B-A3B,
T=1, H200: a sort, a combine and the gaps between four launches, ~17 of 42 µs:
bench/results/kernel_breakdown_2026-12-03.md). Here one program per (slot, slice of ``BLOCK_I``
intermediate columns) streams the expert's GEMM1 rows of its slice (gate and up), applies the
activation in registers, then streams GEMM2's matching columns and writes an fp32 partial ``[H]``;
the combine sums each token's partials with the routing weights (and the biases and identity
experts). Two launches, no sort, no layout buffer; ``[T * K, I / BLOCK_I, H]`` fp32 partials. Every
slot reads its expert's weights itself (two slots on one expert read them twice).

Measured on the H200 (bench/decode_path.py; bench/results/decode_path_2026-12-03*.md) it is slower
than the sorted layout in every cell: as multiply-and-reduce GEMVs 1.3-6.6x (the loads do not
pipeline), as MMAs on 16-column tiles (``use_dot``, the default here) 1.09-1.42x at T = 1 and 4
(Qwen3 T=1 48.7 vs 42.3 µs, Mixtral 257 vs 187 µs). The lowering therefore never picks it; the
module stays for the benchmark and as the start of a decode kernel (next: several slots of one
expert per program; programmatic dependent launch between the two kernels is not available to user
kernels that Inductor launches: docs/triton.md).

FP8 weights (128x128 block scales) are dequantised in registers: the tokens and the activation stay
in their dtype and fp32 (no 1x128 quantisation of the activations, unlike the fp8 GEMMs; 1e-5 against
the reference where the fp8 GEMMs give 4e-2).
"""

from __future__ import annotations

import torch

from moe_fx.lowering.triton._loader import launch
from moe_fx.lowering.triton.act_args import epilogue_args
from moe_fx.lowering.triton.grouped_gemm import _known_empty, _out, _pow2
from moe_fx.ops import ExpertActivation
from moe_fx.ops.recipe import FP8_BLOCK, FP8_DTYPE, cdiv

__all__ = ["DEFAULT_BLOCK_I", "decode_experts"]

#: slice width by weight kind (fp8?): the widest that fits (128 was the fastest in every cell measured;
#: fp8's dequantised 128-wide tiles exceed the shared memory of an H200)
DEFAULT_BLOCK_I = {False: 128, True: 64}


def decode_experts(
    hidden: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    spec: ExpertActivation,
    *,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    weights_on_input: bool = False,
    identity_experts: int = 0,
    block_i: int | None = None,
    block_k: int = 128,
    block_h: int = 256,
    use_dot: bool = True,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``moe_fx::experts`` for a decode-sized step: ``[T, H]`` in ``hidden.dtype``.

    Args: as the op's (``w13 [E, N1, H]``, ``w2 [E, H, I]``, any strides; fp8 weights with their
    ``[E, ceil(N/128), ceil(K/128)]`` fp32 scales). ``block_i`` (default :data:`DEFAULT_BLOCK_I`),
    ``block_k`` (GEMM1's step over H; at most 128 and a divisor of it with fp8 weights) and ``block_h``
    (GEMM2's chunk of H) are powers of two. ``use_dot``: the products as tensor-core MMAs on 16-column
    tiles (the slot in column 0), else fp32 multiply-and-reduce GEMVs (see the kernel). ``out``: a ``[T, H]``
    tensor of ``hidden``'s dtype to write.
    """
    act = epilogue_args(spec, "decode_experts")  # the activation's kernel arguments (raises for a bad spec)
    del act["ACT_FUSED"]  # a GEMM epilogue's switch: this kernel always applies the activation
    if hidden.dim() != 2 or topk_ids.dim() != 2 or topk_weights.shape != topk_ids.shape:
        raise ValueError(f"decode_experts: want hidden [T, H], ids and weights [T, K], got {list(hidden.shape)}, "
                         f"{list(topk_ids.shape)}, {list(topk_weights.shape)}")
    fp8 = w13.dtype == FP8_DTYPE
    if fp8 != (w2.dtype == FP8_DTYPE) or fp8 != (w13_scale is not None) or fp8 != (w2_scale is not None):
        raise ValueError("decode_experts: fp8 weights need both w13 and w2 in fp8, each with its block scales")
    for name, b in (("block_k", block_k), ("block_h", block_h)) + ((("block_i", block_i),) if block_i else ()):
        if b < 16 or b & (b - 1):
            raise ValueError(f"decode_experts: {name} must be a power of two >= 16, got {b}")
    if fp8 and FP8_BLOCK % block_k:
        raise ValueError(f"decode_experts: fp8 weights need block_k dividing {FP8_BLOCK}, got {block_k}")
    t, k = topk_ids.shape
    e, n1, h = w13.shape
    inter = w2.shape[2]
    if n1 != (2 * inter if spec.gated else inter) or w2.shape[:2] != (e, h) or hidden.shape[1] != h:
        raise ValueError(f"decode_experts: w13 {list(w13.shape)} and w2 {list(w2.shape)} do not fit hidden "
                         f"{list(hidden.shape)} ({'gated' if spec.gated else 'not gated'})")
    out = _out("decode_experts", out, (t, h), hidden.dtype, hidden.device)
    if _known_empty(t, k):
        return out.zero_()
    block_i = block_i or DEFAULT_BLOCK_I[fp8]
    slices = cdiv(inter, block_i)
    part = torch.empty(t * k, slices, h, dtype=torch.float32, device=hidden.device)
    dummy = hidden  # never read: the pointer of an absent optional tensor
    s13, s2 = (w13_scale, w2_scale) if fp8 else (dummy.new_empty(1, 1, 1, dtype=torch.float32),) * 2
    b13 = w13_bias if w13_bias is not None else dummy.new_empty(1, 1)
    launch("decode_experts_kernel", hidden.device, (t * k, slices),
           hidden, topk_ids, topk_weights, w13, w2, s13, s2, b13, part, h, inter, e, slices,
           *hidden.stride(), *topk_ids.stride(), *topk_weights.stride(), *w13.stride(), *w2.stride(),
           *s13.stride(), *s2.stride(), *b13.stride(), **act,
           TOPK=int(k), BLOCK_I=block_i, BLOCK_K=block_k, BLOCK_H=block_h,
           HAS_BIAS=w13_bias is not None, ROUTE_ON_INPUT=weights_on_input, FP8=fp8,
           INTERP=hidden.device.type == "cpu", USE_DOT=use_dot,
           IEEE=w13.dtype == torch.float32, num_warps=4)
    b2 = w2_bias if w2_bias is not None else dummy.new_empty(1, 1)
    combine_h = min(1024, max(16, _pow2(h)))
    launch("decode_combine_kernel", hidden.device, (t, cdiv(h, combine_h)),
           part, topk_ids, topk_weights, hidden, b2, out, h, e, int(identity_experts), slices,
           *topk_ids.stride(), *topk_weights.stride(), *hidden.stride(), *b2.stride(), *out.stride(),
           TOPK=int(k), BLOCK_H=combine_h, HAS_W=not weights_on_input, HAS_BIAS=w2_bias is not None,
           IDENTITY=identity_experts > 0, num_warps=4)
    return out
