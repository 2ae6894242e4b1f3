// Validated arguments handed from attention.cpp (checks) to the CPU and GPU backends.
#pragma once

#include <cstdint>

#include "llmk/attention.h"

namespace llmk::detail {

struct AttentionParams {
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  void* out = nullptr;
  float* lse = nullptr;  // optional, (B, Hq, Sq)
  int64_t q_strides[3] = {}, k_strides[3] = {}, v_strides[3] = {}, out_strides[3] = {};  // B, S, H
  int64_t lse_strides[3] = {};
  int64_t batch = 0, q_len = 0, kv_len = 0, q_heads = 0, kv_heads = 0, head_dim = 0;
  float scale = 1.f;
  bool causal = false;
  int64_t diagonal_offset = 0;  // query i sees keys j <= i + diagonal_offset when causal
  DType dtype = DType::f32;
  Device device;
  Stream stream = nullptr;
};

// Head dims the GPU kernels are built for.
inline bool gpu_head_dim_supported(int64_t d) { return d == 64 || d == 80 || d == 96 || d == 128 || d == 256; }

void attention_cpu(const AttentionParams& p);
// GPU backend: the tensor-core (mma.sync) kernel on NVIDIA sm_80+, else (HIP, older GPUs,
// unaligned strides, or LLMK_ATTENTION_PORTABLE=1 in the environment) the portable FMA kernel.
void attention_gpu(const AttentionParams& p);

}  // namespace llmk::detail
