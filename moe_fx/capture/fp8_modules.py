"""Recognise transformers' fine-grained FP8 experts modules and route them to ``moe_fx::experts`` as they are.

transformers (5.x) loads a fine-grained FP8 checkpoint (``FineGrainedFP8Config``, DeepSeek-V3 style)
by swapping each ``*.experts`` module for ``FP8Experts``: fp8 e4m3 ``gate_up_proj [E, 2I, H]`` and
``down_proj [E, H, I]`` with fp32 ``*_scale_inv`` per 128x128 block, i.e. exactly the fp8 contract
of ``moe_fx::experts``. Its forwards cannot be captured as a graph (docs/fp8_checkpoints.md): the
``grouped_mm`` / ``batched_mm`` ones load a Triton kernel from the Hugging Face Hub inside the traced
code (without the ``kernels`` package, or offline, Dynamo fails at trace time), and ``eager`` loops
over experts with a data-dependent ``nonzero`` (graph breaks).

So this recognizer works on the module before tracing (a capture step, like the one DESIGN.md asks
for graph breaks), to the standard of :mod:`~moe_fx.capture.hit_loops`:

* :func:`match_fp8_experts` checks the op's contract from the parameters (gated ``gate_up_proj`` /
  ``down_proj`` in e4m3, fp32 128x128 block scales of the right shapes, no bias, dynamic activation
  quantisation, not transformers' own expert parallelism, an experts implementation whose kernels are
  modelled); then **records** the module's own forward (:func:`~moe_fx.capture.record_forward.record_forward`,
  on tokens that hit every expert) and **reads** it (:func:`~moe_fx.passes.recognize.read_form.read_form`: every op
  accounted for, the activation and where the routing weights multiply read from it), and **checks** it
  numerically (:func:`~moe_fx.capture.hit_loops.check_forward`: float32, per token, real and
  random fp8 weights and scales, against :func:`~moe_fx.ops.experts_reference` on the dequantised weights).
  transformers' fp8 matmuls are opaque kernels (a Hub Triton kernel, DeepGEMM) that cannot run here and
  could not be read: while recording and checking, :func:`modelled_fp8_kernels` puts in their place the
  products their contract states, ``x @ (w * s).T`` with ``s`` expanded over 128x128 blocks (the
  activations' dynamic 1x128 quantisation is rounding, like a cast), each recorded as one node
  (:func:`fp8_block_linear`, :func:`fp8_block_grouped_mm`, :func:`fp8_block_batched_mm`) that the reader
  reads as an expert product. Everything around the kernels (the gate, the routing, the combine, a
  subclass's extra steps) is the module's own code and is proved; the kernels are taken at their contract
  (docs/soundness.md). A module that computes something else is left alone, with the reason.
* :func:`capture_fp8_experts` gives each matching module a forward that calls ``moe_fx::experts``
  with the module's own fp8 parameters and scales -- no dequantise/requantise, no copy. Dynamo then
  traces the op as one node and the lowering picks DeepGEMM's fp8 masked GEMMs, Triton's fp8 GEMMs or
  the reference. Modules that do not match keep their forward and are reported with the reason.
"""

from __future__ import annotations

import contextlib
import logging
import math
import types
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn
from torch.overrides import handle_torch_function, has_torch_function

import moe_fx.ops  # noqa: F401  (registers torch.ops.moe_fx.experts)
from moe_fx.capture.hit_loops import check_forward, trace_inputs
from moe_fx.capture.patch import patch_forward, patched_with, release_patched
from moe_fx.capture.record_forward import record_forward
from moe_fx.config import MoEConfig
from moe_fx.ops import ExpertActivation, dequantize_blockwise
from moe_fx.passes.recognize.read_form import Boundary, FormReading, WeightView, read_form
from moe_fx.passes.report import RegionReport
from moe_fx.verify.check_numerics import OpWeights, Semantics, clamp_scale, random_weight

__all__ = [
    "Fp8ExpertsMatch",
    "capture_fp8_experts",
    "fp8_block_batched_mm",
    "fp8_block_grouped_mm",
    "fp8_block_linear",
    "fp8_candidates",
    "match_fp8_experts",
    "modelled_fp8_kernels",
    "release_fp8_experts",
]

log = logging.getLogger("moe_fx.passes")

