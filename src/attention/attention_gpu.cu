// Attention forward on the GPU (one source for CUDA and HIP, through src/gpu/ only): out =
// softmax(q k^T * scale + causal mask) v without forming the score matrix (FlashAttention-2).
//
// One block per tile of queries of one head (a grid (ceil(Sq / rows), Hq, B) for the portable
// kernel, a 1-D grid in sections of heads for the tensor-core ones: grid_block); it walks
// the key tiles that tile can see (all of them, or up to the causal diagonal), keeping a running
// row max m, running sum l and output accumulator o, rescaled whenever m grows. Causal grids run
// their longest (last) query tiles first. GQA: query head h reads KV head h / (Hq / Hkv) in place.
// A row that sees no key writes zeros and an lse of -inf (as PyTorch's SDPA and the CPU path).
//
// Three kernels:
//  * mma v2 (NVIDIA sm_80+, the default there; attention_mma2_kernel): FlashAttention-2's forward on
//    tensor cores (mma.sync m16n8k16, fp32 accumulators), one barrier per key tile, ex2.approx
//    softmax, rescaling skipped while the row maxima stand still, causal tiles skipped per warp, a
//    1-D grid in L2-sized sections of heads (grid_block; longest causal tiles first within a
//    section) and 64-row blocks for grids too small to fill the GPU. See its own comment.
//  * wgmma (Hopper sm_90a, D 64 and 128; the default there, LLMK_ATTENTION_HOPPER=0 turns it off):
//    attention_hopper.cu.
//  * portable (what AMD runs; any warp size >= 8): 16 query rows per block of 128 threads, 8
//    threads per row each owning D / 8 of the dims; K / V tiles of 32 keys in shared memory,
//    scores by FMA and an 8-lane shuffle reduction. Selected on NVIDIA by LLMK_ATTENTION_PORTABLE=1.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <type_traits>

#include "attention/attention_internal.h"
#include "core/check.h"
#include "core/text_parts.h"
#include "gpu/compat.h"
#include "gpu/mma.h"
#include "gpu/runtime.h"

