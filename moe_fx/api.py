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

__all__ = ["ExplainReport", "compile", "enable_capture", "explain"]

log = logging.getLogger("moe_fx")


def enable_capture() -> None:
    """Set the Dynamo options that let MoE blocks trace into one graph.

    ``capture_dynamic_output_shape_ops`` lets a ``range(E)`` loop over ``nn.ModuleList`` experts with
    ``torch.where`` / ``nonzero`` trace without a graph break; ``capture_scalar_outputs`` does the
    same for ``.item()``-style counts. Both are process-wide Dynamo settings.
    """
    cfg = torch._dynamo.config
    if not (cfg.capture_dynamic_output_shape_ops and cfg.capture_scalar_outputs):
        log.info("moe_fx: enabling torch._dynamo.config.capture_dynamic_output_shape_ops and capture_scalar_outputs")
    cfg.capture_dynamic_output_shape_ops = True
    cfg.capture_scalar_outputs = True


def compile(model: Callable, config: MoEConfig | None = None, **torch_compile_kwargs: Any) -> Callable:
    """``torch.compile(model, backend=<moe_fx with config>, **torch_compile_kwargs)``.

    Also sets the Dynamo options the MoE capture needs (:func:`enable_capture`). For Hugging Face
    ``generate()``, compile the module in place instead: ``model.forward = moe_fx.compile(model.forward)``.
    """
    from moe_fx.backend import make_backend

    if "backend" in torch_compile_kwargs:
        raise TypeError("moe_fx.compile() picks the backend itself; pass other torch.compile arguments only")
    config = config or MoEConfig()
    enable_capture()
    _capture_modules(model, config)
    return torch.compile(model, backend=make_backend(config), **torch_compile_kwargs)


def _capture_modules(model: Callable, config: MoEConfig) -> list[RegionReport]:
    """Module-level capture before tracing: experts whose forwards Dynamo cannot trace as one graph
    (FP8 checkpoint experts; loops over the experts a batch hits)."""
    from moe_fx.passes.capture_expert_loops import capture_expert_loops
    from moe_fx.passes.match_fp8_experts import capture_fp8_experts

    module = model if isinstance(model, torch.nn.Module) else getattr(model, "__self__", None)
    if not isinstance(module, torch.nn.Module) or not config.enabled:
        return []
    return capture_fp8_experts(module, config) + capture_expert_loops(module, config)


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
            last = r.kernel if r.matched else r.reason
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


def _explain_kernel(r: RegionReport, config: MoEConfig) -> tuple[str, dict[str, str]]:
    """The lowering's kernel choice for one matched region: the only call into ``explain_kernel``."""
    from moe_fx.lowering.select import explain_kernel

    return explain_kernel(
        r.device or "cpu", r.dtype, r.num_experts, r.hidden, r.intermediate, r.fp8,
        request=config.kernel, activation=r.activation or "silu",
    )  # fmt: skip


def _fill_kernels(regions: list[RegionReport], config: MoEConfig) -> None:
    """Fill ``kernel`` / ``kernel_reasons`` of every matched region with what will really run.

    A request that cannot run makes the op raise when the layer runs (on any device): said, with a
    warning. On CPU a ``kernel="triton"`` request runs the Triton kernels under Triton's interpreter.
    """
    for r in regions:
        if not r.matched:
            continue
        kernel, reasons = _explain_kernel(r, config)
        if kernel.endswith("(cannot run)"):
            why = reasons.get(config.kernel, "")
            r.warnings.append(f"kernel={config.kernel!r} was requested but cannot run ({why}): the compiled "
                              "model raises when this layer runs; use kernel='auto'")
        elif kernel.startswith("triton (interpreted"):
            r.warnings.append("kernel='triton' on CPU runs the Triton kernels under Triton's interpreter: "
                              "correct but very slow (for tests); kernel='auto' runs the torch reference")
        r.kernel, r.kernel_reasons = kernel, reasons


def _mode_notes(model: Callable) -> list[str]:
    """What the model's mode means for the report (explain itself always traces under no_grad)."""
    module = model if isinstance(model, torch.nn.Module) else getattr(model, "__self__", None)
    if not isinstance(module, torch.nn.Module) or not module.training:
        return []
    grads = any(p.requires_grad for p in module.parameters())
    return [
        "the model is in train mode (model.training is True); explain traced it under torch.no_grad(). "
        + ("A compiled call with grad enabled leaves every region as written (training is not supported): "
           "the rows below hold for calls under torch.no_grad() / inference_mode(). " if grads else "")
        + "Call model.eval() for inference."
    ]


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

    from moe_fx.backend import make_backend
    from moe_fx.passes.inventory import qualify_layer_names, unseen_moe_layers

    config = config or MoEConfig()
    enable_capture()
    module = model if isinstance(model, torch.nn.Module) else getattr(model, "__self__", None)
    states = _snapshot(module) if isinstance(module, torch.nn.Module) else {}
    report = ExplainReport()
    try:
        sink: list[RegionReport] = _capture_modules(model, config)
        inner = make_backend(config, sink=sink, inductor=False)

        def counting_backend(gm, inputs):
            report.graphs += 1
            # explain only reports: the example call runs the graph as the model wrote it (a rewritten layer
            # whose requested kernel cannot run here would raise, and the report must still come out)
            original = torch.fx.GraphModule(gm, copy.deepcopy(gm.graph))
            start = time.perf_counter()
            inner(gm, inputs)
            report.pass_ms += 1e3 * (time.perf_counter() - start)
            return original.forward

        with torch.no_grad():
            torch.compile(model, backend=counting_backend, dynamic=dynamic)(*example_inputs, **example_kwargs)
    finally:
        restored = _restore(states)
        log.debug("moe_fx: explain restored %d module(s)", restored)
    if isinstance(module, torch.nn.Module):
        qualify_layer_names(module, sink)
        sink += unseen_moe_layers(module, sink)
    report.regions = sink
    report.notes = _mode_notes(model)
    _fill_kernels(report.regions, config)
    return report
