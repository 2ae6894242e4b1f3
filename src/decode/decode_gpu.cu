// Decode attention and KV-cache writes on the GPU (one source for CUDA and HIP, through src/gpu/).
//
// decode_mma_kernel (default on NVIDIA sm_80+, up to 16 query rows per KV head, D 64 / 128; its
// comment further down): tensor cores over a cp.async ring of K/V tiles, one launch with the merge.
// decode_warp_kernel (AMD, and NVIDIA with LLMK_DECODE_KERNEL=warp or shapes the mma kernel does
// not take; up to 8 rows): warps stream their own K/V rows with 16-byte register loads.
// LLMK_DECODE_KERNEL=split (or LLMK_DECODE_LEGACY=1) selects the previous kernel below for every
// shape; above the rows the others take (e.g. 8 tokens x GQA 4) it is used anyway.
//
// decode_split_kernel (previous): split-KV (flash-decoding). Grid (num_splits, kv_heads * row_groups, batch).
// A block takes one KV head of one sequence and one chunk of its positions, and serves the query
// rows of that KV head: all Hq / Hkv query heads of the GQA group times all T new tokens (split
// into row groups only when there are more than 4096 / D rows, to bound shared memory). It walks
// its chunk in tiles of N keys: each thread loads its share of the next tile of K and V with
// 16-byte loads into registers while the current tile (in shared memory) is used, so K/V are read
// from memory once and the loads stay in flight. Per tile: scores q.k for every (row, key) pair
// from shared memory (q pre-scaled by scale * log2 e), an online-softmax update per row (a warp per
// row), and o += p v with each thread owning 4 output elements of some rows (registers, fp32).
// With one split the block writes the normalised output; otherwise it writes o / l and the
// log2-sum-exp of its chunk to the workspace, and decode_merge_kernel (one block per query row)
// combines the splits. A bad sequence length or block index (not checkable on the host without a
// sync) turns that sequence's output into NaN; positions past the sequence are never read.
//
// write_kv_kernel: one block per (sequence, token), a thread per VEC-element piece of a head (16
//   bytes when every pointer and stride allows); the k/v loads go first, as they do not depend on
//   the position, then the position, then the stores: two memory round trips, not three.
// rope_write_kv_kernel (rope_write_kv_cache): the same with rotate-half RoPE of q and k first; a
//   thread per rotation piece (VEC elements at d and d + D / 2 of a head of q, then of k) and per
//   VEC-element piece of v, up to 512 threads; q and k rotated in fp32 into q_out and k_out, the
//   rotated k and v stored into the cache.
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <type_traits>

#include "core/check.h"
#include "decode/decode_internal.h"
#include "gpu/compat.h"
#include "gpu/mma.h"
#include "gpu/runtime.h"
#include "gpu/tensor_map.h"
#include "gpu/tma.h"

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

std::size_t smem_bytes(int head_dim, int rows) {
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

template <typename T, int D, bool PAGED>
__global__ void __launch_bounds__(kThreads) decode_split_kernel(DecodeParams p) {
  constexpr int N = tile_keys(D);
  constexpr int KS = D + 8;  // padded K row: conflict-free 16-byte reads of different keys
  constexpr int CH = D / 8;  // 16-byte chunks per key
  constexpr int LOADS = N * CH / kThreads;
  constexpr int UNITS = 8;   // output quads per thread (rows * D / 4 <= 8 * kThreads)
  constexpr int WARPS = kThreads / LLMK_WARP_SIZE;
  static_assert(N * CH % kThreads == 0, "tile must split evenly over the threads");
  using V8 = gpu::Vec<T, 8>;
  using V4 = gpu::Vec<T, 4>;

  extern __shared__ __align__(16) unsigned char smem[];
  T* ks = reinterpret_cast<T*>(smem);
  T* vs = ks + N * KS;
  float* qs = reinterpret_cast<float*>(vs + N * D);
  const int rc = p.rows_per_block;
  float* ss = qs + rc * D;
  float* ms = ss + rc * N;
  float* ls = ms + rc;
  float* as = ls + rc;
  __shared__ int bad;

  const int tid = threadIdx.x, lane = tid % LLMK_WARP_SIZE, warp = tid / LLMK_WARP_SIZE;
  const int T_ = static_cast<int>(p.tokens);
  const int group = static_cast<int>(p.q_heads / p.kv_heads);
  const int R = group * T_;
  const int row_groups = (R + rc - 1) / rc;
  const int64_t hk = blockIdx.y / row_groups;
  const int row0 = (blockIdx.y % row_groups) * rc;
  const int rows = min(rc, R - row0);
  const int64_t b = blockIdx.z;
  const int split = blockIdx.x;

  const int64_t len = seq_len_at(p, b);
  const bool len_bad = len < 0 || len > p.cache.capacity;
  const int64_t start = static_cast<int64_t>(split) * p.split_len;
  int64_t end = split == p.num_splits - 1 ? len : min(len, start + p.split_len);
  if (len_bad || end < start) end = start;

  if (tid == 0) bad = len_bad ? 1 : 0;
  const float qscale = p.scale * kLog2e;
  for (int i = tid; i < rows * D; i += kThreads) {
    const int r = i / D, d = i % D, gr = row0 + r, g = gr / T_, t = gr % T_;
    const T* qp = static_cast<const T*>(p.q) + b * p.q_strides[0] + t * p.q_strides[1] +
                  (hk * group + g) * p.q_strides[2];
    qs[i] = gpu::to_float(qp[d]) * qscale;
  }
  for (int r = tid; r < rows; r += kThreads) {
    ms[r] = -INFINITY;
    ls[r] = 0.f;
  }
  __syncthreads();

  float acc[UNITS][4];
#pragma unroll
  for (int i = 0; i < UNITS; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) acc[i][j] = 0.f;

  // Per-block bases: the key rows of this (sequence, KV head), or its block-table row.
  const KvCache& cache = p.cache;
  const T* kbase = static_cast<const T*>(cache.k) + (PAGED ? hk * cache.k_strides[2] : b * cache.k_strides[0] + hk * cache.k_strides[1]);
  const T* vbase = static_cast<const T*>(cache.v) + (PAGED ? hk * cache.v_strides[2] : b * cache.v_strides[0] + hk * cache.v_strides[1]);
  const int32_t* table_row = PAGED ? cache.block_table + b * cache.table_stride : nullptr;
  const PageSize page(cache.block_size);
  V8 kr[LOADS], vr[LOADS];
  auto load_tile = [&](int64_t kb) {
#pragma unroll
    for (int i = 0; i < LOADS; ++i) {
      const int idx = tid + i * kThreads, key = idx / CH, c = idx % CH;
      const int64_t pos = kb + key;
      int64_t ko = -1, vo = -1;
      if (pos < end) {
        if (PAGED) {
          const int bi = page.block_of(static_cast<int>(pos)), off = page.offset_of(static_cast<int>(pos));
          const int64_t blk = table_row[bi];
          if (blk >= 0 && blk < cache.num_blocks) {
            ko = blk * cache.k_strides[0] + off * cache.k_strides[1];
            vo = blk * cache.v_strides[0] + off * cache.v_strides[1];
          } else {
            bad = 1;
          }
        } else {
          ko = pos * cache.k_strides[2];
          vo = pos * cache.v_strides[2];
        }
      }
      if (ko >= 0) {
        kr[i] = gpu::load_vec<T, 8, gpu::Cache::stream>(kbase + ko + c * 8);
        vr[i] = gpu::load_vec<T, 8, gpu::Cache::stream>(vbase + vo + c * 8);
      } else {
#pragma unroll
        for (int j = 0; j < 8; ++j) kr[i].v[j] = vr[i].v[j] = gpu::from_float<T>(0.f);
      }
    }
  };

  const int64_t ntiles = (end - start + N - 1) / N;
  if (ntiles > 0) load_tile(start);
  for (int64_t it = 0; it < ntiles; ++it) {
    const int64_t kb = start + it * N;
    __syncthreads();  // the previous tile is no longer read
#pragma unroll
    for (int i = 0; i < LOADS; ++i) {
      const int idx = tid + i * kThreads, key = idx / CH, c = idx % CH;
      *reinterpret_cast<V8*>(ks + key * KS + c * 8) = kr[i];
      *reinterpret_cast<V8*>(vs + key * D + c * 8) = vr[i];
    }
    __syncthreads();
    if (it + 1 < ntiles) load_tile(kb + N);  // in flight while this tile is used

    // scores (log2 domain), masked to the chunk and to each token's causal limit
    for (int j = tid; j < rows * N; j += kThreads) {
      const int r = j / N, n = j % N;
      const int t = (row0 + r) % T_;
      const int64_t pos = kb + n;
      float s = -INFINITY;
      if (pos < end && pos <= len - T_ + t) {
        const float* qr = qs + r * D;
        const T* kk = ks + n * KS;
        float dot = 0.f;
#pragma unroll 4
        for (int c = 0; c < CH; ++c) {
          float kf[8];
          gpu::to_float(*reinterpret_cast<const V8*>(kk + c * 8), kf);
          const float4 q0 = *reinterpret_cast<const float4*>(qr + c * 8);
          const float4 q1 = *reinterpret_cast<const float4*>(qr + c * 8 + 4);
          dot += q0.x * kf[0] + q0.y * kf[1] + q0.z * kf[2] + q0.w * kf[3] + q1.x * kf[4] +
                 q1.y * kf[5] + q1.z * kf[6] + q1.w * kf[7];
        }
        s = dot + mask_log2(p.mask, b, t, pos);
      }
      ss[j] = s;
    }
    __syncthreads();

    // online softmax, one warp per row
    for (int r = warp; r < rows; r += WARPS) {
      float mx = -INFINITY;
      for (int n = lane; n < N; n += LLMK_WARP_SIZE) mx = fmaxf(mx, ss[r * N + n]);
      mx = warp_max(mx);
      const float m_old = ms[r], m_new = fmaxf(m_old, mx);
      float sum = 0.f;
      for (int n = lane; n < N; n += LLMK_WARP_SIZE) {
        const float e = m_new == -INFINITY ? 0.f : exp2f(ss[r * N + n] - m_new);
        ss[r * N + n] = e;
        sum += e;
      }
      sum = gpu::warp_reduce_sum(sum);
      if (lane == 0) {
        const float alpha = m_new == -INFINITY ? 1.f : exp2f(m_old - m_new);
        as[r] = alpha;
        ls[r] = ls[r] * alpha + sum;
        ms[r] = m_new;
      }
    }
    __syncthreads();

    // o = o * alpha + p v
#pragma unroll
    for (int i = 0; i < UNITS; ++i) {
      const int u = tid + i * kThreads, r = u / (D / 4), c = u % (D / 4);
      if (r < rows) {
        const float a = as[r];
        float o0 = acc[i][0] * a, o1 = acc[i][1] * a, o2 = acc[i][2] * a, o3 = acc[i][3] * a;
        const float* pr = ss + r * N;
#pragma unroll 8
        for (int n = 0; n < N; ++n) {
          const float pn = pr[n];
          float vf[4];
          gpu::to_float(*reinterpret_cast<const V4*>(vs + n * D + c * 4), vf);
          o0 += pn * vf[0];
          o1 += pn * vf[1];
          o2 += pn * vf[2];
          o3 += pn * vf[3];
        }
        acc[i][0] = o0;
        acc[i][1] = o1;
        acc[i][2] = o2;
        acc[i][3] = o3;
      }
    }
  }
  __syncthreads();

  const bool is_bad = bad != 0;
  const float nan = __int_as_float(0x7fc00000);
  const int64_t rows_total = p.batch * p.q_heads * p.tokens;
  float* ws_o = static_cast<float*>(p.workspace);
  float* ws_lse = ws_o + rows_total * p.num_splits * D;
#pragma unroll
  for (int i = 0; i < UNITS; ++i) {
    const int u = tid + i * kThreads, r = u / (D / 4), c = u % (D / 4);
    if (r < rows) {
      const int gr = row0 + r, g = gr / T_, t = gr % T_;
      const int64_t h = hk * group + g;
      const float l = ls[r];
      const float inv = is_bad ? nan : (l > 0.f ? 1.f / l : 0.f);
      if (p.num_splits == 1) {
        T* o = static_cast<T*>(p.out) + b * p.out_strides[0] + t * p.out_strides[1] + h * p.out_strides[2] + c * 4;
        gpu::from_float2<T>(acc[i][0] * inv, acc[i][1] * inv, o[0], o[1]);
        gpu::from_float2<T>(acc[i][2] * inv, acc[i][3] * inv, o[2], o[3]);
      } else {
        const int64_t row = (b * p.q_heads + h) * p.tokens + t;
        float4 v = make_float4(acc[i][0] * inv, acc[i][1] * inv, acc[i][2] * inv, acc[i][3] * inv);
        *reinterpret_cast<float4*>(ws_o + (row * p.num_splits + split) * D + c * 4) = v;
      }
    }
  }
  if (p.num_splits > 1) {
    for (int r = tid; r < rows; r += kThreads) {
      const int gr = row0 + r, g = gr / T_, t = gr % T_;
      const int64_t row = (b * p.q_heads + hk * group + g) * p.tokens + t;
      const float l = ls[r];
      ws_lse[row * p.num_splits + split] = is_bad ? 0.f : (l > 0.f ? ms[r] + log2f(l) : -INFINITY);
    }
  }
}

// One block per query row (b, h, t): out = sum_s 2^(lse_s - max) o_s / sum_s 2^(lse_s - max).
template <typename T, int D>
__global__ void __launch_bounds__(kThreads) decode_merge_kernel(DecodeParams p) {
  const int64_t row = blockIdx.x;
  const int64_t t = row % p.tokens, h = (row / p.tokens) % p.q_heads, b = row / (p.tokens * p.q_heads);
  const int S = p.num_splits;
  const int64_t rows_total = p.batch * p.q_heads * p.tokens;
  const float* ws_o = static_cast<const float*>(p.workspace);
  const float* lse = ws_o + rows_total * S * D + row * S;
  const float* o = ws_o + row * S * D;
  __shared__ float w[kMaxSplits];
  __shared__ float total;
  if (threadIdx.x == 0) {
    float mx = -INFINITY;
    for (int s = 0; s < S; ++s) mx = fmaxf(mx, lse[s]);
    float sum = 0.f;
    for (int s = 0; s < S; ++s) {
      const float e = lse[s] == -INFINITY ? 0.f : exp2f(lse[s] - mx);  // NaN stays NaN
      w[s] = e;
      sum += e;
    }
    total = sum;
  }
  __syncthreads();
  const float sum = total;
  T* out = static_cast<T*>(p.out) + b * p.out_strides[0] + t * p.out_strides[1] + h * p.out_strides[2];
  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    float a = 0.f;
    for (int s = 0; s < S; ++s)
      if (w[s] != 0.f) a += w[s] * o[s * D + d];
    out[d] = gpu::from_float<T>(sum > 0.f ? a / sum : (sum == 0.f ? 0.f : sum));
  }
}

