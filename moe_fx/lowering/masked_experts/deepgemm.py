"""DeepGEMM's masked grouped GEMMs as the experts pipeline's GEMMs (Hopper; 128-aligned; bf16 or fp8 1x128/128x128).

``deep_gemm.m_grouped_{bf16,fp8}_gemm_nt_masked`` are C++ entry points, not Triton kernels: they are
exposed as the op ``moe_fx_kernels::deepgemm_masked_gemm`` (defined with ``torch.library.Library``, so
a call goes straight from the dispatcher to its kernel), which Inductor's generated code calls as an
extern kernel between the Triton launches of the rest of the pipeline. Layout duties (what DeepGEMM
reads, :mod:`moe_fx.lowering.layouts`): K-major operands, MN-major TMA-aligned fp32 activation scales
(the permute and the activation kernel write them in place), contiguous 128x128 weight scales,
``M`` a multiple of 256 (DeepGEMM stores whole row tiles, which must not spill into the next expert).

If DeepGEMM fails at run time (its JIT compiler missing, for instance), the op logs the reason once,
marks DeepGEMM unusable for the process (later compilations choose Triton) and computes the GEMM with
the Triton kernel instead, so a graph compiled for DeepGEMM still runs.
"""

from __future__ import annotations

import importlib
import logging
from types import ModuleType

import torch

from moe_fx.lowering.masked_experts.pipeline import GemmHints
from moe_fx.lowering.problem import DEEPGEMM_DOC, ROW_REGIMES, Capabilities, ExpertsProblem, mark_unusable
from moe_fx.ops.recipe import FP8_BLOCK, FP8_DTYPE, cdiv

__all__ = ["CONTIGUOUS_M_ALIGN", "GEMMS", "LAYOUTS", "LOCAL_CHOICE_SOURCE", "LOCAL_FROM_REGIME", "MASKED_M_ALIGN",
           "NAME", "DeepGemms", "deepgemm_expected_m", "prefer", "supports"]

log = logging.getLogger("moe_fx.lowering")

NAME = "deepgemm"
#: the row layouts its GEMMs read: masked, and contiguous with 128-aligned expert segments (its m-grouped
#: contiguous GEMMs; under auto from the top rows-per-expert regime on, prepare_finalize/local_contiguous.py)
LAYOUTS = ("masked", "contiguous")
#: N and K of both GEMMs must be multiples of DeepGEMM's tile edge; fp8 blocks must equal it.
ALIGN = 128
#: Rows per expert of DeepGEMM's masked layout are rounded up to this (see the module docstring).
MASKED_M_ALIGN = 256
#: Rows added to the uniform-load estimate in DeepGEMM's ``expected_m`` hint. DeepGEMM picks its tiles and the SMs
#: it runs on from the hint (on SM90 the fewest SMs that keep the hint's number of waves), while random routing
#: sends about half the experts more rows than the mean, whose extra tiles then run on those SMs. More SMs did not
#: pay (64 rows of slack or max_m: 0.89-1.00x, Mixtral at T=1024 the loss; docs/deepgemm.md), hence 0. An A/B of
#: one layer: ``bench/fused_activation.py --switch dg_hint``.
EXPECTED_M_SLACK = 0
#: Each expert's segment of the contiguous layout is whole blocks of this many rows
#: (``deep_gemm.get_mk_alignment_for_contiguous_layout()`` in v2.1).
CONTIGUOUS_M_ALIGN = 128
#: Under ``auto`` on one GPU, by weight kind (fp8 or not), the first rows-per-expert regime (an index into
#: :data:`~moe_fx.lowering.problem.ROW_REGIMES`) where DeepGEMM is preferred to Triton's sorted layout; ``None``:
#: never. Measured (:data:`LOCAL_CHOICE_SOURCE`): fp8 DeepGEMM is 1.20-1.42x faster above 64 rows per expert
#: (H100, same run: Mixtral T=4096 2890 vs 4110 µs) and slower up to 64 (H200: DeepSeek-V3 shard T=256 481 vs
#: 429 µs); bf16 DeepGEMM is slower than or level with Triton's sorted layout at every size measured (H100, same
#: run, 256 to 4096 rows per expert: Qwen3 T=4096 870 vs 734 µs, Mixtral T=1024 1515 vs 1381, the two T=16384
#: rows within 0.5%).
LOCAL_FROM_REGIME: dict[bool, int | None] = {False: None, True: 3}
#: The results file (repository path) of :data:`LOCAL_FROM_REGIME`'s figures: the rows and the runs they come from.
LOCAL_CHOICE_SOURCE = "bench/results/deepgemm_vs_triton_2026-12-06_h100.md"
#: Activations DeepGEMM's path supports: the activation runs in moe_fx's Triton kernel between the GEMMs.
_ACTIVATIONS = ("silu", "gelu", "gelu_tanh", "relu", "relu2")


