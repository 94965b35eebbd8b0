"""The pass ``rewrite_moe_regions``: replace every recognised experts region by ``moe_fx::experts``.

For each group of expert weights (:mod:`find_experts`), cut out the region from routing results to
combined output (:mod:`extract_region`), check it (:mod:`~moe_fx.passes.recognize.verify_region`), and if every guard says
yes, insert one ``torch.ops.moe_fx.experts`` call and delete the region. Routing stays as written.

Per-expert weights (``nn.ModuleList`` experts) are stacked once into ``w13 [E, 2I, H]`` and
``w2 [E, H, I]``; the module's own parameters are then made to alias their slots of the stacked
tensors, so no second copy of the experts stays in memory, and a check before every call keeps it so
(:mod:`moe_fx.passes.expert_storage`). Experts that share a weight (tied parameters) are left as
written: their stack would need a second copy of it. Stacked weights are used as they are (a transposed layout is
passed as a transposed view, not copied).
"""

from __future__ import annotations

import logging
import math
import re

import torch
import torch.fx as fx

from moe_fx.ops import ExpertActivation
from moe_fx.passes.context import PassContext
from moe_fx.passes.expert_storage import PerExpertSync, WeightSources, share_storage, stack_per_expert
from moe_fx.passes.graph_utils import (
    DataFlow,
    add_weight_buffer,
    clean_module_path,
    experts_module_of,
    fake_mode_of,
    module_stack,
    tensor_value,
)
from moe_fx.passes.recognize.autocast_guard import check_autocast
from moe_fx.passes.recognize.extract_region import Region, expert_products, extract_region
from moe_fx.passes.recognize.find_experts import ExpertAnchors, find_expert_weights
from moe_fx.passes.recognize.near_misses import per_expert_near_misses
from moe_fx.passes.recognize.read_form import FormReading, expert_id_bound, read_region
from moe_fx.passes.recognize.verify_region import ProbeResult, probe_region, region_rows_per_token, specialize_scalars
from moe_fx.passes.report import RegionReport
from moe_fx.passes.split_ep import ep_weights_freed
from moe_fx.verify.probe_plan import ProbePlan, plan_probe, token_hint, tokens_text

__all__ = ["rewrite_moe_regions"]

log = logging.getLogger("moe_fx.passes")


def _common_module(a: fx.Node, b: fx.Node) -> tuple[str, str]:
    """The innermost module around both ``a`` and ``b`` (JetMoE keeps w13 and w2 in two sibling modules)."""
    inner = ("", "")
    for x, y in zip(module_stack(a), module_stack(b)):
        if clean_module_path(x[0]) != clean_module_path(y[0]):
            break
        inner = x
    return inner


_FAMILY_SUFFIXES = ("Experts", "SparseMoeBlock", "SparseMoEBlock", "MoE", "Moe")


def _family(cls: str) -> str:
    """``GptOss`` from ``GptOssExperts``, ``JetMoe`` from ``JetMoeMoE``; ``""`` for other classes."""
    for suffix in _FAMILY_SUFFIXES:
        if cls.endswith(suffix) and len(cls) > len(suffix):
            return cls[: -len(suffix)]
    return ""


def _per_expert_values(anchors: ExpertAnchors, ctx: PassContext) -> list[torch.Tensor] | None:
    """The real gate, up and down weights of every expert (E each, in that order), or None."""
    values = [ctx.real_value(n) for n in anchors.gate + anchors.up + anchors.down]
    return values if all(isinstance(t, torch.Tensor) for t in values) else None


def _stacked_weights(region: Region, ctx: PassContext) -> tuple[torch.Tensor, torch.Tensor] | None:
    a = region.anchors
    if a.kind == "per_expert":
        values = _per_expert_values(a, ctx)
        if values is None:
            return None
        e = a.num_experts
        return stack_per_expert(values[:e], values[e : 2 * e], values[2 * e :])
    w13, w2 = ctx.real_value(a.w13), ctx.real_value(a.w2)
    if not isinstance(w13, torch.Tensor) or not isinstance(w2, torch.Tensor):
        return None
    return (w13.transpose(1, 2), w2.transpose(1, 2)) if a.transposed else (w13, w2)


