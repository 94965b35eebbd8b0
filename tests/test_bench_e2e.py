"""bench/e2e_model.py end to end on CPU: its smoke mode writes results files of the expected shape."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "e2e_model.py"


def _run(args: list[str], timeout: float) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout,
                          env=env, cwd=ROOT, check=False)


@pytest.mark.timeout(120)
def test_e2e_model_smoke_writes_results(tmp_path):
    """A tiny one-layer model, one T, default mode, static shapes: two Inductor compiles on CPU (~35 s of
    CPU time, most of it Inductor's C++ builds). Checks the forward row of both backends (times, first-call
    and compile seconds), the markdown tables, the progress lines, and ``--merge`` of the JSON. The layer-host
    and generate cells (four more compiles) are left to a manual ``python bench/e2e_model.py --smoke`` run to
    keep this test short."""
    out = tmp_path / "res"
    proc = _run(["--smoke", "--cpu", "--tokens", "8", "--layers", "1", "--dynamic", "false", "--no-layer-host",
                 "--no-generate", "--no-plot", "--out", str(out), "--tag", "t"], timeout=100)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    [js] = out.glob("e2e_model_*_t.json")
    data = json.loads(js.read_text())
    meta, rows = data["meta"], data["rows"]
    for key in ("date", "gpu", "torch", "triton", "transformers", "command", "deepgemm", "layers", "vocab", "explain"):
        assert key in meta, key
    assert meta["smoke"] is True and meta["device"] == "cpu"
    assert "1/1 regions rewritten" in meta["explain"]["qwen3"], meta["explain"]
    [row] = rows
    assert row["kind"] == "forward" and row["model"] == "qwen3" and row["T"] == 8 and row["mode"] == "default"
    assert "error" not in row, row
    for backend in ("plain", "moe_fx"):
        assert row[backend]["wall_us"] > 0 and row[backend]["host_us"] > 0
        assert row[backend]["gpu_us"] is None and row[backend]["moe_us"] is None  # no CUDA: no profiler numbers
        # the row's first call compiled (static shapes, a new T): its seconds, split by phase
        split = row[backend]["compile"]
        assert split["backend_calls"] >= 1 and split["restarts"] >= 0, split
        for key in ("dynamo_s", "backend_s", "tracing_s", "inductor_s"):
            assert split[key] > 0, (backend, key, split)
        assert row[backend]["first_call_s"] >= split["dynamo_s"] > split["backend_s"], (backend, row[backend])
    assert row["plain"]["compile"]["passes_s"] == 0 < row["moe_fx"]["compile"]["passes_s"]
    assert meta["explain_s"]["qwen3"]["wall_s"] > meta["explain_s"]["qwen3"]["passes_s"] > 0
    assert row["speedup"] == pytest.approx(row["plain"]["wall_us"] / row["moe_fx"]["wall_us"])
    assert row["target"] == 1.0 and isinstance(row["ok"], bool)
    assert meta["limits"] is None and row["moe_floor_us"] is None and row["gpu_ceiling"] is None  # rates: CUDA only
    # the floor's routing, recorded on CPU too: the experts the one layer's router reached (8 tokens, top-2 of 8)
    [hit] = row["experts_hit"]
    assert 2 <= hit <= 8, row["experts_hit"]
    md = js.with_suffix(".md").read_text()
    assert "| qwen3 | bf16 | 1 | default | " in md and "## Host time of one MoE decoder layer" in md and "## generate()" in md
    assert "## Compile time" in md and f"| {row['plain']['first_call_s']:.1f} | {row['moe_fx']['first_call_s']:.1f} |" in md
    assert "qwen3 default T=8 moe_fx: compiled, first call " in proc.stdout, proc.stdout[-2000:]  # the timestamped progress line

    sys.path.insert(0, str(SCRIPT.parent))
    import e2e_model

    merged = tmp_path / "merged"
    e2e_model.merge_runs([str(js), str(js)], str(merged), "m", plot_it=False)
    [mjs] = merged.glob("e2e_model_*_m.json")
    mdata = json.loads(mjs.read_text())
    assert len(mdata["rows"]) == 1 and mdata["meta"]["merged_from"] == [js.name, js.name]


@pytest.mark.timeout(120)
def test_e2e_model_fp8_checkpoint_rows_on_shared_weights(tmp_path):
    """``--weights fp8_checkpoint --share-weights``: moe_fx runs transformers' FP8 experts model (captured),
    plain the model it can run, both on one model's tensors; the logits of both are checked against the
    eager oracle (the dequantised model) and the shared tensors are unchanged at the end."""
    out = tmp_path / "res"
    proc = _run(["--smoke", "--cpu", "--tokens", "8", "--layers", "1", "--dynamic", "false", "--no-layer-host",
                 "--no-generate", "--no-plot", "--out", str(out), "--tag", "f", "--weights", "fp8_checkpoint",
                 "--share-weights"], timeout=100)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    [js] = out.glob("e2e_model_*_f.json")
    data = json.loads(js.read_text())
    meta, [row] = data["meta"], data["rows"]
    assert meta["weights"] == "fp8_checkpoint" and meta["share_weights"] is True
    assert meta["shared_weights_changed"] == {"qwen3": []}
    assert meta["plain_model"]["qwen3"].startswith(("the FP8 model", "the dequantised bf16 model"))
    assert "1/1 regions rewritten (1 with fp8 weights)" in meta["explain"]["qwen3"], meta["explain"]
    assert row["weights"] == "fp8_checkpoint" and "error" not in row, row
    for backend in ("plain", "moe_fx"):
        assert 0 <= row[backend]["logits_err"] < 1e-3, row[backend]
    assert "| qwen3 | fp8_checkpoint | 1 | default |" in js.with_suffix(".md").read_text()


def test_a_failed_first_call_names_its_backend(monkeypatch):
    """A cell whose compile fails records which backend failed (plain or moe_fx), not only the exception."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import e2e_model

    def broken():
        raise AssertionError()  # an empty message, as Inductor's assertion errors often have

    with pytest.raises(AssertionError) as info:
        e2e_model.compiling_call(broken, "forward moe_fx")
    # exceptions take notes from Python 3.11 (the README allows 3.10, where the row has no backend)
    named = " (in forward moe_fx)" if sys.version_info >= (3, 11) else ""
    assert e2e_model.error_text(info.value) == "AssertionError: " + named
    assert e2e_model.error_text(ValueError("bad\nmore")) == "ValueError: bad"