def supports(problem: ExpertsProblem, caps: Capabilities) -> tuple[bool, str]:
    """Can DeepGEMM's masked GEMMs run ``problem`` on ``caps``? ``(True, "")`` or ``(False, reason)``."""
    if caps.deep_gemm_error is not None:
        return False, caps.deep_gemm_error
    if caps.triton_error is not None:
        return False, f"its permute/activation kernels need Triton: {caps.triton_error}"
    if problem.device_type != "cuda" or caps.device_type != "cuda":
        return False, f"needs a CUDA GPU, device is {problem.device_type}"
    if caps.capability is None or caps.capability < (9, 0):
        cap = "unknown" if caps.capability is None else f"SM{caps.capability[0]}{caps.capability[1]}"
        return False, f"needs SM90 or newer (Hopper), GPU is {cap}"
    if problem.dtype != "bfloat16":
        return False, f"needs bfloat16 activations, got {problem.dtype}"
    if problem.activation.name not in _ACTIVATIONS:
        return False, f"activation {problem.activation.name!r} has no kernel"
    bad = [f"{gemm} {dim}={v}" for gemm, (n, k) in problem.gemm_shapes().items()
           for dim, v in (("N", n), ("K", k)) if v % ALIGN]
    if bad:
        return False, f"N and K of both GEMMs must be multiples of {ALIGN}: {', '.join(bad)}"
    if problem.fp8_block is not None and tuple(problem.fp8_block) != (FP8_BLOCK, FP8_BLOCK):
        return False, f"fp8 weights need {FP8_BLOCK}x{FP8_BLOCK} blocks, got {problem.fp8_block[0]}x{problem.fp8_block[1]}"
    if not problem.k_major:
        return False, "expert weights are not K-major contiguous [E, N, K] (a transposed layout): Triton reads them as they are"
    if problem.w2_bias:
        return False, "no bias epilogue for the second GEMM"
    if problem.masked_rows is not None and problem.masked_rows % MASKED_M_ALIGN:
        return False, (f"M={problem.masked_rows} rows per expert is not a multiple of {MASKED_M_ALIGN} "
                       "(DeepGEMM stores whole row tiles)")
    return True, ""


def prefer(problem: ExpertsProblem, caps: Capabilities) -> str | None:
    """Under ``auto``: where Triton measured as fast or faster, a reason to pass DeepGEMM over, else ``None``.

    A preference, not a capability (an explicit ``kernel="deepgemm"`` still runs DeepGEMM). Decode-sized
    batches (regime 0, <= 4 rows per expert) go to Triton everywhere: the GEMMs only stream weights, and
    Triton's decode tiles are as fast or faster (H200: Qwen3-30B-A3B T=1 45 vs 67 µs bf16, 48 vs 60 fp8,
    bench/results/moe_layer_2026-12-02_v2.md). On one GPU (``moe_fx::experts``, where Triton runs the sorted
    layout) :data:`LOCAL_FROM_REGIME` says, per weight kind, from which regime DeepGEMM is worth it (where the
    regime is unknown, DeepGEMM is taken unless its kind never prefers it). Behind expert-parallel dispatch
    (``moe_fx::masked_experts``: ``masked_rows`` is set, both kernels read the masked layout) DeepGEMM stays
    first above the decode regime.
    """
    if problem.regime == 0:
        return "decode-size batch (<= 4 rows per expert): Triton's decode tiles stream the weights as fast or faster"
    if problem.masked_rows is not None:
        return None
    start = LOCAL_FROM_REGIME[problem.fp8]
    if start is not None and (problem.regime is None or problem.regime >= start):
        return None
    where = "at every size" if start is None else f"up to {ROW_REGIMES[start - 1]} rows per expert"
    return (f"{'fp8' if problem.fp8 else 'bf16'} weights {where} on one GPU: Triton's sorted layout measured "
            f"as fast or faster ({LOCAL_CHOICE_SOURCE})")


def deepgemm_expected_m(rows: object, max_m: object) -> object:
    """DeepGEMM's ``expected_m`` hint (DESIGN.md): rows per expert plus :data:`EXPECTED_M_SLACK`, rounded up to 16,
    clamped to ``[16, max_m]``."""
    m = cdiv(rows + EXPECTED_M_SLACK, 16) * 16
    return torch.sym_min(torch.sym_max(m, 16), max_m)


