// Gated activations on the GPU (one source for CUDA and HIP, through src/gpu/ only).
//
// out = act(gate) * up (or, backward, grad_gate and grad_up) elementwise. Each thread handles one
// 16-byte vector (8 bf16/fp16 or 4 fp32 elements) when every pointer and row stride allows,
// single elements otherwise; blockIdx.x walks the columns of a row, blockIdx.y the rows (a
// grid-stride loop past 65535 rows). Pure streaming: every element is read once and written
// once, so loads and stores are marked evict-first.
#include <algorithm>
#include <cstdint>
#include <initializer_list>

#include "activation/activation_internal.h"
#include "activation/activation_math.h"
#include "core/check.h"
#include "gpu/compat.h"
#include "gpu/runtime.h"

namespace llmk::detail {

using gpu::bfloat16;
using gpu::Cache;
using gpu::half;

namespace {

constexpr int kThreads = 256;

template <typename T, int VEC, int ACT, bool BACKWARD>
__global__ void __launch_bounds__(kThreads) gated_activation_kernel(GatedParams p) {
  using Fn = ActivationFn<ACT>;
  const int64_t nvec = p.cols / VEC;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= nvec) return;
  for (int64_t row = blockIdx.y; row < p.rows; row += gridDim.y) {
    float g[VEC], u[VEC];
    gpu::load_float<T, VEC, Cache::stream>(static_cast<const T*>(p.gate) + row * p.gate_stride + i * VEC, g);
    gpu::load_float<T, VEC, Cache::stream>(static_cast<const T*>(p.up) + row * p.up_stride + i * VEC, u);
    if constexpr (!BACKWARD) {
      float out[VEC];
#pragma unroll
      for (int k = 0; k < VEC; ++k) out[k] = Fn::value(g[k]) * u[k];
      gpu::store_float<T, VEC, Cache::stream>(static_cast<T*>(p.out) + row * p.out_stride + i * VEC, out);
    } else {
      float d[VEC], dg[VEC], du[VEC];
      gpu::load_float<T, VEC, Cache::stream>(
          static_cast<const T*>(p.grad_out) + row * p.grad_out_stride + i * VEC, d);
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        dg[k] = d[k] * u[k] * Fn::derivative(g[k]);
        du[k] = d[k] * Fn::value(g[k]);
      }
      gpu::store_float<T, VEC, Cache::stream>(
          static_cast<T*>(p.grad_gate) + row * p.grad_gate_stride + i * VEC, dg);
      gpu::store_float<T, VEC, Cache::stream>(
          static_cast<T*>(p.grad_up) + row * p.grad_up_stride + i * VEC, du);
    }
  }
}

template <typename T, int ACT>
void launch(const GatedParams& p) {
  constexpr int kVec = 16 / sizeof(T);
  const bool vec =
      gpu::vector_width<T>(p.cols, {p.gate, p.up, p.out, p.grad_out, p.grad_gate, p.grad_up},
                           {p.gate_stride, p.up_stride, p.out_stride, p.grad_out_stride,
                            p.grad_gate_stride, p.grad_up_stride}) == kVec;
  const int64_t nvec = p.cols / (vec ? kVec : 1);
  const dim3 grid(static_cast<unsigned>((nvec + kThreads - 1) / kThreads),
                  static_cast<unsigned>(std::min<int64_t>(p.rows, 65535)));
  gpuStream_t stream = gpu::as_stream(p.stream);
  if (grid.x == 0 || (nvec + kThreads - 1) / kThreads > 0x7fffffff)
    fail(ErrorKind::value, "gated_activation", "gate: rows too long for one launch");
  if (vec) {
    if (p.backward()) gated_activation_kernel<T, kVec, ACT, true><<<grid, kThreads, 0, stream>>>(p);
    else gated_activation_kernel<T, kVec, ACT, false><<<grid, kThreads, 0, stream>>>(p);
  } else {
    if (p.backward()) gated_activation_kernel<T, 1, ACT, true><<<grid, kThreads, 0, stream>>>(p);
    else gated_activation_kernel<T, 1, ACT, false><<<grid, kThreads, 0, stream>>>(p);
  }
}

template <typename T>
void with_activation(const GatedParams& p) {
  switch (p.act) {
    case Activation::silu: launch<T, 0>(p); break;
    case Activation::gelu: launch<T, 1>(p); break;
    case Activation::gelu_tanh: launch<T, 2>(p); break;
  }
}

}  // namespace

void gated_activation_gpu(const GatedParams& p) {
  const char* op = p.backward() ? "gated_activation_backward" : "gated_activation";
  gpu::DeviceGuard guard(p.device, op);
  switch (p.dtype) {
    case DType::f32: with_activation<float>(p); break;
    case DType::f16: with_activation<half>(p); break;
    case DType::bf16: with_activation<bfloat16>(p); break;
    default: fail(ErrorKind::type, op, "unsupported dtype");
  }
  gpu::check_launch(op);
}

}  // namespace llmk::detail
