#!/bin/bash
# One device call: GPU tests of the Triton lowering, then the layer benchmark with tile tuning.
# Usage (on the GPU machine, repo root): bash bench/gpu_check.sh [bench budget s]
set -o pipefail
export PYTHONUNBUFFERED=1 MOE_FX_CACHE_DIR=${OUT:-/tmp}/cache
mkdir -p "$MOE_FX_CACHE_DIR"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv | tee ${OUT:-/tmp}/gpu.txt
timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_triton_dispatch.py tests/test_triton_gemm.py \
  tests/test_triton_activation.py tests/test_triton_experts.py 2>&1 | tee ${OUT:-/tmp}/pytest_gpu.log | tail -40
timeout 420 python3 bench/moe_layer.py --tune --out ${OUT:-/tmp} --budget-s ${1:-300} 2>&1 | tee ${OUT:-/tmp}/bench.log
