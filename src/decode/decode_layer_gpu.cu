// One decoder layer's batch-1 decode step in a single persistent kernel (decode_layer_step in
// include/llmk/decode_layer.h). The decode step of a small model is a chain of ten kernels per
// layer; most of them are latency-bound and leave HBM idle (docs/decode-step-kernel.md). Here they
// are phases of one kernel, separated by gpu::grid_barrier:
//   0  every block: h = RMSNorm(x) * norm1, kept in shared memory (x is a few KB, read from L2)
//   1  qkv = h Wqkv^T                                                    -> workspace (fp32)
//   -- barrier
//   2  attention: one work item per (KV head, key chunk); RoPE of q and the new k, the new k/v
//      written into the cache by the item holding position pos, partial (o, max, sum) per chunk
//   -- barrier
//   3  every block merges the chunks into a (shared memory); xm = x + a Wo^T -> workspace
//   -- barrier
//   4  every block: h = RMSNorm(xm) * norm2
//   5  u = silu(h Wg^T) * (h Wu^T)                                       -> workspace
//   -- barrier
//   6  out = xm + u Wd^T
// The GEMV phases split the product into units of R rows (R * NT = 2 weight rows, NT = 2 for the
// gate/up pair) by a segment of K, dealt round-robin to every warp of the grid; per trip of 2048
// (warp 32) of K each lane keeps 16 16-byte weight loads in flight. K is cut into segments only as
// far as it takes to give every warp a unit (k_split); then the segments' partial sums meet in
// fp32 atomics in the workspace and the last unit of a row group (a ticket counter) applies the
// epilogue and resets the sums and the ticket to zero for the next call. With
// LLMK_DECODE_LAYER_PREFETCH=1, before each barrier a warp asks L2 for the weights of its first
// unit of the next phase (weights do not depend on activations, so HBM would keep streaming
// through the barrier); measured slower on the H200 (the prefetches queue in front of the small
// phases' latency-bound loads), so off by default.
// Every intermediate is rounded to the activation dtype where the unfused chain of ops rounds it
// (qkv, rotated q/k, attention output, x + o, the SwiGLU output). Not bitwise: a different fp32
// summation order flips some of those roundings. Portable (no tensor cores, no TMA): the same code
// runs on AMD.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <map>
#include <mutex>

#include "core/check.h"
#include "decode/decode_internal.h"
#include "gpu/compat.h"
#include "gpu/runtime.h"

namespace llmk::detail {

using gpu::bfloat16;
using gpu::half;

namespace {

constexpr int kThreads = 512;
constexpr int kLoadsPerRow = 8;  // 16-byte weight loads per lane per weight row of a unit

// 8 consecutive weights as floats: one 16-byte evict-first load (VEC), or 8 scalar loads of which
// those at or past `left` elements are zero (rows of an odd K are not 16-byte aligned).
template <typename T, bool VEC>
struct WeightChunk {
  gpu::Vec<T, 8> v;
  __device__ __forceinline__ void load(const T* p, int left, uint64_t policy) {
    if constexpr (VEC) {
      v = gpu::load_once(reinterpret_cast<const gpu::Vec<T, 8>*>(p), policy);
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i) v.v[i] = i < left ? p[i] : gpu::from_float<T>(0.f);
    }
  }
  __device__ __forceinline__ void zero() {
#pragma unroll
    for (int i = 0; i < 8; ++i) v.v[i] = gpu::from_float<T>(0.f);
  }
};

template <typename T>
__device__ __forceinline__ float round_to(float v) {
  return gpu::to_float(gpu::from_float<T>(v));
}

// How a GEMV phase cuts K: a trip is kLoadsPerRow 16-byte loads per lane per weight row; K is cut
// into `segs` segments of whole trips only as far as needed to give every warp of the grid a unit
// (a split costs fp32 atomics and a ticket per unit; a unit of several trips costs nothing, as the
// grid as a whole keeps enough bytes in flight either way).
struct KSplit {
  int segs, seg_len;
};
template <int R>
__device__ __forceinline__ KSplit k_split(int64_t rows, int k) {
  constexpr int kTrip = LLMK_WARP_SIZE * 8 * kLoadsPerRow;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / LLMK_WARP_SIZE);
  const int64_t groups = (rows + R - 1) / R;
  const int trips = (k + kTrip - 1) / kTrip;
  const int64_t ratio = warps / groups;
  const int want = ratio < 1 ? 1 : ratio > trips ? trips : static_cast<int>(ratio);
  const int per = (trips + want - 1) / want;
  return {(trips + per - 1) / per, per * kTrip};
}

