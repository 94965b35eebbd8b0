"""Is it safe to replace a region by ``moe_fx::experts``? Structural and numerical guards.

* :func:`check_ops` — every op in the region is one an experts computation uses (layout, routing
  plumbing, products, the gated activation, the weighted combine); anything else (a clamp, a bias,
  a norm after the experts, ...) keeps the region as the model wrote it.
* :func:`activation_hypotheses` — which gated activations the region can mean.
* :func:`probe_region` — runs the region itself on random inputs (uneven expert loads that reach
  every expert, two input scales) with the model's real expert weights and compares it with the op's
  reference implementation; this decides the activation and whether routing weights scale the expert
  input or output, and rejects anything that computes something else. How many tokens and runs
  (the full problem, or a reduced one when that costs too much) is :mod:`moe_fx.passes.probe_plan`'s.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.fx as fx

from moe_fx.ops import experts_reference
from moe_fx.passes.extract_region import Region
from moe_fx.passes.graph_utils import DataFlow, node_value, op_name, tensor_value
from moe_fx.passes.probe_plan import (
    SCALES,
    ProbePlan,
    probe_routing,
    resize_literals,
    symbolic_value,
    token_hint,
)

__all__ = [
    "ALLOWED_OPS",
    "ProbeResult",
    "activation_hypotheses",
    "check_ops",
    "probe_region",
    "region_rows_per_token",
]

log = logging.getLogger("moe_fx.passes")

#: Ops an experts region may contain (by :func:`~moe_fx.passes.graph_utils.op_name`).
ALLOWED_OPS = frozenset(
    {
        # layout
        "reshape", "view", "flatten", "unsqueeze", "squeeze", "transpose", "permute", "t", "contiguous",
        "expand", "expand_as", "repeat_interleave", "repeat", "chunk", "split", "narrow", "getitem",
        "stack", "cat", "unflatten",
        # dtype
        "to", "float", "half", "bfloat16", "type", "type_as", "long", "int",
        # routing plumbing: permutations, counts, offsets, masks, scatter/gather
        "sort", "argsort", "floordiv", "histc", "bincount", "cumsum", "one_hot", "where", "nonzero", "eq",
        "setitem", "index_select", "gather", "scatter", "scatter_add", "scatter_add_", "index_copy",
        "index_copy_", "index_add", "index_add_", "index_put", "index_put_", "masked_fill", "masked_fill_",
        "zeros", "zeros_like", "empty", "empty_like", "new_zeros", "new_empty", "full", "ones",
        "ones_like", "arange", "add", "iadd", "add_",
        # products, activation, combine
        "linear", "_grouped_mm", "grouped_mm", "grouped_mm_fallback", "bmm", "matmul", "mm", "einsum",
        "silu", "sigmoid", "gelu", "mul", "sum",
        # symbolic shapes from data-dependent ops
        "sym_size", "sym_size.int", "_assert_scalar", "ge", "le", "lt", "gt", "sym_constrain_range_for_size",
        "_check_is_size",
    }
)

_TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-6, torch.bfloat16: 3e-2, torch.float16: 1e-2}


#: Ops allowed only on integer tensors (expert ids): a clamp of activations (GPT-OSS) is not an experts op.
INTEGER_ONLY_OPS = frozenset({"clamp", "clamp_", "clamp_max", "clamp_min"})


def check_ops(region: Region) -> str | None:
    """None if every op in the region is allowed, else the reason naming the first one that is not."""
    bad = sorted(region.ops - ALLOWED_OPS - INTEGER_ONLY_OPS)
    if bad:
        return f"unsupported op {bad[0]!r} inside the experts region"
    for n in sorted(region.nodes, key=lambda n: n.name):
        if op_name(n) in INTEGER_ONLY_OPS:
            v = tensor_value(n.args[0]) if n.args else None
            if v is None or v.dtype.is_floating_point:
                return f"unsupported op {op_name(n)!r} on floating-point values inside the experts region"
    return None


def activation_hypotheses(region: Region) -> list[str]:
    """Gated activations the region may compute, most likely first; empty if none is present."""
    out = []
    if "silu" in region.ops or "sigmoid" in region.ops:
        out.append("silu")
    if "gelu" in region.ops:
        approx = {n.kwargs.get("approximate", "none") for n in region.nodes if op_name(n) == "gelu"}
        out += ["gelu_tanh", "gelu"] if "tanh" in approx else ["gelu", "gelu_tanh"]
    return out


def region_rows_per_token(region: Region) -> int:
    """Expert rows one token costs: K, or E for a dense form that runs every expert on every token."""
    return region.anchors.num_experts if region.form == "dense_bmm" else region.top_k


def _subgraph(region: Region, flow: DataFlow) -> tuple[fx.GraphModule, list[fx.Node]]:
    """The region as a standalone GraphModule; returns it and its input nodes in placeholder order."""
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    inputs: list[fx.Node] = [region.hidden, region.ids, region.weights, *region.anchors.nodes]
    nodes = sorted(region.nodes, key=flow.order.__getitem__)
    extras = []
    for n in nodes:
        for i in n.all_input_nodes:
            if i not in region.nodes and i not in inputs and i not in extras:
                extras.append(i)
    inputs += extras
    for i in inputs:
        env[i] = g.placeholder(f"in_{i.name}")
    for n in nodes:
        env[n] = g.node_copy(n, lambda x: env[x])
    out = region.output_base if region.output_base is not None else region.output
    g.output(env[out])
    return fx.GraphModule(torch.nn.Module(), g), inputs


def _probe_inputs(region: Region, device: torch.device, scale: float, ids: torch.Tensor, gen: torch.Generator):
    """Random hidden states and routing weights for the top-k ``ids`` of one probe run (see :mod:`probe_plan`)."""
    t, h = ids.shape[0], region.anchors.hidden
    hidden = (torch.randn(t, h, generator=gen) * scale).to(device=device, dtype=tensor_value(region.hidden).dtype)
    weights = torch.rand(t, region.top_k, generator=gen) + 0.1
    weights = weights.to(device=device, dtype=tensor_value(region.weights).dtype)
    return hidden, ids.to(device=device, dtype=tensor_value(region.ids).dtype), weights


def _extra_args(
    region: Region, inputs: list[fx.Node], real_value: Callable[[fx.Node], object], plan: ProbePlan
) -> list[object] | str:
    """Values of the subgraph inputs after hidden/ids/weights (expert weights, then sizes), at the
    probe's T; or the reason they cannot be had."""
    args: list[object] = []
    for node in inputs[3:]:
        v = real_value(node)
        if isinstance(v, torch.Tensor):
            args.append(v)
            continue
        traced = node_value(node)
        if isinstance(traced, torch.Tensor):
            return f"no real value for {node.name}"
        sym = traced if isinstance(traced, torch.SymInt) else v
        if isinstance(sym, torch.SymInt):
            try:
                v = symbolic_value(sym, region.num_tokens.node.expr, plan.tokens) if plan.reduced and \
                    isinstance(region.num_tokens, torch.SymInt) else token_hint(sym)
            except ValueError as exc:
                return f"the probe cannot be resized to T={plan.tokens}: {exc}"
            if v is None:
                return f"no concrete value known for {node.name} ({sym})"
        elif isinstance(traced, (torch.SymFloat, torch.SymBool)):
            # A Python float of the model that Dynamo made a graph input (dynamic=True): it may change
            # between calls without a recompile, and the op has no argument for it.
            return f"the region reads {node.name}, a run-time scalar ({traced}) moe_fx::experts has no argument for"
        elif v is None:
            v = traced
        args.append(v)
    return args


