"""Where one MoE layer's time goes on one GPU: each kernel of a CUDA-graph replay of
``torch.ops.moe_fx.experts`` (Triton), against the layer's floor and each GEMM's own bandwidth floor.

For each shape and token count T the layer (bf16 or fp8 weights, moe_layer's SHAPES and forms) is captured
in CUDA graphs over rotating routing sets; the replay is timed (median), then the same graphs are profiled in the
same rotation (``torch.profiler``) and each kernel's mean GPU time over the sets is listed in launch order. ``gaps``
is the replay time minus the kernels' sum: launch latency and idle time between kernels inside the graph.
``kernels µs`` is that sum and the floor's share of it: what the layer's own kernels reach, without the latency of
launching a graph of one layer (a model's graph or wrapper pays that once for all its layers; the short gaps between
its kernels it still pays, so the share is an upper bound of the layer's inside a model). GEMM floors are the
bytes of the weights of the experts hit over the copy rate measured in the same run; the layer's floor is
moe_layer's (``max(bytes / copy rate, flops / matmul rate)``).

    python bench/kernel_breakdown.py [--shapes qwen3,gpt_oss,mixtral] [--tokens 1,4,16] [--fp8]
                                     [--set masked_experts.pipeline.SLOT_ROWS_MAX_TOKENS=4 ...]
                                     [--plain] [--kernel-choice auto] [--compiled]

``--plain`` also profiles each row's layer called without a graph (the same kernels launched one by one):
a second table sets its call time, kernels and gaps beside the replay's, to tell slower kernels from longer gaps.
``--kernel-choice auto`` lets the op take DeepGEMM where its lowering would (DeepGEMM must import); the default runs
moe_fx's Triton kernels.

``--compiled`` profiles the op as bench/moe_layer.py times it: ``torch.compile`` of one call (Inductor's graph around
the op, its lowering's kernels), captured in the same graphs; the default calls the op eagerly.

``--set`` runs every row with a lowering constant changed (a switch of docs/triton.md's table), to see where a
switch moves the time; the settings are written beside the results.

Writes ``kernel_breakdown_<date>[_tag].{md,json}`` to ``--out`` (default bench/results).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fused_activation import layer
from moe_layer import (
    SHAPES,
    allow_many_compiles,
    apply_settings,
    bench_meta,
    capture_graphs,
    qualified_setting,
    replay_us,
    results_stem,
    routing_sets,
    row_metrics,
    salt_compile_cache,
    time_rotating,
)

SETS = 3
PROFILED_REPLAYS = 5


def kernels_share(floor_us: float, kernels: list[tuple[str, float]]) -> tuple[float, float]:
    """(sum of the kernels' GPU µs, the floor's share of it): the layer's kernels against its floor, without the
    replay's launch latency and gaps."""
    total = sum(d for _, d in kernels)
    return total, (floor_us / total if total > 0 else float("nan"))


def choice_label(kernel_choice: str) -> str:
    """The ``pair`` column of a row whose kernel and layout the op chose under ``kernel_choice``."""
    return "op's choice" if kernel_choice == "triton" else f"op's choice ({kernel_choice})"


def per_launch_us(events: list[tuple[str, float, float]], replays: int) -> list[tuple[str, float]]:
    """Mean GPU µs of each launch of one replay, in launch order, from the events ``(name, start, end)`` of
    ``replays`` identical replays (each launches the same kernels in the same order)."""
    if replays < 1 or len(events) % replays:
        raise ValueError(f"{len(events)} GPU events are not {replays} replays of one kernel sequence")
    ev = sorted(events, key=lambda e: e[1])
    n = len(ev) // replays
    chunks = [ev[r * n:(r + 1) * n] for r in range(replays)]
    names = [e[0] for e in chunks[0]]
    if any([e[0] for e in c] != names for c in chunks[1:]):
        raise ValueError("the replays launched different kernel sequences")
    return [(names[j], sum(c[j][2] - c[j][1] for c in chunks) / replays) for j in range(n)]


