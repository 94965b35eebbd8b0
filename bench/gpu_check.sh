#!/bin/bash
# One device call: GPU tests of the Triton lowering, then the layer benchmark with tile tuning.
# Usage (on the GPU machine, repo root): bash bench/gpu_check.sh [bench budget s] [extra bench args]
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PYTHONPATH MOE_FX_CACHE_DIR=${OUT:-/tmp}/cache
mkdir -p "$MOE_FX_CACHE_DIR"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv | tee ${OUT:-/tmp}/gpu.txt
timeout ${PYTEST_S:-170} python3 -m pytest -v --tb=short -m gpu -p no:cacheprovider tests/test_triton_dispatch.py \
  tests/test_triton_activation.py tests/test_triton_experts.py tests/test_triton_gemm.py 2>&1 | tee ${OUT:-/tmp}/pytest_gpu.log \
  | grep -E "PASSED|FAILED|ERROR|^E |passed|failed" | cut -c1-300
budget=${1:-300}; shift
timeout $((budget + 90)) python3 bench/moe_layer.py ${TUNE:-} --out ${OUT:-/tmp} --budget-s $budget "$@" 2>&1 | tee ${OUT:-/tmp}/bench.log | cut -c1-400
