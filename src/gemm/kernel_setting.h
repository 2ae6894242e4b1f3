// The GEMM's kernel-choice settings that carry values, read here in host code of its own so that a
// CPU test checks how they are read (gemm_gpu.cu's env_kernel and default_kernel use them): the
// shape list of LLMK_GEMM_KERNEL=tma@SHAPES (a measurement switch: the TMA kernel for the listed
// weight shapes only, the default kernel elsewhere, so that an e2e can time the TMA kernel on the
// GEMMs of a model where it leads back to back and nowhere else), and LLMK_GEMM_TMA_ROWS.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "core/check.h"
#include "core/text_parts.h"

namespace llmk::detail {

// Whether the weight of a product with reduction length k and n weight rows (for gated GEMMs, gate
// and up together: 2 x the output's columns) is in `shapes`, KxN entries joined by "+" (e.g.
// "4096x14336+4096x28672"; not commas, which the benchmark scripts' VAR=VALUE,VAR=VALUE settings
// use). `setting` (the whole variable's value) is for the error message; an
// empty list, an empty entry or anything but two positive integers joined by x is an error.
inline bool gemm_shape_listed(std::string_view shapes, std::string_view setting, int64_t k, int64_t n) {
  const auto bad = [&] {
    fail(ErrorKind::value, "skinny_gemm",
         "LLMK_GEMM_KERNEL: expected tma@ followed by KxN weight shapes joined by + (e.g. "
         "tma@4096x14336+14336x4096), got '" + std::string(setting) + "'");
  };
  const auto number = [&](std::string_view text) {
    const auto v = whole_integer(text);
    if (!v || *v <= 0) bad();
    return *v;
  };
  bool listed = false;
  for_each_part(shapes, '+', [&](std::string_view entry) {  // every entry checked: a typo fails at once
    const size_t x = entry.find('x');
    if (x == std::string_view::npos) bad();
    listed = (number(entry.substr(0, x)) == k && number(entry.substr(x + 1)) == n) || listed;
  });
  return listed;
}

// The row limit of the default's TMA rule, LLMK_GEMM_TMA_ROWS's value `setting` (nullptr when unset):
// 1 when unset or empty, else a whole number of rows from 1 to kMaxTmaRows (one launch's rows).
constexpr int64_t kMaxTmaRows = 16;
inline int64_t gemm_tma_rows(const char* setting) {
  if (setting == nullptr || *setting == '\0') return 1;
  const auto rows = whole_integer(setting);
  if (!rows || *rows < 1 || *rows > kMaxTmaRows)
    fail(ErrorKind::value, "skinny_gemm",
         std::string("LLMK_GEMM_TMA_ROWS: expected a row count from 1 to 16, got '") + setting + "'");
  return *rows;
}

}  // namespace llmk::detail
