"""Capture: no graph break inside MoE blocks, and one compile for every token count."""

from __future__ import annotations

import pytest
import torch
from helpers import capture_backend, rel_err

from moe_fx.backend import enable_capture
from moe_fx.testing.models import HF_FAMILIES, DenseBmmMoE, LoopMoE, TitanGroupedMoE, tiny_hf_model

OP = "torch.ops.moe_fx.experts.default("


def _moe_block(family: str, impl: str, dtype=torch.float32):
    model = tiny_hf_model(family, num_layers=1, experts_implementation=impl, dtype=dtype)
    return model.model.layers[0].mlp


@pytest.mark.parametrize("impl", ["grouped_mm", "batched_mm"])
@pytest.mark.parametrize("family", HF_FAMILIES)
def test_no_graph_break_in_hf_moe_blocks(family, impl):
    enable_capture()
    torch._dynamo.reset()
    block = _moe_block(family, impl)
    with torch.no_grad():
        result = torch._dynamo.explain(block)(torch.randn(1, 6, 32))
    assert result.graph_break_count == 0, result.break_reasons
    assert result.graph_count == 1


@pytest.mark.parametrize("cls, dtype", [(TitanGroupedMoE, torch.bfloat16), (DenseBmmMoE, torch.float32),
                                        (LoopMoE, torch.float32)])
def test_no_graph_break_in_user_blocks(cls, dtype):
    enable_capture()
    torch._dynamo.reset()
    with torch.no_grad():
        result = torch._dynamo.explain(cls().to(dtype))(torch.randn(6, 32, dtype=dtype))
    assert result.graph_break_count == 0, result.break_reasons


@pytest.mark.parametrize("form", ["qwen3_moe_block", "loop"])
def test_one_compile_serves_1_to_64_tokens(form):
    """With the token dimension marked dynamic (size-oblivious), T = 1..64 run on one compiled graph."""
    enable_capture()
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _moe_block("qwen3_moe", "grouped_mm") if form == "qwen3_moe_block" else LoopMoE()
    backend, cap = capture_backend()
    compiled = torch.compile(model, backend=backend)
    with torch.no_grad(), torch.fx.experimental._config.patch(backed_size_oblivious=True):
        for t in range(1, 65):
            x = torch.randn(t, 32) if form == "loop" else torch.randn(1, t, 32)
            torch._dynamo.mark_dynamic(x, 0 if form == "loop" else 1)
            got = compiled(x)
            if t in (1, 2, 17, 64):
                assert rel_err(got, model(x)) < 1e-5, t
    assert cap.compiles == 1, f"{cap.compiles} compiles for T = 1..64"
    assert cap.count(OP) == 1
