// RoPE vs a float64 reference: both styles, partial rotary dims, GQA head counts, the (B, H, S, D)
// layout through strides, the cache and the per-token forms, in place, and the inverse rotation.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "llmk/rope.h"
#include "support/tensors.h"
#include "support/testing.h"

using llmk::DType;
using llmk::RopeStyle;
using llmk_test::Tensor;

namespace {

struct Case {
  bool gpu;
  DType dtype;
  RopeStyle style;
  int64_t batch, seq, hq, hk, head_dim, rot_dim;
  bool bhsd;     // q/k stored as (B, H, S, D), passed as transposed views
  bool cached;   // cos_sin_cache + positions, else per-token cos/sin
  bool in_place;
};

std::string case_name(const testing::TestParamInfo<Case>& info) {
  const Case& c = info.param;
  return std::string(c.gpu ? "gpu_" : "cpu_") + llmk::dtype_name(c.dtype) + "_" +
         llmk::rope_style_name(c.style) + "_b" + std::to_string(c.batch) + "s" + std::to_string(c.seq) +
         "q" + std::to_string(c.hq) + "k" + std::to_string(c.hk) + "d" + std::to_string(c.head_dim) +
         "r" + std::to_string(c.rot_dim) + (c.bhsd ? "_bhsd" : "_bshd") + (c.cached ? "_cache" : "_cossin") +
         (c.in_place ? "_inplace" : "");
}

std::vector<Case> cases() {
  std::vector<Case> out;
  for (bool gpu : {false, true})
    for (DType dt : {DType::f32, DType::f16, DType::bf16})
      for (RopeStyle st : {RopeStyle::neox, RopeStyle::gptj}) {
        out.push_back({gpu, dt, st, 2, 7, 4, 2, 64, 64, false, true, false});
        out.push_back({gpu, dt, st, 1, 33, 8, 1, 128, 64, true, true, true});     // partial, MQA
        out.push_back({gpu, dt, st, 3, 5, 6, 6, 80, 80, true, false, false});
        out.push_back({gpu, dt, st, 2, 3, 32, 8, 96, 32, false, false, true});
        out.push_back({gpu, dt, st, 1, 1, 2, 2, 256, 256, false, true, false});
      }
  return out;
}

// A (B, S, H, D) view of a tensor stored as (B, S, H, D) or (B, H, S, D).
llmk::TensorView bshd_view(const Tensor& t, bool bhsd) {
  llmk::TensorView v = t.view();
  if (bhsd) {  // stored (B, H, S, D): swap dims 1 and 2
    std::swap(v.shape[1], v.shape[2]);
    std::swap(v.strides[1], v.strides[2]);
  }
  return v;
}

std::vector<int64_t> stored_shape(const Case& c, int64_t heads) {
  return c.bhsd ? std::vector<int64_t>{c.batch, heads, c.seq, c.head_dim}
                : std::vector<int64_t>{c.batch, c.seq, heads, c.head_dim};
}

// Element (b, s, h, d) of a stored tensor, as a flat row/col for Tensor::get.
double at(const Tensor& t, const Case& c, int64_t heads, int64_t b, int64_t s, int64_t h, int64_t d) {
  const int64_t row = c.bhsd ? (b * heads + h) * c.seq + s : (b * c.seq + s) * heads + h;
  return t.get(row, d);
}

class RopeTest : public testing::TestWithParam<Case> {};

TEST_P(RopeTest, MatchesFloat64AndInverts) {
  const Case& c = GetParam();
  SKIP_WITHOUT_GPU(c.gpu);
  const int64_t half = c.rot_dim / 2, positions_count = 50;
  Tensor q(c.dtype, stored_shape(c, c.hq), c.gpu), k(c.dtype, stored_shape(c, c.hk), c.gpu);
  q.fill_random();
  k.fill_random();
  Tensor q_out(c.dtype, stored_shape(c, c.hq), c.gpu), k_out(c.dtype, stored_shape(c, c.hk), c.gpu);
  q_out.poison();
  k_out.poison();
  // Angles: theta(pos, i) = pos * 10000^(-2i / rot_dim); positions shuffled per token.
  std::vector<int64_t> pos(c.batch * c.seq);
  for (size_t t = 0; t < pos.size(); ++t) pos[t] = (t * 17 + 3) % positions_count;
  auto theta = [&](int64_t p, int64_t i) { return p * std::pow(10000.0, -2.0 * i / c.rot_dim); };
  Tensor cache(DType::f32, {positions_count, c.rot_dim}, c.gpu);
  Tensor positions(DType::f32, {c.batch, c.seq * 2}, c.gpu);  // int64 storage: 2 floats a value
  Tensor cos(c.dtype, {c.batch, c.seq, half}, c.gpu), sin(c.dtype, {c.batch, c.seq, half}, c.gpu);
  for (int64_t p = 0; p < positions_count; ++p)
    for (int64_t i = 0; i < half; ++i) {
      cache.set(p, i, std::cos(theta(p, i)));
      cache.set(p, half + i, std::sin(theta(p, i)));
    }
  cache.upload();
  for (int64_t t = 0; t < c.batch * c.seq; ++t)
    for (int64_t i = 0; i < half; ++i) {
      cos.set(t, i, std::cos(theta(pos[t], i)));
      sin.set(t, i, std::sin(theta(pos[t], i)));
    }
  cos.upload();
  sin.upload();
  llmk::TensorView pv = positions.view();
  pv.dtype = DType::i64;
  pv.shape[1] = c.seq;
  pv.strides[0] = c.seq;
  {
    std::vector<int64_t> host(pos);
    Tensor& raw = positions;  // write the int64 values through the float storage
    for (size_t t = 0; t < host.size(); ++t) {
      float two[2];
      std::memcpy(two, &host[t], 8);
      raw.set(t / c.seq, 2 * (t % c.seq), two[0]);
      raw.set(t / c.seq, 2 * (t % c.seq) + 1, two[1]);
    }
    raw.upload();
  }
  const llmk::TensorView qi = bshd_view(q, c.bhsd), ki = bshd_view(k, c.bhsd);
  const llmk::TensorView qo = c.in_place ? qi : bshd_view(q_out, c.bhsd);
  const llmk::TensorView ko = c.in_place ? ki : bshd_view(k_out, c.bhsd);
  // float64 expectations from the inputs as stored, before an in-place call overwrites them
  std::vector<double> want_q, want_k;
  auto expect = [&](const Tensor& t, int64_t heads, std::vector<double>& want) {
    for (int64_t b = 0; b < c.batch; ++b)
      for (int64_t s = 0; s < c.seq; ++s)
        for (int64_t h = 0; h < heads; ++h)
          for (int64_t d = 0; d < c.head_dim; ++d) {
            double v = at(t, c, heads, b, s, h, d);
            if (d < c.rot_dim) {
              const int64_t i = c.style == RopeStyle::neox ? d % half : d / 2;
              const bool first = c.style == RopeStyle::neox ? d < half : d % 2 == 0;
              const int64_t partner = c.style == RopeStyle::neox ? (first ? d + half : d - half) : (first ? d + 1 : d - 1);
              // angles as the kernel sees them (rounded to the angle dtype)
              const double cs = c.cached ? static_cast<float>(std::cos(theta(pos[b * c.seq + s], i)))
                                         : cos.get(b * c.seq + s, i);
              const double sn = c.cached ? static_cast<float>(std::sin(theta(pos[b * c.seq + s], i)))
                                         : sin.get(b * c.seq + s, i);
              const double x = v, y = at(t, c, heads, b, s, h, partner);
              v = first ? x * cs - y * sn : x * cs + y * sn;
            }
            want.push_back(v);
          }
  };
  expect(q, c.hq, want_q);
  expect(k, c.hk, want_k);
  if (c.cached)
    llmk::rope_cached(qo, ko, qi, ki, cache.view(), pv, c.style, false);
  else
    llmk::rope_cos_sin(qo, ko, qi, ki, cos.view(), sin.view(), c.style, false);
  Tensor& q_res = c.in_place ? q : q_out;
  Tensor& k_res = c.in_place ? k : k_out;
  q_res.download();
  k_res.download();
  auto compare = [&](const Tensor& t, int64_t heads, const std::vector<double>& want) {
    double num = 0, den = 0;
    size_t n = 0;
    for (int64_t b = 0; b < c.batch; ++b)
      for (int64_t s = 0; s < c.seq; ++s)
        for (int64_t h = 0; h < heads; ++h)
          for (int64_t d = 0; d < c.head_dim; ++d, ++n) {
            const double got = at(t, c, heads, b, s, h, d);
            if (!std::isfinite(got)) return std::numeric_limits<double>::infinity();
            num += (got - want[n]) * (got - want[n]);
            den += want[n] * want[n];
          }
    return std::sqrt(num / den);
  };
  EXPECT_LT(compare(q_res, c.hq, want_q), llmk_test::tolerance(c.dtype));
  EXPECT_LT(compare(k_res, c.hk, want_k), llmk_test::tolerance(c.dtype));

  // The inverse rotation brings the rotated values back (up to the rounding of two passes).
  Tensor q_back(c.dtype, stored_shape(c, c.hq), c.gpu), k_back(c.dtype, stored_shape(c, c.hk), c.gpu);
  q_back.poison();
  k_back.poison();
  llmk::rope_cached(bshd_view(q_back, c.bhsd), bshd_view(k_back, c.bhsd), c.in_place ? qi : qo,
                    c.in_place ? ki : ko, cache.view(), pv, c.style, true);
  q_back.download();
  k_back.download();
  // Rotating the stored result back by the float32 cache angles: compare with the rotation of
  // want by -theta in float64, which is the original input up to the result's rounding.
  double num = 0, den = 0;
  size_t n = 0;
  for (int64_t b = 0; b < c.batch; ++b)
    for (int64_t s = 0; s < c.seq; ++s)
      for (int64_t h = 0; h < c.hq; ++h)
        for (int64_t d = 0; d < c.head_dim; ++d, ++n) {
          const double got = at(q_back, c, c.hq, b, s, h, d);
          const double orig = c.in_place ? 0 : at(q, c, c.hq, b, s, h, d);
          if (c.in_place) continue;  // q was overwritten: covered by the out-of-place cases
          num += (got - orig) * (got - orig);
          den += orig * orig;
        }
  if (!c.in_place) EXPECT_LT(std::sqrt(num / den), 3 * llmk_test::tolerance(c.dtype));
}

INSTANTIATE_TEST_SUITE_P(All, RopeTest, testing::ValuesIn(cases()), case_name);

TEST(RopeErrors, NameOpArgumentExpectedAndGot) {
  using llmk_test::error_of;
  Tensor q(DType::bf16, {1, 4, 2, 64}, false), k(DType::bf16, {1, 4, 1, 64}, false);
  Tensor cache(DType::f32, {8, 64}, false), odd_cache(DType::f32, {8, 66}, false);
  Tensor pos(DType::f32, {1, 8}, false);  // int64 storage for (1, 4)
  llmk::TensorView pv = pos.view();
  pv.dtype = DType::i64;
  pv.shape[1] = 4;
  pv.strides[0] = 4;
  std::vector<int64_t> values = {0, 1, 2, 9};  // 9 is outside the 8-row cache
  for (int t = 0; t < 4; ++t) {
    float two[2];
    std::memcpy(two, &values[t], 8);
    pos.set(0, 2 * t, two[0]);
    pos.set(0, 2 * t + 1, two[1]);
  }
  EXPECT_EQ(error_of([&] { llmk::rope_cached(q.view(), k.view(), q.view(), k.view(), cache.view(), pv, RopeStyle::neox, false); }),
            "llmk::rope: positions: expected values in [0, 8) (the rows of cos_sin_cache), got 9 at (0, 3)");
  EXPECT_EQ(error_of([&] { llmk::rope_cached(q.view(), k.view(), q.view(), k.view(), odd_cache.view(), pv, RopeStyle::neox, false); }),
            "llmk::rope: cos_sin_cache: expected an even rotary dim between 2 and the head dim 64, got 66");
  Tensor k_bad(DType::bf16, {1, 3, 1, 64}, false);
  EXPECT_EQ(error_of([&] { llmk::rope_cached(q.view(), k_bad.view(), q.view(), k_bad.view(), cache.view(), pv, RopeStyle::gptj, false); }),
            "llmk::rope: k: expected shape (1, 4, heads, 64) (batch, tokens and head dim of q), got (1, 3, 1, 64)");
  Tensor k_f16(DType::f16, {1, 4, 1, 64}, false);
  EXPECT_EQ(error_of([&] { llmk::rope_cached(q.view(), k_f16.view(), q.view(), k_f16.view(), cache.view(), pv, RopeStyle::neox, false); }),
            "llmk::rope: k: expected dtype bfloat16 (the dtype of q), got float16");
  llmk::TensorView pf = pv;
  pf.dtype = DType::f32;
  EXPECT_EQ(error_of([&] { llmk::rope_cached(q.view(), k.view(), q.view(), k.view(), cache.view(), pf, RopeStyle::neox, false); }),
            "llmk::rope: positions: expected dtype int64 or int32, got float32");
}

// rope_angles against float64: cos / sin of the fp32 angle float(pos) * inv_freq[i] (the op's
// definition, HF's product), scaled, in every output dtype, half and full (duplicated) widths,
// int32 and int64 positions past any table, rows with padding that must stay untouched.
struct AnglesCase {
  bool gpu;
  DType dtype;
  bool duplicated;  // width 2 F (HF's cat((freqs, freqs), -1)), else F
  bool int64_positions;
  int64_t batch, seq, freqs;
  double scaling;
};

class RopeAnglesTest : public testing::TestWithParam<AnglesCase> {};

TEST_P(RopeAnglesTest, MatchesFloat64) {
  const AnglesCase& c = GetParam();
  SKIP_WITHOUT_GPU(c.gpu);
  const int64_t width = c.duplicated ? 2 * c.freqs : c.freqs, pad = 3, tokens = c.batch * c.seq;
  Tensor inv_freq(DType::f32, {c.freqs}, c.gpu);
  for (int64_t i = 0; i < c.freqs; ++i) inv_freq.set(0, i, std::pow(10000.0, -2.0 * i / (2 * c.freqs)));
  inv_freq.upload();
  // positions: int64 through two floats a value, int32 through one (bit copies)
  const int per = c.int64_positions ? 2 : 1;
  Tensor positions(DType::f32, {c.batch, c.seq * per}, c.gpu);
  std::vector<int64_t> pos(tokens);
  for (int64_t t = 0; t < tokens; ++t) {
    pos[t] = (t * 7919 + 13) % 200003;  // up to ~2e5: past any cos/sin table a model would keep
    float two[2] = {0, 0};
    if (c.int64_positions) std::memcpy(two, &pos[t], 8);
    else { const int32_t v = static_cast<int32_t>(pos[t]); std::memcpy(two, &v, 4); }
    for (int j = 0; j < per; ++j) positions.set(t / c.seq, per * (t % c.seq) + j, two[j]);
  }
  positions.upload();
  llmk::TensorView pv = positions.view();
  pv.dtype = c.int64_positions ? DType::i64 : DType::i32;
  pv.shape[1] = c.seq;
  pv.strides[0] = c.seq;
  Tensor cos(c.dtype, {c.batch, c.seq, width}, c.gpu, width + pad), sin(c.dtype, {c.batch, c.seq, width}, c.gpu, width + pad);
  cos.fill(7.0);  // the padding must keep this
  sin.fill(7.0);
  for (Tensor* t : {&cos, &sin}) {
    for (int64_t r = 0; r < tokens; ++r)
      for (int64_t d = 0; d < width; ++d) t->set(r, d, std::numeric_limits<double>::quiet_NaN());
    t->upload();
  }
  llmk::rope_angles(cos.view(), sin.view(), inv_freq.view(), pv, static_cast<float>(c.scaling));
  cos.download();
  sin.download();
  std::vector<double> want_cos, want_sin;
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t d = 0; d < width; ++d) {
      const float a = static_cast<float>(pos[t]) * static_cast<float>(inv_freq.get(0, d % c.freqs));
      want_cos.push_back(std::cos(static_cast<double>(a)) * c.scaling);
      want_sin.push_back(std::sin(static_cast<double>(a)) * c.scaling);
    }
  EXPECT_LT(llmk_test::relative_error(cos, want_cos), llmk_test::tolerance(c.dtype));
  EXPECT_LT(llmk_test::relative_error(sin, want_sin), llmk_test::tolerance(c.dtype));
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t d = 0; d < c.freqs && c.duplicated; ++d) {  // the two halves are one rounding
      EXPECT_EQ(cos.get(t, d), cos.get(t, c.freqs + d));
      EXPECT_EQ(sin.get(t, d), sin.get(t, c.freqs + d));
    }
  for (Tensor* t : {&cos, &sin})
    for (int64_t r = 0; r + 1 < tokens; ++r)
      for (int64_t j = 0; j < pad; ++j) EXPECT_EQ(t->get(r, width + j), 7.0) << "padding written, row " << r;
}

