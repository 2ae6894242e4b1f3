// Skinny GEMM on the GPU (one source for CUDA and HIP, through src/gpu/): y = x W^T (+ bias),
// optionally silu(gate) * up, for x of up to 16 rows (larger M runs in groups of rows).
//
// gemm_deep_kernel (NVIDIA sm_80+ with LLMK_GEMM_KERNEL=deep; kernel choice: env_kernel below):
//   W is the A operand of mma.sync m16n8k16 (16 W rows = 16 output columns per warp) and x the B
//   operand (8 rows of x; a second B for rows 8..15 only when M > 8), so x costs one 16-byte L1
//   load per 32 of K instead of two and M <= 8 wastes nothing on empty x rows. Per loop trip a lane
//   issues 8 independent 16-byte W loads (rows g and g + 8 of the warp's 16, 4 K steps of 32; gate
//   and up rows for swiglu, 2 K steps) before the first mma.sync: 4 KB in flight per warp, up to 96 KB
//   per SM (sm_90 ptxas, CUDA 13.0: 80 registers at M <= 8, 3 blocks of 8 warps per SM; 110-118 registers,
//   2 blocks, at M > 8). W loads skip L1, mark L2 lines evict-first and prefetch 256 bytes
//   (gpu::load_once). Rows past N or past M are read from row 0 and their results dropped (no
//   masks in the loop); only the last partial trip of a K slice has bounds checks. sk warps split
//   K per 16-column group (8 / sk groups per 8-warp block, or one group per 16-warp block with
//   sk = 16), sk chosen on the host as the largest split whose blocks still fit in one wave of
//   resident blocks (every warp starts at once with the same bytes to read: no tail wave), or
//   sk = 8 over more than 4 waves where not even sk = 2 fits one (large N: 8192 x 28672; at
//   M > 8 only with 8 trips a warp or more);
//   sk = 1 stores straight from the accumulators, sk > 1 adds the slices in shared memory (one
//   barrier). Grid = the blocks of that plan (no persistent loop). LLMK_GEMM_DEEP_SPLIT forces sk,
//   LLMK_GEMM_DEEP_LOADS=16 16 W loads per lane per trip instead of 8 at M <= 8 (tuning knobs, read
//   per call).
//   On Hopper (gpu::launch; LLMK_PDL=0 turns it off) it is launched with programmatic dependent
//   launch: each warp loads its first trip of a fixed weight (GemmOptions::fixed_weight) into
//   registers, or asks L2 for it (any other weight: read after the wait), then waits for the kernel
//   before it (which writes x); the next kernel may launch once every warp has streamed its W, but
//   at the start of one-wave gate/up launches and 16-warp launches (LLMK_GEMM_PDL_LATE: at the
//   start always, where the grid is one wave, or for other roles; gemm/pdl_trigger.h).
// gemm_stream_kernel (NVIDIA sm_80+ with LLMK_GEMM_STREAM=1; measured slower than gemm_mma_kernel at
//   every benchmarked shape on the H200, bench/results/h200-decode.md, so not the default): the
//   weight-streaming kernel.
//   A block of 8 warps (16 with SK = 16, for N too small to give every SM enough warps) works on a tile of CPB = 8 / SK column groups (8 output columns each, 8
//   gate + 8 up rows for swiglu); the SK warps of a column group split K (SK = 8 for small N, down
//   to SK = 1 for N >= ~28k, chosen on the host so that the tiles fill about one wave of resident
//   blocks). Per loop trip each lane issues 4 independent 16-byte evict-first W loads (kUnroll =
//   4 / NT K steps of 32) before any mma.sync consumes them: 2 KB in flight per warp, ~64 KB per
//   SM. Rows of x 8..15 are not loaded at all when M <= 8 (template HALF). SK = 1 stores straight
//   from the accumulator fragments; SK > 1 reduces through shared memory. The grid is at
//   most the resident blocks and blocks loop over tiles (persistent), each block the same number
//   of tiles, so no partial second wave of short blocks.
// gemm_tma_kernel (Hopper, sm_90a; K a multiple of 64, no RMSNorm prologue; the default for one
//   row of x against a weight of 40M elements or more since 2026-12-07, LLMK_GEMM_KERNEL=tma
//   everywhere it applies; see the kernel and default_kernel below): W by the bulk tensor copy
//   engine, split-K merged in thread block clusters. Measured on the H200 (2026-12-01,
//   bench-decode): 127.4 us at M = 1, 8192 x 28672 (deep 129.6, cuBLAS 123.8; 122.6 against 123.9
//   and 129.2 in scripts/gemm_sweep.py) but 138.5 at M = 16 and 18.0-20.0 us at 4096 x 4096
//   (deep 15.6-17.0); its first layout (128-row boxes of 128 bytes per row) took 146.7 us at the
//   large shape.
// The first kernels (gemm_mma_kernel on NVIDIA sm_80+, the portable one elsewhere):
// Both kernels: a block of 8 warps owns 8 output columns (NT = 1: W rows col0..col0+7; NT = 2,
// swiglu: those gate rows and the matching up rows), and splits K between its warps, so that even
// N = 4096 gives thousands of warps streaming W. Each warp reads its W rows once with 16-byte
// streaming loads (x through L1, it is tiny and shared by every block), the warps' partial sums
// meet in shared memory and the epilogue adds the bias, applies the activation and stores.
//   gemm_mma_kernel (LLMK_HAS_MMA_SYNC: NVIDIA sm_80+): per step a warp multiplies 16 rows of x by
//     8 W rows over 32 of K with two mma.sync m16n8k16 (fp32 accumulate). Lane (g, tig) loads 8
//     consecutive K elements of W row g (16 bytes) and of x rows g and g + 8; the MMA's K order is
//     permuted alike for A and B, so no shuffles are needed.
//   gemm_portable_kernel (everything else, and NVIDIA on request): lanes split K in 16-byte chunks
//     (or single elements when K is not a multiple of 8), fp32 FMAs for up to 16 rows of x in one
//     pass (3-16 rows: warp groups of 4 W rows each, see the kernel) into per-lane sums, then a
//     reduce-scatter butterfly.
// Decode-step fusions (deep, mma and portable kernels; the stream kernel hands them to mma):
//   RMSNorm prologue (p.norm_w), two ways (NormMode): fp16 and the portable kernel first compute
//   the rstd of their x rows (a warp per row, into shared memory; the deep kernel has its first
//   trip of W on the way meanwhile, into registers for a fixed weight, else to L2), then normalise
//   every x element as it is loaded, rounded to T as rms_norm rounds it. bf16 on the tensor-core
//   kernels defers it: the operand is T(x * (offset + w)), each lane sums the squares of the x it
//   loads anyway, and the rstd scales the sums in the epilogue, where the warps' partial sums meet
//   (no round trip before the weights stream; one rounding of the operand as before, at a
//   different scale).
//   Residual epilogue (p.residual): the stored value is T(T(y) + residual) (out_value).
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <string_view>
#include <type_traits>

#include "activation/activation_math.h"
#include "core/check.h"
#include "gemm/deep_stream.h"
#include "gemm/gemm_internal.h"
#include "gemm/kernel_setting.h"
#include "gemm/pdl_trigger.h"
#include "gpu/compat.h"
#include "gpu/mma.h"
#include "gpu/runtime.h"
#include "gpu/tensor_map.h"
#include "gpu/tma.h"
#include "rope/rope_math.h"  // rotate_pair

namespace llmk::detail {

using gpu::bfloat16;
using gpu::half;

namespace {

constexpr int kWarps = 8;
constexpr int kRowsMma = 16;
static_assert(kRowsMma == kMaxTmaRows, "LLMK_GEMM_TMA_ROWS's limit is one launch's rows");
std::atomic<int64_t> g_rope_kv_launches{0};  // skinny_gemm_rope_kv's fused launches (tests ask)
std::atomic<int64_t> g_tma_tail_launches{0};  // the TMA kernel's split-tail launches (tests ask)
std::atomic<int64_t> g_tma_calls{0};  // products the TMA kernel ran (tests ask which kernel ran)
[[maybe_unused]] constexpr int kUnroll = 2;  // 32-wide K steps per loop trip of the mma kernel (registers: 4 blocks/SM)

// ---- The decode-step fusions (GemmParams::norm_w, ::residual), shared by every kernel.
// The rstd of an x row from the sum of its squares (fp32, as rms_norm computes it).
__device__ __forceinline__ float rstd_of(const GemmParams& p, float sum_squares) {
  return gpu::rsqrt(sum_squares / static_cast<float>(p.k) + p.norm_eps);
}

// RMSNorm prologue, statistics: rstd[m] of x rows m0 .. m0 + mrows - 1 into shared memory (warp w
// sums rows w, w + warps, ...; fp32 sums and rsqrt as rms_norm computes them). The caller syncs.
template <typename T, int VW>
__device__ void norm_rstd(const GemmParams& p, int64_t m0, int mrows, float* rstd) {
  constexpr int WS = LLMK_WARP_SIZE;
  const int warp = threadIdx.x / WS, lane = threadIdx.x % WS, warps = blockDim.x / WS;
  const T* x = static_cast<const T*>(p.x);
  for (int m = warp; m < mrows; m += warps) {
    const T* row = x + (m0 + m) * p.x_stride;
    float s = 0.f;
#pragma unroll 4
    for (int64_t k = lane * VW; k < p.k; k += WS * VW) {
      float v[VW];
      gpu::load_float<T, VW>(row + k, v);
#pragma unroll
      for (int i = 0; i < VW; ++i) s += v[i] * v[i];
    }
    s = gpu::warp_reduce_sum(s);
    if (lane == 0) rstd[m] = rstd_of(p, s);
  }
}

// RMSNorm prologue, applied: VW elements of an x row at k (as floats) become x * rstd * (offset +
// w), rounded to T, as rms_norm writes them.
template <typename T, int VW>
__device__ __forceinline__ void norm_apply(const GemmParams& p, int64_t k, float rstd, float (&x)[VW]) {
  float w[VW];
  gpu::load_float<T, VW>(static_cast<const T*>(p.norm_w) + k, w);
#pragma unroll
  for (int i = 0; i < VW; ++i) x[i] = gpu::to_float(gpu::from_float<T>(x[i] * rstd * (p.norm_offset + w[i])));
}

// Sum of the squares of 8 elements kept in T.
template <typename T>
__device__ __forceinline__ float sum_squares(const gpu::Vec<T, 8>& x) {
  float f[8];
  gpu::to_float(x, f);
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < 8; ++i) s += f[i] * f[i];
  return s;
}

// The same on 8 elements kept in T (the tensor-core kernels' operand registers), with the 8
// norm weights already loaded (w).
template <typename T>
__device__ __forceinline__ void norm_apply(const GemmParams& p, const gpu::Vec<T, 8>& w, float rstd,
                                           gpu::Vec<T, 8>& x) {
  float f[8], wf[8];
  gpu::to_float(x, f);
  gpu::to_float(w, wf);
#pragma unroll
  for (int i = 0; i < 8; ++i) f[i] = f[i] * rstd * (p.norm_offset + wf[i]);
  x = gpu::from_float<T, 8>(f);
}

// How a tensor-core kernel runs the RMSNorm prologue (template NM): none; PRE, the rows' rstd first
// (a block-wide pass over x and a barrier before the product), x normalised as it is loaded; or
// DEFER (bf16: its range is fp32's), the product taken of T(x * (offset + w)) while each lane sums
// the squares of the x it loads anyway, and the rstd applied to the sums in the epilogue, where the
// warps' partial sums meet: no extra round trip before the weights stream. fp16 takes PRE, as
// x * w could overflow its range where the normalised value does not.
enum NormMode : int { kNoNorm = 0, kNormPre = 1, kNormDefer = 2 };
template <typename T>
constexpr int norm_mode_for() {
  return std::is_same_v<T, bfloat16> ? kNormDefer : kNormPre;
}

// DEFER: the sums of squares of x rows g and g + 8 of this lane (one per row, `n` of them), summed
// over the 4 lanes of a quad (lanes 4 g .. 4 g + 3 hold the same rows' other K elements).
template <int N>
__device__ __forceinline__ void quad_sum(float (&ssq)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) {
    ssq[i] += gpu::shfl_xor(ssq[i], 1);
    ssq[i] += gpu::shfl_xor(ssq[i], 2);
  }
}

// An output element: y rounded to T, then (residual epilogue) plus the residual, rounded again.
template <typename T>
__device__ __forceinline__ T out_value(const GemmParams& p, int64_t row, int64_t col, float y) {
  const T v = gpu::from_float<T>(y);
  if (p.residual == nullptr) return v;
  return gpu::from_float<T>(gpu::to_float(v) + gpu::to_float(static_cast<const T*>(p.residual)[row * p.residual_stride + col]));
}

// A product sum y times scale (the deferred RMSNorm's rstd, else 1) plus the bias b, rounded once:
// an explicit fma, so that every kernel (and skinny_gemm_rope_kv's epilogue beside skinny_gemm's)
// rounds it alike whatever the compiler would contract (a product then a conditional add was
// fused in one kernel and not in another: 1-ulp differences between them, 2026-12-06).
__device__ __forceinline__ float scaled_plus_bias(float y, float scale, bool has_bias, float b) {
  return has_bias ? fmaf(y, scale, b) : y * scale;
}

