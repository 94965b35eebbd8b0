#!/bin/bash
# Named GPU-machine runs of issue 16's open measurements, each sized for one device call (<= 10 minutes).
# Usage (on the GPU machine, repo root, through the device tool): bash bench/gpu_recipes.sh NAME [NAME ...]
# Results and logs go to $OUT (the device tool's output folder; /tmp/out elsewhere); copy them to bench/results
# with the machine in the name (_h100 for an H100). Nothing here builds or fetches code from outside the project.
# PACK=1: after each recipe, what it wrote in $OUT goes into one archive, results_NAME.tgz (the device tool brings back
# at most 8 files a call: several recipes in one call write more; one archive per recipe keeps the finished recipes'
# results when a later one runs past the call's limit).
#
#   tests          every GPU test (pytest -m gpu tests, 8 workers, 4 on an 80 GB GPU, skip reasons listed; test_ep_gpu's multi-GPU ones
#                  skip on one GPU; the modules that import expecttest hold no GPU test and are left out where it is
#                  not installed, as on the GPU image)
#   tests_compiled the GPU tests of tests/test_compiled_gpu.py and test_backend.py only (4 workers)
#   switches       the GPU tests of the lowering switches only (static launch, combine in graph)
#   tests_cpp      the GPU tests of the C++ wrapper only (decode graphs bf16 / fp8; prefill graphs under the caller's option)
#   gen_cg_plain   GPT-OSS-20B 24 layers, generate() through transformers' CompileConfig (CUDA graphs), plain
#   gen_cg_moe_fx  the same under backend="moe_fx" (its own call: the compile takes minutes)
#   gen_cg_profile both CompileConfig sides in one call with --profile: one decode step's GPU time, launches, host time
#   gen_cg_qwen3   Qwen3-30B-A3B 48 layers (no sliding-window layers), both CompileConfig sides with --profile
#   gen_cg_cache   Qwen3 48 layers, CompileConfig with one StaticCache passed to every call, both sides
#   gen_default    GPT-OSS-20B 24 layers, default-mode generate() with the decode-step split, shipped settings
#   gen_combine    the same with masked_experts.pipeline.COMBINE_IN_GRAPH=True (one launch fewer a layer)
#   l2_static      GPT-OSS 2 layers, T=1 forward + generate(), Triton's launcher then STATIC_LAUNCH_KERNELS (one call)
#   gen_ab_static  GPT-OSS 16 layers (weights shared by the sides), default-mode generate(): plain, moe_fx (static
#                  launch, on since 2026-12-05) and moe_fx with Triton's launcher (STATIC_LAUNCH_KERNELS=False) timed in
#                  the same alternating rounds (e2e_model --ab-set: no drift between runs; the A/B side compiles after
#                  moe_fx's, on Triton's warm on-disk cache: its warm-up is not a cold compile)
#   gen_ab_cpp     the same A/B at 8 layers with moe_fx.backend.CPP_WRAPPER=False on the A/B side (Inductor's Python wrapper;
#                  the C++ wrapper of decode-sized graphs is on since 2026-12-06, e2e_model_2026-12-06_gpt_oss8_ab_cpp_h100.md
#                  measured it the other way round, every graph of the A/B side under it)
#   gen_ab_cpp_fp8 the C++-wrapper A/B on Qwen3-30B-A3B with transformers' fine-grained FP8 experts, 8 layers
#   gen_ab_cpp_qwen3  the same on the bf16 Qwen3-30B-A3B
#   gen_ab_cpp_dyn the C++ wrapper for decode graphs of a symbolic batch (backend.CPP_WRAPPER_DYNAMIC on the A/B side):
#                  its GPU test, then Qwen3 bf16, 4 layers, generate() with a batch of 4 under dynamic=True (2026-12-06,
#                  H100: 1.01x; transformers' StaticCache keeps the decode batch static, so the shipped rule already gave
#                  that step the C++ wrapper; the test's own C++ compile takes ~100 s)
#   gen_ab_combine the same A/B with masked_experts.pipeline.COMBINE_IN_GRAPH=True
#   compile_static what STATIC_LAUNCH_KERNELS costs a cold compile (no worker pool): GPT-OSS 16 layers, one T=1
#                  forward per side, Triton's launcher then static, each process with empty Inductor and Triton caches
#   fwd_fp8        whole 2-layer models with transformers' fine-grained FP8 experts (Qwen3, Mixtral, OLMoE; GPT-OSS's
#                  biased experts have no FP8 form there, two DeepSeek-V3 layers with their copies do not fit an H100),
#                  T = 1024 / 4096 forwards, moe_fx against plain (issue 16: >= 1.5x)
#   pass_time      the moe_fx passes on 4 real-size GPT-OSS and Mixtral layers, the numerical check's random weights
#                  drawn on the GPU (shipped since 2026-12-05) against on the host and copied over (before)
#   tune_fp8_prefill  retune the fp8 GEMM tiles of the regimes above 16 rows per expert for Qwen3, Mixtral and the
#                  DeepSeek-V3 shard on this GPU (the H100's were shipped from it, 2026-12-05); the report gives each T's
#                  old (shipped) tile beside the new choice, and the merged table comes back as tuned_tiles_fp8_prefill.json
#   tune_bf16_prefill  retune the bf16 GEMM tiles of the two prefill regimes (more than 64 rows per expert) for every
#                  bench shape on this GPU with the current candidates (the 4-stage flattened tile joined them on
#                  2026-12-06, after the H200's table was tuned); the new table stays in the working tree, so a
#                  recipe after this one in the same call (layer, peer_vllm) runs it, and comes back as
#                  tuned_tiles_bf16_prefill.json, the reports and logs as tune_bf16_prefill.tgz
#   tune_decode_bf16, tune_decode_fp8  tune the decode regimes (at most 16 rows per expert) of every bench shape
#                  on this GPU, one kind a recipe (one call each), with their static-size entries; the merged table
#                  comes back as tuned_tiles_decode_<kind>.json, the tree keeps its own (an H100 reads the H200's decode
#                  tiles: on 2026-12-07 its own choices timed 0.998-1.007x of those, and were not shipped)
#   tune_bf16_qwen3  tune_bf16_prefill for Qwen3 only (its two prefill regimes, with the 64x256 candidate of
#                  2026-12-06, which lost 1.10-1.34x everywhere on an H100); the new table comes back as
#                  tuned_tiles_bf16_qwen3.json, the working tree keeps its own
#   layer          bench/moe_layer.py with its roofline column: Qwen3, Mixtral and the DeepSeek-V3 shard, T = 1 ... 16384,
#                  moe_fx bf16 and fp8 beside transformers' grouped_mm experts under plain torch.compile; T <= 16 also
#                  in chain mode (8 calls in one CUDA graph, per call: a layer in a model's graph, since 2026-12-07)
#   fwd_flat       whole 2-layer models (Qwen3, Mixtral, OLMoE, GPT-OSS, DeepSeek-V3; weights shared by the sides),
#                  T = 1 / 16 / 1024 / 4096 forwards, Triton only, moe_fx against plain with the GPU ceiling column
#   fwd_flat_1, fwd_flat_2  fwd_flat in two calls (Qwen3, Mixtral, OLMoE; then GPT-OSS and DeepSeek-V3): on the H200 VM,
#                  whose host compiles slower, the five models did not fit one call (2026-12-06: DeepSeek-V3 was cut
#                  after T=1 with four models)
#   slot_down      one token's GEMM2 and combine in one launch (masked_experts.pipeline.SLOT_DOWN_COMBINE, off: it
#                  lost with each tile on an H100, slot_down_2026-12-06_tiles_h100.md) against the two launches,
#                  Qwen3, Mixtral, GPT-OSS at T=1, CUDA-graph replays alternating; one
#                  run with the shipped tile (grouped_gemm.SLOT_DOWN_TILE), then one for each of three other tiles;
#                  its GPU tests first
#   breakdown_prefill  where one layer's time goes at prefill sizes (bench/kernel_breakdown.py): each kernel of a CUDA-graph
#                  replay, bf16 Qwen3 / Mixtral / GPT-OSS at T = 1024 and 4096 (Qwen3 T=4096 ran at 49% of its floor
#                  on an H100 where T=1024 ran at 79%), then Qwen3 with fp8 weights
#   breakdown_decode  the same at decode sizes: Qwen3 and GPT-OSS at T = 1 and 16, bf16 then fp8 (issue 16: >= 80% of
#                  the floor at T <= 16; T=1 ran at 53% / 34% for Qwen3 bf16 / fp8 on an H100)
#   breakdown_plain  one layer at T = 1 and 16 as a CUDA graph and as plain calls, each profiled (kernel_breakdown
#                  --plain), Mixtral, the DeepSeek-V3 shard and Qwen3, bf16 then fp8: on H100s the compiled bf16 graph
#                  rows of Mixtral and the shard at T=1 ran ~40 µs slower than their plain calls (294 against 255 µs,
#                  every H100 run since 2026-12-05; within 3% on the H200). kernel_breakdown runs the op eagerly: on
#                  2026-12-07 its graphs replayed in 245 / 247 µs, as fast as the compiled plain calls; so did the
#                  compiled call's own graphs (kernel_breakdown --compiled), and moe_layer's with fewer sides: the slow
#                  rows come from the layer bench's process holding all five sides (one_call_graph_2026-12-07_s28_h100.md)
#   layout_copy    the copies of the tokens into DeepGEMM's layouts on their own (bench/layout_copy.py; no DeepGEMM
#                  needed): the contiguous layout's copy in bf16, fp8 quantised in the copy's launch (shipped 2026-12-07,
#                  one program a token) and fp8 in two launches (quantize_rows, then the copy), and the masked layout's
#                  permute (bf16, fp8: 1024 columns a step since 2026-12-07), DeepSeek-V3 shard, Mixtral, Qwen3, T = 1024
#                  / 4096 / 16384, against the bytes floor (before: the contiguous copy 193.7 / 949.4 µs for the shard at
#                  T = 4096 / 16384 on an H100, 2-3x its floor; the fp8 permute 59.0 µs at T=1024, 2.4x); with two
#                  more fp8 sides: the scales stored straight into DeepGEMM's MN-major layout (before 2026-12-07), through
#                  a row-major scratch and a copy (sort.SCALE_SCRATCH, shipped), and row by row with no copy (a
#                  diagnostic: a layout DeepGEMM cannot read)
#   epilogue_prefill  gate/up halves' activation in GEMM1's epilogue against the separate activation kernel at prefill
#                  sizes (Qwen3, Mixtral; T = 1024, 4096, 16384; masked_experts.pipeline.FUSE_HALVES_MAX_ROWS=None on both
#                  sides so the "on" side fuses at every size, the shipped choice since it won 1.04-1.11x on an H100,
#                  fused_activation_2026-12-06_prefill_h100.md)
#   w8a16          fp8 weights with bf16 activations at decode sizes (masked_gemm_kernel's B_FP8, the weight tile
#                  dequantised into bf16 since 2026-12-06: one accumulator, no per-step product scaling) against the
#                  quantised W8A8 pipeline up to 64 rows per expert, Qwen3, Mixtral, the DeepSeek-V3 shard, GPT-OSS,
#                  T = 1 / 16 / 64 / 256 (its first form lost 1.45-1.83x on the H200, w8a16_2026-12-04.md); the
#                  W8A16 GPU tests first, then where a W8A16 decode step's time goes (kernel_breakdown, Qwen3 and
#                  GPT-OSS at T = 1 and 16)
#   peer_vllm      one layer against the peer in .ext/vllm_peer.py (carried; never committed: docs/performance.md
#                  "How the vLLM comparison is made"), Qwen3 and Mixtral, bf16 and fp8, T = 1 ... 16384
#   peer_vllm_more the same for the DeepSeek-V3 shard and GPT-OSS
#   peer_issue     the rows of issue 16's vLLM table, bf16 and fp8, every shape in one call ($PEER_ISSUE_CELLS: the
#                  call to make first when an H200 is scarce; peer_vllm and peer_vllm_more hold every T)
#   peer_mixtral256 the one H200 row of that table where moe_fx's Triton was slower (Mixtral T=256 bf16, 1.010x in the
#                  thirty-second session), bf16 only, 7 rounds: both sides run the same 128x256x64 tile there;
#                  --kernels lists each side's kernels of one replay, to place the difference
#
# The dg_* recipes need an importable DeepGEMM on the GPU machine (the GPU image has none; docs/deepgemm.md says how
# to build one against its torch, outside this repository); each stops at once, saying why, where it does not import.
#   dg_tests       the GPU tests of tests/test_deepgemm_gpu.py (the real deep_gemm against the reference and Triton,
#                  auto's choice, compiled models, fp8 checkpoints, the contiguous layout)
#   dg_peer        one layer against the peer with kernel_choice='auto' beside Triton (bench/peer_layer.py --auto):
#                  Qwen3, Mixtral and the DeepSeek-V3 shard, bf16 and fp8, T = 1024 / 4096 / 16384 (issue 16: >= 75%
#                  of the roofline at T >= 1024 with DeepGEMM)
#   dg_breakdown_fp8  where an fp8 layer's time goes under kernel_choice='auto' (bench/kernel_breakdown.py
#                  --kernel-choice auto): each kernel of the DeepGEMM path (sort, row copy and quantisation, the GEMMs,
#                  the activation, the combine) beside its GEMMs' floors; the DeepSeek-V3 shard, Mixtral and Qwen3 at
#                  T = 1024 / 4096 / 16384 (issue 16: what keeps DeepGEMM rows under 75% of the roofline)
#   dg_fwd_fp8     fwd_fp8 with DeepGEMM importable (issue 16: fp8 checkpoint rows >= 1.5x at T >= 1024)
#   dg_fwd_q8      MoEConfig(quantize="fp8") on the bf16 models against plain bf16, DeepGEMM importable (Qwen3, Mixtral,
#                  OLMoE, T = 1024 / 4096; the logit error column is the accuracy cost)
#   dg_fwd         whole 2-layer models with DeepGEMM importable: Qwen3, Mixtral, OLMoE, DeepSeek-V3 at T = 1024 / 4096
#   dg_switches    two A/Bs of one fp8 layer under auto, CUDA-graph replays alternating (bench/fused_activation.py):
#                  DeepGEMM's expected_m hint with 64 rows of slack (masked_experts.deepgemm.EXPECTED_M_SLACK: the SMs
#                  DeepGEMM runs on come from the hint), T = 512 ... 4096, where T=2048 / 4096 of Mixtral and the
#                  shard run the contiguous layout, which takes no hint (the controls); the contiguous copy's scales
#                  through the scratch against straight MN-major stores (sort.SCALE_SCRATCH) at T = 4096 / 16384;
#                  then the hint at max_m
#
# Mixtral-8x7B at its released 32 layers holds ~93 GB of bf16 weights: an H200 only (the device tool's needs_h200).
#   full_mixtral   Mixtral-8x7B, 32 layers (one copy of the weights, shared by the sides), T = 16 / 1024 / 4096
#                  forwards, default mode, Triton only (issue 16: whole models at full depth where they fit)
#   full_mixtral_gen  the same model, generate() decode, batch 1, 32 new tokens, default mode (issue 16: >= 1.2x)
#   qwen3_gen32    Qwen3-30B-A3B, 32 of its 48 layers (weights shared by the sides), generate() decode, batch 1,
#                  32 new tokens, default mode (issue 16: >= 1.2x). All 48 layers do not fit a call: on 2026-12-07
#                  (H100) plain's compile alone took 276 s (Dynamo 56 s, Inductor 218 s) and moe_fx's had not finished
#                  at the call's 590 s; two thirds of the depth leave both compiles and the rounds inside it
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader | tee -a "$OUT/gpu.txt"
git log --oneline -1 2>/dev/null | tee -a "$OUT/commit.txt"

