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
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from moe_layer import SHAPES, TOKENS  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="mixtral,qwen3,dsv3")
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    ap.add_argument("--kinds", default="bf16,fp8")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    ap.add_argument("--force", action="store_true", help="tune buckets the cache already holds")
    ap.add_argument("--ship", action="store_true", help="copy the cache to moe_fx/lowering/triton/tuned_tiles.json")
    ap.add_argument("--budget-s", type=float, default=1e9, help="stop tuning new buckets after this many seconds")
    args = ap.parse_args()
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


if __name__ == "__main__":
    main()