namespace llmk::detail {

using gpu::bfloat16;
using gpu::half;

namespace {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// Keys of sequence `sp` visible to its queries [m0, m0 + rows): [0, end).
__device__ __forceinline__ int64_t keys_end(const AttentionParams& p, const SeqSpan& sp, int64_t m0, int64_t rows) {
  if (!p.causal) return sp.kv_len;
  const int64_t e = m0 + rows + sp.diagonal_offset;
  return e < 0 ? 0 : (e > sp.kv_len ? sp.kv_len : e);
}

// ------------------------------------------------------------------------------ portable kernel
constexpr int kPortThreads = 128, kPortGroup = 8, kPortRows = kPortThreads / kPortGroup, kPortKeys = 32;

template <typename T, int D>
__global__ void __launch_bounds__(kPortThreads) attention_portable_kernel(AttentionParams p) {
  constexpr int kPairs = D / (2 * kPortGroup);  // dim pairs per thread: pair i*8+t, i < kPairs
  __shared__ T sK[kPortKeys][D];
  __shared__ T sV[kPortKeys][D];
  const int tid = threadIdx.x, t = tid % kPortGroup;
  const int64_t m0 = (p.causal ? gridDim.x - 1 - blockIdx.x : blockIdx.x) * int64_t{kPortRows};
  const int64_t h = blockIdx.y, b = blockIdx.z, hk = h / (p.q_heads / p.kv_heads);
  const SeqSpan sp = seq_span(p, b);
  if (m0 >= sp.q_len) return;  // varlen: a shorter sequence (the whole block leaves)
  const int64_t row = m0 + tid / kPortGroup;
  const bool valid = row < sp.q_len;
  const float sl2 = p.scale * kLog2e;  // scores in log2 units: exp2 instead of exp
  float qv[2 * kPairs], acc[2 * kPairs];
  const T* q = static_cast<const T*>(p.q) + b * p.q_strides[0] + (sp.q_start + (valid ? row : 0)) * p.q_strides[1] +
               h * p.q_strides[2];
#pragma unroll
  for (int i = 0; i < kPairs; ++i) {
    const int d = 2 * (i * kPortGroup + t);
    qv[2 * i] = valid ? gpu::to_float(q[d]) * sl2 : 0.f;
    qv[2 * i + 1] = valid ? gpu::to_float(q[d + 1]) * sl2 : 0.f;
    acc[2 * i] = acc[2 * i + 1] = 0.f;
  }
  const T* kb = static_cast<const T*>(p.k) + b * p.k_strides[0] + sp.k_start * p.k_strides[1] + hk * p.k_strides[2];
  const T* vb = static_cast<const T*>(p.v) + b * p.v_strides[0] + sp.k_start * p.v_strides[1] + hk * p.v_strides[2];
  const int64_t n_end = keys_end(p, sp, m0, kPortRows);
  const int64_t row_end = p.causal ? row + sp.diagonal_offset + 1 : sp.kv_len;  // this row's keys: j < row_end
  float m = -INFINITY, l = 0.f;
  for (int64_t n0 = 0; n0 < n_end; n0 += kPortKeys) {
    __syncthreads();  // the previous tile is no longer read
    for (int idx = tid; idx < kPortKeys * D; idx += kPortThreads) {
      const int j = idx / D, d = idx % D;
      const bool in = n0 + j < sp.kv_len;
      sK[j][d] = in ? kb[(n0 + j) * p.k_strides[1] + d] : gpu::from_float<T>(0.f);
      sV[j][d] = in ? vb[(n0 + j) * p.v_strides[1] + d] : gpu::from_float<T>(0.f);
    }
    __syncthreads();
    float s[kPortKeys];
    float mx = m;
#pragma unroll
    for (int j = 0; j < kPortKeys; ++j) {
      float dot = 0.f;
#pragma unroll
      for (int i = 0; i < kPairs; ++i) {
        const int d = 2 * (i * kPortGroup + t);
        dot = fmaf(qv[2 * i], gpu::to_float(sK[j][d]), dot);
        dot = fmaf(qv[2 * i + 1], gpu::to_float(sK[j][d + 1]), dot);
      }
      dot += gpu::shfl_xor(dot, 1);
      dot += gpu::shfl_xor(dot, 2);
      dot += gpu::shfl_xor(dot, 4);
      const int64_t key = n0 + j;
      s[j] = key < sp.kv_len && key < row_end ? dot : -INFINITY;
      mx = fmaxf(mx, s[j]);
    }
    const float base = mx == -INFINITY ? 0.f : mx;
    const float alpha = exp2f(m - base);
    m = mx;
    l *= alpha;
#pragma unroll
    for (int i = 0; i < 2 * kPairs; ++i) acc[i] *= alpha;
#pragma unroll
    for (int j = 0; j < kPortKeys; ++j) {
      const float w = exp2f(s[j] - base);
      l += w;
#pragma unroll
      for (int i = 0; i < kPairs; ++i) {
        const int d = 2 * (i * kPortGroup + t);
        acc[2 * i] = fmaf(w, gpu::to_float(sV[j][d]), acc[2 * i]);
        acc[2 * i + 1] = fmaf(w, gpu::to_float(sV[j][d + 1]), acc[2 * i + 1]);
      }
    }
  }
  if (!valid) return;
  const float inv = l > 0.f ? 1.f / l : 0.f;
  T* o = static_cast<T*>(p.out) + b * p.out_strides[0] + (sp.q_start + row) * p.out_strides[1] + h * p.out_strides[2];
#pragma unroll
  for (int i = 0; i < kPairs; ++i) {
    const int d = 2 * (i * kPortGroup + t);
    gpu::from_float2<T>(acc[2 * i] * inv, acc[2 * i + 1] * inv, o[d], o[d + 1]);
  }
  if (p.lse && t == 0)
    p.lse[b * p.lse_strides[0] + h * p.lse_strides[1] + (sp.q_start + row) * p.lse_strides[2]] =
        l > 0.f ? (m + log2f(l)) * kLn2 : -INFINITY;
}

template <typename T, int D>
void launch_portable(const AttentionParams& p) {
  const dim3 grid(static_cast<unsigned>((p.q_len + kPortRows - 1) / kPortRows), static_cast<unsigned>(p.q_heads),
                  static_cast<unsigned>(p.batch));
  attention_portable_kernel<T, D><<<grid, kPortThreads, 0, gpu::as_stream(p.stream)>>>(p);
}

// ------------------------------------------------------------------------------ mma kernel (v2)
#if LLMK_MMA_SYNC_BUILD

// A tiling: head dim, warps, 16-row m-tiles per warp, keys per tile. Q's fragments stay in
// registers when they take at most 64 per thread, else they are re-read from shared memory per
// k-step.
template <int D_, int kWarps_, int kMT_, int kBN_>
struct MmaConfig {
  static constexpr int D = D_, kWarps = kWarps_, kMT = kMT_, kBN = kBN_;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kBM = kWarps * kMT * 16;  // query rows per block
  static constexpr int kStride = D + 8;           // shared row stride (elements): +16 bytes
  static constexpr bool kQInRegs = kMT * D <= 128;
  static constexpr int kSmemQ = kBM * kStride, kSmemKV = kBN * kStride;  // elements
  static constexpr int kSmemBytes = (kSmemQ + 4 * kSmemKV) * 2;
  static_assert(D % 16 == 0 && kBN % 16 == 0, "tile sizes");
};

// Copies rows [row0, row0 + R) (those below `len`; the rest become zeros) of a (len x D) matrix
// with row stride `stride` into shared memory, 16 bytes per cp.async.
template <typename C, int R, typename T>
__device__ __forceinline__ void load_tile(T* smem, const T* base, int64_t stride, int row0, int len) {
  constexpr int kChunks = C::D / 8;
#pragma unroll
  for (int idx = threadIdx.x; idx < R * kChunks; idx += C::kThreads) {
    const int r = idx / kChunks, c = idx % kChunks;
    const bool in = row0 + r < len;
    const T* src = base + (in ? static_cast<int64_t>(row0 + r) * stride : 0) + c * 8;
    gpu::mma::cp_async16(smem + r * C::kStride + c * 8, src, in ? 16 : 0);
  }
}

// The tensor-core kernel (FlashAttention-2's forward). A block owns kBM = 16 * kMT * kWarps query
// rows of one head, each warp 16 * kMT of them; per key tile of kBN keys a warp computes S = Q K^T
// and O += P V for its rows with mma.sync m16n8k16 (fp32 accumulators), keeping the row maxima and
// sums of the online softmax in registers. The Q tile is loaded once (its fragments kept in
// registers when they take at most 64 per thread, else re-read from shared memory by ldmatrix);
// K and V tiles are double-buffered in shared memory by cp.async, shared rows padded by 16 bytes
// so that ldmatrix is conflict-free. Needs 16-byte aligned rows (pointers and every stride a
// multiple of 8 elements). Beyond that textbook form (which it replaced on 2026-11-30; that kernel
// was removed on 2026-12-05):
//  * one barrier per key tile: wait for the tile, __syncthreads, then issue the next tile's copy
//    into the buffer every warp has just finished with (a whole tile of math hides it);
//  * cp.async addresses from one per-thread base pointer, and head / batch recomputed for the
//    epilogue, so fewer values stay live through the key loop (D = 128: 16 B spilled, was 168);
//  * exp2 by ex2.approx with the softmax scale folded into one FFMA per score;
//  * the output rescale (kDTiles * 2 FMULs per row pair) skipped by a warp vote when no row of the
//    warp raised its maximum (most tiles once the maxima settle);
//  * causal: a warp skips a key tile none of its rows can see (the diagonal tile's upper half),
//    and only tiles that cross the diagonal or the end of the keys are masked;
//  * P V per 16-key slice (each slice's scores packed to 16 bits just before its MMAs);
//  * a 1-D grid in sections of heads whose K / V fits in L2 (grid_block), each walked tile-major,
//    so that the longest (causal) query tiles of every head in a section start first;
//  * tilings: FlashAttention-2's for sm_80 / sm_90 (4 warps of 32 rows, 64-key tiles; 8 warps of
//    16 rows at D = 256, whose accumulators would not fit twice), and for short problems whose
//    128-row grid would not fill the GPU twice 64-row blocks of 4 warps x 16 rows (twice the
//    blocks). (128-key tiles at D = 64, FlashAttention-2's choice, spilled here with Q re-read from
//    shared memory.)
template <typename C, int R, typename T>
__device__ __forceinline__ void load_rows(T* smem, const T* base, int64_t stride, int row0, int len) {
  constexpr int kChunks = C::D / 8;
  if constexpr (C::kThreads % kChunks == 0 && R % (C::kThreads / kChunks) == 0) {
    constexpr int kStep = C::kThreads / kChunks;  // rows per pass
    const int r0 = threadIdx.x / kChunks, c = threadIdx.x % kChunks;
    const T* src = base + static_cast<int64_t>(row0 + r0) * stride + c * 8;
    const int64_t step = kStep * stride;
    T* dst = smem + r0 * C::kStride + c * 8;
#pragma unroll
    for (int i = 0; i < R / kStep; ++i) {
      const bool in = row0 + r0 + i * kStep < len;
      gpu::mma::cp_async16(dst + i * kStep * C::kStride, in ? src + i * step : base, in ? 16 : 0);
    }
  } else {
    load_tile<C, R>(smem, base, stride, row0, len);
  }
}

template <typename T, typename C, bool kVarlen>
__global__ void __launch_bounds__(C::kThreads) attention_mma2_kernel(AttentionParams p, int m_tiles) {
  using namespace gpu::mma;
  constexpr int D = C::D, kMT = C::kMT, kBN = C::kBN, kBM = C::kBM, kStride = C::kStride;
  constexpr int kDTiles = D / 8, kNTiles = kBN / 8;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);
  T* sKV = sQ + C::kSmemQ;  // K0, V0, K1, V1

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, tig = lane % 4;
  // Block i: its query tile rank and batch x head by grid_block (the last tiles first when causal).
  const int heads = static_cast<int>(p.q_heads);
  const int bh_count = heads * static_cast<int>(p.batch);
  const auto [tile_rank, bh] = grid_block(p, static_cast<int>(blockIdx.x), m_tiles, bh_count);
  const int m0 = (p.causal ? m_tiles - 1 - tile_rank : tile_rank) * kBM;
  const int64_t h = bh % heads, b = bh / heads, hk = h / (p.q_heads / p.kv_heads);
  const SeqSpan sp = kVarlen ? seq_span(p, b) : SeqSpan{0, p.q_len, 0, p.kv_len, p.diagonal_offset};
  if (kVarlen && m0 >= sp.q_len) return;  // a shorter sequence: the whole block leaves
  const int q_len = static_cast<int>(sp.q_len), kv_len = static_cast<int>(sp.kv_len);
  const int diagonal_offset = static_cast<int>(sp.diagonal_offset);
  const T* q = static_cast<const T*>(p.q) + b * p.q_strides[0] + sp.q_start * p.q_strides[1] + h * p.q_strides[2];
  const T* k = static_cast<const T*>(p.k) + b * p.k_strides[0] + sp.k_start * p.k_strides[1] + hk * p.k_strides[2];
  const T* v = static_cast<const T*>(p.v) + b * p.v_strides[0] + sp.k_start * p.v_strides[1] + hk * p.v_strides[2];
  const int n_end = static_cast<int>(keys_end(p, sp, m0, kBM));
  const int n_tiles = (n_end + kBN - 1) / kBN;
  const int warp_row0 = warp * kMT * 16;  // within the block
  const float sl2 = p.scale * kLog2e;

