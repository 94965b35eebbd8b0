"""Expert parallelism across processes on CPU: gloo process groups of 2 and 4 ranks (torch.multiprocessing).

Each rank compiles the same tiny MoE model with ``MoEConfig(ep_group="default")`` and runs its own
tokens; its output must equal the single-process eager model on those tokens. Loads are uneven, some
rank has no tokens in some step, and a last step gives one rank more tokens than
``max_tokens_per_rank``: every rank must then raise the same ValueError (none may hang). Every run is
bounded by a timeout so that a hang fails the test instead of CI.
"""

from __future__ import annotations

import pytest
from ep_workers import ep_model_worker, run_ranks

pytestmark = pytest.mark.timeout(180)


def _check(results, steps, max_tokens, tol=1e-5):
    for rank, res in enumerate(results):
        assert all(res["freed"]), f"rank {rank}: expert weights not reduced to the local experts"
        for i, (err, step) in enumerate(zip(res["errors"], steps)):
            if max(step) > max_tokens:
                assert isinstance(err, str) and "max_tokens_per_rank" in err, (rank, i, err)
                over = [r for r, n in enumerate(step) if n > max_tokens]
                assert all(f"rank {r}: {step[r]}" in err for r in over), err
            else:
                assert isinstance(err, float) and err < tol, (rank, i, err)


@pytest.fixture(autouse=True)
def _inductor_in_process(monkeypatch):
    # Compile Inductor's kernels in the worker itself: a compile-worker pool per rank is slow on 2 cores.
    monkeypatch.setenv("TORCHINDUCTOR_COMPILE_THREADS", "1")


def test_ep_two_ranks_inductor_uneven_and_empty_rank():
    steps = [[6, 0]]
    results = run_ranks(ep_model_worker, 2, "epmoe", steps, 8, True, timeout=150)
    _check(results, steps, 8)


def test_ep_two_ranks_recognized_model_steps():
    # DenseBmmMoE goes through the recognizer (rewrite into moe_fx::experts), then split_ep.
    steps = [[5, 3], [0, 7], [8, 8], [9, 2]]
    results = run_ranks(ep_model_worker, 2, "dense_bmm", steps, 8, False, timeout=120)
    assert all(r["matched"] for r in results)
    _check(results, steps, 8)


def test_ep_four_ranks_steps():
    steps = [[5, 0, 3, 7], [3, 3, 12, 0]]
    results = run_ranks(ep_model_worker, 4, "epmoe", steps, 8, False, timeout=150)
    _check(results, steps, 8)
