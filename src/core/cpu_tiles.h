// The CPU kernels' small matrix products in register tiles: 2-4 output rows x 16 columns of sums
// stay in SIMD registers while the sum runs, instead of a row of sums being loaded and stored for
// every term. The right-hand operand is packed in panels of 16 columns, so that a tile streams
// one contiguous panel (a strided column walk through a large block would miss L1 on every term:
// 256 rows 1 KB apart share a few cache sets) and the next row tiles find it in L1. Each output's
// sum runs in index order, so results do not depend on the tiling, the SIMD width (core/parallel.h's
// clones) or the thread count.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "core/parallel.h"

namespace llmk::detail {

// SIMD vectors of floats (GCC / Clang vector extension), only ever locals (never passed by value,
// so the ABI of such arguments does not come into it). Float8 is an AVX register; in code built
// without AVX GCC splits it into pairs of SSE registers with heavy spilling (attention 5x slower
// than plain loops), so such code takes Float4 (SSE, NEON) and half as many rows per tile.
using Float8 = float __attribute__((vector_size(32)));
using Float4 = float __attribute__((vector_size(16)));

constexpr int64_t kPanel = 16;  // columns per panel

// Floats a matrix of `terms` x `cols` takes in panels: every panel padded to kPanel columns.
inline int64_t panels_size(int64_t terms, int64_t cols) { return (cols + kPanel - 1) / kPanel * kPanel * terms; }

// Packs element (j, c) of a matrix, load(j, c), into panels: dst[(c / 16) * terms * 16 + j * 16 +
// c % 16], padding the last panel with zeros.
template <typename Load>
void pack_panels(int64_t terms, int64_t cols, float* dst, Load load) {
  for (int64_t c0 = 0; c0 < cols; c0 += kPanel) {
    float* panel = dst + c0 * terms;
    const int64_t width = std::min(kPanel, cols - c0);
    for (int64_t j = 0; j < terms; ++j) {
      for (int64_t c = 0; c < width; ++c) panel[j * kPanel + c] = load(j, c0 + c);
      for (int64_t c = width; c < kPanel; ++c) panel[j * kPanel + c] = 0.f;
    }
  }
}

// out[r * out_row + c] += sum over j < terms, in order j = 0, 1, ..., of a[j * a_term + r * a_row]
// times element (j, c) of the panel, for r < R, c < width (width <= 16), in vectors of type Vec.
template <typename Vec, int R>
[[gnu::always_inline]] inline void tile_accumulate(float* out, int64_t out_row, const float* a, int64_t a_term,
                                                   int64_t a_row, const float* panel, int64_t terms, int64_t width) {
  constexpr int kLanes = sizeof(Vec) / sizeof(float), kVecs = kPanel / kLanes;
  float edge[R][kPanel];  // a narrower last panel's outputs, padded
  Vec acc[R][kVecs];
  for (int r = 0; r < R; ++r) {
    const float* src = out + r * out_row;
    if (width < kPanel) {
      std::fill_n(edge[r], kPanel, 0.f);
      std::copy(src, src + width, edge[r]);
      src = edge[r];
    }
    for (int v = 0; v < kVecs; ++v) std::memcpy(&acc[r][v], src + v * kLanes, sizeof(Vec));
  }
  for (int64_t j = 0; j < terms; ++j) {
    Vec b[kVecs];
    for (int v = 0; v < kVecs; ++v) std::memcpy(&b[v], panel + j * kPanel + v * kLanes, sizeof(Vec));
    for (int r = 0; r < R; ++r) {
      const float ar = a[j * a_term + r * a_row];
      for (int v = 0; v < kVecs; ++v) acc[r][v] += ar * b[v];
    }
  }
  for (int r = 0; r < R; ++r) {
    float* dst = width < kPanel ? edge[r] : out + r * out_row;
    for (int v = 0; v < kVecs; ++v) std::memcpy(dst + v * kLanes, &acc[r][v], sizeof(Vec));
    if (width < kPanel) std::copy(edge[r], edge[r] + width, out + r * out_row);
  }
}

// panels_accumulate (below) in vectors of type Vec: 4 rows per tile in Float8 (8 registers of
// sums), 2 in Float4 (also 8).
template <typename Vec>
[[gnu::always_inline]] inline void panels_accumulate_in(float* out, int64_t out_row, const float* a, int64_t a_term,
                                                        int64_t a_row, const float* panels, int64_t packed_terms,
                                                        int64_t terms, int64_t rows, int64_t cols) {
  constexpr int kRows = sizeof(Vec) == sizeof(Float8) ? 4 : 2;
  for (int64_t c0 = 0; c0 < cols; c0 += kPanel) {
    const float* panel = panels + c0 * packed_terms;
    const int64_t width = std::min(kPanel, cols - c0);
    float* o = out + c0;
    int64_t r = 0;
    for (; r + kRows <= rows; r += kRows)
      tile_accumulate<Vec, kRows>(o + r * out_row, out_row, a + r * a_row, a_term, a_row, panel, terms, width);
    switch (rows - r) {
      case 3: tile_accumulate<Vec, 3>(o + r * out_row, out_row, a + r * a_row, a_term, a_row, panel, terms, width); break;
      case 2: tile_accumulate<Vec, 2>(o + r * out_row, out_row, a + r * a_row, a_term, a_row, panel, terms, width); break;
      case 1: tile_accumulate<Vec, 1>(o + r * out_row, out_row, a + r * a_row, a_term, a_row, panel, terms, width); break;
      default: break;
    }
  }
}

// out[r * out_row + c] += sum over j < terms (in order) of a[j * a_term + r * a_row] * B[j, c] for
// r < rows, c < cols, with B packed by pack_panels(packed_terms, cols, ...) (terms <= packed_terms:
// the first terms rows of B). Panel by panel, each panel's row tiles in turn (the panel stays in
// L1 across them). Inside GCC's SIMD clones (core/parallel.h) the AVX2 / AVX-512 ones take Float8
// and the baseline one Float4 (the check is true exactly where the AVX2 resolver picked a clone
// built with AVX); other builds choose by their compile target. So in GCC builds call it only
// from code inlined into an LLMK_CPU_CLONES function: elsewhere the code is built without AVX
// and the check would still pick Float8.
[[gnu::always_inline]] inline void panels_accumulate(float* out, int64_t out_row, const float* a, int64_t a_term,
                                                     int64_t a_row, const float* panels, int64_t packed_terms,
                                                     int64_t terms, int64_t rows, int64_t cols) {
#if LLMK_CPU_HAS_CLONES
  if (__builtin_cpu_supports("avx2"))
    panels_accumulate_in<Float8>(out, out_row, a, a_term, a_row, panels, packed_terms, terms, rows, cols);
  else
    panels_accumulate_in<Float4>(out, out_row, a, a_term, a_row, panels, packed_terms, terms, rows, cols);
#elif defined(__AVX__)
  panels_accumulate_in<Float8>(out, out_row, a, a_term, a_row, panels, packed_terms, terms, rows, cols);
#else
  panels_accumulate_in<Float4>(out, out_row, a, a_term, a_row, panels, packed_terms, terms, rows, cols);
#endif
}

}  // namespace llmk::detail
