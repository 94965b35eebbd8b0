"""autocast (issue 11, point 3): a region under ``torch.autocast`` is either rewritten and equal to
eager autocast, or left as written with a reason; the compile never fails."""

from __future__ import annotations

import pytest
import torch
from helpers import logits, rel_err, run_captured

import moe_fx
from moe_fx.testing.models import DenseBmmMoE, LoopMoE, TitanGroupedMoE, tiny_hf_model

OP = "torch.ops.moe_fx.experts.default("

CASES = {
    # fp32 models: autocast runs their expert products in bf16, which the op would not -> left alone
    "loop_fp32": (LoopMoE, lambda: torch.randn(6, 32), False),
    "dense_fp32": (DenseBmmMoE, lambda: torch.randn(6, 32), False),
    "hf_batched_mm_fp32": (lambda: tiny_hf_model("qwen3_moe", num_layers=1, experts_implementation="batched_mm"),
                           lambda: torch.randint(0, 128, (1, 6)), False),
    # transformers' fp32 grouped_mm runs its own op, which autocast leaves in fp32 -> rewritten, same result
    "hf_grouped_mm_fp32": (lambda: tiny_hf_model("mixtral", num_layers=1), lambda: torch.randint(0, 128, (1, 6)), True),
    # bf16 models: autocast changes nothing inside the region -> rewritten
    "titan_bf16": (lambda: TitanGroupedMoE().bfloat16(), lambda: torch.randn(6, 32, dtype=torch.bfloat16), True),
    "hf_bf16": (lambda: tiny_hf_model("mixtral", num_layers=1, dtype=torch.bfloat16),
                lambda: torch.randint(0, 128, (1, 6)), True),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_region_under_autocast_is_rewritten_right_or_left_alone(case):
    make, inputs, rewritten = CASES[case]
    torch.manual_seed(0)
    model, x = make(), inputs()
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
        want = logits(model(x)).float()
        got, cap = run_captured(model, x)  # raised BackendCompilerFailed (index_add_ Float/BFloat16) before
    (r,) = cap.reports
    assert r.matched == rewritten, r.reason
    if rewritten:
        assert cap.count(OP) == 1
        assert rel_err(logits(got).float(), want) < 1e-2
    else:
        assert cap.count(OP) == 0 and r.reason.startswith("autocast: the expert product")
        assert torch.equal(logits(got).float(), want)


def test_issue_example_compiles_through_inductor_under_autocast():
    """A tiny fp32 Mixtral under ``torch.autocast("cpu", torch.bfloat16)``, whole backend."""
    model = tiny_hf_model("mixtral", num_layers=2)
    ids = torch.randint(0, 128, (1, 9), generator=torch.Generator().manual_seed(0))
    torch._dynamo.reset()
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
        want = model(ids).logits.float()
        got = moe_fx.compile(model)(ids).logits.float()
        report = moe_fx.explain(model, ids)
    assert rel_err(got, want) < 2e-2
    assert len(report.regions) == 2 and all(r.matched or "autocast" in r.reason for r in report.regions)


def test_op_ignores_ambient_autocast():
    """The op computes in its inputs' dtypes: an fp32 call under bf16 autocast gives the fp32 result."""
    g = torch.Generator().manual_seed(0)
    hidden, w13 = torch.randn(5, 16, generator=g), torch.randn(4, 16, 16, generator=g)
    w2 = torch.randn(4, 16, 8, generator=g)
    ids, weights = torch.tensor([[0, 1], [2, 3], [1, 1], [3, 0], [2, 2]]), torch.rand(5, 2, generator=g)
    want = torch.ops.moe_fx.experts(hidden, ids, weights, w13, w2)
    with torch.autocast("cpu", torch.bfloat16):
        got = torch.ops.moe_fx.experts(hidden, ids, weights, w13, w2)
    assert got.dtype == torch.float32 and torch.equal(got, want)
