"""What a kernel choice depends on, as plain values (no tensors), and what a device offers.

* :class:`ExpertsProblem` — one masked-experts computation (E, H, I, dtype, fp8, activation, biases,
  weight layout, and the rows-per-expert regime when it is known);
* :class:`DispatchProblem` — one prepare/finalize pair (local permute, or expert-parallel dispatch and
  combine over a process group);
* :class:`Capabilities` and :func:`probe_capabilities` — the libraries and GPU a device has, probed
  once per device;
* :func:`rows_per_expert` and :func:`row_regime` — the one home of the rows-per-expert estimate and of
  the few token-count regimes a compiled graph specialises on.

Everything a kernel choice reads is fixed when a graph is compiled except the token count T; the
choices that depend on T (DeepGEMM or Triton at decode sizes, decode or prefill GEMM tiles) are
made per *regime* of ``ceil(T * K / E)``, so a graph with a dynamic T carries a guard on its regime
and a call in another regime compiles one more graph (at most ``len(ROW_REGIMES) + 1``).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from moe_fx.ops import ExpertActivation

__all__ = [
    "DISABLE_DEEPGEMM_ENV",
    "ROW_REGIMES",
    "Capabilities",
    "assume_capabilities",
    "DispatchProblem",
    "ExpertsProblem",
    "dtype_name",
    "mark_unusable",
    "probe_capabilities",
    "row_regime",
    "rows_per_expert",
    "size_hint",
]

log = logging.getLogger("moe_fx.lowering")

#: Environment switch for users and benchmarks: ``MOE_FX_DISABLE_DEEPGEMM=1`` makes "auto" skip DeepGEMM.
DISABLE_DEEPGEMM_ENV = "MOE_FX_DISABLE_DEEPGEMM"
#: Where users learn how to install a DeepGEMM that matches their torch.
DEEPGEMM_DOC = "docs/deepgemm.md"
#: Upper bounds of the rows-per-expert regimes: <= 4 rows (decode: Triton's streaming tiles beat
#: DeepGEMM, bench/results/moe_layer_2026-12-02_v2.md), <= 16 (16-row tiles stream the weights), <= 64,
#: <= 256, more (prefill tiles). Each regime has one tile configuration per GEMM, tuned over every
#: token count of the regime (bench/tune_tiles.py), so a graph compiled for a dynamic T runs tiles
#: chosen for its regime, not for the T it was traced with. Five regimes: with the graph of the first
#: (static) shape, six graphs at most, inside Dynamo's default recompile limit of 8.
ROW_REGIMES: tuple[int, ...] = (4, 16, 64, 256)


def dtype_name(dtype: torch.dtype | str) -> str:
    """``torch.bfloat16`` / ``"torch.bfloat16"`` / ``"bfloat16"`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def size_hint(size: int | torch.SymInt) -> int:
    """A plain int for a size: a SymInt's value when it was traced (for host-side choices only: a graph with a
    symbolic size serves other sizes with the same choice), an int as it is."""
    if isinstance(size, torch.SymInt):
        node = size.node
        return int(node.hint if node.hint is not None else node.shape_env.size_hint(node.expr))
    return int(size)


def rows_per_expert(num_tokens: object, top_k: int, num_experts: int) -> object:
    """Uniform-load estimate of the rows each expert gets, ``ceil(T * K / E)`` (at least 1).

    The one home of this estimate: tile buckets, DeepGEMM's ``expected_m`` hint and the regimes
    below all derive from it. ``num_tokens`` may be a SymInt (the result then is one too).
    """
    rows = (num_tokens * top_k + num_experts - 1) // max(num_experts, 1)
    return torch.sym_max(rows, 1)


def row_regime(rows: object) -> int:
    """Index of the :data:`ROW_REGIMES` regime of ``rows`` (``len(ROW_REGIMES)`` above the last bound).

    With a symbolic ``rows`` every comparison made here becomes a guard of the compiled graph: this
    is the one place where moe_fx specialises a graph on its token count.
    """
    for i, bound in enumerate(ROW_REGIMES):
        if rows <= bound:
            return i
    return len(ROW_REGIMES)


def regime_bounds(regime: int) -> tuple[int, int | None]:
    """``(lowest, highest)`` rows of a regime (``None``: unbounded)."""
    lo = 1 if regime == 0 else ROW_REGIMES[regime - 1] + 1
    hi = ROW_REGIMES[regime] if regime < len(ROW_REGIMES) else None
    return lo, hi


@dataclass(frozen=True)
class ExpertsProblem:
    """One masked-experts computation (GEMM1 -> activation -> GEMM2 on ``[E, M, *]``), as plain values.

    Attributes:
        device_type: ``"cuda"``, ``"cpu"``, ...
        dtype: activation dtype name (``"bfloat16"``, ``"float16"``, ``"float32"``).
        num_experts: E. hidden: H. intermediate: I (GEMM1 is ``[*, H] x [N1, H]^T``, GEMM2 ``[*, I] x [H, I]^T``).
        activation: what runs between the GEMMs.
        fp8_block: ``None`` for unquantised weights, else the (N, K) edge of the fp8 weight-scale blocks.
        w13_bias, w2_bias: whether the GEMMs have biases.
        k_major: whether both weights are K-major and contiguous (``[E, N, K]``, unit K stride).
        regime: :func:`row_regime` of the call's rows per expert, or ``None`` when unknown.
        masked_rows: ``M`` of a ``masked_experts`` call's ``[E, M, H]`` layout (fixed by the dispatch), or
            ``None`` for ``moe_fx::experts`` (whose local layout the lowering sizes itself).
    """

    device_type: str
    dtype: str
    num_experts: int
    hidden: int
    intermediate: int
    activation: ExpertActivation = ExpertActivation()
    fp8_block: tuple[int, int] | None = None
    w13_bias: bool = False
    w2_bias: bool = False
    k_major: bool = True
    regime: int | None = None
    masked_rows: int | None = None

    @property
    def fp8(self) -> bool:
        """Whether the expert weights are fp8 with block scales (``fp8_block`` set)."""
        return self.fp8_block is not None

    def gemm_shapes(self) -> dict[str, tuple[int, int]]:
        """``{"gemm1": (N, K), "gemm2": (N, K)}`` of the two expert GEMMs."""
        return {"gemm1": (self.activation.columns(self.intermediate), self.hidden),
                "gemm2": (self.hidden, self.intermediate)}

    def describe(self) -> str:
        """One line for logs: sizes, dtypes, activation, regime."""
        w = f"fp8 {self.fp8_block[0]}x{self.fp8_block[1]}" if self.fp8_block else self.dtype
        dims = f"E={self.num_experts} H={self.hidden} I={self.intermediate}"
        extras = "".join(s for s, on in ((" +bias13", self.w13_bias), (" +bias2", self.w2_bias)) if on)
        rows = ""
        if self.regime is not None:
            lo, hi = regime_bounds(self.regime)
            rows = f" ({lo}..{hi if hi is not None else ''} rows per expert)"
        return f"{dims} {self.dtype} weights={w} act={self.activation.describe()}{extras} on {self.device_type}{rows}"


@dataclass(frozen=True)
class DispatchProblem:
    """One prepare/finalize pair, as plain values.

    Attributes:
        world_size: ranks in the EP group (1 for the local permute).
        device_type: ``"cuda"``/``"cpu"``. dtype: activation dtype name.
        hidden: H. top_k: K. num_experts: E (all ranks).
        max_tokens_per_rank: tokens per rank per step (EP), 0 for the local permute.
        use_fp8: prepare quantises activations to fp8 with 1x128 scales.
        expert_parallel: ``True`` for ``moe_fx::ep_dispatch`` / ``ep_combine`` (a process group),
            ``False`` for the local layouts inside ``moe_fx::experts``.
        experts_layouts: the row layouts the chosen experts kernel reads (``"masked"``, ``"sorted"``).
        regime: the call's rows-per-expert regime (:func:`row_regime`), ``None`` when unknown.
    """

    world_size: int
    device_type: str
    dtype: str
    hidden: int
    top_k: int
    num_experts: int
    max_tokens_per_rank: int = 0
    use_fp8: bool = False
    expert_parallel: bool = True
    experts_layouts: tuple[str, ...] = ("masked",)
    regime: int | None = None

    def describe(self) -> str:
        """One line for logs."""
        where = f"world={self.world_size} max_tokens={self.max_tokens_per_rank}" if self.expert_parallel else "local"
        if self.regime is not None:
            lo, hi = regime_bounds(self.regime)
            where += f" ({lo}..{hi if hi is not None else ''} rows per expert)"
        return (f"{where} {self.dtype} H={self.hidden} K={self.top_k} E={self.num_experts}"
                f"{' fp8' if self.use_fp8 else ''} on {self.device_type}")


@dataclass(frozen=True)
class Capabilities:
    """What a device offers, as plain values; ``None`` in a ``*_error`` field means "usable".

    Attributes:
        device_type: ``"cuda"``, ``"cpu"``, ...
        capability: CUDA compute capability ``(major, minor)``, ``None`` off CUDA.
        deep_gemm_error: why ``deep_gemm`` cannot be used (not installed, failed to import, lacks the
            masked GEMMs, disabled by the environment, failed at run time), or ``None``.
        triton_error: why Triton cannot be used, or ``None``.
        deep_ep_error: why ``deep_ep``'s low-latency kernels cannot be used, or ``None``.
        num_sms: streaming multiprocessors (persistent-grid sizing), 0 off CUDA.
        device_name: the GPU's name (keys the tuned tile tables), or the device type.
    """

    device_type: str
    capability: tuple[int, int] | None = None
    deep_gemm_error: str | None = None
    triton_error: str | None = None
    deep_ep_error: str | None = "not probed"
    num_sms: int = 0
    device_name: str = ""


_runtime_unusable: dict[str, str] = {}


def mark_unusable(library: str, reason: str) -> None:
    """Record that ``library`` (``"deepgemm"``) failed at run time so later choices skip it."""
    if library not in ("deepgemm", "triton"):
        raise ValueError(f"moe_fx: cannot mark {library!r} unusable")
    _runtime_unusable[library] = reason
    _probe.cache_clear()


def _deep_gemm_error() -> str | None:
    if os.environ.get(DISABLE_DEEPGEMM_ENV, "0") not in ("", "0"):
        return f"disabled by {DISABLE_DEEPGEMM_ENV}={os.environ[DISABLE_DEEPGEMM_ENV]}"
    if importlib.util.find_spec("deep_gemm") is None:
        return f"deep_gemm is not installed (see {DEEPGEMM_DOC} to build one that matches torch {torch.__version__})"
    try:
        dg = importlib.import_module("deep_gemm")
    except (ImportError, OSError, RuntimeError) as e:
        # Typically a wheel built for another torch: undefined symbols in its extension.
        return f"deep_gemm failed to import ({type(e).__name__}: {e}); see {DEEPGEMM_DOC}"
    missing = [f for f in ("m_grouped_bf16_gemm_nt_masked", "m_grouped_fp8_gemm_nt_masked") if not hasattr(dg, f)]
    if missing:
        return f"deep_gemm {getattr(dg, '__version__', '?')} lacks {', '.join(missing)} (need DeepGEMM >= 2.0)"
    return None


def _triton_error() -> str | None:
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    try:
        importlib.import_module("triton")
    except ImportError as e:
        return f"triton failed to import ({e})"
    return None


def _deep_ep_error() -> str | None:
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


@functools.lru_cache(maxsize=None)
def _probe(device_type: str, index: int | None) -> Capabilities:
    triton = _runtime_unusable.get("triton") or _triton_error()
    if device_type != "cuda":
        why = f"needs a CUDA GPU, device is {device_type}"
        return Capabilities(device_type, None, why, triton, why, 0, device_type)
    if not torch.cuda.is_available():
        why = "no CUDA device is available"
        return Capabilities("cuda", None, why, why, why, 0, "cuda")
    capability = tuple(torch.cuda.get_device_capability(index))
    dg = _runtime_unusable.get("deepgemm") or _deep_gemm_error()
    props = torch.cuda.get_device_properties(index)
    caps = Capabilities("cuda", capability, dg, triton, _deep_ep_error(), props.multi_processor_count, props.name)
    if dg is not None:
        log.info("moe_fx: DeepGEMM unavailable on cuda:%s (%s); expert GEMMs use Triton", index, dg)
    return caps


_assumed: dict[str, Capabilities] = {}


@contextlib.contextmanager
def assume_capabilities(caps: Capabilities) -> Iterator[None]:
    """Within the block, devices of ``caps.device_type`` are taken to have ``caps`` instead of being probed.

    For compiling (and testing the compiled code) for a GPU this machine lacks: with fake CUDA tensors
    and an assumed H200, a CPU machine traces exactly the graph the H200 would run.
    """
    old = _assumed.get(caps.device_type)
    _assumed[caps.device_type] = caps
    try:
        yield
    finally:
        if old is None:
            del _assumed[caps.device_type]
        else:
            _assumed[caps.device_type] = old


def probe_capabilities(device: torch.device | str | None = None) -> Capabilities:
    """Gather the real capability inputs for ``device`` once (cached): libraries, SM version, SM count."""
    if device is not None and torch.device(device).type in _assumed:
        return _assumed[torch.device(device).type]
    if device is None:
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    index = device.index
    if device.type == "cuda" and index is None and torch.cuda.is_available():
        index = torch.cuda.current_device()
    return _probe(device.type, index)


probe_capabilities.cache_clear = _probe.cache_clear  # type: ignore[attr-defined]
