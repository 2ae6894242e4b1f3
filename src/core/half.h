// Host-side fp16/bf16 <-> fp32 conversions for the CPU backend (round to nearest even).
#pragma once

#include <cstdint>
#include <cstring>

namespace llmk::detail {

struct Half { uint16_t bits; };
struct BFloat16 { uint16_t bits; };

inline float to_float(float v) { return v; }

// Bit arithmetic and selects, not a _Float16 cast: x86-64 has no fp16 conversion instruction
// below F16C, so GCC's cast is a library call per element there (fp16 CPU ops ran ~20x slower
// than fp32), and these vectorise in every SIMD clone. Same results as the cast (NaN stays NaN).
inline float to_float(Half h) {
  const uint32_t x = h.bits;
  const uint32_t sign = (x & 0x8000u) << 16, exponent = (x >> 10) & 0x1fu, mantissa = x & 0x3ffu;
  const uint32_t normal = sign | ((exponent + (127u - 15u)) << 23) | (mantissa << 13);
  const uint32_t inf_nan = sign | 0x7f800000u | (mantissa << 13);
  // exponent 0: mantissa * 2^-24 (zero or a subnormal half; exact in float)
  const float small = static_cast<float>(static_cast<int32_t>(mantissa)) * 5.9604644775390625e-8f;
  uint32_t small_bits;
  std::memcpy(&small_bits, &small, 4);
  const uint32_t u = exponent == 0 ? (sign | small_bits) : exponent == 31 ? inf_nan : normal;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline float to_float(BFloat16 b) {
  uint32_t u = static_cast<uint32_t>(b.bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

template <typename T> T from_float(float v);

template <> inline float from_float<float>(float v) { return v; }

// Round to nearest even, in bit arithmetic and selects (see to_float(Half)).
template <> inline Half from_float<Half>(float v) {
  uint32_t u;
  std::memcpy(&u, &v, 4);
  const uint32_t sign = (u >> 16) & 0x8000u, a = u & 0x7fffffffu;
  // [2^-14, 65536): rebias the exponent, round the 13 dropped bits (65520 and up round to inf)
  const uint32_t normal = (a - ((127u - 15u) << 23) + 0xfffu + ((a >> 13) & 1u)) >> 13;
  // below 2^-14: in a + 0.5 the float unit rounds a to a multiple of 2^-24 (the ulp of [0.5, 1)),
  // the subnormal half's step, and leaves that multiple in the low bits
  float magnitude;
  std::memcpy(&magnitude, &a, 4);
  const float shifted = magnitude + 0.5f;
  uint32_t shifted_bits;
  std::memcpy(&shifted_bits, &shifted, 4);
  const uint32_t small = shifted_bits - 0x3f000000u;  // minus 0.5's bits
  const uint32_t big = a > 0x7f800000u ? 0x7e00u : 0x7c00u;  // NaN : inf
  Half h;
  h.bits = static_cast<uint16_t>(sign | (a >= 0x47800000u ? big : a < 0x38800000u ? small : normal));
  return h;
}

template <> inline BFloat16 from_float<BFloat16>(float v) {
  uint32_t u;
  std::memcpy(&u, &v, 4);
  // a select, not a branch, so that loops over it vectorise
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const uint32_t quiet_nan = (u >> 16) | 0x40u;  // keep NaN a NaN
  BFloat16 b;
  b.bits = static_cast<uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded);
  return b;
}

}  // namespace llmk::detail
