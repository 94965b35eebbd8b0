"""``quantize_experts`` on hand-built graphs: one bf16 ``moe_fx::experts`` node gets fp8 weights and block
scales as four new buffers (exact graph text), and nothing else changes; negatives: ``0``, graph as it was."""

from __future__ import annotations

import pytest
import torch
from graphs import context, ops, traced

from moe_fx.passes.quantize_experts import quantize_experts

T, K, E, H, I = 4, 2, 2, 128, 128


def _inputs(dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(0)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    return [torch.randn(T, H, generator=g).to(dtype), ids, torch.rand(T, K, generator=g),
            (torch.randn(E, 2 * I, H, generator=g) * 0.1).to(dtype), (torch.randn(E, H, I, generator=g) * 0.1).to(dtype)]


def layer(h, ids, w, w13, w2):
    return torch.ops.moe_fx.experts.default(h, ids, w, w13, w2, kernel_choice="auto")


def _quantize(inputs, **config):
    gm = traced(layer, *inputs)
    before = gm.code
    count = quantize_experts(gm, context(gm, inputs, **config))
    gm.recompile()
    return gm, before, count


def test_bf16_experts_get_fp8_weights_and_scales():
    inputs = _inputs()
    gm, _, count = _quantize(inputs, quantize="fp8")
    assert count == 1 and ops(gm) == ["experts.default"]
    body = [line.strip() for line in gm.code.strip().splitlines()[1:-1]]
    assert body[:4] == [f"moe_fx_fp8_0_{s} = self.moe_fx_fp8_0_{s}" for s in ("w13", "w13_scale", "w2", "w2_scale")]
    assert body[4].startswith("experts_default = torch.ops.moe_fx.experts.default(h, ids, w, moe_fx_fp8_0_w13, "
                              "moe_fx_fp8_0_w2, kernel_choice = 'auto', w13_scale = moe_fx_fp8_0_w13_scale, "
                              "w2_scale = moe_fx_fp8_0_w2_scale)")
    assert gm.moe_fx_fp8_0_w13.dtype == torch.float8_e4m3fn and gm.moe_fx_fp8_0_w13_scale.shape == (E, 2, 1)
    ref = layer(*inputs).float()
    assert ((gm(*inputs).float() - ref).norm() / ref.norm()) < 0.1  # fp8 e4m3 weights


@pytest.mark.parametrize("case", ["not asked", "float32 activations", "already fp8"])
def test_nothing_to_quantize_leaves_the_graph_as_it_was(case):
    inputs = _inputs(torch.float32 if case == "float32 activations" else torch.bfloat16)
    if case == "already fp8":
        from moe_fx.lowering.quant import quantize_fp8_blockwise

        (q13, s13), (q2, s2) = quantize_fp8_blockwise(inputs[3].float()), quantize_fp8_blockwise(inputs[4].float())
        inputs = [*inputs[:3], q13, q2, s13, s2]

        def fp8_layer(h, ids, w, w13, w2, s13, s2):
            return torch.ops.moe_fx.experts.default(h, ids, w, w13, w2, w13_scale=s13, w2_scale=s2)

        gm = traced(fp8_layer, *inputs)
        before = gm.code
        count = quantize_experts(gm, context(gm, inputs, quantize="fp8"))
    else:
        gm, before, count = _quantize(inputs, **({} if case == "not asked" else {"quantize": "fp8"}))
    assert count == 0 and gm.code == before and not any(n.op == "get_attr" for n in gm.graph.nodes)
