"""The structural reader on hand-built graphs (recorded forwards of small functions): what it proves, with exact
node counts per part of the form, and the near misses it names (in the style of Inductor's test_pattern_matcher:
a pass on a graph, exact counts, negatives)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moe_fx.capture.record_forward import record_forward
from moe_fx.ops import ExpertActivation
from moe_fx.passes.recognize.read_form import Boundary, FormReading, WeightView, read_form

T, K, E, H, I = 6, 2, 4, 8, 4
G = torch.Generator().manual_seed(0)
P = {
    "w13": torch.randn(E, 2 * I, H, generator=G), "w2": torch.randn(E, H, I, generator=G),
    "b13": torch.randn(E, 2 * I, generator=G), "b2": torch.randn(E, H, generator=G),
    "up": torch.randn(E, I, H, generator=G),
}
STACKED = {"w13": WeightView("w13", ("e", "o", "i")), "w2": WeightView("w2", ("e", "o", "i"))}
BIASES = {"b13": WeightView("bias", ("e", "o")), "b2": WeightView("bias", ("e", "o"))}


def _inputs(slots: int = E):
    g = torch.Generator().manual_seed(1)
    ids = torch.stack([torch.randperm(slots, generator=g)[:K] for _ in range(T)])
    return torch.randn(T, H, generator=g), ids, torch.rand(T, K, generator=g)


def read(fn, views=STACKED, gated=True, slots=E) -> FormReading | str:
    rec = record_forward(fn, _inputs(slots), P)
    used = {name: v for name, v in views.items() if name in rec.params}
    boundary = Boundary(*rec.inputs, False, {rec.params[n]: v for n, v in used.items()}, E, K, gated)
    return read_form([n for n in rec.graph.nodes if n.op in ("call_function", "call_method")], rec.output, boundary)


def batched(h, ids, w, *, h1_hook=None, gate_up=None, act=F.silu, y_hook=None, weight=True, combine=None,
            biases=False, on_input=False):
    """transformers' batched_mm experts, with hooks for the variants below."""
    flat = ids.reshape(-1)
    x = h.repeat_interleave(K, dim=0)
    if on_input:
        x = x * w.reshape(-1, 1)
    h1 = torch.bmm(P["w13"][flat], x.unsqueeze(-1)).squeeze(-1)
    if biases:
        h1 = h1 + P["b13"][flat]
    if h1_hook is not None:
        h1 = h1_hook(h1)
    g, u = h1.chunk(2, dim=-1) if gate_up is None else gate_up(h1)
    y = torch.bmm(P["w2"][flat], (act(g) * u).unsqueeze(-1)).squeeze(-1)
    if biases:
        y = y + P["b2"][flat]
    if y_hook is not None:
        y = y_hook(y)
    if weight and not on_input:
        y = y * w.reshape(-1, 1)
    if combine is not None:
        return combine(y, ids)
    return y.view(-1, K, H).sum(dim=1)


def test_batched_swiglu_is_read_with_exact_counts():
    r = read(batched)
    assert isinstance(r, FormReading), r
    assert r.spec == ExpertActivation("silu") and not r.weights_on_input and r.identity_experts == 0
    assert r.counts == {
        "routing plumbing": 1, "hidden rows": 2, "expert weights": 2, "first product": 1, "layout": 6,
        "gate/up split": 1, "activation": 1, "gated product": 1, "second product": 1, "routing weights": 1,
        "routing weight": 1, "combine": 1,
    }


def gpt_oss(h, ids, w, *, up_limit=7.0):
    """GPT-OSS's experts: interleaved gate/up, clamps, alpha, up + 1, biases, index_add into zeros."""
    out = torch.zeros_like(h)
    mask = F.one_hot(ids, num_classes=E).permute(2, 1, 0)
    for e in range(E):
        slot, tok = torch.where(mask[e])
        gate_up = F.linear(h[tok], P["w13"][e]) + P["b13"][e]
        gate, up = gate_up[..., ::2], gate_up[..., 1::2]
        gate, up = gate.clamp(max=7.0), up.clamp(-up_limit, up_limit)
        y = F.linear((up + 1) * (gate * torch.sigmoid(gate * 1.702)), P["w2"][e]) + P["b2"][e]
        out.index_add_(0, tok, y * w[tok, slot, None])
    return out


