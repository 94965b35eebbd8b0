"""Kernel selection (moe_fx.lowering.select): one rule for both families, on CPU.

The rule is tested with the capability inputs given (never by probing the real library), so every
case here runs on a machine without a GPU, DeepGEMM or DeepEP; the eager registration is exercised
on CPU tensors (Triton kernels under the interpreter).
"""

from __future__ import annotations

import logging
import sys
import types
from pathlib import Path

import pytest
import torch

import moe_fx.lowering.problem as problem_mod
import moe_fx.lowering.select as select
from moe_fx.lowering.experts import explain_experts
from moe_fx.lowering.masked_experts import deepgemm, pipeline
from moe_fx.lowering.prepare_finalize import deepep_ll
from moe_fx.lowering.problem import (
    ROW_REGIMES,
    Capabilities,
    DispatchProblem,
    ExpertsProblem,
    assume_capabilities,
    row_regime,
    rows_per_expert,
)
from moe_fx.lowering.select import decide
from moe_fx.ops import ExpertActivation

H100 = Capabilities("cuda", (9, 0), None, None, None, 132, "NVIDIA H100")
A100 = Capabilities("cuda", (8, 0), None, None, None, 108, "NVIDIA A100")
L40 = Capabilities("cuda", (8, 9), None, None, None, 142, "NVIDIA L40")
NO_DG = Capabilities("cuda", (9, 0), "deep_gemm is not installed", None, None, 132, "NVIDIA H100")
NO_DG_NO_TRITON = Capabilities("cuda", (9, 0), "deep_gemm is not installed", "triton is not installed")
CPU = Capabilities("cpu", None, "needs a CUDA GPU, device is cpu", None, "needs a CUDA GPU", 0, "cpu")
PREFILL = len(ROW_REGIMES)


def problem(h=256, i=512, *, dtype="bfloat16", fp8=False, device="cuda", regime=PREFILL, **kw) -> ExpertsProblem:
    return ExpertsProblem(device, dtype, 8, h, i, fp8_block=(128, 128) if fp8 else None, regime=regime, **kw)


def experts(p, caps, kernel="auto"):
    return decide("experts", p, caps, kernel)


@pytest.fixture(autouse=True)
def _fresh_state(monkeypatch):
    # Runtime demotions and the once-per-problem log set are process state: isolate each test.
    monkeypatch.setattr(problem_mod, "_runtime_unusable", {})
    monkeypatch.setattr(select, "_logged", set())
    problem_mod.probe_capabilities.cache_clear()
    yield
    problem_mod.probe_capabilities.cache_clear()


@pytest.fixture
def deepgemm_wherever_it_runs(monkeypatch):
    """DeepGEMM preferred in every regime above decode (the rule before 2026-12-05), so one explain line shows
    both of a DeepGEMM layer's layouts from 5 rows per expert (:func:`test_measured_preference_per_regime` and
    :func:`test_explain_says_why_triton_runs_where_deepgemm_could` test the shipped rule)."""
    monkeypatch.setattr(deepgemm, "LOCAL_FROM_REGIME", {False: 1, True: 1})


def test_rows_per_expert_and_regimes():
    assert rows_per_expert(1, 8, 128) == 1 and rows_per_expert(4096, 8, 32) == 1024 and rows_per_expert(0, 2, 8) == 1
    assert [row_regime(r) for r in (1, 4, 5, 16, 17, 64, 65, 256, 257, 4096)] == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]


@pytest.mark.usefixtures("deepgemm_wherever_it_runs")
@pytest.mark.parametrize("fp8", [False, True])
def test_aligned_hopper_takes_deepgemm(fp8):
    c = experts(problem(7168, 2048, fp8=fp8), H100)
    assert (c.kernel, c.error) == ("deepgemm", None)
    assert c.reasons == {"triton": "deepgemm preferred", "reference": "deepgemm preferred"}


