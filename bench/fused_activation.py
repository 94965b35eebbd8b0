"""One MoE layer on one GPU, a switch of the sorted-layout pipeline on against off (Triton):

* ``--switch epilogue`` (default): GEMM1 with the activation in its epilogue vs the separate activation kernel
  (``moe_fx.lowering.masked_experts.pipeline.FUSE_ACTIVATION``), bf16 weights;
* ``--switch sort_quant``: fp8 weights at decode sizes, the tokens quantised in the sort's launch vs in a launch of
  their own (``pipeline.QUANTIZE_TOKENS_IN_SORT``);
* ``--switch w8a16``: fp8 weights (128x128 blocks) with bf16 activations at decode sizes (W8A16: the GEMMs
  dequantise the weight tiles, GEMM1 applies the activation) vs activations quantised 1x128 as at prefill
  (``pipeline.W8A16_MAX_ROWS`` 16 vs 0);
* ``--switch fp8_scales``: fp8 weights, the GEMMs' scales loaded one k step ahead vs in the step that uses them
  (``moe_fx.lowering.triton.grouped_gemm.PREFETCH_FP8_SCALES``), at any T;
* ``--switch pair_halves``: bf16 weights, gate/up halves in GEMM1's epilogue as one tile of gate and up rows vs
  two accumulators (``moe_fx.lowering.triton.grouped_gemm.PAIR_GATE_UP``);
* ``--switch slot_rows``: bf16 weights, one token's rows in slot order without the sort vs sorted
  (``pipeline.SLOT_ROWS_MAX_TOKENS`` 1 vs 0): only T=1 differs;
* ``--switch slot_down``: bf16 weights, one token's GEMM2 and combine in one launch vs two
  (``pipeline.SLOT_DOWN_COMBINE`` True vs False): only T=1 differs;
* ``--switch bitonic_sort``: bf16 weights, the one-launch sort's program 0 sorting up to 1024 slots by a bitonic
  network vs blocks of pairwise ranks (``moe_fx.lowering.triton.sort.BITONIC_SORT_SLOTS`` 1024 vs 0): T * K
  between the pairwise tile (128 slots at 128 experts) and 1024 differs;
* ``--switch scale_scratch`` (DeepGEMM): fp8 weights, the aligned contiguous layout's copy writing its scales to a
  row-major scratch moved by ``copy_scales`` vs straight into DeepGEMM's MN-major layout
  (``moe_fx.lowering.triton.sort.SCALE_SCRATCH``): above 256 rows per expert, where ``auto`` takes that layout;
* ``--switch dg_hint`` (DeepGEMM): fp8 weights, DeepGEMM's ``expected_m`` hint with 64 rows of slack (``--on``
  for another) vs the uniform-load estimate (``moe_fx.lowering.masked_experts.deepgemm.EXPECTED_M_SLACK``):
  the masked layout's GEMMs, from 65 to 256 rows per expert under ``auto``.

For each shape and token count T, ``torch.ops.moe_fx.experts(kernel_choice="triton")`` (``"auto"`` for the
DeepGEMM switches, which stop when DeepGEMM is not usable) is captured in CUDA graphs twice (switch on / off:
the switch is read when a call runs, so each capture launches its own kernels), over the same rotating routing sets, and the two are timed alternately in rounds (medians of
``triton.testing.do_bench`` over replays). Each row also gives the floor ``max(bytes / copy rate, flops /
matmul rate)`` with both limits measured in the same run, and the relative error of each variant against the
fp32 reference (first routing set of the row), and of one variant against the other at every T.

    python bench/fused_activation.py [--switch epilogue|sort_quant|w8a16|fp8_scales|pair_halves|slot_rows|slot_down|bitonic_sort|scale_scratch|dg_hint] [--shapes qwen3,mixtral,gpt_oss]
                                     [--tokens 1,16,256,1024,4096] [--rounds 3]
    python bench/fused_activation.py --smoke   # CPU, Triton interpreter, tiny shapes: checks the script end to end

Writes ``fused_activation_<date>[_tag].{md,json}`` (``<switch>_<date>...`` for the other switches) to ``--out`` (default
bench/results; smoke: a temp folder).
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from moe_layer import (
    GPT_OSS_ACT,
    SHAPES,
    apply_settings,
    bench_meta,
    capture_graphs,
    replay_us,
    replayed_outputs,
    results_stem,
    routing_sets,
    row_metrics,
)

SETS = 3
#: --smoke: tiny layers of the same forms (E, K, H, I as in SHAPES), run on CPU under the interpreter
SMOKE_SHAPES = {"qwen3": ("qwen3_moe", 4, 2, 128, 64), "gpt_oss": ("gpt_oss", 4, 2, 128, 72)}


def layer(shape: str, dims: tuple, device: str, seed: int = 0, fp8: bool = False,
          kernel_choice: str = "triton") -> tuple[dict, dict]:
    """(weights, op keyword arguments) of one bf16 layer (GPT-OSS: biases, interleaved clamped SwiGLU);
    ``fp8``: the weights quantised to e4m3 with 128x128 block scales (``w13_scale``, ``w2_scale``)."""
    _, e, _, h, i = dims
    g = torch.Generator(device=device).manual_seed(seed)
    w = {"w13": torch.randn(e, 2 * i, h, device=device, generator=g, dtype=torch.bfloat16) / h**0.5,
         "w2": torch.randn(e, h, i, device=device, generator=g, dtype=torch.bfloat16) / i**0.5}
    kw: dict = {"kernel_choice": kernel_choice}
    if shape == "gpt_oss":
        kw.update(GPT_OSS_ACT)
        kw["w13_bias"] = 0.1 * torch.randn(e, 2 * i, device=device, generator=g, dtype=torch.bfloat16)
        kw["w2_bias"] = 0.1 * torch.randn(e, h, device=device, generator=g, dtype=torch.bfloat16)
    if fp8:
        from moe_fx.lowering.quant import quantize_fp8_blockwise

        w["w13"], kw["w13_scale"] = quantize_fp8_blockwise(w["w13"])
        w["w2"], kw["w2_scale"] = quantize_fp8_blockwise(w["w2"])
    return w, kw


#: the switches this bench times: name -> (module attribute under moe_fx.lowering, value on, value off, fp8 weights,
#: title)
SWITCHES = {
    "epilogue": ("masked_experts.pipeline.FUSE_ACTIVATION", True, False, False,
                 "GEMM1 with the activation in its epilogue (on) vs the separate activation kernel (off), bf16"),
    "sort_quant": ("masked_experts.pipeline.QUANTIZE_TOKENS_IN_SORT", True, False, True,
                   ("fp8 weights at decode sizes: the tokens quantised by programs of the sort's launch (on) vs by "
                    "a launch of their own (off)")),
    "w8a16": ("masked_experts.pipeline.W8A16_MAX_ROWS", 16, 0, True,
              ("fp8 weights: bf16 activations up to the switch's value of rows per expert (on, W8A16; 16 unless "
               "--on says) vs activations quantised 1x128 at every size (off, W8A8)")),
    "fp8_scales": ("triton.grouped_gemm.PREFETCH_FP8_SCALES", True, False, True,
                   ("fp8 GEMMs: each k step's scales loaded one step ahead (on) vs in the step that uses them (off)")),
    "pair_halves": ("triton.grouped_gemm.PAIR_GATE_UP", True, False, False,
                    ("gate/up halves in GEMM1's epilogue as one tile of gate and up rows (on) vs two accumulators of "
                     "half the tile (off), bf16 (rows per expert up to 64, where halves take the epilogue)")),
    "bitonic_sort": ("triton.sort.BITONIC_SORT_SLOTS", 1024, 0, False,
                     ("decode-sized sort: program 0 sorts up to 1024 slots by a bitonic network (on) vs blocks of "
                      "pairwise ranks (off), bf16 (T * K from 129 to 1024 slots at 128 experts)")),
    "slot_rows": ("masked_experts.pipeline.SLOT_ROWS_MAX_TOKENS", 1, 0, False,
                  ("one token: rows in slot order, no sort launch (on) vs sorted rows (off), bf16 (T=1 rows only "
                   "differ)")),
    "slot_down": ("masked_experts.pipeline.SLOT_DOWN_COMBINE", True, False, False,
                  ("one token: GEMM2 and the combine in one launch (on) vs GEMM2, then the combine kernel (off), bf16 "
                   "(T=1 rows only differ)")),
    "scale_scratch": ("triton.sort.SCALE_SCRATCH", True, False, True,
                      ("fp8 weights, DeepGEMM's aligned contiguous layout: the copy's scales through a row-major "
                       "scratch and `copy_scales` (on) vs stored straight into the MN-major layout (off) (above 256 "
                       "rows per expert only)")),
    "dg_hint": ("masked_experts.deepgemm.EXPECTED_M_SLACK", 64, 0, True,
                ("fp8 weights, DeepGEMM's masked GEMMs: `expected_m` with rows of slack (on) vs the uniform-load "
                 "estimate (off) (from 65 to 256 rows per expert only)")),
}
#: the switches of DeepGEMM's path: the op runs under kernel_choice="auto", and the run stops without DeepGEMM
DEEPGEMM_SWITCHES = ("scale_scratch", "dg_hint")


def kernel_choice_of(switch: str) -> str:
    """The op's ``kernel_choice`` for ``switch``'s run: ``"auto"`` on DeepGEMM's path, else ``"triton"``."""
    return "auto" if switch in DEEPGEMM_SWITCHES else "triton"


