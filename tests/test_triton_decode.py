"""The decode path (``moe_fx.lowering.triton.decode``): each slot's whole expert MLP in one kernel, sliced
along I, and the combine; Triton interpreter, tiny shapes, fp32 (tight) and fp8 weights, against the op's
torch reference. Outputs are NaN-poisoned so unwritten rows show."""

from __future__ import annotations

import pytest
import torch
from _triton_util import ACTIVATION_FORMS, rel_err

from moe_fx.lowering.quant import quantize_fp8_blockwise
from moe_fx.lowering.triton.decode import decode_experts
from moe_fx.ops import ExpertActivation, experts_reference

SPECS = ACTIVATION_FORMS
T, K, E, H, I = 3, 2, 4, 48, 24  # H = 48: a tail for 32-wide steps; I = 24: a slice tail of 16-wide slices
BLOCKS = {"block_i": 16, "block_k": 32, "block_h": 32}


def _spec_kwargs(spec: ExpertActivation) -> dict:
    return {"activation": spec.name, "gated": spec.gated, "gate_up_layout": spec.gate_up_layout,
            "alpha": spec.alpha, "limit": spec.limit, "up_offset": spec.up_offset}


def _layer(spec: ExpertActivation, seed: int, *, t: int = T, k: int = K, e: int = E, h: int = H, i: int = I):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=gen)
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])
    w = torch.rand(t, k, generator=gen) + 0.1
    w13 = torch.randn(e, spec.columns(i), h, generator=gen) / h**0.5
    w2 = torch.randn(e, h, i, generator=gen) / i**0.5
    b13 = torch.randn(e, spec.columns(i), generator=gen) * 0.3
    b2 = torch.randn(e, h, generator=gen) * 0.3
    return x, ids, w, w13, w2, b13, b2


def _poisoned(t: int, h: int, dtype=torch.float32) -> torch.Tensor:
    return torch.full((t, h), float("nan"), dtype=dtype)


#: every form with the MMAs; the GEMV variant (its activation code is the same) on the two gated layouts
CASES = [(form, bias, True) for form in SPECS for bias in (False, True)] + [
    (form, bias, False) for form in ("silu", "gpt_oss") for bias in (False, True)]


@pytest.mark.parametrize(("form", "bias", "use_dot"), CASES)
def test_every_activation_form_matches_the_reference(form, bias, use_dot):
    spec = SPECS[form]
    x, ids, w, w13, w2, b13, b2 = _layer(spec, seed=len(form) + 7 * bias)
    ids[1, 0] = -1  # a slot naming no expert adds nothing
    biases = {"w13_bias": b13, "w2_bias": b2} if bias else {}
    got = decode_experts(x, ids, w, w13, w2, spec, **biases, **BLOCKS, use_dot=use_dot, out=_poisoned(T, H))
    want = experts_reference(x, ids, w, w13, w2, **_spec_kwargs(spec), **biases)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_identity_experts_duplicates_weights_on_input_and_strided_weights():
    spec = SPECS["silu"]
    x, ids, w, w13, w2, _, _ = _layer(spec, seed=3, t=4, k=3)
    ids[0] = torch.tensor([2, 2, 1])  # a token naming one expert twice: each slot counts
    ids[1, 2] = E  # an identity (zero-computation) expert: adds w * x
    ids[2, 1] = E + 1
    ids[3, 0] = -1
    w13_t = w13.transpose(1, 2).contiguous().transpose(1, 2)  # the same weights through other strides
    for on_input, use_dot in ((False, True), (True, False)):
        got = decode_experts(x, ids, w, w13_t, w2, spec, weights_on_input=on_input, identity_experts=2,
                             **BLOCKS, use_dot=use_dot, out=_poisoned(4, H))
        want = experts_reference(x, ids, w, w13, w2, weights_on_input=on_input, identity_experts=2)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(("form", "use_dot"), [("silu", True), ("gpt_oss", False)])
def test_fp8_weights_dequantised_in_registers(form, use_dot):
    spec = SPECS[form]
    x, ids, w, w13, w2, b13, _ = _layer(spec, seed=11, t=2, h=144, i=136)  # tails of the 128x128 scale blocks
    q13, s13 = quantize_fp8_blockwise(w13)
    q2, s2 = quantize_fp8_blockwise(w2)
    x = x.bfloat16()
    got = decode_experts(x, ids, w, q13, q2, spec, w13_scale=s13, w2_scale=s2, w13_bias=b13, block_i=32,
                         block_k=64, block_h=64, use_dot=use_dot, out=_poisoned(2, 144, torch.bfloat16))
    want = experts_reference(x, ids, w, q13, q2, **_spec_kwargs(spec), w13_scale=s13, w2_scale=s2, w13_bias=b13)
    assert rel_err(got, want) < 1e-2  # bf16 tokens and output; no fp8 rounding of the activations here


def test_empty_step_and_bad_input():
    spec = SPECS["silu"]
    x, ids, w, w13, w2, _, _ = _layer(spec, seed=5)
    got = decode_experts(x[:0], ids[:0], w[:0], w13, w2, spec)
    assert got.shape == (0, H)
    with pytest.raises(ValueError, match="fp8 weights need both"):
        decode_experts(x, ids, w, quantize_fp8_blockwise(w13)[0], w2, spec)
    q13, s13 = quantize_fp8_blockwise(w13)
    q2, s2 = quantize_fp8_blockwise(w2)
    with pytest.raises(ValueError, match="block_k dividing 128"):
        decode_experts(x, ids, w, q13, q2, spec, w13_scale=s13, w2_scale=s2, block_k=256)
    with pytest.raises(ValueError, match="do not fit"):
        decode_experts(x, ids, w, w13, w2, SPECS["relu2_not_gated"])  # w13 has 2I rows
    with pytest.raises(ValueError, match="power of two"):
        decode_experts(x, ids, w, w13, w2, spec, block_i=24)
    with pytest.raises(ValueError, match="unknown activation"):
        decode_experts(x, ids, w, w13, w2, ExpertActivation("swish"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("use_dot", [False, True])
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("form", ["silu", "gpt_oss", "relu2_not_gated"])
def test_compiled_kernels_match_the_reference_on_the_gpu(form, fp8, use_dot):
    """The compiled kernels (not the interpreter) at a Qwen3-like slice count, every default block choice."""
    spec = SPECS[form]
    x, ids, w, w13, w2, b13, b2 = _layer(spec, seed=21, t=4, k=8, e=64, h=512, i=384)
    x, ids, w, w13, w2, b13, b2 = (v.cuda() for v in (x, ids, w, w13, w2, b13, b2))
    x, w13, w2 = x.bfloat16(), w13.bfloat16(), w2.bfloat16()
    kw = {"w13_bias": b13, "w2_bias": b2} if form == "gpt_oss" else {}
    if fp8:
        w13, kw["w13_scale"] = quantize_fp8_blockwise(w13)
        w2, kw["w2_scale"] = quantize_fp8_blockwise(w2)
    got = decode_experts(x, ids, w, w13, w2, spec, **kw, use_dot=use_dot,
                         out=_poisoned(4, 512, torch.bfloat16).cuda())
    want = experts_reference(x, ids, w, w13, w2, **_spec_kwargs(spec), **kw)
    assert rel_err(got, want) < 1e-2
