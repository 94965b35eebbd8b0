"""The expert activation kernel (every ExpertActivation, biases, fused fp8 quantisation) on the masked layout, against torch."""

from __future__ import annotations

import pytest
import torch
from _triton_util import devices

from moe_fx.lowering.quant import quantize_fp8_per_token_group
from moe_fx.lowering.triton.act_args import ACT_CODES
from moe_fx.lowering.triton.activation import expert_activation
from moe_fx.ops import ACTIVATIONS, ExpertActivation

SHAPES = {"cpu": [(3, 10, 72)], "cuda": [(60, 64, 1408), (32, 512, 2048), (8, 3, 14336)]}

SPECS = [
    *(ExpertActivation(name) for name in ACTIVATIONS),
    ExpertActivation("silu", alpha=1.702, limit=7.0, up_offset=1.0, gate_up_layout="interleaved"),  # GPT-OSS
    ExpertActivation("silu", limit=0.5),  # clamped SwiGLU with a limit the data crosses
    ExpertActivation("relu2", gated=False),  # non-gated, squared ReLU (Nemotron-H style)
    ExpertActivation("gelu", gated=False, limit=1.0),
]


def _rows(g, m, device):
    mm = torch.randint(0, m + 1, (g,), dtype=torch.int32)
    mm[0] = 0
    mm[-1] = m
    return mm.to(device)


def test_every_op_activation_has_a_kernel():
    assert set(ACT_CODES) == set(ACTIVATIONS)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.describe().replace(" ", "_"))
@pytest.mark.parametrize("with_bias", [False, True])
def test_expert_activation(device, spec, with_bias):
    gen = torch.Generator().manual_seed(2)
    for g, m, i in SHAPES[device]:
        n1 = spec.columns(i)
        x = (torch.randn(g, m, n1, generator=gen) * 3).to(torch.bfloat16).to(device)
        bias = torch.randn(g, n1, generator=gen).to(device) if with_bias else None
        mm = _rows(g, m, device)
        out = torch.full((g, m, i), float("nan"), dtype=torch.bfloat16, device=device)
        expert_activation(x, mm, spec, bias=bias, out=out)
        h = x.float() + (bias[:, None, :] if with_bias else 0)
        ref = spec.apply(h)
        for e, r in enumerate(mm.tolist()):
            assert torch.isnan(out[e, r:].float()).all()
            torch.testing.assert_close(out[e, :r].float(), ref[e, :r], rtol=1.6e-2, atol=2e-2)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("mn_major", [False, True])
def test_activation_quant_fp8(device, mn_major):
    spec = ExpertActivation("silu")
    for g, m, i in SHAPES[device]:
        x = (torch.randn(g, m, 2 * i) * 3).to(torch.bfloat16).to(device)
        mm = _rows(g, m, device)
        ib = -(-i // 128)
        if mn_major:  # DeepGEMM's layout: [G, ib, M_aligned] storage viewed as [G, M, ib]
            store = torch.full((g, ib, -(-m // 4) * 4), float("nan"), device=device)
            out_scale = store.transpose(1, 2)[:, :m, :]
        else:
            out_scale = torch.full((g, m, ib), float("nan"), device=device)
        q, s = expert_activation(x, mm, spec, quant_fp8=True, out_scale=out_scale)
        assert s.data_ptr() == out_scale.data_ptr() and q.dtype == torch.float8_e4m3fn
        v = spec.apply(x.float())
        q_ref, s_ref = quantize_fp8_per_token_group(v)
        for e, r in enumerate(mm.tolist()):
            assert torch.isnan(s[e, r:]).all()
            torch.testing.assert_close(s[e, :r], s_ref[e, :r], rtol=1e-5, atol=0)
            back = q[e, :r].float() * s[e, :r].repeat_interleave(128, -1)[:, :i]
            torch.testing.assert_close(back, v[e, :r], rtol=2**-4, atol=float(s[e, :r].max()) * 2**-9 if r else 0)
            # codes equal the torch quantiser's except where the division rounds to the other neighbour
            same = (q[e, :r].float() == q_ref[e, :r].float()).float().mean().item() if r else 1.0
            assert same > 0.99


def test_bad_inputs():
    mm = torch.zeros(2, dtype=torch.int32)
    with pytest.raises(ValueError, match="even"):
        expert_activation(torch.zeros(2, 3, 5), mm)
    with pytest.raises(ValueError, match="unknown activation"):
        expert_activation(torch.zeros(2, 3, 4), mm, ExpertActivation("swish"))
    with pytest.raises(ValueError, match="masked_m"):
        expert_activation(torch.zeros(2, 3, 4), torch.zeros(3, dtype=torch.int32))
    with pytest.raises(ValueError, match="bias"):
        expert_activation(torch.zeros(2, 3, 4), mm, bias=torch.zeros(2, 3))


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("spec", SPECS[len(ACTIVATIONS):], ids=lambda s: s.describe().replace(" ", "_"))
def test_activation_variants_quant_fp8(device, spec):
    """The variants (GPT-OSS's, clamped, non-gated) with a bias, fused with the fp8 quantisation."""
    gen = torch.Generator().manual_seed(8)
    for g, m, i in SHAPES[device]:
        n1 = spec.columns(i)
        x = (torch.randn(g, m, n1, generator=gen) * 3).to(torch.bfloat16).to(device)
        bias = torch.randn(g, n1, generator=gen).to(device)
        mm = _rows(g, m, device)
        q, s = expert_activation(x, mm, spec, bias=bias, quant_fp8=True)
        v = spec.apply(x.float() + bias[:, None, :])
        for e, r in enumerate(mm.tolist()):
            if r:
                back = q[e, :r].float() * s[e, :r].repeat_interleave(128, -1)[:, :i]
                torch.testing.assert_close(back, v[e, :r], rtol=2**-3, atol=float(s[e, :r].max()) * 2**-8)
