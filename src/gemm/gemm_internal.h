// Validated arguments handed from gemm.cpp (checks) to the CPU and GPU backends.
#pragma once

#include <cstdint>

#include "llmk/gemm.h"

namespace llmk::detail {

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
  bool pdl = false;  // set by the GPU launcher: launched with programmatic dependent launch
  bool pdl_late = true;  // deep kernel: the next kernel launches after the streaming loop (LLMK_GEMM_PDL_LATE=0: at the start)
  DType dtype = DType::f32;
  Device device{};
  Stream stream = nullptr;
};

void skinny_gemm_cpu(const GemmParams& p);
void skinny_gemm_gpu(const GemmParams& p);

}  // namespace llmk::detail