def deepgemm_module() -> ModuleType:
    """``import deep_gemm`` (raises ImportError with the install hint when it is absent)."""
    try:
        return importlib.import_module("deep_gemm")
    except ImportError as e:
        raise ImportError(f"moe_fx: the DeepGEMM path needs the 'deep_gemm' package ({e}); see {DEEPGEMM_DOC}") from e


# --------------------------------------------------------------------------------------------------
# The extern op
# --------------------------------------------------------------------------------------------------

_LIB = torch.library.Library("moe_fx_kernels", "FRAGMENT")
_TAGS = (torch.Tag.needs_exact_strides,) if hasattr(torch.Tag, "needs_exact_strides") else ()
_LIB.define(
    "deepgemm_masked_gemm(Tensor a, Tensor? a_scale, Tensor b, Tensor? b_scale, Tensor masked_m, "
    "SymInt expected_m) -> Tensor",
    tags=_TAGS,
)


_LIB.define(
    "deepgemm_contiguous_gemm(Tensor a, Tensor? a_scale, Tensor b, Tensor? b_scale, Tensor m_indices) -> Tensor",
    tags=_TAGS,
)


def _check_scales(op: str, a: torch.Tensor, a_scale: torch.Tensor | None, b: torch.Tensor,
                  b_scale: torch.Tensor | None) -> None:
    if (a.dtype == FP8_DTYPE) != (a_scale is not None) or (b.dtype == FP8_DTYPE) != (b_scale is not None):
        raise ValueError(f"{op}: fp8 operands need scales, others none")


def _check_gemm(a: torch.Tensor, a_scale: torch.Tensor | None, b: torch.Tensor, b_scale: torch.Tensor | None) -> None:
    if a.dim() != 3 or b.dim() != 3 or a.shape[0] != b.shape[0] or a.shape[2] != b.shape[2]:
        raise ValueError(f"deepgemm_masked_gemm: want a [G, M, K] and b [G, N, K], got {list(a.shape)}, {list(b.shape)}")
    _check_scales("deepgemm_masked_gemm", a, a_scale, b, b_scale)


@torch.library.register_fake("moe_fx_kernels::deepgemm_masked_gemm")
def _deepgemm_masked_gemm_fake(a, a_scale, b, b_scale, masked_m, expected_m):
    _check_gemm(a, a_scale, b, b_scale)
    return a.new_empty((a.shape[0], a.shape[1], b.shape[1]), dtype=torch.bfloat16)


_warned = False


def _triton_fallback(a, a_scale, b, b_scale, masked_m, out) -> torch.Tensor:
    from moe_fx.lowering.triton.grouped_gemm import masked_gemm, masked_gemm_fp8

    with torch._library.triton.set_wrap_triton_enabled(False):
        if a_scale is not None:
            return masked_gemm_fp8(a, a_scale, b, b_scale, masked_m, out)
        return masked_gemm(a, b, masked_m, out)


def _deepgemm_masked_gemm(a, a_scale, b, b_scale, masked_m, expected_m):
    """Kernel of ``moe_fx_kernels::deepgemm_masked_gemm``: bf16 ``[G, M, N]``, rows past masked_m unwritten."""
    global _warned
    out = torch.empty((a.shape[0], a.shape[1], b.shape[1]), dtype=torch.bfloat16, device=a.device)
    if _warned:  # DeepGEMM already failed in this process: do not retry a broken toolchain per call
        return _triton_fallback(a, a_scale, b, b_scale, masked_m, out)
    try:
        dg = deepgemm_module()
        if a_scale is not None:
            dg.m_grouped_fp8_gemm_nt_masked((a, a_scale), (b, b_scale), out, masked_m, expected_m, **_fp8_kwargs(a))
        else:
            dg.m_grouped_bf16_gemm_nt_masked(a, b, out, masked_m, expected_m)
        return out
    except (RuntimeError, ImportError) as e:
        # DeepGEMM JIT-compiles at first use; a broken toolchain shows up here. Later graphs choose
        # Triton; this one goes on with Triton's GEMM on the same operands (it reads any layout).
        reason = f"failed at run time ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
        if not _warned:
            _warned = True
            log.warning("moe_fx: DeepGEMM %s; using Triton's GEMMs instead for this process", reason)
        mark_unusable("deepgemm", f"deep_gemm {reason}")
        return _triton_fallback(a, a_scale, b, b_scale, masked_m, out)


_SM100_KWARGS: dict[int, dict] = {}


