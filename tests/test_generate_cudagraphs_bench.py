"""bench/generate_cudagraphs.py's decode-step profile: the per-step arithmetic and its table (CPU)."""

from __future__ import annotations

import torch
from helpers import load_bench

gc = load_bench("generate_cudagraphs")


def test_per_step_keeps_what_grew_most_per_step():
    full = {"a": 100.0, "b": 40.0, "c": 7.0, "only_full": 30.0}
    one = {"a": 10.0, "b": 38.0, "c": 1.0, "only_one": 99.0}
    got = gc._per_step(full, one, steps=3, top=3)
    assert got == [["a", 30.0], ["only_full", 10.0], ["c", 2.0]]


def test_per_step_cuts_long_names():
    got = gc._per_step({"x" * 500: 10.0}, {}, steps=1, top=5)
    assert got == [["x" * 120, 10.0]]


def test_step_profile_counts_the_work_each_extra_token_adds():
    # a unit of work of ~20 ms on CPU, and the least of three calls of each size: the per-step difference must stand
    # clear of a loaded machine's noise (beside another pytest worker one 384x384 add read 0.1-9 ms, so a ~1 ms unit
    # read -1334 µs a step once; a 64x64 product, ~10 µs, read -8.8 µs once before that)
    a = torch.randn(1024, 1024)

    def one_token_of_work() -> None:
        a @ a

    def run(n: int) -> None:  # stands for generate(n): a fixed cost plus one unit of work per new token
        a + a
        for _ in range(n):
            one_token_of_work()

    got = gc.step_profile(run, new=5, top=20, rounds=3)
    ops = dict(got["top_ops"])
    python = dict(got["top_python"])
    assert ops.get("aten::mm", 0) > 0, got["top_ops"]
    assert ops.get("aten::add", 0) < ops["aten::mm"]  # the fixed cost cancels
    assert any(name.endswith(":one_token_of_work") for name in python), got["top_python"]
    assert got["ops_self_us"] > 0
    if not torch.cuda.is_available():
        assert got["gpu_us"] == 0 and got["gpu_activities"] == 0 and got["graph_launches"] == 0


def test_profile_lines_table_and_rows_without_a_profile():
    profile = {"gpu_us": 4800.0, "gpu_activities": 1121.0, "graph_launches": 1.0, "graph_records": 0.0,
               "kernel_launches": 30.0, "ops_self_us": 9000.0, "top_ops": [["cudaGraphLaunch", 1300.0]],
               "top_python": [["graphs.py:137:replay", 500.0]]}
    rows = [{"variant": "cc-ro-moe_fx", "decode_tok_s": 125.0, "profile": profile},
            {"variant": "cc-ro-inductor", "decode_tok_s": 90.0}]
    lines = gc.profile_lines(rows, batch=1)
    table = [line for line in lines if line.startswith("| cc-")]
    assert table == ["| cc-ro-moe_fx | 8000 | 4800.0 | 1121.0 | 1.0 | 0.0 | 30.0 | 9000.0 |"]
    assert "- cc-ro-moe_fx: cudaGraphLaunch 1300.0" in lines
    assert "- cc-ro-moe_fx: graphs.py:137:replay 500.0" in lines
    assert gc.profile_lines(rows[1:], batch=1) == []
