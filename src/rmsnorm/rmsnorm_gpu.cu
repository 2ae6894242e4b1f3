// RMSNorm family on the GPU (one source for CUDA and HIP, through src/gpu/ only).
//
// Forward (rms_norm, fused_add_rms_norm): a group of threads per row (threadIdx.x across the row,
// threadIdx.y picks one of several rows of a block when rows are short). Each thread reads its
// part of the row once with up-to-16-byte vector loads, keeps it in registers (CACHE vectors per
// thread; the "streaming" variant, CACHE == 0, re-reads the row for very long rows), the group
// sums the squares, and each thread writes its part scaled by rstd * (offset + weight).
// One pass over memory: x (and residual) read once, y (and residual_out) written once.
//
// Backward: same row layout, in a grid-stride loop over row groups so that each block
// accumulates its rows' share of grad_weight in registers; the per-block partials go to a fp32
// workspace and a second kernel sums them column by column.
#include <algorithm>
#include <cstdlib>
#include <initializer_list>
#include <type_traits>

#include "core/check.h"
#include "gpu/compat.h"
#include "gpu/runtime.h"
#include "rmsnorm/rmsnorm_internal.h"

namespace llmk::detail {

using gpu::bfloat16;
using gpu::half;
using gpu::Vec;

namespace {

constexpr int kMaxThreads = 1024;
constexpr int kBackwardMaxThreads = 512;  // leaves 128 registers a thread for the cached rows
constexpr int kScratchFloats = 2 * kMaxThreads / 32;  // 2 values per warp, smallest warp is 32

// Launch shape for a row of `cols` elements: vector width, threads per row, rows per block and
// vectors cached per thread (0 = streaming).
struct RowLayout {
  int vec = 1;
  int threads_per_row = 32;
  int rows_per_block = 1;
  int cache = 1;
};

// Vectors each thread should own when the row allows. 4 (four independent 16-byte loads in
// flight, 256 threads for a row of 8192 16-bit elements) measured best on the H200 against 1, 2
// and 8 (2026-11-30, bench/results/h200-tuning.md). LLMK_RMSNORM_VPT overrides it (1, 2, 4 or 8).
int target_vectors_per_thread() {
  static const int vpt = [] {
    const char* env = std::getenv("LLMK_RMSNORM_VPT");
    const int v = env ? std::atoi(env) : 4;
    return (v == 1 || v == 2 || v == 4 || v == 8) ? v : 4;
  }();
  return vpt;
}

RowLayout choose_layout(int64_t cols, int vec, int warp, int max_cache, int max_threads) {
  RowLayout l;
  l.vec = vec;
  const int64_t nvec = cols / vec;
  auto round_up = [](int64_t v, int64_t m) { return (v + m - 1) / m * m; };
  const int64_t want = std::min<int64_t>(target_vectors_per_thread(), max_cache);
  int64_t tpr = std::min<int64_t>(
      std::max<int64_t>(round_up((nvec + want - 1) / want, warp), warp), 512);
  int64_t per_thread = (nvec + tpr - 1) / tpr;
  if (per_thread > max_cache) {
    tpr = max_threads;
    per_thread = (nvec + tpr - 1) / tpr;
  }
  l.threads_per_row = static_cast<int>(tpr);
  l.cache = per_thread <= 1 ? 1 : per_thread <= 2 ? 2 : per_thread <= 4 ? 4 : per_thread <= 8 ? 8 : 0;
  if (l.cache > max_cache) l.cache = 0;
  l.rows_per_block = std::max(1, 128 / l.threads_per_row);
  return l;
}

// ------------------------------------------------------------------------------- forward
// Rows cached in up to 4 vectors a thread run in blocks of at most 512 threads; asking for 3
// such blocks per multiprocessor caps registers at 40 a thread, so that enough threads stay
// resident to keep loads in flight. Uncapped, bf16 took 44-50 registers and ran 20% slower than
// fp16; a cap of 32 (4 blocks) spilled and lost 5-10% on the fused op (H200, 2026-11-30,
// bench/results/h200-tuning.md).
template <int CACHE>
constexpr int forward_max_threads() { return CACHE == 0 || CACHE > 4 ? kMaxThreads : 512; }
template <int CACHE>
constexpr int forward_min_blocks() { return CACHE == 0 || CACHE > 4 ? 1 : 3; }

// Forward launches of at most this many rows prefetch the weight (see the kernel).
constexpr int64_t kPrefetchWeightRows = 256;

template <typename T, typename W, int VEC, int CACHE, bool ADD>
__global__ void __launch_bounds__(forward_max_threads<CACHE>(), forward_min_blocks<CACHE>())
rms_norm_forward_kernel(RmsNormParams p) {
  using gpu::Cache;
  using V = Vec<T, VEC>;
  __shared__ float scratch[kScratchFloats];
  // PDL (gpu::launch): the next kernel may launch. A few rows (a decode step: one block, latency
  // bound): this thread's weight vectors are asked of L1 first, so that reading them after the
  // reduction is not a second trip to memory (and, under PDL, happens before waiting for the
  // kernel that writes x). Safe even for a weight that kernel writes: a prefetch holds no value, and
  // the loads come after the wait, which makes that kernel's writes visible. Only in the
  // cached layouts of up to 4 vectors a thread without the fused add (elsewhere the extra live
  // range makes ptxas spill, or the row is too wide for one block to matter).
  gpu::pdl_trigger();
  if constexpr (!ADD && CACHE > 0 && CACHE <= 4)
    if (p.rows <= kPrefetchWeightRows)
      for (int64_t i = threadIdx.x; i < p.cols / VEC; i += blockDim.x)
        gpu::prefetch_l1(static_cast<const W*>(p.weight) + i * VEC);
  gpu::pdl_wait();
  const int64_t row = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y;
  const bool active = row < p.rows;
  const int64_t nvec = p.cols / VEC;
  const V* x = reinterpret_cast<const V*>(static_cast<const T*>(p.x) + row * p.x_stride);
  const V* res = reinterpret_cast<const V*>(static_cast<const T*>(p.residual) + row * p.residual_stride);
  V* res_out = reinterpret_cast<V*>(static_cast<T*>(p.residual_out) + row * p.residual_out_stride);
  T* y = static_cast<T*>(p.y) + row * p.y_stride;
  const W* w = static_cast<const W*>(p.weight);

  // Vector i of the input row: x, or x + residual rounded to T (and stored to residual_out).
  // Activations are touched once: streamed past L2, so that the weight stays resident.
  auto load_input = [&](int64_t i) {
    V v = gpu::load<Cache::stream>(x + i);
    if constexpr (ADD) {
      float a[VEC], b[VEC];
      gpu::to_float(v, a);
      gpu::to_float(gpu::load<Cache::stream>(res + i), b);
#pragma unroll
      for (int k = 0; k < VEC; ++k) a[k] += b[k];
      v = gpu::from_float<T, VEC>(a);
      gpu::store<Cache::keep>(res_out + i, v);  // read again by the next layer: keep it in L2
    }
    return v;
  };
  auto add_squares = [](const V& v, float& acc) {
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      const float f = gpu::to_float(v.v[k]);
      acc += f * f;
    }
  };
  auto write_output = [&](int64_t i, const V& v, float rstd) {
    float xv[VEC], wv[VEC], out[VEC];
    gpu::to_float(v, xv);
    gpu::load_float<W, VEC>(w + i * VEC, wv);
#pragma unroll
    for (int k = 0; k < VEC; ++k) out[k] = xv[k] * rstd * (p.offset + wv[k]);
    gpu::store_float<T, VEC, Cache::stream>(y + i * VEC, out);
  };

