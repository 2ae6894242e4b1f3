// Attention forward for Hopper (sm_90a) on warpgroup MMA (wgmma), FlashAttention-3 style: out =
// softmax(q k^T * scale + causal mask) v, the same contract as attention_mma2_kernel (v2) in
// attention_gpu.cu (strides, GQA in place, causal diagonal offsets, varlen SeqSpans, lse, rows
// that see no key -> zeros and lse -inf). The default on sm_90a devices with an sm_90a build;
// LLMK_ATTENTION_HOPPER=0 selects v2.
//
// Grid: a 1-D grid like v2's (grid_block: sections of heads, tile-major within each, the last
// tiles first when causal). Block: kWarpgroups = 2 warpgroups of 128 threads, 64 query rows
// each (128 rows per block); key tiles of kBN = 128.
//  * Loads: every thread issues cp.async (16 bytes, zero fill past the end) into 128-byte-swizzled
//    shared tiles (layout in gpu/wgmma.h): Q once, K and V double-buffered (the next tile's copy
//    overlaps this tile's math), one __syncthreads per key tile, after fence.proxy.async so that
//    wgmma (the async proxy) sees the data.
//  * S = Q K^T: per warpgroup D / 16 wgmma m64n128k16, A = Q and B = K from shared memory (both
//    K-major descriptors), fp32 accumulators (64 per thread).
//  * Mask (only tiles crossing the causal diagonal or the end of the keys) and online softmax in
//    the log2 domain with ex2.approx; a row lives in the 4 lanes of a quad (2 shuffles).
//  * O += P V: P converted in registers to 16-bit A fragments (the accumulator layout of two
//    adjacent 8-column chunks is the register-A layout), B = V from shared memory through an
//    MN-major descriptor (transpose bit): kBN / 16 wgmma m64n{D}k16.
//  * A warpgroup none of whose rows sees any key of a tile skips its math (causal).
// Needs 16-byte aligned rows (as v2; the caller checks) and D = 64 or 128.
//
// Tilings (LLMK_ATTENTION_HOPPER_CONFIG forces one; the default rule is at launch_hopper_typed):
// "plain" = the above; "pipe" = the same with FlashAttention-3's intra-warpgroup overlap (S_t =
// Q K_t^T and O += P_{t-1} V_{t-1} issued together, the softmax of S_t running while P V is on
// the tensor cores; V lags K by one tile in the ring); "wg1" = 1 warpgroup (64 rows) per block in
// 80 KB, two blocks per SM.
//
// "ws" / "ws_pp" / "ws3" / "ws_pp3" (the defaults where TMA applies, see attention_wgmma_ws_kernel
// below): warp specialisation on top of "pipe": a TMA producer warpgroup, an mbarrier-guarded K / V
// ring, setmaxnreg; "ws_pp" adds the ping-pong of the consumer warpgroups (named barriers); "ws3"
// / "ws_pp3" have three consumer warpgroups (192 rows; D = 64). Varlen falls back to "pipe".
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
#include "gpu/tensor_map.h"
#include "gpu/tma.h"
#include "gpu/wgmma.h"

#if LLMK_MMA_SYNC_BUILD

#include <algorithm>
#include <atomic>
#endif

namespace llmk::detail {

using gpu::bfloat16;
using gpu::half;

namespace {

#if LLMK_MMA_SYNC_BUILD

// (D, warpgroups of 64 query rows per block, keys per tile).
template <int D_, int kWarpgroups_, int kBN_, bool kPipelined_ = false>
struct HopperConfig {
  static constexpr int D = D_;
  static constexpr bool kPipelined = kPipelined_;  // S_t and P_{t-1} V_{t-1} overlapped (see the kernel)
  static constexpr int kWarpgroups = kWarpgroups_;
  static constexpr int kThreads = kWarpgroups * 128;
  static constexpr int kBM = kWarpgroups * 64;  // query rows per block
  static constexpr int kBN = kBN_;              // keys per tile
  static constexpr int kBytesQ = kBM * D * 2, kBytesKV = kBN * D * 2;
  static constexpr int kSmemBytes = kBytesQ + 4 * kBytesKV + 1024;  // Q, K0 V0 K1 V1, alignment slack
  static_assert(D % 64 == 0, "128-byte swizzle rows: D a multiple of 64");
  static_assert(kBN == 64 || kBN == 128, "wgmma widths built");
};

// Tilings, chosen by LLMK_ATTENTION_HOPPER_CONFIG (for measuring; unset: the default).
// The default: 2 warpgroups (128 rows), 128-key tiles (D = 128: 161 KB of shared memory, one block
// per SM). "wg1" (LLMK_ATTENTION_HOPPER_CONFIG=wg1, for measuring): 1 warpgroup (64 rows) per
// block and 80 KB, so two independent blocks share an SM and one's softmax overlaps the other's
// MMAs (128-key tiles at D = 64, 64-key tiles at D = 128).
template <int D> using HopperDefault = HopperConfig<D, 2, 128>;
template <int D> using HopperWg1 = HopperConfig<D, 1, (D == 64 ? 128 : 64)>;
// "pipe": the default tiling with the software-pipelined key loop. (Its SASS waits for P V right
// after S_t, before the softmax, with or without mask_softmax's branch: ptxas 13.0 keeps no
// softmax / P V overlap here at 248-254 registers; the ws consumers, at 240, keep it.)
template <int D> using HopperPipe = HopperConfig<D, 2, 128, true>;

// Rows [row0, row0 + R) of a (len x D) matrix (row stride `stride`; rows past len become zeros)
// into an R-row 128B-swizzled tile at `smem` (1024-byte aligned), 16 bytes per cp.async; the
// threads of a row's chunks are consecutive (coalesced reads, conflict-free stores).
template <int R, int D, int kThreads, typename T>
__device__ __forceinline__ void load_swizzled(unsigned char* smem, const T* base, int64_t stride, int row0, int len) {
  constexpr int kChunks = D / 8, kTotal = R * kChunks;
  static_assert(kTotal % kThreads == 0, "whole passes");
#pragma unroll
  for (int i = 0; i < kTotal / kThreads; ++i) {
    const int idx = static_cast<int>(threadIdx.x) + i * kThreads;
    const int r = idx / kChunks, c = idx % kChunks;
    const bool in = row0 + r < len;
    const T* src = base + (in ? static_cast<int64_t>(row0 + r) * stride : 0) + c * 8;
    gpu::mma::cp_async16(smem + gpu::wgmma::swizzled_chunk<R>(r, c), src, in ? 16 : 0);
  }
}

#if LLMK_HAS_WGMMA
// S (64 x kBN fp32, this warpgroup's rows) = Q K^T: D / 16 wgmmas from shared memory (issued
// after a wgmma.fence, not committed). q_addr: this warpgroup's rows of the kBM-row Q tile.
template <typename T, int D, int kBM, int kBN>
__device__ __forceinline__ void issue_qk(float (&s)[kBN / 2], uint32_t q_addr, uint32_t k_addr) {
  namespace wg = gpu::wgmma;
#pragma unroll
  for (int i = 0; i < kBN / 2; ++i) s[i] = 0.f;
  wg::fence();
  const uint64_t da0 = wg::make_desc(q_addr, 16, 1024), db0 = wg::make_desc(k_addr, 16, 1024);
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    const uint64_t da = wg::desc_offset(da0, (kk / 4) * (kBM * 128) + (kk % 4) * 32);
    const uint64_t db = wg::desc_offset(db0, (kk / 4) * (kBN * 128) + (kk % 4) * 32);
    wg::mma_ss<T, kBN>(s, da, db, kk > 0 ? 1 : 0);
  }
}

// O += P V: kBN / 16 wgmmas, P from registers, V (kBN keys x D) MN-major in shared memory (not
// committed; the caller fences first).
template <typename T, int D, int kBN>
__device__ __forceinline__ void issue_pv(float (&acc)[D / 2], const uint32_t (&pa)[kBN / 16][4], uint32_t v_addr) {
  namespace wg = gpu::wgmma;
  const uint64_t dv0 = wg::make_desc(v_addr, kBN * 128, 1024);
#pragma unroll
  for (int kk = 0; kk < kBN / 16; ++kk) wg::mma_rs<T, D>(acc, pa[kk], wg::desc_offset(dv0, kk * 16 * 128), 1);
}

// The probabilities as the register-A fragments of P V: keys 16kk..16kk+15 are accumulator
// chunks 2kk and 2kk + 1.
template <typename T, int kBN>
__device__ __forceinline__ void pack_p(uint32_t (&pa)[kBN / 16][4], const float (&s)[kBN / 2]) {
#pragma unroll
  for (int kk = 0; kk < kBN / 16; ++kk) {
    pa[kk][0] = gpu::mma::pack2<T>(s[8 * kk + 0], s[8 * kk + 1]);
    pa[kk][1] = gpu::mma::pack2<T>(s[8 * kk + 2], s[8 * kk + 3]);
    pa[kk][2] = gpu::mma::pack2<T>(s[8 * kk + 4], s[8 * kk + 5]);
    pa[kk][3] = gpu::mma::pack2<T>(s[8 * kk + 6], s[8 * kk + 7]);
  }
}

// Mask (keys past kv_left, and when causal past each row's diagonal) and online softmax in log2
// units (as v2) of one tile's scores, in place: s becomes the probabilities, row_m / row_l the
// running max (raw score units) and sum of this thread's two rows (warp rows r16 = 16 * warp + g
// and r16 + 8 of the warpgroup), alpha the factors the output rows must be rescaled by. diag0:
// the warpgroup's first row's diagonal relative to the tile (key c visible to warpgroup row rr
// when c <= diag0 + rr).
// kAlwaysMask: run the masking code on every tile (it changes nothing on tiles that need no mask:
// left = kBN and lim_d >= kBN there), so that the softmax has no branch ptxas schedules around.
// kNeverMask: no masking code at all (the caller knows the tile needs none).
template <int kBN, int kBM, bool kAlwaysMask = false, bool kNeverMask = false>
__device__ __forceinline__ void mask_softmax(float (&s)[kBN / 2], float (&row_m)[2], float (&row_l)[2], float (&alpha)[2],
                                             bool causal, int kv_left, int diag0, int r16, int tig, float sl2) {
  if (!kNeverMask && (kAlwaysMask || kv_left < kBN || (causal && diag0 < kBN - 1))) {
    const int left = kv_left < kBN ? kv_left : kBN;
    const int diag = causal ? (diag0 < -kBM ? -kBM : (diag0 > kBN ? kBN : diag0)) : kBN;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int lim_d = diag + r16 + 8 * r + 1;  // this row's visible columns
      const int lim = (lim_d < left ? lim_d : left) - tig * 2;
#pragma unroll
      for (int j = 0; j < kBN / 8; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e)
          if (j * 8 + e >= lim) s[4 * j + 2 * r + e] = -INFINITY;
    }
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float mx = row_m[r];
#pragma unroll
    for (int j = 0; j < kBN / 8; ++j) mx = fmaxf(mx, fmaxf(s[4 * j + 2 * r], s[4 * j + 2 * r + 1]));
    mx = fmaxf(mx, gpu::shfl_xor(mx, 1));
    mx = fmaxf(mx, gpu::shfl_xor(mx, 2));
    const float base = mx == -INFINITY ? 0.f : mx * sl2;
    // exactly 1 when the maximum did not move (the FFMA would leave its rounding error)
    alpha[r] = mx == row_m[r] ? 1.f : gpu::mma::ex2_approx(fmaf(row_m[r], sl2, -base));
    row_m[r] = mx;
    float sum = 0.f;
#pragma unroll
    for (int j = 0; j < kBN / 8; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float w = gpu::mma::ex2_approx(fmaf(s[4 * j + 2 * r + e], sl2, -base));
        s[4 * j + 2 * r + e] = w;
        sum += w;
      }
    row_l[r] = fmaf(row_l[r], alpha[r], sum);
  }
}

