// Validated arguments handed from rope.cpp (checks) to the CPU and GPU backends.
#pragma once

#include <cstdint>

#include "llmk/rope.h"

namespace llmk::detail {

// One of q or k: (B, S, H, D) strides in elements; the last dim is contiguous.
struct RopeTensor {
  const void* in = nullptr;
  void* out = nullptr;
  int64_t heads = 0;
  int64_t in_strides[3] = {};   // batch, seq, head
  int64_t out_strides[3] = {};
};

struct RopeParams {
  RopeTensor q, k;
  int64_t batch = 0, seq = 0, head_dim = 0, rot_dim = 0;
  // Angles: cache mode (positions != nullptr) reads cache[positions[b, s]] = [cos | sin];
  // direct mode reads cos[b, s, :] and sin[b, s, :] (rot_dim / 2 each).
  const void* cache = nullptr;
  int64_t cache_rows = 0, cache_stride = 0;
  const void* positions = nullptr;
  bool positions_int64 = true;
  int64_t pos_strides[2] = {};
  const void* cos = nullptr;
  const void* sin = nullptr;
  int64_t cos_strides[2] = {}, sin_strides[2] = {};
  DType dtype = DType::f32;        // q, k
  DType angle_dtype = DType::f32;  // cache or cos/sin
  RopeStyle style = RopeStyle::neox;
  bool inverse = false;
  bool in_place = false;
  Device device{};
  Stream stream = nullptr;
};

void rope_cpu(const RopeParams& p);
void rope_gpu(const RopeParams& p);

// rope_angles: cos/sin rows of width `width` (freqs or 2 * freqs) from positions and inv_freq.
struct RopeAnglesParams {
  void* cos = nullptr;
  void* sin = nullptr;
  int64_t cos_strides[2] = {}, sin_strides[2] = {};  // batch, seq (elements)
  const float* inv_freq = nullptr;
  const void* positions = nullptr;
  bool positions_int64 = true;
  int64_t pos_strides[2] = {};
  int64_t batch = 0, seq = 0, freqs = 0, width = 0;
  float scaling = 1.f;
  DType dtype = DType::f32;  // cos and sin
  Device device{};
  Stream stream = nullptr;
};

void rope_angles_cpu(const RopeAnglesParams& p);
void rope_angles_gpu(const RopeAnglesParams& p);

}  // namespace llmk::detail
