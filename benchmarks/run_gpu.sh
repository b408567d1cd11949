#!/usr/bin/env bash
# One device session: build the extension, run the GPU tests, then the benchmark suites, writing logs and results
# under $OUT (default ./gpu-out). Usage: bash benchmarks/run_gpu.sh [pytest -k expression for the tests]
set -uo pipefail
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 LONGSPEC_BENCH_OUT="$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/env.txt"
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" | tee -a "$OUT/env.txt"
start=$(date +%s)
LONGSPEC_BUILD_EXT=1 LONGSPEC_CUDA_ARCHS=9.0 MAX_JOBS=16 pip install -e . --no-build-isolation --no-deps -q \
  > "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
echo "build: $(( $(date +%s) - start )) s"; grep -i "longspec build" "$OUT/build.log" | head -3
python3 -c "import longspec_ops; print('has_cuda_kernels', longspec_ops.has_cuda_kernels())"
python3 -m pytest -q -x tests/ops ${1:+-k "$1"} -p no:cacheprovider 2>&1 | tail -25 | tee "$OUT/tests.log"
echo "tests done at $(( $(date +%s) - start )) s"
if [ "${SKIP_BENCH:-0}" != 1 ]; then
  python3 -m pytest -q benchmarks/test_attention.py --benchmark-enable -p no:cacheprovider 2>&1 | tail -15 | tee "$OUT/bench.log"
  cat "$OUT/attention.md" 2>/dev/null
fi
echo "total $(( $(date +%s) - start )) s"