  load_rows<C, kBM>(sQ, q, p.q_strides[1], m0, q_len);
  if (n_tiles > 0) {
    load_rows<C, kBN>(sKV, k, p.k_strides[1], 0, kv_len);
    load_rows<C, kBN>(sKV + C::kSmemKV, v, p.v_strides[1], 0, kv_len);
  }
  cp_async_commit();

  float acc[kMT][kDTiles][4];
  float row_m[kMT][2], row_l[kMT][2];
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
    for (int j = 0; j < kDTiles; ++j) acc[mt][j][0] = acc[mt][j][1] = acc[mt][j][2] = acc[mt][j][3] = 0.f;
    row_m[mt][0] = row_m[mt][1] = -INFINITY;
    row_l[mt][0] = row_l[mt][1] = 0.f;
  }
  uint32_t qf[C::kQInRegs ? kMT : 1][C::kQInRegs ? D / 16 : 1][4];

#pragma unroll 1
  for (int tile = 0; tile < n_tiles; ++tile) {
    const int n0 = tile * kBN;
    cp_async_wait<0>();
    __syncthreads();  // this tile is in shared memory; every warp is done with the previous one
    const T* sK = sKV + (tile & 1) * 2 * C::kSmemKV;
    const T* sV = sK + C::kSmemKV;
    if (tile + 1 < n_tiles) {  // into the buffer the previous tile used
      T* nK = sKV + ((tile + 1) & 1) * 2 * C::kSmemKV;
      load_rows<C, kBN>(nK, k, p.k_strides[1], n0 + kBN, kv_len);
      load_rows<C, kBN>(nK + C::kSmemKV, v, p.v_strides[1], n0 + kBN, kv_len);
      cp_async_commit();
    }
    if constexpr (C::kQInRegs) {
      if (tile == 0) {
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
          for (int kk = 0; kk < D / 16; ++kk)
            ldmatrix_x4(qf[mt][kk], sQ + (warp_row0 + mt * 16 + lane % 16) * kStride + kk * 16 + (lane / 16) * 8);
      }
    }
    // Key n0 + c is visible to row m0 + warp_row0 + rr when c < kv_left and (not causal or
    // c <= diag0 + rr); a warp none of whose rows sees any key of the tile skips it.
    const int diag0 = m0 + warp_row0 + diagonal_offset - n0;  // |.| < 2^31: all terms below 2^30
    if (p.causal && diag0 + kMT * 16 - 1 < 0) continue;

    // S = Q K^T for this warp's rows and the tile's kBN keys
    float s[kMT][kNTiles][4];
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
      for (int j = 0; j < kNTiles; ++j) s[mt][j][0] = s[mt][j][1] = s[mt][j][2] = s[mt][j][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      uint32_t a[kMT][4];
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) {
        if constexpr (C::kQInRegs) {
#pragma unroll
          for (int r = 0; r < 4; ++r) a[mt][r] = qf[mt][kk][r];
        } else {
          ldmatrix_x4(a[mt], sQ + (warp_row0 + mt * 16 + lane % 16) * kStride + kk * 16 + (lane / 16) * 8);
        }
      }
#pragma unroll
      for (int nj = 0; nj < kBN / 16; ++nj) {
        uint32_t bk[4];  // keys nj*16 + [0, 8) and [8, 16), dims kk*16 + [0, 16)
        ldmatrix_x4(bk, sK + (nj * 16 + lane % 8 + (lane / 16) * 8) * kStride + kk * 16 + ((lane / 8) % 2) * 8);
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) {
          mma_16816<T>(s[mt][2 * nj], a[mt], bk[0], bk[1]);
          mma_16816<T>(s[mt][2 * nj + 1], a[mt], bk[2], bk[3]);
        }
      }
    }

    if (n0 + kBN > kv_len || (p.causal && diag0 < kBN - 1)) {
      const int kv_left = kv_len - n0 < kBN ? kv_len - n0 : kBN;
      const int diag = p.causal ? (diag0 < -kBM ? -kBM : (diag0 > kBN ? kBN : diag0)) : kBN;
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          // this row's visible columns, relative to this lane's first column
          const int lim_d = diag + mt * 16 + g + 8 * r + 1;
          const int lim = (lim_d < kv_left ? lim_d : kv_left) - tig * 2;
#pragma unroll
          for (int j = 0; j < kNTiles; ++j)
#pragma unroll
            for (int e = 0; e < 2; ++e)
              if (j * 8 + e >= lim) s[mt][j][2 * r + e] = -INFINITY;
        }
    }

    // Online softmax in log2 units: p = 2^(s * scale * log2e - m * scale * log2e), one FFMA and
    // one MUFU per score; a row is spread over the 4 lanes of a quad (two shuffles).
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        float mx = row_m[mt][r];
#pragma unroll
        for (int j = 0; j < kNTiles; ++j) mx = fmaxf(mx, fmaxf(s[mt][j][2 * r], s[mt][j][2 * r + 1]));
        mx = fmaxf(mx, gpu::shfl_xor(mx, 1));
        mx = fmaxf(mx, gpu::shfl_xor(mx, 2));
        const float base = mx == -INFINITY ? 0.f : mx * sl2;
        // exactly 1 when the maximum did not move (the FFMA would leave its rounding error)
        const float alpha = mx == row_m[mt][r] ? 1.f : ex2_approx(fmaf(row_m[mt][r], sl2, -base));
        row_m[mt][r] = mx;
        float sum = 0.f;
