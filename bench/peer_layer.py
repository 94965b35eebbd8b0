"""One MoE layer: moe_fx against a peer implementation (vLLM's fused MoE, SGLang's, ...) loaded from a file.

The peer's code is never part of moe_fx: it lives in a git-ignored folder (``.ext/``) on the machine that runs
this script, in a Python file that ``--peer`` names. That file defines

* ``NAME``: a short name for the tables (``"vllm_triton"``);
* ``experts(hidden, topk_ids, topk_weights, w13, w2, *, w13_scale=None, w2_scale=None, **op_kwargs)``: one layer,
  ``[T, H]`` in ``hidden``'s dtype, with ``torch.ops.moe_fx.experts``' layout (``w13 [E, N1, H]`` gate then up
  halves or interleaved, ``w2 [E, H, I]``; fp8 e4m3 weights with ``[E, ceil(N/128), ceil(K/128)]`` fp32
  scales; ``op_kwargs`` as the op's: ``w13_bias``, ``w2_bias``, the activation's ``gate_up_layout``, ``alpha``,
  ``limit``, ``up_offset``). It may raise ``NotImplementedError`` for a case it does not cover (the row says so).

For each shape (bench/moe_layer.py's ``SHAPES``), token count and weight dtype, both sides get the same weights
and the same ``ROTATE`` routing sets, are captured in CUDA graphs (one per set) and replayed in rotation; the two
sides alternate over ``--rounds`` rounds (the side that goes first alternates too) and each side's figure is the
median of its rounds, so drift of the machine hits both. moe_fx is ``torch.ops.moe_fx.experts`` under
``torch.compile`` with ``kernel_choice`` ``"triton"`` (and ``"auto"`` with ``--auto``): the kernels a compiled
model launches. Every side is checked first against the fp32 torch reference on fresh random inputs (relative
error per shape and dtype in the results); a side whose error is above ``MAX_REL_ERR`` of its dtype gets no time
(a fast wrong answer must not show as a win). Roofline columns as bench/moe_layer.py's (limits measured in the
run).

    python bench/peer_layer.py --peer .ext/vllm_peer.py [--shapes qwen3,mixtral,dsv3,gpt_oss]
        [--tokens 1,16,64,256,1024,4096,16384] [--dtypes bf16,fp8] [--auto] [--rounds 5] [--tag TAG]
    python bench/peer_layer.py --peer .ext/vllm_peer.py --cells "qwen3:1,256/mixtral:64,4096"   # chosen cells only
    python bench/peer_layer.py --peer .ext/vllm_peer.py --cells mixtral:256 --dtypes bf16 --kernels  # where it goes
    TRITON_INTERPRET=1 python bench/peer_layer.py --peer .ext/vllm_peer.py --smoke --out /tmp/p   # CPU check

Writes ``peer_layer_<date>[_tag].{md,json}`` to ``--out`` (default bench/results) after every cell, and at the end
a plot of moe_fx's time over the peer's against T (``.png``). Needs CUDA.

``--kernels`` also profiles each side's timed graphs after the timing (``torch.profiler``: 5 rotations over the routing
sets, as timed) and lists every kernel's mean GPU µs in launch order, both sides in one table: where a row's difference
between the sides lies (GEMM1, GEMM2, the sort or the combine), not only how large it is. ``gaps`` is the side's replay
time minus its kernels' sum (launch latency and idle time inside the graph); the profiled rotations run after the timed
ones, so a small negative gap is drift between the two, not time saved.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # bench/moe_layer.py's helpers

from moe_layer import (
    GPT_OSS_ACT,
    ROTATE,
    SHAPES,
    allow_many_compiles,
    capture_graphs,
    experts_fn,
    layer_floor,
    log,
    machine_meta,
    measure_limits,
    rel_err,
    replay_us,
    results_stem,
    routing_sets,
    salt_compile_cache,
)

TOKENS = (1, 16, 64, 256, 1024, 4096, 16384)
#: ``--smoke`` (CPU): 128-multiple sizes (whole fp8 blocks), Qwen3's form and GPT-OSS's.
SMOKE_SHAPES = {"tiny": ("qwen3_moe", 8, 2, 128, 128), "tiny_gpt_oss": ("gpt_oss", 8, 2, 128, 128)}
#: Above this relative error (Frobenius norm, against the fp32 reference) a side's output is wrong, per weight
#: dtype: bf16 rounding of a layer's output stays near 1e-2, fp8 blocks with 1x128 activations near 5e-2.
MAX_REL_ERR = {"bf16": 3e-2, "fp8": 1e-1}


def load_peer(path: str) -> types.ModuleType:
    """The peer module of ``path`` (see the module docstring); ``ValueError`` naming what it lacks."""
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"--peer {path}: no such file")
    spec = importlib.util.spec_from_file_location(f"moe_fx_peer_{file.stem}", file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    missing = [n for n, ok in (("NAME", isinstance(getattr(module, "NAME", None), str)),
                               ("experts", callable(getattr(module, "experts", None)))) if not ok]
    if missing:
        raise ValueError(f"--peer {path}: the file must define {' and '.join(missing)} (bench/peer_layer.py's "
                         "docstring says how)")
    return module


def check_side(fn: Callable, reference: Callable, sets: list) -> float:
    """The worst relative error of ``fn`` against ``reference`` over ``sets`` (fresh inputs, never zeros)."""
    return max(rel_err(fn(*s), reference(*s)) for s in sets)


def fp32_reference(w13, w2, **op_kwargs) -> Callable:
    """``fn(hidden, ids, weights)``: the op's torch reference in fp32 on these (bf16) weights, the yardstick of
    both sides (fp8 sides then also carry their quantisation error)."""
    import torch

    from moe_fx.ops import experts_reference

    kw = {n: (v.float() if torch.is_tensor(v) else v) for n, v in op_kwargs.items()}
    w13, w2 = w13.float(), w2.float()

    def reference(hidden, ids, weights):
        return experts_reference(hidden.float(), ids, weights.float(), w13, w2, **kw)

    return reference


def alternate_graph_us(fns: dict[str, Callable], sets: list, rounds: int,
                       timer: Callable[[list], float] = replay_us,
                       capture: Callable[[Callable, list], tuple[list, list]] = capture_graphs,
                       graphs: dict[str, list] | None = None) -> dict[str, float]:
    """Median µs of one replay per side: each side's CUDA graphs (one per input set) replayed in rotation,
    the sides alternating over ``rounds`` rounds with the first side alternating too. ``graphs``, when given,
    receives each side's captured graphs (``--kernels`` profiles them: ``kernel_breakdown.graph_kernels``)."""
    graphs = {} if graphs is None else graphs
    graphs.update({name: capture(fn, sets)[0] for name, fn in fns.items()})
    names = list(fns)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            times[name].append(timer(graphs[name]))
    return {name: statistics.median(values) for name, values in times.items()}


