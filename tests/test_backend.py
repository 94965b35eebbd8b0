"""The backend, its registration, Inductor's cache key, explain and the command line."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from helpers import experts_in_one_copy, run_captured

import moe_fx
from moe_fx.backend import cache_salt, passes_fingerprint
from moe_fx.lowering.settings import changed_settings, settings_fingerprint
from moe_fx.testing.models import DenseBmmMoE, tiny_hf_model


def test_entry_point_backend_works_without_importing_moe_fx(tmp_path):
    """`torch.compile(m, backend="moe_fx")` in a fresh process that never imports moe_fx itself."""
    script = textwrap.dedent(
        """
        import sys, torch
        import torch.nn.functional as F
        assert "moe_fx" in torch._dynamo.list_backends(), torch._dynamo.list_backends()
        torch.manual_seed(0)
        E, K, H, I, T = 4, 2, 16, 8, 5
        router = torch.randn(E, H); w13 = torch.randn(E, 2 * I, H) * 0.3; w2 = torch.randn(E, H, I) * 0.3
        def moe(x):
            w, ids = torch.topk(F.softmax(x @ router.t(), dim=-1), K)
            dense = torch.zeros(x.shape[0], E).scatter(1, ids, w)
            h = torch.bmm(x.unsqueeze(0).expand(E, -1, -1), w13.transpose(1, 2))
            g, u = h.chunk(2, dim=-1)
            return (torch.bmm(F.silu(g) * u, w2.transpose(1, 2)) * dense.t().unsqueeze(-1)).sum(0)
        x = torch.randn(T, H)
        assert "moe_fx" not in sys.modules
        with torch.no_grad():
            got = torch.compile(moe, backend="moe_fx")(x)
        torch.testing.assert_close(got, moe(x), rtol=1e-4, atol=1e-4)
        print("OK", "moe_fx" in sys.modules)
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("OK True")


def test_cache_key_follows_pass_sources(tmp_path, monkeypatch):
    from moe_fx import backend

    salt = cache_salt()
    assert salt.uuid() == f"moe_fx-{passes_fingerprint()}-{settings_fingerprint()}"
    # A copy of the package whose pass source differs gets another fingerprint.
    pkg = Path(moe_fx.__file__).parent
    copy = tmp_path / "moe_fx"
    shutil.copytree(pkg, copy, ignore=shutil.ignore_patterns("__pycache__"))
    before = backend._fingerprint_of(copy, moe_fx.__version__)
    assert before == passes_fingerprint()
    (copy / "passes" / "rewrite_moe.py").write_text((copy / "passes" / "rewrite_moe.py").read_text() + "\n# changed\n")
    changed_source = backend._fingerprint_of(copy, moe_fx.__version__)
    assert changed_source != before
    # so does one whose shipped tile table differs (an upgrade that only retunes tiles: the lowering plans with it)
    table = copy / "lowering" / "triton" / "tuned_tiles.json"
    entries = json.loads(table.read_text())
    entries.pop(next(iter(entries)))
    table.write_text(json.dumps(entries))
    assert backend._fingerprint_of(copy, moe_fx.__version__) not in (before, changed_source)


def _clear_moe_fx_environment(monkeypatch) -> None:
    """No MOE_FX_* variable of the machine's environment in this test (they are settings too)."""
    import os

    for key in [k for k in os.environ if k.startswith("MOE_FX_")]:
        monkeypatch.delenv(key)


