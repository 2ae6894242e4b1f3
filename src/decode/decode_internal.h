// Validated arguments handed from decode.cpp (checks) to the CPU and GPU backends.
#pragma once

#include <cstddef>
#include <cstdint>

#include "gpu/host_device.h"
#include "llmk/decode.h"

namespace llmk::detail {

// Where key/value position p of sequence b, head h lives:
//   contiguous: base + b * s0 + h * s1 + p * s2
//   paged:      base + block_table[b][p / block_size] * s0 + (p % block_size) * s1 + h * s2
struct KvCache {
  const void* k = nullptr;
  const void* v = nullptr;
  int64_t k_strides[3] = {}, v_strides[3] = {};
  bool paged = false;
  int64_t capacity = 0;    // contiguous: Smax; paged: max_blocks * block_size
  int64_t block_size = 1;  // paged only
  int64_t num_blocks = 0;  // paged only
  const int32_t* block_table = nullptr;
  int64_t table_stride = 0;  // elements between rows of block_table
  int64_t max_blocks = 0;
};

// The optional attention mask over cache positions (DecodeOptions::attn_mask): element
// data[b * strides[0] + t * strides[1] + pos * strides[2]] for positions pos < len (t stride 0 when
// the mask is shared by the T tokens). dtype boolean (true = attend) or f32 / f16 / bf16 (additive).
struct KeyMask {
  const void* data = nullptr;
  DType dtype = DType::boolean;
  int64_t strides[3] = {};
  int64_t len = 0;
};

struct DecodeParams {
  const void* q = nullptr;
  void* out = nullptr;
  int64_t q_strides[3] = {}, out_strides[3] = {};  // B, T, H (last dim contiguous)
  KvCache cache;
  const void* seq_lens = nullptr;  // int32, or int64 with seq_lens_i64 (seq_len_at reads either)
  int64_t seq_lens_stride = 1;
  bool seq_lens_i64 = false;
  KeyMask mask;
  int64_t batch = 0, tokens = 0, q_heads = 0, kv_heads = 0, head_dim = 0;
  float scale = 1.f;
  DType dtype = DType::f32;
  Device device{};
  Stream stream = nullptr;
  // GPU plan (decode_plan)
  int num_splits = 1;
  int64_t split_len = 0;  // positions per split, a multiple of the kernel's key tile
  int rows_per_block = 1;
  bool warp_kernel = false;  // decode_warp_kernel (default) or the previous decode_split_kernel
  bool mma_kernel = false;   // decode_mma_kernel (tensor cores, LLMK_DECODE_KERNEL=mma)
  bool mask_prefetch = false;  // decode_mma_kernel with a mask: stage it through the cp.async ring
                               // and stop at each chunk's last visible key (default; LLMK_DECODE_MASK_PREFETCH=0: off)
  bool mask_skip = false;  // with mask_prefetch: a chunk whose mask terms are 0 up to its last visible
                           // key (every row) runs the loop without the mask (default; LLMK_DECODE_MASK_SKIP=0: off)
  bool cluster_merge = false;  // set by the launch: the splits of a (sequence, KV head) form a
                               // thread block cluster and merge through distributed shared memory
  bool tma = false;  // decode_mma_kernel: K/V tiles by the TMA engine where the device and the
                     // cache (contiguous, or pages of 8, 16, 32, ... keys) allow (default;
                     // LLMK_DECODE_TMA=0: cp.async)
  void* workspace = nullptr;
  bool workspace_zeroed = false;  // DecodeOptions::workspace_zeroed: the split counters need no memset
};

// Element i of an int32 array, or of an int64 one when `wide` (lengths, positions, counters).
LLMK_HOST_DEVICE int64_t int_at(const void* data, bool wide, int64_t i) {
  return wide ? static_cast<const int64_t*>(data)[i] : static_cast<const int32_t*>(data)[i];
}

// seq_lens[b] (either integer width).
LLMK_HOST_DEVICE int64_t seq_len_at(const DecodeParams& p, int64_t b) {
  return int_at(p.seq_lens, p.seq_lens_i64, b * p.seq_lens_stride);
}

// GPU launch plan from shapes and options only (never from seq_lens' contents).
struct DecodePlan {
  int num_splits = 1;
  int64_t split_len = 0;
  int rows_per_block = 1;
  bool warp_kernel = false;
  bool mma_kernel = false;
  bool mask_prefetch = false;  // read from LLMK_DECODE_MASK_PREFETCH; never changes the split plan
  bool mask_skip = false;      // read from LLMK_DECODE_MASK_SKIP; never changes the split plan
  bool tma = false;            // read from LLMK_DECODE_TMA (with it, up to 4096 keys on the H200
                               // the plan takes at most 8 splits, merged in a cluster)
  std::size_t workspace_bytes = 0;
};
DecodePlan decode_plan_gpu(const DecodeParams& p, const DecodeOptions& options);

void decode_attention_cpu(const DecodeParams& p);
void decode_attention_gpu(const DecodeParams& p);

// The tensor-core decode kernels' flags since the last call, which clears them (0 without a GPU
// build): bit 0, an mbarrier wait of the TMA kernels timed out (a protocol bug: the wait gives up
// after 10 s, gpu/tma.h); bit 1, a block ran its chunk without the mask (LLMK_DECODE_MASK_SKIP).
unsigned decode_mma_flags();
unsigned decode_mma_flags_gpu();

struct KvWriteParams {
  void* k_cache = nullptr;
  void* v_cache = nullptr;
  KvCache cache;  // strides and table (k, v pointers unused)
  const void* k = nullptr;
  const void* v = nullptr;
  int64_t k_strides[3] = {}, v_strides[3] = {};  // B, T, H
  const void* positions = nullptr;
  bool positions_int64 = false;
  int64_t pos_strides[2] = {};
  void* advance = nullptr;  // length counter += tokens after the positions are read, or nullptr
  bool advance_int64 = false;
  int64_t batch = 0, tokens = 0, kv_heads = 0, head_dim = 0;
  // rope_write_kv_cache on the GPU: cos != nullptr. q (q_heads heads) and k rotated into q_out and
  // k_out, the rotated k written to the cache; cos, sin rows (B, T) of head_dim / 2 in the dtype of
  // k. (The CPU runs rope_cos_sin, then write_kv_cache_cpu with k_out as k.)
  const void* cos = nullptr;
  const void* sin = nullptr;
  int64_t cos_strides[2] = {}, sin_strides[2] = {};
  const void* q = nullptr;
  void* q_out = nullptr;
  void* k_out = nullptr;
  int64_t q_strides[3] = {}, q_out_strides[3] = {}, k_out_strides[3] = {};  // B, T, H
  int64_t q_heads = 0;
  DType dtype = DType::f32;
  Device device{};
  Stream stream = nullptr;
};

// positions[b, t] (either integer width).
LLMK_HOST_DEVICE int64_t position_at(const KvWriteParams& p, int64_t b, int64_t t) {
  return int_at(p.positions, p.positions_int64, b * p.pos_strides[0] + t * p.pos_strides[1]);
}

// KvWriteParams::advance: the length counter += T (the CPU, or one GPU thread).
LLMK_HOST_DEVICE void advance_length(const KvWriteParams& p) {
  if (p.advance_int64) *static_cast<int64_t*>(p.advance) += p.tokens;
  else *static_cast<int32_t*>(p.advance) += static_cast<int32_t>(p.tokens);
}

void write_kv_cache_cpu(const KvWriteParams& p);
void write_kv_cache_gpu(const KvWriteParams& p);

// decode_layer_step (include/llmk/decode_layer.h): one decoder layer's batch-1 decode step in one
// persistent kernel. Weights are row-major and contiguous; caches (1, Hkv, S, D), strides of the
// head and position dims in k_strides / v_strides.
constexpr int64_t kLayerMinChunk = 16;    // keys per attention work item, at least (unless fewer)
constexpr int64_t kLayerMaxChunk = 1024;  // and at most (shared memory of the scores)
constexpr int kLayerTraceStamps = 14;

struct DecodeLayerParams {
  const void* x = nullptr;
  void* out = nullptr;
  const void* norm1 = nullptr;
  const void* norm2 = nullptr;
  const void* w_qkv = nullptr;      // ((Hq + 2 Hkv) D, H)
  const void* w_o = nullptr;        // (H, Hq D)
  const void* w_gate_up = nullptr;  // (2 I, H): gate rows, then up rows
  const void* w_down = nullptr;     // (H, I)
  const float* rope = nullptr;      // (rope_rows, D): [cos | sin] of neox pairs (i, i + D/2)
  int64_t rope_rows = 0;
  void* k_cache = nullptr;
  void* v_cache = nullptr;
  int64_t k_strides[2] = {}, v_strides[2] = {};
  const void* position = nullptr;  // one int32 or int64 on the device: the new token's position
  bool position_int64 = false;
  int64_t hidden = 0, inter = 0, q_heads = 0, kv_heads = 0, head_dim = 0, cache_len = 0;
  float eps = 1e-6f, scale = 1.f;
  DType dtype = DType::f16;
  Device device{};
  Stream stream = nullptr;
  // workspace (decode_layer_workspace): zero before the first call; every call leaves it so
  unsigned* barrier = nullptr;
  uint64_t* trace = nullptr;  // kLayerTraceStamps global-timer stamps of block 0 (ns), at workspace
                              // byte 16: start, norm, qkv, barrier, attention, barrier, merge, o, barrier,
                              // norm, gate/up, barrier, staging u, down (bench_decode.fused_layer_phases)
  unsigned* ws_tickets = nullptr;
  float* ws_sums = nullptr;
  float* ws_qkv = nullptr;
  float* ws_part_o = nullptr;
  float* ws_part_ml = nullptr;
  float* ws_xmid = nullptr;
  float* ws_u = nullptr;
  int64_t max_chunks = 1;
  bool vector_loads = true;  // 16-byte weight loads (H, I multiples of 8, aligned weights)
  bool prefetch = false;     // L2 prefetch of the next phase's weights (and K/V) before each barrier
                             // (LLMK_DECODE_LAYER_PREFETCH=1; measured slower, so off by default)
};

struct DecodeLayerPlan {
  int blocks = 1;
  std::size_t smem_bytes = 0;
  int64_t max_chunks = 1;
};
DecodeLayerPlan decode_layer_plan_gpu(const DecodeLayerParams& p);
void decode_layer_step_gpu(const DecodeLayerParams& p, const DecodeLayerPlan& plan);

}  // namespace llmk::detail