// ------------------------------------------------------------------ decode_warp_kernel (default)
// Split-KV decode attention built for bandwidth. Grid (num_splits, kv_heads, batch), 256 threads.
// A block takes one KV head of one sequence and one chunk of its positions and serves all
// R = (Hq / Hkv) * T query rows of that head (R <= 8) from a single pass over K/V. Each warp
// streams its own keys straight from global memory into registers with 16-byte loads, no shared
// memory staging and no block barriers in the loop: D / 8 lanes hold one key row (8 elements each),
// a warp step covers U * (warp / (D / 8)) keys (U = warp_unroll: 4, or 2 above 4 rows) and issues
// all of their K and V loads at once (4 KB in flight per warp), and the 8 warps of a block
// interleave steps over the chunk. Per step: q.k by FMAs on the lane's 8 elements and a butterfly
// over the D / 8 lanes of the key, a warp-wide online-softmax update (log2 domain, one running max
// per row for the whole warp), and o += p v on the lane's 8 output columns (R x 8 fp32
// accumulators per lane). The pre-scaled query rows sit in shared memory (16-byte broadcast reads),
// which keeps the kernel at <= 128 registers: 2 blocks, 16 warps, 64 KB of K/V in flight per SM
// (ptxas: 122-128 registers with 4 rows, 128 with a few spills with 8). The paged block-table
// entries for the next step are loaded while the current step's K/V are in flight. At the end the
// warps are combined through shared memory. With several splits, each block writes (o / l, lse)
// to the workspace like decode_split_kernel, then counts itself done on a per-(sequence, head)
// counter in the workspace; the last block of the head merges all splits in place (one launch, no
// merge kernel) and resets the counter to zero. The host zeroes the counters with an async memset
// before the launch (capturable), so a fresh or reused workspace is always valid; a caller that
// keeps a zeroed workspace for calls of one shape skips it (DecodeOptions::workspace_zeroed).
constexpr int kWThreads = 256;
constexpr int kWMaxRows = 8;
// 16-byte K and V loads per lane per warp step: 4 (4 KB of K/V in flight per warp) with up to 4
// rows, 2 with 5 to 8 rows (their accumulators need the registers).
__host__ __device__ constexpr int warp_unroll(int rows) { return rows <= 4 ? 4 : 2; }
// Keys one block covers per step (all warps): the split length is a multiple of it.
__host__ __device__ constexpr int warp_tile_keys(int head_dim, int rows) {
  return kWThreads * 8 * warp_unroll(rows) / head_dim;
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

template <typename T, int D, int RB, bool PAGED, bool MASKED>
__global__ void __launch_bounds__(kWThreads, 2) decode_warp_kernel(DecodeParams p) {
  constexpr int W = LLMK_WARP_SIZE;
  constexpr int NW = kWThreads / W;
  constexpr int LPK = D / 8;       // lanes per key row
  static_assert(LPK <= W, "a key row must fit one warp");
  constexpr int KPL = W / LPK;     // keys per warp-wide load
  constexpr int U = warp_unroll(RB);
  constexpr int KI = U * KPL;      // keys per warp step
  using V8 = gpu::Vec<T, 8>;

  __shared__ __align__(16) float o_s[RB * D];
  __shared__ __align__(16) float q_s[RB * D];
  __shared__ float m_s[NW][RB], l_s[NW][RB];
  __shared__ float wts[RB][kMaxSplits];
  __shared__ float tot_s[RB], lse_s[RB];
  __shared__ float4 part_s[kWThreads];
  __shared__ int last_s;

  const int tid = threadIdx.x, lane = tid % W, warp = tid / W;
  const int sub = lane % LPK, kg = lane / LPK;
  const int T_ = static_cast<int>(p.tokens);
  const int group = static_cast<int>(p.q_heads / p.kv_heads);
  const int rows = group * T_;  // <= RB (the plan guarantees it)
  const int64_t hk = blockIdx.y;
  const int64_t b = blockIdx.z;
  const int split = blockIdx.x;

  const SplitChunk chunk = split_chunk(p, b, split);
  const bool len_bad = chunk.len_bad;
  const int len = chunk.len, start = chunk.start;
  int end = chunk.end;

  for (int i = tid; i < RB * D; i += kWThreads) o_s[i] = 0.f;

  // the query rows, pre-scaled (log2 domain), in shared memory: read as 16-byte broadcasts in the
  // loop rather than held in registers (R x 8 floats per lane would halve the occupancy)
  const float qscale = p.scale * kLog2e;
  for (int i = tid; i < RB * D; i += kWThreads) {
    const int r = i / D, d = i % D;
    float x = 0.f;
    if (r < rows) {
      const int g = r / T_, t = r % T_;
      x = gpu::to_float(static_cast<const T*>(p.q)[b * p.q_strides[0] + t * p.q_strides[1] +
                                                   (hk * group + g) * p.q_strides[2] + d]) * qscale;
    }
    q_s[i] = x;
  }
  // row r (token t = r % T) sees keys 0 .. len - T + t; rows past `rows` see none
  const int lim0 = len - T_;

  const KvCache& cache = p.cache;
  const T* kbase = static_cast<const T*>(cache.k) + sub * 8 +
                   (PAGED ? hk * cache.k_strides[2] : b * cache.k_strides[0] + hk * cache.k_strides[1]);
  const T* vbase = static_cast<const T*>(cache.v) + sub * 8 +
                   (PAGED ? hk * cache.v_strides[2] : b * cache.v_strides[0] + hk * cache.v_strides[1]);
  const int32_t* table_row = PAGED ? cache.block_table + b * cache.table_stride : nullptr;
  const PageSize page(cache.block_size);
  const int num_blocks = static_cast<int>(cache.num_blocks < INT32_MAX ? cache.num_blocks : INT32_MAX);

  float acc[RB][8], m[RB], l[RB];
#pragma unroll
  for (int r = 0; r < RB; ++r) {
    m[r] = -INFINITY;
    l[r] = 0.f;
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[r][e] = 0.f;
  }
  bool bad = len_bad;

  __syncthreads();  // q_s and o_s are ready
  constexpr int STRIDE = NW * KI;
  int kb = start + warp * KI;
  int blk[U];  // paged: block of each of this lane's keys in the current step (-1: past the end)
  if (PAGED) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int key = kb + u * KPL + kg;
      blk[u] = key < end ? table_row[page.block_of(key)] : -1;
    }
  }
#pragma unroll 1
  for (; kb < end; kb += STRIDE) {
    V8 kv[U], vv[U];
    bool ok[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int key = kb + u * KPL + kg;
      ok[u] = key < end;
      int64_t ko = 0, vo = 0;
      if (PAGED) {
        if (ok[u] && (blk[u] < 0 || blk[u] >= num_blocks)) {
          bad = true;
          ok[u] = false;
        }
        const int off = page.offset_of(key);
        ko = static_cast<int64_t>(blk[u]) * cache.k_strides[0] + off * cache.k_strides[1];
        vo = static_cast<int64_t>(blk[u]) * cache.v_strides[0] + off * cache.v_strides[1];
      } else {
        ko = static_cast<int64_t>(key) * cache.k_strides[2];
        vo = static_cast<int64_t>(key) * cache.v_strides[2];
      }
      if (ok[u]) {
        kv[u] = gpu::load_vec<T, 8, gpu::Cache::stream>(kbase + ko);
        vv[u] = gpu::load_vec<T, 8, gpu::Cache::stream>(vbase + vo);
      } else {
#pragma unroll
        for (int e = 0; e < 8; ++e) kv[u].v[e] = vv[u].v[e] = gpu::from_float<T>(0.f);
      }
    }
    // masked: this step's mask terms, in flight with its K/V (rows r and r' of one token share one)
    float mterm[MASKED ? U : 1][MASKED ? RB : 1];
    if constexpr (MASKED) {
#pragma unroll
      for (int u = 0; u < U; ++u)
#pragma unroll
        for (int r = 0; r < RB; ++r)
          mterm[u][r] = ok[u] && r < rows ? mask_log2(p.mask, b, r % T_, kb + u * KPL + kg) : 0.f;
    }
    if (PAGED) {  // next step's block-table entries, in flight with this step's K/V
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int key = kb + STRIDE + u * KPL + kg;
        blk[u] = key < end ? table_row[page.block_of(key)] : -1;
      }
    }

    // scores (log2 domain) of this lane's keys for every row; masked to the chunk and causality
    float s[U][RB];
#pragma unroll
    for (int r = 0; r < RB; ++r) {
      const float4 q0 = *reinterpret_cast<const float4*>(q_s + r * D + sub * 8);
      const float4 q1 = *reinterpret_cast<const float4*>(q_s + r * D + sub * 8 + 4);
      const int lim = r < rows ? lim0 + r % T_ : -1;
#pragma unroll
      for (int u = 0; u < U; ++u) {
        float kf[8];
        gpu::to_float(kv[u], kf);
        float d = q0.x * kf[0] + q0.y * kf[1] + q0.z * kf[2] + q0.w * kf[3] + q1.x * kf[4] + q1.y * kf[5] +
                  q1.z * kf[6] + q1.w * kf[7];
#pragma unroll
        for (int mk = LPK / 2; mk > 0; mk >>= 1) d += gpu::shfl_xor(d, mk);
        const int key = kb + u * KPL + kg;
        if constexpr (MASKED) d += mterm[u][r];
        s[u][r] = ok[u] && key <= lim ? d : -INFINITY;
      }
    }

    // online softmax: one running max per row for the whole warp
#pragma unroll
    for (int r = 0; r < RB; ++r) {
      float mx = s[0][r];
#pragma unroll
      for (int u = 1; u < U; ++u) mx = fmaxf(mx, s[u][r]);
#pragma unroll
      for (int mk = LPK; mk < W; mk <<= 1) mx = fmaxf(mx, gpu::shfl_xor(mx, mk));
      const float mn = fmaxf(m[r], mx);
      if (mn == -INFINITY) {
#pragma unroll
        for (int u = 0; u < U; ++u) s[u][r] = 0.f;
      } else {
        const float alpha = exp2f(m[r] - mn);
        m[r] = mn;
        l[r] *= alpha;
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[r][e] *= alpha;
#pragma unroll
        for (int u = 0; u < U; ++u) {
          s[u][r] = exp2f(s[u][r] - mn);
          l[r] += s[u][r];
        }
      }
    }

    // o += p v
#pragma unroll
    for (int u = 0; u < U; ++u) {
      float vf[8];
      gpu::to_float(vv[u], vf);
#pragma unroll
      for (int r = 0; r < RB; ++r)
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[r][e] += s[u][r] * vf[e];
    }
  }

  // combine the key groups of the warp (same running max), then the warps of the block
#pragma unroll
  for (int mk = LPK; mk < W; mk <<= 1)
#pragma unroll
    for (int r = 0; r < RB; ++r) {
      l[r] += gpu::shfl_xor(l[r], mk);
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[r][e] += gpu::shfl_xor(acc[r][e], mk);
    }
  if (lane == 0)
#pragma unroll
    for (int r = 0; r < RB; ++r) m_s[warp][r] = m[r];
  const bool any_bad = __syncthreads_or(bad ? 1 : 0) != 0;  // also orders o_s zeroing and m_s