def kernels_section(rows: list[dict]) -> str:
    """The page's kernel table (``--kernels``): per row and side, each kernel's GPU µs in launch order, their sum and
    the gaps (the side's replay µs minus that sum); nothing when no row was profiled."""
    from kernel_breakdown import section

    cells = []
    for r in rows:
        for side, kernels in r.get("kernels", {}).items():
            total = sum(d for _, d in kernels)
            cells.append([r["shape"], r["T"], r["dtype"], side, " · ".join(f"{n} {d:.1f}" for n, d in kernels),
                          f"{total:.1f}", f"{r['us'][side] - total:.1f}"])
    return section("Kernels of one replay (GPU µs, launch order)",
                   ["shape", "T", "dtype", "side", "kernels", "sum µs", "gaps µs"], cells)


def floor_cell(t: int, ids, k: int, h: int, i: int, fp8: bool, limits: dict | None) -> dict[str, float | None]:
    """The layer's roofline for these routings (:func:`moe_layer.layer_floor`): floor µs (None without measured
    limits) and experts hit."""
    hit = int(ids.unique().numel())
    floor_us = layer_floor(t, hit, k, h, i, fp8, limits)[2] if limits else None
    return {"floor_us": floor_us, "experts_hit": hit}


def call_us(calls: list) -> float:
    """``--smoke``'s timer: median wall µs of one call, the calls (fn, inputs) made in rotation."""
    times = []
    for fn, inputs in calls * 3:
        start = time.perf_counter()
        fn(*inputs)
        times.append((time.perf_counter() - start) * 1e6)
    return statistics.median(times)


def pair_row(shape: str, t: int, dtype: str, sides: dict[str, float], errors: dict[str, float | str],
             floor: dict[str, float], peer_name: str) -> dict[str, Any]:
    """One results row: each side's µs and fraction of the floor, moe_fx / peer time ratios (< 1: moe_fx faster)."""
    row: dict[str, Any] = {"shape": shape, "T": t, "dtype": dtype, "peer": peer_name, "us": sides,
                           "rel_err": errors, **floor}
    row["frac_floor"] = {name: floor["floor_us"] / us if floor["floor_us"] else None for name, us in sides.items()}
    peer_us = sides.get("peer")
    row["vs_peer"] = {name: us / peer_us for name, us in sides.items() if name != "peer" and peer_us}
    return row


