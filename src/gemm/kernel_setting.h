// The shape list of LLMK_GEMM_KERNEL=tma@SHAPES (a measurement switch: the TMA kernel for the
// listed weight shapes only, the default kernel elsewhere), so that an e2e can time the TMA kernel
// on the GEMMs of a model where it leads back to back and nowhere else. Host code in a header of
// its own so that a CPU test checks how the list is read (gemm_gpu.cu's env_kernel uses it).
#pragma once

#include <charconv>
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
    int64_t v = 0;
    const auto [end, err] = std::from_chars(text.data(), text.data() + text.size(), v);
    if (err != std::errc() || end != text.data() + text.size() || v <= 0) bad();
    return v;
  };
  bool listed = false;
  for_each_part(shapes, '+', [&](std::string_view entry) {  // every entry checked: a typo fails at once
    const size_t x = entry.find('x');
    if (x == std::string_view::npos) bad();
    listed = (number(entry.substr(0, x)) == k && number(entry.substr(x + 1)) == n) || listed;
  });
  return listed;
}

}  // namespace llmk::detail
