"""Is it safe to replace a region by ``moe_fx::experts``? Structural and numerical guards.

* :func:`check_ops` — every op in the region is one an experts computation uses (layout, routing
  plumbing, products, the gated activation, the weighted combine); anything else (a clamp, a bias,
  a norm after the experts, ...) keeps the region as the model wrote it.
* :func:`activation_hypotheses` — which gated activations the region can mean.
* :func:`probe_region` — runs the region itself on random inputs (uneven expert loads, two input
  scales) with the model's real expert weights and compares it with the op's reference
  implementation; this decides the activation and whether routing weights scale the expert input
  or output, and rejects anything that computes something else.
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

__all__ = ["ALLOWED_OPS", "ProbeResult", "activation_hypotheses", "check_ops", "estimate_probe_flops", "probe_region"]

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


def _hint(v: object) -> int:
    if isinstance(v, torch.SymInt):
        hint = v.node.hint
        if hint is None:
            raise ValueError(f"no concrete value known for {v}")
        return int(hint)
    return int(v)


def estimate_probe_flops(region: Region) -> float:
    """Flops of one probe run: every routed token through one expert (dense forms: through all)."""
    a = region.anchors
    t = _hint(region.num_tokens)
    rows = t * a.num_experts if region.form == "dense_bmm" else t * region.top_k
    return 6.0 * rows * a.hidden * a.intermediate


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


def _probe_inputs(region: Region, device: torch.device, scale: float, gen: torch.Generator):
    t, h, e, k = _hint(region.num_tokens), region.anchors.hidden, region.anchors.num_experts, region.top_k
    hidden = (torch.randn(t, h, generator=gen) * scale).to(device=device, dtype=tensor_value(region.hidden).dtype)
    # Skewed random top-k: some experts get many tokens, some none.
    logits = torch.rand(t, e, generator=gen) + torch.linspace(0, 4, e) * (torch.rand(e, generator=gen) > 0.3)
    ids = logits.topk(k, dim=-1).indices.to(device=device, dtype=tensor_value(region.ids).dtype)
    weights = (torch.rand(t, k, generator=gen) + 0.1).to(device=device, dtype=tensor_value(region.weights).dtype)
    return hidden, ids, weights


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
) -> ProbeResult:
    """Run the region on random inputs and compare with :func:`experts_reference` under each hypothesis.

    ``stacked`` is ``(w13 [E, 2I, H], w2 [E, H, I])`` built from the real weights the way the rewrite
    will pass them to the op.
    """
    gm, inputs = _subgraph(region, flow)
    w13, w2 = stacked
    device = w13.device
    dtype = tensor_value(region.hidden).dtype
    tol = _TOLERANCE.get(dtype, 3e-2)
    gen = torch.Generator().manual_seed(1234)
    probes = [_probe_inputs(region, device, s, gen) for s in (1.0, 4.0)]
    with torch.no_grad():
        outs = []
        for hidden, ids, weights in probes:
            args: list[object] = [hidden, ids, weights]
            for node in inputs[3:]:
                v = real_value(node)
                if isinstance(v, torch.SymInt):
                    v = _hint(v)
                if v is None:
                    v = node_value(node)
                    if isinstance(v, torch.Tensor):
                        return ProbeResult(False, reason=f"no real value for {node.name}")
                    v = _hint(v)
                args.append(v)
            try:
                # The Interpreter, unlike gm(...), does not print the traceback of an expected failure.
                outs.append(fx.Interpreter(gm).run(*args))
            except (RuntimeError, ValueError, TypeError, IndexError) as exc:
                return ProbeResult(False, reason=f"the region failed on probe inputs: {exc}")
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
                                       f"numerical check failed: relative error {err:.2e} > {tol:.0e} "
                                       f"(best hypothesis: {act}, weights on {'input' if on_input else 'output'})")
        return best
