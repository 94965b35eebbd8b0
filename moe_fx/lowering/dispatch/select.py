"""Choosing the expert-parallel dispatch/combine backend (one place for the rule).

The rule (DESIGN.md, "Choosing kernels"), for ``backend="auto"``:

* ``"deepep_ll"``: DeepEP's low-latency kernels when ``deep_ep`` imports, the group has more than one
  rank, the tensors are bf16 on CUDA, the hidden size is one DeepEP's LL kernels are compiled for, the
  top-k is within its limit, ``max_tokens_per_rank * world`` is a multiple of 4 (its TMA rule) and, for
  fp8 dispatch, the hidden size is a multiple of 512;
* ``"torch_dist"``: ``all_to_all_single`` through torch.distributed (gloo on CPU, NCCL on GPU);
* ``"local"``: one rank and no DeepEP request: the torch_dist code without any collective.

An explicit ``backend="deepep"`` runs DeepEP even with one rank (that is how the single-GPU check
runs it) and raises, saying why, when DeepEP cannot run; ``backend="torch_dist"`` always runs.

Each candidate answers ``(ok, reason)`` from plain values (:func:`deepep_ll_supports`), so tests can
give capabilities as inputs and ``explain`` / the logs can say why DeepEP was not taken; the choice is
logged once per problem on the ``moe_fx.lowering`` logger.
"""

from __future__ import annotations

import functools
import importlib
import logging
from dataclasses import dataclass, field

import torch

__all__ = [
    "DEEPEP_LL_HIDDEN",
    "DEEPEP_LL_MAX_TOPK",
    "DispatchChoice",
    "DispatchProblem",
    "choose_dispatch_backend",
    "decide_dispatch_backend",
    "deepep_ll_supports",
    "probe_deep_ep",
]

log = logging.getLogger("moe_fx.lowering")

#: Hidden sizes the low-latency kernels of the DeepEP sources we build (V1 API, 2025-08) are compiled
#: for (their ``SWITCH_HIDDEN``); later versions add 3072.
DEEPEP_LL_HIDDEN: tuple[int, ...] = (2048, 2560, 4096, 5120, 6144, 7168, 8192)
#: Largest top-k of those sources' LL dispatch (``kNumMaxTopK = 9``; later versions allow 11).
DEEPEP_LL_MAX_TOPK = 9


def _dtype_name(dtype: torch.dtype | str) -> str:
    name = str(dtype)
    return name.removeprefix("torch.")


@dataclass(frozen=True)
class DispatchProblem:
    """What one dispatch/combine pair moves, as plain values (no tensors).

    Attributes:
        world_size: ranks in the EP group. device_type: ``"cuda"``/``"cpu"``. dtype: activation dtype name.
        hidden: H. top_k: K. num_experts: E (all ranks). max_tokens_per_rank: tokens per rank per step.
        use_fp8: dispatch quantises activations to fp8 with 1x128 scales.
    """

    world_size: int
    device_type: str
    dtype: str
    hidden: int
    top_k: int
    num_experts: int
    max_tokens_per_rank: int
    use_fp8: bool = False

    def describe(self) -> str:
        return (
            f"world={self.world_size} {self.dtype} H={self.hidden} K={self.top_k} E={self.num_experts} "
            f"max_tokens={self.max_tokens_per_rank}{' fp8' if self.use_fp8 else ''} on {self.device_type}"
        )


@dataclass(frozen=True)
class DispatchChoice:
    """The backend picked for a dispatch/combine pair and why the others were not.

    Attributes:
        backend: ``"deepep_ll"``, ``"torch_dist"`` or ``"local"``.
        reasons: ``{candidate: why not}`` for each candidate not taken.
        request: what was asked (``"auto"``, ``"deepep"``, ``"torch_dist"``).
        error: ``None``, or why an explicit request cannot be honoured.
    """

    backend: str
    reasons: dict[str, str] = field(default_factory=dict)
    request: str = "auto"
    error: str | None = None

    def summary(self) -> str:
        if self.error is not None:
            return f"{self.request} requested but cannot run: {self.error}"
        why = "; ".join(f"{k}: {v}" for k, v in self.reasons.items())
        return self.backend + (f" [not taken: {why}]" if why else "")