def variant(switch: str, on: bool, w: dict, kw: dict, on_value: object = None):
    """``fn(hidden, ids, weights)``: the op with ``switch`` on or off while it runs (and while captured); ``on_value``
    replaces the switch's value on the 'on' side."""
    import importlib

    path, value_on, value_off = SWITCHES[switch][:3]
    value_on = value_on if on_value is None else on_value
    module, attr = path.rsplit(".", 1)
    module = importlib.import_module(f"moe_fx.lowering.{module}")

    def fn(x, ids, rw):
        saved = getattr(module, attr)
        setattr(module, attr, value_on if on else value_off)
        try:
            return torch.ops.moe_fx.experts(x, ids, rw, w["w13"], w["w2"], **kw)
        finally:
            setattr(module, attr, saved)

    return fn


class _Call:
    """A plain call standing in for a CUDA graph (--smoke, on CPU)."""

    def __init__(self, fn, args):
        self.fn, self.args = fn, args

    def replay(self):
        return self.fn(*self.args)


def graphs_of(fn, sets) -> tuple[list, list]:
    """CUDA graphs of ``fn`` on each set and their outputs (:func:`moe_layer.capture_graphs`); CPU: plain calls."""
    if sets[0][0].device.type == "cuda":
        return capture_graphs(fn, sets)
    return [_Call(fn, s) for s in sets], [fn(*s) for s in sets]


