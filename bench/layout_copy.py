"""The copies of the tokens into DeepGEMM's layouts on their own, against their bytes floor (one GPU, no DeepGEMM).

DeepGEMM's grouped GEMMs read the tokens from a copy: the aligned contiguous layout above 256 rows per expert
(``moe_fx.lowering.triton.sort.contiguous_rows``), the masked ``[E, max_m, H]`` layout below
(``moe_fx.lowering.triton.permute.permute_to_masked``). At prefill sizes those copies (with fp8 weights, quantised)
were 6-10% of a DeepSeek-V3-shard layer (kernel_breakdown_2026-12-07_prefill_fp8_dg_s27_h100.md: the contiguous copy
193.7 + 30.9 µs of quantisation at T=4096, 949.4 + 129.1 µs at T=16384, then a program per (slot, 1024 columns); the
masked permute 59.0 µs at T=1024, then 128 columns a step). For each shape and T the sort runs once, then each side
is captured in CUDA graphs (one per routing set) and the sides' replays alternate over a few rounds (median per side):

* ``bf16``: the contiguous copy of the bf16 tokens (the bf16 DeepGEMM path above 256 rows per expert);
* ``fp8_fused``: ``contiguous_rows(quantize=True, scale_scratch=False)``, the tokens quantised in the copy's launch,
  each group's scale stored straight into DeepGEMM's MN-major layout;
* ``fp8_two_launches``: ``quantize_rows`` then the copy of its codes and scales (the fp8 path before 2026-12-07);
* ``fp8_fused_kmajor``: ``fp8_fused`` with its scales written row by row (``[rows, groups]`` contiguous, a layout
  DeepGEMM does not read): what writing the MN-major scales, K scattered 4-byte stores per group, costs;
* ``fp8_fused_scratch``: ``contiguous_rows(quantize=True, scale_scratch=True)``: the scales written row by row
  into a scratch, then moved into the MN-major layout by a second launch (``sort.copy_scales``; torch's ``copy_``
  in the first run, layout_copy_2026-12-07_layout_copy_s30_h100.md): the other form of the fp8 path
  (``sort.SCALE_SCRATCH`` picks the shipped one, the scratch since 2026-12-07);
* ``masked_bf16``, ``masked_fp8``: the permute into the masked layout (``max_m = T``), bf16 and quantised, where
  DeepGEMM runs that layout (at most 256 rows per expert).

floor = bytes / the copy rate measured in the same run (a read and a write of 1 GiB): the tokens read once, each
slot's row written, with fp8 its 1x128 scales; two launches also write and read back the quantised tokens. The
fused side's codes and scales are compared with the two launches' (they must be equal). The DeepGEMM GEMMs are
not run: nothing here needs DeepGEMM.

    python bench/layout_copy.py [--shapes dsv3,mixtral,qwen3] [--tokens 1024,4096,16384]

Writes ``layout_copy_<date>[_tag].{md,json}`` to ``--out`` (default bench/results).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from unittest import mock

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from moe_layer import SHAPES, bench_meta, results_stem, routing_sets
from peer_layer import alternate_graph_us

from moe_fx.lowering import layouts
from moe_fx.lowering.masked_experts.deepgemm import CONTIGUOUS_M_ALIGN
from moe_fx.lowering.problem import ROW_REGIMES

SIDES = ("bf16", "fp8_fused", "fp8_two_launches", "fp8_fused_kmajor", "fp8_fused_scratch", "masked_bf16",
         "masked_fp8")
ROUNDS = 5
SETS = 3


def sides_for(t: int, k: int, e: int) -> tuple[str, ...]:
    """The sides a cell runs: the masked layout's only where DeepGEMM would run it, up to the top rows-per-expert
    regime's bound (``ROW_REGIMES[-1]`` rows per expert on average, as ``local_contiguous.prefer`` decides; above it
    the masked layout's [E, T, H] buffers would only cost memory)."""
    return tuple(s for s in SIDES if not s.startswith("masked_") or t * k <= ROW_REGIMES[-1] * e)


