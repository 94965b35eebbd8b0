"""Expert parallelism across processes on CPU: gloo process groups of 2 and 4 ranks (torch.multiprocessing).

Each rank compiles the same tiny MoE model with ``MoEConfig(ep_group="default")`` and runs its own
tokens; its output must equal the single-process op on those tokens. Loads are uneven, some rank has
no tokens in some step, and steps with more tokens than ``max_tokens_per_rank`` on some rank run in
rounds every rank agrees on. Every form of the experts op is split (biases, activation variants,
identity experts, weights on the input for top-1 and top-2, fp8 weights, GPT-OSS's hidden size 2880
unpadded), the sync-free fixed-size exchange is checked at the op level, and EPLB (counts, placement
changes, moved weights, unchanged outputs) through the compiled model.

Each world size is one spawn of worker processes running every job in turn (:func:`ep_workers.several`),
shared by the tests of that size through a module fixture; every run is bounded by a timeout so that
a hang fails the test instead of CI.
"""

from __future__ import annotations

import pytest
from ep_workers import FORMS, run_ranks, several

pytestmark = pytest.mark.timeout(300)

#: forms run with 4 ranks too (all of them run with 2)
_FORMS_4 = ["gpt_oss_h2880", "identity_experts", "weights_on_input_top2", "fp8"]
#: tokens per rank per step, max_tokens_per_rank 4: rounds of 1, 3 and 2
_STEPS_2 = [[3, 0], [11, 4], [2, 7]]
_STEPS_4 = [[3, 0, 4, 1], [0, 2, 9, 5]]


@pytest.fixture(autouse=True)
def _inductor_in_process(monkeypatch):
    # Compile Inductor's kernels in the worker itself: a compile-worker pool per rank is slow on 2 cores.
    monkeypatch.setenv("TORCHINDUCTOR_COMPILE_THREADS", "1")


@pytest.fixture(scope="module")
def two_ranks():
    jobs = [
        ("forms_worker", (list(FORMS), _STEPS_2, 4)),
        ("fixed_exchange_worker", (8,)),
        ("eplb_worker", ([[6, 5], [7, 0], [12, 4], [3, 9]], 4, 1, 0, 1)),
        ("hf_model_worker", ("gpt_oss", 2, 5, 4)),  # 5 and 10 tokens: 2 and 3 rounds
        ("ep_model_worker", ("dense_bmm", [[5, 3], [0, 7], [8, 8], [9, 2]], 8, False)),
        ("ep_model_worker", ("epmoe", [[5, 3], [9, 7], [20, 2]], 8, False, True)),
    ]
    return run_ranks(several, 2, jobs, timeout=240)


@pytest.fixture(scope="module")
def four_ranks():
    jobs = [
        ("forms_worker", (_FORMS_4, _STEPS_4, 4)),
        ("fixed_exchange_worker", (8,)),
        ("eplb_worker", ([[6, 5, 0, 3], [7, 0, 2, 2], [12, 4, 1, 1]], 4, 0, 2, None)),
        ("ep_model_worker", ("epmoe", [[5, 0, 3, 7], [3, 3, 12, 0]], 8, False)),
    ]
    return run_ranks(several, 4, jobs, timeout=280)


def _tolerance(form: str) -> float:
    return 0.06 if form.startswith("fp8") else 1e-5


def _check_forms(results, names):
    for rank, res in enumerate(results):
        for name in names:
            got = res[0][name]
            assert got["ops"] == ["ep_combine", "ep_dispatch_recv", "ep_dispatch_send", "ep_remaining_rounds",
                                  "masked_experts"], (rank, name)
            assert all(err < _tolerance(name) for err in got["errors"]), (rank, name, got["errors"])


def test_every_form_two_ranks(two_ranks):
    _check_forms(two_ranks, list(FORMS))


def test_every_form_four_ranks(four_ranks):
    _check_forms(four_ranks, _FORMS_4)