// Stores output (row, col) from its product sums: y (NT = 2: the gate's) times scale plus the
// bias (scaled_plus_bias), and for the gated activations silu(y) or gelu_tanh(y) times (up the
// same way, with the up bias), through out_value. Every kernel's last step.
template <typename T, int NT>
__device__ __forceinline__ void store_out(const GemmParams& p, int64_t row, int64_t col, int64_t out_cols, float y,
                                          float up, float scale = 1.f) {
  const T* bias = static_cast<const T*>(p.bias);
  y = scaled_plus_bias(y, scale, bias != nullptr, bias ? gpu::to_float(bias[col]) : 0.f);
  if constexpr (NT == 2) {
    up = scaled_plus_bias(up, scale, bias != nullptr, bias ? gpu::to_float(bias[out_cols + col]) : 0.f);
    y = p.activation == GemmActivation::geglu_tanh ? ActivationFn<2>::value(y) * up : y / (1.f + __expf(-y)) * up;
  }
  static_cast<T*>(p.out)[row * p.out_stride + col] = out_value<T>(p, row, col, y);
}

// red: [warp slot][W row of the block][x row] partial sums, slots of them per W row; ssq (DEFER):
// [warp][x row] partial sums of squares of x, or nullptr.
template <typename T, int NT>
__device__ __forceinline__ void epilogue(const GemmParams& p, const float* red, int64_t m0, int mrows,
                                         int64_t col0, const float* ssq = nullptr, int slots = kWarps) {
  const int64_t out_cols = NT == 2 ? p.n / 2 : p.n;
  for (int e = threadIdx.x; e < mrows * 8; e += blockDim.x) {
    const int m = e / 8, j = e % 8;
    const int64_t col = col0 + j;
    if (col >= out_cols) continue;
    float g = 0.f, u = 0.f, rstd = 1.f;
    for (int w = 0; w < slots; ++w) g += red[(w * NT * 8 + j) * kRowsMma + m];
    if constexpr (NT == 2)
      for (int w = 0; w < slots; ++w) u += red[(w * NT * 8 + 8 + j) * kRowsMma + m];
    if (ssq) {
      float s = 0.f;
      for (int w = 0; w < kWarps; ++w) s += ssq[w * kRowsMma + m];
      rstd = rstd_of(p, s);
    }
    store_out<T, NT>(p, m0 + m, col, out_cols, g, u, rstd);
  }
}

// K range of warp `warp` of `parts`: slices of ceil(K / parts) rounded up to `granule`.
__device__ __forceinline__ void warp_slice(int64_t k, int warp, int granule, int64_t& kb, int64_t& ke,
                                           int parts = kWarps) {
  int64_t per = (k + parts - 1) / parts;
  per = (per + granule - 1) / granule * granule;
  kb = warp * per;
  ke = kb + per < k ? kb + per : k;
}

// NM: the RMSNorm prologue's NormMode (a template value, so that the plain kernel keeps its registers).
// (3 blocks per SM with the prologue: at 4 its registers spill.)
template <typename T, int NT, int NM = kNoNorm>
__global__ void __launch_bounds__(kWarps * 32, NM == kNoNorm ? 4 : 3) gemm_mma_kernel(GemmParams p, int64_t m0, int mrows) {
#if LLMK_HAS_MMA_SYNC
  using V8 = gpu::Vec<T, 8>;
  __shared__ float red[kWarps * NT * 8 * kRowsMma];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane >> 2, tig = lane & 3;
  const int64_t out_cols = NT == 2 ? p.n / 2 : p.n;
  const int64_t col0 = static_cast<int64_t>(blockIdx.x) * 8;
  const bool col_ok = col0 + g < out_cols;
  const T* w = static_cast<const T*>(p.w);
  const T* wrow[NT];
#pragma unroll
  for (int t = 0; t < NT; ++t) wrow[t] = w + (t * out_cols + col0 + (col_ok ? g : 0)) * p.w_stride;
  const T* x = static_cast<const T*>(p.x);
  const bool x0_ok = g < mrows, x1_ok = g + 8 < mrows;
  const T* x0 = x + (m0 + (x0_ok ? g : 0)) * p.x_stride;
  const T* x1 = x + (m0 + (x1_ok ? g + 8 : 0)) * p.x_stride;
  int64_t kb, ke;
  warp_slice(p.k, warp, 32, kb, ke);
  gpu::pdl_begin();  // PDL (gpu::launch): inputs only after the previous kernel
  __shared__ float rstd[NM == kNormDefer ? kWarps * kRowsMma : kRowsMma];  // PRE: rstd; DEFER: [warp][row] sums
  float rs0 = 1.f, rs1 = 1.f;  // PRE: rstd of x rows g and g + 8
  float ssq[2] = {0.f, 0.f};   // DEFER: sums of squares of this lane's x of rows g and g + 8
  if constexpr (NM == kNormPre) {
    norm_rstd<T, 8>(p, m0, mrows, rstd);
    __syncthreads();
    rs0 = rstd[x0_ok ? g : 0];
    rs1 = rstd[x1_ok ? g + 8 : 0];
  }

  float acc[NT][4];
#pragma unroll
  for (int t = 0; t < NT; ++t) acc[t][0] = acc[t][1] = acc[t][2] = acc[t][3] = 0.f;
  V8 zero;
#pragma unroll
  for (int i = 0; i < 8; ++i) zero.v[i] = gpu::from_float<T>(0.f);

  for (int64_t base = kb; base < ke; base += 32 * kUnroll) {
    V8 wv[NT][kUnroll], xa[kUnroll], xb[kUnroll], nw[NM == kNoNorm ? 1 : kUnroll];
#pragma unroll
    for (int j = 0; j < kUnroll; ++j) {
      const int64_t kk = base + j * 32 + tig * 8;
      const bool ok = kk < ke;
#pragma unroll
      for (int t = 0; t < NT; ++t)
        wv[t][j] = ok && col_ok ? gpu::load_vec<T, 8, gpu::Cache::stream>(wrow[t] + kk) : zero;
      xa[j] = ok && x0_ok ? gpu::load_vec<T, 8>(x0 + kk) : zero;
      xb[j] = ok && x1_ok ? gpu::load_vec<T, 8>(x1 + kk) : zero;
      if constexpr (NM != kNoNorm) nw[j] = ok ? gpu::load_vec<T, 8>(static_cast<const T*>(p.norm_w) + kk) : zero;
    }
#pragma unroll
    for (int j = 0; j < kUnroll; ++j) {
      // RMSNorm prologue (its weights came with the trip's other loads). This kernel took 27.8-28.8
      // us with it for the 1B model's gate/up (2048 x 16384) against 19.5 us without, whether the
      // norm ran here, in the load loop or as a pre-pass (H200, 2026-12-01; cause not found), so
      // by default the deep kernel runs the prologue (default_kernel).
      if constexpr (NM != kNoNorm) {
        if (x0_ok) {
          if constexpr (NM == kNormDefer) ssq[0] += sum_squares(xa[j]);
          norm_apply<T>(p, nw[j], rs0, xa[j]);
        }
        if (x1_ok) {
          if constexpr (NM == kNormDefer) ssq[1] += sum_squares(xb[j]);
          norm_apply<T>(p, nw[j], rs1, xb[j]);
        }
      }
      const uint32_t* a0 = reinterpret_cast<const uint32_t*>(&xa[j]);
      const uint32_t* a1 = reinterpret_cast<const uint32_t*>(&xb[j]);
      const uint32_t A1[4] = {a0[0], a1[0], a0[1], a1[1]};
      const uint32_t A2[4] = {a0[2], a1[2], a0[3], a1[3]};
#pragma unroll
      for (int t = 0; t < NT; ++t) {
        const uint32_t* bw = reinterpret_cast<const uint32_t*>(&wv[t][j]);
        const uint32_t B1[2] = {bw[0], bw[1]};
        const uint32_t B2[2] = {bw[2], bw[3]};
        gpu::mma_m16n8k16<T>(acc[t], A1, B1);
        gpu::mma_m16n8k16<T>(acc[t], A2, B2);
      }
    }
  }
  // C fragment: acc[t][0..1] at row g, cols 2 tig + {0, 1}; acc[t][2..3] at row g + 8.
#pragma unroll
  for (int t = 0; t < NT; ++t)
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int col = t * 8 + 2 * tig + i;
      red[(warp * NT * 8 + col) * kRowsMma + g] = acc[t][i];
      red[(warp * NT * 8 + col) * kRowsMma + g + 8] = acc[t][2 + i];
    }
  if constexpr (NM == kNormDefer) {
    quad_sum(ssq);
    if (tig == 0) {
      rstd[warp * kRowsMma + g] = ssq[0];
      rstd[warp * kRowsMma + g + 8] = ssq[1];
    }
  }
  __syncthreads();
  epilogue<T, NT>(p, red, m0, mrows, col0, NM == kNormDefer ? rstd : nullptr);
#else
  (void)p;
  (void)m0;
  (void)mrows;
#endif
}

// The weight-streaming tensor-core kernel (see the top of the file). `tiles` = ceil(column groups / CPB).
// NW warps per block (8, or 16 for small N: more warps streaming when there are few column groups).
template <typename T, int NT, int SK, bool HALF, int NW>
__global__ void __launch_bounds__(NW * 32, NW == 16 ? (HALF ? 2 : 1) : HALF ? (NT == 1 ? 4 : 3) : (NT == 1 ? 2 : 3))
    gemm_stream_kernel(GemmParams p, int64_t m0, int mrows, int64_t tiles) {
#if LLMK_HAS_MMA_SYNC
  constexpr int U = 4 / NT;  // K steps of 32 per trip: NT * U = 4 16-byte W loads per lane in flight
  constexpr int CPB = NW / SK;
  using V8 = gpu::Vec<T, 8>;
  __shared__ float red[SK > 1 ? NW * NT * 8 * kRowsMma : 1];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane >> 2, tig = lane & 3;
  const int cg = warp / SK, ks = warp % SK;
  const int64_t out_cols = NT == 2 ? p.n / 2 : p.n;
  const T* w = static_cast<const T*>(p.w);
  const T* x = static_cast<const T*>(p.x);
  const bool x0_ok = g < mrows, x1_ok = !HALF && g + 8 < mrows;
  const T* x0 = x + (m0 + (x0_ok ? g : 0)) * p.x_stride;
  const T* x1 = x + (m0 + (x1_ok ? g + 8 : 0)) * p.x_stride;
  int64_t kb = 0, ke = p.k;
  if constexpr (SK > 1) {
    int64_t per = (p.k + SK - 1) / SK;
    per = (per + 31) / 32 * 32;
    kb = ks * per;
    ke = kb + per < p.k ? kb + per : p.k;
  }
  V8 zero;
#pragma unroll
  for (int i = 0; i < 8; ++i) zero.v[i] = gpu::from_float<T>(0.f);

  for (int64_t tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    const int64_t col0 = (tile * CPB + cg) * 8;
    const bool col_ok = col0 + g < out_cols;
    const T* wrow[NT];
#pragma unroll
    for (int t = 0; t < NT; ++t) wrow[t] = w + (t * out_cols + col0 + (col_ok ? g : 0)) * p.w_stride;
    float acc[NT][4];
#pragma unroll
    for (int t = 0; t < NT; ++t) acc[t][0] = acc[t][1] = acc[t][2] = acc[t][3] = 0.f;
    if (col0 < out_cols) {  // warp-uniform: the last tile may hold column groups past the end
      for (int64_t base = kb; base < ke; base += 32 * U) {
        V8 wv[NT][U], xa[U], xb[HALF ? 1 : U];
#pragma unroll
        for (int j = 0; j < U; ++j) {
          const int64_t kk = base + j * 32 + tig * 8;
          const bool ok = kk < ke;
#pragma unroll
          for (int t = 0; t < NT; ++t)
            wv[t][j] = ok && col_ok ? gpu::load_vec<T, 8, gpu::Cache::stream>(wrow[t] + kk) : zero;
        }
#pragma unroll
        for (int j = 0; j < U; ++j) {
          const int64_t kk = base + j * 32 + tig * 8;
          const bool ok = kk < ke;
          xa[j] = ok && x0_ok ? gpu::load_vec<T, 8>(x0 + kk) : zero;
          if constexpr (!HALF) xb[j] = ok && x1_ok ? gpu::load_vec<T, 8>(x1 + kk) : zero;
        }
#pragma unroll
        for (int j = 0; j < U; ++j) {
          const uint32_t* a0 = reinterpret_cast<const uint32_t*>(&xa[j]);
          const uint32_t* a1 = reinterpret_cast<const uint32_t*>(&xb[HALF ? 0 : j]);
          const uint32_t A1[4] = {a0[0], HALF ? 0u : a1[0], a0[1], HALF ? 0u : a1[1]};
          const uint32_t A2[4] = {a0[2], HALF ? 0u : a1[2], a0[3], HALF ? 0u : a1[3]};
#pragma unroll
          for (int t = 0; t < NT; ++t) {
            const uint32_t* bw = reinterpret_cast<const uint32_t*>(&wv[t][j]);
            const uint32_t B1[2] = {bw[0], bw[1]};
            const uint32_t B2[2] = {bw[2], bw[3]};
            gpu::mma_m16n8k16<T>(acc[t], A1, B1);
            gpu::mma_m16n8k16<T>(acc[t], A2, B2);
          }
        }
      }
    }
    // C fragment: acc[t][0..1] at row g, cols 2 tig + {0, 1}; acc[t][2..3] at row g + 8.
    if constexpr (SK == 1) {
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int64_t col = col0 + 2 * tig + i;
        if (col >= out_cols) continue;
#pragma unroll
        for (int h = 0; h < (HALF ? 1 : 2); ++h) {
          const int m = g + 8 * h;
          if (m >= mrows) continue;
          store_out<T, NT>(p, m0 + m, col, out_cols, acc[0][2 * h + i], acc[NT - 1][2 * h + i]);
        }
      }
    } else {
#pragma unroll
      for (int t = 0; t < NT; ++t)
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          const int col = t * 8 + 2 * tig + i;
          red[(warp * NT * 8 + col) * kRowsMma + g] = acc[t][i];
          red[(warp * NT * 8 + col) * kRowsMma + g + 8] = acc[t][2 + i];
        }
      __syncthreads();
      for (int e = threadIdx.x; e < mrows * CPB * 8; e += blockDim.x) {
        const int m = e / (CPB * 8), c = e % (CPB * 8), grp = c / 8, j = c % 8;
        const int64_t col = tile * CPB * 8 + c;
        if (col >= out_cols) continue;
        float y = 0.f, u = 0.f;
#pragma unroll
        for (int s = 0; s < SK; ++s) {
          y += red[((grp * SK + s) * NT * 8 + j) * kRowsMma + m];
          if constexpr (NT == 2) u += red[((grp * SK + s) * NT * 8 + 8 + j) * kRowsMma + m];
        }
        store_out<T, NT>(p, m0 + m, col, out_cols, y, u);
      }
      __syncthreads();  // red is rewritten by the next tile
    }
  }