_BLOCK = 128
#: transformers' experts implementations whose fp8 kernels :func:`modelled_fp8_kernels` stands in for.
_MODELLED = ("grouped_mm", "batched_mm", "eager")
#: The parameters the op reads, and the role of each in the reading.
_WEIGHTS = {"gate_up_proj": "w13", "down_proj": "w2"}


@dataclass(frozen=True)
class Fp8ExpertsMatch:
    """A recognised FP8 experts module: its shapes and the op arguments it maps to.

    Attributes:
        num_experts, hidden, intermediate: E, H, I.
        spec: the activation read from the module's forward.
        weights_on_input: the routing weights scale the expert input (read, not assumed).
        error: the largest per-token error of the numerical check.
        probe: what the numerical check ran, for reports.
    """

    num_experts: int
    hidden: int
    intermediate: int
    spec: ExpertActivation
    weights_on_input: bool = False
    error: float = math.nan
    probe: str = ""

    @property
    def activation(self) -> str:
        """The activation's name (``"silu"``)."""
        return self.spec.name

    def op_kwargs(self) -> dict[str, object]:
        """The op's keyword arguments that describe the activation beyond its name."""
        s = self.spec
        return {"gated": s.gated, "gate_up_layout": s.gate_up_layout, "alpha": s.alpha, "limit": s.limit,
                "up_offset": s.up_offset}


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _looks_like_fp8_experts(module: nn.Module) -> bool:
    # Duck-typed: transformers' class lives in transformers.integrations.finegrained_fp8 and is
    # re-decorated per model; its parameters are what matters.
    return hasattr(module, "gate_up_proj_scale_inv") or hasattr(module, "down_proj_scale_inv")


# ------------------------------------------------------------------------------------------------
# The fp8 products, as their contract states them (what the recording and the check run instead of
# transformers' kernels)


def _block_weight(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``w [N, K]`` (fp8) times its block scales ``[ceil(N/128), ceil(K/128)]``, in float32."""
    return dequantize_blockwise(w, scale, _BLOCK)


def fp8_block_linear(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x [..., K] @ (w * scale).T`` for one expert's fp8 ``w [N, K]`` and its block scales, in ``x``'s dtype.

    Recorded as one node (it dispatches ``__torch_function__``), which :mod:`read_form` reads as an expert product.
    """
    if has_torch_function((x, w, scale)):
        return handle_torch_function(fp8_block_linear, (x, w, scale), x, w, scale)
    return (x.float() @ _block_weight(w, scale).t()).to(x.dtype)


def fp8_block_grouped_mm(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, offsets: torch.Tensor
                         ) -> torch.Tensor:
    """Rows ``offsets[e-1]:offsets[e]`` of ``x [R, K]`` times ``(w[e] * scale[e]).T`` (fp8 ``w [E, N, K]``); rows
    past ``offsets[-1]`` are zero. One expert's weight is dequantised at a time. Recorded as one node."""
    if has_torch_function((x, w, scale, offsets)):
        return handle_torch_function(fp8_block_grouped_mm, (x, w, scale, offsets), x, w, scale, offsets)
    out = x.new_zeros(x.shape[0], w.shape[1])
    start = 0
    for e, end in enumerate(offsets.tolist()):
        if end > start:
            out[start:end] = fp8_block_linear(x[start:end], w[e], scale[e])
        start = end
    return out


def fp8_block_batched_mm(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Row ``r`` of ``x [R, K]`` times ``(w[ids[r]] * scale[ids[r]]).T`` (fp8 ``w [E, N, K]``); rows whose id names
    no expert are zero. Recorded as one node."""
    if has_torch_function((x, w, scale, ids)):
        return handle_torch_function(fp8_block_batched_mm, (x, w, scale, ids), x, w, scale, ids)
    out = x.new_zeros(x.shape[0], w.shape[1])
    for e in ids.unique().tolist():
        if 0 <= e < w.shape[0]:
            rows = ids == e
            out[rows] = fp8_block_linear(x[rows], w[e], scale[e])
    return out


def _check_block(block_size: object, activation_scale: object = None) -> None:
    if block_size is None or [int(b) for b in block_size] != [_BLOCK, _BLOCK]:
        raise ValueError(f"fp8 weight block {block_size} is not modelled (only {_BLOCK}x{_BLOCK})")
    if activation_scale is not None:
        raise ValueError("static activation scales are not modelled (only dynamic quantisation)")


def _linear(input: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor, block_size: object = None,
            bias: torch.Tensor | None = None, activation_scale: torch.Tensor | None = None,
            allow_deepgemm: bool = True) -> torch.Tensor:
    """transformers' ``fp8_linear`` by its contract (DeepGEMM or the Hub's Triton kernel there)."""
    _check_block(block_size, activation_scale)
    out = fp8_block_linear(input, weight, weight_scale_inv)
    return out if bias is None else out + bias


# The Hub kernel's entry points (transformers' ``FineGrainedFP8`` bundle), by their contract.
def _kernel_matmul(input: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor, block_size: object = None,
                   output_dtype: torch.dtype | None = None, activation_scale: torch.Tensor | None = None
                   ) -> torch.Tensor:
    _check_block(block_size, activation_scale)
    out = fp8_block_linear(input, weight, weight_scale_inv)
    return out if output_dtype is None else out.to(output_dtype)


def _kernel_batched(input: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor, block_size: object = None,
                    expert_ids: torch.Tensor | None = None) -> torch.Tensor:
    _check_block(block_size)
    return fp8_block_batched_mm(input, weight, weight_scale_inv, expert_ids)


def _kernel_grouped(input: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor,
                    offsets: torch.Tensor | None = None, tokens_per_expert: torch.Tensor | None = None,
                    block_size: object = None) -> torch.Tensor:
    _check_block(block_size)
    return fp8_block_grouped_mm(input, weight, weight_scale_inv, offsets)


_MODELLED_KERNEL = types.SimpleNamespace(matmul=_kernel_matmul, batched_matmul=_kernel_batched,
                                         grouped_matmul=_kernel_grouped)


@contextlib.contextmanager
def modelled_fp8_kernels() -> Iterator[None]:
    """Meanwhile, transformers' fine-grained fp8 kernels (``fp8_linear``, the Hub kernel's ``matmul`` /
    ``batched_matmul`` / ``grouped_matmul``) are the products of their contract (:func:`fp8_block_linear` and
    kin), so a module's forward runs anywhere and records into nodes :mod:`read_form` reads."""
    try:
        from transformers.integrations import finegrained_fp8 as tf8
    except ImportError:  # a look-alike module without transformers: its own forward, as it is
        yield
        return
    saved = {name: getattr(tf8, name) for name in ("fp8_linear", "load_finegrained_fp8_kernel") if hasattr(tf8, name)}
    tf8.fp8_linear = _linear
    tf8.load_finegrained_fp8_kernel = lambda: _MODELLED_KERNEL
    try:
        yield
    finally:
        for name in ("fp8_linear", "load_finegrained_fp8_kernel"):
            if name in saved:
                setattr(tf8, name, saved[name])
            else:
                delattr(tf8, name)


