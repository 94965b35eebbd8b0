"""The moe_fx ops lowered: ``moe_fx::experts`` = a local layout (sorted: sort -> experts -> combine, or
masked: permute -> masked experts -> unpermute), and ``moe_fx::masked_experts`` (expert parallelism,
between ``ep_dispatch`` and ``ep_combine``) = the masked experts.

Every function here takes an op call's arguments bound by name from its schema (``a``:
:data:`moe_fx.ops.experts.bind_experts`, :data:`moe_fx.ops.masked_experts.bind_masked_experts`), real or fake
tensors alike. :func:`plan_experts` / :func:`plan_masked_experts` decide everything the shapes decide (kernels,
via :mod:`moe_fx.lowering.select`; tiles and grids, inside the Triton wrappers) and the token-count regime
(:func:`moe_fx.lowering.problem.row_regime`); :func:`run_experts` / :func:`run_masked_experts_op` run the plan.
Both run eagerly on real tensors, and inside Inductor's tracing of a graph that holds the op (see
:mod:`moe_fx.lowering.register`), where they run once, at compile time, and leave behind the kernel launches
that Inductor's generated code makes. :func:`explain_experts` is what ``moe_fx.explain`` reports for an op
node: the same plan, on the node's fake arguments.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from moe_fx.lowering.masked_experts.pipeline import (
    ExpertWeights,
    GemmHints,
    combine_in_graph,
    empty_scales,
    fuse_activation,
    fuse_down_combine,
    quantize_activations,
    quantize_tokens_in_sort,
    run_contiguous_experts,
    run_masked_experts,
    run_sorted_experts,
    slot_rows,
)
from moe_fx.lowering.problem import (
    ROW_REGIMES,
    Capabilities,
    ExpertsProblem,
    dtype_name,
    probe_capabilities,
    regime_bounds,
    row_regime,
    rows_per_expert,
)
from moe_fx.lowering.select import LOCAL_LAYOUTS, Choice, choose, choose_layout, layout_of
from moe_fx.ops import ExpertActivation
from moe_fx.ops.masked_experts import masked_output_dtype
from moe_fx.ops.recipe import FP8_BLOCK, FP8_DTYPE

__all__ = ["ExpertsExplanation", "ExpertsPlan", "decide_experts_plan", "experts_problem", "explain_experts",
           "plan_experts", "plan_masked_experts", "run_experts", "run_masked_experts_op"]


@dataclass(frozen=True)
class ExpertsPlan:
    """What runs a moe_fx op call: the experts choice, the prepare/finalize (layout) choice, the problem."""

    experts: Choice
    prepare: Choice | None
    problem: ExpertsProblem
    #: the call's token count where it is static (Dynamo specialises one token), else None
    tokens: int | None = None
    #: the call's slots a token (K), once a call's plan is made (None: a plan of no call)
    top_k: int | None = None

    @property
    def reference(self) -> bool:
        """The whole op runs its torch reference (no kernel pipeline)."""
        return self.experts.kernel == "reference"

    @property
    def layout(self) -> str:
        """``"sorted"``, ``"masked"`` or ``"reference"``: the row layout the call runs on."""
        return "reference" if self.reference else layout_of(self.prepare)

    @property
    def error(self) -> str | None:
        """Why an explicit ``kernel`` (or ``layout``) request cannot run, or None."""
        if self.experts.error is not None:
            return self.experts.error
        return None if self.prepare is None else self.prepare.error

    @property
    def activation_epilogue(self) -> bool:
        """GEMM1 applies the activation in its epilogue (sorted layout, where that measured faster:
        :func:`~moe_fx.lowering.masked_experts.pipeline.fuse_activation`, which the run asks too)."""
        return self.layout == "sorted" and fuse_activation(
            self.problem.activation, self.problem.fp8_block is not None, self.problem.regime)

    @property
    def bf16_activations_fp8_weights(self) -> bool:
        """fp8 weights meet unquantised bf16 activations (W8A16, sorted layout at decode sizes:
        :func:`~moe_fx.lowering.masked_experts.pipeline.quantize_activations`, which the run asks too)."""
        fp8 = self.problem.fp8_block is not None
        return self.layout == "sorted" and fp8 and not quantize_activations(fp8, self.problem.regime)

    @property
    def slot_rows(self) -> bool:
        """The sorted layout's rows stay in slot order, no sort (a static token count of one:
        :func:`~moe_fx.lowering.masked_experts.pipeline.slot_rows`, which the run asks too)."""
        return self.layout == "sorted" and slot_rows(self.problem.fp8_block is not None, self.tokens)

    @property
    def combine_in_graph(self) -> bool:
        """A compiled graph runs the combine as torch ops that Inductor fuses with what follows (decode sizes, while
        :func:`~moe_fx.lowering.masked_experts.pipeline.combine_in_graph` says so; the run asks this)."""
        return not self.reference and combine_in_graph(self.problem.regime if self.problem is not None else None)

    @property
    def down_combined(self) -> bool:
        """GEMM2 and the combine run as one launch (rows in slot order, while
        :func:`~moe_fx.lowering.masked_experts.pipeline.fuse_down_combine` says so; the run asks this)."""
        return self.top_k is not None and fuse_down_combine(self.slot_rows, self.top_k, self.combine_in_graph)

    def summary(self) -> str:
        """One line: kernel and layout, e.g. ``"triton, sorted layout, activation in GEMM1's epilogue"``."""
        if self.reference:
            return self.experts.kernel
        return f"{self.experts.kernel}, {self.layout} layout" + (
            ", rows in slot order (no sort)" if self.slot_rows else "") + (
            ", GEMM2 and the combine in one launch" if self.down_combined else "") + (
            ", bf16 activations x fp8 weights" if self.bf16_activations_fp8_weights else "") + (
            ", activation in GEMM1's epilogue" if self.activation_epilogue else "") + (
            ", combine fused by Inductor in compiled graphs" if self.combine_in_graph else "")

    def raise_if_unrunnable(self, what: str) -> ExpertsPlan:
        """Itself, or ``RuntimeError`` when an explicit request cannot run (never a silent fallback)."""
        if self.experts.error is not None:
            raise RuntimeError(
                f"moe_fx.{what}: kernel={self.experts.requested!r} was requested but cannot run: "
                f"{self.experts.error} ({self.problem.describe()}); use kernel='auto' to let moe_fx pick one that can"
            )
        if self.prepare is not None and self.prepare.error is not None:
            raise RuntimeError(f"moe_fx.{what}: layout {self.prepare.requested!r} cannot run: {self.prepare.error} "
                               f"({self.problem.describe()})")
        return self


def _k_major(w: torch.Tensor) -> bool:
    return w.dim() == 3 and w.is_contiguous()


def experts_problem(a: dict, regime: int | None, *, masked_rows: int | None = None) -> ExpertsProblem:
    """The selection problem of an op call's bound arguments (``experts`` or ``masked_experts``), in ``regime``."""
    x = a["hidden"] if "hidden" in a else a["x"]
    w13, w2 = a["w13"], a["w2"]
    act_dtype = torch.bfloat16 if x.dtype == FP8_DTYPE else x.dtype
    fp8 = w13.dtype == FP8_DTYPE
    # E, H, I are compile-time constants of the kernels: a graph traced with them dynamic (weights as
    # inputs under dynamic=True) specialises on them here (model parameters have static shapes anyway)
    return ExpertsProblem(
        x.device.type, dtype_name(act_dtype), int(w13.shape[0]), int(w2.shape[1]), int(w2.shape[2]),
        ExpertActivation.of(a), (FP8_BLOCK, FP8_BLOCK) if fp8 else None, a["w13_bias"] is not None,
        a["w2_bias"] is not None, _k_major(w13) and _k_major(w2), regime, masked_rows,
    )  # fmt: skip