#else
  (void)p;
  (void)m0;
  (void)mrows;
  (void)tiles;
#endif
}

// ---- skinny_gemm_rope_kv's epilogue (template RK; GemmRopeKvParams r) on the deep kernel (column
// groups of G = 16: a warp's W rows) and the portable one (G = 8: a block's).
// The W row (= output column) that local row i (0..G-1) of the G-column group at col0 computes: in
// the q and k columns a group is G / 2 rotation pairs of one head (D a multiple of G, so a group
// never straddles heads): group c of a head takes rows (G / 2) c + i and, for i >= G / 2, their
// partners D / 2 on. Deep: lane g then holds both halves of pairs 8 c + g (its rows g and g + 8);
// portable: the epilogue's thread for pair j reads local rows j and j + 4. v columns keep the plain
// order.
template <int G>
__device__ __forceinline__ int rope_row(const GemmRopeKvParams& r, int col0, int i) {
  const int d = static_cast<int>(r.head_dim), at = col0 % d;
  if (col0 >= static_cast<int>(r.q_heads + r.kv_heads) * d) return col0 + i;
  return col0 - at + at / 2 + i % (G / 2) + i / (G / 2) * (d / 2);
}

// What rope_store reads besides the sums: x row `row`'s position (from rope_positions' shared copy),
// the pair's cos / sin and the two outputs' biases. Fetched apart so that a kernel can issue these
// loads before its partial sums meet (one L2 round trip under that exchange instead of after it).
struct RopeFetch {
  int64_t pos = -1;
  float c = 0.f, s = 0.f, blo = 0.f, bhi = 0.f;
  int lo = 0, i = 0;  // the lower output column (= W row) and, in q / k, its pair's index in the head
};

// Column bookkeeping in 32-bit ints: the host sends only N < 2^31 here (launch_rope_kv).
template <typename T, int G>
__device__ __forceinline__ RopeFetch rope_fetch(const GemmParams& p, const GemmRopeKvParams& r, int64_t row,
                                                int64_t pos, int col0, int j) {
  const T* bias = static_cast<const T*>(p.bias);
  const int d = static_cast<int>(r.head_dim);
  RopeFetch f;
  f.pos = pos;
  f.lo = col0 + j;  // v: plain columns
  int hi = f.lo + G / 2;
  if (col0 < static_cast<int>(r.q_heads + r.kv_heads) * d) {
    f.lo = rope_row<G>(r, col0, j);
    hi = f.lo + d / 2;
    f.i = f.lo % d;  // pair i of its head
    f.c = gpu::to_float(static_cast<const T*>(r.cos)[row * r.cos_stride + f.i]);
    f.s = gpu::to_float(static_cast<const T*>(r.sin)[row * r.sin_stride + f.i]);
  }
  if (bias) {
    f.blo = gpu::to_float(bias[f.lo]);
    f.bhi = gpu::to_float(bias[hi]);
  }
  return f;
}

// Stores x row `row`'s results of local rows j and j + G / 2 (j < G / 2) of the group at col0 (their
// sums ylo, yhi times scale; f: rope_fetch's for that j): q / k pairs rotated (y plus bias rounded to T
// as store_out rounds it, then rotate_pair in fp32, rounded once: skinny_gemm then
// rope_write_kv_cache, bit for bit), k and v also
// into the caches at the row's position (skipped when negative or past the cache).
template <typename T, int G>
__device__ __forceinline__ void rope_store(const GemmParams& p, const GemmRopeKvParams& r, int64_t row, int col0,
                                           float ylo, float yhi, const RopeFetch& f, float scale = 1.f) {
  T* out = static_cast<T*>(p.out) + row * p.out_stride;
  const int d = static_cast<int>(r.head_dim), half = d / 2, qcols = static_cast<int>(r.q_heads) * d;
  const int qk = qcols + static_cast<int>(r.kv_heads) * d;
  const bool write = f.pos >= 0 && f.pos < r.capacity, has_bias = p.bias != nullptr;
  if (col0 >= qk) {  // v
    const T v1 = gpu::from_float<T>(scaled_plus_bias(ylo, scale, has_bias, f.blo));
    const T v2 = gpu::from_float<T>(scaled_plus_bias(yhi, scale, has_bias, f.bhi));
    const int c1 = f.lo - qk, c2 = c1 + G / 2;
    out[qk + c1] = v1;
    out[qk + c2] = v2;
    if (write) {
      T* vc = static_cast<T*>(r.v_cache) + row * r.v_strides[0] + f.pos * r.v_strides[2];
      vc[c1 / d * r.v_strides[1] + c1 % d] = v1;
      vc[c2 / d * r.v_strides[1] + c2 % d] = v2;
    }
    return;
  }
  const int lo = f.lo, i = f.i;  // (rope_fetch's: the rows' map and the pair's index, once)
  const float x1 = gpu::to_float(gpu::from_float<T>(scaled_plus_bias(ylo, scale, has_bias, f.blo)));
  const float x2 = gpu::to_float(gpu::from_float<T>(scaled_plus_bias(yhi, scale, has_bias, f.bhi)));
  float r1, r2;
  rotate_pair(x1, x2, f.c, f.s, r1, r2);
  const T y1 = gpu::from_float<T>(r1), y2 = gpu::from_float<T>(r2);
  out[lo] = y1;
  out[lo + half] = y2;
  if (col0 >= qcols && write) {  // k
    T* kc = static_cast<T*>(r.k_cache) + row * r.k_strides[0] + (lo - qcols) / d * r.k_strides[1] + f.pos * r.k_strides[2];
    kc[i] = y1;
    kc[i + half] = y2;
  }
}

// skinny_gemm_rope_kv's positions and the length's count, once per block at its start (after
// pdl_wait, before the streaming loop): x rows m0 .. m0 + mrows - 1's positions go to pos (shared
// memory, so that the epilogue's cache addresses wait for no L2 round trip after the sums), and
// thread 0 draws the block's ticket from r.counter (gpu::atomic_ticket, one of gridDim.x: the last
// draw leaves the counter zero for the next call). Returns the ticket (0 in the other threads): the
// block that draws gridDim.x - 1 is the last to have read its positions and advances the length at
// its end (rope_advance). Every thread of the block calls it (one barrier).
// The draw is a relaxed atomic whose value is first used in rope_advance, so its round trip runs
// under the streaming loop; counted at the end of the kernel (a barrier, then one acquire-release
// atomic a block) the advance cost ~1 us a call (H100, 2026-12-06: 8.3 against 7.3 us a 1B layer
// without it, scripts/rope_gemm_times.py). The order the advance needs (no block's read sees the
// advanced length) rests on the hardware, not on the PTX / HSA memory models, which allow this
// load-buffering pattern with relaxed atomics: a block draws only after a barrier behind its reads,
// whose values are then in shared memory (the loads have returned; AMD's s_barrier waits for them
// before the LDS write), and the advance is stored only after the last draw's value has come back
// (a dependence on it). A formal guarantee would be a release draw plus an acquire fence in the last
// block, at a cost not measured. The counter must be zero on entry (one stream per counter).
__device__ __forceinline__ unsigned rope_positions(const GemmRopeKvParams& r, int64_t m0, int mrows, int64_t* pos) {
  if (static_cast<int>(threadIdx.x) < mrows) {
    const int64_t at = (m0 + static_cast<int64_t>(threadIdx.x)) * r.pos_stride;
    pos[threadIdx.x] =
        r.positions_int64 ? static_cast<const int64_t*>(r.positions)[at] : static_cast<const int32_t*>(r.positions)[at];
  }
  __syncthreads();
  return r.advance != nullptr && threadIdx.x == 0 ? gpu::atomic_ticket(r.counter, gridDim.x) : 0u;
}

// The length's advance by the block that drew the last ticket (rope_positions). No barrier: only
// thread 0 holds a ticket.
__device__ __forceinline__ void rope_advance(const GemmRopeKvParams& r, unsigned ticket) {
  if (r.advance == nullptr || threadIdx.x != 0 || ticket != gridDim.x - 1) return;
  if (r.advance_int64) *static_cast<int64_t*>(r.advance) += 1;
  else *static_cast<int32_t*>(r.advance) += 1;
}

// The deep-streaming kernel (LLMK_GEMM_KERNEL=deep; see the top of the file). Template: NT (1, or
// 2 for swiglu: gate and up rows), MH (1: rows 0..7 of x, 2: rows 0..15), NW warps per block (8,
// or 16 for small N). Run time: sk, the warps splitting K per 16-column group (NW / sk groups per
// block; sk = 16 only with NW = 16).
// L: 16-byte W loads per lane per trip (8, or 16 at M <= 8 by LLMK_GEMM_DEEP_LOADS=16: 8 KB per
// warp in flight and 512-byte row segments per trip, at 2 blocks of 8 warps per SM).
// NM: the RMSNorm prologue's NormMode (a template value, so that the plain kernel keeps its registers).
// RK: skinny_gemm_rope_kv's epilogue (NT = 1; r: its arguments, ignored otherwise): rows mapped by
// rope_row<16>, positions read and counted by rope_positions, results stored by rope_store, the
// length advanced by rope_advance.
// K steps of 32 per trip: 2 * NT * U = L 16-byte W loads per lane in flight (the kernel and its plan).
template <int NT, int L>
__host__ __device__ constexpr int deep_steps_per_trip() {
  return L / (2 * NT);
}

template <typename T, int NT, int MH, int NW, int L = 8, int NM = kNoNorm, bool RK = false>
__global__ void __launch_bounds__(NW * 32, NW == 16 ? 1 : (MH == 1 && L == 8 && NM == kNoNorm ? 3 : 2))
    gemm_deep_kernel(GemmParams p, GemmRopeKvParams r, int64_t m0, int mrows, int sk) {
  static_assert(!RK || NT == 1, "the RoPE epilogue takes plain products");
#if LLMK_HAS_MMA_SYNC
  constexpr int U = deep_steps_per_trip<NT, L>();
  using V8 = gpu::Vec<T, 8>;
  __shared__ float red[NW * NT * 16 * 16];  // [warp][t][x row 16][column 16]
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane >> 2, tq = lane & 3;
  const int cg = warp / sk, ks = warp % sk;
  const int64_t out_cols = NT == 2 ? p.n / 2 : p.n;
  const int64_t col0 = (static_cast<int64_t>(blockIdx.x) * (NW / sk) + cg) * 16;
  // Rows of W past the end and rows of x past mrows are read from row 0 instead (valid memory):
  // the products they feed land in accumulator entries that are never stored, so no masking.
  const T* w = static_cast<const T*>(p.w);
  const T* wlo[NT];
  const T* whi[NT];
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    const int64_t rlo = RK ? rope_row<16>(r, static_cast<int>(col0), g) : col0 + g;
    const int64_t rhi = RK ? rope_row<16>(r, static_cast<int>(col0), g + 8) : col0 + g + 8;
    wlo[t] = w + (t * out_cols + (rlo < out_cols ? rlo : 0)) * p.w_stride;
    whi[t] = w + (t * out_cols + (rhi < out_cols ? rhi : 0)) * p.w_stride;
  }
  const T* x = static_cast<const T*>(p.x);
  const T* xr[MH];
