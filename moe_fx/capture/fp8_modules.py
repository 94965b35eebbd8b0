"""Recognise transformers' fine-grained FP8 experts modules and route them to ``moe_fx::experts`` as they are.

transformers (5.x) loads a fine-grained FP8 checkpoint (``FineGrainedFP8Config``, DeepSeek-V3 style)
by swapping each ``*.experts`` module for ``FP8Experts``: fp8 e4m3 ``gate_up_proj [E, 2I, H]`` and
``down_proj [E, H, I]`` with fp32 ``*_scale_inv`` per 128x128 block, i.e. exactly the fp8 contract
of ``moe_fx::experts``. Its forwards cannot be captured as a graph (docs/fp8_checkpoints.md): the
``grouped_mm`` / ``batched_mm`` ones load a Triton kernel from the Hugging Face Hub inside the traced
code (without the ``kernels`` package, or offline, Dynamo fails at trace time), and ``eager`` loops
over experts with a data-dependent ``nonzero`` (graph breaks).

So this recognizer works on the module before tracing (a capture step, like the one DESIGN.md asks
for graph breaks): :func:`match_fp8_experts` checks that a module means what the op computes
(gated SwiGLU/GELU, no bias, no clamp or softcap, dynamic activation quantisation, 128x128 fp32
block scales of the right shapes, not expert-parallel) and says why not otherwise;
:func:`capture_fp8_experts` gives each matching module a forward that calls ``moe_fx::experts``
with the module's own fp8 parameters and scales -- no dequantise/requantise, no copy. Dynamo then
traces the op as one node and the lowering picks DeepGEMM's fp8 masked GEMMs, Triton's fp8 GEMMs or
the reference. Modules that do not match keep their forward and are reported with the reason.
"""

from __future__ import annotations

import logging
import types
from dataclasses import dataclass

import torch
from torch import nn

import moe_fx.ops  # noqa: F401  (registers torch.ops.moe_fx.experts)
from moe_fx.passes.report import RegionReport

__all__ = ["Fp8ExpertsMatch", "capture_fp8_experts", "fp8_candidates", "match_fp8_experts", "release_fp8_experts"]

log = logging.getLogger("moe_fx.passes")

_BLOCK = 128
#: transformers' ``hidden_act`` names -> moe_fx activation names (see moe_fx.ops.ACTIVATIONS).
_ACTIVATIONS = {
    "silu": "silu",
    "swish": "silu",
    "gelu": "gelu",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_new": "gelu_tanh",
}
_UNSUPPORTED_GATES = ("swiglu_alpha", "swiglu_limit", "limit", "gate_softcap", "up_softcap")


@dataclass(frozen=True)
class Fp8ExpertsMatch:
    """A recognised FP8 experts module: its shapes and the op arguments it maps to."""

    num_experts: int
    hidden: int
    intermediate: int
    activation: str


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _looks_like_fp8_experts(module: nn.Module) -> bool:
    # Duck-typed: transformers' class lives in transformers.integrations.finegrained_fp8 and is
    # re-decorated per model; its parameters are what matters.
    return hasattr(module, "gate_up_proj_scale_inv") or hasattr(module, "down_proj_scale_inv")


def match_fp8_experts(module: nn.Module) -> Fp8ExpertsMatch | str:
    """Whether ``module`` is an FP8 experts module ``moe_fx::experts`` computes exactly; else why not."""
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
    for name in _UNSUPPORTED_GATES:
        if getattr(module, name, None) is not None:
            return f"gated activation variant {name}={getattr(module, name)!r} is not the plain op"
    if _custom_gate(module):
        return f"{type(module).__name__} overrides _apply_gate"
    cfg = getattr(module, "config", None)
    act_name = None if cfg is None else (getattr(cfg, "hidden_activation", None) or getattr(cfg, "hidden_act", None))
    if act_name not in _ACTIVATIONS:
        return f"activation {act_name!r} has no moe_fx equivalent"
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
    return Fp8ExpertsMatch(e, h, two_i // 2, _ACTIVATIONS[act_name])


def _custom_gate(module: nn.Module) -> bool:
    try:
        from transformers.integrations.finegrained_fp8 import FP8Experts
    except ImportError:  # a look-alike module without transformers: judge by the attributes alone
        return False
    return isinstance(module, FP8Experts) and type(module)._apply_gate is not FP8Experts._apply_gate


def _moe_fx_fp8_forward(
    self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """FP8Experts.forward through ``moe_fx::experts``: fp8 weights and block scales used as stored."""
    return torch.ops.moe_fx.experts(
        hidden_states,
        top_k_index,
        top_k_weights,
        self.gate_up_proj,
        self.down_proj,
        self._moe_fx_activation,
        False,
        self.gate_up_proj_scale_inv,
        self.down_proj_scale_inv,
        self._moe_fx_kernel,
    )


def capture_fp8_experts(model: nn.Module, kernel: str = "auto") -> list[RegionReport]:
    """Route every matching FP8 experts module of ``model`` to ``moe_fx::experts`` (in place, before tracing).

    Returns one :class:`RegionReport` per FP8 experts module found (form ``"fp8_experts"``), matched or
    with the reason it was left alone. ``kernel`` is the op's kernel request (``MoEConfig.kernel``).
    Idempotent; :func:`release_fp8_experts` undoes it.
    """
    from moe_fx.ops import KERNELS

    if kernel not in KERNELS:
        raise ValueError(f"capture_fp8_experts: unknown kernel {kernel!r}; known: {KERNELS}")
    reports = []
    # The hidden states' dtype is the model's compute dtype: that of its first non-fp8 float weight.
    compute = next((p.dtype for p in model.parameters() if p.dtype.is_floating_point and p.element_size() > 1), None)
    dtype = str(compute).replace("torch.", "") if compute is not None else ""
    for name, module in model.named_modules():
        if not _looks_like_fp8_experts(module):
            continue
        family = type(model).__name__.replace("ForCausalLM", "")
        m = match_fp8_experts(module)
        if isinstance(m, str):
            reports.append(RegionReport(layer=name, form="fp8_experts", family=family, fp8=True, reason=m))
            log.info("moe_fx: FP8 experts %s left as they are: %s", name, m)
            continue
        module._moe_fx_activation = m.activation
        module._moe_fx_kernel = kernel
        module.forward = types.MethodType(_moe_fx_fp8_forward, module)
        w = module.gate_up_proj
        reports.append(
            RegionReport(
                layer=name, matched=True, form="fp8_experts", family=family, num_experts=m.num_experts,
                top_k=int(getattr(getattr(module, "config", None), "num_experts_per_tok", 0) or 0),
                hidden=m.hidden, intermediate=m.intermediate, dtype=dtype,
                device=w.device.type, fp8=True, activation=m.activation, verified="attributes",
            )
        )  # fmt: skip
        log.info("moe_fx: FP8 experts %s -> moe_fx::experts (fp8 weights and scales as stored)", name)
    return reports


def release_fp8_experts(model: nn.Module) -> int:
    """Undo :func:`capture_fp8_experts`: restore the class forward of captured modules; returns how many."""
    count = 0
    for module in model.modules():
        if "forward" in vars(module) and getattr(module.forward, "__func__", None) is _moe_fx_fp8_forward:
            del module.forward
            count += 1
    return count


def fp8_candidates(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of every FP8 experts module of ``model`` that :func:`capture_fp8_experts` has not routed."""
    return [(name, m) for name, m in model.named_modules() if _looks_like_fp8_experts(m)
            and getattr(vars(m).get("forward"), "__func__", None) is not _moe_fx_fp8_forward]
