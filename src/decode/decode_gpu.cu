// Decode attention and KV-cache writes on the GPU (one source for CUDA and HIP, through src/gpu/).
//
// This file: the plans, the dispatch, the split kernel and the KV-cache writes. The other kernels
// live in headers instantiated by files of their own, which compile in parallel:
// decode_mma_kernel (default on NVIDIA sm_80+, up to 16 query rows per KV head, D 64 / 128;
// decode_mma.h, decode_mma_<dtype>_d<D>.cu): tensor cores over a ring of K/V tiles, one launch
// with the merge. decode_warp_kernel (AMD, and NVIDIA with LLMK_DECODE_KERNEL=warp or shapes the
// mma kernel does not take; up to 8 rows; decode_warp.h, decode_warp_<dtype>.cu): warps stream
// their own K/V rows with 16-byte register loads. What they share: decode_gpu_common.h.
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
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>

#include "core/check.h"
#include "core/text_parts.h"
#include "decode/decode_gpu_common.h"
#include "decode/decode_internal.h"
#include "gpu/compat.h"
#include "gpu/mma.h"
#include "gpu/runtime.h"
#include "gpu/tensor_map.h"  // gpu::tma::is_sm90
#include "rope/rope_math.h"  // rotate_pair

namespace llmk::detail {

namespace {

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

// Occupancy (p == nullptr) or launch of decode_warp_kernel (decode_warp.h), compiled in two files
// by dtype (decode_warp_<dtype>.cu).
int warp_dispatch(DType dtype, int head_dim, bool paged, int rows, const DecodeParams* p) {
  return dtype == DType::f16 ? decode_warp_f16(head_dim, paged, rows, p) : decode_warp_bf16(head_dim, paged, rows, p);
}

// Occupancy (launch == false) or launch of the tensor-core kernel (decode_mma.h), compiled in four
// files by dtype and head dim (decode_mma_<dtype>_d<D>.cu).
int mma_dispatch(const DecodeParams& p, bool launch) {
#if LLMK_MMA_SYNC_BUILD
  if (p.dtype == DType::f16) return p.head_dim == 64 ? decode_mma_f16_d64(p, launch) : decode_mma_f16_d128(p, launch);
  return p.head_dim == 64 ? decode_mma_bf16_d64(p, launch) : decode_mma_bf16_d128(p, launch);
#else
  (void)p;
  (void)launch;
  fail(ErrorKind::not_implemented, "decode_attention", "the tensor-core kernel needs a CUDA build");
  return 0;
#endif
}

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
      for (int e = 0; e < VEC; ++e) rotate_pair(x1[e], x2[e], cf[e], sf[e], y1[e], y2[e]);
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
  const auto n = whole_integer(v);
  if (!n || *n < 0 || *n > kMaxSplits)
    fail(ErrorKind::value, "decode_attention",
         std::string("LLMK_DECODE_SPLITS: expected an integer in [0, ") + std::to_string(kMaxSplits) + "], got '" + v +
             "'");
  return *n;
}

}  // namespace

DecodePlan decode_plan_gpu(const DecodeParams& p, const DecodeOptions& given) {
  DecodeOptions options = given;
  if (options.num_splits <= 0) options.num_splits = requested_splits();
  const DecodeKernel kernel = requested_kernel();
  // on by default since the H200 run of 2026-11-30 22:39 (bench-decode's 1B model-step rows: 12.3
  // vs 14.0 us with the per-lane mask loads, a 4096-slot cache 16.2 vs 20.6); "0" turns it off
  [[maybe_unused]] const bool mask_prefetch = gpu::env_flag("LLMK_DECODE_MASK_PREFETCH", true);
  // on by default since the H100 run of 2026-12-06 (the 1B e2e with its step masks: 952-953 vs
  // 933-934 tok/s after 128 tokens, 919 vs 892 after 1000; decode_mma_body); "0" turns it off
  [[maybe_unused]] const bool mask_skip = gpu::env_flag("LLMK_DECODE_MASK_SKIP", true);
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
    plan.mask_skip = mask_skip;
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

unsigned decode_mma_flags_gpu() {
#if LLMK_MMA_SYNC_BUILD
  // every file's flags read (and cleared)
  return decode_mma_f16_d64_flags() | decode_mma_f16_d128_flags() | decode_mma_bf16_d64_flags() |
         decode_mma_bf16_d128_flags();
#else
  return 0;
#endif
}

}  // namespace llmk::detail
