"""The experts pipeline, written once: GEMM1 -> activation (+ bias, + fp8 quantisation) -> GEMM2.

It runs on one of two row layouts (vLLM's "batched" and "standard" experts formats):

* masked (:func:`run_masked_experts`): ``x [E, M, H]`` + ``masked_m [E]``, whatever put the tokens
  there (the local permute of ``moe_fx::experts``, or an expert-parallel dispatch: DeepEP LL returns
  it), on DeepGEMM's or Triton's GEMMs (:class:`MaskedGemms`);
* sorted (:func:`run_sorted_experts`): one row per (token, k) slot, grouped by expert
  (:class:`~moe_fx.lowering.triton.grouped_gemm.SortedRows`); GEMM1 reads the tokens in place,
  no ``[E, M, H]`` buffer. Only GEMMs whose ``layouts`` name it (Triton's).

It runs in two ways: eagerly on real tensors, and while Inductor traces a moe_fx op into its graph,
where every kernel launch becomes a node of the graph and Inductor's generated code launches the
kernels itself (see :mod:`moe_fx.lowering.register`).
So everything here that depends on shapes only is decided once, when the graph is compiled.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from moe_fx.lowering.quant import quantize_fp8_per_token_group
from moe_fx.ops import ExpertActivation
from moe_fx.ops.masked_experts import dequantize_activations
from moe_fx.ops.recipe import FP8_DTYPE

__all__ = ["COMBINE_IN_GRAPH", "FUSE_ACTIVATION", "QUANTIZE_TOKENS_IN_SORT", "SLOT_DOWN_COMBINE", "SLOT_ROWS_MAX_TOKENS",
           "W8A16_MAX_ROWS", "ExpertWeights", "GemmHints", "MaskedGemms", "combine_in_graph", "fuse_activation",
           "fuse_down_combine", "quantize_activations", "quantize_tokens_in_sort", "run_masked_experts",
           "run_sorted_experts", "slot_rows"]

#: Whether the sorted layout may apply the activation in GEMM1's epilogue (where :func:`fuse_activation`
#: says it wins). Read when a call runs (so when a graph is compiled, for compiled code); benchmarks set
#: it False to time the separate activation kernel beside it (bench/fused_activation.py).
FUSE_ACTIVATION = True
#: Rows per expert up to which a gate/up-halves GEMM1 takes the epilogue (see :func:`fuse_activation`); None, the
#: measured choice since 2026-12-06: at every size (``bash bench/gpu_recipes.sh epilogue_prefill`` times it).
FUSE_HALVES_MAX_ROWS: int | None = None
#: Rows per expert up to which fp8 weights meet unquantised bf16 activations on the sorted layout (W8A16,
#: see :func:`quantize_activations`). 0: activations are quantised at every size, the measured choice
#: (W8A16 ran 1.08-2.1x slower at up to 64 rows per expert on an H100 in its second form,
#: bench/results/w8a16_2026-12-06_w8a16_fold_s21_h100.md; 1.3-1.8x in its first on the H200); benchmarks and
#: tests set it to 16 to run W8A16 (10x lower error against the fp32 reference).
W8A16_MAX_ROWS = 0
#: Whether a decode step with fp8 weights and quantised activations quantises its tokens in the sort's launch
#: (:func:`quantize_tokens_in_sort`). Read when a call runs; bench/fused_activation.py ``--switch sort_quant``
#: sets it False to time the separate quantisation launch beside it.
QUANTIZE_TOKENS_IN_SORT = True
#: Token counts (static, at most this many) whose sorted-layout call keeps its rows in slot order: no sort launch,
#: the GEMMs read each slot's expert id (:func:`slot_rows`). 0: always sort. Read when a call runs;
#: bench/fused_activation.py ``--switch slot_rows`` sets it 0 to time the sort beside it.
SLOT_ROWS_MAX_TOKENS = 1
#: Whether a decode-sized call (rows-per-expert regime 0) leaves its combine to Inductor while a graph is compiled
#: (:func:`combine_in_graph`). Off: on an H100 (2-layer GPT-OSS, 2026-12-05) it saved the launch it should (62 -> 60
#: GPU activities per T=1 forward, 1.09 -> 1.11x plain) but generate()'s decode moved inside the runs' drift
#: (bench/results/e2e_model_2026-12-05_gptoss_l2_{shipped,combine}_h100.md). At full depth (GPT-OSS-20B, 24 layers,
#: H200, e2e_model_2026-12-05_full_gpt_oss_gen_b1_{shipped,combine}.md) one launch a layer fewer again, GPU busy
#: -1%, generate() 1.13x shipped / 1.10x with it, two runs whose host time drifted ~30%: no gain seen. The A/B in
#: one set of alternating rounds is ``bash bench/gpu_recipes.sh gen_ab_combine``.
COMBINE_IN_GRAPH = False
#: Whether a call whose rows stay in slot order (:func:`slot_rows`) runs GEMM2 and the combine as one launch
#: (:func:`fuse_down_combine`, ``grouped_gemm.slot_down_combine``): one launch and the ``[T * K, H]`` rows fewer
#: a decode step (Qwen3-30B-A3B at T=1 spent 2.7 µs in its combine and ~2.5 µs in the gap before it,
#: bench/results/kernel_breakdown_2026-12-03.md). Off, as measured: 0.87-0.99x at T=1 for Qwen3, Mixtral and
#: GPT-OSS with each of four tiles (one H100, bench/results/slot_down_2026-12-06_tiles_h100.md). Read when a call
#: runs; bench/fused_activation.py ``--switch slot_down`` times both sides in one process.
SLOT_DOWN_COMBINE = False


@dataclass(frozen=True)
class ExpertWeights:
    """One MoE layer's expert weights as the op contract gives them (see ``moe_fx/ops/experts.py``)."""

    w13: torch.Tensor
    w2: torch.Tensor
    w13_scale: torch.Tensor | None = None
    w2_scale: torch.Tensor | None = None
    w13_bias: torch.Tensor | None = None
    w2_bias: torch.Tensor | None = None

    @property
    def fp8(self) -> bool:
        """Whether the weights are fp8 codes (the op contract then gives both block scales)."""
        return self.w13.dtype == FP8_DTYPE


