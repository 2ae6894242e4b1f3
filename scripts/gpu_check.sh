#!/usr/bin/env bash
# The one command for the GPU machine (run through the device tool from the repo root):
# builds the C++ library and tests and the Python package for the GPU there, runs every test with
# no GPU skips allowed, runs the GPU tests under compute-sanitizer memcheck, then the benchmark.
# Logs go to $OUT/logs.tar.gz, benchmark JSON and Markdown to $OUT/results.tar.gz (to commit
# under bench/results/).
#
#   OUT=/tmp/out bash scripts/gpu_check.sh [--no-bench] [--no-sanitizer] [--bench-only] [--fast]
#                                          [--no-cpp] [--no-pytest]
#
# --fast: no pip install (the CMake build makes the torch extension too and the package runs from
# python/ on PYTHONPATH), for short device budgets. LLMK_GTEST_FILTER narrows the C++ tests,
# LLMK_PYTEST_FILES pytest (default: tests/python), LLMK_STEPS names a file of further commands to
# run and log (see below), LLMK_MEMCHECK_FILTER the C++ memcheck (default: '*gpu*'),
# LLMK_MEMCHECK_PY=0 skips the Python one (LLMK_MEMCHECK_PY_FILES / LLMK_MEMCHECK_PY_K narrow it,
# LLMK_MEMCHECK_PY_JOBS runs it as that many processes at once, default 1),
# LLMK_BENCHES and LLMK_E2E_BUDGET the benchmarks, LLMK_CUDA_FLAGS extra nvcc flags (e.g. -lineinfo for
# source lines in compute-sanitizer reports). The sanitizer runs last.
#
# The whole run can pass the device tool's 10-minute limit per call: then run it as two calls,
# --no-bench and --bench-only. Even the tests alone do on the H200 (2026-12-03, --fast --no-bench
# --no-sanitizer: build 121 s, C++ 150 s + 42 s, pytest 306 s): then --no-pytest in one call and
# --no-cpp in the next (--no-cpp leaves out both C++ test steps, --no-pytest the plain pytest step).
# A step's log is packed into $OUT/logs.tar.gz every 30 s while it runs, so a step cut off by the
# time limit still leaves what it printed.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
OUT=${OUT:-/tmp/llmk-gpu-check}
mkdir -p "$OUT"
# Logs and results are written outside $OUT and packed into it after every step: at most 8 files
# come back from the device machine, also when a run is stopped at its time limit.
WORK=$(mktemp -d /tmp/llmk-gpu-check.XXXXXX)
LOGS="$WORK/logs" R="$WORK/results"
mkdir -p "$LOGS" "$R"
export PYTHONUNBUFFERED=1 LLMK_REQUIRE_GPU=1
PY=${PYTHON:-python3}
ARCH=${LLMK_CUDA_ARCH:-90a}
bench=1 sanitizer=1 tests=1 fast=0 cpp=1 pytest=1
for a in "$@"; do
  case "$a" in
    --no-bench) bench=0 ;; --no-sanitizer) sanitizer=0 ;; --bench-only) tests=0 sanitizer=0 ;; --fast) fast=1 ;;
    --no-cpp) cpp=0 ;; --no-pytest) pytest=0 ;;
    *) echo "unknown option $a"; exit 2 ;;
  esac
