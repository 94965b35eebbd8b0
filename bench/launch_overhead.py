"""Host-side cost of one moe_fx experts call at decode size (what CUDA graphs remove).

Times, at T=1 for each shape, the wall time per call of back-to-back calls (the GPU work is tiny,
so the host is the bottleneck) for: the op under ``torch.compile`` (what a rewritten model runs:
Inductor's generated code launches the kernels), the op called eagerly (dispatcher, input checks,
kernel choice, launches), an empty Triton kernel launch, and a small torch op; then prints a
cProfile of the eager op's calls (top functions by own time).

    python bench/launch_overhead.py [--shapes qwen3,mixtral] [--calls 300] [--out FILE]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from moe_layer import SHAPES, routing_sets  # noqa: E402


def _empty_kernel():
    """A Triton kernel that does nothing, with 11 arguments (Triton's own launch cost)."""
    import triton
    import triton.language as tl

    @triton.jit
    def empty(x_ptr, a, b, c, d, e, f, g, h, i, j, BLOCK: tl.constexpr):
        pass

    empty.fn.__globals__["tl"] = tl  # the JIT resolves annotations in the function's globals
    return empty


def _has_deep_gemm() -> bool:
    try:
        import deep_gemm  # noqa: F401
    except ImportError:
        return False
    return True


def per_call_us(fn, calls: int) -> float:
    """Median over 3 rounds of wall µs per call, ``calls`` calls per round, synchronised at the ends."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    rounds = []
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        rounds.append((time.perf_counter() - t0) / calls * 1e6)
    return sorted(rounds)[1]


def _op_costs(shape: str, name: str, kernel: str, ws: tuple, hidden, ids, w, calls: int) -> list[str]:
    """Host cost per call of torch.ops.moe_fx.experts(kernel_choice=...): plain, as a CUDA-graph replay, and a cProfile."""

    def op():
        return torch.ops.moe_fx.experts(hidden, ids, w, ws[0], ws[1], w13_scale=ws[2], w2_scale=ws[3], kernel_choice=kernel)

    graph = torch.cuda.CUDAGraph()
    op()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        op()
    out = [
        f"{shape} T=1 {name} kernel={kernel}: torch.ops.moe_fx.experts {per_call_us(op, calls):.1f} us/call, "
        f"CUDA-graph replay {per_call_us(graph.replay, calls):.1f} us/call"
    ]
    print(out[-1], flush=True)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(100):
        op()
    prof.disable()
    torch.cuda.synchronize()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(18)
    out.append(f"cProfile, 100 calls, {shape} {name} kernel={kernel}:\n" + buf.getvalue()[-4000:])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shapes", default="qwen3")
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import triton

    import moe_fx  # noqa: F401  (registers the op and its kernels)
    from moe_fx.lowering.quant import quantize_fp8_blockwise

    _empty = _empty_kernel()

    lines = [
        f"# Host cost per call, {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}"
    ]
    x = torch.empty(16, device="cuda")
    empty_us = per_call_us(lambda: _empty[(1,)](x, *range(1, 11), BLOCK=16), args.calls)
    lines.append(f"empty triton kernel, 11 args: {empty_us:.1f} us")
    lines.append(f"torch.empty(16): {per_call_us(lambda: torch.empty(16, device='cuda'), args.calls):.1f} us")
    for shape in args.shapes.split(","):
        _, e, k, h, i = SHAPES[shape]
        w13 = torch.randn(e, 2 * i, h, device="cuda", dtype=torch.bfloat16) / h**0.5
        w2 = torch.randn(e, h, i, device="cuda", dtype=torch.bfloat16) / i**0.5
        q13, s13 = quantize_fp8_blockwise(w13)
        q2, s2 = quantize_fp8_blockwise(w2)
        hidden, ids, w = routing_sets(1, e, k, h, 1)[0]
        kernels = ["triton"] + (["deepgemm"] if _has_deep_gemm() else [])
        for name, ws in (("bf16", (w13, w2, None, None)), ("fp8", (q13, q2, s13, s2))):

            for kernel in kernels:

                def layer(hidden, ids, w, ws=ws, kernel=kernel):
                    return torch.ops.moe_fx.experts(hidden, ids, w, ws[0], ws[1], w13_scale=ws[2], w2_scale=ws[3],
                                                    kernel_choice=kernel)

                compiled = torch.compile(layer, fullgraph=True)
                lines.append(
                    f"{shape} T=1 {name} kernel={kernel}: compiled (Inductor launches) "
                    f"{per_call_us(lambda c=compiled: c(hidden, ids, w), args.calls):.1f} us/call"
                )
                print(lines[-1], flush=True)
                lines += _op_costs(shape, name, kernel, ws, hidden, ids, w, args.calls)
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
