"""Every rewritten region is checked numerically (issue 11, point 1): a probe of the region itself,
reduced to a few tokens when the full problem costs more than ``verify_max_flops``, whose routing
reaches every expert; ``verify="never"`` rewrites on structure alone and says so."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from helpers import rel_err, run_captured
from torch import nn

import moe_fx
from moe_fx.config import MoEConfig
from moe_fx.testing.models import LoopMoE, SwiGLUExpert
from moe_fx.verify.probe_plan import plan_probe, probe_routing

OP = "torch.ops.moe_fx.experts.default("
#: A budget below every probe below: each region gets the reduced probe.
TINY_BUDGET = MoEConfig(verify_max_flops=1e3)


class GatherBmmMoE(nn.Module):
    """Stacked weights ``[E, 2I, H]`` / ``[E, H, I]`` gathered per routed token and applied with ``bmm``
    (transformers' ``batched_mm`` shape). ``act`` is ``"silu"`` (SwiGLU), ``"sigmoid"`` (a sigmoid GLU,
    ``sigmoid(g) * u``: not an op activation) or ``"silu_by_hand"`` (``g * sigmoid(g) * u``: SwiGLU);
    ``inner_scale`` multiplies each expert's activation (2: the extra ``* 2`` of the issue, inside the
    experts, so inside the region)."""

    def __init__(self, hidden=32, inter=16, num_experts=8, top_k=2, act="silu", inner_scale=1.0):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.router = nn.Parameter(torch.randn(num_experts, hidden, generator=g) * 0.3)
        self.w13 = nn.Parameter(torch.randn(num_experts, 2 * inter, hidden, generator=g) * 0.2)
        self.w2 = nn.Parameter(torch.randn(num_experts, hidden, inter, generator=g) * 0.2)
        self.top_k, self.act, self.inner_scale = top_k, act, inner_scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = torch.topk(F.softmax(x @ self.router.t(), dim=-1), self.top_k, dim=-1)
        flat = ids.reshape(-1)
        xs = x.repeat_interleave(self.top_k, dim=0)
        h = torch.bmm(self.w13[flat], xs.unsqueeze(-1)).squeeze(-1)
        g, u = h.chunk(2, dim=-1)
        if self.act == "silu":
            a = F.silu(g) * u
        elif self.act == "sigmoid":
            a = torch.sigmoid(g) * u
        else:
            a = g * torch.sigmoid(g) * u
        if self.inner_scale != 1.0:
            a = a * self.inner_scale
        y = torch.bmm(self.w2[flat], a.unsqueeze(-1)).squeeze(-1) * weights.reshape(-1, 1)
        return y.view(x.shape[0], self.top_k, x.shape[1]).sum(dim=1)


def _x(t: int, h: int = 32, seed: int = 1) -> torch.Tensor:
    return torch.randn(t, h, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("act", ["silu", "silu_by_hand"])
def test_over_budget_region_is_verified_on_a_reduced_probe(act, dynamic):
    """Above the budget the region is still run and compared, on a few tokens, then rewritten."""
    model = GatherBmmMoE(act=act)
    x = _x(40)
    got, cap = run_captured(model, x, config=TINY_BUDGET, dynamic=dynamic)
    (r,) = cap.reports
    assert r.matched and cap.count(OP) == 1
    assert r.verified == "numerics" and r.probe.startswith("reduced T="), r.probe
    assert ("T=64 x2" in r.probe) == dynamic, "a symbolic T is also checked well above the traced one"
    assert r.probe_error < 1e-4
    with torch.no_grad():
        assert rel_err(got, model(x)) < 1e-5


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("variant, why", [(dict(act="sigmoid"), "multiplies the sigmoid of the gate by the up"),
                                          (dict(inner_scale=2.0), "scales act(gate) * up by 2")])
def test_over_budget_region_computing_something_else_is_left_untouched(variant, why, dynamic):
    """The issue's counter-examples: a sigmoid GLU and an extra ``* 2``, both above the probe budget.
    Before, they were rewritten on structure alone as SwiGLU (relative error 10.6 and 0.5); then caught by the
    reduced probe; now the structure refuses them, naming the op, before any probe runs."""
    model = GatherBmmMoE(**variant)
    x = _x(40)
    got, cap = run_captured(model, x, config=TINY_BUDGET, dynamic=dynamic)
    (r,) = cap.reports
    assert not r.matched and cap.count(OP) == 0
    assert why in r.reason and not r.probe, r.reason
    with torch.no_grad():
        assert rel_err(got, model(x)) < 1e-6


class _ScaledExperts(GatherBmmMoE):
    """Multiplies each expert's activation by the attribute ``scale`` (a Python float)."""

    scale = 1.0

    def forward(self, x):
        weights, ids = torch.topk(F.softmax(x @ self.router.t(), dim=-1), self.top_k, dim=-1)
        flat = ids.reshape(-1)
        h = torch.bmm(self.w13[flat], x.repeat_interleave(self.top_k, dim=0).unsqueeze(-1)).squeeze(-1)
        g, u = h.chunk(2, dim=-1)
        y = torch.bmm(self.w2[flat], (F.silu(g) * u * self.scale).unsqueeze(-1)).squeeze(-1)
        return (y * weights.reshape(-1, 1)).view(x.shape[0], self.top_k, x.shape[1]).sum(dim=1)


