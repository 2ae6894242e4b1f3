#!/usr/bin/env bash
# A/B of a kernel change on the GPU machine in one device call: builds the working tree ("new")
# and the same tree with the base versions of the changed files ("old") side by side, then runs a
# command on each in alternating rounds (new, old, new, old, ...), so that both see the same
# machine state. Logs and a summary come back as one archive, $OUT/ab.tar.gz (the device tool
# returns at most 8 files).
#
# Here (no GPU): record the base versions of the files changed since REV (default HEAD):
#   bash scripts/gpu_ab.sh --prepare [REV]        # writes .ab-base/ (git-ignored, carry it)
# There (device tool, carry [".carry", ".ab-base"]):
#   OUT=$OUT bash scripts/gpu_ab.sh [--rounds N] [--tests FILTER] -- CMD...
# CMD runs from the repo root with PYTHONPATH set to the variant's Python package and AB_VARIANT
# set to new or old, e.g. `-- python3 scripts/decode_split_sweep.py --rows b1kv16384`.
# --tests FILTER first runs the new build's C++ tests matching the gtest filter (e.g. '*Decode*').
# LLMK_CUDA_FLAGS adds nvcc flags to both builds (e.g. -lineinfo: source lines in compute-sanitizer's
# reports). AB_SKIP_BUILD=1 skips both builds (they exist from an earlier call on a warm machine).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
BASE_DIR=.ab-base

if [ "${1:-}" = --prepare ]; then
  rev=${2:-HEAD}
  rm -rf "$BASE_DIR" && mkdir -p "$BASE_DIR"
  grep -qx "/$BASE_DIR/" .git/info/exclude 2>/dev/null || echo "/$BASE_DIR/" >> .git/info/exclude
  n=0
  while IFS= read -r f; do
    if git cat-file -e "$rev:$f" 2>/dev/null; then
      mkdir -p "$BASE_DIR/$(dirname "$f")"
      git show "$rev:$f" > "$BASE_DIR/$f"
      n=$((n + 1))
    else
      echo "$f is new since $rev: the old build leaves it out" >&2
      printf '%s\n' "$f" >> "$BASE_DIR/.new-files"
    fi
  done < <(git diff --name-only "$rev")
  echo "$n base files of $rev in $BASE_DIR/"
  exit 0
fi

rounds=2 tests=""
while [ $# -gt 0 ]; do
  case "$1" in
    --rounds) rounds=$2; shift 2 ;;
    --tests) tests=$2; shift 2 ;;
    --) shift; break ;;
    *) echo "unknown option $1 (the command goes after --)"; exit 2 ;;
  esac
done
[ $# -gt 0 ] || { echo "no command after --"; exit 2; }
[ -d "$BASE_DIR" ] || { echo "no $BASE_DIR/: run --prepare here first and carry it"; exit 2; }
OUT=${OUT:-/tmp/llmk-gpu-ab}
mkdir -p "$OUT"
LOGS=$(mktemp -d /tmp/llmk-ab.XXXXXX)
OLD_TREE=/tmp/llmk-ab-old
t0=$SECONDS
note() { echo "== $((SECONDS - t0)) s: $*" | tee -a "$LOGS/summary.txt"; }
pack() { tar -czf "$OUT/ab.tar.gz" -C "$LOGS" . 2>/dev/null; }
PY=${PYTHON:-python3}
configure() {  # configure SRC BUILD
  local gtest=()
  [ -d .carry/googletest ] && gtest=(-DLLMK_GTEST_SOURCE_DIR="$PWD/.carry/googletest")
  cmake -S "$1" -B "$2" -G Ninja -DLLMK_GPU=cuda -DCMAKE_CUDA_ARCHITECTURES="${LLMK_CUDA_ARCH:-90a}" "${gtest[@]}" \
    -DLLMK_BUILD_TORCH=ON -DPython_EXECUTABLE="$(command -v "$PY")" -DCMAKE_CUDA_FLAGS="${LLMK_CUDA_FLAGS:-}"
}

if [ "${AB_SKIP_BUILD:-0}" != 1 ]; then
  # the old tree: the tracked files with the base versions over them, new files left out
  rm -rf "$OLD_TREE" && mkdir -p "$OLD_TREE"
  git ls-files -z | xargs -0 cp --parents -t "$OLD_TREE"
  cp -r "$BASE_DIR"/. "$OLD_TREE"/
  if [ -f "$BASE_DIR/.new-files" ]; then
    while IFS= read -r f; do rm -f "$OLD_TREE/$f"; done < "$BASE_DIR/.new-files"
  fi
  [ -d .carry ] && cp -r .carry "$OLD_TREE"/
  jobs_each=$(( $(nproc) / 2 )); [ "$jobs_each" -ge 1 ] || jobs_each=1
  note "building new (build/gpu) and old ($OLD_TREE/build) side by side, -j $jobs_each each"
  (configure . build/gpu && cmake --build build/gpu -j "$jobs_each" --target llmk_tests llmk_torch) \
    > "$LOGS/build_new.log" 2>&1 &
  pid_new=$!
  (cd "$OLD_TREE" && configure . build && cmake --build build -j "$jobs_each" --target llmk_torch) \
    > "$LOGS/build_old.log" 2>&1 &
  pid_old=$!
  wait $pid_new; rc_new=$?
  wait $pid_old; rc_old=$?
  note "builds: new rc $rc_new, old rc $rc_old"
  pack
  [ $rc_new = 0 ] && [ $rc_old = 0 ] || { tail -n 20 "$LOGS"/build_*.log; exit 1; }
fi
# each variant's Python package (its own sources: a change may add arguments that the old
# library does not take), with its libraries
rm -rf /tmp/llmk-ab-py-new /tmp/llmk-ab-py-old
cp -r python /tmp/llmk-ab-py-new
cp -r "$OLD_TREE/python" /tmp/llmk-ab-py-old
cp build/gpu/libllmk.so build/gpu/src/torch/libllmk_torch.so /tmp/llmk-ab-py-new/llm_kernels/
cp "$OLD_TREE/build/libllmk.so" "$OLD_TREE/build/src/torch/libllmk_torch.so" /tmp/llmk-ab-py-old/llm_kernels/

status=0
if [ -n "$tests" ]; then
  build/gpu/llmk_tests --gtest_brief=1 --gtest_filter="$tests" > "$LOGS/cpp_tests_new.log" 2>&1
  rc=$?; [ $rc = 0 ] || status=1
  note "C++ tests '$tests' on new: rc $rc, $(grep -E '^\[  PASSED  \]|FAILED TEST' "$LOGS/cpp_tests_new.log" | head -n 2 | tr '\n' ' ')"
  pack
fi
for r in $(seq 1 "$rounds"); do
  for v in new old; do
    AB_VARIANT=$v PYTHONPATH="/tmp/llmk-ab-py-$v" "$@" > "$LOGS/round${r}_$v.log" 2>&1
    rc=$?; [ $rc = 0 ] || status=1
    note "round $r $v: rc $rc"
    pack
  done
done
note "done, status $status"
pack
exit $status
