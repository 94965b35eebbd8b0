"""generate() with a static KV cache and CUDA graphs: which recipes run, which segfault, how fast.

Issue 10, item 5: on the H200 machine (torch 2.11, transformers 5.17) ``generate()`` with
``cache_implementation="static"`` and ``model.forward = torch.compile(model.forward,
mode="reduce-overhead")`` ends in a segmentation fault, for plain Inductor too, after Inductor logs
"skipping cudagraphs due to mutated inputs (6 instances)" at ``StaticLayer.update``. See
docs/generate_cudagraphs.md for the hypotheses this script tests.

Every variant runs in its own subprocess (so a segfault is reported as exit -11 and the others still
run), with ``faulthandler`` on (a crash prints the Python stack it happened in). A variant:

1. builds the model (``--model``, real per-layer sizes from bench/e2e_model.py, ``--layers`` layers,
   bf16, random weights; tiny and fp32 with ``--smoke``), and greedy-generates with it eagerly (the
   reference tokens);
2. applies its recipe (see ``VARIANTS`` / ``--list``): how the forward is compiled (``fwd``: the user
   replaces ``model.forward``; ``cc``: transformers' own path, ``generation_config.compile_config =
   CompileConfig(backend=..., mode=...)``, which compiles ``model.__call__`` for the decode steps only and
   runs the prefill eagerly), the backend (Inductor or moe_fx), the mode, and the knobs: ``autocompile``
   (no ``disable_compile``: generate() compiles the already compiled forward again), ``markstep``
   (``torch.compiler.cudagraph_mark_step_begin()`` before every forward), ``notrees``
   (``torch._inductor.config.triton.cudagraph_trees = False``), ``nopartition``
   (``torch._inductor.config.graph_partition = False``), ``earlycache`` (a ``StaticCache`` allocated
   and initialised outside compiled code, so its tensors are marked static addresses, passed to generate),
   ``eagerprefill`` (the compiled forward is used for one-token steps only);
3. generates twice to warm up, then times ``--rounds`` calls of ``--new`` and of 1 new token;
4. prints one ``RESULT {json}`` line: tokens/s, whether the tokens equal eager's, Inductor's
   cudagraph-skip count and Dynamo's graph count.

The parent collects exit codes, ``RESULT`` lines, the "skipping cudagraphs ..." log lines and, for a
crash, the last Python frames faulthandler printed; it writes ``generate_cudagraphs_<date>[_tag].{md,json}``
to ``--out`` (default bench/results) after every variant.

    python bench/generate_cudagraphs.py                         # every variant (two device calls' worth)
    python bench/generate_cudagraphs.py --variants fwd-ro-inductor,cc-ro-inductor,cc-ro-moe_fx
    python bench/generate_cudagraphs.py --list
    python bench/generate_cudagraphs.py --merge A.json B.json      # variants split over device calls
    python bench/generate_cudagraphs.py --smoke                 # CPU: CUDA-graph variants report "needs CUDA"
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import faulthandler
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from e2e_model import (  # noqa: E402
    MODELS,
    SMOKE_MODELS,
    build_model,
    cache_kwarg,
    gpu_activities,
    load_runs,
    static_cache,
)
from moe_layer import log, machine_meta  # noqa: E402

RESULT = "RESULT "


@dataclasses.dataclass(frozen=True)
class Variant:
    """One way to run generate() with a compiled forward.

    Attributes:
        path: ``eager`` (nothing compiled), ``fwd`` (``model.forward = torch.compile(model.forward, ...)``) or
            ``cc`` (transformers compiles, from ``generation_config.compile_config``).
        backend: ``inductor`` or ``moe_fx``.
        mode: ``reduce-overhead`` (CUDA graphs) or ``default``.
        autocompile: ``fwd`` only: leave ``generation_config.disable_compile`` False.
        markstep: ``torch.compiler.cudagraph_mark_step_begin()`` before every forward.
        trees: ``torch._inductor.config.triton.cudagraph_trees``.
        earlycache: pass a ``StaticCache`` allocated and initialised before anything is compiled.
        eagerprefill: ``fwd`` only: run multi-token forwards (the prefill) eagerly.
        partition: ``torch._inductor.config.graph_partition`` (on by default in recent torch: CPU ops are
            split off and the GPU partitions of a graph are CUDA-graphed on their own).
    """

    path: str
    backend: str = "inductor"
    mode: str = "reduce-overhead"
    autocompile: bool = False
    markstep: bool = False
    trees: bool = True
    earlycache: bool = False
    eagerprefill: bool = False
    partition: bool = True

    @property
    def name(self) -> str:
        if self.path == "eager":
            return "eager"
        parts = [self.path, "ro" if self.mode == "reduce-overhead" else "default", self.backend]
        for knob in ("autocompile", "markstep", "earlycache", "eagerprefill"):
            if getattr(self, knob):
                parts.append(knob)
        if not self.trees:
            parts.append("notrees")
        if not self.partition:
            parts.append("nopartition")
        return "-".join(parts)

    @property
    def needs_cuda(self) -> bool:
        return self.mode == "reduce-overhead" and self.path != "eager"


VARIANTS = [
    Variant("eager", mode="default"),
    # the documented recipe, as seen failing on the GPU machine
    Variant("fwd"),
    Variant("fwd", backend="moe_fx"),
    Variant("fwd", autocompile=True),
    Variant("fwd", markstep=True),
    Variant("fwd", trees=False),
    Variant("fwd", partition=False),
    # hypothesis 1: the KV cache is allocated inside the compiled (CUDA-graphed) prefill
    Variant("fwd", earlycache=True),
    Variant("fwd", backend="moe_fx", earlycache=True),
    Variant("fwd", eagerprefill=True),
    Variant("fwd", backend="moe_fx", eagerprefill=True),
    # transformers' own compile path (eager prefill, compiled decode)
    Variant("cc"),
    Variant("cc", backend="moe_fx"),
    # the same with one cache for every call (transformers builds a new one per call otherwise: a re-recording)
    Variant("cc", earlycache=True),
    Variant("cc", backend="moe_fx", earlycache=True),
    # default mode, for the tokens/s without CUDA graphs
    Variant("fwd", mode="default"),
    Variant("fwd", backend="moe_fx", mode="default"),
]
BY_NAME = {v.name: v for v in VARIANTS}
SMOKE_VARIANTS = "eager,fwd-default-inductor,fwd-default-moe_fx,fwd-ro-inductor,cc-ro-moe_fx"


# ---------------------------------------------------------------------------------------------- child


def apply_variant(model, v: Variant, device: str):
    """Set ``model`` up for ``v``; returns the cache to pass to generate() (None: generate makes its own)."""
    import torch

    torch._inductor.config.triton.cudagraph_trees = v.trees
    if hasattr(torch._inductor.config, "graph_partition"):
        torch._inductor.config.graph_partition = v.partition
    gc = model.generation_config
    gc.disable_compile = v.path != "cc" and not v.autocompile
    if v.path == "fwd":
        kwargs: dict[str, Any] = {} if v.mode == "default" else {"mode": v.mode}
        if v.backend == "moe_fx":
            kwargs["backend"] = "moe_fx"
        compiled = torch.compile(model.forward, **kwargs)
        eager_forward = model.forward

        def forward(*args, **kw):
            ids = kw.get("input_ids", args[0] if args else None)
            if v.eagerprefill and ids is not None and ids.shape[-1] > 1:
                return eager_forward(*args, **kw)
            if v.markstep:
                torch.compiler.cudagraph_mark_step_begin()
            return compiled(*args, **kw)

        model.forward = forward
    elif v.path == "cc":
        import transformers

        cfg = transformers.CompileConfig(backend=v.backend, mode=v.mode)
        if device != "cuda":
            cfg._compile_all_devices = True  # transformers compiles on CUDA only unless told (smoke runs)
        gc.compile_config = cfg
        if v.markstep:
            raise ValueError("markstep applies to the fwd path only")
    return None


def child(args: argparse.Namespace) -> None:
    """Run one variant in this process and print its ``RESULT`` line."""
    faulthandler.enable(all_threads=False)
    import torch
    import transformers  # noqa: F401

    import moe_fx  # noqa: F401  (registers backend="moe_fx" in a source checkout)

    v = BY_NAME[args.child]
    # Inductor's "skipping cudagraphs due to ..." goes to the "cudagraphs" logging artifact; recompiles are counted.
    # Set here, not through TORCH_LOGS, which would make torch ignore the set_logs call before the timed calls.
    torch._logging.set_logs(cudagraphs=True, recompiles=True)
    cuda = torch.cuda.is_available() and not args.smoke_cpu
    device = "cuda" if cuda else "cpu"
    spec = (SMOKE_MODELS if args.smoke else MODELS)[args.model]
    dtype = torch.bfloat16 if cuda else torch.float32
    model = build_model(spec, args.layers, args.vocab, device, dtype)
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(3, args.vocab, (args.batch, args.prompt), generator=g).to(device)
    mask = torch.ones_like(prompts)
    cache_kw = cache_kwarg(model)
    gen = dict(attention_mask=mask, do_sample=False, pad_token_id=0)

    def sync():
        if cuda:
            torch.cuda.synchronize()

    with torch.no_grad():
        model.generation_config.disable_compile = True
        want = model.generate(prompts, max_new_tokens=args.new, min_new_tokens=args.new,
                              cache_implementation="static", **gen)[:, args.prompt:].cpu()
        cache = static_cache(model, args.batch, args.prompt + args.new) if v.earlycache else None
        apply_variant(model, v, device)

        def run(new: int):
            if cache is not None:
                cache.reset()
                extra = {cache_kw: cache}
            else:
                extra = {"cache_implementation": "static"}
            out = model.generate(prompts, max_new_tokens=new, min_new_tokens=new, **extra, **gen)
            sync()
            return out

        phase = "warm-up"
        print(f"[{v.name}] {phase}", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        got = run(args.new)[:, args.prompt:].cpu()
        run(args.new)
        warm_s = time.perf_counter() - t0
        # Inductor's cudagraphs log is on (for the skip messages) and at debug level it formats every re-recording's
        # reason (milliseconds of host time a step where graphs re-record): keep it out of the timed calls.
        torch._logging.set_logs(recompiles=True)
        full, one = [], []
        for _ in range(args.rounds):
            for new, bucket in ((args.new, full), (1, one)):
                t0 = time.perf_counter()
                run(new)
                bucket.append(time.perf_counter() - t0)
        profiled = step_profile(run, args.new) if args.profile else None
    from torch._dynamo.utils import counters

    t_full, t_one = statistics.median(full), statistics.median(one)
    result = {
        "variant": v.name,
        "device": device,
        "warmup_s": round(warm_s, 2),
        "new_tok_s": args.batch * args.new / t_full,
        "decode_tok_s": args.batch * (args.new - 1) / max(t_full - t_one, 1e-9),
        "same_tokens_as_eager": float((got == want).float().mean()),
        "cudagraph_skips": int(counters["inductor"].get("cudagraph_skips", 0)),
        "graphs": int(counters["stats"].get("unique_graphs", 0)),
    }
    if profiled is not None:
        result["profile"] = profiled
    print(RESULT + json.dumps(result), flush=True)


HOST_TOP = 10  # host functions / ops kept per decode step in a profile


def _per_step(full: dict[str, float], one: dict[str, float], steps: int, top: int) -> list[list]:
    """``[name, per-step value]`` of the ``top`` names whose totals grew most from a 1-token to an N-token call."""
    grown = {k: (v - one.get(k, 0.0)) / steps for k, v in full.items()}
    return [[k[:120], round(v, 1)] for k, v in sorted(grown.items(), key=lambda kv: -kv[1])[:top]]


def _least(samples: list[dict[str, float]]) -> dict[str, float]:
    """Each name's least value over the runs that have it: a busy machine only adds time to a run."""
    out: dict[str, float] = {}
    for sample in samples:
        for k, v in sample.items():
            out[k] = min(v, out.get(k, v))
    return out