@dataclass(frozen=True)
class GemmHints:
    """Host-side facts for tile choice and grid sizes (never read from ``masked_m``, which stays on device).

    Attributes:
        expected_m: rows per expert under a uniform load (picks the tile bucket).
        max_total_m: bound on ``sum(masked_m)`` (sizes persistent grids).
        active_groups: experts with rows, at most (decode tile choice).
        regime: the call's rows-per-expert regime (:func:`moe_fx.lowering.problem.row_regime`), which
            picks the tiles when T is symbolic (None: from ``expected_m``).
    All may be SymInts while traced.
    """

    expected_m: object
    max_total_m: object
    active_groups: object
    regime: int | None = None


class MaskedGemms(Protocol):
    """A GEMM implementation of the pipeline (:mod:`.triton`, :mod:`.deepgemm`)."""

    name: str
    #: ``"any"``: fp8 activation scales may have any strides; ``"mn_major"``: DeepGEMM's TMA-aligned layout
    scale_layout: str
    #: whether ``gemm`` adds a bias in its epilogue (else the pipeline adds it)
    bias_epilogue: bool
    #: the row layouts it runs: ``"masked"`` (``gemm``), ``"sorted"`` (``sorted_gemm``), ``"contiguous"``
    #: (``contiguous_gemm``: each expert's rows in whole blocks of ``contiguous_align`` rows)
    layouts: tuple[str, ...]

    def rows(self, needed: object) -> object:
        """``max_m`` for ``needed`` rows per expert (an implementation may round up)."""

    def gemm(
        self,
        a: torch.Tensor,
        a_scale: torch.Tensor | None,
        w: torch.Tensor,
        w_scale: torch.Tensor | None,
        masked_m: torch.Tensor,
        *,
        bias: torch.Tensor | None,
        hints: GemmHints,
    ) -> torch.Tensor:
        """``[G, M, K] x [G, N, K]^T -> [G, M, N]`` on the valid rows."""


def empty_scales(groups: int, rows: object, cols: int, layout: str, device: torch.device) -> torch.Tensor | None:
    """fp32 1x128 scale buffer for ``[groups, rows, cols]`` activations in ``layout`` (None: let the producer allocate)."""
    if layout != "mn_major":
        return None
    from moe_fx.lowering.layouts import empty_mn_major_scales

    return empty_mn_major_scales(groups, rows, cols, device=device)