#pragma unroll
        for (int j = 0; j < kNTiles; ++j)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const float w = ex2_approx(fmaf(s[mt][j][2 * r + e], sl2, -base));
            s[mt][j][2 * r + e] = w;
            sum += w;
          }
        row_l[mt][r] = fmaf(row_l[mt][r], alpha, sum);
        if (__any_sync(0xffffffffu, alpha != 1.f)) {  // rarely, once the maxima have settled
#pragma unroll
          for (int j = 0; j < kDTiles; ++j) {
            acc[mt][j][2 * r] *= alpha;
            acc[mt][j][2 * r + 1] *= alpha;
          }
        }
      }

    // O += P V, 16 keys at a time: the score accumulators of n-tiles 2kk and 2kk+1 are the A
    // fragment of keys kk*16 + [0, 16).
#pragma unroll
    for (int kk = 0; kk < kBN / 16; ++kk) {
      uint32_t a[kMT][4];
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) {
        a[mt][0] = pack2<T>(s[mt][2 * kk][0], s[mt][2 * kk][1]);
        a[mt][1] = pack2<T>(s[mt][2 * kk][2], s[mt][2 * kk][3]);
        a[mt][2] = pack2<T>(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
        a[mt][3] = pack2<T>(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
      }
#pragma unroll
      for (int dj = 0; dj < D / 16; ++dj) {
        uint32_t bv[4];  // keys kk*16 + [0, 16), dims dj*16 + [0, 8) and [8, 16)
        ldmatrix_x4_trans(bv, sV + (kk * 16 + lane % 16) * kStride + dj * 16 + (lane / 16) * 8);
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) {
          mma_16816<T>(acc[mt][2 * dj], a[mt], bv[0], bv[1]);
          mma_16816<T>(acc[mt][2 * dj + 1], a[mt], bv[2], bv[3]);
        }
      }
    }
  }
  cp_async_wait<0>();

  // Epilogue: normalise and store (each quad writes 16 contiguous bytes of a row per d-tile).
  // Head and batch are recomputed from the block index: nothing of the prologue beyond m0 stays
  // live through the key loop (registers are at the limit there).
  const int bh_e =
      grid_block(p, static_cast<int>(blockIdx.x), m_tiles, static_cast<int>(p.q_heads) * static_cast<int>(p.batch)).bh;
  const int64_t h_e = bh_e % static_cast<int>(p.q_heads), b_e = bh_e / static_cast<int>(p.q_heads);
  const int64_t q_start = kVarlen ? p.cu_seqlens_q[b_e] : 0;
  T* o = static_cast<T*>(p.out) + b_e * p.out_strides[0] + q_start * p.out_strides[1] + h_e * p.out_strides[2];
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float l = row_l[mt][r];
      l += gpu::shfl_xor(l, 1);
      l += gpu::shfl_xor(l, 2);
      const int row = m0 + warp_row0 + mt * 16 + g + 8 * r;
      if (row >= q_len) continue;
      const float inv = l > 0.f ? 1.f / l : 0.f;
      T* orow = o + static_cast<int64_t>(row) * p.out_strides[1];
