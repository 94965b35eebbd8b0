"""bench/moe_layer.py's chain mode: one CUDA graph of consecutive calls, timed per call (on CPU with stand-ins
for the CUDA pieces; on a GPU for real)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _triton_util import gpu
from helpers import load_bench

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "moe_layer.py"


@pytest.fixture(scope="module")
def moe_layer():
    return load_bench("moe_layer")


class _FakeStream:
    def wait_stream(self, other) -> None:
        pass


def test_capture_chain_captures_every_set_once_in_order(moe_layer, monkeypatch):
    """Each set is run once outside the capture (compiles and allocations stay out of the graph), then once
    inside one capture, in order; the per-call time is one replay over the number of calls."""
    events: list[tuple[str, int]] = []
    state = {"capturing": False}

    @contextlib.contextmanager
    def capture(graph):
        state["capturing"] = True
        yield
        state["capturing"] = False

    monkeypatch.setattr(torch.cuda, "Stream", _FakeStream)
    monkeypatch.setattr(torch.cuda, "current_stream", _FakeStream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: events.append(("sync", -1)))
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: "graph")
    monkeypatch.setattr(torch.cuda, "graph", capture)

    def fn(x, ids, w):
        events.append(("capture" if state["capturing"] else "warm", int(x)))

    sets = [(n, None, None) for n in (3, 1, 2)]
    assert moe_layer.capture_chain(fn, sets) == "graph"
    assert events == [("warm", 3), ("warm", 1), ("warm", 2), ("sync", -1),
                      ("capture", 3), ("capture", 1), ("capture", 2)]

    replays = []
    monkeypatch.setattr(moe_layer, "replay_us", lambda graphs: replays.append(graphs) or 30.0)
    assert moe_layer.time_graph_chain(fn, sets) == pytest.approx(10.0)
    assert replays == [["graph"]]  # one graph, replayed whole


def test_chain_mode_options(moe_layer):
    """Chain rows by default up to T=16, of CHAIN_LAYERS calls; --chain-max-t 0 turns them off."""
    args = moe_layer.parse_args([])
    assert (args.chain_max_t, args.chain_layers) == (16, moe_layer.CHAIN_LAYERS) and moe_layer.CHAIN_LAYERS > 1
    assert moe_layer.parse_args(["--chain-max-t", "0", "--chain-layers", "4"]).chain_max_t == 0


def test_markdown_lists_chain_rows_beside_graph_rows(moe_layer, tmp_path):
    """A chain row gets its own line in the rows table and in the per-row comparison with transformers."""
    limits = {"copy_tbs": 3.0, "bf16_tflops": 700.0, "fp8_tflops": 1200.0}
    sets = [(torch.zeros(1, 64), torch.tensor([[0, 3]]), None)]
    rows = []
    for mode, us_fx, us_hf in (("graph", 40.0, 60.0), ("chain", 30.0, 50.0)):
        for impl, us in (("moe_fx_bf16", us_fx), ("hf_grouped_mm", us_hf)):
            rows.append({"shape": "qwen3", "T": 1, "impl": impl, "mode": mode,
                         **moe_layer.row_metrics(us, sets, 16, 2, 64, 32, False, limits)})
    meta = {"date": "2026-12-07T00:00:00", "gpu": "g", "torch": "t", "triton": "tr", "transformers": "tf",
            "hf_compiled": "grouped_mm", "limits": limits}
    path = tmp_path / "m.md"
    moe_layer.write_markdown(str(path), meta, rows)
    text = path.read_text()
    assert "| qwen3 | 1 | moe_fx_bf16 | chain | 30.0 |" in text and "| qwen3 | 1 | moe_fx_bf16 | graph | 40.0 |" in text
    assert "| qwen3 | 1 | chain | hf_grouped_mm | 50.0 | 30.0 (1.67x) |" in text, text


@gpu
@pytest.mark.gpu
def test_chain_graph_replays_every_call(moe_layer):
    """On a GPU, a chain graph's replay writes what each call writes when run alone, for every set."""
    sets = moe_layer.routing_sets(4, 16, 2, 64, 3, seed=1)
    w = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16)
    outs = [torch.full((4, 64), float("nan"), device="cuda", dtype=torch.bfloat16) for _ in sets]
    index = {id(s[0]): n for n, s in enumerate(sets)}

    def fn(x, ids, weights):
        outs[index[id(x)]].copy_((x @ w) * weights.sum(-1, keepdim=True))

    graph = moe_layer.capture_chain(fn, sets)
    for o in outs:
        o.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    for (x, _, weights), o in zip(sets, outs):
        torch.testing.assert_close(o, (x @ w) * weights.sum(-1, keepdim=True), rtol=0, atol=0)
    assert moe_layer.time_graph_chain(fn, sets) > 0


@gpu
@pytest.mark.gpu
@pytest.mark.timeout(400)
def test_layer_script_writes_chain_rows(tmp_path):
    """The script on a GPU: Qwen3's layer at T=1 gives plain, graph and chain rows for moe_fx bf16, each timed."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--shapes", "qwen3", "--tokens", "1", "--impls", "moe_fx_bf16",
         "--chain-layers", "4", "--out", str(tmp_path), "--tag", "chain"],
        capture_output=True, text=True, timeout=380, cwd=ROOT, check=False, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rows = json.loads(next(tmp_path.glob("moe_layer_*_chain.json")).read_text())["rows"]
    by_mode = {r["mode"]: r for r in rows if r["impl"] == "moe_fx_bf16"}
    assert set(by_mode) == {"plain", "graph", "chain"}, rows
    assert all(r.get("us", 0) > 0 and r["experts_hit"] == 8 for r in by_mode.values()), rows


def test_salt_compile_cache_puts_moe_fx_in_inductors_key(moe_layer, monkeypatch):
    import torch._inductor.config as inductor_config

    from moe_fx.backend import passes_fingerprint

    monkeypatch.setattr(inductor_config, "post_grad_custom_post_pass", None)
    moe_layer.salt_compile_cache()
    salt = inductor_config.post_grad_custom_post_pass
    assert salt is not None and passes_fingerprint() in salt.uuid()  # source and tile table in the key
    mine = object()  # a caller's own pass is left alone
    monkeypatch.setattr(inductor_config, "post_grad_custom_post_pass", mine)
    moe_layer.salt_compile_cache()
    assert inductor_config.post_grad_custom_post_pass is mine
