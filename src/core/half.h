// Host-side fp16/bf16 <-> fp32 conversions for the CPU backend (round to nearest even).
#pragma once

#include <cstdint>
#include <cstring>

namespace llmk::detail {

struct Half { uint16_t bits; };
struct BFloat16 { uint16_t bits; };

inline float to_float(float v) { return v; }

inline float to_float(Half h) {
  _Float16 f;
  std::memcpy(&f, &h.bits, 2);
  return static_cast<float>(f);
}

inline float to_float(BFloat16 b) {
  uint32_t u = static_cast<uint32_t>(b.bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

template <typename T> T from_float(float v);

template <> inline float from_float<float>(float v) { return v; }

template <> inline Half from_float<Half>(float v) {
  _Float16 f = static_cast<_Float16>(v);
  Half h;
  std::memcpy(&h.bits, &f, 2);
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