// Weight rows r (and rows + r for the gate/up pair, NT = 2) of `w` (rows x K, contiguous) times
// xs (K floats in shared memory). R rows per unit; epi(row, sum, up_sum) is called once per row
// by one lane with the complete sums.
template <typename T, int NT, bool VEC, typename Epi>
__device__ void gemv_phase(const T* w, int64_t rows, int k, const float* xs, float* sums, unsigned* tickets,
                           Epi epi) {
  constexpr int WS = LLMK_WARP_SIZE;
  constexpr int R = 2 / NT;
  const int lane = threadIdx.x % WS;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / WS);
  const int64_t warp = static_cast<int64_t>(blockIdx.x) * (blockDim.x / WS) + threadIdx.x / WS;
  const KSplit split = k_split<R>(rows, k);
  const int segs = split.segs;
  const int64_t groups = (rows + R - 1) / R;
  const uint64_t policy = gpu::l2_evict_first_policy();
  for (int64_t unit = warp; unit < groups * segs; unit += warps) {
    const int64_t group = unit / segs;
    const int k_begin = static_cast<int>(unit % segs) * split.seg_len;
    const int k_end = min(k, k_begin + split.seg_len);
    const T* src[R * NT];
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int t = 0; t < NT; ++t) {
        int64_t row = group * R + r;
        row = row < rows ? row : rows - 1;  // a past-the-end row reads a valid one; never stored
        src[r * NT + t] = w + (t * rows + row) * static_cast<int64_t>(k);
      }
    float acc[R * NT];
#pragma unroll
    for (int i = 0; i < R * NT; ++i) acc[i] = 0.f;
    for (int kb = k_begin; kb < k_end; kb += WS * 8 * kLoadsPerRow) {
      WeightChunk<T, VEC> wv[R * NT][kLoadsPerRow];
#pragma unroll
      for (int i = 0; i < R * NT; ++i)
#pragma unroll
        for (int j = 0; j < kLoadsPerRow; ++j) {
          const int kk = kb + j * WS * 8 + lane * 8;
          if (kk < k_end)
            wv[i][j].load(src[i] + kk, k - kk, policy);
          else
            wv[i][j].zero();
        }
#pragma unroll
      for (int j = 0; j < kLoadsPerRow; ++j) {
        const int kk = kb + j * WS * 8 + lane * 8;
        if (kk >= k_end) continue;  // xs past K is not defined (the weights there are zero)
        float xv[8];
        if (VEC || kk + 8 <= k) {  // two 16-byte shared loads (8 scalar ones conflict 8-way on the banks)
          const float4 lo = reinterpret_cast<const float4*>(xs + kk)[0], hi = reinterpret_cast<const float4*>(xs + kk)[1];
          xv[0] = lo.x, xv[1] = lo.y, xv[2] = lo.z, xv[3] = lo.w, xv[4] = hi.x, xv[5] = hi.y, xv[6] = hi.z, xv[7] = hi.w;
        } else {
#pragma unroll
          for (int i = 0; i < 8; ++i) xv[i] = kk + i < k ? xs[kk + i] : 0.f;
        }
#pragma unroll
        for (int i = 0; i < R * NT; ++i) {
          float wf[8];
          gpu::to_float(wv[i][j].v, wf);
#pragma unroll
          for (int e = 0; e < 8; ++e) acc[i] += wf[e] * xv[e];
        }
      }
    }