def markdown(meta: dict, rows: list[dict]) -> str:
    """The results page: one line per (shape, T, dtype) with both sides, their floors and ratios."""
    peer = meta.get("peer_name", "peer")
    mine = sorted({n for r in rows for n in r.get("us", {}) if n != "peer"})
    lim = meta.get("limits") or {}
    lines = [
        f"# One MoE layer: moe_fx against {peer} ("
        + ("SMOKE: CPU wall-clock calls" if meta.get("smoke") else "CUDA-graph replays") + ", sides alternated)",
        "",
        (f"{meta.get('date')} · {meta.get('gpu')} · torch {meta.get('torch')} · triton {meta.get('triton')} · "
         f"peer file `{meta.get('peer_file')}`: {meta.get('peer_doc') or '-'}"),
        "",
        f"Command: `{meta.get('command', '?')}`",
        "",
        (f"Limits measured in the run: copy {lim.get('copy_tbs', 0):.2f} TB/s, bf16 matmul "
         f"{lim.get('bf16_tflops', 0):.0f} TFLOP/s, fp8 matmul {lim.get('fp8_tflops', 0):.0f} TFLOP/s. "
         f"floor = max(bytes / copy rate, flops / matmul rate) for the experts the routings hit; frac = floor / "
         f"time. x = moe_fx µs / {peer} µs (< 1: moe_fx is faster). {meta.get('timing', '')}"),
        "",
        (f"| shape | T | dtype | {peer} µs | " + " | ".join(f"{n} µs" for n in mine) + " | "
         + " | ".join(f"{n} x" for n in mine) + f" | floor µs | frac {peer} | "
         + " | ".join(f"frac {n}" for n in mine) + " | rel err |"),
        "|---|---|---|---|" + "---|" * (3 * len(mine) + 2),
    ]
    for r in rows:
        head = f"| {r['shape']} | {r['T']} | {r['dtype']} | "
        if "error" in r:
            lines.append(head + r["error"] + " |" + " |" * (3 * len(mine) + 3))
            continue
        us, frac, vs = r["us"], r["frac_floor"], r["vs_peer"]
        cells = [_num(us.get("peer"))] + [_num(us.get(n)) for n in mine] + [_num(vs.get(n), 3) for n in mine]
        cells += [_num(r["floor_us"])] + [_pct(frac.get("peer"))] + [_pct(frac.get(n)) for n in mine]
        cells.append(", ".join(f"{n} {v:.1e}" if isinstance(v, float) else f"{n} {v}" for n, v in r["rel_err"].items()))
        lines.append(head + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n" + kernels_section(rows)


def plot(path: str, meta: dict, rows: list[dict]) -> None:
    """moe_fx's time over the peer's against T, one panel per weight dtype, one line per (shape, moe_fx side);
    below 1 moe_fx is faster. Rows without times are left out."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timed = [r for r in rows if "vs_peer" in r]
    dtypes = list(dict.fromkeys(r["dtype"] for r in timed)) or ["bf16"]
    fig, axes = plt.subplots(1, len(dtypes), figsize=(6 * len(dtypes), 4.5), squeeze=False)
    for ax, dtype in zip(axes[0], dtypes):
        lines = sorted({(r["shape"], side) for r in timed if r["dtype"] == dtype for side in r["vs_peer"]})
        for shape, side in lines:
            pts = sorted((r["T"], r["vs_peer"][side]) for r in timed
                         if r["dtype"] == dtype and r["shape"] == shape and side in r["vs_peer"])
            ax.plot(*zip(*pts), "-" if side == "moe_fx" else "--", marker="o", ms=3, label=f"{shape} {side}")
        ax.axhline(1.0, color="k", lw=1)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens T")
        ax.set_ylabel(f"moe_fx µs / {meta.get('peer_name', 'peer')} µs")
        ax.set_title(f"{dtype} weights (below 1: moe_fx faster)")
        ax.grid(alpha=0.3)
        if lines:
            ax.legend(fontsize=8)
    fig.suptitle(f"one MoE layer, {meta.get('gpu')}, CUDA-graph replays, sides alternated")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _num(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def parse_cells(spec: str, known: dict) -> dict[str, list[int]]:
    """``--cells``: ``shape:T,T/shape:T`` to the token counts of each shape, in the order given (a GPU call that
    should hold a few rows of every shape runs them in one process). Unknown shapes and empty or non-positive token
    lists are refused, the part named."""
    cells: dict[str, list[int]] = {}
    for part in filter(None, spec.split("/")):
        shape, sep, tokens = part.partition(":")
        if not sep or shape not in known:
            raise SystemExit(f"--cells: {part!r} is not SHAPE:T,T with SHAPE one of {', '.join(known)}")
        try:
            ts = [int(t) for t in tokens.split(",")]
        except ValueError:
            ts = []
        if not ts or min(ts) < 1:
            raise SystemExit(f"--cells: {part!r} needs a comma list of positive token counts")
        cells[shape] = cells.get(shape, []) + ts
    if not cells:
        raise SystemExit("--cells: no cells")
    return cells


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (the module docstring's options)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--peer", required=True, help="the peer's Python file (git-ignored; see above)")
    ap.add_argument("--shapes", default=None, help=f"comma list of {', '.join(SHAPES)} (default: qwen3,mixtral,dsv3,"
                                                   "gpt_oss; smoke: tiny,tiny_gpt_oss)")
    ap.add_argument("--tokens", default=None, help="comma list of T (default 1 ... 16384; smoke 1,5)")
    ap.add_argument("--cells", default=None,
                    help="SHAPE:T,T/SHAPE:T,...: each shape with its own token counts (instead of --shapes, --tokens)")
    ap.add_argument("--smoke", action="store_true",
                    help="CPU, tiny shapes, wall-clock calls instead of CUDA graphs, moe_fx's op uncompiled with "
                         "kernel_choice='auto' (its reference on CPU), no floors: checks the script and a peer file")
    ap.add_argument("--dtypes", default="bf16,fp8", help="weight dtypes: bf16, fp8 (128x128 blocks)")
    ap.add_argument("--auto", action="store_true", help="also time kernel_choice='auto' (DeepGEMM where it fits)")
    ap.add_argument("--rounds", type=int, default=5, help="alternating rounds per cell")
    ap.add_argument("--kernels", action="store_true",
                    help="also profile each side's replay: every kernel's GPU µs, both sides in one table (needs CUDA)")
    ap.add_argument("--budget-s", type=float, default=1e9, help="start no cell after this many seconds")
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    ap.add_argument("--tag", default="")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    """Run the cells the command line names, write the results page, its JSON and plot (the module docstring)."""
    args = parse_args(argv)
    shapes = SMOKE_SHAPES if args.smoke else SHAPES
    if args.kernels and args.smoke:
        raise SystemExit("--kernels profiles CUDA-graph replays: not with --smoke")
    if args.cells:
        if args.shapes or args.tokens:
            raise SystemExit("--cells names the shapes and their token counts: not with --shapes or --tokens")
        cells = parse_cells(args.cells, shapes)
    else:
        names = (args.shapes or ",".join(SMOKE_SHAPES if args.smoke else ("qwen3", "mixtral", "dsv3", "gpt_oss")))
        for shape in names.split(","):
            if shape not in shapes:
                raise SystemExit(f"unknown shape {shape!r}; known: {', '.join(shapes)}")
        counts = [int(t) for t in (args.tokens or ("1,5" if args.smoke else ",".join(map(str, TOKENS)))).split(",")]
        cells = {shape: counts for shape in names.split(",")}
    peer = load_peer(args.peer)

    import torch

    if not torch.cuda.is_available() and not args.smoke:
        raise SystemExit("bench/peer_layer.py needs a CUDA GPU (CUDA graphs of both sides); --smoke runs on CPU")
    import moe_fx.lowering  # noqa: F401  (the op's CUDA implementation)
    from moe_fx.lowering.quant import quantize_fp8_blockwise

    allow_many_compiles()  # every moe_fx row compiled: none past Dynamo's limit timed uncompiled
    salt_compile_cache()
    device = "cpu" if args.smoke else "cuda"
    start = time.time()
    limits = None if args.smoke else measure_limits()
    meta = {**machine_meta(), "peer_name": peer.NAME, "peer_file": os.path.basename(args.peer),
            "peer_doc": (peer.__doc__ or "").strip().splitlines()[0] if peer.__doc__ else "", "limits": limits,
            "smoke": args.smoke,
            "timing": (f"SMOKE (CPU): wall-clock calls over {ROTATE} routing sets" if args.smoke else
                       f"{ROTATE} routing sets, one graph each, replayed in rotation")
                      + f"; {args.rounds} alternating rounds, medians; first side alternates.",
            "max_rel_err": MAX_REL_ERR}
    rows: list[dict] = []
    os.makedirs(args.out, exist_ok=True)
    base = os.path.join(args.out, results_stem("peer_layer", args.tag))

    def save() -> None:
        with open(base + ".json", "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
        with open(base + ".md", "w") as f:
            f.write(markdown(meta, rows))

    def finish(row: dict) -> None:  # every cell's row, timed or not: kept, logged, saved
        rows.append(row)
        log(json.dumps({n: row[n] for n in ("shape", "T", "dtype", "us", "vs_peer", "error") if n in row}))
        save()

    op = torch.ops.moe_fx.experts
    for shape, tokens in cells.items():
        family, e, k, h, i = shapes[shape]
        g = torch.Generator(device=device).manual_seed(1)
        w13 = torch.randn(e, 2 * i, h, device=device, generator=g, dtype=torch.bfloat16) / h**0.5
        w2 = torch.randn(e, h, i, device=device, generator=g, dtype=torch.bfloat16) / i**0.5
        op_kw: dict[str, Any] = {}
        if family == "gpt_oss":
            op_kw = {**GPT_OSS_ACT,
                     "w13_bias": torch.randn(e, 2 * i, device=device, generator=g, dtype=torch.bfloat16) * 0.1,
                     "w2_bias": torch.randn(e, h, device=device, generator=g, dtype=torch.bfloat16) * 0.1}
        for dtype in args.dtypes.split(","):
            if dtype == "fp8":
                (q13, s13), (q2, s2) = quantize_fp8_blockwise(w13), quantize_fp8_blockwise(w2)
                weights = (q13, q2, s13, s2)
            else:
                weights = (w13, w2, None, None)
            fns = {"peer": experts_fn(peer.experts, *weights, **op_kw),
                   "moe_fx": experts_fn(op, *weights, kernel_choice="auto", **op_kw) if args.smoke else
                   torch.compile(experts_fn(op, *weights, kernel_choice="triton", **op_kw))}
            if args.auto and not args.smoke:
                fns["moe_fx_auto"] = torch.compile(experts_fn(op, *weights, kernel_choice="auto", **op_kw))
            reference = fp32_reference(w13, w2, **op_kw)
            for t in tokens:
                if time.time() - start > args.budget_s:
                    finish({"shape": shape, "T": t, "dtype": dtype, "error": "skipped: time budget"})
                    continue
                sets = routing_sets(t, e, k, h, ROTATE, seed=t, device=device)
                fresh = routing_sets(t, e, k, h, 2, seed=10_000 + t, device=device)
                errors: dict[str, float | str] = {}
                timed = {}
                with torch.no_grad():
                    for name, fn in fns.items():
                        try:
                            errors[name] = check_side(fn, reference, fresh)
                        except NotImplementedError as err:
                            errors[name] = f"not supported: {err}"
                            continue
                        if errors[name] <= MAX_REL_ERR[dtype]:
                            timed[name] = fn
                        else:
                            errors[name] = f"WRONG ({errors[name]:.2e}): not timed"
                    if "peer" not in timed or "moe_fx" not in timed:
                        finish({"shape": shape, "T": t, "dtype": dtype, "error": f"not compared: {errors}"})
                        continue
                    graphs: dict[str, list] = {}
                    try:
                        sides = (alternate_graph_us(timed, sets, args.rounds, timer=call_us,
                                                    capture=lambda fn, inputs: ([(fn, s) for s in inputs], None))
                                 if args.smoke else alternate_graph_us(timed, sets, args.rounds, graphs=graphs))
                    except RuntimeError as err:  # a side that cannot be captured (a host sync): the row says so
                        finish({"shape": shape, "T": t, "dtype": dtype, "rel_err": errors,
                                "error": f"not timed: {type(err).__name__}: {str(err).splitlines()[0][:160]}"})
                        continue
                row = pair_row(shape, t, dtype, sides, errors,
                               floor_cell(t, sets[0][1], k, h, i, dtype == "fp8", limits), peer.NAME)
                if args.kernels:
                    from kernel_breakdown import graph_kernels

                    with torch.no_grad():
                        row["kernels"] = {name: graph_kernels(graphs[name]) for name in timed}
                del graphs
                finish(row)
                if not args.smoke:
                    torch.cuda.empty_cache()
    save()
    plot(base + ".png", meta, rows)
    log(f"done in {time.time() - start:.0f}s -> {base}.md")


if __name__ == "__main__":
    main()