  float sumsq[1] = {0.f};
  V cache[CACHE > 0 ? CACHE : 1];  // the row as stored (no float round trip)
  if constexpr (CACHE > 0) {
#pragma unroll
    for (int j = 0; j < CACHE; ++j) {
      const int64_t i = threadIdx.x + static_cast<int64_t>(j) * blockDim.x;
      if (active && i < nvec) {
        cache[j] = load_input(i);
        add_squares(cache[j], sumsq[0]);
      }
    }
  } else {
    for (int64_t i = threadIdx.x; active && i < nvec; i += blockDim.x) add_squares(load_input(i), sumsq[0]);
  }
  gpu::group_reduce_sum<1>(sumsq, scratch);
  if (!active) return;
  const float rstd = gpu::rsqrt(sumsq[0] / static_cast<float>(p.cols) + p.eps);

  if constexpr (CACHE > 0) {
#pragma unroll
    for (int j = 0; j < CACHE; ++j) {
      const int64_t i = threadIdx.x + static_cast<int64_t>(j) * blockDim.x;
      if (i < nvec) write_output(i, cache[j], rstd);
    }
  } else {
    const V* in = ADD ? res_out : x;  // this thread wrote res_out itself above
    for (int64_t i = threadIdx.x; i < nvec; i += blockDim.x) write_output(i, in[i], rstd);
  }
}

// ------------------------------------------------------------------------------- backward
template <typename T, typename W, int VEC, int CACHE>
__global__ void __launch_bounds__(kBackwardMaxThreads)
rms_norm_backward_kernel(RmsNormBackwardParams p) {
  __shared__ float scratch[kScratchFloats];
  const int64_t nvec = p.cols / VEC;
  const W* w = static_cast<const W*>(p.weight);
  // This thread's slot of grad_weight partials: one workspace row per (block, row-in-block).
  float* partial = p.workspace + (static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y) * p.cols;
  float dw[CACHE > 0 ? CACHE : 1][VEC] = {};
  if constexpr (CACHE == 0) {
    for (int64_t c = threadIdx.x; c < p.cols; c += blockDim.x) partial[c] = 0.f;
  }
  const int64_t groups = (p.rows + blockDim.y - 1) / blockDim.y;
  for (int64_t g = blockIdx.x; g < groups; g += gridDim.x) {
    const int64_t row = g * blockDim.y + threadIdx.y;
    const bool active = row < p.rows;
    const T* x = static_cast<const T*>(p.x) + row * p.x_stride;
    const T* gy = static_cast<const T*>(p.grad_y) + row * p.grad_y_stride;
    T* gx = static_cast<T*>(p.grad_x) + row * p.grad_x_stride;
    const T* extra = static_cast<const T*>(p.grad_extra) + row * p.grad_extra_stride;

    float sums[2] = {0.f, 0.f};  // sum x^2, sum grad_y * (offset + w) * x
    auto accumulate = [&](int64_t i) {
      float xv[VEC], gv[VEC], wv[VEC];
      gpu::load_float<T, VEC>(x + i * VEC, xv);
      gpu::load_float<T, VEC>(gy + i * VEC, gv);
      gpu::load_float<W, VEC>(w + i * VEC, wv);
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        sums[0] += xv[k] * xv[k];
        sums[1] += gv[k] * (p.offset + wv[k]) * xv[k];
      }
    };
    Vec<T, VEC> xc[CACHE > 0 ? CACHE : 1], gc[CACHE > 0 ? CACHE : 1];
    if constexpr (CACHE > 0) {
#pragma unroll
      for (int j = 0; j < CACHE; ++j) {
        const int64_t i = threadIdx.x + static_cast<int64_t>(j) * blockDim.x;
        if (active && i < nvec) {
          xc[j] = *reinterpret_cast<const Vec<T, VEC>*>(x + i * VEC);
          gc[j] = *reinterpret_cast<const Vec<T, VEC>*>(gy + i * VEC);
          accumulate(i);  // re-reads x and grad_y from L1: the loads above just brought them in
        }
      }
    } else {
      for (int64_t i = threadIdx.x; active && i < nvec; i += blockDim.x) accumulate(i);
    }
    gpu::group_reduce_sum<2>(sums, scratch);
    if (!active) continue;
    const float inv_n = 1.f / static_cast<float>(p.cols);
    const float rstd = gpu::rsqrt(sums[0] * inv_n + p.eps);
    const float coef = sums[1] * rstd * rstd * rstd * inv_n;

    auto emit = [&](int64_t i, const float (&xv)[VEC], const float (&gv)[VEC], float (&dwv)[VEC]) {
      float wv[VEC], dx[VEC];
      gpu::load_float<W, VEC>(w + i * VEC, wv);
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        dx[k] = rstd * gv[k] * (p.offset + wv[k]) - coef * xv[k];
        dwv[k] += gv[k] * xv[k] * rstd;
      }
      if (p.grad_extra) {
        float e[VEC];
        gpu::load_float<T, VEC>(extra + i * VEC, e);
#pragma unroll
        for (int k = 0; k < VEC; ++k) dx[k] += e[k];
      }
      gpu::store_float<T, VEC>(gx + i * VEC, dx);
    };
    if constexpr (CACHE > 0) {
#pragma unroll
      for (int j = 0; j < CACHE; ++j) {
        const int64_t i = threadIdx.x + static_cast<int64_t>(j) * blockDim.x;
        if (i < nvec) {
          float xv[VEC], gv[VEC];
#pragma unroll
          for (int k = 0; k < VEC; ++k) {
            xv[k] = gpu::to_float(xc[j].v[k]);
            gv[k] = gpu::to_float(gc[j].v[k]);
          }
          emit(i, xv, gv, dw[j]);
        }
      }
    } else {
      for (int64_t i = threadIdx.x; i < nvec; i += blockDim.x) {
        float xv[VEC], gv[VEC], dwv[VEC];
        gpu::load_float<T, VEC>(x + i * VEC, xv);
        gpu::load_float<T, VEC>(gy + i * VEC, gv);
#pragma unroll
        for (int k = 0; k < VEC; ++k) dwv[k] = partial[i * VEC + k];
        emit(i, xv, gv, dwv);
#pragma unroll
        for (int k = 0; k < VEC; ++k) partial[i * VEC + k] = dwv[k];
      }
    }
  }
  if constexpr (CACHE > 0) {
#pragma unroll
    for (int j = 0; j < CACHE; ++j) {
      const int64_t i = threadIdx.x + static_cast<int64_t>(j) * blockDim.x;
      if (i < nvec) {
#pragma unroll
        for (int k = 0; k < VEC; ++k) partial[i * VEC + k] = dw[j][k];
      }
    }
  }
}