def test_cache_key_follows_lowering_settings(tmp_path, monkeypatch):
    """The key changes with each setting the lowering reads while a graph compiles (a module switch, a MOE_FX_*
    variable, the user's tuned tiles), goes back with it, and ignores what was imported before."""
    import importlib
    import json

    from moe_fx.lowering.masked_experts import pipeline

    _clear_moe_fx_environment(monkeypatch)
    salt = cache_salt()
    base = salt.uuid()
    importlib.import_module("moe_fx.lowering.triton.decode")  # a module loaded later holds its source's values
    assert salt.uuid() == base
    monkeypatch.setattr(pipeline, "COMBINE_IN_GRAPH", not pipeline.COMBINE_IN_GRAPH)
    assert salt.uuid() != base
    assert changed_settings() == {"moe_fx.lowering.masked_experts.pipeline.COMBINE_IN_GRAPH": repr(
        pipeline.COMBINE_IN_GRAPH)}
    monkeypatch.setattr(pipeline, "COMBINE_IN_GRAPH", not pipeline.COMBINE_IN_GRAPH)
    assert salt.uuid() == base
    monkeypatch.setenv("MOE_FX_DISABLE_DEEPGEMM", "1")
    assert salt.uuid() != base
    monkeypatch.delenv("MOE_FX_DISABLE_DEEPGEMM")
    monkeypatch.setenv("MOE_FX_CACHE_DIR", str(tmp_path))
    no_tiles = salt.uuid()
    (tmp_path / "triton_tiles.json").write_text(json.dumps({"NVIDIA H200|sorted_gemm1": {"block_m": 64}}))
    assert salt.uuid() != no_tiles


def test_compiled_graph_cache_misses_after_a_setting_changes(monkeypatch):
    """AOTAutograd's cache (in front of Inductor's) replays a moe_fx graph compiled with the same settings, and
    compiles anew once a lowering setting changed: its code would otherwise keep the old decisions."""
    from torch._dynamo.utils import counters

    from moe_fx.lowering.masked_experts import pipeline

    torch.manual_seed(0)
    model, x = DenseBmmMoE(), torch.randn(4, 32)

    def compile_once() -> tuple[int, int]:
        torch._dynamo.reset()
        counters.clear()
        with torch.no_grad():
            torch.testing.assert_close(torch.compile(model, backend="moe_fx")(x), model(x), rtol=1e-4, atol=1e-4)
        return counters["aot_autograd"]["autograd_cache_hit"], counters["aot_autograd"]["autograd_cache_miss"]

    compile_once()
    assert compile_once() == (1, 0)
    monkeypatch.setattr(pipeline, "COMBINE_IN_GRAPH", not pipeline.COMBINE_IN_GRAPH)
    assert compile_once() == (0, 1)


class _CountingPass:
    """A user's Inductor post-grad pass: counts the graphs it sees; ``key`` is its uuid (None: not cacheable)."""

    def __init__(self, key: str | None) -> None:
        from torch._inductor.custom_graph_pass import CustomGraphPass

        outer = self

        class Pass(CustomGraphPass):
            def __call__(self, graph) -> None:
                outer.graphs += 1

            def uuid(self):
                return key

        self.graphs, self.pass_ = 0, Pass()


def test_cache_salt_runs_and_keys_the_users_post_grad_pass():
    """The salt takes Inductor's one post-grad slot: a user's pass there runs inside it, its uuid joins the key, and
    a pass Inductor could not key leaves the salt without a uuid (Inductor then skips its caches)."""
    own = cache_salt().uuid()
    first, second = _CountingPass("first-v1"), _CountingPass("second-v1")
    salt = cache_salt([first.pass_, second.pass_])
    assert salt.uuid() == f"{own}-first-v1-second-v1"
    assert cache_salt(_CountingPass("first-v2").pass_).uuid() == f"{own}-first-v2"
    salt(torch.fx.Graph())
    assert (first.graphs, second.graphs) == (1, 1)
    assert cache_salt(_CountingPass(None).pass_).uuid() is None
    assert cache_salt(lambda graph: None).uuid() is None


@pytest.mark.parametrize("where", ["options", "global"])
def test_backend_keeps_the_users_post_grad_pass(where, monkeypatch):
    """A post-grad pass the user gives Inductor (torch.compile's options, or Inductor's config) still runs under
    backend="moe_fx", whose cache salt uses the same slot, and the output is still right."""
    import torch._inductor.config as inductor_config

    torch.manual_seed(0)
    model, x = DenseBmmMoE(), torch.randn(4, 32)
    user = _CountingPass(f"user-{where}")
    options = {}
    if where == "options":
        options["options"] = {"post_grad_custom_post_pass": user.pass_}
    else:
        monkeypatch.setattr(inductor_config, "post_grad_custom_post_pass", user.pass_)
    torch._dynamo.reset()
    with torch.no_grad():
        got = torch.compile(model, backend="moe_fx", **options)(x)
    torch.testing.assert_close(got, model(x), rtol=1e-4, atol=1e-4)
    assert user.graphs >= 1