#pragma unroll
    for (int i = 0; i < R * NT; ++i) acc[i] = gpu::warp_reduce_sum(acc[i]);
    if (lane != 0) continue;
    if (segs == 1) {
#pragma unroll
      for (int r = 0; r < R; ++r)
        if (group * R + r < rows) epi(group * R + r, acc[r * NT], acc[r * NT + NT - 1]);
      continue;
    }
    // several K segments: fp32 atomics; the last segment of the group finishes the rows
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int t = 0; t < NT; ++t)
        if (group * R + r < rows) atomicAdd(sums + t * rows + group * R + r, acc[r * NT + t]);
    __threadfence();
    if (atomicAdd(tickets + group, 1u) != static_cast<unsigned>(segs - 1)) continue;
    __threadfence();
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const int64_t row = group * R + r;
      if (row >= rows) continue;
      float s[NT];
#pragma unroll
      for (int t = 0; t < NT; ++t) {
        s[t] = gpu::load_coherent(sums + t * rows + row);
        sums[t * rows + row] = 0.f;
      }
      epi(row, s[0], s[NT - 1]);
    }
    tickets[group] = 0u;
  }
}

// Asks L2 for the weights of this warp's first unit of a GEMV phase (one 128-byte line per lane
// per weight row): issued before a grid barrier, they stream in while the grid waits.
template <typename T, int NT>
__device__ void prefetch_first_unit(const T* w, int64_t rows, int k) {
  constexpr int WS = LLMK_WARP_SIZE;
  constexpr int R = 2 / NT;
  constexpr int kLineElems = 128 / sizeof(T);
  const int lane = threadIdx.x % WS;
  const int64_t warp = static_cast<int64_t>(blockIdx.x) * (blockDim.x / WS) + threadIdx.x / WS;
  const KSplit split = k_split<R>(rows, k);
  const int64_t group = warp / split.segs;
  const int kb = static_cast<int>(warp % split.segs) * split.seg_len;
  if (group * R >= rows) return;
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < NT; ++t) {
      const int64_t row = group * R + r < rows ? group * R + r : rows - 1;
      for (int e = kb + lane * kLineElems; e < kb + WS * 8 * kLoadsPerRow && e < k; e += WS * kLineElems)
        gpu::prefetch_l2(w + (t * rows + row) * static_cast<int64_t>(k) + e);
    }
}

// Every thread's loads of a pass are issued before the first is used: the small phases are
// chains of memory latencies, so a pass must cost one round trip, not one per loop trip.
constexpr int kStageVecs = 4;  // 16-byte loads per thread per pass

// dst[0, n) = src[0, n) for floats another block wrote in this kernel (read from L2). src, dst
// 16-byte aligned (workspace regions).
__device__ void stage_coherent(float* dst, const float* src, int n) {
  const int step = blockDim.x * kStageVecs * 4;
  for (int base = 0; base < n; base += step) {
    float4 v[kStageVecs];
#pragma unroll
    for (int u = 0; u < kStageVecs; ++u) {
      const int i = base + (u * blockDim.x + threadIdx.x) * 4;
      if (i + 4 <= n) v[u] = gpu::load_coherent(reinterpret_cast<const float4*>(src + i));
    }
#pragma unroll
    for (int u = 0; u < kStageVecs; ++u) {
      const int i = base + (u * blockDim.x + threadIdx.x) * 4;
      if (i + 4 <= n)
        reinterpret_cast<float4*>(dst + i)[0] = v[u];
      else
        for (int e = i; e < n; ++e) dst[e] = gpu::load_coherent(src + e);
    }
  }
}

// 8 elements of a T row at i as floats (a 16-byte load when `vec`), zeros past n.
template <typename T>
__device__ __forceinline__ void load8(const T* src, int i, int n, bool vec, float (&out)[8]) {
  if (vec && i + 8 <= n) {
    gpu::load_float<T, 8>(src + i, out);
  } else {
#pragma unroll
    for (int e = 0; e < 8; ++e) out[e] = i + e < n ? gpu::to_float(src[i + e]) : 0.f;
  }
}

__device__ __forceinline__ bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// f(i, v) for each 8-element piece [i, i + 8) of src[0, n), the pieces spread over the block's
// threads (v: the piece as floats, zeros past n).
template <typename T, typename F>
__device__ __forceinline__ void for_each_piece8(const T* src, int n, F f) {
  const bool vec = aligned16(src);
  for (int i = threadIdx.x * 8; i < n; i += blockDim.x * 8) {
    float v[8];
    load8(src, i, n, vec, v);
    f(i, v);
  }
}