// grad_weight[c] = sum over `slots` workspace rows. Block (32 columns) x (8 slot lanes).
template <typename W>
__global__ void sum_partials_kernel(const float* __restrict__ partial, W* __restrict__ grad_weight,
                                    int64_t slots, int64_t cols) {
  __shared__ float sums[8][33];
  const int64_t c = static_cast<int64_t>(blockIdx.x) * 32 + threadIdx.x;
  float s = 0.f;
  if (c < cols)
    for (int64_t r = threadIdx.y; r < slots; r += 8) s += partial[r * cols + c];
  sums[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y == 0 && c < cols) {
    float total = 0.f;
#pragma unroll
    for (int r = 0; r < 8; ++r) total += sums[r][threadIdx.x];
    grad_weight[c] = gpu::from_float<W>(total);
  }
}

// ------------------------------------------------------------------------------- dispatch
template <typename F>
void dispatch_types(const char* op, DType dtype, DType weight_dtype, F&& f) {
  auto with_weight = [&](auto t) {
    if (weight_dtype == DType::f32) f(t, float{});
    else f(t, decltype(t){});
  };
  switch (dtype) {
    case DType::f32: f(float{}, float{}); break;
    case DType::f16: with_weight(half{}); break;
    case DType::bf16: with_weight(bfloat16{}); break;
    default: fail(ErrorKind::type, op, "unsupported dtype");
  }
}

