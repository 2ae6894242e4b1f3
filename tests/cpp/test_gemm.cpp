// Skinny GEMM vs a float64 reference: M = 1..16 (and 17, 40: groups of rows), K that is and is not a
// multiple of 8, N that is not a multiple of 8, bias, the fused SwiGLU epilogue, strided x rows,
// the GPU kernels (deep, mma, stream, tma, portable: LLMK_GEMM_KERNEL, and the older aliases), every K
// split of the deep kernel (LLMK_GEMM_DEEP_SPLIT) and cluster sizes of the TMA kernel
// (LLMK_GEMM_TMA_SPLIT); the RMSNorm prologue and the residual epilogue
// (separate and in place) on every kernel; bad input.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <string>
#include <vector>

#include "llmk/gemm.h"
#include "support/tensors.h"
#include "support/testing.h"

using llmk::DType;
using llmk::GemmActivation;
using llmk_test::Tensor;

namespace {

struct Case {
  bool gpu;
  DType dtype;
  int64_t m, k, n;
  bool bias;
  GemmActivation act;
  bool portable;
  int64_t x_stride;  // -1: contiguous
  const char* kernel = "deep";  // GPU: LLMK_GEMM_KERNEL (deep, mma, stream; "alias:stream": LLMK_GEMM_STREAM=1)
  int split = 0;                // GPU deep kernel: LLMK_GEMM_DEEP_SPLIT, tma: LLMK_GEMM_TMA_SPLIT (0: the plan)
  int loads = 0;                // GPU deep kernel: LLMK_GEMM_DEEP_LOADS (0: unset, 8 per trip)
  bool norm = false;            // RMSNorm prologue (GemmOptions::norm_weight, offset 0.5 on odd M)
  int residual = 0;             // residual epilogue: 0 none, 1 a separate tensor, 2 in place (out itself)
};

std::string case_name(const testing::TestParamInfo<Case>& info) {
  const Case& c = info.param;
  return std::string(c.gpu ? "gpu_" : "cpu_") + llmk::dtype_name(c.dtype) + "_m" + std::to_string(c.m) + "k" +
         std::to_string(c.k) + "n" + std::to_string(c.n) + (c.bias ? "_bias" : "") + "_" +
         llmk::gemm_activation_name(c.act) + (c.portable ? "_portable" : "") + (c.x_stride > 0 ? "_strided" : "") +
         (c.gpu && !c.portable ? std::string("_") + (std::string(c.kernel) == "alias:stream" ? "aliasstream" : c.kernel) : "") +
         (c.split ? "_sk" + std::to_string(c.split) : "") + (c.loads ? "_loads" + std::to_string(c.loads) : "") +
         (c.norm ? "_norm" : "") + (c.residual == 1 ? "_residual" : c.residual == 2 ? "_inplace" : "");
}

std::vector<Case> cases() {
  std::vector<Case> out;
  for (bool gpu : {false, true})
    for (DType dt : {DType::f32, DType::f16, DType::bf16}) {
      if (gpu && dt == DType::f32) continue;
      for (bool portable : {false, true}) {
        if (!gpu && portable) continue;
        for (int64_t m : {1, 3, 8, 16, 17})
          out.push_back({gpu, dt, m, 1024, 72, false, GemmActivation::none, portable, -1});
        out.push_back({gpu, dt, 4, 77, 13, true, GemmActivation::none, portable, -1});      // K % 8 != 0
        out.push_back({gpu, dt, 2, 4096, 40, true, GemmActivation::swiglu, portable, -1});
        out.push_back({gpu, dt, 16, 520, 26, true, GemmActivation::swiglu, portable, -1});  // inter 13
        out.push_back({gpu, dt, 5, 333, 8, false, GemmActivation::swiglu, portable, -1});
        out.push_back({gpu, dt, 16, 520, 26, true, GemmActivation::geglu_tanh, portable, -1});  // Gemma's MLP
        out.push_back({gpu, dt, 3, 333, 8, false, GemmActivation::geglu_tanh, portable, -1});
        out.push_back({gpu, dt, 6, 256, 100, true, GemmActivation::none, portable, 264});   // strided rows
        out.push_back({gpu, dt, 40, 64, 24, true, GemmActivation::none, portable, -1});
        out.push_back({gpu, dt, 1, 8, 1, true, GemmActivation::none, portable, -1});
      }
      // the fusions: every kernel (portable, and on the GPU deep, mma, stream -> mma), M in one and
      // two groups of rows, K % 8 != 0, swiglu, strided rows, K splits, residual in place
      for (const char* kernel : {"deep", "mma", "stream", "tma"}) {
        for (bool portable : {false, true}) {
          if ((!gpu && (portable || std::string(kernel) != "deep")) || (portable && std::string(kernel) != "deep")) continue;
          for (int64_t m : {1, 5, 9, 17}) {
            out.push_back({gpu, dt, m, 1032, 72, true, GemmActivation::none, portable, -1, kernel, 0, 0, true, 1});
            out.push_back({gpu, dt, m, 776, 40, false, GemmActivation::swiglu, portable, -1, kernel, 0, 0, true, 0});
          }
          out.push_back({gpu, dt, 9, 776, 40, true, GemmActivation::geglu_tanh, portable, -1, kernel, 0, 0, true, 0});
          out.push_back({gpu, dt, 1, 776, 40, false, GemmActivation::geglu_tanh, portable, -1, kernel, 0, 0, false, 1});
          out.push_back({gpu, dt, 3, 77, 13, true, GemmActivation::none, portable, -1, kernel, 0, 0, true, 2});
          out.push_back({gpu, dt, 6, 256, 100, true, GemmActivation::none, portable, 264, kernel, 0, 0, false, 2});
          out.push_back({gpu, dt, 2, 2048, 3000, false, GemmActivation::none, portable, -1, kernel, 0, 0, true, 0});
          out.push_back({gpu, dt, 1, 8192, 200, false, GemmActivation::none, portable, -1, kernel, 0, 0, false, 1});
        }
      }
      if (!gpu) continue;
      for (int split : {1, 4, 16})
        out.push_back({gpu, dt, 3, 1032, 170, true, GemmActivation::none, false, -1, "deep", split, 0, true, 1});
      // the deep kernel's plans on an H200 (132 SMs, 2 blocks of 8 / 1 of 16 warps per SM): sk = 16
      // (16-warp blocks, empty K slices at the end), 4 (M > 8, odd N), 2, 1 (direct stores, one and
      // several waves, swiglu); and every split forced on one shape, with swiglu and M > 8
      out.push_back({gpu, dt, 5, 2056, 100, true, GemmActivation::none, false, -1});
      out.push_back({gpu, dt, 9, 512, 4801, true, GemmActivation::none, false, -1});
      out.push_back({gpu, dt, 4, 392, 3000, false, GemmActivation::none, false, -1});
      out.push_back({gpu, dt, 16, 200, 130, true, GemmActivation::none, false, -1});
      out.push_back({gpu, dt, 12, 48, 14002, true, GemmActivation::swiglu, false, -1});
      out.push_back({gpu, dt, 1, 32, 70001, true, GemmActivation::none, false, -1});
      for (int split : {1, 2, 4, 8, 16}) {
        out.push_back({gpu, dt, 3, 1032, 170, true, GemmActivation::none, false, -1, "deep", split});
        out.push_back({gpu, dt, 14, 776, 90, true, GemmActivation::swiglu, false, 264 * 3, "deep", split});
        out.push_back({gpu, dt, 5, 776, 90, true, GemmActivation::geglu_tanh, false, -1, "deep", split});
      }
      // 16 W loads per lane per trip (M <= 8; M = 11 shows the fallback to 8 for rows 8..15)
      for (int split : {0, 1, 8, 16}) {
        out.push_back({gpu, dt, 7, 1288, 77, true, GemmActivation::none, false, -1, "deep", split, 16});
        out.push_back({gpu, dt, 1, 776, 40, true, GemmActivation::swiglu, false, -1, "deep", split, 16});
      }
      out.push_back({gpu, dt, 11, 2056, 4801, true, GemmActivation::none, false, -1, "deep", 0, 16});
      // plans of one partial wave (on the H200 188 blocks of 8 warps at split 8; 2 trips a warp at
      // 16 loads) at the default 8 loads and with 8 and 16 forced
      out.push_back({gpu, dt, 3, 4096, 3000, true, GemmActivation::none, false, -1, "deep"});
      out.push_back({gpu, dt, 3, 4096, 3000, true, GemmActivation::none, false, -1, "deep", 0, 8});
      out.push_back({gpu, dt, 3, 4096, 3000, true, GemmActivation::none, false, -1, "deep", 0, 16});
      out.push_back({gpu, dt, 8, 4104, 3001, false, GemmActivation::none, false, 4112, "deep"});
      // the TMA kernel (the H200, K a multiple of 64; elsewhere it falls back to deep): its plans
      // (one row tile and 8-block clusters, persistent clusters over many row tiles, K shorter
      // than the clusters, a last K step of 64 to 192 columns, M in two groups) and every cluster
      // size forced, with swiglu and strided rows; K % 64 != 0 falls back (the fusion cases above)
      const char* tma = "tma";
      for (int64_t m : {1, 8, 9, 16, 17}) out.push_back({gpu, dt, m, 1024, 72, true, GemmActivation::none, false, -1, tma});
      out.push_back({gpu, dt, 9, 4096, 4801, true, GemmActivation::none, false, -1, tma});
      out.push_back({gpu, dt, 16, 192, 130, true, GemmActivation::none, false, -1, tma});
      out.push_back({gpu, dt, 3, 64, 28674, true, GemmActivation::none, false, -1, tma});
      out.push_back({gpu, dt, 12, 128, 14002, true, GemmActivation::swiglu, false, -1, tma});
      out.push_back({gpu, dt, 2, 64, 140002, false, GemmActivation::swiglu, false, -1, tma});
      out.push_back({gpu, dt, 1, 8192, 200, false, GemmActivation::none, false, -1, tma});
      for (int split : {1, 2, 3, 5, 8}) {
        out.push_back({gpu, dt, 3, 1088, 170, true, GemmActivation::none, false, -1, tma, split});
        out.push_back({gpu, dt, 14, 832, 90, true, GemmActivation::swiglu, false, 840, tma, split});
        out.push_back({gpu, dt, 1, 4096, 1000, false, GemmActivation::none, false, -1, tma, split});
      }
      if (dt != DType::bf16) continue;
      // the streaming kernel's K splits (the small-N cases above take 16-warp blocks, SK = 16):
      // SK = 8, N large enough for SK = 1 (direct stores), 2 or 4, and more tiles than resident
      // blocks (the persistent loop); odd N, M above and below 8
      const char* st = "stream";
      out.push_back({gpu, dt, 5, 200, 4100, true, GemmActivation::none, false, -1, st});
      out.push_back({gpu, dt, 16, 64, 3000, true, GemmActivation::none, false, -1, st});
      out.push_back({gpu, dt, 3, 64, 28674, true, GemmActivation::none, false, -1, st});
      out.push_back({gpu, dt, 12, 136, 14002, true, GemmActivation::swiglu, false, -1, st});
      out.push_back({gpu, dt, 16, 96, 9000, false, GemmActivation::none, false, -1, st});
      out.push_back({gpu, dt, 1, 32, 70001, true, GemmActivation::none, false, -1, "alias:stream"});
      out.push_back({gpu, dt, 2, 32, 140002, false, GemmActivation::swiglu, false, -1, st});
      for (int64_t m : {1, 9, 16, 17}) out.push_back({gpu, dt, m, 1024, 72, true, GemmActivation::none, false, -1, st});
      // the default tensor-core kernel (mma)
      for (int64_t m : {1, 9, 16, 17})
        out.push_back({gpu, dt, m, 1024, 72, true, GemmActivation::none, false, -1, "mma"});
      out.push_back({gpu, dt, 16, 520, 26, true, GemmActivation::swiglu, false, -1, "mma"});
      out.push_back({gpu, dt, 3, 64, 28674, true, GemmActivation::none, false, -1, "mma"});
    }
  return out;
}

class GemmTest : public testing::TestWithParam<Case> {};

TEST_P(GemmTest, MatchesFloat64) {
  const Case& c = GetParam();
  SKIP_WITHOUT_GPU(c.gpu);
  const int64_t out_cols = llmk::gemm_gated(c.act) ? c.n / 2 : c.n;
  Tensor x(c.dtype, {c.m, c.k}, c.gpu, c.x_stride), w(c.dtype, {c.n, c.k}, c.gpu), b(c.dtype, {c.n}, c.gpu);
  Tensor y(c.dtype, {c.m, out_cols}, c.gpu), nw(c.dtype, {c.k}, c.gpu), res(c.dtype, {c.m, out_cols}, c.gpu);
  x.fill_random(-1, 1);
  w.fill_random(-1, 1);
  b.fill_random(-1, 1);
  nw.fill_random(-1, 1);
  res.fill_random(-4, 4);
  y.poison();
  if (c.residual == 2) y.fill_random(-4, 4);  // in place: out holds the residual
  const Tensor& residual = c.residual == 2 ? y : res;
  const float eps = 1e-5f, offset = c.m % 2 ? 0.5f : 0.f;
  std::vector<double> want(c.m * out_cols), full(c.n), xr(c.k);
  for (int64_t m = 0; m < c.m; ++m) {
    double ss = 0.0;
    for (int64_t k = 0; k < c.k; ++k) ss += x.get(m, k) * x.get(m, k);
    const double rstd = c.norm ? 1.0 / std::sqrt(ss / c.k + eps) : 1.0;
    for (int64_t k = 0; k < c.k; ++k) xr[k] = c.norm ? x.get(m, k) * rstd * (offset + nw.get(0, k)) : x.get(m, k);
    for (int64_t n = 0; n < c.n; ++n) {
      double s = c.bias ? b.get(0, n) : 0.0;
      for (int64_t k = 0; k < c.k; ++k) s += xr[k] * w.get(n, k);
      full[n] = s;
    }
    for (int64_t j = 0; j < out_cols; ++j) {
      const double g = full[j], u = c.act == GemmActivation::none ? 1.0 : full[out_cols + j];
      const double act = c.act == GemmActivation::swiglu       ? g / (1 + std::exp(-g))
                         : c.act == GemmActivation::geglu_tanh ? 0.5 * g * (1 + std::tanh(0.7978845608028654 * (g + 0.044715 * g * g * g)))
                                                               : g;
      want[m * out_cols + j] = act * u + (c.residual ? residual.get(m, j) : 0.0);
    }
  }
  llmk::GemmOptions opt;
  opt.activation = c.act;
  opt.portable = c.portable;
  if (c.norm) {
    opt.norm_weight = nw.view();
    opt.norm_eps = eps;
    opt.norm_offset = offset;
  }
  if (c.residual) opt.residual = residual.view();
  const std::string kernel = c.kernel;
  if (kernel == "alias:stream") setenv("LLMK_GEMM_STREAM", "1", 1);
  else setenv("LLMK_GEMM_KERNEL", c.kernel, 1);
  if (c.split) setenv(kernel == "tma" ? "LLMK_GEMM_TMA_SPLIT" : "LLMK_GEMM_DEEP_SPLIT", std::to_string(c.split).c_str(), 1);
  if (c.loads) setenv("LLMK_GEMM_DEEP_LOADS", std::to_string(c.loads).c_str(), 1);
  llmk::skinny_gemm(y.view(), x.view(), w.view(), c.bias ? b.view() : llmk::TensorView{}, opt);
  unsetenv("LLMK_GEMM_STREAM");
  unsetenv("LLMK_GEMM_KERNEL");
  unsetenv("LLMK_GEMM_DEEP_SPLIT");
  unsetenv("LLMK_GEMM_TMA_SPLIT");
  unsetenv("LLMK_GEMM_DEEP_LOADS");
  y.download();
  EXPECT_LT(llmk_test::relative_error(y, want), llmk_test::tolerance(c.dtype));
}

INSTANTIATE_TEST_SUITE_P(Gemm, GemmTest, testing::ValuesIn(cases()), case_name);

TEST(GemmTest, UnknownKernelName) {
  SKIP_WITHOUT_GPU(true);
  Tensor x(DType::bf16, {2, 64}, true), w(DType::bf16, {16, 64}, true), y(DType::bf16, {2, 16}, true);
  setenv("LLMK_GEMM_KERNEL", "bogus", 1);
  const std::string err = llmk_test::error_of([&] { llmk::skinny_gemm(y.view(), x.view(), w.view(), {}); });
  unsetenv("LLMK_GEMM_KERNEL");
  EXPECT_EQ(err, "llmk::skinny_gemm: LLMK_GEMM_KERNEL: expected deep, mma, stream, tma, portable or default, got 'bogus'");
}

TEST(GemmTest, BadInput) {
  using llmk_test::error_of;
  Tensor x(DType::f32, {2, 3, 64}, false), w(DType::f32, {10, 64}, false), w63(DType::f32, {10, 63}, false);
  Tensor y(DType::f32, {2, 3, 10}, false), b(DType::f32, {9}, false), w16(DType::f16, {10, 64}, false);
  Tensor w9(DType::f32, {9, 64}, false), y5(DType::f32, {2, 3, 5}, false);
  auto gemm = [&](const Tensor& yy, const Tensor& ww, llmk::TensorView bias = {},
                  GemmActivation act = GemmActivation::none) {
    return error_of([&] {
      llmk::GemmOptions opt;
      opt.activation = act;
      llmk::skinny_gemm(yy.view(), x.view(), ww.view(), bias, opt);
    });
  };
  EXPECT_EQ(gemm(y, w63),
            "llmk::skinny_gemm: weight: expected shape (out_features, 64) (in_features = the last dim of x), got (10, 63)");
  EXPECT_EQ(gemm(y, w16), "llmk::skinny_gemm: weight: expected dtype float32 (the dtype of x), got float16");
  EXPECT_EQ(gemm(y, w, b.view()), "llmk::skinny_gemm: bias: expected shape (10) (the rows of weight), got (9)");
  EXPECT_EQ(gemm(y5, w9, {}, GemmActivation::swiglu),
            "llmk::skinny_gemm: weight: expected an even number of rows for swiglu ([gate; up], 2 * inter), got "
            "shape (9, 64)");
  EXPECT_EQ(gemm(y, w, {}, GemmActivation::swiglu), "llmk::skinny_gemm: out: expected shape (2, 3, 5), got (2, 3, 10)");
  EXPECT_EQ(gemm(y5, w), "llmk::skinny_gemm: out: expected shape (2, 3, 10), got (2, 3, 5)");
  EXPECT_EQ(gemm(y5, w, {}, GemmActivation::swiglu), "<no error>");
  EXPECT_EQ(gemm(y5, w9, {}, GemmActivation::geglu_tanh),
            "llmk::skinny_gemm: weight: expected an even number of rows for geglu_tanh ([gate; up], 2 * inter), got "
            "shape (9, 64)");
  EXPECT_EQ(gemm(y, w, {}, static_cast<GemmActivation>(7)), "llmk::skinny_gemm: activation: expected none, swiglu or "
                                                             "geglu_tanh, got 7");
  // the fusions
  Tensor nw63(DType::f32, {63}, false), nw16(DType::f16, {64}, false), nw(DType::f32, {64}, false);
  auto fused = [&](const llmk::TensorView& norm_weight, const llmk::TensorView& residual, float eps = 1e-6f) {
    return error_of([&] {
      llmk::GemmOptions opt;
      opt.norm_weight = norm_weight;
      opt.norm_eps = eps;
      opt.residual = residual;
      llmk::skinny_gemm(y.view(), x.view(), w.view(), {}, opt);
    });
  };
  EXPECT_EQ(fused(nw63.view(), {}), "llmk::skinny_gemm: norm_weight: expected shape (64) (the last dim of x), got (63)");
  EXPECT_EQ(fused(nw16.view(), {}), "llmk::skinny_gemm: norm_weight: expected dtype float32 (the dtype of x), got float16");
  EXPECT_EQ(fused(nw.view(), {}, -1.f), "llmk::skinny_gemm: norm_eps: expected a finite value >= 0, got -1.000000");
  EXPECT_EQ(fused({}, y5.view()), "llmk::skinny_gemm: residual: expected shape (2, 3, 10) (the shape of out), got (2, 3, 5)");
  llmk::TensorView shifted = y.view();  // out's shape, one element further on: overlaps out without being it
  shifted.data = static_cast<float*>(shifted.data) + 1;
  EXPECT_EQ(fused({}, shifted),
            "llmk::skinny_gemm: residual: expected either out's very memory (in place) or memory that does not overlap it");
  EXPECT_EQ(fused(nw.view(), y.view()), "<no error>");
}

}  // namespace
