#!/usr/bin/env bash
# One device session: build the extension, run the GPU tests, then the benchmark suites, writing logs and results
# under $OUT (default ./gpu-out). Usage: bash benchmarks/run_gpu.sh [pytest -k expression for the tests]
# The trained pair (recipe + end-to-end benchmark) has its own script: benchmarks/run_pair.sh.
set -uo pipefail
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 LONGSPEC_BENCH_OUT="$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"
start=$(date +%s)
LONGSPEC_BUILD_EXT=1 LONGSPEC_CUDA_ARCHS=9.0 MAX_JOBS=16 python3 -m pip install -e . --no-build-isolation --no-deps -q \
  > /tmp/build.log 2>&1 || { tail -40 /tmp/build.log; exit 1; }
echo "build: $(( $(date +%s) - start )) s"; grep -i "longspec build" /tmp/build.log | head -3
python3 -c "import longspec_ops; print('has_cuda_kernels', longspec_ops.has_cuda_kernels())"
# -n 12: the op grid is ~800 tests dominated by Triton compiles and float32 references (5 min serially, <2 with xdist)
timeout 300 python3 -m pytest -q -n 12 --timeout 120 tests/ops ${1:+-k "$1"} -p no:cacheprovider > "$OUT/tests.log" 2>&1
grep -E "passed|failed|Fatal|Segmentation|Error" "$OUT/tests.log" | head -20
echo "op tests done at $(( $(date +%s) - start )) s"
timeout 200 python3 -m pytest -q tests/decode/test_gpu_decoder.py tests/model -p no:cacheprovider > "$OUT/tests_decode.log" 2>&1
grep -E "passed|failed|Error|first divergence" "$OUT/tests_decode.log" | head -20
echo "decode tests done at $(( $(date +%s) - start )) s"
if [ "${SANITIZE:-0}" = 1 ]; then  # memcheck on a small subset (Firecracker machines run compute-sanitizer)
  timeout 400 compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest -q -p no:cacheprovider \
    tests/ops/test_csrc_build.py tests/ops/test_gpu_attention.py -k "small_grid and 3-69-97-heads0 or commit_matches or merge_matches_reference and contiguous" \
    > "$OUT/sanitizer.log" 2>&1; echo "compute-sanitizer exit $?"; grep -E "ERROR SUMMARY|passed|failed" "$OUT/sanitizer.log" | tail -3
fi
if [ "${SWEEP:-0}" = 1 ]; then
  timeout 300 python3 -m benchmarks.sweep_attention --quick --cases "${SWEEP_CASES:-tree-32768,decode-32768}" --out /tmp 2>&1 | grep -v "^\s*$" | head -40
fi
if [ "${SKIP_BENCH:-0}" != 1 ]; then
  timeout 240 python3 -m pytest -q --tb=short benchmarks/test_attention.py --benchmark-enable -p no:cacheprovider > "$OUT/bench.log" 2>&1; grep -E "^E |passed|failed" "$OUT/bench.log" | head -12
  cat "$OUT/attention.md" 2>/dev/null
fi
if [ "${E2E:-1}" = 1 ]; then
  timeout 300 python3 -m benchmarks.bench_step_latency --models pair --out "$OUT" 2>&1 | grep -v "^{" | tail -12
  [ "${TRAIN:-1}" = 1 ] && timeout 120 python3 -m benchmarks.bench_train --steps 30 --out "$OUT" 2>&1 | tail -3
fi
echo "total $(( $(date +%s) - start )) s"
