"""bench/peer_layer.py (one MoE layer, moe_fx against a peer implementation loaded from a file): the peer file's
contract, the alternating rounds, the correctness gate and the results page on CPU; the whole run on a GPU."""

from __future__ import annotations

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
SCRIPT = ROOT / "bench" / "peer_layer.py"

# A peer computing SwiGLU experts densely in fp32 (every expert on every token, weighted by its routing weight:
# no host sync, so CUDA graphs capture it) and one that drops the routing weights (wrong).
REFERENCE_PEER = '''"""Dense fp32 SwiGLU experts as a peer."""
import torch

NAME = "dense_fp32"


def experts(hidden, ids, weights, w13, w2, *, w13_scale=None, w2_scale=None, **kw):
    if w13_scale is not None:
        raise NotImplementedError("bf16 weights only")
    if kw:
        raise NotImplementedError(f"arguments {sorted(kw)}")
    x = hidden.float()
    out = torch.zeros_like(x)
    for e in range(w13.shape[0]):
        gate, up = (x @ w13[e].float().T).chunk(2, dim=-1)
        coef = ((ids == e).float() * weights.float()).sum(-1, keepdim=True)
        out += coef * ((torch.nn.functional.silu(gate) * up) @ w2[e].float().T)
    return out.to(hidden.dtype)
'''
WRONG_PEER = REFERENCE_PEER.replace('"dense_fp32"', '"unweighted"').replace(" * weights.float()", "")


@pytest.fixture(scope="module")
def peer_layer():
    return load_bench("peer_layer")


