// Validated arguments handed from activation.cpp (checks) to the CPU and GPU backends.
#pragma once

#include <cstdint>

#include "llmk/activation.h"

namespace llmk::detail {

// Forward: out = act(gate) * up. Backward (grad_out set): grad_gate, grad_up.
struct GatedParams {
  const void* gate = nullptr;
  const void* up = nullptr;
  void* out = nullptr;             // forward only
  const void* grad_out = nullptr;  // backward only
  void* grad_gate = nullptr;       // backward only
  void* grad_up = nullptr;         // backward only
  int64_t gate_stride = 0, up_stride = 0, out_stride = 0;
  int64_t grad_out_stride = 0, grad_gate_stride = 0, grad_up_stride = 0;
  int64_t rows = 0, cols = 0;
  DType dtype = DType::f32;
  Activation act = Activation::silu;
  Device device{};
  Stream stream = nullptr;
  bool backward() const { return grad_out != nullptr; }
};

void gated_activation_cpu(const GatedParams& p);
void gated_activation_gpu(const GatedParams& p);

}  // namespace llmk::detail