template <int D>
__device__ __forceinline__ void rescale(float (&acc)[D / 2], const float (&alpha)[2]) {
#pragma unroll
  for (int j = 0; j < D / 8; ++j) {
    acc[4 * j + 0] *= alpha[0];
    acc[4 * j + 1] *= alpha[0];
    acc[4 * j + 2] *= alpha[1];
    acc[4 * j + 3] *= alpha[1];
  }
}
#endif  // LLMK_HAS_WGMMA

// Epilogue of every tiling: normalise this lane's two rows (row0 and row0 + 8 of the block's
// span, sequence-relative) and store them (each quad writes 16 contiguous bytes of a row per
// chunk, as v2), plus their lse. o: the output at this (sequence start, head); lse_row0: the
// sequence's first row index in the lse.
#if LLMK_HAS_WGMMA
template <typename T, int D>
__device__ __forceinline__ void store_rows(const AttentionParams& p, T* o, int64_t b, int64_t h, int64_t lse_row0,
                                           int row0, int q_len, int tig, const float (&acc)[D / 2],
                                           const float (&row_m)[2], const float (&row_l)[2]) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float l = row_l[r];
    l += gpu::shfl_xor(l, 1);
    l += gpu::shfl_xor(l, 2);
    const int row = row0 + 8 * r;
    if (row >= q_len) continue;
    const float inv = l > 0.f ? 1.f / l : 0.f;
    T* orow = o + static_cast<int64_t>(row) * p.out_strides[1];
#pragma unroll
    for (int j = 0; j < D / 8; ++j)
      *reinterpret_cast<uint32_t*>(orow + j * 8 + tig * 2) =
          gpu::mma::pack2<T>(acc[4 * j + 2 * r] * inv, acc[4 * j + 2 * r + 1] * inv);
    if (p.lse && tig == 0)
      p.lse[b * p.lse_strides[0] + h * p.lse_strides[1] + (lse_row0 + row) * p.lse_strides[2]] =
          l > 0.f ? row_m[r] * p.scale + logf(l) : -INFINITY;
  }
}
#endif  // LLMK_HAS_WGMMA

