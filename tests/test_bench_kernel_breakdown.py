"""bench/kernel_breakdown.py's pure parts: per-launch means from a profile of identical replays, GEMM floors, the
lowering constants a run sets."""

from __future__ import annotations

import pytest
from helpers import load_bench


@pytest.fixture(scope="module")
def mod():
    pytest.importorskip("transformers")  # moe_layer's machine_meta
    return load_bench("kernel_breakdown")


def _replay(t0: float, gemm1: float) -> list[tuple[str, float, float]]:
    return [("sort_small_kernel", t0, t0 + 2.0), ("masked_gemm_kernel", t0 + 3.0, t0 + 3.0 + gemm1),
            ("masked_gemm_kernel", t0 + 20.0, t0 + 28.0), ("void unpermute_kernel<int>(float*)", t0 + 29.0, t0 + 31.0)]


def test_per_launch_means_keep_launch_order_and_tell_the_two_gemms_apart(mod):
    events = _replay(100.0, 12.0) + _replay(0.0, 14.0)  # out of order, as a profile may list them
    got = mod.per_launch_us(events, 2)
    assert [n for n, _ in got] == ["sort_small_kernel", "masked_gemm_kernel", "masked_gemm_kernel",
                                   "void unpermute_kernel<int>(float*)"]
    assert [d for _, d in got] == pytest.approx([2.0, 13.0, 8.0, 2.0])


def test_per_launch_refuses_events_that_are_not_identical_replays(mod):
    with pytest.raises(ValueError, match="not 2 replays"):
        mod.per_launch_us(_replay(0.0, 1.0)[:3], 2)
    other = _replay(100.0, 1.0)
    other[0] = ("sort_slots_kernel", 100.0, 101.0)
    with pytest.raises(ValueError, match="different kernel sequences"):
        mod.per_launch_us(_replay(0.0, 1.0) + other, 2)


def test_graph_kernels_profile_every_set_in_the_timed_rotation(mod):
    """One graph per routing set, replayed in rotation ``PROFILED_REPLAYS`` times: each kernel's time is its mean
    over the sets and rotations, names shortened, launch order kept; graphs whose launches differ give the first
    graph's kernels alone."""

    class Graph:
        def __init__(self, gemm_us, gemm="gemm1"):
            self.gemm_us, self.gemm, self.replays = gemm_us, gemm, 0

        def replay(self):
            self.replays += 1

    def profiler(graphs):
        def profile(step):  # what the profiler records: each replay's two kernels, back to back
            events, clock = [], 0.0
            for _ in range(mod.PROFILED_REPLAYS):
                before = [g.replays for g in graphs]
                step()
                for g, b in zip(graphs, before):
                    for _ in range(g.replays - b):
                        events += [("void sort<int>(int*)", clock, clock + 2.0),
                                   (g.gemm, clock + 2.0, clock + 2.0 + g.gemm_us)]
                        clock += 100.0
            return events

        return profile

    graphs = [Graph(10.0), Graph(20.0), Graph(30.0)]
    assert mod.graph_kernels(graphs, profile=profiler(graphs)) == [("sort", pytest.approx(2.0)),
                                                                   ("gemm1", pytest.approx(20.0))]
    assert [g.replays for g in graphs] == [mod.PROFILED_REPLAYS] * 3
    differing = [Graph(10.0), Graph(20.0), Graph(30.0, gemm="gemm1_other")]
    assert mod.graph_kernels(differing, profile=profiler(differing)) == [("sort", pytest.approx(2.0)),
                                                                         ("gemm1", pytest.approx(10.0))]


def test_gemm_floors_and_short_names(mod):
    # Qwen3-30B-A3B, T=1: 8 experts hit, bf16; 4 TB/s
    g1, g2 = mod.gemm_floors_us(8, 2048, 768, False, 4.0)
    assert g1 == pytest.approx(8 * 1536 * 2048 * 2 / 4e6) and g2 == pytest.approx(g1 / 2)
    assert mod.gemm_floors_us(8, 2048, 768, True, 4.0)[0] == pytest.approx(g1 / 2)
    assert mod.short("void at::native::vectorized_elementwise_kernel<4, at::native::Fill>(int, float)") == \
        "vectorized_elementwise_kernel"
    assert mod.short("masked_gemm_kernel") == "masked_gemm_kernel"


def test_two_pass_sort_context_gives_the_same_rows_through_the_other_branch(mod, monkeypatch):
    """--sort-ab's other side: inside the context the decode sort launches with PAIRWISE=False (the two passes)
    and yields the same stable rows as the pairwise branch; the real launcher is back afterwards."""
    import torch

    from moe_fx.lowering.triton import sort as sort_mod

    seen = []
    real = sort_mod.launch
    monkeypatch.setattr(sort_mod, "launch", lambda name, *a, **kw: (seen.append((name, kw.get("PAIRWISE"))),
                                                                   real(name, *a, **kw))[1])
    ids = torch.tensor([[3, 1], [1, -1], [0, 3], [2, 2]], dtype=torch.int32)
    new = sort_mod.sort_by_expert(ids, 4, small=True)
    with mod.two_pass_sort():
        old = sort_mod.sort_by_expert(ids, 4, small=True)
    assert seen == [("sort_small_kernel", None), ("sort_small_kernel", False)]
    assert sort_mod.launch.__name__ == "<lambda>"  # restored to what it was before the context
    for a, b in ((new.counts, old.counts), (new.sorted_slots[:7], old.sorted_slots[:7]), (new.slot_pos, old.slot_pos)):
        assert torch.equal(a, b)
    assert old.sorted_slots[:7].tolist() == [4, 1, 2, 6, 7, 0, 5]


