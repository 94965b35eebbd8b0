"""Expert parallelism on a multi-GPU machine, run as it is: ``torchrun --nproc-per-node N bench/ep_multi_gpu.py``.

Every rank builds the same DeepSeek-V3-like MoE block (a softmax top-k router, E routed experts of
H x I, one shared expert), computes its eager output on its own tokens with the full weights, then
compiles the block with ``MoEConfig(ep_group="default")``: ``split_ep`` keeps ``E / N`` experts per
rank and the block runs dispatch -> masked experts -> combine over the group, the shared expert
between dispatch's send and receive. Per configuration and per-rank token count T it reports

* correctness: the relative error of each rank's output against its eager output (max over ranks);
* latency: the median of 20 steps, CUDA events, the slowest rank, for Inductor's default mode and
  for ``mode="reduce-overhead"`` (CUDA graphs; decode sizes only: one round);
* a step larger than ``max_tokens_per_rank`` (prefill): it runs in rounds every rank agrees on;
* EPLB with one redundant slot per rank under a router skewed towards a few experts: the most loaded
  rank's share before and after ``moe_fx.rebalance_experts()``, the rebalance's time, and the step
  time with EPLB's per-step map and counts against without.

EP kernels: whatever ``auto`` picks (DeepEP's low-latency kernels where ``deep_ep`` imports and the
hidden size is compiled into them, else the sync-free fixed-size exchange on NCCL); the log says which.
Rank 0 writes ``ep_multi_gpu_<date>.{json,md}`` to ``--out``. ``--device cpu`` runs a tiny version on
gloo (``torchrun --nproc-per-node 2 bench/ep_multi_gpu.py --device cpu``): a smoke test, no timings.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from ep_single_rank import _commit  # bench/ is the script's directory: its sibling imports
from torch import nn


class Block(nn.Module):
    """Router + routed experts (``moe_fx::experts``) + a shared expert, DeepSeek style."""

    def __init__(self, hidden: int, inter: int, experts: int, top_k: int, skew: float, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        g = torch.Generator(device=device).manual_seed(0)  # the same weights on every rank

        def rand(*shape, scale):
            return nn.Parameter((torch.randn(*shape, device=device, generator=g) * scale).to(dtype))

        self.top_k = top_k
        self.router = rand(experts, hidden, scale=hidden**-0.5)
        bias = torch.zeros(experts, device=device)
        bias[: max(1, experts // 16)] = skew  # a few hot experts (EPLB's case)
        self.router_bias = nn.Parameter(bias.to(dtype))
        self.w13 = rand(experts, 2 * inter, hidden, scale=hidden**-0.5)
        self.w2 = rand(experts, hidden, inter, scale=inter**-0.5)
        self.shared_up = rand(2 * inter, hidden, scale=hidden**-0.5)
        self.shared_down = rand(hidden, inter, scale=inter**-0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = F.softmax(F.linear(x, self.router, self.router_bias), dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        routed = torch.ops.moe_fx.experts(x, ids, weights, self.w13, self.w2)
        gate, up = F.linear(x, self.shared_up).chunk(2, dim=-1)
        return routed + F.linear(F.silu(gate) * up, self.shared_down)


def _step_ms(fn, x, cuda: bool, iters: int = 20) -> float:
    """Median time of ``fn(x)`` in ms (CUDA events on a GPU), ranks started together."""
    with torch.no_grad():
        for _ in range(3):
            fn(x)
        times = []
        for _ in range(iters):
            dist.barrier()
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn(x)
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fn(x)
                times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


def _slowest(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--inter", type=int, default=2048)
    ap.add_argument("--experts-per-rank", type=int, default=32)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128, help="MoEConfig.max_tokens_per_rank")
    ap.add_argument("--decode", default="1,16,64,128", help="tokens per rank of the decode steps")
    ap.add_argument("--prefill", type=int, default=2048, help="tokens per rank of one step larger than max_tokens")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = ap.parse_args()
    cuda = args.device == "cuda"
    if not cuda:  # smoke sizes
        args.hidden, args.inter, args.experts_per_rank, args.topk, args.max_tokens = 64, 32, 2, 2, 8
        args.decode, args.prefill = "1,8", 20
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    if cuda:
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local))
        device = torch.device("cuda", local)
    else:
        dist.init_process_group("gloo")
        device = torch.device("cpu")
    import moe_fx
    from moe_fx.backend import make_backend
    from moe_fx.config import MoEConfig
    from moe_fx.passes.eplb import rank_loads

    dtype = torch.bfloat16 if cuda else torch.float32
    experts = args.experts_per_rank * world
    decode = [int(v) for v in args.decode.split(",")]
    steps = decode + [args.prefill]
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name() if cuda else platform.processor() or "cpu", "ranks": world,
        "torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
        "commit": _commit(),
        "shape": {"H": args.hidden, "I": args.inter, "E": experts, "K": args.topk, "dtype": str(dtype),
                  "max_tokens_per_rank": args.max_tokens},
    }
    rows: list[dict] = []

    def inputs(t: int) -> torch.Tensor:
        g = torch.Generator(device=device).manual_seed(1000 * t + rank)
        return torch.randn(t, args.hidden, device=device, generator=g).to(dtype)

    for label, eplb, skew in (("EP", False, 0.0), ("EP, skewed router", False, 4.0), ("EP + EPLB, skewed router", True, 4.0)):
        for mode in ("default", "reduce-overhead") if cuda else ("default",):
            torch._dynamo.reset()
            block = Block(args.hidden, args.inter, experts, args.topk, skew, dtype, device).eval()
            with torch.no_grad():
                want = {t: block(inputs(t)) for t in steps}
            config = MoEConfig(ep_group="default", max_tokens_per_rank=args.max_tokens, verify="never", eplb=eplb,
                               eplb_redundant_slots=1 if eplb else 0)
            compiled = torch.compile(block, backend=make_backend(config), dynamic=False,
                                     mode=None if mode == "default" else mode)
            for t in steps:
                if mode == "reduce-overhead" and t > args.max_tokens:
                    continue  # more than one round cannot be replayed from a CUDA graph
                x = inputs(t)
                with torch.no_grad():
                    err = _rel(compiled(x), want[t])
                ms = _step_ms(compiled, x, cuda)
                row = {"config": label, "mode": mode, "T_per_rank": t, "rounds": -(-t // args.max_tokens),
                       "ms": _slowest(ms), "rel_err": _slowest(err)}
                rows.append(row)
                if rank == 0:
                    print(json.dumps(row), flush=True)
            if eplb and mode == "default":
                from moe_fx.passes.eplb import layers_of

                layer = layers_of()[0]
                before = list(layer.phys_to_log)
                dist.barrier()
                t0 = time.perf_counter()
                report = moe_fx.rebalance_experts()
                rebalance_ms = 1e3 * (time.perf_counter() - t0)
                ((_, rep),) = report.items()
                load = rep["load"]
                mean = sum(load) / world
                x = inputs(decode[-1])
                with torch.no_grad():
                    err = _rel(compiled(x), want[decode[-1]])
                row = {"config": label, "mode": mode, "rebalance_ms": _slowest(rebalance_ms), "moved": rep["moved"],
                       "max_rank_share_before": max(rank_loads(load, before, world)) / max(mean, 1e-9),
                       "max_rank_share_after": max(rank_loads(load, rep["placement"], world)) / max(mean, 1e-9),
                       "rel_err_after": _slowest(err), "T_per_rank": decode[-1],
                       "ms_after": _slowest(_step_ms(compiled, x, cuda))}
                rows.append(row)
                if rank == 0:
                    print(json.dumps(row), flush=True)
    if rank == 0 and cuda:
        os.makedirs(args.out, exist_ok=True)
        base = os.path.join(args.out, f"ep_multi_gpu_{meta['date'][:10]}")
        with open(base + ".json", "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
        with open(base + ".md", "w") as f:
            f.write(f"# Expert parallelism on {world} GPUs ({meta['date']})\n\n{meta['device']}, torch {meta['torch']} "
                    f"(CUDA {meta['cuda']}), commit {meta['commit']}\n\nShape: {meta['shape']}\n\n")
            f.write("| config | mode | T per rank | rounds | ms (slowest rank) | rel. err |\n|---|---|---|---|---|---|\n")
            for r in rows:
                if "ms" in r:
                    f.write(f"| {r['config']} | {r['mode']} | {r['T_per_rank']} | {r['rounds']} | {r['ms']:.3f} | "
                            f"{r['rel_err']:.2e} |\n")
            for r in rows:
                if "rebalance_ms" in r:
                    f.write(f"\nEPLB rebalance: {r['rebalance_ms']:.1f} ms, {r['moved']} expert copies moved; most "
                            f"loaded rank {r['max_rank_share_before']:.2f}x the mean before, "
                            f"{r['max_rank_share_after']:.2f}x after; step at T={r['T_per_rank']} "
                            f"{r['ms_after']:.3f} ms after (rel. err {r['rel_err_after']:.2e})\n")
        print("wrote", base + ".md")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
