"""Kernel selection: one selector and one :class:`Choice` type for both families of implementations.

Families, each an ordered list of candidates (best first for ``request="auto"``):

* ``"experts"`` — masked experts (GEMM1 -> activation -> GEMM2 on ``[E, M, *]``):
  :mod:`~moe_fx.lowering.masked_experts.deepgemm`, :mod:`~moe_fx.lowering.masked_experts.triton`,
  :mod:`~moe_fx.lowering.masked_experts.reference`;
* ``"prepare_finalize"`` — getting tokens into and out of the experts' row layout:
  :mod:`~moe_fx.lowering.prepare_finalize.deepep_ll`, :mod:`~moe_fx.lowering.prepare_finalize.torch_dist_fixed`,
  :mod:`~moe_fx.lowering.prepare_finalize.torch_dist` (expert parallelism, masked layout),
  :mod:`~moe_fx.lowering.prepare_finalize.local_sorted` (one device, contiguous layout),
  :mod:`~moe_fx.lowering.prepare_finalize.local_permute` (one device, masked layout).

Every candidate module has ``NAME``, ``supports(problem, caps) -> (ok, reason)`` (can it run: a pure
function of plain values) and, optionally, ``prefer(problem, caps) -> reason | None`` (is it worth
it under ``auto``: a reason to pass it over although it can run). :func:`decide` is the rule, a
pure function; :func:`choose` probes the device once and logs each distinct choice once, so explain
and the logs say why every other candidate was not taken.
"""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass, field
from types import ModuleType

from moe_fx.lowering.problem import Capabilities, probe_capabilities

__all__ = ["FAMILIES", "REQUEST_ALIASES", "Choice", "candidates", "choose", "choose_layout", "decide", "explain_kernel",
           "layout_of"]

log = logging.getLogger("moe_fx.lowering")

#: The candidates of each family, best first (module paths; imported on first use).
FAMILIES: dict[str, tuple[str, ...]] = {
    "experts": (
        "moe_fx.lowering.masked_experts.deepgemm",
        "moe_fx.lowering.masked_experts.triton",
        "moe_fx.lowering.masked_experts.reference",
    ),
    "prepare_finalize": (
        "moe_fx.lowering.prepare_finalize.deepep_ll",
        "moe_fx.lowering.prepare_finalize.torch_dist_fixed",
        "moe_fx.lowering.prepare_finalize.torch_dist",
        "moe_fx.lowering.prepare_finalize.local_sorted",
        "moe_fx.lowering.prepare_finalize.local_permute",
    ),
}
#: Request spellings users and ops pass, by the candidate name they mean.
REQUEST_ALIASES: dict[str, str] = {"deepep": "deepep_ll"}


@dataclass(frozen=True)
class Choice:
    """The candidate picked for a problem, and why each other candidate was not taken.

    Attributes:
        family: ``"experts"`` or ``"prepare_finalize"``.
        name: the candidate that will run.
        reasons: ``{candidate: why not}`` for every candidate not taken; one that could run but
            lost to a better one says ``"<winner> preferred"`` (or its own ``prefer`` reason).
        request: what was asked for (``"auto"`` or a candidate name).
        error: ``None``, or why an explicit request cannot be honoured (the caller then raises).
    """

    family: str
    name: str
    reasons: dict[str, str] = field(default_factory=dict)
    request: str = "auto"
    error: str | None = None

    def summary(self) -> str:
        """One line for explain and the logs: ``"triton [not taken: deepgemm: ...; reference: ...]"``."""
        if self.error is not None:
            return f"{self.name} requested but cannot run: {self.error}"
        why = "; ".join(f"{k}: {v}" for k, v in self.reasons.items())
        head = self.name if self.request == "auto" else f"{self.name} (requested)"
        return head + (f" [not taken: {why}]" if why else "")


def candidates(family: str) -> list[ModuleType]:
    """The candidate modules of ``family``, best first."""
    if family not in FAMILIES:
        raise ValueError(f"moe_fx: unknown kernel family {family!r}; known: {sorted(FAMILIES)}")
    return [importlib.import_module(path) for path in FAMILIES[family]]


def decide(family: str, problem: object, caps: Capabilities, request: str = "auto") -> Choice:
    """The selection rule: a pure function of the problem, the device's capabilities and the request.

    ``request="auto"`` takes the first candidate that can run and is not passed over by its own
    ``prefer``; an explicit request is honoured when it can run, else the choice carries ``error``
    (never a silent fallback).
    """
    mods = candidates(family)
    names = [m.NAME for m in mods]
    request = REQUEST_ALIASES.get(request, request)
    if request != "auto" and request not in names:
        raise ValueError(f"moe_fx: unknown {family} request {request!r}; known: {['auto', *names]}")
    verdicts = {m.NAME: m.supports(problem, caps) for m in mods}
    if request != "auto":
        ok, why = verdicts[request]
        return Choice(family, request, {n: "not requested" for n in names if n != request}, request,
                      None if ok else why)
    reasons: dict[str, str] = {}
    for m in mods:
        ok, why = verdicts[m.NAME]
        if not ok:
            reasons[m.NAME] = why
            continue
        passed = m.prefer(problem, caps) if hasattr(m, "prefer") else None
        if passed is not None:
            reasons[m.NAME] = passed
            continue
        for n in names:
            if n not in reasons and n != m.NAME:
                reasons[n] = f"{m.NAME} preferred" if verdicts[n][0] else verdicts[n][1]
        return Choice(family, m.NAME, reasons, request)
    raise RuntimeError(f"moe_fx: no {family} implementation can run {problem}: {reasons}")


_logged: set[tuple] = set()


