"""The graph pass's numerical check of a region: the region itself, run in float32 against the op's reference.

The structure decides what a region computes (:func:`~moe_fx.passes.recognize.read_form.read_form`); this module
confirms it with the verification toolkit (:mod:`~moe_fx.verify.check_numerics`): the region is cut into a
standalone graph, upcast to float32 when it is low precision (inputs upcast, the dtype casts inside redirected
to float32, ``torch._grouped_mm`` run per group), and run on the toolkit's cases, with the model's real expert
weights and with random ones of the same shapes; a symbolic token count is also run well above its traced
value. How many tokens and runs is :mod:`~moe_fx.verify.probe_plan`'s; a static graph probed at another token
count has its literals resized there.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.fx as fx

from moe_fx.ops import ExpertActivation
from moe_fx.passes.graph_utils import DataFlow, node_value, scalar_hint, tensor_value
from moe_fx.passes.recognize.extract_region import Region
from moe_fx.passes.recognize.probe_resize import resize_literals, symbolic_value
from moe_fx.passes.recognize.read_form import FormReading, expert_id_bound, region_boundary
from moe_fx.verify.check_numerics import (
    NumericsResult,
    OpWeights,
    ProbeCase,
    Semantics,
    check_cases,
    clamp_scale,
    large_tokens,
    make_cases,
    out_of_range_cases,
    random_weight,
)
from moe_fx.verify.probe_plan import ProbePlan, probe_routing, token_hint

__all__ = ["ProbeResult", "probe_region", "region_rows_per_token", "specialize_scalars"]

log = logging.getLogger("moe_fx.passes")

#: Large-T runs of a symbolic region (random weights; uniform and skewed loads).
LARGE_T_RUNS = 2
_LOW_PRECISION = (torch.bfloat16, torch.float16)


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


def region_rows_per_token(region: Region) -> int:
    """Expert rows one token costs: K, or E for a dense form that runs every expert on every token."""
    return region.anchors.num_experts if region.form == "dense_bmm" else region.top_k


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


def _grouped_mm_float(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor | None = None, bias=None,
                      out_dtype=None) -> torch.Tensor:
    """``torch._grouped_mm`` in any float dtype (it takes bf16 only on some devices): rows ``offs[e-1]:offs[e]``
    of ``a [R, K]`` times ``b[e] [K, N]``; without ``offs``, a batched product."""
    if bias is not None:
        raise ValueError("_grouped_mm_float: bias is not supported")
    if offs is None or a.dim() != 2:
        return torch.matmul(a, b.to(a.dtype))
    out = a.new_zeros(a.shape[0], b.shape[-1])
    start = 0
    for e, end in enumerate(offs.tolist()):
        if end > start:
            out[start:end] = a[start:end] @ b[e].to(a.dtype)
        start = end
    return out


#: Ops through which an expert weight is still the whole weight (a view): its float32 cast goes after them.
_WEIGHT_VIEWS = frozenset({"transpose", "t", "permute", "view", "reshape", "unsqueeze", "squeeze", "expand", "T", "mT"})


def _upcast(gm: fx.GraphModule, weights: list[fx.Node]) -> None:
    """Make a low-precision region subgraph compute in float32: its dtype constants and casts
    (``.to(torch.bfloat16)``, ``.half()``, ``dtype=`` of factories) name float32, ``torch._grouped_mm``
    (bf16 only on CPU) runs per group (:func:`_grouped_mm_float`), and the expert weights (placeholders
    ``weights``, given in their own dtype) are cast where they are used (:func:`_cast_weights_late`)."""

    def fp32(a: object) -> object:
        return torch.float32 if isinstance(a, torch.dtype) and a in _LOW_PRECISION else a

    for n in gm.graph.nodes:
        n.args = fx.node.map_aggregate(n.args, fp32)
        n.kwargs = fx.node.map_aggregate(n.kwargs, fp32)
        if n.op == "call_method" and n.target in ("bfloat16", "half"):
            n.target = "float"
        if n.op == "call_function" and n.target is torch._grouped_mm:
            n.target = _grouped_mm_float
    _cast_weights_late(gm, weights)
    gm.recompile()


def _cast_weights_late(gm: fx.GraphModule, weights: list[fx.Node]) -> None:
    """A float32 cast of each expert weight where it is consumed, after its views and its row or expert selection
    (``w13[ids]``: only the rows a run gathers are copied), never of the whole stack before (which would double the
    experts' memory on a large model). The per-group product (:func:`_grouped_mm_float`) casts group by group."""
    g = gm.graph
    frontier = list(weights)
    while frontier:
        n = frontier.pop()
        for u in list(n.users):
            name = u.target if u.op == "call_method" else getattr(u.target, "__name__", "")
            if name in _WEIGHT_VIEWS:
                frontier.append(u)
            elif u.target is _grouped_mm_float:
                continue
            elif name in ("getitem", "index_select"):
                with g.inserting_after(u):
                    cast = g.call_method("float", (u,))
                u.replace_all_uses_with(cast, delete_user_cb=lambda user, cast=cast: user is not cast)
            else:
                with g.inserting_before(u):
                    cast = g.call_method("float", (n,))
                u.replace_input_with(n, cast)


def _extra_args(
    region: Region, inputs: list[fx.Node], real_value: Callable[[fx.Node], object], tokens: int
) -> list[object] | str:
    """Values of the subgraph inputs after the weights (``inputs``: sizes, scalars, constants computed outside),
    at ``tokens`` tokens; or the reason they cannot be had."""
    args: list[object] = []
    symbolic = isinstance(region.num_tokens, torch.SymInt)
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
                v = symbolic_value(sym, region.num_tokens.node.expr, tokens) if symbolic and \
                    tokens != token_hint(region.num_tokens) else token_hint(sym)
            except ValueError as exc:
                return f"the probe cannot be resized to T={tokens}: {exc}"
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


@dataclass
class ProbeResult:
    """Outcome of the guards: the reading that is rewritten, or why not.

    ``activation`` is the activation's name (``silu``), ``spec`` the whole activation
    (:class:`~moe_fx.ops.ExpertActivation`) when the region is rewritten.
    """

    ok: bool
    activation: str = ""
    weights_on_input: bool = False
    error: float = float("nan")
    reason: str = ""
    spec: ExpertActivation | None = None
    probe: str = ""  # what the numerical check ran, for reports ("T=14 x3, real and random weights")


def _random_set(region: Region, real: dict[fx.Node, torch.Tensor], gen: torch.Generator) -> dict[fx.Node, torch.Tensor]:
    """Random float32 weights and biases of the real shapes, for every anchor and bias of the region."""
    views = region_boundary(region).weights_of
    out = {}
    for node, t in real.items():
        axes = views[node].axes
        fan_in = t.shape[axes.index("i")] if "i" in axes else 4
        out[node] = random_weight(tuple(t.shape), fan_in, gen, device=t.device)
    return out


def probe_region(
    region: Region,
    flow: DataFlow,
    real_value: Callable[[fx.Node], object],
    reading: FormReading,
    plan: ProbePlan,
    op_weights: Callable[[list[torch.Tensor]], tuple[torch.Tensor, torch.Tensor]],
    real_weights: bool = True,
) -> ProbeResult:
    """Run the region on the toolkit's cases and compare it with the reference for ``reading``.

    ``op_weights`` builds the op's ``(w13, w2)`` from the region's anchor tensors (in
    ``region.anchors.nodes`` order), the way the rewrite passes them; it is applied to the real weights
    and to random ones alike. ``plan`` gives the token count and the runs (:func:`probe_plan.plan_probe`).
    ``real_weights=False``: only random weights of the real shapes (the real tensors' values are not read; an
    expert-parallel recompile, whose weights hold this rank's experts only).
    """
    gm, inputs = _subgraph(region, flow)
    where = f" ({plan.describe()})"
    bad = _resize(gm, region, plan)
    if bad is not None:
        return ProbeResult(False, reason=f"no numerical check possible{where}: {bad}")
    n_routing = 1 if region.dense_scores else 2  # [T, E] scores, or top-k ids and weights
    weight_nodes = [*region.anchors.nodes, *region.biases]
    if tensor_value(region.hidden).dtype in _LOW_PRECISION:
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        _upcast(gm, placeholders[1 + n_routing : 1 + n_routing + len(weight_nodes)])
    real = {}
    for node in weight_nodes:
        v = real_value(node)
        if not isinstance(v, torch.Tensor):
            return ProbeResult(False, reason=f"no numerical check possible: the real value of {node.name} is not "
                                             "available to the pass")
        real[node] = v  # in its own dtype: the subgraph casts what a run reads (_cast_weights_late)
    extra_nodes = inputs[1 + n_routing + len(weight_nodes):]
    device = next(iter(real.values())).device
    gen = torch.Generator().manual_seed(1234)
    sets = {"real": real, "random": _random_set(region, real, gen)}
    if not real_weights:
        del sets["real"]  # only their shapes were used
    sem = Semantics(reading.spec, reading.weights_on_input)
    ops = {name: _op_weights(region, ws, op_weights) for name, ws in sets.items()}
    clamps = {name: clamp_scale(op.w13, reading.spec.limit) for name, op in ops.items()}
    e, k, h = region.anchors.num_experts, region.top_k, region.anchors.hidden
    routing = probe_routing(plan.tokens, plan.runs, e, k, gen)
    cases = make_cases(routing, h, clamps, gen, device=device)
    ran = f"{plan.describe()}, " + ("real and random weights" if real_weights else
                                    "random weights only (the real ones are split across ranks)")
    if isinstance(region.num_tokens, torch.SymInt) and region.num_tokens.node.hint is not None:
        big = large_tokens(e, k)
        if big > plan.tokens:
            cases += make_cases(probe_routing(big, LARGE_T_RUNS, e, k, gen), h, {"random": clamps["random"]}, gen,
                                device=device)
            ran += f", T={big} x{LARGE_T_RUNS}"
    if region.ids is not None and not region.dense_scores and expert_id_bound(region.ids)[0] is None:
        # Nothing in the graph keeps the ids in [0, E): the region must skip the others as the op does.
        cases += out_of_range_cases(cases, e, gen)
        ran += f", ids -1 and {e} in some slots"
    extras: dict[int, list[object] | str] = {}

    def run(case: ProbeCase) -> torch.Tensor | str:
        t = case.hidden.shape[0]
        if t not in extras:
            extras[t] = _extra_args(region, extra_nodes, real_value, t)
        if isinstance(extras[t], str):
            return extras[t]
        ids = case.ids.to(tensor_value(region.ids).dtype) if region.ids is not None else case.ids
        ws = sets[case.weights]
        args = [case.hidden, *_routing_args(region, ids, case.routing), *(ws[n] for n in weight_nodes), *extras[t]]
        try:
            out = gm.forward(*args)  # not gm(...): that prints the traceback of an expected failure

        except (RuntimeError, ValueError, TypeError, IndexError) as exc:
            return str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
        return out.float() if out.dtype in _LOW_PRECISION else out

    result: NumericsResult = check_cases(run, ops.__getitem__, sem, cases, where)
    if not result.ok:
        return ProbeResult(False, reading.spec.name, reading.weights_on_input, result.error, result.reason, probe=ran)
    return ProbeResult(True, reading.spec.name, reading.weights_on_input, result.error, spec=reading.spec, probe=ran)


def _op_weights(region: Region, ws: dict[fx.Node, torch.Tensor],
                build: Callable[[list[torch.Tensor]], tuple[torch.Tensor, torch.Tensor]]) -> OpWeights:
    w13, w2 = build([ws[n] for n in region.anchors.nodes])
    b13 = None if region.w13_bias is None else ws[region.w13_bias]
    b2 = None if region.w2_bias is None else ws[region.w2_bias]
    return OpWeights(w13, w2, b13, b2)