def test_gpt_oss_loop_is_read_with_its_parameters():
    r = read(gpt_oss, {**STACKED, **BIASES})
    assert isinstance(r, FormReading), r
    assert r.spec == ExpertActivation("silu", True, "interleaved", 1.702, 7.0, 1.0)
    assert r.w13_bias is not None and r.w2_bias is not None and r.w13_bias.name == "param_b13"
    assert (r.counts["first product"], r.counts["second product"], r.counts["combine"]) == (E, E, E)
    assert (r.counts["clamp"], r.counts["up offset"], r.counts["bias"]) == (2 * E, E, 2 * E)


def test_non_gated_relu2_with_weights_on_the_input():
    def fn(h, ids, w):
        flat = ids.reshape(-1)
        x = h.repeat_interleave(K, dim=0) * w.reshape(-1, 1)
        y = torch.bmm(P["w2"][flat], F.relu(torch.bmm(P["up"][flat], x.unsqueeze(-1))).square()).squeeze(-1)
        return y.view(-1, K, H).sum(dim=1)

    r = read(fn, {"up": WeightView("w13", ("e", "o", "i")), "w2": STACKED["w2"]}, gated=False)
    assert isinstance(r, FormReading), r
    assert r.spec == ExpertActivation("relu2", gated=False) and r.weights_on_input


def test_identity_experts_of_a_hit_loop():
    def fn(h, ids, w):
        out = torch.zeros_like(h)
        mask = F.one_hot(ids, num_classes=E + 2).permute(2, 1, 0)
        for hit in torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero():
            e = int(hit.item())
            slot, tok = torch.where(mask[e])
            x = h[tok]
            if e < E:
                g, u = F.linear(x, P["w13"][e]).chunk(2, dim=-1)
                x = F.linear(F.silu(g) * u, P["w2"][e])
            out.index_add_(0, tok, x * w[tok, slot, None])
        return out

    r = read(fn, slots=E + 2)
    assert isinstance(r, FormReading) and r.identity_experts == 2 and r.spec == ExpertActivation("silu"), r


def _mask(h1):
    return h1.masked_fill(h1 > 30, 0)


def _half_up_first(h1):
    g, u = h1.chunk(2, dim=-1)
    return u, g