def _keep_weights_in_step(region: Region, ctx: PassContext, stacked: tuple[torch.Tensor, torch.Tensor]) -> str:
    """Per-expert weights: after compiling, make the parameters alias their slots of the stacks, and check
    before every call that they still do (:mod:`expert_storage`). Returns a warning when that cannot be
    guaranteed (a parameter the pass cannot find again at call time), else ``""``."""
    a = region.anchors
    if a.kind != "per_expert":
        return ""
    e, (w13, w2) = a.num_experts, stacked
    values = _per_expert_values(a, ctx)
    refs = [ctx.input_ref(n) for n in a.gate + a.up + a.down]
    ctx.after_compile.append(lambda: share_storage(values[:e], values[e : 2 * e], values[2 * e :], w13, w2))
    if any(r is None for r in refs):
        return ("per-expert weights were stacked at compile time and some cannot be found at call time: "
                "replacing or reloading them with assign=True is not seen by this compiled graph")
    ctx.call_checks.append(PerExpertSync(refs, w13, w2))
    return ""


def _weight_sources(region: Region, ctx: PassContext, stacked: tuple[torch.Tensor, torch.Tensor]) -> WeightSources:
    """The model's own weight tensors the op's weights come from (as graph input positions or
    tensors, see :data:`~moe_fx.passes.expert_storage.TensorRef`), how to build the op's ``(w13, w2)``
    from them, and what to sample: what a later pass that makes new weights (fp8) re-reads."""
    a = region.anchors
    if a.kind == "per_expert":
        refs = [ctx.input_ref(n) for n in a.gate + a.up + a.down]
        e = a.num_experts
        # The parameters view the stacks (kept so by PerExpertSync, which runs first): sample the stacks.
        return WeightSources(refs, lambda ts: stack_per_expert(ts[:e], ts[e : 2 * e], ts[2 * e :]), list(stacked))
    refs = [ctx.input_ref(a.w13), ctx.input_ref(a.w2)]
    if a.transposed:
        return WeightSources(refs, lambda ts: (ts[0].transpose(1, 2), ts[1].transpose(1, 2)), refs)
    return WeightSources(refs, lambda ts: (ts[0], ts[1]), refs)


def _insert_op(
    gm: fx.GraphModule, flow: DataFlow, region: Region, probe: ProbeResult, ctx: PassContext,
    stacked: tuple[torch.Tensor, torch.Tensor], index: int, report_index: int,
) -> fx.Node:
    g = gm.graph
    a = region.anchors
    with g.inserting_before(region.output):
        if a.kind == "per_expert":
            w13, w2 = stacked
            w13_node = add_weight_buffer(gm, f"moe_fx_w13_{index}", w13, region.hidden)
            w2_node = add_weight_buffer(gm, f"moe_fx_w2_{index}", w2, region.hidden)
        elif a.transposed:
            w13_node = g.call_method("transpose", (a.w13, 1, 2))
            w2_node = g.call_method("transpose", (a.w2, 1, 2))
            w13_node.meta["example_value"] = tensor_value(a.w13).transpose(1, 2)
            w2_node.meta["example_value"] = tensor_value(a.w2).transpose(1, 2)
        else:
            w13_node, w2_node = a.w13, a.w2
        weights_node = _gather_scores(g, region) if region.dense_scores else region.weights
        kwargs = {"activation": probe.activation, "weights_on_input": probe.weights_on_input,
                  "kernel_choice": ctx.config.kernel, **_variant_kwargs(region, probe.spec)}
        op = g.call_function(
            torch.ops.moe_fx.experts.default,
            (region.hidden, region.ids, weights_node, w13_node, w2_node),
            kwargs,
        )
    fake_args = [tensor_value(n) for n in (region.hidden, region.ids, weights_node, w13_node, w2_node)]
    fake_kwargs = {k: tensor_value(v) if isinstance(v, fx.Node) else v for k, v in kwargs.items()}
    mode = fake_mode_of(fake_args)
    with mode if mode is not None else torch.no_grad():
        op.meta["example_value"] = torch.ops.moe_fx.experts.default(*fake_args, **fake_kwargs)
    for key in ("nn_module_stack", "stack_trace", "source_fn_stack"):
        if key in region.output.meta:
            op.meta[key] = region.output.meta[key]
    # report_index lets later passes (quantize_experts) update this region's entry in ctx.report.
    op.meta["moe_fx"] = {"form": region.form, "E": a.num_experts, "K": region.top_k, "report_index": report_index}
    for reader in region.output_readers(flow):
        reader.replace_input_with(region.output, op)
        if region.output_base is not None:
            reader.replace_input_with(region.output_base, op)
    for n in sorted(region.nodes, key=flow.order.__getitem__, reverse=True):
        g.erase_node(n)
    return op


