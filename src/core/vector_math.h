// Math for the CPU kernels' inner loops that the compiler can vectorise: no libm calls, no
// branches. Used by the *_cpu.cpp files (built with -ffp-contract=off, so every SIMD clone of a
// loop rounds alike; core/parallel.h).
#pragma once

#include <cstdint>
#include <cstring>
#include <limits>

namespace llmk::detail {

// e^x in plain float arithmetic (Cephes' expf: x = n ln2 + r, |r| <= ln2/2, a degree-7
// polynomial in r, times 2^n built in the exponent bits): within 2 ulp of libm's expf from -86.6
// to 88.72283; 0 below (libm's results there are under 2.7e-38), inf above, NaN stays NaN. No
// calls and no branches, so loops over it vectorise.
inline float exp_vectorisable(float x) {
  constexpr float kHi = 88.72283f, kLo = -86.6f;
  float xc = x > kLo ? x : kLo;  // NaN -> kLo here; restored below
  xc = xc < kHi ? xc : kHi;
  constexpr float kRound = 12582912.f;  // 1.5 * 2^23: adding it rounds to an integer
  const float n = (xc * 1.44269504088896341f + kRound) - kRound;  // in [-125, 128]
  const float r = (xc - n * 0.693359375f) - n * -2.12194440e-4f;   // ln2 in two parts
  float q = 1.9875691500e-4f;
  q = q * r + 1.3981999507e-3f;
  q = q * r + 8.3334519073e-3f;
  q = q * r + 4.1665795894e-2f;
  q = q * r + 1.6666665459e-1f;
  q = q * r + 5.0000001201e-1f;
  const float poly = q * r * r + r + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 126) << 23;  // 2^(n-1): a normal float
  float half_scale;
  std::memcpy(&half_scale, &bits, 4);
  const float y = poly * half_scale * 2.f;
  const float out_of_range = x < kLo ? 0.f : std::numeric_limits<float>::infinity();
  return x != x ? x : (x >= kLo && x <= kHi ? y : out_of_range);
}

}  // namespace llmk::detail
