"""Multi-process helpers for the expert-parallel tests (spawned workers must live in an importable module).

:func:`run_ranks` starts ``world`` processes with ``torch.multiprocessing``'s spawn context, each of which
joins a gloo process group through a file store and runs ``fn(rank, world, *args)``; it returns the
per-rank results, or raises with the workers' tracebacks. A hang fails the test after ``timeout`` seconds
(the workers are killed) instead of hanging CI.

Workers (each ``fn(rank, world, ...)``, returning what the tests assert on): :func:`ep_model_worker`
(a model compiled under EP, step after step, against eager), :func:`forms_worker` (every form of
:data:`FORMS`), :func:`fixed_exchange_worker` (the sync-free exchange at the op level),
:func:`eplb_worker` (counts, rebalances, moved weights), :func:`hf_model_worker` (a recognised
transformers model); :func:`several` runs a list of them in one spawn.
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
        from moe_fx.testing.models import DenseBmmMoE

        torch.manual_seed(0)
        return DenseBmmMoE(hidden=32, inter=16, num_experts=8, top_k=2).eval()
    raise ValueError(kind)


def ep_model_worker(rank: int, world: int, kind: str, steps: list[list[int]], max_tokens: int, inductor: bool,
                    dynamic: bool = False) -> dict:
    """Run ``steps`` (tokens per rank per step) through the EP-compiled model; compare with eager.

    ``dynamic``: the token count is a symbolic size (one graph for every step; round 0 is
    ``min(T, max_tokens_per_rank)`` tokens and the agreement reads T from the call's inputs).

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
    # The default check: the first compile probes the real weights; a recompile (the steps change T), after which
    # only this rank's experts are left in them, probes random weights of the full shapes instead.
    config = MoEConfig(ep_group="default", max_tokens_per_rank=max_tokens)
    inner = make_backend(config, sink=sink, inductor=inductor)
    compiles: list = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        compiles.append(gm)
        return inner(gm, example_inputs)

    compiled = torch.compile(model, backend=backend, dynamic=None if dynamic else False)
    if dynamic:
        for x in inputs:
            torch._dynamo.mark_dynamic(x, 0)
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
        "compiles": len(compiles),
        "errors": results,
        "freed": [ep_weights_freed(p) for p in weights],
        "matched": [r.one_line() for r in sink if getattr(r, "matched", False)],
    }


# --------------------------------------------------------------------------------------------------
# Every form of the experts op under EP (issue 18): a tiny block calling moe_fx::experts with the form's
# arguments, compiled with the moe_fx passes (split_ep) and compared with the single-process op.
# --------------------------------------------------------------------------------------------------

#: Forms of the experts op: constructor options of :class:`FormMoE`.
FORMS: dict[str, dict] = {
    "plain": {},
    "biases": {"bias": True},
    # GPT-OSS's experts at its real hidden size 2880 (not a multiple of 128, not a DeepEP size): biases,
    # interleaved gate/up rows, clamped SwiGLU with alpha and the +1 on up
    "gpt_oss_h2880": {"bias": True, "gate_up_layout": "interleaved", "alpha": 1.702, "limit": 7.0,
                      "up_offset": 1.0, "hidden": 2880},
    "not_gated_relu2": {"gated": False, "activation": "relu2"},
    "gelu_tanh": {"activation": "gelu_tanh"},
    "identity_experts": {"identity_experts": 2},
    "weights_on_input_top2": {"weights_on_input": True},
    "weights_on_input_top1": {"weights_on_input": True, "top_k": 1},
    "fp8": {"fp8": True, "hidden": 256},  # H % 128 == 0: dispatched in fp8
    "fp8_h192": {"fp8": True, "hidden": 192},  # H % 128 != 0: dispatched in bf16, quantised by the experts
}


