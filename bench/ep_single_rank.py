"""Expert parallelism with ONE rank on one GPU: DeepEP low-latency vs the torch.distributed backend vs local.

Runs the whole EP path (``moe_fx::ep_dispatch`` -> experts on the masked layout -> ``moe_fx::ep_combine``)
through DeepEP's low-latency kernels with an NCCL process group of size 1 (NVSHMEM over P2P), and
checks it against

* the torch.distributed backend (same ops, ``backend="torch_dist"``; with one rank no collective runs),
* the single-process experts op (:func:`moe_fx.ops.experts_reference`, fp32),
* DeepEP's own round trip: combining the dispatched tokens gives ``x * sum(weights)``.

Then times dispatch + combine at T = 128, H = 7168, K = 8 (E = 32, as one rank of a DeepSeek-V3 EP-8
shard) for DeepEP bf16 / fp8 dispatch, the torch_dist backend, and the local no-EP path (moe_fx's Triton
``permute_to_masked`` + ``unpermute_from_masked``, what ``moe_fx::experts`` does on one GPU), plus the whole layer
with Triton masked GEMMs as experts where available.

Usage (GPU machine, DeepEP built with .ext/build_deepep.sh)::

    PYTHONPATH=.ext/DeepEP python bench/ep_single_rank.py

Writes ``ep_single_rank_<date>.{json,md}`` to ``--out`` (default bench/results).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import tempfile

import torch
import torch.distributed as dist


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _time_us(fn, iters: int = 50, warmup: int = 10) -> float:
    """Median of ``iters`` calls, each timed with CUDA events (microseconds)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) * 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--inter", type=int, default=2048)
    ap.add_argument(
        "--max-tokens",
        type=int,
        default=256,
        help="max_tokens_per_rank (M = this * ranks; 256 keeps DeepGEMM's masked GEMMs eligible)",
    )
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = ap.parse_args()
    t, h, k, e, inter = args.tokens, args.hidden, args.topk, args.experts, args.inter
    mt = args.max_tokens

    torch.cuda.set_device(0)
    store = os.path.join(tempfile.mkdtemp(), "store")
    dist.init_process_group(
        "nccl", init_method=f"file://{store}", rank=0, world_size=1, device_id=torch.device("cuda", 0)
    )
    import moe_fx  # noqa: F401
    from moe_fx.lowering.problem import probe_capabilities
    from moe_fx.ops import experts_reference
    from moe_fx.ops.ep import ep_group_name
    from moe_fx.ops.masked_experts import masked_experts_reference

    g = ep_group_name("default")
    deep_ep_error = probe_capabilities("cuda").deep_ep_error
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "deep_ep": None if deep_ep_error else _deep_ep_version(),
        "deep_ep_error": deep_ep_error,
        "commit": _commit(),
        "shape": {"T": t, "H": h, "K": k, "E": e, "I": inter, "ranks": 1, "max_tokens_per_rank": mt},
    }
    print(json.dumps(meta, indent=1), flush=True)
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(t, h, device=dev, generator=gen).bfloat16()
    scores = torch.randn(t, e, device=dev, generator=gen)
    weights, ids = torch.topk(scores.softmax(-1), k, dim=-1)
    ids[0, -1] = -1  # one empty slot: must contribute nothing
    w13 = (torch.randn(e, 2 * inter, h, device=dev, generator=gen) * h**-0.5).bfloat16()
    w2 = (torch.randn(e, h, inter, device=dev, generator=gen) * inter**-0.5).bfloat16()
    ref = experts_reference(x, ids, weights, w13, w2)
    counts = torch.bincount(ids[ids >= 0].flatten(), minlength=e).int()
    rows: list[dict] = []
    checks: dict[str, object] = {}
    ops = torch.ops.moe_fx

    def ep_path(backend: str, fp8: bool, experts=masked_experts_reference, w=None):
        w13_, w2_, s13, s2 = w if w is not None else (w13, w2, None, None)
        recv_x, recv_scale, masked_m, src_info, layout_range = ops.ep_dispatch(x, ids, e, mt, g, fp8, backend)
        if s13 is None:
            y = experts(recv_x, masked_m, w13_, w2_, "silu", recv_scale if fp8 else None)
        else:
            y = experts(recv_x, masked_m, w13_, w2_, "silu", recv_scale if fp8 else None, s13, s2)
        out = ops.ep_combine(y, ids, weights, src_info, layout_range, e, mt, g, fp8, backend)
        return out, masked_m, recv_x, recv_scale, src_info, layout_range

    backends = ["torch_dist"] + ([] if deep_ep_error else ["deepep"])
    outs = {}
    for backend in backends:
        for fp8 in (False, True):
            name = f"{backend}{'_fp8' if fp8 else ''}"
            out, masked_m, recv_x, _recv_scale, src_info, layout_range = ep_path(backend, fp8)
            torch.cuda.synchronize()
            outs[name] = out
            checks[name] = {
                "masked_m_exact": bool(torch.equal(masked_m.cpu(), counts.cpu())),
                "rel_err_vs_single_process_op": _rel(out, ref),
            }
            # Round trip: combining the dispatched tokens themselves gives x * sum_k w_k.
            if not fp8:
                rt = ops.ep_combine(recv_x.contiguous(), ids, weights, src_info, layout_range, e, mt, g, False, backend)
                want = x.float() * (weights * (ids >= 0)).sum(-1, keepdim=True)
                checks[name]["roundtrip_rel_err"] = _rel(rt, want)
            print(name, checks[name], flush=True)
    for fp8 in ("", "_fp8"):
        if f"deepep{fp8}" in outs:
            checks[f"deepep{fp8}_vs_torch_dist{fp8}_rel_err"] = _rel(outs[f"deepep{fp8}"], outs[f"torch_dist{fp8}"])

    # The whole path with the CUDA kernels of moe_fx::masked_experts (DeepGEMM where it imports and
    # M % 256 == 0, else Triton), bf16 weights and fp8 weights (DeepEP's fp8 tokens go in as they are).
    from moe_fx.lowering.quant import quantize_fp8_blockwise
    from moe_fx.ops import dequantize_blockwise

    q13, s13 = quantize_fp8_blockwise(w13)
    q2, s2 = quantize_fp8_blockwise(w2)
    ref_fp8w = experts_reference(
        x, ids, weights, dequantize_blockwise(q13, s13).bfloat16(), dequantize_blockwise(q2, s2).bfloat16()
    )
    full_paths = {}
    if not deep_ep_error:
        for kernel in ("auto", "triton"):

            def op_experts(xx, mm, a, b, act="silu", xs=None, sa=None, sb=None, kernel=kernel):
                return ops.masked_experts(xx, mm, a, b, act, xs, sa, sb, 16, kernel)

            for fp8 in (False, True):
                name = f"deepep{'_fp8' if fp8 else ''} + masked_experts kernel={kernel}{' fp8 weights' if fp8 else ''}"
                wts = (q13, q2, s13, s2) if fp8 else None
                try:
                    out, *_ = ep_path("deepep", fp8, op_experts, wts)
                    torch.cuda.synchronize()
                    checks[name] = _rel(out, ref_fp8w if fp8 else ref)
                    full_paths[name] = lambda fp8=fp8, f=op_experts, wts=wts: ep_path("deepep", fp8, f, wts)[0]
                except (RuntimeError, ImportError, ValueError) as err:
                    checks[name] = f"failed: {type(err).__name__}: {str(err).splitlines()[0][:300]}"
                print(name, checks[name], flush=True)
    # ---- latency: dispatch + combine (expert outputs precomputed) ----
    y_bf16 = torch.randn(e, mt, h, device=dev).bfloat16()
    for backend in backends:
        for fp8 in (False, True):

            def dc(backend=backend, fp8=fp8):
                r = ops.ep_dispatch(x, ids, e, mt, g, fp8, backend)
                return ops.ep_combine(y_bf16, ids, weights, r[3], r[4], e, mt, g, fp8, backend)

            us = _time_us(dc)
            rows.append({"path": f"{backend} dispatch+combine{' (fp8 dispatch)' if fp8 else ''}", "us": us})
            print(rows[-1], flush=True)
    if not deep_ep_error:
        from moe_fx.lowering.prepare_finalize.deepep_ll import get_buffer

        buf = get_buffer(dist.group.WORLD, max_tokens_per_rank=mt, hidden=h, num_experts=e)
        ids64 = ids.long()
        for fp8 in (False, True):

            def raw(fp8=fp8):
                _recv, _cnt, handle, _, _ = buf.low_latency_dispatch(x, ids64, mt, e, use_fp8=fp8)
                return buf.low_latency_combine(y_bf16, ids64, weights, handle)[0]

            rows.append({"path": f"deep_ep raw Buffer calls{' (fp8 dispatch)' if fp8 else ''}", "us": _time_us(raw)})
            print(rows[-1], flush=True)
    # Where the torch_dist backend's time goes (it is the CPU/gloo fallback; one rank: no collective).
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            r = ops.ep_dispatch(x, ids, e, mt, g, False, "torch_dist")
            ops.ep_combine(y_bf16, ids, weights, r[3], r[4], e, mt, g, False, "torch_dist")
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=12), flush=True)
    local = _local_dispatch_combine(x, ids, weights, e, y_bf16)
    if local is not None:
        rows.append({"path": "local (no EP): Triton permute + unpermute", "us": _time_us(local)})
        print(rows[-1], flush=True)
    for fp8 in (False, True):
        wts = (q13, q2, s13, s2) if fp8 else (w13, w2, None, None)
        rows.append(
            {
                "path": f"local (no EP): whole moe_fx::experts op (kernel auto){', fp8 weights' if fp8 else ''}",
                "us": _time_us(
                    lambda wts=wts: ops.experts(x, ids, weights, wts[0], wts[1], "silu", False, wts[2], wts[3])
                ),
            }
        )
        print(rows[-1], flush=True)
    for name, fn in full_paths.items():
        rows.append({"path": f"EP 1 rank, whole step: {name} + DeepEP combine", "us": _time_us(fn)})
        print(rows[-1], flush=True)

    os.makedirs(args.out, exist_ok=True)
    base = os.path.join(args.out, f"ep_single_rank_{meta['date'][:10]}")
    with open(base + ".json", "w") as f:
        json.dump({"meta": meta, "checks": checks, "latency": rows}, f, indent=1)
    with open(base + ".md", "w") as f:
        f.write(f"# EP with one rank: DeepEP LL vs torch.distributed vs local ({meta['date']})\n\n")
        f.write(
            f"{meta['gpu']}, torch {meta['torch']} (CUDA {meta['cuda']}), deep_ep {meta['deep_ep']}, "
            f"commit {meta['commit']}\n\nShape: {meta['shape']}\n\n## Checks\n\n"
        )
        f.writelines(f"- {key}: {val}\n" for key, val in checks.items())
        f.write("\n## Latency (median of 50 calls, CUDA events)\n\n| path | µs |\n|---|---|\n")
        for r in rows:
            f.write(f"| {r['path']} | {r['us']:.1f} |\n")
    print("wrote", base + ".md")
    dist.destroy_process_group()


def _deep_ep_version() -> str:
    import importlib.metadata

    try:
        return importlib.metadata.version("deep_ep")
    except importlib.metadata.PackageNotFoundError:
        return "d31c72a (2025-08-07, built in place)"


def _commit() -> str:
    try:
        return (
            os.environ.get("MOE_FX_COMMIT")
            or subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True).strip()
        )
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _local_dispatch_combine(x, ids, weights, e, y_bf16):
    try:
        from moe_fx.lowering.triton.permute import permute_to_masked, unpermute_from_masked
    except ImportError:
        return None
    t = x.shape[0]

    y_local = torch.randn(e, t, x.shape[1], device=x.device).bfloat16()  # the local layout has max_m = T

    def run():
        batch = permute_to_masked(x, ids, e, t)
        return unpermute_from_masked(y_local, batch.slot_pos, weights)

    return run


if __name__ == "__main__":
    main()
