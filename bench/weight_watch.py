"""What keeping fp8 copies current costs per call: the SourceWatch check against the compiled call.

``python bench/weight_watch.py [--layers 4] [--tokens 1 64]``: compiles a tiny random bf16 Qwen3-MoE
(CPU, H = I = 128, E = 8) with ``MoEConfig(quantize="fp8")`` and times, per call of the compiled model:
the whole call, the check before it (exact version/pointer state plus the sampled-bits comparison), the
exact part alone, and what a full content check (reading every bf16 expert weight) would cost instead.
Then the re-quantisation a ``.data`` edit triggers. CPU numbers are ratios only (BRIEF.md); the GPU cost
is stated in :class:`moe_fx.passes.expert_storage.SourceWatch`. Writes bench/results/weight_watch_<date>.md.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import time
from pathlib import Path

import torch

import moe_fx
from moe_fx.passes import expert_storage
from moe_fx.testing.models import tiny_hf_model


def _median_us(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e6 * statistics.median(times)


def measure(layers: int, tokens: int, reps: int) -> dict[str, float]:
    """Microseconds per compiled call and per check, for one model size and token count."""
    torch._dynamo.reset()
    model = tiny_hf_model("qwen3_moe", num_layers=layers, dtype=torch.bfloat16, hidden=128, intermediate=128)
    ids = torch.randint(0, 128, (1, tokens), generator=torch.Generator().manual_seed(0))
    watches: list[expert_storage.SourceWatch] = []
    original_record = expert_storage.SourceWatch.record

    def record(self, args):
        watches.append((self, list(args)))
        original_record(self, args)

    expert_storage.SourceWatch.record = record
    try:
        compiled = moe_fx.compile(model, moe_fx.MoEConfig(quantize="fp8"), dynamic=False)
        with torch.no_grad():
            compiled(ids)
    finally:
        expert_storage.SourceWatch.record = original_record
    (watch, args), = watches  # one graph, one watch for all layers
    experts = [p for n, p in model.named_parameters() if ".experts." in n]
    with torch.no_grad():
        call = _median_us(lambda: compiled(ids), reps)
        check = _median_us(lambda: watch(args), reps)
        exact = _median_us(lambda: [w.exact_state(args) == w.state for w in watch.watched], reps)
        full = _median_us(lambda: [p.view(torch.int16).sum() for p in experts], reps)
        model.model.layers[0].mlp.experts.gate_up_proj.data.mul_(2)  # seen by sampling only
        start = time.perf_counter()
        watch(args)
        requant = 1e6 * (time.perf_counter() - start)
    return {"layers": layers, "tokens": tokens, "regions": len(watch), "call": call, "check": check,
            "exact": exact, "full": full, "requant": requant}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--reps", type=int, default=200)
    args = parser.parse_args()
    rows = [measure(args.layers, t, args.reps) for t in args.tokens]
    lines = [
        f"# fp8 weight watch: cost per call (CPU, bf16 Qwen3-MoE, {args.layers} layers, H=I=128, E=8)",
        "",
        f"{datetime.datetime.now().isoformat(timespec='seconds')} · {platform.machine()} "
        f"({torch.get_num_threads()} threads, load average {os.getloadavg()[0]:.1f} at the end) · torch {torch.__version__} · "
        f"`python bench/weight_watch.py --layers {args.layers} --tokens {' '.join(map(str, args.tokens))}`",
        "",
        "| T | regions | compiled call (µs) | check (µs) | check / call | exact part (µs) | full read instead (µs) "
        "| full / call | re-quantisation after a .data edit (µs) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['tokens']} | {r['regions']} | {r['call']:.0f} | {r['check']:.1f} | {r['check'] / r['call']:.1%} "
            f"| {r['exact']:.1f} | {r['full']:.0f} | {r['full'] / r['call']:.1%} | {r['requant']:.0f} |"
        )
    lines += [
        "",
        "The check runs before every call of the compiled graph: the exact version/pointer state of every source "
        "tensor (Python), then the bits of an 8x8 grid of elements of every expert of every layer (views, one "
        "`cat`) compared in one `torch.equal`. 'full read instead' sums every bf16 expert weight once (the least "
        "a complete content check reads). On a GPU the check is one cat and one equal per compiled call, whose "
        "answer the host reads (one host sync per call).",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    out = Path(__file__).parent / "results" / f"weight_watch_{datetime.date.today()}.md"
    out.write_text(text)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