def floor_bytes(side: str, t: int, k: int, h: int) -> int:
    """Bytes a side must move at least: the bf16 tokens read once, each of the T * K slots' rows written (fp8: its
    codes and one fp32 scale per 128 columns); two launches also write the quantised tokens and read them back."""
    groups = -(-h // 128)
    if side in ("bf16", "masked_bf16"):
        return t * h * 2 + t * k * h * 2
    fused = t * h * 2 + t * k * (h + 4 * groups)
    if side in ("fp8_fused", "fp8_fused_kmajor", "fp8_fused_scratch", "masked_fp8"):
        return fused
    if side == "fp8_two_launches":
        return fused + 2 * t * (h + 4 * groups)
    raise ValueError(f"unknown side {side!r}")


def _row_major_scales(num_groups: int, mn: int, k: int, *, device=None, dtype=torch.float32) -> torch.Tensor:
    """``[num_groups, mn, ceil(k / 128)]`` scales, each row's groups adjacent (side ``fp8_fused_kmajor``)."""
    return torch.empty(num_groups, mn, -(-k // 128), device=device, dtype=dtype)


def side_fn(side: str, e: int):
    """``fn(x, ids)`` running one side's launches after the sort (the sort is timed by neither: each set's rows come
    sorted already, through the closure's cache)."""
    from moe_fx.lowering.triton.permute import permute_to_masked
    from moe_fx.lowering.triton.sort import contiguous_rows, quantize_rows, sort_by_expert

    sorted_rows = {}

    def fn(x, ids):
        if side.startswith("masked_"):
            return permute_to_masked(x, ids, e, x.shape[0], quant_fp8=side == "masked_fp8")
        key = ids.data_ptr()
        if key not in sorted_rows:
            sorted_rows[key] = sort_by_expert(ids, e)
        rows = sorted_rows[key]
        if side == "bf16":
            return contiguous_rows(rows, x, None, ids, align=CONTIGUOUS_M_ALIGN)
        if side in ("fp8_fused", "fp8_fused_scratch"):
            return contiguous_rows(rows, x, None, ids, align=CONTIGUOUS_M_ALIGN, quantize=True,
                                   scale_scratch=side == "fp8_fused_scratch")
        if side == "fp8_fused_kmajor":
            with mock.patch.object(layouts, "empty_mn_major_scales", _row_major_scales):
                return contiguous_rows(rows, x, None, ids, align=CONTIGUOUS_M_ALIGN, quantize=True,
                                       scale_scratch=False)
        codes, scales = quantize_rows(x)
        return contiguous_rows(rows, codes, scales, ids, align=CONTIGUOUS_M_ALIGN)

    return fn


def same_layout(a, b) -> bool:
    """Whether two layouts hold the same rows: the same experts' row blocks, the same slots sending rows, and each
    slot's codes and scales bit for bit. Compared slot by slot, not row by row: on a GPU the sort claims an
    expert's rows with atomics, so two sorts of one routing order an expert's rows differently."""
    sent = a.slot_pos >= 0
    if not (torch.equal(a.m_indices, b.m_indices) and torch.equal(sent, b.slot_pos >= 0)):
        return False
    ra, rb = a.slot_pos[sent], b.slot_pos[sent]
    return (torch.equal(a.x[ra].view(torch.uint8), b.x[rb].view(torch.uint8))
            and torch.equal(a.x_scale[ra], b.x_scale[rb]))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (``argv``, default ``sys.argv[1:]``) as parsed arguments."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="dsv3,mixtral,qwen3")
    ap.add_argument("--tokens", default="1024,4096,16384")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    ap.add_argument("--tag", default="")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    """Time every (shape, T, side) cell and write the tables."""
    args = parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench/layout_copy.py needs a CUDA GPU")
    import moe_fx  # noqa: F401

    meta = bench_meta()
    copy_tbs = meta["limits"]["copy_tbs"]
    rows = []
    for shape in args.shapes.split(","):
        _, e, k, h, _ = SHAPES[shape]
        for t in map(int, args.tokens.split(",")):
            sets = [(x, ids) for x, ids, _ in routing_sets(t, e, k, h, SETS, seed=t)]
            sides = sides_for(t, k, e)
            fns = {side: side_fn(side, e) for side in sides}
            with torch.no_grad():
                equal = same_layout(fns["fp8_fused"](*sets[0]), fns["fp8_two_launches"](*sets[0]))
                times = alternate_graph_us(fns, sets, ROUNDS)
            for side in sides:
                floor = floor_bytes(side, t, k, h) / copy_tbs / 1e6
                row = {"shape": shape, "T": t, "side": side, "us": times[side], "floor_us": floor,
                       "frac": floor / times[side], "fused_equals_two_launches": equal}
                rows.append(row)
                print(json.dumps({kk: (round(v, 2) if isinstance(v, float) else v) for kk, v in row.items()}),
                      flush=True)
    stem = results_stem("layout_copy", args.tag)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, stem + ".json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    with open(os.path.join(args.out, stem + ".md"), "w") as f:
        f.write(f"# The copies of the tokens into DeepGEMM's layouts ({meta['date']})\n\n{meta.get('gpu', '')} · torch "
                f"{torch.__version__} · copy rate in this run {copy_tbs:.2f} TB/s\n\n"
                "| shape | T | side | µs | floor µs | % of floor | fp8 fused = two launches |\n"
                "|---|---|---|---|---|---|---|\n")
        f.writelines(f"| {r['shape']} | {r['T']} | {r['side']} | {r['us']:.1f} | {r['floor_us']:.1f} | "
                     f"{100 * r['frac']:.0f}% | {'yes' if r['fused_equals_two_launches'] else 'NO'} |\n" for r in rows)
        f.write(f"\nµs: median over {ROUNDS} rounds of CUDA-graph replays ({SETS} routing sets, one graph each), the "
                "sides alternating within each round (peer_layer.alternate_graph_us: the first side alternates too); "
                "the sort is outside the graphs.\n")
    print("wrote", os.path.join(args.out, stem + ".md"))


if __name__ == "__main__":
    main()