done
status=0
# The summary lines of pytest's -rs in log $1 that skip a test for want of a GPU (none: rc 1)
gpu_skips() { grep -E "^SKIPPED \[[0-9]+\] .*(GPU|gpu)" "$1"; }
# The Python tests under compute-sanitizer's memcheck, without the caching allocator (every tensor
# its own allocation, so memcheck sees overruns; CUDA-graph capture needs the allocator, so the
# graph tests run only in the plain pytest step). The selected tests are collected, dealt round
# robin into LLMK_MEMCHECK_PY_JOBS shares (default 1) and the shares run at once, each its own
# sanitized process stopping at its first failure (logs memcheck_py.N.log): one process ran ~1.4
# tests a second on an H100 (2026-12-06). The selection is every test conftest.py marks llmk_gpu
# (2153 on 2026-12-06; until then `-k cuda` took 1545, missing GPU-only tests without "cuda" in
# their ids, the attention kernels' among them): 8 shares take ~5-7 min, so split it by files
# (LLMK_MEMCHECK_PY_FILES) over calls. LLMK_MEMCHECK=1 tells tests/python/conftest.py to keep
# torch's memory-efficient SDPA (its own out-of-bounds read) out.
# shellcheck disable=SC2317  # called through run
memcheck_py() {
  local jobs=${LLMK_MEMCHECK_PY_JOBS:-1} list="$WORK/memcheck_py.tests" rc=0 i=0 share pid
  local pids=()
  [[ $jobs =~ ^[1-9][0-9]{0,2}$ ]] || { echo "memcheck_py: LLMK_MEMCHECK_PY_JOBS=$jobs is not 1..999"; return 1; }
  # the collection's own log; a module that fails to import fails the step (pytest rc 2), as it
  # did the single run
  # shellcheck disable=SC2086  # a list of files
  "$PY" -m pytest --collect-only -q ${LLMK_MEMCHECK_PY_FILES:-tests/python} -p no:cacheprovider \
    -k "${LLMK_MEMCHECK_PY_K:-llmk_gpu and not compile and not opcheck and not cli and not graph}" \
    >"$LOGS/memcheck_py.collect.log" 2>&1
  rc=$?
  [ $rc = 0 ] || { echo "memcheck_py: collection failed (pytest rc $rc)"; tail -n 20 "$LOGS/memcheck_py.collect.log"; return 1; }
  grep -E '^[^[:space:]]+::' "$LOGS/memcheck_py.collect.log" >"$list"  # node ids only (not warnings' text)
  [ -s "$list" ] || { echo "memcheck_py: no tests collected"; return 1; }
  # (never more shares than tests: pytest given an empty list would run its default paths)
  [ "$jobs" -gt "$(wc -l <"$list")" ] && jobs=$(wc -l <"$list")
  echo "memcheck_py: $(wc -l <"$list") tests in $jobs share(s)"
  split -n "r/$jobs" -d -a 3 "$list" "$WORK/memcheck_py.share." || return 1
  for share in "$WORK"/memcheck_py.share.*; do
    env PYTORCH_NO_CUDA_MEMORY_CACHING=1 LLMK_MEMCHECK=1 compute-sanitizer --tool memcheck --error-exitcode 1 \
      "$PY" -m pytest -v -rs -x -p no:cacheprovider "@$share" >"$LOGS/memcheck_py.$i.log" 2>&1 &
    pids+=($!) i=$((i + 1))
  done
  i=0
  for pid in "${pids[@]}"; do
    if wait "$pid"; then echo "share $i: ok"; else echo "share $i: FAILED"; rc=1; fi
    # (as the plain pytest step: a GPU test skipped for want of a GPU fails the step)
    gpu_skips "$LOGS/memcheck_py.$i.log" && { echo "share $i: GPU tests SKIPPED"; rc=1; }
    grep -E "^(FAILED|ERROR) |ERROR SUMMARY|passed|failed" "$LOGS/memcheck_py.$i.log" | tail -n 4
    i=$((i + 1))
  done
  return "$rc"
}
note() { echo "== $(date +%T) $*" | tee -a "$OUT/summary.txt"; }
pack_logs() { tar -czf "$OUT/logs.tar.gz" -C "$LOGS" . 2>/dev/null; }
run() {  # run NAME CMD...: log to NAME.log in $OUT/logs.tar.gz (packed every 30 s meanwhile), remember failures
  local name=$1; shift
  note "$name: $*"
  "$@" >"$LOGS/$name.log" 2>&1 &
  local pid=$! last=$SECONDS rc
  while kill -0 "$pid" 2>/dev/null; do
    sleep 1
    if [ $((SECONDS - last)) -ge 30 ]; then pack_logs; last=$SECONDS; fi
  done
  wait "$pid"; rc=$?
  if [ $rc = 0 ]; then note "$name: ok"; else note "$name: FAILED (rc $rc)"; status=1; fi
  tail -n 5 "$LOGS/$name.log"
  pack_logs
}

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"

if [ $tests = 1 ] || [ $fast = 1 ]; then
gtest=()
[ -d .carry/googletest ] && gtest=(-DLLMK_GTEST_SOURCE_DIR="$PWD/.carry/googletest")
torch_ext=()
[ $fast = 1 ] && torch_ext=(-DLLMK_BUILD_TORCH=ON -DPython_EXECUTABLE="$(command -v "$PY")")
run cmake_configure cmake -S . -B build/gpu -G Ninja -DLLMK_GPU=cuda -DCMAKE_CUDA_ARCHITECTURES="$ARCH" \
  "${gtest[@]}" "${torch_ext[@]}" -DCMAKE_CUDA_FLAGS="${LLMK_CUDA_FLAGS:-}"