def test_settings_change_the_lowering_constants_and_refuse_typos(mod, monkeypatch):
    from moe_fx.lowering.masked_experts import pipeline

    monkeypatch.setattr(pipeline, "FUSE_ACTIVATION", True)  # restored after the test
    monkeypatch.setattr(pipeline, "SLOT_ROWS_MAX_TOKENS", 1)
    got = mod.apply_settings(["masked_experts.pipeline.FUSE_ACTIVATION=False",
                              " masked_experts.pipeline.SLOT_ROWS_MAX_TOKENS = 4"])
    assert got == {"masked_experts.pipeline.FUSE_ACTIVATION": False, "masked_experts.pipeline.SLOT_ROWS_MAX_TOKENS": 4}
    assert pipeline.FUSE_ACTIVATION is False and pipeline.SLOT_ROWS_MAX_TOKENS == 4
    with pytest.raises(AttributeError, match="SLOT_ROWS_MAX_TOKEN"):
        mod.apply_settings(["masked_experts.pipeline.SLOT_ROWS_MAX_TOKEN=4"])
    with pytest.raises(ValueError, match="module.ATTR=value"):
        mod.apply_settings(["SLOT_ROWS_MAX_TOKENS"])
    # a full moe_fx module name reaches constants outside moe_fx.lowering (the backend's)
    from moe_fx import backend

    monkeypatch.setattr(backend, "STATIC_LAUNCH_KERNELS", False)
    assert mod.apply_settings(["moe_fx.backend.STATIC_LAUNCH_KERNELS=True"]) == {"moe_fx.backend.STATIC_LAUNCH_KERNELS": True}
    assert backend.STATIC_LAUNCH_KERNELS is True
    with pytest.raises(AttributeError, match="moe_fx.backend has no STATIC_LAUNCH"):
        mod.apply_settings(["moe_fx.backend.STATIC_LAUNCH=True"])
    assert mod.qualified_setting("masked_experts.pipeline.FUSE_ACTIVATION") == (
        "moe_fx.lowering.masked_experts.pipeline.FUSE_ACTIVATION")
    assert mod.qualified_setting("moe_fx.backend.STATIC_LAUNCH_KERNELS") == "moe_fx.backend.STATIC_LAUNCH_KERNELS"


def test_kernels_share_is_the_floor_over_the_kernels_sum(mod):
    # Qwen3-30B-A3B bf16 T=1 on an H100 (kernel_breakdown_2026-12-06_decode_h100.md): 25.1 µs floor, three kernels
    kernels = [("masked_gemm_kernel", 20.0), ("masked_gemm_kernel", 12.2), ("unpermute_kernel", 2.3)]
    total, share = mod.kernels_share(25.1, kernels)
    assert total == pytest.approx(34.5) and share == pytest.approx(25.1 / 34.5)
    total, share = mod.kernels_share(25.1, [])
    assert total == 0 and share != share  # no kernels: no share (NaN), not a division error


def test_kernel_choice_reaches_the_op_and_names_the_rows(mod):
    assert mod.parse_args([]).kernel_choice == "triton"
    assert mod.parse_args(["--kernel-choice", "auto"]).kernel_choice == "auto"
    with pytest.raises(SystemExit):
        mod.parse_args(["--kernel-choice", "deepgemm"])  # not a choice the op takes from here
    assert mod.choice_label("triton") == "op's choice"  # the label of every earlier results file
    assert mod.choice_label("auto") == "op's choice (auto)"


def test_kernels_cell_gives_each_gemm_its_own_floor(mod):
    row = {"gemm1_floor_us": 16.7, "gemm2_floor_us": 8.4}
    cell = mod.kernels_cell(row, [("masked_gemm_kernel", 20.0), ("masked_gemm_kernel", 12.24), ("unpermute_kernel", 2.3)])
    assert cell == "masked_gemm_kernel 20.0 (16.7) · masked_gemm_kernel 12.2 (8.4) · unpermute_kernel 2.3"
    assert mod.kernels_cell(row, [("unpermute_kernel", 2.0)]) == "unpermute_kernel 2.0"
    assert mod.parse_args(["--plain"]).plain and not mod.parse_args([]).plain


def test_section_writes_a_table_only_where_there_are_rows(mod):
    assert mod.section("Plain calls", ["shape", "T"], []) == ""
    text = mod.section("Plain calls", ["shape", "T"], [["qwen3", 1], ["mixtral", 16]])
    assert text == "\n## Plain calls\n\n| shape | T |\n|---|---|\n| qwen3 | 1 |\n| mixtral | 16 |\n"
    assert mod.dtype({"fp8": True}) == "fp8" and mod.dtype({"fp8": False}) == "bf16"
