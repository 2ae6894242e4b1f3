// Skinny GEMM on the CPU: y = x W^T + bias (and silu(g) * u), sums in double, with the optional
// RMSNorm prologue and residual epilogue rounded as the GPU kernels (and the unfused ops) round
// them. Also the reference the GPU kernels are tested against. Each row's output columns are
// split over the installed threads (core/parallel.h); every sum runs in k order on one thread.
#include <cmath>
#include <vector>

#include "activation/activation_math.h"
#include "core/check.h"
#include "core/half.h"
#include "core/parallel.h"
#include "gemm/gemm_internal.h"

namespace llmk::detail {

namespace {

template <typename T>
void gemm_typed(const GemmParams& p) {
  const T* x = static_cast<const T*>(p.x);
  const T* w = static_cast<const T*>(p.w);
  const T* bias = static_cast<const T*>(p.bias);
  const T* norm_w = static_cast<const T*>(p.norm_w);
  const T* residual = static_cast<const T*>(p.residual);
  T* out = static_cast<T*>(p.out);
  // out[m, n] = (residual +) y, y rounded to T first when a residual is added.
  const auto store = [&](int64_t m, int64_t n, double y) {
    T v = from_float<T>(static_cast<float>(y));
    if (residual) v = from_float<T>(to_float(v) + to_float(residual[m * p.residual_stride + n]));
    out[m * p.out_stride + n] = v;
  };
  std::vector<double> xr(p.k), y(p.n);
  for (int64_t m = 0; m < p.m; ++m) {
    for (int64_t i = 0; i < p.k; ++i) xr[i] = to_float(x[m * p.x_stride + i]);
    if (norm_w) {  // rms_norm's CPU arithmetic: rstd from double sums, x * rstd * (offset + w) rounded to T
      double ss = 0.0;
      for (int64_t i = 0; i < p.k; ++i) ss += xr[i] * xr[i];
      const float rstd = static_cast<float>(1.0 / std::sqrt(ss / static_cast<double>(p.k) + p.norm_eps));
      for (int64_t i = 0; i < p.k; ++i)
        xr[i] = to_float(from_float<T>(static_cast<float>(xr[i]) * rstd * (p.norm_offset + to_float(norm_w[i]))));
    }
    parallel_rows(p.n, grain_for(p.k), [&](int64_t begin, int64_t end) {
      for (int64_t n = begin; n < end; ++n) {
        const T* wr = w + n * p.w_stride;
        double s = bias ? to_float(bias[n]) : 0.0;
        for (int64_t i = 0; i < p.k; ++i) s += xr[i] * to_float(wr[i]);
        y[n] = s;
      }
    });
    if (gemm_gated(p.activation)) {
      const int64_t inter = p.n / 2;
      const bool tanh_gelu = p.activation == GemmActivation::geglu_tanh;
      for (int64_t j = 0; j < inter; ++j) {
        const double g = y[j], u = y[inter + j];
        // gelu_tanh(g) = g * sigmoid(2 sqrt(2/pi) (g + 0.044715 g^3)), in double like silu here
        const double z = tanh_gelu ? 2.0 * kSqrt2OverPi * (g + kGeluTanhCubic * g * g * g) : g;
        store(m, j, g / (1.0 + std::exp(-z)) * u);
      }
    } else {
      for (int64_t n = 0; n < p.n; ++n) store(m, n, y[n]);
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
