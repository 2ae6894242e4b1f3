#!/usr/bin/env bash
# The one command for the GPU machine (run through the device tool from the repo root):
# builds the C++ library and tests and the Python package for the GPU there, runs every test with
# no GPU skips allowed, runs the GPU tests under compute-sanitizer memcheck, then the benchmark.
# Logs and results go to $OUT (bench/results/<gpu>.json and .md are written there to commit).
#
#   OUT=/tmp/out bash scripts/gpu_check.sh [--no-bench] [--no-sanitizer]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/llmk-gpu-check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 LLMK_REQUIRE_GPU=1
PY=${PYTHON:-python3}
ARCH=${LLMK_CUDA_ARCH:-90a}
bench=1 sanitizer=1
for a in "$@"; do
  case "$a" in --no-bench) bench=0 ;; --no-sanitizer) sanitizer=0 ;; *) echo "unknown option $a"; exit 2 ;; esac
done
status=0
note() { echo "== $(date +%T) $*" | tee -a "$OUT/summary.txt"; }
run() {  # run NAME CMD...: log to $OUT/NAME.log, remember failures
  local name=$1; shift
  note "$name: $*"
  if "$@" >"$OUT/$name.log" 2>&1; then note "$name: ok"; else note "$name: FAILED (rc $?)"; status=1; fi
  tail -n 5 "$OUT/$name.log"
}

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"

gtest=()
[ -d .carry/googletest ] && gtest=(-DLLMK_GTEST_SOURCE_DIR="$PWD/.carry/googletest")
run cmake_configure cmake -S . -B build/gpu -G Ninja -DLLMK_GPU=cuda -DCMAKE_CUDA_ARCHITECTURES="$ARCH" "${gtest[@]}"
run cmake_build cmake --build build/gpu -j "$(nproc)"
run cpp_tests build/gpu/llmk_tests --gtest_brief=1
grep -q "SKIPPED" "$OUT/cpp_tests.log" && { note "cpp_tests: some tests SKIPPED"; status=1; }

run pip_install "$PY" -m pip install --no-build-isolation --no-deps -v -C cmake.define.CMAKE_CUDA_ARCHITECTURES="$ARCH" .
run probe llm-kernels probe
cat "$OUT/probe.log"
run pytest "$PY" -m pytest -v -rs tests/python -p no:cacheprovider
grep -E "SKIPPED.*(GPU|gpu)" "$OUT/pytest.log" && { note "pytest: GPU tests SKIPPED"; status=1; }

if [ $sanitizer = 1 ]; then
  run memcheck_cpp compute-sanitizer --tool memcheck --error-exitcode 1 build/gpu/llmk_tests \
    --gtest_brief=1 --gtest_filter='*gpu*'
  # Without the caching allocator every tensor is its own allocation, so memcheck sees overruns.
  run memcheck_py env PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck \
    --error-exitcode 1 "$PY" -m pytest -v -x tests/python -p no:cacheprovider \
    -k "cuda and not compile and not opcheck and not cli"
fi

if [ $bench = 1 ]; then
  run bench llm-kernels bench --json "$OUT/h200.json" --md "$OUT/h200.md"
  cat "$OUT/h200.md"
  run bench_attention llm-kernels bench-attention --json "$OUT/attention.json" --md "$OUT/attention.md"
  cat "$OUT/attention.md"
fi
note "done, status $status"
# At most 8 files come back from the device machine: keep results apart, pack the logs.
mkdir -p "$OUT/keep" && mv "$OUT"/*.log "$OUT/keep/" 2>/dev/null
tar -czf "$OUT/logs.tar.gz" -C "$OUT/keep" . && rm -rf "$OUT/keep"
exit $status