#pragma unroll
  for (int h = 0; h < MH; ++h) xr[h] = x + (m0 + (h * 8 + g < mrows ? h * 8 + g : 0)) * p.x_stride;
  const int k = static_cast<int>(p.k);  // < 2^31 (the host checks)
  int kb = 0, ke = k;
  if (sk > 1) {
    int per = (k + sk - 1) / sk;
    per = (per + 31) / 32 * 32;
    kb = ks * per;
    ke = kb + per < k ? kb + per : k;
  }
  const uint64_t policy = gpu::l2_evict_first_policy();
  V8 zero;
#pragma unroll
  for (int i = 0; i < 8; ++i) zero.v[i] = gpu::from_float<T>(0.f);

  float acc[NT][MH][4];
#pragma unroll
  for (int t = 0; t < NT; ++t)
#pragma unroll
    for (int h = 0; h < MH; ++h) acc[t][h][0] = acc[t][h][1] = acc[t][h][2] = acc[t][h][3] = 0.f;

  // PDL (gpu::launch): a fixed weight's first trip is loaded into registers before this warp
  // waits for the previous kernel (which writes x), so that those bytes stream during that
  // kernel's end and the RMSNorm prologue's round trip (1B decode on an H100, 2026-12-06: 1051
  // against 933 tok/s with them only prefetched into L2). Any other weight may still be being
  // written by the previous kernel: its first trip is only pulled into L2 before the wait (lane:
  // one of the 16 rows, every other 128-byte line; a hint, the loads come after the wait). The
  // next kernel may launch only after the streaming loop below (p.pdl_late), unless
  // LLMK_GEMM_PDL_LATE asks for it here (gemm/pdl_trigger.h).
  if (!p.pdl_late) gpu::pdl_trigger();
  const bool streams = col0 < out_cols && kb < ke;  // warp-uniform: the last block may hold groups past the end
  DeepTrip<T, NT, U> first;
  if (streams && p.fixed_weight) {
    first = deep_load_any_trip<T, NT, U>(wlo, whi, kb, ke, tq, policy, zero);
  } else if (streams && (p.pdl || NM == kNormPre)) {
    const int64_t lrow = RK ? rope_row<16>(r, static_cast<int>(col0), lane >> 1) : col0 + (lane >> 1);
    const int64_t col = lrow < out_cols ? lrow : 0;
    for (int c = (lane & 1) * 64; c < 32 * U && kb + c < ke; c += 128)
#pragma unroll
      for (int t = 0; t < NT; ++t) gpu::prefetch_l2(w + (t * out_cols + col) * p.w_stride + kb + c);
  }
  gpu::pdl_wait();
  // RK: the rows' positions (after pdl_wait: the previous call may have advanced the length) and
  // this block's ticket for the length's advance
  __shared__ int64_t rope_pos[RK ? 16 : 1];
  unsigned rope_ticket = 0;
  if constexpr (RK) rope_ticket = rope_positions(r, m0, mrows, rope_pos);
  // RMSNorm prologue. PRE: the rows' rstd (one L2 round trip, under the first trip's W loads or
  // prefetches above). DEFER: ssq, this lane's sums of squares of x row 8 h + g, applied in the epilogue.
  __shared__ float rstd[16];
  float xs[MH], ssq[MH];
#pragma unroll
  for (int h = 0; h < MH; ++h) xs[h] = 1.f, ssq[h] = 0.f;
  if constexpr (NM == kNormPre) {
    norm_rstd<T, 8>(p, m0, mrows, rstd);
    __syncthreads();
#pragma unroll
    for (int h = 0; h < MH; ++h) xs[h] = rstd[h * 8 + g < mrows ? h * 8 + g : 0];
  }

  // The streaming loop (deep_stream.h), with the RMSNorm prologue applied to x as it is loaded.
  const auto x_fix = [&](V8 (&xv)[MH], int kk, bool ok) {
    if constexpr (NM != kNoNorm) {
      const V8 nw = ok ? gpu::load_vec<T, 8>(static_cast<const T*>(p.norm_w) + kk) : zero;
#pragma unroll
      for (int h = 0; h < MH; ++h) {
        if constexpr (NM == kNormDefer) ssq[h] += sum_squares(xv[h]);  // zeros past ke add nothing
        norm_apply<T>(p, nw, xs[h], xv[h]);
      }
    } else {
      (void)xv, (void)kk, (void)ok;
    }
  };
  // (two call sites, each inlining its own copy of the loop: with one call for both, the first trip
  // held across the wait or not, the 3-block gate/up build spilled 8 bytes)
  if (streams && p.fixed_weight)
    deep_stream_from<T, NT, MH, U>(first, wlo, whi, xr, kb, ke, tq, policy, zero, acc, x_fix);
  else if (streams)
    deep_stream<T, NT, MH, U>(wlo, whi, xr, kb, ke, tq, policy, zero, acc, x_fix);
  // Let the next kernel launch once every warp has streamed its W (by default: all but one-wave
  // gate/up launches and 16-warp launches, whose early trigger gained at 1B and cost nothing at 7B:
  // pdl_trigger.h).
  // Triggered at the start, the next call's blocks take the slots this grid leaves free and hold
  // them until it completes (they wait for it): where the plan is one partial wave that cost the
  // 8-load kernel 20-30% back to back (H200, 2026-12-03: 4096x14336 41.8 against 31.9 us with PDL
  // off; 31.5-32.4 with this trigger).
  // Placement changes scheduling only: the next kernel's pdl_wait still waits for this whole grid.
  if (p.pdl_late) gpu::pdl_trigger();

  // C fragment (rows = W rows = output columns, cols = x rows): acc[t][h][r] at column
  // col0 + g (r = 0, 1) or col0 + g + 8 (r = 2, 3), x row 8 h + 2 tq + (r & 1).
  if constexpr (NM == kNormDefer) quad_sum(ssq);  // now: this warp's K slice of row 8 h + g
  if (sk == 1) {
    // DEFER: the rstd of the x rows this lane's accumulators hold (8 h + 2 tq + b, from lane 4 (2 tq + b))
    float rs[MH][2];
    const auto rstds = [&] {
#pragma unroll
      for (int h = 0; h < MH; ++h)
#pragma unroll
        for (int b = 0; b < 2; ++b)
          rs[h][b] = NM == kNormDefer ? rstd_of(p, gpu::shfl(ssq[h], (2 * tq + b) * 4)) : 1.f;
    };
    if constexpr (RK) {  // acc[0][h][b] and [2 + b]: rows g and g + 8, a rotation pair
      if (col0 < out_cols) {  // warp-uniform
        RopeFetch f[MH][2];
#pragma unroll
        for (int h = 0; h < MH; ++h)
#pragma unroll
          for (int b = 0; b < 2; ++b)
            if (h * 8 + 2 * tq + b < mrows)
              f[h][b] = rope_fetch<T, 16>(p, r, m0 + h * 8 + 2 * tq + b, rope_pos[h * 8 + 2 * tq + b], static_cast<int>(col0), g);
        rstds();
#pragma unroll
        for (int h = 0; h < MH; ++h)
#pragma unroll
          for (int b = 0; b < 2; ++b) {
            const int m = h * 8 + 2 * tq + b;
            if (m < mrows)
              rope_store<T, 16>(p, r, m0 + m, static_cast<int>(col0), acc[0][h][b], acc[0][h][2 + b], f[h][b],
                                rs[h][b]);
          }
      }
      rope_advance(r, rope_ticket);
      return;
    }
    if (col0 >= out_cols) return;  // no barrier on this path (sk is uniform over the grid)
    rstds();
#pragma unroll
    for (int h = 0; h < MH; ++h)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int m = h * 8 + 2 * tq + (i & 1);
        const int64_t col = col0 + g + (i >> 1) * 8;
        if (m >= mrows || col >= out_cols) continue;
        store_out<T, NT>(p, m0 + m, col, out_cols, acc[0][h][i], acc[NT - 1][h][i], rs[h][i & 1]);
      }
    return;
  }
  const int cpb = NW / sk;
  // RK: this thread's first pair's position, angle and biases, on their way while the sums meet
  RopeFetch f0;
  if constexpr (RK) {
    const int e = threadIdx.x, grp = e / (mrows * 8);
    const int64_t gcol0 = (static_cast<int64_t>(blockIdx.x) * cpb + grp) * 16;
    if (e < cpb * mrows * 8 && gcol0 < out_cols)
      f0 = rope_fetch<T, 16>(p, r, m0 + e / 8 % mrows, rope_pos[e / 8 % mrows], static_cast<int>(gcol0), e % 8);
  }
#pragma unroll
  for (int t = 0; t < NT; ++t)
#pragma unroll
    for (int h = 0; h < MH; ++h)
#pragma unroll
      for (int i = 0; i < 4; ++i)
        red[((warp * NT + t) * 16 + h * 8 + 2 * tq + (i & 1)) * 16 + g + (i >> 1) * 8] = acc[t][h][i];
  __shared__ float ssq_red[NM == kNormDefer ? NW * 16 : 1];  // DEFER: [warp][x row]
  if constexpr (NM == kNormDefer) {
    if (tq == 0)
#pragma unroll
      for (int h = 0; h < MH; ++h) ssq_red[warp * 16 + h * 8 + g] = ssq[h];
  }
  __syncthreads();  // (MH = 1: rows 8..15 of red stay unwritten and are never read, mrows <= 8)
  if constexpr (RK) {  // a thread per rotation pair (local rows j and j + 8) and x row
    for (int e = threadIdx.x; e < cpb * mrows * 8; e += NW * 32) {
      const int grp = e / (mrows * 8), m = e / 8 % mrows, j = e % 8;
      const int64_t gcol0 = (static_cast<int64_t>(blockIdx.x) * cpb + grp) * 16;
      if (gcol0 >= out_cols) continue;
      float ylo = 0.f, yhi = 0.f, ss = 0.f;
      for (int s = 0; s < sk; ++s) {
        const int wi = grp * sk + s;
        ylo += red[(wi * 16 + m) * 16 + j];
        yhi += red[(wi * 16 + m) * 16 + j + 8];
        if constexpr (NM == kNormDefer) ss += ssq_red[wi * 16 + m];
      }
      const float rstd_m = NM == kNormDefer ? rstd_of(p, ss) : 1.f;
      const RopeFetch f =
          e == static_cast<int>(threadIdx.x) ? f0 : rope_fetch<T, 16>(p, r, m0 + m, rope_pos[m], static_cast<int>(gcol0), j);
      rope_store<T, 16>(p, r, m0 + m, static_cast<int>(gcol0), ylo, yhi, f, rstd_m);
    }
    rope_advance(r, rope_ticket);
  } else {
    for (int e = threadIdx.x; e < cpb * mrows * 16; e += NW * 32) {
      const int grp = e / (mrows * 16), m = e / 16 % mrows, j = e % 16;
      const int64_t col = (static_cast<int64_t>(blockIdx.x) * cpb + grp) * 16 + j;
      if (col >= out_cols) continue;
      float y = 0.f, u = 0.f, ss = 0.f;
      for (int s = 0; s < sk; ++s) {
        const int wi = grp * sk + s;
        y += red[((wi * NT) * 16 + m) * 16 + j];
        if constexpr (NT == 2) u += red[((wi * NT + 1) * 16 + m) * 16 + j];
        if constexpr (NM == kNormDefer) ss += ssq_red[wi * 16 + m];
      }
      store_out<T, NT>(p, m0 + m, col, out_cols, y, u, NM == kNormDefer ? rstd_of(p, ss) : 1.f);
    }
  }
#else
  (void)p;
  (void)r;
  (void)m0;
  (void)mrows;
  (void)sk;
#endif
}

