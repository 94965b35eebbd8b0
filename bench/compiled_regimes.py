"""A compiled MoE layer under a dynamic token count: one graph per rows-per-expert regime, the regime's tiles.

    python bench/compiled_regimes.py [--shape qwen3] [--tokens 1,2,...] [--out DIR]

``torch.compile(dynamic=True)`` of ``torch.ops.moe_fx.experts`` (Inductor launches the kernels) is
called at every T, rising then falling: the number of graphs Dynamo compiles (at most one per regime),
each call's error against the eager op, and both as CUDA-graph replays (the compiled graph must run the
tiles the eager call runs: the regime's, not those of the T it was traced with). Also records whether
Inductor's generated code makes tensor descriptors on the device (``make_tensor_descriptor``).
Writes ``compiled_regimes_<date>.json`` to ``--out``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from moe_layer import SHAPES, machine_meta, routing_sets, time_graph  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="qwen3")
    ap.add_argument("--tokens", default="64,1,8,256,1024,4096,16384,2048,16,2")
    ap.add_argument("--fp8", action="store_true")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/compiled_regimes.py needs a CUDA GPU")
    from unittest import mock

    from torch._dynamo.testing import CompileCounterWithBackend
    from torch._inductor.graph import GraphLowering

    import moe_fx  # noqa: F401  (registers the lowering)
    from moe_fx.lowering.problem import row_regime, rows_per_expert
    from moe_fx.lowering.quant import quantize_fp8_blockwise

    t0 = time.time()
    _, e, k, h, i = SHAPES[args.shape]
    g = torch.Generator(device="cuda").manual_seed(1)
    w13 = torch.randn(e, 2 * i, h, device="cuda", generator=g, dtype=torch.bfloat16) / h**0.5
    w2 = torch.randn(e, h, i, device="cuda", generator=g, dtype=torch.bfloat16) / i**0.5
    kw = {}
    if args.fp8:
        w13, s13 = quantize_fp8_blockwise(w13)
        w2, s2 = quantize_fp8_blockwise(w2)
        kw = {"w13_scale": s13, "w2_scale": s2}

    def layer(x, ids, w):
        return torch.ops.moe_fx.experts(x, ids, w, w13, w2, **kw)

    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(layer, backend=counter, dynamic=True)
    rows, codes = [], []
    # Inductor's output code, saved as it is written (run_and_get_code would reset Dynamo at every call)
    saver = mock.patch.object(GraphLowering, "save_output_code", staticmethod(codes.append), create=True)
    for t in map(int, args.tokens.split(",")):
        sets = routing_sets(t, e, k, h, 2, seed=t)
        with torch.no_grad(), saver:
            got = compiled(*sets[0])
            ref = layer(*sets[0])
            err = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
            us_c = time_graph(compiled, sets)
            us_e = time_graph(layer, sets)
        row = {"T": t, "regime": row_regime(rows_per_expert(t, k, e)), "graphs_so_far": counter.frame_count,
               "rel_err_vs_eager": err, "compiled_us": us_c, "eager_us": us_e}
        rows.append(row)
        print(json.dumps({kk: (round(v, 4) if isinstance(v, float) else v) for kk, v in row.items()}), flush=True)
    code_has_descriptors = any("make_tensor_descriptor" in c for c in codes)
    out = {"meta": {**machine_meta(), "shape": args.shape, "fp8": args.fp8, "seconds": round(time.time() - t0)},
           "graphs": counter.frame_count, "regimes_hit": sorted({r["regime"] for r in rows}),
           "generated_code_makes_descriptors": code_has_descriptors, "rows": rows}
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"compiled_regimes_{datetime.date.today()}{'_fp8' if args.fp8 else ''}.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    print(f"graphs {counter.frame_count} for regimes {out['regimes_hit']}; descriptors in code: {code_has_descriptors}; "
          f"wrote {path} ({time.time() - t0:.0f}s)")


if __name__ == "__main__":
    main()