def _write(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_load_peer_checks_the_contract(peer_layer, tmp_path):
    """A peer file must define NAME and experts(); the error names what is missing and the file."""
    mod = peer_layer.load_peer(_write(tmp_path, "ok.py", REFERENCE_PEER))
    assert mod.NAME == "dense_fp32" and callable(mod.experts)
    with pytest.raises(ValueError, match=r"bad\.py.*experts"):
        peer_layer.load_peer(_write(tmp_path, "bad.py", 'NAME = "x"\n'))
    with pytest.raises(ValueError, match="NAME and experts"):
        peer_layer.load_peer(_write(tmp_path, "empty.py", "\n"))
    with pytest.raises(ValueError, match="no such file"):
        peer_layer.load_peer(str(tmp_path / "absent.py"))


def test_check_side_tells_a_wrong_peer(peer_layer, tmp_path):
    """The correctness gate on fresh random inputs: the reference peer is within bf16 rounding of the fp32
    reference, the peer that ignores the routing weights is far outside it (and would not be timed)."""
    e, k, h, i, t = 4, 2, 32, 16, 5
    g = torch.Generator().manual_seed(0)
    w13 = (torch.randn(e, 2 * i, h, generator=g) / h**0.5).bfloat16()
    w2 = (torch.randn(e, h, i, generator=g) / i**0.5).bfloat16()
    sets = []
    for _ in range(2):
        x = torch.randn(t, h, generator=g).bfloat16()
        w, ids = torch.randn(t, e, generator=g).softmax(-1).topk(k, dim=-1)
        sets.append((x, ids, w.bfloat16()))
    reference = peer_layer.fp32_reference(w13, w2)
    right = peer_layer.load_peer(_write(tmp_path, "ref.py", REFERENCE_PEER))
    wrong = peer_layer.load_peer(_write(tmp_path, "wrong.py", WRONG_PEER))
    moe_layer = load_bench("moe_layer")
    good = peer_layer.check_side(moe_layer.experts_fn(right.experts, w13, w2), reference, sets)
    bad = peer_layer.check_side(moe_layer.experts_fn(wrong.experts, w13, w2), reference, sets)
    assert 0 < good <= peer_layer.MAX_REL_ERR["bf16"] < bad, (good, bad)


def _sides(moe_layer, count: int) -> tuple[list[tuple[torch.Tensor, object]], object]:
    """``count`` compiled sides as the benches make them (``experts_fn`` of one op, each with weights of a shape of
    its own, so each needs its own compile) and the counter of their compiles."""
    from torch._dynamo.testing import CompileCounter

    def op(x, ids, w, w13, w2, **kw):
        return x * w13.sum() + w2.sum()

    counter = CompileCounter()
    sides = [(torch.full((n + 1,), float(n)), torch.compile(moe_layer.experts_fn(op, torch.ones(n + 1), torch.ones(2)),
                                                          backend=counter, dynamic=False)) for n in range(count)]
    return sides, counter


def test_allow_many_compiles_times_every_side_compiled():
    """Past Dynamo's default limit (8 entries a code object) the benches' later sides ran uncompiled; the helper
    lets each compile and turns a hit into an error instead of a silent eager run."""
    moe_layer = load_bench("moe_layer")
    ids, w = torch.zeros(1, dtype=torch.long), torch.ones(1)
    with torch._dynamo.config.patch(recompile_limit=8, cache_size_limit=8, fail_on_recompile_limit_hit=False):
        torch._dynamo.reset()
        sides, counter = _sides(moe_layer, 12)
        for x, fn in sides:  # Dynamo's defaults: 8 compiles, then the frame runs uncompiled
            fn(x, ids, w)
        assert counter.frame_count == 8
        torch._dynamo.reset()
        moe_layer.allow_many_compiles()
        sides, counter = _sides(moe_layer, 12)
        for n, (x, fn) in enumerate(sides):
            torch.testing.assert_close(fn(x, ids, w), x * (n + 1) + 2)
        assert counter.frame_count == 12
        torch._dynamo.reset()
        torch._dynamo.config.recompile_limit = torch._dynamo.config.cache_size_limit = 2  # the helper's error, sooner
        sides, counter = _sides(moe_layer, 3)
        sides[0][1](sides[0][0], ids, w)
        sides[1][1](sides[1][0], ids, w)
        with pytest.raises(torch._dynamo.exc.FailOnRecompileLimitHit):
            sides[2][1](sides[2][0], ids, w)
    torch._dynamo.reset()


def test_alternate_graph_us_alternates_and_takes_medians(peer_layer):
    """Each side's graphs are captured once; the sides alternate over the rounds, the first side alternating
    too; each side's figure is the median of its rounds."""
    calls = []
    values = {"peer": iter([10.0, 30.0, 20.0]), "moe_fx": iter([5.0, 7.0, 100.0])}

    def capture(fn, sets):
        return [fn], None

    def timer(graphs):
        name = graphs[0]
        calls.append(name)
        return next(values[name])

    got = peer_layer.alternate_graph_us({"peer": "peer", "moe_fx": "moe_fx"}, [None], 3, timer=timer,
                                        capture=capture)
    assert calls == ["peer", "moe_fx", "moe_fx", "peer", "peer", "moe_fx"]
    assert got == {"peer": 20.0, "moe_fx": 7.0}


def test_alternate_graph_us_hands_back_the_timed_graphs(peer_layer):
    """``graphs=`` receives each side's captured graphs, one per routing set: ``--kernels`` profiles those, the
    graphs that were timed, not a fresh capture."""
    kept: dict = {}
    peer_layer.alternate_graph_us({"peer": "p", "moe_fx": "m"}, ["a", "b", "c"], 1, timer=lambda graphs: 1.0,
                                  capture=lambda fn, sets: ([f"{fn}{s}" for s in sets], None), graphs=kept)
    assert kept == {"peer": ["pa", "pb", "pc"], "moe_fx": ["ma", "mb", "mc"]}


def test_results_page(peer_layer):
    """A compared row shows both sides, moe_fx / peer and the fractions of the floor; a row that was not
    compared shows why."""
    row = peer_layer.pair_row("qwen3", 16, "bf16", {"peer": 40.0, "moe_fx": 30.0}, {"peer": 4e-3, "moe_fx": 5e-3},
                              {"floor_us": 24.0, "experts_hit": 90}, "vllm_triton")
    assert row["vs_peer"] == {"moe_fx": pytest.approx(0.75)}
    assert row["frac_floor"] == {"peer": pytest.approx(0.6), "moe_fx": pytest.approx(0.8)}
    skipped = {"shape": "qwen3", "T": 1024, "dtype": "fp8", "error": "not compared: {'peer': 'WRONG (9.9e-01)'}"}
    md = peer_layer.markdown({"peer_name": "vllm_triton", "limits": {"copy_tbs": 4.0}}, [row, skipped])
    assert "| shape | T | dtype | vllm_triton µs | moe_fx µs | moe_fx x | floor µs | frac vllm_triton | frac moe_fx |" in md
    assert "| qwen3 | 16 | bf16 | 40.0 | 30.0 | 0.750 | 24.0 | 60% | 80% | peer 4.0e-03, moe_fx 5.0e-03 |" in md
    assert "| qwen3 | 1024 | fp8 | not compared: {'peer': 'WRONG (9.9e-01)'} |" in md
    assert "Kernels of one replay" not in md  # no row was profiled


def test_kernels_table(peer_layer):
    """``--kernels``: each profiled side's kernels in launch order, their sum and the gaps to the side's replay time,
    one line per (row, side); ``--kernels`` with ``--smoke`` (no CUDA graphs) is refused."""
    row = peer_layer.pair_row("mixtral", 256, "bf16", {"peer": 800.0, "moe_fx": 810.0}, {"peer": 4e-3, "moe_fx": 5e-3},
                              {"floor_us": 600.0, "experts_hit": 8}, "vllm_triton")
    row["kernels"] = {"peer": [("align", 5.0), ("fused_moe_kernel", 500.0), ("fused_moe_kernel", 280.0)],
                      "moe_fx": [("sort", 4.0), ("gemm1", 520.0), ("gemm2", 275.5)]}
    md = peer_layer.markdown({"peer_name": "vllm_triton", "limits": {"copy_tbs": 4.0}}, [row])
    assert "## Kernels of one replay (GPU µs, launch order)" in md
    assert "| mixtral | 256 | bf16 | peer | align 5.0 · fused_moe_kernel 500.0 · fused_moe_kernel 280.0 | 785.0 | 15.0 |" in md
    assert "| mixtral | 256 | bf16 | moe_fx | sort 4.0 · gemm1 520.0 · gemm2 275.5 | 799.5 | 10.5 |" in md
    with pytest.raises(SystemExit, match="--kernels profiles CUDA-graph replays: not with --smoke"):
        peer_layer.main(["--peer", "p.py", "--smoke", "--kernels"])


def test_main_needs_a_gpu_or_a_peer(peer_layer, tmp_path):
    """Without CUDA the run stops with a message (after checking the peer file and the shapes) unless it is a
    smoke run; an unknown shape is named."""
    with pytest.raises(SystemExit, match="unknown shape 'nope'"):
        peer_layer.main(["--peer", _write(tmp_path, "ref.py", REFERENCE_PEER), "--shapes", "nope"])
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="needs a CUDA GPU.*--smoke runs on CPU"):
            peer_layer.main(["--peer", _write(tmp_path, "ref2.py", REFERENCE_PEER), "--out", str(tmp_path)])