def decide_experts_plan(
    problem: ExpertsProblem,
    top_k: int,
    kernel: str = "auto",
    *,
    layout: str = "auto",
    caps: Capabilities | None = None,
) -> ExpertsPlan:
    """The kernel and the row layout of one ``moe_fx::experts`` problem: the lowering's rule.

    The experts kernel first (:mod:`moe_fx.lowering.select`, family ``"experts"``), then the local
    layout among those it reads (:func:`~moe_fx.lowering.select.choose_layout`: ``local_sorted`` or
    ``local_permute``). ``caps`` makes it pure (explain for a device this machine lacks; tests);
    ``layout`` requests one (benchmarks; ``"auto"`` otherwise). A request that cannot run is in the
    plan's :attr:`~ExpertsPlan.error` (the run time raises it: :meth:`ExpertsPlan.raise_if_unrunnable`).
    """
    experts = choose("experts", problem, kernel=kernel, caps=caps, device=problem.device_type)
    if experts.kernel == "reference" or experts.error is not None:
        return ExpertsPlan(experts, None, problem)
    prepare = choose_layout(problem, top_k, experts, layout=layout, caps=caps)
    return ExpertsPlan(experts, prepare, problem)


def _regime(a: dict) -> int:
    t, k = a["topk_ids"].shape
    return row_regime(rows_per_expert(t, k, a["w13"].shape[0]))