// dst[0, n) = src[0, n) as floats (an input row, e.g. x).
template <typename T>
__device__ void stage_row(float* dst, const T* src, int n) {
  for_each_piece8(src, n, [&](int i, const float (&v)[8]) {
#pragma unroll
    for (int e = 0; e < 8; ++e)
      if (i + e < n) dst[i + e] = v[e];
  });
  __syncthreads();
}

// xs[i] = round(xs[i] * rsqrt(mean(xs^2) + eps) * norm[i]) for the n floats of xs (every thread of
// the block calls it; `red` holds one float per warp).
template <typename T>
__device__ void rms_norm_into(float* xs, int n, const T* norm, float eps, float* red) {
  float ss[1] = {0.f};
  for (int i = threadIdx.x; i < n; i += blockDim.x) ss[0] += xs[i] * xs[i];
  gpu::group_reduce_sum<1>(ss, red);
  const float inv = gpu::rsqrt(ss[0] / n + eps);
  for_each_piece8(norm, n, [&](int i, const float (&g)[8]) {
#pragma unroll
    for (int e = 0; e < 8; ++e)
      if (i + e < n) xs[i + e] = round_to<T>(xs[i + e] * inv * g[e]);
  });
  __syncthreads();
}

// Rotated (neox pairs i, i + D/2) and rounded element i of a head whose D values start at `v`.
template <typename T>
__device__ __forceinline__ float rope_at(const float* v, const float* cos_sin, int i, int d) {
  const int half_d = d / 2, j = i % half_d;
  const float c = cos_sin[j], s = cos_sin[half_d + j];
  const float r = i < half_d ? v[i] * c - v[i + half_d] * s : v[i] * c + v[i - half_d] * s;
  return round_to<T>(r);
}

// The number of key chunks for a cache of `len` positions (the same on every block).
__device__ __forceinline__ int key_chunks(const DecodeLayerParams& p, int len) {
  const int by_grid = max(1, static_cast<int>(gridDim.x) / static_cast<int>(p.kv_heads));
  const int by_len = (len + kLayerMinChunk - 1) / kLayerMinChunk;
  const int need = (len + kLayerMaxChunk - 1) / kLayerMaxChunk;
  return max(need, min(by_grid, by_len));
}