def test_cells_give_each_shape_its_own_token_counts(peer_layer, tmp_path):
    """``--cells``: each shape with its token counts in the order given (a repeated shape adds its counts); anything
    else is refused with the part named, and it does not mix with --shapes or --tokens."""
    known = {"qwen3": (), "mixtral": ()}
    assert peer_layer.parse_cells("qwen3:1,256/mixtral:64/qwen3:4096", known) == {"qwen3": [1, 256, 4096],
                                                                                    "mixtral": [64]}
    for bad, why in (("dsv3:1", "'dsv3:1' is not SHAPE:T,T"), ("qwen3", "'qwen3' is not SHAPE:T,T"),
                     ("qwen3:", "needs a comma list"), ("qwen3:1,x", "needs a comma list"),
                     ("qwen3:0", "needs a comma list"), ("/", "no cells")):
        with pytest.raises(SystemExit, match=why):
            peer_layer.parse_cells(bad, known)
    peer = _write(tmp_path, "ref.py", REFERENCE_PEER)
    for extra in (["--shapes", "qwen3"], ["--tokens", "1"]):
        with pytest.raises(SystemExit, match="not with --shapes or --tokens"):
            peer_layer.main(["--peer", peer, "--cells", "qwen3:1", *extra])
    with pytest.raises(SystemExit, match="'nope:1' is not SHAPE:T,T"):
        peer_layer.main(["--peer", peer, "--cells", "nope:1"])


@pytest.mark.timeout(120)
def test_smoke_run_end_to_end(peer_layer, tmp_path):
    """``--smoke`` on CPU, the whole script: the dense peer is timed beside moe_fx where it supports the case
    (bf16, Qwen3's form), its other rows say why not; a peer that drops the routing weights is never timed.
    Results, page and plot are written; no floors without measured limits."""
    out = tmp_path / "res"
    peer_layer.main(["--peer", _write(tmp_path, "ref.py", REFERENCE_PEER), "--smoke", "--rounds", "2",
                     "--out", str(out), "--tag", "s"])
    data = json.loads(next(out.glob("peer_layer_*_s.json")).read_text())
    assert data["meta"]["smoke"] is True and data["meta"]["limits"] is None
    by_key = {(r["shape"], r["T"], r["dtype"]): r for r in data["rows"]}
    assert sorted(by_key) == sorted((s, t, d) for s in ("tiny", "tiny_gpt_oss") for t in (1, 5) for d in ("bf16", "fp8"))
    for t in (1, 5):
        row = by_key[("tiny", t, "bf16")]
        assert row["us"]["peer"] > 0 and row["us"]["moe_fx"] > 0 and row["floor_us"] is None
        assert row["rel_err"]["peer"] <= peer_layer.MAX_REL_ERR["bf16"] and row["rel_err"]["moe_fx"] <= 3e-2
        assert "not supported: bf16 weights only" in by_key[("tiny", t, "fp8")]["error"]
        assert "not supported: arguments" in by_key[("tiny_gpt_oss", t, "bf16")]["error"]
    md = next(out.glob("peer_layer_*_s.md")).read_text()
    assert "SMOKE: CPU wall-clock calls" in md and next(out.glob("peer_layer_*_s.png")).stat().st_size > 0
    peer_layer.main(["--peer", _write(tmp_path, "wrong.py", WRONG_PEER), "--smoke", "--cells", "tiny:5,1",
                     "--dtypes", "bf16", "--out", str(out), "--tag", "w"])
    wrong = json.loads(next(out.glob("peer_layer_*_w.json")).read_text())["rows"]
    assert [r["T"] for r in wrong] == [5, 1] and all("WRONG" in r["error"] and "us" not in r for r in wrong), wrong


