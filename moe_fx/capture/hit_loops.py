"""Capture experts modules that loop over the experts a batch actually hits, before tracing.

Many experts modules are written as a loop over the experts that received tokens::

    expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()
    for expert_idx in expert_hit:                 # the loop's length is data
        ...                                       # (LongCat-Flash: int(expert_idx.item()), identity experts)

transformers' ``eager`` experts implementation, GPT-OSS's and LongCat-Flash's experts, Step-3.7's and DBRX's
are. Dynamo cannot trace such a loop as one graph (it breaks the graph at the loop, even with
``capture_dynamic_output_shape_ops``), so the graph pass never sees these blocks. This capture step
works on the module instead, before tracing, like :mod:`~moe_fx.capture.fp8_modules`:

* :func:`loop_experts_candidates` picks the modules to look at: experts modules called as
  ``experts(hidden [T, H], top_k_index [T, K], top_k_weights [T, K])`` whose forward is not one of
  transformers' traceable implementations (``grouped_mm``, ``batched_mm``: the graph pass handles those).
* :func:`match_loop_experts` reads the candidate semantics from the module's parameters (stacked
  ``[E, N1, H]`` / ``[E, H, I]`` weights or their transposes, ``[E, N1]`` / ``[E, H]`` biases, extra
  ``w13`` rows for identity experts) and attributes (activation function, ``alpha``, ``limit``), then
  runs the module's own forward on random routed tokens (every expert hit, identity ones included; an
  input scale that reaches the clamp bound) and keeps the first reading that equals
  :func:`~moe_fx.ops.experts_reference`. Nothing matches: the module keeps its forward, with the reason.
* :func:`capture_expert_loops` gives each matched module a forward that calls ``moe_fx::experts`` on
  views of its own parameters (a transpose, the first E rows; never a copy); Dynamo then traces it as
  one op. :func:`release_expert_loops` undoes it.

A module that is captured computes exactly what the reference does; a module whose forward computes
something the op cannot express (Step-3.7's clamp after the activation) is reported and left alone.
DBRX keeps gate and up in two flat ``[E * I, H]`` parameters: capture moves them into one storage, rows
interleaved (:func:`pack_split_gate_up`; the parameters become views of it, still one copy), so that the
op's ``[E, 2I, H]`` weight is a view too. A parameter replaced later (``load_state_dict(assign=True)``,
``.to()``) breaks that layout: the module then runs its own loop (right, slower) until the next
``moe_fx.compile`` packs it again. ``moe_fx.explain`` captures and packs to trace, then puts every
module back as it was (forwards, parameter objects, attributes).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import itertools
import logging
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch import nn

from moe_fx.capture.patch import patch_forward, patched_with, release_patched
from moe_fx.capture.record_forward import RecordedForward, record_forward
from moe_fx.config import MoEConfig
from moe_fx.ops import ExpertActivation
from moe_fx.ops.checks import FLOAT_DTYPES
from moe_fx.passes.recognize.read_form import Boundary, FormReading, WeightView, read_form
from moe_fx.passes.report import RegionReport
from moe_fx.verify.check_numerics import (
    NumericsResult,
    OpWeights,
    ProbeCase,
    Semantics,
    check_cases,
    clamp_scale,
    large_tokens,
    make_cases,
    random_weight,
)
from moe_fx.verify.probe_plan import plan_probe, probe_routing

__all__ = [
    "LoopExpertsMatch",
    "capture_expert_loops",
    "check_forward",
    "loop_candidates",
    "loop_experts_candidates",
    "match_loop_experts",
    "pack_split_gate_up",
    "release_expert_loops",
    "trace_inputs",
]

log = logging.getLogger("moe_fx.passes")

_TRACEABLE = ("grouped_mm", "batched_mm")
#: Runs at a large token count (random weights) after the planned ones.
LARGE_T_RUNS = 2


@dataclass(frozen=True)
class LoopExpertsMatch:
    """How a captured experts module maps onto ``moe_fx::experts``.

    Attributes:
        w13, w2: parameter names (relative to the module) of the first and second expert weights.
        transposed: the weights are stored ``[E, H, N1]`` / ``[E, I, H]`` (passed as transposed views).
        w13_bias, w2_bias: bias parameter names, or None.
        num_experts, hidden, intermediate: E, H, I (``w13`` may hold more than E rows: only E are read).
        identity_experts: ids ``E .. E + identity_experts - 1`` return their input (LongCat-Flash).
        spec: the activation.
        weights_on_input: routing weights scale the expert input (Llama 4 style) instead of the output.
        error: the largest per-token error of the numerical check (:mod:`~moe_fx.verify.check_numerics`).
        up: the up projection's parameter when gate (``w13``) and up are separate (DBRX).
        batch_view: the module takes ``[B, S, H]`` and returns ``out.view(B, -1, H)`` (DBRX), also for
            ``[T, H]`` inputs (``[T, 1, H]``).
        probe: what the numerical check ran, for reports.
    """

    w13: str
    w2: str
    transposed: bool
    w13_bias: str | None
    w2_bias: str | None
    num_experts: int
    hidden: int
    intermediate: int
    identity_experts: int
    spec: ExpertActivation
    weights_on_input: bool
    error: float
    up: str | None = None
    batch_view: bool = False
    probe: str = ""

    def weights(self, module: nn.Module, copy: bool = False) -> dict[str, torch.Tensor | None] | None:
        """The op's weight arguments as views of ``module``'s own parameters (no copy).

        With separate gate and up parameters (``up`` set; DBRX's flat ``[E * I, H]`` w1 / v1 / w2),
        ``w13`` is the interleaved ``[E, 2I, H]`` view of the storage :func:`pack_split_gate_up` gave
        them; None when they no longer lie that way (a parameter was replaced since), unless ``copy``
        (the probe, before packing) allows building it.
        """
        names = [n for n in (self.w13, self.w2, self.up, self.w13_bias, self.w2_bias) if n is not None]
        return self.weights_from({n: module.get_parameter(n) for n in names}, copy)

    def weights_from(self, params: Mapping[str, torch.Tensor], copy: bool = False
                     ) -> dict[str, torch.Tensor | None] | None:
        """:meth:`weights` from tensors by parameter name (the module's own, or the probe's float32 / random ones)."""
        e = self.num_experts
        w13, w2 = params[self.w13], params[self.w2]
        if self.up is not None:
            w13 = _interleaved_view(w13, params[self.up], e, copy)
            if w13 is None:
                return None
            w2 = w2.view(e, self.intermediate, self.hidden).transpose(1, 2)
        elif self.transposed:
            w13, w2 = w13.transpose(1, 2), w2.transpose(1, 2)
        b13 = None if self.w13_bias is None else params[self.w13_bias]
        b2 = None if self.w2_bias is None else params[self.w2_bias]
        return {
            "w13": w13 if w13.shape[0] == e else w13[:e],
            "w2": w2,
            "w13_bias": b13 if b13 is None or b13.shape[0] == e else b13[:e],
            "w2_bias": b2,
        }

    def op_kwargs(self) -> dict[str, object]:
        """The op's keyword arguments that describe the activation and identity experts."""
        s = self.spec
        return {"gated": s.gated, "gate_up_layout": s.gate_up_layout, "alpha": s.alpha, "limit": s.limit,
                "up_offset": s.up_offset, "identity_experts": self.identity_experts}


def _interleaved_view(gate: torch.Tensor, up: torch.Tensor, e: int, copy: bool) -> torch.Tensor | None:
    """``[E, 2I, H]`` with gate row i of an expert at 2i and up row i at 2i + 1, from flat ``[E * I, H]``
    gate and up parameters: a view when they interleave in one storage, else a copy (``copy``) or None."""
    rows, h = gate.shape
    i = rows // e
    packed = gate.stride() == (2 * h, 1) and up.stride() == (2 * h, 1)
    if packed and not torch.compiler.is_compiling():
        # Dynamo sees strides (and guards on them) but not storages: traced, the strides decide. What
        # gives both parameters these strides is packing, or a load of a packed model's state dict (views
        # of its one storage, interleaved the same way).
        packed = (
            up.untyped_storage().data_ptr() == gate.untyped_storage().data_ptr()
            and up.storage_offset() == gate.storage_offset() + h
        )
    if packed:
        return gate.as_strided((e, 2 * i, h), (2 * i * h, h, 1))
    if not copy:
        return None
    return torch.stack([gate.view(e, i, h), up.view(e, i, h)], dim=2).reshape(e, 2 * i, h)


def pack_split_gate_up(module: nn.Module, gate: str, up: str) -> bool:
    """Give ``module``'s separate flat gate and up parameters one storage, rows interleaved, so that the
    op's ``[E, 2I, H]`` weight is a view of them (one copy of the experts). True when it repacked."""
    g, u = module.get_parameter(gate), module.get_parameter(up)
    if _interleaved_view(g, u, 1, copy=False) is not None:
        return False  # already one storage
    with torch.no_grad():
        storage = torch.stack([g.detach(), u.detach()], dim=1)  # [E * I, 2, H]
    for name, rows in ((gate, storage[:, 0]), (up, storage[:, 1])):
        owner, _, attr = name.rpartition(".")
        old = module.get_parameter(name)
        setattr(module.get_submodule(owner) if owner else module, attr,
                nn.Parameter(rows, requires_grad=old.requires_grad))
    return True


# ------------------------------------------------------------------------------------------------
# Which modules


def _positional_arity(module: nn.Module) -> int:
    try:
        params = inspect.signature(type(module).forward).parameters.values()
    except (TypeError, ValueError):
        return 0
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    named = [p for p in params if p.kind in kinds]
    if any(p.kind == inspect.Parameter.VAR_POSITIONAL for p in params):
        return 99
    return len(named) - 1  # self


def _is_fp8(module: nn.Module) -> bool:
    return any(name.endswith("_scale_inv") for name, _ in module.named_parameters()) or any(
        p.dtype == torch.float8_e4m3fn for p in module.parameters()
    )


def _traceable_implementation(module: nn.Module) -> str | None:
    """The transformers experts implementation the module's forward dispatches to, when it is traceable."""
    forward = type(module).forward
    if getattr(forward, "__wrapped__", None) is None:
        return None  # not transformers' @use_experts_implementation: the forward is the class's own
    impl = getattr(getattr(module, "config", None), "_experts_implementation", None)
    return impl if impl in _TRACEABLE else None


def _captured(module: nn.Module) -> bool:
    return patched_with(module, _captured_forward)


def loop_experts_candidates(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """``(name, module)`` for every experts module the capture step examines (see the module docstring)."""
    for name, module in model.named_modules():
        if _captured(module):
            yield name, module
            continue
        if not type(module).__name__.endswith("Experts") and "num_experts" not in vars(module):
            continue
        if hasattr(module, "base_model_prefix"):
            continue  # a whole transformers model, not an experts module
        if _positional_arity(module) < 3 or _is_fp8(module) or _traceable_implementation(module):
            continue
        if any(isinstance(m, nn.ModuleList) for m in module.children()):
            continue  # per-expert modules: the graph pass's expert_loop form
        yield name, module


# ------------------------------------------------------------------------------------------------
# Readings of a module's parameters


@dataclass(frozen=True)
class _Layout:
    w13: str
    w2: str
    transposed: bool
    num_experts: int
    hidden: int
    intermediate: int
    gated: bool
    extra_rows: int  # w13 rows beyond E (LongCat-Flash keeps one per identity expert)
    up: str | None = None  # the up projection when gate (w13) and up are separate flat [E * I, H] parameters


def _split_layouts(module: nn.Module, params: dict[str, torch.Tensor]) -> list[_Layout]:
    """Readings of three flat ``[E * I, H]`` parameters as gate, up and down (DBRX's w1, v1, w2)."""
    e = getattr(module, "num_experts", None)
    flat = {n: p for n, p in params.items() if p.dim() == 2 and p.dtype.is_floating_point}
    out = []
    if not isinstance(e, int) or e <= 0:
        return out
    for (ng, g), (nu, u), (nd, d) in itertools.permutations(flat.items(), 3):
        rows, h = g.shape
        if g.shape == u.shape == d.shape and rows % e == 0 and rows > e:
            out.append(_Layout(ng, nd, False, e, h, rows // e, True, 0, nu))
    return out


def _layouts(params: dict[str, torch.Tensor]) -> list[_Layout]:
    """Every reading of two 3-D parameters as (w13, w2), gated or not, plain or transposed."""
    out = []
    cubes = {n: p for n, p in params.items() if p.dim() == 3 and p.dtype.is_floating_point}
    for (na, a), (nb, b) in itertools.permutations(cubes.items(), 2):
        e = b.shape[0]
        if a.shape[0] < e:
            continue
        _, x, y = a.shape
        _, p, q = b.shape
        extra = a.shape[0] - e
        if x == 2 * q and y == p:
            out.append(_Layout(na, nb, False, e, p, q, True, extra))
        if y == 2 * p and x == q:
            out.append(_Layout(na, nb, True, e, q, p, True, extra))
        if x == q and y == p:  # non-gated; the orientation is not known from the shapes alone
            out.append(_Layout(na, nb, False, e, y, x, False, extra))
            if x != y:
                out.append(_Layout(na, nb, True, e, x, y, False, extra))
    return out


# ------------------------------------------------------------------------------------------------
# Reading and checking


def _top_k(module: nn.Module, slots: int) -> int:
    cfg = getattr(module, "config", None)
    k = getattr(cfg, "num_experts_per_tok", None) or getattr(module, "top_k", None) or 2
    return max(1, min(int(k) if isinstance(k, int) else 2, slots))


def _params(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach() for n, p in module.named_parameters()}


def _views(rec: RecordedForward, lay: _Layout) -> dict[fx.Node, WeightView] | str:
    """What each parameter the recorded forward read is, under the reading ``lay`` (biases: the other 2-D ones)."""
    views: dict[fx.Node, WeightView] = {}
    if lay.up is not None:  # DBRX: flat [E * I, H] gate, up and down, viewed [E, I, H] per expert
        named = {lay.w13: WeightView("gate", ("e*o", "i")), lay.up: WeightView("up", ("e*o", "i")),
                 lay.w2: WeightView("w2", ("e*i", "o"))}
    else:
        axes = ("e", "i", "o") if lay.transposed else ("e", "o", "i")
        named = {lay.w13: WeightView("w13", axes), lay.w2: WeightView("w2", axes)}
    for name, view in named.items():
        if name not in rec.params:
            return f"its forward does not read {name}"
        views[rec.params[name]] = view
    rows = {lay.num_experts, lay.num_experts + lay.extra_rows}
    for name, node in rec.params.items():
        v = node.meta["example_value"]
        if name not in named and v.dim() == 2 and v.dtype.is_floating_point and v.shape[0] in rows:
            views[node] = WeightView("bias", ("e", "o"))
    return views


def trace_inputs(hidden_size: int, slots: int, k: int, device: torch.device, dtype: torch.dtype
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Routed tokens ``(hidden [T, H], ids [T, K], weights [T, K])`` whose ids hit every one of ``slots`` experts
    (identity ones too): what a module's forward is recorded on (:func:`record_forward`)."""
    gen = torch.Generator().manual_seed(4321)
    tokens = max(2, math.ceil(slots / k))
    (ids,) = probe_routing(tokens, 1, slots, k, gen)
    hidden = torch.randn(tokens, hidden_size, generator=gen).to(device=device, dtype=dtype)
    weights = (torch.rand(tokens, k, generator=gen) + 0.1).to(device=device, dtype=dtype)
    return hidden, ids.to(device), weights


def _read_module(module: nn.Module, lay: _Layout, identity: int) -> tuple[FormReading, bool] | tuple[int, str]:
    """Record the module's forward on tokens that hit every expert and read it (:func:`read_form`): the reading
    and whether the module returns ``[T, 1, H]``, or ``(rank, reason)`` (a lower rank got further)."""
    slots = lay.num_experts + identity
    k = _top_k(module, slots)
    w13 = module.get_parameter(lay.w13)
    inputs = trace_inputs(lay.hidden, slots, k, w13.device, w13.dtype)
    try:
        rec = record_forward(lambda h, i, w: type(module).forward(module, h, i, w), inputs, dict(module.named_parameters()))
    except (RuntimeError, ValueError, TypeError, IndexError) as exc:
        return 3, f"the module's forward failed on probe inputs: {str(exc).splitlines()[0][:200]}"
    t, h = inputs[0].shape
    out = rec.value
    if not isinstance(out, torch.Tensor) or tuple(out.shape) not in ((t, h), (t, 1, h)) or rec.output is None:
        got = list(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        return 3, f"the module returns {got} for hidden states {list(inputs[0].shape)}"
    views = _views(rec, lay)
    if isinstance(views, str):
        return 2, views
    hidden, ids, weights = rec.inputs
    boundary = Boundary(hidden, ids, weights, False, views, lay.num_experts, k, lay.gated)
    nodes = [n for n in rec.graph.nodes if n.op in ("call_function", "call_method")]
    reading = read_form(nodes, rec.output, boundary)
    if isinstance(reading, str):
        return 1, reading
    if reading.identity_experts != identity:
        return 1, f"{reading.identity_experts} of its experts return their input, where {identity} were routed"
    return reading, tuple(out.shape) == (t, 1, h)


def _random_params(module: nn.Module, m: LoopExpertsMatch, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Random float32 tensors of the real shapes for the op's weights and biases (fan-in: their input width)."""
    out = {}
    for name, fan_in in ((m.w13, m.hidden), (m.up, m.hidden), (m.w2, m.intermediate), (m.w13_bias, 4),
                         (m.w2_bias, 4)):
        if name is not None:
            p = module.get_parameter(name)
            out[name] = random_weight(tuple(p.shape), fan_in, gen, device=p.device, windowed_bytes=math.inf)
    return out


def _check_module(module: nn.Module, m: LoopExpertsMatch, config: MoEConfig) -> tuple[NumericsResult, str]:
    """The module's own forward in float32 against the reference for ``m`` (:func:`check_forward`)."""
    slots = m.num_experts + m.identity_experts
    gen = torch.Generator().manual_seed(1234)
    params = _params(module)
    real = {n: p.float() for n, p in params.items() if p.dtype.is_floating_point}
    sets = {"real": real, "random": {**real, **_random_params(module, m, gen)}}
    ops = {}
    for name, ps in sets.items():
        w = m.weights_from(ps, copy=True)
        ops[name] = OpWeights(w["w13"], w["w2"], w["w13_bias"], w["w2_bias"])
    clamps = {name: clamp_scale(op.w13, m.spec.limit) for name, op in ops.items()}
    sem = Semantics(m.spec, m.weights_on_input, m.identity_experts)
    return check_forward(module, sets, ops, clamps, sem, _top_k(module, slots), m.intermediate, config, gen)


def check_forward(
    module: nn.Module, sets: Mapping[str, Mapping[str, torch.Tensor]], ops: Mapping[str, OpWeights],
    clamps: Mapping[str, float | None], sem: Semantics, top_k: int, intermediate: int, config: MoEConfig,
    gen: torch.Generator, context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
) -> tuple[NumericsResult, str]:
    """The module's own forward in float32 against the reference for ``sem`` (:mod:`check_numerics`), with each
    weight set of ``sets`` (``"real"`` and ``"random"``: parameter name -> tensor, through ``functional_call``;
    ``ops`` are the op's weights of each set, ``clamps`` their clamp scales), on routing that reaches every expert,
    also at a large T; each run inside ``context()``. Returns the result and what ran."""
    e = ops["real"].w13.shape[0]
    slots, k, hidden = e + sem.identity_experts, top_k, ops["real"].w2.shape[1]
    plan = plan_probe(None, k, slots, k, hidden, intermediate, config.verify_max_flops, config.verify)
    device = ops["real"].w13.device
    cases = make_cases(probe_routing(plan.tokens, plan.runs, slots, k, gen), hidden, dict(clamps), gen, device=device)
    big = probe_routing(large_tokens(slots, k), LARGE_T_RUNS, slots, k, gen)
    cases += make_cases(big, hidden, {"random": clamps["random"]}, gen, device=device)

    def run(case: ProbeCase) -> torch.Tensor | str:
        try:
            with context():
                out = torch.func.functional_call(module, sets[case.weights], (case.hidden, case.ids, case.routing))
        except (RuntimeError, ValueError, TypeError, IndexError) as exc:
            return str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
        return out.reshape(case.hidden.shape) if isinstance(out, torch.Tensor) else type(out).__name__

    ran = f"the module's forward in float32: {plan.describe()}, real and random weights, T={big[0].shape[0]} x{len(big)}"
    return check_cases(run, ops.__getitem__, sem, cases, f" ({ran})"), ran


def _param_name(node: fx.Node | None) -> str | None:
    return None if node is None else node.meta["moe_fx_param"]


def match_loop_experts(module: nn.Module, config: MoEConfig | None = None) -> LoopExpertsMatch | str:
    """How ``module`` maps onto ``moe_fx::experts``, or why it does not.

    Its forward is recorded on tokens that hit every expert and read by :func:`read_form` (the structure proves
    the form), then checked numerically (:func:`_check_module`). No module is captured on the probe alone.
    """
    config = config or MoEConfig()
    if config.verify == "never":
        return "a loop over hit experts is captured only after the numerical check, and verify='never'"
    params = _params(module)
    layouts = _layouts(params) or _split_layouts(module, params)
    if not layouts:
        return _no_layout_reason(params)
    dtypes = {params[lay.w13].dtype for lay in layouts}
    if not dtypes & set(FLOAT_DTYPES):
        # checked here, not by the op at trace time: the probe runs in float32 and would pass
        names = "/".join(str(d).replace("torch.", "") for d in FLOAT_DTYPES)
        return f"expert weights are {', '.join(sorted(str(d).replace('torch.', '') for d in dtypes))}: " \
               f"moe_fx::experts takes {names}"
    reasons: list[tuple[int, str]] = []
    with torch.no_grad():
        for lay in layouts:
            extra = {lay.extra_rows} | {int(getattr(module, "zero_expert_num", 0) or 0)}
            for identity in sorted(extra, reverse=True):
                read = _read_module(module, lay, identity)
                if isinstance(read[0], int):
                    reasons.append(read)  # type: ignore[arg-type]
                    continue
                reading, batch_view = read
                spec = reading.spec
                if lay.up is not None:  # gate and up rows interleave once packed into one storage
                    spec = dataclasses.replace(spec, gate_up_layout="interleaved")
                m = LoopExpertsMatch(lay.w13, lay.w2, lay.transposed, _param_name(reading.w13_bias),
                                     _param_name(reading.w2_bias), lay.num_experts, lay.hidden, lay.intermediate,
                                     identity, spec, reading.weights_on_input, math.nan, lay.up, batch_view)
                result, ran = _check_module(module, m, config)
                if result.ok:
                    return dataclasses.replace(m, error=result.error, probe=ran)
                reasons.append((0, result.reason))
    return min(reasons, key=lambda r: r[0])[1]


def _no_layout_reason(params: dict[str, torch.Tensor]) -> str:
    shapes = ", ".join(f"{n} {list(p.shape)}" for n, p in params.items())
    flat = [p.shape for p in params.values() if p.dim() == 2]
    if len(flat) >= 3 and len(set(flat)) == 1:
        return (f"gate and up projections are separate parameters ({shapes}); moe_fx::experts needs them in "
                f"one [E, 2I, H] tensor, and stacking them would keep a second copy of the experts")
    return f"no stacked expert weights [E, N1, H] + [E, H, I] (or transposed) among its parameters ({shapes})"


# ------------------------------------------------------------------------------------------------
# Capture


def _captured_forward(
    self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
    *args: object, **kwargs: object,
) -> torch.Tensor:
    """The experts module's forward through ``moe_fx::experts``, on views of its own parameters.

    Training (grad mode with inputs or weights that require grad) and calls outside the op's contract run
    the module's own forward: the op has no backward.
    """
    m: LoopExpertsMatch = self._moe_fx_loop
    w = m.weights(self)
    if w is None:  # separate gate/up parameters replaced since packing (assign=True, .to()): as written
        return type(self).forward(self, hidden_states, top_k_index, top_k_weights, *args, **kwargs)
    tensors = [hidden_states, top_k_weights, *(t for t in w.values() if t is not None)]
    training = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    flat = hidden_states.dim() == 2 or (m.batch_view and hidden_states.dim() == 3)
    if training or not flat or top_k_index.dim() != 2 or args or kwargs:
        return type(self).forward(self, hidden_states, top_k_index, top_k_weights, *args, **kwargs)
    out = torch.ops.moe_fx.experts(
        hidden_states if hidden_states.dim() == 2 else hidden_states.reshape(-1, m.hidden), top_k_index, top_k_weights, w["w13"], w["w2"], m.spec.name,
        m.weights_on_input, None, None, self._moe_fx_kernel, w13_bias=w["w13_bias"], w2_bias=w["w2_bias"],
        **m.op_kwargs(),
    )
    return out.view(hidden_states.shape[0], -1, m.hidden) if m.batch_view else out


def _family(model: nn.Module, module: nn.Module) -> str:
    cls = type(module).__name__
    return cls[: -len("Experts")] if cls.endswith("Experts") else type(model).__name__.replace("ForCausalLM", "")


def _details(m: LoopExpertsMatch) -> str:
    parts = [] if m.spec.is_plain else [m.spec.describe()]
    if m.w13_bias or m.w2_bias:
        parts.append("biases " + "+".join(k for k, b in (("w13", m.w13_bias), ("w2", m.w2_bias)) if b))
    if m.identity_experts:
        parts.append(f"{m.identity_experts} identity experts")
    return "; ".join(parts)


def capture_expert_loops(model: nn.Module, config: MoEConfig | None = None) -> list[RegionReport]:
    """Route every matching loop-over-hit-experts module of ``model`` to ``moe_fx::experts`` (in place).

    Returns one :class:`RegionReport` per candidate (form ``"hit_loop"``), matched or with the reason it
    was left alone. Idempotent; :func:`release_expert_loops` undoes it.
    """
    config = config or MoEConfig()
    reports = []
    for name, module in loop_experts_candidates(model):
        found = module._moe_fx_loop if _captured(module) else match_loop_experts(module, config)
        if not isinstance(found, str) and found.up is not None:
            # Packed once; again after a parameter was replaced (load_state_dict(assign=True), .to()),
            # until when the module runs its own loop.
            pack_split_gate_up(module, found.w13, found.up)
        report = RegionReport(layer=name or type(module).__name__, form="hit_loop", family=_family(model, module))
        reports.append(report)
        if isinstance(found, str):
            report.reason = found
            log.info("moe_fx: experts loop %s left as it is: %s", report.layer, found)
            continue
        module._moe_fx_loop = found
        module._moe_fx_kernel = config.kernel
        patch_forward(module, _captured_forward)
        w13 = module.get_parameter(found.w13)
        report.matched, report.num_experts, report.hidden = True, found.num_experts, found.hidden
        report.intermediate, report.top_k = found.intermediate, _top_k(module, found.num_experts)
        report.dtype, report.device = str(w13.dtype).replace("torch.", ""), w13.device.type
        report.activation, report.weights_on_input = found.spec.name, found.weights_on_input
        report.verified, report.details = "numerics", _details(found)
        report.probe, report.probe_error = found.probe, found.error
        log.info("moe_fx: experts loop %s -> moe_fx::experts: %s", report.layer, report.one_line())
    return reports


def release_expert_loops(model: nn.Module) -> int:
    """Undo :func:`capture_expert_loops`: restore the class forward of captured modules; returns how many."""
    return release_patched(model, _captured_forward)


def loop_candidates(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The candidates of :func:`loop_experts_candidates` that are not captured (the module runs its own loop)."""
    return [(name, m) for name, m in loop_experts_candidates(model) if not _captured(m)]