def step_profile(run: Any, new: int, top: int = HOST_TOP, rounds: int = 1) -> dict[str, Any]:
    """Where one decode step's time goes: a call generating ``new`` tokens minus one generating 1 (the prefill
    and the fixed cost cancel), divided by ``new - 1``. From torch.profiler: ``gpu_us`` (GPU busy), ``gpu_activities``,
    ``graph_launches`` and ``kernel_launches`` (CUDA runtime/driver calls), ``graph_records`` (CUDA graphs
    recorded anew: cudagraph trees record one per new value of a dynamic int input), ``ops_self_us`` (the host time spent in
    profiled ops, the rest being Python) and ``top_ops`` (self µs); from cProfile, a separate call each:
    ``top_python`` (own time µs of the Python functions, cProfile's overhead included). ``rounds``: calls of each
    size, each time the least over them (one call's time can carry another process's; the counts are one call's)."""
    import cProfile
    import pstats

    import torch
    from torch.profiler import ProfilerActivity, profile

    steps = max(new - 1, 1)
    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])

    def torch_profile(n: int) -> tuple[dict[str, float], dict[str, float], float, float]:
        if cuda:
            torch.cuda.synchronize()
        with profile(activities=activities) as prof:
            run(n)
        gpu = gpu_activities(prof)
        gpu_us = sum(ns for _, ns in gpu) / 1e3
        self_us = {a.key: a.self_cpu_time_total for a in prof.key_averages()}
        counts = {a.key: float(a.count) for a in prof.key_averages()}
        return self_us, counts, gpu_us, float(len(gpu))

    def python_profile(n: int) -> dict[str, float]:
        pr = cProfile.Profile()
        pr.enable()
        run(n)
        pr.disable()
        stats = pstats.Stats(pr).stats  # {(file, line, func): (cc, nc, tottime, cumtime, callers)}
        own: dict[str, float] = {}
        for (file, line, func), (_, _, tottime, _, _) in stats.items():
            name = f"{os.path.basename(file)}:{line}:{func}" if line else func
            own[name] = own.get(name, 0.0) + tottime * 1e6
        return own

    def least_torch_profile(n: int) -> tuple[dict[str, float], dict[str, float], float, float]:
        runs = [torch_profile(n) for _ in range(rounds)]
        return _least([r[0] for r in runs]), runs[0][1], min(r[2] for r in runs), runs[0][3]

    self_n, count_n, gpu_n, act_n = least_torch_profile(new)
    self_1, count_1, gpu_1, act_1 = least_torch_profile(1)
    launches = (lambda counts, names: sum(v for k, v in counts.items() if k in names))
    graph_names = {"cudaGraphLaunch", "cuGraphLaunch"}
    records = (lambda counts: sum(v for k, v in counts.items() if k.startswith("CUDAGraphNode.record")))
    kernel_names = {"cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx"}
    return {
        "gpu_us": round((gpu_n - gpu_1) / steps, 1),
        "gpu_activities": round((act_n - act_1) / steps, 1),
        "graph_launches": round((launches(count_n, graph_names) - launches(count_1, graph_names)) / steps, 2),
        "graph_records": round((records(count_n) - records(count_1)) / steps, 2),
        "kernel_launches": round((launches(count_n, kernel_names) - launches(count_1, kernel_names)) / steps, 1),
        "ops_self_us": round((sum(self_n.values()) - sum(self_1.values())) / steps, 1),
        "top_ops": _per_step(self_n, self_1, steps, top),
        "top_python": _per_step(*(_least([python_profile(n) for _ in range(rounds)]) for n in (new, 1)), steps, top),
    }


