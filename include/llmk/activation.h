// Gated activations: out = act(gate) * up, elementwise over rows of the last dim.
// act: silu (SwiGLU), gelu with erf (GEGLU), gelu with the tanh approximation.
// fp32 arithmetic whatever the storage dtype.
//
// Shapes: gate, up, out are (..., d) with the same shape and dtype (f32, f16, bf16); the last dim
// contiguous, leading dims reachable with one row stride. The packed form of vLLM and FlashInfer,
// x of (..., 2d) with gate = x[..., :d] and up = x[..., d:], is the same call on two row-strided
// views of x (TensorView slices), so it needs no op of its own.
#pragma once

#include "llmk/tensor.h"

namespace llmk {

enum class Activation : int { silu, gelu, gelu_tanh };

const char* activation_name(Activation act);

void gated_activation(TensorView out, TensorView gate, TensorView up, Activation act,
                      Stream stream = nullptr);

// grad_gate = grad_out * up * act'(gate); grad_up = grad_out * act(gate).
void gated_activation_backward(TensorView grad_gate, TensorView grad_up, TensorView grad_out,
                               TensorView gate, TensorView up, Activation act,
                               Stream stream = nullptr);

}  // namespace llmk