def choose(
    family: str,
    problem: object,
    *,
    request: str = "auto",
    caps: Capabilities | None = None,
    device: object = None,
) -> Choice:
    """:func:`decide` with the real capabilities of ``device`` (probed once), logged once per problem.

    ``caps`` makes the call pure (tests; explain for a device this machine lacks).
    """
    if caps is None:
        caps = probe_capabilities(device if device is not None else getattr(problem, "device_type", None))
    choice = decide(family, problem, caps, request)
    key = (family, problem, caps, request)
    if key not in _logged:
        _logged.add(key)
        describe = getattr(problem, "describe", lambda: str(problem))
        log.info("moe_fx %s %s: %s", family, describe(), choice.summary())
    return choice


def choose_layout(
    problem: object, top_k: int, experts: Choice, *, request: str = "auto", caps: Capabilities | None = None
) -> Choice:
    """The local row layout of a one-device experts problem once its experts kernel is chosen.

    Family ``"prepare_finalize"`` on a :class:`~moe_fx.lowering.problem.DispatchProblem` that carries
    the layouts the chosen kernel reads (its module's ``LAYOUTS``) and the problem's regime: the
    lowering's rule (:func:`moe_fx.lowering.experts.decide_experts_plan`) and explain's.
    """
    from moe_fx.lowering.problem import DispatchProblem

    mod = next(m for m in candidates("experts") if m.NAME == experts.name)
    local = DispatchProblem(1, problem.device_type, problem.dtype, problem.hidden, int(top_k), problem.num_experts,
                            use_fp8=problem.fp8, expert_parallel=False, experts_layouts=getattr(mod, "LAYOUTS", ()),
                            regime=problem.regime)
    return choose("prepare_finalize", local, request=request, caps=caps, device=problem.device_type)


def layout_of(prepare: Choice | None) -> str:
    """``"sorted"`` or ``"masked"``: the row layout a prepare/finalize choice runs (masked without one)."""
    return "sorted" if prepare is not None and prepare.name == "local_sorted" else "masked"


def explain_kernel(
    device_type: str,
    dtype: object,
    num_experts: int,
    hidden: int,
    intermediate: int,
    fp8: bool = False,
    *,
    request: str = "auto",
    fp8_block: tuple[int, int] | None = None,
    activation: object = "silu",
    w13_bias: bool = False,
    w2_bias: bool = False,
    k_major: bool = True,
    caps: Capabilities | None = None,
) -> tuple[str, dict[str, str]]:
    """For ``moe_fx.explain()``: ``(kernel, {other kernel: why not, "layout": ...})`` for one experts layer.

    explain sees no batch: the kernel is the one prefill-sized batches run, and ``reasons["layout"]``
    says which kernel and row layout each rows-per-expert regime runs and why, computed by the
    functions the lowering's rule is made of (:func:`choose`, :func:`choose_layout`). ``activation`` is a
    name or a :class:`moe_fx.ops.ExpertActivation`. An explicit request that cannot run is reported
    as ``"<request> (cannot run)"`` with the reason under the request's own name; a Triton request on
    CPU as ``"triton (interpreted on CPU)"``.
    """
    from moe_fx.lowering.problem import ROW_REGIMES, ExpertsProblem, dtype_name, regime_bounds
    from moe_fx.ops import ExpertActivation

    spec = activation if isinstance(activation, ExpertActivation) else ExpertActivation(str(activation))
    block = (tuple(fp8_block) if fp8_block is not None else (128, 128)) if fp8 else None
    caps = caps or probe_capabilities(device_type)

    def problem(regime: int) -> ExpertsProblem:
        return ExpertsProblem(device_type, dtype_name(dtype), num_experts, hidden, intermediate, spec, block,
                              w13_bias, w2_bias, k_major, regime)

    prefill = len(ROW_REGIMES)
    choice = choose("experts", problem(prefill), request=request, caps=caps)
    if choice.error is not None:
        return f"{choice.name} (cannot run)", {choice.name: choice.error, **choice.reasons}
    reasons = dict(choice.reasons)
    if choice.name == "triton" and device_type == "cpu":
        return "triton (interpreted on CPU)", reasons
    if choice.name == "reference":
        return choice.name, reasons
    plans = []
    for r in range(prefill + 1):
        experts = choose("experts", problem(r), request=request, caps=caps)
        plans.append((experts, choose_layout(problem(r), 0, experts, request="auto", caps=caps)))
    if choice.name == "deepgemm" and request == "auto" and plans[0][0].name != "deepgemm":
        reasons[plans[0][0].name] = (f"deepgemm preferred; {plans[0][0].name} runs batches of <= "
                                     f"{ROW_REGIMES[0]} rows per expert")
    reasons["layout"] = _layout_summary(plans, regime_bounds)
    return choice.name, reasons


def _layout_summary(plans: list[tuple[Choice, Choice]], regime_bounds) -> str:
    """``"rows per expert 1..4: triton, sorted layout; 5..: deepgemm, masked layout (why)"``: runs of equal plans."""
    def head(plan: tuple[Choice, Choice]) -> str:
        return f"{plan[0].name}, {layout_of(plan[1])} layout"

    parts: list[str] = []
    start = 0
    for r in range(1, len(plans) + 1):
        if r < len(plans) and head(plans[r]) == head(plans[start]):
            continue
        lo, _ = regime_bounds(start)
        _, hi = regime_bounds(r - 1)
        prepare = plans[start][1]
        why = "; ".join(f"{k}: {v}" for k, v in prepare.reasons.items() if not k.startswith(("deepep", "torch_dist")))
        span = f"{lo}..{hi}" if hi is not None else f"{lo}.."
        parts.append(f"rows per expert {span}: {head(plans[start])}" + (f" ({why})" if why else ""))
        start = r
    return "; ".join(parts)
