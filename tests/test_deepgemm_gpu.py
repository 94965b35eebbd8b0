"""The DeepGEMM path on a Hopper GPU with a real ``deep_gemm`` (skipped on CPU and without DeepGEMM).

Run on the GPU machine after building DeepGEMM (see docs/deepgemm.md)::

    pytest -m gpu tests/test_deepgemm_gpu.py
"""

from __future__ import annotations

import math

import pytest
import torch

from moe_fx.ops import experts_reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _need_deepgemm():
    from moe_fx.lowering.problem import probe_capabilities

    caps = probe_capabilities("cuda")
    if caps.capability < (9, 0):
        pytest.skip(f"DeepGEMM needs SM90+, GPU is {caps.capability}")
    if caps.deep_gemm_error is not None:
        pytest.skip(f"DeepGEMM unusable: {caps.deep_gemm_error}")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))


def _ragged_routing(t: int, e: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k ids with a skewed load (expert 0 hot, the last expert cold) and some -1 slots."""
    logits = torch.randn(t, e, generator=gen, device="cuda")
    logits[:, 0] += 2.0
    logits[:, -1] -= 4.0
    w, ids = torch.softmax(logits, -1).topk(k, dim=-1)
    ids = ids.int()
    ids[torch.rand(t, k, generator=gen, device="cuda") < 0.05] = -1
    return ids, w


def _poison_allocator(numel: int = 1 << 27) -> None:
    """Leave NaNs in the caching allocator's free blocks so that buffers the kernels leave unwritten show."""
    torch.full((numel,), float("nan"), device="cuda")
    torch.cuda.synchronize()


class _CountingDeepGemm:
    """Stands in for the ``deep_gemm`` module: records each masked GEMM's weight, then runs the real one."""

    def __init__(self, real):
        self.real, self.calls = real, []

    def m_grouped_bf16_gemm_nt_masked(self, a, b, *rest, **kw):
        self.calls.append((b.data_ptr(), b.dtype))
        return self.real.m_grouped_bf16_gemm_nt_masked(a, b, *rest, **kw)

    def m_grouped_fp8_gemm_nt_masked(self, a, b, *rest, **kw):
        self.calls.append((b[0].data_ptr(), b[0].dtype))
        return self.real.m_grouped_fp8_gemm_nt_masked(a, b, *rest, **kw)


@pytest.fixture
def deepgemm_above_decode(monkeypatch):
    """Under ``auto``, DeepGEMM from 5 rows per expert (the tiny models here have 20-24): these tests are about
    DeepGEMM's plumbing in a compiled model, not about where it measured faster (tests/test_select.py)."""
    from moe_fx.lowering.masked_experts import deepgemm as dg_mod

    monkeypatch.setattr(dg_mod, "LOCAL_FROM_REGIME", {False: 1, True: 1})


@pytest.fixture
def counting_dg(monkeypatch):
    _need_deepgemm()
    from moe_fx.lowering.masked_experts import deepgemm as dg_mod

    counting = _CountingDeepGemm(dg_mod.deepgemm_module())
    monkeypatch.setattr(dg_mod, "deepgemm_module", lambda: counting)
    return counting


def _op(*args, kernel, **kw):
    return torch.ops.moe_fx.experts(*args, kernel_choice=kernel, **kw)


def _weights(e, h, i, fp8, gen):
    from moe_fx.lowering.quant import quantize_fp8_blockwise

    w13 = torch.randn(e, 2 * i, h, generator=gen, device="cuda") / h**0.5
    w2 = torch.randn(e, h, i, generator=gen, device="cuda") / i**0.5
    if fp8:
        (w13, s13), (w2, s2) = quantize_fp8_blockwise(w13), quantize_fp8_blockwise(w2)
        return w13, w2, s13, s2
    return w13.bfloat16(), w2.bfloat16(), None, None


# (T, E, K, H, I, weights_on_input). Few distinct (N, K, expected_m) on purpose: DeepGEMM JIT-compiles
# a kernel per GEMM shape and tile choice at first use (seconds each with NVCC).
CASES = [
    (1, 8, 2, 256, 128, False),
    (300, 8, 2, 256, 128, True),
    (1000, 32, 8, 512, 256, False),
]


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("t, e, k, h, i, weights_on_input", CASES)
def test_deepgemm_experts_matches_reference_and_triton(counting_dg, t, e, k, h, i, weights_on_input, fp8):
    gen = torch.Generator(device="cuda").manual_seed(t * 7 + h + fp8)
    hidden = torch.randn(t, h, generator=gen, device="cuda").bfloat16()
    ids, w = _ragged_routing(t, e, k, gen)
    w13, w2, s13, s2 = _weights(e, h, i, fp8, gen)
    args = (hidden, ids, w, w13, w2, "silu", weights_on_input, s13, s2)
    _poison_allocator()
    out = _op(*args, kernel="deepgemm")
    ref = experts_reference(*args)
    tri = _op(*args, kernel="triton")
    assert len(counting_dg.calls) == 2, "two DeepGEMM GEMMs per call"
    torch.cuda.synchronize()
    assert out.shape == (t, h) and out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    # fp8: activations are quantised before both GEMMs (~4% Frobenius); bf16: rounding of two GEMM outputs.
    tol = 0.06 if fp8 else 0.01
    assert _rel(out, ref) < tol, (_rel(out, ref), tol)
    assert _rel(out, tri) < tol / 2, _rel(out, tri)


def test_op_auto_selects_deepgemm_and_explicit_requests(monkeypatch):
    _need_deepgemm()
    from moe_fx.lowering.experts import explain_experts
    from moe_fx.lowering.masked_experts import deepgemm as dg_mod
    from moe_fx.ops.experts import bind_experts

    gen = torch.Generator(device="cuda").manual_seed(1)
    t = 512  # 128 rows per expert

    def explained(inter: int):  # explain on this GPU's probed capabilities
        h = torch.empty(t, 256, device="cuda", dtype=torch.bfloat16)
        w13 = torch.empty(8, 2 * inter, 256, device="cuda", dtype=torch.bfloat16)
        w2 = torch.empty(8, 256, inter, device="cuda", dtype=torch.bfloat16)
        ids0, w0 = torch.zeros(t, 2, device="cuda", dtype=torch.long), torch.ones(t, 2, device="cuda")
        return explain_experts(bind_experts(h, ids0, w0, w13, w2))

    # the shipped rule: bf16 weights run Triton on one GPU, and explain says DeepGEMM was passed over
    why = explained(128)
    assert why.kernel == "triton" and "bf16 weights at every size" in why.reasons["deepgemm"], why.reasons
    monkeypatch.setattr(dg_mod, "LOCAL_FROM_REGIME", {False: 1, True: 1})  # preferred wherever it runs
    for inter, want in ((128, "deepgemm"), (96, "triton")):
        why = explained(inter)
        assert why.kernel == want, (inter, why.reasons)
    assert "gemm2 K=96" in why.reasons["deepgemm"]
    hidden = torch.randn(t, 256, generator=gen, device="cuda").bfloat16()
    ids, w = _ragged_routing(t, 8, 2, gen)
    w13, w2, _, _ = _weights(8, 256, 128, False, gen)
    ref = experts_reference(hidden, ids, w, w13, w2)
    for kernel in ("auto", "deepgemm", "triton", "reference"):
        out = torch.ops.moe_fx.experts(hidden, ids, w, w13, w2, kernel_choice=kernel)
        assert _rel(out, ref) < 0.01, kernel
    w13u, w2u, _, _ = _weights(8, 256, 96, False, gen)
    with pytest.raises(RuntimeError, match="kernel='deepgemm' was requested but cannot run"):
        torch.ops.moe_fx.experts(hidden, ids, w, w13u, w2u, kernel_choice="deepgemm")


@pytest.mark.parametrize("quantize", [None, "fp8"])
def test_compiled_tiny_model_takes_deepgemm_end_to_end(counting_dg, deepgemm_above_decode, quantize):
    pytest.importorskip("transformers")
    from torch._inductor.utils import run_and_get_code

    from moe_fx.backend import make_backend
    from moe_fx.config import MoEConfig
    from moe_fx.testing.models import tiny_hf_model

    torch.manual_seed(0)
    model = tiny_hf_model(
        "mixtral", dtype=torch.bfloat16, hidden=256, intermediate=128, num_experts=8, top_k=2
    ).cuda()
    tokens = torch.randint(0, 128, (2, 48), device="cuda")
    reports = []
    with torch.no_grad():
        want = model(tokens).logits.float()
        # bf16 logits of a random model differ between any two compilations: measure plain Inductor's
        # (first, on a fresh cache; a non-finite result there is Inductor's, seen once on torch 2.11).
        noise = _rel(torch.compile(model)(tokens).logits.float(), want)
        noise = 0.0 if math.isnan(noise) else noise
        torch._dynamo.reset()
        backend = make_backend(MoEConfig(quantize=quantize), sink=reports)
        compiled = torch.compile(model, backend=backend, fullgraph=False)
        out, code = run_and_get_code(compiled, tokens)
        got = out.logits.float()
    calls = [d for _, d in counting_dg.calls]
    assert calls, f"the compiled model never ran DeepGEMM; pass reports: {reports}"
    assert set(calls) == {torch.float8_e4m3fn if quantize else torch.bfloat16}
    code = "\n".join(code)
    # Inductor's generated code launches the pipeline itself: the extern GEMMs and moe_fx's Triton kernels,
    # and never calls the experts op (a Python op per call) at run time.
    assert "deepgemm_masked_gemm" in code and "permute_kernel" in code and "unpermute_kernel" in code
    assert "moe_fx.experts" not in code
    assert torch.isfinite(got).all()
    # fp8 weights (128x128 blocks) and activations (1x128) in both layers of a random tiny model:
    # 0.136 measured on the H200 (a wrong scale layout or row mix-up gives ~1).
    assert _rel(got, want) < (0.2 if quantize else 0.02) + 2 * noise, (_rel(got, want), noise)


def test_fp8_checkpoint_model_uses_its_fp8_weights_on_deepgemm(counting_dg, deepgemm_above_decode):
    """transformers FP8Experts (fp8 + 128x128 scale_inv) -> capture -> compiled -> DeepGEMM fp8.

    Compared with the eager model holding the dequantised weights.
    """
    pytest.importorskip("transformers")
    from moe_fx.backend import make_backend
    from moe_fx.capture.fp8_modules import capture_fp8_experts
    from moe_fx.testing.fp8 import dequantized_copy, tiny_fp8_hf_model

    model = tiny_fp8_hf_model("mixtral", hidden=256, intermediate=128, num_experts=8, top_k=2, device="cuda")
    oracle = dequantized_copy(model)
    reports = capture_fp8_experts(model)
    assert all(r.matched for r in reports) and len(reports) == 2
    tokens = torch.randint(0, 128, (2, 40), device="cuda")
    with torch.no_grad():
        want = oracle(tokens).logits.float()
        got = torch.compile(model, backend=make_backend(), fullgraph=True)(tokens).logits.float()
    ptrs = {m.gate_up_proj.data_ptr() for m in model.modules() if hasattr(m, "gate_up_proj_scale_inv")}
    ptrs |= {m.down_proj.data_ptr() for m in model.modules() if hasattr(m, "down_proj_scale_inv")}
    calls = counting_dg.calls
    assert calls and {p for p, _ in calls} == ptrs and {d for _, d in calls} == {torch.float8_e4m3fn}
    # The oracle keeps activations in bf16; the fp8 path quantises them (1x128) before both GEMMs of both
    # layers, and this random tiny model's expert outputs dominate its residual stream. Measured on the
    # H200: 0.093 relative Frobenius error of the logits (a wrong scale layout or row mix-up gives ~1).
    assert _rel(got, want) < 0.15, _rel(got, want)


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("t, e, k, h, i, weights_on_input", [(300, 8, 2, 256, 128, True), (1000, 32, 8, 512, 256, False)])
def test_contiguous_layout_on_real_deepgemm(t, e, k, h, i, weights_on_input, fp8):
    """DeepGEMM's m-grouped contiguous GEMMs (``local_contiguous``, forced) against the reference and Triton.

    Skewed loads with -1 slots: some experts get no rows, some several 128-row blocks; the allocator is
    poisoned with NaN so padding rows or a block DeepGEMM leaves unwritten would show in the output.
    """
    _need_deepgemm()
    from moe_fx.lowering.experts import plan_experts, run_experts
    from moe_fx.ops.experts import bind_experts

    gen = torch.Generator(device="cuda").manual_seed(t + 11 * h + fp8)
    hidden = torch.randn(t, h, generator=gen, device="cuda").bfloat16()
    ids, w = _ragged_routing(t, e, k, gen)
    w13, w2, s13, s2 = _weights(e, h, i, fp8, gen)
    args = (hidden, ids, w, w13, w2, "silu", weights_on_input, s13, s2)
    bound = bind_experts(*args, kernel_choice="deepgemm")
    plan = plan_experts(bound, layout="local_contiguous")
    assert plan.layout == "contiguous", plan
    _poison_allocator()
    out = run_experts(bound, plan)
    ref = experts_reference(*args)
    tri = _op(*args, kernel="triton")
    torch.cuda.synchronize()
    assert out.shape == (t, h) and out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    tol = 0.06 if fp8 else 0.01
    assert _rel(out, ref) < tol, (_rel(out, ref), tol)
    assert _rel(out, tri) < tol / 2, _rel(out, tri)
