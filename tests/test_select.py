"""The kernel-selection rule (moe_fx.lowering.select) and the CUDA registration's use of it, on CPU.

The rule is tested with the capability inputs given (never by probing the real library), so every
case here runs on a machine without a GPU, DeepGEMM or a working Triton.
"""

from __future__ import annotations

import logging
import sys
import types

import pytest
import torch

import moe_fx.lowering.register as register
import moe_fx.lowering.select as select
from moe_fx.lowering.select import Capabilities, ExpertsProblem, decide_experts_kernel, explain_kernel

H100 = Capabilities("cuda", (9, 0))
A100 = Capabilities("cuda", (8, 0))
L40 = Capabilities("cuda", (8, 9))
NO_DG = Capabilities("cuda", (9, 0), deep_gemm_error="deep_gemm is not installed")
NO_DG_NO_TRITON = Capabilities("cuda", (9, 0), "deep_gemm is not installed", "triton is not installed")
CPU = Capabilities("cpu", None, "needs a CUDA GPU, device is cpu", None)


def problem(h: int = 256, i: int = 512, *, dtype: str = "bfloat16", fp8: bool = False, device: str = "cuda", **kw):
    return ExpertsProblem(device, dtype, 8, h, i, (128, 128) if fp8 else None, **kw)


@pytest.fixture(autouse=True)
def _fresh_state(monkeypatch):
    # Runtime demotions and the once-per-shape log set are process state: isolate each test.
    monkeypatch.setattr(select, "_runtime_unusable", {})
    monkeypatch.setattr(select, "_logged", set())
    select.probe_capabilities.cache_clear()
    yield
    select.probe_capabilities.cache_clear()


@pytest.mark.parametrize("fp8", [False, True])
def test_aligned_hopper_takes_deepgemm(fp8):
    c = decide_experts_kernel(problem(7168, 2048, fp8=fp8), H100)
    assert c.kernel == "deepgemm" and c.error is None
    assert c.reasons == {"triton": "deepgemm preferred", "reference": "deepgemm preferred"}


@pytest.mark.parametrize("fp8", [False, True])
def test_decode_sized_batches_take_triton_under_auto_only(fp8):
    """<= DEEPGEMM_MIN_ROWS rows per expert: "auto" prefers Triton (a preference, not a capability)."""
    from moe_fx.lowering.select import DEEPGEMM_MIN_ROWS, ExpertsProblem, decode_rows

    assert decode_rows(1, 8, 128) == 1 and decode_rows(8, 2, 8) == 2 and decode_rows(64, 8, 128) == 4
    assert decode_rows(65, 8, 128) is None and decode_rows(4096, 8, 32) is None
    p = problem(7168, 2048, fp8=fp8)
    small = ExpertsProblem(**{**p.__dict__, "decode_rows": DEEPGEMM_MIN_ROWS})
    c = decide_experts_kernel(small, H100)
    assert c.kernel == "triton" and "decode-size batch (4 rows per expert" in c.reasons["deepgemm"]
    assert decide_experts_kernel(small, H100, "deepgemm").kernel == "deepgemm"  # explicit: honoured
    assert decide_experts_kernel(small, H100, "deepgemm").error is None
    assert decide_experts_kernel(p, H100).kernel == "deepgemm"
    # without usable Triton, DeepGEMM stays (it is still the best that runs)... but DeepGEMM needs Triton
    # for its dispatch and combine, so nothing GPU-side runs: the reference does
    no_triton = Capabilities("cuda", (9, 0), None, "triton is not installed")
    assert decide_experts_kernel(small, no_triton).kernel == "reference"


def test_explain_names_the_decode_rule():
    kernel, reasons = explain_kernel("cuda", torch.bfloat16, 8, 4096, 1024, caps=H100)
    assert kernel == "deepgemm" and "triton runs batches of <= 4 rows per expert" in reasons["triton"]


@pytest.mark.parametrize(
    "h, i, bad",
    [
        (4000, 512, "gemm1 K=4000"),  # H unaligned: GEMM1's K and GEMM2's N
        (256, 64, "gemm2 K=64"),  # 2I = 128 is aligned, but GEMM2's K = I = 64 is not
        (256, 192, "gemm2 K=192"),  # 2I = 384 is aligned too
        (32, 16, "gemm1 N=32"),  # the tiny CPU test models
    ],
)
def test_unaligned_shapes_take_triton_and_say_which_dim(h, i, bad):
    c = decide_experts_kernel(problem(h, i), H100)
    assert c.kernel == "triton"
    assert bad in c.reasons["deepgemm"] and "multiples of 128" in c.reasons["deepgemm"]
    assert c.reasons["reference"] == "triton preferred"


