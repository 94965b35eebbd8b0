"""Masked grouped GEMMs (Triton) against torch: ragged masked_m, tails, strided scales, fp8."""

from __future__ import annotations

import pytest
import torch
from _triton_util import devices, rel_err

from moe_fx.lowering.quant import quantize_fp8_blockwise, quantize_fp8_per_token_group
from moe_fx.lowering.triton.configs import TileConfig, candidates
from moe_fx.lowering.triton.grouped_gemm import masked_gemm, masked_gemm_fp8
from moe_fx.ops import dequantize_blockwise

# (G, M, N, K) per device. CPU: tails in every dim; CUDA: the odd MoE shapes and a DeepSeek shard.
SHAPES = {
    "cpu": [(3, 20, 72, 136)],
    "cuda": [(60, 40, 2816, 2880), (60, 40, 2880, 1408), (32, 300, 4096, 7168), (8, 1, 28672, 4096)],
}


def _masked(g: int, m: int, device: str, gen: torch.Generator) -> torch.Tensor:
    """Ragged rows: an empty group, a full group, random in between."""
    mm = torch.randint(0, m + 1, (g,), generator=gen, dtype=torch.int32)
    mm[0] = 0
    if g > 1:
        mm[1] = m
    return mm.to(device)


def _check_rows(out, ref, masked_m, tol):
    for i, m in enumerate(masked_m.tolist()):
        assert torch.isnan(out[i, m:].float()).all(), "rows past masked_m must stay unwritten"
        if m:
            assert rel_err(out[i, :m], ref[i, :m]) < tol, (i, m, rel_err(out[i, :m], ref[i, :m]))


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_masked_gemm(device, dtype):
    gen = torch.Generator().manual_seed(1)
    for g, m, n, k in SHAPES[device]:
        a = torch.randn(g, m, k, generator=gen).to(dtype).to(device)
        b = (torch.randn(g, n, k, generator=gen) / k**0.5).to(dtype).to(device)
        mm = _masked(g, m, device, gen)
        out = torch.full((g, m, n), float("nan"), dtype=dtype, device=device)
        masked_gemm(a, b, mm, out=out)
        ref = torch.bmm(a.float(), b.float().transpose(1, 2))
        _check_rows(out, ref, mm.cpu(), 1e-2 if dtype == torch.bfloat16 else 1e-5)


@pytest.mark.parametrize("device", devices())
def test_masked_gemm_strided_and_errors(device):
    g, m, n, k = 2, 16, 40, 48
    a = torch.randn(g, k, m, device=device).transpose(1, 2)  # M-major A
    b = torch.randn(g, k, n, device=device).transpose(1, 2)
    mm = torch.tensor([5, 16], dtype=torch.int32, device=device)
    out = masked_gemm(a, b, mm)
    ref = torch.bmm(a, b.transpose(1, 2))
    for i, r in enumerate(mm.tolist()):
        torch.testing.assert_close(out[i, :r], ref[i, :r], rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError):
        masked_gemm(a, b, mm.long())
    with pytest.raises(TypeError):
        masked_gemm(a, b.double(), mm)


