// Skinny GEMM vs a float64 reference: M = 1..16 (and 17, 40: groups of rows), K that is and is not a
// multiple of 8, N that is not a multiple of 8, bias, the fused SwiGLU epilogue, strided x rows,
// the GPU kernels (deep, mma, stream, tma, portable: LLMK_GEMM_KERNEL, and the older aliases), every K
// split of the deep kernel (LLMK_GEMM_DEEP_SPLIT) and cluster sizes of the TMA kernel
// (LLMK_GEMM_TMA_SPLIT) and its split tail (LLMK_GEMM_TMA_TAIL); the RMSNorm prologue and the residual epilogue
// (separate and in place) on every kernel; bad input.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "llmk/decode.h"
#include "gemm/gemm_internal.h"  // skinny_gemm_rope_kv_launches, skinny_gemm_tma_tail_launches
#include "gemm/kernel_setting.h"
#include "gemm/pdl_trigger.h"
#include "llmk/gemm.h"
#include "support/tensors.h"
#include "support/testing.h"

using llmk::DType;
using llmk::GemmActivation;
using llmk_test::Ints;
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
  const char* kernel = "deep";  // GPU: LLMK_GEMM_KERNEL (deep, mma, stream; "alias:stream": LLMK_GEMM_STREAM=1;
                                //   "tma4": tma with LLMK_GEMM_TMA_STAGES=4)
  int split = 0;                // GPU deep kernel: LLMK_GEMM_DEEP_SPLIT, tma: LLMK_GEMM_TMA_SPLIT (0: the plan)
  int loads = 0;                // GPU deep kernel: LLMK_GEMM_DEEP_LOADS (0: unset, 8 per trip)
  bool norm = false;            // RMSNorm prologue (GemmOptions::norm_weight, offset 0.5 on odd M)
  int residual = 0;             // residual epilogue: 0 none, 1 a separate tensor, 2 in place (out itself)
  bool tail = false;            // GPU tma kernel: LLMK_GEMM_TMA_TAIL=1 (the split tail in a second launch)
};

std::string case_name(const testing::TestParamInfo<Case>& info) {
  const Case& c = info.param;
  return std::string(c.gpu ? "gpu_" : "cpu_") + llmk::dtype_name(c.dtype) + "_m" + std::to_string(c.m) + "k" +
         std::to_string(c.k) + "n" + std::to_string(c.n) + (c.bias ? "_bias" : "") + "_" +
         llmk::gemm_activation_name(c.act) + (c.portable ? "_portable" : "") + (c.x_stride > 0 ? "_strided" : "") +
         (c.gpu && !c.portable ? std::string("_") + (std::string(c.kernel) == "alias:stream" ? "aliasstream" : c.kernel) : "") +
         (c.split ? "_sk" + std::to_string(c.split) : "") + (c.loads ? "_loads" + std::to_string(c.loads) : "") +
         (c.norm ? "_norm" : "") + (c.residual == 1 ? "_residual" : c.residual == 2 ? "_inplace" : "") +
         (c.tail ? "_tail" : "");
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
      // LLMK_GEMM_TMA_TAIL=1 (K = 1024: 4 steps), on 132 multiprocessors: 397 row tiles (64
      // columns; 32 with swiglu), three rounds of one-block clusters and one tile left over for a
      // 4-block cluster; 448 (8192 x 28672's count), 52 left over for 52 2-block clusters; M = 17
      // in two groups (each its two launches), strided x
      for (Case t : {Case{gpu, dt, 3, 1024, 25350, true, GemmActivation::none, false, -1, tma},
                     Case{gpu, dt, 17, 1024, 25350, false, GemmActivation::none, false, 1032, tma},
                     Case{gpu, dt, 5, 1024, 25354, true, GemmActivation::swiglu, false, -1, tma},
                     Case{gpu, dt, 2, 1024, 28664, true, GemmActivation::none, false, -1, tma},
                     Case{gpu, dt, 9, 1024, 2 * 14330, false, GemmActivation::swiglu, false, -1, tma}}) {
        t.tail = true;
        if (gpu) out.push_back(t);  // (the CPU has no kernels to choose)
      }
      // the 4-stage build (LLMK_GEMM_TMA_STAGES=4): one and two groups of rows, K shorter than the
      // ring, swiglu with strided rows, persistent clusters, forced splits
      const char* tma4 = "tma4";
      for (int64_t m : {1, 9, 17}) out.push_back({gpu, dt, m, 1024, 72, true, GemmActivation::none, false, -1, tma4});
      out.push_back({gpu, dt, 16, 192, 130, true, GemmActivation::none, false, -1, tma4});
      out.push_back({gpu, dt, 14, 832, 90, true, GemmActivation::swiglu, false, 840, tma4});
      out.push_back({gpu, dt, 9, 4096, 4801, true, GemmActivation::none, false, -1, tma4});
      for (int split : {2, 5}) out.push_back({gpu, dt, 3, 1088, 170, true, GemmActivation::none, false, -1, tma4, split});
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
  const bool tma = kernel == "tma" || kernel == "tma4";
  if (kernel == "alias:stream") setenv("LLMK_GEMM_STREAM", "1", 1);
  else setenv("LLMK_GEMM_KERNEL", tma ? "tma" : c.kernel, 1);
  if (kernel == "tma4") setenv("LLMK_GEMM_TMA_STAGES", "4", 1);
  if (c.split) setenv(tma ? "LLMK_GEMM_TMA_SPLIT" : "LLMK_GEMM_DEEP_SPLIT", std::to_string(c.split).c_str(), 1);
  if (c.loads) setenv("LLMK_GEMM_DEEP_LOADS", std::to_string(c.loads).c_str(), 1);
  if (c.tail) setenv("LLMK_GEMM_TMA_TAIL", "1", 1);
  const int64_t tails = llmk::detail::skinny_gemm_tma_tail_launches();
  llmk::skinny_gemm(y.view(), x.view(), w.view(), c.bias ? b.view() : llmk::TensorView{}, opt);
  // the split tail ran where the TMA kernel does (Hopper), once per group of 16 rows (the shapes'
  // tile counts are chosen for 132 multiprocessors: H100 SXM, H200)
  if (c.tail && llmk_test::gpu_is_sm90() && llmk_test::gpu_multiprocessors() == 132)
    EXPECT_EQ(llmk::detail::skinny_gemm_tma_tail_launches() - tails, (c.m + 15) / 16);
  if (!c.tail) EXPECT_EQ(llmk::detail::skinny_gemm_tma_tail_launches(), tails);
  // A fixed weight (GemmOptions::fixed_weight: on Hopper the deep kernel loads its first trip before
  // the PDL wait) gives the same bits: the same products in the same order. (In place the residual
  // was consumed by the first call.)
  const bool check_fixed = c.gpu && c.residual != 2;  // (on the CPU the option changes nothing)
  Tensor y_fixed(c.dtype, {c.m, out_cols}, c.gpu);
  if (check_fixed) {
    y_fixed.poison();
    llmk::GemmOptions fixed = opt;
    fixed.fixed_weight = true;
    llmk::skinny_gemm(y_fixed.view(), x.view(), w.view(), c.bias ? b.view() : llmk::TensorView{}, fixed);
  }
  unsetenv("LLMK_GEMM_TMA_TAIL");
  unsetenv("LLMK_GEMM_STREAM");
  unsetenv("LLMK_GEMM_KERNEL");
  unsetenv("LLMK_GEMM_DEEP_SPLIT");
  unsetenv("LLMK_GEMM_TMA_SPLIT");
  unsetenv("LLMK_GEMM_TMA_STAGES");
  unsetenv("LLMK_GEMM_DEEP_LOADS");
  y.download();
  EXPECT_LT(llmk_test::relative_error(y, want), llmk_test::tolerance(c.dtype));
  if (check_fixed) {
    y_fixed.download();
    for (int64_t m = 0; m < c.m; ++m)
      for (int64_t j = 0; j < out_cols; ++j) ASSERT_EQ(y_fixed.get(m, j), y.get(m, j)) << "fixed_weight, m" << m << " j" << j;
  }
}