#pragma unroll
  for (int r = 0; r < RB; ++r) {
    if (r >= rows) continue;
    float mb = -INFINITY;
#pragma unroll
    for (int w = 0; w < NW; ++w) mb = fmaxf(mb, m_s[w][r]);
    const float f = m[r] == -INFINITY ? 0.f : exp2f(m[r] - mb);
    if (kg == 0)
#pragma unroll
      for (int e = 0; e < 8; ++e) atomicAdd(&o_s[r * D + sub * 8 + e], acc[r][e] * f);
    if (lane == 0) l_s[warp][r] = l[r] * f;
    if (tid == 0) lse_s[r] = mb;
  }
  __syncthreads();
  if (tid < rows) {
    float lb = 0.f;
#pragma unroll
    for (int w = 0; w < NW; ++w) lb += l_s[w][tid];
    tot_s[tid] = lb;
  }
  __syncthreads();

  finish_split_block<T, D, kWThreads>(p, b, hk, split, rows, o_s, tot_s, lse_s, any_bad, &wts[0][0], part_s,
                                     last_s);
}

#if LLMK_MMA_SYNC_BUILD
constexpr int kMaxClusterSplits = 8;  // the most splits merged in a cluster (see mma_tma_launch)

// The end of a split-KV block whose launch made the S = p.num_splits splits of each (sequence, KV
// head) one thread block cluster (rank = split; sm_90a code only): no workspace, no counter, no
// memset. Inputs as finish_split_block's (o_s unnormalised at the block's running maxima lse_s,
// row sums tot_s; wts: rows x kMaxSplits floats of shared scratch). After a cluster barrier, each
// block reads the S (lse, sum) pairs of its rows from the cluster's shared memory, turns them into
// merge weights, and writes the 16-byte quads of the output whose index is its rank modulo S,
// reading the S partial outputs remotely; a second cluster barrier keeps every block's shared
// memory alive until all have read it. A bad block (any_bad) makes the whole head's output NaN,
// rows that see no key anywhere are zero, as on the workspace path. Every remote read is unrolled
// over kMaxClusterSplits (predicated by j < S), so that a thread's S distributed-shared-memory
// loads are in flight together: one round trip per phase instead of S dependent ones.
template <typename T, int D, int NT>
__device__ __forceinline__ void cluster_finish(const DecodeParams& p, int64_t b, int64_t hk, int split, int rows,
                                               const float* o_s, const float* tot_s, const float* lse_s,
                                               bool any_bad, float* wts) {
  __shared__ int bad_s;
  const int tid = threadIdx.x;
  const int T_ = static_cast<int>(p.tokens);
  const int group = static_cast<int>(p.q_heads / p.kv_heads);
  const int S = p.num_splits;
  if (tid == 0) bad_s = any_bad ? 1 : 0;
  gpu::tma::cluster_sync();
  if (tid < rows) {
    float m[kMaxClusterSplits], tot[kMaxClusterSplits];
    int bad = 0;
#pragma unroll
    for (int j = 0; j < kMaxClusterSplits; ++j) {  // the S running maxima and row sums, the bad flags
      if (j < S) {
        m[j] = *gpu::tma::cluster_map(lse_s + tid, j);
        tot[j] = *gpu::tma::cluster_map(tot_s + tid, j);
        bad |= *gpu::tma::cluster_map(&bad_s, j);
      }
    }
    float mx = -INFINITY;
#pragma unroll
    for (int j = 0; j < kMaxClusterSplits; ++j)
      if (j < S) mx = fmaxf(mx, m[j]);
    float sum = 0.f;
#pragma unroll
    for (int j = 0; j < kMaxClusterSplits; ++j) {
      if (j < S) {
        m[j] = m[j] == -INFINITY ? 0.f : exp2f(m[j] - mx);
        sum += m[j] * tot[j];
      }
    }
    const float inv = bad ? __int_as_float(0x7fc00000) : (sum > 0.f ? 1.f / sum : 0.f);
    float* w = wts + tid * kMaxSplits;
#pragma unroll
    for (int j = 0; j < kMaxClusterSplits; ++j)
      if (j < S) w[j] = m[j] * inv;
  }
  __syncthreads();
  const int nq = rows * D / 4;
  for (int qd = split + S * tid; qd < nq; qd += S * NT) {
    const int r = qd / (D / 4), d = (qd % (D / 4)) * 4, g = r / T_, t = r % T_;
    float4 x[kMaxClusterSplits];
#pragma unroll
    for (int j = 0; j < kMaxClusterSplits; ++j)
      if (j < S) x[j] = *gpu::tma::cluster_map(reinterpret_cast<const float4*>(o_s + r * D + d), j);
    float4 a = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int j = 0; j < kMaxClusterSplits; ++j) {
      if (j < S) {
        const float w = wts[r * kMaxSplits + j];
        a.x += w * x[j].x;
        a.y += w * x[j].y;
        a.z += w * x[j].z;
        a.w += w * x[j].w;
      }
    }
    T* out = static_cast<T*>(p.out) + b * p.out_strides[0] + t * p.out_strides[1] +
             (hk * group + g) * p.out_strides[2] + d;
    gpu::from_float2<T>(a.x, a.y, out[0], out[1]);
    gpu::from_float2<T>(a.z, a.w, out[2], out[3]);
  }
  gpu::tma::cluster_sync();
}

// ------------------------------------------------------------ decode_mma_kernel (NVIDIA sm_80+)
// Split-KV decode attention on tensor cores (LLMK_DECODE_KERNEL=mma). Grid (num_splits, kv_heads,
// batch), 128 threads (4 warps). A block takes one KV head of one sequence and one chunk of its
// positions and serves all R = (Hq / Hkv) * T query rows of that head (R <= 16: one m16 tile; the
// padding rows see no key) from a single pass over K/V. The chunk is streamed in tiles of 64 keys
// through a ring of STAGES shared-memory stages filled by cp.async (16-byte pieces, zero-filled
// past the chunk or at a bad block; paged: every key's address from the block table, whose entries
// are read one tile ahead), rows padded to D + 8 elements so that ldmatrix is conflict-free; 3
// stages of 64 keys at D = 128 (102 KB, 2 blocks and 128 KB of K/V in flight per SM on an H100 /
// H200), 4 at D = 64. The warps split each tile (16 keys each):
// S = Q K^T by mma.m16n8k16 (Q as A fragments in registers, K as B through ldmatrix), masked to
// the chunk and to each token's causal limit, scaled into the log2 domain in fp32, an online
// softmax per warp (a row lives in a quad; each warp keeps its own running max and sum), P
// rounded to T as the A fragment of O += P V (V through ldmatrix.trans), O in fp32 registers
// (16 x D per warp). At the end the warps' (m, l, O) are combined through shared memory (the ring,
// no longer needed) and finish_split_block writes the output, or the split's partial result and,
// in the last block of the head, the merge of all splits (one launch, as decode_warp_kernel).
// The TMA kernel below merges 2 to 8 splits in a thread block cluster instead where that applies
// (cluster_finish, kMaxClusterSplits). Where its grid fits the multiprocessors without a cluster
// merge (e.g. the 1B model's decode step: 8 blocks) it runs two warp groups per block
// (mma_groups): each group takes every other tile of the chunk through its own ring slots, so that
// each multiprocessor has two tiles' dependent chains in flight instead of one.
// TMA (decode_mma_tma_kernel: sm_90a, a cache whose strides TMA can express, pages of a power-of-two
// size >= 8; on unless LLMK_DECODE_TMA=0): thread 0 fills each stage with the bulk tensor copy
// engine instead (per tile, D / 64 boxes of 64 keys x 64 columns of K and of V, or of a page's
// rows when pages are smaller than a tile, the block table read one tile ahead; 128B-swizzled,
// unpadded rows, completing on the stage's mbarrier; positions past the cache read as zeros, V
// rows past the chunk's end in its last tile are zeroed after arrival, as they may hold anything;
// no L2 promotion). Measured on
// the H200 (bench/micro/kv_stream.cu, a pure read of the b32 kv4096 cache in this kernel's
// pattern, 2026-12-01): 4.07 TB/s by these tensor maps against 3.83 with 16-byte cp.async pieces;
// the kernel itself (scripts/decode_split_sweep.py, do_bench) 142.1 us against 147.2 (with L2
// promotion, which the micro-benchmark then showed to cost 3-4%).
constexpr int kMThreads = 128;
constexpr int kMWarps = kMThreads / 32;
constexpr int kMRows = 16;   // query rows per block (one m16 tile)
constexpr int kMKeys = 64;   // keys per tile (16 per warp)
__host__ __device__ constexpr int mma_stages(int head_dim) { return head_dim <= 64 ? 4 : 3; }
// Staged mask (default; LLMK_DECODE_MASK_PREFETCH=0 turns it off): per stage, its rows (1 for a mask shared by the
// tokens, else T <= 8) of a window of 16-byte pieces that covers the tile's 64 positions from the
// 16-byte boundary at or below the first: 64 * size + 16 bytes per row (bool 80, f16 / bf16 144,
// f32 272), sized per launch (a shared bf16 mask adds 4 x 144 bytes at D = 64, which keeps its 3
// blocks per multiprocessor on the H200).
constexpr int kMMaskRows = 8;  // = decode.cpp's kMaxTokens (T <= 8: a per-token mask has T rows)
__host__ __device__ constexpr int mask_row_bytes(int elem_bytes) { return kMKeys * elem_bytes + 16; }
// tma: unpadded, 128B-swizzled K / V tiles from a 1024-byte aligned base (up to 1 KB of slack).
// groups: warp groups (decode_mma_body's NG), each with mma_stages ring slots.
__host__ __device__ constexpr std::size_t mma_smem_bytes(int head_dim, std::size_t mask_stage_bytes = 0, bool tma = false,
                                                         int groups = 1) {
  const std::size_t slots = static_cast<std::size_t>(groups) * mma_stages(head_dim);
  const std::size_t ring = slots * 2 * kMKeys * (head_dim + (tma ? 0 : 8)) * 2 + slots * mask_stage_bytes;
  const std::size_t tail = static_cast<std::size_t>(groups * kMWarps * kMRows * head_dim + kMRows * head_dim +
                                                    groups * kMWarps * kMRows + kMRows * kMaxSplits) * 4 +
                           static_cast<std::size_t>(groups) * kMThreads * 16;
  return (ring > tail ? ring : tail) + (tma ? 1024 : 0);
}

// Bytes of one mask element.
__host__ __device__ constexpr int mask_elem_bytes(DType t) {
  return t == DType::boolean ? 1 : (t == DType::f16 || t == DType::bf16) ? 2 : 4;
}

// The mask term (log2 domain) of the element at `e` (global or shared memory): -inf hides the key.
__device__ __forceinline__ float mask_term_at(const unsigned char* e, DType t) {
  switch (t) {
    case DType::boolean: return *e ? 0.f : -INFINITY;
    case DType::f16: return gpu::to_float(*reinterpret_cast<const half*>(e)) * kLog2e;
    case DType::bf16: return gpu::to_float(*reinterpret_cast<const bfloat16*>(e)) * kLog2e;
    default: return *reinterpret_cast<const float*>(e) * kLog2e;
  }
}