def _capacity(y, ids):
    out = torch.zeros(T, H)
    mask = F.one_hot(ids.reshape(-1), E)  # [T*K, E]
    for e in range(E):
        (rows,) = torch.where(mask[:, e])
        rows = rows[:2]
        out.index_add_(0, rows // K, y[rows])
    return out


NEAR_MISSES = {
    "float_mask": (dict(h1_hook=_mask), "unsupported op 'gt' (gt) on the first expert product"),
    "extra_scale": (dict(y_hook=lambda y: y * 1.02), "scales the expert output by 1.02"),
    "division": (dict(y_hook=lambda y: y / 2), "(div) on the expert output"),
    "sigmoid_glu": (dict(act=torch.sigmoid), "multiplies the sigmoid of the gate by the up projection"),
    "second_activation": (dict(act=lambda g: torch.tanh(F.silu(g))), "unsupported op 'tanh'"),
    "up_first": (dict(gate_up=_half_up_first), "applies silu to the up projection"),
    "gate_clamp_only": (dict(h1_hook=None, act=lambda g: F.silu(g.clamp(max=1.0))),
                        "the gate is clamped at 1 but the up half is not"),
    "clamp_after_act": (dict(act=lambda g: F.silu(g).clamp(max=1.0)), "clamps the activation"),
    "no_weight": (dict(weight=False), "adds the expert output to the output without a routing weight"),
    "weights_twice": (dict(on_input=True, y_hook=None, combine=lambda y, ids: y.view(-1, K, H).sum(1) * 1.0),
                      None),
    "sum_over_hidden": (dict(combine=lambda y, ids: y.view(-1, K, H).sum(dim=2)),
                        "sums the expert output over its feature axis"),
    "bias_after_weight": (dict(y_hook=None, combine=lambda y, ids: (y + P["b2"][ids.reshape(-1)]).view(-1, K, H).sum(1)),
                          "after the routing weight"),
    "capacity": (dict(combine=_capacity), "with a literal bound"),
}


@pytest.mark.parametrize("name", sorted(NEAR_MISSES))
def test_near_misses_name_the_op(name):
    hooks, why = NEAR_MISSES[name]
    r = read(lambda h, ids, w: batched(h, ids, w, **hooks), {**STACKED, **BIASES})
    if why is None:  # a mul by 1 is no scale: still read
        assert isinstance(r, FormReading) and r.weights_on_input, r
        return
    assert isinstance(r, str) and why in r, r


def test_routing_weights_twice_and_mask_from_ids():
    def twice(h, ids, w):
        return batched(h, ids, w, on_input=True, y_hook=lambda y: y * w.reshape(-1, 1))

    def keep_mask(h, ids, w):  # token dropping by a float mask computed from the ids
        keep = (ids.reshape(-1, 1) < E - 1).to(h.dtype)
        return batched(h, ids, w, y_hook=lambda y: y * keep)

    assert "scale this row a second time" in read(twice)
    assert "computed from the expert ids alone" in read(keep_mask)


def test_experts_that_differ_are_refused():
    def fn(h, ids, w):
        out = torch.zeros_like(h)
        mask = F.one_hot(ids, num_classes=E).permute(2, 1, 0)
        for e in range(E):
            slot, tok = torch.where(mask[e])
            g, u = F.linear(h[tok], P["w13"][e]).chunk(2, dim=-1)
            act = F.gelu(g) if e == 2 else F.silu(g)
            out.index_add_(0, tok, F.linear(act * u, P["w2"][e]) * w[tok, slot, None])
        return out

    assert read(fn) == "experts compute different things (silu and gelu)"


def test_weights_read_the_wrong_way_round_are_refused():
    """The same shapes transposed (H = 2I): the axes, not the shapes, decide which way a product reads."""
    square = {"w13": torch.randn(E, H, H, generator=G), "w2": torch.randn(E, H, I, generator=G)}
    P.update(square)
    try:
        def fn(h, ids, w):
            return batched(h, ids, w)

        ok = read(fn, {"w13": WeightView("w13", ("e", "o", "i")), "w2": STACKED["w2"]})
        wrong = read(fn, {"w13": WeightView("w13", ("e", "i", "o")), "w2": STACKED["w2"]})
    finally:
        P.update({"w13": torch.randn(E, 2 * I, H, generator=G)})
    assert isinstance(ok, FormReading)
    assert isinstance(wrong, str) and "not an expert product" in wrong


@pytest.mark.parametrize("route, want", [
    (lambda s: s.topk(K, dim=-1).indices, (5, "topk over [6, 5]")),
    (lambda s: torch.topk(s, K, -1)[1].to(torch.int32).reshape(-1), (5, "topk over [6, 5]")),
    (lambda s: torch.cat([s.max(dim=-1, keepdim=True)[1], s.argmax(-1, keepdim=True)], dim=-1), (5, "cat")),
    (lambda s: s.argsort(dim=-1, descending=True)[:, :K], (5, "argsort over [6, 5]")),
    (lambda s: s.topk(K, dim=-1).indices.clamp(max=E - 1), (None, "computed by clamp")),
    (lambda s: s.topk(K, dim=0).indices, (6, "topk over [6, 5]")),
    (lambda s: (lambda i: i.masked_fill(i == 4, 0))(s.topk(K, dim=-1).indices), (4, "then masked_fill")),  # Zaya
    (lambda s: (lambda i: i.masked_fill(i == 2, 0))(s.topk(K, dim=-1).indices), (5, "then masked_fill")),
    (lambda s: torch.where(s.topk(K, dim=-1).values > 0, s.topk(K, dim=-1).indices, -1), (None, "can be -1")),
    (lambda s: (lambda i: i.masked_fill(i == 1, 5))(s.topk(K, dim=-1).indices), (None, "can be 5")),  # sentinel E
])
def test_expert_id_bound_reads_where_the_ids_come_from(route, want):
    """How many experts the ids can name, from the op that made them; no bound from any other op."""
    from moe_fx.passes.recognize.read_form import expert_id_bound

    rec = record_forward(route, [torch.randn(T, 5, generator=torch.Generator().manual_seed(2))], {})
    bound, where = expert_id_bound(rec.output)
    assert bound == want[0] and want[1] in where, (bound, where)
    assert expert_id_bound(rec.inputs[0]) == (None, "the expert ids are a graph input")
