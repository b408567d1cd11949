#!/usr/bin/env bash
# The trained pair on one H200 (issue 7), in three device calls of < 10 minutes each. Each phase leaves its work in
# $PAIR_DIR (default /tmp/pair) for the next one and returns what a fresh machine would need under $OUT as
# 15 MB tar parts; a phase that finds no $PAIR_DIR restores it from the files of the earlier phases in the tree
# (longspec/assets/code-pair/target and benchmarks/results/h200/recipe.json after phase 1; gpu-carry/pair2 after
# phase 2, carried).
#   phase 1: build the extension and run the engine's GPU tests (background); recipe stages data + target.
#   phase 2: recipe stage drafts (main + the two ablations), export of the shippable pair.
#   phase 3: end-to-end benchmark, the pair's round costs.
#   phase cont: the draft trained on from INIT_DRAFT (default the shipped one) against the shipped target, unchanged
#     (long-context mode with long_steps=0: one more warm-up + cosine schedule of draft_seconds); returns its export.
#     E2E_ARGS: then bench_e2e on the continued pair with these arguments (E2E_SHIPPED=1: and on the shipped pair,
#     into $OUT/shipped); PROFILE=1: then a draft-training step
#     under the profiler (benchmarks/profile_draft_train.py).
#   phase e2e: bench_e2e on the shipped pair (longspec/assets/code-pair) with E2E_ARGS, its held-out split rebuilt
#     from this machine's standard library (what the recipe's corpus stage writes; 32 s on an H100 machine).
# Knobs: SCALE (h200; h200-deep: issue 33's deeper pair; tiny: a CPU rehearsal), TESTS=0 (phase 1 without the build
# and the engine tests), ABLATIONS=0 (phase 2: the main draft only), RECIPE_TIMEOUT (seconds), E2E_ARGS (phase 3's
# bench_e2e arguments after --pair, instead of the default contexts and prompts).
# Usage: bash benchmarks/run_pair.sh 1|2|3|cont|e2e
set -uo pipefail
phase=${1:?usage: run_pair.sh 1|2|3|cont|e2e}
OUT=${OUT:-$PWD/gpu-out}
PAIR=${PAIR_DIR:-/tmp/pair}
SCALE=${SCALE:-h200}
TESTS=${TESTS:-1} ABLATIONS=${ABLATIONS:-1} RECIPE_TIMEOUT=${RECIPE_TIMEOUT:-}
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
  [ "$TESTS" = 1 ] && ( build && elapsed "built" && timeout 300 python3 -m pytest -q tests/decode/test_gpu_decoder.py -p no:cacheprovider \
      > "$OUT/tests_decode.log" 2>&1; elapsed "engine GPU tests: $(tail -1 "$OUT/tests_decode.log")" ) &
  timeout "${RECIPE_TIMEOUT:-500}" python3 -m longspec.recipes.code_pair --out "$PAIR" --scale "$SCALE" \
    --stages data target \
    > "$OUT/recipe1.log" 2>&1
  elapsed "recipe data+target exit $?"; grep -v "^target step" "$OUT/recipe1.log" | tail -20
  grep "^target step" "$OUT/recipe1.log" | awk 'NR % 10 == 1' | tail -12
  wait
  tar -C "$PAIR" -cf - target recipe.json | split -b 15m - "$OUT/pair1.tar."
  ;;
2)
  if [ ! -f "$PAIR/recipe.json" ] && ls gpu-carry/pair1.tar.* > /dev/null 2>&1; then
    elapsed "fresh machine: restoring the target from phase 1's files"; mkdir -p "$PAIR"
    cat gpu-carry/pair1.tar.* | tar -C "$PAIR" -xf - || exit 1
  elif [ ! -f "$PAIR/recipe.json" ]; then
    elapsed "fresh machine: restoring the shipped target"; mkdir -p "$PAIR"
    cp -r longspec/assets/code-pair/target "$PAIR/target" && cp benchmarks/results/h200/recipe.json "$PAIR/" || exit 1
  fi
  ablations=(); [ "$ABLATIONS" = 1 ] && ablations=(--ablations)
  timeout "${RECIPE_TIMEOUT:-540}" python3 -m longspec.recipes.code_pair --out "$PAIR" --scale "$SCALE" \
    --stages drafts "${ablations[@]}" \
    --export "$PAIR/export" > "$OUT/recipe2.log" 2>&1
  elapsed "recipe drafts exit $?"; tail -8 "$OUT/recipe2.log"
  (cd "$PAIR" && tar -cf - recipe.json export/draft export/pair.json draft*/checkpoint-*/config.json \
      draft*/checkpoint-*/model.safetensors) | split -b 15m - "$OUT/pair2.tar."
  ;;