// Calls f(std::integral_constant<int, VEC>, std::integral_constant<int, CACHE>) for the layout.
template <int FULL_VEC, int MAX_CACHE, typename F>
void dispatch_layout(const RowLayout& l, F&& f) {
  auto with_cache = [&](auto vec) {
    switch (l.cache) {
      case 1: f(vec, std::integral_constant<int, 1>{}); break;
      case 2: f(vec, std::integral_constant<int, 2>{}); break;
      case 4: if constexpr (MAX_CACHE >= 4) f(vec, std::integral_constant<int, 4>{}); break;
      case 8: if constexpr (MAX_CACHE >= 8) f(vec, std::integral_constant<int, 8>{}); break;
      default: f(vec, std::integral_constant<int, 0>{}); break;
    }
  };
  if (l.vec == FULL_VEC) with_cache(std::integral_constant<int, FULL_VEC>{});
  else with_cache(std::integral_constant<int, 1>{});
}

constexpr int kForwardMaxCache = 8;
constexpr int kBackwardMaxCache = 4;  // x, grad_y and the grad_weight partials all in registers

struct BackwardLaunch {
  RowLayout layout;
  int64_t blocks = 0;
  int64_t slots() const { return blocks * layout.rows_per_block; }
};

BackwardLaunch backward_launch(int64_t rows, int64_t cols, int vec, Device device) {
  BackwardLaunch b;
  b.layout = choose_layout(cols, vec, gpu::warp_size(device.index), kBackwardMaxCache,
                           kBackwardMaxThreads);
  const int64_t groups = (rows + b.layout.rows_per_block - 1) / b.layout.rows_per_block;
  const int threads = b.layout.threads_per_row * b.layout.rows_per_block;
  const int64_t per_sm = std::max(1, 2048 / threads);
  b.blocks = std::max<int64_t>(1, std::min<int64_t>(groups, per_sm * gpu::multiprocessor_count(device.index)));
  return b;
}

}  // namespace

