#!/usr/bin/env bash
# The draft step at its floor (issue 32), one device call: build, the GPU tests of what the draft step runs, then the
# step benchmark (with the draft's kernel profile). Writes logs and results under $OUT.
# Knobs: TESTS=0 skips the tests, TESTS=ops runs only the op tests, TESTS_LAST=1 runs the decode tests after the
# benchmark; MODELS / CONTEXTS / TREES pick the benchmark rows; PROFILE=0 skips the profile; PROBE=1 runs
# benchmarks/probe_skinny_gemm.py (with PROBE_ARGS) while the extension builds (it needs only Triton); SWEEP_BEAM=1
# runs benchmarks/sweep_beam.py (with SWEEP_ARGS) after the tests; GAP=1 runs benchmarks/probe_round_gap.py (with
# GAP_ARGS; the GPU's clocks and power sampled beside it into $OUT/smi.csv) after the sweep; FP8=1 adds the
# float8-weight draft rows (--fp8); BENCH=0 skips the step benchmark; BENCH_ARGS adds arguments to it (e.g.
# --inductor combo_kernels=True --tree-tau FILE).
# Usage: LONGSPEC_GIT_SHA=$(git rev-parse --short HEAD) bash benchmarks/run_draft_step.sh
set -uo pipefail
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 LONGSPEC_BENCH_OUT="$OUT"
start=$(date +%s)
elapsed() { echo "[$(( $(date +%s) - start )) s] $*"; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader
LONGSPEC_BUILD_EXT=1 LONGSPEC_CUDA_ARCHS=9.0 MAX_JOBS=16 python3 -m pip install -e . --no-build-isolation --no-deps -q \
  > "$OUT/build.log" 2>&1 &
build=$!
if [ "${PROBE:-0}" = 1 ]; then
  timeout 200 python3 -m benchmarks.probe_skinny_gemm ${PROBE_ARGS:-} --out "$OUT" > "$OUT/probe.log" 2>&1
  elapsed "probe rc $?"; cat "$OUT/probe.log"
fi
wait $build || { tail -30 "$OUT/build.log"; exit 1; }
elapsed "built; has_cuda_kernels $(python3 -c 'import longspec_ops; print(longspec_ops.has_cuda_kernels())')"
if [ "${TESTS:-1}" != 0 ]; then
  timeout 240 python3 -m pytest -q -x -p no:cacheprovider tests/ops/test_beam_kernel.py tests/ops/test_gpu_attention.py \
    tests/ops/test_triton_kernels.py tests/ops/test_fused_linear.py tests/model/test_draft_fused.py \
    -k "${OPS_K:-beam or more_tree_keys or hybrid or opcheck or capture or tree or fused or drafting_path}" \
    > "$OUT/tests_ops.log" 2>&1
  elapsed "op tests: $(tail -1 "$OUT/tests_ops.log")"
fi
if [ "${SWEEP_BEAM:-0}" = 1 ]; then
  timeout "${SWEEP_TIMEOUT:-200}" python3 -m benchmarks.sweep_beam ${SWEEP_ARGS:-} --out "$OUT" > "$OUT/sweep_beam.log" 2>&1
  elapsed "sweep_beam rc $?"; grep -v "^ " "$OUT/sweep_beam.log" | tail -12
fi
if [ "${GAP:-0}" = 1 ]; then
  why=clocks_event_reasons.active  # the older drivers' name: clocks_throttle_reasons.active
  nvidia-smi --query-gpu=$why --format=csv > /dev/null 2>&1 || why=clocks_throttle_reasons.active
  nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,$why --format=csv -lms 250 \
    > "$OUT/smi.csv" 2>&1 &
  smi=$!
  # shellcheck disable=SC2086
  timeout "${GAP_TIMEOUT:-330}" python3 -m benchmarks.probe_round_gap ${GAP_ARGS:-} --out "$OUT" > "$OUT/gap.log" 2>&1
  rc=$?; kill $smi
  elapsed "round gap probe rc $rc"; tail -60 "$OUT/gap.log" | cut -c1-200
fi
decode_tests() {
  timeout "${DECODE_TIMEOUT:-240}" python3 -m pytest -q -p no:cacheprovider tests/decode/test_gpu_decoder.py \
    -k "fp32_speculative_equals_plain or bf16_speculative or graphed_tail or compiled_rounds" \
    > "$OUT/tests_decode.log" 2>&1
  elapsed "decode tests: $(tail -1 "$OUT/tests_decode.log")"
}
[ "${TESTS:-1}" = 1 ] && [ "${TESTS_LAST:-0}" != 1 ] && decode_tests
profile=$([ "${PROFILE:-1}" = 1 ] && echo --profile)
fp8=$([ "${FP8:-0}" = 1 ] && echo --fp8)
if [ "${BENCH:-1}" = 1 ]; then
  # shellcheck disable=SC2086
  timeout "${BENCH_TIMEOUT:-420}" python3 -m benchmarks.bench_step_latency --models ${MODELS:-Llama-3-8B pair} \
    --contexts ${CONTEXTS:-32768} --trees ${TREES:-4-16-16-16-16} --compile on $profile $fp8 ${BENCH_ARGS:-} --out "$OUT" \
    > "$OUT/bench.log" 2>&1
  elapsed "bench rc $?"
  grep -v "^{" "$OUT/bench.log" | tail -20
fi
[ "${TESTS:-1}" = 1 ] && [ "${TESTS_LAST:-0}" = 1 ] && decode_tests
exit 0