// Phase 2, one work item: KV head `kvh`, keys [t0, t1) of the len = pos + 1 cached positions.
// Writes the chunk's unnormalised output and its (max, sum) for each of the head's G query heads.
template <typename T>
__device__ void attention_chunk(const DecodeLayerParams& p, int kvh, int chunk, int t0, int t1, int pos,
                                float* smem) {
  constexpr int WS = LLMK_WARP_SIZE;
  const int d = static_cast<int>(p.head_dim), g_heads = static_cast<int>(p.q_heads / p.kv_heads);
  const int n = t1 - t0, dpl = d / WS, lane = threadIdx.x % WS, warp = threadIdx.x / WS;
  const int warps = blockDim.x / WS;
  float* qs = smem;                     // [G][D], rotated and rounded q
  float* kn = qs + g_heads * d;         // [D] the new token's rotated k
  float* vn = kn + d;                   // [D] its v
  float* sc = vn + d;                   // [G][kLayerMaxChunk] scores, then probabilities
  float* os = sc + g_heads * kLayerMaxChunk;  // [G][D] output sums ([G + 2][D] while staging qkv)
  const float* cos_sin = p.rope + static_cast<int64_t>(pos) * p.head_dim;
  const float* qkv = p.ws_qkv;
  const int64_t q0 = static_cast<int64_t>(kvh) * g_heads * d;
  const int64_t k0 = p.q_heads * p.head_dim + static_cast<int64_t>(kvh) * d;
  const int64_t v0 = (p.q_heads + p.kv_heads) * p.head_dim + static_cast<int64_t>(kvh) * d;
  T* kc = static_cast<T*>(p.k_cache) + kvh * p.k_strides[0];
  T* vc = static_cast<T*>(p.v_cache) + kvh * p.v_strides[0];
  // qkv was written by other blocks: stage it through shared memory with L2 (coherent) loads
  for (int i = threadIdx.x; i < (g_heads + 2) * d; i += blockDim.x) {
    const int64_t at = i < g_heads * d ? q0 + i : i < (g_heads + 1) * d ? k0 + i - g_heads * d : v0 + i - (g_heads + 1) * d;
    os[i] = gpu::load_coherent(qkv + at);
  }
  __syncthreads();
  for (int i = threadIdx.x; i < (g_heads + 2) * d; i += blockDim.x) {
    const int h = i / d, e = i % d;
    if (h <= g_heads)
      qs[i] = rope_at<T>(os + h * d, cos_sin, e, d);  // (h == g_heads: the new k, into kn)
    else
      vn[e] = os[i];
  }
  __syncthreads();
  if (pos >= t0 && pos < t1)  // this chunk holds the new token: it writes the cache
    for (int e = threadIdx.x; e < d; e += blockDim.x) {
      kc[pos * p.k_strides[1] + e] = gpu::from_float<T>(kn[e]);
      vc[pos * p.v_strides[1] + e] = gpu::from_float<T>(vn[e]);
    }
  for (int i = threadIdx.x; i < g_heads * d; i += blockDim.x) os[i] = 0.f;
  // scores: a warp per key, lanes over D
  for (int t = warp; t < n; t += warps) {
    const int key = t0 + t;
    float kv[8];
    for (int i = 0; i < dpl; ++i) {
      const int e = lane * dpl + i;
      kv[i] = key == pos ? kn[e] : gpu::to_float(kc[key * p.k_strides[1] + e]);
    }
    for (int g = 0; g < g_heads; ++g) {
      float s = 0.f;
      for (int i = 0; i < dpl; ++i) s += qs[g * d + lane * dpl + i] * kv[i];
      s = gpu::warp_reduce_sum(s);
      if (lane == 0) sc[g * kLayerMaxChunk + t] = s * p.scale;
    }
  }
  __syncthreads();
  // softmax statistics: a warp per query head
  for (int g = warp; g < g_heads; g += warps) {
    float m = -INFINITY;
    for (int t = lane; t < n; t += WS) m = fmaxf(m, sc[g * kLayerMaxChunk + t]);
    for (int o = WS / 2; o > 0; o >>= 1) m = fmaxf(m, gpu::shfl_xor(m, o));
    float l = 0.f;
    for (int t = lane; t < n; t += WS) {
      const float e = __expf(sc[g * kLayerMaxChunk + t] - m);
      sc[g * kLayerMaxChunk + t] = e;
      l += e;
    }
    l = gpu::warp_reduce_sum(l);
    if (lane == 0) {
      const int64_t at = (static_cast<int64_t>(kvh) * g_heads + g) * p.max_chunks + chunk;
      p.ws_part_ml[2 * at] = m;
      p.ws_part_ml[2 * at + 1] = l;
    }
  }
  __syncthreads();
  // P V: thread groups over (query head, dim), key subsets per group, shared-memory atomics
  const int outs = g_heads * d, key_groups = max(1, static_cast<int>(blockDim.x) / outs);
  for (int o = threadIdx.x; o < outs * key_groups; o += blockDim.x) {
    const int e = o % outs, kg = o / outs, g = e / d, i = e % d;
    float acc = 0.f;
#pragma unroll 8
    for (int t = kg; t < n; t += key_groups) {
      const int key = t0 + t;
      const float v = key == pos ? vn[i] : gpu::to_float(vc[key * p.v_strides[1] + i]);
      acc += sc[g * kLayerMaxChunk + t] * v;
    }
    atomicAdd(os + e, acc);
  }
  __syncthreads();
  for (int e = threadIdx.x; e < outs; e += blockDim.x) {
    const int g = e / d, i = e % d;
    const int64_t at = (static_cast<int64_t>(kvh) * g_heads + g) * p.max_chunks + chunk;
    p.ws_part_o[at * d + i] = os[e];
  }
  __syncthreads();  // shared memory is reused by the next item
}