def time_us(graphs: list) -> float:
    """Median µs of one replay, in rotation (:func:`moe_layer.replay_us`); CPU: the mean of one pass over them."""
    if not isinstance(graphs[0], _Call):
        return replay_us(graphs)
    t0 = time.perf_counter()
    for gr in graphs:
        gr.replay()
    return (time.perf_counter() - t0) / len(graphs) * 1e6


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative Frobenius error of ``a`` against ``b``, in fp32."""
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (``argv``, default ``sys.argv[1:]``) as parsed arguments."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--switch", choices=sorted(SWITCHES), default="epilogue")
    ap.add_argument("--shapes", default="qwen3,mixtral,gpt_oss")
    ap.add_argument("--tokens", default=None, help="comma list of T (default 1,16,256,1024,4096; smoke 1,8)")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds per cell")
    ap.add_argument("--out", default=None, help="results folder (default bench/results; smoke: a temp folder)")
    ap.add_argument("--tag", default="")
    ap.add_argument("--smoke", action="store_true", help="CPU, Triton interpreter, tiny qwen3/gpt_oss forms")
    ap.add_argument("--on", default=None, metavar="VALUE",
                    help="the switch's value on the 'on' side (a Python literal; e.g. --switch slot_rows --on 4)")
    ap.add_argument("--set", action="append", default=[], metavar="MODULE.ATTR=VALUE",
                    help="a lowering constant for both sides and the whole run, e.g. "
                         "\"triton.grouped_gemm.SLOT_DOWN_TILE={'block_n': 32}\" (repeatable)")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    """Run the comparison (see the module docstring); ``argv`` as on the command line."""
    args = parse_args(argv)
    if args.smoke:
        shapes, device = {n: SMOKE_SHAPES[n] for n in ("qwen3", "gpt_oss")}, "cpu"
        tokens, args.rounds = args.tokens or "1,8", 1
        out = args.out or tempfile.mkdtemp(prefix="fused_activation_smoke_")
    else:
        if not torch.cuda.is_available():
            raise SystemExit("bench/fused_activation.py needs a CUDA GPU (or --smoke)")
        shapes, device = {n: SHAPES[n] for n in args.shapes.split(",")}, "cuda"
        tokens = args.tokens or "1,16,256,1024,4096"
        out = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    import moe_fx  # noqa: F401  (registers the ops)
    from moe_fx.ops import experts_reference

    kernel_choice = kernel_choice_of(args.switch)
    if kernel_choice == "auto":
        from moe_fx.lowering.problem import probe_capabilities

        error = probe_capabilities(device).deep_gemm_error
        if error:  # both sides would time Triton's path, where the switch does nothing
            raise SystemExit(f"--switch {args.switch} acts on DeepGEMM's path, which is not usable here: {error}")

    meta = bench_meta(device, args.smoke)
    meta["switch"] = args.switch
    meta["kernel_choice"] = kernel_choice
    on_value = SWITCHES[args.switch][1] if args.on is None else ast.literal_eval(args.on)
    meta["on_value"] = on_value
    meta["settings"] = apply_settings(args.set)
    print("meta", json.dumps(meta), flush=True)
    rows: list[dict] = []
    fp8 = SWITCHES[args.switch][3]
    stem = results_stem("fused_activation" if args.switch == "epilogue" else args.switch, args.tag)
    for shape, dims in shapes.items():
        _, e, k, h, i = dims
        w, kw = layer(shape, dims, device, fp8=fp8, kernel_choice=kernel_choice)
        for t in (int(x) for x in tokens.split(",")):
            sets = routing_sets(t, e, k, h, SETS, seed=t, device=device)
            g_on, out_on = graphs_of(variant(args.switch, True, w, kw, on_value), sets)
            g_off, out_off = graphs_of(variant(args.switch, False, w, kw), sets)
            times: dict[str, list[float]] = {"on": [], "off": []}
            for r in range(args.rounds):
                order = (("on", g_on), ("off", g_off)) if r % 2 == 0 else (("off", g_off), ("on", g_on))
                for name, gr in order:
                    times[name].append(time_us(gr))
            on_us, off_us = statistics.median(times["on"]), statistics.median(times["off"])
            # each variant's outputs, each read right after its own graph's replay (the graphs share a pool)
            out_on, out_off = replayed_outputs(g_on, out_on), replayed_outputs(g_off, out_off)
            ref = experts_reference(*sets[0], w["w13"], w["w2"], **kw)
            errs = {"on": rel(out_on[0], ref), "off": rel(out_off[0], ref)}
            row = {"shape": shape, "T": t, "on_us": on_us, "off_us": off_us,
                   "speedup": off_us / on_us, "on_vs_off_err": max(rel(a, b) for a, b in zip(out_on, out_off)),
                   "ref_err_on": errs["on"], "ref_err_off": errs["off"],
                   "floor_us": row_metrics(on_us, sets, e, k, h, i, fp8, meta["limits"])["floor_us"]
                   if meta["limits"] else None}
            rows.append(row)
            print(f"{shape:8s} T={t:5d} on {on_us:8.1f} µs  off {off_us:8.1f} µs  "
                  f"x{row['speedup']:.3f}  err on/off vs ref {errs['on']:.1e}/{errs['off']:.1e}", flush=True)
            del g_on, g_off, out_on, out_off
            write(out, stem, meta, rows)
        del w
        if device == "cuda":
            torch.cuda.empty_cache()
    print("done ->", os.path.join(out, stem + ".md"), flush=True)


def write(out: str, stem: str, meta: dict, rows: list[dict]) -> None:
    """The results as JSON and markdown (machine, versions, date, command; one row per shape and T)."""
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, stem + ".json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    lim = meta["limits"]
    limits = (f"limits measured in the same run: copy {lim['copy_tbs']:.2f} TB/s, bf16 matmul "
              f"{lim['bf16_tflops']:.0f} TFLOP/s" if lim else "smoke run on CPU (tiny shapes; times are not GPU times)")
    choice = meta.get("kernel_choice", "triton")
    lines = [
        (f"# One layer, Triton, sorted layout: {SWITCHES[meta.get('switch', 'epilogue')][4]}" if choice == "triton"
         else f"# One layer, the op's choice (auto, DeepGEMM): {SWITCHES[meta['switch']][4]}"),
        "",
        f"{meta['date']} · {meta['gpu']} · torch {meta['torch']} · triton {meta['triton']} · {limits}",
        "",
        f"Command: `{meta['command']}`",
        "",
        (f"Switch: `moe_fx.lowering.{SWITCHES[meta.get('switch', 'epilogue')][0]}` = "
         f"{meta.get('on_value', SWITCHES[meta.get('switch', 'epilogue')][1])!r} (on) / "
         f"{SWITCHES[meta.get('switch', 'epilogue')][2]!r} (off)."
         + "".join(f" Both sides: `{name}` = {value!r}." for name, value in meta.get("settings", {}).items())),
        "",
        (f"CUDA-graph replays of `torch.ops.moe_fx.experts(kernel_choice='{choice}')`"
         f"{' (sorted layout)' if choice == 'triton' else ''}, the two variants "
         "timed alternately; µs, lower is better. Speed-up = off / on. Floor = max(bytes / copy rate, "
         "flops / matmul rate). Errors: relative Frobenius, against the fp32 reference on the row's first "
         "routing set, and on against off over the row's sets."),
        "",
        "| shape | T | on µs | off µs | speed-up | floor µs | on floor% | err on / off vs ref | on vs off |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        floor = (f"{r['floor_us']:.1f} | {100 * r['floor_us'] / r['on_us']:.0f}%" if r["floor_us"] else "— | —")
        lines.append(f"| {r['shape']} | {r['T']} | {r['on_us']:.1f} | {r['off_us']:.1f} | {r['speedup']:.3f} | "
                     f"{floor} | {r['ref_err_on']:.1e} / {r['ref_err_off']:.1e} | {r['on_vs_off_err']:.1e} |")
    with open(os.path.join(out, stem + ".md"), "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
