"""Shared helpers for the graph-rewrite and numerics tests (no Inductor unless asked)."""

from __future__ import annotations

import importlib.util
import pathlib
import sys
import types
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from moe_fx.backend import enable_capture, make_backend
from moe_fx.config import MoEConfig
from moe_fx.passes.report import RegionReport

#: ``tiny_hf_model`` keywords for graph tests that print Dynamo's code of a transformers model. Under sdpa
#: attention the traced code depends on the torch version: transformers' masking_utils skips the causal
#: mask (``is_causal=True``, GQA inside sdpa) only where Dynamo does not fold ``torch.compiler.is_exporting()``
#: to True (pytorch#176499: torch 2.13 yes, 2.11 no); elsewhere it builds the mask and traces ``repeat_kv``,
#: whose ``hidden_states`` locals shift Dynamo's ``hidden_states_N`` numbering of every later name.
#: Eager attention always builds the mask and repeats k/v, so the printed graph is the same on both.
ATTENTION_SAME_ON_EVERY_TORCH = {"_attn_implementation": "eager"}


@dataclass
class Captured:
    """What a compile through the moe_fx passes produced: graph code after the pass, reports, count."""

    codes: list[str] = field(default_factory=list)
    reports: list[RegionReport] = field(default_factory=list)
    compiles: int = 0

    @property
    def code(self) -> str:
        return "\n".join(self.codes)

    def count(self, needle: str) -> int:
        return self.code.count(needle)


class OpSpy(TorchDispatchMode):
    """Records ``(args, kwargs)`` of every ``moe_fx::experts`` call made while it is active."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[tuple, dict]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.moe_fx.experts.default:
            self.calls.append((args, kwargs or {}))
        return func(*args, **(kwargs or {}))


def capture_backend(config: MoEConfig | None = None, *, passes: bool = True):
    """A backend that runs the moe_fx passes (or none) and the graph eagerly, recording what it saw."""
    cap = Captured()
    inner = make_backend(config or MoEConfig(enabled=passes), sink=cap.reports, inductor=False)

    def backend(gm, inputs):
        cap.compiles += 1
        fn = inner(gm, inputs)
        cap.codes.append(gm.code)
        return fn

    return backend, cap


def run_captured(model, *inputs, config: MoEConfig | None = None, passes: bool = True, **compile_kwargs):
    """Compile ``model`` through :func:`capture_backend` (fresh Dynamo state), run it, return (out, Captured)."""
    torch._dynamo.reset()
    enable_capture()
    backend, cap = capture_backend(config, passes=passes)
    with torch.no_grad():
        out = torch.compile(model, backend=backend, **compile_kwargs)(*inputs)
    return out, cap


def logits(out):
    """The logits of a transformers output (its last hidden state for a model without a head), or the tensor."""
    if hasattr(out, "logits"):
        return out.logits
    return out.last_hidden_state if hasattr(out, "last_hidden_state") else out


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative Frobenius error of ``a`` against ``b`` in float64."""
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def experts_in_one_copy(experts) -> bool:
    """True if every gate/up/down weight of ``experts`` (SwiGLU modules) lies in its slot of one live pair
    of stacks, the ones the compiled op reads (one copy of the experts in memory)."""
    from moe_fx.passes.expert_storage import existing_stacks

    weights = [[getattr(e, name).weight for e in experts] for name in ("gate_proj", "up_proj", "down_proj")]
    return existing_stacks(*weights) is not None


def load_bench(name: str) -> types.ModuleType:
    """The module of ``bench/<name>.py`` (bench scripts import their siblings by name: bench/ is on the path
    while it loads)."""
    bench = pathlib.Path(__file__).resolve().parents[1] / "bench"
    sys.path.insert(0, str(bench))
    try:
        spec = importlib.util.spec_from_file_location(f"{name}_bench", bench / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod  # dataclasses look their module up while the class is made
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(str(bench))
    return mod
