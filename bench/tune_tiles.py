"""Tune the Triton masked-GEMM tiles for the benchmark's MoE shapes and report every candidate.

For each shape of ``bench/moe_layer.py`` (Mixtral-8x7B, Qwen3-30B-A3B, a DeepSeek-V3 EP-8 shard),
each token count T, each GEMM (gate+up ``2I x H``, down ``H x I``) and each kind (bf16, fp8 with
1x128 / 128x128 scales), times every candidate tile of the bucket ``ceil(T * K / E)`` on uniform
loads (decode buckets with only the ``min(E, T * K)`` experts a step hits) and keeps the fastest in
the tuning cache (``$MOE_FX_CACHE_DIR/triton_tiles.json``). Buckets already tuned are skipped, so
a second run does not tune again; ``--force`` tunes anew.

    python bench/tune_tiles.py [--shapes mixtral,qwen3,dsv3] [--tokens 1,8,...] [--out DIR] [--ship]

Writes ``tune_tiles_<date>.md`` (every candidate: µs and TFLOP/s; the winner marked) to ``--out``;
``--ship`` also copies the cache into the package's ``tuned_tiles.json`` (the shipped table).

``--sorted``: the contiguous layout's GEMMs (the default on one GPU), tuned per rows-per-expert
*regime*: every candidate of a regime (``configs.regime_candidates``) is timed at every T of the
regime on real routings (random top-k: uneven loads), and the one with the best worst case is kept
(``configs.pick_regime_config``), so a compiled graph, which runs one tile per regime whatever T
it was traced with, stays within that worst case of the best tile at every T. The report gives, per
T, the best candidate, the chosen one and their ratio. ``--warm N`` compiles every candidate in N
processes first (Triton's on-disk cache then serves the timing process): compiling, not timing,
is what a tuning lease spends most of its time on.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import shutil
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from moe_layer import GPT_OSS_ACT, SHAPES, TOKENS  # noqa: E402

#: where --sorted builds its operands (a CPU smoke run of the script sets it to "cpu")
DEVICE = "cuda"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (``argv``, default ``sys.argv[1:]``)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="mixtral,qwen3,dsv3")
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    ap.add_argument("--kinds", default="bf16,fp8")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    ap.add_argument("--force", action="store_true", help="tune buckets the cache already holds")
    ap.add_argument("--ship", action="store_true", help="copy the cache to moe_fx/lowering/triton/tuned_tiles.json")
    ap.add_argument("--budget-s", type=float, default=1e9, help="stop tuning new buckets after this many seconds")
    ap.add_argument("--sorted", action="store_true", help="tune the sorted layout's GEMMs per regime")
    ap.add_argument("--warm", type=int, default=0, help="--sorted: compile the candidates in this many processes first")
    ap.add_argument("--worker", default="", help=argparse.SUPPRESS)  # "i/n": one compile-only worker
    ap.add_argument("--tag", default="")
    ap.add_argument("--add-shape", action="append", default=[], metavar="NAME=E,K,H,I", type=parse_shape,
                    help="tune a layer that is not in bench/moe_layer.py's SHAPES (your model's): E experts, top-K, "
                         "hidden H, expert intermediate I; name it in --shapes too")
    ap.add_argument("--ship-slots", nargs="+", metavar="JSON", help="no GPU: add the static-size entries of saved "
                    "--sorted runs (their report JSON) to the shipped table")
    return ap.parse_args(argv)


def main() -> None:
    args = parse_args()
    SHAPES.update(dict(args.add_shape))
    if args.ship_slots:
        ship_slots(args.ship_slots)
        return
    if args.sorted:
        tune_sorted(args)
        return
    if not torch.cuda.is_available():
        sys.exit("bench/tune_tiles.py needs a CUDA GPU")
    import triton

    from moe_fx.lowering.problem import rows_per_expert
    from moe_fx.lowering.triton import configs
    from moe_fx.lowering.triton.grouped_gemm import tune_masked_gemm

    t0 = time.time()
    stamp = datetime.datetime.now(datetime.timezone.utc)
    lines = [
        "# Triton masked-GEMM tiles, every candidate",
        "",
        f"{stamp.isoformat(timespec='seconds')} · {torch.cuda.get_device_name()} · torch {torch.__version__} · "
        f"triton {triton.__version__}",
        "",
        "Uniform loads: m = ceil(T*K/E) rows in each expert hit (decode: min(E, T*K) experts hit). "
        "µs = mean of CUDA-graph replays (triton.testing.do_bench_cudagraph: GPU time, no launch cost); "
        "* = chosen. Tile = block_m x block_n x block_k / warps / "
        "stages / programs per SM (+tma).",
        "",
        "| shape | T | kind | GEMM N x K | m | tile | µs | TFLOP/s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    seen = set()
    for shape in args.shapes.split(","):
        _, e, k, h, i = SHAPES[shape]
        for t in map(int, args.tokens.split(",")):
            em = rows_per_expert(t, k, e)
            active = min(e, t * k)
            for kind in args.kinds.split(","):
                for n_, k_ in ((2 * i, h), (h, i)):
                    # the tuning cache's own key: one tuning per bucket, whichever shape and T reach it
                    key = configs._key("", kind, n_, k_, configs.m_bucket(em), active)
                    if key in seen:
                        continue
                    seen.add(key)
                    if time.time() - t0 > args.budget_s:
                        print(f"budget spent; not tuned: {shape} T={t} {kind} {n_}x{k_}", flush=True)
                        continue
                    timings: dict = {}
                    s0 = time.time()
                    best = tune_masked_gemm(
                        kind, e, n_, k_, em, active_groups=active, force=args.force, timings=timings
                    )
                    print(f"{shape} T={t} {kind} N={n_} K={k_} m={em}: {best} ({time.time() - s0:.1f}s)", flush=True)
                    flops = 2 * active * max(em, 1) * n_ * k_
                    for cfg, ms in sorted(timings.items(), key=lambda kv: kv[1]):
                        tile = (
                            f"{cfg.block_m}x{cfg.block_n}x{cfg.block_k}/{cfg.num_warps}/{cfg.num_stages}/"
                            f"{cfg.programs_per_sm}{'+tma' if cfg.tma else ''}{' *' if cfg == best else ''}"
                        )
                        lines.append(
                            f"| {shape} | {t} | {kind} | {n_} x {k_} | {em} | {tile} | {ms * 1e3:.1f} | "
                            f"{flops / ms / 1e9:.0f} |"
                        )
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"tune_tiles_{stamp.strftime('%Y-%m-%d')}.md")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("wrote", path, f"({time.time() - t0:.0f}s)")
    if args.ship:
        dst = os.path.join(os.path.dirname(configs.__file__), "tuned_tiles.json")
        shutil.copy(configs.cache_path(), dst)
        print("shipped", dst, len(json.load(open(dst))), "entries")


def _sorted_jobs(args):
    """(shape, T, kind, gemm) cells of a --sorted run, in a fixed order (workers split them by index)."""
    for shape in args.shapes.split(","):
        for t in map(int, args.tokens.split(",")):
            for kind in args.kinds.split(","):
                for gemm in (1, 2):
                    yield shape, t, kind, gemm


def epilogue_activation(shape: str, kind: str, regime: int):
    """The activation GEMM1 of ``shape``'s layer applies in its epilogue at ``regime`` (``None``: the separate kernel).

    Tuning times the GEMM the pipeline runs: with gate/up halves in its epilogue a swapped tile loads two weight
    tiles per k step (twice its shared memory: fewer programs fit per SM), so the unfused GEMM's best tile is not
    the fused one's. Asks the pipeline's own rule (``pipeline.fuse_activation``)."""
    from moe_fx.lowering.masked_experts.pipeline import fuse_activation
    from moe_fx.ops import ExpertActivation

    spec = ExpertActivation(**GPT_OSS_ACT) if SHAPES[shape][0] == "gpt_oss" else ExpertActivation()
    return spec if fuse_activation(spec, kind == "fp8", regime) else None


def _sorted_cell(shape: str, t: int, kind: str, gemm: int, cache: dict):
    """``(run(cfg), N, K, regime, flops)`` for one cell: real routing, the layer's operands."""
    from moe_fx.lowering.masked_experts.pipeline import slot_rows
    from moe_fx.lowering.problem import row_regime, rows_per_expert
    from moe_fx.lowering.quant import quantize_fp8_blockwise
    from moe_fx.lowering.triton.grouped_gemm import SlotRows, sorted_gemm
    from moe_fx.lowering.triton.sort import quantize_rows, sort_by_expert

    _, e, k, h, i = SHAPES[shape]
    if cache.get("shape") != shape:
        cache.clear()
        if DEVICE == "cuda":  # the last shape's weights and fp32 quantisation temporaries stay reserved otherwise:
            torch.cuda.empty_cache()  # ten warm-up workers each holding the largest shape's ran the H200 out of memory
        g = torch.Generator(device=DEVICE).manual_seed(1)
        cache["shape"] = shape
        w13 = torch.randn(e, 2 * i, h, device=DEVICE, generator=g, dtype=torch.bfloat16) / h**0.5
        w2 = torch.randn(e, h, i, device=DEVICE, generator=g, dtype=torch.bfloat16) / i**0.5
        cache["bf16"] = (w13, None, w2, None)
    if kind == "fp8" and "fp8" not in cache:  # only when asked: eight warm-up workers quantising Mixtral's weights
        w13, _, w2, _ = cache["bf16"]  # for a bf16 run ran an 80 GB H100 out of memory (2026-12-06)
        q13, s13 = quantize_fp8_blockwise(w13)
        q2, s2 = quantize_fp8_blockwise(w2)
        cache["fp8"] = (q13, s13, q2, s2)
    if cache.get("t") != t:
        g = torch.Generator(device=DEVICE).manual_seed(t)
        scores = torch.randn(t, e, device=DEVICE, generator=g)
        ids = scores.topk(k, dim=-1).indices
        x = torch.randn(t, h, device=DEVICE, generator=g, dtype=torch.bfloat16)
        a2 = torch.randn(1, t * k, i, device=DEVICE, generator=g, dtype=torch.bfloat16)
        cache.update(t=t, ids=ids, rows=sort_by_expert(ids, e), x=x, a2=a2, xq=quantize_rows(x),
                     a2q=quantize_rows(a2[0]))
    w13, s13, w2, s2 = cache[kind]
    fp8 = kind == "fp8"
    # the rows the pipeline runs: one token's in slot order (no sort) where pipeline.slot_rows says so
    rows = SlotRows.of(cache["ids"], e) if slot_rows(fp8, t) else cache["rows"]
    regime = row_regime(rows_per_expert(t, k, e))
    activation = None
    if gemm == 1:
        a, a_s = cache["xq"] if fp8 else (cache["x"], None)
        w, w_s, gather = w13, s13, True
        activation = epilogue_activation(shape, kind, regime)
    else:
        a, a_s = (cache["a2q"][0].unsqueeze(0), cache["a2q"][1].unsqueeze(0)) if fp8 else (cache["a2"], None)
        w, w_s, gather = w2, s2, False
    n_, k_ = w.shape[1], w.shape[2]
    out = torch.empty(1, t * k, n_ // 2 if activation is not None else n_, device=DEVICE, dtype=torch.bfloat16)

    def run(cfg):
        return sorted_gemm(a, w, rows, out, a_scale=a_s, b_scale=w_s, gather=gather, regime=regime, config=cfg,
                           activation=activation)

    return run, n_, k_, regime, 2 * t * k * n_ * k_


def _warm_worker(args) -> None:
    """Compile (run once) every candidate of this worker's share of the cells."""
    from moe_fx.lowering.triton import configs

    index, count = map(int, args.worker.split("/"))
    cache: dict = {}
    for j, (shape, t, kind, gemm) in enumerate(_sorted_jobs(args)):
        if j % count != index:
            continue
        run, _, _, regime, _ = _sorted_cell(shape, t, kind, gemm, cache)
        for cfg in configs.regime_candidates(kind, regime):
            try:
                run(cfg)
            except Exception as err:  # noqa: BLE001 - a candidate that fails is reported by the timing pass
                print(f"warm {shape} T={t} {kind} gemm{gemm} {cfg}: {type(err).__name__}", flush=True)
    torch.cuda.synchronize()


def tune_sorted(args) -> None:
    """--sorted: per-regime tiles of the contiguous layout's GEMMs (see the module docstring)."""
    import subprocess

    import triton
    import triton.testing

    from moe_fx.lowering.problem import rows_per_expert
    from moe_fx.lowering.triton import configs
    from moe_fx.lowering.triton.configs import pick_regime_config, regime_candidates, regime_key

    if args.worker:
        _warm_worker(args)
        return
    t0 = time.time()
    if args.warm:
        cmd = [sys.executable, os.path.abspath(__file__), "--sorted", "--shapes", args.shapes, "--tokens", args.tokens,
               "--kinds", args.kinds]
        for name, (_, e, k, h, i) in args.add_shape:  # the workers need the user's shapes too
            cmd += ["--add-shape", f"{name}={e},{k},{h},{i}"]
        procs = [subprocess.Popen(cmd + ["--worker", f"{w}/{args.warm}"]) for w in range(args.warm)]
        for p in procs:
            p.wait()
        print(f"warm compile: {time.time() - t0:.0f}s in {args.warm} processes", flush=True)
    name = torch.cuda.get_device_name()
    timings: dict = {}  # (shape, kind, gemm, regime) -> {T: {cfg: ms}}
    before: dict = {}  # (shape, kind, gemm, regime) -> {T: (the table's tile before this run, ms)}
    meta: dict = {}
    cache: dict = {}
    for shape, t, kind, gemm in _sorted_jobs(args):
        if time.time() - t0 > args.budget_s:
            print(f"budget spent; not timed: {shape} T={t} {kind} gemm{gemm}", flush=True)
            continue
        run, n_, k_, regime, flops = _sorted_cell(shape, t, kind, gemm, cache)
        key = (shape, kind, gemm, regime)
        meta[key] = (n_, k_)
        per = timings.setdefault(key, {}).setdefault(t, {})
        for cfg in regime_candidates(kind, regime):
            try:
                per[cfg] = _graph_ms(lambda: run(cfg))
            except (RuntimeError, ValueError) as err:
                print(f"{shape} T={t} {kind} gemm{gemm} {cfg} failed: {str(err).splitlines()[0][:120]}", flush=True)
        # what the lookup gave before this run (the shipped table, or for an untuned shape its fallback)
        e, topk = SHAPES[shape][1], SHAPES[shape][2]
        table_cfg = configs.get_config(kind, n_, k_, rows_per_expert(t, topk, e), torch.device(DEVICE),
                                       layout="sorted", regime=regime, symbolic=True)
        try:
            before.setdefault(key, {})[t] = (table_cfg, per.get(table_cfg) or _graph_ms(lambda: run(table_cfg)))
        except (RuntimeError, ValueError) as err:
            print(f"{shape} T={t} {kind} gemm{gemm} table tile {table_cfg} failed: {str(err).splitlines()[0][:120]}")
        best = min(per, key=per.get) if per else None
        print(f"{shape} T={t} {kind} gemm{gemm} r{regime}: best {best} {per.get(best, 0) * 1e3:.1f}us "
              f"({flops / max(per.get(best, 1), 1e-9) / 1e9:.0f} TFLOP/s)", flush=True)
    entries, rows = {}, []
    for (shape, kind, gemm, regime), per_t in timings.items():
        cfg, worst = pick_regime_config(per_t)
        n_, k_ = meta[(shape, kind, gemm, regime)]
        entries[regime_key(name, kind, n_, k_, "sorted", regime)] = cfg
        for t, per in sorted(per_t.items()):
            best = min(per, key=per.get)
            prior = before.get((shape, kind, gemm, regime), {}).get(t)
            rows.append({"shape": shape, "kind": kind, "gemm": gemm, "N": n_, "K": k_, "regime": regime, "T": t,
                         "best": _tile(best), "best_us": per[best] * 1e3, "chosen": _tile(cfg),
                         "chosen_us": per[cfg] * 1e3, "ratio": per[cfg] / per[best],
                         "before": _tile(prior[0]) if prior else None, "before_us": prior[1] * 1e3 if prior else None,
                         "all_us": {_tile(c): v * 1e3 for c, v in per.items()}})
    entries.update(slot_entries(rows, name))
    configs.store(entries)
    stamp = datetime.datetime.now(datetime.timezone.utc)
    os.makedirs(args.out, exist_ok=True)
    base = os.path.join(args.out, f"tune_tiles_sorted_{stamp.strftime('%Y-%m-%d')}{'_' + args.tag if args.tag else ''}")
    head = {"date": stamp.isoformat(timespec="seconds"), "gpu": name, "torch": torch.__version__,
            "triton": triton.__version__, "command": " ".join(sys.argv), "seconds": round(time.time() - t0)}
    with open(base + ".json", "w") as f:
        json.dump({"meta": head, "rows": rows, "entries": {k: dataclasses.asdict(v) for k, v in entries.items()}}, f,
                  indent=1)
    lines = [f"# Sorted-layout GEMM tiles per regime, {head['date']} · {name} · torch {head['torch']} · "
             f"triton {head['triton']}", "",
             "µs: CUDA-graph replays of one GEMM on a real routing (random top-k). chosen = the regime's tile "
             "(best worst case over the regime's T); ratio = chosen / best at that T; before = the tile the lookup "
             "gave before this run (the shipped table, or an untuned shape's fallback) and its µs.", "",
             "| shape | kind | GEMM | N x K | regime | T | best | µs | chosen | µs | ratio | before | µs |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        prior = f"{r['before']} | {r['before_us']:.1f}" if r["before"] else "— | —"
        lines.append(f"| {r['shape']} | {r['kind']} | {r['gemm']} | {r['N']} x {r['K']} | {r['regime']} | {r['T']} | "
                     f"{r['best']} | {r['best_us']:.1f} | {r['chosen']} | {r['chosen_us']:.1f} | {r['ratio']:.2f} | "
                     f"{prior} |")
    worst = max((r["ratio"] for r in rows), default=1.0)
    lines += ["", f"Worst ratio over every row: {worst:.2f}."]
    with open(base + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"wrote {base}.md ({time.time() - t0:.0f}s); worst chosen/best {worst:.2f}", flush=True)
    if args.ship:
        dst = os.path.join(os.path.dirname(configs.__file__), "tuned_tiles.json")
        with open(dst) as f:
            shipped = merge_shipped(json.load(f), entries, rows, name)
        with open(dst, "w") as f:
            json.dump(shipped, f, indent=1, sort_keys=True)
        print("shipped", dst, len(shipped), "entries")


def merge_shipped(shipped: dict, entries: dict, rows: list[dict], device_name: str) -> dict:
    """The shipped table with a ``--sorted`` run's entries: its regime tiles, and static-size entries only where this
    run found one. A static-size entry of an earlier run at a size this run timed is dropped first: it beat the regime
    tile of its own run, which this run's regime tile replaces (a retune must not leave the old exceptions behind)."""
    from moe_fx.lowering.triton.configs import regime_key

    out = dict(shipped)
    for r in rows:
        out.pop(regime_key(device_name, r["kind"], r["N"], r["K"], "sorted", r["regime"],
                           r["T"] * SHAPES[r["shape"]][2]), None)
    out.update({k: dataclasses.asdict(v) for k, v in entries.items()})
    return out


def _graph_ms(fn, target_ms: float = 2.0, replays: int = 5) -> float:
    """Median ms per call of ``fn`` as CUDA-graph replays (GPU time, no launch cost), sized to ~``target_ms``.

    Cheaper than ``do_bench_cudagraph`` (which retries ten times): a tuning run times ~1000 cells.
    """
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # compile / warm outside the capture
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    calls = max(1, min(100, int(target_ms / max(start.elapsed_time(end), 1e-3))))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    times = []
    for _ in range(replays):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    del graph
    return sorted(times)[len(times) // 2]


def parse_shape(text: str) -> tuple[str, tuple]:
    """``"mine=64,8,2048,1408"`` -> ``("mine", ("custom", 64, 8, 2048, 1408))``: a SHAPES entry (E, K, H, I)."""
    name, _, dims = text.partition("=")
    try:
        e, k, h, i = (int(v) for v in dims.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected NAME=E,K,H,I (four integers), got {text!r}") from None
    if not name or min(e, k, h, i) < 1 or k > e:
        raise argparse.ArgumentTypeError(f"expected NAME=E,K,H,I with 1 <= K <= E and H, I >= 1, got {text!r}")
    return name, ("custom", e, k, h, i)


#: a static token count gets its own tile (``configs.regime_key(..., slots)``) where the best at that T
#: beats the regime's by more than this factor
SLOT_MARGIN = 1.03


def slot_entries(rows: list[dict], device_name: str, margin: float = SLOT_MARGIN) -> dict:
    """``{regime_key(..., slots=T*K): best tile}`` for the report rows where the regime's tile loses by > ``margin``."""
    from moe_fx.lowering.triton.configs import regime_key

    out = {}
    for r in rows:
        if r["chosen_us"] > margin * r["best_us"]:
            slots = r["T"] * SHAPES[r["shape"]][2]
            out[regime_key(device_name, r["kind"], r["N"], r["K"], "sorted", r["regime"], slots)] = parse_tile(r["best"])
    return out


def ship_slots(paths: list[str]) -> None:
    """--ship-slots: merge the static-size entries of saved ``--sorted`` reports into ``tuned_tiles.json``."""
    from moe_fx.lowering.triton import configs

    dst = os.path.join(os.path.dirname(configs.__file__), "tuned_tiles.json")
    with open(dst) as f:
        shipped = json.load(f)
    added = {}
    for path in paths:
        with open(path) as f:
            run = json.load(f)
        added.update(slot_entries(run["rows"], run["meta"]["gpu"]))
    shipped.update({k: dataclasses.asdict(v) for k, v in added.items()})
    with open(dst, "w") as f:
        json.dump(shipped, f, indent=1, sort_keys=True)
    print(f"shipped {len(added)} static-size entries to {dst} ({len(shipped)} entries)")


def parse_tile(label: str):
    """The ``TileConfig`` of a :func:`_tile` label (reports name tiles by label)."""
    from moe_fx.lowering.triton.configs import TileConfig

    flags = label.split("+")
    dims, warps, stages, ppsm, *group = flags[0].split("/")
    bm, bn, bk = map(int, dims.split("x"))
    return TileConfig(bm, bn, bk, int(group[0].removeprefix("g")) if group else 1, int(warps), int(stages), int(ppsm),
                      tma="tma" in flags[1:], swap_ab="swap" in flags[1:], flatten="flat" in flags[1:])


def _tile(cfg) -> str:
    # every field that tells two candidates apart (a swapped tile and its plain twin differ only there)
    return (f"{cfg.block_m}x{cfg.block_n}x{cfg.block_k}/{cfg.num_warps}/{cfg.num_stages}/{cfg.programs_per_sm}"
            f"{f'/g{cfg.group_m}' if cfg.group_m != 1 else ''}{'+tma' if cfg.tma else ''}{'+swap' if cfg.swap_ab else ''}"
            f"{'+flat' if cfg.flatten else ''}")


if __name__ == "__main__":
    main()