def deepep_ll_supports(
    problem: DispatchProblem,
    *,
    deep_ep_error: str | None,
    supported_hidden: tuple[int, ...] = DEEPEP_LL_HIDDEN,
    max_top_k: int = DEEPEP_LL_MAX_TOPK,
) -> tuple[bool, str]:
    """Can DeepEP's low-latency dispatch/combine run ``problem``? ``(True, "")`` or ``(False, reason)``.

    ``deep_ep_error`` is ``None`` when ``deep_ep`` imports, else why it does not.
    """
    if deep_ep_error is not None:
        return False, deep_ep_error
    if problem.device_type != "cuda":
        return False, f"needs CUDA tensors, got {problem.device_type}"
    if problem.dtype != "bfloat16":
        return False, f"needs bfloat16 activations, got {problem.dtype}"
    if problem.hidden not in supported_hidden:
        return False, f"hidden size {problem.hidden} not compiled into its LL kernels (supported: {supported_hidden})"
    if problem.top_k > max_top_k:
        return False, f"top-k {problem.top_k} above its limit {max_top_k}"
    if problem.num_experts % problem.world_size:
        return False, f"{problem.num_experts} experts not divisible by {problem.world_size} ranks"
    if (problem.max_tokens_per_rank * problem.world_size) % 4:
        return False, (
            f"max_tokens_per_rank * world = {problem.max_tokens_per_rank * problem.world_size} is not a multiple "
            "of 4 (its TMA rule)"
        )
    if problem.use_fp8 and problem.hidden % 512:
        return False, f"fp8 dispatch needs hidden % 512 == 0, got {problem.hidden}"
    return True, ""


def decide_dispatch_backend(
    problem: DispatchProblem,
    *,
    deep_ep_error: str | None,
    request: str = "auto",
    supported_hidden: tuple[int, ...] = DEEPEP_LL_HIDDEN,
    max_top_k: int = DEEPEP_LL_MAX_TOPK,
) -> DispatchChoice:
    """Pure rule (see module docstring): plain inputs in, :class:`DispatchChoice` out."""
    if request not in ("auto", "deepep", "torch_dist"):
        raise ValueError(f"moe_fx: unknown EP backend request {request!r}; known: auto, deepep, torch_dist")
    ok, why = deepep_ll_supports(
        problem, deep_ep_error=deep_ep_error, supported_hidden=supported_hidden, max_top_k=max_top_k
    )
    if request == "deepep":
        return DispatchChoice("deepep_ll", {}, request, None if ok else why)
    if request == "torch_dist":
        return DispatchChoice("torch_dist", {"deepep_ll": "torch_dist requested"}, request)
    if problem.world_size == 1:
        return DispatchChoice("local", {"deepep_ll": "one rank: no communication needed"}, request)
    if ok:
        return DispatchChoice("deepep_ll", {}, request)
    return DispatchChoice("torch_dist", {"deepep_ll": why}, request)


@functools.cache
def probe_deep_ep() -> str | None:
    """``None`` when ``deep_ep`` imports and has the LL API, else the reason (probed once per process)."""
    if importlib.util.find_spec("deep_ep") is None:
        return "deep_ep is not installed"
    try:
        deep_ep = importlib.import_module("deep_ep")
    except (ImportError, OSError) as e:  # a wheel built for another torch fails here (undefined symbols)
        return f"deep_ep failed to import ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
    buffer = getattr(deep_ep, "Buffer", None)
    if buffer is None or not hasattr(buffer, "low_latency_dispatch"):
        return "deep_ep has no Buffer.low_latency_dispatch (not the V1 API)"
    return None


_LOGGED: set[tuple] = set()


def choose_dispatch_backend(problem: DispatchProblem, request: str = "auto") -> DispatchChoice:
    """Probe DeepEP (once), apply :func:`decide_dispatch_backend`, and log the choice once per problem."""
    deep_ep_error = probe_deep_ep() if problem.device_type == "cuda" or request == "deepep" else "not probed off CUDA"
    choice = decide_dispatch_backend(problem, deep_ep_error=deep_ep_error, request=request)
    key = (problem, request)
    if key not in _LOGGED:
        _LOGGED.add(key)
        if choice.backend == "torch_dist" and request == "auto" and problem.device_type == "cuda":
            # A GPU fallback away from DeepEP is worth a warning: it is much slower at decode sizes.
            log.warning(
                "moe_fx EP %s: falling back to torch.distributed: %s",
                problem.describe(),
                choice.reasons.get("deepep_ll", ""),
            )
        else:
            log.info("moe_fx EP %s: %s", problem.describe(), choice.summary())
    return choice