template <typename T, typename C, bool kVarlen>
__global__ void __launch_bounds__(C::kThreads, 1) attention_wgmma_kernel(AttentionParams p, int m_tiles) {
  static_assert(!C::kPipelined || C::kWarpgroups >= 1, "pipelined: whole warpgroups");
#if LLMK_HAS_WGMMA
  // Marker: its static shared size tells the host that this body was built (sm_90a), see
  // gpu::tma::kernel_built; elsewhere the kernel is empty and never launched.
  __shared__ int built_marker[4];
  if (threadIdx.x == 0) static_cast<volatile int*>(built_marker)[0] = 1;

  using namespace gpu::mma;
  namespace wg = gpu::wgmma;
  constexpr int D = C::D, kBN = C::kBN, kBM = C::kBM;
  extern __shared__ unsigned char smem_raw[];
  // 128B swizzle atoms must be 1024-byte aligned (the descriptors' base offset is 0).
  unsigned char* smem = gpu::mma::align_smem_1024(smem_raw);
  unsigned char* sQ = smem;
  unsigned char* sKV = smem + C::kBytesQ;  // K0, V0, K1, V1

  // wgi through a shuffle: the compiler then knows it is warp-uniform and builds the wgmma
  // descriptors in uniform registers (see attention_wgmma_ws_kernel).
  const int tid = threadIdx.x, wgi = gpu::shfl(tid / 128, 0), warp = (tid % 128) / 32, lane = tid % 32,
            g = lane / 4, tig = lane % 4;
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
  int n_end = kv_len;
  if (p.causal) {
    const int e = m0 + kBM + diagonal_offset;  // |.| < 2^31: terms below 2^30
    n_end = e < 0 ? 0 : (e > kv_len ? kv_len : e);
  }
  const int n_tiles = (n_end + kBN - 1) / kBN;
  const float sl2 = p.scale * 1.4426950408889634f;  // scores in log2 units

  load_swizzled<kBM, D, C::kThreads>(sQ, q, p.q_strides[1], m0, q_len);
  if (n_tiles > 0) {
    load_swizzled<kBN, D, C::kThreads>(sKV, k, p.k_strides[1], 0, kv_len);
    if (!C::kPipelined) load_swizzled<kBN, D, C::kThreads>(sKV + C::kBytesKV, v, p.v_strides[1], 0, kv_len);
  }
  cp_async_commit();

  float acc[D / 2];
#pragma unroll
  for (int i = 0; i < D / 2; ++i) acc[i] = 0.f;
  float row_m[2] = {-INFINITY, -INFINITY}, row_l[2] = {0.f, 0.f};
  // This warpgroup's 64 Q rows: in every 64-column block, bytes [wgi * 64 * 128, +64 * 128).
  const uint32_t q_addr = smem_u32(sQ) + wgi * 64 * 128;
  const int wg_row0 = wgi * 64;  // within the block

  if constexpr (!C::kPipelined) {
#pragma unroll 1
    for (int tile = 0; tile < n_tiles; ++tile) {
      const int n0 = tile * kBN;
      cp_async_wait<0>();
      wg::fence_proxy_async();
      __syncthreads();  // this tile is in shared memory; every warpgroup is done with the previous one
      unsigned char* sK = sKV + (tile & 1) * 2 * C::kBytesKV;
      unsigned char* sV = sK + C::kBytesKV;
      if (tile + 1 < n_tiles) {  // into the buffers the previous tile used
        unsigned char* nK = sKV + ((tile + 1) & 1) * 2 * C::kBytesKV;
        load_swizzled<kBN, D, C::kThreads>(nK, k, p.k_strides[1], n0 + kBN, kv_len);
        load_swizzled<kBN, D, C::kThreads>(nK + C::kBytesKV, v, p.v_strides[1], n0 + kBN, kv_len);
        cp_async_commit();
      }
      // Key n0 + c is visible to block row wg_row0 + rr when c < kv_left and (not causal or
      // c <= diag0 + rr). Uniform per warpgroup (wgmma needs all 128 threads).
      const int diag0 = m0 + wg_row0 + diagonal_offset - n0;
      if (p.causal && diag0 + 63 < 0) continue;

      // S = Q K^T (64 x kBN per warpgroup)
      float s[kBN / 2];
      issue_qk<T, D, kBM, kBN>(s, q_addr, smem_u32(sK));
      wg::commit();
      wg::wait<0>();
      wg::fence_regs(s);
      float alpha[2];
      mask_softmax<kBN, kBM>(s, row_m, row_l, alpha, p.causal, kv_len - n0, diag0, warp * 16 + g, tig, sl2);
      // skipped while the warp's row maxima stand still (as v2; nothing is in flight here)
      if (__any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) rescale<D>(acc, alpha);
      // O += P V. All of P is packed before the fence: registers written between two wgmmas of a
      // batch make ptxas insert extra warpgroup.arrive (serialising the batch).
      uint32_t pa[kBN / 16][4];
      pack_p<T, kBN>(pa, s);
      wg::fence();
      issue_pv<T, D, kBN>(acc, pa, smem_u32(sV));
      wg::commit();
      wg::wait<0>();
      wg::fence_regs(acc);
    }
  } else {
    // Software pipelined (FlashAttention-3's intra-warpgroup overlap): iteration t issues S_t =
    // Q K_t^T and O += P_{t-1} V_{t-1} back to back, then runs the softmax of S_t while the P V
    // product is still on the tensor cores, and rescales O once it is done. V lags K by one
    // tile in the shared ring: after the barrier of iteration t, K_{t-1} and V_{t-2} are free,
    // so K_{t+1} and V_t are loaded there. Causal tiles are not skipped per warpgroup (the mask
    // zeroes them); P_{t-1} lives in registers across the barrier.
    // The first and last iterations are peeled so that every wgmma of the steady-state loop is
    // unconditional (ptxas serialises wgmmas it cannot track).
    uint32_t pa[kBN / 16][4];
    float alpha[2] = {1.f, 1.f};
    auto k_stage = [&](int t) { return smem_u32(sKV + (t & 1) * 2 * C::kBytesKV); };
    auto v_stage = [&](int t) { return smem_u32(sKV + (t & 1) * 2 * C::kBytesKV + C::kBytesKV); };
    auto arrive_and_load = [&](int t) {  // after it: K_t, V_{t-1} readable; K_{t+1}, V_t in flight
      cp_async_wait<0>();
      wg::fence_proxy_async();
      __syncthreads();  // everyone is done with K_{t-1} and V_{t-2}
      if (t + 1 < n_tiles)
        load_swizzled<kBN, D, C::kThreads>(sKV + ((t + 1) & 1) * 2 * C::kBytesKV, k, p.k_strides[1], (t + 1) * kBN,
                                           kv_len);
      if (t < n_tiles)
        load_swizzled<kBN, D, C::kThreads>(sKV + (t & 1) * 2 * C::kBytesKV + C::kBytesKV, v, p.v_strides[1], t * kBN,
                                           kv_len);
      cp_async_commit();
    };
    const int diag_wg = m0 + wg_row0 + diagonal_offset;  // minus n0: the tile-relative diagonal
    if (n_tiles > 0) {
      arrive_and_load(0);
      float s[kBN / 2];
      issue_qk<T, D, kBM, kBN>(s, q_addr, k_stage(0));
      wg::commit();
      wg::wait<0>();
      wg::fence_regs(s);
      mask_softmax<kBN, kBM>(s, row_m, row_l, alpha, p.causal, kv_len, diag_wg, warp * 16 + g, tig, sl2);
      pack_p<T, kBN>(pa, s);
    }
#pragma unroll 1
    for (int tile = 1; tile < n_tiles; ++tile) {
      const int n0 = tile * kBN;
      arrive_and_load(tile);
      float s[kBN / 2];
      issue_qk<T, D, kBM, kBN>(s, q_addr, k_stage(tile));
      wg::commit();
      rescale<D>(acc, alpha);  // O = alpha_{t-1} O + P_{t-1} V_{t-1}, the rescale while S_t runs
      wg::fence();
      issue_pv<T, D, kBN>(acc, pa, v_stage(tile - 1));
      wg::commit();
      wg::wait<1>();  // S_t is done (P V may still run)
      wg::fence_regs(s);
      mask_softmax<kBN, kBM>(s, row_m, row_l, alpha, p.causal, kv_len - n0, diag_wg - n0, warp * 16 + g, tig, sl2);
      wg::wait<0>();
      wg::fence_regs(acc);
      pack_p<T, kBN>(pa, s);
    }
    if (n_tiles > 0) {
      arrive_and_load(n_tiles);  // V_{n-1}
      rescale<D>(acc, alpha);
      wg::fence();
      issue_pv<T, D, kBN>(acc, pa, v_stage(n_tiles - 1));
      wg::commit();
      wg::wait<0>();
      wg::fence_regs(acc);
    }
  }
  cp_async_wait<0>();

  // Epilogue: normalise and store.
  T* o = static_cast<T*>(p.out) + b * p.out_strides[0] + sp.q_start * p.out_strides[1] + h * p.out_strides[2];
  store_rows<T, D>(p, o, b, h, sp.q_start, m0 + wg_row0 + warp * 16 + g, q_len, tig, acc, row_m, row_l);
#else
  (void)p;
  (void)m_tiles;
#endif
}

