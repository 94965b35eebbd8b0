"""The moe_fx::experts op contract: reference numerics, edge cases, fake impl, input errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import moe_fx  # noqa: F401  (registers the ops)
from moe_fx.ops import ACTIVATIONS, dequantize_blockwise, experts_reference

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 5e-3}


def per_token_oracle(hidden, ids, weights, w13, w2, activation="silu", on_input=False):
    """A second, independent oracle: token by token, slot by slot, in float64."""
    out = torch.zeros(hidden.shape, dtype=torch.float64)
    inter = w2.shape[-1]
    act = ACTIVATIONS[activation]
    for t in range(hidden.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            if e < 0:
                continue
            r = float(weights[t, k])
            x = hidden[t].double() * (r if on_input else 1.0)
            gu = w13[e].double() @ x
            y = w2[e].double() @ (act(gu[:inter]) * gu[inter:])
            out[t] += y * (1.0 if on_input else r)
    return out


def make_inputs(t, k, e, h, i, dtype, *, ids_dtype=torch.int64, seed=0, skew=False):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(t, h, generator=g).to(dtype)
    logits = torch.rand(t, e, generator=g)
    if skew:  # expert 0 and 1 take every token, the rest none
        logits[:, :2] += 10.0
    ids = logits.topk(k, dim=-1).indices.to(ids_dtype)
    weights = torch.rand(t, k, generator=g) + 0.05
    w13 = (torch.randn(e, 2 * i, h, generator=g) * 0.3).to(dtype)
    w2 = (torch.randn(e, h, i, generator=g) * 0.3).to(dtype)
    return hidden, ids, weights, w13, w2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("ids_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("skew", [False, True])
def test_reference_matches_per_token_oracle(dtype, ids_dtype, skew):
    hidden, ids, weights, w13, w2 = make_inputs(9, 3, 6, 16, 8, dtype, ids_dtype=ids_dtype, skew=skew)
    got = torch.ops.moe_fx.experts(hidden, ids, weights, w13, w2)
    assert got.dtype == dtype and got.shape == hidden.shape
    want = per_token_oracle(hidden, ids, weights, w13, w2)
    err = (got.double() - want).norm() / want.norm()
    assert err < TOL[dtype], err


@pytest.mark.parametrize("activation", sorted(ACTIVATIONS))
@pytest.mark.parametrize("on_input", [False, True])
def test_activation_and_weights_on_input(activation, on_input):
    hidden, ids, weights, w13, w2 = make_inputs(7, 2, 4, 8, 4, torch.float32, seed=3)
    got = torch.ops.moe_fx.experts(hidden, ids, weights, w13, w2, activation=activation, weights_on_input=on_input)
    want = per_token_oracle(hidden, ids, weights, w13, w2, activation, on_input)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    other = torch.ops.moe_fx.experts(hidden, ids, weights, w13, w2, activation=activation, weights_on_input=not on_input)
    assert not torch.allclose(other, got, atol=1e-3), "weights_on_input must change the result"


def test_zero_tokens_and_minus_one_ids():
    hidden, ids, weights, w13, w2 = make_inputs(5, 2, 4, 8, 4, torch.float32)
    empty = torch.ops.moe_fx.experts(hidden[:0], ids[:0], weights[:0], w13, w2)
    assert empty.shape == (0, 8)
    ids[1, 0] = -1
    ids[3] = -1  # token 3 goes to no expert at all
    got = torch.ops.moe_fx.experts(hidden, ids, weights, w13, w2)
    torch.testing.assert_close(got.double(), per_token_oracle(hidden, ids, weights, w13, w2), rtol=1e-5, atol=1e-6)
    assert torch.count_nonzero(got[3]) == 0


def test_fp8_weights_reference_uses_block_scales():
    hidden, ids, weights, w13, w2 = make_inputs(6, 2, 3, 256, 128, torch.bfloat16)
    from moe_fx.lowering.quant import quantize_fp8_blockwise

    q13, s13 = quantize_fp8_blockwise(w13)
    q2, s2 = quantize_fp8_blockwise(w2)
    got = torch.ops.moe_fx.experts(hidden, ids, weights, q13, q2, w13_scale=s13, w2_scale=s2)
    want = experts_reference(hidden, ids, weights, dequantize_blockwise(q13, s13).bfloat16(),
                             dequantize_blockwise(q2, s2).bfloat16())
    assert (got.float() - want.float()).norm() / want.float().norm() < 2e-2


def test_opcheck_and_dynamic_fake():
    hidden, ids, weights, w13, w2 = make_inputs(5, 2, 4, 8, 4, torch.float32)
    torch.library.opcheck(torch.ops.moe_fx.experts.default, (hidden, ids, weights, w13, w2))

    def f(h, i, w):
        return torch.ops.moe_fx.experts(h, i, w, w13, w2) * 2

    compiled = torch.compile(f, backend="eager", dynamic=True, fullgraph=True)
    for t in (3, 7, 11):
        h, i, w, _, _ = make_inputs(t, 2, 4, 8, 4, torch.float32, seed=t)
        torch.testing.assert_close(compiled(h, i, w), f(h, i, w))


@pytest.mark.parametrize(
    "mutate, exc, match",
    [
        (lambda a: a.update(ids=a["ids"].float()), TypeError, "topk_ids must be int32 or int64"),
        (lambda a: a.update(ids=a["ids"][:3]), ValueError, r"topk_ids must be \[T, K\]"),
        (lambda a: a.update(weights=a["weights"][:, :1]), ValueError, "must have the shape of topk_ids"),
        (lambda a: a.update(weights=a["weights"].long()), TypeError, "topk_weights must be"),
        (lambda a: a.update(w2=a["w2"][:, :, :3]), ValueError, "inconsistent shapes"),
        (lambda a: a.update(w13=a["w13"].double()), TypeError, "w13 is torch.float64 but hidden is torch.float32"),
        (lambda a: a.update(activation="swish"), ValueError, "unknown activation"),
        (lambda a: a.update(hidden=a["hidden"][None]), ValueError, r"hidden must be a 2-D \[T, H\]"),
    ],
)
def test_bad_inputs_raise_clear_errors(mutate, exc, match):
    hidden, ids, weights, w13, w2 = make_inputs(5, 2, 4, 8, 4, torch.float32)
    args = dict(hidden=hidden, ids=ids, weights=weights, w13=w13, w2=w2, activation="silu")
    mutate(args)
    with pytest.raises(exc, match=match):
        torch.ops.moe_fx.experts(args["hidden"], args["ids"], args["weights"], args["w13"], args["w2"],
                                 activation=args["activation"])
    # The fake implementation raises the same error at trace time.
    with pytest.raises(exc, match=match), torch._subclasses.FakeTensorMode(allow_non_fake_inputs=True):
        torch.ops.moe_fx.experts(args["hidden"], args["ids"], args["weights"], args["w13"], args["w2"],
                                 activation=args["activation"])


def test_silu_is_swiglu():
    x = torch.randn(4, 6)
    assert torch.equal(ACTIVATIONS["silu"](x), F.silu(x))
