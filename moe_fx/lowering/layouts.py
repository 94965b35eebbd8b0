"""Memory layouts DeepGEMM's masked grouped GEMMs need, and the sizes that go with them.

DeepGEMM (v2.x, SM90 "1D2D" fp8 recipe) reads:

* activations ``a`` fp8 ``[G, M, K]`` K-major (row-major per group, ``stride(0) == M * K``) with fp32
  per-token-group scales ``sfa [G, M, ceil(K/128)]`` that are **MN-major and TMA-aligned**:
  ``sfa.stride() == (A * ceil(K/128), 1, A)`` where ``A = tma_aligned_size(M, 4)`` (M rounded up to a
  multiple of 16 bytes / 4 bytes = 4). Given any other layout DeepGEMM copies the scales into this one
  on every call; writing them there in the first place saves that copy.
* weights ``b`` fp8 (or bf16) ``[G, N, K]`` K-major and contiguous, with fp32 128x128 block scales
  ``sfb [G, ceil(N/128), ceil(K/128)]``, contiguous. This is exactly the layout of the
  ``moe_fx::experts`` contract (``w13 [E, 2I, H]``, ``w2 [E, H, I]`` and their scales) and of
  transformers' fine-grained FP8 checkpoints, so preparing weights is a check plus, at most, one
  ``contiguous()`` copy at rewrite time.
* outputs ``d`` bf16 ``[G, M, N]`` row-major.

Everything here is plain torch and runs on CPU; :mod:`moe_fx.lowering.experts.deepgemm_experts` uses it.
"""

from __future__ import annotations

import torch

__all__ = [
    "FP8_E4M3_MAX",
    "MASKED_M_ALIGN",
    "empty_mn_major_scales",
    "expected_m",
    "is_mn_major_tma_aligned",
    "masked_rows",
    "per_token_group_quant_fp8_reference",
    "prepare_deepgemm_weights",
    "prepare_expert_weights",
    "tma_aligned_size",
    "to_mn_major_tma_aligned",
]

#: TMA needs 16-byte aligned global strides.
TMA_ALIGN_BYTES = 16
#: Largest finite float8_e4m3fn value.
FP8_E4M3_MAX = 448.0
#: Scale floor of the activation quantisation (DeepGEMM's ``per_token_cast_to_fp8`` uses the same).
FP8_AMAX_EPS = 1e-4
#: Rows per expert in the masked layout are rounded up to this. DeepGEMM addresses group g's rows as
#: ``g * M + block * BLOCK_M`` and stores whole BLOCK_M-row tiles (BLOCK_M <= 256 on SM90): with M a
#: multiple of 256 a tile never spills into the next expert's rows.
MASKED_M_ALIGN = 256


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def tma_aligned_size(x: int, element_size: int) -> int:
    """``x`` rounded up so that ``x * element_size`` is a multiple of 16 bytes (DeepGEMM's rule)."""
    if TMA_ALIGN_BYTES % element_size:
        raise ValueError(f"element size {element_size} does not divide {TMA_ALIGN_BYTES}")
    step = TMA_ALIGN_BYTES // element_size
    return _cdiv(x, step) * step