def test_moe_kernels_floor_and_ceiling():
    """The GPU-time ceiling's parts: which profiler names are moe_fx's MoE kernels, the experts a uniform routing
    hits, the floor of a forward's MoE layers, and the ceiling's arithmetic."""
    sys.path.insert(0, str(SCRIPT.parent))
    import e2e_model
    from moe_layer import layer_floor

    for name in ("masked_gemm_kernel", "masked_gemm_kernel_0", "sort_small_kernel", "unpermute_kernel",
                 "void deep_gemm::sm90_fp8_gemm_1d2d_impl<128u>(unsigned int)"):
        assert e2e_model.moe_kernel(name), name
    for name in ("triton_poi_fused_add_0", "triton_red_fused_mul_sum_1", "sm90_xmma_gemm_bf16bf16_bf16f32",
                 "masked_gemm", "void at::native::vectorized_elementwise_kernel<4>()"):
        assert not e2e_model.moe_kernel(name), name
    assert e2e_model.expected_experts_hit(1, 128, 8) == pytest.approx(8)
    assert e2e_model.expected_experts_hit(4096, 8, 2) == pytest.approx(8)
    assert 8 < e2e_model.expected_experts_hit(16, 128, 8) < 128

    limits = {"copy_tbs": 4.0, "bf16_tflops": 600.0, "fp8_tflops": 1200.0}
    spec = e2e_model.MODELS["mixtral"]
    # T=1: two experts' weights stream (3 * H * I bf16 each) plus the token in and out, at 4 TB/s
    nbytes, flops, floor = layer_floor(1, 2, 2, 4096, 14336, False, limits)
    assert nbytes == 2 * 3 * 4096 * 14336 * 2 + 4 * 4096 and floor == pytest.approx(nbytes / 4e6)
    assert flops == 2 * 2 * 3 * 4096 * 14336
    # T=4096: compute-bound; two layers, fp8 halves the floor
    per_layer = 2 * 4096 * 2 * 3 * 4096 * 14336 / 600e6
    assert e2e_model.moe_floor_us(spec, 2, 4096, False, limits) == pytest.approx(2 * per_layer)
    assert e2e_model.moe_floor_us(spec, 2, 4096, True, limits) == pytest.approx(per_layer)
    assert e2e_model.moe_floor_us(spec, 2, 4096, False, None) is None
    # measured routing: one term per layer with the experts it reached (T=1: the weights of 2 and of 1 expert)
    one, two = (layer_floor(1, hit, 2, 4096, 14336, False, limits)[2] for hit in (1, 2))
    assert e2e_model.moe_floor_us(spec, 2, 1, False, limits, [2, 1]) == pytest.approx(two + one)
    assert e2e_model.moe_floor_us(spec, 2, 1, False, limits, []) == pytest.approx(2 * two)  # none seen: uniform
    # plain 13000 µs; moe_fx 12300 µs of which 9600 in its MoE kernels; floor 8500: 13000 / (2700 + 8500)
    got = e2e_model.gpu_ceiling({"gpu_us": 13000.0}, {"gpu_us": 12300.0, "moe_us": 9600.0}, 8500.0)
    assert got == pytest.approx(13000 / 11200)
    assert e2e_model.gpu_ceiling({"gpu_us": 13000.0}, {"gpu_us": 12300.0, "moe_us": 0.0}, 8500.0) is None
    assert e2e_model.gpu_ceiling({"gpu_us": None}, {"gpu_us": None, "moe_us": None}, None) is None


