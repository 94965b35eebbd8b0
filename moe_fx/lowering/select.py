"""Kernel selection: one selector and one :class:`Choice` type for both families of implementations.

Families, each an ordered list of candidates (best first for ``kernel="auto"``):

* ``"experts"`` — masked experts (GEMM1 -> activation -> GEMM2 on ``[E, M, *]``):
  :mod:`~moe_fx.lowering.masked_experts.deepgemm`, :mod:`~moe_fx.lowering.masked_experts.triton`,
  :mod:`~moe_fx.lowering.masked_experts.reference`;
* ``"prepare_finalize"`` — getting tokens into and out of the experts' row layout:
  :mod:`~moe_fx.lowering.prepare_finalize.deepep_ll`, :mod:`~moe_fx.lowering.prepare_finalize.torch_dist_fixed`,
  :mod:`~moe_fx.lowering.prepare_finalize.torch_dist` (expert parallelism, masked layout),
  :mod:`~moe_fx.lowering.prepare_finalize.local_sorted` (one device, contiguous layout),
  :mod:`~moe_fx.lowering.prepare_finalize.local_contiguous` (one device, contiguous layout in aligned blocks),
  :mod:`~moe_fx.lowering.prepare_finalize.local_permute` (one device, masked layout).

Every candidate module has ``NAME`` (the kernel name a ``kernel=`` argument names it by), ``supports(problem,
caps) -> (ok, reason)`` (can it run: a pure function of plain values) and, optionally, ``prefer(problem, caps)
-> reason | None`` (is it worth it under ``auto``: a reason to pass it over although it can run). :func:`decide`
is the rule, a pure function; :func:`choose` probes the device once and logs each distinct choice once, so
explain and the logs say why every other candidate was not taken. A :class:`Choice` carries the chosen module
itself (``implementation``): nothing maps a name back to code.

The kernel names are the ops' contract (:data:`moe_fx.ops.checks.KERNELS`, :data:`~moe_fx.ops.checks.EP_KERNELS`,
their one home): :func:`candidates` checks the families against them when it first loads them.
"""

from __future__ import annotations

import functools
import importlib
import logging
from dataclasses import dataclass, field
from types import ModuleType

from moe_fx.lowering.problem import Capabilities, probe_capabilities
from moe_fx.ops.checks import EP_KERNELS, KERNELS

__all__ = ["FAMILIES", "LOCAL_LAYOUTS", "Choice", "candidates", "choose", "choose_layout", "decide", "layout_of"]

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
        "moe_fx.lowering.prepare_finalize.local_contiguous",
        "moe_fx.lowering.prepare_finalize.local_permute",
    ),
}
#: The prepare/finalize candidates of one device (the row layouts of ``moe_fx::experts``, chosen after its
#: experts kernel), by the layout each runs; the others of the family are the EP ops' kernels.
LOCAL_LAYOUTS: dict[str, str] = {"local_sorted": "sorted", "local_contiguous": "contiguous", "local_permute": "masked"}
#: The names each family's candidates must have: the ops' contract (``"auto"`` aside).
_CONTRACT: dict[str, set[str]] = {
    "experts": set(KERNELS) - {"auto"},
    "prepare_finalize": (set(EP_KERNELS) - {"auto"}) | set(LOCAL_LAYOUTS),
}


@dataclass(frozen=True)
class Choice:
    """The candidate picked for a problem, and why each other candidate was not taken.

    Attributes:
        family: ``"experts"`` or ``"prepare_finalize"``.
        kernel: the name of the candidate that will run (its ``NAME``).
        implementation: the candidate's module itself (its ``GEMMS``, ``dispatch``/``combine``, ``LAYOUTS``).
        reasons: ``{candidate: why not}`` for every candidate not taken; one that could run but
            lost to a better one says ``"<winner> preferred"`` (or its own ``prefer`` reason).
        requested: what the ``kernel=`` argument asked for (``"auto"`` or a candidate name).
        error: ``None``, or why an explicit request cannot be honoured (the caller then raises).
        passed_over: the better-ranked candidates that could run but their own ``prefer`` passed over under
            ``auto`` (explain shows them per regime; their reasons are in ``reasons``).
    """

    family: str
    kernel: str
    implementation: ModuleType
    reasons: dict[str, str] = field(default_factory=dict)
    requested: str = "auto"
    error: str | None = None
    passed_over: tuple[str, ...] = ()

    def summary(self) -> str:
        """One line for explain and the logs: ``"triton [not taken: deepgemm: ...; reference: ...]"``."""
        if self.error is not None:
            return f"{self.kernel} requested but cannot run: {self.error}"
        why = "; ".join(f"{k}: {v}" for k, v in self.reasons.items())
        head = self.kernel if self.requested == "auto" else f"{self.kernel} (requested)"
        return head + (f" [not taken: {why}]" if why else "")


