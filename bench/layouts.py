"""One MoE layer on one GPU, every (experts kernel, row layout) pair the lowering can run: the measurement
the layout choice (``prefer`` of ``moe_fx/lowering/prepare_finalize/local_*.py``) is made from.

For each shape, weight dtype (bf16; fp8 with 128x128 block scales) and T, the plan of ``moe_fx::experts`` is
made with the layout forced (``plan_experts(..., layout=...)``: ``local_sorted``, ``local_contiguous``,
``local_permute``) for each kernel (``triton``, ``deepgemm``); pairs that cannot run say why. The runnable
ones are captured in CUDA graphs over the same rotating routing sets and timed in alternating rounds
(medians); each row gives the floor (max of bytes / copy rate and flops / matmul rate, limits measured in
the same run) and each pair's relative error against the fp32 reference.

    python bench/layouts.py [--shapes qwen3,mixtral,dsv3] [--tokens 64,256,1024,4096,16384] [--no-fp8]
    python bench/layouts.py --smoke   # CPU, Triton interpreter, tiny shapes: checks the script end to end

Writes ``layouts_<date>[_tag].{md,json}`` to ``--out`` (default bench/results; smoke: a temp folder).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fused_activation import SMOKE_SHAPES, graphs_of, layer, rel, time_us
from moe_layer import SHAPES, bench_meta, results_stem, routing_sets, row_metrics

SETS = 3
KERNELS = ("triton", "deepgemm")
LAYOUTS = ("local_sorted", "local_contiguous", "local_permute")


def pair_fn(w: dict, kw: dict, kernel: str, layout: str, example):
    """``fn(hidden, ids, weights)`` running the lowering's plan for (kernel, layout), or the reason it cannot."""
    from moe_fx.lowering.experts import plan_experts, run_experts
    from moe_fx.ops.experts import bind_experts

    op_kw = {**kw, "kernel_choice": kernel}

    def bound(x, ids, rw):
        return bind_experts(x, ids, rw, w["w13"], w["w2"], **op_kw)

    try:
        plan = plan_experts(bound(*example), layout=layout)
    except RuntimeError as err:
        return str(err).split(": ", 1)[-1][:160]
    return lambda x, ids, rw: run_experts(bound(x, ids, rw), plan)


def measured_call(fn, inputs, ref: torch.Tensor) -> tuple[float, float | None]:
    """One eager call of a pair: its relative error against ``ref`` and the GPU memory it allocated beyond
    what was live before it (GB: the layout's transient buffers and the output; ``None`` on CPU)."""
    cuda = ref.is_cuda
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    out = fn(*inputs)
    peak = (torch.cuda.max_memory_allocated() - before) / 1e9 if cuda else None
    return rel(out, ref), peak


