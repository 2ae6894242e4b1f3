// RMSNorm family: y = x / sqrt(mean(x^2) + eps) * (offset + weight), per row of the last dim.
// Statistics and arithmetic in fp32 whatever the storage dtype. offset = 1 gives Gemma's form.
//
// Shapes: x is (..., N), any rank >= 1; the last dim must be contiguous, the leading dims must
// be reachable with a single row stride (true for contiguous tensors and row slices).
// dtypes: x, residual, y in f32, f16 or bf16 (all the same); weight (N) in x's dtype or f32.
// Devices: CPU, or the GPU this library was built for (CUDA or HIP); all tensors on one device.
#pragma once

#include "llmk/tensor.h"

namespace llmk {

// y = rms_norm(x). y has x's shape and dtype.
void rms_norm(TensorView y, TensorView x, TensorView weight, float eps, float offset = 0.f,
              Stream stream = nullptr);

// residual_out = x + residual; y = rms_norm(residual_out), in one pass. residual_out may be the
// same memory as residual (the in-place form inference engines use), but must not partly overlap.
void fused_add_rms_norm(TensorView y, TensorView residual_out, TensorView x, TensorView residual,
                        TensorView weight, float eps, float offset = 0.f, Stream stream = nullptr);

// Backward of y = rms_norm(x):
//   grad_x = d(sum grad_y * y)/dx (+ grad_extra, when given: the residual path of the fused op)
//   grad_weight = sum over rows of grad_y * x / rms(x), accumulated in fp32, stored in weight's dtype.
// GPU calls need a fp32 workspace of rms_norm_backward_workspace_size() bytes (may be nullptr on
// the CPU or when the size is 0).
std::size_t rms_norm_backward_workspace_size(TensorView x);
void rms_norm_backward(TensorView grad_x, TensorView grad_weight, TensorView grad_y, TensorView x,
                       TensorView weight, float eps, float offset, const TensorView* grad_extra,
                       void* workspace, Stream stream = nullptr);

}  // namespace llmk