def plan_experts(a: dict, *, layout: str = "auto", caps: Capabilities | None = None) -> ExpertsPlan:
    """The plan of one ``moe_fx::experts`` call (a guard on the token-count regime when T is symbolic).

    Raises ``RuntimeError`` when an explicit ``kernel`` (or ``layout``) cannot run (never a silent fallback).
    """
    problem = experts_problem(a, _regime(a))
    top_k = int(a["topk_ids"].shape[1])
    plan = decide_experts_plan(problem, top_k, a["kernel_choice"], layout=layout, caps=caps)
    return replace(plan, tokens=_static(a["topk_ids"].shape[0]), top_k=top_k).raise_if_unrunnable("experts")


def _static(n: object) -> int | None:
    """``n`` where it is a plain int (a static size), else None."""
    return n if isinstance(n, int) and not isinstance(n, bool) else None


def run_experts(a: dict, plan: ExpertsPlan) -> torch.Tensor:
    """``moe_fx::experts`` with the plan's kernels (not the reference): permute, masked experts, unpermute.

    Shapes and semantics as in :mod:`moe_fx.ops.experts`; returns ``[T, H]`` in ``hidden.dtype``.
    """
    from moe_fx.lowering.triton.grouped_gemm import SlotRows, slot_down_combine
    from moe_fx.lowering.triton.permute import masked_rows_needed, permute_to_masked, unpermute_from_masked
    from moe_fx.lowering.triton.sort import sort_and_quantize, sort_by_expert

    if plan.reference:
        raise ValueError("run_experts: the plan runs the reference, not a kernel pipeline")
    hidden, topk_ids, topk_weights, w13 = a["hidden"], a["topk_ids"], a["topk_weights"], a["w13"]
    weights_on_input, spec = a["weights_on_input"], ExpertActivation.of(a)
    t, k = topk_ids.shape
    h = hidden.shape[1]
    if isinstance(t, int) and t == 0:
        return hidden.new_zeros(hidden.shape)
    e = w13.shape[0]
    gemms = plan.experts.implementation.GEMMS
    weights = ExpertWeights(w13, a["w2"], a["w13_scale"], a["w2_scale"], a["w13_bias"], a["w2_bias"])
    rows = rows_per_expert(t, k, e)
    regime = plan.problem.regime if plan.problem is not None else None
    hints = GemmHints(expected_m=rows, max_total_m=t * k, active_groups=torch.sym_min(e, t * k), regime=regime)
    if plan.layout in ("sorted", "contiguous"):
        # decode (regime 0: at most 4 rows per expert, so T * K <= 4E slots): the one-launch sort
        tokens = None
        if plan.slot_rows:  # one token: its rows in slot order, no sort launch
            sorted_rows = SlotRows.of(topk_ids, e)
        elif plan.layout == "sorted" and quantize_tokens_in_sort(weights.fp8, regime):
            # fp8 decode: the tokens quantised by programs of the sort's launch
            sorted_rows, codes, scales = sort_and_quantize(topk_ids, e, hidden)
            tokens = (codes, scales)
        else:
            sorted_rows = sort_by_expert(topk_ids, e, small=(regime == 0) if regime is not None else None)
        route_weights = topk_weights if weights_on_input else None
        if plan.layout == "contiguous":
            y, slot_pos = run_contiguous_experts(hidden, sorted_rows, topk_ids, weights, spec, gemms,
                                                 route_weights=route_weights)
        else:
            if plan.down_combined:  # one token: GEMM2 and the combine in one launch, no [K, H] rows between
                a2 = run_sorted_experts(hidden, sorted_rows, weights, spec, gemms, hints, route_weights=route_weights,
                                        down=False)
                return slot_down_combine(a2, weights.w2, sorted_rows, topk_weights, bias=weights.w2_bias,
                                         weights_on_output=not weights_on_input, hidden=hidden,
                                         identity_experts=a["identity_experts"], out_dtype=hidden.dtype)
            y = run_sorted_experts(hidden, sorted_rows, weights, spec, gemms, hints, route_weights=route_weights,
                                   tokens=tokens)
            slot_pos = None if plan.slot_rows else sorted_rows.slot_pos
    else:
        max_m = gemms.rows(masked_rows_needed(t, k, weights_on_input))
        batch = permute_to_masked(
            hidden, topk_ids, e, max_m, topk_weights, weights_on_input=weights_on_input, quant_fp8=weights.fp8,
            x_scale=empty_scales(e, max_m, h, gemms.scale_layout, hidden.device) if weights.fp8 else None,
        )
        y = run_masked_experts(batch.x, batch.x_scale, batch.masked_m, weights, spec, gemms, hints)
        slot_pos = batch.slot_pos
    return unpermute_from_masked(
        y, slot_pos, topk_weights, weights_on_output=not weights_on_input, topk_ids=topk_ids, hidden=hidden,
        num_experts=e, identity_experts=a["identity_experts"], out_dtype=hidden.dtype, slot_rows=plan.slot_rows,
        in_graph=plan.combine_in_graph,
    )


