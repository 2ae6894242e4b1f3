#!/usr/bin/env bash
# The one command for the GPU machine (run through the device tool from the repo root):
# builds the C++ library and tests and the Python package for the GPU there, runs every test with
# no GPU skips allowed, runs the GPU tests under compute-sanitizer memcheck, then the benchmark.
# Logs go to $OUT/logs.tar.gz, benchmark JSON and Markdown to $OUT/results.tar.gz (to commit
# under bench/results/).
#
#   OUT=/tmp/out bash scripts/gpu_check.sh [--no-bench] [--no-sanitizer] [--bench-only]
#
# The whole run can pass the device tool's 10-minute limit per call: then run it as two calls,
# --no-bench and --bench-only.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/llmk-gpu-check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 LLMK_REQUIRE_GPU=1
PY=${PYTHON:-python3}
ARCH=${LLMK_CUDA_ARCH:-90a}
bench=1 sanitizer=1 tests=1
for a in "$@"; do
  case "$a" in --no-bench) bench=0 ;; --no-sanitizer) sanitizer=0 ;; --bench-only) tests=0 sanitizer=0 ;; *) echo "unknown option $a"; exit 2 ;; esac
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

if [ $tests = 1 ]; then
gtest=()
[ -d .carry/googletest ] && gtest=(-DLLMK_GTEST_SOURCE_DIR="$PWD/.carry/googletest")
run cmake_configure cmake -S . -B build/gpu -G Ninja -DLLMK_GPU=cuda -DCMAKE_CUDA_ARCHITECTURES="$ARCH" "${gtest[@]}"
run cmake_build cmake --build build/gpu -j "$(nproc)"
run cpp_tests build/gpu/llmk_tests --gtest_brief=1
grep -q "SKIPPED" "$OUT/cpp_tests.log" && { note "cpp_tests: some tests SKIPPED"; status=1; }
fi

run pip_install "$PY" -m pip install --no-build-isolation --no-deps -v -C cmake.define.CMAKE_CUDA_ARCHITECTURES="$ARCH" .
run probe llm-kernels probe
cat "$OUT/probe.log"
xdist=(); "$PY" -c "import xdist" 2>/dev/null && xdist=(-n 8)  # correctness tests share the GPU fine
[ $tests = 1 ] && run pytest "$PY" -m pytest -v -rs "${xdist[@]}" tests/python -p no:cacheprovider
[ $tests = 1 ] && grep -E "SKIPPED.*(GPU|gpu)" "$OUT/pytest.log" && { note "pytest: GPU tests SKIPPED"; status=1; }

if [ $sanitizer = 1 ]; then
  run memcheck_cpp compute-sanitizer --tool memcheck --error-exitcode 1 build/gpu/llmk_tests \
    --gtest_brief=1 --gtest_filter='*gpu*'
  # Without the caching allocator every tensor is its own allocation, so memcheck sees overruns.
  run memcheck_py env PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck \
    --error-exitcode 1 "$PY" -m pytest -v -x tests/python -p no:cacheprovider \
    -k "cuda and not compile and not opcheck and not cli"
fi

if [ $bench = 1 ]; then
  R="$OUT/results"; mkdir -p "$R"
  bench_run() {  # bench_run NAME CMD...: results in $R/NAME.json and .md, shown in the log
    local name=$1; shift
    run "bench_$name" "$@" --json "$R/$name.json" --md "$R/$name.md"
    [ -f "$R/$name.md" ] && cat "$R/$name.md"
    tar -czf "$OUT/results.tar.gz" -C "$R" .  # after each, so a run stopped at its limit keeps them
  }
  bench_run attention llm-kernels bench-attention
  bench_run decode llm-kernels bench-decode
  bench_run monarch llm-kernels bench-monarch
  bench_run e2e llm-kernels e2e --budget-s 90
  # shellcheck disable=SC2086  # LLMK_BENCH_ARGS: e.g. "--op rope --op swiglu" to bench a subset
  bench_run h200 llm-kernels bench ${LLMK_BENCH_ARGS:-}
fi
note "done, status $status"
# At most 8 files come back from the device machine: pack the results and the logs.
[ -d "$OUT/results" ] && rm -rf "$OUT/results"
mkdir -p "$OUT/keep" && mv "$OUT"/*.log "$OUT/keep/" 2>/dev/null
tar -czf "$OUT/logs.tar.gz" -C "$OUT/keep" . && rm -rf "$OUT/keep"
exit $status