#pragma unroll
      for (int j = 0; j < kDTiles; ++j)
        *reinterpret_cast<uint32_t*>(orow + j * 8 + tig * 2) =
            pack2<T>(acc[mt][j][2 * r] * inv, acc[mt][j][2 * r + 1] * inv);
      if (p.lse && tig == 0)
        p.lse[b_e * p.lse_strides[0] + h_e * p.lse_strides[1] + (q_start + row) * p.lse_strides[2]] =
            l > 0.f ? row_m[mt][r] * p.scale + logf(l) : -INFINITY;
    }
}

// Tilings: MmaConfig<D, warps, 16-row m-tiles per warp, keys per tile>.
template <int D, bool kShort> struct Mma2ConfigFor { using type = void; };
template <> struct Mma2ConfigFor<64, false> { using type = MmaConfig<64, 4, 2, 64>; };
template <> struct Mma2ConfigFor<80, false> { using type = MmaConfig<80, 4, 2, 64>; };
template <> struct Mma2ConfigFor<96, false> { using type = MmaConfig<96, 4, 2, 64>; };
template <> struct Mma2ConfigFor<128, false> { using type = MmaConfig<128, 4, 2, 64>; };
template <> struct Mma2ConfigFor<256, false> { using type = MmaConfig<256, 8, 1, 64>; };
// short problems: 64 query rows per block (4 warps of 16), Q in registers
template <> struct Mma2ConfigFor<64, true> { using type = MmaConfig<64, 4, 1, 64>; };
template <> struct Mma2ConfigFor<80, true> { using type = MmaConfig<80, 4, 1, 64>; };
template <> struct Mma2ConfigFor<96, true> { using type = MmaConfig<96, 4, 1, 64>; };
template <> struct Mma2ConfigFor<128, true> { using type = MmaConfig<128, 4, 1, 64>; };