// ------------------------------------------------------------ warp-specialised tiling ("ws")
// FlashAttention-3's producer / consumer structure on top of the "pipe" math. Block: 3 warp-
// groups (384 threads), 128 query rows, 128-key tiles (ws3 / ws_pp3: 4 warpgroups, 192 rows, the
// consumers at 160 registers; see kConsumerWGs_ below).
//  * Warpgroup 0 (producer) gives its registers away (setmaxnreg 24); one thread issues every
//    load with TMA (cp.async.bulk.tensor, 128B swizzle: the layout of gpu/wgmma.h, zero fill past
//    the ends of the tensors): Q once, then K_t and V_t into a ring of kStages slots each. A slot
//    has a "full" mbarrier (the producer's arrive.expect_tx plus the TMA's complete_tx) and an
//    "empty" one (one arrival per consumer warp once its wgmmas reading the slot are done).
//  * Warpgroups 1 and 2 (consumers, 64 rows each, setmaxnreg 240) run the "pipe" loop: S_t =
//    Q K_t^T and O += P_{t-1} V_{t-1} issued back to back, the softmax of S_t while P V runs; K_t
//    is released as soon as S_t is done, V_{t-1} once P V is. No block-wide barrier in the loop:
//    the two consumers drift freely within the ring.
//  * kPingPong ("ws_pp"): FA3's inter-warpgroup schedule on top: each consumer issues its wgmmas
//    of an iteration only after the other has issued its own (named barriers 1 and 2, 256
//    threads: consumer c waits on 1 + c, then arrives on the other's), so the tensor cores take
//    the two warpgroups' GEMMs in turns and one's softmax overlaps the other's GEMMs.
//  * Tiles: a block runs query tiles blockIdx.x, + gridDim.x, ... in grid_block's order (one
//    when launched a block per tile; the persistent launch, see launch_hopper_ws, strides). The
//    K / V ring's slots and phases count on across tiles; Q has two buffers with full / empty
//    mbarriers (one where shared memory leaves no room for two: 176-key tiles), so the producer
//    loads the next tile's Q and first K / V while the consumers finish this one and write it out.
// Tensor maps (host, per call): 4-D (D, S, H, B) views with the tensors' own strides, boxes of
// 64 columns x kBM (Q) or kBN (K, V) rows (two boxes per tile at D = 128). Not for varlen (the
// caller falls back).
// kConsumerWGs_ = 3 ("ws3", "ws_pp3"; D = 64): FA3's block of 192 query rows at D = 64, three
// consumer warpgroups of 160 registers (S 64, P 32 and O 32 per thread fit): each K / V tile
// feeds 1.5x the rows, and with ping-pong the three warpgroups take the tensor cores in a ring,
// two softmaxes overlapping each one's GEMMs (at D = 64 the exponentials take about as long as
// the GEMMs of a tile).
// kRescaleLate_ (ws3): O is rescaled by alpha_t at the end of iteration t, once P_{t-1} V_{t-1}
// is done, instead of by alpha_{t-1} between the two wgmmas' issues. H200, 2026-12-02 16:04 and
// 16:12 (scripts/attention_tiling_sweep.py, fp16, two rounds each): 1.00-1.05x the early
// rescale at the six non-causal D = 64 shapes in both runs, causal 1.02-1.07x and 0.98-1.06x;
// bench-attention 1.03-1.08x. With ping-pong (at D = 128, or ws_pp3) it changed nothing beyond
// noise (0.96-1.03x), nor did skipping the rescale where no row's maximum moved, nor issuing
// P V before S_t and running the softmax with nothing in flight (1.00-1.05x the early rescale,
// below the late one); none kept. Nor did computing a part of the softmax's exponentials by a
// polynomial on the FMA units (FlashAttention-4's split): 0.83-0.99x at D = 64 for a half to an
// eighth of them, so the consumers are bound by issue or latency, not by the MUFU (16:53; all
// in bench/results/h200-attention-consumer-loop.md).
// kBN_ (keys per tile; 128 unless forced): 160 or 176 at D = 128 ("ws_pp160" / "ws_pp176";
// FlashAttention-3 takes 176 for non-causal D = 128), so that each S / P V pair of wgmmas does more
// work per softmax and per barrier round. 176 leaves no room for Q's second buffer (kQBuffers 1:
// the next query tile's Q loads only once this one's last P V is done).
template <int D_, bool kPingPong_ = false, int kConsumerWGs_ = 2, bool kRescaleLate_ = false, int kBN_ = 128>
struct HopperWsConfig {
  static constexpr int D = D_;
  static constexpr bool kPingPong = kPingPong_;
  static constexpr int kConsumerWGs = kConsumerWGs_;
  static constexpr bool kRescaleLate = kRescaleLate_;
  static constexpr int kConsumerThreads = 128 * kConsumerWGs, kThreads = 128 + kConsumerThreads;
  static constexpr int kBM = 64 * kConsumerWGs, kBN = kBN_;
  static_assert(kBN % 16 == 0 && kBN <= 256, "whole k16 steps of P V; a TMA box of at most 256 rows");
  // K / V slots (3 at D = 128 or 2 and 5 at D = 64 timed the same, H200 2026-12-02 16:27)
  static constexpr int kStages = D == 64 ? 3 : 2;
  static constexpr int kBytesQ = kBM * D * 2, kBytesKV = kBN * D * 2;
  static constexpr int kBarrierBytes = 8 * (4 + 4 * kStages);
  static constexpr int kSmemFor2Q = 2 * kBytesQ + 2 * kStages * kBytesKV + 1024 + kBarrierBytes;
  static constexpr int kQBuffers = kSmemFor2Q <= 227 * 1024 ? 2 : 1;  // the H100 / H200 opt-in limit
  static constexpr int kSmemBytes = kQBuffers * kBytesQ + 2 * kStages * kBytesKV + 1024 + kBarrierBytes;
  static constexpr int kProducerRegs = 24, kConsumerRegs = kConsumerWGs == 2 ? 240 : 160;
  static_assert(kProducerRegs * 128 + kConsumerRegs * kConsumerThreads <= 65536, "register file");
};

template <typename T, typename C>
__global__ void __launch_bounds__(C::kThreads, 1)
    attention_wgmma_ws_kernel(AttentionParams p, int m_tiles, const __grid_constant__ CUtensorMap map_q,
                              const __grid_constant__ CUtensorMap map_k, const __grid_constant__ CUtensorMap map_v) {
  static_assert(C::kConsumerWGs + 1 <= 16, "named barriers 1..kConsumerWGs");
  static_assert(!C::kPingPong || C::kConsumerWGs >= 2, "ping-pong takes turns between two or more consumers");
#if LLMK_HAS_WGMMA
  __shared__ int built_marker[4];  // see gpu::tma::kernel_built
  if (threadIdx.x == 0) static_cast<volatile int*>(built_marker)[0] = 1;

  using namespace gpu::mma;
  namespace wg = gpu::wgmma;
  namespace tma = gpu::tma;
  constexpr int D = C::D, kBN = C::kBN, kBM = C::kBM, kStages = C::kStages;
  extern __shared__ unsigned char smem_raw[];
  unsigned char* smem = gpu::mma::align_smem_1024(smem_raw);
  const uint32_t sQ = smem_u32(smem);                       // kQBuffers Q buffers (tiles in turn)
  const uint32_t sK0 = sQ + C::kQBuffers * C::kBytesQ;       // K slots, then V slots
  const uint32_t sV0 = sK0 + kStages * C::kBytesKV;
  const uint32_t bars = sV0 + kStages * C::kBytesKV;        // 8-byte mbarriers:
  auto full_q = [&](int i) { return bars + 8 * i; };        //   Q full / empty (per buffer)
  auto empty_q = [&](int i) { return bars + 8 * (2 + i); };
  auto full_k = [&](int s) { return bars + 8 * (4 + s); };  //   K full / empty, V full / empty
  auto empty_k = [&](int s) { return bars + 8 * (4 + kStages + s); };
  auto full_v = [&](int s) { return bars + 8 * (4 + 2 * kStages + s); };
  auto empty_v = [&](int s) { return bars + 8 * (4 + 3 * kStages + s); };
  constexpr uint32_t kConsumerWarps = C::kConsumerThreads / 32;

  const int tid = threadIdx.x;
  if (tid == 0) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      tma::mbar_init(full_q(i), 1);
      tma::mbar_init(empty_q(i), kConsumerWarps);
    }
