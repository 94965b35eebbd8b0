"""The contiguous ("sorted") layout on one GPU: every (token, k) slot gets a row, rows grouped by expert.

vLLM's "standard" experts format, without its block padding: the GEMMs walk each expert's rows in
tiles from the counts (as the masked kernels do), so no row is padded and no ``[E, max_m, H]`` buffer
exists. Two kernels (:func:`sort_by_expert`): a histogram of the expert ids, then each slot's row
``start[e] + rank``. GEMM1 then reads the tokens where they are (through ``sorted_slots``), GEMM2
writes the sorted rows, and the combine gathers each token's K rows (``slot_pos``) and sums them with
their routing weights in fp32 (:func:`moe_fx.lowering.triton.permute.unpermute_from_masked`, the
same kernel as the masked layout's). Memory per call: ``T * K * (N1 + I + H)`` activations, the
bound of the contiguous layout.

Every slot sends its own row: a token naming one expert twice computes it twice (each slot counts,
as in the op contract), so K may exceed E. Ids outside ``[0, E)`` (``-1``, identity experts,
anything else) send no row. Nothing synchronises with the host (CUDA-graph safe).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_fx.lowering.triton._loader import launch
from moe_fx.lowering.triton.grouped_gemm import SortedRows, _known_empty, _out, _pow2
from moe_fx.lowering.triton.permute import copy_block
from moe_fx.ops.recipe import FP8_BLOCK, FP8_DTYPE, cdiv

__all__ = ["ContiguousRows", "SortedRows", "bitonic_log", "contiguous_rows", "quantize_rows", "sort_and_quantize",
           "sort_by_expert"]


def _slots_per_program(e_pow2: int) -> int:
    # the row lookup compares every slot with every expert: keep [BLOCK, E_POW2] near 16K elements
    return max(16, min(1024, 16384 // e_pow2))


#: The one-program sort's smaller pairwise tile: a decode step's slots (T * K <= 32) rank in a 32-slot tile, which
#: the GPU runs in about 60% of the time of the 128-slot one (bench/results/kernel_breakdown_2026-12-03_sortab*.md).
DECODE_PAIRWISE_SLOTS = 32


def pairwise_slots(e_pow2: int) -> int:
    """Most slots the one-program sort ranks pairwise (``[PAIRS, PAIRS]`` and ``[PAIRS, E_POW2]`` tiles near 16K
    elements: no spills at 4 warps); more slots take its two passes."""
    return max(16, min(128, 16384 // e_pow2))


#: The one-launch sort's program 0 sorts up to this many slots alone (a power of two; 0: off): keys (expert, slot)
#: in one bitonic sort and the counts from ``tl.histogram``, where the pairwise blocks of more than
#: :func:`pairwise_slots` slots spent 13-17 µs at 128 experts (Qwen3 T=32/64, kernel_breakdown_2026-12-05_sortab).
#: Read at every launch, so ``bench/fused_activation.py --switch bitonic_sort`` times both sides in one process.
BITONIC_SORT_SLOTS = 1024

#: decode-sized sorts (at most this many slots, or the decode regime) run in one launch, without atomics
SMALL_SORT_SLOTS = 1024

#: :func:`contiguous_rows` writes the fp8 scales row by row into a scratch ``[rows, groups]`` and
#: :func:`copy_scales` moves them into DeepGEMM's MN-major layout in a second launch, instead of storing each
#: group's scale straight into the MN-major layout (one 4-byte store a slot and group, each in a sector of its own).
#: Those stores held the copy at 43% of its bytes floor for the DeepSeek-V3 shard at T=16384: 933 µs, against 492
#: µs (81%) for the two launches (1.29x at T=4096; Mixtral and Qwen3 at T=16384 1.11x / 1.10x; level, within 1 µs,
#: for Mixtral at T=4096, the other size the lowering copies into this layout, above 256 rows per expert; smaller
#: layouts, which the lowering puts in the masked layout instead, lose up to 3 µs to the second launch) (H100,
#: bench/results/layout_copy_2026-12-07_copy_scales_s30_h100.md). In the whole layer the kernels' profile agrees
#: (944 against 488 µs), but the two sides' replays in alternating rounds are level, 0.988-1.005x, not yet explained
#: (scale_scratch_2026-12-07_s31_h100.md). A fixed choice, not one by token count: under a symbolic T a size rule
#: would guard the graph on T. Read at every call.
SCALE_SCRATCH = True


def sort_by_expert(topk_ids: torch.Tensor, num_experts: int, *, small: bool | None = None) -> SortedRows:
    """Rows of the contiguous layout for ``topk_ids [T, K]`` (int32/int64, any strides).

    Returns a :class:`SortedRows` with ``num_rows = T * K``. ``small`` (default: ``T * K <=``
    :data:`SMALL_SORT_SLOTS` when T is known) sorts in one launch, a stable counting sort with no
    memset and no atomics (decode: the pipeline passes its regime); otherwise two launches over the
    slots and one memset, with rows inside an expert in no set order (atomics). Every result is
    deterministic.
    """
    _check_ids("sort_by_expert", topk_ids, num_experts)
    t, k = topk_ids.shape
    n = t * k
    dev = topk_ids.device
    if small is None:
        small = isinstance(n, int) and n <= SMALL_SORT_SLOTS
    if small:
        return _sort_small(topk_ids, num_experts)
    e_pow2 = _pow2(num_experts)
    sorted_slots = torch.empty(n, dtype=torch.int32, device=dev)
    slot_pos = torch.empty(n, dtype=torch.int64, device=dev)
    # counts [E], total, cursors [E]: one buffer, one memset
    scratch = torch.zeros(2 * num_experts + 1, dtype=torch.int32, device=dev)
    if not _known_empty(t, k):
        block = _slots_per_program(e_pow2)
        grid = (cdiv(n, block),)
        launch("expert_counts_kernel", dev, grid, topk_ids, scratch, n, num_experts, *topk_ids.stride(),
               TOPK=int(k), BLOCK=block, E_POW2=e_pow2, num_warps=4)
        launch("sort_slots_kernel", dev, grid, topk_ids, scratch, sorted_slots, slot_pos, n, num_experts,
               *topk_ids.stride(), TOPK=int(k), BLOCK=block, E_POW2=e_pow2, num_warps=4)
    return SortedRows(scratch, sorted_slots, slot_pos, int(k), n, num_experts)


def sort_and_quantize(topk_ids: torch.Tensor, num_experts: int, tokens: torch.Tensor
                      ) -> tuple[SortedRows, torch.Tensor, torch.Tensor]:
    """The decode sort (:func:`sort_by_expert` with ``small=True``) and :func:`quantize_rows` of ``tokens``
    in ONE launch: programs after the sort's quantise the tokens, so a decode step with fp8 weights
    does not pay a launch (and the gap after it) for the quantisation.

    Returns ``(rows, codes [T, H] float8_e4m3fn, scales [T, ceil(H/128)] fp32)``: the same values as the
    two functions give.
    """
    _check_ids("sort_and_quantize", topk_ids, num_experts)
    if tokens.dim() != 2 or tokens.shape[0] != topk_ids.shape[0]:
        raise ValueError(f"sort_and_quantize: tokens must be [T, H] with T = {topk_ids.shape[0]}, got "
                         f"{list(tokens.shape)}")
    q, s = _quantized_like(tokens, "sort_and_quantize")
    return _sort_small(topk_ids, num_experts, quantize=(tokens, q, s)), q, s


#: tokens per program of the token quantisation (:func:`quantize_rows`, :func:`sort_and_quantize`)
QUANT_BLOCK_T = 8


def _check_ids(name: str, topk_ids: torch.Tensor, num_experts: int) -> None:
    if topk_ids.dim() != 2 or topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name}: topk_ids must be int32/int64 [T, K], got {topk_ids.dtype} {list(topk_ids.shape)}")
    if num_experts <= 0:
        raise ValueError(f"{name}: need num_experts > 0, got {num_experts}")


def _sort_small(topk_ids: torch.Tensor, num_experts: int, *, quantize: tuple | None = None) -> SortedRows:
    """The one-launch decode sort (``sort_small_kernel``): counts and total written whole (no memset), one
    program per block of pairwise slots (one for a decode step's few slots); ``quantize = (x, q, s)``: more
    programs write ``x``'s 1x128 codes and scales to ``q`` and ``s``."""
    t, k = topk_ids.shape
    n = t * k
    dev = topk_ids.device
    e_pow2 = _pow2(num_experts)
    scratch = torch.empty(2 * num_experts + 1, dtype=torch.int32, device=dev)
    sorted_slots = torch.empty(n, dtype=torch.int32, device=dev)
    slot_pos = torch.empty(n, dtype=torch.int64, device=dev)
    pairs = pairwise_slots(e_pow2)
    sort_programs = torch.sym_max(1, cdiv(n, pairs))
    programs, extra = sort_programs, {}
    if quantize is not None:  # the quantisation's programs after the sort's
        x, q, s = quantize
        programs = sort_programs + cdiv(t, QUANT_BLOCK_T) * cdiv(x.shape[1], FP8_BLOCK)
        extra = dict(x_ptr=x, q_ptr=q, qs_ptr=s, T=t, H=x.shape[1], s_xt=x.stride(0), s_xh=x.stride(1),
                     s_qt=q.stride(0), s_qh=q.stride(1), s_st=s.stride(0), s_sh=s.stride(1),
                     sort_programs=sort_programs, QUANT=True, BLOCK_T=QUANT_BLOCK_T, INTERP=dev.type == "cpu")
    launch("sort_small_kernel", dev, (programs,), topk_ids, scratch, sorted_slots, slot_pos, n, num_experts,
           *topk_ids.stride(), TOPK=int(k), CHUNK=max(16, min(64, 8192 // e_pow2)), E_POW2=e_pow2,
           DECODE_PAIRS=DECODE_PAIRWISE_SLOTS, PAIRS=pairs, SORT_LOG=bitonic_log(BITONIC_SORT_SLOTS), num_warps=4,
           **extra)
    return SortedRows(scratch, sorted_slots, slot_pos, int(k), n, num_experts)


def bitonic_log(slots: int) -> int:
    """The kernel's SORT_LOG for a bitonic sort of ``slots`` (:data:`BITONIC_SORT_SLOTS`): log2, 0 for off."""
    if slots < 0 or slots & (slots - 1):
        raise ValueError(f"sort.BITONIC_SORT_SLOTS must be 0 or a power of two, got {slots}")
    return max(slots, 1).bit_length() - 1


def _quantized_like(x: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty fp8 codes and fp32 1x128 scales for ``x [T, H]`` (checked: bf16/fp16/fp32, 2-D)."""
    if x.dim() != 2 or x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"{name}: want a bf16/fp16/fp32 [T, H] tensor, got {x.dtype} {list(x.shape)}")
    t, h = x.shape
    return (torch.empty(t, h, dtype=FP8_DTYPE, device=x.device),
            _out(name, None, (t, cdiv(h, FP8_BLOCK)), torch.float32, x.device))


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [T, H]`` -> ``(codes [T, H] float8_e4m3fn, scales [T, ceil(H/128)] fp32)``, 1x128 groups.

    The recipe of :func:`moe_fx.lowering.quant.quantize_fp8_per_token_group`, in one Triton kernel.
    """
    q, s = _quantized_like(x, "quantize_rows")
    t, h = x.shape
    if _known_empty(t, h):
        return q, s
    launch("quantize_rows_kernel", x.device, (cdiv(t, QUANT_BLOCK_T), cdiv(h, FP8_BLOCK)),
           x, q, s, t, h, *x.stride(), *q.stride(), *s.stride(),
           BLOCK_T=QUANT_BLOCK_T, INTERP=x.device.type == "cpu", num_warps=4)
    return q, s


@dataclass(frozen=True)
class ContiguousRows:
    """The aligned contiguous layout of one call (DeepGEMM's m-grouped contiguous GEMMs read it).

    Expert ``e``'s rows are one segment of whole ``align``-row blocks: ``[start_pad[e], start_pad[e] +
    counts[e])`` holds its tokens, the rest of the segment is padding; ``num_rows`` is the static bound
    ``cdiv(T * K + E * (align - 1), align) * align``.

    Attributes:
        x: ``[num_rows, H]`` the tokens in their rows (fp8 codes with fp8 weights; padding rows unwritten).
        x_scale: ``[num_rows, ceil(H/128)]`` fp32, MN-major TMA-aligned (fp8), else None.
        m_indices: ``[num_rows]`` int32 expert of each row, -1 on padding rows (which DeepGEMM skips).
        slot_pos: ``[T * K]`` int64 row of each slot, -1 for a slot that sends no row.
    """

    x: torch.Tensor
    x_scale: torch.Tensor | None
    m_indices: torch.Tensor
    slot_pos: torch.Tensor
    num_rows: object


def copy_scales(src: torch.Tensor, dst: torch.Tensor) -> None:
    """``dst.copy_(src)`` for ``[R, G]`` fp32 scales, one Triton launch: a row-major scratch into DeepGEMM's MN-major
    layout (:func:`moe_fx.lowering.layouts.empty_mn_major_scales`), read and written in whole sectors. A launch
    rather than ``copy_`` so that the copy is a kernel of the graph like the rest of the layout's."""
    if src.shape != dst.shape or src.dim() != 2:
        raise ValueError(f"copy_scales: [R, G] to [R, G], got {list(src.shape)} to {list(dst.shape)}")
    r, g = src.shape
    block_g = min(64, _pow2(g))
    block_r = 4096 // block_g
    launch("copy_scales_kernel", src.device, (cdiv(r, block_r), cdiv(g, block_g)),
           src, dst, r, g, *src.stride(), *dst.stride(), BLOCK_R=block_r, BLOCK_G=block_g, num_warps=4)


def contiguous_rows(
    rows: SortedRows,
    x: torch.Tensor,
    x_scale: torch.Tensor | None,
    topk_ids: torch.Tensor,
    *,
    align: int,
    route_weights: torch.Tensor | None = None,
    quantize: bool = False,
    scale_scratch: bool | None = None,
) -> ContiguousRows:
    """The tokens ``x [T, H]`` (fp8 codes with their ``[T, ceil(H/128)]`` scales, or bf16) copied into the
    aligned contiguous layout of ``rows`` (:func:`sort_by_expert` of ``topk_ids``): one Triton launch, and a
    fill of ``m_indices`` with -1. ``quantize``: ``x`` is unquantised (``x_scale`` None) and the layout gets its
    fp8 codes and 1x128 scales, quantised in the same launch as :func:`quantize_rows` would (same codes and
    scales). ``route_weights [T, K]``: each row scaled by its slot's routing weight (weights on the input; fp8:
    the scales are scaled). ``scale_scratch`` (default :data:`SCALE_SCRATCH`): the launch writes the scales row by
    row into a scratch and :func:`copy_scales` moves them into the MN-major layout (the same values). No host
    synchronisation.
    """
    from moe_fx.lowering.layouts import empty_mn_major_scales

    if align <= 0 or align & (align - 1):
        raise ValueError(f"contiguous_rows: align must be a power of two, got {align}")
    if quantize and x_scale is not None:
        raise ValueError("contiguous_rows: quantize=True takes unquantised tokens (x_scale must be None)")
    t, h = x.shape
    k, e = rows.topk, rows.num_experts
    n = rows.num_rows
    num_rows = cdiv(n + e * (align - 1), align) * align
    out = torch.empty(num_rows, h, dtype=FP8_DTYPE if quantize else x.dtype, device=x.device)
    out_scale = None
    if x_scale is not None or quantize:
        out_scale = empty_mn_major_scales(1, num_rows, h, device=x.device).squeeze(0)
    m_indices = torch.full((num_rows,), -1, dtype=torch.int32, device=x.device)
    slot_pos = torch.empty(n, dtype=torch.int64, device=x.device)
    if _known_empty(t, k):
        return ContiguousRows(out, out_scale, m_indices, slot_pos, num_rows)
    block_h = copy_block(h, quantize)
    sg = cdiv(h, FP8_BLOCK)
    scratch = None  # where the launch writes the scales: out_scale itself, or a row-major scratch moved after it
    if out_scale is not None and (SCALE_SCRATCH if scale_scratch is None else scale_scratch):
        scratch = torch.empty(num_rows, sg, dtype=out_scale.dtype, device=x.device)
    xs = x_scale if x_scale is not None else x
    os_ = out if out_scale is None else scratch if scratch is not None else out_scale
    w = route_weights if route_weights is not None else x
    launch("contiguous_rows_kernel", x.device, (t,),
           x, xs, w, rows.scratch, rows.slot_pos, topk_ids, out, os_, m_indices, slot_pos, e, h, sg,
           *x.stride(), *xs.stride()[-2:], *w.stride()[-2:], *topk_ids.stride(), *out.stride(), *os_.stride(),
           TOPK=int(k), K_POW2=max(2, _pow2(int(k))), E_POW2=_pow2(e), ALIGN=align, BLOCK_H=block_h,
           SG_POW2=max(2, _pow2(sg)),
           HAS_SCALE=x_scale is not None, QUANT=quantize, ROUTE_W=route_weights is not None,
           INTERP=x.device.type == "cpu", num_warps=4)
    if scratch is not None:
        copy_scales(scratch, out_scale)
    return ContiguousRows(out, out_scale, m_indices, slot_pos, num_rows)
