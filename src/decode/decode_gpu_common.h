// Decode attention on the GPU: what the kernels of decode_gpu.cu (split), decode_warp_*.cu (warp)
// and decode_mma_*.cu (tensor cores) share; the kernels are spread over those files by dtype (and
// head dim) so that they compile in parallel (decode_gpu.cu alone took ~3.5 minutes). Shared: constants, device
// helpers, the end of a split-KV block (finish_split_block), the split counters' reset, and the
// cluster merge's rules. Everything here is internal (an unnamed namespace) to each file.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>

#include "core/check.h"
#include "decode/decode_internal.h"
#include "gpu/compat.h"
#include "gpu/mma.h"  // LLMK_MMA_SYNC_BUILD
#include "gpu/runtime.h"

namespace llmk::detail {

using gpu::bfloat16;
using gpu::half;

namespace {

constexpr int kThreads = 128;
constexpr int kMaxSplits = 256;
constexpr float kLog2e = 1.4426950408889634f;

__host__ __device__ constexpr int tile_keys(int head_dim) { return head_dim == 256 ? 32 : 64; }
// Rows (query heads x tokens) one block serves at most: bounds shared memory and the registers of
// the output accumulator (rows * D / 4 elements of 4 over the block's threads: at most 8 each).
__host__ __device__ constexpr int max_rows(int head_dim) { return 4096 / head_dim; }

inline std::size_t smem_bytes(int head_dim, int rows) {
  const int n = tile_keys(head_dim);
  return static_cast<std::size_t>(n) * (head_dim + 8) * 2 + static_cast<std::size_t>(n) * head_dim * 2 +
         static_cast<std::size_t>(rows) * head_dim * 4 + static_cast<std::size_t>(rows) * n * 4 +
         3 * static_cast<std::size_t>(rows) * 4;
}

// The mask term (log2 domain) of position pos for token t of sequence b: 0 without a mask, -inf
// for a hidden key (boolean false, -inf, or past the mask's positions).
__device__ __forceinline__ float mask_log2(const KeyMask& m, int64_t b, int t, int64_t pos) {
  if (m.data == nullptr) return 0.f;
  if (pos >= m.len) return -INFINITY;
  const int64_t i = b * m.strides[0] + t * m.strides[1] + pos * m.strides[2];
  switch (m.dtype) {
    case DType::boolean: return static_cast<const bool*>(m.data)[i] ? 0.f : -INFINITY;
    case DType::f16: return gpu::to_float(static_cast<const half*>(m.data)[i]) * kLog2e;
    case DType::bf16: return gpu::to_float(static_cast<const bfloat16*>(m.data)[i]) * kLog2e;
    default: return static_cast<const float*>(m.data)[i] * kLog2e;
  }
}

// The positions [start, end) split `split` of sequence b reads in the one-launch kernels (warp,
// mma): its share of the sequence's length; a bad length (negative or past the cache) reads
// nothing and is reported through len_bad.
struct SplitChunk {
  int len, start, end;
  bool len_bad;
};
__device__ __forceinline__ SplitChunk split_chunk(const DecodeParams& p, int64_t b, int split) {
  const int64_t len64 = seq_len_at(p, b);
  SplitChunk c;
  c.len_bad = len64 < 0 || len64 > p.cache.capacity;
  c.len = c.len_bad ? 0 : static_cast<int>(len64);
  c.start = split * static_cast<int>(p.split_len);
  c.end = split == p.num_splits - 1 ? c.len : min(c.len, c.start + static_cast<int>(p.split_len));
  if (c.end < c.start) c.end = c.start;
  return c;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int m = LLMK_WARP_SIZE / 2; m > 0; m >>= 1) v = fmaxf(v, gpu::shfl_xor(v, m));
  return v;
}

// A paged cache's block size as a divisor: a shift and a mask when it is a power of two (vLLM's
// sizes), else a division; the kernels split every key's position into (block, offset), and a
// division by a run-time value costs ~20 instructions where a shift costs one.
struct PageSize {
  int size, shift = -1;  // shift < 0: not a power of two
  __device__ __forceinline__ explicit PageSize(int64_t block_size) : size(static_cast<int>(block_size)) {
    if (size > 0 && (size & (size - 1)) == 0)
      for (shift = 0; (1 << shift) < size;) ++shift;  // once per thread, <= 8 trips (sizes <= 256)
  }
  __device__ __forceinline__ int block_of(int pos) const { return shift >= 0 ? pos >> shift : pos / size; }
  __device__ __forceinline__ int offset_of(int pos) const {
    return shift >= 0 ? pos & (size - 1) : pos - (pos / size) * size;
  }
};

// Global offset of chunk c (8 elements) of position pos; -1 when the block index is bad.
template <bool PAGED>
__device__ __forceinline__ int64_t kv_offset(const KvCache& c, const int64_t* strides, int64_t b,
                                             int64_t h, int64_t pos) {
  if (!PAGED) return b * strides[0] + h * strides[1] + pos * strides[2];
  const int64_t blk = c.block_table[b * c.table_stride + pos / c.block_size];
  if (blk < 0 || blk >= c.num_blocks) return -1;
  return blk * strides[0] + (pos % c.block_size) * strides[1] + h * strides[2];
}

// The end of a split-KV block, shared by decode_warp_kernel and decode_mma_kernel: the block's
// rows have their unnormalised output o_s[rows][D] (fp32, shared), row sums tot_s and running
// maxima lse_s (log2 domain) in shared memory. One split: writes the normalised output. Several:
// writes (o / l, lse) to the workspace (the layout of decode_split_kernel), counts the block done on
// the per-(sequence, KV head) counter, and the last block of the head merges every split in place
// and resets the counter. wts: rows x kMaxSplits floats, part_s: NT float4 (both shared scratch);
// every thread of the block (NT) calls it.
template <typename T, int D, int NT>
__device__ __forceinline__ void finish_split_block(const DecodeParams& p, int64_t b, int64_t hk, int split,
                                                   int rows, float* o_s, float* tot_s, const float* lse_s,
                                                   bool any_bad, float* wts, float4* part_s, int& last_s) {
  constexpr int W = LLMK_WARP_SIZE;
  constexpr int NW = NT / W;
  const int tid = threadIdx.x, lane = tid % W, warp = tid / W;
  const int T_ = static_cast<int>(p.tokens);
  const int group = static_cast<int>(p.q_heads / p.kv_heads);
  const int S = p.num_splits;
  const float nan = __int_as_float(0x7fc00000);
  if (S == 1) {
    for (int i = tid; i < rows * D; i += NT) {
      const int r = i / D, d = i % D, g = r / T_, t = r % T_;
      const float lb = tot_s[r];
      const float inv = any_bad ? nan : (lb > 0.f ? 1.f / lb : 0.f);
      T* o = static_cast<T*>(p.out) + b * p.out_strides[0] + t * p.out_strides[1] + (hk * group + g) * p.out_strides[2];
      o[d] = gpu::from_float<T>(o_s[i] * inv);
    }
    return;
  }

  // several splits: partial result to the workspace (the layout of decode_split_kernel)
  const int64_t rows_total = p.batch * p.q_heads * p.tokens;
  float* ws_o = static_cast<float*>(p.workspace);
  float* ws_lse = ws_o + rows_total * S * D;
  unsigned* counters = reinterpret_cast<unsigned*>(
      static_cast<char*>(p.workspace) + (static_cast<std::size_t>(rows_total) * S * (D + 1) * 4 + 15) / 16 * 16);
  auto row_of = [&](int r) { return (b * p.q_heads + hk * group + r / T_) * p.tokens + r % T_; };
  for (int i = tid; i < rows * D; i += NT) {
    const int r = i / D, d = i % D;
    const float lb = tot_s[r];
    const float inv = any_bad ? nan : (lb > 0.f ? 1.f / lb : 0.f);
    ws_o[(row_of(r) * S + split) * D + d] = o_s[i] * inv;
  }
  if (tid < rows) {
    const float lb = tot_s[tid];
    ws_lse[row_of(tid) * S + split] = any_bad ? nan : (lb > 0.f ? lse_s[tid] + log2f(lb) : -INFINITY);
  }
  // One thread counts the block done once every thread's writes are in (the barrier): its
  // acquire-release atomic publishes them all and, in the last block, acquires every other
  // block's, which the barrier after it hands to the whole block (no per-thread fences).
  __syncthreads();
  if (tid == 0) {
    unsigned* counter = counters + b * p.kv_heads + hk;
    const unsigned done = gpu::atomic_add_acq_rel(counter, 1u);
    last_s = done == static_cast<unsigned>(S - 1);
    if (last_s) atomicExch(counter, 0u);  // ready for the next call (and graph replay)
  }
  __syncthreads();
  if (!last_s) return;

  // the last block of this (sequence, KV head) merges every split of its rows: split weights per
  // row (a warp per row), then threads over (row, 4 columns) x parts of the split range, so that
  // many 16-byte loads are in flight at once
  for (int r = warp; r < rows; r += NW) {
    const float* lse = ws_lse + row_of(r) * S;
    float mx = -INFINITY;
    for (int sp = lane; sp < S; sp += W) mx = fmaxf(mx, gpu::load_coherent(lse + sp));
#pragma unroll
    for (int mk = W / 2; mk > 0; mk >>= 1) mx = fmaxf(mx, gpu::shfl_xor(mx, mk));
    float sum = 0.f;
    for (int sp = lane; sp < S; sp += W) {
      const float x = gpu::load_coherent(lse + sp);
      const float e = x == -INFINITY ? 0.f : exp2f(x - mx);  // NaN stays NaN
      wts[r * kMaxSplits + sp] = e;
      sum += e;
    }
    sum = gpu::warp_reduce_sum(sum);
    if (lane == 0) tot_s[r] = sum;
  }
  __syncthreads();
  const int nq = rows * D / 4;
  const int parts = nq >= NT ? 1 : NT / nq;
  auto write_quad = [&](int qd, float4 a) {
    const int r = qd / (D / 4), d = (qd % (D / 4)) * 4, g = r / T_, t = r % T_;
    const float sum = tot_s[r];
    const float f = sum > 0.f ? 1.f / sum : 0.f;
    float v[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) v[j] = sum > 0.f ? v[j] * f : (sum == 0.f ? 0.f : sum);
    T* out = static_cast<T*>(p.out) + b * p.out_strides[0] + t * p.out_strides[1] +
             (hk * group + g) * p.out_strides[2] + d;
    gpu::from_float2<T>(v[0], v[1], out[0], out[1]);
    gpu::from_float2<T>(v[2], v[3], out[2], out[3]);
  };
  for (int i = tid; i < nq * parts; i += NT) {
    const int qd = i % nq, part = i / nq;
    const int r = qd / (D / 4), d = (qd % (D / 4)) * 4;
    const float* o = ws_o + row_of(r) * S * D + d;
    float4 a = make_float4(0.f, 0.f, 0.f, 0.f);
    const int count = (S - part + parts - 1) / parts;
#pragma unroll 8
    for (int j = 0; j < count; ++j) {
      const int sp = part + j * parts;
      const float w = wts[r * kMaxSplits + sp];
      const float4 x = gpu::load_coherent(reinterpret_cast<const float4*>(o + sp * D));
      a.x += w * x.x;
      a.y += w * x.y;
      a.z += w * x.z;
      a.w += w * x.w;
    }
    if (parts == 1) write_quad(qd, a);
    else part_s[i] = a;
  }
  if (parts > 1) {
    __syncthreads();
    for (int qd = tid; qd < nq; qd += NT) {
      float4 a = part_s[qd];
      for (int part = 1; part < parts; ++part) {
        const float4 x = part_s[part * nq + qd];
        a.x += x.x;
        a.y += x.y;
        a.z += x.z;
        a.w += x.w;
      }
      write_quad(qd, a);
    }
  }
}

// Before a launch of decode_warp_kernel or decode_mma_kernel with several splits: zeroes the
// per-(sequence, KV head) counters behind the partial results in the workspace (async, capturable),
// unless the caller vouches that they are zero (DecodeOptions::workspace_zeroed: the kernels leave
// them so).
inline void zero_split_counters(const DecodeParams& p) {
  if (p.num_splits <= 1 || p.workspace_zeroed) return;
  const std::size_t rows_total = static_cast<std::size_t>(p.batch * p.q_heads * p.tokens);
  const std::size_t off = (rows_total * p.num_splits * (p.head_dim + 1) * 4 + 15) / 16 * 16;
  gpu::check(gpuMemsetAsync(static_cast<char*>(p.workspace) + off, 0,
                            static_cast<std::size_t>(p.batch * p.kv_heads) * sizeof(unsigned),
                            gpu::as_stream(p.stream)),
             "decode_attention", "zeroing the split counters");
}

// decode_warp_kernel's block (its description: decode_warp.h)
constexpr int kWThreads = 256;
constexpr int kWMaxRows = 8;
// 16-byte K and V loads per lane per warp step: 4 (4 KB of K/V in flight per warp) with up to 4
// rows, 2 with 5 to 8 rows (their accumulators need the registers).
__host__ __device__ constexpr int warp_unroll(int rows) { return rows <= 4 ? 4 : 2; }
// Keys one block covers per step (all warps): the split length is a multiple of it.
__host__ __device__ constexpr int warp_tile_keys(int head_dim, int rows) {
  return kWThreads * 8 * warp_unroll(rows) / head_dim;
}

#if LLMK_MMA_SYNC_BUILD
constexpr int kMaxClusterSplits = 8;  // the most splits merged in a cluster (see mma_tma_launch)
// decode_mma_kernel's block (its description: decode_mma.h)
constexpr int kMThreads = 128;
constexpr int kMWarps = kMThreads / 32;
constexpr int kMRows = 16;   // query rows per block (one m16 tile)
constexpr int kMKeys = 64;   // keys per tile (16 per warp)

// The cluster merge (cluster_finish), measured on the H200 (2026-12-01, scripts/decode_split_sweep.py,
// 32 / 8 heads, D 128): b1 kv4096 with 8 splits 17.8 us (do_bench) / 13.8 (in a CUDA graph)
// against 18.6 / 16.3 through the workspace; but with 16 splits 19.0 against 18.3 (a 16-block
// cluster packs onto 8 multiprocessors), and at b8 kv32768 with 4 splits (256 blocks, two per
// multiprocessor) 311 against 271. Hence: at most 8 splits (kMaxClusterSplits, defined above
// cluster_finish), and no more blocks than multiprocessors. LLMK_DECODE_CLUSTER=0 turns it off.
// It was off by default on 2026-12-04: in a model's decode step (a CUDA graph of GEMMs, RMSNorm,
// RoPE and attention) the clustered plan lost end to end (H200 2026-12-04 18:25 UTC,
// scripts/e2e_ab.py, 1B at batch 1: 891 against 980 tok/s at --context 1000, 854 against 986 at
// 4000) although the kernel alone was faster. That loss was the clustered grid's early PDL trigger
// (decode_mma_body): since it triggers at its exit (2026-12-05) the 1B e2e at --context 1000 takes
// 1081 tok/s clustered against 1082, and b1 kv4096 alone 16.8 us do_bench against 18.7; the
// default again since its tests passed with it (2026-12-05).

// Whether the TMA kernel can read this cache's pages: a power-of-two block size of 8 or more (a
// 64-key tile is then whole pages, or lies in one page), 32-bit block indices.
inline bool tma_pages(const KvCache& c) {
  return c.block_size >= 8 && (c.block_size & (c.block_size - 1)) == 0 && c.num_blocks < (int64_t{1} << 31);
}

inline bool cluster_merge_wanted(const DecodeParams& p, int64_t splits) {
  return splits > 1 && splits <= kMaxClusterSplits && (!p.cache.paged || tma_pages(p.cache)) &&
         splits * p.batch * p.kv_heads <= gpu::multiprocessor_count(p.device.index) &&
         gpu::env_flag("LLMK_DECODE_CLUSTER", true);
}
inline bool cluster_merge_applies(const DecodeParams& p) { return cluster_merge_wanted(p, p.num_splits); }
#endif  // LLMK_MMA_SYNC_BUILD

}  // namespace

// decode_warp_kernel's occupancy (p == nullptr: blocks per multiprocessor) or launch, one function
// per dtype (decode_warp_<dtype>.cu).
int decode_warp_f16(int head_dim, bool paged, int rows, const DecodeParams* p);
int decode_warp_bf16(int head_dim, bool paged, int rows, const DecodeParams* p);

#if LLMK_MMA_SYNC_BUILD
// The tensor-core kernel's occupancy (launch == false: blocks per multiprocessor) or launch, one
// function per dtype and head dim (decode_mma_<dtype>_d<D>.cu).
int decode_mma_f16_d64(const DecodeParams& p, bool launch);
int decode_mma_f16_d128(const DecodeParams& p, bool launch);
int decode_mma_bf16_d64(const DecodeParams& p, bool launch);
int decode_mma_bf16_d128(const DecodeParams& p, bool launch);
// that file's flags since the last call, which clears them (decode_mma_flags: bit 0 a TMA wait
// timed out, bit 1 a block skipped the mask)
unsigned decode_mma_f16_d64_flags();
unsigned decode_mma_f16_d128_flags();
unsigned decode_mma_bf16_d64_flags();
unsigned decode_mma_bf16_d128_flags();
#endif

}  // namespace llmk::detail
