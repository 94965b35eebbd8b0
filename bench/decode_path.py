"""One MoE layer at decode sizes on one GPU: the decode path (``moe_fx.lowering.triton.decode``: each slot's
whole expert MLP in one kernel, sliced along I, plus a combine) against what ``moe_fx::experts`` runs today
(``kernel_choice="triton"``: sort, GEMM1 with its epilogue, GEMM2, combine), CUDA-graph replays.

For each shape, dtype (bf16; fp8 with 128x128 block scales) and T, every decode variant (slice width
``BLOCK_I`` x GEMM1 step ``BLOCK_K``) and the current path are captured over the same rotating routing sets
and timed in alternating rounds (medians); each row gives the best variant, the default variant's time
(:data:`~moe_fx.lowering.triton.decode.DEFAULT_BLOCK_I`), the floor (moe_layer's, limits measured in the
same run) and each path's relative error against the fp32 reference.

    python bench/decode_path.py [--shapes qwen3,gpt_oss,mixtral,dsv3] [--tokens 1,2,4,8,16] [--no-fp8]

Writes ``decode_path_<date>[_tag].{md,json}`` to ``--out`` (default bench/results).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fused_activation import layer, rel
from moe_layer import SHAPES, bench_meta, capture_graphs, replay_us, results_stem, routing_sets, row_metrics

SETS = 3
BLOCK_IS = {"bf16": (32, 64, 128), "fp8": (32, 64)}  # fp8 at 128: over the H200's shared memory
BLOCK_KS = {"bf16": (64, 128), "fp8": (64, 128)}
#: the multiply-and-reduce GEMV variant (``use_dot=False``), at its best tile of the first run
GEMV = (64, 128)


def _spec(kw: dict):
    from moe_fx.ops import ExpertActivation

    return ExpertActivation(gate_up_layout=kw.get("gate_up_layout", "halves"), alpha=kw.get("alpha", 1.0),
                            limit=kw.get("limit"), up_offset=kw.get("up_offset", 0.0))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="qwen3,gpt_oss,mixtral,dsv3")
    ap.add_argument("--tokens", default="1,2,4,8,16")
    ap.add_argument("--no-fp8", action="store_true")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    ap.add_argument("--tag", default="")
    args = ap.parse_args(argv)
    import moe_fx  # noqa: F401
    from moe_fx.lowering.triton.decode import DEFAULT_BLOCK_I, decode_experts
    from moe_fx.ops import experts_reference

    meta = bench_meta()
    limits = meta["limits"]
    rows = []
    for shape in args.shapes.split(","):
        dims = SHAPES[shape]
        _, e, k, h, i = dims
        for dtype in ("bf16",) + (() if args.no_fp8 else ("fp8",)):
            w, kw = layer(shape, dims, "cuda", fp8=dtype == "fp8")
            spec = _spec(kw)
            dk = {n: kw[n] for n in ("w13_scale", "w2_scale", "w13_bias", "w2_bias") if n in kw}
            ref_kw = {n: v for n, v in kw.items() if n != "kernel_choice"}

            def current(x, ids, rw):
                return torch.ops.moe_fx.experts(x, ids, rw, w["w13"], w["w2"], **kw)

            def decode(bi, bk, use_dot=True):
                return lambda x, ids, rw: decode_experts(x, ids, rw, w["w13"], w["w2"], spec, block_i=bi,
                                                         block_k=bk, use_dot=use_dot, **dk)

            variants = {"current": current}
            for bi in BLOCK_IS[dtype]:
                for bk in BLOCK_KS[dtype]:
                    variants[f"decode_{bi}x{bk}"] = decode(bi, bk)
            variants[f"gemv_{GEMV[0]}x{GEMV[1]}"] = decode(*GEMV, use_dot=False)
            default_bi = DEFAULT_BLOCK_I[dtype == "fp8"]
            default = f"decode_{default_bi}x128"
            variants.setdefault(default, decode(default_bi, 128))
            for t in map(int, args.tokens.split(",")):
                sets = routing_sets(t, e, k, h, SETS, seed=t)
                x, ids, rw = sets[0]
                ref = experts_reference(x, ids, rw, w["w13"], w["w2"], **ref_kw)
                errs = {name: rel(fn(x, ids, rw), ref) for name, fn in variants.items()}
                graphs = {name: capture_graphs(fn, sets)[0] for name, fn in variants.items()}
                times: dict[str, list[float]] = {name: [] for name in variants}
                for r in range(args.rounds):
                    for name in (list(graphs) if r % 2 == 0 else list(graphs)[::-1]):
                        times[name].append(replay_us(graphs[name]))
                us = {name: statistics.median(v) for name, v in times.items()}
                best = min((n for n in us if n != "current"), key=us.get)
                floor = row_metrics(us["current"], sets[:1], e, k, h, i, dtype == "fp8", limits)["floor_us"]
                row = {"shape": shape, "dtype": dtype, "T": t, "current_us": us["current"], "best": best,
                       "best_us": us[best], "default": default, "default_us": us.get(default), "floor_us": floor,
                       "us": us, "rel_err": errs}
                rows.append(row)
                print(json.dumps({kk: v for kk, v in row.items() if kk not in ("us", "rel_err")}), flush=True)
                del graphs
    stem = results_stem("decode_path", args.tag)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, stem + ".json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    with open(os.path.join(args.out, stem + ".md"), "w") as f:
        f.write(f"# Decode path vs the current path, one layer, CUDA-graph replays ({meta['date']})\n\n")
        f.write(f"{meta['gpu']} · torch {meta['torch']} · triton {meta['triton']} · limits in this run: copy "
                f"{limits['copy_tbs']:.2f} TB/s, bf16 {limits['bf16_tflops']:.0f} TFLOP/s · `{meta['command']}`\n\n")
        f.write("| shape | dtype | T | current µs | decode default µs | best decode (µs) | best / current | floor µs | "
                "floor % (best path) | rel. err current / default |\n|---|---|---|---|---|---|---|---|---|---|\n")
        for r in rows:
            fastest = min(r["best_us"], r["current_us"])
            f.write(f"| {r['shape']} | {r['dtype']} | {r['T']} | {r['current_us']:.1f} | {r['default_us']:.1f} | "
                    f"{r['best']} ({r['best_us']:.1f}) | {r['best_us'] / r['current_us']:.2f} | {r['floor_us']:.1f} | "
                    f"{100 * r['floor_us'] / fastest:.0f}% | {r['rel_err']['current']:.1e} / "
                    f"{r['rel_err'][r['default']]:.1e} |\n")
        f.write("\nMedians of alternating rounds of `triton.testing.do_bench` over CUDA-graph replays (3 rotating "
                "routing sets). decode_<BLOCK_I>x<BLOCK_K>: slice width and GEMM1 step, MMAs on 16-column tiles; "
                "gemv_<BLOCK_I>x<BLOCK_K>: the multiply-and-reduce variant. Errors against the fp32 "
                "reference on the cell's first routing set.\n")
    print("wrote", os.path.join(args.out, stem + ".md"))


if __name__ == "__main__":
    main()