def _check_fixed(results):
    for rank, res in enumerate(results):
        fixed = res[1]
        for case in ("fp32", "empty_rank", "three_rounds"):
            assert fixed[case] < 1e-5, (rank, case, fixed)
        assert fixed["bf16_fp8_dispatch"] < 0.06, (rank, fixed)
        assert fixed["rounds"] == 3
    world = len(results)
    # rows received over all ranks: every valid (token, distinct expert) pair once; -1, the repeated
    # expert and the id out of range send none (3 tokens with such slots on ranks that have >= 3 tokens)
    for case, tokens in (("fp32", [5] * world), ("empty_rank", [6] + [0] * (world - 1))):
        assert sum(r[1][case + "_masked_m"] for r in results) == sum(3 * t - 3 * (t >= 3) for t in tokens)


def test_fixed_exchange_two_ranks(two_ranks):
    _check_fixed(two_ranks)


def test_fixed_exchange_four_ranks(four_ranks):
    _check_fixed(four_ranks)


def test_eplb_rebalance_on_request_two_ranks(two_ranks):
    results = [r[2] for r in two_ranks]
    for rank, res in enumerate(results):
        assert all(err < 1e-5 for err in res["errors"]), (rank, res["errors"])  # outputs unchanged throughout
        assert all(res["load_ok"]), (rank, res["load_ok"])  # counted on the device = the routing's own counts
        assert res["slots"] == 5 and res["freed"] and res["weights_ok"]  # 4 experts + 1 copy, weights moved
        assert res["weights"] == ["w13", "w13_bias", "w2", "w2_bias"]
        assert res["placements"][1] != res["placements"][2] == res["placements"][-1]  # changed by the call only
    report = results[0]["reports"][0]
    ((_, layer),) = report.items()
    # the report's load is every rank's count summed; the hot experts 0 and 1 now have copies on both ranks
    assert layer["load"] == [a + b for a, b in zip(results[0]["local_load"], results[1]["local_load"])]
    placement = layer["placement"]
    assert layer["moved"] > 0 and all(i in placement[:5] and i in placement[5:] for i in (0, 1))


def test_eplb_interval_four_ranks(four_ranks):
    results = [r[2] for r in four_ranks]
    for rank, res in enumerate(results):
        assert all(err < 1e-5 for err in res["errors"]), (rank, res["errors"])
        assert all(res["load_ok"]) and res["weights_ok"] and res["freed"]
        # eplb_interval=2: rebalanced before the second call, never by hand
        assert res["placements"][0] == res["placements"][1] != res["placements"][2] and not res["reports"]
    assert all(r["placements"] == results[0]["placements"] for r in results)


def test_recognized_models_two_ranks(two_ranks):
    for rank, res in enumerate(two_ranks):
        hf = res[3]  # GPT-OSS: biases, clamped interleaved SwiGLU, split (no longer left local)
        assert "ep_dispatch_send" in hf["ops"] and "experts" not in hf["ops"], hf["ops"]
        assert all(err < 1e-4 for err in hf["errors"]), (rank, hf["errors"])
        dense = res[4]
        assert dense["matched"] and all(dense["freed"]), dense
        assert all(isinstance(err, float) and err < 1e-5 for err in dense["errors"]), (rank, dense["errors"])


def test_symbolic_token_count_two_ranks(two_ranks):
    # one graph with a symbolic T for steps of 1, 2 and 3 rounds (mark_dynamic): the agreement reads T
    # from each call's inputs
    for rank, res in enumerate(two_ranks):
        dyn = res[5]
        assert dyn["compiles"] == 1
        assert all(isinstance(err, float) and err < 1e-5 for err in dyn["errors"]), (rank, dyn["errors"])


def test_ep_four_ranks_model_steps(four_ranks):
    for rank, res in enumerate(four_ranks):
        model = res[3]
        assert all(model["freed"]), rank
        assert all(isinstance(err, float) and err < 1e-5 for err in model["errors"]), (rank, model["errors"])


def test_ep_two_ranks_inductor_uneven_empty_rank_and_rounds():
    # Inductor compiles the split graph; the step needs 2 rounds on rank 0, which the empty rank 1 joins.
    from ep_workers import ep_model_worker

    steps = [[13, 0]]
    results = run_ranks(ep_model_worker, 2, "epmoe", steps, 8, True, timeout=200)
    for rank, res in enumerate(results):
        assert all(res["freed"]), rank
        assert all(isinstance(err, float) and err < 1e-5 for err in res["errors"]), (rank, res["errors"])