template <typename T, typename C>
bool launch_mma2_config(const AttentionParams& p) {
  if (C::kSmemBytes > gpu::mma::max_shared_memory(p.device.index)) return false;
  const int64_t m_tiles = (p.q_len + C::kBM - 1) / C::kBM;
  const int64_t blocks = m_tiles * p.q_heads * p.batch;
  if (blocks >= (int64_t{1} << 31)) return false;
  auto kernel = p.cu_seqlens_q != nullptr ? attention_mma2_kernel<T, C, true> : attention_mma2_kernel<T, C, false>;
  gpu::check(gpuFuncSetAttribute(kernel, gpuFuncAttributeMaxDynamicSharedMemorySize, C::kSmemBytes), "attention",
             "setting the shared memory size");
  kernel<<<static_cast<unsigned>(blocks), C::kThreads, C::kSmemBytes, gpu::as_stream(p.stream)>>>(
      p, static_cast<int>(m_tiles));
  return true;
}

// The short tiling when 128-row blocks would not give every SM two (the blocks that fit at once);
// `tiling` "long" or "short" forces one (tests, tuning).
template <typename T, int D>
bool launch_mma2(const AttentionParams& p, const std::string& tiling) {
  using Short = typename Mma2ConfigFor<D, true>::type;
  if constexpr (!std::is_void_v<Short>) {
    const int64_t blocks128 = (p.q_len + 127) / 128 * p.q_heads * p.batch;
    const bool short_grid = blocks128 < 2 * int64_t{gpu::multiprocessor_count(p.device.index)};
    if (tiling != "long" && (short_grid || tiling == "short") && launch_mma2_config<T, Short>(p)) return true;
  }
  return launch_mma2_config<T, typename Mma2ConfigFor<D, false>::type>(p);
}

