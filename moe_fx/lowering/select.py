"""Kernel selection for the ``moe_fx::experts`` op: the one place where the rule lives.

The rule (DESIGN.md, "Choosing kernels"), in order of preference for ``kernel="auto"``:

* ``"deepgemm"``: DeepGEMM's masked grouped GEMMs (``m_grouped_bf16_gemm_nt_masked`` /
  ``m_grouped_fp8_gemm_nt_masked``) when ``deep_gemm`` imports, the device is a CUDA GPU of SM90 or
  newer, activations are bfloat16, the gated activation is one the Triton activation kernel fuses
  (``silu``, ``gelu``, ``gelu_tanh``), both GEMMs' N and K are
  multiples of 128 (GEMM1: N = 2I, K = H; GEMM2: N = H, K = I) and, for fp8 weights, the weight
  block is 128x128;
  and the batch is not decode-sized: with at most :data:`DEEPGEMM_MIN_ROWS` rows per expert
  (``ceil(T * K / E)``, known at run time only) the GEMMs just stream weights, and Triton's
  decode tiles match or beat DeepGEMM there (H200, CUDA-graph replays of the whole layer: Qwen3-30B-A3B
  T=1 45 vs 67 µs bf16, 48 vs 60 fp8; elsewhere within 5%, bench/results/moe_layer_2026-12-02_v2.md);
* ``"triton"``: moe_fx's own Triton kernels when a CUDA GPU and Triton are present (fp8 weights
  need SM89+ there);
* ``"reference"``: the torch reference (CPU, or anything else).

Each candidate answers small capability questions with "ok" or the reason it cannot run
(:func:`experts_kernel_checks`, a pure function of plain values), so that ``moe_fx.explain()`` and the
logs can say why a kernel was not taken. :func:`probe_capabilities` gathers the real inputs (library
imports, GPU capability) once per device; :func:`choose_experts_kernel` combines both and logs every
choice once per problem shape on the ``moe_fx.lowering`` logger.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
from dataclasses import dataclass, field

import torch

__all__ = [
    "AUTO_ORDER",
    "Capabilities",
    "ExpertsChoice",
    "ExpertsProblem",
    "choose_experts_kernel",
    "decide_experts_kernel",
    "decode_rows",
    "experts_kernel_checks",
    "explain_kernel",
    "mark_kernel_unusable",
    "probe_capabilities",
]

log = logging.getLogger("moe_fx.lowering")

#: Candidates for ``kernel="auto"``, best first. ``"reference"`` always runs.
AUTO_ORDER: tuple[str, ...] = ("deepgemm", "triton", "reference")
#: DeepGEMM's tile edge: N and K of both GEMMs must be multiples of it, fp8 blocks must equal it.
DEEPGEMM_ALIGN = 128
#: At most this many rows per expert (``ceil(T * K / E)``), "auto" leaves DeepGEMM for Triton
#: (bench/results/moe_layer_2026-12-02_v2.md: Triton equal or faster at <= 4, DeepGEMM ahead from 16).
DEEPGEMM_MIN_ROWS = 4
#: The fp8 weight block DeepGEMM's 1D2D recipe (and our Triton kernels) understand.
SUPPORTED_FP8_BLOCK = (128, 128)
#: Activation dtypes each GPU kernel accepts (fp8 weights need bf16 activations in both).
_TRITON_DTYPES = ("bfloat16", "float16", "float32")
_TRITON_FP8_DTYPES = ("bfloat16",)
#: Gated activations fused by the Triton kernels (all of moe_fx.ops.ACTIVATIONS) and by the DeepGEMM path.
_TRITON_ACTIVATIONS = ("silu", "gelu", "gelu_tanh")
_DEEPGEMM_ACTIVATIONS = _TRITON_ACTIVATIONS  # the activation between the GEMMs is the Triton kernel
#: Environment switch for users and benchmarks: ``MOE_FX_DISABLE_DEEPGEMM=1`` makes "auto" skip DeepGEMM.
DISABLE_DEEPGEMM_ENV = "MOE_FX_DISABLE_DEEPGEMM"
#: Where users learn how to install a DeepGEMM that matches their torch.
DEEPGEMM_DOC = "docs/deepgemm.md"


def _dtype_name(dtype: torch.dtype | str) -> str:
    """``torch.bfloat16`` / ``"torch.bfloat16"`` / ``"bfloat16"`` -> ``"bfloat16"``."""
    name = str(dtype)
    return name[len("torch.") :] if name.startswith("torch.") else name


@dataclass(frozen=True)
class ExpertsProblem:
    """What the experts op is asked to compute, as plain values (no tensors).

    Attributes:
        device_type: ``"cuda"``, ``"cpu"``, ...
        dtype: activation dtype name (``"bfloat16"``, ``"float16"``, ``"float32"``).
        num_experts: E. hidden: H. intermediate: I (GEMM1 is ``[*, H] x [2I, H]^T``, GEMM2 ``[*, I] x [H, I]^T``).
        fp8_block: ``None`` for unquantised weights, else the (N, K) edge of the fp8 weight-scale blocks.
        activation: gated activation name (``"silu"`` = SwiGLU).
        decode_rows: rows per expert of this call's batch when it is decode-sized (at most
            :data:`DEEPGEMM_MIN_ROWS`), else ``None`` (larger batch, or not known: explain).
    """

    device_type: str
    dtype: str
    num_experts: int
    hidden: int
    intermediate: int
    fp8_block: tuple[int, int] | None = None
    activation: str = "silu"
    decode_rows: int | None = None

    @property
    def fp8(self) -> bool:
        return self.fp8_block is not None

    def gemm_shapes(self) -> dict[str, tuple[int, int]]:
        """``{"gemm1": (N, K), "gemm2": (N, K)}`` of the two expert GEMMs."""
        return {"gemm1": (2 * self.intermediate, self.hidden), "gemm2": (self.hidden, self.intermediate)}

    def describe(self) -> str:
        w = f"fp8 {self.fp8_block[0]}x{self.fp8_block[1]}" if self.fp8_block else self.dtype
        dims = f"E={self.num_experts} H={self.hidden} I={self.intermediate}"
        rows = f" ({self.decode_rows} rows per expert)" if self.decode_rows is not None else ""
        return f"{dims} {self.dtype} weights={w} on {self.device_type}{rows}"


@dataclass(frozen=True)
class Capabilities:
    """What a device offers, as plain values; ``None`` in a ``*_error`` field means "usable".

    Attributes:
        device_type: ``"cuda"``, ``"cpu"``, ...
        capability: CUDA compute capability ``(major, minor)``, ``None`` off CUDA.
        deep_gemm_error: why ``deep_gemm`` cannot be used (not installed, failed to import, lacks the
            masked GEMMs, disabled by the environment, failed at run time), or ``None``.
        triton_error: why Triton cannot be used, or ``None``.
    """

    device_type: str
    capability: tuple[int, int] | None = None
    deep_gemm_error: str | None = None
    triton_error: str | None = None


@dataclass(frozen=True)
class ExpertsChoice:
    """The kernel picked for an experts op, and why each other candidate was not taken.

    Attributes:
        kernel: the kernel that will run (``"deepgemm"``, ``"triton"`` or ``"reference"``).
        reasons: for each candidate that was not taken, why (``{kernel: reason}``); a candidate that
            could run but lost to a better one has the reason ``"<winner> preferred"``.
        request: what was asked for (``"auto"`` or a kernel name).
        error: ``None``, or why an explicit request cannot be honoured (the op then raises).
    """

    kernel: str
    reasons: dict[str, str] = field(default_factory=dict)
    request: str = "auto"
    error: str | None = None

    def summary(self) -> str:
        """One line for explain and the logs: ``"deepgemm (triton: deepgemm preferred; ...)"``."""
        if self.error is not None:
            return f"{self.kernel} requested but cannot run: {self.error}"
        why = "; ".join(f"{k}: {v}" for k, v in self.reasons.items())
        head = self.kernel if self.request == "auto" else f"{self.kernel} (requested)"
        return f"{head}" + (f" [not taken: {why}]" if why else "")


def _unaligned(problem: ExpertsProblem) -> list[str]:
    bad = []
    for gemm, (n, k) in problem.gemm_shapes().items():
        for dim, v in (("N", n), ("K", k)):
            if v % DEEPGEMM_ALIGN:
                bad.append(f"{gemm} {dim}={v}")
    return bad


def _check_deepgemm(problem: ExpertsProblem, caps: Capabilities) -> str | None:
    if caps.deep_gemm_error is not None:
        return caps.deep_gemm_error
    if caps.triton_error is not None:
        # Dispatch, activation and combine around DeepGEMM's GEMMs are moe_fx's Triton kernels.
        return f"its dispatch/activation/combine kernels need Triton: {caps.triton_error}"
    if problem.device_type != "cuda" or caps.device_type != "cuda":
        return f"needs a CUDA GPU, device is {problem.device_type}"
    if caps.capability is None or caps.capability < (9, 0):
        cap = "unknown" if caps.capability is None else f"SM{caps.capability[0]}{caps.capability[1]}"
        return f"needs SM90 or newer (Hopper), GPU is {cap}"
    if problem.dtype != "bfloat16":
        return f"needs bfloat16 activations, got {problem.dtype}"
    if problem.activation not in _DEEPGEMM_ACTIVATIONS:
        return f"activation {problem.activation!r} is not fused; fused: {', '.join(_DEEPGEMM_ACTIVATIONS)}"
    bad = _unaligned(problem)
    if bad:
        return f"N and K of both GEMMs must be multiples of {DEEPGEMM_ALIGN}: {', '.join(bad)}"
    if problem.fp8_block is not None and tuple(problem.fp8_block) != SUPPORTED_FP8_BLOCK:
        return f"fp8 weights need 128x128 blocks, got {problem.fp8_block[0]}x{problem.fp8_block[1]}"
    return None


def decode_rows(num_tokens: int, top_k: int, num_experts: int) -> int | None:
    """``ceil(T * K / E)`` when it is at most :data:`DEEPGEMM_MIN_ROWS` (a decode-sized batch), else None."""
    rows = -(-num_tokens * top_k // max(num_experts, 1))
    return rows if rows <= DEEPGEMM_MIN_ROWS else None


def _check_triton(problem: ExpertsProblem, caps: Capabilities) -> str | None:
    if caps.triton_error is not None:
        return caps.triton_error
    if problem.device_type != "cuda" or caps.device_type != "cuda":
        return f"needs a CUDA GPU, device is {problem.device_type}"
    if problem.fp8_block is not None:
        if tuple(problem.fp8_block) != SUPPORTED_FP8_BLOCK:
            return f"fp8 weights need 128x128 blocks, got {problem.fp8_block[0]}x{problem.fp8_block[1]}"
        if problem.dtype not in _TRITON_FP8_DTYPES:
            return f"fp8 weights need bfloat16 activations, got {problem.dtype}"
        # Triton's e4m3 dot needs the fp8 tensor cores of Ada/Hopper (SM89+).
        if caps.capability is None or caps.capability < (8, 9):
            cap = "unknown" if caps.capability is None else f"SM{caps.capability[0]}{caps.capability[1]}"
            return f"fp8 GEMMs need SM89 or newer, GPU is {cap}"
    elif problem.dtype not in _TRITON_DTYPES:
        return f"unsupported activation dtype {problem.dtype}"
    if problem.activation not in _TRITON_ACTIVATIONS:
        return f"activation {problem.activation!r} is not fused; fused: {', '.join(_TRITON_ACTIVATIONS)}"
    return None


_CHECKS = {"deepgemm": _check_deepgemm, "triton": _check_triton, "reference": lambda p, c: None}


def experts_kernel_checks(problem: ExpertsProblem, caps: Capabilities) -> dict[str, str | None]:
    """Ask every candidate whether it can run ``problem`` on ``caps``: ``{kernel: None or reason}``. Pure."""
    return {name: _CHECKS[name](problem, caps) for name in AUTO_ORDER}


def decide_experts_kernel(problem: ExpertsProblem, caps: Capabilities, request: str = "auto") -> ExpertsChoice:
    """The selection rule: a pure function of the problem, the device's capabilities and the request.

    ``request="auto"`` takes the first candidate of :data:`AUTO_ORDER` that can run; an explicit
    request is honoured when it can run, else the choice carries ``error`` (never a silent fallback).
    """
    if request != "auto" and request not in _CHECKS:
        raise ValueError(f"moe_fx: unknown kernel request {request!r}; known: {('auto',) + AUTO_ORDER}")
    checks = experts_kernel_checks(problem, caps)
    if request != "auto":
        reasons = {k: "not requested" for k in AUTO_ORDER if k != request}
        return ExpertsChoice(request, reasons, request, checks[request])
    winner = next(k for k in AUTO_ORDER if checks[k] is None)
    reasons = {k: (checks[k] or f"{winner} preferred") for k in AUTO_ORDER if k != winner}
    if winner == "deepgemm" and problem.decode_rows is not None and checks["triton"] is None:
        # a preference, not a capability: an explicit impl="deepgemm" still runs DeepGEMM here
        winner = "triton"
        reasons = {k: f"{winner} preferred" for k in AUTO_ORDER if k != winner}
        reasons["deepgemm"] = (
            f"decode-size batch ({problem.decode_rows} rows per expert <= {DEEPGEMM_MIN_ROWS}): "
            "Triton's decode tiles stream the weights as fast or faster"
        )
    return ExpertsChoice(winner, reasons, request)


# ---------------------------------------------------------------------------------------------------
# Probing the real capabilities (once per device) and runtime demotions.

_runtime_unusable: dict[str, str] = {}


def mark_kernel_unusable(kernel: str, reason: str) -> None:
    """Record that ``kernel`` failed at run time (e.g. DeepGEMM's JIT found no NVCC) so "auto" skips it."""
    if kernel not in ("deepgemm", "triton"):
        raise ValueError(f"moe_fx: cannot mark {kernel!r} unusable")
    _runtime_unusable[kernel] = reason
    probe_capabilities.cache_clear()


def _deep_gemm_error() -> str | None:
    if os.environ.get(DISABLE_DEEPGEMM_ENV, "0") not in ("", "0"):
        return f"disabled by {DISABLE_DEEPGEMM_ENV}={os.environ[DISABLE_DEEPGEMM_ENV]}"
    try:
        dg = importlib.import_module("deep_gemm")
    except ModuleNotFoundError:
        return f"deep_gemm is not installed (see {DEEPGEMM_DOC} to build one that matches torch {torch.__version__})"
    except (ImportError, OSError, RuntimeError) as e:
        # Typically a wheel built for another torch: undefined symbols in its extension.
        return f"deep_gemm failed to import ({type(e).__name__}: {e}); see {DEEPGEMM_DOC}"
    missing = [f for f in ("m_grouped_bf16_gemm_nt_masked", "m_grouped_fp8_gemm_nt_masked") if not hasattr(dg, f)]
    if missing:
        return f"deep_gemm {getattr(dg, '__version__', '?')} lacks {', '.join(missing)} (need DeepGEMM >= 2.0)"
    return None


def _triton_error() -> str | None:
    try:
        importlib.import_module("triton")
    except ImportError as e:
        return f"triton is not installed ({e})"
    return None


@functools.lru_cache(maxsize=None)
def _probe(device_type: str, index: int | None) -> Capabilities:
    if device_type != "cuda":
        return Capabilities(device_type, None, f"needs a CUDA GPU, device is {device_type}", None)
    if not torch.cuda.is_available():
        why = "no CUDA device is available"
        return Capabilities("cuda", None, why, why)
    capability = tuple(torch.cuda.get_device_capability(index))
    dg = _runtime_unusable.get("deepgemm") or _deep_gemm_error()
    tr = _runtime_unusable.get("triton") or _triton_error()
    caps = Capabilities("cuda", capability, dg, tr)
    if dg is not None:
        log.info("moe_fx: DeepGEMM unavailable on cuda:%s (%s); expert GEMMs use Triton", index, dg)
    return caps


def probe_capabilities(device: torch.device | str | None = None) -> Capabilities:
    """Gather the real capability inputs for ``device`` once (cached): libraries, SM version."""
    if device is None:
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    index = device.index
    if device.type == "cuda" and index is None and torch.cuda.is_available():
        index = torch.cuda.current_device()
    return _probe(device.type, index)


probe_capabilities.cache_clear = _probe.cache_clear  # type: ignore[attr-defined]


# ---------------------------------------------------------------------------------------------------
# The entry points used by the op registration and by explain.

_logged: set[tuple] = set()


def _problem(
    device_type: str,
    dtype: torch.dtype | str,
    num_experts: int,
    hidden: int,
    intermediate: int,
    fp8: bool,
    fp8_block: tuple[int, int] | None,
    activation: str,
    rows: int | None = None,
) -> ExpertsProblem:
    block = (tuple(fp8_block) if fp8_block is not None else SUPPORTED_FP8_BLOCK) if fp8 else None
    return ExpertsProblem(
        device_type, _dtype_name(dtype), num_experts, hidden, intermediate, block, activation, rows
    )


def choose_experts_kernel(
    *,
    device_type: str,
    dtype: torch.dtype | str,
    hidden: int,
    intermediate: int,
    num_experts: int,
    request: str = "auto",
    fp8: bool = False,
    fp8_block: tuple[int, int] | None = None,
    activation: str = "silu",
    caps: Capabilities | None = None,
    device: torch.device | str | None = None,
    rows_per_expert: int | None = None,
) -> ExpertsChoice:
    """Pick the experts kernel for a problem given as plain values; log the choice once per shape.

    ``caps`` makes the call pure (tests, explain on a machine without the GPU); without it the
    capabilities of ``device`` (default: the current device of ``device_type``) are probed once.
    ``rows_per_expert``: :func:`decode_rows` of the call's batch (None: not decode-sized, or unknown).
    """
    problem = _problem(
        device_type, dtype, num_experts, hidden, intermediate, fp8, fp8_block, activation, rows_per_expert
    )
    if caps is None:
        caps = probe_capabilities(device if device is not None else device_type)
    choice = decide_experts_kernel(problem, caps, request)
    key = (problem, caps, request)
    if key not in _logged:
        _logged.add(key)
        log.info("moe_fx.experts %s: %s", problem.describe(), choice.summary())
    return choice


def explain_kernel(
    device_type: str,
    dtype: torch.dtype | str,
    num_experts: int,
    hidden: int,
    intermediate: int,
    fp8: bool = False,
    *,
    request: str = "auto",
    fp8_block: tuple[int, int] | None = None,
    activation: str = "silu",
    caps: Capabilities | None = None,
) -> tuple[str, dict[str, str]]:
    """For ``moe_fx.explain()``: ``(kernel, {other kernel: why not})`` for one experts layer.

    An explicit request that cannot run is reported as kernel ``"<request> (cannot run)"`` with the
    reason under the request's own name.
    """
    choice = choose_experts_kernel(
        device_type=device_type,
        dtype=dtype,
        hidden=hidden,
        intermediate=intermediate,
        num_experts=num_experts,
        request=request,
        fp8=fp8,
        fp8_block=fp8_block,
        activation=activation,
        caps=caps,
    )
    if choice.error is not None:
        return f"{choice.kernel} (cannot run)", {choice.kernel: choice.error, **choice.reasons}
    if choice.kernel == "deepgemm" and request == "auto":
        # explain sees no batch: say what decode-sized batches run instead
        return "deepgemm", {
            **choice.reasons,
            "triton": f"deepgemm preferred; triton runs batches of <= {DEEPGEMM_MIN_ROWS} rows per expert",
        }
    return choice.kernel, dict(choice.reasons)