def test_cache_salt_keys_the_op_under_plain_inductor(monkeypatch):
    """docs/lowering.md's recipe for calling the op under plain Inductor: with ``cache_salt()`` in the options,
    AOTAutograd's cache replays the graph while nothing changed and compiles anew after a lowering setting did."""
    from torch._dynamo.utils import counters

    from moe_fx.lowering.masked_experts import pipeline

    torch.manual_seed(0)
    e, k, h, i, t = 4, 2, 16, 8, 5
    w13, w2, x = torch.randn(e, 2 * i, h) * 0.3, torch.randn(e, h, i) * 0.3, torch.randn(t, h)
    w, ids = torch.randn(t, e).softmax(-1).topk(k, dim=-1)

    def fn(x):
        return torch.ops.moe_fx.experts(x, ids, w, w13, w2)

    def compile_once() -> tuple[int, int]:
        torch._dynamo.reset()
        counters.clear()
        compiled = torch.compile(fn, options={"post_grad_custom_post_pass": cache_salt()})
        torch.testing.assert_close(compiled(x), fn(x))
        return counters["aot_autograd"]["autograd_cache_hit"], counters["aot_autograd"]["autograd_cache_miss"]

    compile_once()
    assert compile_once() == (1, 0)
    monkeypatch.setattr(pipeline, "COMBINE_IN_GRAPH", not pipeline.COMBINE_IN_GRAPH)
    assert compile_once() == (0, 1)


def test_grad_mode_leaves_graph_untouched():
    torch.manual_seed(0)
    model = DenseBmmMoE()
    torch._dynamo.reset()
    from helpers import capture_backend

    backend, cap = capture_backend()
    x = torch.randn(4, 32)
    out = torch.compile(model, backend=backend)(x)  # grad enabled, parameters require grad
    assert "moe_fx" not in cap.code
    assert "grad mode" in cap.reports[0].reason
    out.sum().backward()  # training still works, through the model's own ops
    assert model.gate_up.grad is not None


def test_explain_reports_every_layer_and_reasons():
    model = tiny_hf_model("deepseek_v3", num_layers=2, dtype=torch.bfloat16)
    report = moe_fx.explain(model, torch.randint(0, 128, (1, 6)))
    assert [r.layer for r in report.matched] == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    r = report.matched[0]
    assert (r.family, r.form, r.num_experts, r.top_k, r.hidden, r.intermediate, r.dtype) == (
        "DeepseekV3", "grouped_mm", 8, 2, 32, 16, "bfloat16")
    assert r.kernel == "reference" and "interpreter" in r.kernel_reasons["triton"]
    text = str(report)
    assert "2 of 2 MoE region(s) rewritten in 1 graph(s)" in text
    assert "DeepseekV3/grouped_mm" in text

    near_miss = moe_fx.explain(DenseBmmMoE(variant="tanh"), torch.randn(4, 32))
    assert not near_miss.matched
    assert "unsupported op 'tanh'" in str(near_miss)


def test_explain_names_lowering_settings_that_differ_from_the_defaults(monkeypatch):
    """A switch set by hand or a MOE_FX_* variable shows in explain's notes (the kernels follow it); none by
    default."""
    from moe_fx.lowering.masked_experts import pipeline

    _clear_moe_fx_environment(monkeypatch)
    model, x = DenseBmmMoE(), torch.randn(4, 32)
    assert not [n for n in moe_fx.explain(model, x).notes if "lowering settings" in n]
    monkeypatch.setattr(pipeline, "SLOT_ROWS_MAX_TOKENS", 4)
    monkeypatch.setenv("MOE_FX_DISABLE_DEEPGEMM", "1")
    text = str(moe_fx.explain(model, x))
    assert ("note: lowering settings differ from moe_fx's defaults: masked_experts.pipeline.SLOT_ROWS_MAX_TOKENS=4, "
            "$MOE_FX_DISABLE_DEEPGEMM=1") in text