run cmake_build cmake --build build/gpu -j "$(nproc)"
fi
if [ $tests = 1 ] && [ $cpp = 1 ]; then
run cpp_tests build/gpu/llmk_tests --gtest_brief=1 --gtest_filter="${LLMK_GTEST_FILTER:-*}"
grep -q "SKIPPED" "$LOGS/cpp_tests.log" && { note "cpp_tests: some tests SKIPPED"; status=1; }
# the Hopper attention's persistent launch with several query tiles per block, causal included
# (by default only large non-causal D = 128 calls run it); with the whole suite only (a narrowed
# LLMK_GTEST_FILTER is a call about something else: this step took 32-35 s of each such call)
if [ -z "${LLMK_GTEST_FILTER:-}" ]; then
LLMK_ATTENTION_PERSISTENT=1 LLMK_ATTENTION_PERSISTENT_BLOCKS=3 run cpp_attention_persistent \
  build/gpu/llmk_tests --gtest_brief=1 --gtest_filter='*ttention*:*Grid*:*Hopper*'
fi
fi

if [ $fast = 1 ]; then
  cp build/gpu/libllmk.so build/gpu/src/torch/libllmk_torch.so python/llm_kernels/
  export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
  llm-kernels() { "$PY" -m llm_kernels.cli "$@"; }
else
  run pip_install "$PY" -m pip install --no-build-isolation --no-deps -v -C cmake.define.CMAKE_CUDA_ARCHITECTURES="$ARCH" .
fi
run probe llm-kernels probe
cat "$LOGS/probe.log"
xdist=(); "$PY" -c "import xdist" 2>/dev/null && xdist=(-n 12)  # correctness tests share the GPU fine
# shellcheck disable=SC2086  # a list of files
[ $tests = 1 ] && [ $pytest = 1 ] && run pytest "$PY" -m pytest -v -rs "${xdist[@]}" ${LLMK_PYTEST_FILES:-tests/python} -p no:cacheprovider
[ $tests = 1 ] && [ $pytest = 1 ] && gpu_skips "$LOGS/pytest.log" && { note "pytest: GPU tests SKIPPED"; status=1; }

# LLMK_STEPS: a file of further steps, one "name: shell command" per line (blank lines and lines
# starting with # skipped), each run as the steps above (its log packed into logs.tar.gz, its last
# lines printed, a failure counted), after the tests and before the benchmarks. For a session's
# own measurements (an e2e, a sweep) without a loose file under $OUT per command: the device tool
# returns at most eight files. The commands see PYTHONPATH (with --fast) but not the llm-kernels
# shell function: call `python3 -m llm_kernels.cli`.
if [ -n "${LLMK_STEPS:-}" ]; then
  while IFS= read -r -u 3 line; do
    case "$line" in ''|'#'*) continue ;; esac
    run "step_$(echo "${line%%:*}" | tr -c 'A-Za-z0-9_.\n-' _)" bash -c "${line#*:}"
  done 3< "$LLMK_STEPS"
fi

if [ $bench = 1 ]; then
  bench_run() {  # bench_run NAME CMD...: results in $R/NAME.json and .md, shown in the log
    local name=$1; shift
    run "bench_$name" "$@" --json "$R/$name.json" --md "$R/$name.md"
    [ -f "$R/$name.md" ] && cat "$R/$name.md"
    tar -czf "$OUT/results.tar.gz" -C "$R" .
  }
  # LLMK_BENCHES picks and orders them; LLMK_BENCH_ARGS narrows `bench` (e.g. "--op rope").
  for b in ${LLMK_BENCHES:-attention decode monarch e2e h200}; do
    case $b in
      attention|decode|monarch) bench_run "$b" llm-kernels "bench-$b" ;;
      e2e) bench_run e2e llm-kernels e2e --budget-s "${LLMK_E2E_BUDGET:-90}" ;;
      # e2e with the deep skinny-GEMM kernel (not in the default list; LLMK_BENCHES="... e2e-deep")
      e2e-deep) LLMK_GEMM_KERNEL=deep bench_run e2e_deep llm-kernels e2e --budget-s "${LLMK_E2E_BUDGET:-90}" ;;
      h200)
        # shellcheck disable=SC2086  # a list of arguments
        bench_run h200 llm-kernels bench ${LLMK_BENCH_ARGS:-} ;;
      *) note "unknown benchmark $b"; status=1 ;;
    esac
  done
fi
if [ $sanitizer = 1 ]; then
  run memcheck_cpp compute-sanitizer --tool memcheck --error-exitcode 1 build/gpu/llmk_tests \
    --gtest_brief=1 --gtest_filter="${LLMK_MEMCHECK_FILTER:-*gpu*}"
  [ "${LLMK_MEMCHECK_PY:-1}" = 1 ] && run memcheck_py memcheck_py
fi

note "done, status $status"
rm -rf "$WORK"
exit $status