def _tokens_for(
    x: torch.Tensor, x_scale: torch.Tensor | None, weights: ExpertWeights, gemms: MaskedGemms
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Bring the tokens to the weights' recipe: fp8 tokens for fp8 weights (scales in the GEMM's layout),
    tokens of the weights' dtype otherwise. A no-op on the local path, whose permute already did it."""
    if weights.fp8:
        if x.dtype != FP8_DTYPE:
            x, x_scale = quantize_fp8_per_token_group(x)
        if gemms.scale_layout == "mn_major":
            from moe_fx.lowering.layouts import to_mn_major_tma_aligned

            x_scale = to_mn_major_tma_aligned(x_scale)
        return x, x_scale
    if x.dtype == FP8_DTYPE:
        return dequantize_activations(x, x_scale).to(weights.w13.dtype), None
    return x, None


def run_masked_experts(
    x: torch.Tensor,
    x_scale: torch.Tensor | None,
    masked_m: torch.Tensor,
    weights: ExpertWeights,
    spec: ExpertActivation,
    gemms: MaskedGemms,
    hints: GemmHints,
) -> torch.Tensor:
    """Expert ``e``'s MLP on the first ``masked_m[e]`` rows of ``x[e]``.

    Args:
        x: ``[E, M, H]`` tokens (float, or float8_e4m3fn with ``x_scale`` fp32 ``[E, M, ceil(H/128)]``).
        masked_m: ``[E]`` int32.
        weights: the layer's expert weights (fp8 weights: activations are quantised 1x128 before each GEMM).
        spec: the activation between the GEMMs.
        gemms: the GEMM implementation.
        hints: tile and grid hints.

    Returns:
        ``[E, M, H]``: bf16 with fp8 weights, else the weights' dtype; rows past ``masked_m`` unspecified.
    """
    from moe_fx.lowering.triton.activation import expert_activation

    x, x_scale = _tokens_for(x, x_scale, weights, gemms)
    e, m, _ = x.shape
    gate_up = gemms.gemm(x, x_scale, weights.w13, weights.w13_scale, masked_m, bias=None, hints=hints)
    inter = weights.w2.shape[2]
    a2_scale = empty_scales(e, m, inter, gemms.scale_layout, x.device) if weights.fp8 else None
    a2, a2_scale = expert_activation(
        gate_up, masked_m, spec, bias=weights.w13_bias, quant_fp8=weights.fp8, out_scale=a2_scale,
        max_total_m=hints.max_total_m,
    )
    bias2 = weights.w2_bias if gemms.bias_epilogue else None
    y = gemms.gemm(a2, a2_scale, weights.w2, weights.w2_scale, masked_m, bias=bias2, hints=hints)
    if weights.w2_bias is not None and not gemms.bias_epilogue:
        y = y + weights.w2_bias.unsqueeze(1).to(y.dtype)
    return y


def quantize_activations(fp8: bool, regime: int | None) -> bool:
    """Whether a sorted-layout call with fp8 weights (``fp8``) quantises its activations per 1x128 group
    (W8A8: fp8 tensor-core products) or keeps them unquantised (W8A16: each weight tile converted in the
    GEMM's registers: code times block scale, rounded to bf16, into one accumulator).

    W8A16 (up to :data:`W8A16_MAX_ROWS` rows per expert) moves the same fp8 weight bytes, runs no
    quantisation kernel before either GEMM, lets GEMM1 apply the activation in its epilogue (sort -> GEMM1
    -> GEMM2 -> combine, as bf16 layers run, instead of six launches) and does not round the activations
    to fp8 (relative error 4e-3 against the fp32 reference where W8A8 has 4e-2). Measured, it loses at decode
    sizes all the same (1.08-2.1x slower on an H100 up to 64 rows per expert,
    bench/results/w8a16_2026-12-06_w8a16_fold_s21_h100.md; its first form 1.3-1.8x on the H200): converting
    the weight tiles in registers costs more than the two launches it saves, so the bound is 0 (off).
    ``regime`` None (unknown size): quantised.
    """
    from moe_fx.lowering.problem import regime_bounds

    if not fp8:
        return False
    if regime is None:
        return True
    hi = regime_bounds(regime)[1]
    return hi is None or hi > W8A16_MAX_ROWS


