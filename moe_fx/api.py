"""The user verbs: :func:`compile` and :func:`explain`."""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from moe_fx.config import MoEConfig
from moe_fx.passes.report import RegionReport

__all__ = ["ExplainReport", "compile", "explain"]

log = logging.getLogger("moe_fx")


def compile(model: Callable, config: MoEConfig | None = None, **torch_compile_kwargs: Any) -> Callable:
    """``torch.compile(model, backend=<moe_fx with config>, **torch_compile_kwargs)``.

    Sets the Dynamo options the MoE capture needs (:func:`moe_fx.backend.enable_capture`) and runs the module
    capture steps (:data:`moe_fx.capture.steps.STEPS`: what a backend cannot do, as it never sees modules)
    before Dynamo traces. For Hugging Face
    ``generate()``, compile the module in place instead: ``model.forward = moe_fx.compile(model.forward)``.
    """
    from moe_fx.backend import enable_capture, make_backend

    if "backend" in torch_compile_kwargs:
        raise TypeError("moe_fx.compile() picks the backend itself; pass other torch.compile arguments only")
    if config is not None and not isinstance(config, MoEConfig):
        raise TypeError(f"moe_fx.compile(): config must be a MoEConfig or None, got {type(config).__name__}")
    config = config or MoEConfig()
    enable_capture()
    _capture_modules(model, config)
    return torch.compile(model, backend=make_backend(config, captured=True), **torch_compile_kwargs)


def _module_of(model: Callable) -> torch.nn.Module | None:
    """The module behind ``model`` (a module, or a bound method of one such as ``model.forward``), or None."""
    module = model if isinstance(model, torch.nn.Module) else getattr(model, "__self__", None)
    return module if isinstance(module, torch.nn.Module) else None


def _capture_modules(model: Callable, config: MoEConfig) -> list[RegionReport]:
    """Module-level capture before tracing (:data:`moe_fx.capture.steps.STEPS`): experts whose forwards Dynamo
    cannot trace as one graph (FP8 checkpoint experts; loops over the experts a batch hits)."""
    from moe_fx.capture.steps import capture_modules

    module = _module_of(model)
    return [] if module is None else capture_modules(module, config)


@dataclass
class ExplainReport:
    """What moe_fx does to a model: one :class:`RegionReport` per candidate MoE region.

    Attributes:
        regions: the reports, in graph order (several graphs if the model has graph breaks).
        graphs: how many graphs Dynamo handed the backend.
        pass_ms: time spent in the moe_fx passes, in milliseconds.
        notes: what holds for the whole model (its train mode, for instance).
    """

    regions: list[RegionReport] = field(default_factory=list)
    graphs: int = 0
    pass_ms: float = 0.0
    notes: list[str] = field(default_factory=list)

    @property
    def matched(self) -> list[RegionReport]:
        """The regions that were rewritten."""
        return [r for r in self.regions if r.matched]

    @property
    def warnings(self) -> list[str]:
        """Every region's warnings, as ``"<layer>: <warning>"``, without repeats."""
        out: list[str] = []
        for r in self.regions:
            for w in r.warnings:
                line = f"{r.layer}: {w}"
                if line not in out:
                    out.append(line)
        return out

    def __str__(self) -> str:
        head = ("layer", "match", "family/form", "E", "K", "H", "I", "T", "dtype", "weights", "verified",
                "kernel / reason")
        rows = []
        for r in self.regions:
            what = f"{r.family or '-'}/{r.form or '?'}"
            last = r.reason
            if r.matched:
                last = r.kernel + (f", {r.layout} layout" if r.layout and r.layout != "reference" else "")
            weights = "-" if not r.matched else ("fp8 128x128" if r.fp8 else r.dtype or "-")
            rows.append((r.layer, "yes" if r.matched else "no", what, str(r.num_experts or "-"),
                         str(r.top_k or "-"), str(r.hidden or "-"), str(r.intermediate or "-"), r.tokens or "-",
                         r.dtype or "-", weights, r.verification() if r.matched else (r.probe or "-"), last))
        widths = [max(len(str(x)) for x in col) for col in zip(head, *rows, strict=True)]
        widths[-1] = 0
        lines = [f"note: {n}" for n in self.notes]
        lines += ["  ".join(str(x).ljust(w) for x, w in zip(row, widths, strict=True)).rstrip()
                  for row in [head, *rows]]
        lines.append(
            f"{len(self.matched)} of {len(self.regions)} MoE region(s) rewritten in {self.graphs} graph(s); "
            f"passes took {self.pass_ms:.1f} ms"
        )
        only = [r.layer for r in self.matched if r.entry == "moe_fx.compile"]
        if only:
            lines.append("rewritten by moe_fx.compile only (torch.compile(model, backend='moe_fx') runs them as "
                         "written: a capture step patches these modules before tracing, and a backend never sees "
                         "modules; it warns once and names them):")
            lines += [f"  {layer}" for layer in only]
        forms = [(r.layer, r.details) for r in self.matched if r.details]
        if forms:
            # what the op computes beyond plain SwiGLU (activation variant, clamps, biases, dense scores)
            lines.append("forms beyond plain SwiGLU:")
            lines += [f"  {layer}: {details}" for layer, details in forms]
        if self.warnings:
            lines.append("warnings:")
            lines += [f"  {w}" for w in self.warnings]
        why_not = [(r.layer, k, v) for r in self.matched for k, v in r.kernel_reasons.items()]
        if why_not:
            lines.append("kernels not taken:")
            seen = set()
            for layer, k, v in why_not:
                if (k, v) not in seen:
                    seen.add((k, v))
                    lines.append(f"  {k}: {v}")
        return "\n".join(lines)


