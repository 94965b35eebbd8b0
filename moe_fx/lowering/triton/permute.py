"""The local (one GPU) permute into, and unpermute out of, the masked layout ``[E, max_m, H]`` + ``masked_m``.

Permute is one kernel (one program per token; rows claimed with device atomics), unpermute one kernel
(one program per token and column block, gathering the token's K rows): each reads and writes the
activations once. Nothing synchronises with the host, so both run under CUDA graphs and inside
compiled graphs. Ids outside ``[0, E)`` (``-1``, and the documented GPU rule for any other) send no
row; unpermute adds identity experts (ids in ``[E, E + identity_experts)``) as ``w * hidden``.

Rows per expert (``max_m``): with routing weights applied after the expert, a token naming one expert
several times sends one row (every such slot points at it), so ``max_m = T`` always suffices. With
weights on the input each slot needs its own row: ``max_m = T * K`` (Llama 4 routes with K = 1).
This is not the EP dispatch (``moe_fx::ep_dispatch``, :mod:`moe_fx.lowering.prepare_finalize`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_fx.lowering.triton._loader import is_traced, launch
from moe_fx.lowering.triton.grouped_gemm import _known_empty, _out, _pow2
from moe_fx.ops.recipe import FP8_BLOCK, FP8_DTYPE, cdiv

__all__ = ["MaskedBatch", "combine_block", "combine_rows", "copy_block", "masked_rows_needed", "permute_to_masked",
           "unpermute_from_masked"]


@dataclass
class MaskedBatch:
    """Tokens in the masked layout, and where each ``(token, k)`` slot went.

    Attributes:
        x: ``[E, max_m, H]`` hidden's dtype, or float8_e4m3fn when quantised.
        x_scale: fp32 ``[E, max_m, ceil(H/128)]`` 1x128 group scales (quantised only), else None.
        masked_m: ``[E]`` int32 rows per expert.
        slot_pos: ``[T * K]`` int64: ``e * max_m + row`` of each slot, -1 when it sent no row.
    """

    x: torch.Tensor
    x_scale: torch.Tensor | None
    masked_m: torch.Tensor
    slot_pos: torch.Tensor


def masked_rows_needed(num_tokens: object, top_k: int, weights_on_input: bool) -> object:
    """``max_m`` a permute needs so that no row is ever dropped (see the module docstring)."""
    return num_tokens * top_k if weights_on_input and top_k > 1 else num_tokens


def _check_routing(hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor | None) -> None:
    if hidden.dim() != 2:
        raise ValueError(f"permute_to_masked: hidden must be [T, H], got {list(hidden.shape)}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != hidden.shape[0] or topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"permute_to_masked: topk_ids must be int32/int64 [T={hidden.shape[0]}, K], got {topk_ids.dtype} "
            f"{list(topk_ids.shape)}"
        )
    if topk_weights is not None and tuple(topk_weights.shape) != tuple(topk_ids.shape):
        raise ValueError(
            f"permute_to_masked: topk_weights {list(topk_weights.shape)} must match topk_ids {list(topk_ids.shape)}"
        )


def copy_block(h: int, quant_fp8: bool) -> int:
    """Columns a step of the copies of a token into its rows (the masked permute, the contiguous layout's copy): up to
    1024 (1 KB of fp8 a row), with ``quant_fp8`` whole 1x128 groups (one group a step left DeepSeek-V3's 7168 columns
    56 steps)."""
    block = min(1024, _pow2(h))
    return max(FP8_BLOCK, block) if quant_fp8 else block


def permute_to_masked(
    hidden: torch.Tensor,
    topk_ids: torch.Tensor,
    num_experts: int,
    max_m: object,
    topk_weights: torch.Tensor | None = None,
    *,
    weights_on_input: bool = False,
    quant_fp8: bool = False,
    x_scale: torch.Tensor | None = None,
) -> MaskedBatch:
    """Scatter tokens into the masked layout, one row per (token, distinct chosen expert).

    Args:
        hidden: ``[T, H]`` activations (bf16/fp16/fp32).
        topk_ids: ``[T, K]`` int32/int64 expert ids; ids outside ``[0, E)`` send no row.
        num_experts: ``E``.
        max_m: rows per expert of the output (:func:`masked_rows_needed` or more; may be symbolic).
        topk_weights: ``[T, K]`` routing weights, needed only with ``weights_on_input``.
        weights_on_input: multiply each row by its routing weight (Llama 4 style); each slot then
            gets its own row (no merging of repeated ids).
        quant_fp8: quantise rows to fp8 with 1x128 group scales (written through ``x_scale``'s strides).
        x_scale: optional fp32 ``[E, max_m, ceil(H/128)]`` tensor of ANY strides for the scales (e.g.
            DeepGEMM's MN-major TMA-aligned layout, which then needs no copy).

    Returns:
        A :class:`MaskedBatch`. Row order inside an expert is not deterministic (atomics); what the
        rows hold is, and so is every result computed from them.
    """
    _check_routing(hidden, topk_ids, topk_weights)
    if weights_on_input and topk_weights is None:
        raise ValueError("permute_to_masked: weights_on_input=True needs topk_weights")
    if num_experts <= 0:
        raise ValueError(f"permute_to_masked: need num_experts > 0, got {num_experts}")
    t, h = hidden.shape
    k = topk_ids.shape[1]
    dev = hidden.device
    x = torch.empty(num_experts, max_m, h, dtype=FP8_DTYPE if quant_fp8 else hidden.dtype, device=dev)
    if quant_fp8:
        x_scale = _out("permute_to_masked: x_scale", x_scale, (num_experts, max_m, cdiv(h, FP8_BLOCK)),
                       torch.float32, dev)
    elif x_scale is not None:
        raise ValueError("permute_to_masked: x_scale given without quant_fp8")
    counts = torch.zeros(num_experts, dtype=torch.int32, device=dev)
    slot_pos = torch.empty(t * k, dtype=torch.int64, device=dev)
    if _known_empty(t, k):
        return MaskedBatch(x, x_scale, counts, slot_pos)
    # Unused pointers are None (a constexpr to Triton): nothing aliases what the kernel writes.
    w = topk_weights if weights_on_input else None
    w_strides = topk_weights.stride() if weights_on_input else (0, 0)
    xs = x_scale if quant_fp8 else None
    xs_strides = x_scale.stride() if quant_fp8 else (0, 0, 0)
    block_h = copy_block(h, quant_fp8)
    launch(
        "permute_kernel", dev, (t,),
        hidden, topk_ids, w, counts, x, xs, slot_pos,
        t, k, h, num_experts, max_m,
        *hidden.stride(), *topk_ids.stride(), *w_strides, *x.stride(), *xs_strides,
        K_POW2=max(2, _pow2(k)), BLOCK_H=block_h, WEIGHTS_ON_INPUT=weights_on_input,
        DEDUPE=not weights_on_input and k > 1, QUANT=quant_fp8, INTERP=dev.type == "cpu", num_warps=4,
    )  # fmt: skip
    return MaskedBatch(x, x_scale, counts, slot_pos)


#: the combine's grid at a static token count has at least this many programs where rows allow it (one per SM
#: of an H200): at T=1 a 2048-wide row in 1024-column blocks left 2 programs for the whole step
COMBINE_MIN_PROGRAMS = 132
#: the narrowest column block the combine takes to get there (8 rows x 128 columns per program at top-8)
COMBINE_MIN_BLOCK = 128


def combine_block(t: object, h: int) -> int:
    """Columns per program of the combine: 1024 (long rows stream well), halved for a static decode-sized token
    count until the grid has :data:`COMBINE_MIN_PROGRAMS` programs (T=1, H=2048: 16 programs of 128 columns
    instead of 2 of 1024). A symbolic T keeps 1024: its grid is a constant of the compiled graph."""
    block = min(1024, _pow2(h))
    if isinstance(t, int):
        while block > COMBINE_MIN_BLOCK and t * cdiv(h, block) < COMBINE_MIN_PROGRAMS:
            block //= 2
    return block


def unpermute_from_masked(
    y: torch.Tensor,
    slot_pos: torch.Tensor | None,
    topk_weights: torch.Tensor,
    *,
    weights_on_output: bool = True,
    topk_ids: torch.Tensor | None = None,
    hidden: torch.Tensor | None = None,
    num_experts: int = 0,
    identity_experts: int = 0,
    out_dtype: torch.dtype | None = None,
    slot_rows: bool = False,
    in_graph: bool = False,
) -> torch.Tensor:
    """Gather expert outputs back to tokens: ``out[t] = sum_k w[t, k] * y[row of (t, k)]`` in fp32.

    Args:
        y: ``[E, max_m, H]`` expert outputs (rows ``< masked_m[e]`` valid; any layout whose rows are
            addressed as ``e * max_m + r``, i.e. ``y.stride(0) == max_m * y.stride(1)``).
        slot_pos: ``[T * K]`` int64 from :func:`permute_to_masked`.
        topk_weights: ``[T, K]`` routing weights.
        weights_on_output: ``False`` sums rows unweighted (the weights were applied on the input).
        topk_ids, hidden, num_experts, identity_experts: for identity experts (ids in
            ``[E, E + identity_experts)``), which add ``w[t, k] * hidden[t]``.
        out_dtype: result dtype (default ``y.dtype``).
        slot_rows: the rows are in slot order (``grouped_gemm.SlotRows``): slot ``(t, k)``'s row is ``t * K + k``
            when ``0 <= topk_ids[t, k] < num_experts`` (``slot_pos`` is not read and may be None).
        in_graph: while Inductor traces the op, the same sum as torch ops (:func:`combine_rows`) for Inductor to
            fuse with what follows, instead of the kernel (``pipeline.combine_in_graph``); eager calls ignore it.

    Returns:
        ``[T, H]``; tokens with no valid expert get zeros.
    """
    if topk_weights.dim() != 2:
        raise ValueError(f"unpermute_from_masked: topk_weights must be [T, K], got {list(topk_weights.shape)}")
    t, k = topk_weights.shape
    if y.dim() != 3:
        raise ValueError(f"unpermute_from_masked: y must be [E, max_m, H], got {list(y.shape)}")
    h = y.shape[2]
    if slot_rows:
        if topk_ids is None or num_experts <= 0 or tuple(topk_ids.shape) != (t, k):
            raise ValueError(f"unpermute_from_masked: rows in slot order need topk_ids [{t}, {k}] and num_experts")
        slot_pos = topk_ids  # not read (SLOT_ROWS): a placeholder of the kernel's argument
    elif slot_pos is None or tuple(slot_pos.shape) != (t * k,):
        raise ValueError(f"unpermute_from_masked: slot_pos must have T*K = {t * k} entries, got "
                         f"{None if slot_pos is None else list(slot_pos.shape)}")
    identity = identity_experts > 0
    if identity and (topk_ids is None or hidden is None or num_experts <= 0):
        raise ValueError("unpermute_from_masked: identity experts need topk_ids, hidden and num_experts")
    if in_graph and is_traced(y):
        return combine_rows(y, None if slot_rows else slot_pos, topk_weights, topk_ids, num_experts,
                            weights_on_output=weights_on_output, hidden=hidden, identity_experts=identity_experts,
                            out_dtype=out_dtype or y.dtype)
    dev = y.device
    out = torch.empty(t, h, dtype=out_dtype or y.dtype, device=dev)
    if _known_empty(t, h):
        return out
    if y.stride(0) != y.shape[1] * y.stride(1):
        y = y.contiguous()  # rows are addressed as e * max_m + r
    ids = topk_ids if identity or slot_rows else None
    ids_strides = topk_ids.stride() if identity or slot_rows else (0, 0)
    hid = hidden if identity else None
    hid_strides = hidden.stride() if identity else (0, 0)
    block_h = combine_block(t, h)
    launch(
        "unpermute_kernel", dev, (t, cdiv(h, block_h)),
        y, slot_pos, topk_weights, out, ids, hid,
        k, h, num_experts, identity_experts,
        y.stride(1), y.stride(2), *topk_weights.stride(), *out.stride(), *ids_strides, *hid_strides,
        K_POW2=max(2, _pow2(k)), BLOCK_H=block_h, HAS_W=weights_on_output, IDENTITY=identity, SLOT_ROWS=slot_rows,
        num_warps=4,
    )  # fmt: skip
    return out


def combine_rows(
    y: torch.Tensor,
    slot_pos: torch.Tensor | None,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor | None,
    num_experts: int,
    *,
    weights_on_output: bool,
    hidden: torch.Tensor | None,
    identity_experts: int,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """What ``unpermute_kernel`` computes, as torch ops (for Inductor to fuse; ``in_graph`` of
    :func:`unpermute_from_masked`): ``out[t] = sum_k w[t, k] * y_row(t, k)`` in fp32 over the slots that have a row,
    plus ``w[t, k] * hidden[t]`` for identity experts (ids in ``[E, E + identity_experts)``). Rows of other slots
    are never used (unwritten memory). ``slot_pos`` (``[T * K]``, ``-1`` for no row) addresses ``y``'s rows as
    ``e * max_m + r``; None: ``y`` holds the ``T * K`` rows in slot order (``[1, T * K, H]``, as the sorted
    layout's GEMM2 writes them for one token) and a slot has its row when its id lies in ``[0, E)``. Returns ``[T, H]`` in
    ``out_dtype``."""
    t, k = topk_weights.shape
    h = y.shape[-1]
    if slot_pos is None:
        if topk_ids is None or y.dim() != 3 or y.shape[0] * y.shape[1] != t * k:
            raise ValueError(f"combine_rows: rows in slot order need topk_ids and the T*K = {t * k} slot rows, "
                             f"got y {list(y.shape)}")
        rows = y.reshape(t, k, h)
        has_row = (topk_ids >= 0) & (topk_ids < num_experts)
    else:
        # index_select rather than y[...]: either is an indirect load in Inductor's kernel, and index_select also
        # traces with fake CUDA tensors on a CPU-only torch (tests/test_lowered_graph.py)
        rows = y.reshape(-1, h).index_select(0, slot_pos.clamp_min(0)).view(t, k, h)
        has_row = slot_pos.view(t, k) >= 0
    terms = torch.where(has_row.unsqueeze(-1), rows.float(), 0.0)
    w = topk_weights.float()
    if weights_on_output:
        terms = terms * w.unsqueeze(-1)
    out = terms.sum(1)
    if identity_experts > 0:
        ident = (topk_ids >= num_experts) & (topk_ids < num_experts + identity_experts)
        out = out + torch.where(ident, w, 0.0).sum(1, keepdim=True) * hidden.float()
    return out.to(out_dtype)