#pragma unroll
    for (int s = 0; s < kStages; ++s) {
      tma::mbar_init(full_k(s), 1);
      tma::mbar_init(full_v(s), 1);
      tma::mbar_init(empty_k(s), kConsumerWarps);
      tma::mbar_init(empty_v(s), kConsumerWarps);
    }
    tma::fence_mbar_init();
  }
  __syncthreads();  // the last block-wide barrier: the roles part here

  // The block's query tiles: blocks blockIdx.x, + gridDim.x, ... of the grid_block order (one
  // when the launch has a block per tile; persistent launches stride over them).
  const int heads = static_cast<int>(p.q_heads);
  const int bh_count = heads * static_cast<int>(p.batch);
  const int total_blocks = m_tiles * bh_count;
  const int q_len = static_cast<int>(p.q_len), kv_len = static_cast<int>(p.kv_len);
  const int diagonal_offset = static_cast<int>(p.diagonal_offset);
  struct TileAt {
    int m0, h, b, hk, n_tiles;
  };
  auto tile_at = [&](int blk) {
    const auto [tile_rank, bh] = grid_block(p, blk, m_tiles, bh_count);
    TileAt w;
    w.m0 = (p.causal ? m_tiles - 1 - tile_rank : tile_rank) * kBM;
    w.h = bh % heads;
    w.b = bh / heads;
    w.hk = w.h / static_cast<int>(p.q_heads / p.kv_heads);
    int n_end = kv_len;
    if (p.causal) {
      const int e = w.m0 + kBM + diagonal_offset;
      n_end = e < 0 ? 0 : (e > kv_len ? kv_len : e);
    }
    w.n_tiles = (n_end + kBN - 1) / kBN;
    return w;
  };

  // The warpgroup, through a shuffle so that the compiler knows it is the same in every lane: the
  // role branches are then warp-uniform and the wgmma descriptors (which depend on it) are built
  // in uniform registers rather than per thread and moved over for every wgmma (H200, 2026-12-02:
  // 1.02-1.09x for ws_pp and ws3, 1.09-1.19x for ws; bench/results/h200-attention-uniform-desc.md).
  const int wg_role = gpu::shfl(tid / 128, 0);
  if (wg_role == 0) {
    // ---------------------------------------------------------------- producer
    tma::regs_dealloc<C::kProducerRegs>();
    if (tid == 0) {
      tma::prefetch_map(&map_q);
      tma::prefetch_map(&map_k);
      tma::prefetch_map(&map_v);
      int q_count = 0, kv_count = 0;  // Q tiles and K / V tiles loaded so far: buffer, slot, phase
#pragma unroll 1
      for (int blk = blockIdx.x; blk < total_blocks; blk += gridDim.x) {
        const TileAt w = tile_at(blk);
        if (w.n_tiles == 0) continue;
        const int qb = q_count % C::kQBuffers;
        tma::mbar_wait(empty_q(qb), ((q_count / C::kQBuffers) & 1) ^ 1);  // the first use of a buffer finds it free
        tma::mbar_arrive_expect_tx(full_q(qb), C::kBytesQ);
#pragma unroll
        for (int cb = 0; cb < D / 64; ++cb)
          tma::load_4d(sQ + qb * C::kBytesQ + cb * kBM * 128, &map_q, full_q(qb), cb * 64, w.m0, w.h, w.b);
        ++q_count;
#pragma unroll 1
        for (int t = 0; t < w.n_tiles; ++t, ++kv_count) {
          const int s = kv_count % kStages;
          const uint32_t parity = ((kv_count / kStages) & 1) ^ 1;  // the first round finds every slot free
          tma::mbar_wait(empty_k(s), parity);
          tma::mbar_arrive_expect_tx(full_k(s), C::kBytesKV);
#pragma unroll
          for (int cb = 0; cb < D / 64; ++cb)
            tma::load_4d(sK0 + s * C::kBytesKV + cb * kBN * 128, &map_k, full_k(s), cb * 64, t * kBN, w.hk, w.b);
          tma::mbar_wait(empty_v(s), parity);
          tma::mbar_arrive_expect_tx(full_v(s), C::kBytesKV);
#pragma unroll
          for (int cb = 0; cb < D / 64; ++cb)
            tma::load_4d(sV0 + s * C::kBytesKV + cb * kBN * 128, &map_v, full_v(s), cb * 64, t * kBN, w.hk, w.b);
        }
      }
    }
    return;  // the loads in flight complete on the barriers the consumers wait for
  }

  // ------------------------------------------------------------------ consumers
  tma::regs_alloc<C::kConsumerRegs>();
  const int ctid = tid - 128, wgi = wg_role - 1, warp = (ctid % 128) / 32, lane = ctid % 32, g = lane / 4,
            tig = lane % 4;
  const float sl2 = p.scale * 1.4426950408889634f;
  const int wg_row0 = wgi * 64;
  // K / V tile number i (counted over all of this block's query tiles) is in slot i % kStages,
  // in that slot's phase (i / kStages) & 1.
  auto k_slot = [&](int i) { return sK0 + (i % kStages) * C::kBytesKV; };
  auto v_slot = [&](int i) { return sV0 + (i % kStages) * C::kBytesKV; };
  auto parity_of = [&](int i) { return static_cast<uint32_t>((i / kStages) & 1); };
  // After wgmma.wait_group every lane of the warp is past its reads of the slot.
  auto release = [&](uint32_t bar) {
    if (lane == 0) tma::mbar_arrive(bar);
  };
  // Ping-pong: every issue section (prologue, each iteration, last P V) is bracketed by
  // sched_sync / sched_arrive, the consumers taking turns in a ring: consumer c waits on named
  // barrier 1 + c (256 threads: its own 128 and the previous consumer's arriving 128), then
  // arrives on the next one's. The last consumer arrives once ahead (consumer 0 goes first), and
  // consumer 0 takes that one extra arrival with a last wait before it exits, so every barrier
  // sees as many arrivals as waits.
  constexpr int kWGs = C::kConsumerWGs;
  auto sched_sync = [&] {
    if constexpr (C::kPingPong) tma::named_sync(1 + wgi, 256);
  };
  auto sched_arrive = [&] {
    if constexpr (C::kPingPong) tma::named_arrive(1 + (wgi + 1) % kWGs, 256);
  };
  bool primed = false;  // the ring's first arrival is made
  int q_count = 0, kv_base = 0;  // as the producer's counters