INSTANTIATE_TEST_SUITE_P(Gemm, GemmTest, testing::ValuesIn(cases()), case_name);

TEST(GemmTest, UnknownKernelName) {
  SKIP_WITHOUT_GPU(true);
  Tensor x(DType::bf16, {2, 64}, true), w(DType::bf16, {16, 64}, true), y(DType::bf16, {2, 16}, true);
  setenv("LLMK_GEMM_KERNEL", "bogus", 1);
  const std::string err = llmk_test::error_of([&] { llmk::skinny_gemm(y.view(), x.view(), w.view(), {}); });
  unsetenv("LLMK_GEMM_KERNEL");
  EXPECT_EQ(err, "llmk::skinny_gemm: LLMK_GEMM_KERNEL: expected deep, mma, stream, tma, tma@SHAPES, portable or default, got "
                 "'bogus'");
}

// Restores LLMK_GEMM_TMA_ROWS as it was (a GPU run may export it for every test) when it goes out of
// scope.
struct TmaRowsRestore {
  const char* was = std::getenv("LLMK_GEMM_TMA_ROWS");
  const std::string value = was ? was : "";
  ~TmaRowsRestore() {
    if (was) setenv("LLMK_GEMM_TMA_ROWS", value.c_str(), 1);
    else unsetenv("LLMK_GEMM_TMA_ROWS");
  }
};

TEST(GemmTest, BadTmaRows) {
  SKIP_WITHOUT_GPU(true);
  const TmaRowsRestore restore;
  Tensor x(DType::bf16, {2, 64}, true), w(DType::bf16, {16, 64}, true), y(DType::bf16, {2, 16}, true);
  setenv("LLMK_GEMM_TMA_ROWS", "17", 1);  // (the values it takes: SkinnyGemmKernelSetting.TmaRows)
  EXPECT_EQ(llmk_test::error_of([&] { llmk::skinny_gemm(y.view(), x.view(), w.view(), {}); }),
            "llmk::skinny_gemm: LLMK_GEMM_TMA_ROWS: expected a row count from 1 to 16, got '17'");
  setenv("LLMK_GEMM_TMA_ROWS", "16", 1);
  EXPECT_EQ(llmk_test::error_of([&] { llmk::skinny_gemm(y.view(), x.view(), w.view(), {}); }), "<no error>");
}

// LLMK_GEMM_KERNEL=tma@SHAPES sends the listed KxN weights to the TMA kernel and every other to the
// default one. Seen through the split tail's launch counter (LLMK_GEMM_TMA_TAIL=1 gives this shape,
// 397 row tiles, a tail launch where the TMA kernel runs: Hopper with 132 multiprocessors), and the
// bits: a listed shape's equal LLMK_GEMM_KERNEL=tma's, an unlisted one's the default's.
TEST(GemmTest, TmaAtShapesPicksTheKernelPerShape) {
  SKIP_WITHOUT_GPU(true);
  const int64_t m = 3, k = 1024, n = 25350;
  Tensor x(DType::bf16, {m, k}, true), w(DType::bf16, {n, k}, true);
  x.fill_random(-1, 1);
  w.fill_random(-1, 1);
  const bool tail_runs = llmk_test::gpu_is_sm90() && llmk_test::gpu_multiprocessors() == 132;
  setenv("LLMK_GEMM_TMA_TAIL", "1", 1);
  const auto run = [&](const char* kernel, int64_t& tail_launches) {
    auto y = std::make_unique<Tensor>(DType::bf16, std::vector<int64_t>{m, n}, true);
    y->poison();
    if (kernel) setenv("LLMK_GEMM_KERNEL", kernel, 1);
    else unsetenv("LLMK_GEMM_KERNEL");
    const int64_t before = llmk::detail::skinny_gemm_tma_tail_launches();
    llmk::skinny_gemm(y->view(), x.view(), w.view(), {});
    tail_launches = llmk::detail::skinny_gemm_tma_tail_launches() - before;
    y->download();
    return y;
  };
  int64_t launches = 0;
  const auto tma = run("tma", launches);
  EXPECT_EQ(launches, tail_runs ? 1 : 0);
  const auto deflt = run(nullptr, launches);
  EXPECT_EQ(launches, 0);
  for (const char* listed : {"tma@1024x25350", "tma@64x64+1024x25350+25350x1024"}) {
    const auto y = run(listed, launches);
    EXPECT_EQ(launches, tail_runs ? 1 : 0) << listed;
    for (int64_t r = 0; r < m; ++r)
      for (int64_t j = 0; j < n; ++j) ASSERT_EQ(y->get(r, j), tma->get(r, j)) << listed << ", m" << r << " j" << j;
  }
  for (const char* unlisted : {"tma@25350x1024", "tma@1024x25351+1024x2535"}) {
    const auto y = run(unlisted, launches);
    EXPECT_EQ(launches, 0) << unlisted;
    for (int64_t r = 0; r < m; ++r)
      for (int64_t j = 0; j < n; ++j) ASSERT_EQ(y->get(r, j), deflt->get(r, j)) << unlisted << ", m" << r << " j" << j;
  }
  unsetenv("LLMK_GEMM_TMA_TAIL");
  unsetenv("LLMK_GEMM_KERNEL");
}