// MASK: 0 none; 1 each lane loads its 8 mask terms per tile from global memory (previous path);
// 2 (the default, LLMK_DECODE_MASK_PREFETCH unset or 1; a mask with a contiguous last dim): the mask rows of a tile ride
// the cp.async ring with its K/V (a window of 16-byte pieces from the 16-byte boundary at or below
// the tile's first position, so any element-aligned row works; pieces past the mask's positions or
// the chunk are zero-filled, never read), and each block first scans its chunk's mask once
// (coalesced, before it requests any K/V) and stops at one past its last visible key.
// The body of decode_mma_kernel (TMA false) and decode_mma_tma_kernel (TMA true: map_k and map_v
// are the tensor maps of the K and V caches, kernel parameters). NG warp groups of kMWarps warps:
// with NG = 2 (TMA; mma_groups) group g takes tiles g, g + 2, ... of the chunk through its own
// STAGES ring slots, its own issuing thread (with its own page-table entries) and its own named
// barrier, so that
// two tiles' dependent chains (S, softmax, P V) run at once on each multiprocessor; the groups
// meet only in the final combination, which covers all NG * kMWarps warps.
template <typename T, int D, bool PAGED, int MASK, bool TMA, int NG>
__device__ __forceinline__ void decode_mma_body(const DecodeParams& p, [[maybe_unused]] const void* map_k,
                                                [[maybe_unused]] const void* map_v) {
  static_assert(NG == 1 || (NG == 2 && TMA), "two warp groups: TMA loads");
  constexpr int KS = D + 8;  // padded row (elements; cp.async)
  constexpr int CH = D / 8;  // 16-byte pieces per row
  constexpr int STAGES = mma_stages(D);  // ring slots per group
  constexpr int SLOTS = NG * STAGES;
  constexpr int BT = NG * kMThreads, BW = NG * kMWarps;  // the block's threads and warps
  constexpr int LOADS = kMKeys * CH / kMThreads;
  constexpr int KT = D / 16;  // k steps of Q K^T
  constexpr int NT = D / 8;   // n tiles of O
  constexpr int ROW = TMA ? D : KS;         // elements from one key's row to the next in a tile
  constexpr int STAGE = 2 * kMKeys * ROW;   // elements of one stage (K tile, then V tile)
  static_assert(kMKeys * CH % kMThreads == 0, "tile must split evenly over the threads");
  static_assert(kMKeys == 16 * kMWarps, "16 keys per warp");

  extern __shared__ __align__(16) unsigned char smem_raw[];
  // TMA: 128B-swizzle atoms start on 1024-byte boundaries (mma_smem_bytes adds the slack)
  unsigned char* smem =
      TMA ? gpu::mma::align_smem_1024(smem_raw) : smem_raw;
  T* ring = reinterpret_cast<T*>(smem);
  __shared__ float m_s[BW][kMRows];
  __shared__ float tot_s[kMRows], lse_s[kMRows];
  __shared__ int last_s;
  __shared__ int eff_s[BW];
  __shared__ __align__(8) uint64_t full_s[TMA ? SLOTS : 1];  // TMA: a slot's K / V have landed

  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  // this thread's group, its index in the group, its warp's index in the group (16 keys of a tile)
  const int grp = NG == 1 ? 0 : warp / kMWarps;
  const int gtid = tid - grp * kMThreads, gwarp = warp - grp * kMWarps;
  const int g = lane / 4, tq = lane % 4;
  const int T_ = static_cast<int>(p.tokens);
  const int group = static_cast<int>(p.q_heads / p.kv_heads);
  const int rows = group * T_;  // <= kMRows (the plan guarantees it)
  const int64_t hk = blockIdx.y;
  const int64_t b = blockIdx.z;
  const int split = blockIdx.x;

  // PDL (gpu::launch): inputs only after the previous kernel. The next kernel may launch now, except
  // after a clustered launch: there it launches at this grid's exit. An early trigger from the
  // clusters cost the 1B model's decode step ~6 us a layer in its CUDA graph (H200, 2026-12-05,
  // scripts/decode_cluster_bisect.py: the whole layer 63.5 us with the cluster merge against 57.6
  // without, 54.8 with the trigger at exit; e2e at --context 1000 946 against 1081-1082 tok/s).
  if (!p.cluster_merge) gpu::pdl_trigger();
  gpu::pdl_wait();
  // Q rows g and g + 8 of the tile as A fragments (as given; the scale is applied to S in fp32),
  // loaded first: they depend on nothing else, so their round trip overlaps the sequence length's
  // and the first K/V tile's instead of following them.
  // Row r is query head hk * group + r / T of token r % T; rows >= `rows` are zero and masked.
  uint32_t qf[KT][4];
  {
    auto qrow = [&](int r) -> const T* {
      return r < rows ? static_cast<const T*>(p.q) + b * p.q_strides[0] + (r % T_) * p.q_strides[1] +
                            (hk * group + r / T_) * p.q_strides[2]
                      : nullptr;
    };
    const T* q0 = qrow(g);
    const T* q1 = qrow(g + 8);
    auto pair = [](const T* q, int d) -> uint32_t {
      if (q == nullptr) return 0u;
      uint32_t lo = 0, hi = 0;
      lo = *reinterpret_cast<const uint16_t*>(q + d);
      hi = *reinterpret_cast<const uint16_t*>(q + d + 1);
      return lo | (hi << 16);
    };
#pragma unroll
    for (int kt = 0; kt < KT; ++kt) {
      qf[kt][0] = pair(q0, kt * 16 + 2 * tq);
      qf[kt][1] = pair(q1, kt * 16 + 2 * tq);
      qf[kt][2] = pair(q0, kt * 16 + 2 * tq + 8);
      qf[kt][3] = pair(q1, kt * 16 + 2 * tq + 8);
    }
  }
  const SplitChunk chunk = split_chunk(p, b, split);
  const bool len_bad = chunk.len_bad;
  const int len = chunk.len, start = chunk.start;
  int end = chunk.end;

  const KvCache& cache = p.cache;
  const T* kbase = static_cast<const T*>(cache.k) +
                   (PAGED ? hk * cache.k_strides[2] : b * cache.k_strides[0] + hk * cache.k_strides[1]);
  const T* vbase = static_cast<const T*>(cache.v) +
                   (PAGED ? hk * cache.v_strides[2] : b * cache.v_strides[0] + hk * cache.v_strides[1]);
  const int32_t* table_row = PAGED ? cache.block_table + b * cache.table_stride : nullptr;
  const PageSize page(cache.block_size);
  const int num_blocks = static_cast<int>(cache.num_blocks < INT32_MAX ? cache.num_blocks : INT32_MAX);
  bool bad = len_bad;

  // paged: the block of each of this thread's keys in the next tile to load, read one tile ahead
  // so that the table reads are in flight while a tile is used (unused past the chunk). TMA: the
  // blocks of the tile's pages (read by the group's issuing thread; page_rows keys each, a power
  // of two >= 8 that divides the 64-key tile, as the host checks; -1 past the chunk).
  int tbl[LOADS];
  constexpr int kMaxPages = kMKeys / 8;
  const int page_rows = PAGED && TMA ? min(page.size, kMKeys) : kMKeys;
  int tpage[PAGED && TMA ? kMaxPages : 1];
  auto fetch_pages = [&](int tile, int* dst) {
    if (gtid == 0) {  // the group's issuing thread
#pragma unroll
      for (int i = 0; i < kMaxPages; ++i) {
        const int pos = start + tile * kMKeys + i * page_rows;
        dst[i] = i * page_rows < kMKeys && pos < end ? table_row[page.block_of(pos)] : -1;
      }
    }
  };
  auto fetch_table = [&](int tile) {
    if constexpr (PAGED && TMA) {
      fetch_pages(tile, tpage);
    } else if constexpr (PAGED) {
#pragma unroll
      for (int i = 0; i < LOADS; ++i) {
        const int pos = start + tile * kMKeys + (tid + i * kMThreads) / CH;
        tbl[i] = pos < end ? table_row[page.block_of(pos)] : 0;
      }
    }
  };
  // The 16-byte piece c (columns 8c .. 8c + 7) of key row kr of a K or V tile at `tile`: padded
  // rows (cp.async), or D / 64 column blocks of 64 rows x 128 bytes, piece c % 8 of row kr at slot
  // (c % 8) ^ (kr % 8) (TMA's 128B swizzle), so that ldmatrix's 8 rows hit 8 different bank groups.
  auto piece_at = [](const T* tile, int kr, int c) -> const T* {
    if constexpr (TMA) return tile + (c / 8) * (kMKeys * 64) + kr * 64 + ((c % 8) ^ (kr % 8)) * 8;
    else return tile + kr * KS + c * 8;
  };

  // tile `tile` of the chunk into stage `slot` (paged: with the entries fetch_table(tile) read):
  // piece (key, c) of K and V per thread; TMA: D / 64 boxes of K and of V issued by thread 0
  // (paged: one box per page and column block, page_rows x 128 bytes at row 8-aligned offsets, so
  // the 128B swizzle is the same as one 64-row box's; pages past the chunk read block 0, a bad
  // block reads block 0 and marks the head bad: those rows are masked, zeroed or make NaN).
  auto load_tile = [&](int tile, int slot) {
    if constexpr (TMA) {
      if (gtid == 0) {
        const uint32_t bar = gpu::mma::smem_u32(&full_s[slot]);
        const uint32_t ks = gpu::mma::smem_u32(ring + slot * STAGE), vs = ks + kMKeys * D * sizeof(T);
        gpu::tma::mbar_arrive_expect_tx(bar, STAGE * sizeof(T));
        const int pos = start + tile * kMKeys;
        if constexpr (PAGED) {
#pragma unroll
          for (int i = 0; i < kMaxPages; ++i) {
            if (i * page_rows >= kMKeys) break;
            int blk = tpage[i];
            if (blk < 0 || blk >= num_blocks) {
              bad |= pos + i * page_rows < end;  // (past the chunk: no entry was read)
              blk = 0;
            }
            const int off = page.offset_of(pos + i * page_rows);
#pragma unroll
            for (int h = 0; h < D / 64; ++h) {
              const uint32_t at = h * kMKeys * 128 + i * page_rows * 128;
              gpu::tma::load_4d(ks + at, map_k, bar, h * 64, off, static_cast<int>(hk), blk);
              gpu::tma::load_4d(vs + at, map_v, bar, h * 64, off, static_cast<int>(hk), blk);
            }
          }
        } else {
#pragma unroll
          for (int h = 0; h < D / 64; ++h) {
            gpu::tma::load_4d(ks + h * kMKeys * 128, map_k, bar, h * 64, pos, static_cast<int>(hk), static_cast<int>(b));
            gpu::tma::load_4d(vs + h * kMKeys * 128, map_v, bar, h * 64, pos, static_cast<int>(hk), static_cast<int>(b));
          }
        }
      }
      return;
    }
    T* ks = ring + slot * STAGE;
    T* vs = ks + kMKeys * KS;
    const int kb = start + tile * kMKeys;
#pragma unroll
    for (int i = 0; i < LOADS; ++i) {
      const int idx = tid + i * kMThreads, key = idx / CH, c = idx % CH;
      const int pos = kb + key;
      bool ok = pos < end;
      int64_t ko = 0, vo = 0;
      if (PAGED) {
        if (ok) {
          const int blk = tbl[i];
          if (blk < 0 || blk >= num_blocks) {
            bad = true;
            ok = false;
          } else {
            const int off = page.offset_of(pos);
            ko = static_cast<int64_t>(blk) * cache.k_strides[0] + off * cache.k_strides[1];
            vo = static_cast<int64_t>(blk) * cache.v_strides[0] + off * cache.v_strides[1];
          }
        }
      } else {
        ko = static_cast<int64_t>(pos) * cache.k_strides[2];
        vo = static_cast<int64_t>(pos) * cache.v_strides[2];
      }
      gpu::mma::cp_async16(ks + key * KS + c * 8, ok ? kbase + ko + c * 8 : kbase, ok ? 16 : 0);
      gpu::mma::cp_async16(vs + key * KS + c * 8, ok ? vbase + vo + c * 8 : vbase, ok ? 16 : 0);
    }
  };

  // MASK == 2: the staged mask. Row t (token t, or the one row of a shared mask) of tile `tile`:
  // 16-byte pieces from the boundary at or below the address of its first position; the piece that
  // holds position kb sits at byte delta = (row address % 16) of the stage row (kb * size is a
  // multiple of 64).
  const KeyMask& mask = p.mask;
  const DType mdt = mask.dtype;
  const int mE = MASK == 2 ? mask_elem_bytes(mdt) : 1;
  const int mrows = mask.strides[1] == 0 ? 1 : T_;
  const int mlen = mask.len < INT32_MAX ? static_cast<int>(mask.len) : INT32_MAX;
  const int mrowb = mask_row_bytes(mE), mstage = mrows * mrowb;  // bytes per stage row, per stage
  auto mask_row = [&](int t) -> const unsigned char* {
    return static_cast<const unsigned char*>(mask.data) + (b * mask.strides[0] + t * mask.strides[1]) * mE;
  };
  [[maybe_unused]] unsigned char* mring = smem + static_cast<std::size_t>(SLOTS) * STAGE * sizeof(T);
  auto load_mask = [&](int tile, int slot) {
    if constexpr (MASK == 2) {
      const int cpr = 4 * mE + 1;  // pieces per row
      const int kb = start + tile * kMKeys;
      const int lim = min(end, mlen);
      unsigned char* dst = mring + slot * mstage;
      for (int i = gtid; i < mrows * cpr; i += kMThreads) {
        const int t = i / cpr, c = i - t * cpr;
        const unsigned char* row = mask_row(t);
        const uintptr_t w = ((reinterpret_cast<uintptr_t>(row) + static_cast<uintptr_t>(kb) * mE) & ~uintptr_t{15}) +
                            16 * static_cast<uintptr_t>(c);
        const int64_t valid = static_cast<int64_t>(reinterpret_cast<uintptr_t>(row) + static_cast<uintptr_t>(lim) * mE) -
                              static_cast<int64_t>(w);
        const int nb = lim > kb ? static_cast<int>(valid < 0 ? 0 : (valid > 16 ? 16 : valid)) : 0;
        // nothing to read: a valid 16-byte aligned address all the same (this head's K rows)
        gpu::mma::cp_async16(dst + t * mrowb + 16 * c,
                             nb > 0 ? reinterpret_cast<const void*>(w) : static_cast<const void*>(kbase), nb);
      }
    }
  };

  // MASK == 2: the effective end of the chunk, found before any K/V is requested: one past its
  // last key that the mask leaves visible to some row (keys past it are hidden for every row, so
  // they need not be read; a chunk with none reads nothing and writes lse -inf). One pass over the
  // chunk's mask rows (coalesced, 8 loads in flight per thread); for a chunk with visible keys it
  // delays the first K/V tile by about one mask read.
  if constexpr (MASK == 2) {
    const int lim = min(end, mlen);
    int last = start;
    for (int t = 0; t < mrows; ++t) {
      const unsigned char* row = mask_row(t);
#pragma unroll 8
      for (int pos = start + tid; pos < lim; pos += BT)
        if (mask_term_at(row + static_cast<int64_t>(pos) * mE, mdt) != -INFINITY) last = max(last, pos + 1);  // NaN: visible
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) last = max(last, __shfl_xor_sync(0xffffffffu, last, o));
    if (lane == 0) eff_s[warp] = last;
    __syncthreads();
#pragma unroll
    for (int w = 0; w < BW; ++w) last = max(last, eff_s[w]);
    end = min(end, last);
  }

  const int ntiles = (end - start + kMKeys - 1) / kMKeys;
  const int gtiles = (ntiles - grp + NG - 1) / NG;  // this group's tiles: grp, grp + NG, ...
  auto slot_of = [&](int li) { return grp * STAGES + li % STAGES; };  // slot of the group's li-th tile
  if constexpr (TMA) {
    if (tid == 0) {
#pragma unroll
      for (int s = 0; s < SLOTS; ++s) gpu::tma::mbar_init(gpu::mma::smem_u32(&full_s[s]), 1);
      gpu::tma::fence_mbar_init();
      gpu::tma::prefetch_map(map_k);
      gpu::tma::prefetch_map(map_v);
    }
    __syncthreads();
  }
  // (TMA, paged: the pages of the first tiles are read at once, not one round trip per tile)
  [[maybe_unused]] int first_pages[PAGED && TMA ? STAGES - 1 : 1][PAGED && TMA ? kMaxPages : 1];
  if constexpr (PAGED && TMA) {
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) fetch_pages(s * NG + grp, first_pages[s]);
  }
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < gtiles) {
      if constexpr (PAGED && TMA) {
#pragma unroll
        for (int i = 0; i < kMaxPages; ++i) tpage[i] = first_pages[s][i];
      } else {
        fetch_table(s);
      }
      load_tile(s * NG + grp, slot_of(s));
      load_mask(s * NG + grp, slot_of(s));
    }
    gpu::mma::cp_async_commit();
  }
  fetch_table((STAGES - 1) * NG + grp);  // the group's next tile after the prologue's

  const float qscale = p.scale * kLog2e;
  // row r (token t = r % T) sees keys 0 .. len - T + t; padding rows see none
  const int lim0 = g < rows ? len - T_ + g % T_ : -1;
  const int lim1 = g + 8 < rows ? len - T_ + (g + 8) % T_ : -1;

  // MASK == 2: this lane's two stage rows (rows g and g + 8)
  int mofs0 = 0, mofs1 = 0;
  if constexpr (MASK == 2) {
    const int t0 = mrows == 1 ? 0 : g % T_, t1 = mrows == 1 ? 0 : (g + 8) % T_;
    mofs0 = t0 * mrowb + static_cast<int>(reinterpret_cast<uintptr_t>(mask_row(t0)) & 15);
    mofs1 = t1 * mrowb + static_cast<int>(reinterpret_cast<uintptr_t>(mask_row(t1)) & 15);
  }

  float acc[NT][4];
