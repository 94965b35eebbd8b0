"""The compiled path on a GPU: Inductor's generated code launches moe_fx's kernels itself.

Run on the GPU machine: ``pytest -m gpu tests/test_compiled_gpu.py``. The CPU side of the same path
(the graph Inductor receives) is tests/test_lowered_graph.py.
"""

from __future__ import annotations

import pytest
import torch
from helpers import rel_err

import moe_fx
from moe_fx.ops import experts_reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
triton = pytest.importorskip("triton")


def _code_of(fn, *args, **kwargs):
    from torch._inductor.utils import run_and_get_code

    out, code = run_and_get_code(fn, *args, **kwargs)
    return out, "\n".join(code)


@pytest.fixture
def fresh_compile(monkeypatch):
    """Compile from scratch: no AOTAutograd / Inductor cache entry (a graph that calls a moe_fx op directly under
    plain Inductor has no moe_fx salt in its key, so a switch a test flips would not reach a cached graph) and no
    kernel module loaded by an earlier test (Inductor reuses a loaded kernel as it was compiled, launcher
    included)."""
    from torch._inductor.codecache import PyCodeCache

    monkeypatch.setattr(torch._inductor.config, "force_disable_caches", True)
    PyCodeCache.cache_clear()


def _layer(t, e=16, k=4, h=256, i=384, dtype=torch.bfloat16, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    hidden = torch.randn(t, h, generator=g, device="cuda").to(dtype)
    logits = torch.randn(t, e, generator=g, device="cuda")
    w, ids = torch.softmax(logits, -1).topk(k, dim=-1)
    w13 = (torch.randn(e, 2 * i, h, generator=g, device="cuda") / h**0.5).to(dtype)
    w2 = (torch.randn(e, h, i, generator=g, device="cuda") / i**0.5).to(dtype)
    return hidden, ids, w, w13, w2


@pytest.mark.parametrize("t", [64, 512])
def test_compiled_op_is_kernel_launches_in_inductor_code(t):
    """The sorted (contiguous) layout's Triton kernels, launched by Inductor's code (Triton asked for: under
    auto an importable DeepGEMM takes these 128-aligned shapes); the activation runs in GEMM1's epilogue at decode
    (T=64: 16 rows per expert) and prefill sizes (T=512: 128 rows) alike, no kernel of its own."""
    hidden, ids, w, w13, w2 = _layer(t)

    def layer(hidden, ids, w):
        return torch.ops.moe_fx.experts(hidden, ids, w, w13, w2, kernel_choice="triton") * 2

    torch._dynamo.reset()
    out, code = _code_of(torch.compile(layer, fullgraph=True), hidden, ids, w)
    for kernel in ("expert_counts_kernel", "sort_slots_kernel", "masked_gemm_kernel", "unpermute_kernel"):
        assert kernel in code, kernel
    assert "activation_kernel" not in code, "the activation epilogue's choice changed"
    assert "moe_fx.experts" not in code
    ref = experts_reference(hidden, ids, w, w13, w2) * 2
    assert rel_err(out, ref) < 1e-2


def test_one_token_compiles_to_three_launches_without_a_sort():
    """A batch-1 decode step (Dynamo specialises T=1): GEMM1 (with the activation), GEMM2 and the combine on rows in
    slot order, no sort kernel in Inductor's code, the reference's numbers."""
    hidden, ids, w, w13, w2 = _layer(1)

    def layer(hidden, ids, w):
        return torch.ops.moe_fx.experts(hidden, ids, w, w13, w2, kernel_choice="triton") * 2

    torch._dynamo.reset()
    out, code = _code_of(torch.compile(layer, fullgraph=True), hidden, ids, w)
    assert "masked_gemm_kernel" in code and "unpermute_kernel" in code
    assert "sort_small_kernel" not in code and "sort_slots_kernel" not in code and "activation_kernel" not in code
    assert rel_err(out, experts_reference(hidden, ids, w, w13, w2) * 2) < 1e-2


@pytest.mark.parametrize("t", [1, 16])
def test_decode_combine_left_to_inductor_gives_the_same_numbers(t, monkeypatch, fresh_compile):
    """``pipeline.COMBINE_IN_GRAPH`` on: a decode step's code (one token: rows in slot order; 16 tokens: sorted rows)
    launches no combine kernel (the weighted sum over K is Inductor's, fused with the ``* 2`` after it), with the
    reference's numbers."""
    from moe_fx.lowering.masked_experts import pipeline

    monkeypatch.setattr(pipeline, "COMBINE_IN_GRAPH", True)
    hidden, ids, w, w13, w2 = _layer(t)

    def layer(hidden, ids, w):
        return torch.ops.moe_fx.experts(hidden, ids, w, w13, w2, kernel_choice="triton") * 2

    torch._dynamo.reset()
    out, code = _code_of(torch.compile(layer, fullgraph=True), hidden, ids, w)
    assert "masked_gemm_kernel" in code and "unpermute_kernel" not in code
    assert rel_err(out, experts_reference(hidden, ids, w, w13, w2) * 2) < 1e-2


@pytest.mark.parametrize("t", [1, 512])
def test_static_launch_of_the_kernels_gives_the_same_numbers(t, monkeypatch, fresh_compile):
    """``backend.STATIC_LAUNCH_KERNELS`` on (Inductor's static launcher for user-defined Triton kernels; those it
    cannot take keep Triton's): a decode step and a prefill-sized call through ``backend="moe_fx"`` give the
    reference's numbers, and at least one moe_fx kernel is launched statically."""
    import torch._inductor.runtime.triton_heuristics as th

    from moe_fx import backend

    monkeypatch.setattr(backend, "STATIC_LAUNCH_KERNELS", True)
    monkeypatch.setattr(backend, "CPP_WRAPPER", False)  # the static launcher is the Python wrapper's
    static = []  # (kernel, launched statically?) as Inductor decided for each compiled kernel
    real = th.StaticTritonCompileResult.can_statically_launch

    def spy(kernel, *args, **kwargs):
        result = real(kernel, *args, **kwargs)
        static.append((kernel.src.fn.__name__, result is not None))
        return result

    monkeypatch.setattr(th.StaticTritonCompileResult, "can_statically_launch", staticmethod(spy))
    hidden, ids, w, w13, w2 = _layer(t)

    def layer(hidden, ids, w):
        return torch.ops.moe_fx.experts(hidden, ids, w, w13, w2, kernel_choice="triton") * 2

    torch._dynamo.reset()
    out = torch.compile(layer, backend="moe_fx", fullgraph=True)(hidden, ids, w)
    assert rel_err(out, experts_reference(hidden, ids, w, w13, w2) * 2) < 1e-2
    assert any(ok and ("gemm" in name or "unpermute" in name) for name, ok in static), static


def _fp8_layer(t):
    """:func:`_layer` with its weights in fp8 (e4m3, 128x128 block scales): ``hidden, ids, w, w13, w2, scales``."""
    from moe_fx.lowering.quant import quantize_fp8_blockwise

    hidden, ids, w, w13, w2 = _layer(t)
    w13, s13 = quantize_fp8_blockwise(w13)
    w2, s2 = quantize_fp8_blockwise(w2)
    return hidden, ids, w, w13, w2, {"w13_scale": s13, "w2_scale": s2}


def _layer_of(t, fp8):
    """A compiled-graph test's layer function on ``t`` tokens (fp8 or bf16 weights), its inputs and the reference's
    output with the tolerance that fits the weights."""
    if fp8:
        hidden, ids, w, w13, w2, scales = _fp8_layer(t)
    else:
        (hidden, ids, w, w13, w2), scales = _layer(t), {}

    def layer(hidden, ids, w):
        return torch.ops.moe_fx.experts(hidden, ids, w, w13, w2, kernel_choice="triton", **scales) * 2

    ref = experts_reference(hidden, ids, w, w13, w2, w13_scale=scales.get("w13_scale"),
                            w2_scale=scales.get("w2_scale")) * 2
    return layer, (hidden, ids, w), ref, (6e-2 if fp8 else 1e-2)


def _cpp_wrapper_spy(monkeypatch) -> list[bool]:
    """A list that gets, at each of the backend's Inductor compiles, whether it asked for the C++ wrapper."""
    import torch._inductor.compile_fx as cfx

    seen = []
    real = cfx.compile_fx

    def spy(gm, inputs, config_patches=None, **kw):
        if config_patches is not None:  # the backend's call (compile_fx calls itself again, without patches)
            seen.append(bool(config_patches.get("cpp_wrapper")))
        return real(gm, inputs, config_patches=config_patches, **kw)

    monkeypatch.setattr(cfx, "compile_fx", spy)
    return seen


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("t", [1, 16])
def test_decode_graph_with_cpp_wrapper_gives_the_python_wrappers_numbers(t, fp8, monkeypatch, fresh_compile, caplog):
    """``backend.CPP_WRAPPER`` on: a decode-sized graph through ``backend="moe_fx"`` compiles with Inductor's C++
    wrapper (no fallback to the Python one) and gives, bit for bit, what the Python wrapper's graph gives."""
    from moe_fx import backend

    layer, inputs, ref, tol = _layer_of(t, fp8)
    seen = _cpp_wrapper_spy(monkeypatch)
    outs = {}
    for on in (False, True):
        monkeypatch.setattr(backend, "CPP_WRAPPER", on)
        torch._dynamo.reset()
        with caplog.at_level("WARNING", logger="moe_fx"):
            outs[on] = torch.compile(layer, backend="moe_fx", fullgraph=True)(*inputs)
    assert seen == [False, True], seen
    assert "C++ wrapper failed" not in caplog.text, caplog.text
    assert torch.equal(outs[True], outs[False])
    assert rel_err(outs[True], ref) < tol


def test_dynamic_decode_graph_with_cpp_wrapper_gives_the_python_wrappers_numbers(monkeypatch, fresh_compile, caplog):
    """``backend.CPP_WRAPPER_DYNAMIC``: a graph with a symbolic token count traced at a decode size compiles with the
    C++ wrapper and gives, bit for bit, the Python wrapper's output at every size it serves (T = 2..16: at most 4 rows
    per expert, one regime, one graph)."""
    from moe_fx import backend

    _, _, _, w13, w2 = _layer(1)

    def layer(hidden, ids, w):
        return torch.ops.moe_fx.experts(hidden, ids, w, w13, w2, kernel_choice="triton") * 2

    seen = _cpp_wrapper_spy(monkeypatch)
    monkeypatch.setattr(backend, "CPP_WRAPPER_DYNAMIC", True)
    sizes = (2, 3, 12, 16)
    outs = {}
    for on in (False, True):
        monkeypatch.setattr(backend, "CPP_WRAPPER", on)
        torch._dynamo.reset()
        compiled = torch.compile(layer, backend="moe_fx", fullgraph=True, dynamic=True)
        with caplog.at_level("WARNING", logger="moe_fx"):
            outs[on] = [compiled(*_layer(t, seed=t)[:3]) for t in sizes]
    assert seen == [False, True], seen
    assert "C++ wrapper failed" not in caplog.text, caplog.text
    for t, got, want in zip(sizes, outs[True], outs[False]):
        hidden, ids, w, _, _ = _layer(t, seed=t)
        assert torch.equal(got, want), t
        assert rel_err(got, experts_reference(hidden, ids, w, w13, w2) * 2) < 1e-2, t


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_prefill_graph_under_the_callers_cpp_wrapper_runs(fp8, fresh_compile):
    """A prefill-sized graph (T=512, 128 rows per expert) compiled with the caller's ``cpp_wrapper`` option: its
    kernels load tiles through pointers (no TMA descriptor made on the device, whose global scratch a C++-launched
    kernel does not get; an fp8 graph so crashed with an illegal memory access, 2026-12-06) and give the Python
    wrapper's numbers."""
    layer, inputs, ref, tol = _layer_of(512, fp8)
    outs = {}
    for on in (False, True):
        torch._dynamo.reset()
        outs[on] = torch.compile(layer, backend="moe_fx", fullgraph=True, options={"cpp_wrapper": on})(*inputs)
    torch.cuda.synchronize()
    assert rel_err(outs[True], outs[False]) < 1e-2
    assert rel_err(outs[True], ref) < tol


def test_dynamic_token_count_recompiles_per_regime_only():
    """One dynamic graph per rows-per-expert regime (<= 4 rows, <= 16, <= 64, <= 256, more), each exact."""
    from torch._dynamo.utils import counters

    _, _, _, w13, w2 = _layer(1)

    def layer(hidden, ids, w):
        return torch.ops.moe_fx.experts(hidden, ids, w, w13, w2)

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(layer, fullgraph=True, dynamic=True)
    for t in (2, 3, 12, 16, 100, 130, 700):
        hidden, ids, w, _, _ = _layer(t, seed=t)
        assert rel_err(compiled(hidden, ids, w), experts_reference(hidden, ids, w, w13, w2)) < 1e-2, t
    # ceil(T * 4 / 16) rows per expert: T = 2..16 -> 1..4 (regime 0), 100, 130 -> 25, 33 (2), 700 -> 175 (3)
    assert counters["stats"]["unique_graphs"] == 3, dict(counters["stats"])


@pytest.mark.parametrize("fp8", [False, True])
def test_compiled_variants_match_reference(fp8):
    """GPT-OSS-style experts (biases, interleaved gate/up, alpha, clamp, up + 1), duplicates and identity
    experts, non-gated experts: compiled equals the reference."""
    from moe_fx.lowering.quant import quantize_fp8_blockwise

    hidden, ids, w, w13, w2 = _layer(96, e=8, k=4, h=256, i=256)
    ids[0] = torch.tensor([3, 3, 3, 3])  # a token naming one expert four times
    ids[1, 0] = -1
    ids[2, 1] = 9  # an identity expert (8 real + 2 identity)
    e, n1, h = w13.shape
    b13 = torch.randn(e, n1, device="cuda")
    b2 = torch.randn(e, h, device="cuda") * 0.1
    kw = dict(w13_bias=b13, w2_bias=b2, gate_up_layout="interleaved", alpha=1.702, limit=7.0, up_offset=1.0,
              identity_experts=2)
    if fp8:
        w13, s13 = quantize_fp8_blockwise(w13)
        w2, s2 = quantize_fp8_blockwise(w2)
        kw.update(w13_scale=s13, w2_scale=s2)

    def layer(hidden, ids, w):
        return torch.ops.moe_fx.experts(hidden, ids, w, w13, w2, **kw)

    torch._dynamo.reset()
    got = torch.compile(layer, fullgraph=True)(hidden, ids, w)
    ref = experts_reference(hidden, ids, w, w13, w2, "silu", False, kw.pop("w13_scale", None),
                            kw.pop("w2_scale", None), **kw)
    assert rel_err(got, ref) < (6e-2 if fp8 else 1e-2), rel_err(got, ref)
    # non-gated, squared ReLU
    w1 = (torch.randn(e, 256, h, device="cuda") / h**0.5).bfloat16()
    w2b = (torch.randn(e, h, 256, device="cuda") / 16).bfloat16()

    def plain(hidden, ids, w):
        return torch.ops.moe_fx.experts(hidden, ids.clamp(max=7), w, w1, w2b, activation="relu2", gated=False)

    torch._dynamo.reset()
    got = torch.compile(plain, fullgraph=True)(hidden, ids, w)
    ref = experts_reference(hidden, ids.clamp(max=7), w, w1, w2b, "relu2", gated=False)
    assert rel_err(got, ref) < 1e-2


def test_out_of_range_ids_follow_the_documented_gpu_rule():
    """On the GPU an id outside [-1, E + identity_experts) contributes nothing (the CPU reference raises)."""
    hidden, ids, w, w13, w2 = _layer(8, e=8, k=2)
    bad = ids.clone()
    bad[0, 0] = 100
    out = torch.ops.moe_fx.experts(hidden, bad, w, w13, w2, kernel_choice="triton")
    skip = bad.clone()
    skip[0, 0] = -1
    assert rel_err(out, experts_reference(hidden, skip, w, w13, w2)) < 1e-2


def test_compiled_hf_model_matches_and_generates():
    pytest.importorskip("transformers")
    from moe_fx.testing.models import tiny_hf_model

    model = tiny_hf_model("qwen3_moe", num_layers=2, dtype=torch.bfloat16, hidden=128, intermediate=128).cuda()
    tokens = torch.randint(0, 128, (2, 24), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    with torch.no_grad():
        torch._dynamo.reset()
        plain = torch.compile(model)(tokens, use_cache=False).logits.float()
        torch._dynamo.reset()
        got, code = _code_of(moe_fx.compile(model), tokens, use_cache=False)
        eager = model(tokens, use_cache=False).logits.float()
    assert "permute_kernel" in code and "moe_fx.experts" not in code
    noise = rel_err(plain, eager)
    assert rel_err(got.logits.float(), eager) < 2 * noise + 1e-2, (rel_err(got.logits.float(), eager), noise)