#pragma unroll 1
  for (int blk = blockIdx.x; blk < total_blocks; blk += gridDim.x) {
    const TileAt w = tile_at(blk);
    const int n_tiles = w.n_tiles;
    float acc[D / 2];
#pragma unroll
    for (int i = 0; i < D / 2; ++i) acc[i] = 0.f;
    float row_m[2] = {-INFINITY, -INFINITY}, row_l[2] = {0.f, 0.f};
    const int diag_wg = w.m0 + wg_row0 + diagonal_offset;
    if (n_tiles > 0) {
      if (C::kPingPong && !primed && wgi == kWGs - 1) tma::named_arrive(1, 256);
      primed = true;
      const int qb = q_count % C::kQBuffers;
      const uint32_t q_addr = sQ + qb * C::kBytesQ + wgi * 64 * 128;  // this warpgroup's 64 rows of every column block
      uint32_t pa[kBN / 16][4];
      float alpha[2] = {1.f, 1.f};
      tma::mbar_wait(full_q(qb), (q_count / C::kQBuffers) & 1);
      tma::mbar_wait(full_k(kv_base % kStages), parity_of(kv_base));
      {
        float s[kBN / 2];
        sched_sync();
        issue_qk<T, D, kBM, kBN>(s, q_addr, k_slot(kv_base));
        wg::commit();
        sched_arrive();
        wg::wait<0>();
        wg::fence_regs(s);
        release(empty_k(kv_base % kStages));
        mask_softmax<kBN, kBM>(s, row_m, row_l, alpha, p.causal, kv_len, diag_wg, warp * 16 + g, tig, sl2);
        pack_p<T, kBN>(pa, s);
      }
      // One key tile (t >= 1). masked: std::true_type runs the mask code on the tile (without a
      // "does this tile need one" branch: with the branch, ptxas hoists the P V wait above the whole
      // softmax (SASS), losing the overlap), std::false_type none (tiles before n_plain).
      auto key_tile = [&](int t, auto masked) {
        constexpr bool kMasked = decltype(masked)::value;
        const int n0 = t * kBN, i = kv_base + t;
        // Both waits before any wgmma is in flight (fewer live registers; V_{t-1} was issued before
        // K_t, so it is in by the time K_t is).
        tma::mbar_wait(full_k(i % kStages), parity_of(i));
        tma::mbar_wait(full_v((i - 1) % kStages), parity_of(i - 1));
        float s[kBN / 2];
        sched_sync();
        issue_qk<T, D, kBM, kBN>(s, q_addr, k_slot(i));
        wg::commit();
        if constexpr (!C::kRescaleLate) rescale<D>(acc, alpha);  // O = alpha_{t-1} O + P_{t-1} V_{t-1}, while S_t runs
        wg::fence();
        issue_pv<T, D, kBN>(acc, pa, v_slot(i - 1));
        wg::commit();
        sched_arrive();
        wg::wait<1>();  // S_t is done (P V may still run)
        wg::fence_regs(s);
        release(empty_k(i % kStages));
        mask_softmax<kBN, kBM, kMasked, !kMasked>(s, row_m, row_l, alpha, p.causal, kv_len - n0, diag_wg - n0,
                                                  warp * 16 + g, tig, sl2);
        wg::wait<0>();
        wg::fence_regs(acc);
        release(empty_v((i - 1) % kStages));
        if constexpr (C::kRescaleLate) rescale<D>(acc, alpha);  // O relative to tile t's maxima, as P_t is
        pack_p<T, kBN>(pa, s);
      };
      // Tiles 1 .. n_plain - 1 need no mask for any row of this warpgroup: all their keys are before
      // the end (kv_len) and, when causal, on or before the diagonal of the warpgroup's first row
      // (key diag_wg). They run the softmax without the mask code; the rest (the ragged last tile,
      // the tiles crossing the diagonal) with it. Every consumer runs n_tiles - 1 iterations in all,
      // as the ping-pong's barrier counts need.
      int n_plain = kv_len / kBN;
      if (p.causal && (diag_wg + 1) / kBN < n_plain) n_plain = diag_wg < 0 ? 0 : (diag_wg + 1) / kBN;
      int t = 1;
#pragma unroll 1
      for (; t < n_plain && t < n_tiles; ++t) key_tile(t, std::false_type{});
#pragma unroll 1
      for (; t < n_tiles; ++t) key_tile(t, std::true_type{});
      if constexpr (!C::kRescaleLate) rescale<D>(acc, alpha);  // (late: done in the last iteration, or acc is 0)
      const int last = kv_base + n_tiles - 1;
      tma::mbar_wait(full_v(last % kStages), parity_of(last));
      sched_sync();
      wg::fence();
      issue_pv<T, D, kBN>(acc, pa, v_slot(last));
      wg::commit();
      sched_arrive();
      wg::wait<0>();
      wg::fence_regs(acc);
      release(empty_v(last % kStages));  // the next query tile's K / V reuse the ring
      release(empty_q(qb));              // and the next-but-one its Q buffer
      ++q_count;
      kv_base += n_tiles;
    }
    // Epilogue (as the other tilings; no varlen here, so the sequence starts at row 0).
    T* o = static_cast<T*>(p.out) + w.b * p.out_strides[0] + w.h * p.out_strides[2];
    store_rows<T, D>(p, o, w.b, w.h, 0, w.m0 + wg_row0 + warp * 16 + g, q_len, tig, acc, row_m, row_l);
  }
  if (C::kPingPong && primed && wgi == 0) tma::named_sync(1, 256);  // the last consumer's extra arrival
#else
  (void)p;
  (void)m_tiles;
  (void)map_q;
  (void)map_k;
  (void)map_v;
  (void)C::kRescaleLate;  // (read by the sm_90a body only)
#endif
}

template <typename T, typename C>
bool launch_hopper_config(const AttentionParams& p) {
  if (C::kSmemBytes > gpu::mma::max_shared_memory(p.device.index)) return false;
  const int64_t m_tiles = (p.q_len + C::kBM - 1) / C::kBM;
  const int64_t blocks = m_tiles * p.q_heads * p.batch;
  if (blocks >= (int64_t{1} << 31)) return false;
  auto kernel = p.cu_seqlens_q != nullptr ? attention_wgmma_kernel<T, C, true> : attention_wgmma_kernel<T, C, false>;
  if (!gpu::tma::kernel_built(kernel)) return false;
  gpu::check(gpuFuncSetAttribute(kernel, gpuFuncAttributeMaxDynamicSharedMemorySize, C::kSmemBytes), "attention",
             "setting the shared memory size");
  kernel<<<static_cast<unsigned>(blocks), C::kThreads, C::kSmemBytes, gpu::as_stream(p.stream)>>>(
      p, static_cast<int>(m_tiles));
  return true;
}

// ---------------------------------------------------------------- "ws": tensor maps and launch
std::atomic<int64_t> g_ws_launches{0};

// The "ws" tiling; false (the caller then takes "pipe") for varlen batches, tensors TMA cannot
// describe, sizes past 32-bit coordinates, or a build without its sm_90a body.
template <typename T, int D, bool kPingPong, int kConsumerWGs = 2, bool kRescaleLate = false, int kBN = 128>
bool launch_hopper_ws(const AttentionParams& p) {
  using C = HopperWsConfig<D, kPingPong, kConsumerWGs, kRescaleLate, kBN>;
  if (p.cu_seqlens_q != nullptr) return false;
  if (C::kSmemBytes > gpu::mma::max_shared_memory(p.device.index)) return false;
  if (p.q_len >= (int64_t{1} << 31) || p.kv_len >= (int64_t{1} << 31)) return false;
  const int64_t m_tiles = (p.q_len + C::kBM - 1) / C::kBM;
  const int64_t blocks = m_tiles * p.q_heads * p.batch;
  if (blocks >= (int64_t{1} << 31)) return false;
  auto kernel = attention_wgmma_ws_kernel<T, C>;
  if (!gpu::tma::kernel_built(kernel)) return false;
  // setmaxnreg.inc blocks until the block's register pool holds what it asks for (no timeout
  // covers that wait): the registers the block is launched with (ptxas: 168 per thread today, 128
  // with three consumer warpgroups) must cover the producer's 24 and the consumers' 240 (160) per
  // thread, else take "pipe".
  static const bool regs_ok = [&] {
    cudaFuncAttributes attr{};
    if (cudaFuncGetAttributes(&attr, kernel) != cudaSuccess) {
      (void)cudaGetLastError();
      return false;
    }
    return attr.numRegs * C::kThreads >= C::kProducerRegs * (C::kThreads - C::kConsumerThreads) +
                                             C::kConsumerRegs * C::kConsumerThreads;
  }();
  if (!regs_ok) return false;
  CUtensorMap map_q{}, map_k{}, map_v{};
  if (!gpu::tma::make_tensor_map(&map_q, std::is_same_v<T, half>, p.q, D, p.q_len, p.q_heads, p.batch, p.q_strides, C::kBM)) return false;
  if (!gpu::tma::make_tensor_map(&map_k, std::is_same_v<T, half>, p.k, D, p.kv_len, p.kv_heads, p.batch, p.k_strides, C::kBN)) return false;
  if (!gpu::tma::make_tensor_map(&map_v, std::is_same_v<T, half>, p.v, D, p.kv_len, p.kv_heads, p.batch, p.v_strides, C::kBN)) return false;
  gpu::check(gpuFuncSetAttribute(kernel, gpuFuncAttributeMaxDynamicSharedMemorySize, C::kSmemBytes), "attention",
             "setting the shared memory size");
  // Persistent (a block per SM striding over the query tiles, the next tile's Q and first K / V
  // loading while this one finishes) for non-causal calls at D = 128: H200 2026-12-02 19:05
  // (scripts/attention_tiling_sweep.py, two rounds): 1.00-1.04x the block-per-tile launch at all
  // nine non-causal D = 128 shapes; at D = 64 0.98-1.02x (left off); causal 0.89-0.99x where its
  // tiles differ in length and a static stride leaves SMs idle (1.02-1.08x only at the 8192-block
  // grids of 1024-2048 tokens). LLMK_ATTENTION_PERSISTENT=0 / 1 forces it off / on;
  // LLMK_ATTENTION_PERSISTENT_BLOCKS=N (tests) caps a persistent grid at N blocks, so that small
  // calls also run several tiles per block.
  const bool persistent = gpu::env_flag("LLMK_ATTENTION_PERSISTENT", !p.causal && D == 128);
  const char* cap_env = std::getenv("LLMK_ATTENTION_PERSISTENT_BLOCKS");
  const int64_t capped = cap_env != nullptr ? std::atoll(cap_env) : 0;
  const int64_t cap = capped > 0 ? capped : gpu::multiprocessor_count(p.device.index);
  const int64_t grid = persistent && blocks > cap ? cap : blocks;
  kernel<<<static_cast<unsigned>(grid), C::kThreads, C::kSmemBytes, gpu::as_stream(p.stream)>>>(
      p, static_cast<int>(m_tiles), map_q, map_k, map_v);
  g_ws_launches.fetch_add(1, std::memory_order_relaxed);
  return true;
}

