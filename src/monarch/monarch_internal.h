// Validated arguments handed from monarch.cpp (checks) to the CPU and GPU backends.
#pragma once

#include <cstddef>
#include <cstdint>

#include "llmk/monarch.h"

namespace llmk::detail {

struct MonarchParams {
  int64_t tokens = 0;
  int64_t k = 0, q = 0, p = 0;  // w1 (k, q, p)
  int64_t l = 0, s = 0, r = 0;  // w2 (l, s, r)
  const void* x = nullptr;
  int64_t x_stride = 0;  // row stride of x in elements
  const void* w1 = nullptr;
  const void* w2 = nullptr;
  void* out = nullptr;
  int64_t out_stride = 0;
  // backward only
  const void* dout = nullptr;
  int64_t dout_stride = 0;
  void* dx = nullptr;
  int64_t dx_stride = 0;
  void* dw1 = nullptr;
  void* dw2 = nullptr;
  void* workspace = nullptr;
  std::size_t workspace_bytes = 0;
  DType dtype = DType::f32;
  Device device{};
  Stream stream = nullptr;

  int64_t n() const { return k * p; }
  int64_t m() const { return l * s; }
  int64_t mid() const { return k * q; }
};

// Whether a pointer suits 16-byte vector loads and cp.async.
inline bool aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

// Rounds workspace pieces up to 256 bytes.
inline std::size_t monarch_align(std::size_t bytes) { return (bytes + 255) / 256 * 256; }

// Backward workspace (GPU), byte offsets: w1^T (k, p, q), w2^T (l, r, s), z = y in (l, r)
// order and dy in (k, q) order, each (tokens, k*q), dout in block order (tokens, l*s), all in the
// dtype; then fp32 partial weight-gradient sums, up to kMaxDwSplits copies of the larger factor.
constexpr int kMaxDwSplits = 16;

struct MonarchWorkspace {
  std::size_t w1t = 0, w2t = 0, z = 0, dy = 0, dout_perm = 0, partial = 0, total = 0;
};

inline MonarchWorkspace monarch_backward_layout(const MonarchParams& p) {
  const std::size_t e = dtype_size(p.dtype);
  const std::size_t t = static_cast<std::size_t>(p.tokens);
  const std::size_t w1 = p.k * p.q * p.p, w2 = p.l * p.s * p.r;
  MonarchWorkspace w;
  w.w2t = w.w1t + monarch_align(w1 * e);
  w.z = w.w2t + monarch_align(w2 * e);
  w.dy = w.z + monarch_align(t * p.mid() * e);
  w.dout_perm = w.dy + monarch_align(t * p.mid() * e);
  w.partial = w.dout_perm + monarch_align(t * p.m() * e);
  w.total = w.partial + monarch_align(kMaxDwSplits * (w1 > w2 ? w1 : w2) * sizeof(float));
  return w;
}

inline std::size_t monarch_backward_bytes(const MonarchParams& p) { return monarch_backward_layout(p).total; }

void monarch_cpu(const MonarchParams& p);
void monarch_backward_cpu(const MonarchParams& p);
std::size_t monarch_gpu_workspace_bytes(const MonarchParams& p);  // forward
void monarch_gpu(const MonarchParams& p);
// The forward as one kernel on thread block clusters (monarch_cluster.cu); false (nothing launched)
// where the build, device, dtype or shape do not suit it.
bool monarch_cluster_forward(const MonarchParams& p);
void monarch_backward_gpu(const MonarchParams& p);
// The few-token forward (monarch_skinny.cu): up to kMonarchSkinnyTokens tokens, fp16/bf16, block
// inputs in multiples of 8 (p, r), NVIDIA sm_80+, unless LLMK_MONARCH_SKINNY=0 (shape: whether it
// applies, pointers aside); it needs monarch_skinny_bytes of workspace. monarch_skinny_forward
// returns false (nothing launched) where it does not apply.
constexpr int64_t kMonarchSkinnyTokens = 16;
bool monarch_skinny_shape(const MonarchParams& p);
inline std::size_t monarch_skinny_bytes(const MonarchParams& p) {
  return static_cast<std::size_t>(p.tokens) * p.mid() * dtype_size(p.dtype);
}
bool monarch_skinny_forward(const MonarchParams& p);
// The few-token forward in one launch by stage-2 block (monarch_decode.cu, portable, fp16/bf16,
// up to kMonarchSkinnyTokens tokens, blocks p, r multiples of 8 up to 256, no workspace); false
// (nothing launched) where it does not apply.
bool monarch_decode_forward(const MonarchParams& p);
// The few-token forward in one launch on tensor cores and thread block clusters
// (monarch_decode_mma.cu: NVIDIA sm_90a, fp16/bf16, up to kMonarchSkinnyTokens tokens, l and q
// multiples of 8, p, s, r of 16); false (nothing launched) where it does not apply. The launches
// so far (for tests that must know it ran).
bool monarch_decode_mma_forward(const MonarchParams& p);
int64_t monarch_decode_mma_launches();  // monarch.cpp: 0 in a build without a GPU backend
int64_t monarch_decode_mma_launches_gpu();
// Launches of the CUDA-core tiled kernels (monarch_simt_tile_kernel, dw_simt_kernel; monarch_gpu.cu)
// so far, for tests that must know they ran.
int64_t monarch_simt_launches();  // monarch.cpp: 0 in a build without a GPU backend
int64_t monarch_simt_launches_gpu();
// Of those stage launches, the ones that read 16-byte chunks (the default; LLMK_MONARCH_SIMT_VEC=0 turns them off).
int64_t monarch_simt_vec_launches();
int64_t monarch_simt_vec_launches_gpu();

// The operands of both one-launch few-token kernels (the first members of their argument structs).
struct FewTokenOperands {
  const void* x = nullptr;
  int64_t x_stride = 0;
  const void* w1 = nullptr;  // (k*q, p) rows
  const void* w2 = nullptr;  // (l, s, r)
  void* out = nullptr;
  int64_t out_stride = 0;
};
inline void set_operands(FewTokenOperands& o, const MonarchParams& p) {
  o.x = p.x, o.x_stride = p.x_stride, o.w1 = p.w1, o.w2 = p.w2, o.out = p.out, o.out_stride = p.out_stride;
}

}  // namespace llmk::detail