def gemm_floors_us(hit: int, h: int, i: int, fp8: bool, copy_tbs: float) -> tuple[float, float]:
    """Bandwidth floors (µs) of GEMM1 (``[2I, H]`` per expert hit) and GEMM2 (``[H, I]``)."""
    per = 1 if fp8 else 2
    return hit * 2 * i * h * per / copy_tbs / 1e6, hit * h * i * per / copy_tbs / 1e6


def kernels_cell(row: dict, kernels: list[tuple[str, float]]) -> str:
    """``kernels`` (name, GPU µs) in launch order as one table cell, each GEMM with its bandwidth floor from ``row``
    (the first GEMM launched is GEMM1)."""
    parts, gemm = [], 0
    for name, d in kernels:
        if "gemm" in name:
            gemm += 1
            floor = row["gemm1_floor_us"] if gemm == 1 else row["gemm2_floor_us"]
            parts.append(f"{name} {d:.1f} ({floor:.1f})")
        else:
            parts.append(f"{name} {d:.1f}")
    return " · ".join(parts)


def dtype(row: dict) -> str:
    """A row's weight dtype as the tables write it."""
    return "fp8" if row["fp8"] else "bf16"


def section(heading: str, columns: list[str], cells: list[list]) -> str:
    """A markdown section: ``heading`` and a table of ``columns`` with one row per entry of ``cells``; nothing
    when there are no rows (the run did not measure what the section shows)."""
    if not cells:
        return ""
    lines = [f"\n## {heading}\n", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(map(str, row)) + " |" for row in cells]
    return "\n".join(lines) + "\n"


def short(name: str) -> str:
    """A kernel's name without template arguments and signature (``void at::native::foo<...>(...)`` -> ``foo``)."""
    name = name.split("(")[0].split("<")[0].replace("void ", "")
    return name.split("::")[-1]


