// Monarch forward for few tokens (decode): each stage as a block-diagonal skinny GEMM that
// streams its factor once across the whole GPU (NVIDIA sm_80+, fp16/bf16).
//
// At up to 16 tokens the forward is bound by reading w1 and w2, not by arithmetic, and the tiled
// and cluster kernels (token tiles x output tiles) leave most SMs idle: at n = 4096 with 4 blocks
// they give 32 CTAs for 16.8 MB of weights. Here a stage is R[b, g, nn] = sum_kk A[b, g*K + kk] *
// W[g, nn, kk] for blocks g < G, W (G, N, K) contiguous, and runs as gemm_deep_kernel runs a skinny
// GEMM (the shared loop of gemm/deep_stream.h): a warp owns 16 rows nn of one block g and a 1/sk
// slice of its K, streams those W rows with 8 independent 16-byte loads per lane per trip, and
// multiplies them by the 16 (MH = 2) or 8 (MH = 1) token rows on mma.sync m16n8k16 with fp32
// accumulation. 8 warps per CTA; sk warps of a CTA split K for the same 16 rows and add their
// sums through shared memory; sk is chosen on the host as for the skinny GEMM (the largest split
// whose CTAs fit one wave, else 8-way over several waves for long K). Each result is stored, rounded to
// the dtype, at out[b, (j % L) * R + j / L] with j = g*N + nn: stage 1 (L, R) = (l, r) writes y
// already in stage 2's order Z[b, u, t] = y[b, t*l + u] (z[b, u*r + t]) into the workspace, and
// stage 2 (L, R) = (s, l) writes out[b, v*l + u]. Two launches; z costs tokens x k*q elements of
// workspace (monarch_skinny_bytes). On sm_90+ stage 2 is a programmatic dependent launch: its blocks
// start as stage 1's retire, prefetch their w2 slices into L2 and then wait for z (H200, 16 tokens,
// CUDA-graph GPU times: 1.0-1.6 us less per forward, e.g. 12.3 against 13.4 us at n = 4096 with 4
// blocks; LLMK_MONARCH_SKINNY_PDL=0 launches it plainly).
#include <cstdint>
#include <cstdlib>

#include "core/check.h"
#include "gemm/deep_stream.h"
#include "gpu/compat.h"
#include "gpu/mma.h"
#include "gpu/runtime.h"
#include "monarch/monarch_internal.h"