def test_cli_explain_prints_report(capsys):
    from moe_fx.__main__ import main

    assert main(["explain", "--family", "mixtral", "--layers", "1"]) == 0
    out = capsys.readouterr().out
    assert "model.layers.0.mlp.experts" in out and "Mixtral/grouped_mm" in out and "1 of 1" in out
    torch._dynamo.reset()
    assert main(["explain", "--family", "mixtral", "--layers", "1", "--dynamic"]) == 0
    assert "symbolic (traced at 8)" in capsys.readouterr().out


def test_compile_rejects_backend_kwarg_and_bad_config():
    with pytest.raises(TypeError, match="picks the backend itself"):
        moe_fx.compile(DenseBmmMoE(), backend="inductor")
    with pytest.raises(TypeError, match="config must be a MoEConfig or None, got dict"):
        moe_fx.compile(DenseBmmMoE(), config={"kernel": "triton"})
    with pytest.raises(ValueError, match="MoEConfig.kernel"):
        moe_fx.MoEConfig(kernel="cublas")


def test_verify_never_still_matches_structurally():
    torch.manual_seed(0)
    _, cap = run_captured(DenseBmmMoE(), torch.randn(4, 32), config=moe_fx.MoEConfig(verify="never"))
    assert cap.reports[0].matched and cap.reports[0].verified == "unverified"


