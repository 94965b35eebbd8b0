"""Local (one GPU) dispatch to and combine from the masked layout ``[E, max_m, H]`` + ``masked_m [E]``.

Dispatch is one kernel (one program per token; rows claimed with device atomics), combine one
kernel (one program per token and column block, gathering the token's K rows): each reads and
writes the activations once. Nothing synchronises with the host, so both run under CUDA graphs.
``-1`` ids (and any id outside ``[0, E)``) are skipped. Rows beyond ``max_m`` are dropped; with
``max_m = T`` (what :func:`moe_fx.lowering.experts.triton_experts.triton_experts` uses) that never
happens while each token names an expert at most once, as top-k routing guarantees.
"""

from __future__ import annotations

import torch

from moe_fx.lowering.triton._loader import kernels
from moe_fx.lowering.triton.grouped_gemm import _check_masked, _out, _pow2

__all__ = ["dispatch_rows", "local_combine", "local_dispatch"]

_GROUP = 128


def _check_routing(hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor | None) -> None:
    if hidden.dim() != 2:
        raise ValueError(f"local_dispatch: hidden must be [T, H], got {list(hidden.shape)}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != hidden.shape[0] or topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"local_dispatch: topk_ids must be int32/int64 [T={hidden.shape[0]}, K], got {topk_ids.dtype} "
            f"{list(topk_ids.shape)}"
        )
    if topk_weights is not None and tuple(topk_weights.shape) != tuple(topk_ids.shape):
        raise ValueError(
            f"local_dispatch: topk_weights {list(topk_weights.shape)} must match topk_ids {list(topk_ids.shape)}"
        )