#if LLMK_MMA_SYNC_BUILD  // CUDA: tensor maps and clusters
// The TMA kernel (LLMK_GEMM_KERNEL=tma; sm_90a only, the H200; K a multiple of 64): W streamed by
// the bulk tensor copy engine. A block (8 warps) owns a row tile of kTmaRows = 64 W rows (NT = 1:
// output columns c0 .. c0 + 63; NT = 2, swiglu: gate rows c0 .. c0 + 31 and the matching up rows)
// and a contiguous 1/S of K; the S blocks of a thread block cluster share the row tile and add
// their partial sums through distributed shared memory. Clusters are persistent: cluster c takes
// row tiles tile0 + c, tile0 + c + clusters, ... of the launch's row_tiles (S, the cluster count and
// the launches chosen on the host, tma_plan). K streams in steps of 256 through a ring of ST
// stages (kTmaStages = 5; 4 with LLMK_GEMM_TMA_STAGES=4), each one box of W (64 rows x 512 bytes: 4
// segments of 64 columns per row, so that DRAM sees 512 contiguous bytes of every row) and one of
// x (8 MH rows alike; rows past M read as zeros), 128B-swizzled (16-byte chunk c of segment q of
// row r at slot c ^ ((4 r + q) % 8)), issued by thread 0 on the stage's mbarrier ST - 1
// steps ahead, across row tiles (the ring does not drain between tiles). Warp w takes W rows
// 16 (w % 4) .. + 15 and segments w / 4 and w / 4 + 2 of every step: lane (g, tq) reads 16 bytes
// of W rows g and g + 8 and of x row g (8 h + g) per 32 columns, conflict-free, the K order
// permuted alike for both operands (as the deep kernel), W the A operand of mma.sync m16n8k16, fp32
// accumulation. At the end of a row tile the two warps' partial sums go to shared memory; with S > 1
// a cluster barrier, then block r adds the S partials of its 1/S of the tile's columns (DSMEM),
// applies bias / SwiGLU / residual and stores; a second barrier before the buffer is written
// again. No RMSNorm prologue (those calls take the deep kernel). A fixed weight's first W boxes
// are requested before the PDL wait (the x boxes after it; LLMK_GEMM_TMA_EARLY_W=0 turns that off).
constexpr int kTmaWarps = 8;
constexpr int kTmaRows = 64;                           // W rows per row tile
constexpr int kTmaStepK = 256;                         // K per stage (4 segments of 64)
constexpr int kTmaStages = 5;                          // 4 steps (128 KB of W) in flight per block
constexpr int kTmaWBytes = kTmaRows * kTmaStepK * 2;   // the W box of a stage (32 KB)
constexpr int kTmaStageBytes = kTmaWBytes + 16 * kTmaStepK * 2;  // + the x box (up to 16 rows)
constexpr int kTmaRedStride = kRowsMma + 1;            // floats per W row of the partial sums (padded)
// The dynamic shared memory of a block with ST stages (+ alignment slack): ~214.5 KB at the default
// 5. LLMK_GEMM_TMA_STAGES=4 (read per call; an A/B) builds 4 stages, ~174 KB. Written to let this
// kernel's blocks start beside the small blocks of the kernel before it under PDL; what it measured
// (H100, 2026-12-07) is that it leaves the next kernels more L1: the 7B layer's chain with the TMA
// down 150.6 us a layer against 164.9 with 5 stages, as LLMK_SMEM_CARVEOUT=fit does with 5 (151.6),
// and the 7B decodes 201 tok/s with either (4 stages + fit 201 too; gpu/runtime.h).
constexpr std::size_t tma_smem(int stages) {
  return static_cast<std::size_t>(stages) * kTmaStageBytes + 2 * kTmaRows * kTmaRedStride * sizeof(float) + 1024;
}

template <typename T, int NT, int MH, int ST = kTmaStages>
__global__ void __launch_bounds__(kTmaWarps * 32, 1)
    gemm_tma_kernel(GemmParams p, int64_t m0, int mrows, int S, int steps, int row_tiles, int tile0,
                    const __grid_constant__ CUtensorMap map_w, const __grid_constant__ CUtensorMap map_x) {
#if LLMK_HAS_WGMMA
  constexpr int kCols = kTmaRows / NT;  // output columns per row tile
  using V8 = gpu::Vec<T, 8>;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  // 128B-swizzle atoms start on 1024-byte boundaries (tma_smem has the slack)
  unsigned char* smem = gpu::mma::align_smem_1024(smem_raw);
  float* red = reinterpret_cast<float*>(smem + ST * kTmaStageBytes);  // [segment pair][W row][x row]
  __shared__ __align__(8) uint64_t full_s[ST];
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, tq = lane % 4;
  const int rank = static_cast<int>(blockIdx.x) % S, cluster = static_cast<int>(blockIdx.x) / S;
  const int clusters = static_cast<int>(gridDim.x) / S;
  const int per = (steps + S - 1) / S, s0 = rank * per;
  const int ns = max(0, min(steps, s0 + per) - s0);  // this block's K steps of every row tile
  const int units = cluster < row_tiles ? (row_tiles - cluster + clusters - 1) / clusters : 0;
  const int total = units * ns;
  const int64_t out_cols = NT == 2 ? p.n / 2 : p.n;
  const uint64_t w_policy = p.w_evict_first ? gpu::l2_evict_first_policy() : 0;

  if (tid == 0) {
#pragma unroll
    for (int s = 0; s < ST; ++s) gpu::tma::mbar_init(gpu::mma::smem_u32(&full_s[s]), 1);
    gpu::tma::fence_mbar_init();
    gpu::tma::prefetch_map(&map_w);
    gpu::tma::prefetch_map(&map_x);
  }
  __syncthreads();

  // step `it` of this block's sequence (row tile cluster + (it / ns) clusters, K step s0 + it % ns):
  // its W box (w, with the barrier's expected bytes for W and x) and / or its x box (xb), so that a
  // fixed weight's first W boxes can be requested before the PDL wait and their x boxes after it
  const auto issue = [&](int it, bool w, bool xb) {
    if (tid != 0 || it >= total) return;
    const int slot = it % ST;
    const uint32_t bar = gpu::mma::smem_u32(&full_s[slot]);
    const uint32_t dst = gpu::mma::smem_u32(smem + slot * kTmaStageBytes);
    const int seg = (s0 + it % ns) * (kTmaStepK / 64);  // first 64-column segment
    if (w) {
      const int row0 = (tile0 + cluster + (it / ns) * clusters) * kCols;
      gpu::tma::mbar_arrive_expect_tx(bar, kTmaWBytes + 8 * MH * kTmaStepK * 2);
#pragma unroll
      for (int t = 0; t < NT; ++t) {
        const uint32_t to = dst + t * (kTmaWBytes / NT);
        const int r = t * static_cast<int>(out_cols) + row0;
        if (p.w_evict_first) gpu::tma::load_4d_hint(to, &map_w, bar, 0, seg, r, 0, w_policy);
        else gpu::tma::load_4d(to, &map_w, bar, 0, seg, r, 0);
      }
    }
    if (xb) gpu::tma::load_4d(dst + kTmaWBytes, &map_x, bar, 0, seg, 0, 0);
  };
  // PDL (gpu::launch): the next kernel may launch now (with p.pdl_late, the default: once this
  // block has taken its last stage, below); x only after the previous kernel. A fixed
  // weight (GemmOptions::fixed_weight; no kernel still running writes it) has its first
  // ST - 1 W boxes requested before the wait, so that they stream while the previous kernel
  // ends (its blocks leave this SM, its memory flush); their barriers complete once the x boxes
  // issued after the wait have landed too (one transaction count for both).
  if (!p.pdl_late) gpu::pdl_trigger();
  const int early = p.fixed_weight ? ST - 1 : 0;
  for (int s = 0; s < early; ++s) issue(s, true, false);
  gpu::pdl_wait();
  for (int s = 0; s < ST - 1; ++s) issue(s, s >= early, true);

  // byte offset of 16-byte chunk c of segment q of row r in a swizzled stage box
  const auto tma_chunk = [](int r, int q, int c) { return r * 512 + q * 128 + ((c ^ ((4 * r + q) & 7)) << 4); };
  const int wr = 16 * (warp & 3) + g;  // this lane's W rows wr and wr + 8
  const int qa = warp >> 2;            // this warp's segments qa and qa + 2
  int it = 0;
  for (int u = 0; u < units; ++u) {
    float acc[MH][4];
#pragma unroll
    for (int h = 0; h < MH; ++h) acc[h][0] = acc[h][1] = acc[h][2] = acc[h][3] = 0.f;
    for (int j = 0; j < ns; ++j, ++it) {
      const int slot = it % ST;
      gpu::tma::mbar_wait(gpu::mma::smem_u32(&full_s[slot]), (it / ST) & 1);
      __syncthreads();  // every warp is done with step it - 1, whose stage now takes it + ST - 1
      issue(it + ST - 1, true, true);
      const unsigned char* st = smem + slot * kTmaStageBytes;
#pragma unroll
      for (int qi = 0; qi < 2; ++qi)
#pragma unroll
        for (int half = 0; half < 2; ++half) {  // columns 32 half .. + 31 of segment q
          const int q = qa + 2 * qi, c = 4 * half + tq;
          const V8 lo = *reinterpret_cast<const V8*>(st + tma_chunk(wr, q, c));
          const V8 hi = *reinterpret_cast<const V8*>(st + tma_chunk(wr + 8, q, c));
          const uint32_t* l = reinterpret_cast<const uint32_t*>(&lo);
          const uint32_t* hh = reinterpret_cast<const uint32_t*>(&hi);
          const uint32_t A1[4] = {l[0], hh[0], l[1], hh[1]};
          const uint32_t A2[4] = {l[2], hh[2], l[3], hh[3]};
#pragma unroll
          for (int h = 0; h < MH; ++h) {
            const V8 xv = *reinterpret_cast<const V8*>(st + kTmaWBytes + tma_chunk(8 * h + g, q, c));
            const uint32_t* b = reinterpret_cast<const uint32_t*>(&xv);
            const uint32_t B1[2] = {b[0], b[1]};
            const uint32_t B2[2] = {b[2], b[3]};
            gpu::mma_m16n8k16<T>(acc[h], A1, B1);
            gpu::mma_m16n8k16<T>(acc[h], A2, B2);
          }
        }
    }
    // the late trigger: this block's W stream is over (only its last tile's sums and stores are
    // left; a block without tiles exits, which counts as the trigger). Scheduling only: the next
    // kernel's pdl_wait still waits for the whole grid.
    if (p.pdl_late && u == units - 1) gpu::pdl_trigger();
    // C fragment: acc[h][0..1] at W row wr, x rows 8 h + 2 tq + {0, 1}; [2..3] at W row wr + 8
    float* rw = red + (qa * kTmaRows + wr) * kTmaRedStride;
#pragma unroll
    for (int h = 0; h < MH; ++h)
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        rw[8 * h + 2 * tq + i] = acc[h][i];
        rw[8 * kTmaRedStride + 8 * h + 2 * tq + i] = acc[h][2 + i];
      }
    if (S > 1) gpu::tma::cluster_sync();
    else __syncthreads();
    // this block's columns of the tile: [j0, j0 + nj)
    const int cper = (kCols + S - 1) / S, j0 = rank * cper, nj = max(0, min(kCols, j0 + cper) - j0);
    const int64_t col0 = static_cast<int64_t>(tile0 + cluster + u * clusters) * kCols;
    for (int e = tid; e < mrows * nj; e += kTmaWarps * 32) {
      const int m = e / nj, j = j0 + e % nj;
      const int64_t col = col0 + j;
      if (col >= out_cols) continue;
      float y = 0.f, up = 0.f;
      for (int s = 0; s < S; ++s) {
        const float* rs = S > 1 ? gpu::tma::cluster_map(red, s) : red;
#pragma unroll
        for (int pair = 0; pair < 2; ++pair) {
          y += rs[(pair * kTmaRows + j) * kTmaRedStride + m];
          if constexpr (NT == 2) up += rs[(pair * kTmaRows + kCols + j) * kTmaRedStride + m];
        }
      }
      store_out<T, NT>(p, m0 + m, col, out_cols, y, up);
    }
    if (S > 1) gpu::tma::cluster_sync();  // every block has read the partials before they are rewritten
    else __syncthreads();
  }
#else
  (void)p;
  (void)m0;
  (void)mrows;
  (void)S;
  (void)steps;
  (void)row_tiles;
  (void)tile0;
  (void)map_w;
  (void)map_x;
#endif
}
#endif  // LLMK_MMA_SYNC_BUILD