// L2 prefetch of the K/V rows of this block's attention items (phase 2; `chunks` of `per` keys).
template <typename T>
__device__ void prefetch_kv_chunks(const DecodeLayerParams& p, int chunks, int per, int len) {
  constexpr int kLineElems = 128 / sizeof(T);
  const int lines = static_cast<int>(p.head_dim) / kLineElems;
  for (int item = blockIdx.x; item < p.kv_heads * chunks; item += gridDim.x) {
    const int kvh = item / chunks, t0 = item % chunks * per, t1 = min(len, t0 + per);
    const T* kc = static_cast<const T*>(p.k_cache) + kvh * p.k_strides[0];
    const T* vc = static_cast<const T*>(p.v_cache) + kvh * p.v_strides[0];
    for (int e = threadIdx.x; e < (t1 - t0) * lines; e += blockDim.x) {
      const int64_t key = t0 + e / lines, off = e % lines * kLineElems;
      gpu::prefetch_l2(kc + key * p.k_strides[1] + off);
      gpu::prefetch_l2(vc + key * p.v_strides[1] + off);
    }
  }
}

template <typename T, bool VEC>
__global__ void __launch_bounds__(kThreads) decode_layer_kernel(DecodeLayerParams p) {
  extern __shared__ float smem[];
  __shared__ float red[kThreads / 32];
  float* xs = smem;
  const int h = static_cast<int>(p.hidden), inter = static_cast<int>(p.inter);
  const int qd = static_cast<int>(p.q_heads * p.head_dim);
  const int64_t n_qkv = (p.q_heads + 2 * p.kv_heads) * p.head_dim;
  const unsigned blocks = gridDim.x;
  const T* x = static_cast<const T*>(p.x);
  T* out = static_cast<T*>(p.out);
  const T* w_qkv = static_cast<const T*>(p.w_qkv);
  const T* w_o = static_cast<const T*>(p.w_o);
  const T* w_gu = static_cast<const T*>(p.w_gate_up);
  const T* w_d = static_cast<const T*>(p.w_down);
  const int64_t pos64 = p.position_int64 ? *static_cast<const int64_t*>(p.position) : *static_cast<const int32_t*>(p.position);
  if (pos64 < 0 || pos64 >= p.cache_len || pos64 >= p.rope_rows) {
    // a position outside the cache or the rotary table: NaN outputs, nothing read or written
    for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < h; i += static_cast<int64_t>(blocks) * blockDim.x)
      out[i] = gpu::from_float<T>(NAN);
    return;  // every block takes this branch (same position): no barrier is left waiting
  }
  const int pos = static_cast<int>(pos64), len = pos + 1;
  // block 0's timeline (DecodeLayerParams::trace): phase ends and barrier exits, in ns
  int stamp = 0;
  const auto mark = [&] {
    if (blockIdx.x == 0 && threadIdx.x == 0) p.trace[stamp] = gpu::global_timer_ns();
    ++stamp;
  };
  // the end of a phase: a stamp, the (optional) L2 prefetch of what the next phase reads, the
  // barrier, a stamp
  const auto end_phase = [&](auto prefetch_next) {
    mark();
    if (p.prefetch) prefetch_next();
    gpu::grid_barrier(p.barrier, blocks);
    mark();
  };
  mark();
  if (p.prefetch) prefetch_first_unit<T, 1>(w_qkv, n_qkv, h);

  // 0-1: RMSNorm, qkv
  stage_row(xs, x, h);
  rms_norm_into<T>(xs, h, static_cast<const T*>(p.norm1), p.eps, red);
  mark();
  gemv_phase<T, 1, VEC>(w_qkv, n_qkv, h, xs, p.ws_sums, p.ws_tickets,
                        [&](int64_t row, float s, float) { p.ws_qkv[row] = round_to<T>(s); });
  const int chunks = key_chunks(p, len), per = (len + chunks - 1) / chunks;
  end_phase([&] {
    prefetch_kv_chunks<T>(p, chunks, per, len);
    prefetch_first_unit<T, 1>(w_o, h, qd);
  });

  // 2: attention over len keys
  for (int item = blockIdx.x; item < p.kv_heads * chunks; item += blocks) {
    const int kvh = item / chunks, c = item % chunks;
    const int t0 = c * per, t1 = min(len, t0 + per);
    attention_chunk<T>(p, kvh, c, t0, t1, pos, smem);
  }
  end_phase([] {});

  // 3: merge the chunks into a (weights exp(m_c - max) / sum per query head and chunk first, in
  // shared memory after xs; then every element's chunks in one pass), then xm = x + a Wo^T
  const int d = static_cast<int>(p.head_dim);
  float* chunk_w = smem + qd;                           // [Hq][chunks]
  float* chunk_ml = chunk_w + (p.q_heads * p.max_chunks + 3) / 4 * 4;  // [Hq][max_chunks][2], staged in one pass
  stage_coherent(chunk_ml, p.ws_part_ml, static_cast<int>(2 * p.q_heads * p.max_chunks));
  __syncthreads();
  for (int hq = threadIdx.x; hq < p.q_heads; hq += blockDim.x) {
    const float* ml = chunk_ml + 2 * hq * p.max_chunks;
    float m = -INFINITY, den = 0.f;
    for (int c = 0; c < chunks; ++c) m = fmaxf(m, ml[2 * c]);
    for (int c = 0; c < chunks; ++c) {
      const float mc = ml[2 * c];
      const float wc = mc == -INFINITY ? 0.f : __expf(mc - m);
      chunk_w[hq * chunks + c] = wc;
      den += wc * ml[2 * c + 1];
    }
    for (int c = 0; c < chunks; ++c) chunk_w[hq * chunks + c] = den > 0.f ? chunk_w[hq * chunks + c] / den : 0.f;
  }
  __syncthreads();
  for (int e = threadIdx.x * 4; e < qd; e += blockDim.x * 4) {  // D is a multiple of 4: a float4 stays in a head
    const int hq = e / d, i = e % d;
    const float* src = p.ws_part_o + static_cast<int64_t>(hq) * p.max_chunks * d + i;
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 8
    for (int c = 0; c < chunks; ++c) {
      const float4 o = gpu::load_coherent(reinterpret_cast<const float4*>(src + static_cast<int64_t>(c) * d));
      const float wc = chunk_w[hq * chunks + c];
      acc.x += wc * o.x, acc.y += wc * o.y, acc.z += wc * o.z, acc.w += wc * o.w;
    }
    xs[e] = round_to<T>(acc.x), xs[e + 1] = round_to<T>(acc.y), xs[e + 2] = round_to<T>(acc.z), xs[e + 3] = round_to<T>(acc.w);
  }
  __syncthreads();
  mark();
  gemv_phase<T, 1, VEC>(w_o, h, qd, xs, p.ws_sums, p.ws_tickets, [&](int64_t row, float s, float) {
    p.ws_xmid[row] = round_to<T>(round_to<T>(s) + gpu::to_float(x[row]));
  });
  end_phase([&] { prefetch_first_unit<T, 2>(w_gu, inter, h); });

  // 4-5: RMSNorm of xm, then u = silu(gate) * up
  stage_coherent(xs, p.ws_xmid, h);
  __syncthreads();
  rms_norm_into<T>(xs, h, static_cast<const T*>(p.norm2), p.eps, red);
  mark();
  gemv_phase<T, 2, VEC>(w_gu, inter, h, xs, p.ws_sums, p.ws_tickets, [&](int64_t row, float g, float u) {
    p.ws_u[row] = round_to<T>(g / (1.f + __expf(-g)) * u);
  });
  end_phase([&] { prefetch_first_unit<T, 1>(w_d, h, inter); });

  // 6: out = xm + u Wd^T
  stage_coherent(xs, p.ws_u, inter);
  __syncthreads();
  mark();
  gemv_phase<T, 1, VEC>(w_d, h, inter, xs, p.ws_sums, p.ws_tickets, [&](int64_t row, float s, float) {
    out[row] = gpu::from_float<T>(round_to<T>(s) + gpu::load_coherent(p.ws_xmid + row));
  });
  mark();
}

