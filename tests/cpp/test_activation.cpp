// Gated activations (forward and backward) vs float64 references, on the CPU and the GPU.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <functional>
#include <string>
#include <tuple>
#include <vector>

#include "llmk/activation.h"
#include "llmk/error.h"
#include "support/tensors.h"
#include "support/testing.h"

using llmk::Activation;
using llmk::DType;
using llmk_test::Tensor;

namespace {

double act64(Activation a, double x) {
  switch (a) {
    case Activation::silu: return x / (1 + std::exp(-x));
    // Evaluated without the cancellation of 1 + erf / 1 + tanh near -1 (same functions).
    case Activation::gelu: return 0.5 * x * std::erfc(-x / std::sqrt(2.0));
    case Activation::gelu_tanh: {
      const double k = std::sqrt(2.0 / M_PI);
      return x / (1 + std::exp(-2 * k * (x + 0.044715 * x * x * x)));
    }
  }
  return NAN;
}

// Central difference of act64 in float64: an independent check of the hand-written derivatives.
double dact64(Activation a, double x) {
  const double h = 1e-5;
  return (act64(a, x + h) - act64(a, x - h)) / (2 * h);
}

struct Case {
  bool gpu;
  DType dtype;
  Activation act;
  int64_t rows, d;
  bool packed;  // gate and up are the halves of one (rows, 2d) tensor
};

std::string case_name(const testing::TestParamInfo<Case>& info) {
  const Case& c = info.param;
  return std::string(c.gpu ? "gpu_" : "cpu_") + llmk::dtype_name(c.dtype) + "_" +
         llmk::activation_name(c.act) + "_" + std::to_string(c.rows) + "x" + std::to_string(c.d) +
         (c.packed ? "_packed" : "");
}

std::vector<Case> cases() {
  std::vector<Case> out;
  for (bool gpu : {false, true})
    for (DType dt : {DType::f32, DType::f16, DType::bf16})
      for (Activation a : {Activation::silu, Activation::gelu, Activation::gelu_tanh})
        for (auto [rows, d] : std::vector<std::pair<int64_t, int64_t>>{{1, 1}, {3, 7}, {5, 77}, {2, 4097}, {33, 256}, {2, 14336}})
          for (bool packed : {false, true}) out.push_back({gpu, dt, a, rows, d, packed});
  return out;
}

// gate and up views: separate tensors, or the two halves of one (rows, 2d) tensor.
struct Inputs {
  Tensor a, b;  // a holds gate (or both), b holds up (unused when packed)
  llmk::TensorView gate, up;
  Inputs(const Case& c)
      : a(c.dtype, {c.rows, c.packed ? 2 * c.d : c.d}, c.gpu), b(c.dtype, {c.rows, c.d}, c.gpu) {
    a.fill_random(-4, 4);
    b.fill_random(-2, 2);
    gate = a.view();
    if (c.packed) {
      gate.shape[1] = c.d;
      up = gate;
      up.data = static_cast<char*>(gate.data) + c.d * llmk::dtype_size(c.dtype);
    } else {
      up = b.view();
    }
  }
  double g(int64_t r, int64_t c) const { return a.get(r, c); }
  double u(int64_t r, int64_t c, const Case& k) const { return k.packed ? a.get(r, k.d + c) : b.get(r, c); }
};

class GatedTest : public testing::TestWithParam<Case> {};

TEST_P(GatedTest, ForwardMatchesFloat64) {
  const Case& c = GetParam();
  SKIP_WITHOUT_GPU(c.gpu);
  Inputs in(c);
  Tensor out(c.dtype, {c.rows, c.d}, c.gpu);
  out.poison();
  llmk::gated_activation(out.view(), in.gate, in.up, c.act);
  out.download();
  std::vector<double> ref(c.rows * c.d);
  for (int64_t r = 0; r < c.rows; ++r)
    for (int64_t k = 0; k < c.d; ++k) ref[r * c.d + k] = act64(c.act, in.g(r, k)) * in.u(r, k, c);
  EXPECT_LT(llmk_test::relative_error(out, ref), llmk_test::tolerance(c.dtype));
}

TEST_P(GatedTest, BackwardMatchesFloat64) {
  const Case& c = GetParam();
  SKIP_WITHOUT_GPU(c.gpu);
  Inputs in(c);
  Tensor grad_out(c.dtype, {c.rows, c.d}, c.gpu);
  grad_out.fill_random();
  // Gradients land in one (rows, 2d) tensor when packed, as the packed op's backward writes them.
  Tensor ga(c.dtype, {c.rows, c.packed ? 2 * c.d : c.d}, c.gpu), gb(c.dtype, {c.rows, c.d}, c.gpu);
  ga.poison();
  gb.poison();
  llmk::TensorView gg = ga.view(), gu = gb.view();
  if (c.packed) {
    gg.shape[1] = c.d;
    gu = gg;
    gu.data = static_cast<char*>(gg.data) + c.d * llmk::dtype_size(c.dtype);
  }
  llmk::gated_activation_backward(gg, gu, grad_out.view(), in.gate, in.up, c.act);
  ga.download();
  gb.download();
  double num_g = 0, den_g = 0, num_u = 0, den_u = 0;
  for (int64_t r = 0; r < c.rows; ++r)
    for (int64_t k = 0; k < c.d; ++k) {
      const double x = in.g(r, k), u = in.u(r, k, c), d = grad_out.get(r, k);
      const double want_g = d * u * dact64(c.act, x), want_u = d * act64(c.act, x);
      const double got_g = ga.get(r, k), got_u = c.packed ? ga.get(r, c.d + k) : gb.get(r, k);
      ASSERT_TRUE(std::isfinite(got_g) && std::isfinite(got_u)) << "unwritten or NaN at " << r << "," << k;
      num_g += (got_g - want_g) * (got_g - want_g);
      den_g += want_g * want_g;
      num_u += (got_u - want_u) * (got_u - want_u);
      den_u += want_u * want_u;
    }
  // The reference derivative is a central difference (error ~1e-10): far below every tolerance.
  EXPECT_LT(std::sqrt(num_g / den_g), llmk_test::tolerance(c.dtype));
  EXPECT_LT(std::sqrt(num_u / den_u), llmk_test::tolerance(c.dtype));
}

INSTANTIATE_TEST_SUITE_P(All, GatedTest, testing::ValuesIn(cases()), case_name);

// Outputs may be exactly an input (activation.h): in place, forward (out = gate) and backward
// (grad_gate = gate, grad_up = up), the results are those of separate buffers, bit for bit.
// 1000 columns: the CPU's fp16 / bf16 chunks of 256 and a partial one.
class GatedInPlace : public testing::TestWithParam<std::tuple<bool, DType, Activation>> {};

TEST_P(GatedInPlace, MatchesSeparateBuffers) {
  const auto [gpu, dt, act] = GetParam();
  SKIP_WITHOUT_GPU(gpu);
  const int64_t rows = 3, cols = 1000;
  auto copy = [&](const Tensor& from, Tensor& to) {
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c) to.set(r, c, from.get(r, c));  // exact: same dtype
    to.upload();
  };
  Tensor g(dt, {rows, cols}, gpu), u(dt, {rows, cols}, gpu), go(dt, {rows, cols}, gpu);
  g.fill_random(-4, 4);
  u.fill_random(-2, 2);
  go.fill_random();
  Tensor out(dt, {rows, cols}, gpu), gg(dt, {rows, cols}, gpu), gu(dt, {rows, cols}, gpu);
  llmk::gated_activation(out.view(), g.view(), u.view(), act);
  llmk::gated_activation_backward(gg.view(), gu.view(), go.view(), g.view(), u.view(), act);
  Tensor g_fwd(dt, {rows, cols}, gpu), g_bwd(dt, {rows, cols}, gpu), u_bwd(dt, {rows, cols}, gpu);
  copy(g, g_fwd);
  llmk::gated_activation(g_fwd.view(), g_fwd.view(), u.view(), act);  // out = gate
  copy(g, g_bwd);
  copy(u, u_bwd);
  llmk::gated_activation_backward(g_bwd.view(), u_bwd.view(), go.view(), g_bwd.view(), u_bwd.view(), act);
  for (Tensor* t : {&out, &gg, &gu, &g_fwd, &g_bwd, &u_bwd}) t->download();
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      ASSERT_EQ(g_fwd.get(r, c), out.get(r, c)) << "out in place at " << r << "," << c;
      ASSERT_EQ(g_bwd.get(r, c), gg.get(r, c)) << "grad_gate in place at " << r << "," << c;
      ASSERT_EQ(u_bwd.get(r, c), gu.get(r, c)) << "grad_up in place at " << r << "," << c;
    }
}

