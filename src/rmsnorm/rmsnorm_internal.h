// Validated arguments handed from rmsnorm.cpp (checks) to the CPU and GPU backends.
#pragma once

#include <cstddef>
#include <cstdint>

#include "llmk/tensor.h"

namespace llmk::detail {

struct RmsNormParams {
  void* y = nullptr;
  const void* x = nullptr;
  const void* residual = nullptr;  // fused add only
  void* residual_out = nullptr;    // fused add only (may equal residual)
  const void* weight = nullptr;
  int64_t y_stride = 0, x_stride = 0, residual_stride = 0, residual_out_stride = 0;
  int64_t rows = 0, cols = 0;
  DType dtype = DType::f32;         // of x, y, residual
  DType weight_dtype = DType::f32;  // x's dtype or f32
  float eps = 0.f, offset = 0.f;
  Device device{};
  Stream stream = nullptr;
};

struct RmsNormBackwardParams {
  void* grad_x = nullptr;
  void* grad_weight = nullptr;
  const void* grad_y = nullptr;
  const void* x = nullptr;
  const void* weight = nullptr;
  const void* grad_extra = nullptr;  // optional, added to grad_x
  int64_t grad_x_stride = 0, grad_y_stride = 0, x_stride = 0, grad_extra_stride = 0;
  int64_t rows = 0, cols = 0;
  DType dtype = DType::f32;
  DType weight_dtype = DType::f32;
  float eps = 0.f, offset = 0.f;
  float* workspace = nullptr;  // GPU only
  Device device{};
  Stream stream = nullptr;
};

void rms_norm_cpu(const RmsNormParams& p);
void rms_norm_backward_cpu(const RmsNormBackwardParams& p);

void rms_norm_gpu(const RmsNormParams& p);
void rms_norm_backward_gpu(const RmsNormBackwardParams& p);
std::size_t rms_norm_backward_workspace_gpu(int64_t rows, int64_t cols, DType dtype, Device device);

}  // namespace llmk::detail