def test_region_reading_a_run_time_scalar_is_specialised_on_its_value():
    """With dynamic=True Dynamo makes a float attribute a graph input, which can change between calls.
    At 1.0 the region equals SwiGLU: it is rewritten with the graph guarded on the value, so a later
    ``scale = 2`` recompiles (and that region, SwiGLU times 2, is left as written: the structure reads the
    extra scale)."""
    model = _ScaledExperts()
    x = _x(6)
    torch._dynamo.reset()
    from helpers import capture_backend

    from moe_fx.backend import enable_capture

    enable_capture()
    backend, cap = capture_backend()
    compiled = torch.compile(model, backend=backend, dynamic=True)
    with torch.no_grad():
        assert rel_err(compiled(x), model(x)) < 1e-5
        assert cap.compiles == 1 and cap.reports[0].matched, cap.reports[0].reason
        model.scale = 2.0
        got = compiled(x)
        assert rel_err(got, model(x)) < 1e-6
    assert cap.compiles == 2, "the new value must fail the guard and recompile"
    assert not cap.reports[1].matched and "scales act(gate) * up by 2" in cap.reports[1].reason


def test_issue_sizes_get_a_small_reduced_probe():
    """H = I = 1024, K = 2, 2048 tokens on CPU (over the default budget): a few tokens, every expert."""
    cfg = MoEConfig()
    plan = plan_probe(2048, 2, 8, 2, 1024, 1024, cfg.verify_max_flops, cfg.verify)
    assert plan.reduced and 4 <= plan.tokens <= 64 and plan.runs >= 2
    assert plan.flops <= cfg.verify_max_flops
    assert plan_probe(2048, 2, 8, 2, 1024, 1024, cfg.verify_max_flops, "always").tokens == 2048
    assert not plan_probe(14, 2, 8, 2, 32, 16, cfg.verify_max_flops, "auto").reduced


@pytest.mark.parametrize("tokens, runs, experts, top_k", [(1, 8, 16, 2), (5, 2, 8, 2), (32, 2, 64, 8), (3, 2, 4, 4)])
def test_probe_routing_reaches_every_expert_with_distinct_ids_per_token(tokens, runs, experts, top_k):
    plan = plan_probe(tokens, top_k, experts, top_k, 32, 16, 1e12, "auto")
    assert plan.runs >= runs
    routing = probe_routing(plan.tokens, plan.runs, experts, top_k, torch.Generator().manual_seed(0))
    assert len(routing) == plan.runs
    seen = torch.cat([ids.flatten() for ids in routing]).unique()
    assert seen.tolist() == list(range(experts)), "every expert weight must be exercised"
    for ids in routing:
        assert ids.shape == (plan.tokens, top_k) and ids.dtype == torch.int64
        assert all(len(set(row)) == top_k for row in ids.tolist()), "a token names an expert once (top-k)"


class _GeluExpert(SwiGLUExpert):
    def forward(self, x):
        return self.down_proj(F.gelu(self.gate_proj(x)) * self.up_proj(x))


@pytest.mark.parametrize("tokens", [1, 3])
def test_probe_reaches_an_odd_expert_at_decode_sizes(tokens):
    """One expert of eight (expert 2) computes GELU where the others compute SiLU: no single activation is right
    for every expert. With T * K < E the probe runs as often as needed to reach every expert, so the
    odd expert is seen and the region is left alone (a probe of T tokens alone may miss it). The structure reads
    every expert's chain and refuses first; the probe would catch it too (test_sound_rewrites)."""
    torch.manual_seed(0)
    model = LoopMoE(num_experts=8)
    odd = _GeluExpert(32, 16)
    odd.load_state_dict(model.experts[2].state_dict())
    model.experts[2] = odd
    x = _x(tokens)
    got, cap = run_captured(model, x)
    (r,) = cap.reports
    assert not r.matched, f"rewritten although expert 2 differs: {r.one_line()}"
    assert "experts compute different things (silu and gelu)" in r.reason
    with torch.no_grad():
        assert rel_err(got, model(x)) < 1e-6