def _variant_kwargs(region: Region, spec: ExpertActivation | None) -> dict[str, object]:
    """The op's keyword arguments beyond the plain SwiGLU ones: biases and the activation variant."""
    out: dict[str, object] = {}
    if region.w13_bias is not None:
        out["w13_bias"] = region.w13_bias
    if region.w2_bias is not None:
        out["w2_bias"] = region.w2_bias
    if spec is None:
        return out
    default = ExpertActivation(spec.name)
    for name in ("gated", "gate_up_layout", "alpha", "limit", "up_offset"):
        if getattr(spec, name) != getattr(default, name):
            out[name] = getattr(spec, name)
    return out


def _gather_scores(g: fx.Graph, region: Region) -> fx.Node:
    """``scores.gather(1, ids)``: the top-k routing weights of a dense ``[T, E]`` score matrix (Llama 4)."""
    node = g.call_method("gather", (region.weights, 1, region.ids))
    scores, ids = tensor_value(region.weights), tensor_value(region.ids)
    mode = fake_mode_of([scores, ids])
    with mode if mode is not None else torch.no_grad():
        node.meta["example_value"] = scores.gather(1, ids)
    return node


def _param_path(node: fx.Node) -> str:
    """``experts.3.down_proj.weight`` from Dynamo's ``l_self_modules_experts_modules_3_..._weight_``."""
    if node.op == "get_attr":
        return str(node.target)
    name = re.sub(r"^[lL]_self_", "", node.name).rstrip("_")
    return re.sub(r"_(modules|parameters|buffers)_", ".", "_" + name).lstrip("._")


def _tied_weights(anchors: ExpertAnchors) -> str | None:
    """Why a group whose experts share a weight (one Parameter in two slots) is left as written, or None.

    The op reads one stacked ``[E, 2I, H]`` / ``[E, H, I]`` copy with a slot per expert: a tie would need
    the shared weight twice in the stacks (a second copy), and an in-place edit of the shared parameter
    would then reach one slot only. Ties are rare enough that leaving the block as written is the sound
    answer; the numerical probe could not run them either (one graph input in two places).
    """
    if anchors.kind != "per_expert":
        return None
    if anchors.repeated:
        return (f"tied expert weights: the graph runs expert {anchors.repeated[0]}'s weights in more than one "
                "expert slot (one module in two places of the ModuleList); stacking them would need a second copy")
    seen: dict[fx.Node, str] = {}
    for role, nodes in (("gate", anchors.gate), ("up", anchors.up), ("down", anchors.down)):
        for e, node in enumerate(nodes):
            here = f"expert {e}'s {role}"
            if node in seen:
                return (f"tied expert weights: {seen[node]} and {here} projection are one parameter "
                        f"({_param_path(node)}); stacking them would need a second copy of it")
            seen[node] = here
    return None


def _report_for(anchors: ExpertAnchors, region: Region | None) -> RegionReport:
    path, cls = experts_module_of(region.output) if region is not None else ("", "")
    if not cls.endswith("Experts"):
        # No experts module around the output: name the region after its weights' owner, or the
        # module around both weights when each lives in its own (JetMoE's input_linear / output_linear).
        owners = [next(iter(w.users), w) for w in (anchors.w13, anchors.w2) if w is not None]
        owners = owners or [next(iter(anchors.nodes[-1].users), anchors.nodes[-1])]
        split = len({experts_module_of(o)[0] for o in owners}) > 1
        wpath, wcls = _common_module(*owners) if split else experts_module_of(owners[-1])
        if wpath and (split or wcls.endswith("Experts")) or not path:
            path, cls = wpath, wcls
    if anchors.kind == "per_expert" and not cls.endswith("Experts"):
        path = re.sub(r"\.\d+\.[^.]+\.weight$", "", _param_path(anchors.down[0]))
        cls = ""
    family = _family(cls)
    layer = clean_module_path(path) or ".".join(_param_path(anchors.nodes[-1]).split(".")[:-1]) or _param_path(anchors.nodes[-1])
    return RegionReport(
        layer=layer, family=family, num_experts=anchors.num_experts,
        hidden=anchors.hidden, intermediate=anchors.intermediate,
    )


