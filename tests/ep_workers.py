"""Multi-process helpers for the expert-parallel tests (spawned workers must live in an importable module).

:func:`run_ranks` starts ``world`` processes with ``torch.multiprocessing``'s spawn context, each of which
joins a gloo process group through a file store and runs ``fn(rank, world, *args)``; it returns the
per-rank results, or raises with the workers' tracebacks. A hang fails the test after ``timeout`` seconds
(the workers are killed) instead of hanging CI.
"""

from __future__ import annotations

import os
import queue
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

__all__ = ["EPMoE", "run_ranks"]


def _worker(fn: Callable, rank: int, world: int, store: str, out: Any, args: tuple) -> None:
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
        try:
            result = fn(rank, world, *args)
        finally:
            dist.destroy_process_group()
        out.put((rank, True, result))
    except BaseException:  # noqa: BLE001 - report any failure of the worker to the parent, then exit
        out.put((rank, False, traceback.format_exc()))


def run_ranks(fn: Callable, world: int, *args: Any, timeout: float = 60.0) -> list[Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` gloo ranks; return ``[result of rank 0, ...]``."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_worker, args=(fn, r, world, store, out, args), daemon=True) for r in range(world)]
        for p in procs:
            p.start()
        results: dict[int, Any] = {}
        errors: dict[int, str] = {}
        try:
            import time

            deadline = time.monotonic() + timeout
            while len(results) + len(errors) < world:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(
                        f"EP workers did not finish within {timeout:.0f} s (ranks done: {sorted(results)})"
                    )
                try:
                    rank, ok, value = out.get(timeout=min(left, 1.0))
                except queue.Empty:
                    dead = [
                        r
                        for r, p in enumerate(procs)
                        if p.exitcode not in (None, 0) and r not in results and r not in errors
                    ]
                    if dead:
                        raise RuntimeError(f"EP worker(s) {dead} died (exit codes {[procs[r].exitcode for r in dead]})")
                    continue
                (results if ok else errors)[rank] = value
        finally:
            for p in procs:
                p.join(timeout=5)
                if p.is_alive():
                    p.kill()
                    p.join()
    if errors:
        raise RuntimeError(
            "EP worker(s) failed:\n" + "\n".join(f"--- rank {r}\n{tb}" for r, tb in sorted(errors.items()))
        )
    return [results[r] for r in range(world)]


class EPMoE(nn.Module):
    """A tiny MoE block already written with ``torch.ops.moe_fx.experts`` (what the rewrite produces),
    with a softmax top-k router and a shared expert added after the routed experts (DeepSeek style).

    Input ``[T, H]``; weights random from ``seed`` so every rank builds the same model.
    """

    def __init__(
        self,
        hidden: int = 32,
        inter: int = 16,
        num_experts: int = 8,
        top_k: int = 2,
        seed: int = 0,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.top_k = top_k
        self.router = nn.Parameter(torch.randn(num_experts, hidden, generator=g, dtype=dtype) * 0.3)
        self.w13 = nn.Parameter(torch.randn(num_experts, 2 * inter, hidden, generator=g, dtype=dtype) * 0.2)
        self.w2 = nn.Parameter(torch.randn(num_experts, hidden, inter, generator=g, dtype=dtype) * 0.2)
        self.shared_up = nn.Parameter(torch.randn(2 * inter, hidden, generator=g, dtype=dtype) * 0.2)
        self.shared_down = nn.Parameter(torch.randn(hidden, inter, generator=g, dtype=dtype) * 0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = F.softmax(F.linear(x, self.router), dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        routed = torch.ops.moe_fx.experts(x, ids, weights, self.w13, self.w2)
        gate, up = F.linear(x, self.shared_up).chunk(2, dim=-1)
        shared = F.linear(F.silu(gate) * up, self.shared_down)
        return routed + shared


def _make_model(kind: str) -> nn.Module:
    if kind == "epmoe":
        return EPMoE(hidden=32, inter=16, num_experts=8, top_k=2).eval()
    if kind == "dense_bmm":
        from moe_fx.testing import DenseBmmMoE

        torch.manual_seed(0)
        return DenseBmmMoE(hidden=32, inter=16, num_experts=8, top_k=2).eval()
    raise ValueError(kind)


def ep_model_worker(rank: int, world: int, kind: str, steps: list[list[int]], max_tokens: int, inductor: bool) -> dict:
    """Run ``steps`` (tokens per rank per step) through the EP-compiled model; compare with eager.

    Returns ``{"errors": [max abs error or the ValueError text per step], "splits": ..., "freed": ...}``.
    The eager outputs are computed before compiling: compiling under EP leaves only this rank's experts
    in the model's parameters.
    """
    from moe_fx.backend import make_backend
    from moe_fx.config import MoEConfig
    from moe_fx.passes.split_ep import ep_weights_freed

    model = _make_model(kind)
    inputs = [
        torch.randn(s[rank], 32, generator=torch.Generator().manual_seed(1000 * i + rank)) for i, s in enumerate(steps)
    ]
    with torch.no_grad():
        eager = [model(x) for x in inputs]
    sink: list = []
    # verify="never": the recognizer's numeric probe would read the full expert weights again on a
    # recompile, and after the first EP compile only this rank's experts are left in them.
    config = MoEConfig(ep_group="default", max_tokens_per_rank=max_tokens, verify="never")
    compiled = torch.compile(model, backend=make_backend(config, sink=sink, inductor=inductor), dynamic=False)
    results: list = []
    for x, ref in zip(inputs, eager):
        try:
            with torch.no_grad():
                out = compiled(x)
        except ValueError as e:  # raised on every rank together when any rank has too many tokens
            results.append(f"ValueError: {e}")
            continue
        results.append(float((out - ref).abs().max()) if out.numel() else 0.0)
        if out.shape != ref.shape:
            results[-1] = f"shape {tuple(out.shape)} != {tuple(ref.shape)}"
    weights = [p for n, p in model.named_parameters() if n in ("w13", "w2", "gate_up", "down")]
    return {
        "errors": results,
        "freed": [ep_weights_freed(p) for p in weights],
        "matched": [r.one_line() for r in sink if getattr(r, "matched", False)],
    }
