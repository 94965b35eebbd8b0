"""bench/ep_overlap.py: the in-flight window read from a replay's GPU events, and its CPU smoke run."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest
from helpers import load_bench

ROOT = pathlib.Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench" / "ep_overlap.py"


def _bench():
    return load_bench("ep_overlap")


#: one replay of each order on the H200 (DeepEP, one rank, T=128, H=7168; the trace of 2026-12-03, cut down)
DEEPEP_OVERLAPPED = [
    ("void deep_ep::internode_ll::dispatch<false, false, 7168>", 0.0, 24.9),
    ("nvjet_sm90_tst_64x64_64x13_2x1_v_bz_TNT", 25.4, 49.1),
    ("void at::native::elementwise_kernel<128, 4>", 49.2, 51.9),
    ("nvjet_sm90_tst_112x64_64x9_1x2_h_bz_TNN", 55.4, 67.5),
    ("void deep_ep::internode_ll::dispatch<false, false, 7168>", 68.2, 86.8),
    ("masked_gemm_kernel", 87.3, 847.1),
    ("void deep_ep::internode_ll::combine<false, 7168, 9, 4>", 1230.1, 1262.3),
]
DEEPEP_SEQUENTIAL = [
    ("void deep_ep::internode_ll::dispatch<false, false, 7168>", 0.0, 24.6),
    ("void deep_ep::internode_ll::dispatch<false, false, 7168>", 25.1, 42.6),
    ("masked_gemm_kernel", 43.0, 803.4),
    ("void deep_ep::internode_ll::combine<false, 7168, 9, 4>", 1184.9, 1217.6),
    ("Memcpy DtoD (Device -> Device)", 1218.6, 1220.4),
    ("nvjet_sm90_tst_64x64_64x13_2x1_v_bz_TNT", 1220.8, 1242.9),
    ("nvjet_sm90_tst_112x64_64x9_1x2_h_bz_TNN", 1249.4, 1260.0),
]


def test_window_between_deepep_send_and_receive_holds_the_shared_gemms():
    mod = _bench()
    got = mod.in_flight_profile(DEEPEP_OVERLAPPED, mod.RECEIVE_KERNEL["deepep"])
    assert got["window_us"] == pytest.approx(68.2 - 24.9)
    # both shared GEMMs, not the elementwise kernel between them nor the routed experts' masked GEMM
    assert got["shared_gemm_in_window_us"] == pytest.approx((49.1 - 25.4) + (67.5 - 55.4))
    assert got["shared_gemm_us"] == pytest.approx(got["shared_gemm_in_window_us"])
    seq = mod.in_flight_profile(DEEPEP_SEQUENTIAL, mod.RECEIVE_KERNEL["deepep"])
    assert seq["window_us"] == 0 and seq["shared_gemm_in_window_us"] == 0
    assert seq["shared_gemm_us"] == pytest.approx((1242.9 - 1220.8) + (1260.0 - 1249.4))


def test_window_opens_at_a_running_collective_and_counts_only_its_part_of_a_gemm():
    mod = _bench()
    events = [
        ("void at::native::CatArrayBatchedCopy", 0.0, 2.0),
        ("ncclDevKernel_AllGather_RING_LL", 2.5, 40.0),  # in flight while the shared expert runs
        ("nvjet_sm90_tst_64x64", 3.0, 30.0),
        ("nvjet_sm90_tst_112x64", 30.5, 50.0),
        ("permute_kernel", 45.0, 52.0),  # the receive starts while the second GEMM still runs
    ]
    got = mod.in_flight_profile(events, mod.RECEIVE_KERNEL["torch_dist_fixed"])
    assert got["window_us"] == pytest.approx(45.0 - 2.5)
    assert got["shared_gemm_in_window_us"] == pytest.approx(27.0 + (45.0 - 30.5))
    # no shared GEMM at all: nothing to report
    assert mod.in_flight_profile(events[:2] + events[4:], "permute_kernel")["window_us"] == 0


@pytest.mark.timeout(300)
def test_cpu_smoke_run_matches_the_reference():
    pytest.importorskip("triton")
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    done = subprocess.run([sys.executable, str(BENCH), "--device", "cpu"], capture_output=True, text=True,
                          timeout=280, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    errs = [float(line.split(":")[1].strip().rstrip(",")) for line in done.stdout.splitlines() if "_rel_err" in line]
    assert len(errs) == 2 and max(errs) < 1e-4, done.stdout[-1000:]