E2E_GEN="bench/e2e_model.py --models gpt_oss --layers full --tokens 32 --no-forward --modes default --no-deepgemm
  --gen-batch 1 --gen-new 32 --gen-rounds 3 --no-layer-host --budget-s 500 --no-plot --out $OUT"
L2="bench/e2e_model.py --models gpt_oss --tokens 1 --modes default --no-deepgemm --layers 2 --no-layer-host
  --rounds 8 --gen-batch 1 --gen-new 32 --gen-rounds 3 --budget-s 120 --no-plot --out $OUT"
# 16 of GPT-OSS's 24 layers: three compiled sides (plain, moe_fx, the A/B side) fit one call
E2E_AB="bench/e2e_model.py --models gpt_oss --layers 16 --share-weights --tokens 32 --no-forward --modes default --no-deepgemm
  --gen-batch 1 --gen-new 32 --gen-rounds 4 --no-layer-host --budget-s 500 --no-plot --out $OUT"
E2E_FULL="bench/e2e_model.py --models mixtral --layers full --modes default --no-deepgemm --no-layer-host
  --budget-s 480 --no-plot --out $OUT"
E2E_COMPILE="bench/e2e_model.py --models gpt_oss --layers 16 --tokens 1 --modes default --no-deepgemm
  --no-layer-host --no-generate --rounds 2 --per-round 2 --budget-s 250 --no-plot --out $OUT"
