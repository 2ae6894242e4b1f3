// Attention forward on the GPU (one source for CUDA and HIP, through src/gpu/ only): out =
// softmax(q k^T * scale + causal mask) v without forming the score matrix (FlashAttention-2).
//
// Grid (ceil(Sq / BLOCK_M), Hq, B): one block per tile of BLOCK_M queries of one head; it walks
// the key tiles that tile can see (all of them, or up to the causal diagonal), keeping a running
// row max m, running sum l and output accumulator o, rescaled whenever m grows. Causal grids run
// their longest (last) query tiles first. GQA: query head h reads KV head h / (Hq / Hkv) in place.
// A row that sees no key writes zeros and an lse of -inf (as PyTorch's SDPA and the CPU path).
//
// Two kernels:
//  * mma (NVIDIA sm_80+, LLMK_MMA_SYNC_BUILD): warps of 16 * MT query rows each; S = Q K^T and
//    O += P V on tensor cores (mma.sync m16n8k16, fp32 accumulators). The Q tile is loaded once
//    (kept in registers when small enough, else re-read from shared memory by ldmatrix); K and V
//    tiles are double-buffered in shared memory with cp.async, the next tile's copy overlapping
//    the current tile's math. Shared rows are padded by 16 bytes, so ldmatrix is conflict-free.
//    Needs 16-byte aligned rows (pointers and every stride a multiple of 8 elements).
//  * portable (what AMD runs; any warp size >= 8): 16 query rows per block of 128 threads, 8
//    threads per row each owning D / 8 of the dims; K / V tiles of 32 keys in shared memory,
//    scores by FMA and an 8-lane shuffle reduction. Selected on NVIDIA by LLMK_ATTENTION_PORTABLE=1.
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <type_traits>

#include "attention/attention_internal.h"
#include "core/check.h"
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

// ------------------------------------------------------------------------------ mma kernel
#if LLMK_MMA_SYNC_BUILD

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

// Per head dim: FlashAttention-2's tilings for sm_80/sm_90 (4 warps of 32 rows; 8 warps of 16
// rows at D = 256, whose accumulators would not fit twice). For tuning runs,
// LLMK_ATTENTION_MMA_CONFIG picks a variant: "alt" = 8 warps of 16 rows with Q in registers
// (D = 64 and 128), "bn32" = 32-key tiles (D = 128: no register spills).
enum class Variant { standard, alt, bn32 };
template <int D, Variant V> struct MmaConfigFor { using type = void; };
template <> struct MmaConfigFor<64, Variant::standard> { using type = MmaConfig<64, 4, 2, 64>; };
template <> struct MmaConfigFor<80, Variant::standard> { using type = MmaConfig<80, 4, 2, 64>; };
template <> struct MmaConfigFor<96, Variant::standard> { using type = MmaConfig<96, 4, 2, 64>; };
template <> struct MmaConfigFor<128, Variant::standard> { using type = MmaConfig<128, 4, 2, 64>; };
template <> struct MmaConfigFor<256, Variant::standard> { using type = MmaConfig<256, 8, 1, 64>; };
template <> struct MmaConfigFor<64, Variant::alt> { using type = MmaConfig<64, 8, 1, 64>; };
template <> struct MmaConfigFor<128, Variant::alt> { using type = MmaConfig<128, 8, 1, 64>; };
template <> struct MmaConfigFor<128, Variant::bn32> { using type = MmaConfig<128, 4, 2, 32>; };

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