class FormMoE(nn.Module):
    """A routed MoE block that calls ``moe_fx::experts`` in one form (see :data:`FORMS`).

    Options: ``hidden``, ``inter``, ``num_experts``, ``top_k``, ``bias`` (both GEMMs), ``gated``,
    ``activation``, ``gate_up_layout``, ``alpha``, ``limit``, ``up_offset``, ``identity_experts``
    (the router then scores E + n ids), ``weights_on_input``, ``fp8`` (bf16 activations, fp8 block
    weights), ``skew`` (router bias towards the first experts, for load balancing). Weights are random
    from ``seed``, the same on every rank.
    """

    def __init__(self, seed: int = 0, dtype: torch.dtype = torch.float32, **form: object) -> None:
        super().__init__()
        from moe_fx.lowering.quant import quantize_fp8_blockwise

        g = torch.Generator().manual_seed(seed)
        h, i = int(form.get("hidden", 32)), int(form.get("inter", 16))
        e, self.top_k = int(form.get("num_experts", 8)), int(form.get("top_k", 2))
        gated = bool(form.get("gated", True))
        n1 = 2 * i if gated else i
        n_id = int(form.get("identity_experts", 0))
        fp8 = bool(form.get("fp8", False))
        self.dtype = torch.bfloat16 if fp8 else dtype
        self.router = nn.Parameter((torch.randn(e + n_id, h, generator=g) * h**-0.5).to(self.dtype))
        bias = torch.zeros(e + n_id)
        bias[: e // 4] = float(form.get("skew", 0.0))
        self.router_bias = nn.Parameter(bias.to(self.dtype))
        w13 = torch.randn(e, n1, h, generator=g) * h**-0.5
        w2 = torch.randn(e, h, i, generator=g) * i**-0.5
        self.kwargs = {k: form[k] for k in ("activation", "gated", "gate_up_layout", "alpha", "limit", "up_offset",
                                             "identity_experts", "weights_on_input") if k in form}
        if fp8:
            q13, s13 = quantize_fp8_blockwise(w13)
            q2, s2 = quantize_fp8_blockwise(w2)
            self.w13, self.w2 = (nn.Parameter(t, requires_grad=False) for t in (q13, q2))
            self.w13_scale, self.w2_scale = (nn.Parameter(t, requires_grad=False) for t in (s13, s2))
        else:
            self.w13, self.w2 = nn.Parameter(w13.to(dtype)), nn.Parameter(w2.to(dtype))
            self.w13_scale = self.w2_scale = None
        if form.get("bias"):
            self.w13_bias = nn.Parameter((torch.randn(e, n1, generator=g) * 0.1).to(self.dtype))
            self.w2_bias = nn.Parameter((torch.randn(e, h, generator=g) * 0.1).to(self.dtype))
        else:
            self.w13_bias = self.w2_bias = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = F.softmax(F.linear(x, self.router, self.router_bias), dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return torch.ops.moe_fx.experts(
            x, ids, weights, self.w13, self.w2, w13_scale=self.w13_scale, w2_scale=self.w2_scale,
            w13_bias=self.w13_bias, w2_bias=self.w2_bias, **self.kwargs,
        )


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30)) if b.numel() else 0.0


def _compile_ep(model: nn.Module, config: object, graphs: list) -> Callable:
    """``model`` compiled with the moe_fx passes (no Inductor); the rewritten graphs go to ``graphs``."""
    from moe_fx.backend import make_backend

    inner = make_backend(config, inductor=False)

    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        fn = inner(gm, example_inputs)
        graphs.append(gm)
        return fn

    torch._dynamo.reset()
    return torch.compile(model, backend=backend, dynamic=False)


def _ep_ops(graphs: list) -> list[str]:
    return [str(n.target).split(".")[-2] for gm in graphs for n in gm.graph.nodes
            if n.op == "call_function" and str(n.target).startswith("moe_fx.")]


def forms_worker(rank: int, world: int, names: list[str], steps: list[list[int]], max_tokens: int) -> dict:
    """Each form of :data:`FORMS` under EP on ``steps`` (tokens per rank per step), against the one-process op.

    Returns ``{form: {"errors": [relative error per step], "ops": [moe_fx ops of the graph]}}``.
    """
    from moe_fx.config import MoEConfig

    out = {}
    for name in names:
        model = FormMoE(**FORMS[name]).eval()
        h = model.router.shape[1]
        inputs = [torch.randn(s[rank], h, generator=torch.Generator().manual_seed(100 * i + rank)).to(model.dtype)
                  for i, s in enumerate(steps)]
        with torch.no_grad():
            want = [model(x) for x in inputs]
        graphs: list = []
        config = MoEConfig(ep_group="default", max_tokens_per_rank=max_tokens, verify="never")
        compiled = _compile_ep(model, config, graphs)
        with torch.no_grad():
            errors = [_rel(compiled(x), ref) for x, ref in zip(inputs, want)]
        out[name] = {"errors": errors, "ops": sorted(set(_ep_ops(graphs)))}
    return out