// With LLMK_GEMM_TMA_DEFAULT=1, also when unset (the default since 2026-12-07), the default kernel
// choice picks the TMA kernel for one row of x (up to 8 with LLMK_GEMM_TMA_ROWS=8) against a weight
// of 40M elements or more where it applies (Hopper with sm_90a code), and the other kernels
// elsewhere: at more rows, below the size floor (odd N both sides of it), and with the RMSNorm
// prologue; with 0 never. Seen through the TMA kernel's call counter, and the bits (the same as
// LLMK_GEMM_KERNEL=tma's, or deep's / mma's); a plain and a SwiGLU product.
TEST(GemmTest, TmaDefaultPicksTheTmaKernelForLargeWeightsUpToItsRowLimit) {
  SKIP_WITHOUT_GPU(true);
  const bool tma_runs = llmk_test::gpu_is_sm90();
  const int64_t k = 4096, big_n = 10250, small_n = 10238;  // 4096 x 10250 = 41.98M >= 40 x 2^20 > 4096 x 10238
  unsetenv("LLMK_GEMM_TMA_DEFAULT");
  const TmaRowsRestore restore;
  for (const char* rows_setting : {static_cast<const char*>(nullptr), "8"}) {
    if (rows_setting) setenv("LLMK_GEMM_TMA_ROWS", rows_setting, 1);
    else unsetenv("LLMK_GEMM_TMA_ROWS");
    const int64_t tma_rows = rows_setting ? 8 : 1;
    for (GemmActivation act : {GemmActivation::none, GemmActivation::swiglu}) {
      for (int64_t n : {big_n, small_n}) {
        for (int64_t m : {int64_t{1}, int64_t{2}, int64_t{8}, int64_t{9}}) {
          Tensor x(DType::bf16, {m, k}, true), w(DType::bf16, {n, k}, true);
          x.fill_random(-1, 1);
          w.fill_random(-1, 1);
          const int64_t out_n = act == GemmActivation::none ? n : n / 2;
          const auto run = [&](const char* kernel, const char* tma_default, int64_t& tma_calls) {
            auto y = std::make_unique<Tensor>(DType::bf16, std::vector<int64_t>{m, out_n}, true);
            y->poison();
            if (kernel) setenv("LLMK_GEMM_KERNEL", kernel, 1);
            else unsetenv("LLMK_GEMM_KERNEL");
            if (tma_default) setenv("LLMK_GEMM_TMA_DEFAULT", tma_default, 1);
            else unsetenv("LLMK_GEMM_TMA_DEFAULT");
            const int64_t before = llmk::detail::skinny_gemm_tma_calls();
            llmk::GemmOptions opt;
            opt.activation = act;
            llmk::skinny_gemm(y->view(), x.view(), w.view(), {}, opt);
            tma_calls = llmk::detail::skinny_gemm_tma_calls() - before;
            y->download();
            return y;
          };
          const auto same = [&](const Tensor& a, const Tensor& b, const char* what) {
            for (int64_t r = 0; r < m; ++r)
              for (int64_t j = 0; j < out_n; ++j)
                ASSERT_EQ(a.get(r, j), b.get(r, j))
                    << what << ", rows " << tma_rows << " m " << m << " n " << n << " row " << r << " col " << j;
          };
          int64_t calls = 0;
          const bool picks = m <= tma_rows && n == big_n;
          const auto on = run(nullptr, "1", calls);
          EXPECT_EQ(calls, picks && tma_runs ? 1 : 0) << "rows " << tma_rows << " m " << m << " n " << n;
          const auto tma = run("tma", nullptr, calls);
          EXPECT_EQ(calls, tma_runs ? 1 : 0);
          const auto off = run(nullptr, "0", calls);
          EXPECT_EQ(calls, 0);
          const auto deflt = run(nullptr, nullptr, calls);
          EXPECT_EQ(calls, picks && tma_runs ? 1 : 0) << "default, rows " << tma_rows << " m " << m << " n " << n;
          const auto other = run(act == GemmActivation::none ? "deep" : "mma", nullptr, calls);
          EXPECT_EQ(calls, 0);
          same(*on, picks ? *tma : *other, "LLMK_GEMM_TMA_DEFAULT=1");
          same(*off, *other, "LLMK_GEMM_TMA_DEFAULT=0");
          same(*deflt, picks ? *tma : *other, "default");
        }
      }
    }
  }
  // the RMSNorm prologue rules the TMA kernel out: the deep kernel runs it
  Tensor x(DType::bf16, {1, k}, true), w(DType::bf16, {big_n, k}, true), g(DType::bf16, {k}, true);
  Tensor y(DType::bf16, {1, big_n}, true);
  x.fill_random(-1, 1);
  w.fill_random(-1, 1);
  g.fill_random(0.5, 1.5);
  llmk::GemmOptions normed;
  normed.norm_weight = g.view();
  unsetenv("LLMK_GEMM_KERNEL");
  setenv("LLMK_GEMM_TMA_DEFAULT", "1", 1);
  const int64_t before = llmk::detail::skinny_gemm_tma_calls();
  llmk::skinny_gemm(y.view(), x.view(), w.view(), {}, normed);
  EXPECT_EQ(llmk::detail::skinny_gemm_tma_calls(), before);
  unsetenv("LLMK_GEMM_TMA_DEFAULT");
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

// skinny_gemm_rope_kv: out = [rope(q) | rope(k) | v] of x W^T (+ bias, after the RMSNorm
// prologue) and the caches' slots at each row's position, against a float64 reference (the
// product rounded to the dtype, then rotated); the caches' other slots untouched; padding rows
// (position -1) write nothing; the length counter advanced once per call (twice in a row: the
// GPU's block count must be back at zero), positions then a view of it, as Hugging Face's static
// cache has them. GPU: the fused deep kernel at every K split (both epilogues: direct stores at
// sk = 1, the shared-memory sums above), with and without the RMSNorm prologue, M in one and two
// launches (17 rows), one and many blocks; the portable kernel's (AMD's) epilogue, forced on NVIDIA;
// bitwise equal to skinny_gemm followed by rope_write_kv_cache at the same split; and the two-call
// path where the kernel cannot fuse (D not a multiple of 16 on the deep kernel or of 8 on the
// portable one, LLMK_GEMM_KERNEL=mma).
struct RopeCase {
  bool gpu;
  DType dtype;
  int64_t m, k, hq, hkv, d;
  bool bias = false, norm = false, advance = false, int64_pos = false, shared_angles = false;
  const char* kernel = "deep";  // GPU: LLMK_GEMM_KERNEL
  int split = 0;                // GPU: LLMK_GEMM_DEEP_SPLIT (0: the plan)
  bool portable = false;
  bool strided = false;  // cos / sin rows D apart (Hugging Face's tables' first halves), caches' rows D + 8
};

// The fused launches a case makes on the GPU (skinny_gemm_rope_kv_launches): one per 16 rows on the
// deep kernel (D a multiple of 16; LLMK_GEMM_KERNEL=tma takes it too, the TMA kernel having no RoPE
// epilogue) or per pass of the portable kernel (D a multiple of 8; K % 8 != 0 and
// GemmOptions::portable take it too); none where the op runs as two calls.
int64_t expected_rope_launches(const RopeCase& c) {
  const std::string kernel = c.kernel;
  if (!c.gpu || kernel == "mma") return 0;
  if (c.portable || kernel == "portable" || c.k % 8 != 0) return c.d % 8 == 0 ? (c.m + 15) / 16 : 0;
  return c.d % 16 == 0 ? (c.m + 15) / 16 : 0;
}

// Sets the GEMM switches of one case and clears the others; restores the unset state when it goes
// out of scope (also when an assertion ends the test early).
struct GemmEnv {
  GemmEnv(const char* kernel, int split) {
    clear();
    setenv("LLMK_GEMM_KERNEL", kernel, 1);
    if (split) setenv("LLMK_GEMM_DEEP_SPLIT", std::to_string(split).c_str(), 1);
  }
  ~GemmEnv() { clear(); }
  static void clear() {
    for (const char* v : {"LLMK_GEMM_KERNEL", "LLMK_GEMM_DEEP_SPLIT", "LLMK_GEMM_DEEP_LOADS", "LLMK_GEMM_PORTABLE_ROWS",
                          "LLMK_GEMM_PORTABLE_ALL_W_ROWS", "LLMK_GEMM_STREAM", "LLMK_GEMM_PORTABLE", "LLMK_GEMM_TMA_SPLIT"})
      unsetenv(v);
  }
};

std::string rope_case_name(const testing::TestParamInfo<RopeCase>& info) {
  const RopeCase& c = info.param;
  return std::string(c.gpu ? "gpu_" : "cpu_") + llmk::dtype_name(c.dtype) + "_m" + std::to_string(c.m) + "k" +
         std::to_string(c.k) + "_q" + std::to_string(c.hq) + "kv" + std::to_string(c.hkv) + "d" + std::to_string(c.d) +
         (c.bias ? "_bias" : "") + (c.norm ? "_norm" : "") + (c.advance ? "_advance" : "") + (c.int64_pos ? "_i64" : "") +
         (c.shared_angles ? "_shared" : "") + (c.gpu ? std::string("_") + c.kernel : "") +
         (c.split ? "_sk" + std::to_string(c.split) : "") + (c.portable ? "_portable" : "") + (c.strided ? "_strided" : "");
}

std::vector<RopeCase> rope_cases() {
  std::vector<RopeCase> out;
  for (bool gpu : {false, true})
    for (DType dt : {DType::f32, DType::f16, DType::bf16}) {
      if (gpu && dt == DType::f32) continue;
      out.push_back({gpu, dt, 1, 256, 4, 2, 64, true, true, true, true, true});  // batch-1 decode, HF's layout
      out.push_back({gpu, dt, 3, 520, 3, 1, 32, false, false, false});
      out.push_back({gpu, dt, 5, 64, 2, 2, 24, true, false, false, false});      // D % 16 != 0
      out.push_back({gpu, dt, 17, 136, 2, 1, 16, true, true, true, false, true});  // two launches of rows
      out.push_back({gpu, dt, 3, 264, 2, 1, 32, false, true, true, false, false, "deep", 0, false, true});
      if (!gpu) continue;
      out.push_back({gpu, dt, 2, 264, 4, 2, 64, true, false, false, true, false, "portable", 0, false, true});
      // the fused kernel's plans: every split, direct stores (sk 1) and shared-memory sums, with the
      // prologue (bf16: deferred; f16: its rstd first) and without, one and 9-16 rows (11: padding
      // and scattered positions; 2 and 13: the length advanced by the last ticket's block)
      for (int split : {1, 2, 4, 8, 16}) {
        out.push_back({gpu, dt, 2, 1032, 4, 2, 64, true, true, true, false, false, "deep", split});
        out.push_back({gpu, dt, 11, 776, 2, 1, 128, false, false, false, true, false, "deep", split});
        out.push_back({gpu, dt, 13, 520, 2, 1, 64, false, true, true, false, false, "deep", split});
      }
      // a grid of one block (8 column groups of 16, sk 1): its own ticket is the last
      out.push_back({gpu, dt, 1, 264, 2, 1, 32, false, false, true, false, false, "deep", 1});
      out.push_back({gpu, dt, 4, 2048, 32, 8, 64, false, true, true, true, true});   // the 1B model's q/k/v
      out.push_back({gpu, dt, 1, 4096, 32, 8, 128, true, true, true, true, true});   // 7B's, with a bias
      out.push_back({gpu, dt, 16, 1024, 3, 3, 80, true, false, false});               // D 80, 16 rows
      out.push_back({gpu, dt, 2, 264, 2, 1, 256, false, true, true});                 // D 256
      // the portable kernel's epilogue (AMD's; D a multiple of 8): 1-2-row and 4-row warp-group
      // passes, two passes (17 rows), K % 8 != 0 (single elements), GemmOptions::portable
      for (int64_t m : {1, 2, 5, 16, 17})
        out.push_back({gpu, dt, m, 520, 3, 1, 24, m % 2 == 1, m > 2, true, m == 5, m == 1, "portable"});
      out.push_back({gpu, dt, 3, 1032, 4, 2, 64, true, true, true, false, false, "deep", 0, true});
      out.push_back({gpu, dt, 3, 77, 4, 2, 64, true, false, true});  // K % 8 != 0: portable
      out.push_back({gpu, dt, 5, 1024, 4, 2, 64, true, false, true, false, false, "tma"});  // fused on deep
      // where the kernel cannot fuse: the two calls
      out.push_back({gpu, dt, 3, 1032, 4, 2, 64, true, true, true, false, false, "mma"});
      out.push_back({gpu, dt, 2, 264, 2, 2, 20, true, false, true, false, false, "portable"});  // D % 8 != 0
    }
  return out;
}

// (M, 1, heads, D) view of columns [col, col + heads * D) of a (M, N) tensor's rows.
llmk::TensorView head_view(const Tensor& t, int64_t col, int64_t heads, int64_t d) {
  llmk::TensorView v = t.view();
  const int64_t row = v.strides[0];
  v.data = static_cast<char*>(v.data) + col * static_cast<int64_t>(llmk::dtype_size(v.dtype));
  v.ndim = 4;
  const int64_t shape[4] = {v.shape[0], 1, heads, d}, strides[4] = {row, row, d, 1};
  for (int i = 0; i < 4; ++i) v.shape[i] = shape[i], v.strides[i] = strides[i];
  return v;
}

class GemmRopeKvTest : public testing::TestWithParam<RopeCase> {};

TEST_P(GemmRopeKvTest, MatchesFloat64AndWritesTheCaches) {
  const RopeCase& c = GetParam();
  SKIP_WITHOUT_GPU(c.gpu);
  const int64_t M = c.m, K = c.k, D = c.d, half = D / 2, S = 37, N = (c.hq + 2 * c.hkv) * D, qk = (c.hq + c.hkv) * D;
  const int64_t start = 11;
  Tensor x(c.dtype, {M, K}, c.gpu), w(c.dtype, {N, K}, c.gpu), b(c.dtype, {N}, c.gpu), nw(c.dtype, {K}, c.gpu);
  const int64_t cache_row = c.strided ? D + 8 : -1, angle_cols = c.strided ? D : half;
  Tensor kc(c.dtype, {M, c.hkv, S, D}, c.gpu, cache_row), vc(c.dtype, {M, c.hkv, S, D}, c.gpu, cache_row);
  Tensor cs(c.dtype, {c.shared_angles ? 1 : M, angle_cols}, c.gpu), sn(c.dtype, {c.shared_angles ? 1 : M, angle_cols}, c.gpu);
  for (Tensor* t : {&x, &w, &b, &nw, &kc, &vc}) t->fill_random(-1, 1);
  for (int64_t r = 0; r < cs.rows(); ++r)
    for (int64_t i = 0; i < half; ++i) {
      const double a = (start + 3 * r) / std::pow(10000.0, 2.0 * i / D);
      cs.set(r, i, std::cos(a));
      sn.set(r, i, std::sin(a));
    }
  cs.upload();
  sn.upload();
  llmk::TensorView cos_v = cs.view(), sin_v = sn.view();
  for (llmk::TensorView* v : {&cos_v, &sin_v}) {  // (M, D / 2): a stride-0 row, or the first half of D
    v->shape[0] = M;
    v->shape[1] = half;
    if (c.shared_angles) v->strides[0] = 0;
  }
  std::vector<double> kc0(M * c.hkv * S * D), vc0(kc0.size());
  for (int64_t i = 0; i < static_cast<int64_t>(kc0.size()); ++i) kc0[i] = kc.get(i / D, i % D), vc0[i] = vc.get(i / D, i % D);
  // positions: with advance, a view of the length counter for every row (Hugging Face's layout);
  // else row r at (7 r + 3) % S, row 3 padding
  Ints length({1}, {start}, c.gpu, c.int64_pos), counter({1}, {0}, c.gpu);
  std::vector<int64_t> pos_values(M);
  for (int64_t r = 0; r < M; ++r) pos_values[r] = c.advance ? start : r == 3 ? -1 : (7 * r + 3) % S;
  Ints own_positions({M}, pos_values, c.gpu, c.int64_pos);
  llmk::TensorView positions = own_positions.view();
  if (c.advance) {
    positions = length.view();
    positions.shape[0] = M;
    positions.strides[0] = 0;
  }
  llmk::GemmRopeKv rope;
  rope.q_heads = c.hq;
  rope.cos = cos_v;
  rope.sin = sin_v;
  rope.positions = positions;
  rope.k_cache = kc.view();
  rope.v_cache = vc.view();
  if (c.advance) rope.advance = length.view(), rope.counter = counter.view();
  llmk::GemmOptions opt;
  opt.portable = c.portable;
  const float eps = 1e-5f, offset = M % 2 ? 0.5f : 0.f;
  if (c.norm) opt.norm_weight = nw.view(), opt.norm_eps = eps, opt.norm_offset = offset;
  const GemmEnv env(c.kernel, c.split);
  const auto call = [&](Tensor& y, const llmk::GemmRopeKv& r) {
    llmk::skinny_gemm_rope_kv(y.view(), x.view(), w.view(), c.bias ? b.view() : llmk::TensorView{}, r, opt);
  };
  Tensor y(c.dtype, {M, N}, c.gpu);
  y.poison();
  const int64_t launches = llmk::detail::skinny_gemm_rope_kv_launches();
  call(y, rope);
  EXPECT_EQ(llmk::detail::skinny_gemm_rope_kv_launches() - launches, expected_rope_launches(c));
  y.download();
  kc.download();
  vc.download();
  // float64: the product (after the prologue) rounded to the dtype, then each pair rotated
  std::vector<double> want(M * N), full(N), xr(K);
  for (int64_t m = 0; m < M; ++m) {
    double ss = 0.0;
    for (int64_t k = 0; k < K; ++k) ss += x.get(m, k) * x.get(m, k);
    const double rstd = c.norm ? 1.0 / std::sqrt(ss / K + eps) : 1.0;
    for (int64_t k = 0; k < K; ++k) xr[k] = c.norm ? x.get(m, k) * rstd * (offset + nw.get(0, k)) : x.get(m, k);
    for (int64_t n = 0; n < N; ++n) {
      double s = c.bias ? b.get(0, n) : 0.0;
      for (int64_t k = 0; k < K; ++k) s += xr[k] * w.get(n, k);
      full[n] = llmk_test::rounded(c.dtype, s);
    }
    const int64_t ar = c.shared_angles ? 0 : m;
    for (int64_t n = 0; n < N; ++n) {
      const int64_t h0 = n - n % D, e = n % D, i = e % half;
      const double x1 = full[h0 + i], x2 = full[h0 + i + half], co = cs.get(ar, i), si = sn.get(ar, i);
      want[m * N + n] = n >= qk ? full[n] : e < half ? x1 * co - x2 * si : x2 * co + x1 * si;
    }
  }
  EXPECT_LT(llmk_test::relative_error(y, want), llmk_test::tolerance(c.dtype));
  // the caches: row m's slot holds out's k and v bitwise; every other slot as it was
  for (int64_t m = 0; m < M; ++m)
    for (int64_t h = 0; h < c.hkv; ++h)
      for (int64_t s = 0; s < S; ++s)
        for (int64_t e = 0; e < D; ++e) {
          const int64_t at = ((m * c.hkv + h) * S + s) * D + e;
          const bool written = s == pos_values[m];
          ASSERT_EQ(kc.get(at / D, e), written ? y.get(m, c.hq * D + h * D + e) : kc0[at]) << "k m" << m << " h" << h << " s" << s;
          ASSERT_EQ(vc.get(at / D, e), written ? y.get(m, qk + h * D + e) : vc0[at]) << "v m" << m << " h" << h << " s" << s;
        }
  if (c.advance) {
    EXPECT_EQ(length.current(0), start + 1);
    if (c.gpu) EXPECT_EQ(counter.current(0), 0);
    Tensor y2(c.dtype, {M, N}, c.gpu);  // again: the next slot, the counter moved once more
    call(y2, rope);
    kc.download();
    EXPECT_EQ(length.current(0), start + 2);
    if (c.gpu) EXPECT_EQ(counter.current(0), 0);
    y2.download();
    for (int64_t e = 0; e < D; ++e) EXPECT_EQ(kc.get(start + 1, e), y2.get(0, c.hq * D + e));  // (m 0, head 0)
  }
  // GPU: bitwise what skinny_gemm and rope_write_kv_cache give at the same split (out; the caches
  // hold out's k and v, checked above)
  if (c.gpu) {
    Tensor y1(c.dtype, {M, N}, c.gpu);
    // (the fused call ran on the deep kernel; under LLMK_GEMM_KERNEL=tma a plain skinny_gemm would
    // take the TMA kernel, whose sums round differently: the reference asks for deep; env clears it)
    if (std::string(c.kernel) == "tma") setenv("LLMK_GEMM_KERNEL", "deep", 1);
    llmk::skinny_gemm(y1.view(), x.view(), w.view(), c.bias ? b.view() : llmk::TensorView{}, opt);
    Ints fixed({M}, c.advance ? std::vector<int64_t>(M, start) : pos_values, c.gpu);
    llmk::TensorView pos2 = fixed.view();
    pos2.ndim = 2;
    pos2.shape[1] = 1;
    pos2.strides[1] = 1;
    llmk::TensorView cos3 = cos_v, sin3 = sin_v;
    for (llmk::TensorView* v : {&cos3, &sin3}) {
      v->ndim = 3;
      v->shape[2] = half, v->strides[2] = 1;
      v->shape[1] = 1, v->strides[1] = v->strides[0];
    }
    Tensor kc1(c.dtype, {M, c.hkv, S, D}, c.gpu), vc1(c.dtype, {M, c.hkv, S, D}, c.gpu);
    const llmk::TensorView q1 = head_view(y1, 0, c.hq, D), k1 = head_view(y1, c.hq * D, c.hkv, D);
    llmk::rope_write_kv_cache(q1, k1, kc1.view(), vc1.view(), q1, k1, head_view(y1, qk, c.hkv, D), cos3, sin3, pos2);
    y1.download();
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = 0; n < N; ++n) ASSERT_EQ(y.get(m, n), y1.get(m, n)) << "m" << m << " n" << n;
  }
}

