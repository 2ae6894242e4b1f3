#!/usr/bin/env bash
# The full test suite on any machine, GPU or not (CI runs this through .ci/run):
#   1. a Python venv with torch from PyPI (kept in ~/.cache/llmk-venv, created when missing),
#   2. the C++ library + GoogleTest for CUDA (sm_80, sm_90a) and run,
#   3. the same for HIP (gfx90a, gfx940, gfx1030) and run (the CPU path; GPU cases skip),
#   3b. a CPU-only build under AddressSanitizer + UndefinedBehaviorSanitizer and its GoogleTest run
#      (LLMK_CPU_SANITIZERS=0 leaves it out),
#   4. a CPU-only install used by a C++ project through find_package(llmk) (tests/consumer),
#   5. the Python package installed into the venv (from step 2's build tree where there is one:
#      its CUDA objects are reused, not compiled again), and pytest.
# GPU test cases skip with a visible reason where no GPU is present.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${LLMK_VENV:-$HOME/.cache/llmk-venv}
JOBS=${JOBS:-$(nproc)}
t0=$SECONDS
say() { echo "== [$((SECONDS - t0))s] $*"; }

need_apt=()
[ -f /usr/include/gtest/gtest.h ] || need_apt+=(libgtest-dev)
command -v hipcc >/dev/null || need_apt+=(hipcc libamdhip64-dev rocm-device-libs)
command -v ninja >/dev/null || need_apt+=(ninja-build)
if [ ${#need_apt[@]} -gt 0 ]; then
  say "installing ${need_apt[*]} from Debian"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi

if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c "import torch, pytest, scikit_build_core, typer, rich, safetensors, transformers" 2>/dev/null; then
  say "creating the venv $VENV (torch from PyPI)"
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip
  "$VENV/bin/pip" install -q torch numpy pytest scikit-build-core cmake ninja typer rich safetensors transformers
fi
export PATH="$VENV/bin:$PATH"

py_build_dir=""
if command -v nvcc >/dev/null || [ -x /usr/local/cuda/bin/nvcc ]; then
  say "C++: CUDA build (sm_80, sm_90a, with the PyTorch extension) and tests"
  cmake -S . -B build/ci-cuda -G Ninja -DLLMK_GPU=cuda -DCMAKE_CUDA_ARCHITECTURES="80;90a" -DCMAKE_BUILD_TYPE=Release \
    -DLLMK_BUILD_TORCH=ON -DPython_EXECUTABLE="$VENV/bin/python" >/dev/null
  cmake --build build/ci-cuda -j "$JOBS"
  build/ci-cuda/llmk_tests --gtest_brief=1
  py_build_dir=build/ci-cuda
else
  say "C++: no nvcc here, CUDA build not checked"
fi

if command -v hipcc >/dev/null; then
  say "C++: HIP build (gfx90a, gfx940, gfx1030) and tests"
  cmake -S . -B build/ci-hip -G Ninja -DLLMK_GPU=hip -DLLMK_HIP_ARCHITECTURES="gfx90a;gfx940;gfx1030" >/dev/null
  cmake --build build/ci-hip -j "$JOBS"
  build/ci-hip/llmk_tests --gtest_brief=1
fi

if [ "${LLMK_CPU_SANITIZERS:-1}" != 0 ]; then
  # The CPU kernels (also the tests' references) under ASan + UBSan: out-of-bounds reads of the
  # tiled loops, leaks, overflow and misaligned access stop the run (first run 2026-12-07: clean).
  say "C++: CPU-only build under AddressSanitizer + UndefinedBehaviorSanitizer, and tests"
  san="-fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined"
  cmake -S . -B build/ci-asan -G Ninja -DLLMK_GPU=off -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_FLAGS="$san" \
    -DCMAKE_SHARED_LINKER_FLAGS="$san" -DCMAKE_EXE_LINKER_FLAGS="$san" >/dev/null
  cmake --build build/ci-asan -j "$JOBS" >/dev/null
  ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 build/ci-asan/llmk_tests --gtest_brief=1
fi

say "C++: install a CPU-only build and build tests/consumer against it with find_package(llmk)"
prefix=$(mktemp -d)
cmake -S . -B build/ci-install -G Ninja -DLLMK_GPU=off -DLLMK_BUILD_TESTS=OFF -DCMAKE_INSTALL_PREFIX="$prefix" >/dev/null
cmake --build build/ci-install -j "$JOBS" >/dev/null && cmake --install build/ci-install >/dev/null
cmake -S tests/consumer -B build/ci-consumer -G Ninja -DCMAKE_PREFIX_PATH="$prefix" >/dev/null
cmake --build build/ci-consumer >/dev/null
LD_LIBRARY_PATH="$prefix/lib:${LD_LIBRARY_PATH:-}" build/ci-consumer/consumer
rm -rf "$prefix"

if [ -n "$py_build_dir" ]; then
  # the same configuration as step 2, so the wheel build finds its objects up to date
  say "Python: install the package (built in $py_build_dir: CUDA sm_80 and sm_90a)"
  pip install -q --no-build-isolation --no-deps -C build-dir="$py_build_dir" -C cmake.define.LLMK_GPU=cuda \
    -C 'cmake.define.CMAKE_CUDA_ARCHITECTURES=80;90a' .
else
  say "Python: install the package"
  pip install -q --no-build-isolation --no-deps .
fi
say "Python: pytest"
python -m pytest -q -rs -p no:cacheprovider tests/python
say "all tests done"