#endif  // LLMK_MMA_SYNC_BUILD

// Environment switches (gpu::env_flag, read per call so tests can flip them).
[[maybe_unused]] bool portable_requested() { return gpu::env_flag("LLMK_ATTENTION_PORTABLE"); }

// The wgmma kernel (attention_hopper.cu) where it applies (sm_90a build, compute capability 9.0,
// D 64 or 128): the default since the H200 run of 2026-11-30 17:50 (bench/results/h200-attention.md:
// above PyTorch's flash backend at every benchmarked shape, causal and not, fp16 and bf16, but one
// within 1%); LLMK_ATTENTION_HOPPER=0 selects v2 instead.
[[maybe_unused]] bool hopper_requested() {
  const char* env = std::getenv("LLMK_ATTENTION_HOPPER");
  return env == nullptr || *env == '\0' || std::string(env) != "0";
}

// LLMK_ATTENTION_MMA_CONFIG: for the mma.sync kernel "long" (128-row blocks) or "short" (64-row
// blocks) instead of the choice by grid size.
[[maybe_unused]] std::string tiling_requested() {
  const char* env = std::getenv("LLMK_ATTENTION_MMA_CONFIG");
  return env != nullptr ? env : "";
}

// The grid's section width in batch x head indices (grid_block): as many heads as share the K / V
// of the KV heads that fit in kL2KvBytes, whole GQA groups. Against one tile-major section, the
// H200 sweep of 2026-12-02 10:32 UTC (scripts/attention_tiling_sweep.py --configs
// default,GRID=tile,GRID=head; bench/results/h200-attention-grid-order.md) gained 1.0-1.29x, most on
// large grids ((4, 32, 4096, 128) causal: 469 vs 363 TFLOP/s). One head per section ("head") was
// within a few percent either way, but lower on causal grids of few blocks (455 vs 511 at
// (1, 32, 4096, 128): the longest tiles first then holds per head only).
// LLMK_ATTENTION_GRID overrides it: "tile" (one section), "head" (one head each) or a width.
constexpr int64_t kL2KvBytes = int64_t{32} << 20;  // of the H200's 50 MiB L2
int grid_section(const AttentionParams& p) {
  const int64_t bh_count = p.q_heads * p.batch;
  if (const char* env = std::getenv("LLMK_ATTENTION_GRID"); env != nullptr && *env != '\0') {
    if (std::strcmp(env, "tile") == 0) return 0;
    if (std::strcmp(env, "head") == 0) return 1;
    const auto width = whole_integer(env);
    if (!width || *width <= 0)
      fail(ErrorKind::value, "attention",
           std::string("LLMK_ATTENTION_GRID: expected tile, head or a positive width, got ") + env);
    return static_cast<int>(std::min<int64_t>(*width, bh_count));
  }
  const int64_t kv_head_bytes = std::max<int64_t>(1, p.kv_len * p.head_dim * 2 * 2);  // K and V, 2-byte elements
  const int64_t kv_heads = std::max<int64_t>(1, kL2KvBytes / kv_head_bytes);
  return static_cast<int>(std::min(bh_count, kv_heads * (p.q_heads / p.kv_heads)));
}