@pytest.mark.parametrize("fp8", [False, True])
def test_decode_regime_takes_triton_under_auto_only(fp8):
    """<= 4 rows per expert: "auto" prefers Triton (a preference, not a capability)."""
    small = problem(7168, 2048, fp8=fp8, regime=0)
    c = experts(small, H100)
    assert c.kernel == "triton" and "decode-size batch (<= 4 rows per expert)" in c.reasons["deepgemm"]
    assert experts(small, H100, "deepgemm").kernel == "deepgemm" and experts(small, H100, "deepgemm").error is None
    # behind expert-parallel dispatch (both kernels read the masked layout) DeepGEMM stays first above decode
    assert experts(problem(7168, 2048, fp8=fp8, regime=1, masked_rows=256), H100).kernel == "deepgemm"
    # DeepGEMM's path needs Triton for its permute and activation: without it the reference runs
    no_triton = Capabilities("cuda", (9, 0), None, "triton is not installed")
    assert experts(small, no_triton).kernel == "reference"


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("regime", range(len(ROW_REGIMES) + 1))
def test_measured_preference_per_regime(fp8, regime):
    """The shipped rule: on one GPU fp8 weights take Triton's sorted layout up to 64 rows per expert and DeepGEMM
    above; bf16 weights take Triton at every size; behind EP dispatch (``masked_rows``) DeepGEMM above decode."""
    assert deepgemm.LOCAL_FROM_REGIME == {False: None, True: 3}
    assert ROW_REGIMES[deepgemm.LOCAL_FROM_REGIME[True] - 1] == 64
    local = experts(problem(7168, 2048, fp8=fp8, regime=regime), H100)
    want = "deepgemm" if fp8 and regime >= 3 else "triton"
    assert (local.kernel, local.error) == (want, None)
    if regime == 0:
        assert local.reasons["deepgemm"].startswith("decode-size batch")
    elif want == "triton":
        why = local.reasons["deepgemm"]
        where = "fp8 weights up to 64 rows per expert" if fp8 else "bf16 weights at every size"
        assert why.startswith(f"{where} on one GPU: Triton's sorted layout measured as fast or faster"), why
        # the figures the reason cites are in the repository
        source = deepgemm.LOCAL_CHOICE_SOURCE
        assert f"({source})" in why and (Path(__file__).parents[1] / source).is_file()
    else:
        assert local.reasons == {"triton": "deepgemm preferred", "reference": "deepgemm preferred"}
    ep = experts(problem(7168, 2048, fp8=fp8, regime=regime, masked_rows=256), H100)
    assert ep.kernel == ("triton" if regime == 0 else "deepgemm")
    # an unknown regime: DeepGEMM where its weight kind prefers it anywhere (fp8), Triton where never (bf16)
    assert experts(problem(7168, 2048, fp8=fp8, regime=None), H100).kernel == ("deepgemm" if fp8 else "triton")
    # a preference, not a capability: an explicit request runs DeepGEMM in every regime
    forced = experts(problem(7168, 2048, fp8=fp8, regime=regime), H100, "deepgemm")
    assert (forced.kernel, forced.error) == ("deepgemm", None)


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
    c = experts(problem(h, i), H100)
    assert c.kernel == "triton"
    assert bad in c.reasons["deepgemm"] and "multiples of 128" in c.reasons["deepgemm"]
    assert c.reasons["reference"] == "triton preferred"


@pytest.mark.usefixtures("deepgemm_wherever_it_runs")
def test_layout_and_bias_rules():
    c = experts(problem(k_major=False), H100)
    assert c.kernel == "triton" and "K-major" in c.reasons["deepgemm"]
    c = experts(problem(w2_bias=True), H100)
    assert c.kernel == "triton" and "bias" in c.reasons["deepgemm"]
    assert experts(problem(w13_bias=True), H100).kernel == "deepgemm"  # the activation kernel adds it
    # non-gated experts: GEMM1's N is I
    c = experts(problem(256, 192, activation=ExpertActivation("relu2", gated=False)), H100)
    assert c.kernel == "triton" and "gemm1 N=192" in c.reasons["deepgemm"]


def test_missing_library_takes_triton_with_the_library_reason():
    c = experts(problem(), NO_DG)
    assert (c.kernel, c.reasons["deepgemm"]) == ("triton", "deep_gemm is not installed")
    c = experts(problem(), Capabilities("cuda", (9, 0), None, "triton is not installed"))
    assert c.kernel == "reference" and "need Triton: triton is not installed" in c.reasons["deepgemm"]
    c = experts(problem(), NO_DG_NO_TRITON)
    assert c.kernel == "reference" and c.reasons["triton"] == "triton is not installed"