def test_verify_never_is_an_explicit_unverified_rewrite():
    """``verify="never"`` (documented expert option) rewrites on structure alone; the report and
    explain say "unverified", with a warning. The structure still decides: a sigmoid GLU (rewritten as
    SwiGLU under verify="never" before the structural reader) stays as written."""
    model = GatherBmmMoE(act="silu_by_hand")
    x = _x(6)
    _, cap = run_captured(model, x, config=MoEConfig(verify="never"))
    (r,) = cap.reports
    assert r.matched and r.verified == "unverified" and not r.probe and math.isnan(r.probe_error)
    assert any("without a numerical check" in w for w in r.warnings)
    text = str(moe_fx.explain(model, x, config=MoEConfig(verify="never")))
    assert "UNVERIFIED" in text and "without a numerical check" in text
    _, cap = run_captured(GatherBmmMoE(act="sigmoid"), x, config=MoEConfig(verify="never"))
    assert not cap.reports[0].matched and "sigmoid of the gate" in cap.reports[0].reason
    verified = str(moe_fx.explain(GatherBmmMoE(), x))
    assert "T=6 x3, real and random weights, err" in verified and "UNVERIFIED" not in verified


class _CapacityMoE(GatherBmmMoE):
    """Switch-style capacity: each expert keeps its first ``int(1.25 * T * K / E)`` tokens, drops the rest."""

    def forward(self, x):
        t, e = x.shape[0], self.w13.shape[0]
        weights, ids = torch.topk(F.softmax(x @ self.router.t(), dim=-1), self.top_k, dim=-1)
        flat = ids.reshape(-1)
        position = (F.one_hot(flat, e).cumsum(0) * F.one_hot(flat, e)).sum(-1)  # 1-based rank within expert
        keep = (position <= int(1.25 * t * self.top_k / e)).to(x.dtype)
        h = torch.bmm(self.w13[flat], x.repeat_interleave(self.top_k, dim=0).unsqueeze(-1)).squeeze(-1)
        g, u = h.chunk(2, dim=-1)
        y = torch.bmm(self.w2[flat], (F.silu(g) * u).unsqueeze(-1)).squeeze(-1)
        y = y * (weights.reshape(-1) * keep).unsqueeze(-1)
        return y.view(t, self.top_k, x.shape[1]).sum(dim=1)


@pytest.mark.parametrize("budget", ["default", "tiny"])
@pytest.mark.parametrize("dynamic", [False, True])
def test_capacity_token_dropping_is_never_rewritten(dynamic, budget):
    """Token dropping depends on the load and on T. Within the budget the skewed probe runs show it;
    above it, a static T's capacity literal is not resized (no reduced probe: left alone) and a
    symbolic capacity is not a multiple of T. Before: rewritten as plain SwiGLU above the budget."""
    model = _CapacityMoE()
    x = torch.randn(1, 32).repeat(40, 1) + 0.3 * _x(40)  # similar tokens: a few experts overflow
    config = TINY_BUDGET if budget == "tiny" else MoEConfig()
    got, cap = run_captured(model, x, config=config, dynamic=dynamic)
    (r,) = cap.reports
    assert not r.matched and cap.count(OP) == 0, r.one_line()
    with torch.no_grad():
        want = model(x)
    assert rel_err(want, GatherBmmMoE()(x)) > 1e-2, "the input must make the capacity drop tokens"
    assert rel_err(got, want) < 1e-6


def test_a_graph_traced_with_no_tokens_compiles():
    """T = 0 (a rank with no tokens in a step, under expert parallelism): the check's reference has nothing to
    compare and must not fail on the empty reshape (it raised out of the compile before)."""
    from moe_fx.testing.models import DenseBmmMoE

    torch.manual_seed(0)
    model = DenseBmmMoE()
    out, cap = run_captured(model, torch.randn(0, 32))
    assert out.shape == (0, 32) and cap.reports[0].matched and cap.reports[0].probe.startswith("T=0")
