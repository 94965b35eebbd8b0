"""How long the moe_fx passes take on the graph of a deep tiny model, and what fraction of the compile.

``python bench/pass_time.py [--layers 48]``: compiles a tiny random Qwen3-MoE (CPU, fp32) with
``backend="moe_fx"`` (passes + Inductor) and reports the time in the passes against the whole first call, for
``verify="auto"`` (the default), ``"always"`` and ``"never"`` (no numerical check). The verification cost is a
mode's pass time minus ``"never"``'s (the structural reading is in both). Each mode runs in a fresh process with
Inductor's caches off, so that no mode compiles faster for coming second. Writes
bench/results/pass_time_<date>.md.

``python bench/pass_time.py --split [--layers 8,48] [--repeats 2]``: where the first call's time goes, plain
``torch.compile`` against ``backend="moe_fx"`` (``dynamic=True``, the default mode, bench/e2e_model.py's forward),
each run in a fresh process with a fresh ``TORCHINDUCTOR_CACHE_DIR``: Dynamo's tracing, the moe_fx passes and
Inductor (AOT + lowering + code generation + C++/Triton builds), from ``torch._dynamo.utils.compile_times()``
(:func:`compile_split`); ``--specialize-float`` with ``torch._dynamo.config.specialize_float = True``. Writes
bench/results/compile_time_<date>.md.

``python bench/pass_time.py --real gpt_oss,mixtral --layers 4 [--repeats 2]``: the passes on real-size layers of
bench/e2e_model.py's models (bf16; on the GPU where there is one), with the numerical check's random weights drawn
on the device (shipped) and on the host (as until 2026-12-05: :func:`host_random_weight`), the sides alternating.
Writes bench/results/pass_time_real_<date>.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

MODES = ("auto", "always", "never")
SPLIT_BACKENDS = ("plain", "moe_fx")
#: Dynamo's timer names (torch._dynamo.utils.compilation_time_metrics) that compile_split reads, beside the moe_fx
#: backend's own (moe_fx.backend.PASSES_TIMER).
_DYNAMO_COMPILE, _BACKEND_COMPILE = "_compile.compile_inner", "OutputGraph.call_user_compiler"


def compile_metrics() -> dict[str, list[float]]:
    """A copy of Dynamo's per-timer compile times so far in this process (``compile_times()``'s data)."""
    from torch._dynamo.utils import compilation_time_metrics

    return {key: list(values) for key, values in compilation_time_metrics.items()}


def compile_split(before: dict[str, list[float]], after: dict[str, list[float]]) -> dict[str, float | int]:
    """What Dynamo compiled between two :func:`compile_metrics` snapshots, in seconds summed over its graphs.

    ``dynamo_s``: whole Dynamo compiles (tracing, guards, the backend); ``backend_s``: the backend's part
    (plain: Inductor; moe_fx: its passes, then Inductor); ``passes_s``: the moe_fx passes (0 for plain);
    ``inductor_s`` = backend - passes; ``tracing_s`` = dynamo - backend (bytecode tracing, guards, restarts);
    ``backend_calls``: graphs handed to the backend; ``restarts``: Dynamo analyses started again (each
    traces the frame once more and hands its graph to the backend once more: with ``dynamic=True``, a
    float attribute AOTAutograd cannot turn into a tensor restarts the whole compile to specialise it).
    All zero when nothing compiled.
    """

    from moe_fx.backend import PASSES_TIMER

    def new(key: str) -> list[float]:
        return after.get(key, [])[len(before.get(key, [])):]

    dynamo, backend, passes = sum(new(_DYNAMO_COMPILE)), sum(new(_BACKEND_COMPILE)), sum(new(PASSES_TIMER))
    attempts = sum(len(new(key)) for key in after if key.startswith("compile_attempt_"))
    return {"dynamo_s": dynamo, "backend_s": backend, "passes_s": passes, "inductor_s": backend - passes,
            "tracing_s": dynamo - backend, "backend_calls": len(new(_BACKEND_COMPILE)),
            "restarts": max(0, attempts - len(new(_DYNAMO_COMPILE)))}


def measure(layers: int, verify: str) -> dict[str, float]:
    """Seconds for the passes and for the whole first compiled call, for one verify mode."""
    import moe_fx
    import moe_fx.backend as backend_mod
    from moe_fx.testing.models import tiny_hf_model

    torch._dynamo.reset()
    model = tiny_hf_model("qwen3_moe", num_layers=layers)
    ids = torch.randint(0, 128, (1, 16))
    spent = {"passes": 0.0, "matched": 0}
    original = backend_mod._run_moe_passes

    def timed(*args, **kwargs):
        start = time.perf_counter()
        ctx = original(*args, **kwargs)
        spent["passes"] += time.perf_counter() - start
        spent["matched"] += sum(r.matched for r in ctx.report)
        return ctx

    backend_mod._run_moe_passes = timed
    try:
        compiled = moe_fx.compile(model, config=moe_fx.MoEConfig(verify=verify))
        start = time.perf_counter()
        with torch.no_grad():
            compiled(ids)
        total = time.perf_counter() - start
    finally:
        backend_mod._run_moe_passes = original
    return {"passes": spent["passes"], "total": total, "matched": spent["matched"]}


#: Inner timers shown beside the split (where Inductor's time goes): AOT + Inductor, its code generation,
#: the C++ / Triton builds it waits for, loading the generated module.
INNER_TIMERS = ("create_aot_dispatcher_function", "GraphLowering.codegen", "compile_file", "async_compile.wait",
                "PyCodeCache.load_by_key_path", "bytecode_tracing", "build_guards")


def measure_split(layers: int, backend: str, specialize_float: bool = False) -> dict[str, Any]:
    """The first call's seconds and their :func:`compile_split` for ``backend`` (``plain`` or ``moe_fx``) on a
    ``layers``-layer tiny Qwen3-MoE, ``torch.compile(dynamic=True)``, the forward bench/e2e_model.py times;
    ``specialize_float`` sets ``torch._dynamo.config.specialize_float`` (float attributes become constants)."""
    import moe_fx  # noqa: F401  (registers backend="moe_fx" in a source checkout)
    from moe_fx.testing.models import tiny_hf_model

    if backend not in SPLIT_BACKENDS:
        raise ValueError(f"backend must be one of {SPLIT_BACKENDS}, got {backend!r}")
    torch._dynamo.config.specialize_float = specialize_float
    model = tiny_hf_model("qwen3_moe", num_layers=layers)
    ids = torch.randint(0, 128, (1, 16))
    kwargs = {"backend": "moe_fx"} if backend == "moe_fx" else {}
    compiled = torch.compile(model, dynamic=True, **kwargs)
    before = compile_metrics()
    start = time.perf_counter()
    with torch.no_grad():
        compiled(input_ids=ids, use_cache=False, logits_to_keep=1)
    first = time.perf_counter() - start
    after = compile_metrics()
    inner = {key: sum(after.get(key, [])[len(before.get(key, [])):]) for key in INNER_TIMERS}
    return {"first_call_s": first, **compile_split(before, after), "inner": inner}


def _split_in_fresh_process(layers: int, backend: str, specialize_float: bool) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="moe_fx_inductor_cache_") as cache:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "TRITON_CACHE_DIR": os.path.join(cache, "triton")}
        flags = ["--specialize-float"] if specialize_float else []
        out = subprocess.run([sys.executable, __file__, "--layers", str(layers), "--one-split", backend, *flags],
                             env=env, check=True, capture_output=True, text=True, timeout=3600)
    return json.loads(out.stdout.strip().splitlines()[-1])


def split_report(layer_counts: list[int], repeats: int, tag: str, specialize_float: bool = False) -> Path:
    """Run :func:`measure_split` for both backends at each depth, ``repeats`` times (alternating, fresh processes),
    and write the median of each figure to bench/results/compile_time_<date><tag>.md."""
    import statistics

    runs: dict[tuple[int, str], list[dict[str, Any]]] = {}
    for layers in layer_counts:
        for r in range(repeats):
            for backend in (SPLIT_BACKENDS if r % 2 == 0 else SPLIT_BACKENDS[::-1]):
                m = _split_in_fresh_process(layers, backend, specialize_float)
                runs.setdefault((layers, backend), []).append(m)
                print(f"{datetime.datetime.now():%H:%M:%S} layers={layers} {backend}: first call {m['first_call_s']:.1f} s, "
                      f"tracing {m['tracing_s']:.1f}, passes {m['passes_s']:.2f}, inductor {m['inductor_s']:.1f}, "
                      f"backend calls {m['backend_calls']}, restarts {m['restarts']}", flush=True)

    def med(layers: int, backend: str, key: str, inner: bool = False) -> float:
        return statistics.median((m["inner"] if inner else m)[key] for m in runs[(layers, backend)])

    lines = [
        f"# Compile time: plain torch.compile vs backend=\"moe_fx\", tiny Qwen3-MoE (CPU, fp32, T=16, dynamic=True"
        f"{', specialize_float' if specialize_float else ''})",
        "",
        f"{datetime.datetime.now().isoformat(timespec='seconds')} · {platform.processor() or platform.machine()} "
        f"({os.cpu_count()} CPUs, {torch.get_num_threads()} threads) · torch {torch.__version__} · python "
        f"{platform.python_version()} · `python bench/pass_time.py --split --layers "
        f"{','.join(map(str, layer_counts))} --repeats {repeats}{' --specialize-float' if specialize_float else ''}` · each run in a fresh process with a fresh "
        "TORCHINDUCTOR_CACHE_DIR; medians of the runs; CPU: compare ratios only",
        "",
        "first call = the wall time of the first compiled forward (Dynamo + backend + one run); tracing = Dynamo's "
        "compile minus the backend's (bytecode tracing, guards, restarts); passes = moe_fx's passes "
        "(`moe_fx_passes` in `torch._dynamo.utils.compile_times()`); Inductor = the backend minus the passes.",
        "",
        "| layers | backend | first call (s) | tracing (s) | moe_fx passes (s) | Inductor (s) | backend calls | "
        "restarts | first call / plain's |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for layers in layer_counts:
        for backend in SPLIT_BACKENDS:
            ratio = med(layers, backend, "first_call_s") / med(layers, "plain", "first_call_s")
            lines.append(f"| {layers} | {backend} | {med(layers, backend, 'first_call_s'):.1f} | "
                         f"{med(layers, backend, 'tracing_s'):.1f} | {med(layers, backend, 'passes_s'):.2f} | "
                         f"{med(layers, backend, 'inductor_s'):.1f} | {med(layers, backend, 'backend_calls'):.0f} | "
                         f"{med(layers, backend, 'restarts'):.0f} | {ratio:.2f} |")
    lines += ["", "Inside Inductor and Dynamo (s, medians; nested timers: a row includes the rows it calls):", "",
              "| layers | backend | " + " | ".join(INNER_TIMERS) + " |", "|---|---|" + "---|" * len(INNER_TIMERS)]
    for layers in layer_counts:
        for backend in SPLIT_BACKENDS:
            lines.append(f"| {layers} | {backend} | " + " | ".join(f"{med(layers, backend, k, inner=True):.1f}"
                                                               for k in INNER_TIMERS) + " |")
    lines += ["", "All runs (first call s): " + "; ".join(
        f"{layers} layers {backend}: " + ", ".join(f"{m['first_call_s']:.1f}" for m in ms)
        for (layers, backend), ms in runs.items())]
    out = Path(__file__).parent / "results" / f"compile_time_{datetime.date.today()}{tag}.md"
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"wrote {out}")
    return out


def host_random_weight(shape: tuple[int, ...], fan_in: int, gen: torch.Generator, *, device: str | torch.device = "cpu",
                       windowed_bytes: float | None = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``check_numerics.random_weight`` as it was until 2026-12-05 (the "host" side of ``--real``): drawn by the
    probe's generator on the host, then copied to ``device``."""
    import math

    from moe_fx.verify.check_numerics import WINDOWED_BYTES

    windowed_bytes = WINDOWED_BYTES if windowed_bytes is None else windowed_bytes
    std = 1.0 / math.sqrt(max(fan_in, 1))
    if len(shape) == 3 and math.prod(shape) * 4 > windowed_bytes and shape[0] > 1:
        e, a, b = shape
        step = b + 1
        buf = torch.randn(a * b + (e - 1) * step, generator=gen).mul_(std).to(device=device, dtype=dtype)
        return buf.as_strided((e, a, b), (step, b, 1))
    return torch.randn(*shape, generator=gen).mul_(std).to(device=device, dtype=dtype)