def test_missing_library_takes_triton_with_the_library_reason():
    c = decide_experts_kernel(problem(), NO_DG)
    assert (c.kernel, c.reasons["deepgemm"]) == ("triton", "deep_gemm is not installed")
    c = decide_experts_kernel(problem(), Capabilities("cuda", (9, 0), None, "triton is not installed"))
    assert c.kernel == "reference" and "need Triton: triton is not installed" in c.reasons["deepgemm"]
    c = decide_experts_kernel(problem(), NO_DG_NO_TRITON)
    assert c.kernel == "reference" and c.reasons["triton"] == "triton is not installed"


def test_old_gpu():
    c = decide_experts_kernel(problem(), A100)
    assert c.kernel == "triton" and "SM90" in c.reasons["deepgemm"] and "SM80" in c.reasons["deepgemm"]
    # fp8 tensor cores: Triton needs SM89+, so fp8 weights on an A100 fall back to the reference.
    c = decide_experts_kernel(problem(fp8=True), A100)
    assert c.kernel == "reference" and "SM89" in c.reasons["triton"]
    assert decide_experts_kernel(problem(fp8=True), L40).kernel == "triton"


def test_cpu_takes_reference():
    c = decide_experts_kernel(problem(device="cpu"), CPU)
    assert c.kernel == "reference"
    assert "CUDA" in c.reasons["deepgemm"] and "CUDA" in c.reasons["triton"]


def test_dtype_block_and_activation_rules():
    c = decide_experts_kernel(problem(dtype="float16"), H100)
    assert c.kernel == "triton" and "bfloat16" in c.reasons["deepgemm"]
    bad_block = ExpertsProblem("cuda", "bfloat16", 8, 256, 512, (64, 64))
    c = decide_experts_kernel(bad_block, H100)
    assert c.kernel == "reference" and "128x128" in c.reasons["deepgemm"] and "128x128" in c.reasons["triton"]
    assert decide_experts_kernel(problem(activation="gelu"), H100).kernel == "deepgemm"
    c = decide_experts_kernel(problem(activation="relu2"), H100)
    assert c.kernel == "reference" and "relu2" in c.reasons["triton"] and "relu2" in c.reasons["deepgemm"]


def test_explicit_requests():
    ok = decide_experts_kernel(problem(), H100, "triton")
    assert (ok.kernel, ok.error, ok.request) == ("triton", None, "triton")
    bad = decide_experts_kernel(problem(4000, 512), H100, "deepgemm")
    assert bad.kernel == "deepgemm" and "gemm1 K=4000" in bad.error
    assert decide_experts_kernel(problem(device="cpu"), CPU, "triton").error is not None
    ref = decide_experts_kernel(problem(), H100, "reference")
    assert ref.kernel == "reference" and ref.error is None
    with pytest.raises(ValueError, match="unknown kernel request 'cutlass'"):
        decide_experts_kernel(problem(), H100, "cutlass")


def test_explain_kernel_plain_values():
    assert explain_kernel("cuda", torch.bfloat16, 8, 4096, 1024, caps=H100)[0] == "deepgemm"
    kernel, reasons = explain_kernel("cuda", "torch.bfloat16", 8, 4096, 1000, fp8=True, caps=H100)
    assert kernel == "triton" and "gemm2 K=1000" in reasons["deepgemm"]
    kernel, reasons = explain_kernel("cuda", "bfloat16", 8, 4000, 1024, request="deepgemm", caps=H100)
    assert kernel == "deepgemm (cannot run)" and "gemm1 K=4000" in reasons["deepgemm"]


def test_choice_is_logged_once_per_shape(caplog):
    caplog.set_level(logging.INFO, logger="moe_fx.lowering")
    for _ in range(3):
        select.choose_experts_kernel(
            device_type="cuda", dtype="bfloat16", hidden=256, intermediate=512, num_experts=8, caps=H100
        )
    select.choose_experts_kernel(
        device_type="cuda", dtype="bfloat16", hidden=256, intermediate=384, num_experts=8, caps=H100
    )
    msgs = [r.getMessage() for r in caplog.records if r.name == "moe_fx.lowering"]
    assert len(msgs) == 2, msgs
    assert "H=256 I=512" in msgs[0] and msgs[0].endswith("deepgemm [not taken: triton: deepgemm preferred; "
                                                          "reference: deepgemm preferred]")


