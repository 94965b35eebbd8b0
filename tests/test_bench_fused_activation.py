"""bench/fused_activation.py end to end on CPU (--smoke: tiny qwen3 and gpt_oss forms under the interpreter),
for each pipeline switch it times (the activation epilogue; bf16 activations with fp8 weights; fp8 scales
loaded a step ahead; the switch of the decode sort's bitonic network), and that every switch names real constants."""

from __future__ import annotations

import json

import pytest
from helpers import load_bench

pytest.importorskip("triton")


@pytest.mark.parametrize("switch,stem,bound,tokens", [("epilogue", "fused_activation", 3e-2, 3),
                                                       ("w8a16", "w8a16", 8e-2, 3), ("fp8_scales", "fp8_scales", 8e-2, 3),
                                                       ("slot_rows", "slot_rows", 3e-2, 1),
                                                       ("pair_halves", "pair_halves", 3e-2, 3),
                                                       ("bitonic_sort", "bitonic_sort", 3e-2, 3)])
def test_smoke_writes_rows_with_both_variants_close_to_the_reference(tmp_path, switch, stem, bound, tokens):
    mod = load_bench("fused_activation")
    mod.main(["--smoke", "--switch", switch, "--tokens", str(tokens), "--out", str(tmp_path), "--tag", "t"])
    (json_path,) = tmp_path.glob(f"{stem}_*_t.json")
    data = json.loads(json_path.read_text())
    assert data["meta"]["switch"] == switch
    rows = data["rows"]
    assert [(r["shape"], r["T"]) for r in rows] == [("qwen3", tokens), ("gpt_oss", tokens)]
    for r in rows:
        assert r["on_us"] > 0 and r["off_us"] > 0
        # against the fp32 reference: bf16 weights (the fused variant keeps GEMM1's product in fp32); fp8 weights
        # (the quantised variant rounds its activations to e4m3)
        assert r["ref_err_on"] < bound and r["ref_err_off"] < bound, r
        assert r["on_vs_off_err"] < bound, r
    if switch == "w8a16":  # the variants differ in what they round: W8A16 keeps the activations in bf16
        assert all(r["ref_err_on"] < r["ref_err_off"] for r in rows), rows
    # when the scales load / where the rows are / how they were sorted (the same rows), not what is computed
    if switch in ("fp8_scales", "slot_rows", "bitonic_sort"):
        assert all(r["on_vs_off_err"] == 0.0 for r in rows), rows
    md = json_path.with_suffix(".md").read_text()
    assert f"| qwen3 | {tokens} |" in md and f"| gpt_oss | {tokens} |" in md


def test_every_switch_names_constants_the_lowering_has():
    """Each switch names a module attribute under moe_fx.lowering that exists, with its 'on' value of the constant's
    type: a typo would otherwise surface only on the GPU (the smoke runs above cover a few of the switches end to
    end)."""
    import importlib

    mod = load_bench("fused_activation")
    for name, (path, value, *_) in mod.SWITCHES.items():
        module, attr = path.rsplit(".", 1)
        current = getattr(importlib.import_module(f"moe_fx.lowering.{module}"), attr)
        assert type(current) is type(value), (name, path, current, value)


def test_deepgemm_switches_run_the_ops_choice_and_stop_without_deepgemm(tmp_path):
    """The DeepGEMM switches time the op under kernel_choice="auto"; where DeepGEMM is not usable (here: no GPU) the
    run stops and says why, instead of timing Triton's path twice, where the switch changes nothing."""
    mod = load_bench("fused_activation")
    assert [s for s in mod.SWITCHES if mod.kernel_choice_of(s) == "auto"] == ["scale_scratch", "dg_hint"]
    assert mod.kernel_choice_of("epilogue") == "triton"
    for switch in mod.DEEPGEMM_SWITCHES:
        assert mod.SWITCHES[switch][3]  # fp8 weights: DeepGEMM's path under auto on one GPU
        with pytest.raises(SystemExit, match=f"--switch {switch} acts on DeepGEMM's path"):
            mod.main(["--smoke", "--switch", switch, "--out", str(tmp_path)])
    assert not list(tmp_path.iterdir())


def test_settings_apply_to_both_sides_and_are_written(tmp_path, monkeypatch):
    """``--switch slot_down`` with ``--set`` (what the slot_down recipe sweeps tiles with): the constant holds for the
    run, both sides match the reference and each other, and the results say what was set."""
    from moe_fx.lowering.triton import grouped_gemm

    monkeypatch.setattr(grouped_gemm, "SLOT_DOWN_TILE", grouped_gemm.SLOT_DOWN_TILE)  # restored after the test
    tile = {"block_n": 32, "block_k": 64, "num_warps": 4, "num_stages": 2}
    mod = load_bench("fused_activation")
    mod.main(["--smoke", "--switch", "slot_down", "--tokens", "1", "--out", str(tmp_path), "--tag", "s",
              "--set", f"triton.grouped_gemm.SLOT_DOWN_TILE={tile!r}"])
    assert grouped_gemm.SLOT_DOWN_TILE == tile
    (json_path,) = tmp_path.glob("slot_down_*_s.json")
    data = json.loads(json_path.read_text())
    assert data["meta"]["settings"] == {"triton.grouped_gemm.SLOT_DOWN_TILE": tile}
    assert [(r["shape"], r["T"]) for r in data["rows"]] == [("qwen3", 1), ("gpt_oss", 1)]
    for r in data["rows"]:
        assert r["on_us"] > 0 and r["off_us"] > 0
        assert r["ref_err_on"] < 3e-2 and r["ref_err_off"] < 3e-2 and r["on_vs_off_err"] < 3e-2, r
    assert "Both sides: `triton.grouped_gemm.SLOT_DOWN_TILE`" in json_path.with_suffix(".md").read_text()
    with pytest.raises(AttributeError, match="SLOT_DOWN_TILES"):
        mod.main(["--smoke", "--switch", "slot_down", "--out", str(tmp_path), "--set",
                  "triton.grouped_gemm.SLOT_DOWN_TILES={}"])
