// Exact attention that never forms the S x S score matrix: out = softmax(q k^T * scale + mask) v.
//
// q (B, Sq, Hq, D), k and v (B, Skv, Hkv, D), out (B, Sq, Hq, D): views with any strides except a
// contiguous last dim, so (B, H, S, D) tensors are passed transposed, without copies. Hq must be a
// multiple of Hkv (GQA, MQA): query head h reads KV head h / (Hq / Hkv); K and V are never expanded.
// Causal masking aligns the diagonal top-left (PyTorch SDPA: query i sees keys j <= i) or
// bottom-right (flash_attn: j <= i + Skv - Sq). A query row that sees no key gets zeros and a
// log-sum-exp of -inf. lse, when given, is (B, Hq, Sq) float32: log(sum_j exp(score_ij)).
//
// Backends: CPU (f32, f16, bf16; a tiled online-softmax loop, also the reference). The GPU kernel
// is issue 4's next step: GPU tensors get ErrorKind::not_implemented for now.
#pragma once

#include "llmk/tensor.h"

namespace llmk {

enum class CausalAlign : int { top_left, bottom_right };

struct AttentionOptions {
  bool causal = false;
  CausalAlign align = CausalAlign::top_left;
  float scale = 0.f;  // 0: 1 / sqrt(D)
};

void attention(TensorView out, TensorView lse, TensorView q, TensorView k, TensorView v,
               const AttentionOptions& options, Stream stream = nullptr);

}  // namespace llmk