INSTANTIATE_TEST_SUITE_P(All, GatedInPlace,
                         testing::Combine(testing::Bool(), testing::Values(DType::f32, DType::f16, DType::bf16),
                                          testing::Values(Activation::silu, Activation::gelu, Activation::gelu_tanh)),
                         [](const testing::TestParamInfo<std::tuple<bool, DType, Activation>>& info) {
                           return std::string(std::get<0>(info.param) ? "gpu_" : "cpu_") +
                                  llmk::dtype_name(std::get<1>(info.param)) + "_" +
                                  llmk::activation_name(std::get<2>(info.param));
                         });

TEST(GatedExact, KnownValues) {
  // silu(0) = 0, gelu(0) = 0; silu(x)*1 at large x is x; gelu(-10) is ~0.
  Tensor g(DType::f32, {1, 4}, false), u(DType::f32, {1, 4}, false), out(DType::f32, {1, 4}, false);
  const double xs[4] = {0.0, 30.0, -30.0, 1.0};
  for (int k = 0; k < 4; ++k) {
    g.set(0, k, xs[k]);
    u.set(0, k, 1.0);
  }
  llmk::gated_activation(out.view(), g.view(), u.view(), Activation::silu);
  EXPECT_EQ(out.get(0, 0), 0.0);
  EXPECT_NEAR(out.get(0, 1), 30.0, 1e-5);
  EXPECT_NEAR(out.get(0, 2), 0.0, 1e-6);
  EXPECT_NEAR(out.get(0, 3), 1.0 / (1.0 + std::exp(-1.0)), 1e-7);
  llmk::gated_activation(out.view(), g.view(), u.view(), Activation::gelu);
  EXPECT_EQ(out.get(0, 0), 0.0);
  EXPECT_NEAR(out.get(0, 3), 0.8413447460685429, 1e-7);  // Phi(1)
}