def _reports_of(node: torch.fx.Node, a: dict, reports: list[RegionReport], first: int) -> list[RegionReport]:
    """The reports a moe_fx op node of a traced graph stands for (``a``: its bound arguments).

    A rewritten region's op carries its report's index among the reports of its graph (``first`` on);
    a captured module's op is found by its module path (relative after a graph break, when one frame
    may serve several layers: every unexplained capture report of that path and those sizes), else by
    its sizes alone.
    """
    from moe_fx.passes.graph_utils import clean_module_path, experts_module_of

    info = node.meta.get("moe_fx")
    if info is not None:
        i = first + info["report_index"]
        return [reports[i]] if i < len(reports) else []
    _, h, i = a["w2"].shape  # E differs under expert parallelism (this rank's experts)
    captured = [r for r in reports[:first] if r.matched and not r.kernel and r.entry == "moe_fx.compile"
                and (r.hidden, r.intermediate) == (int(h), int(i))]
    path = clean_module_path(experts_module_of(node)[0])
    by_path = [r for r in captured if path and (r.layer == path or r.layer.endswith("." + path))]
    return by_path or captured[:1]


def _explain_ops(gm: torch.fx.GraphModule, reports: list[RegionReport], first: int) -> None:
    """Fill kernel, layout and reasons of the reports behind every moe_fx experts op of ``gm`` (after the passes
    ran): the lowering's own plan (:func:`moe_fx.lowering.experts.explain_experts`) of the op's arguments,
    bound from its schema, on the node's fake tensors: what the lowering decides when it compiles the op."""
    from moe_fx.lowering.experts import explain_experts
    from moe_fx.passes.graph_utils import bound_op_args, moe_fx_op
    from moe_fx.verify.probe_plan import tokens_text

    for node in gm.graph.nodes:
        if moe_fx_op(node) not in ("experts", "masked_experts"):
            continue
        a = bound_op_args(node)
        targets = _reports_of(node, a, reports, first)
        if not targets:
            continue
        why = explain_experts(a)
        kernel, plan = why.kernel, why.plan
        reasons = dict(why.reasons)
        if plan.error is not None:
            kernel, reasons = f"{plan.experts.requested} (cannot run)", {plan.experts.requested: plan.error, **reasons}
        elif kernel == "triton" and plan.problem.device_type == "cpu":
            kernel = "triton (interpreted on CPU)"
        if why.regimes:
            reasons["layout"] = why.regimes
        if why.tiles:
            reasons["tiles"] = why.tiles
        for r in targets:
            r.kernel, r.layout, r.kernel_reasons = kernel, plan.layout, reasons
            if not r.tokens and "hidden" in a:  # a captured module: its T as traced
                r.tokens = tokens_text(a["hidden"].shape[0])