def fixed_exchange_worker(rank: int, world: int, max_tokens: int) -> dict:
    """The sync-free exchange (``kernel="torch_dist_fixed"``) at the op level, against the one-process op.

    Routing with -1 slots, a token naming one expert twice, ids out of range (skipped: the GPU rule),
    an empty rank, fp8 dispatch, and a step of 3 rounds through ``ep_remaining_rounds``. Returns
    ``{case: relative error}`` and the masked counts seen.
    """
    from moe_fx.ops import experts_reference
    from moe_fx.ops.ep import ep_group_name

    ops = torch.ops.moe_fx
    g = ep_group_name("default")
    e, h, i, k = 4 * world, 128, 32, 3
    gen = torch.Generator().manual_seed(7)  # the same weights on every rank
    w13 = torch.randn(e, 2 * i, h, generator=gen) * h**-0.5
    w2 = torch.randn(e, h, i, generator=gen) * i**-0.5
    w13_l, w2_l = w13[4 * rank : 4 * rank + 4], w2[4 * rank : 4 * rank + 4]
    res: dict = {}
    for case, t, dtype, fp8 in (("fp32", 5, torch.float32, False), ("empty_rank", 0 if rank else 6, torch.float32,
                                 False), ("bf16_fp8_dispatch", 7, torch.bfloat16, True)):
        tg = torch.Generator().manual_seed(10 * rank + len(case))
        x = torch.randn(t, h, generator=tg).to(dtype)
        ids = torch.stack([torch.randperm(e, generator=tg)[:k] for _ in range(t)]) if t else torch.empty(0, k).long()
        if t >= 3:
            ids[0, 1] = -1
            ids[1, 2] = ids[1, 0]  # one expert twice: received once, both slots count
            ids[2, 0] = e + 5  # no expert: skipped
        w = torch.rand(t, k, generator=tg)
        d = ops.ep_dispatch(x, ids, e, max_tokens, g, fp8, "torch_dist_fixed")
        y = ops.masked_experts(d[0], d[2], w13_l.to(dtype), w2_l.to(dtype), "silu", d[1] if fp8 else None)
        got = ops.ep_combine(y, ids, w, d[3], d[4], e, max_tokens, g, fp8, "torch_dist_fixed")
        clean = torch.where((ids >= 0) & (ids < e), ids, -1)
        res[case] = _rel(got, experts_reference(x, clean, w, w13.to(dtype), w2.to(dtype)))
        res[case + "_masked_m"] = int(d[2].sum())
    # a step of 3 rounds on rank 0 (2 on the others): ep_agree_step, then round 0 and the remaining rounds
    t = 3 * max_tokens if rank == 0 else max_tokens + 1
    tg = torch.Generator().manual_seed(99 + rank)
    x = torch.randn(t, h, generator=tg)
    ids = torch.stack([torch.randperm(e, generator=tg)[:k] for _ in range(t)])
    w = torch.rand(t, k, generator=tg)
    res["rounds"] = ops.ep_agree_step(t, max_tokens, g)
    first = min(t, max_tokens)
    d = ops.ep_dispatch(x[:first], ids[:first], e, max_tokens, g, False, "torch_dist_fixed")
    y = ops.masked_experts(d[0], d[2], w13_l, w2_l)
    out0 = ops.ep_combine(y, ids[:first], w[:first], d[3], d[4], e, max_tokens, g, False, "torch_dist_fixed")
    full = ops.ep_remaining_rounds(out0, x, ids, w, w13_l, w2_l, e, max_tokens, g, False, "torch_dist_fixed")
    res["three_rounds"] = _rel(full, experts_reference(x, ids, w, w13, w2))
    return res


