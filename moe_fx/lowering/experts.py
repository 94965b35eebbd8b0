"""The moe_fx ops lowered: ``moe_fx::experts`` = a local layout (sorted: sort -> experts -> combine, or
masked: permute -> masked experts -> unpermute), and ``moe_fx::masked_experts`` (expert parallelism,
between ``ep_dispatch`` and ``ep_combine``) = the masked experts.

:func:`plan_experts` / :func:`plan_masked_experts` decide everything the shapes decide (kernels, via
:mod:`moe_fx.lowering.select`; tiles and grids, inside the Triton wrappers) and the token-count regime
(:func:`moe_fx.lowering.problem.row_regime`); :func:`run_experts` / :func:`run_masked_experts_op` run
the plan. Both run eagerly on real tensors, and inside Inductor's tracing of a graph that holds the
op (see :mod:`moe_fx.lowering.register`), where they run once, at compile time, and leave behind the
kernel launches that Inductor's generated code makes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_fx.lowering.masked_experts.pipeline import (
    ExpertWeights,
    GemmHints,
    MaskedGemms,
    empty_scales,
    run_masked_experts,
    run_sorted_experts,
)
from moe_fx.lowering.problem import Capabilities, ExpertsProblem, dtype_name, row_regime, rows_per_expert
from moe_fx.lowering.select import Choice, choose, choose_layout, layout_of
from moe_fx.ops import ExpertActivation
from moe_fx.ops.masked_experts import masked_output_dtype
from moe_fx.ops.recipe import FP8_BLOCK, FP8_DTYPE

__all__ = ["ExpertsPlan", "decide_experts_plan", "gemms_of", "plan_experts", "plan_masked_experts", "run_experts",
           "run_masked_experts_op"]


@dataclass(frozen=True)
class ExpertsPlan:
    """What runs a moe_fx op call: the experts choice, the prepare/finalize (layout) choice, the problem."""

    experts: Choice
    prepare: Choice | None
    problem: ExpertsProblem

    @property
    def reference(self) -> bool:
        """The whole op runs its torch reference (no kernel pipeline)."""
        return self.experts.name == "reference"

    @property
    def layout(self) -> str:
        """``"sorted"``, ``"masked"`` or ``"reference"``: the row layout the call runs on."""
        return "reference" if self.reference else layout_of(self.prepare)

    def summary(self) -> str:
        """One line: kernel and layout, e.g. ``"triton, sorted layout"``."""
        return self.experts.name if self.reference else f"{self.experts.name}, {self.layout} layout"


def _k_major(w: torch.Tensor) -> bool:
    return w.dim() == 3 and w.is_contiguous()


def _problem(
    device: torch.device, dtype: torch.dtype, w13: torch.Tensor, w2: torch.Tensor, spec: ExpertActivation,
    w13_bias: torch.Tensor | None, w2_bias: torch.Tensor | None, regime: int | None,
) -> ExpertsProblem:
    fp8 = w13.dtype == FP8_DTYPE
    # E, H, I are compile-time constants of the kernels: a graph traced with them dynamic (weights as
    # inputs under dynamic=True) specialises on them here (model parameters have static shapes anyway)
    return ExpertsProblem(
        device.type, dtype_name(dtype), int(w13.shape[0]), int(w2.shape[1]), int(w2.shape[2]), spec,
        (FP8_BLOCK, FP8_BLOCK) if fp8 else None, w13_bias is not None, w2_bias is not None,
        _k_major(w13) and _k_major(w2), regime,
    )  # fmt: skip


def _checked(choice: Choice, what: str, problem: ExpertsProblem) -> Choice:
    if choice.error is not None:
        raise RuntimeError(
            f"moe_fx.{what}: impl={choice.request!r} was requested but cannot run: {choice.error} "
            f"({problem.describe()}); use impl='auto' to let moe_fx pick one that can"
        )
    return choice


def decide_experts_plan(
    problem: ExpertsProblem,
    top_k: int,
    impl: str = "auto",
    *,
    layout: str = "auto",
    caps: Capabilities | None = None,
) -> ExpertsPlan:
    """The kernel and the row layout of one ``moe_fx::experts`` problem: the lowering's rule, also explain's.

    The experts kernel first (:mod:`moe_fx.lowering.select`, family ``"experts"``), then the local
    layout among those it reads (:func:`~moe_fx.lowering.select.choose_layout`: ``local_sorted`` or
    ``local_permute``); explain runs the same two. ``caps`` makes it pure (explain for a device this machine lacks; tests);
    ``layout`` requests one (benchmarks; ``"auto"`` otherwise).
    """
    experts = _checked(choose("experts", problem, request=impl, caps=caps, device=problem.device_type), "experts",
                       problem)
    if experts.name == "reference":
        return ExpertsPlan(experts, None, problem)
    prepare = choose_layout(problem, top_k, experts, request=layout, caps=caps)
    if prepare.error is not None:
        raise RuntimeError(f"moe_fx.experts: layout {layout!r} cannot run: {prepare.error} ({problem.describe()})")
    return ExpertsPlan(experts, prepare, problem)


def plan_experts(
    hidden: torch.Tensor,
    topk_ids: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    spec: ExpertActivation,
    impl: str = "auto",
    *,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    layout: str = "auto",
) -> ExpertsPlan:
    """Choose the kernels of one ``moe_fx::experts`` call (a guard on the token-count regime when T is symbolic).

    Raises ``RuntimeError`` when an explicit ``impl`` (or ``layout``) cannot run (never a silent fallback).
    """
    t, k = topk_ids.shape
    regime = row_regime(rows_per_expert(t, k, w13.shape[0]))
    problem = _problem(hidden.device, hidden.dtype, w13, w2, spec, w13_bias, w2_bias, regime)
    return decide_experts_plan(problem, int(k), impl, layout=layout)


def gemms_of(choice: Choice) -> MaskedGemms:
    """The pipeline GEMMs of a masked-experts choice (not the reference)."""
    if choice.name == "deepgemm":
        from moe_fx.lowering.masked_experts.deepgemm import GEMMS
    elif choice.name == "triton":
        from moe_fx.lowering.masked_experts.triton import GEMMS
    else:
        raise ValueError(f"moe_fx: {choice.name!r} has no pipeline GEMMs")
    return GEMMS


def run_experts(
    hidden: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    spec: ExpertActivation,
    plan: ExpertsPlan,
    *,
    weights_on_input: bool = False,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    identity_experts: int = 0,
) -> torch.Tensor:
    """``moe_fx::experts`` with the plan's kernels (not the reference): permute, masked experts, unpermute.

    Shapes and semantics as in :mod:`moe_fx.ops.experts`; returns ``[T, H]`` in ``hidden.dtype``.
    """
    from moe_fx.lowering.triton.permute import masked_rows_needed, permute_to_masked, unpermute_from_masked
    from moe_fx.lowering.triton.sort import sort_by_expert

    if plan.reference:
        raise ValueError("run_experts: the plan runs the reference, not a kernel pipeline")
    t, k = topk_ids.shape
    h = hidden.shape[1]
    if isinstance(t, int) and t == 0:
        return hidden.new_zeros(hidden.shape)
    e = w13.shape[0]
    gemms = gemms_of(plan.experts)
    weights = ExpertWeights(w13, w2, w13_scale, w2_scale, w13_bias, w2_bias)
    rows = rows_per_expert(t, k, e)
    regime = plan.problem.regime if plan.problem is not None else None
    hints = GemmHints(expected_m=rows, max_total_m=t * k, active_groups=torch.sym_min(e, t * k), regime=regime)
    if plan.layout == "sorted":
        # decode (regime 0: at most 4 rows per expert, so T * K <= 4E slots): the one-program sort
        sorted_rows = sort_by_expert(topk_ids, e, small=(regime == 0) if regime is not None else None)
        y = run_sorted_experts(hidden, sorted_rows, weights, spec, gemms, hints,
                               route_weights=topk_weights if weights_on_input else None)
        slot_pos = sorted_rows.slot_pos
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
        num_experts=e, identity_experts=identity_experts, out_dtype=hidden.dtype,
    )


def plan_masked_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    spec: ExpertActivation,
    expected_m: object = 0,
    impl: str = "auto",
    *,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
) -> ExpertsPlan:
    """Choose the kernels of one ``moe_fx::masked_experts`` call (expert parallelism; M is static there).

    DeepGEMM stores whole 256-row tiles, so it needs ``M % 256 == 0``: under ``auto`` another ``M``
    takes Triton; an explicit ``impl="deepgemm"`` raises.
    """
    e, m, _ = x.shape
    act_dtype = torch.bfloat16 if x.dtype == FP8_DTYPE else x.dtype
    rows = expected_m if (not isinstance(expected_m, int) or expected_m > 0) else m
    problem = _problem(x.device, act_dtype, w13, w2, spec, w13_bias, w2_bias, row_regime(rows))
    choice = _checked(choose("experts", problem, request=impl, device=x.device), "masked_experts", problem)
    if choice.name == "deepgemm" and gemms_of(choice).rows(m) != m:
        why = f"M={m} rows per expert is not a multiple of 256 (DeepGEMM stores whole row tiles)"
        if impl != "auto":
            raise RuntimeError(f"moe_fx.masked_experts: impl='deepgemm' cannot run: {why}")
        choice = Choice("experts", "triton", {**choice.reasons, "deepgemm": why}, impl)
    return ExpertsPlan(choice, None, problem)


def run_masked_experts_op(
    x: torch.Tensor,
    masked_m: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    spec: ExpertActivation,
    plan: ExpertsPlan,
    *,
    x_scale: torch.Tensor | None = None,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    expected_m: object = 0,
) -> torch.Tensor:
    """``moe_fx::masked_experts`` with the plan's kernels: ``[E, M, H]`` in :func:`masked_output_dtype`."""
    if plan.reference:
        raise ValueError("run_masked_experts_op: the plan runs the reference, not a kernel pipeline")
    e, m, _ = x.shape
    gemms = gemms_of(plan.experts)
    weights = ExpertWeights(w13, w2, w13_scale, w2_scale, w13_bias, w2_bias)
    rows = expected_m if (not isinstance(expected_m, int) or expected_m > 0) else m
    hints = GemmHints(expected_m=rows, max_total_m=e * m, active_groups=e)
    y = run_masked_experts(x, x_scale, masked_m, weights, spec, gemms, hints)
    return y.to(masked_output_dtype(x))