#: ``--real`` sides: where the probe's random weights are drawn
REAL_SIDES = ("device", "host")


def measure_real(model: torch.nn.Module, ids: torch.Tensor, side: str) -> dict[str, float]:
    """One ``moe_fx.explain`` of ``model`` (Dynamo + the passes, no Inductor) with the probe's random weights
    drawn as ``side`` says; seconds in the passes and in drawing random weights, regions rewritten."""
    import moe_fx
    from moe_fx.passes.recognize import verify_region
    from moe_fx.verify.check_numerics import random_weight

    draw = {"device": random_weight, "host": host_random_weight}[side]
    spent = {"random_s": 0.0}

    def timed(*args, **kwargs):
        start = time.perf_counter()
        out = draw(*args, **kwargs)
        if out.is_cuda:
            torch.cuda.synchronize()
        spent["random_s"] += time.perf_counter() - start
        return out

    torch._dynamo.reset()
    original = verify_region.random_weight
    verify_region.random_weight = timed
    try:
        report = moe_fx.explain(model, ids)
    finally:
        verify_region.random_weight = original
    return {"passes_s": report.pass_ms / 1e3, "random_s": spent["random_s"], "rewritten": len(report.matched)}


def real_report(models: list[str], layers: int, repeats: int, tag: str, out_dir: Path | None = None) -> Path:
    """The passes on ``layers`` real-size layers of each bench/e2e_model.py model (bf16, on the GPU where there
    is one), the probe's random weights drawn on the device against on the host, sides alternating; writes
    pass_time_real_<date><tag>.md to ``out_dir`` (default bench/results)."""
    import statistics

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import e2e_model

    device = "cuda" if torch.cuda.is_available() else "cpu"
    runs: dict[tuple[str, str], list[dict[str, float]]] = {}
    for name in models:
        model = e2e_model.build_model(e2e_model.MODELS[name], layers, 256, device, torch.bfloat16)
        ids = torch.randint(0, 256, (1, 16), device=device)
        for r in range(repeats):
            for side in REAL_SIDES if r % 2 == 0 else REAL_SIDES[::-1]:
                m = measure_real(model, ids, side)
                runs.setdefault((name, side), []).append(m)
                print(f"{datetime.datetime.now():%H:%M:%S} {name} x{layers} {side}: passes {m['passes_s']:.2f} s, "
                      f"random weights {m['random_s']:.2f} s, {m['rewritten']} rewritten", flush=True)
        del model
        if device == "cuda":
            torch.cuda.empty_cache()
    gpu = torch.cuda.get_device_name() if device == "cuda" else "none (CPU: both sides draw on the host)"
    lines = [
        "# moe_fx passes on real-size layers: the probe's random weights drawn on the device vs on the host",
        "",
        (f"{datetime.datetime.now().isoformat(timespec='seconds')} · {gpu} · {os.cpu_count()} CPUs · torch "
         f"{torch.__version__} · `python bench/pass_time.py --real {','.join(models)} --layers {layers} --repeats "
         f"{repeats}` · moe_fx.explain (Dynamo + passes, no Inductor), bf16 random models, T=16; sides alternating, "
         "medians"),
        "",
        "| model | layers | side | passes (s) | drawing random weights (s) | per layer (s) | regions rewritten |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in models:
        for side in REAL_SIDES:
            ms = runs[(name, side)]
            passes = statistics.median(m["passes_s"] for m in ms)
            lines.append(f"| {name} | {layers} | {side} | {passes:.2f} | "
                         f"{statistics.median(m['random_s'] for m in ms):.2f} | {passes / layers:.3f} | "
                         f"{ms[0]['rewritten']} |")
    out_dir = out_dir or Path(__file__).parent / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / f"pass_time_real_{datetime.date.today()}{tag}.md"
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"wrote {out}")
    return out