def _kernel_warnings(regions: list[RegionReport], config: MoEConfig) -> None:
    """Say what a matched region's kernel means: a request that cannot run makes the op raise when the layer
    runs (on any device); ``kernel="triton"`` on CPU runs the Triton kernels under Triton's interpreter."""
    for r in regions:
        if not r.matched:
            continue
        if not r.entry:
            r.entry = "any"
        if not r.kernel:
            r.kernel = "(chosen when the layer first runs)"
            r.warnings.append("the example call did not run this layer: its kernel is chosen when it first runs")
        elif r.kernel.endswith("(cannot run)"):
            why = r.kernel_reasons.get(config.kernel, "")
            r.warnings.append(f"kernel={config.kernel!r} was requested but cannot run ({why}): the compiled "
                              "model raises when this layer runs; use kernel='auto'")
        elif r.kernel.startswith("triton (interpreted"):
            r.warnings.append("kernel='triton' on CPU runs the Triton kernels under Triton's interpreter: "
                              "correct but very slow (for tests); kernel='auto' runs the torch reference")


def _mode_notes(model: Callable) -> list[str]:
    """What the model's mode means for the report (explain itself always traces under no_grad)."""
    module = _module_of(model)
    if module is None or not module.training:
        return []
    grads = any(p.requires_grad for p in module.parameters())
    return [
        "the model is in train mode (model.training is True); explain traced it under torch.no_grad(). "
        + ("A compiled call with grad enabled leaves every region as written (training is not supported): "
           "the rows below hold for calls under torch.no_grad() / inference_mode(). " if grads else "")
        + "Call model.eval() for inference."
    ]


def _settings_notes() -> list[str]:
    """The lowering settings that differ from moe_fx's defaults (a switch set by hand, a ``MOE_FX_*`` variable): the
    kernels in the rows below follow them."""
    from moe_fx.lowering.settings import changed_settings

    changed = changed_settings()
    if not changed:
        return []
    return ["lowering settings differ from moe_fx's defaults: "
            + ", ".join(f"{name.removeprefix('moe_fx.lowering.')}={value}" for name, value in changed.items())]


@dataclass
class _ModuleState:
    """What explain may change on one module, to put back: its attributes and its tensors' data."""

    attrs: dict[str, Any]
    tables: dict[str, dict[str, Any]]
    data: list[tuple[torch.Tensor, torch.Tensor, dict[str, Any]]]


_TABLES = ("_parameters", "_buffers", "_modules")
_MISSING = object()


def _snapshot(root: torch.nn.Module) -> dict[torch.nn.Module, _ModuleState]:
    """Every module's attributes (instance ``forward`` included), parameter / buffer / child tables and
    each tensor's ``.data`` (its storage and strides) and attributes (Dynamo tags the parameters it
    traces), to restore after explain."""
    states = {}
    for module in root.modules():
        tables = {name: dict(getattr(module, name)) for name in _TABLES}
        tensors = [t for name in ("_parameters", "_buffers") for t in tables[name].values() if t is not None]
        states[module] = _ModuleState(dict(vars(module)), tables, [(t, t.data, dict(vars(t))) for t in tensors])
    return states