#pragma unroll
  for (int n = 0; n < NT; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;
  float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.f, l1 = 0.f;  // rows g, g + 8 (l: this lane's part)

#pragma unroll 1
  for (int li = 0; li < gtiles; ++li) {  // the group's li-th tile: tile `it` of the chunk, in `slot`
    const int it = li * NG + grp, slot = slot_of(li);
    gpu::mma::cp_async_wait<STAGES - 2>();  // (TMA: the mask pieces)
    if constexpr (TMA) {
      gpu::tma::mbar_wait(gpu::mma::smem_u32(&full_s[slot]), (li / STAGES) & 1);
      // the chunk's last tile: V rows past its end may hold anything (NaN times a zero weight is NaN)
      const int valid = end - (start + it * kMKeys);
      if (valid < kMKeys) {
        T* vt = ring + slot * STAGE + kMKeys * D;
        for (int i = gtid; i < (kMKeys - valid) * CH; i += kMThreads) {
          const int kr = valid + i / CH, c = i % CH;
          *reinterpret_cast<uint4*>(const_cast<T*>(piece_at(vt, kr, c))) = make_uint4(0u, 0u, 0u, 0u);
        }
      }
    }
    // tile `it` is in shared memory for the group; the slot of its previous tile is free
    if constexpr (NG == 1) __syncthreads();
    else gpu::tma::named_sync(1 + grp, kMThreads);
    if (li + STAGES - 1 < gtiles) {
      load_tile(it + (STAGES - 1) * NG, slot_of(li + STAGES - 1));
      load_mask(it + (STAGES - 1) * NG, slot_of(li + STAGES - 1));
      fetch_table(it + STAGES * NG);  // the group's tile after the one just requested
    }
    gpu::mma::cp_async_commit();

    const T* ks = ring + slot * STAGE;
    const T* vs = ks + kMKeys * ROW;
    const int kw = start + it * kMKeys + gwarp * 16;  // this warp's first key

    // masked: the mask terms of this lane's 8 scores, loaded before the products that hide them
    float mk[MASK ? 2 : 1][MASK ? 4 : 1];
    if constexpr (MASK == 2) {
      const unsigned char* st = mring + slot * mstage + (gwarp * 16 + 2 * tq) * mE;
#pragma unroll
      for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int key = kw + 8 * j + 2 * tq + e;
          const bool in = key < mlen;
          mk[j][e] = in ? mask_term_at(st + mofs0 + (8 * j + e) * mE, mdt) : -INFINITY;
          mk[j][2 + e] = in ? mask_term_at(st + mofs1 + (8 * j + e) * mE, mdt) : -INFINITY;
        }
    } else if constexpr (MASK == 1) {
#pragma unroll
      for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int key = kw + 8 * j + 2 * tq + e;
          mk[j][e] = key < end && g < rows ? mask_log2(p.mask, b, g % T_, key) : 0.f;
          mk[j][2 + e] = key < end && g + 8 < rows ? mask_log2(p.mask, b, (g + 8) % T_, key) : 0.f;
        }
    }

    // S = Q K^T for this warp's 16 keys: s[j] is keys 8j..8j+7 (c0 c1 row g, c2 c3 row g + 8); the
    // even and odd k steps accumulate apart (s and s_odd), two dependent chains of D / 32 mmas
    // instead of one of D / 16, added at the end
    float s[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
    float s_odd[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
    for (int kt = 0; kt < KT; ++kt) {
      uint32_t kf[4];
      gpu::mma::ldmatrix_x4(kf, piece_at(ks, gwarp * 16 + (lane / 16) * 8 + lane % 8, kt * 2 + (lane / 8) % 2));
      float (&acc_s)[2][4] = kt % 2 == 0 ? s : s_odd;
      gpu::mma::mma_16816<T>(acc_s[0], qf[kt], kf[0], kf[1]);
      gpu::mma::mma_16816<T>(acc_s[1], qf[kt], kf[2], kf[3]);
    }
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[j][e] += s_odd[j][e];

    // mask, log2 domain, online softmax (the quad of a row reduces with two shuffles)
    float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int key = kw + 8 * j + 2 * tq + e;
        const bool in = key < end;
        float m_lo = 0.f, m_hi = 0.f;
        if constexpr (MASK != 0) {
          m_lo = mk[j][e];
          m_hi = mk[j][2 + e];
        }
        s[j][e] = in && key <= lim0 ? s[j][e] * qscale + m_lo : -INFINITY;
        s[j][2 + e] = in && key <= lim1 ? s[j][2 + e] * qscale + m_hi : -INFINITY;
        mx0 = fmaxf(mx0, s[j][e]);
        mx1 = fmaxf(mx1, s[j][2 + e]);
      }
    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
    mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
    mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
    const float mn0 = fmaxf(m0, mx0), mn1 = fmaxf(m1, mx1);
    // a row that has seen no key yet keeps -inf; subtracting 0 then gives ex2(-inf) = 0
    const float base0 = mn0 == -INFINITY ? 0.f : mn0, base1 = mn1 == -INFINITY ? 0.f : mn1;
    const float alpha0 = gpu::mma::ex2_approx(m0 - base0), alpha1 = gpu::mma::ex2_approx(m1 - base1);
    m0 = mn0;
    m1 = mn1;
    float ps0 = 0.f, ps1 = 0.f;
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        s[j][e] = gpu::mma::ex2_approx(s[j][e] - base0);
        s[j][2 + e] = gpu::mma::ex2_approx(s[j][2 + e] - base1);
        ps0 += s[j][e];
        ps1 += s[j][2 + e];
      }
    l0 = l0 * alpha0 + ps0;
    l1 = l1 * alpha1 + ps1;
#pragma unroll
    for (int n = 0; n < NT; ++n) {
      acc[n][0] *= alpha0;
      acc[n][1] *= alpha0;
      acc[n][2] *= alpha1;
      acc[n][3] *= alpha1;
    }

    // O += P V: P (16 rows x 16 keys) as one A fragment, V^T pieces through ldmatrix.trans
    const uint32_t pa[4] = {gpu::mma::pack2<T>(s[0][0], s[0][1]), gpu::mma::pack2<T>(s[0][2], s[0][3]),
                            gpu::mma::pack2<T>(s[1][0], s[1][1]), gpu::mma::pack2<T>(s[1][2], s[1][3])};
#pragma unroll
    for (int dp = 0; dp < NT / 2; ++dp) {
      uint32_t vf[4];
      gpu::mma::ldmatrix_x4_trans(vf, piece_at(vs, gwarp * 16 + ((lane / 8) % 2) * 8 + lane % 8, dp * 2 + lane / 16));
      gpu::mma::mma_16816<T>(acc[2 * dp], pa, vf[0], vf[1]);
      gpu::mma::mma_16816<T>(acc[2 * dp + 1], pa, vf[2], vf[3]);
    }
  }
  gpu::mma::cp_async_wait<0>();
  __syncthreads();  // the ring is free: reused for the combination below

  // combine the warps (all groups'): a common max per row, then the sum of the rescaled (l, O)
  float* o_part = reinterpret_cast<float*>(smem);   // [BW][kMRows][D]
  float* o_s = o_part + BW * kMRows * D;            // [kMRows][D]
  float* l_part = o_s + kMRows * D;                 // [BW][kMRows]
  float* wts = l_part + BW * kMRows;                // [kMRows][kMaxSplits]
  float4* part_s = reinterpret_cast<float4*>(wts + kMRows * kMaxSplits);  // [BT]
  l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
  l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
  l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
  l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
  if (tq == 0) {
    m_s[warp][g] = m0;
    m_s[warp][g + 8] = m1;
  }
  const bool any_bad = __syncthreads_or(bad ? 1 : 0) != 0;
  float mb0 = -INFINITY, mb1 = -INFINITY;
#pragma unroll
  for (int w = 0; w < BW; ++w) {
    mb0 = fmaxf(mb0, m_s[w][g]);
    mb1 = fmaxf(mb1, m_s[w][g + 8]);
  }
  const float f0 = m0 == -INFINITY ? 0.f : gpu::mma::ex2_approx(m0 - mb0);
  const float f1 = m1 == -INFINITY ? 0.f : gpu::mma::ex2_approx(m1 - mb1);
  float* op0 = o_part + (warp * kMRows + g) * D + 2 * tq;
  float* op1 = op0 + 8 * D;
#pragma unroll
  for (int n = 0; n < NT; ++n) {
    *reinterpret_cast<float2*>(op0 + n * 8) = make_float2(acc[n][0] * f0, acc[n][1] * f0);
    *reinterpret_cast<float2*>(op1 + n * 8) = make_float2(acc[n][2] * f1, acc[n][3] * f1);
  }
  if (tq == 0) {
    l_part[warp * kMRows + g] = l0 * f0;
    l_part[warp * kMRows + g + 8] = l1 * f1;
  }
  if (warp == 0 && tq == 0) {
    lse_s[g] = mb0;
    lse_s[g + 8] = mb1;
  }
  __syncthreads();
  for (int i = tid; i < rows * D; i += BT) {
    float a = 0.f;
#pragma unroll
    for (int w = 0; w < BW; ++w) a += o_part[w * kMRows * D + i];
    o_s[i] = a;
  }
  if (tid < rows) {
    float lb = 0.f;
#pragma unroll
    for (int w = 0; w < BW; ++w) lb += l_part[w * kMRows + tid];
    tot_s[tid] = lb;
  }
  __syncthreads();
  if constexpr (TMA) {
    if (p.cluster_merge) {
      cluster_finish<T, D, BT>(p, b, hk, split, rows, o_s, tot_s, lse_s, any_bad, wts);
      return;
    }
  }
  finish_split_block<T, D, BT>(p, b, hk, split, rows, o_s, tot_s, lse_s, any_bad, wts, part_s, last_s);
}

template <typename T, int D, bool PAGED, int MASK>
__global__ void __launch_bounds__(kMThreads, 2) decode_mma_kernel(DecodeParams p) {
  decode_mma_body<T, D, PAGED, MASK, false, 1>(p, nullptr, nullptr);
}

// Its body exists only in sm_90a code (gpu::tma::kernel_built tells the host); a stub elsewhere.
// NG warp groups of 4 warps (decode_mma_body; 2: one block per multiprocessor).
template <typename T, int D, bool PAGED, int MASK, int NG>
__global__ void __launch_bounds__(kMThreads * NG, NG == 1 ? 2 : 1)
    decode_mma_tma_kernel(DecodeParams p, const __grid_constant__ CUtensorMap map_k,
                          const __grid_constant__ CUtensorMap map_v) {
#if LLMK_HAS_WGMMA
  decode_mma_body<T, D, PAGED, MASK, true, NG>(p, &map_k, &map_v);
#else
  (void)p;
  (void)map_k;
  (void)map_v;
#endif
}
#endif  // LLMK_MMA_SYNC_BUILD