def test_old_gpu():
    c = experts(problem(), A100)
    assert c.kernel == "triton" and "SM90" in c.reasons["deepgemm"] and "SM80" in c.reasons["deepgemm"]
    # fp8 tensor cores: Triton needs SM89+, so fp8 weights on an A100 fall back to the reference.
    c = experts(problem(fp8=True), A100)
    assert c.kernel == "reference" and "SM89" in c.reasons["triton"]
    assert experts(problem(fp8=True), L40).kernel == "triton"


def test_cpu_takes_reference_and_honours_a_triton_request():
    c = experts(problem(device="cpu"), CPU)
    assert c.kernel == "reference"
    assert "CUDA" in c.reasons["deepgemm"] and "interpreter" in c.reasons["triton"]
    assert experts(problem(device="cpu"), CPU, "triton").error is None


@pytest.mark.usefixtures("deepgemm_wherever_it_runs")
def test_dtype_block_and_activation_rules():
    c = experts(problem(dtype="float16"), H100)
    assert c.kernel == "triton" and "bfloat16" in c.reasons["deepgemm"]
    bad_block = ExpertsProblem("cuda", "bfloat16", 8, 256, 512, fp8_block=(64, 64))
    c = experts(bad_block, H100)
    assert c.kernel == "reference" and "128x128" in c.reasons["deepgemm"] and "128x128" in c.reasons["triton"]
    for act in ("gelu", "relu2"):
        assert experts(problem(activation=ExpertActivation(act)), H100).kernel == "deepgemm"
    c = experts(problem(activation=ExpertActivation("swish")), H100)
    assert c.kernel == "reference" and "swish" in c.reasons["triton"] and "swish" in c.reasons["deepgemm"]


def test_explicit_requests():
    ok = experts(problem(), H100, "triton")
    assert (ok.kernel, ok.error, ok.requested) == ("triton", None, "triton")
    bad = experts(problem(4000, 512), H100, "deepgemm")
    assert bad.kernel == "deepgemm" and "gemm1 K=4000" in bad.error
    ref = experts(problem(), H100, "reference")
    assert ref.kernel == "reference" and ref.error is None
    with pytest.raises(ValueError, match="unknown experts kernel 'cutlass'"):
        experts(problem(), H100, "cutlass")