def quantize_tokens_in_sort(fp8: bool, regime: int | None) -> bool:
    """Whether a sorted-layout call quantises its tokens (W8A8: :func:`quantize_activations`) in the launch of
    its sort (:func:`moe_fx.lowering.triton.sort.sort_and_quantize`): in the decode regime (regime 0, the
    one-launch sort), where a launch and the gap after it are a tenth of the step, while
    :data:`QUANTIZE_TOKENS_IN_SORT` says so. Not timed on the GPU yet (``--switch sort_quant``)."""
    return QUANTIZE_TOKENS_IN_SORT and regime == 0 and quantize_activations(fp8, regime)


def slot_rows(fp8: bool, tokens: object) -> bool:
    """Whether a sorted-layout call runs its rows in slot order (row ``t * K + k`` for slot ``(t, k)``) instead of
    sorting them: a static token count of at most :data:`SLOT_ROWS_MAX_TOKENS` (Dynamo always specialises one
    token: every batch-1 decode step), bf16/fp16/fp32 weights. One token's top-k ids name distinct experts, so
    each expert has one row either way and the GEMMs stream the same weights; the sort's launch and the gap after
    it (~4.5 of Qwen3-30B-A3B's 41 µs at T=1, bench/results/kernel_breakdown_2026-12-03.md) are gone. fp8 weights
    keep the sort, whose launch quantises the tokens (one launch either way). Measured on the H200
    (bench/results/slot_rows_2026-12-05.json, ``--switch slot_rows --on 4``): T=1 1.01-1.12x faster; at 2-4 tokens
    sorted rows win (up to 1.44x), hence one token."""
    return (not fp8 and isinstance(tokens, int) and not isinstance(tokens, bool)
            and 1 <= tokens <= SLOT_ROWS_MAX_TOKENS)


def fuse_down_combine(rows_in_slot_order: bool, top_k: int, in_graph: bool) -> bool:
    """Whether a call runs GEMM2 and the combine as one launch (:data:`SLOT_DOWN_COMBINE`): rows in slot order
    (:func:`slot_rows`), at most ``grouped_gemm.SLOT_DOWN_MAX_TOPK`` slots a token, and a combine that is not left to
    Inductor (``in_graph``, :func:`combine_in_graph`)."""
    from moe_fx.lowering.triton.grouped_gemm import SLOT_DOWN_MAX_TOPK

    return SLOT_DOWN_COMBINE and rows_in_slot_order and top_k <= SLOT_DOWN_MAX_TOPK and not in_graph


def combine_in_graph(regime: int | None) -> bool:
    """Whether a call's combine traces as torch ops (:func:`~moe_fx.lowering.triton.permute.combine_rows`) rather
    than as ``unpermute_kernel`` when Inductor compiles the graph: in the decode regime (at most 4 rows per expert)
    while :data:`COMBINE_IN_GRAPH` says so. Inductor then takes the weighted sum over K (at most 8 terms: unrolled,
    pointwise) into its own kernel for what follows (the residual add, the next layer's norm): one user-kernel
    launch fewer per decoder layer, where a default-mode decode step is bound by the host's launches. Eager calls
    keep the kernel."""
    return COMBINE_IN_GRAPH and regime == 0


