"""The Triton pipeline of moe_fx::experts (permute -> GEMM1 -> activation -> GEMM2 -> unpermute), run
eagerly through the op with ``kernel_choice="triton"`` (CPU: Triton's interpreter), against moe_fx.ops.experts_reference."""

from __future__ import annotations

import pytest
import torch
from _triton_util import devices, gpu, ragged_ids, rel_err

from moe_fx.lowering.masked_experts.pipeline import quantize_activations
from moe_fx.lowering.problem import row_regime, rows_per_expert
from moe_fx.lowering.quant import quantize_fp8_blockwise, quantize_fp8_per_token_group
from moe_fx.ops import experts_reference


def triton_experts(*args, **kwargs):
    """The op with the Triton kernels requested (what the lowering runs eagerly and compiles into graphs)."""
    return torch.ops.moe_fx.experts(*args, kernel_choice="triton", **kwargs)


# (T, H, I, E, K). CPU: tiny, with tails (H, I not multiples of 128). CUDA: the odd shape,
# a Qwen3-like and a Mixtral-like decode shape.
SHAPES = {
    "cpu": [(6, 136, 72, 5, 2)],
    # GPT-OSS's layer at 64 rows per expert: H = 2880 leaves a K tail beside the table's TMA tile for GEMM1
    "cuda": [(96, 2880, 1408, 60, 6), (300, 2048, 768, 128, 8), (3, 4096, 1024, 8, 2), (512, 2880, 2880, 32, 4)],
}


def _problem(t, h, i, e, k, kind, device, gen, dtype=torch.bfloat16):
    hidden = torch.randn(t, h, generator=gen).to(dtype).to(device)
    ids = ragged_ids(t, k, e, kind, gen).to(device)
    w = torch.softmax(torch.randn(t, k, generator=gen), -1).to(device)
    w13 = (torch.randn(e, 2 * i, h, generator=gen) / h**0.5).to(dtype).to(device)
    w2 = (torch.randn(e, h, i, generator=gen) / i**0.5).to(dtype).to(device)
    return hidden, ids, w, w13, w2


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("kind", ["random", "hot", "holes"])
@pytest.mark.parametrize("weights_on_input", [False, True])
def test_triton_experts_bf16(device, kind, weights_on_input):
    gen = torch.Generator().manual_seed(7)
    for shape in SHAPES[device]:
        hidden, ids, w, w13, w2 = _problem(*shape, kind, device, gen)
        out = triton_experts(hidden, ids, w, w13, w2, weights_on_input=weights_on_input)
        ref = experts_reference(hidden, ids, w, w13, w2, weights_on_input=weights_on_input)
        assert out.dtype == hidden.dtype and out.shape == hidden.shape
        assert torch.isfinite(out).all()
        # bf16 intermediates (gate_up, act, y) against an fp32 reference; the CPU interpreter
        # truncates fp32 -> bf16 (a bias of up to an ulp per cast) where the GPU rounds to nearest
        assert rel_err(out, ref) < (1.5e-2 if device == "cuda" else 4e-2), rel_err(out, ref)


@pytest.mark.parametrize("device", devices())
def test_triton_experts_fp32_and_gelu(device):
    gen = torch.Generator().manual_seed(8)
    hidden, ids, w, w13, w2 = _problem(*SHAPES["cpu"][0], "holes", device, gen, dtype=torch.float32)
    out = triton_experts(hidden, ids, w, w13, w2, activation="gelu")
    ref = experts_reference(hidden, ids, w, w13, w2, activation="gelu")
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