def dispatch_rows(
    hidden: torch.Tensor,
    topk_ids: torch.Tensor,
    num_experts: int,
    max_m: int,
    topk_weights: torch.Tensor | None = None,
    weights_on_input: bool = False,
    quant_fp8: bool = False,
    *,
    with_slot_index: bool = True,
    clamp: bool = True,
    x_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Dispatch, also returning each slot's row: the form :func:`triton_experts` uses.

    Returns ``(x, x_scale, masked_m, slot_index, slot_pos)``: ``x [E, max_m, H]`` (hidden's dtype,
    or float8_e4m3fn with ``quant_fp8``), ``x_scale`` fp32 ``[E, max_m, ceil(H/128)]`` 1x128 group
    scales (None without ``quant_fp8``), ``masked_m [E]`` int32, ``slot_index [E, max_m]`` int32
    (``t * K + k``, -1 unused; None with ``with_slot_index=False``), ``slot_pos [T * K]`` int64
    (``e * max_m + row``, -1 skipped).

    ``with_slot_index=False`` and ``clamp=False`` save two small launches on the decode path (host
    overhead dominates there without CUDA graphs): the combine only needs ``slot_pos``, and moe_fx's
    own kernels clamp ``masked_m`` to ``max_m`` themselves (unclamped counts exceed ``max_m`` only
    when a token names one expert several times and an expert then gets more than ``max_m`` rows).
    ``x_scale`` (with ``quant_fp8``): a float32 ``[E, max_m, ceil(H/128)]`` tensor of ANY strides to
    write the scales into, e.g. DeepGEMM's MN-major TMA-aligned layout, which then needs no copy.
    """
    _check_routing(hidden, topk_ids, topk_weights)
    if weights_on_input and topk_weights is None:
        raise ValueError("local_dispatch: weights_on_input=True needs topk_weights")
    if num_experts <= 0 or max_m < 0:
        raise ValueError(f"local_dispatch: need num_experts > 0 and max_m >= 0, got {num_experts} and {max_m}")
    t, h = hidden.shape
    k = topk_ids.shape[1]
    dev = hidden.device
    x = torch.empty(num_experts, max_m, h, dtype=torch.float8_e4m3fn if quant_fp8 else hidden.dtype, device=dev)
    if quant_fp8:
        x_scale = _out("local_dispatch: x_scale", x_scale, (num_experts, max_m, -(-h // _GROUP)), torch.float32, dev)
    else:
        x_scale = None
    counts = torch.zeros(num_experts, dtype=torch.int32, device=dev)
    if with_slot_index:
        slot_index = torch.full((num_experts, max_m), -1, dtype=torch.int32, device=dev)
    else:
        slot_index = None
    slot_pos = torch.empty(t * k, dtype=torch.int64, device=dev)
    if t and k and max_m:
        w = topk_weights if weights_on_input else hidden  # any tensor: unused when not weights_on_input
        w_strides = topk_weights.stride() if weights_on_input else (0, 0)
        xs = x_scale if quant_fp8 else x
        xs_strides = x_scale.stride() if quant_fp8 else (0, 0, 0)
        block_h = _GROUP if quant_fp8 else min(1024, _pow2(h))
        kernels(dev).dispatch_kernel[(t,)](
            hidden, topk_ids, w, counts, x, xs, slot_index if with_slot_index else counts, slot_pos,
            t, k, h, num_experts, max_m,
            *hidden.stride(), *topk_ids.stride(), *w_strides, *x.stride(), *xs_strides,
            K_POW2=max(2, _pow2(k)), BLOCK_H=block_h, WEIGHTS_ON_INPUT=weights_on_input, QUANT=quant_fp8,
            STORE_SLOT=with_slot_index,
            INTERP=dev.type == "cpu", num_warps=4,
        )  # fmt: skip
    elif t and k:
        slot_pos.fill_(-1)
    masked_m = counts.clamp_(max=max_m) if clamp else counts
    return x, x_scale, masked_m, slot_index, slot_pos


def local_dispatch(
    hidden: torch.Tensor,
    topk_ids: torch.Tensor,
    num_experts: int,
    max_m: int,
    topk_weights: torch.Tensor | None = None,
    weights_on_input: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Scatter tokens into the masked layout, one row per (token, chosen expert).

    Args:
        hidden: ``[T, H]`` activations (bf16/fp16/fp32).
        topk_ids: ``[T, K]`` int32/int64 expert ids; ``-1`` (or any id outside ``[0, E)``) skipped.
        num_experts: ``E``.
        max_m: rows per expert in the output (a static bound; ``T`` suffices for distinct ids).
        topk_weights: ``[T, K]`` routing weights, needed only with ``weights_on_input``.
        weights_on_input: multiply each row by its routing weight (Llama 4 style).

    Returns:
        ``(x [E, max_m, H], masked_m [E] int32, slot_index [E, max_m] int32)`` where row ``r`` of
        expert ``e`` holds token ``slot_index[e, r] // K`` (slot ``t * K + k``) for ``r < masked_m[e]``;
        unused rows of ``slot_index`` are -1, unused rows of ``x`` are unwritten. The row order
        inside an expert is not deterministic (atomics); what the rows hold is.
    """
    x, _, masked_m, slot_index, _ = dispatch_rows(hidden, topk_ids, num_experts, max_m, topk_weights, weights_on_input)
    return x, masked_m, slot_index


def local_combine(
    y: torch.Tensor,
    slot_index: torch.Tensor | None,
    masked_m: torch.Tensor,
    topk_weights: torch.Tensor | None,
    num_tokens: int,
    *,
    slot_pos: torch.Tensor | None = None,
) -> torch.Tensor:
    """Gather expert outputs back to tokens: ``out[t] = sum_k w[t, k] * y[row of (t, k)]`` in fp32.

    Args:
        y: ``[E, max_m, H]`` expert outputs (rows ``< masked_m[e]`` valid).
        slot_index: ``[E, max_m]`` int32 from :func:`local_dispatch` (may be None when ``slot_pos`` is given).
        masked_m: ``[E]`` int32.
        topk_weights: ``[T, K]`` routing weights, or None to sum unweighted (weights applied on input).
        num_tokens: ``T``.
        slot_pos: optional ``[T * K]`` int64 rows per slot (from :func:`dispatch_rows`); saves the
            pass that inverts ``slot_index``.

    Returns:
        ``[T, H]`` in ``y.dtype``; tokens with no valid expert get zeros.
    """
    if slot_index is None and slot_pos is None:
        raise ValueError("local_combine: pass slot_index or slot_pos")
    if y.dim() != 3 or (slot_index is not None and slot_index.shape != y.shape[:2]):
        raise ValueError(
            f"local_combine: y [E, max_m, H] and slot_index [E, max_m] disagree: {list(y.shape)}, {list(slot_index.shape)}"
        )
    e, max_m, h = y.shape
    _check_masked("local_combine", masked_m, e, y.device)
    if topk_weights is not None:
        if topk_weights.dim() != 2 or topk_weights.shape[0] != num_tokens:
            raise ValueError(f"local_combine: topk_weights must be [T={num_tokens}, K], got {list(topk_weights.shape)}")
        k = topk_weights.shape[1]
    elif slot_pos is not None:
        k = slot_pos.numel() // max(num_tokens, 1)
    else:
        raise ValueError("local_combine: without topk_weights, pass slot_pos (K cannot be inferred)")
    dev = y.device
    out = torch.empty(num_tokens, h, dtype=y.dtype, device=dev)
    if num_tokens == 0 or h == 0:
        return out
    kern = kernels(dev)
    if slot_pos is None:
        slot_pos = torch.full((num_tokens * k,), -1, dtype=torch.int64, device=dev)
        if e and max_m:
            block = 128
            kern.invert_slots_kernel[(-(-max_m // block), e)](
                slot_index.contiguous(), masked_m, slot_pos, max_m, num_tokens * k, BLOCK=block
            )
    if slot_pos.numel() != num_tokens * k:
        raise ValueError(f"local_combine: slot_pos must have T*K = {num_tokens * k} entries, got {slot_pos.numel()}")
    if y.stride(0) != max_m * y.stride(1):
        y = y.contiguous()  # rows are addressed as e * max_m + r
    w = topk_weights if topk_weights is not None else out
    w_strides = topk_weights.stride() if topk_weights is not None else (0, 0)
    block_h = min(1024, _pow2(h))
    kern.combine_kernel[(num_tokens, -(-h // block_h))](
        y, slot_pos, w, out,
        k, h,
        y.stride(1), y.stride(2), *w_strides, *out.stride(),
        K_POW2=max(2, _pow2(k)), BLOCK_H=block_h, HAS_W=topk_weights is not None,
        num_warps=4,
    )  # fmt: skip
    return out
