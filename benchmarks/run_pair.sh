#!/usr/bin/env bash
# The trained pair on one H200 (issue 7), in three device calls of < 10 minutes each. Each phase leaves its work in
# $PAIR_DIR (default /tmp/pair) for the next one and returns what a fresh machine would need under $OUT as
# 15 MB tar parts; a phase that finds no $PAIR_DIR restores it from the files of the earlier phases in the tree
# (longspec/assets/code-pair/target and benchmarks/results/h200/recipe.json after phase 1; gpu-carry/pair2 after
# phase 2, carried).
#   phase 1: build the extension and run the engine's GPU tests (background); recipe stages data + target.
#   phase 2: recipe stage drafts (main + the two ablations), export of the shippable pair.
#   phase 3: end-to-end benchmark, the pair's round costs.
# Usage: bash benchmarks/run_pair.sh 1|2|3
set -uo pipefail
phase=${1:?usage: run_pair.sh 1|2|3}
OUT=${OUT:-$PWD/gpu-out}
PAIR=${PAIR_DIR:-/tmp/pair}
SCALE=${SCALE:-h200}  # tiny: a CPU rehearsal of the script
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 LONGSPEC_BENCH_OUT="$OUT"
start=$(date +%s)
elapsed() { echo "[$(( $(date +%s) - start )) s] $*"; }
build() {
  [ "${SKIP_BUILD:-0}" = 1 ] && return 0
  python3 -c "import longspec_ops, sys; sys.exit(0 if longspec_ops.has_cuda_kernels() else 1)" 2>/dev/null && return 0
  LONGSPEC_BUILD_EXT=1 LONGSPEC_CUDA_ARCHS=9.0 MAX_JOBS=8 python3 -m pip install -e . --no-build-isolation --no-deps -q \
    > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; return 1; }
}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"

case $phase in
1)
  ( build && elapsed "built" && timeout 300 python3 -m pytest -q tests/decode/test_gpu_decoder.py -p no:cacheprovider \
      > "$OUT/tests_decode.log" 2>&1; elapsed "engine GPU tests: $(tail -1 "$OUT/tests_decode.log")" ) &
  timeout 500 python3 -m longspec.recipes.code_pair --out "$PAIR" --scale "$SCALE" --stages data target \
    > "$OUT/recipe1.log" 2>&1
  elapsed "recipe data+target exit $?"; grep -v "^target step" "$OUT/recipe1.log" | tail -20
  grep "^target step" "$OUT/recipe1.log" | awk 'NR % 10 == 1' | tail -12
  wait
  tar -C "$PAIR" -cf - target recipe.json | split -b 15m - "$OUT/pair1.tar."
  ;;
2)
  if [ ! -f "$PAIR/recipe.json" ]; then
    elapsed "fresh machine: restoring the target"; mkdir -p "$PAIR"
    cp -r longspec/assets/code-pair/target "$PAIR/target" && cp benchmarks/results/h200/recipe.json "$PAIR/" || exit 1
  fi
  timeout 540 python3 -m longspec.recipes.code_pair --out "$PAIR" --scale "$SCALE" --stages drafts --ablations \
    --export "$PAIR/export" > "$OUT/recipe2.log" 2>&1
  elapsed "recipe drafts exit $?"; tail -8 "$OUT/recipe2.log"
  (cd "$PAIR" && tar -cf - recipe.json export/draft export/pair.json draft*/checkpoint-*/config.json \
      draft*/checkpoint-*/model.safetensors) | split -b 15m - "$OUT/pair2.tar."
  ;;
3)
  if [ ! -f "$PAIR/recipe.json" ] || ! grep -q ablations "$PAIR/recipe.json"; then
    elapsed "fresh machine: restoring the pair"; mkdir -p "$PAIR"
    cp -r longspec/assets/code-pair/target "$PAIR/target" && tar -C "$PAIR" -xf gpu-carry/pair2.tar || exit 1
  fi
  [ -f "$PAIR/corpus/heldout.jsonl" ] || python3 -m longspec.recipes.code_pair --out "$PAIR" --scale "$SCALE" --stages data
  build; elapsed "built: $(python3 -c 'import longspec_ops; print(longspec_ops.has_cuda_kernels())')"
  timeout 330 python3 -m benchmarks.bench_e2e --pair "$PAIR" --contexts 4096 8192 16384 32768 --prompts 3 \
    --new-tokens 256 --out "$OUT" 2>&1 | tail -70
  elapsed "e2e done"
  timeout 200 python3 -m benchmarks.bench_step_latency --models pair --out "$OUT" 2>&1 | grep -v "^{" | tail -12
  elapsed "step latency done"
  ;;
esac
elapsed "phase $phase done"
