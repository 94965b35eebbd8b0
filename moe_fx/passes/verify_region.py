"""Is it safe to replace a region by ``moe_fx::experts``? Structural and numerical guards.

* :func:`check_ops` — every op in the region is one an experts computation uses (layout, routing
  plumbing, products, the activation with its clamp / scale / offset, bias adds, the weighted
  combine); anything else (a norm after the experts, ...) keeps the region as the model wrote it.
* :func:`activation_hypotheses` — which activations (:class:`~moe_fx.ops.ExpertActivation`) the
  region can mean, read from its ops and constants (clamp bounds, the sigmoid's scale, the offset
  added to ``up``, strided gate/up slices), most specific first.
* :func:`probe_region` — runs the region itself on random inputs (uneven expert loads that reach
  every expert, two input scales, plus one that drives the first product past every clamp bound in the region) with the
  model's real expert weights and biases and compares it with the op's reference implementation;
  this decides the activation and whether routing weights scale the expert input or output, and
  rejects anything that computes something else.
  How many tokens and runs (the full problem, or a reduced one when that costs too much) is
  :mod:`moe_fx.passes.probe_plan`'s.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.fx as fx

from moe_fx.ops import ExpertActivation, experts_reference
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
    "clamp_bounds",
    "needs_numerics",
    "scalar_hint",
    "specialize_scalars",
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
        "silu", "sigmoid", "gelu", "relu", "square", "pow", "mul", "sum", "clamp", "clamp_min", "clamp_max",
        # data-dependent counts (JetMoE's split sizes from .tolist())
        "item", "sym_sum",
        # symbolic shapes from data-dependent ops
        "sym_size", "sym_size.int", "_assert_scalar", "ge", "le", "lt", "gt", "sym_constrain_range_for_size",
        "_check_is_size",
    }
)

_TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-6, torch.bfloat16: 3e-2, torch.float16: 1e-2}


#: Ops allowed only on integer tensors: index arithmetic (``order.div(K, rounding_mode="trunc")``), and
#: in-place clamps of expert ids (transformers' EP sentinels).
INTEGER_ONLY_OPS = frozenset({"div", "clamp_"})
_CLAMPS = frozenset({"clamp", "clamp_min", "clamp_max"})
#: Most candidates per constant kind (clamp bound, sigmoid scale, offset) a region may offer.
_MAX_CONSTANTS = 2


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


def scalar_hint(a: object) -> float | int | None:
    """``a`` as a Python number: a literal, or a node computing a backed SymFloat / SymInt / SymBool
    (a model float Dynamo made an input under ``dynamic=True``) at the value it was traced with; else None."""
    if isinstance(a, bool):
        return None
    if isinstance(a, (int, float)):
        return a
    if not isinstance(a, fx.Node):
        return None
    v = node_value(a)
    if isinstance(v, (torch.SymFloat, torch.SymInt, torch.SymBool)):
        hint = v.node.hint
        return None if hint is None or isinstance(hint, bool) else hint
    return None


def specialize_scalars(region: Region) -> list[fx.Node]:
    """Guard the graph on the value of every run-time float scalar the region reads or computes (a rewrite
    bakes them into the op's arguments: another value must recompile); returns those nodes."""
    from torch.fx.experimental.symbolic_shapes import guard_float

    out = []
    for n in sorted({*region.nodes, *(a for m in region.nodes for a in m.all_input_nodes)}, key=lambda n: n.name):
        v = node_value(n)
        if isinstance(v, torch.SymFloat) and v.node.hint is not None:
            guard_float(v)
            out.append(n)
    return out


def _float_operand(n: fx.Node) -> tuple[fx.Node, float] | None:
    """``(tensor, constant)`` if ``n`` combines one floating-point tensor with one number (a literal or a
    run-time scalar at its traced value, :func:`scalar_hint`), else None."""
    tensors = [a for a in n.args if isinstance(a, fx.Node) and isinstance(node_value(a), torch.Tensor)]
    numbers = [scalar_hint(a) for a in n.args if not (isinstance(a, fx.Node) and isinstance(node_value(a), torch.Tensor))]
    numbers = [x for x in numbers if x is not None]
    if len(tensors) != 1 or len(numbers) != 1 or len(n.args) != 2:
        return None
    v = tensor_value(tensors[0])
    return (tensors[0], float(numbers[0])) if v is not None and v.dtype.is_floating_point else None


def _in_order(region: Region) -> list[fx.Node]:
    """The region's nodes in graph order (``Region.nodes`` is a set)."""
    return [n for n in region.output.graph.nodes if n in region.nodes]


def clamp_bounds(region: Region) -> list[float]:
    """Magnitudes of the finite bounds of every clamp of floating-point values in the region, sorted."""
    bounds: set[float] = set()
    for n in _in_order(region):
        if op_name(n) not in _CLAMPS or not n.args or tensor_value(n.args[0]) is None:
            continue
        if not tensor_value(n.args[0]).dtype.is_floating_point:
            continue
        values = [scalar_hint(v) for v in (*n.args[1:3], n.kwargs.get("min"), n.kwargs.get("max"))]
        bounds |= {abs(float(v)) for v in values if v is not None and math.isfinite(v)}
    return sorted(bounds)


def _constants(region: Region, op: str) -> list[float]:
    """Distinct finite numbers ``op`` (``mul`` / ``add``) combines with floating-point tensors, in graph order."""
    out: list[float] = []
    for n in _in_order(region):
        if op_name(n) in (op, f"i{op}"):
            pair = _float_operand(n)
            if pair is not None and math.isfinite(pair[1]) and pair[1] not in out:
                out.append(pair[1])
    return out


def _interleaved(region: Region) -> bool:
    """True if the region takes every other column (``h[..., ::2]`` / ``h[..., 1::2]``): GPT-OSS's gate/up rows."""
    for n in _in_order(region):
        if op_name(n) == "getitem" and isinstance(n.args[1], tuple):
            last = n.args[1][-1] if n.args[1] else None
            if isinstance(last, slice) and last.step == 2:
                return True
    return False


def _activation_names(region: Region) -> list[str]:
    names = []
    if "silu" in region.ops or "sigmoid" in region.ops:
        names.append("silu")
    if "gelu" in region.ops:
        approx = {n.kwargs.get("approximate", "none") for n in region.nodes if op_name(n) == "gelu"}
        names += ["gelu_tanh", "gelu"] if "tanh" in approx else ["gelu", "gelu_tanh"]
    if "relu" in region.ops:
        squared = bool(region.ops & {"square", "pow"})
        names += ["relu2", "relu"] if squared else ["relu", "relu2"]
    return names


def activation_hypotheses(region: Region) -> list[ExpertActivation]:
    """Activations the region may compute, most specific first; empty if no activation is present.

    The candidates combine the activation functions present with the constants the region uses: the
    bounds of its clamps (``limit``), numbers multiplied into a sigmoid argument (``alpha``), numbers
    added to a tensor (``up_offset``), and whether gate/up are taken as strided columns (interleaved).
    Every candidate is checked numerically before it is used (see :func:`needs_numerics`).
    """
    gated = region.anchors.gated
    bounds = clamp_bounds(region)
    limits: list[float | None] = list(bounds[:_MAX_CONSTANTS]) if bounds else [None]
    scales = [c for c in _constants(region, "mul") if c > 0 and c != 1.0][:_MAX_CONSTANTS]
    offsets = [c for c in _constants(region, "add") if c != 0.0][:_MAX_CONSTANTS] if gated else []
    layout = "interleaved" if gated and _interleaved(region) else "halves"
    out = []
    for name in _activation_names(region):
        alphas = [*scales, 1.0] if name == "silu" and "sigmoid" in region.ops else [1.0]
        for limit in limits:
            for alpha in alphas:
                for offset in [*offsets, 0.0]:
                    spec = ExpertActivation(name, gated, layout, alpha, limit, offset)
                    if not spec.problems() and spec not in out:
                        out.append(spec)
    return out


def region_rows_per_token(region: Region) -> int:
    """Expert rows one token costs: K, or E for a dense form that runs every expert on every token."""
    return region.anchors.num_experts if region.form == "dense_bmm" else region.top_k


def needs_numerics(region: Region, spec: ExpertActivation) -> str | None:
    """Why ``spec`` may not be taken on the region's structure alone (without the probe), or None.

    The plain forms (SwiGLU/GeGLU halves, no clamp, scale or offset, no bias) are read safely from the
    ops; anything read from constants (a clamp can sit before or after the activation, an offset on
    either half) and any bias must be confirmed numerically.
    """
    if not spec.is_plain or clamp_bounds(region):
        return f"the {spec.describe()} form needs the numerical check"
    if region.biases:
        return "expert biases need the numerical check"
    if region.dense_scores:
        return "dense routing scores need the numerical check"
    return None



def _subgraph(region: Region, flow: DataFlow) -> tuple[fx.GraphModule, list[fx.Node]]:
    """The region as a standalone GraphModule; returns it and its input nodes in placeholder order.

    The inputs start with :attr:`Region.inputs` (hidden, ids and weights or the dense scores, anchors,
    biases), then any other value the region reads (SymInts, constants computed outside).
    """
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    inputs: list[fx.Node] = list(region.inputs)
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
    """Values of the subgraph inputs after the hidden states and the routing ones (``inputs``: expert
    weights, biases, then sizes), at the probe's T; or the reason they cannot be had."""
    args: list[object] = []
    for node in inputs:
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
        elif isinstance(traced, torch.SymBool):
            # specialize_scalars guards floats only: a run-time flag could change without a recompile
            return f"the region reads {node.name}, a run-time flag ({traced}) moe_fx::experts has no argument for"
        elif isinstance(traced, torch.SymFloat):
            # A Python float of the model that Dynamo made a graph input (dynamic=True, e.g. GPT-OSS's
            # alpha and limit): probed at its value; a rewrite specialises the graph on it
            # (specialize_scalars: a guard, so another value recompiles).
            v = scalar_hint(node)
            if v is None:
                return f"the region reads {node.name}, a run-time scalar ({traced}) with no known value"
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


def _routing_args(region: Region, ids: torch.Tensor, weights: torch.Tensor) -> list[torch.Tensor]:
    """What the region reads for the probe's routing: ``[ids, weights]``, or the dense ``[T, E]`` scores."""
    if not region.dense_scores:
        return [ids, weights]
    scores = torch.zeros(ids.shape[0], region.anchors.num_experts, dtype=weights.dtype, device=weights.device)
    return [scores.scatter(1, ids.long(), weights)]


def clamp_probe_scale(region: Region, w13: torch.Tensor) -> float | None:
    """An input scale at which the first product's outputs reach about 3x the region's largest clamp bound.

    Probes at ordinary scales may never reach a clamp (GPT-OSS clamps at 7), and then a clamp placed
    anywhere (before or after the activation, on one half or both) looks like no clamp at all. None
    when the region clamps no floating-point values.
    """
    bounds = clamp_bounds(region)
    if not bounds:
        return None
    # For unit-variance tokens, each output of the first product has standard deviation = its row norm.
    row_norm = w13.float().pow(2).sum(-1).mean().sqrt().item()
    if not row_norm > 0:
        return None
    return 3.0 * bounds[-1] / row_norm


@dataclass
class ProbeResult:
    """Outcome of :func:`probe_region`: the hypothesis that matched, or why none did.

    ``activation`` is the activation's name (``silu``), ``spec`` the whole activation
    (:class:`~moe_fx.ops.ExpertActivation`) when one matched.
    """

    ok: bool
    activation: str = ""
    weights_on_input: bool = False
    error: float = float("nan")
    reason: str = ""
    spec: ExpertActivation | None = None


def probe_region(
    region: Region,
    flow: DataFlow,
    real_value: Callable[[fx.Node], object],
    stacked: tuple[torch.Tensor, torch.Tensor],
    activations: list[ExpertActivation],
    plan: ProbePlan,
    biases: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None),
) -> ProbeResult:
    """Run the region on random inputs and compare with :func:`experts_reference` under each hypothesis.

    ``stacked`` is ``(w13 [E, N1, H], w2 [E, H, I])`` built from the real weights the way the rewrite
    will pass them to the op, ``biases`` the real ``(w13_bias, w2_bias)``. ``plan``
    (:func:`~moe_fx.passes.probe_plan.plan_probe`) gives the token count and the number of runs; the
    routing reaches every expert (:func:`probe_routing`), and one more run drives the first product
    past every clamp bound of the region.
    """
    gm, inputs = _subgraph(region, flow)
    where = f" ({plan.describe()})"
    bad = _resize(gm, region, plan)
    n_routing = 1 if region.dense_scores else 2  # [T, E] scores, or top-k ids and weights
    extras = bad if bad is not None else _extra_args(region, inputs[1 + n_routing:], real_value, plan)
    if isinstance(extras, str):
        return ProbeResult(False, reason=f"no numerical check possible{where}: {extras}")
    w13, w2 = stacked
    b13, b2 = biases
    device = w13.device
    dtype = tensor_value(region.hidden).dtype
    tol = _TOLERANCE.get(dtype, 3e-2)
    gen = torch.Generator().manual_seed(1234)
    routing = probe_routing(plan.tokens, plan.runs, region.anchors.num_experts, region.top_k, gen)
    scales = [SCALES[r % len(SCALES)] for r in range(len(routing))]
    clamp_scale = clamp_probe_scale(region, w13)
    if clamp_scale is not None:
        routing.append(routing[-1])
        scales.append(clamp_scale)
    probes = [_probe_inputs(region, device, s, ids, gen) for s, ids in zip(scales, routing, strict=True)]
    # The region runs under the ambient autocast state, as the model does (the reference ignores it;
    # a region whose products autocast recasts is refused before the probe: check_autocast).
    with torch.no_grad():
        outs = []
        for hidden, ids, weights in probes:
            try:
                # The Interpreter, unlike gm(...), does not print the traceback of an expected failure.
                outs.append(fx.Interpreter(gm).run(hidden, *_routing_args(region, ids, weights), *extras))
            except (RuntimeError, ValueError, TypeError, IndexError) as exc:
                return ProbeResult(False, reason=f"the region failed on probe inputs{where}: {exc}")
        best = ProbeResult(False, reason="no activation found in the region")
        for spec in activations:
            for on_input in (False, True):
                err = 0.0
                for (hidden, ids, weights), got in zip(probes, outs, strict=True):
                    want = experts_reference(
                        hidden, ids, weights, w13, w2, spec.name, on_input, w13_bias=b13, w2_bias=b2,
                        gated=spec.gated, gate_up_layout=spec.gate_up_layout, alpha=spec.alpha, limit=spec.limit,
                        up_offset=spec.up_offset,
                    ).float()
                    err = max(err, ((got.float() - want).norm() / want.norm().clamp_min(1e-30)).item())
                if err <= tol:
                    return ProbeResult(True, spec.name, on_input, err, spec=spec)
                if not err >= best.error:  # keeps the smallest error (nan compares False)
                    best = ProbeResult(False, spec.name, on_input, err,
                                       f"numerical check failed{where}: relative error {err:.2e} > {tol:.0e} "
                                       f"(best hypothesis: {spec.describe()}, weights on "
                                       f"{'input' if on_input else 'output'})")
        return best
