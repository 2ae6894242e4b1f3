// Skinny GEMM on the CPU: y = x W^T + bias (and silu(g) * u), sums in double. Also the reference
// the GPU kernels are tested against.
#include <cmath>
#include <vector>

#include "core/check.h"
#include "core/half.h"
#include "gemm/gemm_internal.h"

namespace llmk::detail {

namespace {

template <typename T>
void gemm_typed(const GemmParams& p) {
  const T* x = static_cast<const T*>(p.x);
  const T* w = static_cast<const T*>(p.w);
  const T* bias = static_cast<const T*>(p.bias);
  T* out = static_cast<T*>(p.out);
  std::vector<double> xr(p.k), y(p.n);
  for (int64_t m = 0; m < p.m; ++m) {
    for (int64_t i = 0; i < p.k; ++i) xr[i] = to_float(x[m * p.x_stride + i]);
    for (int64_t n = 0; n < p.n; ++n) {
      const T* wr = w + n * p.w_stride;
      double s = bias ? to_float(bias[n]) : 0.0;
      for (int64_t i = 0; i < p.k; ++i) s += xr[i] * to_float(wr[i]);
      y[n] = s;
    }
    if (p.activation == GemmActivation::swiglu) {
      const int64_t inter = p.n / 2;
      for (int64_t j = 0; j < inter; ++j) {
        const double g = y[j], u = y[inter + j];
        out[m * p.out_stride + j] = from_float<T>(static_cast<float>(g / (1.0 + std::exp(-g)) * u));
      }
    } else {
      for (int64_t n = 0; n < p.n; ++n) out[m * p.out_stride + n] = from_float<T>(static_cast<float>(y[n]));
    }
  }
}

}  // namespace

void skinny_gemm_cpu(const GemmParams& p) {
  switch (p.dtype) {
    case DType::f32: gemm_typed<float>(p); break;
    case DType::f16: gemm_typed<Half>(p); break;
    case DType::bf16: gemm_typed<BFloat16>(p); break;
    default: fail(ErrorKind::type, "skinny_gemm", "unsupported dtype");
  }
}

}  // namespace llmk::detail
