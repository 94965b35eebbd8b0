"""The contiguous ("sorted") layout on CPU (Triton interpreter, tiny shapes): the sort, its GEMMs, and the
whole experts op on it and on the masked layout, against the torch reference, outputs poisoned with NaN."""

from __future__ import annotations

import pytest
import torch
from _triton_util import devices, rel_err

from moe_fx.lowering.experts import plan_experts, run_experts
from moe_fx.lowering.quant import quantize_fp8_blockwise, quantize_fp8_per_token_group
from moe_fx.lowering.triton.grouped_gemm import sorted_gemm
from moe_fx.lowering.triton.sort import quantize_rows, sort_by_expert
from moe_fx.ops import ExpertActivation, dequantize_blockwise, experts_reference
from moe_fx.ops.experts import bind_experts, reference_of


def _ids(t, k, e, gen, extra=0):
    """Random ids with every hazard: -1, repeats inside a token, ids past E (identity / out of range)."""
    ids = torch.randint(0, e, (t, k), generator=gen)
    ids[torch.rand(t, k, generator=gen) < 0.15] = -1
    if t > 1 and k > 1:
        ids[1, :] = ids[1, 0].clamp(min=0)  # one token names one expert K times
    if extra:
        ids[torch.rand(t, k, generator=gen) < 0.15] = e + extra - 1
    return ids


@pytest.mark.parametrize("small", [False, True])
@pytest.mark.parametrize("t,k,e", [(9, 3, 5), (4, 6, 3), (1, 1, 1), (0, 2, 4), (40, 2, 3), (64, 2, 5), (70, 2, 3),
                                   (17, 8, 128), (120, 8, 128)])
def test_sort_by_expert_puts_every_slot_in_its_expert_segment(t, k, e, small):
    # small: <= 32 slots rank pairwise in the decode tile, <= 128 in the larger one (sort.pairwise_slots up to
    # E = 128); 140 and 136 slots take the bitonic sort of sort.BITONIC_SORT_SLOTS (the blocks: the test below)
    gen = torch.Generator().manual_seed(t * 100 + k)
    ids = _ids(t, k, e, gen, extra=2)  # 2 ids past E: identity experts or out of range: no row either way
    rows = sort_by_expert(ids.to(torch.int32), e, small=small)
    flat = ids.flatten()
    valid = (flat >= 0) & (flat < e)
    counts = [int((flat == x).sum()) for x in range(e)]
    assert rows.counts.tolist() == counts and rows.total.item() == int(valid.sum()) and rows.num_rows == t * k
    starts = [sum(counts[:x]) for x in range(e)]
    for s in range(t * k):
        pos = rows.slot_pos[s].item()
        if not valid[s]:
            assert pos == -1
            continue
        x = flat[s].item()
        assert starts[x] <= pos < starts[x] + counts[x] and rows.sorted_slots[pos].item() == s
    assert sorted(rows.sorted_slots[: rows.total.item()].tolist()) == [s for s in range(t * k) if valid[s]]
    if small:  # the one-program sort is stable: slots in order inside each expert
        for x in range(e):
            seg = rows.sorted_slots[starts[x]: starts[x] + counts[x]].tolist()
            assert seg == sorted(seg)


