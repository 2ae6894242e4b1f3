// RMSNorm family on the CPU: one row at a time, fp32 arithmetic (double row sums), storage in
// the tensors' own dtypes. Single-threaded: no OpenMP runtime of our own to clash with torch's.
#include <cmath>
#include <vector>

#include "core/check.h"
#include "core/half.h"
#include "rmsnorm/rmsnorm_internal.h"

namespace llmk::detail {

namespace {

template <typename F>
void dispatch_cpu(DType dtype, DType weight_dtype, F&& f) {
  auto with_weight = [&](auto t) {
    using T = decltype(t);
    if (weight_dtype == DType::f32) f(T{}, float{});
    else f(T{}, T{});
  };
  switch (dtype) {
    case DType::f32: f(float{}, float{}); break;
    case DType::f16: with_weight(Half{}); break;
    case DType::bf16: with_weight(BFloat16{}); break;
    default: fail(ErrorKind::type, "rms_norm", "unsupported dtype");
  }
}

template <typename T, typename W>
void forward(const RmsNormParams& p) {
  const W* w = static_cast<const W*>(p.weight);
  {
    std::vector<float> row(p.cols);
    for (int64_t r = 0; r < p.rows; ++r) {
      const T* x = static_cast<const T*>(p.x) + r * p.x_stride;
      double sumsq = 0.0;  // long rows: a double sum keeps the CPU result rounding-free
      if (p.residual) {
        const T* res = static_cast<const T*>(p.residual) + r * p.residual_stride;
        T* res_out = static_cast<T*>(p.residual_out) + r * p.residual_out_stride;
        for (int64_t c = 0; c < p.cols; ++c) {
          T sum = from_float<T>(to_float(x[c]) + to_float(res[c]));
          res_out[c] = sum;
          row[c] = to_float(sum);  // normalise the stored (rounded) sum, as the unfused ops would
        }
      } else {
        for (int64_t c = 0; c < p.cols; ++c) row[c] = to_float(x[c]);
      }
      for (int64_t c = 0; c < p.cols; ++c) sumsq += row[c] * row[c];
      const float rstd = static_cast<float>(1.0 / std::sqrt(sumsq / p.cols + p.eps));
      T* y = static_cast<T*>(p.y) + r * p.y_stride;
      for (int64_t c = 0; c < p.cols; ++c)
        y[c] = from_float<T>(row[c] * rstd * (p.offset + to_float(w[c])));
    }
  }
}

template <typename T, typename W>
void backward(const RmsNormBackwardParams& p) {
  const W* w = static_cast<const W*>(p.weight);
  std::vector<float> grad_weight(p.cols, 0.f);
  {
    std::vector<float>& partial = grad_weight;
    for (int64_t r = 0; r < p.rows; ++r) {
      const T* x = static_cast<const T*>(p.x) + r * p.x_stride;
      const T* gy = static_cast<const T*>(p.grad_y) + r * p.grad_y_stride;
      double sumsq = 0.0, dot = 0.0;  // sum x^2, sum grad_y * (offset + w) * x
      for (int64_t c = 0; c < p.cols; ++c) {
        const float xv = to_float(x[c]);
        sumsq += xv * xv;
        dot += to_float(gy[c]) * (p.offset + to_float(w[c])) * xv;
      }
      const float rstd = static_cast<float>(1.0 / std::sqrt(sumsq / p.cols + p.eps));
      const float coef = static_cast<float>(dot * rstd * rstd * rstd / p.cols);
      T* gx = static_cast<T*>(p.grad_x) + r * p.grad_x_stride;
      const T* extra =
          p.grad_extra ? static_cast<const T*>(p.grad_extra) + r * p.grad_extra_stride : nullptr;
      for (int64_t c = 0; c < p.cols; ++c) {
        const float xv = to_float(x[c]), g = to_float(gy[c]);
        float dx = rstd * g * (p.offset + to_float(w[c])) - coef * xv;
        if (extra) dx += to_float(extra[c]);
        gx[c] = from_float<T>(dx);
        partial[c] += g * xv * rstd;
      }
    }
  }
  W* gw = static_cast<W*>(p.grad_weight);
  for (int64_t c = 0; c < p.cols; ++c) gw[c] = from_float<W>(grad_weight[c]);
}

}  // namespace

void rms_norm_cpu(const RmsNormParams& p) {
  dispatch_cpu(p.dtype, p.weight_dtype, [&](auto t, auto w) {
    forward<decltype(t), decltype(w)>(p);
  });
}

void rms_norm_backward_cpu(const RmsNormBackwardParams& p) {
  dispatch_cpu(p.dtype, p.weight_dtype, [&](auto t, auto w) {
    backward<decltype(t), decltype(w)>(p);
  });
}

}  // namespace llmk::detail
