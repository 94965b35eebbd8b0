"""Gated activation (+ fused fp8 quantisation) on the masked layout, against torch."""

from __future__ import annotations

import pytest
import torch
from _triton_util import devices

from moe_fx.lowering.quant import quantize_fp8_per_token_group
from moe_fx.lowering.triton.activation import act_mul, silu_mul, silu_mul_quant_fp8
from moe_fx.ops import ACTIVATIONS

SHAPES = {"cpu": [(3, 10, 72)], "cuda": [(60, 64, 1408), (32, 512, 2048), (8, 3, 14336)]}


def _rows(g, m, device):
    mm = torch.randint(0, m + 1, (g,), dtype=torch.int32)
    mm[0] = 0
    mm[-1] = m
    return mm.to(device)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("activation", ["silu", "gelu", "gelu_tanh"])
def test_act_mul(device, activation):
    for g, m, i in SHAPES[device]:
        x = (torch.randn(g, m, 2 * i) * 3).to(torch.bfloat16).to(device)
        mm = _rows(g, m, device)
        out = torch.full((g, m, i), float("nan"), dtype=torch.bfloat16, device=device)
        fn = silu_mul if activation == "silu" else lambda x, mm, out: act_mul(x, mm, activation, out)
        fn(x, mm, out=out)
        ref = ACTIVATIONS[activation](x[..., :i].float()) * x[..., i:].float()
        for e, r in enumerate(mm.tolist()):
            assert torch.isnan(out[e, r:].float()).all()
            torch.testing.assert_close(out[e, :r].float(), ref[e, :r], rtol=1.6e-2, atol=1e-2)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("mn_major", [False, True])
def test_silu_mul_quant_fp8(device, mn_major):
    for g, m, i in SHAPES[device]:
        x = (torch.randn(g, m, 2 * i) * 3).to(torch.bfloat16).to(device)
        mm = _rows(g, m, device)
        ib = -(-i // 128)
        if mn_major:  # DeepGEMM's layout: [G, ib, M_aligned] storage viewed as [G, M, ib]
            store = torch.full((g, ib, -(-m // 4) * 4), float("nan"), device=device)
            out_scale = store.transpose(1, 2)[:, :m, :]
        else:
            out_scale = torch.full((g, m, ib), float("nan"), device=device)
        q, s = silu_mul_quant_fp8(x, mm, out_scale=out_scale)
        assert s.data_ptr() == out_scale.data_ptr() and q.dtype == torch.float8_e4m3fn
        v = torch.nn.functional.silu(x[..., :i].float()) * x[..., i:].float()
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
    with pytest.raises(ValueError):
        silu_mul(torch.zeros(2, 3, 5), torch.zeros(2, dtype=torch.int32))
    with pytest.raises(ValueError):
        act_mul(torch.zeros(2, 3, 4), torch.zeros(2, dtype=torch.int32), "relu")
    with pytest.raises(ValueError):
        silu_mul(torch.zeros(2, 3, 4), torch.zeros(3, dtype=torch.int32))