void rms_norm_gpu(const RmsNormParams& p) {
  const char* op = p.residual ? "fused_add_rms_norm" : "rms_norm";
  gpu::DeviceGuard guard(p.device, op);
  dispatch_types(op, p.dtype, p.weight_dtype, [&](auto t, auto wt) {
    using T = decltype(t);
    using W = decltype(wt);
    constexpr int kVec = 16 / sizeof(T);
    const int vec = gpu::vector_width<T>(
        p.cols, {p.x, p.y, p.weight, p.residual, p.residual_out},
        {p.x_stride, p.y_stride, p.residual_stride, p.residual_out_stride});
    const RowLayout l = choose_layout(p.cols, vec, gpu::warp_size(p.device.index), kForwardMaxCache, kMaxThreads);
    const dim3 block(l.threads_per_row, l.rows_per_block);
    const int64_t blocks = (p.rows + l.rows_per_block - 1) / l.rows_per_block;
    if (blocks > 0x7fffffff) fail(ErrorKind::value, op, "x: too many rows for one launch");
    dispatch_layout<kVec, kForwardMaxCache>(l, [&](auto vec_c, auto cache_c) {
      constexpr int V = decltype(vec_c)::value, C = decltype(cache_c)::value;
      const bool pdl = gpu::pdl_enabled(p.device.index);
      if (p.residual)
        gpu::launch(rms_norm_forward_kernel<T, W, V, C, true>, static_cast<unsigned>(blocks), block, 0,
                    gpu::as_stream(p.stream), pdl, p);
      else
        gpu::launch(rms_norm_forward_kernel<T, W, V, C, false>, static_cast<unsigned>(blocks), block, 0,
                    gpu::as_stream(p.stream), pdl, p);
    });
  });
  gpu::check_launch(op);
}

std::size_t rms_norm_backward_workspace_gpu(int64_t rows, int64_t cols, DType dtype, Device device) {
  gpu::DeviceGuard guard(device, "rms_norm_backward");
  // The widest layout: vector loads never change the block count, so this bound holds for both.
  const int vec = static_cast<int>(16 / dtype_size(dtype));
  BackwardLaunch a = backward_launch(rows, cols, (cols % vec) ? 1 : vec, device);
  BackwardLaunch b = backward_launch(rows, cols, 1, device);
  return static_cast<std::size_t>(std::max(a.slots(), b.slots()) * cols) * sizeof(float);
}

void rms_norm_backward_gpu(const RmsNormBackwardParams& p) {
  const char* op = "rms_norm_backward";
  gpu::DeviceGuard guard(p.device, op);
  gpuStream_t stream = gpu::as_stream(p.stream);
  if (p.rows == 0) {
    gpu::check(gpuMemsetAsync(p.grad_weight, 0, p.cols * dtype_size(p.weight_dtype), stream), op,
               "zeroing grad_weight");
    return;
  }
  dispatch_types(op, p.dtype, p.weight_dtype, [&](auto t, auto wt) {
    using T = decltype(t);
    using W = decltype(wt);
    constexpr int kVec = 16 / sizeof(T);
    const int vec = gpu::vector_width<T>(p.cols, {p.x, p.grad_x, p.grad_y, p.weight, p.grad_extra},
                                    {p.x_stride, p.grad_x_stride, p.grad_y_stride, p.grad_extra_stride});
    const BackwardLaunch b = backward_launch(p.rows, p.cols, vec, p.device);
    const RowLayout& l = b.layout;
    const dim3 block(l.threads_per_row, l.rows_per_block);
    dispatch_layout<kVec, kBackwardMaxCache>(l, [&](auto vec_c, auto cache_c) {
      constexpr int V = decltype(vec_c)::value, C = decltype(cache_c)::value;
      rms_norm_backward_kernel<T, W, V, C>
          <<<static_cast<unsigned>(b.blocks), block, 0, stream>>>(p);
    });
    gpu::check_launch(op);
    const int64_t col_blocks = (p.cols + 31) / 32;
    sum_partials_kernel<W><<<static_cast<unsigned>(col_blocks), dim3(32, 8), 0, stream>>>(
        p.workspace, static_cast<W*>(p.grad_weight), b.slots(), p.cols);
  });
  gpu::check_launch(op);
}

}  // namespace llmk::detail