def test_sorted_gemms_gather_weight_bias_and_leave_padding_unwritten():
    gen = torch.Generator().manual_seed(3)
    t, k, e, h, n = 7, 3, 4, 136, 72
    ids = _ids(t, k, e, gen)
    rows = sort_by_expert(ids, e)
    x = torch.randn(t, h, generator=gen)
    w = torch.randn(e, n, h, generator=gen) / h**0.5
    rw = torch.rand(t, k, generator=gen)
    bias = torch.randn(e, n, generator=gen)
    out = torch.full((1, t * k, n), float("nan"))
    sorted_gemm(x, w, rows, out, gather=True, route_weights=rw, bias=bias)
    a2 = torch.randn(1, t * k, h, generator=gen)
    out2 = sorted_gemm(a2, w, rows, torch.full((1, t * k, n), float("nan")))
    out, out2, a2 = out[0], out2[0], a2[0]
    flat = ids.flatten()
    for s in range(t * k):
        pos = rows.slot_pos[s].item()
        if pos < 0:
            continue
        tok, x_e = s // k, flat[s].item()
        torch.testing.assert_close(out[pos], (x[tok] @ w[x_e].T) * rw[tok, s % k] + bias[x_e], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(out2[pos], a2[pos] @ w[x_e].T, rtol=1e-4, atol=1e-4)
    total = rows.total.item()
    assert torch.isnan(out[total:]).all() and torch.isnan(out2[total:]).all()
    with pytest.raises(ValueError):
        sorted_gemm(a2[None], w, rows, route_weights=rw)  # weights go with the gathered GEMM only


def test_sorted_fp8_gemm_matches_dequantised_product():
    gen = torch.Generator().manual_seed(4)
    t, k, e, h, n = 5, 2, 3, 256, 136
    ids = _ids(t, k, e, gen)
    rows = sort_by_expert(ids, e)
    xq, xs = quantize_rows(torch.randn(t, h, generator=gen).bfloat16())
    wq, ws = quantize_fp8_blockwise(torch.randn(e, n, h, generator=gen) / h**0.5)
    out = torch.full((1, t * k, n), float("nan"), dtype=torch.bfloat16)
    sorted_gemm(xq, wq, rows, out, a_scale=xs, b_scale=ws, gather=True)
    out = out[0]
    x32 = xq.float() * xs.repeat_interleave(128, -1)[:, :h]
    flat = ids.flatten()
    for s in range(t * k):
        pos = rows.slot_pos[s].item()
        if pos >= 0:
            ref = x32[s // k] @ dequantize_blockwise(wq[flat[s]], ws[flat[s]]).T
            assert rel_err(out[pos], ref) < 2e-2
    assert torch.isnan(out[rows.total.item():].float()).all()


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("tma", [False, True])
def test_sorted_fp8_gemm_reads_no_token_bytes_past_k(tma, device):
    """GEMM1 gathers token rows through pointers beside TMA-loaded weights: at a K tail (K % 128, GPT-OSS's
    H = 2880) it must mask the rows' loads, not read on into the next row. Here the next row is a token no
    slot names, all NaN codes; on the H200 such reads turned GPT-OSS fp8 layers of 17..64 rows per expert
    into garbage once its clamp had made the NaN products finite (relative error 1.9). Only the GPU run
    catches an unmasked load: the interpreter reads e4m3 NaN codes as finite values (times the zeros TMA
    fills in past K)."""
    from moe_fx.lowering.triton.configs import TileConfig

    gen = torch.Generator().manual_seed(9)
    t, k, e, h, n = 6, 2, 3, 320, 128  # h: a 64-wide tail after two 128-wide steps
    ids = torch.randint(0, e, (t, k), generator=gen)
    ids[1] = ids[t - 1] = -1  # tokens 1 and 5 send no row (5: nothing is read past the last row either)
    xq, xs = quantize_rows(torch.randn(t, h, generator=gen).bfloat16())
    xq[1] = torch.tensor(float("nan")).to(torch.float8_e4m3fn)  # what token 0's tail would read
    wq, ws = quantize_fp8_blockwise(torch.randn(e, n, h, generator=gen) / h**0.5)
    rows = sort_by_expert(ids.to(device), e)
    out = sorted_gemm(xq.to(device), wq.to(device), rows, a_scale=xs.to(device), b_scale=ws.to(device), gather=True,
                      config=TileConfig(16, 64, 128, 1, 4, 1, 1, tma=tma))[0].cpu()
    slot_pos = rows.slot_pos.cpu()
    x32 = xq.float() * xs.repeat_interleave(128, -1)[:, :h]
    flat = ids.flatten()
    checked = 0
    for s in range(t * k):
        pos = slot_pos[s].item()
        if pos >= 0:
            ref = x32[s // k] @ dequantize_blockwise(wq[flat[s]], ws[flat[s]]).T
            assert torch.isfinite(out[pos].float()).all() and rel_err(out[pos], ref) < 2e-2, s
            checked += s // k == 0
    assert checked == k  # token 0, whose tail the unmasked load read, was checked


def test_quantize_rows_is_the_recipe():
    x = torch.randn(5, 200, generator=torch.Generator().manual_seed(5)).bfloat16()
    q, s = quantize_rows(x)
    q_ref, s_ref = quantize_fp8_per_token_group(x)
    torch.testing.assert_close(s, s_ref)
    assert torch.equal(q.float(), q_ref.float())


FORMS = {
    "silu": (ExpertActivation(), False, False, 0),
    "gpt_oss": (ExpertActivation("silu", True, "interleaved", 1.702, 7.0, 1.0), True, False, 0),
    "relu2_plain_identity": (ExpertActivation("relu2", gated=False), False, False, 2),
    "gelu_weights_on_input": (ExpertActivation("gelu_tanh"), True, True, 0),
}


def _assert_same_rows(got: torch.Tensor, want: torch.Tensor, device: str, gpu_tol: float) -> None:
    """Two routes to the same rows: bit for bit under the interpreter (one order of operations), within ``gpu_tol``
    on a GPU (tiles and MMA orders may differ)."""
    if device == "cpu":
        assert torch.equal(got, want)
    else:
        assert rel_err(got, want) < gpu_tol, rel_err(got, want)


def _layer(form, t, k, e, h, i, gen, dtype=torch.bfloat16):
    spec, biases, on_input, identity = FORMS[form]
    n1 = spec.columns(i)
    hidden = torch.randn(t, h, generator=gen).to(dtype)
    ids = _ids(t, k, e, gen, extra=identity)
    w = torch.softmax(torch.randn(t, k, generator=gen), -1)
    w13 = (torch.randn(e, n1, h, generator=gen) / h**0.5).to(dtype)
    w2 = (torch.randn(e, h, i, generator=gen) / i**0.5).to(dtype)
    b13 = (torch.randn(e, n1, generator=gen) * 0.1).to(dtype) if biases else None
    b2 = (torch.randn(e, h, generator=gen) * 0.1).to(dtype) if biases else None
    return spec, hidden, ids, w, w13, w2, b13, b2, on_input, identity


@pytest.mark.parametrize("layout", ["local_sorted", "local_permute"])
@pytest.mark.parametrize("form", list(FORMS))
def test_both_layouts_run_every_form(layout, form):
    gen = torch.Generator().manual_seed(hash(form) % 1000)
    t, k, e, h, i = 6, 3, 4, 136, 72  # K close to E: repeats and uneven loads
    spec, hidden, ids, w, w13, w2, b13, b2, on_input, identity = _layer(form, t, k, e, h, i, gen)
    a = bind_experts(hidden, ids, w, w13, w2, spec.name, on_input, kernel_choice="triton", w13_bias=b13,
                     w2_bias=b2, gated=spec.gated, gate_up_layout=spec.gate_up_layout, alpha=spec.alpha,
                     limit=spec.limit, up_offset=spec.up_offset, identity_experts=identity)
    plan = plan_experts(a, layout=layout)
    assert plan.layout == ("sorted" if layout == "local_sorted" else "masked")
    out = run_experts(a, plan)
    ref = reference_of(a)
    assert torch.isfinite(out).all()
    # bf16 intermediates against an fp32 reference, and the interpreter truncates fp32 -> bf16
    assert rel_err(out, ref) < 4e-2, rel_err(out, ref)


def test_sorted_layout_fp8_more_slots_than_experts_and_empty_batch():
    gen = torch.Generator().manual_seed(12)
    t, k, e, h, i = 5, 4, 2, 256, 128  # K > E
    hidden = torch.randn(t, h, generator=gen).bfloat16()
    ids = torch.randint(0, e, (t, k), generator=gen)
    w = torch.rand(t, k, generator=gen)
    q13, s13 = quantize_fp8_blockwise(torch.randn(e, 2 * i, h, generator=gen) / h**0.5)
    q2, s2 = quantize_fp8_blockwise(torch.randn(e, h, i, generator=gen) / i**0.5)
    a = bind_experts(hidden, ids, w, q13, q2, w13_scale=s13, w2_scale=s2, kernel_choice="triton")
    plan = plan_experts(a)
    assert plan.layout == "sorted"
    out = run_experts(a, plan)
    ref = experts_reference(hidden, ids, w, q13, q2, w13_scale=s13, w2_scale=s2)
    assert rel_err(out, ref) < 8e-2, rel_err(out, ref)
    empty = run_experts(bind_experts(hidden[:0], ids[:0], w[:0], q13, q2, w13_scale=s13, w2_scale=s2), plan)
    assert empty.shape == (0, h)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("w8a16_max_rows", [16, 0])
@pytest.mark.parametrize("form", list(FORMS))
def test_sorted_layout_fp8_weights_at_decode_size(form, w8a16_max_rows, device, monkeypatch):
    """fp8 weights at decode size: bf16 activations x fp8 weights dequantised in the GEMMs (W8A16, the
    activation in GEMM1's epilogue: no quantisation kernel), and with W8A16 off the quantised pipeline."""
    from moe_fx.lowering.masked_experts import pipeline

    monkeypatch.setattr(pipeline, "W8A16_MAX_ROWS", w8a16_max_rows)
    gen = torch.Generator().manual_seed(len(form))
    # <= 4 rows per expert (regime 0); K and N tails of 128-wide blocks; on the GPU Qwen3-like widths
    t, k, e, h, i = (3, 3, 4, 256 + 64, 128 + 64) if device == "cpu" else (4, 8, 64, 2048 + 64, 768 + 64)
    spec, hidden, ids, w, w13, w2, b13, b2, on_input, identity = (
        v.to(device) if isinstance(v, torch.Tensor) else v for v in _layer(form, t, k, e, h, i, gen))
    (q13, s13), (q2, s2) = quantize_fp8_blockwise(w13.float()), quantize_fp8_blockwise(w2.float())
    a = bind_experts(hidden, ids, w, q13, q2, spec.name, on_input, s13, s2, kernel_choice="triton", w13_bias=b13,
                     w2_bias=b2, gated=spec.gated, gate_up_layout=spec.gate_up_layout, alpha=spec.alpha,
                     limit=spec.limit, up_offset=spec.up_offset, identity_experts=identity)
    plan = plan_experts(a)
    w8a16 = w8a16_max_rows > 0
    assert plan.bf16_activations_fp8_weights == w8a16 and plan.activation_epilogue == w8a16
    assert ("bf16 activations x fp8 weights" in plan.summary()) == w8a16
    out = run_experts(a, plan)
    err = rel_err(out, reference_of(a))
    # W8A16 rounds no activation (bf16 products of the dequantised weights); W8A8 quantises both GEMMs' inputs
    assert err < (2e-2 if w8a16 else 8e-2), err


@pytest.mark.parametrize("t,k,e,h", [(1, 8, 128, 256), (3, 3, 4, 320), (40, 4, 5, 200), (0, 2, 4, 128)])
def test_sort_and_quantize_is_the_sort_and_the_quantisation(t, k, e, h):
    """One launch (the sort's programs, then the tokens' blocks) gives the rows of sort_by_expert(small=True) and
    the codes and scales of quantize_rows; ids of any strides (a transposed view), more slots than one tile."""
    from moe_fx.lowering.triton.sort import sort_and_quantize

    gen = torch.Generator().manual_seed(t * 7 + h)
    ids = _ids(k, t, e, gen, extra=1).to(torch.int32).t()  # [T, K] with strides (1, T)
    x = (torch.randn(t, h, generator=gen) * torch.rand(t, 1, generator=gen) * 4).bfloat16()
    rows, q, scales = sort_and_quantize(ids, e, x)
    want = sort_by_expert(ids, e, small=True)
    want_q, want_s = quantize_rows(x)
    total = want.total.item()
    assert torch.equal(rows.scratch[: e + 1], want.scratch[: e + 1]) and torch.equal(rows.slot_pos, want.slot_pos)
    assert torch.equal(rows.sorted_slots[:total], want.sorted_slots[:total])
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(scales, want_s)
    with pytest.raises(ValueError, match="tokens must be"):
        sort_and_quantize(ids, e, torch.randn(t + 1, h).bfloat16())


@pytest.mark.parametrize("form", ["silu", "gpt_oss"])
def test_fp8_decode_same_output_with_the_tokens_quantised_in_the_sort(form, monkeypatch):
    """The op at decode size with fp8 weights: the tokens quantised in the sort's launch or in their own, the
    same output bit for bit (the same codes and scales reach the same GEMMs)."""
    from moe_fx.lowering.masked_experts import pipeline

    gen = torch.Generator().manual_seed(11)
    t, k, e, h, i = 5, 2, 4, 256, 128  # 2.5 rows per expert: regime 0
    spec, hidden, ids, w, w13, w2, b13, b2, on_input, identity = _layer(form, t, k, e, h, i, gen)
    (q13, s13), (q2, s2) = quantize_fp8_blockwise(w13.float()), quantize_fp8_blockwise(w2.float())
    a = bind_experts(hidden.bfloat16(), ids, w, q13, q2, spec.name, on_input, s13, s2, kernel_choice="triton",
                     w13_bias=b13, w2_bias=b2, gated=spec.gated, gate_up_layout=spec.gate_up_layout,
                     alpha=spec.alpha, limit=spec.limit, up_offset=spec.up_offset, identity_experts=identity)
    plan = plan_experts(a)
    assert plan.layout == "sorted" and pipeline.quantize_tokens_in_sort(True, plan.problem.regime)
    fused = run_experts(a, plan)
    monkeypatch.setattr(pipeline, "QUANTIZE_TOKENS_IN_SORT", False)
    assert not pipeline.quantize_tokens_in_sort(True, plan.problem.regime)
    assert torch.equal(run_experts(a, plan), fused)
    assert rel_err(fused, reference_of(a)) < 8e-2


def test_quantize_activations_is_the_measured_choice(monkeypatch):
    from moe_fx.lowering.masked_experts import pipeline
    from moe_fx.lowering.problem import ROW_REGIMES, row_regime

    regimes = range(len(ROW_REGIMES) + 1)
    # the shipped choice: W8A16 measured slower at decode sizes on the H200, activations quantised everywhere
    assert all(pipeline.quantize_activations(True, r) for r in (*regimes, None))
    assert not any(pipeline.quantize_activations(False, r) for r in regimes)  # bf16 weights: nothing to quantise
    monkeypatch.setattr(pipeline, "W8A16_MAX_ROWS", 16)  # W8A16 up to 16 rows per expert (benchmarks, tests)
    assert [pipeline.quantize_activations(True, r) for r in regimes] == [False, False, True, True, True]
    assert not pipeline.quantize_activations(True, row_regime(16)) and pipeline.quantize_activations(True, row_regime(17))
    assert pipeline.quantize_activations(True, None)  # unknown size: the prefill recipe


def test_sorted_gemm_bf16_activations_fp8_weights_matches_dequantised_product():
    """W8A16: bf16 tokens gathered, fp8 weights with 128x128 scales (K and N tails), routing weights, bias;
    every tile variant; rows past the total never written."""
    from moe_fx.lowering.triton.configs import TileConfig

    gen = torch.Generator().manual_seed(8)
    t, k, e, h, n = 5, 2, 3, 256 + 64, 136 + 64
    ids = _ids(t, k, e, gen)
    rows = sort_by_expert(ids, e)
    x = torch.randn(t, h, generator=gen).bfloat16()
    wq, ws = quantize_fp8_blockwise(torch.randn(e, n, h, generator=gen) / h**0.5)
    rw = torch.rand(t, k, generator=gen)
    bias = torch.randn(e, n, generator=gen).bfloat16()
    flat = ids.flatten()
    for cfg in (None, TileConfig(16, 64, 128, 1, 4, 1, 1, swap_ab=True), TileConfig(16, 64, 64, 1, 4, 1, 1, tma=True)):
        out = torch.full((1, t * k, n), float("nan"), dtype=torch.bfloat16)
        sorted_gemm(x, wq, rows, out, b_scale=ws, gather=True, route_weights=rw, bias=bias, config=cfg)
        for s in range(t * k):
            pos = rows.slot_pos[s].item()
            if pos >= 0:
                w_e = dequantize_blockwise(wq[flat[s]], ws[flat[s]])
                ref = (x[s // k].float() @ w_e.T) * rw[s // k, s % k] + bias[flat[s]].float()
                assert rel_err(out[0, pos], ref) < 1e-2, (cfg, s)
        assert torch.isnan(out[0, rows.total.item():].float()).all()
    with pytest.raises(ValueError, match="a_scale given"):
        sorted_gemm(x, wq, rows, a_scale=torch.ones(t, 3), b_scale=ws, gather=True)
    with pytest.raises(TypeError, match="fp8 weights with unquantised activations"):
        sorted_gemm(x.float(), wq, rows, b_scale=ws, gather=True)


@pytest.mark.parametrize("swap_ab,tma", [(True, False), (False, True), (True, True)])
@pytest.mark.parametrize("fp8", [False, True])
def test_sorted_gemm_swapped_and_device_descriptor_variants(swap_ab, tma, fp8):
    """acc^T = b^T a^T (decode tiles on wgmma) and descriptors made in the kernel compute the same GEMMs."""
    from moe_fx.lowering.triton.configs import TileConfig

    gen = torch.Generator().manual_seed(6)
    t, k, e, h, n = 6, 2, 3, 256, 192
    ids = _ids(t, k, e, gen)
    rows = sort_by_expert(ids, e)
    cfg = TileConfig(16, 64, 128, 1, 4, 1, 1, tma=tma, swap_ab=swap_ab)
    x = torch.randn(t, h, generator=gen)
    a2 = torch.randn(1, t * k, h, generator=gen)
    if fp8:
        w, ws = quantize_fp8_blockwise(torch.randn(e, n, h, generator=gen) / h**0.5)
        xq, xs = quantize_rows(x.bfloat16())
        aq, as_ = quantize_rows(a2[0].bfloat16())
        out1 = sorted_gemm(xq, w, rows, a_scale=xs, b_scale=ws, gather=True, config=cfg)[0]
        out2 = sorted_gemm(aq[None], w, rows, a_scale=as_[None], b_scale=ws, config=cfg)[0]
        ref1 = sorted_gemm(xq, w, rows, a_scale=xs, b_scale=ws, gather=True, config=TileConfig(16, 64, 128, 1, 4, 1))[0]
        ref2 = sorted_gemm(aq[None], w, rows, a_scale=as_[None], b_scale=ws, config=TileConfig(16, 64, 128, 1, 4, 1))[0]
    else:
        w = torch.randn(e, n, h, generator=gen) / h**0.5
        out1 = sorted_gemm(x, w, rows, gather=True, config=cfg)[0]
        out2 = sorted_gemm(a2, w, rows, config=cfg)[0]
        ref1 = sorted_gemm(x, w, rows, gather=True, config=TileConfig(16, 64, 128, 1, 4, 1))[0]
        ref2 = sorted_gemm(a2, w, rows, config=TileConfig(16, 64, 128, 1, 4, 1))[0]
    total = rows.total.item()
    for out, ref in ((out1, ref1), (out2, ref2)):
        torch.testing.assert_close(out[:total].float(), ref[:total].float(), rtol=1e-3, atol=1e-3)
        flat = ids.flatten()
        s = int((rows.slot_pos >= 0).nonzero()[0])
        assert torch.isfinite(out[rows.slot_pos[s]].float()).all() and flat[s] >= 0


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("fp8", [False, True])
def test_every_regime_candidate_is_correct(fp8, device):
    """Every tile ``bench/tune_tiles.py --sorted`` may ship computes the sorted layout's GEMMs (gathered and not).

    The reference is torch on each slot's token and expert, not another tile. On CPU the interpreter checks
    the tile shapes' index logic (swapped products, device descriptors, row tails, k steps), one candidate
    per distinct shape; on the GPU every candidate runs with its warps, stages and programs per SM.
    """
    from moe_fx.lowering.triton.configs import regime_candidates

    gen = torch.Generator().manual_seed(12)
    t, k, e, h, n = (300, 4, 8, 640, 320) if device == "cuda" else (10, 2, 3, 256, 136)
    ids = _ids(t, k, e, gen).to(device)
    rows = sort_by_expert(ids, e)
    x = torch.randn(t, h, generator=gen).bfloat16().to(device)
    a2 = torch.randn(1, t * k, h, generator=gen).bfloat16().to(device)
    w = (torch.randn(e, n, h, generator=gen) / h**0.5).to(device)
    if fp8:
        w, ws = quantize_fp8_blockwise(w)
        (xq, xs), (aq, as_) = quantize_rows(x), quantize_rows(a2[0])
        args1, args2 = (xq, w), (aq[None], w)
        kw1, kw2 = {"a_scale": xs, "b_scale": ws}, {"a_scale": as_[None], "b_scale": ws}
        x32, a32 = xq.float() * xs.repeat_interleave(128, -1)[:, :h], aq.float() * as_.repeat_interleave(128, -1)[:, :h]
        w32 = dequantize_blockwise(w, ws).float()
    else:
        w = w.bfloat16()
        args1, args2, kw1, kw2 = (x, w), (a2, w), {}, {}
        x32, a32, w32 = x.float(), a2[0].float(), w.float()
    slots = (rows.slot_pos >= 0).nonzero()[:, 0]
    pos, experts = rows.slot_pos[slots].long(), ids.flatten()[slots].long()
    ref1 = torch.einsum("sh,snh->sn", x32[slots // k], w32[experts])
    ref2 = torch.einsum("sh,snh->sn", a32[pos], w32[experts])
    cands = {c for regime in range(5) for c in regime_candidates("fp8" if fp8 else "bf16", regime)}
    if device == "cpu":  # warps, stages and programs per SM do not change what the interpreter runs
        cands = {(c.block_m, c.block_n, c.block_k, c.swap_ab, c.tma, c.flatten): c for c in sorted(cands, key=str)}.values()
    total = rows.total.item()
    for cfg in sorted(cands, key=str):
        for args, kw, gather, ref in ((args1, kw1, True, ref1), (args2, kw2, False, ref2)):
            out = torch.full((1, t * k, n), float("nan"), dtype=torch.bfloat16, device=device)
            sorted_gemm(*args, rows, out, gather=gather, config=cfg, **kw)
            assert rel_err(out[0, pos], ref) < (2e-2 if fp8 else 1e-2), (cfg, gather)
            assert torch.isnan(out[0, total:].float()).all(), cfg


@pytest.mark.parametrize("bitonic", [0, 128])
@pytest.mark.parametrize("t,k,e", [(20, 6, 5), (12, 8, 16)])
def test_block_sort_gives_the_two_passes_rows(t, k, e, bitonic, monkeypatch):
    """More slots than one pairwise tile: the programs that each rank a block (``BITONIC_SORT_SLOTS=0``), or
    program 0's bitonic sort of every slot, give the rows of the one-program two passes (``PAIRWISE=False``, the
    other side of bench/kernel_breakdown.py --sort-ab), slot for slot. The tiles are made small (32 slots) so that
    3-4 programs, middle blocks among them, run in the interpreter's time."""
    from moe_fx.lowering.triton import sort as sort_mod

    monkeypatch.setattr(sort_mod, "BITONIC_SORT_SLOTS", bitonic)
    monkeypatch.setattr(sort_mod, "pairwise_slots", lambda e_pow2: 32)
    monkeypatch.setattr(sort_mod, "DECODE_PAIRWISE_SLOTS", 16)
    gen = torch.Generator().manual_seed(t + k + e)
    ids = _ids(t, k, e, gen, extra=1).to(torch.int32)
    assert t * k > 2 * 32  # three programs or more
    blocks = sort_by_expert(ids, e, small=True)
    real = sort_mod.launch
    monkeypatch.setattr(sort_mod, "launch", lambda name, *a, **kw: real(name, *a, **{**kw, "PAIRWISE": False}))
    passes = sort_by_expert(ids, e, small=True)
    total = passes.total.item()
    assert torch.equal(blocks.scratch[: e + 1], passes.scratch[: e + 1])
    assert torch.equal(blocks.slot_pos, passes.slot_pos)
    assert torch.equal(blocks.sorted_slots[:total], passes.sorted_slots[:total])


# the blocks of pairwise ranks (bitonic 0) on the GPU only: minutes per case in the interpreter
@pytest.mark.parametrize("device,bitonic", [pytest.param(d.values[0], 1024, id=f"{d.id}-bitonic", marks=d.marks)
                                            for d in devices()]
                         + [pytest.param("cuda", 0, id="cuda-blocks", marks=devices()[1].marks)])
@pytest.mark.parametrize("t,k,e", [(17, 8, 128), (64, 8, 128), (120, 8, 256), (500, 2, 8), (200, 4, 32)])
def test_decode_sort_gives_a_stable_sorts_rows(t, k, e, bitonic, device, monkeypatch):
    """The one-launch sort at real sizes (136-1000 slots: the bitonic network, or blocks of pairwise ranks with it
    off) gives the rows of torch's stable sort of the slots by expert, slot for slot, and the counts."""
    from moe_fx.lowering.triton import sort as sort_mod

    monkeypatch.setattr(sort_mod, "BITONIC_SORT_SLOTS", bitonic)
    ids = _ids(t, k, e, torch.Generator().manual_seed(t * k + e), extra=1).to(torch.int32)
    flat = ids.flatten().long()
    valid = (flat >= 0) & (flat < e)
    order = torch.sort(torch.where(valid, flat, e), stable=True).indices
    total = int(valid.sum())
    want_pos = torch.full_like(flat, -1)
    want_pos[order[:total]] = torch.arange(total)
    got = sort_by_expert(ids.to(device), e, small=True)
    assert got.counts.cpu().tolist() == torch.bincount(flat[valid], minlength=e).tolist()
    assert got.total.item() == total
    assert torch.equal(got.slot_pos.cpu(), want_pos)
    assert torch.equal(got.sorted_slots[:total].cpu().long(), order[:total])


def _slot_order_call(form: str, t: int, seed: int, device: str, dtype: torch.dtype = torch.bfloat16) -> dict:
    """The bound arguments of a ``triton`` experts call of ``form`` with ``t`` tokens of 3 slots over 4 experts, the
    first token naming one expert twice and the last slot no expert (-1)."""
    spec, hidden, ids, w, w13, w2, b13, b2, on_input, identity = _layer(form, t, 3, 4, 136, 72,
                                                                        torch.Generator().manual_seed(seed), dtype)
    ids[0, 1] = ids[0, 0].clamp(min=0)  # a token naming one expert twice
    ids[-1, -1] = -1
    args = [x if x is None else x.to(device) for x in (hidden, ids, w, w13, w2, b13, b2)]
    return bind_experts(*args[:5], spec.name, on_input, kernel_choice="triton", w13_bias=args[5], w2_bias=args[6],
                        gated=spec.gated, gate_up_layout=spec.gate_up_layout, alpha=spec.alpha, limit=spec.limit,
                        up_offset=spec.up_offset, identity_experts=identity)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("t,max_tokens", [(1, 1), (3, 4)])
def test_rows_in_slot_order_give_the_sorted_layouts_output(form, t, max_tokens, device, monkeypatch):
    """A static token count up to ``SLOT_ROWS_MAX_TOKENS`` runs without the sort: slot (t, k) owns row t * K + k and
    the GEMMs read its expert id. Same output as the sorted rows (bit for bit under the interpreter), for every
    activation form (biases, identity experts, weights on the input), repeated ids, ids with no expert (-1)."""
    from moe_fx.lowering.masked_experts import pipeline

    monkeypatch.setattr(pipeline, "SLOT_ROWS_MAX_TOKENS", max_tokens)
    a = _slot_order_call(form, t, t * 31 + len(form), device)
    plan = plan_experts(a)
    assert plan.layout == "sorted" and plan.slot_rows and "rows in slot order" in plan.summary()
    slots = run_experts(a, plan)
    monkeypatch.setattr(pipeline, "SLOT_ROWS_MAX_TOKENS", 0)
    sorted_plan = plan_experts(a)
    assert not sorted_plan.slot_rows
    ref = run_experts(a, sorted_plan)
    _assert_same_rows(slots, ref, device, 1e-2)
    assert rel_err(slots, reference_of(a)) < 4e-2


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("t,dtype", [(1, torch.bfloat16), (3, torch.bfloat16), (1, torch.float32)])
def test_down_and_combine_in_one_launch_match_the_two_launches(form, t, dtype, device, monkeypatch):
    """``pipeline.SLOT_DOWN_COMBINE``: rows in slot order run GEMM2 and the combine as one launch
    (``grouped_gemm.slot_down_combine``). Its output is the two launches' (GEMM2, then the combine) up to the bf16
    rounding of GEMM2's rows, which it skips; in fp32 they agree to 1e-5. Every activation form (biases, identity
    experts, weights on the input), a token naming one expert twice, an id with no expert (-1), several tokens."""
    from moe_fx.lowering.masked_experts import pipeline

    monkeypatch.setattr(pipeline, "SLOT_ROWS_MAX_TOKENS", 4)
    a = _slot_order_call(form, t, t * 17 + len(form) + (dtype == torch.float32), device, dtype)
    two = run_experts(a, plan_experts(a))
    monkeypatch.setattr(pipeline, "SLOT_DOWN_COMBINE", True)
    plan = plan_experts(a)
    assert plan.slot_rows and plan.down_combined and "GEMM2 and the combine in one launch" in plan.summary()
    one = run_experts(a, plan)
    assert one.shape == two.shape == a["hidden"].shape and one.dtype == a["hidden"].dtype
    if dtype == torch.float32:
        assert rel_err(one, two) < 1e-5, rel_err(one, two)
    else:
        assert rel_err(one, two) < 1e-2, rel_err(one, two)
    assert rel_err(one, reference_of(a)) < 4e-2


def test_down_and_combine_in_one_launch_only_where_asked(monkeypatch):
    """One launch for GEMM2 and the combine needs the switch, rows in slot order, at most 16 slots a token (the
    columns of its MMA tile) and a combine not left to Inductor."""
    from moe_fx.lowering.masked_experts import pipeline
    from moe_fx.lowering.triton.grouped_gemm import SLOT_DOWN_MAX_TOPK, SlotRows, slot_down_combine

    assert pipeline.SLOT_DOWN_COMBINE is False  # not timed on a GPU yet
    assert not pipeline.fuse_down_combine(True, 8, False)
    monkeypatch.setattr(pipeline, "SLOT_DOWN_COMBINE", True)
    assert pipeline.fuse_down_combine(True, 8, False) and pipeline.fuse_down_combine(True, SLOT_DOWN_MAX_TOPK, False)
    assert not pipeline.fuse_down_combine(False, 8, False)  # sorted rows
    assert not pipeline.fuse_down_combine(True, SLOT_DOWN_MAX_TOPK + 1, False)
    assert not pipeline.fuse_down_combine(True, 8, True)  # the combine is Inductor's
    ids = torch.zeros(1, SLOT_DOWN_MAX_TOPK + 1, dtype=torch.long)
    a, b = torch.randn(1, ids.numel(), 32), torch.randn(2, 16, 32)
    with pytest.raises(ValueError, match="at most 16 slots"):
        slot_down_combine(a, b, SlotRows.of(ids, 2), torch.rand(ids.shape))
    with pytest.raises(TypeError, match="rows in slot order"):
        slot_down_combine(a, b, None, torch.rand(ids.shape))


def test_rows_in_slot_order_only_for_a_static_token_count_and_unquantised_weights():
    from moe_fx.lowering.masked_experts.pipeline import SLOT_ROWS_MAX_TOKENS, slot_rows

    assert SLOT_ROWS_MAX_TOKENS == 1
    assert slot_rows(False, 1) and not slot_rows(False, 2) and not slot_rows(False, 0)
    assert not slot_rows(True, 1)  # fp8 weights: the sort's launch quantises the tokens
    assert not slot_rows(False, None) and not slot_rows(False, True)
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    assert not slot_rows(False, ShapeEnv().create_unbacked_symint())


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("swap_ab", [False, True])
def test_rows_in_slot_order_with_weight_descriptors(swap_ab, device):
    """The bf16 GEMM's slot mode with its weights through descriptors made in the kernel (a tile with ``tma``): the
    expert a slot names (int64 ids) is an int32 coordinate, and the rows equal the pointer tile's."""
    from dataclasses import replace

    from moe_fx.lowering.triton import configs
    from moe_fx.lowering.triton.grouped_gemm import SlotRows

    gen = torch.Generator().manual_seed(9 + swap_ab)
    e, n, h = 5, 96, 192
    x = torch.randn(1, h, generator=gen).bfloat16().to(device)
    w = (torch.randn(e, n, h, generator=gen) / h**0.5).bfloat16().to(device)
    rows = SlotRows.of(torch.tensor([[3, 1, -1]], device=device), e)
    cfg = replace(configs.TileConfig(16, 32, 64, 1, 4, 2), swap_ab=swap_ab)
    got = sorted_gemm(x, w, rows, gather=True, config=replace(cfg, tma=True))[0, :2]
    _assert_same_rows(got, sorted_gemm(x, w, rows, gather=True, config=cfg)[0, :2], device, 1e-2)
    assert rel_err(got, (x.float() @ w[[3, 1]].float().transpose(1, 2))[:, 0]) < 1e-2


def test_rows_in_slot_order_with_the_separate_activation_kernel(monkeypatch):
    """With the activation epilogue off (a benchmark's switch), one token's rows in slot order go through the
    activation kernel as one group of all T * K rows (a slot without an expert: a row never read)."""
    from moe_fx.lowering.masked_experts import pipeline

    monkeypatch.setattr(pipeline, "FUSE_ACTIVATION", False)
    gen = torch.Generator().manual_seed(5)
    k, e, h, i = 3, 4, 136, 72
    spec, hidden, ids, w, w13, w2, *_ = _layer("silu", 1, k, e, h, i, gen)
    ids[0] = torch.tensor([2, 0, -1])
    a = bind_experts(hidden, ids, w, w13, w2, kernel_choice="triton")
    plan = plan_experts(a)
    assert plan.slot_rows and not plan.activation_epilogue
    slots = run_experts(a, plan)
    monkeypatch.setattr(pipeline, "SLOT_ROWS_MAX_TOKENS", 0)
    assert torch.equal(slots, run_experts(a, plan_experts(a)))
