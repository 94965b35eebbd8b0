"""Shared experts overlapped with the expert-parallel dispatch, on one GPU: profile and time saved.

A DeepSeek-V3 block on one rank of an EP-8 shard (T tokens, H = 7168, 32 local experts, top-8,
I = 2048, one shared expert of I = 2048), as ``split_ep`` writes it, in two orders:

* **sequential**: ``ep_dispatch`` (send and receive back to back) -> masked experts -> combine, then
  the shared expert;
* **overlapped**: ``ep_dispatch_send`` -> the shared expert -> ``ep_dispatch_recv`` -> masked experts
  -> combine (what ``split_ep`` emits: the shared expert runs while the tokens are in flight, through
  DeepEP's receive hook or the fixed exchange's asynchronous all_gather on NCCL's stream).

Both are captured in CUDA graphs and timed over replays in alternating rounds (median, CUDA events),
for each kernel that runs (DeepEP's low-latency kernels where ``deep_ep`` imports, the sync-free
torch.distributed exchange over NCCL). One replay of each is profiled (``torch.profiler``): the script
reports the *in-flight window* (from the end of the send to the start of the receive) and how much of
the shared expert's GEMM time lies inside it (:func:`in_flight_profile`); ``--traces`` writes the
Chrome traces.

One GPU means an NCCL group of one rank: the send itself moves the tokens (DeepEP: NVSHMEM to its own
GPU; NCCL: a device copy), so nothing is in flight after it and the time saved is about zero there;
the profile shows where the shared expert runs. On several GPUs the saving is up to min(transfer
time, the shared-expert time inside the window). Usage (GPU machine, repo root; DeepEP on
``PYTHONPATH`` for its rows)::

    python bench/ep_overlap.py --out bench/results [--traces]

``--device cpu`` runs the same code on CPU with gloo at a tiny size (a smoke test, no timing claims).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import tempfile

import torch
import torch.distributed as dist
from ep_single_rank import _commit, _time_us  # bench/ is the script's directory: its sibling imports


#: the first kernel of each path's receive: DeepEP's second launch of its dispatch kernel (the receive hook),
#: the fixed exchange's scatter of the gathered block into the masked layout
RECEIVE_KERNEL = {"deepep": "dispatch", "torch_dist_fixed": "permute_kernel"}
#: the shared expert's GEMMs (cuBLAS's nvjet / CUTLASS kernels); the routed experts' ``masked_gemm`` is not one
SHARED_GEMM_WORDS = ("nvjet", "gemm", "cutlass", "sm90", "xmma", "matmul")


def in_flight_profile(events: list[tuple[str, float, float]], receive_word: str) -> dict:
    """What ran while the dispatched tokens were in flight, from one replay's GPU events ``(name, start, end)``
    (µs; kernels and device copies, any stream).

    The window opens when the last event that started before the first shared-expert GEMM ends (the send:
    DeepEP's dispatch launch, or the fixed exchange's pack and all_gather) and closes when the receive's first
    kernel (``receive_word`` in its name) starts after it; no such kernel: the tokens were received before
    the shared expert ran (the sequential order) and the window is empty. Returns the window's width, the
    shared-expert GEMM time inside it, and that GEMM time in all.
    """
    def is_shared(name: str) -> bool:
        low = name.lower()
        return any(w in low for w in SHARED_GEMM_WORDS) and "masked_gemm" not in low

    ev = sorted(events, key=lambda e: e[1])
    shared = [e for e in ev if is_shared(e[0])]
    out = {"window_us": 0.0, "shared_gemm_in_window_us": 0.0, "shared_gemm_us": sum(e[2] - e[1] for e in shared)}
    if not shared:
        return out
    first = shared[0][1]
    before = [e for e in ev if e[1] < first and not is_shared(e[0])]
    if not before:
        return out
    # a collective still running (NCCL's kernel on several ranks) has the tokens in flight: from its start
    opens = max(e[1] if "nccl" in e[0].lower() else e[2] for e in before)
    receive = [e for e in ev if receive_word in e[0] and e[1] >= opens and not is_shared(e[0])]
    if not receive:
        return out
    closes = receive[0][1]
    out["window_us"] = closes - opens
    out["shared_gemm_in_window_us"] = sum(max(0.0, min(e[2], closes) - max(e[1], opens)) for e in shared)
    return out


def _gpu_events(prof) -> list[tuple[str, float, float]]:
    """(name, start µs, end µs) of a profile's GPU kernels and copies."""
    return [(e.name, e.time_range.start, e.time_range.end) for e in prof.events()
            if e.device_type == torch.autograd.DeviceType.CUDA]


