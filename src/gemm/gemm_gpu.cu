// Skinny GEMM on the GPU (one source for CUDA and HIP, through src/gpu/): y = x W^T (+ bias),
// optionally silu(gate) * up, for x of up to 16 rows (larger M runs in groups of rows).
//
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
//     (or single elements when K is not a multiple of 8), fp32 FMAs for up to 4 rows of x at a time
//     into per-lane sums, then warp reductions.
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "core/check.h"
#include "gemm/gemm_internal.h"
#include "gpu/compat.h"
#include "gpu/mma.h"
#include "gpu/runtime.h"

namespace llmk::detail {

using gpu::bfloat16;
using gpu::half;

namespace {

constexpr int kWarps = 8;
constexpr int kRowsMma = 16;
constexpr int kUnroll = 2;  // 32-wide K steps per loop trip of the mma kernel (registers: 4 blocks/SM)

template <typename T, int NT>
__device__ __forceinline__ void epilogue(const GemmParams& p, const float* red, int64_t m0, int mrows,
                                         int64_t col0) {
  const int64_t out_cols = NT == 2 ? p.n / 2 : p.n;
  const T* bias = static_cast<const T*>(p.bias);
  T* out = static_cast<T*>(p.out);
  for (int e = threadIdx.x; e < mrows * 8; e += blockDim.x) {
    const int m = e / 8, j = e % 8;
    const int64_t col = col0 + j;
    if (col >= out_cols) continue;
    float g = 0.f;
    for (int w = 0; w < kWarps; ++w) g += red[(w * NT * 8 + j) * kRowsMma + m];
    if (bias) g += gpu::to_float(bias[col]);
    float y = g;
    if constexpr (NT == 2) {
      float u = 0.f;
      for (int w = 0; w < kWarps; ++w) u += red[(w * NT * 8 + 8 + j) * kRowsMma + m];
      if (bias) u += gpu::to_float(bias[out_cols + col]);
      y = g / (1.f + __expf(-g)) * u;
    }
    out[(m0 + m) * p.out_stride + col] = gpu::from_float<T>(y);
  }
}

// K range of warp `warp`: slices of ceil(K / kWarps) rounded up to `granule`.
__device__ __forceinline__ void warp_slice(int64_t k, int warp, int granule, int64_t& kb, int64_t& ke) {
  int64_t per = (k + kWarps - 1) / kWarps;
  per = (per + granule - 1) / granule * granule;
  kb = warp * per;
  ke = kb + per < k ? kb + per : k;
}

template <typename T, int NT>
__global__ void __launch_bounds__(kWarps * 32, 4) gemm_mma_kernel(GemmParams p, int64_t m0, int mrows) {
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

  float acc[NT][4];
#pragma unroll
  for (int t = 0; t < NT; ++t) acc[t][0] = acc[t][1] = acc[t][2] = acc[t][3] = 0.f;
  V8 zero;
#pragma unroll
  for (int i = 0; i < 8; ++i) zero.v[i] = gpu::from_float<T>(0.f);

  for (int64_t base = kb; base < ke; base += 32 * kUnroll) {
    V8 wv[NT][kUnroll], xa[kUnroll], xb[kUnroll];
#pragma unroll
    for (int j = 0; j < kUnroll; ++j) {
      const int64_t kk = base + j * 32 + tig * 8;
      const bool ok = kk < ke;
#pragma unroll
      for (int t = 0; t < NT; ++t)
        wv[t][j] = ok && col_ok ? gpu::load_vec<T, 8, gpu::Cache::stream>(wrow[t] + kk) : zero;
      xa[j] = ok && x0_ok ? gpu::load_vec<T, 8>(x0 + kk) : zero;
      xb[j] = ok && x1_ok ? gpu::load_vec<T, 8>(x1 + kk) : zero;
    }
#pragma unroll
    for (int j = 0; j < kUnroll; ++j) {
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
  __syncthreads();
  epilogue<T, NT>(p, red, m0, mrows, col0);
#else
  (void)p;
  (void)m0;
  (void)mrows;
#endif
}

template <typename T, int NT, int VW, int MT>
__global__ void __launch_bounds__(kWarps * LLMK_WARP_SIZE) gemm_portable_kernel(GemmParams p, int64_t m0, int mrows) {
  constexpr int WS = LLMK_WARP_SIZE;
  constexpr int COLS = NT * 8;
  __shared__ float red[kWarps * COLS * kRowsMma];
  const int warp = threadIdx.x / WS, lane = threadIdx.x % WS;
  const int64_t out_cols = NT == 2 ? p.n / 2 : p.n;
  const int64_t col0 = static_cast<int64_t>(blockIdx.x) * 8;
  const T* w = static_cast<const T*>(p.w);
  const T* x = static_cast<const T*>(p.x);
  int64_t kb, ke;
  warp_slice(p.k, warp, VW * WS, kb, ke);

  float acc[MT][COLS];
#pragma unroll
  for (int m = 0; m < MT; ++m)
#pragma unroll
    for (int c = 0; c < COLS; ++c) acc[m][c] = 0.f;

  for (int64_t k = kb + lane * VW; k < ke; k += WS * VW) {
    float xf[MT][VW];
#pragma unroll
    for (int m = 0; m < MT; ++m) {
      if (m < mrows) {
        gpu::load_float<T, VW>(x + (m0 + m) * p.x_stride + k, xf[m]);
      } else {
#pragma unroll
        for (int v = 0; v < VW; ++v) xf[m][v] = 0.f;
      }
    }
#pragma unroll
    for (int c = 0; c < COLS; ++c) {
      const int64_t col = col0 + c % 8;
      if (col >= out_cols) continue;
      float wf[VW];
      gpu::load_float<T, VW, gpu::Cache::stream>(w + ((c / 8) * out_cols + col) * p.w_stride + k, wf);
#pragma unroll
      for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int v = 0; v < VW; ++v) acc[m][c] += xf[m][v] * wf[v];
    }
  }
#pragma unroll
  for (int m = 0; m < MT; ++m)
#pragma unroll
    for (int c = 0; c < COLS; ++c) {
      const float s = gpu::warp_reduce_sum(acc[m][c]);
      if (lane == 0) red[(warp * COLS + c) * kRowsMma + m] = s;
    }
  __syncthreads();
  epilogue<T, NT>(p, red, m0, mrows, col0);
}

bool env_portable() {
  static const bool on = [] {
    const char* v = std::getenv("LLMK_GEMM_PORTABLE");
    return v != nullptr && *v != '\0' && std::strcmp(v, "0") != 0;
  }();
  return on;
}


template <typename T, int NT, int VW>
void launch_portable(const GemmParams& p, unsigned grid) {
  const int threads = kWarps * gpu::warp_size(p.device.index);
  for (int64_t m0 = 0; m0 < p.m; m0 += 4) {
    const int rows = static_cast<int>(p.m - m0 < 4 ? p.m - m0 : 4);
    auto stream = gpu::as_stream(p.stream);
    if (rows == 1) gemm_portable_kernel<T, NT, VW, 1><<<grid, threads, 0, stream>>>(p, m0, rows);
    else if (rows == 2) gemm_portable_kernel<T, NT, VW, 2><<<grid, threads, 0, stream>>>(p, m0, rows);
    else gemm_portable_kernel<T, NT, VW, 4><<<grid, threads, 0, stream>>>(p, m0, rows);
    gpu::check_launch("skinny_gemm");
  }
}

template <typename T, int NT>
void launch_nt(const GemmParams& p) {
  const int64_t out_cols = NT == 2 ? p.n / 2 : p.n;
  const int64_t blocks = (out_cols + 7) / 8;
  if (blocks > 0x7fffffff) fail(ErrorKind::not_implemented, "skinny_gemm", "weight: too many rows for one launch");
  const unsigned grid = static_cast<unsigned>(blocks);
  const bool vec = gpu::vector_width<T>(p.k, {p.x, p.w}, {p.x_stride, p.w_stride}) == 8;
  if (vec && !p.portable && !env_portable() && gpu::mma::available(p.device.index)) {
    for (int64_t m0 = 0; m0 < p.m; m0 += kRowsMma) {
      const int rows = static_cast<int>(p.m - m0 < kRowsMma ? p.m - m0 : kRowsMma);
      gemm_mma_kernel<T, NT><<<grid, kWarps * 32, 0, gpu::as_stream(p.stream)>>>(p, m0, rows);
      gpu::check_launch("skinny_gemm");
    }
  } else if (vec) {
    launch_portable<T, NT, 8>(p, grid);
  } else {
    launch_portable<T, NT, 1>(p, grid);
  }
}

template <typename T>
void launch_typed(const GemmParams& p) {
  if (p.activation == GemmActivation::swiglu) launch_nt<T, 2>(p);
  else launch_nt<T, 1>(p);
}

}  // namespace

void skinny_gemm_gpu(const GemmParams& p) {
  gpu::DeviceGuard guard(p.device, "skinny_gemm");
  switch (p.dtype) {
    case DType::f16: launch_typed<half>(p); break;
    case DType::bf16: launch_typed<bfloat16>(p); break;
    default: fail(ErrorKind::not_implemented, "skinny_gemm", "the GPU path supports float16 and bfloat16");
  }
}

}  // namespace llmk::detail