def _with_root_on_path() -> dict[str, str]:
    """The environment with the repository on ``PYTHONPATH``: the script imports moe_fx, which a checkout that
    is not pip-installed (the GPU machine's copy) has only there."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}


@gpu
@pytest.mark.gpu
@pytest.mark.timeout(400)
def test_peer_layer_runs_on_the_gpu(tmp_path):
    """The whole script on a GPU: OLMoE's layer (E=64, K=8, H=2048, I=1024) at T=1 and 16, bf16 and fp8,
    against a dense fp32 peer (bf16 only: its fp8 rows say so) and against a wrong peer (no time)."""
    out = tmp_path / "res"
    for name, text, dtypes in (("ref.py", REFERENCE_PEER, "bf16,fp8"), ("wrong.py", WRONG_PEER, "bf16")):
        proc = subprocess.run(
            [sys.executable, str(SCRIPT), "--peer", _write(tmp_path, name, text), "--shapes", "olmoe",
             "--tokens", "1,16", "--dtypes", dtypes, "--rounds", "2", "--out", str(out), "--tag", name[:-3]],
            capture_output=True, text=True, timeout=380, cwd=ROOT, check=False, env=_with_root_on_path())
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    ref = json.loads(next(out.glob("peer_layer_*_ref.json")).read_text())
    assert next(out.glob("peer_layer_*_ref.png")).stat().st_size > 0
    bf16 = [r for r in ref["rows"] if r["dtype"] == "bf16"]
    assert [r["T"] for r in bf16] == [1, 16] and all("error" not in r for r in bf16), bf16
    for r in bf16:
        assert r["us"]["peer"] > 0 and r["us"]["moe_fx"] > 0 and r["floor_us"] > 0 and r["experts_hit"] >= 8
        assert r["vs_peer"]["moe_fx"] == pytest.approx(r["us"]["moe_fx"] / r["us"]["peer"])
        assert r["rel_err"]["moe_fx"] <= 3e-2 and r["rel_err"]["peer"] <= 3e-2
    fp8 = [r for r in ref["rows"] if r["dtype"] == "fp8"]
    assert fp8 and all("not supported: bf16 weights only" in r["error"] for r in fp8), fp8
    wrong = json.loads(next(out.glob("peer_layer_*_wrong.json")).read_text())
    assert len(wrong["rows"]) == 2 and all("WRONG" in r["error"] and "us" not in r for r in wrong["rows"]), wrong["rows"]


def test_plot_draws_the_timed_rows(peer_layer, tmp_path):
    """The plot has one panel per weight dtype and one line per (shape, moe_fx side) through the timed rows, in
    T order; rows without times are left out."""
    rows = [peer_layer.pair_row("qwen3", t, "bf16", {"peer": 10.0 * t, "moe_fx": 9.0 * t}, {}, {"floor_us": 1.0},
                                "p") for t in (64, 1, 16)]
    rows.append({"shape": "qwen3", "T": 4096, "dtype": "fp8", "error": "skipped: time budget"})
    path = tmp_path / "p.png"
    import matplotlib.pyplot as plt

    drawn = {}
    real_savefig = plt.Figure.savefig

    def spy(fig, *args, **kwargs):
        drawn["axes"] = [[(line.get_label(), list(line.get_xdata()), list(line.get_ydata())) for line in ax.lines]
                         for ax in fig.axes]
        return real_savefig(fig, *args, **kwargs)

    plt.Figure.savefig = spy
    try:
        peer_layer.plot(str(path), {"peer_name": "p", "gpu": "test"}, rows)
    finally:
        plt.Figure.savefig = real_savefig
    assert path.stat().st_size > 0
    [panel] = drawn["axes"]  # the fp8 row has no time: no panel for it
    [(label, xs, ys), _one] = panel  # the moe_fx line, then the y = 1 line
    assert label == "qwen3 moe_fx" and xs == [1, 16, 64] and ys == pytest.approx([0.9, 0.9, 0.9])