E2E_FP8="bench/e2e_model.py --models qwen3,mixtral,olmoe --weights fp8_checkpoint --tokens 1024,4096 --modes default
  --no-deepgemm --rounds 4 --no-generate --no-layer-host --budget-s 450 --no-plot --out $OUT"
E2E_FLAT="bench/e2e_model.py --models qwen3,mixtral,olmoe,gpt_oss,deepseek_v3 --tokens 1,16,1024,4096 --modes default
  --no-deepgemm --rounds 4 --no-generate --no-layer-host --share-weights --budget-s 480 --no-plot --out $OUT"
LAYER="bench/moe_layer.py --shapes qwen3,mixtral,dsv3 --tokens 1,16,64,256,1024,4096,16384
  --impls moe_fx_bf16,moe_fx_fp8,hf_grouped_mm --budget-s 450 --out $OUT"
BREAKDOWN="bench/kernel_breakdown.py --shapes qwen3,mixtral,gpt_oss --tokens 1024,4096 --out $OUT"
EPILOGUE="bench/fused_activation.py --switch epilogue --shapes qwen3,mixtral --tokens 1024,4096,16384 --rounds 3
  --set masked_experts.pipeline.FUSE_HALVES_MAX_ROWS=None --out $OUT"
W8A16="bench/fused_activation.py --switch w8a16 --on 64 --shapes qwen3,mixtral,dsv3,gpt_oss --tokens 1,16,64,256 --rounds 3
  --out $OUT"