def _details(region: Region, spec: ExpertActivation | None) -> str:
    """What the op computes beyond plain SwiGLU, for reports: the activation variant, biases, dense scores."""
    parts = [] if spec is None or spec.is_plain else [spec.describe()]
    if region.biases:
        named = (("w13", region.w13_bias), ("w2", region.w2_bias))
        parts.append("biases " + "+".join(k for k, b in named if b is not None))
    if region.dense_scores:
        parts.append(f"dense [T, E] scores reduced to the router's top-{region.top_k}")
    return "; ".join(parts)


def _weights_freed(anchors: ExpertAnchors, ctx: PassContext) -> bool:
    """True if ``split_ep`` already reduced these expert weights to this rank's experts (an earlier compile under
    expert parallelism): the other experts' rows are gone, so their values must not be read."""
    values = [ctx.real_value(n) for n in anchors.nodes]
    return any(isinstance(v, torch.Tensor) and ep_weights_freed(v) for v in values)


def _probe_plan(region: Region, ctx: PassContext, stacked) -> ProbePlan | str:
    """The numerical check this region gets, or why it gets none (``verify="never"``)."""
    if ctx.config.verify == "never":
        return "verify='never'"
    budget = ctx.config.verify_max_flops
    if stacked[0].device.type != "cpu":
        budget *= 1000  # an accelerator runs the probe in milliseconds at prefill sizes
    a = region.anchors
    return plan_probe(token_hint(region.num_tokens), region_rows_per_token(region), a.num_experts, region.top_k,
                      a.hidden, a.intermediate, budget, ctx.config.verify)


def _next_layer_start(flow: DataFlow, anchors: ExpertAnchors, groups: list[ExpertAnchors]) -> fx.Node | None:
    """The earliest expert product of another group of expert weights after ``anchors``' products (the next
    MoE layer), or None."""
    own = expert_products(flow, anchors)
    if not own:
        return None
    last = max(flow.order[m] for m in own)
    later = [m for g in groups if g is not anchors for m in expert_products(flow, g) if flow.order[m] > last]
    return min(later, key=flow.order.__getitem__, default=None)


def _guard(region: Region, ctx: PassContext, flow: DataFlow, stacked: tuple[torch.Tensor, torch.Tensor],
           plan: ProbePlan | str, real_weights: bool = True) -> ProbeResult:
    """Is it safe? The structure proves what the region computes (:func:`~moe_fx.passes.recognize.read_form.read_region`),
    then the numerical check confirms it (:func:`~moe_fx.passes.recognize.verify_region.probe_region`).

    ``plan`` is the numerical check to run (:func:`_probe_plan`); a string (the reason there is none) rewrites
    on the structure alone, which the report marks unverified. ``real_weights=False`` checks with random weights
    of the real shapes only (weights split across ranks by an earlier compile).
    """
    bad = check_autocast(region)
    if bad:
        return ProbeResult(False, reason=bad)
    reading = read_region(region)
    if not isinstance(reading, FormReading):
        return ProbeResult(False, reason=reading)
    if isinstance(plan, str):
        return ProbeResult(True, reading.spec.name, reading.weights_on_input, reason="structure", spec=reading.spec)
    return probe_region(region, flow, ctx.real_value, reading, plan, _weight_sources(region, ctx, stacked).build,
                        real_weights)


def _refuse_split(anchors: ExpertAnchors, ctx: PassContext, report: RegionReport) -> None:
    """A region left as written must be able to run: not when its weights hold only this rank's experts (split by
    an earlier compile under expert parallelism, the other rows freed). Raises then, with the reason."""
    if _weights_freed(anchors, ctx):
        raise RuntimeError(
            f"moe_fx: {report.layer} cannot be rewritten ({report.reason}), and its expert weights hold only this "
            "rank's experts (split across ranks by an earlier compile under expert parallelism): the block as "
            "written would read experts that are not there. Compile the model as it was compiled first."
        )


