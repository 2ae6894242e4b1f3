// Validated arguments handed from gemm.cpp (checks) to the CPU and GPU backends.
#pragma once

#include <cstdint>

#include "llmk/gemm.h"

namespace llmk::detail {

// skinny_gemm_rope_kv's epilogue (validated in gemm.cpp): output columns [0, q_heads * D) are q,
// then kv_heads * D of k and as many of v; x row m is sequence m of the caches.
struct GemmRopeKvParams {
  int64_t q_heads = 0, kv_heads = 0, head_dim = 0;
  const void* cos = nullptr;  // row m at m * cos_stride, head_dim / 2 elements
  const void* sin = nullptr;
  int64_t cos_stride = 0, sin_stride = 0;
  const void* positions = nullptr;  // positions[m * pos_stride]
  bool positions_int64 = false;
  int64_t pos_stride = 0;
  void* k_cache = nullptr;  // [m * strides[0] + h * strides[1] + slot * strides[2] + d]
  void* v_cache = nullptr;
  int64_t k_strides[3] = {}, v_strides[3] = {};
  int64_t capacity = 0;  // S, the slots per sequence
  void* advance = nullptr;  // length counter += 1 after every position is read, or nullptr
  bool advance_int64 = false;
  unsigned* counter = nullptr;  // GPU: the blocks' count for the advance (zero between calls)
};

struct GemmParams {
  const void* x = nullptr;
  const void* w = nullptr;
  const void* bias = nullptr;  // (N) or nullptr
  void* out = nullptr;
  int64_t m = 0, k = 0, n = 0;  // x (m, k), w (n, k); out (m, n) or (m, n / 2) when gated
  int64_t x_stride = 0, w_stride = 0, out_stride = 0;  // row strides in elements
  GemmActivation activation = GemmActivation::none;
  const void* norm_w = nullptr;  // (K) RMSNorm prologue, or nullptr
  float norm_eps = 0.f, norm_offset = 0.f;
  const void* residual = nullptr;  // (m, out cols) residual epilogue, or nullptr
  int64_t residual_stride = 0;
  bool portable = false;
  const GemmRopeKvParams* rope = nullptr;  // host side: skinny_gemm_rope_kv's epilogue (the kernel gets a copy), or nullptr
  bool pdl = false;  // set by the GPU launcher: launched with programmatic dependent launch
  bool fixed_weight = false;  // GemmOptions::fixed_weight: W may be read before the PDL wait
  // the next kernel launches after the W stream, not at the start: the deep kernel (deep_pdl_late:
  // launch_deep_rows) and the TMA kernel (LLMK_GEMM_TMA_PDL_LATE: launch_tma_rows) set it per launch
  bool pdl_late = true;
  // the TMA kernel's W boxes mark their L2 lines evict-first (launch_tma_rows sets it per launch;
  // LLMK_GEMM_TMA_W_EVICT_FIRST=0 turns it off)
  bool w_evict_first = false;
  DType dtype = DType::f32;
  Device device{};
  Stream stream = nullptr;
};

void skinny_gemm_cpu(const GemmParams& p);
void skinny_gemm_gpu(const GemmParams& p);
// The fused q/k/v + RoPE + K/V write (p.rope set) in one launch (per 16 rows, or per portable
// pass) where the GPU kernel that runs the product has the epilogue (deep: D a multiple of 16;
// portable: of 8); false, having launched nothing, elsewhere.
bool skinny_gemm_rope_kv_gpu(const GemmParams& p);
// Those fused launches so far, for tests that must know they ran (gemm.cpp: 0 without a GPU backend).
int64_t skinny_gemm_rope_kv_launches();
int64_t skinny_gemm_rope_kv_launches_gpu();
// The TMA kernel's split-tail launches so far (LLMK_GEMM_TMA_TAIL=1), for the tests likewise.
int64_t skinny_gemm_tma_tail_launches();
int64_t skinny_gemm_tma_tail_launches_gpu();
// The products the TMA kernel ran so far (tests of which kernel the default picks).
int64_t skinny_gemm_tma_calls();
int64_t skinny_gemm_tma_calls_gpu();

}  // namespace llmk::detail
