"""bench/pass_time.py --real on CPU: both sides of the random-weights A/B check and rewrite the same regions, each
side's drawing is timed, the shipped drawing is put back, and the host side draws what the shipped one did
before 2026-12-05 (same shapes, windows and spread)."""

from __future__ import annotations

import math

import torch
from helpers import load_bench

from moe_fx.testing.models import tiny_hf_model


def test_real_sides_rewrite_the_same_regions_and_restore_the_drawing():
    from moe_fx.passes.recognize import verify_region

    bench = load_bench("pass_time")
    shipped = verify_region.random_weight
    model = tiny_hf_model("qwen3_moe", num_layers=2)
    ids = torch.randint(0, 128, (1, 16), generator=torch.Generator().manual_seed(0))
    rows = {side: bench.measure_real(model, ids, side) for side in bench.REAL_SIDES}
    assert verify_region.random_weight is shipped
    for row in rows.values():
        assert row["rewritten"] == 2 and row["passes_s"] > 0 and 0 < row["random_s"] < row["passes_s"]


def test_host_side_draws_the_old_way():
    bench = load_bench("pass_time")
    g = torch.Generator().manual_seed(0)
    state = g.get_state()
    w = bench.host_random_weight((64, 128, 256), 256, g, windowed_bytes=1 << 20)
    assert w.shape == (64, 128, 256) and w.untyped_storage().nbytes() < 2 * 128 * 256 * 4
    assert abs(w.std().item() * math.sqrt(256) - 1) < 0.02 and not torch.equal(w[0], w[1])
    g.set_state(state)  # the probe's generator itself made the values: the same state draws them again
    buf = torch.randn(128 * 256 + 63 * 257, generator=g) / 16
    assert torch.equal(buf.as_strided((64, 128, 256), (257, 256, 1)), w)