INSTANTIATE_TEST_SUITE_P(GemmRopeKv, GemmRopeKvTest, testing::ValuesIn(rope_cases()), rope_case_name);

TEST(GemmRopeKvTest, BadInput) {
  using llmk_test::error_of;
  const int64_t M = 2, K = 64, D = 16;
  Tensor x(DType::f32, {M, K}, false), w(DType::f32, {(3 + 2) * D, K}, false), y(DType::f32, {M, 5 * D}, false);
  Tensor kc(DType::f32, {M, 1, 8, D}, false), vc(DType::f32, {M, 1, 8, D}, false), kc3(DType::f32, {3, 1, 8, D}, false);
  Tensor cs(DType::f32, {M, D / 2}, false), sn(DType::f32, {M, D / 2}, false), cs16(DType::f16, {M, D / 2}, false);
  Tensor kc_odd(DType::f32, {M, 1, 8, 15}, false), fpos(DType::f32, {M}, false);
  Ints pos({M}, {0, 1}, false), pos3({3}, {0, 1, 2}, false), len({2}, {0, 0}, false);
  const auto run = [&](auto&& edit, llmk::GemmOptions opt = {}) {
    llmk::GemmRopeKv r;
    r.q_heads = 3;
    r.cos = cs.view();
    r.sin = sn.view();
    r.positions = pos.view();
    r.k_cache = kc.view();
    r.v_cache = vc.view();
    edit(r);
    return error_of([&] { llmk::skinny_gemm_rope_kv(y.view(), x.view(), w.view(), {}, r, opt); });
  };
  EXPECT_EQ(run([](llmk::GemmRopeKv&) {}), "<no error>");
  EXPECT_EQ(run([](llmk::GemmRopeKv& r) { r.q_heads = 2; }),
            "llmk::skinny_gemm_rope_kv: weight: expected (q_heads + 2 * kv_heads) * head_dim = 64 rows ([q; k; v]), got "
            "shape 80 rows");
  EXPECT_EQ(run([](llmk::GemmRopeKv& r) { r.q_heads = 0; }), "llmk::skinny_gemm_rope_kv: q_heads: expected at least 1, got 0");
  EXPECT_EQ(run([&](llmk::GemmRopeKv& r) { r.k_cache = kc3.view(); }),
            "llmk::skinny_gemm_rope_kv: v_cache: expected shape (3, 1, 8, 16) (the shape of k_cache), got (2, 1, 8, 16)");
  EXPECT_EQ(run([&](llmk::GemmRopeKv& r) { r.k_cache = kc3.view(), r.v_cache = kc3.view(); }),
            "llmk::skinny_gemm_rope_kv: k_cache: expected 2 sequences (the rows of x), got shape (3, 1, 8, 16)");
  EXPECT_EQ(run([&](llmk::GemmRopeKv& r) { r.k_cache = kc_odd.view(), r.v_cache = kc_odd.view(); }),
            "llmk::skinny_gemm_rope_kv: k_cache: expected an even head dim of at least 2 (rotate-half pairs), got "
            "shape (2, 1, 8, 15)");
  EXPECT_EQ(run([&](llmk::GemmRopeKv& r) { r.cos = cs16.view(); }),
            "llmk::skinny_gemm_rope_kv: cos: expected dtype float32 (the dtype of x), got float16");
  EXPECT_EQ(run([&](llmk::GemmRopeKv& r) { r.sin = kc.view(); }),
            "llmk::skinny_gemm_rope_kv: sin: expected 2 dims, got 4 dims with shape (2, 1, 8, 16)");
  EXPECT_EQ(run([&](llmk::GemmRopeKv& r) { r.positions = pos3.view(); }),
            "llmk::skinny_gemm_rope_kv: positions: expected shape (2) (the rows of x), got (3)");
  EXPECT_EQ(run([&](llmk::GemmRopeKv& r) { r.positions = fpos.view(); }),
            "llmk::skinny_gemm_rope_kv: positions: expected dtype int32 or int64, got float32");
  EXPECT_EQ(run([&](llmk::GemmRopeKv& r) { r.advance = len.view(); }),
            "llmk::skinny_gemm_rope_kv: advance: expected one element (a length counter), got shape (2)");
  llmk::GemmOptions swiglu;
  swiglu.activation = GemmActivation::swiglu;
  EXPECT_EQ(run([](llmk::GemmRopeKv&) {}, swiglu), "llmk::skinny_gemm_rope_kv: activation: expected none, got swiglu");
  llmk::GemmOptions residual;
  residual.residual = y.view();
  EXPECT_EQ(run([](llmk::GemmRopeKv&) {}, residual),
            "llmk::skinny_gemm_rope_kv: residual: expected none (the epilogue is RoPE's)");
  // a position past the cache: an error on the CPU (rope_write_kv_cache's)
  Ints far({M}, {0, 8}, false);
  EXPECT_NE(run([&](llmk::GemmRopeKv& r) { r.positions = far.view(); }), "<no error>");
}