// Tiling: LLMK_ATTENTION_HOPPER_CONFIG = pipe | wg1 | plain | ws | ws_pp | ws3 | ws_pp3 | ws_pp160 |
// ws_pp176 forces one (the ws tilings fall back to pipe where they do not apply; ws3 / ws_pp3 exist
// at D = 64 only, ws_pp160 / ws_pp176, 160- and 176-key tiles, at D = 128 only).
// Unset, by H200 runs of 2026-12-02 (one build each; scripts/attention_tiling_sweep.py, fp16
// TFLOP/s): at D = 64 "ws3" (12:37: 405-428 non-causal at (1..8, 16, 8192, 64) against 361-372
// "ws" and 383-390 "ws_pp"; causal 403-418 against 353-365 and 374-383) unless the grid has fewer
// than two 128-row blocks per SM; everywhere else "ws_pp", the causal default since 2026-11-30,
// now non-causal too (12:37 and twice at 12:55, in both orders: 1.05-1.13x "ws" at all nine
// D = 128 shapes; on 2026-11-30 "ws" had led non-causal, 469.9 vs 414.4 at (1, 32, 4096, 128),
// before the grid sections and the maskless loop). "ws3" rescales O late since 2026-12-02 16:12
// (see HopperWsConfig): 1.03-1.08x the early rescale in that day's bench-attention.
template <typename T, int D>
bool launch_hopper_typed(const AttentionParams& p) {
  const char* env = std::getenv("LLMK_ATTENTION_HOPPER_CONFIG");
  const std::string config = env != nullptr ? env : "";
  if (config == "wg1") return launch_hopper_config<T, HopperWg1<D>>(p);
  if (config == "pipe") return launch_hopper_config<T, HopperPipe<D>>(p);
  if (config == "plain") return launch_hopper_config<T, HopperDefault<D>>(p);
  if (config == "ws") return launch_hopper_ws<T, D, false>(p) || launch_hopper_config<T, HopperPipe<D>>(p);
  if (config == "ws_pp") return launch_hopper_ws<T, D, true>(p) || launch_hopper_config<T, HopperPipe<D>>(p);
  if constexpr (D == 128) {  // wider key tiles
    if (config == "ws_pp160") return launch_hopper_ws<T, D, true, 2, false, 160>(p) || launch_hopper_config<T, HopperPipe<D>>(p);
    if (config == "ws_pp176") return launch_hopper_ws<T, D, true, 2, false, 176>(p) || launch_hopper_config<T, HopperPipe<D>>(p);
  }
  if constexpr (D == 64) {  // 192-row blocks, three consumer warpgroups
    if (config == "ws3") return launch_hopper_ws<T, D, false, 3, true>(p) || launch_hopper_config<T, HopperPipe<D>>(p);
    if (config == "ws_pp3") return launch_hopper_ws<T, D, true, 3>(p) || launch_hopper_config<T, HopperPipe<D>>(p);
  }
  const int64_t blocks = (p.q_len + HopperPipe<D>::kBM - 1) / HopperPipe<D>::kBM * p.q_heads * p.batch;
  const bool few_blocks = blocks < 2 * static_cast<int64_t>(gpu::multiprocessor_count(p.device.index));
  if constexpr (D == 64) {
    if (!few_blocks && launch_hopper_ws<T, D, false, 3, true>(p)) return true;
  }
  if (launch_hopper_ws<T, D, true>(p)) return true;
  // varlen, or a tensor TMA cannot describe: the register-only tilings
  if (few_blocks) return launch_hopper_config<T, HopperWg1<D>>(p);
  return launch_hopper_config<T, HopperPipe<D>>(p);
}

// ---------------------------------------------------------------- one-tile self test (tests only)
// One warpgroup: s (64 x 128 fp32) = q (64 x D) k^T (k: 128 x D), then o (64 x D fp32) = P v with
// P = s rounded to T in registers (v: 128 x D). Inputs row-major, contiguous.
template <typename T, int D>
__global__ void __launch_bounds__(128) wgmma_tile_kernel(const T* q, const T* k, const T* v, float* s_out,
                                                         float* o_out, int variant) {
#if LLMK_HAS_WGMMA
  __shared__ int built_marker[4];
  if (threadIdx.x == 0) static_cast<volatile int*>(built_marker)[0] = 1;
  using namespace gpu::mma;
  namespace wg = gpu::wgmma;
  constexpr int kN = 128;
  extern __shared__ unsigned char smem_raw[];
  unsigned char* smem = gpu::mma::align_smem_1024(smem_raw);
  unsigned char* sQ = smem;
  unsigned char* sK = sQ + 64 * D * 2;
  unsigned char* sV = sK + kN * D * 2;
  load_swizzled<64, D, 128>(sQ, q, D, 0, 64);
  load_swizzled<kN, D, 128>(sK, k, D, 0, kN);
  load_swizzled<kN, D, 128>(sV, v, D, 0, kN);
  cp_async_commit();
  cp_async_wait<0>();
  wg::fence_proxy_async();
  __syncthreads();
  float s[kN / 2], o[D / 2];
#pragma unroll
  for (int i = 0; i < kN / 2; ++i) s[i] = 0.f;
#pragma unroll
  for (int i = 0; i < D / 2; ++i) o[i] = 0.f;
  wg::fence();
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    const uint64_t da = wg::make_desc(smem_u32(sQ) + (kk / 4) * (64 * 128) + (kk % 4) * 32, 16, 1024);
    const uint64_t db = wg::make_desc(smem_u32(sK) + (kk / 4) * (kN * 128) + (kk % 4) * 32, 16, 1024);
    wg::mma_ss<T, kN>(s, da, db, kk > 0 ? 1 : 0);
  }
  wg::commit();
  wg::wait<0>();
  wg::fence_regs(s);
  uint32_t pa[kN / 16][4];
#pragma unroll
  for (int kk = 0; kk < kN / 16; ++kk) {
    pa[kk][0] = pack2<T>(s[8 * kk + 0], s[8 * kk + 1]);
    pa[kk][1] = pack2<T>(s[8 * kk + 2], s[8 * kk + 3]);
    pa[kk][2] = pack2<T>(s[8 * kk + 4], s[8 * kk + 5]);
    pa[kk][3] = pack2<T>(s[8 * kk + 6], s[8 * kk + 7]);
  }
  wg::fence();
#pragma unroll
  for (int kk = 0; kk < kN / 16; ++kk)
    wg::mma_rs<T, D>(o, pa[kk],
                     variant == 1 ? wg::make_desc(smem_u32(sV) + kk * 16 * 128, 1024, kN * 128)
                                  : wg::make_desc(smem_u32(sV) + kk * 16 * 128, kN * 128, 1024),
                     1);
  wg::commit();
  wg::wait<0>();
  wg::fence_regs(o);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  for (int r = 0; r < 2; ++r) {
    const int row = warp * 16 + g + 8 * r;
    for (int j = 0; j < kN / 8; ++j)
      for (int e = 0; e < 2; ++e) s_out[row * kN + 8 * j + 2 * t + e] = s[4 * j + 2 * r + e];
    for (int j = 0; j < D / 8; ++j)
      for (int e = 0; e < 2; ++e) o_out[row * D + 8 * j + 2 * t + e] = o[4 * j + 2 * r + e];
  }
#else
  (void)q;
  (void)k;
  (void)v;
  (void)s_out;
  (void)o_out;
  (void)variant;
#endif
}

template <typename T, int D>
bool wgmma_tile_typed(const void* q, const void* k, const void* v, float* s, float* o, int variant) {
  auto kernel = wgmma_tile_kernel<T, D>;
  if (!gpu::tma::kernel_built(kernel)) return false;
  constexpr int kSmem = (64 + 2 * 128) * D * 2 + 1024;
  gpu::check(gpuFuncSetAttribute(kernel, gpuFuncAttributeMaxDynamicSharedMemorySize, kSmem), "wgmma_tile",
             "setting the shared memory size");
  kernel<<<1, 128, kSmem>>>(static_cast<const T*>(q), static_cast<const T*>(k), static_cast<const T*>(v), s, o,
                                 variant);
  gpu::check_launch("wgmma_tile");
  gpu::check(gpuDeviceSynchronize(), "wgmma_tile", "synchronizing");
  return true;
}

