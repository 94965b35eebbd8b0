"""Time the DeepGEMM experts path against its raw GEMMs and the Triton path (one MoE layer, one GPU).

For each shape: the whole layer on DeepGEMM (``moe_fx::experts`` with ``kernel_choice="deepgemm"``, compiled: permute, GEMM1, activation+quant, GEMM2,
combine), the raw DeepGEMM masked GEMMs alone on the same masked layout and loads, and the whole
layer with ``kernel_choice="triton"``. Routing is uniform random top-k. Also measures the dense fp8 matmul rate
(``torch._scaled_mm``, 8192^3) the DeepGEMM rate is compared with.

    python bench/deepgemm_layer.py [--shapes dsv3,qwen3,mixtral] [--tokens 4096] [--out FILE]
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/moe_layer.py's helpers
from moe_layer import allow_many_compiles, salt_compile_cache

SHAPES = {  # name: (E, K, H, I)
    "mixtral": (8, 2, 4096, 14336),
    "qwen3": (128, 8, 2048, 768),
    "dsv3": (32, 8, 7168, 2048),
}


def _bench(fn) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=10, rep=40, return_mode="median") * 1e3  # µs


def fp8_matmul_rate() -> float:
    n = 8192
    a = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn).t()
    one = torch.ones((), device="cuda")
    us = _bench(lambda: torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16))
    return 2 * n**3 / us / 1e6  # TFLOP/s


def run_shape(name: str, t: int, fp8: bool) -> dict:
    import deep_gemm

    from moe_fx.lowering.layouts import empty_mn_major_scales, to_mn_major_tma_aligned
    from moe_fx.lowering.masked_experts.deepgemm import GEMMS, deepgemm_expected_m
    from moe_fx.lowering.problem import rows_per_expert
    from moe_fx.lowering.quant import quantize_fp8_blockwise
    from moe_fx.lowering.triton.permute import permute_to_masked

    e, k, h, i = SHAPES[name]
    g = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(t, h, device="cuda", generator=g).bfloat16()
    scores = torch.rand(t, e, device="cuda", generator=g)
    w, ids = scores.topk(k, dim=-1)
    ids = ids.int()
    w13 = torch.randn(e, 2 * i, h, device="cuda", generator=g, dtype=torch.bfloat16) / h**0.5
    w2 = torch.randn(e, h, i, device="cuda", generator=g, dtype=torch.bfloat16) / i**0.5
    s13 = s2 = None
    if fp8:
        (w13, s13), (w2, s2) = quantize_fp8_blockwise(w13), quantize_fp8_blockwise(w2)
    def layer_fn(kernel):
        # the layer as a compiled model runs it: Inductor's generated code launches the kernels
        return torch.compile(lambda: torch.ops.moe_fx.experts(hidden, ids, w, w13, w2, w13_scale=s13, w2_scale=s2,
                                                              kernel_choice=kernel))

    layer = _bench(layer_fn("deepgemm"))
    tri = _bench(layer_fn("triton"))

    # Raw GEMMs on the same masked layout and loads.
    max_m = GEMMS.rows(t)
    exp_m = deepgemm_expected_m(rows_per_expert(t, k, e), max_m)
    batch = permute_to_masked(hidden, ids, e, max_m, quant_fp8=fp8)
    x, xs, masked_m = batch.x, batch.x_scale, batch.masked_m
    d1 = torch.empty(e, max_m, 2 * i, device="cuda", dtype=torch.bfloat16)
    d2 = torch.empty(e, max_m, h, device="cuda", dtype=torch.bfloat16)
    if fp8:
        xs = to_mn_major_tma_aligned(xs)
        a2 = torch.randn(e, max_m, i, device="cuda").to(torch.float8_e4m3fn)
        a2s = empty_mn_major_scales(e, max_m, i, device="cuda").fill_(1e-2)
        g1 = lambda: deep_gemm.m_grouped_fp8_gemm_nt_masked((x, xs), (w13, s13), d1, masked_m, exp_m)  # noqa: E731
        g2 = lambda: deep_gemm.m_grouped_fp8_gemm_nt_masked((a2, a2s), (w2, s2), d2, masked_m, exp_m)  # noqa: E731
    else:
        a2 = torch.randn(e, max_m, i, device="cuda").bfloat16()
        g1 = lambda: deep_gemm.m_grouped_bf16_gemm_nt_masked(x, w13, d1, masked_m, exp_m)  # noqa: E731
        g2 = lambda: deep_gemm.m_grouped_bf16_gemm_nt_masked(a2, w2, d2, masked_m, exp_m)  # noqa: E731
    t1, t2 = _bench(g1), _bench(g2)
    rows = int(masked_m.sum())
    flops = 2 * rows * (2 * i * h + h * i)
    return dict(
        shape=name, T=t, dtype="fp8" if fp8 else "bf16", layer_us=layer, triton_us=tri,
        gemm1_us=t1, gemm2_us=t2, gemm_tflops=flops / (t1 + t2) / 1e6, layer_tflops=flops / layer / 1e6,
    )  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="dsv3,qwen3,mixtral")
    ap.add_argument("--tokens", default="4096")
    ap.add_argument("--dtypes", default="fp8,bf16")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    allow_many_compiles()  # one lambda compiled per shape, dtype and kernel: past 8 they ran uncompiled
    salt_compile_cache()
    rate = fp8_matmul_rate()
    lines = [
        f"# DeepGEMM experts layer, {torch.cuda.get_device_name()}, torch {torch.__version__}, "
        f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {platform.node()}",
        f"dense fp8 matmul (torch._scaled_mm 8192^3): {rate:.0f} TFLOP/s",
        "",
        "| shape | T | dtype | DeepGEMM layer µs | raw GEMM1+GEMM2 µs | Triton layer µs | speed-up vs Triton "
        "| GEMM TFLOP/s (% of fp8 mm) | layer TFLOP/s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    print("\n".join(lines), flush=True)
    for name in a.shapes.split(","):
        for t in map(int, a.tokens.split(",")):
            for dt in a.dtypes.split(","):
                r = run_shape(name, t, dt == "fp8")
                line = (
                    f"| {name} | {t} | {r['dtype']} | {r['layer_us']:.0f} | {r['gemm1_us']:.0f}+{r['gemm2_us']:.0f} "
                    f"| {r['triton_us']:.0f} | {r['triton_us'] / r['layer_us']:.2f}x "
                    f"| {r['gemm_tflops']:.0f} ({100 * r['gemm_tflops'] / rate:.0f}%) | {r['layer_tflops']:.0f} |"
                )
                lines.append(line)
                print(line, flush=True)
    if a.out:
        with open(a.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
