#!/bin/bash
# One device call: GPU tests of the Triton lowering (parallel, pytest-xdist), then the layer benchmark.
# Usage (on the GPU machine, repo root): bash bench/gpu_check.sh [bench budget s] [extra bench args]
# Env: PYTEST_S (test time limit), TUNE=--tune (tune tiles first; cache under $OUT/cache).
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PYTHONPATH MOE_FX_CACHE_DIR=${OUT:-/tmp}/cache
mkdir -p "$MOE_FX_CACHE_DIR"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv | tee ${OUT:-/tmp}/gpu.txt
timeout ${PYTEST_S:-170} python3 -m pytest -v --tb=short -m gpu -p no:cacheprovider ${XDIST:--n 8} \
  tests/test_triton_dispatch.py tests/test_triton_activation.py tests/test_triton_experts.py tests/test_triton_gemm.py \
  2>&1 | tee ${OUT:-/tmp}/pytest_gpu.log | grep -E "FAILED|ERROR|^E |passed|failed" | cut -c1-300
budget=${1:-300}; shift
timeout $((budget + 90)) python3 bench/moe_layer.py ${TUNE:-} --out ${OUT:-/tmp} --budget-s $budget "$@" 2>&1 \
  | tee ${OUT:-/tmp}/bench.log | grep -E "check|limits|done|Error" | cut -c1-400
