#!/usr/bin/env bash
# warmup() on the GPU (issues 34, 36), one device call: build, the GPU tests of warm-up and of the decoder's graphs,
# then the first-call benchmark. Writes logs and results under $OUT.
# Knobs: TESTS=0 skips the tests; BENCH=0 skips the benchmark; CONTEXTS, BATCHES pick the benchmark rows.
# Usage: LONGSPEC_GIT_SHA=$(git rev-parse --short HEAD) bash benchmarks/run_warmup.sh
set -uo pipefail
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 LONGSPEC_BENCH_OUT="$OUT"
start=$(date +%s)
elapsed() { echo "[$(( $(date +%s) - start )) s] $*"; }
LONGSPEC_BUILD_EXT=1 LONGSPEC_CUDA_ARCHS=9.0 MAX_JOBS=16 python3 -m pip install -e . --no-build-isolation --no-deps -q \
  > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
elapsed "built"
if [ "${TESTS:-1}" != 0 ]; then
  timeout "${TEST_TIMEOUT:-300}" python3 -m pytest -q -p no:cacheprovider tests/decode/test_gpu_warmup.py \
    tests/decode/test_gpu_decoder.py ${TEST_K:+-k "$TEST_K"} > "$OUT/tests_decode.log" 2>&1
  elapsed "decode tests: $(tail -1 "$OUT/tests_decode.log")"
  grep -E "^(FAILED|ERROR)|Error" "$OUT/tests_decode.log" | head -20
fi
if [ "${BENCH:-1}" != 0 ]; then
  # shellcheck disable=SC2086
  timeout "${BENCH_TIMEOUT:-300}" python3 -m benchmarks.bench_first_call --contexts ${CONTEXTS:-16384 32768} --compile \
    --warmup-batches ${BATCHES:-1 16} --out "$OUT" > "$OUT/bench.log" 2>&1
  elapsed "bench rc $?"
  grep -v "^{" "$OUT/bench.log" | tail -30
fi
