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

// erfc(x) from Numerical Recipes' erfcc form, t e^(-z^2 + P(t)) with z = |x|, t = 1 / (1 + z/2)
// and P a degree-9 Chebyshev fit (fractional error below 1.2e-7 for every z), erfc(-z) = 2 -
// erfc(z). e^(-z^2) is taken as e^(-h^2) e^(-(z - h)(z + h)) with h = z cut to 12 mantissa bits,
// so that h^2 is exact: a rounded z^2 alone (an error of up to 4e-6 in an exponent near -86)
// would cost erfc 8e-6 of relative accuracy at z ~ 9. Within 4.1e-7 relative of float64 wherever
// erfc is a normal float (x < 9.19; tests/cpp/test_vector_math.cpp), subnormal results up to 9.3,
// 0 above, NaN stays NaN.
inline float erfc_vectorisable(float x) {
  const float z = x < 0.f ? -x : x, t = 1.f / (1.f + 0.5f * z);
  float p = 0.17087277f;
  p = p * t - 0.82215223f;
  p = p * t + 1.48851587f;
  p = p * t - 1.13520398f;
  p = p * t + 0.27886807f;
  p = p * t - 0.18628806f;
  p = p * t + 0.09678418f;
  p = p * t + 0.37409196f;
  p = p * t + 1.00002368f;
  p = p * t - 1.26551223f;
  uint32_t bits;
  std::memcpy(&bits, &z, 4);
  bits &= 0xfffff000u;
  float h;
  std::memcpy(&h, &bits, 4);
  const float tail = t * (exp_vectorisable(-h * h) * exp_vectorisable(p - (z - h) * (z + h)));
  const float upper = z > 10.f ? 0.f : tail;  // also keeps z = inf from inf - inf
  return x < 0.f ? 2.f - upper : upper;
}

}  // namespace llmk::detail
