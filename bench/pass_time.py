"""How long the moe_fx passes take on the graph of a deep tiny model, and what fraction of the compile.

``python bench/pass_time.py [--layers 48]``: compiles a tiny random Qwen3-MoE (CPU, fp32) with
``backend="moe_fx"`` (passes + Inductor) and reports the time in the passes against the whole first call, for
``verify="auto"`` (the default), ``"always"`` and ``"never"`` (no numerical check). The verification cost is a
mode's pass time minus ``"never"``'s (the structural reading is in both). Each mode runs in a fresh process with
Inductor's caches off, so that no mode compiles faster for coming second. Writes
bench/results/pass_time_<date>.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

MODES = ("auto", "always", "never")


def measure(layers: int, verify: str) -> dict[str, float]:
    """Seconds for the passes and for the whole first compiled call, for one verify mode."""
    import moe_fx
    import moe_fx.backend as backend_mod
    from moe_fx.testing.models import tiny_hf_model

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


def _in_fresh_process(layers: int, verify: str) -> dict[str, float]:
    env = {**os.environ, "TORCHINDUCTOR_FORCE_DISABLE_CACHES": "1"}
    out = subprocess.run([sys.executable, __file__, "--layers", str(layers), "--one", verify], env=env, check=True,
                         capture_output=True, text=True, timeout=3600)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--one", choices=MODES, help=argparse.SUPPRESS)  # one mode, in this process
    parser.add_argument("--tag", default="", help="suffix of the results file name")
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(args.layers, args.one)))
        return
    rows = {verify: _in_fresh_process(args.layers, verify) for verify in MODES}
    never = rows["never"]["passes"]
    lines = [
        f"# moe_fx pass time on a {args.layers}-layer tiny Qwen3-MoE (CPU, fp32, T=16)",
        "",
        f"{datetime.datetime.now().isoformat(timespec='seconds')} · {platform.processor() or platform.machine()} "
        f"({torch.get_num_threads()} threads) · torch {torch.__version__} · "
        f"`python bench/pass_time.py --layers {args.layers}` · each mode in a fresh process, Inductor caches off",
        "",
        "| verify | regions rewritten | passes (ms) | first compiled call (s) | passes / compile | "
        "verification (passes - never's) / compile |",
        "|---|---|---|---|---|---|",
    ]
    for verify, m in rows.items():
        check = "-" if verify == "never" else f"{100 * (m['passes'] - never) / m['total']:.1f}%"
        line = (f"| {verify} | {m['matched']} | {1e3 * m['passes']:.0f} | {m['total']:.1f} | "
                f"{100 * m['passes'] / m['total']:.1f}% | {check} |")
        lines.append(line)
        print(line)
    out = Path(__file__).parent / "results" / f"pass_time_{datetime.date.today()}{args.tag}.md"
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
