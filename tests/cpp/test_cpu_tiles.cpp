// core/cpu_tiles.h: the register-tiled products give, for every output, exactly the sum in index
// order that a plain loop gives (so the CPU kernels' results do not depend on the tiling), in both
// vector widths (Float8 where AVX is there, Float4 elsewhere), for row and column counts that are
// no multiple of the tile, strided left operands and partial sums already in the output.
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <vector>

#include "core/cpu_tiles.h"

namespace {

using llmk::detail::Float4;
using llmk::detail::Float8;

template <typename Vec>
void check_against_plain_loop() {
  std::mt19937 rng(7);
  std::normal_distribution<float> normal;
  for (int64_t rows : {1, 2, 3, 4, 5, 9})
    for (int64_t cols : {1, 15, 16, 17, 40})
      for (int64_t terms : {0, 1, 7, 70}) {
        const int64_t a_term = rows + 3, a_row = 1;  // a stored as terms x (rows + 3): a column walk
        std::vector<float> a(terms * a_term + rows), b(terms * cols), out(rows * (cols + 2)), want;
        for (float& v : a) v = normal(rng);
        for (float& v : b) v = normal(rng);
        for (float& v : out) v = normal(rng);  // sums already there, row stride cols + 2
        want = out;
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t c = 0; c < cols; ++c) {
            float acc = want[r * (cols + 2) + c];
            for (int64_t j = 0; j < terms; ++j) {
              volatile float product = a[j * a_term + r * a_row] * b[j * cols + c];  // never fused into an FMA
              acc += product;
            }
            want[r * (cols + 2) + c] = acc;
          }
        const int64_t packed_terms = terms + 2;  // packed with more terms than are summed
        std::vector<float> panels(llmk::detail::panels_size(packed_terms, cols));
        llmk::detail::pack_panels(packed_terms, cols, panels.data(),
                                  [&](int64_t j, int64_t c) { return j < terms ? b[j * cols + c] : 1e30f; });
        llmk::detail::panels_accumulate_in<Vec>(out.data(), cols + 2, a.data(), a_term, a_row, panels.data(),
                                                packed_terms, terms, rows, cols);
        ASSERT_EQ(std::memcmp(out.data(), want.data(), out.size() * sizeof(float)), 0)
            << "rows " << rows << " cols " << cols << " terms " << terms;
      }
}

TEST(CpuTiles, Float8SumsInIndexOrder) { check_against_plain_loop<Float8>(); }
TEST(CpuTiles, Float4SumsInIndexOrder) { check_against_plain_loop<Float4>(); }

}  // namespace