def main(argv: list[str] | None = None) -> None:
    """Run the comparison (see the module docstring); ``argv`` as on the command line."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="qwen3,mixtral,dsv3")
    ap.add_argument("--tokens", default=None, help="comma list of T (default 64,256,1024,4096,16384; smoke 8)")
    ap.add_argument("--no-fp8", action="store_true")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds per cell")
    ap.add_argument("--out", default=None, help="results folder (default bench/results; smoke: a temp folder)")
    ap.add_argument("--tag", default="")
    ap.add_argument("--pairs", default="", help="comma list of kernel/layout pairs to run (default: all); one "
                    "at a time keeps a large T's buffers and CUDA-graph pools inside the GPU's memory")
    ap.add_argument("--smoke", action="store_true", help="CPU, Triton interpreter, tiny qwen3 form, bf16")
    args = ap.parse_args(argv)
    pairs = {p for p in args.pairs.split(",") if p}
    if args.smoke:
        shapes, device, dtypes = {"qwen3": SMOKE_SHAPES["qwen3"]}, "cpu", ("bf16",)
        tokens, args.rounds = args.tokens or "8", 1
        out = args.out or tempfile.mkdtemp(prefix="layouts_smoke_")
    else:
        if not torch.cuda.is_available():
            raise SystemExit("bench/layouts.py needs a CUDA GPU (or --smoke)")
        shapes, device = {n: SHAPES[n] for n in args.shapes.split(",")}, "cuda"
        dtypes = ("bf16",) if args.no_fp8 else ("bf16", "fp8")
        tokens = args.tokens or "64,256,1024,4096,16384"
        out = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    import moe_fx  # noqa: F401  (registers the ops)
    from moe_fx.ops import experts_reference

    meta = bench_meta(device, args.smoke)
    print("meta", json.dumps(meta), flush=True)
    rows: list[dict] = []
    stem = results_stem("layouts", args.tag)
    for shape, dims in shapes.items():
        _, e, k, h, i = dims
        for dtype in dtypes:
            w, kw = layer(shape, dims, device, fp8=dtype == "fp8")
            ref_kw = {n: v for n, v in kw.items() if n != "kernel_choice"}
            for t in (int(x) for x in tokens.split(",")):
                sets = routing_sets(t, e, k, h, SETS, seed=t, device=device)
                fns = {f"{kern}/{lay}": pair_fn(w, kw, kern, lay, sets[0]) for kern in KERNELS for lay in LAYOUTS
                       if not pairs or f"{kern}/{lay}" in pairs}
                runnable = {name: fn for name, fn in fns.items() if callable(fn)}
                ref = experts_reference(*sets[0], w["w13"], w["w2"], **ref_kw)
                errs, graphs, out_of_memory, transient = {}, {}, {}, {}
                for name, fn in runnable.items():
                    try:
                        errs[name], transient[name] = measured_call(fn, sets[0], ref)
                        graphs[name] = graphs_of(fn, sets)[0]
                    except torch.OutOfMemoryError:  # e.g. the permuted layout's [E, T, H] buffers at T = 16384
                        errs.pop(name, None)
                        out_of_memory[name] = f"out of GPU memory at T={t} (its buffers and CUDA-graph pool)"
                        torch.cuda.empty_cache()
                times: dict[str, list[float]] = {name: [] for name in graphs}
                for r in range(args.rounds):
                    for name in (list(graphs) if r % 2 == 0 else list(graphs)[::-1]):
                        times[name].append(time_us(graphs[name]))
                us = {name: statistics.median(v) for name, v in times.items()}
                floor = (row_metrics(min(us.values()), sets[:1], e, k, h, i, dtype == "fp8", meta["limits"])["floor_us"]
                         if meta["limits"] and us else None)
                row = {"shape": shape, "dtype": dtype, "T": t, "us": us, "rel_err": errs, "floor_us": floor,
                       "transient_gb": transient,
                       "cannot_run": {**{name: fn for name, fn in fns.items() if not callable(fn)}, **out_of_memory}}
                rows.append(row)
                print(json.dumps({kk: row[kk] for kk in ("shape", "dtype", "T", "us")}), flush=True)
                del graphs
                write(out, stem, meta, rows)
            del w
            if device == "cuda":
                torch.cuda.empty_cache()
    write(out, stem, meta, rows)
    print("done ->", os.path.join(out, stem + ".md"), flush=True)


def _gb(v: float | None) -> str:
    return "" if v is None else f", {v:.2f} GB"


def write(out: str, stem: str, meta: dict, rows: list[dict]) -> None:
    """The results as JSON and markdown (one row per shape, dtype and T; a column per (kernel, layout))."""
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, stem + ".json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    pairs = [f"{k}/{lay}" for k in KERNELS for lay in LAYOUTS]
    lim = meta["limits"]
    limits = (f"limits measured in the same run: copy {lim['copy_tbs']:.2f} TB/s, bf16 matmul "
              f"{lim['bf16_tflops']:.0f} TFLOP/s" if lim else "smoke run on CPU (tiny shapes; times are not GPU times)")
    lines = [
        "# One MoE layer: every (experts kernel, row layout) pair the lowering can run", "",
        f"{meta['date']} · {meta['gpu']} · torch {meta['torch']} · triton {meta['triton']} · {limits}", "",
        f"Command: `{meta['command']}`", "",
        ("µs of CUDA-graph replays (medians of alternating rounds), relative error against the fp32 reference in "
         "brackets with the GPU memory one eager call allocated beyond its inputs (its transient buffers and "
         "output); — cannot run (reasons in the JSON). Floor = max(bytes / copy rate, flops / matmul rate)."), "",
        "| shape | dtype | T | " + " | ".join(pairs) + " | floor µs |",
        "|---|---|---|" + "---|" * (len(pairs) + 1),
    ]
    for r in rows:
        cells = [f"{r['us'][p]:.1f} ({r['rel_err'][p]:.1e}{_gb(r.get('transient_gb', {}).get(p))})" if p in r["us"]
                 else "—" for p in pairs]
        floor = f"{r['floor_us']:.1f}" if r["floor_us"] is not None else "—"
        lines.append(f"| {r['shape']} | {r['dtype']} | {r['T']} | " + " | ".join(cells) + f" | {floor} |")
    with open(os.path.join(out, stem + ".md"), "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
