// Attention (CPU backend) vs a float64 reference that forms the full score matrix.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "llmk/attention.h"
#include "support/tensors.h"
#include "support/testing.h"

using llmk::DType;
using llmk_test::Tensor;

namespace {

struct Case {
  DType dtype;
  int64_t batch, sq, skv, hq, hkv, d;
  bool causal;
  llmk::CausalAlign align;
};

std::string case_name(const testing::TestParamInfo<Case>& info) {
  const Case& c = info.param;
  return std::string(llmk::dtype_name(c.dtype)) + "_b" + std::to_string(c.batch) + "_q" + std::to_string(c.sq) +
         "_kv" + std::to_string(c.skv) + "_h" + std::to_string(c.hq) + "x" + std::to_string(c.hkv) + "_d" +
         std::to_string(c.d) + (c.causal ? (c.align == llmk::CausalAlign::top_left ? "_causal_tl" : "_causal_br") : "");
}

std::vector<Case> cases() {
  std::vector<Case> out;
  for (DType dt : {DType::f32, DType::f16, DType::bf16})
    for (auto [c, al] : {std::pair{false, llmk::CausalAlign::top_left}, {true, llmk::CausalAlign::top_left},
                         {true, llmk::CausalAlign::bottom_right}}) {
      out.push_back({dt, 2, 7, 77, 4, 4, 64, c, al});
      out.push_back({dt, 1, 77, 33, 8, 2, 80, c, al});
      out.push_back({dt, 1, 1, 130, 4, 1, 128, c, al});
    }
  return out;
}

class AttentionTest : public testing::TestWithParam<Case> {};

TEST_P(AttentionTest, MatchesFloat64) {
  const Case& c = GetParam();
  // Stored (B, S, H, D) row-major: row = (b * S + s) * H + h.
  Tensor q(c.dtype, {c.batch, c.sq, c.hq, c.d}, false), k(c.dtype, {c.batch, c.skv, c.hkv, c.d}, false);
  Tensor v(c.dtype, {c.batch, c.skv, c.hkv, c.d}, false), out(c.dtype, {c.batch, c.sq, c.hq, c.d}, false);
  Tensor lse(DType::f32, {c.batch, c.hq, c.sq}, false);
  q.fill_random(-3, 3);
  k.fill_random(-3, 3);
  v.fill_random();
  out.poison();
  lse.poison();
  llmk::AttentionOptions opt;
  opt.causal = c.causal;
  opt.align = c.align;
  llmk::attention(out.view(), lse.view(), q.view(), k.view(), v.view(), opt);
  const double scale = 1.0 / std::sqrt(static_cast<double>(c.d));
  const int64_t offset = c.causal && c.align == llmk::CausalAlign::bottom_right ? c.skv - c.sq : 0;
  std::vector<double> want(c.batch * c.sq * c.hq * c.d, 0.0);
  double lse_err = 0;
  for (int64_t b = 0; b < c.batch; ++b)
    for (int64_t h = 0; h < c.hq; ++h)
      for (int64_t i = 0; i < c.sq; ++i) {
        const int64_t hk = h / (c.hq / c.hkv);
        std::vector<double> s(c.skv, -INFINITY);
        double m = -INFINITY;
        for (int64_t j = 0; j < c.skv; ++j) {
          if (c.causal && j > i + offset) continue;
          double dot = 0;
          for (int64_t d = 0; d < c.d; ++d)
            dot += q.get((b * c.sq + i) * c.hq + h, d) * k.get((b * c.skv + j) * c.hkv + hk, d);
          s[j] = dot * scale;
          m = std::max(m, s[j]);
        }
        double l = 0;
        for (int64_t j = 0; j < c.skv; ++j) l += std::isinf(s[j]) ? 0 : std::exp(s[j] - m);
        const int64_t row = (b * c.sq + i) * c.hq + h;
        for (int64_t j = 0; j < c.skv; ++j) {
          if (std::isinf(s[j])) continue;
          const double w = std::exp(s[j] - m) / l;
          for (int64_t d = 0; d < c.d; ++d) want[row * c.d + d] += w * v.get((b * c.skv + j) * c.hkv + hk, d);
        }
        const double got_lse = lse.get(b * c.hq + h, i);
        if (l == 0) {
          EXPECT_TRUE(std::isinf(got_lse) && got_lse < 0) << "no visible key: lse must be -inf";
        } else {
          lse_err = std::max(lse_err, std::fabs(got_lse - (m + std::log(l))));
        }
      }
  EXPECT_LT(llmk_test::relative_error(out, want), llmk_test::tolerance(c.dtype));
  EXPECT_LT(lse_err, 1e-4);
}

INSTANTIATE_TEST_SUITE_P(Cpu, AttentionTest, testing::ValuesIn(cases()), case_name);

TEST(AttentionErrors, NameOpArgumentExpectedAndGot) {
  using llmk_test::error_of;
  Tensor q(DType::bf16, {1, 5, 4, 64}, false), k(DType::bf16, {1, 5, 3, 64}, false), out(DType::bf16, {1, 5, 4, 64}, false);
  EXPECT_EQ(error_of([&] { llmk::attention(out.view(), {}, q.view(), k.view(), k.view(), {}); }),
            "llmk::attention: k: expected a head count that divides q's 4 heads, got 3");
  Tensor k2(DType::bf16, {1, 5, 2, 32}, false);
  EXPECT_EQ(error_of([&] { llmk::attention(out.view(), {}, q.view(), k2.view(), k2.view(), {}); }),
            "llmk::attention: k: expected shape (1, kv_len, kv_heads, 64) (batch and head dim of q), got (1, 5, 2, 32)");
  llmk::TensorView qg = q.view();
  qg.device = {llmk::DeviceKind::gpu, 0};
  llmk::TensorView og = out.view(), kg = q.view();
  og.device = kg.device = qg.device;
  try {
    llmk::attention(og, {}, qg, kg, kg, {});
    FAIL() << "GPU attention should not be implemented yet";
  } catch (const llmk::Error& e) {
    EXPECT_EQ(e.kind(), llmk::ErrorKind::not_implemented);
  }
}

}  // namespace
