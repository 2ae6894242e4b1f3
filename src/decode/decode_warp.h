// decode_warp_kernel (what AMD runs; NVIDIA with LLMK_DECODE_KERNEL=warp or shapes the mma kernel
// does not take) and its launch, as templates over dtype; each decode_warp_<dtype>.cu instantiates
// one dtype (they compile in parallel), decode_gpu.cu plans and dispatches to them.
#pragma once

#include "decode/decode_gpu_common.h"

namespace llmk::detail {
namespace {

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
// (kWThreads, kWMaxRows, warp_unroll, warp_tile_keys: decode_gpu_common.h)

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

}  // namespace
}  // namespace llmk::detail
