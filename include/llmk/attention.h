// Exact attention that never forms the S x S score matrix: out = softmax(q k^T * scale + mask) v.
//
// q (B, Sq, Hq, D), k and v (B, Skv, Hkv, D), out (B, Sq, Hq, D): views with any strides except a
// contiguous last dim, so (B, H, S, D) tensors are passed transposed, without copies. Hq must be a
// multiple of Hkv (GQA, MQA): query head h reads KV head h / (Hq / Hkv); K and V are never expanded.
// Causal masking aligns the diagonal top-left (PyTorch SDPA: query i sees keys j <= i) or
// bottom-right (flash_attn: j <= i + Skv - Sq). A query row that sees no key gets zeros and a
// log-sum-exp of -inf. lse, when given, is (B, Hq, Sq) float32: log(sum_j exp(score_ij)).
//
// Backends: CPU (f32, f16, bf16; a tiled online-softmax loop, also the reference); GPU (f16, bf16;
// head dims 64, 80, 96, 128, 256): on Hopper (sm_90a builds) warp-specialised wgmma/TMA kernels
// for D 64 and 128, on NVIDIA sm_80+ otherwise a mma.sync kernel, and a portable one on AMD (or
// with LLMK_ATTENTION_PORTABLE=1 in the environment). The kernels: docs/attention.md.
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

// Packed variable-length batches (flash_attn_varlen_func): q (total_q, Hq, D), k and v
// (total_k, Hkv, D), out like q; sequence b is rows [cu_seqlens_q[b], cu_seqlens_q[b + 1]) of q
// and [cu_seqlens_k[b], cu_seqlens_k[b + 1]) of k and v (int32 (batch + 1,) tensors on the
// tensors' device; checked on the CPU only), every q length at most max_seqlen_q. Causal
// bottom-right aligns per sequence. lse, when given, is (Hq, total_q) float32.
void attention_varlen(TensorView out, TensorView lse, TensorView q, TensorView k, TensorView v,
                      TensorView cu_seqlens_q, TensorView cu_seqlens_k, int64_t max_seqlen_q,
                      const AttentionOptions& options, Stream stream = nullptr);

}  // namespace llmk