// Sets the kernel's shared memory size and returns how many of its blocks fit on one
// multiprocessor (at least 1).
template <typename T, int D, bool PAGED>
int prepare(std::size_t smem) {
  auto kernel = decode_split_kernel<T, D, PAGED>;
  gpu::check(gpuFuncSetAttribute(kernel, gpuFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)),
             "decode_attention", "setting the shared memory size");
  return gpu::resident_blocks(kernel, kThreads, smem, "decode_attention");
}

template <typename T, int D>
int prepare_layout(bool paged, std::size_t smem) {
  return paged ? prepare<T, D, true>(smem) : prepare<T, D, false>(smem);
}

template <typename T>
int prepare_dim(int head_dim, bool paged, std::size_t smem) {
  switch (head_dim) {
    case 64: return prepare_layout<T, 64>(paged, smem);
    case 128: return prepare_layout<T, 128>(paged, smem);
    default: return prepare_layout<T, 256>(paged, smem);
  }
}

template <typename T, int D, bool PAGED>
void launch_typed(const DecodeParams& p) {
  const int R = static_cast<int>(p.q_heads / p.kv_heads * p.tokens);
  const int row_groups = (R + p.rows_per_block - 1) / p.rows_per_block;
  const std::size_t smem = smem_bytes(D, p.rows_per_block);
  prepare<T, D, PAGED>(smem);
  const dim3 grid(p.num_splits, static_cast<unsigned>(p.kv_heads * row_groups), static_cast<unsigned>(p.batch));
  decode_split_kernel<T, D, PAGED><<<grid, kThreads, smem, gpu::as_stream(p.stream)>>>(p);
  gpu::check_launch("decode_attention");
  if (p.num_splits > 1) {
    decode_merge_kernel<T, D><<<static_cast<unsigned>(p.batch * p.q_heads * p.tokens), kThreads, 0,
                                gpu::as_stream(p.stream)>>>(p);
    gpu::check_launch("decode_attention");
  }
}

int warp_dispatch(DType dtype, int head_dim, bool paged, int rows, const DecodeParams* p);
int mma_dispatch(const DecodeParams& p, bool launch);

template <typename T, int D>
void launch_layout(const DecodeParams& p) {
  if (p.mma_kernel) mma_dispatch(p, true);
  else if (p.warp_kernel) warp_dispatch(p.dtype, D, p.cache.paged, static_cast<int>(p.rows_per_block), &p);
  else if (p.cache.paged) launch_typed<T, D, true>(p);
  else launch_typed<T, D, false>(p);
}

template <typename T>
void launch_dim(const DecodeParams& p) {
  switch (p.head_dim) {
    case 64: launch_layout<T, 64>(p); break;
    case 128: launch_layout<T, 128>(p); break;
    case 256: launch_layout<T, 256>(p); break;
    default: fail(ErrorKind::not_implemented, "decode_attention", "unsupported head dim");
  }
}

// Before a launch of decode_warp_kernel or decode_mma_kernel with several splits: zeroes the
// per-(sequence, KV head) counters behind the partial results in the workspace (async, capturable),
// unless the caller vouches that they are zero (DecodeOptions::workspace_zeroed: the kernels leave
// them so).
void zero_split_counters(const DecodeParams& p) {
  if (p.num_splits <= 1 || p.workspace_zeroed) return;
  const std::size_t rows_total = static_cast<std::size_t>(p.batch * p.q_heads * p.tokens);
  const std::size_t off = (rows_total * p.num_splits * (p.head_dim + 1) * 4 + 15) / 16 * 16;
  gpu::check(gpuMemsetAsync(static_cast<char*>(p.workspace) + off, 0,
                            static_cast<std::size_t>(p.batch * p.kv_heads) * sizeof(unsigned),
                            gpu::as_stream(p.stream)),
             "decode_attention", "zeroing the split counters");
}

// Occupancy (p == nullptr) or launch of decode_warp_kernel.
template <typename T, int D, int RB, bool PAGED>
int warp_run(const DecodeParams* p) {
  auto kernel = p != nullptr && p->mask.data ? decode_warp_kernel<T, D, RB, PAGED, true>
                                             : decode_warp_kernel<T, D, RB, PAGED, false>;
  if (p == nullptr) return gpu::resident_blocks(kernel, kWThreads, 0, "decode_attention");
  zero_split_counters(*p);
  const dim3 grid(p->num_splits, static_cast<unsigned>(p->kv_heads), static_cast<unsigned>(p->batch));
  kernel<<<grid, kWThreads, 0, gpu::as_stream(p->stream)>>>(*p);
  gpu::check_launch("decode_attention");
  return 0;
}

template <typename T, int D, bool PAGED>
int warp_rows(int rows, const DecodeParams* p) {
  return rows <= 4 ? warp_run<T, D, 4, PAGED>(p) : warp_run<T, D, kWMaxRows, PAGED>(p);
}

template <typename T, int D>
int warp_layout(bool paged, int rows, const DecodeParams* p) {
  return paged ? warp_rows<T, D, true>(rows, p) : warp_rows<T, D, false>(rows, p);
}

template <typename T>
int warp_dim(int head_dim, bool paged, int rows, const DecodeParams* p) {
  switch (head_dim) {
    case 64: return warp_layout<T, 64>(paged, rows, p);
    case 128: return warp_layout<T, 128>(paged, rows, p);
    default: return warp_layout<T, 256>(paged, rows, p);
  }
}

int warp_dispatch(DType dtype, int head_dim, bool paged, int rows, const DecodeParams* p) {
  return dtype == DType::f16 ? warp_dim<half>(head_dim, paged, rows, p)
                             : warp_dim<bfloat16>(head_dim, paged, rows, p);
}

#if LLMK_MMA_SYNC_BUILD
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
bool tma_pages(const KvCache& c) {
  return c.block_size >= 8 && (c.block_size & (c.block_size - 1)) == 0 && c.num_blocks < (int64_t{1} << 31);
}

bool cluster_merge_wanted(const DecodeParams& p, int64_t splits) {
  return splits > 1 && splits <= kMaxClusterSplits && (!p.cache.paged || tma_pages(p.cache)) &&
         splits * p.batch * p.kv_heads <= gpu::multiprocessor_count(p.device.index) &&
         gpu::env_flag("LLMK_DECODE_CLUSTER", true);
}
bool cluster_merge_applies(const DecodeParams& p) { return cluster_merge_wanted(p, p.num_splits); }

// The warp groups of decode_mma_tma_kernel for this launch: 2 (one block of 8 warps per
// multiprocessor, two tiles in flight through the math at once) where the grid has no more blocks
// than multiprocessors (so that each would run one block of 4 warps, a single dependent chain per
// scheduler) and the splits do not merge in a cluster; else 1. Paged caches too (each group's
// issuing thread reads its own tiles' pages): H100 2026-12-05, b1 kv4096 pages of 16, 16.68 against
// 16.93-16.95 us a call in a CUDA graph; forced at b2 (beyond this rule) 29.0 against 22.4
// (bench/results/h100-decode-patches-portable-2026-12-05.md).
// Measured on the H200 (2026-12-03 13:31 UTC, do_bench us, two rounds each): the 1B model's step
// (8 blocks, D 64, 160 keys; bench_decode._model_step_attention) with HF's mask 10.4 / 11.0 with
// two groups against 11.4 / 12.4 with one (a 4096-slot cache: 13.1 / 13.1 against 14.0 / 14.0),
// with exact seq_lens 8.4 / 9.0 against 8.8 / 8.2 (10.8 against 10.4 at 4096 slots); but with
// the cluster merge no gain at b1 kv4096 (13.0 against 12.7-12.8 us a call in a CUDA graph) and a
// loss at b2 kv4096 (24.9 against 16.7; likely because 16 clusters of 8 one-block
// multiprocessors do not all fit at once, not verified). LLMK_DECODE_GROUPS=1 / 2 forces it (read
// at every call).
int mma_groups(const DecodeParams& p, dim3 grid) {
  const char* v = std::getenv("LLMK_DECODE_GROUPS");
  if (v != nullptr && *v != '\0') {
    if (std::strcmp(v, "1") == 0) return 1;
    if (std::strcmp(v, "2") == 0) return 2;
    fail(ErrorKind::value, "decode_attention", std::string("LLMK_DECODE_GROUPS: expected 1 or 2, got '") + v + "'");
  }
  const int64_t blocks = static_cast<int64_t>(grid.x) * grid.y * grid.z;
  return blocks <= gpu::multiprocessor_count(p.device.index) && !cluster_merge_applies(p) ? 2 : 1;
}

// The launch of decode_mma_tma_kernel (grid and mask stage bytes as decode_mma_kernel's), or false
// where it does not apply: a device other than compute capability 9.0 with its sm_90a body loaded,
// cache strides or a base TMA cannot express, positions past 32-bit coordinates, pages that
// tma_pages rules out.
template <typename T, int D, bool PAGED, int MASK, int NG>
bool mma_tma_launch_groups(const DecodeParams& p, dim3 grid, std::size_t mask_stage_bytes) {
  constexpr auto kernel = decode_mma_tma_kernel<T, D, PAGED, MASK, NG>;
  constexpr int threads = kMThreads * NG;
  // the opt-in covers the largest staged mask, as in mma_run
  constexpr std::size_t smem_max = mma_smem_bytes(D, MASK == 2 ? kMMaskRows * mask_row_bytes(4) : 0, true, NG);
  const int dev = p.device.index;
  const KvCache& c = p.cache;
  if (!gpu::tma::sm90_kernel_ready<kernel>(dev, smem_max, "decode_attention") || c.capacity >= (int64_t{1} << 31) ||
      (PAGED && !tma_pages(c)))
    return false;
  CUtensorMap map_k{}, map_v{};
  const bool f16 = std::is_same_v<T, half>;
  // one streaming pass: no L2 promotion (see make_tensor_map). Contiguous (B, Hkv, Smax, D): dims
  // (D, position, head, sequence), 64-row boxes; paged (num_blocks, block_size, Hkv, D): dims (D,
  // offset in the block, head, block), boxes of min(block size, 64) rows.
  const auto make = [&](CUtensorMap* map, const void* base, const int64_t* st) {
    if constexpr (PAGED) {
      const int64_t strides[3] = {st[0], st[1], st[2]};  // block, offset, head
      return gpu::tma::make_tensor_map(map, f16, base, D, c.block_size, p.kv_heads, c.num_blocks, strides,
                                       static_cast<int>(std::min<int64_t>(c.block_size, kMKeys)), false);
    } else {
      const int64_t strides[3] = {st[0], st[2], st[1]};  // sequence, position, head
      return gpu::tma::make_tensor_map(map, f16, base, D, c.capacity, p.kv_heads, p.batch, strides, kMKeys, false);
    }
  };
  if (!make(&map_k, c.k, c.k_strides) || !make(&map_v, c.v, c.v_strides)) return false;
  const std::size_t smem = mma_smem_bytes(D, mask_stage_bytes, true, NG);
  const int S = p.num_splits;
  if (cluster_merge_applies(p)) {
    // the splits of a head as one cluster, merged through distributed shared memory (cluster_finish)
    if (gpu::resident_clusters<kernel>(dev, static_cast<unsigned>(S), dim3(threads), smem_max) > 0) {
      DecodeParams q = p;
      q.cluster_merge = true;
      gpu::launch_cluster(kernel, grid, threads, smem, gpu::as_stream(p.stream), static_cast<unsigned>(S),
                          gpu::pdl_enabled(dev), q, map_k, map_v);
      gpu::check_launch("decode_attention");
      return true;
    }
  }
  zero_split_counters(p);
  gpu::launch(kernel, grid, threads, smem, gpu::as_stream(p.stream), gpu::pdl_enabled(dev), p, map_k, map_v);
  gpu::check_launch("decode_attention");
  return true;
}

// decode_mma_tma_kernel with the warp groups mma_groups asks for.
template <typename T, int D, bool PAGED, int MASK>
bool mma_tma_launch(const DecodeParams& p, dim3 grid, std::size_t mask_stage_bytes) {
  if (mma_groups(p, grid) == 2) return mma_tma_launch_groups<T, D, PAGED, MASK, 2>(p, grid, mask_stage_bytes);
  return mma_tma_launch_groups<T, D, PAGED, MASK, 1>(p, grid, mask_stage_bytes);
}

