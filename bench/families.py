"""Every transformers text MoE family, tiny and random, through moe_fx: what is rewritten, and equal to eager?

``python bench/families.py [--impl grouped_mm|batched_mm|eager] [--dtype float32|bfloat16] [family ...]``
builds each family with :func:`moe_fx.testing.families.tiny_family_model` (2 layers, H=32, 8 experts,
top-2 where the family allows), compiles it with the moe_fx passes (graphs run eagerly, no Inductor:
the question is what the pass does, not what Inductor does), runs the same tokens through eager and
compiled, and prints one row per family: MoE layers found / rewritten, forms, the largest relative
logit error, and the reason of every layer left alone. Writes bench/results/families_<impl>_<dtype>_<date>.md.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from helpers import logits, rel_err, run_captured  # noqa: E402

import moe_fx  # noqa: E402
from moe_fx.capture.inventory import qualify_layer_names, unseen_moe_layers  # noqa: E402
from moe_fx.capture.steps import capture_modules  # noqa: E402
from moe_fx.testing.families import TEXT_MOE_FAMILIES, tiny_family_model  # noqa: E402

TOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2}
try:  # transformers' strict configs raise this (not a ValueError) for settings a family rejects
    from huggingface_hub.errors import StrictDataclassClassValidationError as _ConfigError
except ImportError:  # pragma: no cover - older huggingface_hub
    _ConfigError = ValueError


def run_family(family: str, impl: str, dtype: torch.dtype, layers: int) -> dict:
    """Build, capture, compile and compare one family; returns the row's fields."""
    start = time.perf_counter()
    model = tiny_family_model(family, dtype=dtype, experts_implementation=impl, num_layers=layers)
    ids = torch.randint(3, 128, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = logits(model(ids))
    module_reports = capture_modules(model, moe_fx.MoEConfig())
    got, cap = run_captured(model, ids)
    reports = module_reports + [r for r in cap.reports if r.layer != "<graph>"]
    qualify_layer_names(model, reports)
    reports += unseen_moe_layers(model, reports)
    matched = [r for r in reports if r.matched]
    err = rel_err(logits(got).float(), want.float())
    return {
        "family": family, "layers": len(reports), "matched": len(matched), "err": err,
        "ok": err < TOL[dtype], "forms": sorted({f"{r.form}:{r.activation}" for r in matched}),
        "reasons": sorted({f"{r.layer}: {r.reason}" for r in reports if not r.matched}),
        "graphs": cap.compiles, "seconds": time.perf_counter() - start,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("families", nargs="*", default=list(TEXT_MOE_FAMILIES))
    parser.add_argument("--impl", default="grouped_mm", choices=["grouped_mm", "batched_mm", "eager"])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--layers", type=int, default=None,
                        help="decoder layers (default: 2 in float32; 1 in bfloat16, so that routing sees bit-identical "
                             "inputs in eager and compiled runs and no top-k tie can flip)")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    layers = args.layers or (2 if dtype == torch.float32 else 1)
    warnings.filterwarnings("ignore")
    rows = []
    for family in args.families:
        try:
            row = run_family(family, args.impl, dtype, layers)
        except (RuntimeError, ValueError, TypeError, AttributeError, KeyError, IndexError, _ConfigError) as exc:
            row = {"family": family, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}
        rows.append(row)
        if "error" in row:
            print(f"{family:18s} ERROR {row['error']}", flush=True)
        else:
            print(f"{family:18s} {row['matched']}/{row['layers']} rewritten, rel err {row['err']:.1e} "
                  f"{'==' if row['ok'] else '!='} eager, {row['graphs']} graph(s), {row['seconds']:.1f} s "
                  f"{' '.join(row['forms'])}", flush=True)
            for reason in row["reasons"]:
                print(f"{'':18s}   {reason[:300]}", flush=True)
    if args.no_write:
        return 0
    out = Path(__file__).parent / "results" / f"families_{args.impl}_{args.dtype}_{datetime.date.today()}.md"
    lines = [
        f"# transformers MoE families through moe_fx ({args.impl}, {args.dtype}, {layers} layer(s), CPU)",
        "",
        f"{datetime.datetime.now().isoformat(timespec='seconds')} · {platform.processor() or platform.machine()} · "
        f"torch {torch.__version__} · transformers {__import__('transformers').__version__} · "
        f"`python bench/families.py --impl {args.impl} --dtype {args.dtype} --layers {layers}`",
        "",
        "| family | MoE layers rewritten | rel. logit error vs eager | graphs | forms | layers left alone (reason) |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['family']} | - | - | - | - | could not build/run: {r['error']} |")
            continue
        reasons = "<br>".join(x.replace("|", "/") for x in r["reasons"]) or "-"
        lines.append(f"| {r['family']} | {r['matched']}/{r['layers']} | {r['err']:.1e} | {r['graphs']} | "
                     f"{' '.join(r['forms']) or '-'} | {reasons} |")
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
