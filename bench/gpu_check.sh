#!/bin/bash
# One device call: every GPU test (pytest -m gpu, in parallel with pytest-xdist), then the layer benchmark.
# Usage (on the GPU machine, repo root): bash bench/gpu_check.sh [bench budget s] [extra bench args]
# Env: PYTEST_S (test time limit), TESTS (test files; default: all of tests/), TUNE=--tune (tune tiles
# first; cache under $OUT/cache), NO_BENCH=1 (tests only). DeepGEMM's tests run when deep_gemm imports.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PYTHONPATH MOE_FX_CACHE_DIR=${OUT:-/tmp}/cache
mkdir -p "$MOE_FX_CACHE_DIR"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv | tee ${OUT:-/tmp}/gpu.txt
timeout ${PYTEST_S:-170} python3 -m pytest -v --tb=short -m gpu -p no:cacheprovider ${XDIST:--n 8} ${TESTS:-tests} \
  2>&1 | tee ${OUT:-/tmp}/pytest_gpu${TAG:-}.log | grep -E "FAILED|ERROR|^E |passed|failed" | cut -c1-300
[ -n "${NO_BENCH:-}" ] && exit 0
budget=${1:-300}; shift
timeout $((budget + 90)) python3 bench/moe_layer.py ${TUNE:-} --out ${OUT:-/tmp} --budget-s $budget "$@" 2>&1 \
  | tee ${OUT:-/tmp}/bench.log | grep -E "check|limits|done|Error" | cut -c1-400