// The choice below (tensor cores, else the portable kernel) is mirrored in Python by
// flash._runs_portable_kernel, which hands the portable cases of lk.sdpa to PyTorch: keep both alike.
template <typename T, int D>
void launch(const AttentionParams& p) {
#if LLMK_MMA_SYNC_BUILD
  const bool aligned =
      gpu::vector_width<T>(D, {p.q, p.k, p.v, p.out},
                           {p.q_strides[0], p.q_strides[1], p.q_strides[2], p.k_strides[0], p.k_strides[1],
                            p.k_strides[2], p.v_strides[0], p.v_strides[1], p.v_strides[2], p.out_strides[0],
                            p.out_strides[1], p.out_strides[2]}) == 8;
  if (aligned && !portable_requested() && gpu::mma::available(p.device.index)) {
    if constexpr (D == 64 || D == 128) {
      if (hopper_requested() && attention_hopper(p)) return;
    }
    if (launch_mma2<T, D>(p, tiling_requested())) return;
  }
#endif
  launch_portable<T, D>(p);
}

template <typename T>
void by_head_dim(const AttentionParams& p) {
  switch (p.head_dim) {
    case 64: launch<T, 64>(p); break;
    case 80: launch<T, 80>(p); break;
    case 96: launch<T, 96>(p); break;
    case 128: launch<T, 128>(p); break;
    case 256: launch<T, 256>(p); break;
    default:
      fail(ErrorKind::not_implemented, "attention",
           "q: head dim " + std::to_string(p.head_dim) + " is not supported on the GPU");
  }
}

}  // namespace

void attention_gpu(const AttentionParams& params) {
  gpu::DeviceGuard guard(params.device, "attention");
  AttentionParams p = params;
  p.grid_section = grid_section(p);
  switch (p.dtype) {
    case DType::f16: by_head_dim<half>(p); break;
    case DType::bf16: by_head_dim<bfloat16>(p); break;
    default: fail(ErrorKind::type, "attention", "q: expected dtype float16 or bfloat16 on the GPU");
  }
  gpu::check_launch("attention");
}

}  // namespace llmk::detail
