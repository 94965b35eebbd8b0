"""Capture experts modules that loop over the experts a batch actually hits, before tracing.

Many experts modules are written as a loop over the experts that received tokens::

    expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()
    for expert_idx in expert_hit:                 # the loop's length is data
        ...                                       # (LongCat-Flash: int(expert_idx.item()), identity experts)

transformers' ``eager`` experts implementation, GPT-OSS's and LongCat-Flash's experts, Step-3.7's and DBRX's
are. Dynamo cannot trace such a loop as one graph (it breaks the graph at the loop, even with
``capture_dynamic_output_shape_ops``), so the graph pass never sees these blocks. This capture step
works on the module instead, before tracing, like :mod:`~moe_fx.passes.match_fp8_experts`:

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

import inspect
import itertools
import logging
import math
import types
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from moe_fx.config import MoEConfig
from moe_fx.ops import ACTIVATIONS, ExpertActivation, experts_reference
from moe_fx.passes.report import RegionReport

__all__ = [
    "LoopExpertsMatch",
    "capture_expert_loops",
    "loop_experts_candidates",
    "match_loop_experts",
    "release_expert_loops",
    "pack_split_gate_up",
]

log = logging.getLogger("moe_fx.passes")

_TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-6, torch.bfloat16: 3e-2, torch.float16: 1e-2}
#: transformers' traceable experts implementations: the graph pass sees these, no capture needed.
_TRACEABLE = ("grouped_mm", "batched_mm")
#: Activation modules (transformers ACT2FN / torch.nn) by class name -> moe_fx activation names.
_ACTIVATION_CLASSES = {
    "SiLU": "silu", "SiLUActivation": "silu", "Swish": "silu", "GELU": "gelu", "GELUActivation": "gelu",
    "PytorchGELUTanh": "gelu_tanh", "GELUTanh": "gelu_tanh", "NewGELUActivation": "gelu_tanh",
    "ReLU": "relu", "ReLUSquaredActivation": "relu2",
}  # fmt: skip
_ACTIVATION_ATTRS = ("act_fn", "activation_fn", "activation", "act")
#: Most probe tokens; fewer when the probe would cost more than MoEConfig.verify_max_flops.
_MAX_PROBE_TOKENS = 64


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
        error: the largest relative error of the probe against the reference.
        up: the up projection's parameter when gate (``w13``) and up are separate (DBRX).
        batch_view: the module takes ``[B, S, H]`` and returns ``out.view(B, -1, H)`` (DBRX), also for
            ``[T, H]`` inputs (``[T, 1, H]``).
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

    def weights(self, module: nn.Module, copy: bool = False) -> dict[str, torch.Tensor | None] | None:
        """The op's weight arguments as views of ``module``'s own parameters (no copy).

        With separate gate and up parameters (``up`` set; DBRX's flat ``[E * I, H]`` w1 / v1 / w2),
        ``w13`` is the interleaved ``[E, 2I, H]`` view of the storage :func:`pack_split_gate_up` gave
        them; None when they no longer lie that way (a parameter was replaced since), unless ``copy``
        (the probe, before packing) allows building it.
        """
        e = self.num_experts
        w13, w2 = module.get_parameter(self.w13), module.get_parameter(self.w2)
        if self.up is not None:
            w13 = _interleaved_view(w13, module.get_parameter(self.up), e, copy)
            if w13 is None:
                return None
            w2 = w2.view(e, self.intermediate, self.hidden).transpose(1, 2)
        elif self.transposed:
            w13, w2 = w13.transpose(1, 2), w2.transpose(1, 2)
        b13 = None if self.w13_bias is None else module.get_parameter(self.w13_bias)
        b2 = None if self.w2_bias is None else module.get_parameter(self.w2_bias)
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
    return getattr(vars(module).get("forward"), "__func__", None) is _captured_forward


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


def _bias_readings(params: dict[str, torch.Tensor], lay: _Layout) -> list[tuple[str | None, str | None]]:
    """``(w13_bias, w2_bias)`` parameter names compatible with ``lay``, most complete first."""
    n1 = 2 * lay.intermediate if lay.gated else lay.intermediate
    flat = {n: p for n, p in params.items() if p.dim() == 2 and p.dtype.is_floating_point}
    b13 = [n for n, p in flat.items() if p.shape[0] in (lay.num_experts, lay.num_experts + lay.extra_rows)
           and p.shape[1] == n1]
    b2 = [n for n, p in flat.items() if tuple(p.shape) == (lay.num_experts, lay.hidden)]
    pairs = [(x, y) for x in b13 for y in b2 if x != y] + [(x, None) for x in b13] + [(None, y) for y in b2]
    return [*pairs, (None, None)]


def _float_attr(module: nn.Module, words: tuple[str, ...]) -> list[float]:
    """Finite positive float attributes of ``module`` whose names contain one of ``words``."""
    out = []
    for key, value in vars(module).items():
        if any(w in key.lower() for w in words) and isinstance(value, float) and math.isfinite(value) and value > 0:
            out.append(value)
    return out


def _activation_names(module: nn.Module) -> list[str]:
    for owner in (module, *module.children()):  # DBRX keeps it on the experts' ``mlp``
        for attr in _ACTIVATION_ATTRS:
            fn = getattr(owner, attr, None)
            name = _ACTIVATION_CLASSES.get(type(fn).__name__) if fn is not None else None
            if name is not None:
                return [name]
    return list(ACTIVATIONS)


def _specs(module: nn.Module, gated: bool) -> list[ExpertActivation]:
    """Activation readings of ``module``, the one its attributes suggest first."""
    limits = [*_float_attr(module, ("limit",)), None]
    alphas = [a for a in _float_attr(module, ("alpha",)) if a != 1.0] + [1.0]
    concatenated = getattr(module, "is_concatenated", True)
    layouts = (["halves", "interleaved"] if concatenated else ["interleaved", "halves"]) if gated else ["halves"]
    out = []
    for name in _activation_names(module):
        for layout, limit, alpha, offset in itertools.product(layouts, limits, alphas, (0.0, 1.0) if gated else (0.0,)):
            spec = ExpertActivation(name, gated, layout, alpha if name == "silu" else 1.0, limit, offset)
            if not spec.problems() and spec not in out:
                out.append(spec)
    return out


# ------------------------------------------------------------------------------------------------
# The probe


def _top_k(module: nn.Module, slots: int) -> int:
    cfg = getattr(module, "config", None)
    k = getattr(cfg, "num_experts_per_tok", None) or getattr(module, "top_k", None) or 2
    return max(1, min(int(k) if isinstance(k, int) else 2, slots))


def _probe_ids(tokens: int, slots: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """``[T, K]`` distinct ids per row in ``[0, slots)``; every id appears (T >= slots), loads uneven."""
    rows = []
    for t in range(tokens):
        first = t % slots
        rest = [i for i in torch.randperm(slots, generator=gen).tolist() if i != first][: k - 1]
        rows.append([first, *rest])
    return torch.tensor(rows, dtype=torch.long)


def _probe_tokens(lay: _Layout, slots: int, k: int, budget: float) -> int:
    per_token = 6.0 * k * lay.hidden * lay.intermediate
    return int(max(slots, min(_MAX_PROBE_TOKENS, budget // max(per_token, 1.0))))


@dataclass
class _Probe:
    hidden: torch.Tensor
    ids: torch.Tensor
    weights: torch.Tensor
    out: torch.Tensor | None = None
    batch_view: bool = False  # the module returned [T, 1, H] (DBRX's view(batch, -1, H))


def _run_module(module: nn.Module, probes: list[_Probe]) -> str | None:
    """Fill every probe's ``out`` with the module's own forward; the reason when it cannot run."""
    for p in probes:
        try:
            out = type(module).forward(module, p.hidden, p.ids, p.weights)
        except (RuntimeError, ValueError, TypeError, IndexError) as exc:
            return f"the module's forward failed on probe inputs: {str(exc).splitlines()[0][:200]}"
        t, h = p.hidden.shape
        p.batch_view = isinstance(out, torch.Tensor) and tuple(out.shape) == (t, 1, h)
        if not isinstance(out, torch.Tensor) or tuple(out.shape) not in ((t, h), (t, 1, h)):
            got = list(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            return f"the module returns {got} for hidden states {list(p.hidden.shape)}"
        p.out = out.view(t, h)
    return None


def _error(want: torch.Tensor, got: torch.Tensor) -> float:
    want, got = want.float(), got.float()
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()


def _params(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach() for n, p in module.named_parameters()}


def _probes(module: nn.Module, lay: _Layout, slots: int, spec_limits: list[float], budget: float) -> list[_Probe]:
    """Probe inputs for a reading with ``slots`` ids: scales 1 and 4, and one that reaches the clamp bound."""
    w13 = module.get_parameter(lay.w13).detach()
    dtype, device = w13.dtype, w13.device
    k = _top_k(module, slots)
    tokens = _probe_tokens(lay, slots, k, budget)
    gen = torch.Generator().manual_seed(1234)
    scales = [1.0, 4.0]
    if spec_limits:
        rows = w13.transpose(1, 2) if lay.transposed else w13
        norm = rows[: lay.num_experts].float().pow(2).sum(-1).mean().sqrt().item()
        if norm > 0:
            scales.append(3.0 * max(spec_limits) / norm)
    out = []
    for scale in scales:
        hidden = (torch.randn(tokens, lay.hidden, generator=gen) * scale).to(device=device, dtype=dtype)
        ids = _probe_ids(tokens, slots, k, gen).to(device)
        weights = (torch.rand(tokens, k, generator=gen) + 0.1).to(device=device, dtype=dtype)
        out.append(_Probe(hidden, ids, weights))
    return out


def match_loop_experts(module: nn.Module, config: MoEConfig | None = None) -> LoopExpertsMatch | str:
    """How ``module`` maps onto ``moe_fx::experts``, checked on probe inputs; else why it does not."""
    config = config or MoEConfig()
    if config.verify == "never":
        return "a loop over hit experts is captured only after the numerical check, and verify='never'"
    params = _params(module)
    layouts = _layouts(params) or _split_layouts(module, params)
    if not layouts:
        return _no_layout_reason(params)
    budget = config.verify_max_flops
    best: tuple[float, str] = (math.inf, "")
    with torch.no_grad():
        for lay in layouts:
            specs = _specs(module, lay.gated)
            if lay.up is not None:  # gate and up rows interleave once packed into one storage
                specs = [sp for sp in specs if sp.gate_up_layout == "interleaved"]
            limits = sorted({s.limit for s in specs if s.limit is not None})
            extra = {lay.extra_rows} | {int(getattr(module, "zero_expert_num", 0) or 0)}
            for identity in sorted(extra, reverse=True):
                probes = _probes(module, lay, lay.num_experts + identity, limits, budget)
                failed = _run_module(module, probes)
                if failed is not None:
                    best = min(best, (math.inf, failed))
                    continue
                found = _first_match(module, lay, identity, specs, probes, params)
                if isinstance(found, LoopExpertsMatch):
                    return found
                best = min(best, found)
    return best[1] or "no reading of its parameters computes what the module computes"


def _first_match(
    module: nn.Module, lay: _Layout, identity: int, specs: list[ExpertActivation], probes: list[_Probe],
    params: dict[str, torch.Tensor],
) -> LoopExpertsMatch | tuple[float, str]:
    """The first (biases, activation, weights on input/output) reading equal to the module on every probe."""
    dtype = probes[0].hidden.dtype
    tol = _TOLERANCE.get(dtype, 3e-2)
    best: tuple[float, str] = (math.inf, "")
    for b13, b2 in _bias_readings(params, lay):
        draft = LoopExpertsMatch(lay.w13, lay.w2, lay.transposed, b13, b2, lay.num_experts, lay.hidden,
                                 lay.intermediate, identity, specs[0], False, math.nan, lay.up)
        w = draft.weights(module, copy=True)
        for spec in specs:
            for on_input in (False, True):
                err = 0.0
                for p in probes:
                    want = experts_reference(
                        p.hidden, p.ids, p.weights, w["w13"], w["w2"], spec.name, on_input,
                        w13_bias=w["w13_bias"], w2_bias=w["w2_bias"], gated=spec.gated,
                        gate_up_layout=spec.gate_up_layout, alpha=spec.alpha, limit=spec.limit,
                        up_offset=spec.up_offset, identity_experts=identity,
                    )
                    err = max(err, _error(want, p.out))
                    if not err <= tol:
                        break
                if err <= tol:
                    return LoopExpertsMatch(lay.w13, lay.w2, lay.transposed, b13, b2, lay.num_experts, lay.hidden,
                                            lay.intermediate, identity, spec, on_input, err, lay.up,
                                            probes[0].batch_view)
                if err < best[0]:
                    biases = "+".join(x for x in (b13, b2) if x) or "no biases"
                    best = (err, f"numerical check failed: relative error {err:.2e} > {tol:.0e} (best reading: "
                                 f"{spec.describe()}, {biases}, weights on {'input' if on_input else 'output'})")
    return best


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
        module.forward = types.MethodType(_captured_forward, module)
        w13 = module.get_parameter(found.w13)
        report.matched, report.num_experts, report.hidden = True, found.num_experts, found.hidden
        report.intermediate, report.top_k = found.intermediate, _top_k(module, found.num_experts)
        report.dtype, report.device = str(w13.dtype).replace("torch.", ""), w13.device.type
        report.activation, report.weights_on_input = found.spec.name, found.weights_on_input
        report.verified, report.details = "numerics", _details(found)
        report.probe, report.probe_error = "the module's own forward on random routed tokens", found.error
        log.info("moe_fx: experts loop %s -> moe_fx::experts: %s", report.layer, report.one_line())
    return reports


def release_expert_loops(model: nn.Module) -> int:
    """Undo :func:`capture_expert_loops`: restore the class forward of captured modules; returns how many."""
    count = 0
    for module in model.modules():
        if _captured(module):
            del module.forward
            count += 1
    return count