def fuse_activation(spec: ExpertActivation, fp8: bool, regime: int | None) -> bool:
    """Whether the sorted layout's GEMM1 applies ``spec`` in its epilogue, as measured on the H200
    (bench/results/fused_activation_2026-12-03.md, one layer, CUDA graphs, fused / unfused).

    Interleaved gate/up (GPT-OSS) split the unfused tile's accumulator: 1.02-1.16x faster at every T.
    Halves (Qwen3, Mixtral) kept two accumulators of half the tuned tile then: 1.01-1.06x up to 64 rows per
    expert, 0.95-0.98x at prefill sizes (Mixtral T >= 1024, Qwen3 T = 4096), where the separate kernel
    stayed. Not gated: the unfused tile and one accumulator, only the store and a launch saved. fp8
    weights with quantised activations (:func:`quantize_activations`) never: GEMM2 needs the activation
    quantised per 1x128 group, the activation kernel's job; with bf16 activations (W8A16) as bf16 weights.
    Halves now run one tile of gate and up rows by default (``grouped_gemm.PAIR_GATE_UP``, the unfused tile's MMA
    shape; 1.00-1.02x up to 256 tokens, bench/results/pair_halves_2026-12-05.md), and with it the epilogue wins at
    prefill sizes too: 1.04-1.11x at T = 1024, 4096, 16384 for Qwen3 and Mixtral (one H100, 2026-12-06,
    bench/results/fused_activation_2026-12-06_prefill_h100.md), so :data:`FUSE_HALVES_MAX_ROWS` is None and halves
    fuse at every size, an unknown regime included.
    ``fp8``: fp8 weights. ``regime``: the call's rows-per-expert regime (None, unknown: halves fuse only
    while the bound is None). The plan explain reports asks the same function (``ExpertsPlan.activation_epilogue``).
    """
    from moe_fx.lowering.problem import regime_bounds

    if not FUSE_ACTIVATION or quantize_activations(fp8, regime):
        return False
    if not spec.gated or spec.gate_up_layout == "interleaved" or FUSE_HALVES_MAX_ROWS is None:
        return True
    if regime is None:
        return False
    hi = regime_bounds(regime)[1]
    return hi is not None and hi <= FUSE_HALVES_MAX_ROWS


def run_sorted_experts(
    hidden: torch.Tensor,
    rows: object,
    weights: ExpertWeights,
    spec: ExpertActivation,
    gemms: MaskedGemms,
    hints: GemmHints,
    *,
    route_weights: torch.Tensor | None = None,
    tokens: tuple[torch.Tensor, torch.Tensor] | None = None,
    down: bool = True,
) -> torch.Tensor:
    """Every slot's expert MLP on the contiguous layout: ``y[row] = expert_e(x_t)`` for each sorted row.

    Args:
        hidden: ``[T, H]`` tokens, read in place by GEMM1 (fp8 weights: quantised 1x128 once, T rows, where
            :func:`quantize_activations` says so; else read as bf16 by GEMMs that dequantise the weights).
        rows: :class:`~moe_fx.lowering.triton.grouped_gemm.SortedRows` of the call, or its rows in slot order
            (:class:`~moe_fx.lowering.triton.grouped_gemm.SlotRows`, :func:`slot_rows`).
        weights, spec, gemms, hints: as in :func:`run_masked_experts` (``gemms`` must run ``"sorted"``).
        route_weights: ``[T, K]`` routing weights applied to the expert's input (``weights_on_input``);
            GEMM1 multiplies its rows by them before the bias (``(w x) W^T = w (x W^T)``).
        tokens: ``hidden``'s fp8 codes and 1x128 scales where the sort quantised them already
            (:func:`quantize_tokens_in_sort`); else quantised here when :func:`quantize_activations` says so.
        down: False stops before GEMM2 and returns the activation rows ``[1, T * K, I]`` (bf16/fp16/fp32 weights;
            for ``grouped_gemm.slot_down_combine``, GEMM2 and the combine in one launch).

    Returns:
        ``[1, T * K, H]`` in sorted row order (slot order for SlotRows; bf16 with fp8 weights, else the weights'
        dtype); rows past the total (of slots without an expert) unspecified.
    """
    from moe_fx.lowering.triton.activation import expert_activation
    from moe_fx.lowering.triton.grouped_gemm import SlotRows
    from moe_fx.lowering.triton.sort import quantize_rows

    if "sorted" not in gemms.layouts:
        raise ValueError(f"run_sorted_experts: {gemms.name} GEMMs do not run the sorted layout")
    x, x_scale = hidden, None
    quantized = quantize_activations(weights.fp8, hints.regime)
    if quantized:
        x, x_scale = tokens if tokens is not None else quantize_rows(hidden)
    elif weights.fp8:  # W8A16: bf16 activations, the GEMMs dequantise the weight tiles
        x = hidden.to(torch.bfloat16)
    elif hidden.dtype != weights.w13.dtype:
        x = hidden.to(weights.w13.dtype)
    # GEMM1's bias is per expert: added in its epilogue (after the routing weight, as (w x) W^T + b)
    if fuse_activation(spec, weights.fp8, hints.regime):
        # the activation in GEMM1's epilogue: the [N, 2I] product is never stored, one launch fewer
        a2 = gemms.sorted_gemm(x, None, weights.w13, weights.w13_scale, rows, bias=weights.w13_bias, hints=hints,
                               gather=True, route_weights=route_weights, activation=spec)
        a2_scale = None
    else:  # the separate activation kernel (W8A8: it quantises its output per 1x128 group for GEMM2)
        gate_up = gemms.sorted_gemm(x, x_scale, weights.w13, weights.w13_scale, rows, bias=weights.w13_bias,
                                    hints=hints, gather=True, route_weights=route_weights)
        # the activation kernel sees the sorted rows [1, N, N1] as one group of all valid rows (the scratch's total;
        # rows in slot order: all N, those of slots without an expert never read)
        if isinstance(rows, SlotRows):
            total, offset = torch.full((1,), rows.num_rows, dtype=torch.int32, device=hidden.device), 0
        else:
            total, offset = rows.scratch, rows.num_experts
        a2, a2_scale = expert_activation(gate_up, total, spec, quant_fp8=quantized, max_total_m=rows.num_rows,
                                         masked_m_offset=offset)
    if not down:
        if a2_scale is not None:
            raise ValueError("run_sorted_experts: down=False returns unquantised activation rows, not fp8 ones")
        return a2
    return gemms.sorted_gemm(a2, a2_scale, weights.w2, weights.w2_scale, rows, bias=weights.w2_bias, hints=hints,
                             gather=False, route_weights=None)