def _fp8_inputs(g, m, n, k, device, gen, mn_major_scale: bool):
    a32 = torch.randn(g, m, k, generator=gen).to(device)
    a, a_s = quantize_fp8_per_token_group(a32)
    if mn_major_scale:  # the layout DeepGEMM wants: [G, ceil(K/128), M_aligned] storage, viewed as [G, M, kb]
        m_al = -(-m // 4) * 4
        store = torch.full((g, a_s.shape[-1], m_al), float("nan"), device=device)
        store[:, :, :m] = a_s.transpose(1, 2)
        a_s = store.transpose(1, 2)[:, :m, :]
    b, b_s = quantize_fp8_blockwise(torch.randn(g, n, k, generator=gen).to(device) / k**0.5)
    return a, a_s, b, b_s


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("mn_major_scale", [False, True])
def test_masked_gemm_fp8(device, mn_major_scale):
    gen = torch.Generator().manual_seed(2)
    for g, m, n, k in SHAPES[device]:
        a, a_s, b, b_s = _fp8_inputs(g, m, n, k, device, gen, mn_major_scale)
        mm = _masked(g, m, device, gen)
        out = torch.full((g, m, n), float("nan"), dtype=torch.bfloat16, device=device)
        masked_gemm_fp8(a, a_s, b, b_s, mm, out=out)
        a_deq = a.float() * a_s.repeat_interleave(128, -1)[..., :k]
        ref = torch.bmm(a_deq, dequantize_blockwise(b, b_s).transpose(1, 2))
        _check_rows(out, ref, mm.cpu(), 1e-2)  # same quantised operands: only accumulation order + bf16 out


@pytest.mark.parametrize("kind", ["bf16", "fp8"])
@pytest.mark.parametrize("block_n", [64, 256])
def test_tma_and_scale_variants_on_cpu(kind, block_n):
    """TMA descriptor loads (zero-filled tails) and both fp8 scale paths (b's scale as one value per
    tile when the tile sits in one 128-column block, per column otherwise) equal the pointer path."""
    gen = torch.Generator().manual_seed(5)
    g, m, n, k = 3, 20, 200, 264  # N and K tails; block_n 64: one b scale per tile, 256: per column
    mm = torch.tensor([0, 20, 7], dtype=torch.int32)
    if kind == "fp8":
        a, a_s, b, b_s = _fp8_inputs(g, m, n, k, "cpu", gen, False)
        ref = torch.bmm(
            a.float() * a_s.repeat_interleave(128, -1)[..., :k], dequantize_blockwise(b, b_s).transpose(1, 2)
        )
    else:
        a = torch.randn(g, m, k, generator=gen).to(torch.bfloat16)
        b = (torch.randn(g, n, k, generator=gen) / k**0.5).to(torch.bfloat16)
        ref = torch.bmm(a.float(), b.float().transpose(1, 2))
    outs = []
    for tma in (False, True):
        cfg = TileConfig(16, block_n, 128 if kind == "fp8" else 64, 1, 4, 1, 1, tma=tma)
        out = torch.full((g, m, n), float("nan"), dtype=torch.bfloat16)
        if kind == "fp8":
            masked_gemm_fp8(a, a_s, b, b_s, mm, out=out, config=cfg)
        else:
            masked_gemm(a, b, mm, out=out, config=cfg)
        _check_rows(out, ref, mm, 1e-2)
        outs.append(out)
    torch.testing.assert_close(outs[0], outs[1], equal_nan=True, rtol=0, atol=0)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("block_n,block_k,swap_ab", [(64, 128, False), (256, 128, False), (64, 64, False),
                                                      (64, 128, True), (256, 64, True)])
def test_fp8_scales_loaded_ahead_give_the_same_bits(device, block_n, block_k, swap_ab, monkeypatch):
    """Each k step loading the next step's scales (``PREFETCH_FP8_SCALES``) changes when they are loaded, not what
    is computed: the output equals the in-step loads bit for bit, for one b scale per tile and per column, k steps of
    a whole scale group and of half of one (two steps share their scales), swapped tiles, a K tail (264: the last
    step's prefetch reads past the scales and must be masked off) and an empty group."""
    from moe_fx.lowering.triton import grouped_gemm

    gen = torch.Generator().manual_seed(7)
    g, m, n, k = 3, 20, 200, 264
    a, a_s, b, b_s = _fp8_inputs(g, m, n, k, device, gen, False)
    mm = torch.tensor([0, 20, 7], dtype=torch.int32, device=device)
    cfg = TileConfig(16, block_n, block_k, 1, 4, 3 if device == "cuda" else 1, 1, swap_ab=swap_ab)
    outs = []
    for ahead in (False, True):
        monkeypatch.setattr(grouped_gemm, "PREFETCH_FP8_SCALES", ahead)
        out = torch.full((g, m, n), float("nan"), dtype=torch.bfloat16, device=device)
        masked_gemm_fp8(a, a_s, b, b_s, mm, out=out, config=cfg)
        outs.append(out)
    ref = torch.bmm(a.float() * a_s.repeat_interleave(128, -1)[..., :k], dequantize_blockwise(b, b_s).transpose(1, 2))
    _check_rows(outs[1], ref, mm.cpu(), 1e-2)
    torch.testing.assert_close(outs[0], outs[1], equal_nan=True, rtol=0, atol=0)


def test_tma_needs_aligned_operands():
    """A row stride that is not a multiple of 16 bytes cannot feed TMA: the pointer path runs instead."""
    from moe_fx.lowering.triton.grouped_gemm import _operands, _tma_ok

    cfg = TileConfig(16, 64, 64, tma=True)
    good = torch.empty(2, 8, 64, dtype=torch.bfloat16)
    odd = torch.empty(2, 8, 68, dtype=torch.bfloat16)[:, :, :60]  # row stride 136 bytes
    assert _tma_ok(good) and not _tma_ok(odd) and not _tma_ok(good.transpose(1, 2))
    assert _operands(cfg, good, good)[2] is True
    assert _operands(cfg, odd, good)[2] is False
    assert _operands(TileConfig(16, 64, 64), good, good)[2] is False


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("kind", ["bf16", "fp8"])
def test_every_tile_candidate_is_correct(device, kind):
    """Each tuning candidate computes the same product (a tuned table can pick any of them).

    On CPU the interpreter checks the tile shapes' index logic (tails, TMA, k steps) on a small problem;
    warps and stages only matter on the GPU.
    """
    gen = torch.Generator().manual_seed(4)
    g, m, n, k = (4, 200, 384, 520) if device == "cuda" else (3, 40, 136, 264)
    mm = torch.tensor([0, m, 17, 130][:g], dtype=torch.int32).clamp(max=m).to(device)
    if kind == "fp8":
        a, a_s, b, b_s = _fp8_inputs(g, m, n, k, device, gen, False)
        ref = torch.bmm(
            a.float() * a_s.repeat_interleave(128, -1)[..., :k], dequantize_blockwise(b, b_s).transpose(1, 2)
        )
    else:
        a = torch.randn(g, m, k, generator=gen).to(torch.bfloat16).to(device)
        b = torch.randn(g, n, k, generator=gen).to(torch.bfloat16).to(device)
        ref = torch.bmm(a.float(), b.float().transpose(1, 2))
    cfgs = {c for bucket in (16, 32, 64, 256) for c in candidates(kind, bucket)}
    assert any(c.tma for c in cfgs) and any(not c.tma for c in cfgs)
    for cfg in sorted(cfgs, key=str):
        out = torch.full((g, m, n), float("nan"), dtype=torch.bfloat16, device=device)
        if kind == "fp8":
            masked_gemm_fp8(a, a_s, b, b_s, mm, out=out, config=cfg)
        else:
            masked_gemm(a, b, mm, out=out, config=cfg)
        _check_rows(out, ref, mm.cpu(), 1e-2)


def test_fp8_block_k_must_divide_128():
    a = torch.zeros(1, 16, 128, dtype=torch.float8_e4m3fn)
    s = torch.ones(1, 16, 1)
    with pytest.raises(ValueError):
        masked_gemm_fp8(a, s, a, torch.ones(1, 1, 1), torch.ones(1, dtype=torch.int32), config=TileConfig(16, 16, 256))


def test_offsets_beyond_int32_are_refused():
    """Rows x row stride of one group must fit int32 offsets; bigger inputs get a clear error, not garbage."""
    a = torch.empty(1, 2**16, 2**15 + 8, dtype=torch.bfloat16, device="meta")
    b = torch.empty(1, 64, 2**15 + 8, dtype=torch.bfloat16, device="meta")
    mm = torch.ones(1, dtype=torch.int32, device="meta")
    with pytest.raises(ValueError, match="int32"):
        masked_gemm(a, b, mm)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("fp8", [False, True])
def test_bias_epilogue(device, fp8):
    """bias [G, N] joins every valid row (the second expert GEMM of GPT-OSS-style experts); rows past masked_m stay unwritten."""
    gen = torch.Generator().manual_seed(5)
    g, m, n, k = SHAPES[device][0]
    a = torch.randn(g, m, k, generator=gen).to(device)
    b = (torch.randn(g, n, k, generator=gen) / k**0.5).to(device)
    bias = torch.randn(g, n, generator=gen).to(device)
    mm = _masked(g, m, device, gen)
    if fp8:
        qa, sa = quantize_fp8_per_token_group(a)
        qb, sb = quantize_fp8_blockwise(b)
        out = torch.full((g, m, n), float("nan"), dtype=torch.bfloat16, device=device)
        masked_gemm_fp8(qa, sa, qb, sb, mm, out=out, bias=bias)
        deq_a = qa.float() * sa.repeat_interleave(128, -1)[..., :k]
        ref = torch.bmm(deq_a, dequantize_blockwise(qb, sb).transpose(1, 2)) + bias[:, None, :]
        _check_rows(out, ref, mm.cpu(), 2e-2)
    else:
        out = torch.full((g, m, n), float("nan"), device=device)
        masked_gemm(a, b, mm, out=out, bias=bias)
        _check_rows(out, torch.bmm(a, b.transpose(1, 2)) + bias[:, None, :], mm.cpu(), 1e-5)
    with pytest.raises(ValueError, match="bias"):
        masked_gemm(a, b, mm, bias=bias[:, :-1])