// kVarlen: sequence offsets from cu_seqlens (a separate instantiation, so that the padded form
// keeps its lengths in the parameter space instead of registers).
template <typename T, typename C, bool kVarlen>
__global__ void __launch_bounds__(C::kThreads) attention_mma_kernel(AttentionParams p) {
  using namespace gpu::mma;
  constexpr int D = C::D, kMT = C::kMT, kBN = C::kBN, kBM = C::kBM, kStride = C::kStride;
  constexpr int kDTiles = D / 8, kNTiles = kBN / 8;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);
  T* sKV = sQ + C::kSmemQ;  // K0, V0, K1, V1

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, tig = lane % 4;
  // Lengths and offsets below 2^30 (checked on the host): 32-bit math except for addresses.
  const int m0 = (p.causal ? gridDim.x - 1 - blockIdx.x : blockIdx.x) * kBM;
  const int64_t h = blockIdx.y, b = blockIdx.z, hk = h / (p.q_heads / p.kv_heads);
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

  load_tile<C, kBM>(sQ, q, p.q_strides[1], m0, q_len);
  cp_async_commit();
  if (n_tiles > 0) {
    load_tile<C, kBN>(sKV, k, p.k_strides[1], 0, kv_len);
    load_tile<C, kBN>(sKV + C::kSmemKV, v, p.v_strides[1], 0, kv_len);
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

  for (int tile = 0; tile < n_tiles; ++tile) {
    const int n0 = tile * kBN;
    const T* sK = sKV + (tile & 1) * 2 * C::kSmemKV;
    const T* sV = sK + C::kSmemKV;
    if (tile + 1 < n_tiles) {
      T* nK = sKV + ((tile + 1) & 1) * 2 * C::kSmemKV;
      load_tile<C, kBN>(nK, k, p.k_strides[1], n0 + kBN, kv_len);
      load_tile<C, kBN>(nK + C::kSmemKV, v, p.v_strides[1], n0 + kBN, kv_len);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    if constexpr (C::kQInRegs) {
      if (tile == 0) {
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
          for (int kk = 0; kk < D / 16; ++kk)
            ldmatrix_x4(qf[mt][kk], sQ + (warp_row0 + mt * 16 + lane % 16) * kStride + kk * 16 + (lane / 16) * 8);
      }
    }

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

    // Mask keys past the end and, causal, past each row's diagonal (only tiles that need it), in
    // 32-bit tile-relative coordinates: key n0 + c is visible to row m0 + warp_row0 + rr when
    // c < kv_left and (not causal or c <= diag + rr).
    const int diag0 = m0 + warp_row0 + diagonal_offset - n0;  // |.| < 2^31: all terms below 2^30
    const bool need_mask = n0 + kBN > kv_len || (p.causal && diag0 < kBN - 1);
    if (need_mask) {
      const int kv_left = kv_len - n0 < kBN ? kv_len - n0 : kBN;
      const int diag = p.causal ? (diag0 < -kBM ? -kBM : (diag0 > kBN ? kBN : diag0)) : kBN;
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
        for (int j = 0; j < kNTiles; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int rr = mt * 16 + g + (e >= 2 ? 8 : 0);
            const int c = j * 8 + tig * 2 + (e & 1);
            if (c >= kv_left || c > diag + rr) s[mt][j][e] = -INFINITY;
          }
    }

    // Online softmax: rows g and g + 8 of each m-tile; a row is spread over the 4 lanes of a quad.
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
        const float alpha = exp2f(row_m[mt][r] * sl2 - base);
        row_m[mt][r] = mx;
        float sum = 0.f;
#pragma unroll
        for (int j = 0; j < kNTiles; ++j)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const float w = exp2f(fmaf(s[mt][j][2 * r + e], sl2, -base));
            s[mt][j][2 * r + e] = w;
            sum += w;
          }
        row_l[mt][r] = row_l[mt][r] * alpha + sum;
#pragma unroll
        for (int j = 0; j < kDTiles; ++j) {
          acc[mt][j][2 * r] *= alpha;
          acc[mt][j][2 * r + 1] *= alpha;
        }
      }

    // O += P V: the score accumulators are already in A-fragment order (two n-tiles per k-step);
    // packing them all first frees the fp32 scores before the V loop.
    uint32_t pf[kBN / 16][kMT][4];
#pragma unroll
    for (int kk = 0; kk < kBN / 16; ++kk)
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) {
        pf[kk][mt][0] = pack2<T>(s[mt][2 * kk][0], s[mt][2 * kk][1]);
        pf[kk][mt][1] = pack2<T>(s[mt][2 * kk][2], s[mt][2 * kk][3]);
        pf[kk][mt][2] = pack2<T>(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
        pf[kk][mt][3] = pack2<T>(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
      }
#pragma unroll
    for (int kk = 0; kk < kBN / 16; ++kk) {
      const auto& a = pf[kk];
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
    __syncthreads();  // the next iteration's copy overwrites this tile's buffer
  }
  cp_async_wait<0>();

  // Epilogue: normalise and store (each quad writes 16 contiguous bytes of a row per d-tile).
  T* o = static_cast<T*>(p.out) + b * p.out_strides[0] + sp.q_start * p.out_strides[1] + h * p.out_strides[2];
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
        p.lse[b * p.lse_strides[0] + h * p.lse_strides[1] + (sp.q_start + row) * p.lse_strides[2]] =
            l > 0.f ? row_m[mt][r] * p.scale + logf(l) : -INFINITY;
    }
}

