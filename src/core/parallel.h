// parallel_rows(n, grain, body): the CPU kernels' one way to split work over threads, through the
// function installed with llmk::set_cpu_parallel_for (include/llmk/threads.h), else inline.
#pragma once

#include <cstdint>
#include <type_traits>

#include "llmk/threads.h"

// On a function holding a CPU kernel's inner loops: GCC compiles it three times on x86-64, for
// the baseline (SSE2: 4 float lanes), AVX2 (8) and AVX-512 (16), and picks one for the CPU when
// the library loads. The *_cpu.cpp files build with -ffp-contract=off, so all three round alike.
// (SwiGLU on 64 x 8192 fp32, one thread of an AMD EPYC: 1.25 ms baseline, 0.53 AVX2, 0.26
// AVX-512.) Clang (hipcc too) does not clone function templates: its builds run the baseline.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && defined(__linux__)
#define LLMK_CPU_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#define LLMK_CPU_HAS_CLONES 1
#else
#define LLMK_CPU_CLONES
#define LLMK_CPU_HAS_CLONES 0
#endif

namespace llmk::detail {

// Items per piece for items of `elements_per_item` elements, so that a piece holds about 32K
// elements: below that, waking a thread costs more than it saves.
inline int64_t grain_for(int64_t elements_per_item) {
  constexpr int64_t kElementsPerPiece = 32768;
  if (elements_per_item >= kElementsPerPiece) return 1;
  return kElementsPerPiece / (elements_per_item + 1) + 1;
}

// body(begin, end) over pieces of [0, n), on the installed threads when n exceeds one grain.
template <typename Body>
void parallel_rows(int64_t n, int64_t grain, Body&& body) {
  if (n <= 0) return;
  const CpuParallelFor fn = cpu_parallel_for();
  if (fn == nullptr || n <= grain) {
    body(int64_t{0}, n);
    return;
  }
  using B = std::remove_reference_t<Body>;
  fn(n, grain, const_cast<void*>(static_cast<const void*>(&body)),
     [](void* ctx, int64_t begin, int64_t end) { (*static_cast<B*>(ctx))(begin, end); });
}

}  // namespace llmk::detail