@pytest.mark.parametrize("name", ["qwen3", "mixtral", "gpt_oss", "deepseek_v3", "olmoe"])
def test_routed_experts_hit_counts_each_layers_router(name):
    """The floor's routing, read from transformers' routers by a forward hook: one count per MoE layer; one token
    reaches exactly top-k experts, many tokens at most all of them; a model without a router gives none."""
    import torch

    sys.path.insert(0, str(SCRIPT.parent))
    import e2e_model

    spec = e2e_model.SMOKE_MODELS[name]
    model = e2e_model.build_model(spec, 2, 64, "cpu", torch.float32)
    assert e2e_model.routed_experts_hit(model, torch.tensor([[5]])) == [spec.top_k] * 2
    many = e2e_model.routed_experts_hit(model, torch.arange(3, 51).reshape(1, -1))
    assert len(many) == 2 and all(spec.top_k <= hit <= spec.experts for hit in many), many
    assert not any(hook for m in model.modules() for hook in m._forward_hooks.values())  # hooks removed
    assert e2e_model.routed_experts_hit(torch.nn.Embedding(64, 8), torch.tensor([[5]])) == []


def test_gpu_tally_ranks_kernels_and_the_markdown_lists_them():
    """tally_gpu: per-call totals, the MoE share and the kernels ranked by GPU time (summed over launches of one
    name); the forward rows' markdown gains a section with each side's top kernels; no CUDA: no numbers."""
    sys.path.insert(0, str(SCRIPT.parent))
    import e2e_model

    long_name = "void cutlass::Kernel<" + "x" * 300 + ">"
    events = [("triton_red_fused_softmax_0", 3000.0), ("masked_gemm_kernel", 2000.0), (long_name, 1500.0),
              ("triton_red_fused_softmax_0", 3000.0), ("masked_gemm_kernel", 2000.0), ("Memset (Device)", 100.0)]
    got = e2e_model.tally_gpu(events, iters=2, top=3)
    assert got["gpu_us"] == pytest.approx(11600 / 1e3 / 2) and got["kernels"] == 3
    assert got["moe_us"] == pytest.approx(4000 / 1e3 / 2)
    assert [k[0] for k in got["top_kernels"]] == ["triton_red_fused_softmax_0", "masked_gemm_kernel", long_name[:100]]
    assert got["top_kernels"][0][1:] == [pytest.approx(3.0), 1.0]
    assert e2e_model.tally_gpu([], 0) == {"gpu_us": None, "kernels": None, "moe_us": None, "top_kernels": []}

    side = {"wall_us": 10.0, "wall_spread_us": 1.0, "host_us": 5.0, "kernels": 3, "gpu_us": got["gpu_us"],
            "moe_us": got["moe_us"], "top_kernels": got["top_kernels"]}
    row = {"kind": "forward", "model": "qwen3", "mode": "default", "deepgemm": "disabled", "T": 4096, "layers": 2,
           "plain": dict(side, moe_us=0.0), "moe_fx": side, "speedup": 1.0, "target": 1.3, "ok": False}
    text = e2e_model.markdown({"date": "d", "gpu": "g", "torch": "t", "triton": "tr", "transformers": "tf"}, [row])
    section = text.split("## Where the GPU time goes")[1].split("\n## ")[0]
    lines = [ln for ln in section.splitlines() if ln.startswith("| qwen3")]
    assert [ln.split(" | ")[6] for ln in lines] == ["moe_fx", "plain"]
    assert "`masked_gemm_kernel` 2 x 1" in lines[0] and "`" + long_name[:60] + "` 1 x 0.5" in lines[1]
    cpu_row = dict(row, plain=dict(side, top_kernels=[]), moe_fx=dict(side, top_kernels=[]))
    assert "Where the GPU time goes" not in e2e_model.markdown(
        {"date": "d", "gpu": "g", "torch": "t", "triton": "tr", "transformers": "tf"}, [cpu_row])