def test_quantize_fp8_packs_weights_once_at_rewrite_time():
    model = tiny_hf_model("qwen3_moe", num_layers=2, dtype=torch.bfloat16, hidden=128, intermediate=128)
    with torch.no_grad():
        # Layer 1 routes every token the same way whatever its input (exactly equal scores), so the fp8
        # error of layer 0 cannot flip a near-tie top-k choice there: the bound below does not depend on
        # the machine's bf16 kernels.
        model.model.layers[1].mlp.gate.weight.zero_()
    ids = torch.randint(0, 128, (1, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(ids).logits
    params_before = {n: p.data_ptr() for n, p in model.named_parameters()}
    got, cap = run_captured(model, ids, config=moe_fx.MoEConfig(quantize="fp8"))
    code = cap.code
    assert code.count("torch.ops.moe_fx.experts.default(") == 2
    # Each op reads its own fp8 buffers (`..._scale = moe_fx_fp8_<n>_...` in the call, and the clearing line).
    assert len(set(re.findall(r"w13_scale = (moe_fx_fp8_\d+)_w13_scale", code))) == 2
    assert all(r.fp8 for r in cap.reports if r.matched)
    # The model's own parameters are untouched; the fp8 copies live on the graph module.
    assert params_before == {n: p.data_ptr() for n, p in model.named_parameters()}
    from helpers import rel_err

    # fp8 weights of a random tiny model (0.06 measured), see bench/fp8_accuracy.py
    assert rel_err(got.logits, want) < 0.12


def test_explain_reports_fp8_checkpoint_experts():
    from moe_fx.testing.fp8 import tiny_fp8_hf_model

    model = tiny_fp8_hf_model()
    report = moe_fx.explain(model, torch.randint(0, 64, (1, 5)))
    fp8 = [r for r in report.regions if r.form == "fp8_experts"]
    assert fp8 and all(r.matched and r.fp8 for r in fp8)


def test_expert_loop_through_inductor_shares_storage_without_recompiling():
    from moe_fx.testing.models import LoopMoE

    torch.manual_seed(0)
    torch._dynamo.reset()
    model = LoopMoE()
    compiled = moe_fx.compile(model)
    torch._dynamo.utils.counters.clear()
    with torch.no_grad():
        for seed in range(3):
            x = torch.randn(6, 32, generator=torch.Generator().manual_seed(seed))
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    assert experts_in_one_copy(model.experts)


def test_mode_and_options_of_torch_compile_reach_inductor(monkeypatch):
    """``torch.compile(m, backend="moe_fx", mode="reduce-overhead")`` asks Inductor for CUDA graphs, and the
    MoE block is still rewritten (plain torch.compile hands mode/options to a non-Inductor backend)."""
    import torch._inductor.compile_fx as cfx

    seen = []
    real = cfx.compile_fx

    def spy(gm, inputs, config_patches=None, **kw):
        if config_patches:  # compile_fx calls itself again, patches applied, with none
            seen.append((dict(config_patches), gm.code))
        return real(gm, inputs, config_patches=config_patches, **kw)

    monkeypatch.setattr(cfx, "compile_fx", spy)
    torch.manual_seed(0)
    model = DenseBmmMoE()
    x = torch.randn(4, 32)
    with torch.no_grad():
        want = model(x)
        torch._dynamo.reset()
        got = torch.compile(model, backend="moe_fx", mode="reduce-overhead")(x)
        torch._dynamo.reset()
        torch.compile(model, backend="moe_fx", options={"max_autotune": False})(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert seen[0][0]["triton.cudagraphs"] is True and "torch.ops.moe_fx.experts" in seen[0][1]
    assert seen[1][0]["max_autotune"] is False and "triton.cudagraphs" not in seen[1][0]


def test_static_launch_of_user_kernels_is_one_switch_the_config_overrides(monkeypatch):
    """``backend.STATIC_LAUNCH_KERNELS`` (on) asks Inductor to launch user-defined Triton kernels statically in a graph
    with CUDA inputs (a CPU graph gets no such patch: it has no CUDA launch to save), the kernels then compile
    in-process (Inductor's workers would not see the option), and ``MoEConfig.inductor_options`` has the last word."""
    import torch._inductor.compile_fx as cfx
    from torch._subclasses.fake_tensor import FakeTensorMode

    from moe_fx import MoEConfig, backend

    seen = []

    def spy(gm, inputs, config_patches=None, **kw):
        seen.append(dict(config_patches or {}))
        return gm.forward  # the patches are what this test reads: no Inductor compile

    monkeypatch.setattr(cfx, "compile_fx", spy)
    gm = torch.fx.symbolic_trace(torch.nn.Linear(4, 4))
    cpu = [torch.randn(2, 4)]
    with FakeTensorMode():
        cuda = [torch.empty(2, 4, device="cuda")]  # a CUDA input's stand-in: no GPU needed
    key = "static_launch_user_defined_triton_kernels"
    assert backend.STATIC_LAUNCH_KERNELS
    backend.MoEFxBackend(captured=True)(gm, cuda)
    backend.MoEFxBackend(captured=True)(gm, cpu)
    backend.MoEFxBackend(MoEConfig(inductor_options={key: False}), captured=True)(gm, cuda)
    monkeypatch.setattr(backend, "STATIC_LAUNCH_KERNELS", False)
    backend.MoEFxBackend(captured=True)(gm, cuda)
    assert seen[0][key] is True and seen[0]["compile_threads"] == 1
    assert key not in seen[1] and "compile_threads" not in seen[1]
    assert seen[2][key] is False
    assert key not in seen[3] and "compile_threads" not in seen[3]


def _experts_graph(t: int, weights: torch.dtype = torch.bfloat16, symbolic: bool = False) -> torch.fx.GraphModule:
    """A graph of one ``moe_fx::experts`` call on ``t`` tokens with ``weights`` of that dtype (fp8 with block scales;
    make_fx; ``symbolic``: a dynamic token count)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    e, k, h, i = 4, 2, 16, 32
    fp8 = weights == torch.float8_e4m3fn
    hidden = torch.randn(t, h, dtype=torch.bfloat16 if fp8 else weights)
    ids = torch.randint(0, e, (t, k))
    w = torch.rand(t, k)
    w13 = torch.randn(e, 2 * i, h).to(weights)
    w2 = torch.randn(e, h, i).to(weights)
    s13, s2 = torch.ones(e, 1, 1), torch.ones(e, 1, 1)

    def layer(hidden, ids, w, w13, w2, s13, s2):
        return torch.ops.moe_fx.experts(hidden, ids, w, w13, w2, w13_scale=s13 if fp8 else None,
                                        w2_scale=s2 if fp8 else None)

    return make_fx(layer, tracing_mode="symbolic" if symbolic else "fake")(hidden, ids, w, w13, w2, s13, s2)


def test_cpp_wrapper_goes_to_decode_sized_graphs_only(monkeypatch):
    """``backend.CPP_WRAPPER``: Inductor's C++ wrapper for graphs on CUDA whose experts ops take bf16, fp16 or fp8
    weights and a static token count of at most ``CPP_WRAPPER_MAX_TOKENS``; every other graph is refused, with the
    reason."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from moe_fx import backend

    with FakeTensorMode():
        cuda = [torch.empty(2, 4, device="cuda")]  # a CUDA input's stand-in: no GPU needed
    cpu = [torch.randn(2, 4)]
    decode = _experts_graph(backend.CPP_WRAPPER_MAX_TOKENS)
    monkeypatch.setattr(backend, "CPP_WRAPPER", False)
    assert backend.cpp_wrapper_refusal(decode, cuda, {}) == "moe_fx.backend.CPP_WRAPPER is off"
    monkeypatch.setattr(backend, "CPP_WRAPPER", True)
    assert backend.cpp_wrapper_refusal(decode, cuda, {}) is None
    assert backend.cpp_wrapper_refusal(decode, cpu, {}) == "no CUDA input"
    assert backend.cpp_wrapper_refusal(decode, cuda, {"triton.cudagraphs": True}) == "CUDA graphs"
    assert backend.cpp_wrapper_refusal(decode, cuda, {"cpp_wrapper": False}) == "cpp_wrapper set by the caller"
    n = backend.CPP_WRAPPER_MAX_TOKENS + 1
    assert backend.cpp_wrapper_refusal(_experts_graph(n), cuda, {}) == f"{n} tokens (more than {n - 1})"
    assert backend.cpp_wrapper_refusal(_experts_graph(4, symbolic=True), cuda, {}) == "a dynamic token count"
    monkeypatch.setattr(backend, "CPP_WRAPPER_DYNAMIC", True)  # a symbolic count, by the size it was traced with
    assert backend.cpp_wrapper_refusal(_experts_graph(4, symbolic=True), cuda, {}) is None
    assert backend.cpp_wrapper_refusal(_experts_graph(n, symbolic=True), cuda, {}) == f"{n} tokens (more than {n - 1})"
    monkeypatch.setattr(backend, "CPP_WRAPPER_DYNAMIC", False)
    for dtype in (torch.float16, torch.float8_e4m3fn):
        assert backend.cpp_wrapper_refusal(_experts_graph(4, dtype), cuda, {}) is None, dtype
    assert backend.cpp_wrapper_refusal(_experts_graph(4, torch.float32), cuda, {}) == "torch.float32 weights"
    assert backend.cpp_wrapper_refusal(torch.fx.symbolic_trace(torch.nn.Linear(4, 4)), cuda, {}) == "no moe_fx op"


def test_cpp_wrapper_compile_falls_back_to_the_python_wrapper(caplog):
    """A graph whose C++ wrapper fails to compile is compiled again, as given, with the Python wrapper (logged); the
    C++ attempt gets a copy of the graph (Inductor rewrites what it compiles), and no attempt is made when not asked."""
    from moe_fx import backend

    gm = _experts_graph(2)
    calls = []

    def compile_fn(g, inputs, config_patches):
        calls.append((g, dict(config_patches)))
        if config_patches.get("cpp_wrapper"):
            raise RuntimeError("CppCompileError: 'aoti_torch_cuda__grouped_mm' was not declared")
        return "python wrapper"

    with caplog.at_level("WARNING", logger="moe_fx"):
        got = backend.compile_with_cpp_wrapper_fallback(compile_fn, gm, [], {"a": 1}, cpp_wrapper=True)
    assert got == "python wrapper"
    assert [p for _, p in calls] == [{"a": 1, "cpp_wrapper": True}, {"a": 1}]
    assert calls[0][0] is not gm and calls[0][0].code == gm.code and calls[1][0] is gm
    assert "C++ wrapper failed" in caplog.text and "aoti_torch_cuda__grouped_mm" in caplog.text
    calls.clear()
    assert backend.compile_with_cpp_wrapper_fallback(compile_fn, gm, [], {"a": 1}, cpp_wrapper=False) == "python wrapper"
    assert calls == [(gm, {"a": 1})]


def test_cpp_wrapper_compile_logs_its_time(caplog):
    """A C++-wrapper compile that succeeds returns its result and says at INFO how long it took (on torch 2.11 a deep
    model's wrapper build takes minutes: the log is the user's progress line); a failed one says nothing of a time."""
    from moe_fx import backend

    def compile_fn(g, inputs, config_patches):
        return "c++ wrapper" if config_patches.get("cpp_wrapper") else "python wrapper"

    with caplog.at_level("INFO", logger="moe_fx"):
        got = backend.compile_with_cpp_wrapper_fallback(compile_fn, _experts_graph(2), [], {}, cpp_wrapper=True)
    assert got == "c++ wrapper"
    assert re.search(r"compiled with Inductor's C\+\+ wrapper in \d+\.\d s", caplog.text), caplog.text
    caplog.clear()

    def failing(g, inputs, config_patches):
        if config_patches.get("cpp_wrapper"):
            raise RuntimeError("CppCompileError")
        return "python wrapper"

    with caplog.at_level("INFO", logger="moe_fx"):
        assert backend.compile_with_cpp_wrapper_fallback(failing, _experts_graph(2), [], {}, cpp_wrapper=True) == (
            "python wrapper")
    assert "C++ wrapper failed" in caplog.text and "compiled with Inductor's C++ wrapper in" not in caplog.text


def test_cpp_wrapper_attempt_passes_dynamos_restart_through(caplog):
    """Dynamo's signals raised inside the C++ attempt's compile (a restart of the trace, seen on GPU 2026-12-06 with
    transformers' FP8 experts) reach Dynamo: no Python-wrapper compile, no warning."""
    from torch._dynamo.exc import TensorifyScalarRestartAnalysis

    from moe_fx import backend

    calls = []

    def compile_fn(g, inputs, config_patches):
        calls.append(dict(config_patches))
        raise TensorifyScalarRestartAnalysis

    with caplog.at_level("WARNING", logger="moe_fx"), pytest.raises(TensorifyScalarRestartAnalysis):
        backend.compile_with_cpp_wrapper_fallback(compile_fn, _experts_graph(2), [], {}, cpp_wrapper=True)
    assert calls == [{"cpp_wrapper": True}]
    assert "C++ wrapper failed" not in caplog.text


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_reduce_overhead_replays_cuda_graphs_on_gpu(monkeypatch):
    """mode="reduce-overhead": the compiled MoE model runs as CUDA-graph replays (moe_fx's kernels never
    synchronise with the host) and gives what the same compilation without graphs gives."""
    from helpers import rel_err
    from torch._dynamo.utils import counters
    from torch._inductor.utils import run_and_get_code

    model = tiny_hf_model("qwen3_moe", num_layers=2, dtype=torch.bfloat16, hidden=128, intermediate=128).cuda()
    ids = torch.randint(0, 128, (2, 16), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    with torch.no_grad():
        torch._dynamo.reset()
        # moe_fx.compile: the backend is a callable (backend="moe_fx" needs the package installed)
        want = moe_fx.compile(model)(ids, use_cache=False).logits.float()
        torch._dynamo.reset()
        counters.clear()
        compiled = moe_fx.compile(model, mode="reduce-overhead")
        first, code = run_and_get_code(lambda: compiled(ids, use_cache=False).logits.float().clone())
        outs = [first] + [compiled(ids, use_cache=False).logits.float().clone() for _ in range(4)]
    code = "\n".join(code)
    # the code Inductor generated launches moe_fx's kernels itself; the experts op is not called at run time
    assert "permute_kernel" in code and "masked_gemm" in code and "moe_fx.experts" not in code
    assert not counters["inductor"]["cudagraph_skips"], dict(counters["inductor"])
    for out in outs:
        assert torch.isfinite(out).all() and rel_err(out, want) < 1e-2, rel_err(out, want)


def test_backend_name_works_from_a_checkout_without_entry_points(tmp_path):
    """No installed entry point (moe_fx on PYTHONPATH only): importing moe_fx registers the name."""
    code = textwrap.dedent(
        """
        import importlib.metadata as md
        md.entry_points = lambda **kw: md.EntryPoints([])  # as if moe_fx were not installed
        import torch
        import moe_fx
        from moe_fx.testing.models import DenseBmmMoE
        m = DenseBmmMoE()
        x = torch.randn(4, 32)
        with torch.no_grad():
            ok = torch.allclose(torch.compile(m, backend="moe_fx")(x), m(x), atol=1e-5)
        print("OK", ok)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240, check=False)
    assert out.returncode == 0 and "OK True" in out.stdout, out.stderr[-2000:]


def test_compiled_model_pickles_like_plain_torch_compile(caplog):
    """``pickle.dumps(moe_fx.compile(m))`` works as it does for ``torch.compile(m)`` (before: "Can't pickle
    local object 'make_backend.<locals>.backend'"), and what comes back compiles with the same config."""
    import pickle

    from moe_fx.backend import MoEFxBackend, make_backend

    torch.manual_seed(0)
    model, x = DenseBmmMoE().eval(), torch.randn(5, 32)
    pickle.loads(pickle.dumps(torch.compile(model)))  # the reference behaviour
    config = moe_fx.MoEConfig(verify="never", verify_max_flops=1e9)  # "never": said in the log
    backend = pickle.loads(pickle.dumps(make_backend(config, inductor=False)))
    assert isinstance(backend, MoEFxBackend) and backend.config == config and backend.inductor is False
    torch._dynamo.reset()
    compiled = moe_fx.compile(model, config)
    with torch.no_grad():
        want = model(x)
        torch.testing.assert_close(compiled(x), want, rtol=1e-5, atol=1e-5)
        loaded = pickle.loads(pickle.dumps(compiled))
        torch._dynamo.reset()
        with caplog.at_level("INFO", logger="moe_fx.passes"):
            torch.testing.assert_close(loaded(x), want, rtol=1e-5, atol=1e-5)
    # The loaded model compiled again through the moe_fx passes, with the pickled config.
    assert any("rewritten without a numerical check" in r.getMessage() for r in caplog.records), caplog.text


@pytest.mark.parametrize("form, inductor", [("fp8", False), ("fp8", True), ("loop", False)])
def test_compiled_graph_keeps_no_input_of_its_first_call_alive(form, inductor):
    """Nothing the passes leave behind (weight checks, fp8 re-quantisation) holds the pass context or the
    example inputs (before, with fp8: the ``refresh`` closure held the context and so the first call's inputs)."""
    import gc
    import weakref

    from moe_fx.backend import enable_capture, make_backend
    from moe_fx.testing.models import LoopMoE

    torch._dynamo.reset()
    enable_capture()
    if form == "fp8":
        model = tiny_hf_model("qwen3_moe", num_layers=1, dtype=torch.bfloat16, hidden=128, intermediate=128)
        x = torch.randint(0, 128, (1, 5))
    else:
        model, x = LoopMoE().eval(), torch.randn(5, 32)
    sink: list = []
    config = moe_fx.MoEConfig(quantize="fp8" if form == "fp8" else None)
    compiled = torch.compile(model, backend=make_backend(config, sink=sink, inductor=inductor), dynamic=False)
    first = weakref.ref(x)
    with torch.no_grad():
        compiled(x)
        del x
        gc.collect()
        assert first() is None, "the first call's input is still alive"
        assert [r.fp8 for r in sink if r.matched] == [form == "fp8"]
        compiled(torch.randint(0, 128, (1, 5)) if form == "fp8" else torch.randn(5, 32))  # still runs