# ---------------------------------------------------------------------------------------------- parent


def describe_exit(rc: int) -> str:
    """``0`` -> ok; a negative code -> the signal (a segfault is ``SIGSEGV (exit -11)``)."""
    if rc == 0:
        return "ok"
    if rc < 0:
        try:
            return f"{signal.Signals(-rc).name} (exit {rc})"
        except ValueError:
            return f"signal {-rc} (exit {rc})"
    return f"exit {rc}"


def crash_frames(stderr: str, keep: int = 6) -> list[str]:
    """The innermost Python frames faulthandler printed for a crash (``File "...", line N in f``)."""
    lines = stderr.splitlines()
    start = max((i for i, line in enumerate(lines) if line.startswith("Fatal Python error")), default=None)
    if start is None:
        return []
    frames = [line.strip() for line in lines[start:] if line.strip().startswith("File ")]
    return frames[:keep]


def skip_messages(stderr: str) -> list[str]:
    """Inductor's distinct "skipping cudagraphs due to ..." messages, first line of each."""
    seen: dict[str, None] = {}
    for line in stderr.splitlines():
        if "skipping cudagraphs" in line or "skipping cudagraph" in line:
            seen[line.split("] ", 1)[-1].strip()[:200]] = None
    return list(seen)


def run_variant(v: Variant, args: argparse.Namespace, cuda: bool) -> dict:
    """Run one variant in a subprocess; its row (status, RESULT numbers, skip messages, crash frames)."""
    row: dict[str, Any] = {"variant": v.name, **dataclasses.asdict(v)}
    if v.needs_cuda and not cuda:
        row["status"] = "needs CUDA"
        return row
    cmd = [sys.executable, os.path.abspath(__file__), "--child", v.name, "--model", args.model,
           "--layers", str(args.layers), "--vocab", str(args.vocab), "--batch", str(args.batch),
           "--prompt", str(args.prompt), "--new", str(args.new), "--rounds", str(args.rounds)]
    if args.profile:
        cmd.append("--profile")
    if args.smoke:
        cmd.append("--smoke")
    if not cuda:
        cmd.append("--smoke-cpu")
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (os.path.dirname(HERE), env.get("PYTHONPATH", "")) if p)
    t0 = time.time()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout_s, env=env)
        rc, out, err = proc.returncode, proc.stdout, proc.stderr
        row["status"] = describe_exit(rc)
    except subprocess.TimeoutExpired as exc:
        rc, out = None, exc.stdout or ""
        err = exc.stderr or ""
        out = out.decode() if isinstance(out, bytes) else out
        err = err.decode() if isinstance(err, bytes) else err
        row["status"] = f"timeout after {args.timeout_s} s"
    row["exit_code"] = rc
    row["wall_s"] = round(time.time() - t0, 1)
    for line in out.splitlines():
        if line.startswith(RESULT):
            row.update(json.loads(line[len(RESULT):]))
    row["skip_messages"] = skip_messages(err)
    row["recompiles"] = err.count("Recompiling function")
    row["crash_frames"] = crash_frames(err)
    if rc not in (0, None) and not row["crash_frames"]:
        tail = [line for line in err.strip().splitlines() if line.strip()][-3:]
        row["error_tail"] = [line[:300] for line in tail]
    if args.keep_logs:
        with open(os.path.join(args.out, f"generate_cudagraphs_{v.name}.log"), "w") as f:
            f.write(out + "\n--- stderr ---\n" + err)
    return row


