"""Tile configurations: lookup order, decode keys by experts hit, the tuning cache on disk (CPU only)."""

from __future__ import annotations

import functools
import json
from dataclasses import asdict, replace

import pytest
import torch

pytest.importorskip("triton")

from moe_fx.lowering.triton import configs  # noqa: E402
from moe_fx.lowering.triton.configs import TileConfig  # noqa: E402

GPU = torch.device("cuda")  # only named: nothing runs on it


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """An empty tuning cache in tmp_path, a fake GPU name (of no known compute capability), no shipped table."""
    monkeypatch.setenv("MOE_FX_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(configs, "_device_name", lambda device: "FakeGPU")
    monkeypatch.setattr(configs, "_capability", lambda device: None)  # borrows no other GPU's tiles, even on one
    monkeypatch.setattr(configs, "_shipped", lambda: {})
    monkeypatch.setattr(configs, "_memory", {})
    monkeypatch.setattr(configs, "_disk_loaded", None)
    return tmp_path


def _bench_from(times: dict):
    calls = []

    def bench(cfg):
        calls.append(cfg)
        return times.get(cfg, 1.0)

    return bench, calls


def test_tune_caches_on_disk_and_a_second_run_does_not_tune(fresh, monkeypatch):
    cands = configs.candidates("fp8", 256)
    bench, calls = _bench_from({cands[2]: 0.1})
    timings = {}
    best = configs.tune("fp8", 4096, 7168, 300, GPU, bench, timings=timings)
    assert best == cands[2] and len(calls) == len(cands) and timings[cands[2]] == 0.1
    on_disk = json.loads((fresh / "triton_tiles.json").read_text())
    assert on_disk == {"FakeGPU|fp8|N4096|K7168|m512": asdict(cands[2])}
    # a new process (memory and disk state dropped) reads the file and does not benchmark again
    monkeypatch.setattr(configs, "_memory", {})
    monkeypatch.setattr(configs, "_disk_loaded", None)
    bench2, calls2 = _bench_from({})
    assert configs.tune("fp8", 4096, 7168, 300, GPU, bench2) == cands[2] and not calls2
    assert configs.get_config("fp8", 4096, 7168, 300, GPU) == cands[2]
    # force tunes again
    configs.tune("fp8", 4096, 7168, 300, GPU, bench2, force=True)
    assert len(calls2) == len(cands)


def test_failing_candidates_are_skipped(fresh):
    cands = configs.candidates("bf16", 1024)

    def bench(cfg):
        if cfg == cands[0]:
            raise RuntimeError("out of shared memory")
        return 2.0 if cfg == cands[1] else 3.0

    assert configs.tune("bf16", 2048, 768, 1024, GPU, bench) == cands[1]


def test_decode_keys_carry_the_experts_hit(fresh):
    """Decode buckets are tuned per experts-hit bucket; prefill buckets are not."""
    few = TileConfig(16, 32, 128, 1, 4, 4, 4)
    many = TileConfig(16, 64, 128, 1, 4, 4, 2)
    configs.tune("bf16", 1536, 2048, 1, GPU, lambda c: 0.1 if c == few else 1.0, active_groups=2)
    configs.tune("bf16", 1536, 2048, 1, GPU, lambda c: 0.1 if c == many else 1.0, active_groups=128)
    configs._memory.clear()
    assert configs.get_config("bf16", 1536, 2048, 1, GPU, active_groups=2) == few
    assert configs.get_config("bf16", 1536, 2048, 1, GPU, active_groups=128) == many
    # an experts-hit bucket never tuned falls back to the heuristic, not to another bucket's entry
    assert configs.get_config("bf16", 1536, 2048, 1, GPU, active_groups=40) == configs._heuristic(
        "bf16", 1536, 2048, 16, 40
    )
    assert configs._key("X", "bf16", 8, 8, 256, 2) == configs._key("X", "bf16", 8, 8, 256)


def test_lookup_order_memory_user_shipped_heuristic(fresh, monkeypatch):
    shipped = TileConfig(128, 128, 64, 8, 8, 4, 1, tma=True)
    user = TileConfig(64, 256, 64, 8, 4, 4, 1, tma=True)
    monkeypatch.setattr(configs, "_shipped", lambda: {"FakeGPU|bf16|N64|K64|m256": asdict(shipped)})
    assert configs.get_config("bf16", 64, 64, 200, GPU) == shipped
    assert configs.get_config("bf16", 64, 32, 200, GPU) == configs._heuristic("bf16", 64, 32, 256)
    # entries written by an older moe_fx (no tma field) or a newer one (unknown fields) still load
    old = {k: v for k, v in asdict(user).items() if k != "tma"}
    (fresh / "triton_tiles.json").write_text(json.dumps({"FakeGPU|bf16|N64|K64|m256": {**old, "future": 1}}))
    monkeypatch.setattr(configs, "_memory", {})
    monkeypatch.setattr(configs, "_disk_loaded", None)
    assert configs.get_config("bf16", 64, 64, 200, GPU) == TileConfig(**old)


def test_unreadable_cache_is_ignored_with_a_warning(fresh, caplog):
    (fresh / "triton_tiles.json").write_text("{not json")
    with caplog.at_level("WARNING", logger="moe_fx.lowering.triton"):
        cfg = configs.get_config("fp8", 512, 512, 4096, GPU)
    assert cfg == configs._heuristic("fp8", 512, 512, 4096)
    assert "unreadable tile cache" in caplog.text


def test_candidates_fit_shared_memory():
    """Every candidate fits Hopper's shared memory per SM at its programs per SM (:func:`configs.programs_that_fit`)."""
    for kind in ("bf16", "fp8"):
        for bucket in (16, 32, 64, 128, 256, 4096):
            for cfg in configs.candidates(kind, bucket):
                assert configs.programs_that_fit(cfg.smem_bytes(1 if kind == "fp8" else 2)) >= cfg.programs_per_sm, (
                    kind, cfg)


def test_every_shipped_entry_is_a_tile_that_fits_under_a_well_formed_key():
    """The shipped table (hand-merged at times from a device run's cache) holds only keys of :func:`configs.regime_key`'s
    form or the masked layout's bucket keys, and tiles the kernels can launch: fields of a TileConfig, powers of two, fp8
    k steps inside one 128-deep scale group, at least one program's tiles in an SM's shared memory."""
    import re

    shipped = configs._shipped()
    assert len(shipped) > 100
    sorted_key = re.compile(r"^[^|]+\|(bf16|fp8)\|N\d+\|K\d+\|sorted\|r[0-4](\|s\d+)?$")
    bucket_key = re.compile(r"^[^|]+\|(bf16|fp8)\|N\d+\|K\d+\|m\d+(\|g\d+|\|ptr)?$")  # the masked layout's
    seen_sorted = 0
    for key, fields in shipped.items():
        cfg = TileConfig(**fields)  # unknown or missing fields raise
        kind = key.split("|")[1]
        assert kind in ("bf16", "fp8"), key
        for v in (cfg.block_m, cfg.block_n, cfg.block_k):
            assert v >= 16 and v & (v - 1) == 0, key
        assert cfg.num_warps in (4, 8) and 2 <= cfg.num_stages <= 6 and cfg.programs_per_sm >= 1, key
        if kind == "fp8":
            assert 128 % cfg.block_k == 0, key
        assert configs.programs_that_fit(cfg.smem_bytes(1 if kind == "fp8" else 2)) >= 1, key
        if "|sorted|" in key:
            assert sorted_key.match(key), key
            seen_sorted += 1
        else:
            assert bucket_key.match(key), key
    assert seen_sorted > 100
    # both tuned GPUs have prefill entries of Qwen3-30B-A3B's GEMM1 in both prefill regimes
    for gpu in ("NVIDIA H200", "NVIDIA H100 80GB HBM3"):
        for regime in (3, 4):
            assert configs.regime_key(gpu, "bf16", 1536, 2048, "sorted", regime) in shipped


def test_fit_smem_shrinks_fp32_tiles():
    """A bf16 table entry serving fp32 operands is cut to fit shared memory (fewer stages, then a shorter k step)."""
    big = TileConfig(128, 256, 64, 8, 8, 3, 1, tma=True)
    assert configs.fit_smem(big, 2) == big
    fitted = configs.fit_smem(big, 4)
    assert fitted.smem_bytes(4) <= configs.SMEM_BUDGET
    assert (fitted.block_m, fitted.block_n, fitted.tma) == (128, 256, True) and fitted.num_stages >= 2
    # what triton 3.6 asked for on an H200 with fp32 operands at 2 stages (240 KB): over the budget, so cut again
    assert replace(big, num_stages=2).smem_bytes(4) == 245760
    four = configs.fit_smem(TileConfig(128, 256, 64, 8, 8, 4, 1, tma=True), 4)
    assert four.smem_bytes(4) <= configs.SMEM_BUDGET and four.block_k == 32


def test_pick_regime_config_takes_the_best_worst_case():
    a, b, c = TileConfig(16, 64, 128), TileConfig(32, 64, 128), TileConfig(64, 128, 64)
    # a is best at small T but falls off a cliff at the regime's top; b is never best but never far off
    timings = {8: {a: 1.0, b: 1.05, c: 1.5}, 16: {a: 1.0, b: 1.04, c: 1.3}, 24: {a: 1.8, b: 1.1, c: 1.0}}
    cfg, worst = configs.pick_regime_config(timings)
    assert cfg == b and worst == pytest.approx(1.1)
    # a candidate not timed at every T cannot win
    cfg, _ = configs.pick_regime_config({8: {a: 1.0, b: 2.0}, 16: {b: 1.0}})
    assert cfg == b
    with pytest.raises(ValueError):
        configs.pick_regime_config({})


def test_regime_entries_win_and_symbolic_counts_never_read_their_hint(fresh):
    entry = TileConfig(64, 128, 64, 4, 4, 4, 1, tma=True)
    configs.store({configs.regime_key("FakeGPU", "bf16", 1536, 2048, "sorted", 2): entry})
    for hint in (20, 64, 4000):  # any hint: the regime's entry
        got = configs.get_config("bf16", 1536, 2048, hint, GPU, layout="sorted", regime=2, symbolic=True,
                                 allow_tma=False)
        assert got == entry  # the sorted layout keeps its (device-made) descriptors in compiled graphs
    # masked layout, symbolic T: the regime's bucket (the hint is ignored), pointer tiles when traced
    assert configs.regime_bucket(2) == 64 and configs.regime_bucket(4) == configs.m_bucket(1028)
    a = configs.get_config("bf16", 4096, 4096, 20, GPU, regime=3, symbolic=True, allow_tma=False)
    b = configs.get_config("bf16", 4096, 4096, 4000, GPU, regime=3, symbolic=True, allow_tma=False)
    assert a == b and not a.tma


def test_regime_candidates_fit_and_cover_uneven_loads():
    for kind in ("bf16", "fp8"):
        for regime in range(5):
            cands = configs.regime_candidates(kind, regime)
            assert len(set(cands)) == len(cands) >= 2
            assert all(c.smem_bytes(1 if kind == "fp8" else 2) <= configs.SMEM_BUDGET for c in cands)
            # the programs of a persistent grid are resident side by side
            assert all(configs.programs_that_fit(c.smem_bytes(1 if kind == "fp8" else 2)) >= c.programs_per_sm
                       for c in cands), (kind, regime)
            if kind == "fp8":
                assert all(128 % c.block_k == 0 for c in cands)
        # a regime of up to 16 expected rows also tries 32-row tiles (real loads exceed the mean)
        assert any(c.block_m >= 32 for c in configs.regime_candidates(kind, 1))


def test_programs_that_fit_are_the_hoppers_shared_memory():
    """One SM's 228 KB less CUDA's 1 KB a block and Triton's barriers: the 4-stage flattened 128x256x64 bf16 tile
    (229408 bytes compiled, the H100's fastest prefill tile) fits alone and is kept whole by fit_smem; two 112 KB
    programs fit, two 113 KB ones do not."""
    assert configs.SMEM_BUDGET == configs.SM_SMEM - configs.BLOCK_RESERVED_SMEM - configs.SMEM_MARGIN
    flat4 = TileConfig(128, 256, 64, 8, 8, 4, 1, tma=True, flatten=True)
    assert flat4.smem_bytes(2) == 229376 and configs.programs_that_fit(flat4.smem_bytes(2)) == 1
    assert configs.fit_smem(flat4, 2) == flat4
    assert configs.programs_that_fit(227 * 1024) == 0 and configs.fit_smem(flat4, 4).num_stages < 4
    assert configs.programs_that_fit(112 * 1024) == 2 and configs.programs_that_fit(113 * 1024) == 1
    assert configs.resident_programs(TileConfig(128, 256, 64, 8, 8, 4, 2, tma=True), 2) == 1


def test_resident_programs_count_the_launched_tiles():
    swapped = TileConfig(16, 64, 128, 1, 4, 4, 2, swap_ab=True)
    assert configs.resident_programs(swapped, 2) == 2  # 80 KB each
    assert configs.resident_programs(swapped, 2, b_tiles=2) == 1  # gate and up tiles: 147 KB each
    assert configs.resident_programs(TileConfig(16, 64, 64, 1, 4, 4, 2, swap_ab=True), 2, b_tiles=2) == 2
    assert configs.resident_programs(TileConfig(128, 256, 64, 8, 8, 3, 1), 4) == 1  # never below one
    assert configs.resident_programs(TileConfig(16, 32, 128, 1, 4, 5, 4), 1) == 4


def test_untuned_shape_takes_the_nearest_tuned_shapes_regime_entry(fresh, monkeypatch):
    near, far, other_regime = TileConfig(16, 128, 128, 1, 4, 3, 3), TileConfig(32, 64, 128), TileConfig(128, 256, 64)
    fp8_only = TileConfig(16, 32, 128, 1, 4, 5, 4)
    shipped = {
        configs.regime_key("FakeGPU", "bf16", 1536, 2048, "sorted", 0): asdict(near),  # Qwen3's GEMM1
        configs.regime_key("FakeGPU", "bf16", 28672, 4096, "sorted", 0): asdict(far),  # Mixtral's
        configs.regime_key("FakeGPU", "bf16", 2048, 2048, "sorted", 3): asdict(other_regime),
        configs.regime_key("FakeGPU", "fp8", 2048, 2048, "sorted", 0): asdict(fp8_only),
        configs.regime_key("OtherGPU", "bf16", 2048, 2048, "sorted", 0): asdict(far),
    }
    monkeypatch.setattr(configs, "_shipped", lambda: shipped)
    # OLMoE's GEMM1 (2048 x 2048): no entry of its own; Qwen3's is nearest (same K, N 1536 against 2048)
    assert configs.get_config("bf16", 2048, 2048, 1, GPU, layout="sorted", regime=0, symbolic=True) == near
    # another regime, another kind: their own nearest entries; never another device's
    assert configs.get_config("bf16", 2048, 2048, 300, GPU, layout="sorted", regime=3, symbolic=True) == other_regime
    assert configs.get_config("fp8", 2048, 1024, 1, GPU, layout="sorted", regime=0, symbolic=True) == fp8_only
    # W8A16 streams fp8 weights: with no bf16-activation entry it takes the fp8 one
    assert configs.get_config("w8a16", 2048, 2048, 1, GPU, layout="sorted", regime=0, symbolic=True) == fp8_only
    # a shape far from every tuned one (a tiny test layer): the heuristic, not a 2048-wide GEMM's tile
    tiny = configs._heuristic("bf16", 128, 64, configs.regime_bucket(0))
    assert configs.get_config("bf16", 128, 64, 4, GPU, layout="sorted", regime=0, symbolic=True) == tiny
    # the tables' other keys (rows buckets) are no regime entries
    assert configs._regime_key_fields(configs.regime_key("G", "fp8", 1536, 2048, "sorted", 3, 8)) == (
        "G", "fp8", 1536, 2048, "sorted", 3, 8)
    assert all(configs._regime_key_fields(configs._key("G", "bf16", 2048, 2048, 16, 8, ptr=ptr)) is None
               for ptr in (False, True))
    # a regime nobody tuned on this device: the heuristic
    heuristic = configs._heuristic("bf16", 2048, 2048, configs.regime_bucket(1))
    assert configs.get_config("bf16", 2048, 2048, 10, GPU, layout="sorted", regime=1, symbolic=True) == heuristic
    # the user's own tuning counts as one more tuned shape: the nearest wins, wherever it is
    mine, closer = TileConfig(16, 64, 64, 1, 4, 4, 4), TileConfig(16, 64, 128, 1, 4, 4, 2, swap_ab=True)
    configs.store({configs.regime_key("FakeGPU", "bf16", 4096, 4096, "sorted", 0): mine})
    assert configs.get_config("bf16", 2048, 2048, 2, GPU, layout="sorted", regime=0, symbolic=True) == near
    configs.store({configs.regime_key("FakeGPU", "bf16", 2048, 2560, "sorted", 0): closer})
    assert configs.get_config("bf16", 2048, 2048, 3, GPU, layout="sorted", regime=0, symbolic=True) == closer


def test_a_gpu_without_tiles_borrows_those_of_its_compute_capabilitys_tuned_gpu(fresh, monkeypatch):
    """Exact entries of this GPU, then the TUNED_DEVICE of its compute capability's, then the nearest tuned shape
    on this GPU, then on that one; a GPU of another capability borrows nothing."""
    h200, own, near_own, near_h200 = (TileConfig(128, 256, 64, 8, 8, 3, 1), TileConfig(64, 128, 64),
                                      TileConfig(32, 64, 128), TileConfig(16, 128, 128, 1, 4, 3, 3))
    shipped = {
        configs.regime_key("NVIDIA H200", "bf16", 1536, 2048, "sorted", 3): asdict(h200),
        configs.regime_key("NVIDIA H200", "bf16", 4096, 4096, "sorted", 3): asdict(near_h200),
        configs.regime_key("FakeGPU", "bf16", 2048, 2048, "sorted", 3): asdict(near_own),
    }
    monkeypatch.setattr(configs, "_shipped", lambda: shipped)
    monkeypatch.setattr(configs, "_capability", lambda device: (9, 0))
    assert configs.tile_devices("FakeGPU", (9, 0)) == ("FakeGPU", "NVIDIA H200")
    assert configs.tile_devices("NVIDIA H200", (9, 0)) == ("NVIDIA H200",)
    assert configs.tile_devices("FakeGPU", (8, 0)) == configs.tile_devices("FakeGPU", None) == ("FakeGPU",)
    kw = {"layout": "sorted", "regime": 3, "symbolic": True}
    # the H200's exact entry beats this GPU's nearest shape
    assert configs.get_config("bf16", 1536, 2048, 300, GPU, **kw) == h200
    # no exact entry anywhere: this GPU's nearest shape (2048x2048) before the H200's (4096x4096)
    assert configs.get_config("bf16", 2048, 4096, 300, GPU, **kw) == near_own
    # nothing near on this GPU: the H200's nearest shape
    assert configs.get_config("bf16", 8192, 4096, 300, GPU, **kw) == near_h200
    # this GPU's own entry, once tuned, wins
    configs.store({configs.regime_key("FakeGPU", "bf16", 1536, 2048, "sorted", 3): own})
    assert configs.get_config("bf16", 1536, 2048, 301, GPU, **kw) == own
    # another compute capability: the nearest shape of its own, never the H200's tiles
    monkeypatch.setattr(configs, "_capability", lambda device: (8, 0))
    monkeypatch.setattr(configs, "_memory", {})
    assert configs.get_config("bf16", 8192, 4096, 300, GPU, **kw) == configs._heuristic(
        "bf16", 8192, 4096, configs.regime_bucket(3))


def test_static_sizes_take_their_own_tile_and_dynamic_ones_the_regimes(fresh):
    regime_tile, one_token = TileConfig(16, 128, 128, 1, 4, 3, 3, swap_ab=True), TileConfig(16, 64, 128, 1, 4, 5, 2)
    configs.store({configs.regime_key("FakeGPU", "fp8", 1536, 2048, "sorted", 0): regime_tile,
                   configs.regime_key("FakeGPU", "fp8", 1536, 2048, "sorted", 0, slots=8): one_token})
    kw = {"layout": "sorted", "regime": 0}
    assert configs.get_config("fp8", 1536, 2048, 1, GPU, slots=8, **kw) == one_token  # T=1, K=8: specialised
    assert configs.get_config("fp8", 1536, 2048, 1, GPU, slots=16, **kw) == regime_tile  # no entry of its own
    assert configs.get_config("fp8", 1536, 2048, 1, GPU, **kw) == regime_tile
    # a symbolic token count never reads a size-specific entry (its hint is only the traced size)
    assert configs.get_config("fp8", 1536, 2048, 1, GPU, slots=8, symbolic=True, **kw) == regime_tile
    # W8A16 streams the fp8 weights: the fp8 entry of its size
    assert configs.get_config("w8a16", 1536, 2048, 1, GPU, slots=8, **kw) == one_token


def test_tune_report_labels_name_every_field():
    from helpers import load_bench

    tune = load_bench("tune_tiles")
    for regime in range(5):
        for kind in ("bf16", "fp8"):
            for cfg in configs.regime_candidates(kind, regime):
                assert tune.parse_tile(tune._tile(cfg)) == cfg
    rows = [{"shape": "qwen3", "kind": "fp8", "N": 1536, "K": 2048, "regime": 0, "T": t, "best": best,
             "best_us": 9.3, "chosen_us": chosen} for t, best, chosen in ((1, "16x64x128/4/5/2+swap", 10.7),
                                                                         (2, "16x64x128/4/4/4/g4+tma", 9.5))]
    got = tune.slot_entries(rows, "FakeGPU")  # only T=1 loses more than the margin; Qwen3 has K=8
    assert got == {configs.regime_key("FakeGPU", "fp8", 1536, 2048, "sorted", 0, 8):
                   TileConfig(16, 64, 128, 1, 4, 5, 2, swap_ab=True)}


def test_a_retune_drops_the_static_size_entries_it_timed_again():
    from helpers import load_bench

    tune = load_bench("tune_tiles")
    key = functools.partial(configs.regime_key, "FakeGPU", "fp8", 1536, 2048, "sorted", 0)
    old_regime, old_t1, old_t2, other = (TileConfig(16, 64, 128), TileConfig(16, 128, 128, 1, 4, 3, 3),
                                         TileConfig(16, 32, 128), TileConfig(32, 64, 128))
    shipped = {key(): asdict(old_regime), key(8): asdict(old_t1), key(16): asdict(old_t2),
               configs.regime_key("FakeGPU", "bf16", 1536, 2048, "sorted", 0, 8): asdict(other)}
    new_regime = TileConfig(16, 64, 128, 1, 4, 4, 4, swap_ab=True, flatten=True)
    # this run timed Qwen3 (K=8) at T=1 only, where its regime tile is now within the margin of the best
    rows = [{"shape": "qwen3", "kind": "fp8", "N": 1536, "K": 2048, "regime": 0, "T": 1, "best": tune._tile(new_regime),
             "best_us": 9.3, "chosen": tune._tile(new_regime), "chosen_us": 9.3}]
    entries = {key(): new_regime, **tune.slot_entries(rows, "FakeGPU")}
    got = tune.merge_shipped(shipped, entries, rows, "FakeGPU")
    assert got[key()] == asdict(new_regime)
    assert key(8) not in got  # timed again, no longer an exception
    assert got[key(16)] == asdict(old_t2)  # T=2 was not timed: kept
    assert configs.regime_key("FakeGPU", "bf16", 1536, 2048, "sorted", 0, 8) in got  # another kind: kept
    assert shipped[key(8)] == asdict(old_t1)  # the input is not changed


@pytest.mark.parametrize("family", ["custom", "gpt_oss"])
def test_tuning_times_gemm1_as_the_pipeline_runs_it(family, monkeypatch):
    """Where the pipeline applies the activation in GEMM1's epilogue, --sorted times that GEMM (a swapped tile then
    loads two weight tiles per k step): the cell's output is the activation of the product, on CPU here."""
    from helpers import load_bench

    from moe_fx.lowering.masked_experts import pipeline
    from moe_fx.lowering.problem import row_regime

    tune = load_bench("tune_tiles")
    monkeypatch.setattr(pipeline, "FUSE_HALVES_MAX_ROWS", 64)  # a bound, so that halves have an unfused regime
    monkeypatch.setattr(tune, "DEVICE", "cpu")
    monkeypatch.setitem(tune.SHAPES, "tiny", (family, 4, 2, 128, 64))
    halves = family == "custom"
    assert tune.epilogue_activation("tiny", "fp8", 0) is None  # fp8: the activation kernel quantises for GEMM2
    top = row_regime(pipeline.FUSE_HALVES_MAX_ROWS + 1)
    assert (tune.epilogue_activation("tiny", "bf16", top) is None) == halves  # halves: unfused above the bound
    spec = tune.epilogue_activation("tiny", "bf16", 0)
    assert spec is not None and spec.gate_up_layout == ("halves" if halves else "interleaved")
    cache: dict = {}
    run, n, k, regime, _ = tune._sorted_cell("tiny", 5, "bf16", 1, cache)
    assert (n, k, regime) == (128, 128, 0)
    assert "fp8" not in cache  # fp8 weights only when a cell asks for them (a worker's memory)
    out = run(TileConfig(16, 64, 64, 1, 4, 1, 1)).float()
    assert out.shape == (1, 10, 64)
    rows, x, (w13, *_) = cache["rows"], cache["x"].float(), cache["bf16"]
    ref = spec.apply(torch.einsum("sh,snh->sn", x.repeat_interleave(2, 0), w13.float()[cache["ids"].flatten()]))
    pos = rows.slot_pos.long()
    assert torch.allclose(out[0, pos], ref, rtol=3e-2, atol=3e-2), (out[0, pos] - ref).abs().max()
    run2, n2, k2, _, _ = tune._sorted_cell("tiny", 5, "bf16", 2, cache)  # GEMM2: no epilogue
    assert (n2, k2) == (128, 64) and run2(TileConfig(16, 64, 64, 1, 4, 1, 1)).shape == (1, 10, 128)
    # one token: the rows the pipeline runs are in slot order (no sort)
    run1, *_ = tune._sorted_cell("tiny", 1, "bf16", 1, cache)
    one = run1(TileConfig(16, 64, 64, 1, 4, 1, 1)).float()
    ref1 = spec.apply(torch.einsum("h,snh->sn", cache["x"].float()[0], w13.float()[cache["ids"][0]]))
    assert torch.allclose(one[0], ref1, rtol=3e-2, atol=3e-2)


def test_tune_takes_a_users_layer_shape():
    import argparse

    from helpers import load_bench

    tune = load_bench("tune_tiles")
    assert tune.parse_shape("mine=64,8,2048,1408") == ("mine", ("custom", 64, 8, 2048, 1408))
    for bad in ("mine=64,8,2048", "=64,8,2048,1408", "mine=8,64,2048,1408", "mine=64,8,2048,x"):
        with pytest.raises(argparse.ArgumentTypeError):
            tune.parse_shape(bad)
