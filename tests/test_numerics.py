"""Numerics: the rewritten graph against eager, for every family and form, fp32 and bf16.

Most tests run the rewritten Dynamo graph eagerly (Inductor adds nothing to what is checked here);
a few go through the whole ``backend="moe_fx"`` path with Inductor.
"""

from __future__ import annotations

import pytest
import torch

import moe_fx
from helpers import logits, rel_err, run_captured
from moe_fx.testing import HF_FAMILIES, DenseBmmMoE, LoopMoE, TitanGroupedMoE, tiny_hf_model

OP = "torch.ops.moe_fx.experts.default("
# fp32: the op's fp32 reference against the model's fp32 ops; bf16: a few bf16 roundings per layer.
TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2}

PROMPTS = {
    "random": lambda: torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(0)),
    "one_token": lambda: torch.tensor([[17]]),
    # The same token everywhere: every position picks (nearly) the same experts, the rest get none.
    "uneven": lambda: torch.full((1, 24), 5),
}


@pytest.mark.parametrize(
    "impl, dtype, prompts",
    [("grouped_mm", torch.float32, sorted(PROMPTS)), ("batched_mm", torch.float32, sorted(PROMPTS)),
     ("grouped_mm", torch.bfloat16, sorted(PROMPTS)), ("batched_mm", torch.bfloat16, ["uneven"])],
)
@pytest.mark.parametrize("family", HF_FAMILIES)
def test_hf_family_matches_eager(family, impl, dtype, prompts):
    """Random tokens, a batch of one token, and very uneven expert loads, through one compiled model.

    bf16 uses one layer: its MoE routing then sees bit-identical inputs in eager and compiled runs, so no
    near-tie in a later layer's top-k can flip (a flipped expert is a correct but different answer)."""
    layers = 2 if dtype == torch.float32 else 1
    model = tiny_hf_model(family, num_layers=layers, experts_implementation=impl, dtype=dtype)
    torch._dynamo.reset()
    from helpers import capture_backend
    from moe_fx.api import enable_capture

    enable_capture()
    backend, cap = capture_backend()
    compiled = torch.compile(model, backend=backend)
    for name in prompts:
        ids = PROMPTS[name]()
        with torch.no_grad():
            want, got = logits(model(ids)), logits(compiled(ids))
        assert rel_err(got, want) < TOL[dtype], name
    assert cap.count(OP) == layers * cap.compiles


def _uneven_tokens(t: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(t)
    return (torch.randn(1, 32, generator=g) + 0.01 * torch.randn(t, 32, generator=g)).to(dtype)


@pytest.mark.parametrize("tokens", [1, 7, "uneven"])
@pytest.mark.parametrize(
    "cls, dtype",
    [(TitanGroupedMoE, torch.bfloat16), (DenseBmmMoE, torch.float32), (DenseBmmMoE, torch.bfloat16),
     (LoopMoE, torch.float32), (LoopMoE, torch.bfloat16)],
)
def test_user_forms_match_eager(cls, dtype, tokens):
    torch.manual_seed(0)
    model = cls().to(dtype)
    if tokens == "uneven":
        x = _uneven_tokens(20, dtype)
    else:
        x = torch.randn(tokens, 32, generator=torch.Generator().manual_seed(1)).to(dtype)
    with torch.no_grad():
        want = model(x)
    got, cap = run_captured(model, x)
    assert cap.count(OP) == 1
    assert rel_err(got, want) < TOL[dtype]


@pytest.mark.parametrize("family", ["deepseek_v3"])
def test_inductor_end_to_end_fp32(family):
    """The whole backend (passes + Inductor) with a dynamic token dimension."""
    model = tiny_hf_model(family, num_layers=2)
    compiled = moe_fx.compile(model, dynamic=True)
    torch._dynamo.reset()
    with torch.no_grad():
        for t in (3, 11):
            ids = torch.randint(0, 128, (1, t), generator=torch.Generator().manual_seed(t))
            torch.testing.assert_close(logits(compiled(ids)), logits(model(ids)), rtol=1e-4, atol=1e-4)


def test_greedy_generate_identical_fp32():
    model = tiny_hf_model("mixtral", num_layers=2)
    compiled = tiny_hf_model("mixtral", num_layers=2)
    compiled.load_state_dict(model.state_dict())
    torch._dynamo.reset()
    from helpers import capture_backend
    from moe_fx.api import enable_capture

    enable_capture()
    backend, cap = capture_backend()
    compiled.forward = torch.compile(compiled.forward, backend=backend, dynamic=True)
    prompt = torch.randint(0, 128, (1, 10), generator=torch.Generator().manual_seed(3))
    gen = dict(max_new_tokens=16, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        want = model.generate(prompt, **gen)
        got = compiled.generate(prompt, **gen)
    assert cap.count(OP) >= 2, "the experts of the compiled model must run through moe_fx"
    assert torch.equal(got, want)