template <typename T, bool VEC>
void launch_layer(DecodeLayerParams p, const DecodeLayerPlan& plan) {
  p.prefetch = gpu::env_flag("LLMK_DECODE_LAYER_PREFETCH");  // off: measured slower with it (1208 vs 1132 us)
  auto kernel = decode_layer_kernel<T, VEC>;
  gpu::allow_dynamic_smem(kernel, plan.smem_bytes, "decode_layer_step");
  gpu::launch_cooperative(kernel, dim3(plan.blocks), dim3(kThreads), plan.smem_bytes,
                          static_cast<gpuStream_t>(p.stream), "decode_layer_step", p);
}

DecodeLayerPlan plan_uncached(const DecodeLayerParams& p) {
  const char* op = "decode_layer_step";
  DecodeLayerPlan plan;
  const int64_t kmax = std::max({p.hidden, p.inter, p.q_heads * p.head_dim});
  const int64_t g = p.q_heads / p.kv_heads;
  // attention: q (G x D), k and v of the new token (2 D), scores (G x kLayerMaxChunk), output
  // sums (G x D, (G + 2) x D while staging qkv)
  const int64_t attn = (g + 2) * p.head_dim + g * kLayerMaxChunk + (g + 2) * p.head_dim;
  plan.smem_bytes = static_cast<std::size_t>(std::max(kmax, attn)) * sizeof(float);
  gpu::DeviceGuard guard(p.device, op);
  const int sms = gpu::multiprocessor_count(p.device.index);
  // the grid: every block resident at once (the grid barrier needs it); occupancy of the widest
  // instantiation (they share the register and shared-memory footprint). The merge's chunk weights
  // (Hq x max_chunks floats after a) need max_chunks, which needs the grid: size them for the grid
  // without them (adding them can only shrink the grid, and with it the chunks).
  auto kernel = decode_layer_kernel<half, true>;
  gpu::allow_dynamic_smem(kernel, plan.smem_bytes, op);
  const int wide = gpu::resident_blocks(kernel, kThreads, plan.smem_bytes, op) * sms;
  plan.max_chunks = std::max<int64_t>(std::max<int64_t>(1, wide / p.kv_heads),
                                      (p.cache_len + kLayerMaxChunk - 1) / kLayerMaxChunk);
  const int64_t merge = p.q_heads * p.head_dim + 3 * p.q_heads * plan.max_chunks + 4;  // a, chunk weights, (max, sum)
  plan.smem_bytes = std::max(plan.smem_bytes, static_cast<std::size_t>(merge) * sizeof(float));
  gpu::allow_dynamic_smem(kernel, plan.smem_bytes, op);
  plan.blocks = gpu::resident_blocks(kernel, kThreads, plan.smem_bytes, op) * sms;
  return plan;
}

}  // namespace