// No rows: nothing written, but the length advances, as rope_write_kv_cache's does (CPU and GPU).
// The length's advance with blocks in several waves, call after call: a block that read the length
// after another had advanced it would write its k and v one slot on (the ticket's order rests on
// the hardware: rope_positions in src/gemm/gemm_gpu.cu). 48 calls back to back on one stream, 800
// blocks of 8 warps (sk 1; two waves or more on a 132-SM GPU), then every slot of every head
// checked: the same x, weights and angles give each call's slot the same k and v.
TEST(GemmRopeKvTest, ManyBlocksAdvanceOnceACall) {
  SKIP_WITHOUT_GPU(true);
  const DType dt = DType::bf16;
  const int64_t hq = 1200, hkv = 200, D = 64, K = 64, N = (hq + 2 * hkv) * D, S = 64, start = 3, calls = 48;
  Tensor x(dt, {1, K}, true), w(dt, {N, K}, true), y(dt, {1, N}, true);
  Tensor kc(dt, {1, hkv, S, D}, true), vc(dt, {1, hkv, S, D}, true), cs(dt, {1, D / 2}, true), sn(dt, {1, D / 2}, true);
  for (Tensor* t : {&x, &w, &kc, &vc, &cs, &sn}) t->fill_random(-1, 1);
  y.poison();
  std::vector<double> k0(hkv * S * D), v0(k0.size());
  for (int64_t i = 0; i < static_cast<int64_t>(k0.size()); ++i) k0[i] = kc.get(i / D, i % D), v0[i] = vc.get(i / D, i % D);
  Ints length({1}, {start}, true), counter({1}, {0}, true);
  llmk::GemmRopeKv r;
  r.q_heads = hq;
  r.cos = cs.view();
  r.sin = sn.view();
  r.positions = length.view();  // (1): the one row's position is the length, as in Hugging Face's cache
  r.k_cache = kc.view();
  r.v_cache = vc.view();
  r.advance = length.view();
  r.counter = counter.view();
  const GemmEnv env("deep", 1);
  const int64_t launches = llmk::detail::skinny_gemm_rope_kv_launches();
  for (int64_t i = 0; i < calls; ++i) llmk::skinny_gemm_rope_kv(y.view(), x.view(), w.view(), {}, r);
  EXPECT_EQ(llmk::detail::skinny_gemm_rope_kv_launches() - launches, calls);
  EXPECT_EQ(length.current(0), start + calls);
  EXPECT_EQ(counter.current(0), 0);
  y.download();
  kc.download();
  vc.download();
  for (int64_t h = 0; h < hkv; ++h)
    for (int64_t slot = 0; slot < S; ++slot) {
      const bool written = slot >= start && slot < start + calls;
      for (int64_t e = 0; e < D; ++e) {
        const int64_t at = (h * S + slot) * D + e;
        ASSERT_EQ(kc.get(at / D, e), written ? y.get(0, (hq + h) * D + e) : k0[at]) << "k h" << h << " slot " << slot;
        ASSERT_EQ(vc.get(at / D, e), written ? y.get(0, (hq + hkv + h) * D + e) : v0[at]) << "v h" << h << " slot " << slot;
      }
    }
}