def alternate_us(graphs: dict, rounds: int = 7, iters: int = 20) -> dict:
    """Median µs per graph replay of each of ``graphs`` (name -> CUDAGraph), replayed in turns (``rounds``
    rounds of ``iters`` replays each, the order alternating) so that clock and neighbour drift hit both alike;
    also each round's median, for the spread."""
    per_round = {name: [] for name in graphs}
    for r in range(rounds):
        order = list(graphs) if r % 2 == 0 else list(graphs)[::-1]
        for name in order:
            per_round[name].append(_time_us(graphs[name].replay, iters=iters, warmup=3))
    return {name: {"median_us": statistics.median(v), "rounds_us": v} for name, v in per_round.items()}


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
    ap.add_argument("--traces", action="store_true", help="write each replay's Chrome trace beside the results")
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
        graphs = {}
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
                graphs[name] = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graphs[name]):
                    fn(kernel)
        if not cpu:
            from torch.profiler import ProfilerActivity, profile

            for name, timing in alternate_us(graphs).items():
                row[f"{name}_us"], row[f"{name}_rounds_us"] = timing["median_us"], timing["rounds_us"]
            for name, graph in graphs.items():
                with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
                    graph.replay()
                    torch.cuda.synchronize()
                if args.traces:
                    os.makedirs(args.out, exist_ok=True)
                    prof.export_chrome_trace(os.path.join(args.out, f"ep_overlap_{kernel}_{name}.trace.json"))
                row[f"{name}_profile"] = in_flight_profile(_gpu_events(prof), RECEIVE_KERNEL[kernel])
            row["saved_us"] = row["sequential_us"] - row["overlapped_us"]
            row["saved_rounds_us"] = [a - b for a, b in zip(row["sequential_rounds_us"], row["overlapped_rounds_us"])]
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
        f.write("| kernel | sequential µs | overlapped µs | saved µs (per round: min .. max) | in-flight window µs "
                "(overlapped / sequential) | shared-expert GEMM µs inside it (of all) | rel. err |\n"
                "|---|---|---|---|---|---|---|\n")
        for r in rows:
            po, ps = r["overlapped_profile"], r["sequential_profile"]
            f.write(f"| {r['kernel']} | {r['sequential_us']:.1f} | {r['overlapped_us']:.1f} | {r['saved_us']:.1f} "
                    f"({min(r['saved_rounds_us']):.1f} .. {max(r['saved_rounds_us']):.1f}) | {po['window_us']:.1f} / "
                    f"{ps['window_us']:.1f} | {po['shared_gemm_in_window_us']:.1f} ({po['shared_gemm_us']:.1f}) | "
                    f"{r['overlapped_rel_err']:.2e} |\n")
        f.write("\nCUDA-graph replays, the two orders in alternating rounds (7 x 20 replays, median; CUDA events). The "
                "in-flight window: from the end of the send (DeepEP's dispatch launch, the fixed exchange's pack and "
                "all_gather) to the start of the receive (DeepEP's receive hook, the fixed exchange's scatter), from a "
                "profile of one replay. One rank: the transfer is done by the send itself (NVSHMEM to its own GPU, "
                "or NCCL's one-rank all_gather, a device copy), so nothing is in flight and no time can be saved here; "
                "on several GPUs the saving is up to min(transfer time, the shared-expert time inside the window).\n")
    print("wrote", base + ".md")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
