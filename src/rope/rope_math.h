// Per-token angle lookup and the pair rotation, shared by the CPU and GPU backends.
#pragma once

#include <cmath>
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

// The pair rotation (y1, y2) = (x1 c - x2 s, x2 c + x1 s) in fp32, each an explicit fma of one
// product onto the other (rounded): the GPU kernels that must agree bit for bit
// (skinny_gemm_rope_kv's epilogue and rope_write_kv_cache) call this rather than leave the
// contraction to the compiler, which may fuse differently in each kernel.
LLMK_HOST_DEVICE void rotate_pair(float x1, float x2, float c, float s, float& y1, float& y2) {
  y1 = fmaf(x1, c, -(x2 * s));
  y2 = fmaf(x2, c, x1 * s);
}

// rope_angles: the position of token (b, s) as a float (HF's position_ids.float(): exact below 2^24)
// and its angle at one frequency (one fp32 product, as HF multiplies them).
LLMK_HOST_DEVICE float angle_position(const RopeAnglesParams& p, int64_t b, int64_t s) {
  const int64_t at = b * p.pos_strides[0] + s * p.pos_strides[1];
  return p.positions_int64 ? static_cast<float>(static_cast<const int64_t*>(p.positions)[at])
                           : static_cast<float>(static_cast<const int32_t*>(p.positions)[at]);
}

}  // namespace llmk::detail