using llmk_test::error_of;

TEST(GatedErrors, NameOpArgumentExpectedAndGot) {
  Tensor g(DType::bf16, {4, 64}, false), u(DType::bf16, {4, 64}, false), out(DType::bf16, {4, 64}, false);
  Tensor u_short(DType::bf16, {4, 63}, false), u_f16(DType::f16, {4, 64}, false);
  EXPECT_EQ(error_of([&] { llmk::gated_activation(out.view(), g.view(), u_short.view(), Activation::silu); }),
            "llmk::gated_activation: up: expected shape (4, 64) (the shape of gate), got (4, 63)");
  EXPECT_EQ(error_of([&] { llmk::gated_activation(out.view(), g.view(), u_f16.view(), Activation::gelu); }),
            "llmk::gated_activation: up: expected dtype bfloat16 (the dtype of gate), got float16");
  EXPECT_EQ(error_of([&] { llmk::gated_activation(out.view(), g.view(), u.view(), static_cast<Activation>(7)); }),
            "llmk::gated_activation: act: expected silu, gelu or gelu_tanh, got 7");
  llmk::TensorView shifted = g.view();  // out one row into gate: a partial overlap
  shifted.data = static_cast<char*>(shifted.data) + 64 * 2;
  shifted.shape[0] = 3;
  llmk::TensorView g3 = g.view(), u3 = u.view();
  g3.shape[0] = u3.shape[0] = 3;
  EXPECT_EQ(error_of([&] { llmk::gated_activation(shifted, g3, u3, Activation::silu); }),
            "llmk::gated_activation: out: expected memory that is gate itself or does not overlap it");
  // In place (out is gate) is allowed.
  EXPECT_EQ(error_of([&] { llmk::gated_activation(g.view(), g.view(), u.view(), Activation::silu); }), "<no error>");
  Tensor go(DType::bf16, {4, 64}, false);
  EXPECT_EQ(error_of([&] {
              llmk::gated_activation_backward(out.view(), out.view(), go.view(), g.view(), u.view(), Activation::silu);
            }),
            "llmk::gated_activation_backward: grad_up: expected memory that does not overlap grad_gate");
}

}  // namespace
