"""bench/layouts.py end to end on CPU (--smoke: a tiny Qwen3 form under the interpreter)."""

from __future__ import annotations

import json

import pytest
from helpers import load_bench

pytest.importorskip("triton")


def test_smoke_times_the_runnable_pairs_and_says_why_the_others_cannot_run(tmp_path):
    load_bench("layouts").main(["--smoke", "--out", str(tmp_path), "--tag", "t"])
    (json_path,) = tmp_path.glob("layouts_*_t.json")
    (row,) = json.loads(json_path.read_text())["rows"]
    assert set(row["us"]) == {"triton/local_sorted", "triton/local_permute"}
    assert all(v > 0 for v in row["us"].values())
    assert max(row["rel_err"].values()) < 3e-2  # bf16 against the fp32 reference
    assert "no aligned contiguous layout" in row["cannot_run"]["triton/local_contiguous"]
    assert all("needs a CUDA GPU" in row["cannot_run"][f"deepgemm/{lay}"]
               for lay in ("local_sorted", "local_contiguous", "local_permute"))
    md = json_path.with_suffix(".md").read_text()
    assert "| qwen3 | bf16 | 8 |" in md and "deepgemm/local_contiguous" in md