// Launches the variant's kernel; false (nothing launched) when the device lacks its shared memory.
template <typename T, int D, Variant V>
bool launch_mma(const AttentionParams& p) {
  using C = typename MmaConfigFor<D, V>::type;
  if (C::kSmemBytes > gpu::mma::max_shared_memory(p.device.index)) return false;
  auto kernel = p.cu_seqlens_q != nullptr ? attention_mma_kernel<T, C, true> : attention_mma_kernel<T, C, false>;
  gpu::check(gpuFuncSetAttribute(kernel, gpuFuncAttributeMaxDynamicSharedMemorySize, C::kSmemBytes), "attention",
             "setting the shared memory size");
  const dim3 grid(static_cast<unsigned>((p.q_len + C::kBM - 1) / C::kBM), static_cast<unsigned>(p.q_heads),
                  static_cast<unsigned>(p.batch));
  kernel<<<grid, C::kThreads, C::kSmemBytes, gpu::as_stream(p.stream)>>>(p);
  return true;
}

#endif  // LLMK_MMA_SYNC_BUILD

// Environment switches, read per call (a getenv is nothing beside a launch) so tests can flip them.
[[maybe_unused]] bool portable_requested() {
  const char* env = std::getenv("LLMK_ATTENTION_PORTABLE");
  return env != nullptr && env[0] != '\0' && env[0] != '0';
}

[[maybe_unused]] std::string variant_requested() {
  const char* env = std::getenv("LLMK_ATTENTION_MMA_CONFIG");
  return env != nullptr ? env : "";
}

template <typename T, int D>
void launch(const AttentionParams& p) {
#if LLMK_MMA_SYNC_BUILD
  const bool aligned =
      gpu::vector_width<T>(D, {p.q, p.k, p.v, p.out},
                           {p.q_strides[0], p.q_strides[1], p.q_strides[2], p.k_strides[0], p.k_strides[1],
                            p.k_strides[2], p.v_strides[0], p.v_strides[1], p.v_strides[2], p.out_strides[0],
                            p.out_strides[1], p.out_strides[2]}) == 8;
  if (aligned && !portable_requested() && gpu::mma::available(p.device.index)) {
    const std::string variant = variant_requested();
    if constexpr (!std::is_void_v<typename MmaConfigFor<D, Variant::alt>::type>) {
      if (variant == "alt" && launch_mma<T, D, Variant::alt>(p)) return;
    }
    if constexpr (!std::is_void_v<typename MmaConfigFor<D, Variant::bn32>::type>) {
      if (variant == "bn32" && launch_mma<T, D, Variant::bn32>(p)) return;
    }
    if (launch_mma<T, D, Variant::standard>(p)) return;
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

void attention_gpu(const AttentionParams& p) {
  gpu::DeviceGuard guard(p.device, "attention");
  switch (p.dtype) {
    case DType::f16: by_head_dim<half>(p); break;
    case DType::bf16: by_head_dim<bfloat16>(p); break;
    default: fail(ErrorKind::type, "attention", "q: expected dtype float16 or bfloat16 on the GPU");
  }
  gpu::check_launch("attention");
}

}  // namespace llmk::detail
