"""The ordered list of module capture steps (moe_fx.capture.steps): printable, applied in order, released."""

from __future__ import annotations

import torch

from moe_fx.capture.steps import STEPS, capture_modules, describe_steps, release_modules, uncaptured_modules
from moe_fx.config import MoEConfig
from moe_fx.testing.families import HitLoopMoE


def test_steps_are_data_in_order():
    assert [s.name for s in STEPS] == ["fp8_modules", "hit_loops"]
    lines = describe_steps().splitlines()
    assert lines[0].startswith("1. fp8_modules: ") and lines[1].startswith("2. hit_loops: ")


def test_capture_then_release_puts_the_module_back():
    torch.manual_seed(0)
    model = HitLoopMoE().eval()
    x = torch.randn(5, 32)
    with torch.no_grad():
        want = model(x)
    assert uncaptured_modules(model) == [("experts", "HitLoopExperts", "hit_loops")]
    (report,) = capture_modules(model, MoEConfig())
    assert (report.matched, report.form, report.entry) == (True, "hit_loop", "moe_fx.compile")
    assert "forward" in vars(model.experts) and uncaptured_modules(model) == []
    with torch.no_grad():
        torch.testing.assert_close(model(x), want, rtol=1e-5, atol=1e-6)  # through moe_fx::experts now
    assert capture_modules(model, MoEConfig(enabled=False)) == []
    assert release_modules(model) == 1 and "forward" not in vars(model.experts)
    assert release_modules(model) == 0 and uncaptured_modules(model) == [("experts", "HitLoopExperts", "hit_loops")]