def _masked_rows_hint(a: dict) -> object:
    """Rows per expert a ``masked_experts`` call expects: its ``expected_m`` hint, or all ``M`` without one."""
    expected_m, m = a["expected_m"], a["x"].shape[1]
    return expected_m if (not isinstance(expected_m, int) or expected_m > 0) else m


def plan_masked_experts(a: dict, *, caps: Capabilities | None = None) -> ExpertsPlan:
    """The plan of one ``moe_fx::masked_experts`` call (expert parallelism; M is static there).

    DeepGEMM stores whole 256-row tiles, so it needs ``M % 256 == 0`` (its ``supports``): under ``auto``
    another ``M`` takes Triton; an explicit ``kernel="deepgemm"`` raises.
    """
    problem = experts_problem(a, row_regime(_masked_rows_hint(a)), masked_rows=int(a["x"].shape[1]))
    choice = choose("experts", problem, kernel=a["kernel_choice"], caps=caps, device=problem.device_type)
    return ExpertsPlan(choice, None, problem).raise_if_unrunnable("masked_experts")


def run_masked_experts_op(a: dict, plan: ExpertsPlan) -> torch.Tensor:
    """``moe_fx::masked_experts`` with the plan's kernels: ``[E, M, H]`` in :func:`masked_output_dtype`."""
    if plan.reference:
        raise ValueError("run_masked_experts_op: the plan runs the reference, not a kernel pipeline")
    x = a["x"]
    e, m, _ = x.shape
    weights = ExpertWeights(a["w13"], a["w2"], a["w13_scale"], a["w2_scale"], a["w13_bias"], a["w2_bias"])
    hints = GemmHints(expected_m=_masked_rows_hint(a), max_total_m=e * m, active_groups=e)
    y = run_masked_experts(x, a["x_scale"], a["masked_m"], weights, ExpertActivation.of(a),
                           plan.experts.implementation.GEMMS, hints)
    return y.to(masked_output_dtype(x))


# ------------------------------------------------------------------------------------------------
# What explain reports: the plans above, on an op node's fake arguments


@dataclass(frozen=True)
class ExpertsExplanation:
    """What ``moe_fx.explain`` reports for one op call: the run time's plan and why.

    Attributes:
        plan: the plan the lowering makes for the call as traced (its token count's regime).
        regimes: ``"rows per expert 1..4: triton, sorted layout; 5..: ..."``: the plans of every regime a
            graph compiled for a dynamic token count may run (runs of equal plans), or ``""`` for the reference.
        reasons: ``{kernel: why not taken}`` of the plan's experts choice.
        tiles: for Triton on a GPU, the GEMM shapes nobody tuned there and the tiles they take instead
            (:func:`~moe_fx.lowering.triton.configs.tile_source`), or ``""``.
    """

    plan: ExpertsPlan
    regimes: str = ""
    reasons: dict[str, str] = field(default_factory=dict)
    #: where the Triton GEMMs' tiles come from when their shapes were never tuned on this GPU ("" if tuned)
    tiles: str = ""

    @property
    def kernel(self) -> str:
        """The experts kernel that runs."""
        return self.plan.experts.kernel

    @property
    def layout(self) -> str:
        """The row layout it runs on (``"reference"`` for the reference)."""
        return self.plan.layout