TEST(GemmRopeKvTest, NoRowsStillAdvances) {
  for (bool gpu : {false, true}) {
    if (gpu && llmk_test::gpu_count() == 0) continue;
    const DType dt = gpu ? DType::bf16 : DType::f32;
    Tensor x(dt, {0, 64}, gpu), w(dt, {4 * 16, 64}, gpu), y(dt, {0, 4 * 16}, gpu);
    Tensor kc(dt, {0, 1, 8, 16}, gpu), vc(dt, {0, 1, 8, 16}, gpu), cs(dt, {0, 8}, gpu);
    Ints pos({0}, {}, gpu), len({1}, {5}, gpu, true), counter({1}, {0}, gpu);
    llmk::GemmRopeKv r;
    r.q_heads = 2;
    r.cos = r.sin = cs.view();
    r.positions = pos.view();
    r.k_cache = kc.view();
    r.v_cache = vc.view();
    r.advance = len.view();
    r.counter = counter.view();
    EXPECT_EQ(llmk_test::error_of([&] { llmk::skinny_gemm_rope_kv(y.view(), x.view(), w.view(), {}, r); }), "<no error>");
    EXPECT_EQ(len.current(0), 6) << (gpu ? "gpu" : "cpu");
  }
}

// LLMK_GEMM_PDL_LATE as deep_pdl_late reads it (host code: the GPU test in
// tests/python/test_decode.py checks that every placement keeps the bits).
TEST(SkinnyGemmPdlTrigger, SettingsRolesAndWaves) {
  using llmk::detail::deep_pdl_late;
  for (const char* role : {"rope", "gated", "plain"})
    for (bool one_wave : {false, true})
      for (bool wide : {false, true}) {
        if (wide && !one_wave) continue;  // (16-warp plans are one wave by construction)
        const std::string at = std::string(role) + (one_wave ? ", one wave" : ", several waves") +
                               (wide ? ", 16-warp blocks" : "");
        const auto late = [&](const char* setting) { return deep_pdl_late(setting, role, one_wave, wide); };
        // unset: as early:gated+wide
        EXPECT_EQ(late(""), !(one_wave && std::string(role) == "gated") && !wide) << at;
        EXPECT_TRUE(late("1")) << at;
        EXPECT_FALSE(late("0")) << at;
        EXPECT_EQ(late("wave"), !one_wave) << at;
        EXPECT_EQ(late("wide"), !wide) << at;
        EXPECT_EQ(late("early:gated"), !(one_wave && std::string(role) == "gated")) << at;
        EXPECT_EQ(late("early:rope,plain"), !(one_wave && std::string(role) != "gated")) << at;
        EXPECT_EQ(late("early:plain,gated,rope"), !one_wave) << at;
        // "+": at the start where any part puts it
        EXPECT_EQ(late("early:gated+wide"), !(one_wave && std::string(role) == "gated") && !wide) << at;
        EXPECT_EQ(late("wide+early:gated"), late("early:gated+wide")) << at;
        EXPECT_EQ(late("1+early:rope"), late("early:rope")) << at;
        EXPECT_FALSE(late("1+0")) << at;
      }
  for (const char* bad : {"late", "2", "early", "early:", "early:head", "early:plain,", "early:,plain", "early:Plain",
                          "Wide", "early:wide", "+", "wide+", "+wide", "wide++early:gated", "early:gated+head",
                          "early:gated,wide"})
    EXPECT_NE(llmk_test::error_of([&] { deep_pdl_late(bad, "plain", true, true); })
                  .find("LLMK_GEMM_PDL_LATE: expected"),
              std::string::npos)
        << bad;
}

