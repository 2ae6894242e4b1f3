// RMSNorm family on the CPU: rows split over the installed threads (core/parallel.h), fp32
// arithmetic with double sums of squares, storage in the tensors' own dtypes. The weight gradient
// is summed over fixed row groups (not per thread), so it does not depend on the thread count.
#include <algorithm>
#include <cmath>
#include <vector>

#include "core/check.h"
#include "core/half.h"
#include "core/parallel.h"
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

// sum of v[c]^2 in double, in kLanes independent sums so that the loop vectorises
double sum_of_squares(const float* v, int64_t n) {
  constexpr int kLanes = 8;
  double lane[kLanes] = {};
  int64_t c = 0;
  for (; c + kLanes <= n; c += kLanes)
    for (int j = 0; j < kLanes; ++j) lane[j] += static_cast<double>(v[c + j]) * v[c + j];
  double sum = 0.0;
  for (; c < n; ++c) sum += static_cast<double>(v[c]) * v[c];
  for (int j = 0; j < kLanes; ++j) sum += lane[j];
  return sum;
}

// Rows [begin, end); row: a cols-long scratch row.
template <typename T, typename W>
LLMK_CPU_CLONES void forward_rows(const RmsNormParams& p, int64_t begin, int64_t end, float* row) {
  const W* w = static_cast<const W*>(p.weight);
  for (int64_t r = begin; r < end; ++r) {
    const T* x = static_cast<const T*>(p.x) + r * p.x_stride;
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
    // long rows: a double sum keeps the CPU result rounding-free
    const float rstd =
        static_cast<float>(1.0 / std::sqrt(sum_of_squares(row, p.cols) / p.cols + p.eps));
    T* y = static_cast<T*>(p.y) + r * p.y_stride;
    for (int64_t c = 0; c < p.cols; ++c)
      y[c] = from_float<T>(row[c] * rstd * (p.offset + to_float(w[c])));
  }
}

template <typename T, typename W>
void forward(const RmsNormParams& p) {
  parallel_rows(p.rows, grain_for(p.cols), [&](int64_t begin, int64_t end) {
    std::vector<float> row(p.cols);
    forward_rows<T, W>(p, begin, end, row.data());
  });
}

// Rows [begin, end): grad_x, and grad_y * x * rstd summed into partial (cols floats).
template <typename T, typename W>
LLMK_CPU_CLONES void backward_rows(const RmsNormBackwardParams& p, int64_t begin, int64_t end,
                                   float* partial) {
  const W* w = static_cast<const W*>(p.weight);
  for (int64_t r = begin; r < end; ++r) {
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

template <typename T, typename W>
void backward(const RmsNormBackwardParams& p) {
  // grad_weight: one fp32 partial per group of rows, summed in group order at the end
  constexpr int64_t kMaxGroups = 64;
  const int64_t groups = std::min<int64_t>(p.rows, kMaxGroups);
  const int64_t rows_per_group = groups ? (p.rows + groups - 1) / groups : 0;
  std::vector<float> partials(static_cast<size_t>(std::max<int64_t>(groups, 1) * p.cols), 0.f);
  parallel_rows(groups, grain_for(rows_per_group * p.cols), [&](int64_t g_begin, int64_t g_end) {
    for (int64_t g = g_begin; g < g_end; ++g)
      backward_rows<T, W>(p, g * rows_per_group, std::min(p.rows, (g + 1) * rows_per_group),
                          partials.data() + g * p.cols);
  });
  W* gw = static_cast<W*>(p.grad_weight);
  for (int64_t c = 0; c < p.cols; ++c) {
    float sum = 0.f;
    for (int64_t g = 0; g < groups; ++g) sum += partials[g * p.cols + c];
    gw[c] = from_float<W>(sum);
  }
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