// gemm_portable_kernel: a block of kWarps warps owns 8 output columns (COLS = NT * 8 W rows, as
// above). Its warps form COLS / CW groups of CW W rows each, and a group's warps split K; lanes take
// K in VW-element chunks. All MT rows of x a pass takes (up to 16: a skinny call's rows in one
// pass, so W streams once) accumulate in fp32: with CW == COLS (1-2 rows) a lane loads its x rows
// for a chunk, then each W row in turn; with CW = 4 (3-16 rows) its 4 W rows first, then x four
// rows at a time. The lanes' MT x CW sums meet by a reduce-scatter butterfly (about one shuffle per
// sum; warp_reduce_scatter) and the warps' in shared memory (epilogue).
template <typename T, int NT, int VW, int MT, int CW, bool RK = false>
__global__ void __launch_bounds__(kWarps * LLMK_WARP_SIZE)
    gemm_portable_kernel(GemmParams p, GemmRopeKvParams r, int64_t m0, int mrows) {
  static_assert(!RK || NT == 1, "the RoPE epilogue takes plain products");
  constexpr int WS = LLMK_WARP_SIZE, COLS = NT * 8, GROUPS = COLS / CW, WPG = kWarps / GROUPS, NV = MT * CW;
  static_assert(COLS % CW == 0 && kWarps % GROUPS == 0 && MT <= kRowsMma && MT % (CW == COLS ? 1 : 4) == 0,
                "gemm_portable_kernel: CW divides the block's W rows, MT a multiple of 4 where CW < COLS");
  __shared__ float red[kWarps * COLS * kRowsMma];
  __shared__ float rstd[kRowsMma];
  const int warp = threadIdx.x / WS, lane = threadIdx.x % WS;
  const int group = warp / WPG, slot = warp % WPG;  // W rows group * CW.. of the block; K share slot
  const int64_t out_cols = NT == 2 ? p.n / 2 : p.n;
  const int64_t col0 = static_cast<int64_t>(blockIdx.x) * 8;
  const T* w = static_cast<const T*>(p.w);
  const T* x = static_cast<const T*>(p.x);
  int64_t kb, ke;
  warp_slice(p.k, slot, VW * WS, kb, ke, WPG);

  // RK: the rows' positions and this block's ticket for the length's advance
  __shared__ int64_t rope_pos[RK ? kRowsMma : 1];
  unsigned rope_ticket = 0;
  if constexpr (RK) rope_ticket = rope_positions(r, m0, mrows, rope_pos);
  if (p.norm_w) {  // RMSNorm prologue: the rows' statistics first
    norm_rstd<T, VW>(p, m0, mrows, rstd);
    __syncthreads();
  }
  // x row m's VW elements at k (zero past the pass's rows), normalised when there is a prologue
  const auto load_x = [&](int m, int64_t k, float (&xf)[VW]) {
    if (m < mrows) {
      gpu::load_float<T, VW>(x + (m0 + m) * p.x_stride + k, xf);
      if (p.norm_w) norm_apply<T, VW>(p, k, rstd[m], xf);
    } else {
#pragma unroll
      for (int v = 0; v < VW; ++v) xf[v] = 0.f;
    }
  };
  // W row c (of the block's COLS: gate rows, then up rows; RK: mapped by rope_row<8>) at k; zero
  // past the output columns
  const auto load_w = [&](int c, int64_t k, float (&wf)[VW]) {
    const int64_t col = RK ? rope_row<8>(r, static_cast<int>(col0), c % 8) : col0 + c % 8;
    if (col < out_cols) {
      gpu::load_float<T, VW, gpu::Cache::stream>(w + ((c / 8) * out_cols + col) * p.w_stride + k, wf);
    } else {
#pragma unroll
      for (int v = 0; v < VW; ++v) wf[v] = 0.f;
    }
  };

  float acc[NV];  // acc[m * CW + c]: row m, W row group * CW + c
#pragma unroll
  for (int i = 0; i < NV; ++i) acc[i] = 0.f;

  for (int64_t k = kb + lane * VW; k < ke; k += WS * VW) {
    if constexpr (CW == COLS) {
      float xf[MT][VW];
#pragma unroll
      for (int m = 0; m < MT; ++m) load_x(m, k, xf[m]);
#pragma unroll
      for (int c = 0; c < CW; ++c) {
        float wf[VW];
        load_w(c, k, wf);
#pragma unroll
        for (int m = 0; m < MT; ++m)
#pragma unroll
          for (int v = 0; v < VW; ++v) acc[m * CW + c] += xf[m][v] * wf[v];
      }
    } else {
      float wf[CW][VW];
#pragma unroll
      for (int c = 0; c < CW; ++c) load_w(group * CW + c, k, wf[c]);
#pragma unroll
      for (int m4 = 0; m4 < MT; m4 += 4) {
        if (m4 < mrows) {  // (a condition, not a break: the loop must unroll to keep acc in registers)
          float xf[4][VW];
#pragma unroll
          for (int i = 0; i < 4; ++i) load_x(m4 + i, k, xf[i]);
#pragma unroll
          for (int i = 0; i < 4; ++i)
#pragma unroll
            for (int c = 0; c < CW; ++c)
#pragma unroll
              for (int v = 0; v < VW; ++v) acc[(m4 + i) * CW + c] += xf[i][v] * wf[c][v];
        }
      }
    }
  }
  gpu::warp_reduce_scatter(acc, lane);
  if (gpu::reduce_scatter_writer<NV>(lane)) {
    const int first = gpu::reduce_scatter_index<NV>(lane);
#pragma unroll
    for (int j = 0; j < gpu::reduce_scatter_count<NV>(); ++j) {
      const int m = (first + j) / CW, c = group * CW + (first + j) % CW;
      red[(slot * COLS + c) * kRowsMma + m] = acc[j];
    }
  }
  __syncthreads();
  if constexpr (RK) {  // a thread per rotation pair (local rows j and j + 4) and x row
    for (int e = threadIdx.x; e < mrows * 4 && col0 < out_cols; e += blockDim.x) {
      const int m = e / 4, j = e % 4;
      float ylo = 0.f, yhi = 0.f;
      for (int s = 0; s < WPG; ++s) {
        ylo += red[(s * COLS + j) * kRowsMma + m];
        yhi += red[(s * COLS + j + 4) * kRowsMma + m];
      }
      rope_store<T, 8>(p, r, m0 + m, static_cast<int>(col0), ylo, yhi,
                       rope_fetch<T, 8>(p, r, m0 + m, rope_pos[m], static_cast<int>(col0), j));
    }
    rope_advance(r, rope_ticket);
  } else {
    epilogue<T, NT>(p, red, m0, mrows, col0, nullptr, WPG);
  }
}

// Which kernel runs, decided here and only here (read at every call, so that tests and the
// benchmark can switch): LLMK_GEMM_KERNEL = deep | mma | stream | tma | portable | tma@SHAPES (the
// TMA kernel for the listed KxN weights only, non_tma_default for the others,
// gemm/kernel_setting.h); unset, empty, "default" or
// "auto": the default below. The older switches stay as aliases when
// LLMK_GEMM_KERNEL is unset: LLMK_GEMM_PORTABLE=1 (portable) and LLMK_GEMM_STREAM=1 (stream).
// Whatever is asked for, a K or a stride that rules out 16-byte loads, GemmOptions::portable or a
// GPU without mma.sync (AMD, pre-sm_80) runs the portable kernel.
enum class KernelChoice { mma, deep, stream, tma, portable };

// The default's choice among the non-TMA kernels (also where the TMA kernel is chosen but does not
// apply, and for the shapes LLMK_GEMM_KERNEL=tma@SHAPES does not list). By the H200 measurements of
// 2026-11-30 17:32 (bench/results/h200-decode.md): deep at every plain shape (1.05-1.2x the mma
// kernel, 9.8 vs 10.9 us at the 1B model's q/k/v, 129 vs 139 us at 8192 x 28672); mma with the
// SwiGLU epilogue (25.4 vs 29.6 us at 2048 x 16384). With the RMSNorm prologue, deep also for
// SwiGLU (H200, 2026-12-01, the 1B model's 16 decode layers in one graph: 939 us with deep vs 1055
// us with mma for gate/up; the mma kernel took 28.8 us with the prologue against 19.5 us without).
KernelChoice non_tma_default(const GemmParams& p) {
  return gemm_gated(p.activation) && p.norm_w == nullptr ? KernelChoice::mma : KernelChoice::deep;
}

// The default: the TMA kernel (where it applies: sm_90a, K a multiple of 64, no RMSNorm prologue)
// for one row of x (LLMK_GEMM_TMA_ROWS: more) against a weight of at least kTmaDefaultWeight
// elements, non_tma_default elsewhere (LLMK_GEMM_TMA_DEFAULT=0: non_tma_default everywhere, the default until 2026-12-07; as
// defaults with fit against both off, H100, 2026-12-07: 7B 202 against 197 tok/s, 8b 182 against
// 180, 1B a tie, bench/results/h100-session67-tma-default-flip-2026-12-07.md; not yet run on an
// H200). First measured as LLMK_GEMM_KERNEL=tma@SHAPES settings with each kernel's shared memory
// split to its need (LLMK_SMEM_CARVEOUT=fit, gpu/runtime.h), which is what made the TMA kernel win
// inside the models (H100, 2026-12-07, tok/s at batch 1 after 128 tokens,
// bench/results/h100-session66-carveout-fit-tma-2026-12-07.md): 7B with the TMA kernel at every
// shape 203 against 197 (gate/up and down 202, down alone 200-201; with the driver's split
// 183-185), 8b 181-183 against 178; in the 1B the head ties (2048 x 128256: 1083 against 1081-1083)
// and the smaller down loses (8192 x 2048, 16.8M: 1052 against 1082), hence the size floor (the
// 7B's down, 11008 x 4096, is 45M). One row by default (LLMK_GEMM_TMA_ROWS=R: up to R rows, 1-16):
// back to back on the H200 the TMA kernel trailed deep at 16 rows (8192 x 28672: 132.5-138.5
// against 129.2-129.6 us), but in the 7B at batch 2 / 4 / 8 / 16 the rule's shapes on it took 401 /
// 791 / 1542 / 2817 against 386 / 762 / 1463 / 2728 tok/s (H100, 2026-12-07, as
// LLMK_GEMM_KERNEL=tma@ those shapes, bench/results/h100-session70-tma-rows-2026-12-07.md); the
// switch is the way to test and time that as a rule before it becomes the default.
constexpr int64_t kTmaDefaultWeight = int64_t{40} << 20;

KernelChoice default_kernel(const GemmParams& p) {
  const int64_t rows = gemm_tma_rows(std::getenv("LLMK_GEMM_TMA_ROWS"));  // checked at every call
  if (p.m <= rows && p.k * p.n >= kTmaDefaultWeight && gpu::env_flag("LLMK_GEMM_TMA_DEFAULT", true))
    return KernelChoice::tma;
  return non_tma_default(p);
}

KernelChoice env_kernel(const GemmParams& p) {
  const char* v = std::getenv("LLMK_GEMM_KERNEL");
  if (v != nullptr && *v != '\0' && std::strcmp(v, "default") != 0 && std::strcmp(v, "auto") != 0) {
    if (std::strcmp(v, "deep") == 0) return KernelChoice::deep;
    if (std::strcmp(v, "mma") == 0) return KernelChoice::mma;
    if (std::strcmp(v, "stream") == 0) return KernelChoice::stream;
    if (std::strcmp(v, "tma") == 0) return KernelChoice::tma;
    if (std::strcmp(v, "portable") == 0) return KernelChoice::portable;
    constexpr std::string_view kTmaAt = "tma@";
    const std::string_view setting = v;
    if (setting.substr(0, kTmaAt.size()) == kTmaAt)
      return gemm_shape_listed(setting.substr(kTmaAt.size()), setting, p.k, p.n) ? KernelChoice::tma : non_tma_default(p);
    fail(ErrorKind::value, "skinny_gemm",
         std::string("LLMK_GEMM_KERNEL: expected deep, mma, stream, tma, tma@SHAPES, portable or default, got '") + v +
             "'");
  }
  if (gpu::env_flag("LLMK_GEMM_PORTABLE")) return KernelChoice::portable;
  if (gpu::env_flag("LLMK_GEMM_STREAM")) return KernelChoice::stream;
  return default_kernel(p);
}

#if LLMK_MMA_SYNC_BUILD
// Resident blocks per SM of one streaming kernel (registers bound it; cached per instantiation).
template <typename T, int NT, int SK, bool HALF, int NW>
int stream_occupancy() {
  static const int cached = gpu::resident_blocks_or(gemm_stream_kernel<T, NT, SK, HALF, NW>, NW * 32, 0, 2);
  return cached;
}

template <typename T, int NT, int SK, bool HALF, int NW = kWarps>
void launch_stream_sk(const GemmParams& p, int64_t groups, int64_t m0, int rows) {
  constexpr int CPB = NW / SK;
  const int64_t tiles = (groups + CPB - 1) / CPB;
  const int64_t slots = static_cast<int64_t>(stream_occupancy<T, NT, SK, HALF, NW>()) *
                        gpu::multiprocessor_count(p.device.index);
  // Whole waves: as many tiles per block for every block (ceil(tiles / slots) rounds).
  const int64_t rounds = slots > 0 ? (tiles + slots - 1) / slots : 1;
  const int64_t grid = (tiles + rounds - 1) / rounds;
  if (grid > 0x7fffffff) fail(ErrorKind::not_implemented, "skinny_gemm", "weight: too many rows for one launch");
  gemm_stream_kernel<T, NT, SK, HALF, NW>
      <<<static_cast<unsigned>(grid), NW * 32, 0, gpu::as_stream(p.stream)>>>(p, m0, rows, tiles);
  gpu::check_launch("skinny_gemm");
}

// Split of K per column group: the fewest warps per column group (SK) whose tiles still give at
// least 80% of one wave of resident blocks; SK = 8 (the old layout) when N is small, and blocks of
// 16 warps splitting K 16 ways when even that leaves the GPU short of warps and one column group
// per 16-warp block still fits in one wave (N = 2048: 256 blocks of 16 warps instead of 8).
template <typename T, int NT, bool HALF>
void launch_stream_rows(const GemmParams& p, int64_t groups, int64_t m0, int rows) {
  const int sms = gpu::multiprocessor_count(p.device.index);
  const int64_t slots = static_cast<int64_t>(stream_occupancy<T, NT, 1, HALF, kWarps>()) * sms;
  const auto fills = [&](int cpb) { return (groups + cpb - 1) / cpb * 10 >= slots * 8; };
  if (fills(8)) launch_stream_sk<T, NT, 1, HALF>(p, groups, m0, rows);
  else if (fills(4)) launch_stream_sk<T, NT, 2, HALF>(p, groups, m0, rows);
  else if (fills(2)) launch_stream_sk<T, NT, 4, HALF>(p, groups, m0, rows);
  else if (fills(1) || groups > static_cast<int64_t>(stream_occupancy<T, NT, 16, HALF, 16>()) * sms)
    launch_stream_sk<T, NT, 8, HALF>(p, groups, m0, rows);
  else launch_stream_sk<T, NT, 16, HALF, 16>(p, groups, m0, rows);
}

