// Validated arguments handed from attention.cpp (checks) to the CPU and GPU backends.
#pragma once

#include <cstdint>

#include "gpu/host_device.h"
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
  // Variable-length batches (packed sequences): sequence b is rows [cu_q[b], cu_q[b + 1]) of q
  // and [cu_k[b], cu_k[b + 1]) of k and v, in memory on the tensors' device; then batch is the
  // number of sequences, q_len / kv_len bound every sequence's length (the grid is sized by
  // q_len), the batch strides are 0 and lse rows are indexed by packed query row. A causal
  // bottom-right mask aligns per sequence (varlen_bottom_right), not by diagonal_offset.
  const int32_t* cu_seqlens_q = nullptr;
  const int32_t* cu_seqlens_k = nullptr;
  bool varlen_bottom_right = false;
  // The 1-D grid's order (grid_block): sections of this many batch x head indices; 0 = one
  // section (tile-major). Set by the GPU dispatch (attention_gpu.cu, grid_section).
  int grid_section = 0;
  Device device;
  Stream stream = nullptr;
};

// One sequence's place: its first q and k rows, lengths and causal diagonal offset.
struct SeqSpan {
  int64_t q_start, q_len, k_start, kv_len, diagonal_offset;
};

LLMK_HOST_DEVICE SeqSpan seq_span(const AttentionParams& p, int64_t b) {
  if (p.cu_seqlens_q == nullptr) return {0, p.q_len, 0, p.kv_len, p.diagonal_offset};
  const int64_t q0 = p.cu_seqlens_q[b], q1 = p.cu_seqlens_q[b + 1];
  const int64_t k0 = p.cu_seqlens_k[b], k1 = p.cu_seqlens_k[b + 1];
  return {q0, q1 - q0, k0, k1 - k0, p.causal && p.varlen_bottom_right ? (k1 - k0) - (q1 - q0) : 0};
}

// Block `block` of a 1-D grid of m_tiles x bh_count blocks: its query tile rank (0 = the first
// tile; the kernels reverse it when causal, so that the longest tiles start first) and its
// batch x head index. The grid runs in sections of p.grid_section batch x head indices (the last
// one may be narrower), each section tile-major: all its heads' first tiles, then their second
// tiles, and so on. Tile-major over the whole grid (one section) has the blocks running at once
// stream the K / V of many heads; sections bound that to what L2 holds, so the other tiles of a
// head find its K / V there, while keeping the longest-first order within each section.
struct GridBlock {
  int tile_rank, bh;
};
LLMK_HOST_DEVICE GridBlock grid_block(const AttentionParams& p, int block, int m_tiles, int bh_count) {
  const int section = p.grid_section > 0 && p.grid_section < bh_count ? p.grid_section : bh_count;
  const int first_bh = block / (section * m_tiles) * section;
  const int rank = block - first_bh * m_tiles;  // within the section
  const int width = bh_count - first_bh < section ? bh_count - first_bh : section;
  return {rank / width, first_bh + rank % width};
}

// Head dims the GPU kernels are built for.
inline bool gpu_head_dim_supported(int64_t d) { return d == 64 || d == 80 || d == 96 || d == 128 || d == 256; }

void attention_cpu(const AttentionParams& p);
// GPU backend: the tensor-core (mma.sync) kernel on NVIDIA sm_80+, else (HIP, older GPUs,
// unaligned strides, or LLMK_ATTENTION_PORTABLE=1 in the environment) the portable FMA kernel.
void attention_gpu(const AttentionParams& p);

// Hopper wgmma kernel (attention_hopper.cu; opt-in with LLMK_ATTENTION_HOPPER=1): launches it and
// returns true when it applies (a CUDA build holding its sm_90a code, a compute capability 9.0
// device, D 64 or 128, f16 or bf16; the caller has checked 16-byte aligned rows), else false.
bool attention_hopper(const AttentionParams& p);

// Whether the Hopper kernel can run on `device` (tests: run, skip, or fail when an sm_90 device
// meets a build without sm_90a code).
enum class HopperStatus { no_device, not_sm90, not_built, available };
HopperStatus hopper_status(int device);  // attention.cpp: no_device in a build without a GPU backend
HopperStatus hopper_status_gpu(int device);

// Test hook for the wgmma primitives alone (one warpgroup, 128-key tile): with q (64 x d), k and
// v (128 x d) contiguous on the current GPU, writes s = q k^T (64 x 128 fp32) and o = P v (64 x d
// fp32, P = s rounded to dtype). d 64 or 128, dtype f16 or bf16. False when not available.
// variant 1 (diagnosis only): V's descriptor with its two byte offsets swapped.
bool wgmma_tile_selftest(DType dtype, int d, const void* q, const void* k, const void* v, float* s, float* o,
                         int variant = 0);
bool wgmma_tile_selftest_gpu(DType dtype, int d, const void* q, const void* k, const void* v, float* s, float* o,
                             int variant);

// The "ws" tiling (LLMK_ATTENTION_HOPPER_CONFIG=ws): how many times it has been launched in this
// process (tests: it did run rather than fall back to "pipe"); 0 in builds without it.
int64_t hopper_ws_launches();
int64_t hopper_ws_launches_gpu();
// Whether an mbarrier wait of the ws tiling (or its TMA self test) timed out on the current device
// since the last call (a pipeline deadlock: the kernel gave up and its results are garbage).
// Clears the flag, so that one deadlocking case does not make every later launch give up at once.
bool hopper_ws_timed_out();
bool hopper_ws_timed_out_gpu();

// Test hook for the "ws" tiling's TMA loads alone: one 128-row x d tile (rows row0.. of a
// rows x d matrix of dtype at src, row stride `stride` elements, on the current GPU) loaded into
// 128B-swizzled shared memory by TMA and by the cp.async path; both byte images (128 * d * 2
// bytes) written to out_tma / out_cp (device memory). d 64 or 128, f16 or bf16. False when not
// available (no sm_90a build or device, or the driver refusing the tensor map).
bool tma_tile_selftest(DType dtype, int d, const void* src, int64_t stride, int rows, int row0, void* out_tma,
                       void* out_cp);
bool tma_tile_selftest_gpu(DType dtype, int d, const void* src, int64_t stride, int rows, int row0, void* out_tma,
                           void* out_cp);

}  // namespace llmk::detail