3)
  if [ ! -f "$PAIR/recipe.json" ] || ! grep -q '"draft"' "$PAIR/recipe.json"; then
    elapsed "fresh machine: restoring the pair"; mkdir -p "$PAIR"
    if ls gpu-carry/pair1.tar.* > /dev/null 2>&1; then cat gpu-carry/pair1.tar.* | tar -C "$PAIR" -xf - || exit 1
    else cp -r longspec/assets/code-pair/target "$PAIR/target" || exit 1; fi
    cat gpu-carry/pair2.tar* | tar -C "$PAIR" -xf - || exit 1
  fi
  [ -f "$PAIR/corpus/heldout.jsonl" ] || python3 -m longspec.recipes.code_pair --out "$PAIR" --scale "$SCALE" --stages data
  build; elapsed "built: $(python3 -c 'import longspec_ops; print(longspec_ops.has_cuda_kernels())')"
  read -ra e2e_args <<< "${E2E_ARGS:---contexts 4096 8192 16384 32768 --prompts 3 --new-tokens 256}"
  timeout 330 python3 -m benchmarks.bench_e2e --pair "$PAIR" "${e2e_args[@]}" --out "$OUT" 2>&1 | tail -70
  elapsed "e2e done"
  timeout 200 python3 -m benchmarks.bench_step_latency --models pair --out "$OUT" 2>&1 | grep -v "^{" | tail -12
  elapsed "step latency done"
  ;;
cont)
  INIT_DRAFT=${INIT_DRAFT:-longspec/assets/code-pair/draft}
  read -ra cont_set <<< "${CONT_SET:-}"
  timeout "${RECIPE_TIMEOUT:-560}" python3 -m longspec.recipes.code_pair --out "$PAIR" --scale "$SCALE" \
    --init-target longspec/assets/code-pair/target --init-draft "$INIT_DRAFT" --stages target drafts \
    --set long_steps=0 --set long_from_seq=131072 --set long_to_seq=131072 "${cont_set[@]}" \
    --export "$PAIR/export" > "$OUT/recipe_cont.log" 2>&1
  elapsed "recipe draft continuation exit $?"; grep -v "Writing model\|Loading weights" "$OUT/recipe_cont.log" | tail -8
  cp "$PAIR/recipe.json" "$OUT/recipe_cont.json"
  if [ -n "${E2E_ARGS:-}" ]; then  # the continued draft end to end (its recipe directory is a pair)
    eval "e2e_args=($E2E_ARGS)"  # quoted method names keep their spaces
    timeout "${E2E_TIMEOUT:-200}" python3 -m benchmarks.bench_e2e --pair "$PAIR" "${e2e_args[@]}" --out "$OUT" 2>&1 \
      | grep -v "Loading weights\|Writing model" | tail -30
    elapsed "e2e done"
    if [ "${E2E_SHIPPED:-0}" = 1 ]; then  # the shipped pair on the same prompts, for the comparison
      timeout "${E2E_TIMEOUT:-200}" python3 -m benchmarks.bench_e2e --pair longspec/assets/code-pair \
        --heldout "$PAIR/corpus/heldout.jsonl" "${e2e_args[@]}" --out "$OUT/shipped" 2>&1 \
        | grep -v "Loading weights\|Writing model" | tail -30
      elapsed "e2e of the shipped pair done"
    fi
  fi
  [ "${PROFILE:-0}" = 1 ] && { timeout "${PROFILE_TIMEOUT:-90}" python3 -m benchmarks.profile_draft_train --data "$PAIR/corpus/draft.jsonl" \
      --steps 10 --out "$OUT" 2>&1 | head -45; elapsed "profile done"; }
  (cd "$PAIR" && tar -cf - export/draft export/pair.json) | split -b 15m - "$OUT/cont.tar."
  ;;
e2e)
  [ -s "$PAIR/corpus/heldout.jsonl" ] || python3 -c "import sys; from longspec.train.corpus import build_corpus
build_corpus(sys.argv[1], splits=('heldout',))" "$PAIR/corpus" || exit 1
  build; elapsed "held-out split and build: $(python3 -c 'import longspec_ops; print(longspec_ops.has_cuda_kernels())')"
  eval "e2e_args=(${E2E_ARGS:?phase e2e needs E2E_ARGS (bench_e2e arguments after --pair)})"
  timeout "${E2E_TIMEOUT:-540}" python3 -m benchmarks.bench_e2e --pair longspec/assets/code-pair \
    --heldout "$PAIR/corpus/heldout.jsonl" "${e2e_args[@]}" --out "$OUT" 2>&1 | grep -v "Loading weights" | tail -40
  ;;
esac
elapsed "phase $phase done"