def empty_mn_major_scales(
    num_groups: int,
    mn: int,
    k: int,
    *,
    block: int = 128,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Allocate per-token-group scales ``[G, mn, ceil(k/block)]`` in DeepGEMM's MN-major TMA-aligned layout.

    The result is a view with strides ``(A * sf_k, 1, A)``, ``A = tma_aligned_size(mn, 4)``: scales of
    one K-group of consecutive rows are adjacent in memory. A kernel that writes element
    ``(g, m, kb)`` through these strides produces what DeepGEMM reads, with no transposing copy.
    """
    sf_k = _cdiv(k, block)
    aligned = tma_aligned_size(mn, torch.empty((), dtype=dtype).element_size())
    storage = torch.empty(num_groups, sf_k, aligned, device=device, dtype=dtype)
    return storage.transpose(1, 2)[:, :mn, :]


def is_mn_major_tma_aligned(sf: torch.Tensor) -> bool:
    """Whether ``sf [G, mn, sf_k]`` (or ``[mn, sf_k]``) is in the layout DeepGEMM takes without a copy."""
    if sf.dim() not in (2, 3):
        return False
    batched = sf if sf.dim() == 3 else sf.unsqueeze(0)
    _, mn, sf_k = batched.shape
    aligned = tma_aligned_size(mn, sf.element_size())
    group_ok = sf.dim() == 2 or batched.shape[0] == 1 or batched.stride(0) == aligned * sf_k
    return group_ok and (batched.stride(1) == 1 or mn == 1) and (batched.stride(2) == aligned or sf_k == 1)


def to_mn_major_tma_aligned(sf: torch.Tensor) -> torch.Tensor:
    """Return ``sf [G, mn, sf_k]`` in the MN-major TMA-aligned layout (no copy if it already is)."""
    if is_mn_major_tma_aligned(sf):
        return sf
    if sf.dim() not in (2, 3):
        raise ValueError(f"scales must be [mn, sf_k] or [G, mn, sf_k], got {list(sf.shape)}")
    batched = sf if sf.dim() == 3 else sf.unsqueeze(0)
    g, mn, sf_k = batched.shape
    out = empty_mn_major_scales(g, mn, sf_k, block=1, device=sf.device, dtype=sf.dtype)
    out.copy_(batched)
    return out if sf.dim() == 3 else out[0]


def per_token_group_quant_fp8_reference(
    x: torch.Tensor, group: int = 128
) -> tuple[torch.Tensor, torch.Tensor]:
    """Straightforward 1 x ``group`` quantisation of ``x [..., K]`` to float8_e4m3fn.

    Returns ``(q [..., K] float8_e4m3fn, scales [..., ceil(K/group)] float32)`` with
    ``x ~= q * scale`` per group; scale = max(amax, 1e-4) / 448. The oracle for the fused kernels.
    """
    k = x.shape[-1]
    pad = _cdiv(k, group) * group - k
    xf = torch.nn.functional.pad(x.float(), (0, pad)).unflatten(-1, (-1, group))
    scale = xf.abs().amax(-1).clamp_min(FP8_AMAX_EPS) / FP8_E4M3_MAX
    q = (xf / scale.unsqueeze(-1)).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).flatten(-2)[..., :k]
    return q.to(torch.float8_e4m3fn), scale


def prepare_deepgemm_weights(
    w: torch.Tensor, scale: torch.Tensor | None = None, *, name: str = "w"
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Put one expert weight ``[E, N, K]`` (and its fp32 block scales) in the layout DeepGEMM reads.

    ``w``: bf16 or float8_e4m3fn ``[E, N, K]``; returned K-major contiguous. ``scale``: for fp8,
    float32 ``[E, ceil(N/128), ceil(K/128)]``; returned contiguous (SM90's 1D2D kernels read 128x128
    fp32 block scales as they are). Copies only what is not already in place, so calling this on the
    contract's layout (or a transformers fine-grained FP8 checkpoint) returns the same tensors.
    Meant to run once, at rewrite time.
    """
    if w.dim() != 3:
        raise ValueError(f"{name} must be [E, N, K], got {list(w.shape)}")
    if w.dtype == torch.float8_e4m3fn:
        e, n, k = w.shape
        want = (e, _cdiv(n, 128), _cdiv(k, 128))
        if scale is None or tuple(scale.shape) != want or scale.dtype != torch.float32:
            got = None if scale is None else f"{scale.dtype} {list(scale.shape)}"
            raise ValueError(f"{name} is fp8 {list(w.shape)}: needs float32 block scales {list(want)}, got {got}")
        scale = scale.contiguous()
    elif w.dtype != torch.bfloat16:
        raise TypeError(f"{name}: DeepGEMM takes bfloat16 or float8_e4m3fn weights, got {w.dtype}")
    elif scale is not None:
        raise ValueError(f"{name} is {w.dtype}; block scales only go with fp8 weights")
    return w.contiguous(), scale


def prepare_expert_weights(
    w13: torch.Tensor,
    w2: torch.Tensor,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    kernel: str = "deepgemm",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Prepare both expert weights for ``kernel`` once, at rewrite time: ``(w13, w2, w13_scale, w2_scale)``.

    For ``"deepgemm"`` see :func:`prepare_deepgemm_weights`; the Triton and reference kernels read the
    contract layout, which they get contiguous too.
    """
    if kernel == "deepgemm":
        w13, w13_scale = prepare_deepgemm_weights(w13, w13_scale, name="w13")
        w2, w2_scale = prepare_deepgemm_weights(w2, w2_scale, name="w2")
        return w13, w2, w13_scale, w2_scale
    contig = [None if t is None else t.contiguous() for t in (w13, w2, w13_scale, w2_scale)]
    return contig[0], contig[1], contig[2], contig[3]


def expected_m(num_tokens: int, top_k: int, num_experts: int, max_m: int) -> int:
    """DeepGEMM's ``expected_m`` hint (DESIGN.md): ``ceil(T*K/E)`` rounded up to 16, clamped to ``[16, max_m]``."""
    m = _cdiv(max(num_tokens * top_k, 1), num_experts)
    m = _cdiv(m, 16) * 16
    return max(1, min(max(m, 16), max_m))


def masked_rows(num_tokens: int) -> int:
    """Rows per expert (``max_m``) of the local masked layout DeepGEMM reads: ``T`` rounded up to 256.

    A token sends at most one row to an expert (top-k ids are distinct), so ``T`` rows always suffice
    and the bound depends on the shape alone: no host synchronisation, CUDA-graph safe (the Triton
    path uses the same bound). The round-up to :data:`MASKED_M_ALIGN` keeps DeepGEMM's whole-tile
    stores inside each expert's rows. Padding rows cost memory only; no kernel visits them.
    """
    return max(MASKED_M_ALIGN, _cdiv(num_tokens, MASKED_M_ALIGN) * MASKED_M_ALIGN)