template <typename T, int NT>
void launch_stream(const GemmParams& p, int64_t groups) {
  for (int64_t m0 = 0; m0 < p.m; m0 += kRowsMma) {
    const int rows = static_cast<int>(p.m - m0 < kRowsMma ? p.m - m0 : kRowsMma);
    if (rows <= 8) launch_stream_rows<T, NT, true>(p, groups, m0, rows);
    else launch_stream_rows<T, NT, false>(p, groups, m0, rows);
  }
}
#endif

#if LLMK_MMA_SYNC_BUILD
// Resident blocks per SM of one deep kernel (registers bound it; cached per instantiation).
template <typename T, int NT, int MH, int NW, int L, int NM>
int deep_occupancy() {
  static const int cached = gpu::resident_blocks_or(gemm_deep_kernel<T, NT, MH, NW, L, NM>, NW * 32, 0, 1);
  return cached;
}

// The deep kernel's launch shape: 16 warps per 16-column group when even one such block per
// group fits in one wave of resident blocks and K gives each warp at least one full trip (small
// N: N = 2048 gets 128 x 16 warps instead of 128 x 8), else blocks of 8 warps with the largest
// K split (8, 4, 2, 1 warps per group) whose blocks still fit in one wave: every warp then starts
// at once with the same bytes to read, so no second wave and no tail of short blocks. N where
// not even sk = 2 fits one wave takes sk = 8 over several waves (deep_split, deep_stream.h).
struct DeepPlan {
  int nw, sk;
  int64_t grid;
  int64_t slots;  // resident blocks of nw warps on the GPU: grid <= slots is one wave
};

template <typename T, int NT, int MH, int L, int NM>
DeepPlan deep_plan(const GemmParams& p) {
  const int64_t out_cols = NT == 2 ? p.n / 2 : p.n;
  const int64_t groups = (out_cols + 15) / 16;
  const int sms = gpu::multiprocessor_count(p.device.index);
  const int64_t slots8 = static_cast<int64_t>(deep_occupancy<T, NT, MH, 8, L, NM>()) * sms;
  const int64_t slots16 = static_cast<int64_t>(deep_occupancy<T, NT, MH, 16, L, NM>()) * sms;
  const int64_t trips = p.k / (32 * deep_steps_per_trip<NT, L>());  // full trips of one warp reading all of K
  // LLMK_GEMM_DEEP_SPLIT = 1, 2, 4, 8 or 16 forces sk (tests, tuning); anything else: the plan.
  if (const char* v = std::getenv("LLMK_GEMM_DEEP_SPLIT")) {
    const int sk = std::atoi(v);
    if (sk == 16) return {16, 16, groups, slots16};
    if (sk == 1 || sk == 2 || sk == 4 || sk == 8) return {8, sk, (groups * sk + 7) / 8, slots8};
  }
  if (trips >= 16 && groups <= slots16) return {16, 16, groups, slots16};
  const int sk = deep_split(groups, trips, slots8, MH == 2);  // (deep_stream.h)
  return {8, sk, (groups * sk + 7) / 8, slots8};
}

// RK: skinny_gemm_rope_kv's epilogue with r. Its launch takes the plain kernel's plan (same K split,
// so the same sums as skinny_gemm's; their occupancies were equal when written, ptxas 2026-12-05).
template <typename T, int NT, int MH, int L, int NM = kNoNorm, bool RK = false>
void launch_deep_rows(const GemmParams& p, int64_t m0, int rows, const GemmRopeKvParams& r = {}) {
  const DeepPlan plan = deep_plan<T, NT, MH, L, NM>(p);
  if (plan.grid > 0x7fffffff) fail(ErrorKind::not_implemented, "skinny_gemm", "weight: too many rows for one launch");
  const unsigned grid = static_cast<unsigned>(plan.grid);
  auto stream = gpu::as_stream(p.stream);
  GemmParams q = p;
  q.pdl = gpu::pdl_enabled(p.device.index);
  const char* late = std::getenv("LLMK_GEMM_PDL_LATE");  // (measurement; read at every launch)
  q.pdl_late = deep_pdl_late(late != nullptr ? late : "", RK ? "rope" : NT == 2 ? "gated" : "plain",
                             plan.grid <= plan.slots, plan.nw == 16);
  q.rope = nullptr;  // (a host pointer; the kernel takes r)
  if (plan.nw == 16)
    gpu::launch(gemm_deep_kernel<T, NT, MH, 16, L, NM, RK>, grid, 16 * 32, 0, stream, q.pdl, q, r, m0, rows, plan.sk);
  else gpu::launch(gemm_deep_kernel<T, NT, MH, 8, L, NM, RK>, grid, 8 * 32, 0, stream, q.pdl, q, r, m0, rows, plan.sk);
  gpu::check_launch(RK ? "skinny_gemm_rope_kv" : "skinny_gemm");
  if (RK) g_rope_kv_launches.fetch_add(1, std::memory_order_relaxed);
}

// 8 W loads per lane per trip; LLMK_GEMM_DEEP_LOADS=16 (read at every call; tests, tuning) takes
// 16 (8 KB per warp in flight, the 128-register kernel) at M <= 8 without the norm. 16 loads were
// the default where the 8-load plan is one partial wave (2026-12-03) while the kernel let the next
// one launch at its start, which cost the 8-load kernel 20-30% back to back there; with the trigger
// after the loop 8 loads decode faster (H200, 2026-12-04, 7b e2e batch 1: 225-226 against 220
// tok/s) and are faster alone after an L2 flush (4096x4096 14.9 against 16.4 us); back to back
// 16 loads still win at 14336x4096 (30.5 against 33.4 us,
// bench/results/h200-gemm-pdl-late-gate-2026-12-04.md).
// RK: skinny_gemm_rope_kv (the same kernel choices; only the launch of the last rows advances the
// length, after every row's position was read).
template <typename T, int NT, bool RK = false>
void launch_deep(const GemmParams& p, const GemmRopeKvParams& rk = {}) {
  const char* loads = std::getenv("LLMK_GEMM_DEEP_LOADS");
  const bool l16 = loads != nullptr && std::strcmp(loads, "16") == 0;
  constexpr int NM = norm_mode_for<T>();
  for (int64_t m0 = 0; m0 < p.m; m0 += kRowsMma) {
    const int rows = static_cast<int>(p.m - m0 < kRowsMma ? p.m - m0 : kRowsMma);
    GemmRopeKvParams r = rk;
    if (m0 + rows < p.m) r.advance = nullptr;
    if (p.norm_w && rows > 8) launch_deep_rows<T, NT, 2, 8, NM, RK>(p, m0, rows, r);
    else if (p.norm_w) launch_deep_rows<T, NT, 1, 8, NM, RK>(p, m0, rows, r);
    else if (rows > 8) launch_deep_rows<T, NT, 2, 8, kNoNorm, RK>(p, m0, rows, r);
    else if (l16) launch_deep_rows<T, NT, 1, 16, kNoNorm, RK>(p, m0, rows, r);
    else launch_deep_rows<T, NT, 1, 8, kNoNorm, RK>(p, m0, rows, r);
  }
}
#endif

#if LLMK_MMA_SYNC_BUILD
// The TMA kernel's split of the work: S blocks per cluster (each 1/S of K) and the number of
// clusters, each taking whole row tiles in turn. Cost model (K steps of 256 one block reads, plus
// about kTmaMergeSteps for each row tile's merge): rounds x (ceil(steps / S) + kTmaMergeSteps),
// where rounds = ceil(row tiles / clusters) and clusters = how many of that size are resident at
// once (one block per multiprocessor; cudaOccupancyMaxActiveClusters), at most one per row tile.
// The cheapest S (the smallest among equals) wins. Measured on the H200 (2026-12-01,
// scripts/gemm_sweep.py, M = 1, us for S = 1 / 2 / 4 / 8): 8192 x 28672 123.1 / 122.1 / 138.7 /
// 162.8 (448 tiles of 64 rows, 32 steps: 4 / 7 / 14 / 28 rounds), 4096 x 4096 18.2 / 18.3 / 22.5 /
// 26.9: a merge costs 2-5 steps; the model takes S = 2 for both.
constexpr int kTmaMergeSteps = 4;
struct TmaPlan {
  int s = 0, clusters = 0;  // s = 0: the kernel cannot run here
  // LLMK_GEMM_TMA_TAIL=1: the row tiles past the last whole round of one-block clusters
  // (head_tiles of them run at S = 1, clusters = every resident block) in a second launch of
  // tail_s-block clusters, one round (tail_s = 0: a single launch of s-block clusters)
  int head_tiles = 0, tail_s = 0, tail_tiles = 0;
};

// Why a tail: at 8192 x 28672 the 448 row tiles give S = 1 four rounds on 132 multiprocessors, the
// last for 52 blocks (3.39 rounds of work), and S = 2 seven rounds of half the steps plus a merge;
// three rounds at S = 1 and the 52 left over at S = 2 (104 blocks, one round) cost 3 x 36 + 20 =
// 128 units of the model against 140. Off until timed on a GPU (written 2026-12-06 without one).
template <typename T, int NT, int MH, int ST>
TmaPlan tma_plan(const GemmParams& p, int64_t steps, int64_t row_tiles) {
  const int dev = p.device.index;
  TmaPlan best;
  int64_t best_cost = 0;
  // LLMK_GEMM_TMA_SPLIT = 1 .. 8 forces S (tests, tuning; read per call)
  const char* forced = std::getenv("LLMK_GEMM_TMA_SPLIT");
  const int only = forced != nullptr ? std::atoi(forced) : 0;
  int64_t resident[9] = {};
  for (int s = 1; s <= 8; ++s) {
    resident[s] = gpu::resident_clusters<gemm_tma_kernel<T, NT, MH, ST>>(dev, static_cast<unsigned>(s),
                                                                         dim3(kTmaWarps * 32), tma_smem(ST));
    if (only >= 1 && only <= 8 && s != only) continue;
    const int64_t clusters = std::min<int64_t>(resident[s], row_tiles);
    if (clusters <= 0 || (s > steps && only != s)) continue;
    const int64_t cost = (row_tiles + clusters - 1) / clusters * ((steps + s - 1) / s + kTmaMergeSteps);
    if (best.s == 0 || cost < best_cost) {
      best = {s, static_cast<int>(clusters)};
      best_cost = cost;
    }
  }
  best.head_tiles = static_cast<int>(row_tiles);
  const char* tail = std::getenv("LLMK_GEMM_TMA_TAIL");
  if (best.s == 0 || only != 0 || tail == nullptr || std::strcmp(tail, "1") != 0 || resident[1] <= 0) return best;
  const int64_t rounds = row_tiles / resident[1], left = row_tiles % resident[1];
  if (rounds == 0 || left == 0) return best;
  for (int s = 2; s <= 8 && s <= steps; ++s) {  // the fewest steps a block for which the tail is one round
    if (resident[s] < left) continue;
    const int64_t cost = rounds * (steps + kTmaMergeSteps) + (steps + s - 1) / s + kTmaMergeSteps;
    if (cost < best_cost) {
      best = {1, static_cast<int>(resident[1]), static_cast<int>(rounds * resident[1]), s, static_cast<int>(left)};
      best_cost = cost;
    }
  }
  return best;
}

