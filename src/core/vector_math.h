// Math for the CPU kernels' inner loops that the compiler can vectorise: no libm calls, no
// branches. Used by the *_cpu.cpp files (built with -ffp-contract=off, so every SIMD clone of a
// loop rounds alike; core/parallel.h).
#pragma once

#include <cstdint>
#include <cstring>
#include <limits>

namespace llmk::detail {

// e^r for the reduced argument |r| <= ln2/2 of the two functions below (Cephes' expf polynomial).
inline float exp_reduced(float r) {
  float q = 1.9875691500e-4f;
  q = q * r + 1.3981999507e-3f;
  q = q * r + 8.3334519073e-3f;
  q = q * r + 4.1665795894e-2f;
  q = q * r + 1.6666665459e-1f;
  q = q * r + 5.0000001201e-1f;
  return q * r * r + r + 1.f;
}

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
  const float poly = exp_reduced(r);
  const int32_t bits = (static_cast<int32_t>(n) + 126) << 23;  // 2^(n-1): a normal float
  float half_scale;
  std::memcpy(&half_scale, &bits, 4);
  const float y = poly * half_scale * 2.f;
  const float out_of_range = x < kLo ? 0.f : std::numeric_limits<float>::infinity();
  return x != x ? x : (x >= kLo && x <= kHi ? y : out_of_range);
}

// erfc(x) from Numerical Recipes' erfcc form, t e^(-z^2 + P(t)) with z = |x|, t = 1 / (1 + z/2)
// and P a degree-9 Chebyshev fit (fractional error below 1.2e-7 for every z), erfc(-z) = 2 -
// erfc(z). The exponent is kept in two parts, -h^2 (h = z cut to 12 mantissa bits, so h^2 is
// exact) and P - (z - h)(z + h): a rounded z^2 alone (an error of up to 4e-6 in an exponent near
// -86) would cost erfc 8e-6 of relative accuracy at z ~ 9. One exp takes both parts, as
// exp_vectorisable does its argument: n = round(s / ln2) for their sum s, r = (-h^2 - n ln2_hi)
// (exact: Cody and Waite's split of ln2) + the second part - n ln2_lo, and t e^r is scaled by 2^n
// in two steps, so that results below 2^-126 round once into the subnormals. Within 3.8e-7
// relative of float64 wherever erfc is a normal float (x < 9.19; tests/cpp/test_vector_math.cpp),
// subnormal results up to 10, 0 above, NaN stays NaN.
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
  const float hi = -h * h, lo = p - (z - h) * (z + h);
  float s = hi + lo;
  s = s > -110.f ? s : -110.f;  // NaN and z > 10 land here; both are replaced below
  constexpr float kRound = 12582912.f;  // 1.5 * 2^23: adding it rounds to an integer
  const float n = (s * 1.44269504088896341f + kRound) - kRound;  // in [-159, 1]
  const float r = ((hi - n * 0.693359375f) + lo) - n * -2.12194440e-4f;
  const float poly = exp_reduced(r);
  const int32_t n_int = static_cast<int32_t>(n), n_half = n_int / 2;  // both in [-80, 1]
  const int32_t bits_a = (n_half + 127) << 23, bits_b = (n_int - n_half + 127) << 23;
  float scale_a, scale_b;
  std::memcpy(&scale_a, &bits_a, 4);
  std::memcpy(&scale_b, &bits_b, 4);
  const float tail = ((t * poly) * scale_a) * scale_b;
  const float upper = z > 10.f ? 0.f : tail;  // also keeps z = inf from inf - inf
  const float out = x < 0.f ? 2.f - upper : upper;
  return x != x ? x : out;
}

}  // namespace llmk::detail
