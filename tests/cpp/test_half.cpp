// The CPU backend's fp16 conversions (core/half.h: bit arithmetic, so that loops over them
// vectorise) against the compiler's _Float16 casts: every half to float, and floats across the
// whole range to half (round to nearest even, overflow to inf, subnormals, ties; NaN stays NaN).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#include "core/half.h"

using llmk::detail::from_float;
using llmk::detail::Half;
using llmk::detail::to_float;

namespace {

uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

float float_of(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

uint16_t cast_to_half(float f) {
  const _Float16 h = static_cast<_Float16>(f);
  uint16_t bits;
  std::memcpy(&bits, &h, 2);
  return bits;
}

bool is_half_nan(uint16_t bits) { return (bits & 0x7fffu) > 0x7c00u; }

// from_float<Half>(f) against the cast; returns false (and says which) on the first mismatch.
testing::AssertionResult rounds_as_the_cast(uint32_t u) {
  const float f = float_of(u);
  const uint16_t want = cast_to_half(f), got = from_float<Half>(f).bits;
  if (is_half_nan(want) ? is_half_nan(got) : want == got) return testing::AssertionSuccess();
  return testing::AssertionFailure() << std::hex << "float bits 0x" << u << ": cast 0x" << want << ", ours 0x" << got;
}

TEST(HalfConversions, EveryHalfToFloatMatchesTheCast) {
  for (uint32_t x = 0; x < 65536; ++x) {
    Half h;
    h.bits = static_cast<uint16_t>(x);
    _Float16 cast;
    std::memcpy(&cast, &h.bits, 2);
    const float want = static_cast<float>(cast), got = to_float(h);
    if (std::isnan(want))
      ASSERT_TRUE(std::isnan(got)) << std::hex << "half 0x" << x;
    else
      ASSERT_EQ(bits_of(want), bits_of(got)) << std::hex << "half 0x" << x;
  }
}

TEST(HalfConversions, FloatsToHalfRoundAsTheCast) {
  // every 251st float bit pattern (both signs, every exponent: ~17M values)...
  for (uint64_t u = 0; u < (uint64_t{1} << 32); u += 251) ASSERT_TRUE(rounds_as_the_cast(static_cast<uint32_t>(u)));
  // ...and around every place where the rounding changes: each half's value and the midpoints
  // between neighbours (ties to even), the subnormal / normal boundary, 65504 / 65520 / inf
  for (uint32_t x = 0; x < 0x7c00u; ++x)
    for (uint32_t sign : {0u, 0x80000000u}) {
      Half h;
      h.bits = static_cast<uint16_t>(x);
      const uint32_t at = bits_of(to_float(h)) | sign;
      for (int32_t d = -2; d <= 2; ++d) ASSERT_TRUE(rounds_as_the_cast(at + d));
      if (x + 1 < 0x7c00u) {
        Half next;
        next.bits = static_cast<uint16_t>(x + 1);
        const float mid = 0.5f * (to_float(h) + to_float(next));  // exact: one more bit than a half
        for (int32_t d = -1; d <= 1; ++d) ASSERT_TRUE(rounds_as_the_cast((bits_of(mid) | sign) + d));
      }
    }
  for (float f : {65504.f, 65519.99f, 65520.f, 65536.f, 1e30f, INFINITY, -INFINITY, NAN, 6.1035156e-05f, 5.9604645e-08f,
                  2.9802322e-08f, 2.9802326e-08f, 1e-30f})
    ASSERT_TRUE(rounds_as_the_cast(bits_of(f)));
}

}  // namespace