def _explain(h, i, *, e=8, t=4096, fp8=False, kernel="auto", caps=H100, device="cuda", dtype=torch.bfloat16):
    """explain_experts on the bound fake arguments of one op call (what explain reads from a traced graph)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from moe_fx.ops.experts import bind_experts

    wd = torch.float8_e4m3fn if fp8 else dtype
    with FakeTensorMode():
        args = [torch.empty(t, h, device=device, dtype=dtype), torch.empty(t, 2, device=device, dtype=torch.long),
                torch.empty(t, 2, device=device), torch.empty(e, 2 * i, h, device=device, dtype=wd),
                torch.empty(e, h, i, device=device, dtype=wd)]
        scales = {"w13_scale": torch.empty(e, -(-2 * i // 128), -(-h // 128), device=device),
                  "w2_scale": torch.empty(e, -(-h // 128), -(-i // 128), device=device)} if fp8 else {}
    return explain_experts(bind_experts(*args, kernel_choice=kernel, **scales), caps=caps)


@pytest.mark.usefixtures("deepgemm_wherever_it_runs")
def test_explain_experts_on_bound_arguments():
    why = _explain(4096, 1024, t=1024)  # 256 rows per expert: the masked layout
    assert (why.kernel, why.layout) == ("deepgemm", "masked") and why.plan.error is None
    why = _explain(4096, 1024)  # 1024 rows per expert: the aligned contiguous layout (no [E, T, H] buffers)
    assert (why.kernel, why.layout) == ("deepgemm", "contiguous") and why.plan.error is None
    why = _explain(4096, 1024, e=3)  # E < 2K: the masked buffers are no larger, so the masked layout stays
    assert (why.kernel, why.layout) == ("deepgemm", "masked")
    why = _explain(4096, 1000, fp8=True)
    assert why.kernel == "triton" and "gemm2 K=1000" in why.reasons["deepgemm"]
    why = _explain(4000, 1024, kernel="deepgemm")
    assert why.kernel == "deepgemm" and "gemm1 K=4000" in why.plan.error
    why = _explain(32, 16, t=5, kernel="triton", caps=CPU, device="cpu", dtype=torch.float32)
    assert (why.kernel, why.layout) == ("triton", "sorted")
    why = _explain(4096, 1024, t=2)  # decode: <= 4 rows per expert
    assert (why.kernel, why.layout) == ("triton", "sorted") and "decode-size batch" in why.reasons["deepgemm"]


def test_explain_says_why_triton_runs_where_deepgemm_could():
    """The shipped rule in explain's regimes line: each regime names the kernel a measured preference passed over
    (decode; fp8 up to 64 rows per expert; bf16 at every size) before the layouts not taken; DeepGEMM's regimes
    name none."""
    source = "bench/results/deepgemm_vs_triton_2026-12-06_h100.md"
    parts = _explain(4096, 1024, fp8=True).regimes.split("; rows per expert ")
    assert [p.split(":")[0].removeprefix("rows per expert ") for p in parts] == ["1..4", "5..64", "65..256", "257.."]
    assert "triton, sorted layout" in parts[0] and "(deepgemm: decode-size batch (<= 4 rows per expert)" in parts[0]
    assert "triton, sorted layout" in parts[1] and (
        "(deepgemm: fp8 weights up to 64 rows per expert on one GPU: Triton's sorted layout measured as fast or "
        f"faster ({source}); local_permute: local_sorted preferred)") in parts[1]
    assert parts[2].startswith("65..256: deepgemm, masked layout (local_sorted:")
    assert parts[3].startswith("257..: deepgemm, contiguous layout (local_sorted:")
    parts = _explain(4096, 1024).regimes.split("; rows per expert ")
    assert [p.split(":")[0].removeprefix("rows per expert ") for p in parts] == ["1..4", "5.."]
    assert "(deepgemm: decode-size batch (<= 4 rows per expert)" in parts[0]
    assert parts[1].startswith(
        "5..: triton, sorted layout, activation in GEMM1's epilogue (deepgemm: bf16 weights at every size on one GPU: "
        f"Triton's sorted layout measured as fast or faster ({source})")
    # without DeepGEMM nothing was passed over: the reasons are the layouts' alone
    no_dg = Capabilities("cuda", (9, 0), "deep_gemm is not installed", None, "x", 132, "NVIDIA H200")
    assert "deepgemm:" not in _explain(4096, 1024, caps=no_dg).regimes


@pytest.mark.usefixtures("deepgemm_wherever_it_runs")
def test_explain_says_layout_and_kernel_per_regime():
    """explain's regimes line is the lowering's own plan for every regime (decide_experts_plan)."""
    why = _explain(4096, 1024)
    assert why.regimes.startswith("rows per expert 1..4: triton, sorted layout, activation in GEMM1's epilogue")
    assert ("5..256: deepgemm, masked layout (local_sorted: the experts kernel reads no sorted layout; local_contiguous: "
            "the masked layout measured faster at <= 256 rows per expert; this one is taken above 256 "
            "(bench/layouts.py)); rows per expert 257..: deepgemm, contiguous layout (local_sorted: the experts kernel "
            "reads no sorted layout; local_permute: local_contiguous preferred)") in why.regimes
    no_dg = Capabilities("cuda", (9, 0), "deep_gemm is not installed", None, "x", 132, "NVIDIA H200")
    why = _explain(2048, 768, e=128, caps=no_dg)
    # gate/up halves: the activation epilogue at every size (where it measured faster), one regime line
    assert why.regimes == ("rows per expert 1..: triton, sorted layout, activation in GEMM1's epilogue "
                           "(local_permute: local_sorted preferred)"), why.regimes
    # under a rows bound (an A/B's setting) the line splits where the plan changes
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(pipeline, "FUSE_HALVES_MAX_ROWS", 64)
        bounded = _explain(2048, 768, e=128, caps=no_dg)
    assert bounded.regimes == ("rows per expert 1..64: triton, sorted layout, activation in GEMM1's epilogue "
                               "(local_permute: local_sorted preferred); rows per expert 65..: triton, sorted layout "
                               "(local_permute: local_sorted preferred)"), bounded.regimes
    fp8 = _explain(2048, 768, e=128, caps=no_dg, fp8=True)
    assert fp8.regimes == "rows per expert 1..: triton, sorted layout (local_permute: local_sorted preferred)"
    # W8A16 on request: bf16 activations (no quantisation, the activation epilogue) up to 16 rows per expert
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(pipeline, "W8A16_MAX_ROWS", 16)
        fp8 = _explain(2048, 768, e=128, caps=no_dg, fp8=True)
    assert fp8.regimes == ("rows per expert 1..16: triton, sorted layout, bf16 activations x fp8 weights, activation "
                           "in GEMM1's epilogue (local_permute: local_sorted preferred); rows per expert 17..: triton, "
                           "sorted layout (local_permute: local_sorted preferred)"), fp8.regimes
    # the decode combine left to Inductor on request: said for the decode regime (1..4 rows per expert) only
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(pipeline, "COMBINE_IN_GRAPH", True)
        why = _explain(2048, 768, e=128, caps=no_dg)
    assert why.regimes.startswith("rows per expert 1..4: triton, sorted layout, activation in GEMM1's epilogue, "
                                  "combine fused by Inductor in compiled graphs (local_permute: local_sorted "
                                  "preferred); rows per expert 5..: triton, sorted layout, activation in GEMM1's "
                                  "epilogue (local_permute"), why.regimes


@pytest.mark.usefixtures("deepgemm_wherever_it_runs")
def test_kernel_names_are_the_ops_contract():
    from moe_fx.ops.checks import EP_KERNELS, KERNELS

    assert {m.NAME for m in select.candidates("experts")} == set(KERNELS) - {"auto"}
    names = {m.NAME for m in select.candidates("prepare_finalize")}
    assert names == (set(EP_KERNELS) - {"auto"}) | set(select.LOCAL_LAYOUTS)
    c = decide("experts", problem(), H100)
    assert c.implementation is select.candidates("experts")[0] and c.implementation.NAME == c.kernel


@pytest.mark.usefixtures("deepgemm_wherever_it_runs")
def test_choice_is_logged_once_per_problem(caplog):
    caplog.set_level(logging.INFO, logger="moe_fx.lowering")
    for _ in range(3):
        select.choose("experts", problem(256, 512), caps=H100)
    select.choose("experts", problem(256, 384), caps=H100)
    msgs = [r.getMessage() for r in caplog.records if r.name == "moe_fx.lowering"]
    assert len(msgs) == 2, msgs
    assert "H=256 I=512" in msgs[0] and msgs[0].endswith(
        "deepgemm [not taken: triton: deepgemm preferred; reference: deepgemm preferred]"
    )


def test_probe_reports_library_state(monkeypatch):
    monkeypatch.setitem(sys.modules, "deep_gemm", None)  # import raises ModuleNotFoundError
    monkeypatch.setattr(problem_mod.importlib.util, "find_spec", lambda name: object())
    assert "failed to import" in problem_mod._deep_gemm_error()
    monkeypatch.setitem(sys.modules, "deep_gemm", types.ModuleType("deep_gemm"))
    assert "lacks m_grouped_bf16_gemm_nt_masked" in problem_mod._deep_gemm_error()
    monkeypatch.setenv(problem_mod.DISABLE_DEEPGEMM_ENV, "1")
    assert "disabled by MOE_FX_DISABLE_DEEPGEMM" in problem_mod._deep_gemm_error()
    caps = problem_mod.probe_capabilities("cpu")
    assert caps.device_type == "cpu" and caps.deep_gemm_error is not None
    assert problem_mod.probe_capabilities("cpu") is caps  # cached
    with assume_capabilities(H100):
        assert problem_mod.probe_capabilities("cuda") is H100


# --- the prepare/finalize family ------------------------------------------------------------------


def ep(**kw) -> DispatchProblem:
    base = dict(world_size=8, device_type="cuda", dtype="bfloat16", hidden=7168, top_k=8, num_experts=256,
                max_tokens_per_rank=128)
    return DispatchProblem(**{**base, **kw})


def test_deepep_taken_when_everything_fits():
    c = decide("prepare_finalize", ep(), H100)
    assert c.kernel == "deepep" and c.error is None
    assert decide("prepare_finalize", ep(use_fp8=True), H100).kernel == "deepep"
    assert c.reasons["local_permute"] == "expert parallelism needs a communication backend"


@pytest.mark.parametrize(
    "kw, deep_ep_error, why",
    [
        ({}, "deep_ep is not installed", "not installed"),
        ({"hidden": 9000}, None, "hidden size 9000"),
        ({"top_k": 10}, None, "top-k 10 above its limit 9"),
        ({"dtype": "float32"}, None, "bfloat16"),
        ({"device_type": "cpu"}, None, "CUDA"),
        ({"max_tokens_per_rank": 3, "world_size": 2, "num_experts": 8}, None, "multiple of 4"),
    ],
)
def test_deepep_fallback_reasons(kw, deep_ep_error, why):
    caps = Capabilities("cuda", (9, 0), None, None, deep_ep_error)
    c = decide("prepare_finalize", ep(**kw), caps)
    # on a GPU the sync-free fixed-size exchange takes over; on CPU the synced one (its host syncs are free)
    assert c.kernel == ("torch_dist" if kw.get("device_type") == "cpu" else "torch_dist_fixed")
    assert why in c.reasons["deepep"]
    ok, reason = deepep_ll.supports(ep(**kw), caps)
    assert not ok and why in reason
    # a (hypothetical) DeepEP build with a hidden size that is not a multiple of 512: fp8 dispatch refused
    ok, reason = deepep_ll.supports(ep(hidden=2176, use_fp8=True), H100, supported_hidden=(2176,))
    assert not ok and "hidden % 512" in reason


def test_deepep_pads_unsupported_hidden_sizes_only_on_request():
    # GPT-OSS's 2880 is not compiled into DeepEP's LL kernels: auto takes the unpadded fixed exchange and
    # says why; an explicit request pads to the next compiled size (4096 in the V1 sources).
    c = decide("prepare_finalize", ep(hidden=2880), H100)
    assert c.kernel == "torch_dist_fixed"
    assert "hidden size 2880" in c.reasons["deepep"] and "padded to 4096" in c.reasons["deepep"]
    padded = decide("prepare_finalize", ep(hidden=2880), H100, "deepep")
    assert (padded.kernel, padded.error) == ("deepep", None)
    assert deepep_ll.padded_hidden(2880) == 4096 and deepep_ll.padded_hidden(7168) == 7168
    assert deepep_ll.padded_hidden(9000) is None


def test_prepare_requests_single_rank_and_local():
    one = ep(world_size=1, num_experts=32)
    c = decide("prepare_finalize", one, H100)
    assert c.kernel == "torch_dist_fixed" and "one rank" in c.reasons["deepep"]
    # An explicit DeepEP request runs it even with one rank (the single-GPU check), or says why not.
    assert decide("prepare_finalize", one, H100, "deepep").kernel == "deepep"
    bad = decide("prepare_finalize", ep(hidden=9000), H100, "deepep")
    assert bad.error is not None and "hidden size 9000" in bad.error
    assert decide("prepare_finalize", ep(), H100, "torch_dist").kernel == "torch_dist"
    assert decide("prepare_finalize", ep(device_type="cpu"), H100).kernel == "torch_dist"
    no_triton = Capabilities("cuda", (9, 0), None, "triton is not installed", None)
    c = decide("prepare_finalize", ep(hidden=9000), no_triton)
    assert c.kernel == "torch_dist" and "Triton" in c.reasons["torch_dist_fixed"]
    with pytest.raises(ValueError, match="unknown prepare_finalize kernel 'nccl'"):
        decide("prepare_finalize", ep(), H100, "nccl")
    local = ep(world_size=1, expert_parallel=False)
    c = decide("prepare_finalize", local, H100)
    assert c.kernel == "local_permute" and "not expert-parallel" in c.reasons["torch_dist"]


# --- the eager registration, on CPU tensors -------------------------------------------------------


def _inputs(t=5, h=32, i=16, e=4, k=2):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(t, h, generator=g)
    ids = torch.randint(0, e, (t, k), generator=g)
    w = torch.rand(t, k, generator=g)
    w13 = torch.randn(e, 2 * i, h, generator=g) / h**0.5
    w2 = torch.randn(e, h, i, generator=g) / i**0.5
    return hidden, ids, w, w13, w2


def test_registration_honours_requests_on_cpu_tensors():
    from moe_fx.ops import experts_reference

    args = _inputs()
    want = experts_reference(*args)
    op = torch.ops.moe_fx.experts
    torch.testing.assert_close(op(*args), want)  # cpu, auto -> reference
    torch.testing.assert_close(op(*args, kernel_choice="reference"), want)
    torch.testing.assert_close(op(*args, kernel_choice="triton"), want, rtol=1e-4, atol=1e-5)  # the interpreter
    with pytest.raises(RuntimeError, match="kernel='deepgemm' was requested but cannot run: needs a CUDA GPU"):
        op(*args, kernel_choice="deepgemm")
    assert op(args[0][:0], args[1][:0], args[2][:0], *args[3:], kernel_choice="triton").shape == (0, 32)


def test_deepgemm_runtime_failure_warns_once_demotes_and_computes_with_triton(monkeypatch, caplog):
    """A DeepGEMM that fails when called (its JIT compiler missing, say): the GEMM still gets computed
    (Triton on the same operands), one warning, and later choices skip DeepGEMM."""
    from moe_fx.lowering.masked_experts import deepgemm

    broken = types.ModuleType("deep_gemm")

    def fail(*a, **kw):
        raise RuntimeError("NVCC compilation failed\nlong compiler log")

    broken.m_grouped_bf16_gemm_nt_masked = broken.m_grouped_fp8_gemm_nt_masked = fail
    monkeypatch.setitem(sys.modules, "deep_gemm", broken)
    monkeypatch.setattr(deepgemm, "_warned", False)
    caplog.set_level(logging.WARNING, logger="moe_fx.lowering")
    g = torch.Generator().manual_seed(1)
    a = torch.randn(2, 8, 32, generator=g).bfloat16()
    b = torch.randn(2, 16, 32, generator=g).bfloat16()
    mm = torch.tensor([3, 8], dtype=torch.int32)
    for _ in range(2):
        out = torch.ops.moe_fx_kernels.deepgemm_masked_gemm(a, None, b, None, mm, 16)
        for e, r in enumerate(mm.tolist()):
            torch.testing.assert_close(out[e, :r].float(), a[e, :r].float() @ b[e].float().t(), rtol=2e-2, atol=2e-2)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "NVCC compilation failed" in warnings[0] and "long compiler log" not in warnings[0]
    assert "failed at run time" in problem_mod._runtime_unusable["deepgemm"]


def test_explain_names_the_gemm_shapes_nobody_tuned(monkeypatch, tmp_path):
    """A Triton plan on a GPU says which GEMM shapes have no tuned tiles there and what they take instead."""
    from moe_fx.lowering.triton import configs

    monkeypatch.setenv("MOE_FX_CACHE_DIR", str(tmp_path))  # the shipped table only, not this machine's cache
    monkeypatch.setattr(configs, "_disk_loaded", None)
    h200 = Capabilities("cuda", (9, 0), "deep_gemm is not installed", None, "x", 132, "NVIDIA H200")
    # Qwen3-30B-A3B's GEMMs (1536 x 2048 and 2048 x 768) are in the shipped table: nothing to say
    assert _explain(2048, 768, e=128, t=16, caps=h200).tiles == ""
    # I=1408 (DeepSeek-V2-Lite's experts): no entries; OLMoE's tuned shapes are the nearest
    why = _explain(2048, 1408, e=64, t=16, caps=h200)
    assert why.kernel == "triton" and why.tiles == (
        "2816x2048: none tuned on NVIDIA H200, the nearest tuned shape's (2048x2048); "
        "2048x1408: none tuned on NVIDIA H200, the nearest tuned shape's (2048x1024) "
        "(tune them: docs/triton.md, Tile configs)"), why.tiles
    # a tiny layer is far from every tuned shape: a heuristic's tiles
    assert _explain(64, 32, t=16, caps=h200).tiles.startswith("64x64: none tuned on NVIDIA H200, a heuristic's")
    # an H100: nothing tuned there; the H200's tiles (the same compute capability) stand in, and explain says so
    h100 = Capabilities("cuda", (9, 0), "deep_gemm is not installed", None, "x", 132, "NVIDIA H100")
    assert _explain(2048, 768, e=128, t=16, caps=h100).tiles.startswith(
        "1536x2048: none tuned on NVIDIA H100, NVIDIA H200's (compute capability 9.0); ")
    assert "2816x2048: none tuned on NVIDIA H100, the nearest tuned shape's (2048x2048 on NVIDIA H200)" in _explain(
        2048, 1408, e=64, t=16, caps=h100).tiles
    # another compute capability borrows nothing
    a100 = Capabilities("cuda", (8, 0), "deep_gemm is not installed", None, "x", 108, "NVIDIA A100")
    assert "1536x2048: none tuned on NVIDIA A100, a heuristic's" in _explain(2048, 768, e=128, t=16, caps=a100).tiles
    # the reference and CPU plans have no tiles to speak of
    assert _explain(32, 16, t=5, kernel="triton", caps=CPU, device="cpu", dtype=torch.float32).tiles == ""
