// Per-token angle lookup and the pair rotation, shared by the CPU and GPU backends.
#pragma once

#include <cstdint>

#include "gpu/host_device.h"
#include "rope/rope_internal.h"

namespace llmk::detail {

// Pointers to the rot_dim/2 cosines and sines of token (b, s); false when its position is
// outside the cache.
template <typename C>
LLMK_HOST_DEVICE bool angle_rows(const RopeParams& p, int64_t b, int64_t s, const C*& cos_row,
                                 const C*& sin_row) {
  if (p.positions != nullptr) {
    const int64_t at = b * p.pos_strides[0] + s * p.pos_strides[1];
    const int64_t pos = p.positions_int64 ? static_cast<const int64_t*>(p.positions)[at]
                                          : static_cast<const int32_t*>(p.positions)[at];
    if (pos < 0 || pos >= p.cache_rows) return false;
    cos_row = static_cast<const C*>(p.cache) + pos * p.cache_stride;
    sin_row = cos_row + p.rot_dim / 2;
  } else {
    cos_row = static_cast<const C*>(p.cos) + b * p.cos_strides[0] + s * p.cos_strides[1];
    sin_row = static_cast<const C*>(p.sin) + b * p.sin_strides[0] + s * p.sin_strides[1];
  }
  return true;
}

// Element indices of rotation pair i (of rot_dim / 2) in a head.
LLMK_HOST_DEVICE void pair_index(RopeStyle style, int64_t i, int64_t rot_dim, int64_t& i1, int64_t& i2) {
  if (style == RopeStyle::neox) {
    i1 = i;
    i2 = i + rot_dim / 2;
  } else {
    i1 = 2 * i;
    i2 = 2 * i + 1;
  }
}

// rope_angles: the position of token (b, s) as a float (HF's position_ids.float(): exact below 2^24)
// and its angle at one frequency (one fp32 product, as HF multiplies them).
LLMK_HOST_DEVICE float angle_position(const RopeAnglesParams& p, int64_t b, int64_t s) {
  const int64_t at = b * p.pos_strides[0] + s * p.pos_strides[1];
  return p.positions_int64 ? static_cast<float>(static_cast<const int64_t*>(p.positions)[at])
                           : static_cast<float>(static_cast<const int32_t*>(p.positions)[at]);
}

}  // namespace llmk::detail
