"""Shared helpers of the tests/test_triton_*.py modules (not a test module itself)."""

from __future__ import annotations

import pytest
import torch

from moe_fx.ops import ExpertActivation

triton = pytest.importorskip("triton")

HAS_CUDA = torch.cuda.is_available()

#: the activation forms the fused kernels are checked with (GEMM1's epilogue, the decode path)
ACTIVATION_FORMS = {
    "silu": ExpertActivation(),
    "gpt_oss": ExpertActivation("silu", True, "interleaved", 1.702, 0.8, 1.0),  # a limit the values cross
    "gelu_erf": ExpertActivation("gelu"),
    "relu2_not_gated": ExpertActivation("relu2", gated=False),
    "gelu_tanh_clamped_not_gated": ExpertActivation("gelu_tanh", gated=False, limit=0.5),
}
gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")


def devices() -> list:
    """CPU (Triton interpreter, tiny shapes) always; CUDA (real sizes) when present, marked gpu."""
    out = [pytest.param("cpu", id="cpu")]
    out.append(pytest.param("cuda", id="cuda", marks=[pytest.mark.gpu, gpu]))
    return out


def ragged_ids(t: int, k: int, e: int, kind: str, gen: torch.Generator) -> torch.Tensor:
    """Top-k ids [T, K] int32, distinct per token, with load patterns that stress the masked layout.

    kind: "random" (uniform), "skewed" (half the experts empty), "hot" (expert 0 in every token),
    "holes" (random with about a fifth of the slots -1).
    """
    if kind == "skewed":
        pool = max(k, e // 2)
        ids = torch.stack([torch.randperm(pool, generator=gen)[:k] for _ in range(t)])
    else:
        ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])
    if kind == "hot":
        has0 = (ids == 0).any(dim=1)
        ids[~has0, 0] = 0
    if kind == "holes":
        ids[torch.rand(t, k, generator=gen) < 0.2] = -1
    return ids.to(torch.int32)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative Frobenius error ||out - ref|| / ||ref||."""
    return ((out.float() - ref.float()).norm() / ref.float().norm().clamp(min=1e-12)).item()

