// One decoder layer's decode step at batch 1 in a single kernel launch (LLaMA family: RMSNorm,
// attention with RoPE and GQA over a KV cache, SwiGLU MLP, two residual adds):
//
//   h   = rms_norm(x) * input_norm
//   q, k, v = split(h qkv^T);  q, k = rope(q, k, cos_sin_cache[position])   (neox pairs i, i + D/2)
//   k_cache[0, :, position] = k;  v_cache[0, :, position] = v
//   a   = softmax(q k_cache[:, :position + 1]^T * scale) v_cache          (GQA: Hq / Hkv heads per KV head)
//   xm  = x + a o^T
//   h2  = rms_norm(xm) * post_norm
//   out = xm + (silu(h2 gate^T) * (h2 up^T)) down^T                       (gate_up = [gate; up])
//
// Shapes: x, out (1, H) (any shape of H elements, contiguous); input_norm, post_norm (H);
// qkv ((Hq + 2 Hkv) D, H); o (H, Hq D); gate_up (2 I, H); down (H, I), all contiguous and of x's
// dtype (f16 or bf16); cos_sin_cache (P, D) float32, [cos | sin] per position; k_cache, v_cache
// (1, Hkv, S, D), last dim contiguous; position: one int32 or int64 on the device (the new token's
// cache slot; the cache holds positions 0..position-1 already). Hkv and D come from the cache, Hq
// from qkv's rows. D = 64, 128 or 256. scale 0 means 1/sqrt(D). out may be x itself.
//
// Every intermediate is rounded to x's dtype where the chain of separate ops would round it
// (rms_norm, skinny_gemm, rope, write_kv_cache, decode_attention, fused_add_rms_norm, skinny_gemm
// with SwiGLU, skinny_gemm, add); not bitwise the same, as a different fp32 summation order flips
// some of those roundings, but as accurate (tests/python/test_decode_layer.py).
//
// GPU only (the persistent kernel is the point; on the CPU use those ops: the Python
// decoder_layer_step does). It is a cooperative launch of as many blocks as fit at once (one per SM
// on the H200), its phases separated by grid-wide barriers: nothing else may hold the GPU's SMs in
// the meantime (the runtime refuses the launch rather than hang). A position outside the cache or
// the rotary table gives NaN outputs and leaves the cache untouched (the GPU cannot check it on the
// host without a sync).
//
// workspace: decode_layer_workspace_size() bytes of GPU memory, 16-byte aligned, ZEROED before the
// first call (every call leaves it ready for the next). Calls sharing a workspace must not run
// concurrently. No allocation or synchronisation inside: capturable in a CUDA graph.
#pragma once

#include <cstddef>

#include "llmk/tensor.h"

namespace llmk {

struct DecoderLayerWeights {
  TensorView input_norm;  // (H)
  TensorView qkv;         // ((Hq + 2 Hkv) D, H): q rows, then k rows, then v rows
  TensorView o;           // (H, Hq D)
  TensorView post_norm;   // (H)
  TensorView gate_up;     // (2 I, H): gate rows, then up rows
  TensorView down;        // (H, I)
};

struct DecoderLayerOptions {
  float eps = 1e-6f;  // of both RMSNorms
  float scale = 0.f;  // attention scale; 0 means 1 / sqrt(D)
};

std::size_t decode_layer_workspace_size(TensorView x, const DecoderLayerWeights& weights,
                                        TensorView cos_sin_cache, TensorView k_cache, TensorView v_cache);

void decode_layer_step(TensorView out, TensorView x, const DecoderLayerWeights& weights, TensorView cos_sin_cache,
                       TensorView k_cache, TensorView v_cache, TensorView position, const DecoderLayerOptions& options,
                       void* workspace, std::size_t workspace_bytes, Stream stream = nullptr);

}  // namespace llmk