// Launches the TMA kernel for every 16 rows of x, or returns false (before launching anything)
// where it does not apply: not a compute capability 9.0 device with the sm_90a body loaded, the
// RMSNorm prologue, K not a multiple of 64, sizes past 32-bit coordinates, strides or bases TMA
// cannot express.
template <typename T, int NT, int MH, int ST>
bool launch_tma_rows(const GemmParams& p, int64_t m0, int rows, bool check_only) {
  constexpr auto kernel = gemm_tma_kernel<T, NT, MH, ST>;
  constexpr std::size_t smem_bytes = tma_smem(ST);
  const int dev = p.device.index;
  if (!gpu::tma::sm90_kernel_ready<kernel>(dev, smem_bytes, "skinny_gemm")) return false;
  const int64_t out_cols = NT == 2 ? p.n / 2 : p.n;
  const int64_t steps = (p.k + kTmaStepK - 1) / kTmaStepK, row_tiles = (out_cols + kTmaRows / NT - 1) / (kTmaRows / NT);
  if (p.k % 64 != 0 || p.k >= (int64_t{1} << 31) || p.n >= (int64_t{1} << 31)) return false;
  CUtensorMap map_w{}, map_x{};
  const bool f16 = std::is_same_v<T, half>;
  // dims (64 columns, K / 64 segments, rows): a box is 4 segments of each of its rows
  const int64_t w_strides[3] = {0, 64, p.w_stride}, x_strides[3] = {0, 64, p.x_stride};  // {-, segment, row}
  constexpr int kSegs = kTmaStepK / 64;
  // W: one streaming pass (no L2 promotion); x: read by every block (promoted)
  if (!gpu::tma::make_tensor_map(&map_w, f16, p.w, 64, p.k / 64, p.n, 1, w_strides, kSegs, false, kTmaRows / NT) ||
      !gpu::tma::make_tensor_map(&map_x, f16, static_cast<const T*>(p.x) + m0 * p.x_stride, 64, p.k / 64, rows, 1,
                                 x_strides, kSegs, true, 8 * MH))
    return false;
  const TmaPlan plan = tma_plan<T, NT, MH, ST>(p, steps, row_tiles);
  if (plan.s == 0) return false;
  if (check_only) return true;
  GemmParams q = p;
  q.pdl = gpu::pdl_enabled(dev);
  // LLMK_GEMM_TMA_EARLY_W=0: a fixed weight's first W boxes too are requested only after the PDL
  // wait (the A/B of the early requests; read per call)
  if (!gpu::env_flag("LLMK_GEMM_TMA_EARLY_W", true)) q.fixed_weight = false;
  // The next kernel launches once every block has taken its last W stage, not at this kernel's
  // start (LLMK_GEMM_TMA_PDL_LATE=0 for the start; read per call), and W's L2 lines are
  // evict-first, as the other kernels' weight loads (LLMK_GEMM_TMA_W_EVICT_FIRST=0 for plain lines).
  // Both defaults since an H100 A/B (2026-12-07, 8b e2e with the TMA gate/up, tok/s): 158 with
  // neither, 166 evict-first, 178 with both, 179 for the deep kernel's default. W's plain lines
  // stayed in L2 ahead of the next kernels' evict-first lines and slowed them (the deep kernels'
  // average 38 -> 69 us under the profiler); the 1B with the TMA head: 1043 plain, 1085 evict-first,
  // 1087-1089 with both, 1085 default. The deep kernel's trigger comment has what an early trigger
  // costs.
  q.pdl_late = gpu::env_flag("LLMK_GEMM_TMA_PDL_LATE", true);
  q.w_evict_first = gpu::env_flag("LLMK_GEMM_TMA_W_EVICT_FIRST", true);
  auto stream = gpu::as_stream(p.stream);
  // row tiles [tile0, tile0 + tiles) by `clusters` clusters of s blocks
  const auto launch = [&](int s, int clusters, int tile0, int tiles) {
    const unsigned grid = static_cast<unsigned>(s * clusters);
    if (s == 1)
      gpu::launch(kernel, grid, kTmaWarps * 32, smem_bytes, stream, q.pdl, q, m0, rows, 1, static_cast<int>(steps), tiles,
                  tile0, map_w, map_x);
    else
      gpu::launch_cluster(kernel, grid, kTmaWarps * 32, smem_bytes, stream, static_cast<unsigned>(s), q.pdl, q, m0, rows,
                          s, static_cast<int>(steps), tiles, tile0, map_w, map_x);
    gpu::check_launch("skinny_gemm");
  };
  launch(plan.s, plan.clusters, 0, plan.head_tiles);
  if (plan.tail_s > 0) {  // (PDL: its blocks start as the head's finish, then wait for the whole head)
    launch(plan.tail_s, plan.tail_tiles, plan.head_tiles, plan.tail_tiles);
    g_tma_tail_launches.fetch_add(1, std::memory_order_relaxed);
  }
  return true;
}

// One group of at most 16 rows of x: the kernel for 8 rows or for 16.
template <typename T, int NT, int ST>
bool launch_tma_group(const GemmParams& p, int64_t m0, int rows, bool check_only) {
  return rows <= 8 ? launch_tma_rows<T, NT, 1, ST>(p, m0, rows, check_only)
                   : launch_tma_rows<T, NT, 2, ST>(p, m0, rows, check_only);
}

template <typename T, int NT>
bool launch_tma(const GemmParams& p) {
  if (p.norm_w != nullptr) return false;
  // LLMK_GEMM_TMA_STAGES=4: the 4-stage build (tma_smem)
  const char* stages = std::getenv("LLMK_GEMM_TMA_STAGES");
  const bool four = stages != nullptr && std::strcmp(stages, "4") == 0;
  const auto group = four ? launch_tma_group<T, NT, 4> : launch_tma_group<T, NT, kTmaStages>;
  // with several groups of 16 rows, first check every one (nothing is launched unless all of them
  // can run); one group is checked by its launch itself
  for (int pass = p.m > kRowsMma ? 0 : 1; pass < 2; ++pass)
    for (int64_t m0 = 0; m0 < p.m; m0 += kRowsMma) {
      const int rows = static_cast<int>(p.m - m0 < kRowsMma ? p.m - m0 : kRowsMma);
      if (!group(p, m0, rows, pass == 0)) return false;
    }
  return true;
}
#endif

// An integer switch read per call, clamped to [lo, hi]; `fallback` when unset or empty.
int env_int(const char* name, int fallback, int lo, int hi) {
  const char* v = std::getenv(name);
  const int x = v != nullptr && *v != '\0' ? std::atoi(v) : fallback;
  return x < lo ? lo : x > hi ? hi : x;
}

// RK: skinny_gemm_rope_kv's epilogue with rk (only the last pass advances the length).
template <typename T, int NT, int VW, bool RK = false>
void launch_portable(const GemmParams& p, unsigned grid, const GemmRopeKvParams& rk = {}) {
  constexpr int COLS = NT * 8;
  const int threads = kWarps * gpu::warp_size(p.device.index);
  // rows of x per pass: all of a skinny call's (16), or LLMK_GEMM_PORTABLE_ROWS (4 reproduces the
  // passes of before 2026-12-05's change, for the A/B)
  const int pass = env_int("LLMK_GEMM_PORTABLE_ROWS", kRowsMma, 1, kRowsMma);
  // passes of up to all_w rows give every warp all of the block's W rows (CW = COLS);
  // LLMK_GEMM_PORTABLE_ALL_W_ROWS = 0-2 for the A/B of the 2-row pass (43.6 us against F.linear's
  // 40.8 at 4096 x 14336 on the H200, 2026-12-05, while 1 row beat it)
  const int all_w = env_int("LLMK_GEMM_PORTABLE_ALL_W_ROWS", 2, 0, 2);
  auto stream = gpu::as_stream(p.stream);
  for (int64_t m0 = 0; m0 < p.m; m0 += pass) {
    const int rows = static_cast<int>(p.m - m0 < pass ? p.m - m0 : pass);
    GemmRopeKvParams r = rk;
    if (m0 + rows < p.m) r.advance = nullptr;  // the last pass moves the length, after every row's read
    if (rows == 1 && all_w >= 1) gemm_portable_kernel<T, NT, VW, 1, COLS, RK><<<grid, threads, 0, stream>>>(p, r, m0, rows);
    else if (rows == 2 && all_w >= 2) gemm_portable_kernel<T, NT, VW, 2, COLS, RK><<<grid, threads, 0, stream>>>(p, r, m0, rows);
    else if (rows <= 4) gemm_portable_kernel<T, NT, VW, 4, 4, RK><<<grid, threads, 0, stream>>>(p, r, m0, rows);
    else if (rows <= 8) gemm_portable_kernel<T, NT, VW, 8, 4, RK><<<grid, threads, 0, stream>>>(p, r, m0, rows);
    else gemm_portable_kernel<T, NT, VW, 16, 4, RK><<<grid, threads, 0, stream>>>(p, r, m0, rows);
    gpu::check_launch(RK ? "skinny_gemm_rope_kv" : "skinny_gemm");
    if (RK) g_rope_kv_launches.fetch_add(1, std::memory_order_relaxed);
  }
}

// The kernel that runs p (env_kernel's choice, or the portable kernel where 16-byte loads, mma.sync
// or GemmOptions::portable rule the others out); vec: whether 16-byte loads apply.
template <typename T>
KernelChoice kernel_for(const GemmParams& p, bool& vec) {
  vec = gpu::vector_width<T>(p.k, {p.x, p.w}, {p.x_stride, p.w_stride}) == 8;
  const KernelChoice kernel = env_kernel(p);
  return !vec || p.portable || !gpu::mma::available(p.device.index) ? KernelChoice::portable : kernel;
}

template <typename T, int NT>
void launch_nt(const GemmParams& p) {
  const int64_t out_cols = NT == 2 ? p.n / 2 : p.n;
  const int64_t blocks = (out_cols + 7) / 8;
  if (blocks > 0x7fffffff) fail(ErrorKind::not_implemented, "skinny_gemm", "weight: too many rows for one launch");
  const unsigned grid = static_cast<unsigned>(blocks);
  bool vec = false;
  KernelChoice kernel = kernel_for<T>(p, vec);
  // The stream kernel has no fusions (measured slower anyway): the mma kernel runs them instead.
  if (kernel == KernelChoice::stream && (p.norm_w || p.residual)) kernel = KernelChoice::mma;
#if LLMK_MMA_SYNC_BUILD
  // the TMA kernel where it applies (Hopper, no RMSNorm prologue), else the default's other choice
  if (kernel == KernelChoice::tma) {
    if (launch_tma<T, NT>(p)) {
      g_tma_calls.fetch_add(1, std::memory_order_relaxed);
      return;
    }
    kernel = non_tma_default(p);
  }
  if (kernel == KernelChoice::deep && p.k < (int64_t{1} << 30)) {  // K in 32-bit ints in the kernel
    launch_deep<T, NT>(p);
    return;
  }
  if (kernel == KernelChoice::stream) {
    launch_stream<T, NT>(p, blocks);
    return;
  }
  if (kernel == KernelChoice::mma || kernel == KernelChoice::deep) {
    for (int64_t m0 = 0; m0 < p.m; m0 += kRowsMma) {
      const int rows = static_cast<int>(p.m - m0 < kRowsMma ? p.m - m0 : kRowsMma);
      const auto kernel_fn = p.norm_w ? gemm_mma_kernel<T, NT, norm_mode_for<T>()> : gemm_mma_kernel<T, NT>;
      gpu::launch(kernel_fn, grid, kWarps * 32, 0, gpu::as_stream(p.stream), gpu::pdl_enabled(p.device.index), p, m0,
                  rows);
      gpu::check_launch("skinny_gemm");
    }
    return;
  }
#else
  (void)kernel;  // HIP: only the portable kernel is built
#endif
  if (vec) launch_portable<T, NT, 8>(p, grid);
  else launch_portable<T, NT, 1>(p, grid);
}

template <typename T>
void launch_typed(const GemmParams& p) {
  if (gemm_gated(p.activation)) launch_nt<T, 2>(p);
  else launch_nt<T, 1>(p);
}

}  // namespace

// One launch (per 16 rows of x, or per pass of the portable kernel) where the kernel that runs this
// product has the epilogue: the deep kernel (the NVIDIA default, and LLMK_GEMM_KERNEL=tma's choice
// where the TMA kernel does not apply, as in launch_nt: it has no RoPE epilogue; D a multiple of
// 16) or the portable one (AMD, LLMK_GEMM_KERNEL=portable, GemmOptions::portable, K % 8 != 0; D a
// multiple of 8), chosen as launch_nt chooses. False, having launched nothing, for the others (mma,
// stream asked for) and other head dims.
template <typename T>
bool launch_rope_kv(const GemmParams& p) {
  const GemmRopeKvParams& r = *p.rope;
  bool vec = false;
  const KernelChoice kernel = kernel_for<T>(p, vec);
#if LLMK_MMA_SYNC_BUILD
  if ((kernel == KernelChoice::deep || kernel == KernelChoice::tma) && r.head_dim % 16 == 0 &&
      p.k < (int64_t{1} << 30)) {
    launch_deep<T, 1, true>(p, r);
    return true;
  }
#endif
  if (kernel != KernelChoice::portable || r.head_dim % 8 != 0) return false;
  const unsigned grid = static_cast<unsigned>(p.n / 8);  // (N = (Hq + 2 Hkv) D: whole blocks of 8)
  if (vec) launch_portable<T, 1, 8, true>(p, grid, r);
  else launch_portable<T, 1, 1, true>(p, grid, r);
  return true;
}

bool skinny_gemm_rope_kv_gpu(const GemmParams& p) {
  gpu::DeviceGuard guard(p.device, "skinny_gemm_rope_kv");
  if (p.rope == nullptr || p.m == 0 || p.n == 0 || p.n >= (int64_t{1} << 31)) return false;  // (32-bit columns)
  switch (p.dtype) {
    case DType::f16: return launch_rope_kv<half>(p);
    case DType::bf16: return launch_rope_kv<bfloat16>(p);
    default: return false;
  }
}

int64_t skinny_gemm_rope_kv_launches_gpu() { return g_rope_kv_launches.load(std::memory_order_relaxed); }
int64_t skinny_gemm_tma_tail_launches_gpu() { return g_tma_tail_launches.load(std::memory_order_relaxed); }
int64_t skinny_gemm_tma_calls_gpu() { return g_tma_calls.load(std::memory_order_relaxed); }

void skinny_gemm_gpu(const GemmParams& p) {
  gpu::DeviceGuard guard(p.device, "skinny_gemm");
  switch (p.dtype) {
    case DType::f16: launch_typed<half>(p); break;
    case DType::bf16: launch_typed<bfloat16>(p); break;
    default: fail(ErrorKind::not_implemented, "skinny_gemm", "the GPU path supports float16 and bfloat16");
  }
}

}  // namespace llmk::detail