namespace llmk::detail {

using gpu::bfloat16;
using gpu::half;

namespace {

// One stage of the few-token forward (see the top of the file).
struct SkinnyStage {
  const void* in = nullptr;  // tokens rows of G*K inputs (block g at column g*K), row stride in_rs
  int64_t in_rs = 0;
  const void* w = nullptr;   // (G, N, K) contiguous
  void* out = nullptr;       // row stride out_rs; result j = g*N + nn at column (j % L) * R + j / L
  int64_t out_rs = 0;
  int G = 0, N = 0, K = 0, L = 1, R = 1;
  int tokens = 0;            // <= 16
  bool after_stage1 = false; // stage 2 launched with PDL: prefetch W to L2, then wait for stage 1
};

#if LLMK_MMA_SYNC_BUILD
constexpr int kSkinnyWarps = 8;  // (deep_split plans blocks of 8 warps)
static_assert(kSkinnyWarps == 8);
constexpr int kSkinnyU = 4;  // K steps of 32 per trip (8 W loads per lane in flight)

template <typename T, int MH>
__global__ void __launch_bounds__(kSkinnyWarps * 32, MH == 1 ? 3 : 2) monarch_skinny_kernel(SkinnyStage s, int sk) {
#if LLMK_HAS_MMA_SYNC
  __shared__ float red[kSkinnyWarps * 16 * 16];  // [warp][token 16][row 16] (sk > 1)
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane >> 2, tq = lane & 3;
  const int cg = warp / sk, ks = warp % sk, cpb = kSkinnyWarps / sk;
  const int groups = (s.N + 15) / 16;  // 16-row groups per block
  const int64_t item = static_cast<int64_t>(blockIdx.x) * cpb + cg;
  const bool live = item < static_cast<int64_t>(s.G) * groups;  // warp-uniform
  const int blk = live ? static_cast<int>(item / groups) : 0, row0 = live ? static_cast<int>(item % groups) * 16 : 0;
  // rows past N read row row0 and tokens past s.tokens read token 0: their results are dropped
  const T* w = static_cast<const T*>(s.w) + static_cast<int64_t>(blk) * s.N * s.K;
  const T* const wlo[1] = {w + static_cast<int64_t>(row0 + g < s.N ? row0 + g : row0) * s.K};
  const T* const whi[1] = {w + static_cast<int64_t>(row0 + g + 8 < s.N ? row0 + g + 8 : row0) * s.K};
  const T* xr[MH];
#pragma unroll
  for (int h = 0; h < MH; ++h)
    xr[h] = static_cast<const T*>(s.in) + (h * 8 + g < s.tokens ? h * 8 + g : 0) * s.in_rs + static_cast<int64_t>(blk) * s.K;
  int per = (s.K + sk - 1) / sk;
  per = (per + 31) / 32 * 32;
  const int kb = ks * per, ke = kb + per < s.K ? kb + per : s.K;
  gpu::Vec<T, 8> zero;
#pragma unroll
  for (int i = 0; i < 8; ++i) zero.v[i] = gpu::from_float<T>(0.f);
  float acc[1][MH][4];
#pragma unroll
  for (int h = 0; h < MH; ++h) acc[0][h][0] = acc[0][h][1] = acc[0][h][2] = acc[0][h][3] = 0.f;
  gpu::pdl_trigger();  // stage 1: stage 2's blocks may start as this grid's retire
  if (s.after_stage1) {  // its W does not depend on stage 1: into L2 before the wait
    if (live)
      for (int k = kb + tq * 64; k < ke; k += 256) {  // the 4 lanes of a row take alternate 128-byte lines
        gpu::prefetch_l2(wlo[0] + k);
        gpu::prefetch_l2(whi[0] + k);
      }
    gpu::pdl_wait();
  }
  if (live && kb < ke)
    deep_stream<T, 1, MH, kSkinnyU>(wlo, whi, xr, kb, ke, tq, gpu::l2_evict_first_policy(), zero, acc,
                                     [](gpu::Vec<T, 8>(&)[MH], int, bool) {});

  // result (token m, row nn) of block g, rounded, at its place in the stage's output order
  const auto store = [&](int m, int g_, int nn, float v) {
    const int j = g_ * s.N + nn;  // < 2^31 (the host checks G*N*K)
    static_cast<T*>(s.out)[m * s.out_rs + (j % s.L) * s.R + j / s.L] = gpu::from_float<T>(v);
  };
  if (sk == 1) {  // (uniform over the grid: no barrier on this path)
    if (!live) return;
#pragma unroll
    for (int h = 0; h < MH; ++h)
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const int m = h * 8 + 2 * tq + (r & 1), nn = row0 + g + (r >> 1) * 8;
        if (m < s.tokens && nn < s.N) store(m, blk, nn, acc[0][h][r]);
      }
    return;
  }
#pragma unroll
  for (int h = 0; h < MH; ++h)
#pragma unroll
    for (int r = 0; r < 4; ++r) red[(warp * 16 + h * 8 + 2 * tq + (r & 1)) * 16 + g + (r >> 1) * 8] = acc[0][h][r];
  __syncthreads();  // (MH = 1: tokens 8..15 of red stay unwritten and are never read, tokens <= 8)
  for (int e = threadIdx.x; e < cpb * s.tokens * 16; e += kSkinnyWarps * 32) {
    const int grp = e / (s.tokens * 16), m = e / 16 % s.tokens, i = e % 16;
    const int64_t it = static_cast<int64_t>(blockIdx.x) * cpb + grp;
    const int nn = static_cast<int>(it % groups) * 16 + i;
    if (it >= static_cast<int64_t>(s.G) * groups || nn >= s.N) continue;
    float v = 0.f;
    for (int k = 0; k < sk; ++k) v += red[((grp * sk + k) * 16 + m) * 16 + i];
    store(m, static_cast<int>(it / groups), nn, v);
  }
#else
  (void)s;
  (void)sk;
#endif
}

template <typename T, int MH>
int skinny_occupancy() {
  static const int cached = gpu::resident_blocks_or(monarch_skinny_kernel<T, MH>, kSkinnyWarps * 32, 0, 1);
  return cached;
}

// K split (sk warps per 16-row group) as for the skinny GEMM's deep kernel (deep_split).
template <typename T, int MH>
void launch_stage(const MonarchParams& p, const SkinnyStage& s) {
  const int64_t groups = static_cast<int64_t>(s.G) * ((s.N + 15) / 16);
  const int64_t slots = static_cast<int64_t>(skinny_occupancy<T, MH>()) * gpu::multiprocessor_count(p.device.index);
  const int sk = deep_split(groups, s.K / (32 * kSkinnyU), slots, MH == 2);
  const int64_t ctas = (groups * sk + kSkinnyWarps - 1) / kSkinnyWarps;
  gpu::launch(monarch_skinny_kernel<T, MH>, dim3(static_cast<unsigned>(ctas)), dim3(kSkinnyWarps * 32), 0,
              gpu::as_stream(p.stream), s.after_stage1, s, sk);
  gpu::check_launch("monarch_matmul");
}

template <typename T>
void run_stage(const MonarchParams& p, const SkinnyStage& s) {
  if (s.tokens > 8) launch_stage<T, 2>(p, s);
  else launch_stage<T, 1>(p, s);
}

// Stage 1 into the workspace (z, in stage 2's order), then stage 2 into out.
template <typename T>
void run_skinny(const MonarchParams& p) {
  const int64_t mid = p.mid();
  SkinnyStage s1;
  s1.in = p.x;
  s1.in_rs = p.x_stride;
  s1.w = p.w1;
  s1.out = p.workspace;
  s1.out_rs = mid;
  s1.G = static_cast<int>(p.k), s1.N = static_cast<int>(p.q), s1.K = static_cast<int>(p.p);
  s1.L = static_cast<int>(p.l), s1.R = static_cast<int>(p.r);
  s1.tokens = static_cast<int>(p.tokens);
  run_stage<T>(p, s1);
  SkinnyStage s2;
  s2.in = p.workspace;
  s2.in_rs = mid;
  s2.w = p.w2;
  s2.out = p.out;
  s2.out_rs = p.out_stride;
  s2.G = static_cast<int>(p.l), s2.N = static_cast<int>(p.s), s2.K = static_cast<int>(p.r);
  s2.L = static_cast<int>(p.s), s2.R = static_cast<int>(p.l);
  s2.tokens = static_cast<int>(p.tokens);
  // stage 2 launches while stage 1 runs (programmatic dependent launch, sm_90+; a plain launch
  // elsewhere) unless LLMK_MONARCH_SKINNY_PDL=0
  s2.after_stage1 = gpu::env_flag("LLMK_MONARCH_SKINNY_PDL", true);
  run_stage<T>(p, s2);
}
#endif

}  // namespace

bool monarch_skinny_shape(const MonarchParams& p) {
#if LLMK_MMA_SYNC_BUILD
  return p.tokens > 0 && p.tokens <= kMonarchSkinnyTokens && (p.dtype == DType::f16 || p.dtype == DType::bf16) &&
         p.p % 8 == 0 && p.r % 8 == 0 && p.k * p.q * p.p < (int64_t{1} << 31) && p.l * p.s * p.r < (int64_t{1} << 31) &&
         gpu::env_flag("LLMK_MONARCH_SKINNY", true) && gpu::mma::available(p.device.index);
#else
  (void)p;
  return false;
#endif
}

bool monarch_skinny_forward(const MonarchParams& p) {
#if LLMK_MMA_SYNC_BUILD
  if (!monarch_skinny_shape(p) || p.x_stride % 8 != 0 || !aligned16(p.x) || !aligned16(p.w1) || !aligned16(p.w2) ||
      !aligned16(p.workspace) || p.workspace_bytes < monarch_skinny_bytes(p))
    return false;
  if (p.dtype == DType::f16) run_skinny<half>(p);
  else run_skinny<bfloat16>(p);
  return true;
#else
  (void)p;
  return false;
#endif
}

}  // namespace llmk::detail