def run_contiguous_experts(
    hidden: torch.Tensor,
    rows: object,
    topk_ids: torch.Tensor,
    weights: ExpertWeights,
    spec: ExpertActivation,
    gemms: MaskedGemms,
    *,
    route_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every slot's expert MLP on the aligned contiguous layout (DeepGEMM's m-grouped contiguous GEMMs).

    The tokens are copied into each expert's segment of whole blocks of ``gemms.contiguous_align`` rows
    (:func:`~moe_fx.lowering.triton.sort.contiguous_rows`, fp8: quantised in the same launch), then
    GEMM1 -> activation (every row of the layout, padding included: one group; fp8: quantised into the
    GEMM's scale layout) -> GEMM2. ``gemms`` must run ``"contiguous"`` (``contiguous_gemm``); no GEMM
    bias (``w13_bias`` would need each row's expert in the activation kernel).

    Returns:
        ``(y [1, R, H] bf16, slot_pos [T * K] int64)``: the rows and each slot's row, for the combine.
    """
    from moe_fx.lowering.triton.activation import expert_activation
    from moe_fx.lowering.triton.sort import contiguous_rows

    if "contiguous" not in gemms.layouts:
        raise ValueError(f"run_contiguous_experts: {gemms.name} GEMMs do not run the contiguous layout")
    if weights.w13_bias is not None or weights.w2_bias is not None:
        raise ValueError("run_contiguous_experts: the contiguous layout takes no GEMM biases")
    x = hidden if weights.fp8 else hidden.to(weights.w13.dtype)
    layout = contiguous_rows(rows, x, None, topk_ids, align=gemms.contiguous_align, route_weights=route_weights,
                             quantize=weights.fp8)
    gate_up = gemms.contiguous_gemm(layout.x, layout.x_scale, weights.w13, weights.w13_scale, layout.m_indices)
    n = layout.num_rows
    inter = weights.w2.shape[2]
    # [1, rows, *] views by view/squeeze (a graph traced on a CPU-only build cannot select or slice fake CUDA
    # tensors)
    a2_scale = empty_scales(1, n, inter, gemms.scale_layout, hidden.device) if weights.fp8 else None
    all_rows = torch.full((1,), n, dtype=torch.int32, device=hidden.device)
    a2, a2_scale = expert_activation(gate_up.view(1, n, -1), all_rows, spec, quant_fp8=weights.fp8,
                                     out_scale=a2_scale, max_total_m=n)
    y = gemms.contiguous_gemm(a2.squeeze(0), None if a2_scale is None else a2_scale.squeeze(0), weights.w2,
                              weights.w2_scale, layout.m_indices)
    return y.view(1, n, -1), layout.slot_pos