def explain_experts(a: dict, *, caps: Capabilities | None = None) -> ExpertsExplanation:
    """The plan of a ``moe_fx::experts`` (or ``masked_experts``) call, as explain reports it.

    The same functions as :func:`plan_experts` / :func:`plan_masked_experts`, on the op's bound arguments
    (fake tensors of a traced graph's node), at the traced token count (a symbolic one at its hint, without
    adding a guard), and the plans of the other regimes. A request that cannot run is in ``plan.error``
    instead of raised.
    """
    if "x" in a:  # masked_experts: M rows per expert, the load hint as its rows
        rows, top_k, masked_rows = _hint(_masked_rows_hint(a)), 1, int(a["x"].shape[1])
    else:
        t, top_k, masked_rows = _hint(a["topk_ids"].shape[0]), int(a["topk_ids"].shape[1]), None
        rows = None if t is None else rows_per_expert(t, top_k, int(a["w13"].shape[0]))
    plans = [_plan_in(a, r, masked_rows, top_k, caps) for r in range(len(ROW_REGIMES) + 1)]
    # a data-dependent token count has no hint: what prefill-sized batches run
    traced = row_regime(rows) if rows is not None else len(ROW_REGIMES)
    plan = plans[traced]
    if masked_rows is None:  # a static token count (one token: rows in slot order)
        plan = replace(plan, tokens=_static(a["topk_ids"].shape[0]), top_k=top_k)
    regimes = "" if plan.reference or plan.error is not None else _regime_summary(plans)
    return ExpertsExplanation(plan, regimes, dict(plan.experts.reasons), _untuned_tiles(a, plan, caps))


def _untuned_tiles(a: dict, plan: ExpertsPlan, caps: Capabilities | None) -> str:
    """explain's note on a Triton plan whose GEMM shapes have no tuned tiles on the GPU (see ExpertsExplanation)."""
    # the sorted layout's tiles are looked up per regime (the masked layout's by rows bucket: not said here)
    if (plan.error is not None or plan.experts.kernel != "triton" or plan.problem.device_type != "cuda"
            or plan.layout != "sorted"):
        return ""
    from moe_fx.lowering.triton.configs import tile_source

    caps = caps or probe_capabilities(torch.device("cuda"))
    name = caps.device_name
    if not name or name == "cuda":  # no GPU to name (a CPU-only trace of CUDA tensors)
        return ""
    kind = "fp8" if plan.problem.fp8_block is not None else "bf16"
    notes = [tile_source(kind, int(w.shape[1]), int(w.shape[2]), name, capability=caps.capability)
             for w in (a["w13"], a["w2"])]
    notes = [n for n in notes if n]
    if not notes:
        return ""
    return "; ".join(notes) + " (tune them: docs/triton.md, Tile configs)"


def _hint(v: object) -> int | None:
    if isinstance(v, torch.SymInt):
        hint = v.node.hint
        return None if hint is None else int(hint)
    return int(v)  # type: ignore[call-overload]


def _plan_in(a: dict, regime: int, masked_rows: int | None, top_k: int, caps: Capabilities | None) -> ExpertsPlan:
    problem = experts_problem(a, regime, masked_rows=masked_rows)
    if masked_rows is not None:
        return ExpertsPlan(choose("experts", problem, kernel=a["kernel_choice"], caps=caps, device=problem.device_type),
                           None, problem)
    return decide_experts_plan(problem, top_k, a["kernel_choice"], caps=caps)


def _regime_summary(plans: list[ExpertsPlan]) -> str:
    """``"rows per expert 1..4: triton, sorted layout (why); 5..: deepgemm, masked layout (why)"``: runs of equal
    plans. Why: the experts kernels a measured preference passed over, then the local layouts not taken."""

    def why(plan: ExpertsPlan) -> str:
        passed = [f"{k}: {plan.experts.reasons[k]}" for k in plan.experts.passed_over]
        prepare = plan.prepare
        # why the other local layouts were not taken; the aligned contiguous one only where the kernel reads it
        reads = getattr(plan.experts.implementation, "LAYOUTS", ())
        shown = [name for name, lay in LOCAL_LAYOUTS.items() if lay != "contiguous" or lay in reads]
        layouts = [] if prepare is None else [f"{k}: {v}" for k, v in prepare.reasons.items() if k in shown]
        return "; ".join(passed + layouts)

    keys = [(plan.summary(), why(plan)) for plan in plans]
    parts: list[str] = []
    start = 0
    for r in range(1, len(plans) + 1):
        if r < len(plans) and keys[r] == keys[start]:
            continue
        lo, _ = regime_bounds(start)
        _, hi = regime_bounds(r - 1)
        span = f"{lo}..{hi}" if hi is not None else f"{lo}.."
        summary, reason = keys[start]
        parts.append(f"rows per expert {span}: {summary}" + (f" ({reason})" if reason else ""))
        start = r
    return "; ".join(parts)
