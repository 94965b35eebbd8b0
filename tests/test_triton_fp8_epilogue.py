"""W8A8 GEMM1 with the activation and its 1x128 fp8 quantisation in the epilogue (``masked_gemm_fp8_kernel``'s
ACT_FUSED, ``pipeline.FUSE_FP8_ACTIVATION``): against the fp32 reference of the dequantised operands, the recipe's
scales, padding rows unwritten (poisoned), and the whole op with the switch on against off. CPU: the Triton
interpreter on tiny shapes; CUDA: Qwen3-like widths."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _triton_util import ACTIVATION_FORMS, devices, rel_err

from moe_fx.lowering.experts import plan_experts, run_experts
from moe_fx.lowering.quant import quantize_fp8_blockwise
from moe_fx.lowering.triton.configs import TileConfig
from moe_fx.lowering.triton.grouped_gemm import fp8_epilogue_tile, sorted_gemm
from moe_fx.lowering.triton.sort import quantize_rows, sort_by_expert
from moe_fx.ops import ExpertActivation, dequantize_blockwise
from moe_fx.ops.experts import bind_experts, reference_of
from moe_fx.ops.recipe import FP8_E4M3_MAX


def _act(v: torch.Tensor, spec: ExpertActivation) -> torch.Tensor:
    """``spec`` on fp32 GEMM1 rows ``v``, written from its definition (not the kernels' helper)."""
    if spec.gated:
        g, u = (v[..., 0::2], v[..., 1::2]) if spec.gate_up_layout == "interleaved" else v.chunk(2, -1)
    else:
        g = u = v
    if spec.limit is not None:
        g = g.clamp(max=spec.limit) if spec.gated else g.clamp(-spec.limit, spec.limit)
        u = u.clamp(-spec.limit, spec.limit)
    a = {"silu": lambda x: x * torch.sigmoid(spec.alpha * x), "gelu": F.gelu,
         "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"), "relu2": lambda x: F.relu(x) ** 2}[spec.name](g)
    return a * (u + spec.up_offset) if spec.gated else a


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("form", list(ACTIVATION_FORMS))
def test_fused_gemm1_gives_the_quantised_activation(form, device):
    spec = ACTIVATION_FORMS[form]
    gen = torch.Generator().manual_seed(len(form))
    # i = 192: a partial last scale group, and halves' up rows starting inside a weight scale block
    t, k, e, h, i = (7, 3, 4, 256, 192) if device == "cpu" else (300, 8, 16, 2048, 768 + 64)
    ids = torch.randint(0, e, (t, k), generator=gen)
    ids[2, 1] = -1  # a slot with no row
    xq, xs = quantize_rows(torch.randn(t, h, generator=gen).bfloat16())
    wq, ws = quantize_fp8_blockwise(torch.randn(e, spec.columns(i), h, generator=gen) / h**0.5)
    rw = torch.rand(t, k, generator=gen) if form == "gpt_oss" else None  # weights on the input, before the bias
    bias = torch.randn(e, spec.columns(i), generator=gen) * 0.1 if form == "gpt_oss" else None
    groups = -(-i // 128)
    rows = sort_by_expert(ids.to(device=device, dtype=torch.int32), e)
    out = torch.full((1, t * k, i), float("nan"), device=device).to(torch.float8_e4m3fn)
    scale = torch.full((1, t * k, groups), float("nan"), device=device)
    cfg = fp8_epilogue_tile(TileConfig(64, 128, 128, 8, 4, 3, 2, tma=device == "cuda"), spec.gated)
    on = (lambda v: v.to(device)) if device == "cuda" else (lambda v: v)
    sorted_gemm(on(xq), on(wq), rows, out, a_scale=on(xs), b_scale=on(ws), gather=True, activation=spec,
                out_scale=scale, config=cfg, route_weights=None if rw is None else on(rw),
                bias=None if bias is None else on(bias))
    out, scale, slot_pos = out[0].cpu(), scale[0].cpu(), rows.slot_pos.cpu()
    x32 = xq.float() * xs.repeat_interleave(128, -1)[:, :h]
    deq = out.float() * scale.repeat_interleave(128, -1)[:, :i]
    flat = ids.flatten()
    checked = 0
    for s in range(t * k):
        pos = slot_pos[s].item()
        if pos < 0:
            continue
        v = x32[s // k] @ dequantize_blockwise(wq[flat[s]], ws[flat[s]]).T
        if rw is not None:
            v = v * rw[s // k, s % k]
        if bias is not None:
            v = v + bias[flat[s]]
        ref = _act(v, spec)
        assert rel_err(deq[pos], ref) < 4e-2, (s, rel_err(deq[pos], ref))
        # the recipe: each group's largest code is +-448 (its amax over the scale), scales from the group's amax
        codes = out[pos].float()
        for g in range(groups):
            cols = slice(128 * g, min(128 * (g + 1), i))
            assert codes[cols].abs().max().item() == FP8_E4M3_MAX, (s, g)
            amax = ref[cols].abs().max().item()
            assert abs(scale[pos, g].item() * FP8_E4M3_MAX - amax) <= 2e-2 * amax + 1e-6, (s, g)
        checked += 1
    total = int(rows.total.item())
    assert checked == total > 0
    assert torch.isnan(out[total:].float()).all() and torch.isnan(scale[total:]).all()


def test_fused_gemm1_refuses_missing_or_stray_scales():
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 2, (3, 2), generator=gen, dtype=torch.int32)
    rows = sort_by_expert(ids, 2)
    xq, xs = quantize_rows(torch.randn(3, 128, generator=gen).bfloat16())
    wq, ws = quantize_fp8_blockwise(torch.randn(2, 256, 128, generator=gen))
    with pytest.raises(ValueError, match="out_scale"):
        sorted_gemm(xq, wq, rows, a_scale=xs, b_scale=ws, gather=True, activation=ExpertActivation())
    with pytest.raises(ValueError, match="out_scale"):
        sorted_gemm(xq, wq, rows, a_scale=xs, b_scale=ws, gather=True, out_scale=torch.empty(1, 6, 1))
    with pytest.raises(ValueError, match="out_scale"):  # W8A16: bf16 activation rows, no scales
        sorted_gemm(torch.randn(3, 128).bfloat16(), wq, rows, b_scale=ws, gather=True, activation=ExpertActivation(),
                    out_scale=torch.empty(1, 6, 1))


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("form", ["silu", "gpt_oss", "relu2_not_gated"])
def test_op_with_the_fp8_epilogue_matches_the_activation_kernel(form, device, monkeypatch):
    """The whole op, fp8 weights above 16 rows per expert: the epilogue on gives the rows the activation kernel gives
    (up to the bf16 rounding of GEMM1's product, which the kernel path has and the epilogue does not), both near the
    fp32 reference; the plan says which ran; at decode sizes (16 rows or fewer) the switch changes nothing."""
    from moe_fx.lowering.masked_experts import pipeline

    spec = ACTIVATION_FORMS[form]
    gen = torch.Generator().manual_seed(7)
    t, k, e, h, i = (40, 2, 3, 256, 192) if device == "cpu" else (1024, 8, 64, 2048, 768)
    hidden = torch.randn(t, h, generator=gen).bfloat16()
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])
    w = torch.softmax(torch.randn(t, k, generator=gen), -1)
    q13, s13 = quantize_fp8_blockwise(torch.randn(e, spec.columns(i), h, generator=gen) / h**0.5)
    q2, s2 = quantize_fp8_blockwise(torch.randn(e, h, i, generator=gen) / i**0.5)
    b13 = (torch.randn(e, spec.columns(i), generator=gen) * 0.1).bfloat16() if form == "gpt_oss" else None
    args = [v.to(device) if isinstance(v, torch.Tensor) else v for v in (hidden, ids, w, q13, q2, s13, s2, b13)]
    hidden, ids, w, q13, q2, s13, s2, b13 = args
    outs = {}
    for on in (True, False):
        monkeypatch.setattr(pipeline, "FUSE_FP8_ACTIVATION", on)
        for rows in (t, 4):  # 4 tokens: at most 8 rows per expert, the decode regimes
            a = bind_experts(hidden[:rows], ids[:rows], w[:rows], q13, q2, spec.name, False, s13, s2,
                             kernel_choice="triton", w13_bias=b13, gated=spec.gated,
                             gate_up_layout=spec.gate_up_layout, alpha=spec.alpha, limit=spec.limit,
                             up_offset=spec.up_offset)
            plan = plan_experts(a)
            assert plan.activation_epilogue == plan.quantized_activation_epilogue == (on and rows == t), (on, rows)
            assert ("fp8 quantisation in GEMM1's epilogue" in plan.summary()) == (on and rows == t)
            outs[on, rows] = run_experts(a, plan)
            assert rel_err(outs[on, rows], reference_of(a)) < 8e-2
    assert rel_err(outs[True, t], outs[False, t]) < 4e-2
    assert torch.equal(outs[True, 4], outs[False, 4])