// ---------------------------------------------------------------- TMA tile self test (tests only)
// One 128-row x D tile (rows row0.. of a rows x D matrix with row stride `stride` elements) loaded
// twice into shared memory, by cp.async (load_swizzled, the layout wgmma reads) and by TMA through
// the "ws" tiling's tensor map; both byte images written out (128 * D * 2 bytes each).
template <typename T, int D>
__global__ void __launch_bounds__(128) tma_tile_kernel(const T* src, int64_t stride, int rows, int row0,
                                                       unsigned char* out_tma, unsigned char* out_cp,
                                                       const __grid_constant__ CUtensorMap map) {
#if LLMK_HAS_WGMMA
  __shared__ int built_marker[4];
  if (threadIdx.x == 0) static_cast<volatile int*>(built_marker)[0] = 1;
  using namespace gpu::mma;
  namespace tma = gpu::tma;
  constexpr int kBytes = 128 * D * 2;
  extern __shared__ unsigned char smem_raw[];
  unsigned char* smem = gpu::mma::align_smem_1024(smem_raw);
  unsigned char* s_tma = smem;
  unsigned char* s_cp = smem + kBytes;
  const uint32_t bar = smem_u32(smem + 2 * kBytes);
  for (int i = threadIdx.x; i < kBytes / 16; i += 128)  // poison the TMA image: every byte must be written
    reinterpret_cast<uint4*>(s_tma)[i] = make_uint4(0xA5A5A5A5u, 0xA5A5A5A5u, 0xA5A5A5A5u, 0xA5A5A5A5u);
  if (threadIdx.x == 0) {
    tma::mbar_init(bar, 1);
    tma::fence_mbar_init();
  }
  gpu::wgmma::fence_proxy_async();  // the poison stores before the TMA writes
  __syncthreads();
  if (threadIdx.x == 0) {
    tma::mbar_arrive_expect_tx(bar, kBytes);
    for (int cb = 0; cb < D / 64; ++cb) tma::load_4d(smem_u32(s_tma) + cb * 128 * 128, &map, bar, cb * 64, row0, 0, 0);
  }
  load_swizzled<128, D, 128>(s_cp, src, stride, row0, rows);
  cp_async_commit();
  cp_async_wait<0>();
  tma::mbar_wait(bar, 0);
  __syncthreads();
  for (int i = threadIdx.x; i < kBytes / 16; i += 128) {
    reinterpret_cast<uint4*>(out_tma)[i] = reinterpret_cast<const uint4*>(s_tma)[i];
    reinterpret_cast<uint4*>(out_cp)[i] = reinterpret_cast<const uint4*>(s_cp)[i];
  }
#else
  (void)src;
  (void)stride;
  (void)rows;
  (void)row0;
  (void)out_tma;
  (void)out_cp;
  (void)map;
#endif
}

template <typename T, int D>
bool tma_tile_typed(const void* src, int64_t stride, int rows, int row0, void* out_tma, void* out_cp) {
  auto kernel = tma_tile_kernel<T, D>;
  if (!gpu::tma::kernel_built(kernel)) return false;
  CUtensorMap map{};
  const int64_t strides[3] = {0, stride, 0};
  if (!gpu::tma::make_tensor_map(&map, std::is_same_v<T, half>, src, D, rows, 1, 1, strides, 128)) return false;
  constexpr int kSmem = 2 * 128 * D * 2 + 1024 + 64;
  gpu::check(gpuFuncSetAttribute(kernel, gpuFuncAttributeMaxDynamicSharedMemorySize, kSmem), "tma_tile",
             "setting the shared memory size");
  kernel<<<1, 128, kSmem>>>(static_cast<const T*>(src), stride, rows, row0, static_cast<unsigned char*>(out_tma),
                            static_cast<unsigned char*>(out_cp), map);
  gpu::check_launch("tma_tile");
  gpu::check(gpuDeviceSynchronize(), "tma_tile", "synchronizing");
  return true;
}

#endif  // LLMK_MMA_SYNC_BUILD

}  // namespace

bool attention_hopper(const AttentionParams& p) {
#if LLMK_MMA_SYNC_BUILD
  if (!gpu::tma::is_sm90(p.device.index)) return false;
  const bool f16 = p.dtype == DType::f16, bf16 = p.dtype == DType::bf16;
  if (p.head_dim == 64 && f16) return launch_hopper_typed<half, 64>(p);
  if (p.head_dim == 64 && bf16) return launch_hopper_typed<bfloat16, 64>(p);
  if (p.head_dim == 128 && f16) return launch_hopper_typed<half, 128>(p);
  if (p.head_dim == 128 && bf16) return launch_hopper_typed<bfloat16, 128>(p);
#else
  (void)p;
#endif
  return false;
}

HopperStatus hopper_status_gpu(int device) {
#if LLMK_MMA_SYNC_BUILD
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || device >= count) {
    (void)cudaGetLastError();
    return HopperStatus::no_device;
  }
  if (!gpu::tma::is_sm90(device)) return HopperStatus::not_sm90;
  int previous = 0;
  gpu::check(cudaGetDevice(&previous), "attention", "cudaGetDevice");
  gpu::check(cudaSetDevice(device), "attention", "cudaSetDevice");
  const bool built = gpu::tma::kernel_built(attention_wgmma_kernel<half, HopperDefault<128>, false>);
  gpu::check(cudaSetDevice(previous), "attention", "cudaSetDevice");
  return built ? HopperStatus::available : HopperStatus::not_built;
#else
  (void)device;
  return HopperStatus::no_device;
#endif
}

bool wgmma_tile_selftest_gpu(DType dtype, int d, const void* q, const void* k, const void* v, float* s, float* o,
                             int variant) {
#if LLMK_MMA_SYNC_BUILD
  if (dtype == DType::f16 && d == 64) return wgmma_tile_typed<half, 64>(q, k, v, s, o, variant);
  if (dtype == DType::f16 && d == 128) return wgmma_tile_typed<half, 128>(q, k, v, s, o, variant);
  if (dtype == DType::bf16 && d == 64) return wgmma_tile_typed<bfloat16, 64>(q, k, v, s, o, variant);
  if (dtype == DType::bf16 && d == 128) return wgmma_tile_typed<bfloat16, 128>(q, k, v, s, o, variant);
#else
  (void)dtype;
  (void)d;
  (void)q;
  (void)k;
  (void)v;
  (void)s;
  (void)o;
  (void)variant;
#endif
  return false;
}

int64_t hopper_ws_launches_gpu() {
#if LLMK_MMA_SYNC_BUILD
  return g_ws_launches.load(std::memory_order_relaxed);
#else
  return 0;
#endif
}

bool hopper_ws_timed_out_gpu() {
#if LLMK_MMA_SYNC_BUILD
  return gpu::tma::take_mbar_timed_out();
#else
  return false;
#endif
}

bool tma_tile_selftest_gpu(DType dtype, int d, const void* src, int64_t stride, int rows, int row0, void* out_tma,
                           void* out_cp) {
#if LLMK_MMA_SYNC_BUILD
  if (dtype == DType::f16 && d == 64) return tma_tile_typed<half, 64>(src, stride, rows, row0, out_tma, out_cp);
  if (dtype == DType::f16 && d == 128) return tma_tile_typed<half, 128>(src, stride, rows, row0, out_tma, out_cp);
  if (dtype == DType::bf16 && d == 64) return tma_tile_typed<bfloat16, 64>(src, stride, rows, row0, out_tma, out_cp);
  if (dtype == DType::bf16 && d == 128) return tma_tile_typed<bfloat16, 128>(src, stride, rows, row0, out_tma, out_cp);
#else
  (void)dtype, (void)d, (void)src, (void)stride, (void)rows, (void)row0, (void)out_tma, (void)out_cp;
#endif
  return false;
}

}  // namespace llmk::detail
