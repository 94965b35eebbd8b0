"""CPU expert parallelism with gloo: EP round trip vs the single-process experts op on the same tokens.

Two (``--ranks``) processes on this machine form a gloo group; each holds E / ranks experts and T
tokens. Timed per step (median over ``--iters`` steps, after warm-up), on rank 0:

* ``dispatch+combine``: ``moe_fx::ep_dispatch`` + ``moe_fx::ep_combine`` (torch.distributed backend),
  the expert outputs precomputed;
* ``EP step``: dispatch + ``moe_fx::masked_experts`` (reference) + combine;
* ``single-process experts op``: ``moe_fx::experts`` on the same T tokens with all E experts, in one
  process (no communication), the thing EP replaces;
* ``ep_agree_step``: the per-call agreement on the step's rounds (one host all-reduce);
* ``EP step, 2 rounds``: 2T tokens with ``max_tokens_per_rank = T`` (round 0 + ``ep_remaining_rounds``);
* ``compiled EP layer, EPLB off / on``: a block calling ``moe_fx::experts``, compiled with the moe_fx
  passes (``split_ep``; no Inductor, so the FX graph runs op by op), without and with ``eplb=True``
  (the per-step map and counts).

Usage: ``python bench/ep_gloo_roundtrip.py`` (writes ``ep_gloo_roundtrip_<date>.{json,md}`` to --out).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _median_ms(fn, iters: int, warmup: int = 3, sync=None) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if sync is not None:
            sync()  # start every timed step together on all ranks
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _compiled_layer_ms(x, w13, w2, k, max_tokens, iters, barrier) -> dict:
    """A block calling moe_fx::experts, compiled with the passes (no Inductor), EPLB off and on."""
    from moe_fx.backend import make_backend
    from moe_fx.config import MoEConfig

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.router = torch.nn.Parameter(torch.randn(w13.shape[0], x.shape[1], generator=torch.Generator().manual_seed(5)))
            self.w13, self.w2 = torch.nn.Parameter(w13.clone()), torch.nn.Parameter(w2.clone())

        def forward(self, h):
            weights, ids = torch.topk(torch.softmax(h @ self.router.t(), -1), k, dim=-1)
            return torch.ops.moe_fx.experts(h, ids, weights, self.w13, self.w2)

    out = {}
    for name, eplb in (("compiled_layer_ms", False), ("compiled_layer_eplb_ms", True)):
        torch._dynamo.reset()
        config = MoEConfig(ep_group="default", max_tokens_per_rank=max_tokens, verify="never", eplb=eplb)
        layer = torch.compile(Layer(), backend=make_backend(config, inductor=False), dynamic=False)
        with torch.no_grad():
            out[name] = _median_ms(lambda: layer(x), iters, sync=barrier)
    return out


def _worker(rank: int, world: int, store: str, args: argparse.Namespace, out: str) -> None:
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    import moe_fx  # noqa: F401
    from moe_fx.ops.ep import ep_group_name

    g = ep_group_name("default")
    t, h, inter, e, k = args.tokens, args.hidden, args.inter, args.experts, args.topk
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(t, h, generator=gen)
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])
    w = torch.rand(t, k, generator=gen)
    wgen = torch.Generator().manual_seed(123)
    w13 = torch.randn(e, 2 * inter, h, generator=wgen) * 0.05
    w2 = torch.randn(e, h, inter, generator=wgen) * 0.05
    e_local = e // world
    w13_l, w2_l = w13[rank * e_local : (rank + 1) * e_local], w2[rank * e_local : (rank + 1) * e_local]
    ops = torch.ops.moe_fx
    m = t * world
    y = torch.randn(e_local, m, h)

    def dc():
        r = ops.ep_dispatch(x, ids, e, t, g, False, "torch_dist")
        return ops.ep_combine(y, ids, w, r[3], r[4], e, t, g, False, "torch_dist")

    def step():
        r = ops.ep_dispatch(x, ids, e, t, g, False, "torch_dist")
        yy = ops.masked_experts(r[0], r[2], w13_l, w2_l)
        return ops.ep_combine(yy, ids, w, r[3], r[4], e, t, g, False, "torch_dist")

    x2 = torch.randn(2 * t, h, generator=gen)
    ids2 = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(2 * t)])
    w2_ = torch.rand(2 * t, k, generator=gen)

    def two_rounds():
        ops.ep_agree_step(2 * t, t, g)
        r = ops.ep_dispatch(x2[:t], ids2[:t], e, t, g, False, "torch_dist")
        yy = ops.masked_experts(r[0], r[2], w13_l, w2_l)
        first = ops.ep_combine(yy, ids2[:t], w2_[:t], r[3], r[4], e, t, g, False, "torch_dist")
        return ops.ep_remaining_rounds(first, x2, ids2, w2_, w13_l, w2_l, e, t, g, False, "torch_dist")

    barrier = dist.barrier
    # Correctness of the timed path: EP step equals the single-process op on these tokens.
    err = float((step() - ops.experts(x, ids, w, w13, w2)).abs().max())
    err2 = float((two_rounds() - ops.experts(x2, ids2, w2_, w13, w2)).abs().max())
    res = {
        "dispatch_combine_ms": _median_ms(dc, args.iters, sync=barrier),
        "ep_step_ms": _median_ms(step, args.iters, sync=barrier),
        "max_abs_err_vs_single_process": err,
        "agree_step_ms": _median_ms(lambda: ops.ep_agree_step(t, t, g), args.iters, sync=barrier),
        "two_rounds_ms": _median_ms(two_rounds, args.iters, sync=barrier),
        "two_rounds_max_abs_err": err2,
    }
    res.update(_compiled_layer_ms(x, w13, w2, k, t, args.iters, barrier))
    barrier()
    # The single-process reference, timed while the other ranks wait (one process computing alone).
    if rank == 0:
        res["single_process_experts_ms"] = _median_ms(lambda: ops.experts(x, ids, w, w13, w2), args.iters)
        with open(out, "w") as f:
            json.dump(res, f)
    barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--inter", type=int, default=128)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--topk", type=int, default=2)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = ap.parse_args()
    tmp = tempfile.mkdtemp()
    res_path = os.path.join(tmp, "res.json")
    mp.spawn(_worker, args=(args.ranks, os.path.join(tmp, "store"), args, res_path), nprocs=args.ranks)
    with open(res_path) as f:
        res = json.load(f)
    res["ratio_dispatch_combine_to_single_process"] = res["dispatch_combine_ms"] / res["single_process_experts_ms"]
    res["ratio_ep_step_to_single_process"] = res["ep_step_ms"] / res["single_process_experts_ms"]
    res["ratio_two_rounds_to_two_steps"] = res["two_rounds_ms"] / (2 * res["ep_step_ms"])
    res["ratio_eplb_on_to_off"] = res["compiled_layer_eplb_ms"] / res["compiled_layer_ms"]
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs (shared), {platform.processor() or ''}".strip(", "),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "shape": {
            "ranks": args.ranks,
            "T_per_rank": args.tokens,
            "H": args.hidden,
            "I": args.inter,
            "E": args.experts,
            "K": args.topk,
            "dtype": "float32",
            "threads_per_rank": args.threads,
        },
    }
    print(json.dumps({"meta": meta, "results": res}, indent=1))
    os.makedirs(args.out, exist_ok=True)
    base = os.path.join(args.out, f"ep_gloo_roundtrip_{meta['date'][:10]}")
    with open(base + ".json", "w") as f:
        json.dump({"meta": meta, "results": res}, f, indent=1)
    with open(base + ".md", "w") as f:
        f.write(
            f"# EP on CPU with gloo, {args.ranks} ranks ({meta['date']})\n\n{meta['machine']}, torch {meta['torch']}\n\n"
        )
        f.write(f"Shape: {meta['shape']}\n\n| what (rank 0, median of {args.iters} steps) | ms |\n|---|---|\n")
        f.write(f"| ep_dispatch + ep_combine (torch.distributed, gloo) | {res['dispatch_combine_ms']:.3f} |\n")
        f.write(f"| EP step: dispatch + masked_experts (reference) + combine | {res['ep_step_ms']:.3f} |\n")
        f.write(
            f"| single-process moe_fx::experts, same T tokens, all E experts | {res['single_process_experts_ms']:.3f} |\n"
        )
        f.write(f"| ep_agree_step (the per-call host all-reduce of the rounds) | {res['agree_step_ms']:.3f} |\n")
        f.write(f"| EP step of 2T tokens in 2 rounds (max_tokens_per_rank = T) | {res['two_rounds_ms']:.3f} |\n")
        f.write(f"| compiled EP layer (passes, no Inductor), EPLB off | {res['compiled_layer_ms']:.3f} |\n")
        f.write(f"| compiled EP layer (passes, no Inductor), EPLB on (map + counts) | "
                f"{res['compiled_layer_eplb_ms']:.3f} |\n\n")
        f.write(
            f"Ratio dispatch+combine / single-process op: {res['ratio_dispatch_combine_to_single_process']:.2f}; "
            f"EP step / single-process op: {res['ratio_ep_step_to_single_process']:.2f}. "
            f"Max abs error of the EP step vs the single-process op: {res['max_abs_err_vs_single_process']:.2e} "
            f"(2 rounds: {res['two_rounds_max_abs_err']:.2e}). 2 rounds / 2 one-round steps: "
            f"{res['ratio_two_rounds_to_two_steps']:.2f}; EPLB on / off: {res['ratio_eplb_on_to_off']:.2f}.\n"
        )
    print("wrote", base + ".md")


if __name__ == "__main__":
    main()
