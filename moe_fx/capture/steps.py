"""The ordered list of module capture steps and the loop that applies (and releases) them.

Like :data:`moe_fx.passes.manager.PASSES` for the graph passes: the order is data, printable
(:func:`describe_steps`), and each step observable by name in the ``moe_fx.capture`` log. A step patches
modules of a model in place before Dynamo traces it and reports every module it examined
(:class:`~moe_fx.passes.report.RegionReport`, matched or with the reason it was left alone); its release
undoes the patch.

Order: FP8 checkpoint experts first (a hit-loop candidate is never an FP8 module, so the two never compete
for one module; FP8 first keeps the reports in the order users read them: checkpoint format, then form).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from moe_fx.capture.fp8_modules import capture_fp8_experts, fp8_candidates, release_fp8_experts
from moe_fx.capture.hit_loops import capture_expert_loops, loop_candidates, release_expert_loops
from moe_fx.config import MoEConfig
from moe_fx.passes.report import RegionReport

__all__ = ["STEPS", "CaptureStep", "capture_modules", "describe_steps", "release_modules", "uncaptured_modules"]

log = logging.getLogger("moe_fx.capture")


@dataclass(frozen=True)
class CaptureStep:
    """One capture step.

    Attributes:
        name: how logs, timings and :func:`describe_steps` call it.
        apply: ``(model, config) -> reports``: patch the matching modules of ``model`` in place.
        release: ``(model) -> count``: undo ``apply`` on every module it patched.
        candidates: ``(model) -> [(path, module)]``: the modules ``apply`` examines that it has not patched
            (cheap: no matching, no probe).
        what: one line for :func:`describe_steps`.
    """

    name: str
    apply: Callable[[nn.Module, MoEConfig], list[RegionReport]]
    release: Callable[[nn.Module], int]
    candidates: Callable[[nn.Module], list[tuple[str, nn.Module]]]
    what: str


#: The capture order (see the module docstring).
STEPS: list[CaptureStep] = [
    CaptureStep("fp8_modules", capture_fp8_experts, release_fp8_experts, fp8_candidates,
                "transformers' fine-grained FP8 experts -> moe_fx::experts on their fp8 weights and scales"),
    CaptureStep("hit_loops", capture_expert_loops, release_expert_loops, loop_candidates,
                "loops over the experts a batch hits (graph breaks) -> moe_fx::experts on views of their weights"),
]


def describe_steps() -> str:
    """The capture steps, one line per step, in order."""
    return "\n".join(f"{i}. {s.name}: {s.what}" for i, s in enumerate(STEPS, 1))


def capture_modules(model: nn.Module, config: MoEConfig) -> list[RegionReport]:
    """Apply every step of :data:`STEPS` to ``model`` in order; the reports of all, in step order.

    Nothing happens when ``config.enabled`` is False. Idempotent (each step is).
    """
    if not config.enabled:
        return []
    reports: list[RegionReport] = []
    for step in STEPS:
        start = time.perf_counter()
        found = step.apply(model, config)
        for r in found:
            r.entry = "moe_fx.compile" if r.matched else ""  # a torch.compile backend never sees modules
        log.debug("capture step %s: %d of %d module(s) captured in %.1f ms", step.name,
                  sum(r.matched for r in found), len(found), 1e3 * (time.perf_counter() - start))
        reports += found
    return reports


def release_modules(model: nn.Module) -> int:
    """Release every step of :data:`STEPS` on ``model``, last step first; returns how many modules were released."""
    return sum(step.release(model) for step in reversed(STEPS))


def uncaptured_modules(model: nn.Module) -> list[tuple[str, str, str]]:
    """``(path, class name, step name)`` of every module of ``model`` a capture step would examine and has not
    patched: what ``torch.compile(model, backend="moe_fx")`` leaves as written (the backend's warning)."""
    return [(path, type(m).__name__, step.name) for step in STEPS for path, m in step.candidates(model)]