def test_compile_table_ratio_only_where_plain_compiled():
    """The compile-time table divides moe_fx's first call by plain's only where plain compiled something: under
    dynamic=True plain's first graph can run a new T while moe_fx compiles its next row regime (plain's first call
    is then a plain forward, and the quotient a meaningless 1000x)."""
    sys.path.insert(0, str(SCRIPT.parent))
    import e2e_model

    def side(first_s: float, calls: int) -> dict:
        return {"first_call_s": first_s, "compile": {"backend_calls": calls, "restarts": 0, "tracing_s": 1.0,
                                                      "passes_s": 0.1, "inductor_s": 2.0}}

    rows = [{"kind": "forward", "model": "qwen3", "mode": "default", "deepgemm": "disabled", "T": t, "layers": 2,
             "plain": side(p_s, p_calls), "moe_fx": side(12.0, 1)}
            for t, p_s, p_calls in ((1024, 10.0, 1), (4096, 0.01, 0))]
    lines = [ln for ln in e2e_model.compile_table(rows, []) if ln.startswith("| qwen3")]
    assert [ln.split(" | ")[8] for ln in lines] == ["1.20x", "plain compiled nothing"], lines


@pytest.mark.timeout(120)
def test_e2e_model_no_forward_runs_no_forward_cell(tmp_path):
    """``--no-forward`` (for generate()-only runs): the model is built and explained at the first T of --tokens,
    no forward cell is compiled or written (here with --no-generate too: a results file without rows). With
    --static-launch and --set (a lowering constant, here at its default) the run says so in its meta and markdown."""
    out = tmp_path / "res"
    proc = _run(["--smoke", "--cpu", "--tokens", "8", "--layers", "1", "--no-forward", "--no-layer-host",
                 "--no-generate", "--no-plot", "--static-launch", "--set", "masked_experts.pipeline.SLOT_ROWS_MAX_TOKENS=1",
                 "--out", str(out), "--tag", "nf"], timeout=100)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    [js] = out.glob("e2e_model_*_nf.json")
    data = json.loads(js.read_text())
    assert data["rows"] == [] and "1/1 regions rewritten" in data["meta"]["explain"]["qwen3"], data["meta"]
    assert "compiled, first call" not in proc.stdout, proc.stdout[-2000:]
    assert data["meta"]["static_launch"] is True
    # --static-launch is one of the settings (--set's mechanism, on the backend's constant)
    assert data["meta"]["settings"] == {"masked_experts.pipeline.SLOT_ROWS_MAX_TOKENS": 1,
                                        "moe_fx.backend.STATIC_LAUNCH_KERNELS": True}
    md = js.with_suffix(".md").read_text()
    assert "launches its Triton kernels statically" in md
    assert "`moe_fx.lowering.masked_experts.pipeline.SLOT_ROWS_MAX_TOKENS` = 1" in md
    assert "`moe_fx.backend.STATIC_LAUNCH_KERNELS` = True" in md


