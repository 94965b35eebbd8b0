"""quantize_fp8_blockwise / quantize_fp8_per_token_group (pure torch) against dequantisation."""

from __future__ import annotations

import pytest
import torch

from moe_fx.lowering.quant import quantize_fp8_blockwise, quantize_fp8_per_token_group
from moe_fx.ops import dequantize_blockwise
from moe_fx.ops.recipe import FP8_E4M3_MAX as FP8_MAX


@pytest.mark.parametrize("shape", [(3, 256, 384), (2, 200, 136), (1, 1, 5), (130, 129)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_blockwise_roundtrip(shape, dtype):
    w = (torch.randn(*shape) * torch.rand(*shape[:-2], 1, 1) * 3).to(dtype)
    w.view(-1)[0] = 0.0
    q, s = quantize_fp8_blockwise(w)
    nb, kb = -(-shape[-2] // 128), -(-shape[-1] // 128)
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape
    assert s.dtype == torch.float32 and tuple(s.shape) == (*shape[:-2], nb, kb)
    back = dequantize_blockwise(q, s)
    # e4m3 keeps 3 mantissa bits: each value is within half an ulp, i.e. 2**-4 relative (plus tiny subnormals)
    tol = (
        w.float().abs() * 2**-4
        + s.repeat_interleave(128, -2)[..., : shape[-2], :].repeat_interleave(128, -1)[..., : shape[-1]] * 2**-9
    )
    assert ((back - w.float()).abs() <= tol + 1e-12).all()
    # the largest magnitude of each block lands on the largest fp8 value
    assert q.float().abs().amax().item() == FP8_MAX


def test_blockwise_zero_block_and_errors():
    w = torch.zeros(1, 128, 128)
    q, s = quantize_fp8_blockwise(w)
    assert torch.isfinite(s).all() and (s > 0).all() and (q.float() == 0).all()
    with pytest.raises(TypeError):
        quantize_fp8_blockwise(torch.ones(4, dtype=torch.int32))


@pytest.mark.parametrize("k", [128, 200, 7])
def test_per_token_group(k):
    x = torch.randn(5, 3, k) * 10
    q, s = quantize_fp8_per_token_group(x)
    assert tuple(s.shape) == (5, 3, -(-k // 128))
    s_rep = s.repeat_interleave(128, -1)[..., :k]
    back = q.float() * s_rep
    # half an ulp: 2**-4 relative for normal codes, half the subnormal step (2**-9 * scale) below them
    assert ((back - x).abs() <= x.abs() * 2**-4 + s_rep * 2**-10 + 1e-7).all()
    assert (q.float().abs().amax(-1) == FP8_MAX).all()