# issue 16's vLLM table (Qwen3 T = 1 / 256 / 1024 / 4096, Mixtral 64 / 256 / 4096, the DeepSeek-V3 shard 64 / 4096,
# GPT-OSS 1 / 256): bench/peer_layer.py --cells
PEER_ISSUE_CELLS="qwen3:1,256,1024,4096/mixtral:64,256,4096/dsv3:64,4096/gpt_oss:1,256"
DG_HINT="bench/fused_activation.py --switch dg_hint --shapes dsv3,mixtral,qwen3 --tokens 512,1024,2048,4096 --rounds 5
  --out $OUT"
SCALE_SCRATCH="bench/fused_activation.py --switch scale_scratch --shapes dsv3,mixtral,qwen3 --tokens 4096,16384 --rounds 5
  --out $OUT"
SLOT_DOWN="bench/fused_activation.py --switch slot_down --shapes qwen3,mixtral,gpt_oss --tokens 1 --rounds 5 --out $OUT"
PASS_TIME="bench/pass_time.py --real gpt_oss,mixtral --layers 4 --repeats 2 --out $OUT"
TUNE_BF16="bench/tune_tiles.py --sorted --kinds bf16 --warm 8 --force --ship --out $OUT"
TUNE_FP8="bench/tune_tiles.py --sorted --kinds fp8 --warm 8 --budget-s 240 --ship --out $OUT"
CG="bench/generate_cudagraphs.py --model gpt_oss --layers 24 --batch 1 --new 32 --rounds 3 --timeout-s 560 --out $OUT"
CG_QWEN3="bench/generate_cudagraphs.py --model qwen3 --layers 48 --batch 1 --new 32 --rounds 3 --timeout-s 285
  --out $OUT"

