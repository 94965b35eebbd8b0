"""How long the moe_fx passes take on the graph of a deep tiny model, and what fraction of the compile.

``python bench/pass_time.py [--layers 48]``: compiles a tiny random Qwen3-MoE (CPU, fp32) with
``backend="moe_fx"`` (passes + Inductor) and reports the time in the passes (with and without the
numerical probe) against the whole first call. Writes bench/results/pass_time_<date>.md.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import time
from pathlib import Path

import torch

import moe_fx
import moe_fx.backend as backend_mod
from moe_fx.testing import tiny_hf_model


def measure(layers: int, verify: str) -> dict[str, float]:
    """Seconds for the passes and for the whole first compiled call, for one verify mode."""
    torch._dynamo.reset()
    model = tiny_hf_model("qwen3_moe", num_layers=layers)
    ids = torch.randint(0, 128, (1, 16))
    spent = {"passes": 0.0, "matched": 0}
    original = backend_mod._run_moe_passes

    def timed(*args, **kwargs):
        start = time.perf_counter()
        ctx = original(*args, **kwargs)
        spent["passes"] += time.perf_counter() - start
        spent["matched"] += sum(r.matched for r in ctx.report)
        return ctx

    backend_mod._run_moe_passes = timed
    try:
        compiled = moe_fx.compile(model, config=moe_fx.MoEConfig(verify=verify))
        start = time.perf_counter()
        with torch.no_grad():
            compiled(ids)
        total = time.perf_counter() - start
    finally:
        backend_mod._run_moe_passes = original
    return {"passes": spent["passes"], "total": total, "matched": spent["matched"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--layers", type=int, default=48)
    args = parser.parse_args()
    rows = []
    for verify in ("always", "never"):
        m = measure(args.layers, verify)
        rows.append((verify, m))
        print(f"verify={verify}: passes {1e3 * m['passes']:.0f} ms of {m['total']:.1f} s first call "
              f"({100 * m['passes'] / m['total']:.1f}%), {m['matched']} regions rewritten")
    out = Path(__file__).parent / "results" / f"pass_time_{datetime.date.today()}.md"
    lines = [
        f"# moe_fx pass time on a {args.layers}-layer tiny Qwen3-MoE (CPU, fp32, T=16)",
        "",
        f"{datetime.datetime.now().isoformat(timespec='seconds')} · {platform.processor() or platform.machine()} "
        f"({torch.get_num_threads()} threads) · torch {torch.__version__} · `python bench/pass_time.py --layers {args.layers}`",
        "",
        "| verify | regions rewritten | passes (ms) | first compiled call (s) | passes / compile |",
        "|---|---|---|---|---|",
    ]
    for verify, m in rows:
        lines.append(f"| {verify} | {m['matched']} | {1e3 * m['passes']:.0f} | {m['total']:.1f} | "
                     f"{100 * m['passes'] / m['total']:.1f}% |")
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