def _resize(gm: fx.GraphModule, region: Region, plan: ProbePlan) -> str | None:
    """Make the region subgraph run at the probe's T; None on success, else the reason."""
    if not plan.reduced or isinstance(region.num_tokens, torch.SymInt):
        return None  # same T, or a symbolic T whose size inputs _extra_args evaluates at the new T
    a = region.anchors
    sizes = {a.num_experts, a.num_experts - 1, region.top_k, a.hidden, a.intermediate, 2 * a.intermediate}
    why = resize_literals(gm, int(region.num_tokens), plan.tokens, region.top_k, a.num_experts, sizes)
    if why is None:
        return None
    return (f"{why}; compile with dynamic=True (a symbolic T is resized exactly), raise "
            f"MoEConfig.verify_max_flops, or use verify='always' to check it at its own size")


@dataclass
class ProbeResult:
    """Outcome of :func:`probe_region`: the hypothesis that matched, or why none did."""

    ok: bool
    activation: str = ""
    weights_on_input: bool = False
    error: float = float("nan")
    reason: str = ""


def probe_region(
    region: Region,
    flow: DataFlow,
    real_value: Callable[[fx.Node], object],
    stacked: tuple[torch.Tensor, torch.Tensor],
    activations: list[str],
    plan: ProbePlan,
) -> ProbeResult:
    """Run the region on random inputs and compare with :func:`experts_reference` under each hypothesis.

    ``stacked`` is ``(w13 [E, 2I, H], w2 [E, H, I])`` built from the real weights the way the rewrite
    will pass them to the op. ``plan`` (:func:`~moe_fx.passes.probe_plan.plan_probe`) gives the token
    count and the number of runs; the routing reaches every expert (:func:`probe_routing`).
    """
    gm, inputs = _subgraph(region, flow)
    where = f" ({plan.describe()})"
    bad = _resize(gm, region, plan)
    extras = bad if bad is not None else _extra_args(region, inputs, real_value, plan)
    if isinstance(extras, str):
        return ProbeResult(False, reason=f"no numerical check possible{where}: {extras}")
    w13, w2 = stacked
    device = w13.device
    dtype = tensor_value(region.hidden).dtype
    tol = _TOLERANCE.get(dtype, 3e-2)
    gen = torch.Generator().manual_seed(1234)
    routing = probe_routing(plan.tokens, plan.runs, region.anchors.num_experts, region.top_k, gen)
    probes = [_probe_inputs(region, device, SCALES[r % len(SCALES)], ids, gen) for r, ids in enumerate(routing)]
    # The region runs under the ambient autocast state, as the model does (the reference ignores it;
    # a region whose products autocast recasts is refused before the probe: check_autocast).
    with torch.no_grad():
        outs = []
        for hidden, ids, weights in probes:
            try:
                # The Interpreter, unlike gm(...), does not print the traceback of an expected failure.
                outs.append(fx.Interpreter(gm).run(hidden, ids, weights, *extras))
            except (RuntimeError, ValueError, TypeError, IndexError) as exc:
                return ProbeResult(False, reason=f"the region failed on probe inputs{where}: {exc}")
        best = ProbeResult(False, reason="no activation found in the region")
        for act in activations:
            for on_input in (False, True):
                err = 0.0
                for (hidden, ids, weights), got in zip(probes, outs, strict=True):
                    want = experts_reference(hidden, ids, weights, w13, w2, act, on_input).float()
                    err = max(err, ((got.float() - want).norm() / want.norm().clamp_min(1e-30)).item())
                if err <= tol:
                    return ProbeResult(True, act, on_input, err)
                if not err >= best.error:  # keeps the smallest error (nan compares False)
                    best = ProbeResult(False, act, on_input, err,
                                       f"numerical check failed{where}: relative error {err:.2e} > {tol:.0e} "
                                       f"(best hypothesis: {act}, weights on {'input' if on_input else 'output'})")
        return best