// Blocks of decode_mma_kernel per multiprocessor (launch == false), or its launch (that of
// decode_mma_tma_kernel where p.tma asks for it and it applies). The opt-in to its dynamic shared
// memory and the occupancy are set / read once per device.
template <typename T, int D, bool PAGED, int MASK>
int mma_run(const DecodeParams& p, bool launch) {
  auto kernel = decode_mma_kernel<T, D, PAGED, MASK>;
  // MASK 2: the opt-in covers the largest staged mask (8 rows of f32); a launch asks for its own
  constexpr std::size_t smem_max = mma_smem_bytes(D, MASK == 2 ? kMMaskRows * mask_row_bytes(4) : 0);
  const std::size_t mask_stage =
      MASK == 2 ? static_cast<std::size_t>(p.mask.strides[1] == 0 ? 1 : p.tokens) * mask_row_bytes(mask_elem_bytes(p.mask.dtype))
                : 0;
  const std::size_t smem = MASK == 2 ? mma_smem_bytes(D, mask_stage) : smem_max;
  static std::atomic<int> per_sm[64];  // 0: not prepared on that device yet
  const int dev = p.device.index;
  int blocks = dev >= 0 && dev < 64 ? per_sm[dev].load() : 0;
  if (blocks == 0) {
    gpu::check(gpuFuncSetAttribute(kernel, gpuFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem_max)),
               "decode_attention", "setting the shared memory size");
    blocks = gpu::resident_blocks(kernel, kMThreads, smem, "decode_attention");
    if (dev >= 0 && dev < 64) per_sm[dev].store(blocks);
  }
  if (!launch) return blocks;
  const dim3 grid(p.num_splits, static_cast<unsigned>(p.kv_heads), static_cast<unsigned>(p.batch));
  if (p.tma && mma_tma_launch<T, D, PAGED, MASK>(p, grid, mask_stage)) return 0;
  zero_split_counters(p);
  gpu::launch(kernel, grid, kMThreads, smem, gpu::as_stream(p.stream), gpu::pdl_enabled(p.device.index), p);
  gpu::check_launch("decode_attention");
  return 0;
}

// The staged mask (MASK 2) needs a contiguous last dim and element-aligned rows; other masks take
// the per-lane loads (MASK 1). The plan (launch == false) reads the unmasked kernel's occupancy, so
// that the split plan and the workspace size never depend on the mask (decode_workspace_size
// takes none); the masked kernels fit the same blocks per multiprocessor (same launch bounds,
// shared memory within the same count).
template <typename T, int D>
int mma_layout(const DecodeParams& p, bool launch) {
  if (launch && p.mask.data) {
    const bool staged = p.mask_prefetch && (p.mask.strides[2] == 1 || p.mask.len <= 1) &&
                        reinterpret_cast<uintptr_t>(p.mask.data) % mask_elem_bytes(p.mask.dtype) == 0;
    if (staged) return p.cache.paged ? mma_run<T, D, true, 2>(p, launch) : mma_run<T, D, false, 2>(p, launch);
    return p.cache.paged ? mma_run<T, D, true, 1>(p, launch) : mma_run<T, D, false, 1>(p, launch);
  }
  return p.cache.paged ? mma_run<T, D, true, 0>(p, launch) : mma_run<T, D, false, 0>(p, launch);
}

template <typename T>
int mma_dim(const DecodeParams& p, bool launch) {
  return p.head_dim == 64 ? mma_layout<T, 64>(p, launch) : mma_layout<T, 128>(p, launch);
}

int mma_dispatch(const DecodeParams& p, bool launch) {
  return p.dtype == DType::f16 ? mma_dim<half>(p, launch) : mma_dim<bfloat16>(p, launch);
}
#else
int mma_dispatch(const DecodeParams&, bool) {
  fail(ErrorKind::not_implemented, "decode_attention", "the tensor-core kernel needs a CUDA build");
  return 0;
}
#endif

// The kernel asked for, read per call (one place) so that tests and benchmarks can flip it:
// LLMK_DECODE_KERNEL = mma (default) | warp | split; LLMK_DECODE_LEGACY=1 (older switch) = split.
// A shape or device a kernel does not serve falls back to the next one (mma -> warp -> split).
enum class DecodeKernel { warp, mma, split };
DecodeKernel requested_kernel() {
  const char* v = std::getenv("LLMK_DECODE_KERNEL");
  if (v != nullptr && *v != '\0') {
    if (std::strcmp(v, "warp") == 0) return DecodeKernel::warp;
    if (std::strcmp(v, "mma") == 0) return DecodeKernel::mma;
    if (std::strcmp(v, "split") == 0) return DecodeKernel::split;
    fail(ErrorKind::value, "decode_attention",
         std::string("LLMK_DECODE_KERNEL: expected warp, mma or split, got '") + v + "'");
  }
  // mma by the H200 run of 2026-11-30 17:50 (bench/results/h200-decode.md): 145 vs 276 us (warp)
  // at b32 kv4096, 274 vs 524 at b8 kv32768, 20 vs 30 at b1 kv4096 (contiguous; paged 1.1x).
  return gpu::env_flag("LLMK_DECODE_LEGACY") ? DecodeKernel::split : DecodeKernel::mma;
}

// The counter's advance as a launch of its own (one thread), after a write of several blocks.
__global__ void advance_length_kernel(KvWriteParams p) {
  gpu::pdl_begin();  // PDL (gpu::launch): after the write kernel
  advance_length(p);
}

// Writes the new K/V of one (sequence, token) per block, 16-byte pieces over the threads. With
// p.advance (only ever in a one-block launch) thread 0 advances the length counter once every
// thread has read its position, so the positions may be views of that counter.
template <typename T, int VEC>
__global__ void __launch_bounds__(kThreads) write_kv_kernel(KvWriteParams p) {
  using V = gpu::Vec<T, VEC>;
  gpu::pdl_begin();  // PDL (gpu::launch): inputs only after the previous kernel
  const int64_t b = blockIdx.x / p.tokens, t = blockIdx.x % p.tokens;
  const int64_t pieces = p.kv_heads * p.head_dim / VEC;
  const T* k = static_cast<const T*>(p.k) + b * p.k_strides[0] + t * p.k_strides[1];
  const T* v = static_cast<const T*>(p.v) + b * p.v_strides[0] + t * p.v_strides[1];
  const auto load_piece = [&](int64_t i, V& kv, V& vv) {
    const int64_t h = i * VEC / p.head_dim, d = i * VEC % p.head_dim;
    kv = gpu::load_vec<T, VEC>(k + h * p.k_strides[2] + d);
    vv = gpu::load_vec<T, VEC>(v + h * p.v_strides[2] + d);
  };
  int64_t i = threadIdx.x;
  V kv{}, vv{};
  if (i < pieces) load_piece(i, kv, vv);  // in flight while the position is read
  const int64_t pos = position_at(p, b, t);
  if (p.advance != nullptr) {  // one block: every thread has read the position
    __syncthreads();
    if (threadIdx.x == 0) advance_length(p);
  }
  const KvCache& c = p.cache;
  if (pos < 0 || pos >= c.capacity) return;  // padding, or out of range (skipped on the GPU)
  for (; i < pieces; i += blockDim.x) {
    if (i != threadIdx.x) load_piece(i, kv, vv);  // heads x head dim beyond one piece per thread
    const int64_t h = i * VEC / p.head_dim, d = i * VEC % p.head_dim;
    const int64_t ko = c.paged ? kv_offset<true>(c, c.k_strides, b, h, pos) : kv_offset<false>(c, c.k_strides, b, h, pos);
    const int64_t vo = c.paged ? kv_offset<true>(c, c.v_strides, b, h, pos) : kv_offset<false>(c, c.v_strides, b, h, pos);
    if (ko < 0 || vo < 0) return;
    gpu::store<gpu::Cache::keep>(reinterpret_cast<V*>(static_cast<T*>(p.k_cache) + ko + d), kv);
    gpu::store<gpu::Cache::keep>(reinterpret_cast<V*>(static_cast<T*>(p.v_cache) + vo + d), vv);
  }
}

constexpr int kRopeKvThreads = 512;

// rope_write_kv_cache's kernel: one block per (sequence, token) as write_kv_kernel; see the top of
// the file. Contiguous caches only (the host checks).
template <typename T, int VEC>
__global__ void __launch_bounds__(kRopeKvThreads) rope_write_kv_kernel(KvWriteParams p) {
  using V = gpu::Vec<T, VEC>;
  gpu::pdl_begin();  // PDL (gpu::launch): inputs only after the previous kernel
  const int64_t b = blockIdx.x / p.tokens, t = blockIdx.x % p.tokens;
  const int64_t half = p.head_dim / 2, hp = half / VEC;  // rotation pieces per head
  const int64_t qn = p.q_heads * hp, kn = p.kv_heads * hp, vn = p.kv_heads * (p.head_dim / VEC);
  const T* cs = static_cast<const T*>(p.cos) + b * p.cos_strides[0] + t * p.cos_strides[1];
  const T* sn = static_cast<const T*>(p.sin) + b * p.sin_strides[0] + t * p.sin_strides[1];
  const int64_t pos = position_at(p, b, t);
  if (p.advance != nullptr) {  // one block: every thread has read the position
    __syncthreads();
    if (threadIdx.x == 0) advance_length(p);
  }
  const KvCache& c = p.cache;
  const bool write = pos >= 0 && pos < c.capacity;  // padding, or out of range (skipped on the GPU)
  for (int64_t i = threadIdx.x; i < qn + kn + vn; i += blockDim.x) {
    if (i < qn + kn) {
      const bool is_q = i < qn;
      const int64_t j = is_q ? i : i - qn, h = j / hp, d = j % hp * VEC;
      const int64_t* xs = is_q ? p.q_strides : p.k_strides;
      const int64_t* ys = is_q ? p.q_out_strides : p.k_out_strides;
      const T* x = static_cast<const T*>(is_q ? p.q : p.k) + b * xs[0] + t * xs[1] + h * xs[2];
      T* y = static_cast<T*>(is_q ? p.q_out : p.k_out) + b * ys[0] + t * ys[1] + h * ys[2];
      float x1[VEC], x2[VEC], cf[VEC], sf[VEC], y1[VEC], y2[VEC];
      gpu::load_float<T, VEC>(x + d, x1);
      gpu::load_float<T, VEC>(x + d + half, x2);
      gpu::load_float<T, VEC>(cs + d, cf);
      gpu::load_float<T, VEC>(sn + d, sf);
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        y1[e] = x1[e] * cf[e] - x2[e] * sf[e];
        y2[e] = x2[e] * cf[e] + x1[e] * sf[e];
      }
      const V lo = gpu::from_float<T, VEC>(y1), hi = gpu::from_float<T, VEC>(y2);
      gpu::store<gpu::Cache::keep>(reinterpret_cast<V*>(y + d), lo);
      gpu::store<gpu::Cache::keep>(reinterpret_cast<V*>(y + d + half), hi);
      if (!is_q && write) {
        T* kc = static_cast<T*>(p.k_cache) + kv_offset<false>(c, c.k_strides, b, h, pos);
        gpu::store<gpu::Cache::keep>(reinterpret_cast<V*>(kc + d), lo);
        gpu::store<gpu::Cache::keep>(reinterpret_cast<V*>(kc + d + half), hi);
      }
    } else {
      const int64_t j = i - qn - kn, h = j * VEC / p.head_dim, d = j * VEC % p.head_dim;
      const V vv = gpu::load_vec<T, VEC>(static_cast<const T*>(p.v) + b * p.v_strides[0] + t * p.v_strides[1] +
                                         h * p.v_strides[2] + d);
      if (write)
        gpu::store<gpu::Cache::keep>(
            reinterpret_cast<V*>(static_cast<T*>(p.v_cache) + kv_offset<false>(c, c.v_strides, b, h, pos) + d), vv);
    }
  }
}

}  // namespace