// How LLMK_GEMM_KERNEL=tma@SHAPES's list is read (gemm/kernel_setting.h); the GPU test above checks
// the kernel each shape then gets.
TEST(SkinnyGemmKernelSetting, TmaAtShapeList) {
  using llmk::detail::gemm_shape_listed;
  const auto listed = [](const char* shapes, int64_t k, int64_t n) { return gemm_shape_listed(shapes, shapes, k, n); };
  EXPECT_TRUE(listed("4096x14336", 4096, 14336));
  EXPECT_FALSE(listed("4096x14336", 14336, 4096));  // K first, then N
  EXPECT_TRUE(listed("4096x14336+14336x4096", 14336, 4096));
  EXPECT_TRUE(listed("1x1+4096x28672+8x8", 4096, 28672));
  EXPECT_FALSE(listed("4096x28672", 4096, 14336));
  EXPECT_FALSE(listed("4096x1433", 4096, 14336));
  for (const char* bad : {"", "+", "4096", "4096x", "x4096", "4096x14336+", "+4096x14336", "4096x14336++1x1", "0x5",
                          "-1x5", "4096X14336", "4096x14336x1", "4096 x14336", "4096x1e3", "tma@4096x14336", "4096x14336,14336x4096"})
    EXPECT_NE(llmk_test::error_of([&] { gemm_shape_listed(bad, bad, 4096, 14336); })
                  .find("LLMK_GEMM_KERNEL: expected tma@ followed by KxN weight shapes joined by +"),
              std::string::npos)
        << "'" << bad << "'";
}