def _reference_fp8_acts(hidden, ids, w, q13, s13, q2, s2, quantized: bool = True):
    """The fp8 recipe in torch, bf16 GEMM outputs: activations quantised 1x128 before each GEMM (W8A8), or
    (``quantized=False``, W8A16) kept in bf16 with the GEMM1 product rounded to bf16 only where the kernels
    store it (the activation epilogue does not: its input stays fp32)."""
    from moe_fx.ops import dequantize_blockwise

    t, h = hidden.shape
    out = torch.zeros(t, h, device=hidden.device)
    i = q2.shape[-1]
    x = hidden.float()
    if quantized:
        xq, xs = quantize_fp8_per_token_group(x)
        x = xq.float() * xs.repeat_interleave(128, -1)[:, :h]
    for e in range(q13.shape[0]):
        tok, slot = torch.nonzero(ids == e, as_tuple=True)
        if tok.numel() == 0:
            continue
        gu = x[tok] @ dequantize_blockwise(q13[e], s13[e]).t()
        gu = gu.bfloat16().float() if quantized else gu
        v = torch.nn.functional.silu(gu[:, :i]) * gu[:, i:]
        if quantized:
            vq, vs = quantize_fp8_per_token_group(v)
            a2 = vq.float() * vs.repeat_interleave(128, -1)[:, :i]
        else:
            a2 = v.bfloat16().float()
        y = (a2 @ dequantize_blockwise(q2[e], s2[e]).t()).bfloat16().float()
        out.index_add_(0, tok, y * w[tok, slot].unsqueeze(-1))
    return out


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("kind", ["random", "hot", "holes"])
def test_triton_experts_fp8(device, kind):
    gen = torch.Generator().manual_seed(9)
    # the CPU interpreter truncates fp32 -> bf16 (the GEMM outputs): looser bound against the recipe there
    recipe_tol = 1.5e-2 if device == "cuda" else 4e-2
    for shape in SHAPES[device]:
        t, _, _, e, k = shape
        # decode sizes keep bf16 activations (W8A16), prefill sizes quantise them (the plan's recipe)
        quantized = quantize_activations(True, row_regime(rows_per_expert(t, k, e)))
        hidden, ids, w, w13, w2 = _problem(*shape, kind, device, gen)
        q13, s13 = quantize_fp8_blockwise(w13)
        q2, s2 = quantize_fp8_blockwise(w2)
        out = triton_experts(hidden, ids, w, q13, q2, w13_scale=s13, w2_scale=s2)
        ref_acts = _reference_fp8_acts(hidden, ids, w, q13, s13, q2, s2, quantized)
        assert rel_err(out, ref_acts) < recipe_tol, (quantized, rel_err(out, ref_acts))  # same recipe: rounding only
        ref = experts_reference(hidden, ids, w, q13, q2, w13_scale=s13, w2_scale=s2)
        # the activation quantisation's cost (W8A8); bf16 roundings only (W8A16)
        assert rel_err(out, ref) < (8e-2 if quantized else recipe_tol), (quantized, rel_err(out, ref))
        bf16 = experts_reference(hidden, ids, w, w13, w2)
        assert rel_err(out, bf16) < 1e-1, rel_err(out, bf16)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("fp8", [False, True])
def test_triton_experts_cuda_graph(fp8):
    """No host synchronisation: the pipeline captures into a CUDA graph and replays on new routing."""
    gen = torch.Generator().manual_seed(10)
    t, h, i, e, k = 64, 2048, 768, 128, 8
    hidden, ids, w, w13, w2 = _problem(t, h, i, e, k, "random", "cuda", gen)
    kw = {}
    if fp8:
        w13, s13 = quantize_fp8_blockwise(w13)
        w2, s2 = quantize_fp8_blockwise(w2)
        kw = {"w13_scale": s13, "w2_scale": s2}
    triton_experts(hidden, ids, w, w13, w2, **kw)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = triton_experts(hidden, ids, w, w13, w2, **kw)
    for seed in range(3):
        h2, ids2, w2r, _, _ = _problem(
            t, h, i, e, k, "holes" if seed else "hot", "cuda", torch.Generator().manual_seed(seed)
        )
        hidden.copy_(h2)
        ids.copy_(ids2)
        w.copy_(w2r)
        graph.replay()
        eager = triton_experts(hidden, ids, w, w13, w2, **kw)
        assert rel_err(out, eager) < 1e-2


@pytest.mark.gpu
@gpu
def test_triton_experts_empty_and_single_token():
    gen = torch.Generator().manual_seed(11)
    hidden, ids, w, w13, w2 = _problem(1, 4096, 1024, 8, 2, "random", "cuda", gen)
    out = triton_experts(hidden, ids, w, w13, w2)
    assert rel_err(out, experts_reference(hidden, ids, w, w13, w2)) < 2e-2
    out = triton_experts(hidden[:0], ids[:0], w[:0], w13, w2)
    assert out.shape == (0, 4096)
    ids[:] = -1
    assert (triton_experts(hidden, ids, w, w13, w2) == 0).all()