// Cached per device and shapes: its occupancy queries and attribute calls would otherwise be host
// time on every eager call (both decode_layer_workspace_size and decode_layer_step ask for it).
DecodeLayerPlan decode_layer_plan_gpu(const DecodeLayerParams& p) {
  static std::mutex mutex;
  static std::map<std::array<int64_t, 7>, DecodeLayerPlan> plans;
  const std::array<int64_t, 7> key = {p.device.index, p.hidden,   p.inter,    p.q_heads,
                                      p.kv_heads,     p.head_dim, p.cache_len};
  std::lock_guard<std::mutex> lock(mutex);
  auto it = plans.find(key);
  if (it == plans.end()) it = plans.emplace(key, plan_uncached(p)).first;
  return it->second;
}

void decode_layer_step_gpu(const DecodeLayerParams& p, const DecodeLayerPlan& plan) {
  const bool vec = p.vector_loads;
  switch (p.dtype) {
    case DType::f16: vec ? launch_layer<half, true>(p, plan) : launch_layer<half, false>(p, plan); break;
    case DType::bf16: vec ? launch_layer<bfloat16, true>(p, plan) : launch_layer<bfloat16, false>(p, plan); break;
    default: fail(ErrorKind::type, "decode_layer_step", std::string("unsupported dtype ") + dtype_name(p.dtype));
  }
}

}  // namespace llmk::detail