@functools.cache
def candidates(family: str) -> tuple[ModuleType, ...]:
    """The candidate modules of ``family``, best first; their names checked against the ops' contract."""
    if family not in FAMILIES:
        raise ValueError(f"moe_fx: unknown kernel family {family!r}; known: {sorted(FAMILIES)}")
    mods = tuple(importlib.import_module(path) for path in FAMILIES[family])
    names = {m.NAME for m in mods}
    if names != _CONTRACT[family] or len(names) != len(mods):
        # the ops accept a kernel name the lowering has no candidate for (or the other way round)
        raise RuntimeError(f"moe_fx: the {family} candidates {sorted(m.NAME for m in mods)} do not match the "
                           f"kernel names of the ops' contract {sorted(_CONTRACT[family])}")
    return mods


def decide(family: str, problem: object, caps: Capabilities, kernel: str = "auto") -> Choice:
    """The selection rule: a pure function of the problem, the device's capabilities and the kernel asked for.

    ``kernel="auto"`` takes the first candidate that can run and is not passed over by its own
    ``prefer``; an explicit kernel is honoured when it can run, else the choice carries ``error``
    (never a silent fallback).
    """
    mods = candidates(family)
    by_name = {m.NAME: m for m in mods}
    if kernel != "auto" and kernel not in by_name:
        raise ValueError(f"moe_fx: unknown {family} kernel {kernel!r}; known: {['auto', *by_name]}")
    verdicts = {m.NAME: m.supports(problem, caps) for m in mods}
    if kernel != "auto":
        ok, why = verdicts[kernel]
        return Choice(family, kernel, by_name[kernel], {n: "not requested" for n in by_name if n != kernel}, kernel,
                      None if ok else why)
    reasons: dict[str, str] = {}
    passed_over: list[str] = []
    for m in mods:
        ok, why = verdicts[m.NAME]
        if not ok:
            reasons[m.NAME] = why
            continue
        passed = m.prefer(problem, caps) if hasattr(m, "prefer") else None
        if passed is not None:
            reasons[m.NAME] = passed
            passed_over.append(m.NAME)
            continue
        for n in by_name:
            if n not in reasons and n != m.NAME:
                reasons[n] = f"{m.NAME} preferred" if verdicts[n][0] else verdicts[n][1]
        return Choice(family, m.NAME, m, reasons, kernel, passed_over=tuple(passed_over))
    raise RuntimeError(f"moe_fx: no {family} implementation can run {problem}: {reasons}")


_logged: set[tuple] = set()


def choose(
    family: str,
    problem: object,
    *,
    kernel: str = "auto",
    caps: Capabilities | None = None,
    device: object = None,
) -> Choice:
    """:func:`decide` with the real capabilities of ``device`` (probed once), logged once per problem.

    ``caps`` makes the call pure (tests; explain for a device this machine lacks).
    """
    if caps is None:
        caps = probe_capabilities(device if device is not None else getattr(problem, "device_type", None))
    choice = decide(family, problem, caps, kernel)
    key = (family, problem, caps, kernel)
    if key not in _logged:
        _logged.add(key)
        describe = getattr(problem, "describe", lambda: str(problem))
        log.info("moe_fx %s %s: %s", family, describe(), choice.summary())
    return choice


def choose_layout(
    problem: object, top_k: int, experts: Choice, *, layout: str = "auto", caps: Capabilities | None = None
) -> Choice:
    """The local row layout of a one-device experts problem once its experts kernel is chosen.

    Family ``"prepare_finalize"`` on a :class:`~moe_fx.lowering.problem.DispatchProblem` that carries
    the layouts the chosen kernel reads (its module's ``LAYOUTS``) and the problem's regime: the
    lowering's rule (:func:`moe_fx.lowering.experts.decide_experts_plan`). ``layout`` asks for one
    (``"auto"`` or a name of :data:`LOCAL_LAYOUTS`: benchmarks). The aligned contiguous layout takes no
    GEMM biases (its pipeline, :func:`~moe_fx.lowering.masked_experts.pipeline.run_contiguous_experts`,
    refuses them), so a problem with biases is not offered it.
    """
    from moe_fx.lowering.problem import DispatchProblem

    layouts = tuple(getattr(experts.implementation, "LAYOUTS", ()))
    if problem.w13_bias or problem.w2_bias:
        layouts = tuple(lay for lay in layouts if lay != "contiguous")
    local = DispatchProblem(1, problem.device_type, problem.dtype, problem.hidden, int(top_k), problem.num_experts,
                            use_fp8=problem.fp8, expert_parallel=False, experts_layouts=layouts, regime=problem.regime)
    return choose("prepare_finalize", local, kernel=layout, caps=caps, device=problem.device_type)


def layout_of(prepare: Choice | None) -> str:
    """``"sorted"``, ``"contiguous"`` or ``"masked"``: the row layout a prepare/finalize choice runs (masked
    without one)."""
    return "masked" if prepare is None else LOCAL_LAYOUTS[prepare.kernel]