std::vector<AnglesCase> angles_cases() {
  std::vector<AnglesCase> out;
  for (bool gpu : {false, true})
    for (DType dt : {DType::f32, DType::f16, DType::bf16}) {
      out.push_back({gpu, dt, true, true, 2, 5, 32, 1.0});
      out.push_back({gpu, dt, false, false, 3, 7, 3, 0.7});
      out.push_back({gpu, dt, true, false, 1, 1, 64, 1.2});
      out.push_back({gpu, dt, false, true, 1, 333, 40, 1.0});
    }
  return out;
}

std::string angles_case_name(const testing::TestParamInfo<AnglesCase>& info) {
  const AnglesCase& c = info.param;
  return std::string(c.gpu ? "gpu_" : "cpu_") + llmk::dtype_name(c.dtype) + (c.duplicated ? "_full" : "_half") +
         (c.int64_positions ? "_i64" : "_i32") + "_b" + std::to_string(c.batch) + "s" + std::to_string(c.seq) + "f" +
         std::to_string(c.freqs) + (c.scaling == 1.0 ? "" : "_scaled");
}

INSTANTIATE_TEST_SUITE_P(All, RopeAnglesTest, testing::ValuesIn(angles_cases()), angles_case_name);

TEST(RopeAnglesErrors, NameOpArgumentExpectedAndGot) {
  using llmk_test::error_of;
  Tensor inv_freq(DType::f32, {8}, false), inv_bf16(DType::bf16, {8}, false);
  Tensor cos(DType::bf16, {1, 4, 16}, false), sin(DType::bf16, {1, 4, 16}, false), odd(DType::bf16, {1, 4, 12}, false);
  Tensor sin_f16(DType::f16, {1, 4, 16}, false);
  Tensor pos(DType::f32, {1, 4}, false);
  llmk::TensorView pv = pos.view();
  pv.dtype = DType::i32;
  EXPECT_EQ(error_of([&] { llmk::rope_angles(odd.view(), odd.view(), inv_freq.view(), pv, 1.f); }),
            "llmk::rope_angles: cos_out: expected a last dim of 8 or 16 (the frequencies of inv_freq, once or twice), got (1, 4, 12)");
  EXPECT_EQ(error_of([&] { llmk::rope_angles(cos.view(), sin.view(), inv_bf16.view(), pv, 1.f); }),
            "llmk::rope_angles: inv_freq: expected dtype float32, got bfloat16");
  EXPECT_EQ(error_of([&] { llmk::rope_angles(cos.view(), sin_f16.view(), inv_freq.view(), pv, 1.f); }),
            "llmk::rope_angles: sin_out: expected dtype bfloat16 (the dtype of cos_out), got float16");
  EXPECT_EQ(error_of([&] { llmk::rope_angles(cos.view(), cos.view(), inv_freq.view(), pv, 1.f); }),
            "llmk::rope_angles: cos_out, sin_out: expected memory that overlaps no other argument");
  llmk::TensorView short_pos = pv;
  short_pos.shape[1] = 3;
  EXPECT_EQ(error_of([&] { llmk::rope_angles(cos.view(), sin.view(), inv_freq.view(), short_pos, 1.f); }),
            "llmk::rope_angles: positions: expected shape (1, 4) (batch and tokens of cos_out), got (1, 3)");
  llmk::TensorView fpos = pos.view();
  EXPECT_EQ(error_of([&] { llmk::rope_angles(cos.view(), sin.view(), inv_freq.view(), fpos, 1.f); }),
            "llmk::rope_angles: positions: expected dtype int64 or int32, got float32");
  EXPECT_EQ(error_of([&] { llmk::rope_angles(cos.view(), sin.view(), inv_freq.view(), pv, std::nanf("")); }),
            "llmk::rope_angles: scaling: expected a finite number, got nan");
}

}  // namespace