def _restore(states: dict[torch.nn.Module, _ModuleState]) -> int:
    """Put back what :func:`_snapshot` saw; returns how many modules had changed."""
    changed = 0
    for module, state in states.items():
        touched = False
        attrs = vars(module)
        for name in set(attrs) - set(state.attrs):  # attributes explain added (a captured forward, ...)
            del attrs[name]
            touched = True
        for name, value in state.attrs.items():
            if attrs.get(name, _MISSING) is not value:
                attrs[name] = value
                touched = True
            if name in _TABLES:
                table, saved = attrs[name], state.tables[name]
                if table.keys() != saved.keys() or any(table[k] is not v for k, v in saved.items()):
                    table.clear()  # the same dict object, its entries as they were (parameter objects)
                    table.update(saved)
                    touched = True
        with torch.no_grad():
            for tensor, data, tensor_attrs in state.data:
                same = (tensor.data_ptr() == data.data_ptr() and tensor.shape == data.shape
                        and tensor.stride() == data.stride() and tensor.dtype == data.dtype)
                if not same:  # re-pointed into a stack made for the report: back to its own storage
                    tensor.data = data
                    touched = True
                if vars(tensor) != tensor_attrs:
                    vars(tensor).clear()
                    vars(tensor).update(tensor_attrs)
                    touched = True
        changed += touched
    return changed


def explain(
    model: Callable, *example_inputs: Any, config: MoEConfig | None = None, dynamic: bool | None = None,
    **example_kwargs: Any,
) -> ExplainReport:
    """Trace ``model(*example_inputs, **example_kwargs)`` and report, per MoE layer, what moe_fx does.

    Nothing is compiled with Inductor and the model's outputs are discarded; the report says for every
    candidate region whether it is rewritten, its family/form, E, K, H, I, the token count T as traced,
    dtype, the kernel that will run (what really runs: on CPU the torch reference whatever was
    requested), how each rewritten region was verified (probe size and error, or "UNVERIFIED" under
    ``verify="never"``), the reason for every non-match, and warnings. Runs under ``torch.no_grad()``; a
    model in train mode gets a note saying what that means for a compiled call with grad enabled.

    ``dynamic`` is torch.compile's: ``dynamic=True`` shows what ``moe_fx.compile(model, dynamic=True)``
    does (regions traced for any T: the T column says "symbolic"), the default what ``moe_fx.compile``
    would do now (a first compile traces the example's T; after recompiles of the same code in this
    process, Dynamo's automatic dynamic shapes may trace any T).

    Free of side effects: the capture step's forwards, repacked parameters and stacked views it needs to
    trace are undone afterwards (every module's attributes, parameter and buffer objects and their data
    are as they were), so the model computes exactly what it computed before.
    """
    import time

    from moe_fx.backend import enable_capture, make_backend
    from moe_fx.capture.inventory import qualify_layer_names, unseen_moe_layers
    from moe_fx.capture.steps import release_modules

    config = config or MoEConfig()
    enable_capture()
    module = _module_of(model)
    states = _snapshot(module) if module is not None else {}
    report = ExplainReport()
    try:
        sink: list[RegionReport] = _capture_modules(model, config)
        inner = make_backend(config, sink=sink, inductor=False, captured=True)

        def counting_backend(gm, inputs):
            report.graphs += 1
            # explain only reports: the example call runs the graph as the model wrote it (a rewritten layer
            # whose requested kernel cannot run here would raise, and the report must still come out)
            original = torch.fx.GraphModule(gm, copy.deepcopy(gm.graph))
            first = len(sink)
            start = time.perf_counter()
            inner(gm, inputs)
            report.pass_ms += 1e3 * (time.perf_counter() - start)
            _explain_ops(gm, sink, first)
            return original.forward

        with torch.no_grad():
            torch.compile(model, backend=counting_backend, dynamic=dynamic)(*example_inputs, **example_kwargs)
    finally:
        # the capture steps' own release first (their forwards), then everything else explain changed
        # (parameters repacked for the trace, attributes Dynamo set)
        released = release_modules(module) if module is not None else 0
        restored = _restore(states)
        log.debug("moe_fx: explain released %d captured module(s) and restored %d module(s)", released, restored)
    if module is not None:
        qualify_layer_names(module, sink)
        sink += unseen_moe_layers(module, sink)
    report.regions = sink
    report.notes = _mode_notes(model) + _settings_notes()
    _kernel_warnings(report.regions, config)
    return report