def _profile(step) -> list[tuple[str, float, float]]:
    """GPU events ``(name, start, end)`` of ``PROFILED_REPLAYS`` calls of ``step`` (a graph's replay, or a plain call)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(PROFILED_REPLAYS):
            step()
        torch.cuda.synchronize()
    return [(e.name, e.time_range.start, e.time_range.end) for e in prof.events()
            if e.device_type == torch.autograd.DeviceType.CUDA]


def graph_kernels(graphs: list, profile: Callable[[Callable], list] | None = None) -> list[tuple[str, float]]:
    """``(kernel, mean GPU µs)`` of one replay, in launch order: ``graphs`` (one per routing set, as timed by
    ``replay_us``) replayed in that rotation ``PROFILED_REPLAYS`` times under the profiler, each kernel's time the
    mean over every set, so the sum compares with the timed figure. Where the graphs launch different kernel
    sequences (a side whose launches depend on more than the shapes), the first graph alone, as before 2026-12-08.
    ``profile`` stands in for :func:`_profile` (tests)."""

    def rotation() -> None:
        for graph in graphs:
            graph.replay()

    events = (profile or _profile)(rotation)
    try:
        launches = per_launch_us(events, PROFILED_REPLAYS * len(graphs))
    except ValueError:
        if len(graphs) == 1:
            raise
        return graph_kernels(graphs[:1], profile)
    return [(short(n), d) for n, d in launches]


def plain_calls(run, sets) -> dict:
    """The same layer called from Python, no CUDA graph (the op's kernels launched one by one): µs per call
    over the rotating sets, each kernel's mean GPU µs and the gaps, to set beside the graph's replay. The graphs
    captured before it warmed ``run`` up on every set already."""
    us = time_rotating(run, sets)
    launches = per_launch_us(_profile(lambda: run(*sets[0])), PROFILED_REPLAYS)
    return {"call_us": us, "kernels": [(short(n), d) for n, d in launches],
            "gaps_us": us - sum(d for _, d in launches)}


def two_pass_sort():
    """A context in which the decode sort keeps its two passes (``sort_small_kernel(PAIRWISE=False)``): the
    other side of ``--sort-ab``, captured into its own graphs."""
    import contextlib

    from moe_fx.lowering.triton import sort as sort_mod

    @contextlib.contextmanager
    def ctx():
        real = sort_mod.launch

        def launch(name, *args, **kw):
            if name == "sort_small_kernel":
                kw["PAIRWISE"] = False
            return real(name, *args, **kw)

        sort_mod.launch = launch
        try:
            yield
        finally:
            sort_mod.launch = real

    return ctx()


def sort_ab(run, sets, rounds: int = 6) -> dict:
    """Replay µs of the layer with the decode sort's pairwise ranks and with its two passes, timed in
    alternating rounds, and the sort kernel's own GPU µs on each side."""
    import statistics

    new, _ = capture_graphs(run, sets)
    with two_pass_sort():
        old, _ = capture_graphs(run, sets)
    times = {"pairwise": [], "two_pass": []}
    for r in range(rounds):
        for name in (("pairwise", "two_pass") if r % 2 == 0 else ("two_pass", "pairwise")):
            times[name].append(replay_us(new if name == "pairwise" else old))
    out = {f"{n}_us": statistics.median(v) for n, v in times.items()}
    for n, g in (("pairwise", new), ("two_pass", old)):
        out[f"{n}_sort_kernel_us"] = sum(d for k, d in graph_kernels(g) if k.startswith("sort_small"))
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (``argv``, default ``sys.argv[1:]``) as parsed arguments."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="qwen3,gpt_oss,mixtral")
    ap.add_argument("--tokens", default="1,4,16")
    ap.add_argument("--fp8", action="store_true", help="fp8 weights (128x128 block scales)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    ap.add_argument("--tag", default="")
    ap.add_argument("--sort-ab", action="store_true", help="also time the layer with the decode sort's two "
                    "passes against its pairwise ranks (alternating rounds)")
    ap.add_argument("--pair", default=None, help="kernel/layout forced as in bench/layouts.py, e.g. "
                    "deepgemm/local_contiguous (default: the op's own choice)")
    ap.add_argument("--plain", action="store_true", help="also profile the layer called without a CUDA graph "
                    "(same kernels, launched one by one), beside its graph replay")
    ap.add_argument("--compiled", action="store_true", help="profile the op compiled as bench/moe_layer.py times "
                    "it (torch.compile of one call, captured in the graphs) instead of called eagerly")
    ap.add_argument("--kernel-choice", default="triton", choices=("triton", "auto"),
                    help="the op's kernel_choice: auto takes DeepGEMM where the lowering would (it must be importable)")
    ap.add_argument("--set", action="append", default=[], metavar="MODULE.ATTR=VALUE",
                    help="a lowering constant for the whole run, e.g. masked_experts.pipeline.SLOT_ROWS_MAX_TOKENS=4 "
                         "(repeatable)")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import moe_fx  # noqa: F401

    settings = apply_settings(args.set)
    if args.compiled:
        allow_many_compiles()
        salt_compile_cache()
    meta = bench_meta()
    meta["settings"] = settings
    limits = meta["limits"]
    rows = []
    for shape in args.shapes.split(","):
        dims = SHAPES[shape]
        _, e, k, h, i = dims
        w, kw = layer(shape, dims, "cuda", fp8=args.fp8)
        kw["kernel_choice"] = args.kernel_choice

        def fn(x, ids, rw):
            return torch.ops.moe_fx.experts(x, ids, rw, w["w13"], w["w2"], **kw)

        if args.compiled:
            fn = torch.compile(fn)

        for t in map(int, args.tokens.split(",")):
            sets = routing_sets(t, e, k, h, SETS, seed=t)
            run = fn
            if args.pair:
                from layouts import pair_fn

                run = pair_fn(w, kw, *args.pair.split("/"), sets[0])
                if not callable(run):
                    print(json.dumps({"shape": shape, "T": t, "pair": args.pair, "cannot_run": run}), flush=True)
                    continue
            graphs, _ = capture_graphs(run, sets)
            us = replay_us(graphs)
            launches = graph_kernels(graphs)
            metrics = row_metrics(us, sets[:1], e, k, h, i, args.fp8, limits)
            g1, g2 = gemm_floors_us(metrics["experts_hit"], h, i, args.fp8, limits["copy_tbs"])
            row = {"shape": shape, "T": t, "fp8": args.fp8, "pair": args.pair or choice_label(args.kernel_choice),
                   "replay_us": us, "floor_us": metrics["floor_us"],
                   "kernels": launches, "gemm1_floor_us": g1, "gemm2_floor_us": g2,
                   "gaps_us": us - sum(d for _, d in launches), "experts_hit": metrics["experts_hit"]}
            if args.sort_ab:
                row["sort_ab"] = sort_ab(run, sets)
            if args.plain:
                row["plain"] = plain_calls(run, sets)
            rows.append(row)
            print(json.dumps(row), flush=True)
            del graphs
    stem = results_stem("kernel_breakdown", args.tag)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, stem + ".json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    with open(os.path.join(args.out, stem + ".md"), "w") as f:
        f.write(f"# One MoE layer's kernels, CUDA-graph replay ({meta['date']})\n\n")
        f.write(f"{meta.get('gpu', '')} · torch {torch.__version__} · limits in this run: copy "
                f"{limits['copy_tbs']:.2f} TB/s, bf16 {limits['bf16_tflops']:.0f} TFLOP/s\n\n")
        if settings:
            f.write("Settings: " + ", ".join(f"`{qualified_setting(n)}` = {v!r}" for n, v in settings.items()) + "\n\n")
        f.write("| shape | dtype | pair | T | replay µs | floor µs (%) | kernels µs (floor %) | "
                "kernels, launch order: GPU µs (GEMM bandwidth floor) | gaps µs |\n|---|---|---|---|---|---|---|---|---|\n")
        for r in rows:
            total, share = kernels_share(r["floor_us"], r["kernels"])
            f.write(f"| {r['shape']} | {dtype(r)} | {r['pair']} | {r['T']} | {r['replay_us']:.1f} | "
                    f"{r['floor_us']:.1f} ({100 * r['floor_us'] / r['replay_us']:.0f}%) | "
                    f"{total:.1f} ({100 * share:.0f}%) | {kernels_cell(r, r['kernels'])} | {r['gaps_us']:.1f} |\n")
        f.write(section("The same layer called without a CUDA graph (its kernels launched one by one), same run",
                        ["shape", "dtype", "T", "graph replay µs", "plain call µs", "graph kernels µs",
                         "plain kernels µs", "plain kernels, launch order: GPU µs (GEMM bandwidth floor)",
                         "plain gaps µs"],
                        [[r["shape"], dtype(r), r["T"], f"{r['replay_us']:.1f}", f"{r['plain']['call_us']:.1f}",
                          f"{sum(d for _, d in r['kernels']):.1f}", f"{sum(d for _, d in r['plain']['kernels']):.1f}",
                          kernels_cell(r, r["plain"]["kernels"]), f"{r['plain']['gaps_us']:.1f}"]
                         for r in rows if "plain" in r]))
        f.write(section("The decode sort: pairwise ranks (one program per block of slots) vs two passes (one program), "
                        "same run, alternating rounds",
                        ["shape", "dtype", "T", "replay µs pairwise", "replay µs two passes", "sort kernel µs pairwise",
                         "sort kernel µs two passes"],
                        [[r["shape"], dtype(r), r["T"], *(f"{r['sort_ab'][k]:.1f}" for k in (
                            "pairwise_us", "two_pass_us", "pairwise_sort_kernel_us", "two_pass_sort_kernel_us"))]
                         for r in rows if "sort_ab" in r]))
        f.write("\nGPU µs: mean over a profile of 5 replays. gaps: replay minus the kernels' sum (launch latency and "
                "idle time inside the graph). kernels µs: the kernels' sum, and the floor's share of it (the layer "
                "without the latency of launching a one-layer graph).\n")
    print("wrote", os.path.join(args.out, stem + ".md"))


if __name__ == "__main__":
    main()