// How LLMK_GEMM_TMA_ROWS is read (gemm/kernel_setting.h), and the whole-integer reading under it and
// the other numeric switches (core/text_parts.h).
TEST(SkinnyGemmKernelSetting, TmaRows) {
  using llmk::detail::gemm_tma_rows;
  EXPECT_EQ(gemm_tma_rows(nullptr), 1);
  EXPECT_EQ(gemm_tma_rows(""), 1);
  EXPECT_EQ(gemm_tma_rows("1"), 1);
  EXPECT_EQ(gemm_tma_rows("8"), 8);
  EXPECT_EQ(gemm_tma_rows("16"), 16);
  for (const char* bad : {"0", "17", "-1", "8x", "x", " 8", "+8", "8 ", "1e1", "99999999999999999999"})
    EXPECT_EQ(llmk_test::error_of([&] { gemm_tma_rows(bad); }),
              std::string("llmk::skinny_gemm: LLMK_GEMM_TMA_ROWS: expected a row count from 1 to 16, got '") + bad + "'")
        << "'" << bad << "'";
}

TEST(SkinnyGemmKernelSetting, WholeInteger) {
  using llmk::detail::whole_integer;
  EXPECT_EQ(whole_integer("0"), 0);
  EXPECT_EQ(whole_integer("42"), 42);
  EXPECT_EQ(whole_integer("-7"), -7);
  EXPECT_EQ(whole_integer("9223372036854775807"), INT64_MAX);
  for (const char* bad : {"", "-", "+1", " 1", "1 ", "1x", "0x10", "1.0", "9223372036854775808"})
    EXPECT_FALSE(whole_integer(bad).has_value()) << "'" << bad << "'";
}

}  // namespace
