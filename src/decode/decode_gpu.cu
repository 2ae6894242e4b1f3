// Decode attention and KV-cache writes on the GPU (one source for CUDA and HIP, through src/gpu/).
//
// decode_split_kernel: split-KV (flash-decoding). Grid (num_splits, kv_heads * row_groups, batch).
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
// write_kv_kernel: one block per (sequence, token), threads over heads x head dim.
#include <cstdint>
#include <string>

#include "core/check.h"
#include "decode/decode_internal.h"
#include "gpu/compat.h"
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

std::size_t smem_bytes(int head_dim, int rows) {
  const int n = tile_keys(head_dim);
  return static_cast<std::size_t>(n) * (head_dim + 8) * 2 + static_cast<std::size_t>(n) * head_dim * 2 +
         static_cast<std::size_t>(rows) * head_dim * 4 + static_cast<std::size_t>(rows) * n * 4 +
         3 * static_cast<std::size_t>(rows) * 4;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int m = LLMK_WARP_SIZE / 2; m > 0; m >>= 1) v = fmaxf(v, gpu::shfl_xor(v, m));
  return v;
}

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

  const int64_t len = p.seq_lens[b * p.seq_lens_stride];
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
  const int block_size = static_cast<int>(cache.block_size);
  V8 kr[LOADS], vr[LOADS];
  auto load_tile = [&](int64_t kb) {
#pragma unroll
    for (int i = 0; i < LOADS; ++i) {
      const int idx = tid + i * kThreads, key = idx / CH, c = idx % CH;
      const int64_t pos = kb + key;
      int64_t ko = -1, vo = -1;
      if (pos < end) {
        if (PAGED) {
          const int bi = static_cast<int>(pos) / block_size, off = static_cast<int>(pos) - bi * block_size;
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
        s = dot;
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

// Sets the kernel's shared memory size and returns how many of its blocks fit on one
// multiprocessor (at least 1).
template <typename T, int D, bool PAGED>
int prepare(std::size_t smem) {
  auto kernel = decode_split_kernel<T, D, PAGED>;
  gpu::check(gpuFuncSetAttribute(kernel, gpuFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)),
             "decode_attention", "setting the shared memory size");
  int blocks = 0;
  gpu::check(gpuOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, kThreads, smem), "decode_attention",
             "reading the occupancy");
  return blocks > 0 ? blocks : 1;
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

template <typename T, int D>
void launch_layout(const DecodeParams& p) {
  if (p.cache.paged) launch_typed<T, D, true>(p);
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

template <typename T>
__global__ void __launch_bounds__(kThreads) write_kv_kernel(KvWriteParams p) {
  const int64_t b = blockIdx.x / p.tokens, t = blockIdx.x % p.tokens;
  const char* praw = static_cast<const char*>(p.positions);
  const int64_t idx = b * p.pos_strides[0] + t * p.pos_strides[1];
  const int64_t pos = p.positions_int64 ? reinterpret_cast<const int64_t*>(praw)[idx]
                                        : reinterpret_cast<const int32_t*>(praw)[idx];
  const KvCache& c = p.cache;
  if (pos < 0 || pos >= c.capacity) return;  // padding, or out of range (skipped on the GPU)
  for (int64_t i = threadIdx.x; i < p.kv_heads * p.head_dim; i += blockDim.x) {
    const int64_t h = i / p.head_dim, d = i % p.head_dim;
    const int64_t ko = c.paged ? kv_offset<true>(c, c.k_strides, b, h, pos) : kv_offset<false>(c, c.k_strides, b, h, pos);
    const int64_t vo = c.paged ? kv_offset<true>(c, c.v_strides, b, h, pos) : kv_offset<false>(c, c.v_strides, b, h, pos);
    if (ko < 0 || vo < 0) return;
    static_cast<T*>(p.k_cache)[ko + d] = static_cast<const T*>(p.k)[b * p.k_strides[0] + t * p.k_strides[1] + h * p.k_strides[2] + d];
    static_cast<T*>(p.v_cache)[vo + d] = static_cast<const T*>(p.v)[b * p.v_strides[0] + t * p.v_strides[1] + h * p.v_strides[2] + d];
  }
}

}  // namespace

DecodePlan decode_plan_gpu(const DecodeParams& p, const DecodeOptions& options) {
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

void write_kv_cache_gpu(const KvWriteParams& p) {
  gpu::DeviceGuard guard(p.device, "write_kv_cache");
  const unsigned grid = static_cast<unsigned>(p.batch * p.tokens);
  switch (p.dtype) {
    case DType::f32: write_kv_kernel<float><<<grid, kThreads, 0, gpu::as_stream(p.stream)>>>(p); break;
    case DType::f16: write_kv_kernel<half><<<grid, kThreads, 0, gpu::as_stream(p.stream)>>>(p); break;
    case DType::bf16: write_kv_kernel<bfloat16><<<grid, kThreads, 0, gpu::as_stream(p.stream)>>>(p); break;
    default: fail(ErrorKind::type, "write_kv_cache", "unsupported dtype");
  }
  gpu::check_launch("write_kv_cache");
}

}  // namespace llmk::detail