def markdown(meta: dict, rows: list[dict]) -> str:
    """The results page: one row per variant."""
    lines = [
        "# generate() with a static cache and CUDA graphs: variants" + (" (SMOKE: tiny CPU run)" if meta["smoke"] else ""),
        "",
        f"{meta['date']} · {meta['gpu']} · host {meta['host']} · torch {meta['torch']} · triton {meta['triton']} · "
        f"transformers {meta['transformers']}",
        "",
        f"Command: `{meta['command']}`",
        "",
        f"Model: {meta['model']} sizes, {meta['layers']} layers, {meta['dtype']}, random weights, vocabulary "
        f"{meta['vocab']}; greedy, batch {meta['batch']} x prompt {meta['prompt']}, {meta['new']} new tokens; "
        f"medians of {meta['rounds']} timed calls after 2 warm-up calls. decode tok/s = batch * (N - 1) / "
        f"(t(N new) - t(1 new)). same = fraction of greedy tokens equal to eager's. Variant names: "
        "docs/generate_cudagraphs.md.",
        "",
        "| variant | status | decode tok/s | new tok/s | same | cudagraph skips | graphs | recompiles | warm-up s | notes |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        notes = "; ".join(r.get("skip_messages", [])[:2])
        if r.get("crash_frames"):
            notes += (" " if notes else "") + "crashed in: " + " <- ".join(r["crash_frames"][:3])
        if r.get("error_tail"):
            notes += (" " if notes else "") + " / ".join(r["error_tail"])
        num = (lambda k, d=0: f"{r[k]:.{d}f}" if isinstance(r.get(k), (int, float)) else "-")
        lines.append(
            f"| {r['variant']} | {r['status']} | {num('decode_tok_s')} | {num('new_tok_s')} | "
            f"{num('same_tokens_as_eager', 2)} | {r.get('cudagraph_skips', '-')} | {r.get('graphs', '-')} | "
            f"{r.get('recompiles', '-')} | "
            f"{num('warmup_s', 1)} | {notes.replace('|', '/')} |"
        )
    lines += profile_lines(rows, meta["batch"])
    return "\n".join(lines) + "\n"


def profile_lines(rows: list[dict], batch: int) -> list[str]:
    """The ``--profile`` section: one decode step per variant (GPU busy, launches, host time by op and function)."""
    rows = [r for r in rows if r.get("profile")]
    if not rows:
        return []
    lines = ["", "## One decode step (--profile: an N-token call minus a 1-token call, / (N - 1))", "",
             ("wall µs = 1e6 / decode tok/s x batch. ops self µs = host time inside profiled torch ops and CUDA calls "
              "(the rest of the wall is Python or waiting); Python own µs comes from a separate cProfile'd call "
              "(its overhead included)."), "",
             ("| variant | wall µs | GPU busy µs | GPU activities | graph launches | graph records | kernel launches | "
              "ops self µs |"),
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        p = r["profile"]
        wall = f"{1e6 * batch / r['decode_tok_s']:.0f}" if r.get("decode_tok_s") else "-"
        lines.append(f"| {r['variant']} | {wall} | {p['gpu_us']} | {p['gpu_activities']} | {p['graph_launches']} | "
                     f"{p.get('graph_records', '-')} | {p['kernel_launches']} | {p['ops_self_us']} |")
    for key, title in (("top_ops", "torch ops / CUDA calls, self µs per step"),
                       ("top_python", "Python functions, own µs per step (cProfile)")):
        lines += ["", f"{title}:", ""]
        for r in rows:
            items = "; ".join(f"{name} {us}" for name, us in r["profile"][key])
            lines.append(f"- {r['variant']}: {items.replace('|', '/')}")
    return lines


def parent(args: argparse.Namespace) -> None:
    """Run the chosen variants one after the other and write the results after each."""
    import torch

    cuda = torch.cuda.is_available() and not args.smoke
    names = (args.variants or (SMOKE_VARIANTS if args.smoke else ",".join(BY_NAME))).split(",")
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        raise SystemExit(f"unknown variant(s) {unknown}; --list shows them")
    if not cuda and not args.smoke:
        raise SystemExit("bench/generate_cudagraphs.py needs a CUDA GPU (or --smoke for a tiny CPU run)")
    os.makedirs(args.out, exist_ok=True)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    base = os.path.join(args.out, f"generate_cudagraphs_{stamp}{'_' + args.tag if args.tag else ''}")
    meta = {**machine_meta(), "smoke": args.smoke, "model": args.model, "layers": args.layers,
            "dtype": "bfloat16" if cuda else "float32", "vocab": args.vocab, "batch": args.batch,
            "prompt": args.prompt, "new": args.new, "rounds": args.rounds}
    rows: list[dict] = []
    from tqdm import tqdm

    start = time.time()
    for name in tqdm(names, desc="variants", file=sys.stderr):
        if time.time() - start > args.budget_s:
            row = {"variant": name, **dataclasses.asdict(BY_NAME[name]), "status": "skipped: time budget"}
        else:
            row = run_variant(BY_NAME[name], args, cuda)
        rows.append(row)
        log(f"{name:40s} {row['status']:20s} decode tok/s {row.get('decode_tok_s', '-')!s:.8s}  "
            f"same {row.get('same_tokens_as_eager', '-')}  skips {row.get('cudagraph_skips', '-')}  "
            f"{' | '.join(row.get('skip_messages', [])[:1])[:120]}  {' <- '.join(row.get('crash_frames', [])[:2])}")
        with open(base + ".json", "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
        with open(base + ".md", "w") as f:
            f.write(markdown(meta, rows))
    log(f"-> {base}.md")


def merge_runs(paths: list[str], out_dir: str, tag: str) -> str:
    """Join runs of this script (variants split over device calls) into one md/json; later files win."""
    metas, by_name = load_runs(paths, lambda row: row["variant"],
                               ("gpu", "torch", "transformers", "model", "layers", "batch", "prompt", "new"))
    meta = {**metas[0], "command": " ; ".join(m["command"] for m in metas)}
    order = {n: i for i, n in enumerate(BY_NAME)}
    rows = sorted(by_name.values(), key=lambda r: order.get(r["variant"], len(order)))
    os.makedirs(out_dir, exist_ok=True)
    base = os.path.join(out_dir, f"generate_cudagraphs_{meta['date'][:10]}{'_' + tag if tag else ''}")
    with open(base + ".json", "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    with open(base + ".md", "w") as f:
        f.write(markdown(meta, rows))
    log(f"merged {len(rows)} variants -> {base}.md")
    return base


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", default=None, help="comma list of variant names (--list); default: all")
    ap.add_argument("--list", action="store_true", help="print the variant names and exit")
    ap.add_argument("--model", default="qwen3", choices=sorted(MODELS))
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=0, help="default 32000 (smoke 128)")
    ap.add_argument("--batch", type=int, default=0, help="prompts per call (default 4, smoke 2)")
    ap.add_argument("--prompt", type=int, default=0, help="prompt length (default 32, smoke 4)")
    ap.add_argument("--new", type=int, default=0, help="new tokens per call (default 64, smoke 4)")
    ap.add_argument("--rounds", type=int, default=0, help="timed calls (default 3, smoke 1)")
    ap.add_argument("--timeout-s", type=int, default=300, help="per variant")
    ap.add_argument("--budget-s", type=float, default=1e9, help="start no variant after this many seconds")
    ap.add_argument("--out", default=None, help="results folder (default bench/results; smoke: a temp folder)")
    ap.add_argument("--tag", default="")
    ap.add_argument("--profile", action="store_true",
                    help="also profile one decode step (GPU busy, launches, host time by op and Python function)")
    ap.add_argument("--keep-logs", action="store_true", help="write each variant's stdout/stderr next to the results")
    ap.add_argument("--smoke", action="store_true", help="tiny model on CPU; CUDA-graph variants report 'needs CUDA'")
    ap.add_argument("--merge", nargs="+", metavar="JSON", help="join earlier runs' JSON files into one md/json")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--smoke-cpu", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.out = args.out or (os.path.join(tempfile.gettempdir(), "moe_fx_smoke") if args.smoke else os.path.join(HERE, "results"))
    args.vocab = args.vocab or (128 if args.smoke else 32000)
    args.batch = args.batch or (2 if args.smoke else 4)
    args.prompt = args.prompt or (4 if args.smoke else 32)
    args.new = args.new or (4 if args.smoke else 64)
    args.rounds = args.rounds or (1 if args.smoke else 3)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.list:
        for v in VARIANTS:
            print(v.name)
        return
    if args.merge:
        merge_runs(args.merge, args.out, args.tag)
    elif args.child:
        child(args)
    else:
        parent(args)


if __name__ == "__main__":
    main()