def eplb_worker(rank: int, world: int, steps: list[list[int]], max_tokens: int, redundant: int, interval: int,
                rebalance_after: int | None) -> dict:
    """EPLB on a block whose router favours experts 0 and 1: loads, rebalances, moved weights, outputs.

    ``rebalance_after``: call ``moe_fx.rebalance_experts()`` after that step (``interval`` 0), or let
    ``MoEConfig.eplb_interval`` do it. Returns the relative error per step, the placement after each
    step, this rank's counted loads against the routing it computed itself, the rebalance report, and
    whether every physical slot of this rank holds its expert's weights after the last step.
    """
    import moe_fx
    from moe_fx.config import MoEConfig
    from moe_fx.ops.ep import ep_group_name
    from moe_fx.passes import eplb

    model = FormMoE(skew=3.0, bias=True).eval()
    e = model.w13.shape[0]
    full = {n: p.detach().clone() for n, p in model.named_parameters() if n.startswith("w")}
    inputs = [torch.randn(s[rank], 32, generator=torch.Generator().manual_seed(7 * i + rank)) for i, s in enumerate(steps)]
    with torch.no_grad():
        want = [model(x) for x in inputs]
        routed = [torch.topk(F.linear(x, model.router, model.router_bias), 2, dim=-1).indices for x in inputs]
    config = MoEConfig(ep_group="default", max_tokens_per_rank=max_tokens, verify="never", eplb=True,
                       eplb_redundant_slots=redundant, eplb_interval=interval)
    compiled = _compile_ep(model, config, [])
    slots = e // world + redundant
    res: dict = {"errors": [], "placements": [eplb.initial_placement(e, world, slots)], "load_ok": [], "reports": []}
    counted = torch.zeros(e + 1, dtype=torch.int64)
    for i, (x, ref) in enumerate(zip(inputs, want)):
        before = res["placements"][-1]
        with torch.no_grad():
            res["errors"].append(_rel(compiled(x), ref))
        layer = eplb.layers_of(ep_group_name("default"))[0]
        if layer.phys_to_log != before:  # the interval trigger rebalanced (and zeroed the counts) before this call
            counted.zero_()
        counted += torch.bincount(routed[i].reshape(-1), minlength=e + 1)
        res["load_ok"].append(torch.equal(layer.load.cpu(), counted))
        if rebalance_after == i:
            res["local_load"] = layer.load[:e].tolist()
            res["reports"].append(moe_fx.rebalance_experts())
            counted.zero_()
        res["placements"].append(list(layer.phys_to_log))
    res["slots"] = layer.slots
    res["weights_ok"] = all(
        torch.equal(layer.weights[name][j], full[name][logical])
        for name in layer.weights for j, logical in enumerate(layer.rows_of(rank))
    )
    res["weights"] = sorted(layer.weights)
    res["freed"] = ep_weights_freed_all(model)
    return res


def ep_weights_freed_all(model: nn.Module) -> bool:
    """Whether every expert weight of ``model`` was reduced to this rank's rows by split_ep."""
    from moe_fx.passes.split_ep import ep_weights_freed

    return all(ep_weights_freed(p) for n, p in model.named_parameters() if n.startswith("w"))


def hf_model_worker(rank: int, world: int, family: str, steps: int, tokens: int, max_tokens: int) -> dict:
    """A tiny transformers model of ``family`` (recognised, verified, rewritten, then split) against eager.

    ``steps`` calls with ``tokens + 5 * rank`` tokens each: one shape per rank, so one compilation (the
    numerical check reads the full expert weights, which only the first compilation still has).
    """
    from moe_fx.config import MoEConfig
    from moe_fx.testing.models import tiny_hf_model

    model = tiny_hf_model(family, num_layers=1, num_experts=4)
    ids = [torch.randint(0, 128, (1, tokens + 5 * rank), generator=torch.Generator().manual_seed(5 * i + rank))
           for i in range(steps)]
    with torch.no_grad():
        want = [model(x).logits for x in ids]
    graphs: list = []
    compiled = _compile_ep(model, MoEConfig(ep_group="default", max_tokens_per_rank=max_tokens), graphs)
    with torch.no_grad():
        errors = [_rel(compiled(x).logits, ref) for x, ref in zip(ids, want)]
    return {"errors": errors, "ops": sorted(set(_ep_ops(graphs)))}


def several(rank: int, world: int, jobs: list[tuple[str, tuple]]) -> list:
    """Run several workers of this module one after the other in the same processes (one spawn for all)."""
    import torch._dynamo

    out = []
    for name, args in jobs:
        torch._dynamo.reset()
        out.append(globals()[name](rank, world, *args))
    return out