summary() {  # the result rows of the markdown files a recipe wrote
  grep -h -E "^\| (gpt_oss|qwen3|cc-|fwd-)" "$OUT"/*"$1"*.md 2>/dev/null | cut -c1-260
}

profile_section() {  # the decode-step section of a generate_cudagraphs --profile run
  grep -h -A30 "^## One decode step" "$OUT"/*"$1".md 2>/dev/null | cut -c1-700
}

peer_run() {  # one layer against .ext/vllm_peer.py (bench/peer_layer.py): $1 the recipe, then its options (--shapes or --cells)
  local tag=$1; shift
  if [ ! -f .ext/vllm_peer.py ]; then echo "no .ext/vllm_peer.py: build it, then carry .ext"; return 2; fi
  timeout 590 python3 bench/peer_layer.py --peer .ext/vllm_peer.py --budget-s 480 --out "$OUT" \
    --tag "$tag" "$@" > "$OUT/log_$tag.txt" 2>&1
  grep -h -E "^\| (qwen3|mixtral|dsv3|gpt_oss)" "$OUT"/peer_layer_*"$tag".md | cut -c1-220
}

need_deepgemm() {  # the dg_* recipes: DeepGEMM must be usable here (this script never builds it: docs/deepgemm.md)
  python3 -c "from moe_fx.lowering.problem import probe_capabilities as p; e = p('cuda').deep_gemm_error
print('deep_gemm:', e or 'usable'); raise SystemExit(1 if e else 0)"
}

TABLE=moe_fx/lowering/triton/tuned_tiles.json

tune_begin() {  # a tuning recipe's start: a fresh tuning cache; with "aside", the shipped table saved to restore after
  [ "${1:-}" = aside ] && cp $TABLE "$OUT/tuned_tiles_shipped.json"
  export MOE_FX_CACHE_DIR=$(mktemp -d)
}

tune_end() {  # $1: the name the tuned table comes back under; with "restore", the working tree's table as it was
  unset MOE_FX_CACHE_DIR
  cp $TABLE "$OUT/$1"
  [ "${2:-}" = restore ] && cp "$OUT/tuned_tiles_shipped.json" $TABLE
  return 0
}

pack() {  # PACK=1: everything in $OUT but earlier archives into results_$1.tgz
  [ "${PACK:-0}" = 1 ] || return 0
  (cd "$OUT" && find . -mindepth 1 -maxdepth 1 ! -name 'results_*.tgz' -print0 | tar czf results_$1.tgz --null -T - \
    && find . -mindepth 1 -maxdepth 1 ! -name 'results_*.tgz' -exec rm -rf {} +)
  echo "packed $OUT/results_$1.tgz"
}

for name in "$@"; do
  echo "== $name $(date +%T)"
  case $name in
    tests)
      no_expecttest=$(python3 -c "import expecttest" 2>/dev/null \
        || grep -l -E "^(from|import) expecttest" tests/*.py | sed 's/^/--ignore=/')
      # 8 workers ran out of memory on an 80 GB H100 (2026-12-05: 8 of 157 tests); 4 there
      workers=$(python3 -c "import torch; print(8 if torch.cuda.get_device_properties(0).total_memory > 100e9 else 4)")
      timeout 560 python3 -m pytest -q -p no:cacheprovider -m gpu -n $workers -rs $no_expecttest tests \
        > "$OUT/pytest_gpu_$name.log" 2>&1
      grep -E "FAILED|ERROR|SKIPPED|passed|failed" "$OUT/pytest_gpu_$name.log" | cut -c1-200 | tail -30 ;;
    tests_compiled)
      timeout 400 python3 -m pytest -q -p no:cacheprovider -m gpu -n 4 tests/test_compiled_gpu.py tests/test_backend.py \
        > "$OUT/pytest_gpu_$name.log" 2>&1
      grep -E "FAILED|ERROR|passed|failed" "$OUT/pytest_gpu_$name.log" | cut -c1-200 | tail -20 ;;
    switches)
      timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_compiled_gpu.py \
        -k "combine_left or static_launch" > "$OUT/pytest_gpu_$name.log" 2>&1
      grep -E "FAILED|ERROR|passed|failed" "$OUT/pytest_gpu_$name.log" | cut -c1-200 | tail -20 ;;
    tests_cpp)
      timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_compiled_gpu.py -k cpp_wrapper \
        > "$OUT/pytest_gpu_$name.log" 2>&1
      grep -E "FAILED|ERROR|passed|failed" "$OUT/pytest_gpu_$name.log" | cut -c1-200 | tail -20 ;;
    gen_cg_plain)
      timeout 590 python3 $CG --variants cc-ro-inductor --tag gpt_oss24_cc_plain > "$OUT/log_$name.txt" 2>&1
      summary gpt_oss24_cc_plain ;;
    gen_cg_moe_fx)
      timeout 590 python3 $CG --variants cc-ro-moe_fx --tag gpt_oss24_cc_moe_fx > "$OUT/log_$name.txt" 2>&1
      summary gpt_oss24_cc_moe_fx ;;
    gen_cg_profile)
      timeout 590 python3 $CG --variants cc-ro-inductor,cc-ro-moe_fx --profile --timeout-s 280 \
        --tag gpt_oss24_cc_profile > "$OUT/log_$name.txt" 2>&1
      summary gpt_oss24_cc_profile; profile_section gpt_oss24_cc_profile ;;
    gen_cg_qwen3)
      timeout 590 python3 $CG_QWEN3 --variants cc-ro-inductor,cc-ro-moe_fx --profile --tag qwen3_48_cc_profile \
        > "$OUT/log_$name.txt" 2>&1
      summary qwen3_48_cc_profile; profile_section qwen3_48_cc_profile ;;
    gen_cg_cache)
      timeout 590 python3 $CG_QWEN3 --variants cc-ro-inductor-earlycache,cc-ro-moe_fx-earlycache \
        --tag qwen3_48_cc_cache > "$OUT/log_$name.txt" 2>&1
      summary qwen3_48_cc_cache ;;
    gen_default)
      timeout 590 python3 $E2E_GEN --tag full_gpt_oss_gen_b1_shipped > "$OUT/log_$name.txt" 2>&1
      summary full_gpt_oss_gen_b1_shipped ;;
    gen_combine)
      timeout 590 python3 $E2E_GEN --set masked_experts.pipeline.COMBINE_IN_GRAPH=True \
        --tag full_gpt_oss_gen_b1_combine > "$OUT/log_$name.txt" 2>&1
      summary full_gpt_oss_gen_b1_combine ;;
    l2_static)
      timeout 280 python3 $L2 --set moe_fx.backend.STATIC_LAUNCH_KERNELS=False --tag gptoss_l2_launcher \
        > "$OUT/log_${name}_launcher.txt" 2>&1
      timeout 280 python3 $L2 --static-launch --tag gptoss_l2_static > "$OUT/log_${name}_static.txt" 2>&1
      summary gptoss_l2_ ;;
    gen_ab_static)
      timeout 590 python3 $E2E_AB --ab-set moe_fx.backend.STATIC_LAUNCH_KERNELS=False --tag gpt_oss16_ab_launcher \
        > "$OUT/log_$name.txt" 2>&1
      summary gpt_oss16_ab_launcher ;;
    gen_ab_cpp)
      timeout 590 python3 $E2E_AB --layers 8 --ab-set moe_fx.backend.CPP_WRAPPER=False --tag gpt_oss8_ab_py \
        > "$OUT/log_$name.txt" 2>&1
      summary gpt_oss8_ab_py ;;
    gen_ab_cpp_fp8)
      timeout ${GEN_TIMEOUT:-590} python3 $E2E_AB --models qwen3 --weights fp8_checkpoint --layers 8 \
        --ab-set moe_fx.backend.CPP_WRAPPER=False --tag qwen3_fp8_8_ab_py > "$OUT/log_$name.txt" 2>&1
      summary qwen3_fp8_8_ab_py ;;
    gen_ab_cpp_qwen3)
      timeout ${GEN_TIMEOUT:-590} python3 $E2E_AB --models qwen3 --layers 8 \
        --ab-set moe_fx.backend.CPP_WRAPPER=False --tag qwen3_8_ab_py > "$OUT/log_$name.txt" 2>&1
      summary qwen3_8_ab_py ;;
    gen_ab_cpp_dyn)
      timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_compiled_gpu.py -k dynamic_decode_graph \
        > "$OUT/pytest_gpu_$name.log" 2>&1
      grep -E "FAILED|ERROR|passed|failed" "$OUT/pytest_gpu_$name.log" | cut -c1-200 | tail -5
      timeout ${GEN_TIMEOUT:-590} python3 $E2E_AB --models qwen3 --layers 4 --gen-batch 4 --gen-rounds 3 \
        --ab-set moe_fx.backend.CPP_WRAPPER_DYNAMIC=True --tag qwen3_4_b4_ab_dyn > "$OUT/log_$name.txt" 2>&1
      summary qwen3_4_b4_ab_dyn ;;
    gen_ab_combine)
      timeout 590 python3 $E2E_AB --ab-set masked_experts.pipeline.COMBINE_IN_GRAPH=True --tag gpt_oss16_ab_combine \
        > "$OUT/log_$name.txt" 2>&1
      summary gpt_oss16_ab_combine ;;
    compile_static)
      for side in launcher static; do
        caches=$(mktemp -d)
        TORCHINDUCTOR_CACHE_DIR=$caches/inductor TRITON_CACHE_DIR=$caches/triton timeout 285 python3 $E2E_COMPILE \
          $([ $side = static ] && echo --static-launch || echo --set moe_fx.backend.STATIC_LAUNCH_KERNELS=False) \
          --tag gpt_oss16_compile_$side > "$OUT/log_${name}_$side.txt" 2>&1
      done
      summary gpt_oss16_compile_ ;;
    fwd_fp8)
      timeout 590 python3 $E2E_FP8 --tag fp8_checkpoint > "$OUT/log_$name.txt" 2>&1
      grep -h -E "^\| (qwen3|mixtral|olmoe)" "$OUT"/*fp8_checkpoint.md 2>/dev/null | cut -c1-260 ;;
    pass_time)
      timeout 590 python3 $PASS_TIME --tag _gpu > "$OUT/log_$name.txt" 2>&1
      grep -h -E "^\| (gpt_oss|mixtral)" "$OUT"/pass_time_real_*.md 2>/dev/null ;;
    tune_fp8_prefill)
      # the token counts of regimes 2 to 4 only (Qwen3: T > 256; Mixtral, DeepSeek: T > 64). The new table comes back
      # in $OUT; the working tree's table and the tuning cache stay as they were for the recipes after this one.
      tune_begin aside
      timeout 290 python3 $TUNE_FP8 --shapes qwen3 --tokens 384,512,768,1024,1536,2048,3072,4096,8192,16384 --tag fp8_prefill_qwen3 \
        > "$OUT/log_${name}_qwen3.txt" 2>&1
      timeout 290 python3 $TUNE_FP8 --shapes mixtral,dsv3 --tokens 96,128,192,256,384,512,768,1024,2048,4096,8192,16384 \
        --tag fp8_prefill_mixtral_dsv3 > "$OUT/log_${name}_mixtral_dsv3.txt" 2>&1
      tune_end tuned_tiles_fp8_prefill.json restore
      grep -h "worst chosen\|shipped" "$OUT"/log_${name}_*.txt ;;
    tune_bf16_prefill)
      # regimes 3 and 4 of each shape: Qwen3 T > 1024; Mixtral and the DeepSeek-V3 shard T > 256; GPT-OSS and OLMoE T > 512
      tune_begin
      timeout 175 python3 $TUNE_BF16 --budget-s 120 --shapes qwen3 --tokens 2048,3072,4096,8192,16384 \
        --tag bf16_prefill_qwen3 > "$OUT/log_${name}_qwen3.txt" 2>&1
      timeout 175 python3 $TUNE_BF16 --budget-s 120 --shapes mixtral,dsv3 --tokens 384,512,768,1024,2048,4096,8192,16384 \
        --tag bf16_prefill_mixtral_dsv3 > "$OUT/log_${name}_mixtral_dsv3.txt" 2>&1
      timeout 175 python3 $TUNE_BF16 --budget-s 120 --shapes gpt_oss,olmoe --tokens 768,1024,2048,4096,8192,16384 \
        --tag bf16_prefill_gpt_oss_olmoe > "$OUT/log_${name}_gpt_oss_olmoe.txt" 2>&1
      tune_end tuned_tiles_bf16_prefill.json
      grep -h "worst chosen\|shipped\|budget spent\|Error" "$OUT"/log_${name}_*.txt
      # one archive of the reports and logs: the device tool brings back at most 8 files a call
      (cd "$OUT" && tar czf $name.tgz tune_tiles_sorted_*bf16_prefill* log_${name}_* \
        && rm tune_tiles_sorted_*bf16_prefill* log_${name}_*) ;;
    tune_decode_bf16|tune_decode_fp8)
      # per shape the token counts of regimes 0 and 1 only (rows per expert = ceil(T * K / E) <= 16)
      tune_begin aside
      kind=${name#tune_decode_}
      for cell in qwen3:1,2,4,8,16,32,64,128,256 mixtral,dsv3:1,2,4,8,16,32,64 gpt_oss:1,2,4,8,16,32,64,128; do
        timeout 170 python3 bench/tune_tiles.py --sorted --kinds $kind --warm 4 --budget-s 120 --ship --out $OUT \
          --shapes ${cell%%:*} --tokens ${cell#*:} --tag decode_${kind}_${cell%%[:,]*} >> "$OUT/log_$name.txt" 2>&1
      done
      tune_end tuned_tiles_decode_$kind.json restore
      grep -h "worst chosen\|shipped\|budget spent\|Error" "$OUT/log_$name.txt" ;;
    tune_bf16_qwen3)
      # the Qwen3 third of tune_bf16_prefill (T > 1024), where 21% of the 128-row tiles' rows are padding: the
      # 64x256 candidate (configs.regime_candidates) beside the others; the table comes back, the tree keeps its own
      tune_begin aside
      timeout 230 python3 $TUNE_BF16 --budget-s 170 --shapes qwen3 --tokens 2048,3072,4096,8192,16384 \
        --tag bf16_prefill_qwen3 > "$OUT/log_$name.txt" 2>&1
      tune_end tuned_tiles_bf16_qwen3.json restore
      grep -h "worst chosen\|shipped\|budget spent\|Error" "$OUT/log_$name.txt" ;;
    layer)
      timeout 590 python3 $LAYER --tag layer > "$OUT/log_$name.txt" 2>&1
      grep -h -E "^\| (qwen3|mixtral|dsv3)" "$OUT"/moe_layer_*layer.md 2>/dev/null | cut -c1-220 ;;
    fwd_flat)
      timeout 590 python3 $E2E_FLAT --tag flat > "$OUT/log_$name.txt" 2>&1
      grep -h -E "^\| (qwen3|mixtral|olmoe|gpt_oss|deepseek_v3)" "$OUT"/*flat.md 2>/dev/null | cut -c1-260 ;;
    fwd_flat_1|fwd_flat_2)
      models=$([ $name = fwd_flat_1 ] && echo qwen3,mixtral,olmoe || echo gpt_oss,deepseek_v3)
      timeout 590 python3 $E2E_FLAT --models $models --tag $name > "$OUT/log_$name.txt" 2>&1
      grep -h -E "^\| (qwen3|mixtral|olmoe|gpt_oss|deepseek_v3)" "$OUT"/*$name.md 2>/dev/null | cut -c1-260 ;;
    slot_down)
      # timeouts sized so the tests and four runs fit one call: 150 + 4 x 105 s
      timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_triton_sorted.py -k one_launch \
        > "$OUT/pytest_gpu_$name.log" 2>&1
      grep -E "FAILED|ERROR|passed|failed" "$OUT/pytest_gpu_$name.log" | cut -c1-200 | tail -5
      n=0
      for tile in shipped "{'block_n':16,'block_k':128,'num_warps':4,'num_stages':6}" \
          "{'block_n':32,'block_k':256,'num_warps':4,'num_stages':4}" "{'block_n':16,'block_k':512,'num_warps':8,'num_stages':3}"; do
        n=$((n + 1))
        set_tile=$([ "$tile" = shipped ] || echo "--set triton.grouped_gemm.SLOT_DOWN_TILE=$tile")
        timeout 105 python3 $SLOT_DOWN $set_tile --tag tile$n > "$OUT/log_${name}_$n.txt" 2>&1
        echo "tile$n $tile"; grep -h -E "^\| (qwen3|mixtral|gpt_oss)" "$OUT"/slot_down_*tile$n.md 2>/dev/null | cut -c1-220
      done ;;
    breakdown_prefill)
      timeout 280 python3 $BREAKDOWN --tag prefill > "$OUT/log_$name.txt" 2>&1
      timeout 200 python3 $BREAKDOWN --shapes qwen3 --fp8 --tag prefill_fp8 >> "$OUT/log_$name.txt" 2>&1
      grep -h -E "^\| (qwen3|mixtral|gpt_oss)" "$OUT"/kernel_breakdown_*prefill*.md 2>/dev/null | cut -c1-400 ;;
    breakdown_decode)
      timeout 150 python3 $BREAKDOWN --shapes qwen3,gpt_oss --tokens 1,16 --tag decode > "$OUT/log_$name.txt" 2>&1
      timeout 150 python3 $BREAKDOWN --shapes qwen3,gpt_oss --tokens 1,16 --fp8 --tag decode_fp8 >> "$OUT/log_$name.txt" 2>&1
      grep -h -E "^\| (qwen3|gpt_oss)" "$OUT"/kernel_breakdown_*decode*.md 2>/dev/null | cut -c1-400 ;;
    breakdown_plain)
      timeout 200 python3 $BREAKDOWN --shapes mixtral,dsv3,qwen3 --tokens 1,16 --plain --tag plain > "$OUT/log_$name.txt" 2>&1
      timeout 200 python3 $BREAKDOWN --shapes mixtral,dsv3,qwen3 --tokens 1,16 --plain --fp8 --tag plain_fp8 \
        >> "$OUT/log_$name.txt" 2>&1
      grep -h -E "^\| (qwen3|mixtral|dsv3)" "$OUT"/kernel_breakdown_*plain*.md 2>/dev/null | cut -c1-400 ;;
    layout_copy)
      timeout 400 python3 bench/layout_copy.py --out "$OUT" --tag layout_copy > "$OUT/log_$name.txt" 2>&1
      grep -h -E "^\| (qwen3|mixtral|dsv3)" "$OUT"/layout_copy_*.md 2>/dev/null | cut -c1-200 ;;
    epilogue_prefill)
      timeout 560 python3 $EPILOGUE --tag prefill > "$OUT/log_$name.txt" 2>&1
      grep -h -E "^\| (qwen3|mixtral)" "$OUT"/fused_activation_*prefill.md 2>/dev/null | cut -c1-220 ;;
    w8a16)
      timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_triton_sorted.py -k fp8_weights_at_decode \
        > "$OUT/pytest_gpu_$name.log" 2>&1
      grep -E "FAILED|ERROR|passed|failed" "$OUT/pytest_gpu_$name.log" | cut -c1-200 | tail -10
      timeout 280 python3 $W8A16 --tag w8a16_fold > "$OUT/log_$name.txt" 2>&1
      grep -h -E "^\| (qwen3|mixtral|dsv3|gpt_oss)" "$OUT"/*w8a16_fold.md 2>/dev/null | cut -c1-200
      timeout 100 python3 $BREAKDOWN --shapes qwen3,gpt_oss --tokens 1,16 --fp8 --tag decode_fp8_w8a16 \
        --set masked_experts.pipeline.W8A16_MAX_ROWS=16 >> "$OUT/log_$name.txt" 2>&1
      grep -h -E "^\| (qwen3|gpt_oss)" "$OUT"/kernel_breakdown_*decode_fp8_w8a16.md 2>/dev/null | cut -c1-400 ;;
    full_mixtral)
      timeout 590 python3 $E2E_FULL --tokens 16,1024,4096 --rounds 3 --no-generate --tag full_mixtral \
        > "$OUT/log_$name.txt" 2>&1
      grep -h -E "^\| mixtral" "$OUT"/*full_mixtral.md 2>/dev/null | cut -c1-260 ;;
    full_mixtral_gen)
      timeout 590 python3 $E2E_FULL --tokens 32 --no-forward --gen-batch 1 --gen-new 32 --gen-rounds 3 \
        --tag full_mixtral_gen > "$OUT/log_$name.txt" 2>&1
      grep -h -E "^\| mixtral" "$OUT"/*full_mixtral_gen.md 2>/dev/null | cut -c1-260 ;;
    qwen3_gen32)
      timeout 590 python3 ${E2E_GEN/--models gpt_oss --layers full/--models qwen3 --layers 32 --share-weights} \
        --tag qwen3_gen32 > "$OUT/log_$name.txt" 2>&1
      grep -h -E "^\| qwen3" "$OUT"/*qwen3_gen32.md 2>/dev/null | cut -c1-260 ;;
    peer_vllm)
      peer_run "$name" --shapes qwen3,mixtral ;;
    peer_vllm_more)
      peer_run "$name" --shapes dsv3,gpt_oss ;;
    peer_issue)
      peer_run "$name" --cells "$PEER_ISSUE_CELLS" ;;
    peer_mixtral256)
      peer_run "$name" --cells mixtral:256 --dtypes bf16 --rounds 7 --kernels ;;
    dg_tests)
      need_deepgemm || continue
      timeout 400 python3 -m pytest -q -p no:cacheprovider -m gpu -n 4 -rs tests/test_deepgemm_gpu.py \
        > "$OUT/pytest_gpu_$name.log" 2>&1
      grep -E "FAILED|ERROR|SKIPPED|passed|failed" "$OUT/pytest_gpu_$name.log" | cut -c1-200 | tail -20 ;;
    dg_peer)
      need_deepgemm || continue
      peer_run "$name" --shapes qwen3,mixtral,dsv3 --auto --tokens 1024,4096,16384 --rounds 3 ;;
    dg_breakdown_fp8)
      need_deepgemm || continue
      timeout 400 python3 $BREAKDOWN --shapes dsv3,mixtral,qwen3 --tokens 1024,4096,16384 --fp8 --kernel-choice auto \
        --tag prefill_fp8_dg > "$OUT/log_$name.txt" 2>&1
      grep -h -E "^\| (qwen3|mixtral|dsv3)" "$OUT"/kernel_breakdown_*prefill_fp8_dg.md 2>/dev/null | cut -c1-600 ;;
    dg_switches)
      need_deepgemm || continue
      # DG_PRINT_CONFIGS: DeepGEMM logs each GEMM's tiles and SMs once, what the hint decides
      DG_PRINT_CONFIGS=1 timeout 180 python3 $DG_HINT --tag slack64 > "$OUT/log_${name}_slack64.txt" 2>&1
      timeout 140 python3 $SCALE_SCRATCH > "$OUT/log_${name}_scratch.txt" 2>&1
      DG_PRINT_CONFIGS=1 timeout 140 python3 $DG_HINT --on 1000000 --tag max_m > "$OUT/log_${name}_max_m.txt" 2>&1
      grep -h -E "^\| (qwen3|mixtral|dsv3)" "$OUT"/dg_hint_*.md "$OUT"/scale_scratch_*.md 2>/dev/null | cut -c1-200 ;;
    dg_fwd_fp8)
      need_deepgemm || continue
      timeout 590 python3 ${E2E_FP8/--no-deepgemm/} --tag fp8_checkpoint_dg > "$OUT/log_$name.txt" 2>&1
      grep -h -E "^\| (qwen3|mixtral|olmoe)" "$OUT"/*fp8_checkpoint_dg.md 2>/dev/null | cut -c1-260 ;;
    dg_fwd_q8)
      need_deepgemm || continue
      timeout 590 python3 ${E2E_FP8/--no-deepgemm/} --weights quantize_fp8 --tag quantize_fp8_dg > "$OUT/log_$name.txt" 2>&1
      grep -h -E "^\| (qwen3|mixtral|olmoe)" "$OUT"/*quantize_fp8_dg.md 2>/dev/null | cut -c1-260 ;;
    dg_fwd)
      need_deepgemm || continue
      timeout 590 python3 ${E2E_FLAT/--no-deepgemm/} --models qwen3,mixtral,olmoe,deepseek_v3 --tokens 1024,4096 \
        --tag flat_dg > "$OUT/log_$name.txt" 2>&1
      grep -h -E "^\| (qwen3|mixtral|olmoe|deepseek_v3)" "$OUT"/*flat_dg.md 2>/dev/null | cut -c1-260 ;;
    *)
      echo "unknown recipe $name (see the head of $0)"; exit 2 ;;
  esac
  pack "$name"
done