@pytest.mark.timeout(170)
def test_e2e_model_generate_cell(tmp_path):
    """The generate() cell alone on CPU (prefill and decode compiles per side): tokens/s of the three sides and of
    the A/B side (``--ab-set``: moe_fx compiled with a lowering constant, each of its compiles seeing it), the
    decode step's wall time from the decode rate, no GPU split without CUDA, and the markdown rows. Five calls of each
    size a side, their median: with one, another pytest worker's load once made a 1-token call slower than a 3-token
    one."""
    out = tmp_path / "res"
    setting = "masked_experts.pipeline.SLOT_ROWS_MAX_TOKENS"
    proc = _run(["--smoke", "--cpu", "--tokens", "8", "--layers", "1", "--no-forward", "--no-layer-host",
                 "--gen-prompt", "4", "--gen-new", "3", "--gen-rounds", "5", "--no-plot", "--out", str(out),
                 "--ab-set", f"{setting}=3", "--tag", "g"], timeout=160)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    [js] = out.glob("e2e_model_*_g.json")
    data = json.loads(js.read_text())
    [row] = data["rows"]
    assert row["kind"] == "generate" and row["new"] == 3 and "error" not in row, row
    # the decode rate is (batch 2) x (3 - 1) steps over the two calls' difference, None where a loaded machine made
    # the 3-token call no slower than the 1-token one (two-worker fresh-clone runs did, even as a median of five)
    for side in ("eager", "plain", "moe_fx", "moe_fx_ab"):
        got = row[side]
        full, one = got["s_per_call"], got["s_per_call_1_new"]
        assert full > 0 and one > 0, (side, got)
        rate = 2 * 2 / (full - one) if full > one else None
        assert got["decode_tok_s"] == (pytest.approx(rate) if rate else None), (side, got)
        assert got["step_wall_us"] == (pytest.approx((full - one) / 2 * 1e6) if rate else None), (side, got)
        assert 0.0 <= got["same_tokens_as_eager"] <= 1.0
    assert row["eager"]["same_tokens_as_eager"] == 1.0
    for side in ("plain", "moe_fx", "moe_fx_ab"):
        assert row[side]["step_gpu_us"] is None and row[side]["step_kernels"] is None  # no CUDA: no profiler split

    def ratio(a: str, b: str):
        x, y = row[a]["decode_tok_s"], row[b]["decode_tok_s"]
        return pytest.approx(x / y) if x and y else None

    assert row["speedup"] == ratio("moe_fx", "plain")
    # the A/B side compiled graphs of its own (prefill and decode), each with the constant in force; the
    # shipped value (1) is what the run's other sides saw, and it is back at the end
    assert row["ab_set"] == [f"{setting}=3"] and data["meta"]["ab_set"] == [f"{setting}=3"]
    assert len(row["ab_compiles"]) >= 2 and all(c == {setting: 3} for c in row["ab_compiles"]), row["ab_compiles"]
    assert row["moe_fx_ab"]["compile"]["backend_calls"] >= 2
    assert row["ab_speedup"] == ratio("moe_fx_ab", "moe_fx")
    md = js.with_suffix(".md").read_text()
    step = row["plain"]["step_wall_us"]
    assert "| step plain | step moe_fx |" in md and f"| {'-' if step is None else f'{step:.0f}'} / - / - |" in md
    ab = row["ab_speedup"]
    assert "## generate() A/B" in md and f"| `{setting}=3` |" in md and f"| {'-' if ab is None else f'{ab:.3f}'}x |" in md


@pytest.mark.timeout(170)
def test_e2e_model_ab_side_with_fp8_checkpoint_weights(tmp_path):
    """``--ab-set`` with transformers' FP8 experts (``--weights fp8_checkpoint``): the A/B side compiles as the moe_fx
    side does for those weights (module capture of its own module tree, then moe_fx's backend), each compile with
    the constant in force, and its generate() row is written."""
    out = tmp_path / "res"
    setting = "moe_fx.backend.CPP_WRAPPER"
    proc = _run(["--smoke", "--cpu", "--models", "qwen3", "--weights", "fp8_checkpoint", "--layers", "1",
                 "--no-forward", "--no-layer-host", "--gen-prompt", "4", "--gen-new", "3", "--gen-rounds", "1",
                 "--no-plot", "--out", str(out), "--ab-set", f"{setting}=False", "--tag", "f"], timeout=160)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    [js] = out.glob("e2e_model_*_f.json")
    [row] = json.loads(js.read_text())["rows"]
    assert row["kind"] == "generate" and "error" not in row, row
    assert len(row["ab_compiles"]) >= 2 and all(c == {setting: False} for c in row["ab_compiles"]), row["ab_compiles"]
    assert row["moe_fx_ab"]["s_per_call"] > 0