# ------------------------------------------------------------------------------------------------
# Matching


def _contract_reason(module: nn.Module) -> str | None:
    """Why ``module``'s parameters and attributes do not fit the op's fp8 arguments, or None."""
    if not _looks_like_fp8_experts(module):
        return "not an FP8 experts module (no *_scale_inv)"
    if not getattr(module, "has_gate", True) or not hasattr(module, "gate_up_proj"):
        return "ungated experts (up_proj only)"
    if getattr(module, "has_bias", False) or getattr(module, "gate_up_proj_bias", None) is not None:
        return "experts with bias"
    if getattr(module, "_is_expert_parallel", False):
        return "already expert-parallel (transformers' own EP)"
    if getattr(module, "activation_scheme", "dynamic") != "dynamic":
        return f"activation_scheme={module.activation_scheme!r} (static activation scales); only dynamic is supported"
    impl = getattr(getattr(module, "config", None), "_experts_implementation", None) or "eager"
    if getattr(type(module).forward, "__wrapped__", None) is not None and impl not in _MODELLED:
        return f"experts implementation {impl!r} calls kernels moe_fx does not model (only {', '.join(_MODELLED)})"
    w13, w2 = module.gate_up_proj, module.down_proj
    s13, s2 = module.gate_up_proj_scale_inv, module.down_proj_scale_inv
    if w13.dtype != torch.float8_e4m3fn or w2.dtype != torch.float8_e4m3fn:
        return f"weights are {w13.dtype}/{w2.dtype}, not float8_e4m3fn (FP4 or another format)"
    if w13.dim() != 3 or w2.dim() != 3:
        return f"weights are not stacked [E, N, K]: {list(w13.shape)}, {list(w2.shape)}"
    e, two_i, h = w13.shape
    if two_i % 2 or tuple(w2.shape) != (e, h, two_i // 2):
        return f"inconsistent shapes gate_up_proj {list(w13.shape)}, down_proj {list(w2.shape)}"
    block = getattr(module, "block_size", None)
    if block is None or tuple(block) != (_BLOCK, _BLOCK):
        return f"weight block {block} is not 128x128"
    for name, w, s in (("gate_up_proj", w13, s13), ("down_proj", w2, s2)):
        want = (e, _cdiv(w.shape[1], _BLOCK), _cdiv(w.shape[2], _BLOCK))
        if s.dtype != torch.float32 or tuple(s.shape) != want:
            return f"{name}_scale_inv is {s.dtype} {list(s.shape)}, want float32 {list(want)} (128x128 blocks)"
    return None


def _top_k(module: nn.Module, num_experts: int) -> int:
    k = getattr(getattr(module, "config", None), "num_experts_per_tok", None)
    return max(1, min(int(k) if isinstance(k, int) else 2, num_experts))


def _read(module: nn.Module, k: int) -> FormReading | str:
    """Record the module's forward on tokens that hit every expert (its kernels modelled) and read it."""
    e, _, h = module.gate_up_proj.shape
    inputs = trace_inputs(h, e, k, module.gate_up_proj.device, torch.float32)
    try:
        with torch.no_grad(), modelled_fp8_kernels():
            rec = record_forward(lambda x, i, w: type(module).forward(module, x, i, w), inputs,
                                 dict(module.named_parameters()))
    except (RuntimeError, ValueError, TypeError, IndexError, NotImplementedError, AttributeError) as exc:
        return f"the module's forward failed on probe inputs: {str(exc).splitlines()[0][:200] if str(exc) else exc!r}"
    out = rec.value
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != tuple(inputs[0].shape) or rec.output is None:
        got = list(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        return f"the module returns {got} for hidden states {list(inputs[0].shape)}"
    views = {}
    for name, role in _WEIGHTS.items():
        w, s = rec.params.get(name), rec.params.get(f"{name}_scale_inv")
        if w is None or s is None:
            return f"its forward does not read {name if w is None else name + '_scale_inv'}"
        views[w] = WeightView(role, ("e", "o", "i"))
        views[s] = WeightView("scale", ("e", "o", "i"), of=w)
    hidden, ids, weights = rec.inputs
    boundary = Boundary(hidden, ids, weights, False, views, e, k, gated=True)
    nodes = [n for n in rec.graph.nodes if n.op in ("call_function", "call_method")]
    reading = read_form(nodes, rec.output, boundary)
    if isinstance(reading, FormReading) and reading.identity_experts:
        return f"{reading.identity_experts} of its experts return their input, which no id was routed to"
    return reading


def _random_fp8(w: torch.Tensor, s: torch.Tensor, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random fp8 weights of ``w``'s shape (unit values) and block scales of ``s``'s (``~1/sqrt(K)``, varied)."""
    rand_w = random_weight(tuple(w.shape), 1, gen, device=w.device, dtype=w.dtype)
    scale = (torch.rand(*s.shape, generator=gen) + 0.5) / math.sqrt(w.shape[-1])
    return rand_w, scale.to(device=s.device, dtype=s.dtype)


def _check(module: nn.Module, reading: FormReading, k: int, config: MoEConfig):
    """The module's forward (kernels modelled) against the reference on the dequantised weights, with its real
    fp8 weights and scales and with random ones of the same shapes (:func:`check_forward`)."""
    gen = torch.Generator().manual_seed(1234)
    real = {n: p.detach() for n, p in module.named_parameters()}
    rand = dict(real)
    for name in _WEIGHTS:
        rand[name], rand[f"{name}_scale_inv"] = _random_fp8(real[name], real[f"{name}_scale_inv"], gen)
    sets = {"real": real, "random": rand}
    ops = {n: OpWeights(ws["gate_up_proj"], ws["down_proj"], w13_scale=ws["gate_up_proj_scale_inv"],
                        w2_scale=ws["down_proj_scale_inv"]) for n, ws in sets.items()}
    limit = reading.spec.limit
    clamps = {n: None if limit is None else clamp_scale(dequantize_blockwise(op.w13[:8], op.w13_scale[:8]), limit)
              for n, op in ops.items()}
    sem = Semantics(reading.spec, reading.weights_on_input)
    intermediate = module.down_proj.shape[2]
    return check_forward(module, sets, ops, clamps, sem, k, intermediate, config, gen, modelled_fp8_kernels)


def match_fp8_experts(module: nn.Module, config: MoEConfig | None = None) -> Fp8ExpertsMatch | str:
    """Whether ``module`` is an FP8 experts module ``moe_fx::experts`` computes exactly; else why not.

    The parameters must fit the op's fp8 arguments; then the module's forward is recorded and read
    (:func:`~moe_fx.passes.recognize.read_form.read_form`: the structure proves the form, transformers' fp8 kernels taken
    at their contract, :func:`modelled_fp8_kernels`) and checked numerically. No module is captured on its
    attributes alone.
    """
    config = config or MoEConfig()
    bad = _contract_reason(module)
    if bad is not None:
        return bad
    if config.verify == "never":
        return "an FP8 experts module is captured only after the numerical check, and verify='never'"
    e, two_i, h = module.gate_up_proj.shape
    k = _top_k(module, e)
    reading = _read(module, k)
    if isinstance(reading, str):
        return reading
    result, ran = _check(module, reading, k, config)
    if not result.ok:
        return result.reason
    return Fp8ExpertsMatch(e, h, two_i // 2, reading.spec, reading.weights_on_input, result.error, ran)


def _moe_fx_fp8_forward(
    self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """FP8Experts.forward through ``moe_fx::experts``: fp8 weights and block scales used as stored."""
    m: Fp8ExpertsMatch = self._moe_fx_fp8
    return torch.ops.moe_fx.experts(
        hidden_states,
        top_k_index,
        top_k_weights,
        self.gate_up_proj,
        self.down_proj,
        m.activation,
        m.weights_on_input,
        self.gate_up_proj_scale_inv,
        self.down_proj_scale_inv,
        self._moe_fx_kernel,
        **m.op_kwargs(),
    )


def _captured(module: nn.Module) -> bool:
    return patched_with(module, _moe_fx_fp8_forward)


def capture_fp8_experts(model: nn.Module, config: MoEConfig | None = None) -> list[RegionReport]:
    """Route every matching FP8 experts module of ``model`` to ``moe_fx::experts`` (in place, before tracing).

    Returns one :class:`RegionReport` per FP8 experts module found (form ``"fp8_experts"``), matched or
    with the reason it was left alone. ``config.kernel`` is the op's kernel request; ``config.verify`` and
    ``verify_max_flops`` shape the numerical check. Idempotent; :func:`release_fp8_experts` undoes it.
    """
    config = config or MoEConfig()
    reports = []
    # The hidden states' dtype is the model's compute dtype: that of its first non-fp8 float weight.
    compute = next((p.dtype for p in model.parameters() if p.dtype.is_floating_point and p.element_size() > 1), None)
    dtype = str(compute).replace("torch.", "") if compute is not None else ""
    for name, module in model.named_modules():
        if not _looks_like_fp8_experts(module):
            continue
        family = type(model).__name__.replace("ForCausalLM", "")
        m = module._moe_fx_fp8 if _captured(module) else match_fp8_experts(module, config)
        if isinstance(m, str):
            reports.append(RegionReport(layer=name, form="fp8_experts", family=family, fp8=True, reason=m))
            log.info("moe_fx: FP8 experts %s left as they are: %s", name, m)
            continue
        module._moe_fx_fp8 = m
        module._moe_fx_kernel = config.kernel
        patch_forward(module, _moe_fx_fp8_forward)
        w = module.gate_up_proj
        reports.append(
            RegionReport(
                layer=name, matched=True, form="fp8_experts", family=family, num_experts=m.num_experts,
                top_k=_top_k(module, m.num_experts), hidden=m.hidden, intermediate=m.intermediate, dtype=dtype,
                device=w.device.type, fp8=True, activation=m.activation, weights_on_input=m.weights_on_input,
                verified="numerics", probe=m.probe, probe_error=m.error,
                details="" if m.spec.is_plain else m.spec.describe(),
            )
        )  # fmt: skip
        log.info("moe_fx: FP8 experts %s -> moe_fx::experts (fp8 weights and scales as stored)", name)
    return reports


def release_fp8_experts(model: nn.Module) -> int:
    """Undo :func:`capture_fp8_experts`: restore the class forward of captured modules; returns how many."""
    return release_patched(model, _moe_fx_fp8_forward)


def fp8_candidates(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of every FP8 experts module of ``model`` that :func:`capture_fp8_experts` has not routed."""
    return [(name, m) for name, m in model.named_modules() if _looks_like_fp8_experts(m) and not _captured(m)]