def _in_fresh_process(layers: int, verify: str) -> dict[str, float]:
    env = {**os.environ, "TORCHINDUCTOR_FORCE_DISABLE_CACHES": "1"}
    out = subprocess.run([sys.executable, __file__, "--layers", str(layers), "--one", verify], env=env, check=True,
                         capture_output=True, text=True, timeout=3600)
    return json.loads(out.stdout.strip().splitlines()[-1])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (``argv``, default ``sys.argv[1:]``)."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--layers", default="48", help="decoder layers (--split: a comma list)")
    parser.add_argument("--one", choices=MODES, help=argparse.SUPPRESS)  # one mode, in this process
    parser.add_argument("--split", action="store_true", help="plain vs moe_fx compile time, split by phase")
    parser.add_argument("--repeats", type=int, default=1, help="--split: runs per (layers, backend)")
    parser.add_argument("--one-split", choices=SPLIT_BACKENDS, help=argparse.SUPPRESS)  # one run, in this process
    parser.add_argument("--specialize-float", action="store_true",
                        help="--split: torch._dynamo.config.specialize_float = True (no restart of the compile)")
    parser.add_argument("--real", metavar="MODELS",
                        help="comma list of bench/e2e_model.py models: the passes on --layers real-size layers, the "
                             "probe's random weights drawn on the device against on the host")
    parser.add_argument("--out", type=Path, default=None, help="--real: results folder (default bench/results)")
    parser.add_argument("--tag", default="", help="suffix of the results file name")
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()
    if args.real:
        real_report(args.real.split(","), int(args.layers), args.repeats, args.tag, args.out)
        return
    if args.split:
        split_report([int(n) for n in args.layers.split(",")], args.repeats, args.tag, args.specialize_float)
        return
    args.layers = int(args.layers)
    if args.one_split:
        print(json.dumps(measure_split(args.layers, args.one_split, args.specialize_float)))
        return
    if args.one:
        print(json.dumps(measure(args.layers, args.one)))
        return
    rows = {verify: _in_fresh_process(args.layers, verify) for verify in MODES}
    never = rows["never"]["passes"]
    lines = [
        f"# moe_fx pass time on a {args.layers}-layer tiny Qwen3-MoE (CPU, fp32, T=16)",
        "",
        f"{datetime.datetime.now().isoformat(timespec='seconds')} · {platform.processor() or platform.machine()} "
        f"({torch.get_num_threads()} threads) · torch {torch.__version__} · "
        f"`python bench/pass_time.py --layers {args.layers}` · each mode in a fresh process, Inductor caches off",
        "",
        "| verify | regions rewritten | passes (ms) | first compiled call (s) | passes / compile | "
        "verification (passes - never's) / compile |",
        "|---|---|---|---|---|---|",
    ]
    for verify, m in rows.items():
        check = "-" if verify == "never" else f"{100 * (m['passes'] - never) / m['total']:.1f}%"
        line = (f"| {verify} | {m['matched']} | {1e3 * m['passes']:.0f} | {m['total']:.1f} | "
                f"{100 * m['passes'] / m['total']:.1f}% | {check} |")
        lines.append(line)
        print(line)
    out = Path(__file__).parent / "results" / f"pass_time_{datetime.date.today()}{args.tag}.md"
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