def test_settings_applied_restores():
    """``settings_applied`` (the A/B side's calls): the constants hold inside the ``with``, and afterwards, also
    after an exception, each is back at its value; a name the module lacks fails before anything changes."""
    sys.path.insert(0, str(SCRIPT.parent))
    import moe_layer

    from moe_fx.lowering.masked_experts import pipeline

    shipped_rows, shipped_combine = pipeline.SLOT_ROWS_MAX_TOKENS, pipeline.COMBINE_IN_GRAPH
    pairs = ["masked_experts.pipeline.SLOT_ROWS_MAX_TOKENS=5", "masked_experts.pipeline.COMBINE_IN_GRAPH=True"]
    with moe_layer.settings_applied(pairs) as got:
        assert got == {"masked_experts.pipeline.SLOT_ROWS_MAX_TOKENS": 5, "masked_experts.pipeline.COMBINE_IN_GRAPH": True}
        assert (pipeline.SLOT_ROWS_MAX_TOKENS, pipeline.COMBINE_IN_GRAPH) == (5, True)
    assert (pipeline.SLOT_ROWS_MAX_TOKENS, pipeline.COMBINE_IN_GRAPH) == (shipped_rows, shipped_combine)
    with pytest.raises(RuntimeError, match="body"), moe_layer.settings_applied(pairs[:1]):
        assert pipeline.SLOT_ROWS_MAX_TOKENS == 5
        raise RuntimeError("body")
    assert pipeline.SLOT_ROWS_MAX_TOKENS == shipped_rows
    with pytest.raises(AttributeError, match="NO_SUCH"), moe_layer.settings_applied(
            pairs[:1] + ["masked_experts.pipeline.NO_SUCH=1"]):
        pass
    assert pipeline.SLOT_ROWS_MAX_TOKENS == shipped_rows


def test_decode_step_gpu_subtracts_the_one_token_call(monkeypatch):
    """The per-step GPU split: one generate(N) call less one generate(1) call, over N - 1 steps (the prefill and
    the fixed cost cancel); None for N < 2 and without profiler numbers."""
    sys.path.insert(0, str(SCRIPT.parent))
    import e2e_model

    calls = []

    def fake_profile(fn, iters):
        new = fn()
        return {"gpu_us": 900.0 + 250.0 * new, "kernels": 40 + 30 * new}  # prefill 900 µs, 250 µs a step

    monkeypatch.setattr(e2e_model, "gpu_time_per_call", fake_profile)
    got = e2e_model.decode_step_gpu(lambda new: calls.append(new) or new, 9)
    assert got == {"step_gpu_us": pytest.approx(250.0), "step_kernels": pytest.approx(30.0)} and calls == [9, 1]
    assert e2e_model.decode_step_gpu(lambda new: new, 1) == {"step_gpu_us": None, "step_kernels": None}
    monkeypatch.setattr(e2e_model, "gpu_time_per_call", lambda fn, iters: {"gpu_us": None, "kernels": None})
    assert e2e_model.decode_step_gpu(lambda new: new, 9) == {"step_gpu_us": None, "step_kernels": None}


@pytest.mark.parametrize("name", ["qwen3", "mixtral", "gpt_oss", "deepseek_v3", "olmoe"])
def test_weight_bound_is_a_lower_bound_close_to_the_real_model(name):
    """The pre-flight bound on a model's weight bytes, against the real-size model's parameters (two layers, built
    on the meta device: nothing allocated): never above them, within 10% of them (the experts dominate)."""
    import torch

    sys.path.insert(0, str(SCRIPT.parent))
    import e2e_model

    spec = e2e_model.MODELS[name]
    model = e2e_model.build_model(spec, 2, 32000, "meta", torch.bfloat16)
    real = sum(p.numel() * p.element_size() for p in model.parameters())
    bound = e2e_model.weight_bytes_at_least(spec, 2, 32000, 2)
    assert 0.9 * real <= bound <= real, (bound, real)


def test_memory_refusal_names_what_does_not_fit(monkeypatch):
    """A model whose weights alone exceed the GPU's free memory is refused before it is built (Mixtral-8x7B's 32
    layers on an 80 GB H100), with what it needs and what is free; shared weights count one copy, else three."""
    import torch

    sys.path.insert(0, str(SCRIPT.parent))
    import e2e_model

    spec = e2e_model.MODELS["mixtral"]
    settings = e2e_model.make_settings(e2e_model.parse_args(["--smoke", "--layers", "full"]))
    assert e2e_model.memory_refusal(spec, 32, settings) is None  # CPU: nothing to check
    gpu = e2e_model.dataclasses.replace(settings, device="cuda", dtype=torch.bfloat16)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (79 * 10**9, 80 * 10**9))
    why = e2e_model.memory_refusal(spec, 32, gpu)
    assert why and "at least 93 GB (1 copy)" in why and "79 of 80 GB free" in why, why
    assert e2e_model.memory_refusal(spec, 2, gpu) is None  # two layers fit
    three = e2e_model.memory_refusal(spec, 16, e2e_model.dataclasses.replace(gpu, share_weights=False))
    assert three and "(3 copies)" in three, three
