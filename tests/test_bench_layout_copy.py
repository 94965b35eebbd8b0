"""bench/layout_copy.py off the GPU: its bytes floors, and its sides run under the Triton interpreter on a tiny layer
(the fused fp8 side writes what the two launches write; the bf16 sides copy the tokens)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import load_bench


@pytest.fixture(scope="module")
def mod():
    pytest.importorskip("transformers")  # moe_layer's machine_meta
    pytest.importorskip("triton")
    return load_bench("layout_copy")


def test_floor_bytes(mod):
    # DeepSeek-V3 shard, T=4096: 58.7 MB of bf16 tokens read; 32768 rows of 7168 codes and 56 scales written
    t, k, h = 4096, 8, 7168
    assert mod.floor_bytes("bf16", t, k, h) == t * h * 2 + t * k * h * 2
    fused = t * h * 2 + t * k * (h + 56 * 4)
    assert mod.floor_bytes("fp8_fused", t, k, h) == fused
    assert mod.floor_bytes("fp8_two_launches", t, k, h) == fused + 2 * t * (h + 56 * 4)
    assert mod.floor_bytes("masked_fp8", t, k, h) == fused
    assert mod.floor_bytes("masked_bf16", t, k, h) == mod.floor_bytes("bf16", t, k, h)
    assert mod.floor_bytes("fp8_fused", 1, 1, 200) == 400 + 200 + 2 * 4  # 200 columns: two scale groups
    with pytest.raises(ValueError, match="unknown side"):
        mod.floor_bytes("fp16", t, k, h)


def test_masked_sides_only_where_deepgemm_runs_that_layout(mod):
    # the DeepSeek-V3 shard (E=32, top-8): 256 rows per expert at T=1024, 1024 at T=4096
    assert mod.sides_for(1024, 8, 32) == mod.SIDES
    assert mod.sides_for(4096, 8, 32) == ("bf16", "fp8_fused", "fp8_two_launches", "fp8_fused_kmajor",
                                            "fp8_fused_scratch")


def test_sides_on_a_tiny_layer(mod):
    torch.manual_seed(0)
    t, e, k, h = 6, 4, 2, 256
    x = torch.randn(t, h, dtype=torch.bfloat16)
    ids = torch.stack([torch.randperm(e)[:k] for _ in range(t)])
    fused, two = mod.side_fn("fp8_fused", e)(x, ids), mod.side_fn("fp8_two_launches", e)(x, ids)
    assert fused.x.dtype == torch.float8_e4m3fn and mod.same_layout(fused, two)
    kmajor = mod.side_fn("fp8_fused_kmajor", e)(x, ids)  # the same values, the scales row by row
    assert kmajor.x_scale.stride(-1) == 1 and fused.x_scale.stride(-2) == 1 and mod.same_layout(fused, kmajor)
    copied = mod.side_fn("fp8_fused_scratch", e)(x, ids)  # row by row, then copied into DeepGEMM's layout
    assert copied.x_scale.stride() == fused.x_scale.stride() and mod.same_layout(fused, copied)
    # a GPU sort orders an expert's rows by atomics: the same layout with two of an expert's rows swapped
    e0 = int(ids[0, 0])
    rows0 = (two.m_indices == e0).nonzero().flatten()
    assert rows0.numel() >= 2
    r1, r2 = int(rows0[0]), int(rows0[1])
    perm = torch.arange(two.x.shape[0])
    perm[r1], perm[r2] = r2, r1
    # perm is its own inverse: each slot follows its row
    swapped = dataclasses.replace(two, x=two.x[perm], x_scale=two.x_scale[perm], slot_pos=perm[two.slot_pos])
    assert not torch.equal(swapped.slot_pos, fused.slot_pos) and mod.same_layout(fused, swapped)
    two.x_scale[two.slot_pos[0]] += 1.0  # one scale off: no longer the same layout
    assert not mod.same_layout(fused, two)
    plain = mod.side_fn("bf16", e)(x, ids)
    assert plain.x.dtype == torch.bfloat16 and plain.x_scale is None
    assert torch.equal(plain.x[plain.slot_pos], x.repeat_interleave(k, dim=0))
    assert plain.x.shape[0] % mod.CONTIGUOUS_M_ALIGN == 0
    masked = mod.side_fn("masked_fp8", e)(x, ids)
    assert masked.x.shape == (e, t, h) and masked.x.dtype == torch.float8_e4m3fn
    assert int(masked.masked_m.sum()) == t * k
    pos = masked.slot_pos[0]  # slot 0's row: expert * max_m + row, the codes the contiguous copy wrote for it
    assert torch.equal(masked.x.view(-1, h)[pos].view(torch.uint8), fused.x[fused.slot_pos[0]].view(torch.uint8))