def test_probe_reports_library_state(monkeypatch):
    monkeypatch.setitem(sys.modules, "deep_gemm", None)  # import raises ModuleNotFoundError
    assert "not installed" in select._deep_gemm_error()
    monkeypatch.setitem(sys.modules, "deep_gemm", types.ModuleType("deep_gemm"))
    assert "lacks m_grouped_bf16_gemm_nt_masked" in select._deep_gemm_error()
    monkeypatch.setenv(select.DISABLE_DEEPGEMM_ENV, "1")
    assert "disabled by MOE_FX_DISABLE_DEEPGEMM" in select._deep_gemm_error()
    caps = select.probe_capabilities("cpu")
    assert caps.device_type == "cpu" and caps.deep_gemm_error is not None
    assert select.probe_capabilities("cpu") is caps  # cached


# --- the CUDA registration, exercised on CPU tensors with the capability probe replaced ------------


def _inputs(t=5, h=32, i=16, e=4, k=2):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(t, h, generator=g)
    ids = torch.randint(0, e, (t, k), generator=g)
    w = torch.rand(t, k, generator=g)
    w13 = torch.randn(e, 2 * i, h, generator=g) / h**0.5
    w2 = torch.randn(e, h, i, generator=g) / i**0.5
    return hidden, ids, w, w13, w2


def test_registration_honours_requests_on_cpu_tensors():
    args = _inputs()
    want = register.experts_reference(*args)
    torch.testing.assert_close(register.experts_cuda(*args), want)  # cpu -> reference
    torch.testing.assert_close(register.experts_cuda(*args, impl="reference"), want)
    with pytest.raises(RuntimeError, match="impl='deepgemm' was requested but cannot run: needs a CUDA GPU"):
        register.experts_cuda(*args, impl="deepgemm")
    empty = register.experts_cuda(args[0][:0], args[1][:0], args[2][:0], *args[3:])
    assert empty.shape == (0, 32)


def test_runtime_fallback_logs_once_and_demotes(monkeypatch, caplog):
    calls = {"deepgemm": 0, "triton": 0}

    def broken_deepgemm(*a):
        calls["deepgemm"] += 1
        raise RuntimeError("NVCC compilation failed\nlong compiler log")

    def fake_triton(*a):
        calls["triton"] += 1
        return register.experts_reference(*a)

    fake = types.ModuleType("moe_fx_test_fake_kernels")
    fake.broken_deepgemm, fake.fake_triton = broken_deepgemm, fake_triton
    monkeypatch.setitem(sys.modules, fake.__name__, fake)
    monkeypatch.setitem(register._IMPLS, "deepgemm", (fake.__name__, "broken_deepgemm"))
    monkeypatch.setitem(register._IMPLS, "triton", (fake.__name__, "fake_triton"))
    real_choose = select.choose_experts_kernel

    def on_fake_hopper(**kw):
        # Pretend the CPU tensors live on an H100 whose DeepGEMM state is the real process state.
        dg = select._runtime_unusable.get("deepgemm")
        kw.update(device_type="cuda", caps=Capabilities("cuda", (9, 0), dg, None))
        return real_choose(**kw)

    monkeypatch.setattr(register, "choose_experts_kernel", on_fake_hopper)
    caplog.set_level(logging.WARNING, logger="moe_fx.lowering")
    hidden, ids, w, w13, w2 = _inputs(t=12, h=128, i=128)  # 6 rows per expert: not decode-sized
    args = (hidden.bfloat16(), ids, w, w13.bfloat16(), w2.bfloat16())
    want = register.experts_reference(*args)
    for _ in range(3):
        torch.testing.assert_close(register.experts_cuda(*args), want)
    assert calls == {"deepgemm": 1, "triton": 3}
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "NVCC compilation failed" in warnings[0] and "long compiler log" not in warnings[0]
    assert "failed at run time" in select._runtime_unusable["deepgemm"]
    # An explicit request is never silently replaced.
    with pytest.raises(RuntimeError, match="failed at run time"):
        register.experts_cuda(*args, impl="deepgemm")