def _fp8_kwargs(a: torch.Tensor) -> dict:
    """SM100 would recast fp32 scales to UE8M0 (lossy) unless told not to; SM90 ignores the flag."""
    index = a.device.index if a.device.index is not None else 0
    kw = _SM100_KWARGS.get(index)
    if kw is None:
        sm100 = a.device.type == "cuda" and torch.cuda.get_device_capability(index)[0] >= 10
        kw = _SM100_KWARGS[index] = {"disable_ue8m0_cast": True} if sm100 else {}
    return kw


@torch.library.register_fake("moe_fx_kernels::deepgemm_contiguous_gemm")
def _deepgemm_contiguous_gemm_fake(a, a_scale, b, b_scale, m_indices):
    _check_contiguous(a, a_scale, b, b_scale, m_indices)
    return a.new_empty((a.shape[0], b.shape[1]), dtype=torch.bfloat16)


def _check_contiguous(a, a_scale, b, b_scale, m_indices) -> None:
    if a.dim() != 2 or b.dim() != 3 or a.shape[1] != b.shape[2] or m_indices.shape != (a.shape[0],):
        raise ValueError(f"deepgemm_contiguous_gemm: want a [M, K], b [G, N, K], m_indices [M], got "
                         f"{list(a.shape)}, {list(b.shape)}, {list(m_indices.shape)}")
    _check_scales("deepgemm_contiguous_gemm", a, a_scale, b, b_scale)


def _deepgemm_contiguous_gemm(a, a_scale, b, b_scale, m_indices):
    """Kernel of ``moe_fx_kernels::deepgemm_contiguous_gemm``: bf16 ``[M, N]``; rows whose index is -1 unwritten.

    The contiguous layout is only run on request (no measured choice yet): a failure of DeepGEMM here is
    raised, not hidden behind another kernel.
    """
    out = torch.empty((a.shape[0], b.shape[1]), dtype=torch.bfloat16, device=a.device)
    dg = deepgemm_module()
    if a_scale is not None:
        dg.m_grouped_fp8_gemm_nt_contiguous((a, a_scale), (b, b_scale), out, m_indices, **_fp8_kwargs(a))
    else:
        dg.m_grouped_bf16_gemm_nt_contiguous(a, b, out, m_indices)
    return out


# CPU too: tests hand a torch stand-in for deep_gemm to check the layouts on CPU.
_LIB.impl("deepgemm_masked_gemm", _deepgemm_masked_gemm, "CUDA")
_LIB.impl("deepgemm_masked_gemm", _deepgemm_masked_gemm, "CPU")
_LIB.impl("deepgemm_contiguous_gemm", _deepgemm_contiguous_gemm, "CUDA")
_LIB.impl("deepgemm_contiguous_gemm", _deepgemm_contiguous_gemm, "CPU")


class DeepGemms:
    """The two expert GEMMs of the pipeline on DeepGEMM."""

    name = NAME
    scale_layout = "mn_major"
    bias_epilogue = False
    layouts = LAYOUTS
    contiguous_align = CONTIGUOUS_M_ALIGN

    def rows(self, needed: object) -> object:
        """``max_m``: ``needed`` rounded up to :data:`MASKED_M_ALIGN` (whole-tile stores stay in their expert)."""
        return cdiv(needed, MASKED_M_ALIGN) * MASKED_M_ALIGN

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
        """``[G, M, K] x [G, N, K]^T -> [G, M, N]`` bf16 on valid rows (DeepGEMM takes no bias)."""
        if bias is not None:
            raise ValueError("DeepGemms.gemm: DeepGEMM has no bias epilogue (the pipeline adds the bias)")
        exp_m = deepgemm_expected_m(hints.expected_m, a.shape[1])
        w_scale = w_scale.contiguous() if w_scale is not None else None
        return torch.ops.moe_fx_kernels.deepgemm_masked_gemm(a, a_scale, w, w_scale, masked_m, exp_m)

    def contiguous_gemm(
        self,
        a: torch.Tensor,
        a_scale: torch.Tensor | None,
        w: torch.Tensor,
        w_scale: torch.Tensor | None,
        m_indices: torch.Tensor,
    ) -> torch.Tensor:
        """``[M, K]`` rows of the aligned contiguous layout ``x [G, N, K]^T`` per row's expert -> ``[M, N]`` bf16
        (rows of expert -1 unwritten)."""
        w_scale = w_scale.contiguous() if w_scale is not None else None
        return torch.ops.moe_fx_kernels.deepgemm_contiguous_gemm(a, a_scale, w, w_scale, m_indices)


GEMMS = DeepGemms()
