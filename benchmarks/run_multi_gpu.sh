#!/usr/bin/env bash
# Issue 23's measurements on one host of K >= 2 H200s. NOT YET RUN: written when no multi-GPU machine was lent; the
# code paths it drives are tested on CPU only (gloo, 2 ranks). Results (json/md/png) go under $OUT (default
# ./gpu-out); copy them to benchmarks/results/h200/ with the log lines that say how they were made.
#   1. round cost of Qwen2.5-32B (fits one H200) on 1 GPU, at 32k and 128k committed tokens: the baseline;
#   2. the same and the Qwen2.5-72B shape (~145 GB in bf16, random weights) tensor-parallel on 2, 4 (and 8) GPUs;
#   3. draft training throughput and loss curves, 1 vs 2 vs 4 (vs 8) GPUs, DDP and FSDP2, the same global batch.
# Usage: bash benchmarks/run_multi_gpu.sh [tp|train]   (both when left out)
# Each step is one command below; under a 10-minute limit per call, run them one at a time (the 72B rows at 128k are
# the longest: building the random shards and capturing graphs take minutes).
set -uo pipefail
what=${1:-all}
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 LONGSPEC_BENCH_OUT="$OUT" OMP_NUM_THREADS=8
K=$(nvidia-smi -L | wc -l)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1; echo "GPUs: $K"
python3 -c "import longspec_ops, sys; sys.exit(0 if longspec_ops.has_cuda_kernels() else 1)" 2>/dev/null || \
  LONGSPEC_BUILD_EXT=1 LONGSPEC_CUDA_ARCHS=9.0 MAX_JOBS=16 python3 -m pip install -e . --no-build-isolation --no-deps -q \
    > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
if [ "$what" != train ]; then
  python3 -m benchmarks.bench_step_latency --models Qwen2.5-32B --contexts 32768 131072 --compile off --out "$OUT"
  for k in 2 4 8; do
    [ "$k" -le "$K" ] || break
    # CUDA graphs over NCCL collectives are untried: on failure, the same rows without graphs
    torchrun --nproc-per-node "$k" -m benchmarks.bench_step_latency --tp --models Qwen2.5-32B Qwen2.5-72B \
        --contexts 32768 131072 --compile off --out "$OUT" \
      || torchrun --nproc-per-node "$k" -m benchmarks.bench_step_latency --tp --cuda-graphs off \
        --models Qwen2.5-32B Qwen2.5-72B --contexts 32768 131072 --compile off --out "$OUT"
  done
fi
if [ "$what" != tp ]; then
  W=${WORK:-/tmp/scaling}
  python3 -m longspec.recipes.code_pair --out "$W/recipe" --stages data > "$OUT/data.log" 2>&1 || { tail "$OUT/data.log"; exit 1; }
  ranks=$(for k in 2 4 8; do [ "$k" -le "$K" ] && echo "$k"; done)
  python3 -m benchmarks.bench_scaling --target "$(python3 -m longspec.pretrained target)" \
      --data "$W/recipe/corpus/train.jsonl" --ranks $ranks --global-batch 8 --steps 200 --seq-len 4096 \
      --work "$W/runs" --out "$OUT"
fi