def _record_verification(report: RegionReport, plan: ProbePlan | str, probe: ProbeResult) -> None:
    """Say in the report how the region was checked: probe size and error, or that it was not."""
    if isinstance(plan, str):
        if probe.ok:
            report.verified = "unverified"
            report.warnings.append(f"rewritten without a numerical check ({plan}): if the region computes "
                                   "something else than moe_fx::experts, the compiled model is wrong")
        return
    if probe.ok or not math.isnan(probe.error):  # the probe ran (a failed structural check runs none)
        report.probe, report.probe_error = probe.probe or plan.describe(), probe.error
    if probe.ok:
        report.verified = "numerics"


def rewrite_moe_regions(gm: fx.GraphModule, ctx: PassContext) -> int:
    """Replace every verified experts region of ``gm`` by ``moe_fx::experts``; return how many."""
    if not ctx.config.enabled:
        return 0
    count = 0
    flow = DataFlow(gm.graph)
    groups = find_expert_weights(gm.graph, flow)
    for near_miss in per_expert_near_misses(gm.graph, (n for a in groups for n in a.nodes)):
        ctx.report.append(near_miss)
        log.info("moe_fx: left %s untouched: %s", near_miss.layer, near_miss.reason)
    for anchors in groups:
        tied = _tied_weights(anchors)
        if tied is not None:
            report = _report_for(anchors, None)
            report.form, report.reason = "expert_loop", tied
            ctx.report.append(report)
            log.info("moe_fx: left %s untouched: %s", report.layer, tied)
            continue
        found = extract_region(flow, anchors, _next_layer_start(flow, anchors, groups))
        region = found if isinstance(found, Region) else None
        if region is None and anchors.kind == "per_expert" and "expert" not in anchors.name.lower():
            # SwiGLU MLPs under a ModuleList that is not named as experts and that no routing feeds
            # (LongCat-Flash's two dense MLPs per layer): not an MoE layer, nothing to report.
            log.debug("moe_fx: %s is not an MoE layer: %s", anchors.name, found)
            continue
        report = _report_for(anchors, region)
        ctx.report.append(report)
        if region is None:
            report.reason = str(found)
            _refuse_split(anchors, ctx, report)
            log.info("moe_fx: left %s untouched: %s", report.layer, report.reason)
            continue
        report.form, report.top_k = region.form, region.top_k
        report.tokens = tokens_text(region.num_tokens)
        report.dtype = str(tensor_value(region.hidden).dtype).replace("torch.", "")
        report.device = tensor_value(region.hidden).device.type
        stacked = _stacked_weights(region, ctx)
        if stacked is None:
            report.reason = "the real expert weights are not available to the pass"
            continue
        plan = _probe_plan(region, ctx, stacked)
        probe = _guard(region, ctx, flow, stacked, plan, real_weights=not _weights_freed(anchors, ctx))
        _record_verification(report, plan, probe)
        if not probe.ok:
            report.reason = probe.reason
            _refuse_split(anchors, ctx, report)
            log.info("moe_fx: left %s untouched: %s", report.layer, report.reason)
            continue
        specialize_scalars(region)  # the op's arguments take the traced values of model floats
        warning = _keep_weights_in_step(region, ctx, stacked)
        if warning:
            report.warnings.append(warning)
        bound, why = expert_id_bound(region.ids)
        if bound is None:  # read_region refused ids that can pass E; here nothing says they cannot
            report.warnings.append(f"the graph gives no bound on the expert ids ({why}): ids outside "
                                   f"[0, {region.anchors.num_experts}) are skipped, as the region skips them or "
                                   "raises on them (checked with ids -1 and E)")
        _insert_op(gm, flow, region, probe, ctx, stacked, count, len(ctx.report) - 1)
        ctx.weight_sources[len(ctx.report) - 1] = _weight_sources(region, ctx, stacked)
        report.matched, report.activation, report.weights_on_input = True, probe.activation, probe.weights_on_input
        report.details = _details(region, probe.spec)
        count += 1
        log.info("moe_fx: rewrote %s", report.one_line())
        flow = DataFlow(gm.graph)  # node positions changed
    unverified = [r.layer for r in ctx.report if r.matched and r.verified == "unverified"]
    if unverified:
        log.warning("moe_fx: %d region(s) rewritten without a numerical check (verify='never'): %s",
                    len(unverified), ", ".join(unverified))
    return count
