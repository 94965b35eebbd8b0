"""Shared experts overlapped with the expert-parallel dispatch, on one GPU: profile and time saved.

A DeepSeek-V3 block on one rank of an EP-8 shard (T tokens, H = 7168, 32 local experts, top-8,
I = 2048, one shared expert of I = 2048), as ``split_ep`` writes it, in two orders:

* **sequential**: ``ep_dispatch`` (send and receive back to back) -> masked experts -> combine, then
  the shared expert;
* **overlapped**: ``ep_dispatch_send`` -> the shared expert -> ``ep_dispatch_recv`` -> masked experts
  -> combine (what ``split_ep`` emits: the shared expert runs while the tokens are in flight, through
  DeepEP's receive hook or the fixed exchange's asynchronous all_gather on NCCL's stream).

Both are captured in CUDA graphs and timed over replays (median, CUDA events), for each kernel that
runs (DeepEP's low-latency kernels where ``deep_ep`` imports, the sync-free torch.distributed exchange
over NCCL). One replay of each is profiled (``torch.profiler``): the script reports how long the
communication kernels ran concurrently with the shared expert's GEMMs, and writes the Chrome traces.

One GPU means an NCCL group of one rank: the transfer is a local copy (DeepEP: NVSHMEM to itself),
so the time saved here is a lower bound of what several GPUs see. Usage (GPU machine, repo root; DeepEP
on ``PYTHONPATH`` for its rows)::

    python bench/ep_overlap.py --out bench/results

``--device cpu`` runs the same code on CPU with gloo at a tiny size (a smoke test, no timing claims).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import tempfile

import torch
import torch.distributed as dist
from ep_single_rank import _commit, _time_us  # bench/ is the script's directory: its sibling imports


def _concurrency_us(prof, comm_words: tuple[str, ...], compute_words: tuple[str, ...]) -> dict:
    """Time (µs) the communication kernels ran while a shared-expert GEMM ran, from a profile's GPU events.

    Shared-expert GEMMs are cuBLAS's (``nvjet`` / CUTLASS names); the routed experts' are moe_fx's
    ``masked_gemm`` Triton kernels, left out.
    """
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]

    def spans(words):
        return [(e.time_range.start, e.time_range.end) for e in kernels
                if any(w in e.name.lower() for w in words) and "masked_gemm" not in e.name]

    comm, compute = spans(comm_words), spans(compute_words)
    overlap = sum(max(0, min(a1, b1) - max(a0, b0)) for a0, a1 in comm for b0, b1 in compute)
    return {"comm_us": sum(b - a for a, b in comm), "shared_gemm_us": sum(b - a for a, b in compute),
            "concurrent_us": overlap, "comm_kernels": sorted({e.name for e in kernels
                                                               if any(w in e.name.lower() for w in comm_words)})[:6]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--inter", type=int, default=2048)
    ap.add_argument("--shared-inter", type=int, default=2048)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = ap.parse_args()
    cpu = args.device == "cpu"
    if cpu:  # smoke sizes
        args.tokens, args.hidden, args.experts, args.topk, args.inter, args.shared_inter = 8, 128, 4, 2, 32, 32
        args.max_tokens = 8
    t, h, e, k, inter, si, mt = (args.tokens, args.hidden, args.experts, args.topk, args.inter, args.shared_inter,
                                 args.max_tokens)
    store = os.path.join(tempfile.mkdtemp(), "store")
    if cpu:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    else:
        torch.cuda.set_device(0)
        dist.init_process_group("nccl", init_method=f"file://{store}", rank=0, world_size=1,
                                device_id=torch.device("cuda", 0))
    import moe_fx  # noqa: F401
    from moe_fx.lowering.problem import probe_capabilities
    from moe_fx.ops import experts_reference
    from moe_fx.ops.ep import ep_group_name

    ops = torch.ops.moe_fx
    g = ep_group_name("default")
    dev = torch.device(args.device)
    dtype = torch.float32 if cpu else torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(t, h, device=dev, generator=gen).to(dtype)
    weights, ids = torch.topk(torch.randn(t, e, device=dev, generator=gen).softmax(-1), k, dim=-1)
    w13 = (torch.randn(e, 2 * inter, h, device=dev, generator=gen) * h**-0.5).to(dtype)
    w2 = (torch.randn(e, h, inter, device=dev, generator=gen) * inter**-0.5).to(dtype)
    s_up = (torch.randn(2 * si, h, device=dev, generator=gen) * h**-0.5).to(dtype)
    s_down = (torch.randn(h, si, device=dev, generator=gen) * si**-0.5).to(dtype)

    def shared() -> torch.Tensor:
        gate, up = torch.nn.functional.linear(x, s_up).chunk(2, dim=-1)
        return torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, s_down)

    def routed(parts, kernel) -> torch.Tensor:
        recv_x, _scale, masked_m, src_info, layout_range = parts
        y = ops.masked_experts(recv_x, masked_m, w13, w2, "silu", None, None, None, 16, "auto")
        out0 = ops.ep_combine(y, ids, weights, src_info, layout_range, e, mt, g, False, kernel)
        return ops.ep_remaining_rounds(out0, x, ids, weights, w13, w2, e, mt, g, False, kernel)

    def sequential(kernel) -> torch.Tensor:
        out = routed(ops.ep_dispatch(x, ids, e, mt, g, False, kernel), kernel)
        return out + shared()

    def overlapped(kernel) -> torch.Tensor:
        ticket = ops.ep_dispatch_send(x, ids, e, mt, g, False, kernel)
        side = shared()  # while the tokens are in flight
        return routed(ops.ep_dispatch_recv(ticket, x, e, mt, g, False, kernel), kernel) + side

    ops.ep_agree_step(t, mt, g)
    want = experts_reference(x, ids, weights, w13, w2).float() + shared().float()
    deep_ep_error = probe_capabilities(args.device).deep_ep_error
    kernels = ["torch_dist_fixed"] + ([] if deep_ep_error or cpu else ["deepep"])
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name() if not cpu else platform.processor() or "cpu",
        "torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
        "deep_ep_error": deep_ep_error, "commit": _commit(),
        "shape": {"T": t, "H": h, "E_local": e, "K": k, "I": inter, "I_shared": si, "max_tokens_per_rank": mt,
                  "ranks": 1, "dtype": str(dtype)},
    }
    print(json.dumps(meta, indent=1), flush=True)
    rows = []
    for kernel in kernels:
        row = {"kernel": kernel}
        for name, fn in (("sequential", sequential), ("overlapped", overlapped)):
            with torch.no_grad():
                out = fn(kernel)
                row[f"{name}_rel_err"] = float((out.float() - want).norm() / want.norm())
                if cpu:
                    continue
                stream = torch.cuda.Stream()
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    for _ in range(3):
                        fn(kernel)
                torch.cuda.current_stream().wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    fn(kernel)
                row[f"{name}_us"] = _time_us(graph.replay)
                from torch.profiler import ProfilerActivity, profile

                with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
                    graph.replay()
                    torch.cuda.synchronize()
                os.makedirs(args.out, exist_ok=True)
                prof.export_chrome_trace(os.path.join(args.out, f"ep_overlap_{kernel}_{name}.trace.json"))
                row[f"{name}_profile"] = _concurrency_us(prof, ("nccl", "dispatch", "deep_ep", "internode", "intranode"),
                                                         ("nvjet", "gemm", "cutlass", "sm90", "xmma", "matmul"))
        if not cpu:
            row["saved_us"] = row["sequential_us"] - row["overlapped_us"]
        rows.append(row)
        print(json.dumps(row, indent=1), flush=True)
    if cpu:
        print("smoke run on CPU: no timings recorded")
        dist.destroy_process_group()
        return
    os.makedirs(args.out, exist_ok=True)
    base = os.path.join(args.out, f"ep_overlap_{meta['date'][:10]}")
    with open(base + ".json", "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    with open(base + ".md", "w") as f:
        f.write(f"# Shared expert overlapped with the EP dispatch, one GPU ({meta['date']})\n\n")
        f.write(f"{meta['device']}, torch {meta['torch']} (CUDA {meta['cuda']}), commit {meta['commit']}; "
                f"DeepEP: {deep_ep_error or 'yes'}\n\nShape: {meta['shape']}\n\n")
        f.write("| kernel | sequential µs | overlapped µs | saved µs | comm kernels concurrent with the shared "
                "GEMMs (µs, overlapped / sequential) | rel. err |\n|---|---|---|---|---|---|\n")
        for r in rows:
            f.write(f"| {r['kernel']} | {r['sequential_us']:.1f} | {r['overlapped_us']:.1f} | {r['saved_us']:.1f} | "
                    f"{r['overlapped_profile']['concurrent_us']:.1f} / {r['sequential_profile']['concurrent_us']:.1f} | "
                    f"{r['overlapped_rel_err']:.2e} |\n")
        f.write("\nCUDA-graph replays, median of 50 (CUDA events). Chrome traces: ep_overlap_<kernel>_<order>.trace.json. "
                "One rank: the transfer is a local copy, a lower bound of the overlap several GPUs get.\n")
    print("wrote", base + ".md")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
