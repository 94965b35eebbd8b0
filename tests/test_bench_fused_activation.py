"""bench/fused_activation.py end to end on CPU (--smoke: tiny qwen3 and gpt_oss forms under the interpreter)."""

from __future__ import annotations

import json

import pytest
from helpers import load_bench

pytest.importorskip("triton")


def test_smoke_writes_rows_with_both_variants_close_to_the_reference(tmp_path):
    mod = load_bench("fused_activation")
    mod.main(["--smoke", "--tokens", "3", "--out", str(tmp_path), "--tag", "t"])
    (json_path,) = tmp_path.glob("fused_activation_*_t.json")
    rows = json.loads(json_path.read_text())["rows"]
    assert [(r["shape"], r["T"]) for r in rows] == [("qwen3", 3), ("gpt_oss", 3)]
    for r in rows:
        assert r["fused_us"] > 0 and r["unfused_us"] > 0
        # bf16 weights against the fp32 reference; the fused variant keeps GEMM1's product in fp32
        assert r["ref_err_fused"] < 3e-2 and r["ref_err_unfused"] < 3e-2, r
        assert r["fused_vs_unfused_err"] < 3e-2, r
    md = json_path.with_suffix(".md").read_text()
    assert "| qwen3 | 3 |" in md and "| gpt_oss | 3 |" in md
