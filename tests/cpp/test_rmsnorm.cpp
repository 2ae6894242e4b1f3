// RMSNorm family vs a float64 reference, on the CPU and (when one is usable) the GPU.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "llmk/error.h"
#include "llmk/rmsnorm.h"
#include "support/tensors.h"
#include "support/testing.h"

using llmk::DType;
using llmk_test::Tensor;

namespace {

const char* name(DType d) { return llmk::dtype_name(d); }

// float64 reference: y = v / sqrt(mean(v^2) + eps) * (offset + w), v from the stored inputs.
std::vector<double> reference_forward(const std::vector<double>& v, int64_t rows, int64_t cols,
                                      const Tensor& w, double eps, double offset) {
  std::vector<double> y(v.size());
  for (int64_t r = 0; r < rows; ++r) {
    double ss = 0;
    for (int64_t c = 0; c < cols; ++c) ss += v[r * cols + c] * v[r * cols + c];
    const double rstd = 1.0 / std::sqrt(ss / cols + eps);
    for (int64_t c = 0; c < cols; ++c)
      y[r * cols + c] = v[r * cols + c] * rstd * (offset + w.get(0, c));
  }
  return y;
}

std::vector<double> read(const Tensor& t) {
  std::vector<double> v(t.rows() * t.cols());
  for (int64_t r = 0; r < t.rows(); ++r)
    for (int64_t c = 0; c < t.cols(); ++c) v[r * t.cols() + c] = t.get(r, c);
  return v;
}

struct Case {
  bool gpu;
  DType dtype;
  bool fp32_weight;
  std::vector<int64_t> shape;
  int64_t pad;  // extra elements between rows (non-contiguous rows)
  double offset;
};

std::string case_name(const testing::TestParamInfo<Case>& info) {
  const Case& c = info.param;
  std::string s = std::string(c.gpu ? "gpu_" : "cpu_") + name(c.dtype) + (c.fp32_weight ? "_w32" : "");
  for (int64_t d : c.shape) s += "_" + std::to_string(d);
  if (c.pad) s += "_pad" + std::to_string(c.pad);
  if (c.offset != 0) s += "_gemma";
  return s;
}

std::vector<Case> cases() {
  std::vector<Case> out;
  const std::vector<std::vector<int64_t>> shapes = {
      {1, 1}, {3, 7}, {5, 77}, {4, 333}, {2, 4097}, {33, 128}, {64, 4096}, {2, 3, 5120},
      {2, 2, 2, 96}, {1, 65536}, {130, 8}};
  for (bool gpu : {false, true})
    for (DType dt : {DType::f32, DType::f16, DType::bf16})
      for (const auto& s : shapes) {
        out.push_back({gpu, dt, false, s, 0, 0.0});
        if (dt != DType::f32 && s.size() == 2 && s[1] % 8 == 0) out.push_back({gpu, dt, true, s, 0, 0.0});
      }
  for (bool gpu : {false, true}) {
    out.push_back({gpu, DType::bf16, false, {9, 4096}, 8, 1.0});   // aligned padding: vector path
    out.push_back({gpu, DType::f16, true, {9, 1000}, 3, 0.0});     // odd padding: scalar path
    out.push_back({gpu, DType::f32, false, {6, 40000}, 4, 0.0});   // long rows: streaming path
    out.push_back({gpu, DType::bf16, false, {3, 140000}, 0, 1.0}); // longest: streaming, vector
  }
  return out;
}

class RmsNormTest : public testing::TestWithParam<Case> {};

TEST_P(RmsNormTest, ForwardMatchesFloat64) {
  const Case& c = GetParam();
  SKIP_WITHOUT_GPU(c.gpu);
  const int64_t cols = c.shape.back();
  Tensor x(c.dtype, c.shape, c.gpu, cols + c.pad), y(c.dtype, c.shape, c.gpu);
  Tensor w(c.fp32_weight ? DType::f32 : c.dtype, {cols}, c.gpu);
  x.fill_random();
  w.fill_random(0.5, 1.5);
  y.poison();
  const double eps = 1e-6;
  llmk::rms_norm(y.view(), x.view(), w.view(), eps, c.offset);
  y.download();
  const auto ref = reference_forward(read(x), x.rows(), cols, w, eps, c.offset);
  EXPECT_LT(llmk_test::relative_error(y, ref), llmk_test::tolerance(c.dtype));
}

TEST_P(RmsNormTest, FusedAddMatchesFloat64InPlaceAndOut) {
  const Case& c = GetParam();
  SKIP_WITHOUT_GPU(c.gpu);
  const int64_t cols = c.shape.back();
  for (bool in_place : {false, true}) {
    Tensor x(c.dtype, c.shape, c.gpu, cols + c.pad), res(c.dtype, c.shape, c.gpu, cols + c.pad);
    Tensor res_out(c.dtype, c.shape, c.gpu), y(c.dtype, c.shape, c.gpu);
    Tensor w(c.fp32_weight ? DType::f32 : c.dtype, {cols}, c.gpu);
    x.fill_random();
    res.fill_random();
    w.fill_random(0.5, 1.5);
    y.poison();
    res_out.poison();
    const auto xv = read(x), rv = read(res);
    std::vector<double> sum(xv.size());
    for (size_t i = 0; i < xv.size(); ++i) sum[i] = llmk_test::rounded(c.dtype, xv[i] + rv[i]);
    Tensor& out_res = in_place ? res : res_out;
    llmk::fused_add_rms_norm(y.view(), out_res.view(), x.view(), res.view(), w.view(), 1e-5, c.offset);
    y.download();
    out_res.download();
    // The float32 sum of two stored values may round differently from the float64 one only in
    // the last bit of the storage type, so compare the residual with the rounding tolerance too.
    EXPECT_LT(llmk_test::relative_error(out_res, sum), llmk_test::tolerance(c.dtype)) << "in_place=" << in_place;
    const auto ref = reference_forward(sum, x.rows(), cols, w, 1e-5, c.offset);
    EXPECT_LT(llmk_test::relative_error(y, ref), llmk_test::tolerance(c.dtype)) << "in_place=" << in_place;
  }
}

TEST_P(RmsNormTest, BackwardMatchesFloat64) {
  const Case& c = GetParam();
  SKIP_WITHOUT_GPU(c.gpu);
  const int64_t cols = c.shape.back();
  for (bool with_extra : {false, true}) {
    Tensor x(c.dtype, c.shape, c.gpu, cols + c.pad), gy(c.dtype, c.shape, c.gpu);
    Tensor gx(c.dtype, c.shape, c.gpu), extra(c.dtype, c.shape, c.gpu);
    const DType wdt = c.fp32_weight ? DType::f32 : c.dtype;
    Tensor w(wdt, {cols}, c.gpu), gw(wdt, {cols}, c.gpu);
    x.fill_random();
    gy.fill_random();
    extra.fill_random();
    w.fill_random(0.5, 1.5);
    gx.poison();
    gw.poison();
    const double eps = 1e-6;
    const size_t ws_bytes = llmk::rms_norm_backward_workspace_size(x.view());
    void* ws = nullptr;
    if (c.gpu && ws_bytes) ws = llmk_test::gpu_alloc(ws_bytes);
    llmk::TensorView ev = extra.view();
    llmk::rms_norm_backward(gx.view(), gw.view(), gy.view(), x.view(), w.view(), eps, c.offset,
                            with_extra ? &ev : nullptr, ws);
    gx.download();
    gw.download();
    if (ws) llmk_test::gpu_free(ws);
    const auto xv = read(x), gv = read(gy), ev_ = read(extra);
    const int64_t rows = x.rows();
    std::vector<double> dx(xv.size()), dx_scale(xv.size()), dw(cols, 0.0);
    for (int64_t r = 0; r < rows; ++r) {
      double ss = 0, dot = 0;
      for (int64_t k = 0; k < cols; ++k) {
        const double xx = xv[r * cols + k];
        ss += xx * xx;
        dot += gv[r * cols + k] * (c.offset + w.get(0, k)) * xx;
      }
      const double rstd = 1.0 / std::sqrt(ss / cols + eps);
      for (int64_t k = 0; k < cols; ++k) {
        const double xx = xv[r * cols + k], g = gv[r * cols + k];
        dx[r * cols + k] = rstd * g * (c.offset + w.get(0, k)) - dot * rstd * rstd * rstd / cols * xx +
                           (with_extra ? ev_[r * cols + k] : 0.0);
        dx_scale[k + r * cols] = std::fabs(rstd * g * (c.offset + w.get(0, k))) +
                                 std::fabs(dot * rstd * rstd * rstd / cols * xx);
        dw[k] += g * xx * rstd;
      }
    }
        // grad_x is a difference of two terms that can cancel (exactly so for rows of 1 element):
    // measure its error against the size of the terms.
    EXPECT_LT(llmk_test::relative_error(gx, dx, &dx_scale), llmk_test::tolerance(c.dtype)) << "extra=" << with_extra;
    EXPECT_LT(llmk_test::relative_error(gw, dw), llmk_test::tolerance(wdt)) << "extra=" << with_extra;
  }
}

INSTANTIATE_TEST_SUITE_P(All, RmsNormTest, testing::ValuesIn(cases()), case_name);

// ----------------------------------------------------------------------- exact answers
class RmsNormExact : public testing::TestWithParam<bool> {};

TEST_P(RmsNormExact, ConstantRowNormalisesToWeight) {
  const bool gpu = GetParam();
  SKIP_WITHOUT_GPU(gpu);
  // A row of 2s has rms 2 exactly; with eps = 0, y = weight (and 1 + weight with offset 1).
  for (double offset : {0.0, 1.0}) {
    Tensor x(DType::f32, {3, 333}, gpu), y(DType::f32, {3, 333}, gpu), w(DType::f32, {333}, gpu);
    x.fill(2.0);
    w.fill_random();
    y.poison();
    llmk::rms_norm(y.view(), x.view(), w.view(), 0.f, static_cast<float>(offset));
    y.download();
    double max_err = 0;
    for (int64_t r = 0; r < 3; ++r)
      for (int64_t c = 0; c < 333; ++c)
        max_err = std::max(max_err, std::fabs(y.get(r, c) - (offset + w.get(0, c))));
    EXPECT_LE(max_err, 1e-6) << "offset " << offset;
  }
}

TEST_P(RmsNormExact, EmptyTensorsAreFine) {
  const bool gpu = GetParam();
  SKIP_WITHOUT_GPU(gpu);
  Tensor x(DType::bf16, {0, 64}, gpu), y(DType::bf16, {0, 64}, gpu), w(DType::bf16, {64}, gpu);
  w.fill_random();
  EXPECT_NO_THROW(llmk::rms_norm(y.view(), x.view(), w.view(), 1e-6f));
  // Backward over zero rows: grad_weight is exactly zero.
  Tensor gw(DType::bf16, {64}, gpu);
  gw.poison();
  const size_t ws = llmk::rms_norm_backward_workspace_size(x.view());
  EXPECT_EQ(ws, 0u);
  llmk::rms_norm_backward(x.view(), gw.view(), x.view(), x.view(), w.view(), 1e-6f, 0.f, nullptr, nullptr);
  gw.download();
  for (int64_t c = 0; c < 64; ++c) EXPECT_EQ(gw.get(0, c), 0.0);
}

INSTANTIATE_TEST_SUITE_P(Devices, RmsNormExact, testing::Values(false, true),
                         [](const testing::TestParamInfo<bool>& i) { return i.param ? "gpu" : "cpu"; });

// ----------------------------------------------------------------------- bad input
using llmk_test::error_of;

TEST(RmsNormErrors, NameOpArgumentExpectedAndGot) {
  Tensor x(DType::f16, {4, 64}, false), y(DType::f16, {4, 64}, false);
  Tensor w(DType::f16, {64}, false), w_short(DType::f16, {63}, false);
  Tensor w_bf(DType::bf16, {64}, false), y_bf(DType::bf16, {4, 64}, false);
  Tensor y_short(DType::f16, {4, 63}, false);
  EXPECT_EQ(error_of([&] { llmk::rms_norm(y.view(), x.view(), w_short.view(), 1e-6f); }),
            "llmk::rms_norm: weight: expected shape (64) (the last dim of x), got (63)");
  EXPECT_EQ(error_of([&] { llmk::rms_norm(y.view(), x.view(), w_bf.view(), 1e-6f); }),
            "llmk::rms_norm: weight: expected dtype float16 (the dtype of x) or float32, got bfloat16");
  EXPECT_EQ(error_of([&] { llmk::rms_norm(y_bf.view(), x.view(), w.view(), 1e-6f); }),
            "llmk::rms_norm: y: expected dtype float16 (the dtype of x), got bfloat16");
  EXPECT_EQ(error_of([&] { llmk::rms_norm(y_short.view(), x.view(), w.view(), 1e-6f); }),
            "llmk::rms_norm: y: expected shape (4, 64) (the shape of x), got (4, 63)");
  EXPECT_NE(error_of([&] { llmk::rms_norm(y.view(), x.view(), w.view(), -1.f); })
                .find("llmk::rms_norm: eps: expected a finite value >= 0"),
            std::string::npos);

  llmk::TensorView xi = x.view();
  xi.dtype = DType::i32;
  EXPECT_EQ(error_of([&] { llmk::rms_norm(y.view(), xi, w.view(), 1e-6f); }),
            "llmk::rms_norm: x: expected dtype float32, float16 or bfloat16, got int32");

  llmk::TensorView wg = w.view();
  wg.device = {llmk::DeviceKind::gpu, 0};
  EXPECT_EQ(error_of([&] { llmk::rms_norm(y.view(), x.view(), wg, 1e-6f); }),
            "llmk::rms_norm: weight: expected device cpu (the device of x), got gpu:0");

  llmk::TensorView w2 = w.view();
  w2.ndim = 2;
  w2.shape[1] = 1;
  w2.strides[1] = 1;
  EXPECT_EQ(error_of([&] { llmk::rms_norm(y.view(), x.view(), w2, 1e-6f); }),
            "llmk::rms_norm: weight: expected 1 dims, got 2 dims with shape (64, 1)");

  llmk::TensorView xt = x.view();  // a transposed x: last dim not contiguous
  std::swap(xt.shape[0], xt.shape[1]);
  std::swap(xt.strides[0], xt.strides[1]);
  Tensor yt(DType::f16, {64, 4}, false), wt(DType::f16, {4}, false);
  EXPECT_EQ(error_of([&] { llmk::rms_norm(yt.view(), xt, wt.view(), 1e-6f); }),
            "llmk::rms_norm: x: expected a contiguous last dim (stride 1), got stride 64");
}

TEST(RmsNormErrors, FusedAddRejectsOverlapAndMismatch) {
  Tensor x(DType::bf16, {4, 64}, false), res(DType::bf16, {4, 64}, false), y(DType::bf16, {4, 64}, false);
  Tensor w(DType::bf16, {64}, false), res3(DType::bf16, {2, 2, 64}, false);
  EXPECT_EQ(error_of([&] {
              llmk::fused_add_rms_norm(y.view(), res.view(), x.view(), res3.view(), w.view(), 1e-6f);
            }),
            "llmk::fused_add_rms_norm: residual: expected shape (4, 64) (the shape of x), got (2, 2, 64)");
  EXPECT_EQ(error_of([&] {
              llmk::fused_add_rms_norm(y.view(), x.view(), x.view(), res.view(), w.view(), 1e-6f);
            }),
            "llmk::fused_add_rms_norm: residual_out: expected memory that does not overlap x");
  llmk::TensorView shifted = res.view();  // residual_out one row past residual: partial overlap
  shifted.data = static_cast<char*>(shifted.data) + 64 * 2;
  shifted.shape[0] = 3;
  llmk::TensorView res3rows = res.view();
  res3rows.shape[0] = 3;
  Tensor x3(DType::bf16, {3, 64}, false), y3(DType::bf16, {3, 64}, false);
  EXPECT_EQ(error_of([&] {
              llmk::fused_add_rms_norm(y3.view(), shifted, x3.view(), res3rows, w.view(), 1e-6f);
            }),
            "llmk::fused_add_rms_norm: residual_out: expected memory that does not overlap residual");
  EXPECT_EQ(error_of([&] {
              llmk::fused_add_rms_norm(res.view(), res.view(), x.view(), res.view(), w.view(), 1e-6f);
            }),
            "llmk::fused_add_rms_norm: y: expected memory that does not overlap residual_out");
}

}  // namespace