namespace {

// How one_launch_plan splits a cache when the caller leaves the count to it: splits of at least
// min_split_keys keys, as many as keep every block resident at once; or, where that makes more,
// splits of short_split_keys keys (the last one shorter) up to one block per multiprocessor (0:
// never); and one split where the cache holds fewer than min_cache_keys keys.
struct SplitRule {
  int64_t min_split_keys;
  int64_t short_split_keys = 0;
  int64_t min_cache_keys = 0;
};

// decode_warp_kernel's rule: splits of at least 256 keys (was 128 until the 17:50 run): a split of
// a few tiles costs more in its merge (a memset, the partials' round trip, the last block's pass)
// than it saves; the 1B model's decode step (a 203-slot static cache) took 14.6 us with 2 splits
// where SDPA took 10.5.
constexpr SplitRule kWarpSplits{256};

// Split count and length for decode_warp_kernel / decode_mma_kernel: a single row group, splits of
// a multiple of the block's step n by `rule` (per_sm blocks per multiprocessor; read only when the
// caller asks for automatic splits). Same workspace layout for both kernels (partials, then the
// counters). cluster_splits: the most automatic splits worth having, up to cluster_splits * 8
// tiles, where the split merge can run in a cluster (0: no such cap).
template <typename PerSm>
DecodePlan one_launch_plan(const DecodeParams& p, const DecodeOptions& options, int n, const SplitRule& rule,
                           PerSm per_sm_of, int64_t cluster_splits = 0) {
  DecodePlan plan;
  const int D = static_cast<int>(p.head_dim);
  plan.rows_per_block = static_cast<int>(p.q_heads / p.kv_heads * p.tokens);
  int64_t hint = p.cache.capacity;
  if (options.max_seq_len > 0 && options.max_seq_len < hint) hint = options.max_seq_len;
  const int64_t tiles = hint > 0 ? (hint + n - 1) / n : 1;
  int64_t splits = options.num_splits;
  if (splits <= 0 && tiles * n < rule.min_cache_keys) splits = 1;
  if (splits <= 0) {
    gpu::DeviceGuard guard(p.device, "decode_attention");
    const int per_sm = per_sm_of();
    const int64_t sms = gpu::multiprocessor_count(p.device.index);
    const int64_t slots = per_sm * sms;
    const int64_t blocks = p.batch * p.kv_heads;
    splits = blocks >= slots ? 1 : slots / blocks;
    const int64_t min_tiles = (rule.min_split_keys + n - 1) / n;
    const int64_t most = tiles / min_tiles > 1 ? tiles / min_tiles : 1;
    if (splits > most) splits = most;
    if (rule.short_split_keys > 0) {
      const int64_t short_tiles = (rule.short_split_keys + n - 1) / n;
      int64_t short_splits = (tiles + short_tiles - 1) / short_tiles;
      const int64_t one_per_sm = sms / blocks;
      if (short_splits > one_per_sm) short_splits = one_per_sm;
      if (short_splits > splits) splits = short_splits;
    }
    if (cluster_splits > 0 && splits > cluster_splits && tiles <= cluster_splits * 8) splits = cluster_splits;
  }
  if (splits > tiles) splits = tiles;
  if (splits > kMaxSplits) splits = kMaxSplits;
  if (splits < 1) splits = 1;
  const int64_t per = (tiles + splits - 1) / splits;
  plan.num_splits = static_cast<int>((tiles + per - 1) / per);
  plan.split_len = per * n;
  if (plan.num_splits > 1) {
    const std::size_t rows_total = static_cast<std::size_t>(p.batch * p.q_heads * p.tokens);
    plan.workspace_bytes = (rows_total * plan.num_splits * (D + 1) * 4 + 15) / 16 * 16 +
                           (static_cast<std::size_t>(p.batch * p.kv_heads) * 4 + 15) / 16 * 16;
  }
  return plan;
}

DecodePlan warp_plan(const DecodeParams& p, const DecodeOptions& options) {
  const int D = static_cast<int>(p.head_dim);
  const int R = static_cast<int>(p.q_heads / p.kv_heads * p.tokens);
  DecodePlan plan = one_launch_plan(p, options, warp_tile_keys(D, R <= 4 ? 4 : kWMaxRows), kWarpSplits,
                                    [&] { return warp_dispatch(p.dtype, D, p.cache.paged, R, nullptr); });
  plan.warp_kernel = true;
  return plan;
}

#if LLMK_MMA_SYNC_BUILD
// decode_mma_kernel's rule: as the warp kernel's, or splits of 2 tiles (128 keys) where those make
// more and leave at most one block per multiprocessor, and none below 512 keys. Measured on the H200
// (2026-12-04 20:27-20:41, 8 KV heads, batch 1, `scripts/decode_split_sweep.py`, us a call in a CUDA
// graph): the 1B model's step at --context 1000 (a 1080-slot cache, head dim 64) took 12.71 us in 9
// splits of 128 keys against 15.08 in the 256-key rule's 4 of 320 (1B e2e: 1013-1014 against
// 977-978 tok/s); at 203 slots one split took 7.33 and two 11.76 (a merge costs ~4.4 us, worth
// paying past ~8 tiles); at 4096 keys, head dim 128, 32 splits of 128 keys (2 blocks a
// multiprocessor) took 17.34 against 16.85 in the 256-key rule's 16, hence the one-block cap.
constexpr SplitRule kMmaSplits{256, 128, 512};

DecodePlan mma_plan(const DecodeParams& p, const DecodeOptions& options, bool tma) {
  // With the cluster merge (LLMK_DECODE_CLUSTER, on by default, see cluster_merge_wanted): up to
  // 4096 keys (8 tiles a split) on the H200 with TMA and a contiguous cache, where 8 splits merged
  // in a cluster measured faster alone than more splits merged through the workspace (see
  // kMaxClusterSplits): at most 8 splits, where those make 64 blocks or more
  // (the measured case: 64 blocks on 132 SMs, 17.3 against 19.2 us, H200 2026-12-01; fewer blocks
  // were not measured and keep the plan they had). Not for paged caches: at block size 16, 8
  // clustered splits took 24.5 us at b1 kv4096 against 20.4 with 16 (one TMA box per page: 4x the
  // boxes of a contiguous tile, and half the SMs issuing them).
  const bool cluster = tma && !p.cache.paged && cluster_merge_wanted(p, kMaxClusterSplits) &&
                       kMaxClusterSplits * p.batch * p.kv_heads >= 64 && gpu::tma::is_sm90(p.device.index);
  DecodePlan plan = one_launch_plan(p, options, kMKeys, kMmaSplits, [&] { return mma_dispatch(p, false); },
                                    cluster ? kMaxClusterSplits : 0);
  plan.mma_kernel = true;
  return plan;
}
#endif

}  // namespace

namespace {

// LLMK_DECODE_SPLITS=N (read at every call): the split count for calls that leave it to the plan
// (num_splits 0), e.g. a whole model's attention calls in an A/B run; 0 or unset: the plan's.
int64_t requested_splits() {
  const char* v = std::getenv("LLMK_DECODE_SPLITS");
  if (v == nullptr || *v == '\0') return 0;
  char* end = nullptr;
  const long n = std::strtol(v, &end, 10);
  if (*end != '\0' || n < 0 || n > kMaxSplits)
    fail(ErrorKind::value, "decode_attention",
         std::string("LLMK_DECODE_SPLITS: expected an integer in [0, ") + std::to_string(kMaxSplits) + "], got '" + v +
             "'");
  return n;
}

}  // namespace

DecodePlan decode_plan_gpu(const DecodeParams& p, const DecodeOptions& given) {
  DecodeOptions options = given;
  if (options.num_splits <= 0) options.num_splits = requested_splits();
  const DecodeKernel kernel = requested_kernel();
  // on by default since the H200 run of 2026-11-30 22:39 (bench-decode's 1B model-step rows: 12.3
  // vs 14.0 us with the per-lane mask loads, a 4096-slot cache 16.2 vs 20.6); "0" turns it off
  [[maybe_unused]] const bool mask_prefetch = gpu::env_flag("LLMK_DECODE_MASK_PREFETCH", true);
  // on by default since the H200 run of 2026-12-01 (see decode_mma_kernel); "0" turns it off
  [[maybe_unused]] const bool tma = gpu::env_flag("LLMK_DECODE_TMA", true);
  const bool one_launch_ok = p.cache.capacity < (int64_t{1} << 30) && p.kv_heads <= 65535 && p.batch <= 65535;
#if LLMK_MMA_SYNC_BUILD
  // tensor cores: up to 16 rows per KV head (one m16 tile), head dims 64 and 128 (256 would need
  // 128 accumulator registers per lane for O alone), compute capability 8.0+
  if (kernel == DecodeKernel::mma && one_launch_ok && p.q_heads / p.kv_heads * p.tokens <= kMRows &&
      (p.head_dim == 64 || p.head_dim == 128) && gpu::mma::available(p.device.index)) {
    DecodePlan plan = mma_plan(p, options, tma);
    plan.mask_prefetch = mask_prefetch;
    plan.tma = tma;
    return plan;
  }
#endif
  if (kernel != DecodeKernel::split && p.q_heads / p.kv_heads * p.tokens <= kWMaxRows && one_launch_ok)
    return warp_plan(p, options);
  DecodePlan plan;
  const int D = static_cast<int>(p.head_dim);
  const int n = tile_keys(D);
  const int64_t R = p.q_heads / p.kv_heads * p.tokens;
  const int64_t cap = max_rows(D);
  const int64_t row_groups = (R + cap - 1) / cap;
  plan.rows_per_block = static_cast<int>((R + row_groups - 1) / row_groups);
  if (p.kv_heads * row_groups > 65535 || p.batch > 65535)
    fail(ErrorKind::not_implemented, "decode_attention",
         "q: the GPU path supports at most 65535 sequences and 65535 KV heads x row groups");
  int64_t hint = p.cache.capacity;
  if (options.max_seq_len > 0 && options.max_seq_len < hint) hint = options.max_seq_len;
  const int64_t tiles = hint > 0 ? (hint + n - 1) / n : 1;
  int64_t splits = options.num_splits;
  if (splits <= 0) {
    // As many splits as keep every block resident at once (one full wave: a partial second wave
    // would double the time of a long sequence); none when the batch alone fills the GPU.
    gpu::DeviceGuard guard(p.device, "decode_attention");
    const std::size_t smem = smem_bytes(D, plan.rows_per_block);
    const int per_sm = p.dtype == DType::f16 ? prepare_dim<half>(D, p.cache.paged, smem)
                                             : prepare_dim<bfloat16>(D, p.cache.paged, smem);
    const int64_t slots = static_cast<int64_t>(per_sm) * gpu::multiprocessor_count(p.device.index);
    const int64_t blocks = p.batch * p.kv_heads * row_groups;
    splits = blocks >= slots ? 1 : slots / blocks;
  }
  if (splits > tiles) splits = tiles;
  if (splits > kMaxSplits) splits = kMaxSplits;
  if (splits < 1) splits = 1;
  const int64_t per = (tiles + splits - 1) / splits;
  plan.num_splits = static_cast<int>((tiles + per - 1) / per);
  plan.split_len = per * n;
  if (plan.num_splits > 1) {
    const std::size_t rows_total = static_cast<std::size_t>(p.batch * p.q_heads * p.tokens);
    plan.workspace_bytes = (rows_total * plan.num_splits * (D + 1) * 4 + 15) / 16 * 16;
  }
  return plan;
}

void decode_attention_gpu(const DecodeParams& p) {
  gpu::DeviceGuard guard(p.device, "decode_attention");
  switch (p.dtype) {
    case DType::f16: launch_dim<half>(p); break;
    case DType::bf16: launch_dim<bfloat16>(p); break;
    default: fail(ErrorKind::not_implemented, "decode_attention", "the GPU path supports float16 and bfloat16");
  }
}

// 16-byte pieces when the head dim, every pointer and every stride allow them, else elements.
template <typename T>
void launch_write_kv(const KvWriteParams& p, unsigned grid, bool pdl) {
  const KvCache& c = p.cache;
  const bool vec = gpu::vector_width<T>(p.head_dim, {p.k, p.v, p.k_cache, p.v_cache},
                                        {p.k_strides[0], p.k_strides[1], p.k_strides[2], p.v_strides[0],
                                         p.v_strides[1], p.v_strides[2], c.k_strides[0], c.k_strides[1],
                                         c.k_strides[2], c.v_strides[0], c.v_strides[1], c.v_strides[2]}) > 1;
  auto stream = gpu::as_stream(p.stream);
  if (p.cos != nullptr) {  // rope_write_kv_cache: 16-byte pieces also need half a head of them
    const bool rvec = vec && gpu::vector_width<T>(p.head_dim / 2, {p.q, p.q_out, p.k_out, p.cos, p.sin},
                                                  {p.q_strides[0], p.q_strides[1], p.q_strides[2],
                                                   p.q_out_strides[0], p.q_out_strides[1], p.q_out_strides[2],
                                                   p.k_out_strides[0], p.k_out_strides[1], p.k_out_strides[2],
                                                   p.cos_strides[0], p.cos_strides[1], p.sin_strides[0],
                                                   p.sin_strides[1]}) > 1;
    const int64_t pieces = ((p.q_heads + p.kv_heads) * (p.head_dim / 2) + p.kv_heads * p.head_dim) /
                           (rvec ? static_cast<int64_t>(16 / sizeof(T)) : 1);
    const int threads = static_cast<int>(std::min<int64_t>(kRopeKvThreads, std::max<int64_t>(32, (pieces + 31) / 32 * 32)));
    if (rvec) gpu::launch(rope_write_kv_kernel<T, 16 / sizeof(T)>, grid, threads, 0, stream, pdl, p);
    else gpu::launch(rope_write_kv_kernel<T, 1>, grid, threads, 0, stream, pdl, p);
    return;
  }
  if (vec) gpu::launch(write_kv_kernel<T, 16 / sizeof(T)>, grid, kThreads, 0, stream, pdl, p);
  else gpu::launch(write_kv_kernel<T, 1>, grid, kThreads, 0, stream, pdl, p);
}

// The length counter (KvWriteParams::advance) moves in the write's launch when that is one block
// (one sequence, one token: a batch-1 decode step), else in a second launch after it: with
// several blocks reading positions that may be views of the counter, none may move it.
void write_kv_cache_gpu(const KvWriteParams& p) {
  gpu::DeviceGuard guard(p.device, "write_kv_cache");
  const unsigned grid = static_cast<unsigned>(p.batch * p.tokens);
  const bool pdl = gpu::pdl_enabled(p.device.index);
  KvWriteParams w = p;
  const bool fused = grid == 1;
  if (!fused) w.advance = nullptr;
  if (grid > 0) {
    switch (p.dtype) {
      case DType::f32: launch_write_kv<float>(w, grid, pdl); break;
      case DType::f16: launch_write_kv<half>(w, grid, pdl); break;
      case DType::bf16: launch_write_kv<bfloat16>(w, grid, pdl); break;
      default: fail(ErrorKind::type, "write_kv_cache", "unsupported dtype");
    }
    gpu::check_launch("write_kv_cache");
  }
  if (p.advance != nullptr && !fused) {
    gpu::launch(advance_length_kernel, 1, 1, 0, gpu::as_stream(p.stream), pdl, p);
    gpu::check_launch("write_kv_cache");
  }
}

}  // namespace llmk::detail
