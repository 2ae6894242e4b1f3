// Attention (CPU backend; GPU: the mma.sync kernel and the portable one) vs a float64 reference
// that forms the full score matrix. Outputs and lse are poisoned first; the max abs and relative
// errors are printed per case.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "attention/attention_internal.h"
#include "llmk/attention.h"
#include "support/tensors.h"
#include "support/testing.h"

using llmk::DType;
using llmk_test::Tensor;

namespace {

// mma: the default GPU kernel (tensor cores on NVIDIA: v2, its tiling chosen by grid size);
// mma_long: v2 forced to 128-row blocks (what large problems run; small test shapes would otherwise
// take the 64-row tiling); the portable kernel elsewhere; hopper:
// the sm_90a wgmma kernel (LLMK_ATTENTION_HOPPER=1; these cases skip unless the device is sm_90,
// and fail there when the build lacks sm_90a code).
// hopper_pipe / hopper_wg1: its other tilings (LLMK_ATTENTION_HOPPER_CONFIG=pipe / wg1);
// hopper_ws: the warp-specialised tiling (=ws: TMA producer, mbarrier ring, setmaxnreg; the
// MatchesFloat64 cases also check that it launched rather than fell back to pipe); hopper_ws_pp:
// the same with the consumers' ping-pong schedule (=ws_pp); hopper_ws3 / hopper_ws_pp3: both with
// 192-row blocks of three consumer warpgroups (=ws3 / ws_pp3, D = 64); hopper_ws_pp160 /
// hopper_ws_pp176: ws_pp with 160- and 176-key tiles (D = 128; 176 with one Q buffer).
enum class Path {
  cpu, mma, portable, mma_long, hopper, hopper_pipe, hopper_wg1, hopper_ws, hopper_ws_pp,
  hopper_ws3, hopper_ws_pp3, hopper_ws_pp160, hopper_ws_pp176
};
bool is_ws(Path p) {
  return p == Path::hopper_ws || p == Path::hopper_ws_pp || p == Path::hopper_ws3 || p == Path::hopper_ws_pp3 ||
         p == Path::hopper_ws_pp160 || p == Path::hopper_ws_pp176;
}

struct Case {
  Path path;
  DType dtype;
  int64_t batch, sq, skv, hq, hkv, d;
  bool causal;
  llmk::CausalAlign align;
  bool bhsd = false;        // stored (B, H, S, D), passed as transposed (B, S, H, D) views
  double logit_scale = 1;   // q and k drawn from [-3, 3] * logit_scale
};

const char* path_name(Path p) {
  switch (p) {
    case Path::cpu: return "cpu";
    case Path::mma: return "gpu";
    case Path::portable: return "gpu_portable";
    case Path::mma_long: return "gpu_long";
    case Path::hopper: return "gpu_hopper";
    case Path::hopper_pipe: return "gpu_hopper_pipe";
    case Path::hopper_wg1: return "gpu_hopper_wg1";
    case Path::hopper_ws: return "gpu_hopper_ws";
    case Path::hopper_ws_pp: return "gpu_hopper_ws_pp";
    case Path::hopper_ws3: return "gpu_hopper_ws3";
    case Path::hopper_ws_pp3: return "gpu_hopper_ws_pp3";
    case Path::hopper_ws_pp160: return "gpu_hopper_ws_pp160";
    case Path::hopper_ws_pp176: return "gpu_hopper_ws_pp176";
  }
  return "?";
}

std::string case_name(const testing::TestParamInfo<Case>& info) {
  const Case& c = info.param;
  return std::string(path_name(c.path)) + "_" + llmk::dtype_name(c.dtype) + "_b" + std::to_string(c.batch) +
         "_q" + std::to_string(c.sq) + "_kv" + std::to_string(c.skv) + "_h" + std::to_string(c.hq) + "x" +
         std::to_string(c.hkv) + "_d" + std::to_string(c.d) +
         (c.causal ? (c.align == llmk::CausalAlign::top_left ? "_causal_tl" : "_causal_br") : "") +
         (c.bhsd ? "_bhsd" : "") + (c.logit_scale != 1 ? "_large" : "");
}

constexpr auto kTL = llmk::CausalAlign::top_left;
constexpr auto kBR = llmk::CausalAlign::bottom_right;

std::vector<Case> cases() {
  std::vector<Case> out;
  for (DType dt : {DType::f32, DType::f16, DType::bf16})
    for (auto [c, al] : {std::pair{false, kTL}, {true, kTL}, {true, kBR}}) {
      out.push_back({Path::cpu, dt, 2, 7, 77, 4, 4, 64, c, al});
      out.push_back({Path::cpu, dt, 1, 77, 33, 8, 2, 80, c, al});
      out.push_back({Path::cpu, dt, 1, 1, 130, 4, 1, 128, c, al});
    }
  // The CPU kernel's edges (blocks of 128 queries in register tiles of 2-4, tiles of 64 keys,
  // panels of 16 columns): head dims that are no multiple of 16 (40) or of anything (33), several
  // query blocks and key tiles with the causal diagonal inside them, rows that see no key, logits
  // ~300.
  for (auto [c, al] : {std::pair{false, kTL}, {true, kTL}, {true, kBR}}) {
    out.push_back({Path::cpu, DType::f32, 1, 101, 203, 6, 2, 40, c, al});
    out.push_back({Path::cpu, DType::bf16, 2, 70, 129, 2, 1, 33, c, al, true});
    out.push_back({Path::cpu, DType::f16, 1, 150, 67, 2, 2, 64, c, al, false, 10});
    out.push_back({Path::cpu, DType::f32, 1, 300, 333, 2, 1, 64, c, al});
  }
  // GPU: both kernels, fp16 and bf16, every head dim, GQA 1/4/8/32, Sq != Skv both ways, lengths
  // that are no multiple of any block size, both causal alignments, both layouts.
  for (Path path : {Path::mma, Path::mma_long, Path::portable})
    for (DType dt : {DType::f16, DType::bf16})
      for (auto [c, al] : {std::pair{false, kTL}, {true, kTL}, {true, kBR}}) {
        out.push_back({path, dt, 2, 77, 333, 8, 2, 64, c, al});
        out.push_back({path, dt, 1, 333, 77, 4, 1, 80, c, al, true});
        out.push_back({path, dt, 1, 1, 333, 32, 1, 96, c, al});
        out.push_back({path, dt, 1, 333, 333, 4, 4, 128, c, al, true});
        out.push_back({path, dt, 2, 77, 77, 8, 1, 256, c, al});
        out.push_back({path, dt, 1, 130, 200, 32, 4, 128, c, al});
      }
  for (Path path : {Path::mma, Path::mma_long, Path::portable}) {
    // 4097 x 4097 (slow under compute-sanitizer): one causal alignment per kernel, plus full
    if (path != Path::portable) out.push_back({path, DType::f16, 1, 4097, 4097, 1, 1, 128, true, kTL});
    if (path == Path::mma) out.push_back({path, DType::f16, 1, 4097, 4097, 1, 1, 128, false, kTL});
    if (path == Path::portable) out.push_back({path, DType::f16, 1, 4097, 4097, 1, 1, 128, true, kBR});
    out.push_back({path, DType::bf16, 1, 4097, 1, 2, 1, 64, true, kBR});  // all but the last query see nothing
    out.push_back({path, DType::bf16, 1, 1, 4097, 2, 1, 256, false, kTL});
    out.push_back({path, DType::f16, 1, 200, 333, 4, 2, 128, true, kBR, false, 10});  // logits ~300: exp would overflow without the max
    out.push_back({path, DType::bf16, 1, 200, 333, 4, 2, 64, false, kTL, true, 10});
  }
  // Hopper wgmma kernel (D 64 and 128 only): fp16 and bf16, every causal alignment, GQA 1/4/8,
  // Sq != Skv both ways, single-query rows, both layouts, multi-tile lengths.
  for (DType dt : {DType::f16, DType::bf16})
    for (auto [c, al] : {std::pair{false, kTL}, {true, kTL}, {true, kBR}}) {
      out.push_back({Path::hopper, dt, 2, 77, 333, 8, 2, 64, c, al});
      out.push_back({Path::hopper, dt, 1, 333, 333, 4, 4, 128, c, al, true});
      out.push_back({Path::hopper, dt, 1, 130, 200, 32, 4, 128, c, al});
      out.push_back({Path::hopper, dt, 1, 1, 333, 4, 1, 64, c, al, true});
      out.push_back({Path::hopper, dt, 1, 333, 77, 4, 1, 128, c, al});
    }
  out.push_back({Path::hopper, DType::f16, 1, 1100, 1100, 2, 1, 128, true, kTL});
  out.push_back({Path::hopper, DType::f16, 1, 1100, 1100, 2, 1, 64, false, kTL, true});
  out.push_back({Path::hopper, DType::bf16, 1, 4097, 1, 2, 1, 64, true, kBR});  // all but the last query see nothing
  out.push_back({Path::hopper, DType::f16, 1, 200, 333, 4, 2, 128, true, kBR, false, 10});  // logits ~300
  out.push_back({Path::hopper, DType::bf16, 1, 200, 333, 4, 2, 64, false, kTL, true, 10});
  for (Path path : {Path::hopper_pipe, Path::hopper_wg1, Path::hopper_ws, Path::hopper_ws_pp})
    for (auto [c, al] : {std::pair{false, kTL}, {true, kTL}, {true, kBR}}) {
      out.push_back({path, DType::f16, 2, 77, 333, 8, 2, 64, c, al});
      out.push_back({path, DType::bf16, 1, 333, 333, 4, 4, 128, c, al, true});
      out.push_back({path, DType::f16, 1, 333, 77, 4, 1, 128, c, al});
      out.push_back({path, DType::bf16, 1, 1, 333, 4, 1, 64, c, al, true});
    }
  for (Path path : {Path::hopper_pipe, Path::hopper_wg1, Path::hopper_ws, Path::hopper_ws_pp}) {
    out.push_back({path, DType::f16, 1, 1100, 1100, 2, 1, 128, true, kTL});
    out.push_back({path, DType::bf16, 1, 4097, 1, 2, 1, 64, true, kBR});
    out.push_back({path, DType::f16, 1, 200, 333, 4, 2, 128, true, kBR, false, 10});
  }
  // ws only: a ring wrapping several times (3 stages at D 64, 2 at D 128) with GQA 8, batch > 1,
  // non-causal both layouts, and the longest odd length.
  for (Path path : {Path::hopper_ws, Path::hopper_ws_pp}) {
    out.push_back({path, DType::bf16, 2, 1100, 1100, 8, 1, 64, false, kTL, true});
    out.push_back({path, DType::f16, 2, 333, 1100, 8, 1, 128, true, kBR});
    out.push_back({path, DType::f16, 1, 4097, 4097, 1, 1, 128, true, kTL});
  }
  // 192-row blocks (D = 64): query counts below one block, between one and two (333 = 192 + 141),
  // GQA 8 with the K / V ring wrapping (1100 keys), both layouts, large logits, 4097 x 4097.
  for (Path path : {Path::hopper_ws3, Path::hopper_ws_pp3}) {
    for (auto [c, al] : {std::pair{false, kTL}, {true, kTL}, {true, kBR}}) {
      out.push_back({path, DType::f16, 2, 77, 333, 8, 2, 64, c, al});
      out.push_back({path, DType::bf16, 1, 333, 333, 4, 4, 64, c, al, true});
      out.push_back({path, DType::f16, 2, 333, 1100, 8, 1, 64, c, al});
      out.push_back({path, DType::bf16, 1, 1, 333, 4, 1, 64, c, al, true});
    }
    out.push_back({path, DType::f16, 1, 4097, 4097, 1, 1, 64, true, kTL});
    out.push_back({path, DType::bf16, 1, 4097, 1, 2, 1, 64, true, kBR});  // all but the last query see nothing
    out.push_back({path, DType::bf16, 1, 200, 333, 4, 2, 64, false, kTL, true, 10});
  }
  // Wider key tiles (D = 128): key counts below one tile, one tile and a ragged rest (333), the
  // ring wrapping with GQA 8 (1100 keys), queries past one block, causal tiles crossing the diagonal,
  // both layouts, large logits, 4097 x 4097 (the single Q buffer of 176 reused over query tiles).
  for (Path path : {Path::hopper_ws_pp160, Path::hopper_ws_pp176}) {
    for (auto [c, al] : {std::pair{false, kTL}, {true, kTL}, {true, kBR}}) {
      out.push_back({path, DType::bf16, 1, 333, 333, 4, 4, 128, c, al, true});
      out.push_back({path, DType::f16, 2, 333, 1100, 8, 1, 128, c, al});
      out.push_back({path, DType::f16, 1, 1, 150, 4, 1, 128, c, al, true});
    }
    out.push_back({path, DType::f16, 1, 4097, 4097, 1, 1, 128, false, kTL});
    out.push_back({path, DType::bf16, 1, 4097, 4097, 1, 1, 128, true, kBR});
    out.push_back({path, DType::bf16, 1, 4097, 1, 2, 1, 128, true, kBR});  // all but the last query see nothing
    out.push_back({path, DType::f16, 1, 200, 333, 4, 2, 128, true, kBR, false, 10});
  }
  return out;
}

// Switches the GPU kernel for one test through the environment (read by the library per call).
class KernelEnv {
 public:
  explicit KernelEnv(Path path) {
    unset();
    if (path == Path::portable) setenv("LLMK_ATTENTION_PORTABLE", "1", 1);
    if (path == Path::mma_long) setenv("LLMK_ATTENTION_MMA_CONFIG", "long", 1);
    if (path == Path::hopper || path == Path::hopper_pipe || path == Path::hopper_wg1 || is_ws(path))
      setenv("LLMK_ATTENTION_HOPPER", "1", 1);
    else
      setenv("LLMK_ATTENTION_HOPPER", "0", 1);  // the other kernels: the wgmma one is the sm_90 default
    if (path == Path::hopper) setenv("LLMK_ATTENTION_HOPPER_CONFIG", "plain", 1);
    if (path == Path::hopper_pipe) setenv("LLMK_ATTENTION_HOPPER_CONFIG", "pipe", 1);
    if (path == Path::hopper_wg1) setenv("LLMK_ATTENTION_HOPPER_CONFIG", "wg1", 1);
    if (path == Path::hopper_ws) setenv("LLMK_ATTENTION_HOPPER_CONFIG", "ws", 1);
    if (path == Path::hopper_ws_pp) setenv("LLMK_ATTENTION_HOPPER_CONFIG", "ws_pp", 1);
    if (path == Path::hopper_ws3) setenv("LLMK_ATTENTION_HOPPER_CONFIG", "ws3", 1);
    if (path == Path::hopper_ws_pp3) setenv("LLMK_ATTENTION_HOPPER_CONFIG", "ws_pp3", 1);
    if (path == Path::hopper_ws_pp160) setenv("LLMK_ATTENTION_HOPPER_CONFIG", "ws_pp160", 1);
    if (path == Path::hopper_ws_pp176) setenv("LLMK_ATTENTION_HOPPER_CONFIG", "ws_pp176", 1);
  }
  ~KernelEnv() { unset(); }

 private:
  static void unset() {
    unsetenv("LLMK_ATTENTION_PORTABLE");
    unsetenv("LLMK_ATTENTION_MMA_CONFIG");
    unsetenv("LLMK_ATTENTION_HOPPER");
    unsetenv("LLMK_ATTENTION_HOPPER_CONFIG");
  }
};

// Hopper cases run only on an sm_90 device, and there the build must hold the sm_90a kernel
// (otherwise the library would silently fall back to v2 and the cases would prove nothing).
#define SKIP_UNLESS_HOPPER(path)                                                                         \
  if ((path) == Path::hopper || (path) == Path::hopper_pipe || (path) == Path::hopper_wg1 ||             \
      is_ws(path)) {                                                                                     \
    const auto status = llmk::detail::hopper_status(0);                                                  \
    if (status == llmk::detail::HopperStatus::not_built)                                                 \
      FAIL() << "sm_90 device but this build has no sm_90a attention kernel (CMAKE_CUDA_ARCHITECTURES)"; \
    if (status != llmk::detail::HopperStatus::available) GTEST_SKIP() << "not an sm_90 device";           \
  }

class AttentionTest : public testing::TestWithParam<Case> {};

TEST_P(AttentionTest, MatchesFloat64) {
  const Case& c = GetParam();
  const bool gpu = c.path != Path::cpu;
  SKIP_WITHOUT_GPU(gpu);
  SKIP_UNLESS_HOPPER(c.path);
  auto stored = [&](int64_t s, int64_t heads) {
    return c.bhsd ? std::vector<int64_t>{c.batch, heads, s, c.d} : std::vector<int64_t>{c.batch, s, heads, c.d};
  };
  Tensor q(c.dtype, stored(c.sq, c.hq), gpu), k(c.dtype, stored(c.skv, c.hkv), gpu);
  Tensor v(c.dtype, stored(c.skv, c.hkv), gpu), out(c.dtype, stored(c.sq, c.hq), gpu);
  Tensor lse(DType::f32, {c.batch, c.hq, c.sq}, gpu);
  q.fill_random(-3 * c.logit_scale, 3 * c.logit_scale);
  k.fill_random(-3 * c.logit_scale, 3 * c.logit_scale);
  v.fill_random();
  out.poison();
  lse.poison();
  auto view = [&](const Tensor& t) {
    llmk::TensorView tv = t.view();
    if (c.bhsd) {
      std::swap(tv.shape[1], tv.shape[2]);
      std::swap(tv.strides[1], tv.strides[2]);
    }
    return tv;
  };
  // Row of element (b, s, h) in the stored tensor.
  auto row_of = [&](int64_t b, int64_t s, int64_t h, int64_t S, int64_t H) {
    return c.bhsd ? (b * H + h) * S + s : (b * S + s) * H + h;
  };
  llmk::AttentionOptions opt;
  opt.causal = c.causal;
  opt.align = c.align;
  const int64_t ws_before = llmk::detail::hopper_ws_launches();
  {
    KernelEnv env(c.path);
    llmk::attention(view(out), lse.view(), view(q), view(k), view(v), opt);
  }
  if (is_ws(c.path)) {  // it ran, rather than falling back to the pipe tiling, and did not deadlock
    EXPECT_EQ(llmk::detail::hopper_ws_launches(), ws_before + 1) << "the ws tiling fell back (tensor map refused, or launched with < 168 registers per thread?)";
    EXPECT_FALSE(llmk::detail::hopper_ws_timed_out()) << "an mbarrier wait timed out (10 s): the ws pipeline deadlocks";
  }
  out.download();
  lse.download();
  const double scale = 1.0 / std::sqrt(static_cast<double>(c.d));
  const int64_t offset = c.causal && c.align == kBR ? c.skv - c.sq : 0;
  // Inputs as float64, (b, h, s, d) order, so the O(Sq * Skv * D) reference stays fast.
  auto as_f64 = [&](const Tensor& t, int64_t S, int64_t H) {
    std::vector<double> r(c.batch * H * S * c.d);
    for (int64_t b = 0; b < c.batch; ++b)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t i = 0; i < S; ++i)
          for (int64_t d = 0; d < c.d; ++d) r[((b * H + h) * S + i) * c.d + d] = t.get(row_of(b, i, h, S, H), d);
    return r;
  };
  const std::vector<double> qd = as_f64(q, c.sq, c.hq), kd = as_f64(k, c.skv, c.hkv), vd = as_f64(v, c.skv, c.hkv);
  std::vector<double> want(c.batch * c.sq * c.hq * c.d, 0.0), s(c.skv), w_row(c.d);
  double lse_err = 0, max_abs = 0;
  int lse_inf_wrong = 0;
  for (int64_t b = 0; b < c.batch; ++b)
    for (int64_t h = 0; h < c.hq; ++h) {
      const int64_t hk = h / (c.hq / c.hkv);
      const double* kh = &kd[(b * c.hkv + hk) * c.skv * c.d];
      const double* vh = &vd[(b * c.hkv + hk) * c.skv * c.d];
      for (int64_t i = 0; i < c.sq; ++i) {
        const double* qi = &qd[((b * c.hq + h) * c.sq + i) * c.d];
        double m = -INFINITY;
        for (int64_t j = 0; j < c.skv; ++j) {
          s[j] = -INFINITY;
          if (c.causal && j > i + offset) continue;
          double dot = 0;
          for (int64_t d = 0; d < c.d; ++d) dot += qi[d] * kh[j * c.d + d];
          s[j] = dot * scale;
          m = std::max(m, s[j]);
        }
        double l = 0;
        for (int64_t j = 0; j < c.skv; ++j) l += std::isinf(s[j]) ? 0 : std::exp(s[j] - m);
        std::fill(w_row.begin(), w_row.end(), 0.0);
        for (int64_t j = 0; j < c.skv; ++j) {
          if (std::isinf(s[j])) continue;
          const double w = std::exp(s[j] - m) / l;
          for (int64_t d = 0; d < c.d; ++d) w_row[d] += w * vh[j * c.d + d];
        }
        const int64_t qr = row_of(b, i, h, c.sq, c.hq);  // want follows out's stored order
        for (int64_t d = 0; d < c.d; ++d) {
          want[qr * c.d + d] = w_row[d];
          const double e = std::fabs(out.get(qr, d) - w_row[d]);
          max_abs = std::isnan(e) ? INFINITY : std::max(max_abs, e);
        }
        const double got_lse = lse.get(b * c.hq + h, i);
        if (l == 0) {
          lse_inf_wrong += !(std::isinf(got_lse) && got_lse < 0);
        } else {
          const double e = std::fabs(got_lse - (m + std::log(l)));
          lse_err = std::isnan(e) ? INFINITY : std::max(lse_err, e);
        }
      }
    }
  const double rel = llmk_test::relative_error(out, want);
  std::printf("  [%s] rel %.3g max_abs %.3g lse_max_abs %.3g\n", case_name(testing::TestParamInfo<Case>(c, 0)).c_str(), rel, max_abs, lse_err);
  EXPECT_LT(rel, llmk_test::tolerance(c.dtype));
  EXPECT_EQ(lse_inf_wrong, 0) << "rows with no visible key must get lse -inf";
  // lse in fp32 from fp32 scores: relative to the size of the logits
  EXPECT_LT(lse_err, (gpu ? 2e-3 : 1e-4) * c.logit_scale * c.logit_scale);
}

INSTANTIATE_TEST_SUITE_P(All, AttentionTest, testing::ValuesIn(cases()), case_name);

TEST(AttentionErrors, NameOpArgumentExpectedAndGot) {
  using llmk_test::error_of;
  Tensor q(DType::bf16, {1, 5, 4, 64}, false), k(DType::bf16, {1, 5, 3, 64}, false), out(DType::bf16, {1, 5, 4, 64}, false);
  EXPECT_EQ(error_of([&] { llmk::attention(out.view(), {}, q.view(), k.view(), k.view(), {}); }),
            "llmk::attention: k: expected a head count that divides q's 4 heads, got 3");
  Tensor k2(DType::bf16, {1, 5, 2, 32}, false);
  EXPECT_EQ(error_of([&] { llmk::attention(out.view(), {}, q.view(), k2.view(), k2.view(), {}); }),
            "llmk::attention: k: expected shape (1, kv_len, kv_heads, 64) (batch and head dim of q), got (1, 5, 2, 32)");
  // GPU-only limits are checked before any device work (fake GPU views; nothing is read).
  auto on_gpu = [](llmk::TensorView t) {
    t.device = {llmk::DeviceKind::gpu, 0};
    return t;
  };
  Tensor q32(DType::f32, {1, 5, 4, 64}, false), o32(DType::f32, {1, 5, 4, 64}, false);
  EXPECT_EQ(error_of([&] {
              llmk::attention(on_gpu(o32.view()), {}, on_gpu(q32.view()), on_gpu(q32.view()), on_gpu(q32.view()), {});
            }),
            "llmk::attention: q: expected dtype float16 or bfloat16 on the GPU, got float32");
  Tensor q72(DType::f16, {1, 5, 4, 72}, false), o72(DType::f16, {1, 5, 4, 72}, false);
  EXPECT_EQ(error_of([&] {
              llmk::attention(on_gpu(o72.view()), {}, on_gpu(q72.view()), on_gpu(q72.view()), on_gpu(q72.view()), {});
            }),
            "llmk::attention: q: head dim 72 is not supported on the GPU (64, 80, 96, 128 or 256)");
}

// An unaligned row stride (not a multiple of 8 elements) cannot take the cp.async path: the
// library must pick the portable kernel by itself and still be right.
TEST(AttentionGpu, UnalignedStridesTakeThePortableKernel) {
  SKIP_WITHOUT_GPU(true);
  const int64_t S = 45, H = 2, D = 64, stride = D + 3;
  Tensor q(DType::f16, {1, S, H, D}, true, stride), k(DType::f16, {1, S, H, D}, true, stride);
  Tensor out(DType::f16, {1, S, H, D}, true);
  Tensor out_ref(DType::f16, {1, S, H, D}, false), q_h(DType::f16, {1, S, H, D}, false), k_h(DType::f16, {1, S, H, D}, false);
  q.fill_random();
  k.fill_random();
  for (int64_t r = 0; r < S * H; ++r)
    for (int64_t d = 0; d < D; ++d) {
      q_h.set(r, d, q.get(r, d));
      k_h.set(r, d, k.get(r, d));
    }
  out.poison();
  llmk::AttentionOptions opt;
  opt.causal = true;
  llmk::attention(out.view(), {}, q.view(), k.view(), k.view(), opt);
  out.download();
  llmk::attention(out_ref.view(), {}, q_h.view(), k_h.view(), k_h.view(), opt);  // CPU
  std::vector<double> want(S * H * D);
  for (int64_t r = 0; r < S * H; ++r)
    for (int64_t d = 0; d < D; ++d) want[r * D + d] = out_ref.get(r, d);
  EXPECT_LT(llmk_test::relative_error(out, want), 4e-3);
}

// Packed variable-length sequences: the GPU kernels (both) and the CPU against the CPU run of each
// sequence on its own (itself checked against float64 above), every causal alignment.
class AttentionVarlen : public testing::TestWithParam<std::tuple<Path, int>> {};

TEST_P(AttentionVarlen, MatchesEachSequenceAlone) {
  const auto [path, mode] = GetParam();
  const bool gpu = path != Path::cpu;
  SKIP_WITHOUT_GPU(gpu);
  SKIP_UNLESS_HOPPER(path);
  const std::vector<int32_t> lens_q = {3, 0, 300, 77, 1, 129}, lens_k = {5, 2, 200, 77, 333, 0};
  std::vector<int32_t> cu_q = {0}, cu_k = {0};
  for (size_t i = 0; i < lens_q.size(); ++i) {
    cu_q.push_back(cu_q.back() + lens_q[i]);
    cu_k.push_back(cu_k.back() + lens_k[i]);
  }
  const int64_t H = 8, Hk = 2, D = 128, tq = cu_q.back(), tk = cu_k.back();
  Tensor q(DType::f16, {tq, H, D}, gpu), k(DType::f16, {tk, Hk, D}, gpu), v(DType::f16, {tk, Hk, D}, gpu);
  Tensor out(DType::f16, {tq, H, D}, gpu), lse(DType::f32, {H, tq}, gpu);
  q.fill_random(-3, 3);
  k.fill_random(-3, 3);
  v.fill_random();
  out.poison();
  lse.poison();
  const size_t cu_bytes = cu_q.size() * sizeof(int32_t);
  void* cu_q_mem = gpu ? llmk_test::gpu_alloc(cu_bytes) : cu_q.data();
  void* cu_k_mem = gpu ? llmk_test::gpu_alloc(cu_bytes) : cu_k.data();
  if (gpu) {
    llmk_test::copy_to_gpu(cu_q_mem, cu_q.data(), cu_bytes);
    llmk_test::copy_to_gpu(cu_k_mem, cu_k.data(), cu_bytes);
  }
  const llmk::Device dev = gpu ? llmk::Device{llmk::DeviceKind::gpu, 0} : llmk::Device{};
  const llmk::TensorView cuq = llmk::TensorView::contiguous(cu_q_mem, DType::i32, dev, {static_cast<int64_t>(cu_q.size())});
  const llmk::TensorView cuk = llmk::TensorView::contiguous(cu_k_mem, DType::i32, dev, {static_cast<int64_t>(cu_k.size())});
  llmk::AttentionOptions opt;
  opt.causal = mode > 0;
  opt.align = mode == 2 ? kBR : kTL;
  {
    KernelEnv env(path);
    llmk::attention_varlen(out.view(), lse.view(), q.view(), k.view(), v.view(), cuq, cuk, 300, opt);
  }
  out.download();
  lse.download();
  if (gpu) {
    llmk_test::gpu_free(cu_q_mem);
    llmk_test::gpu_free(cu_k_mem);
  }
  // Each sequence alone on the CPU, from host copies of its rows.
  std::vector<double> want(tq * H * D, 0.0);
  double lse_err = 0;
  for (size_t b = 0; b < lens_q.size(); ++b) {
    const int64_t sq = lens_q[b], sk = lens_k[b];
    if (sq == 0) continue;
    Tensor qs(DType::f16, {1, sq, H, D}, false), ks(DType::f16, {1, sk, Hk, D}, false), vs(DType::f16, {1, sk, Hk, D}, false);
    Tensor os(DType::f16, {1, sq, H, D}, false), ls(DType::f32, {1, H, sq}, false);
    for (int64_t r = 0; r < sq * H; ++r)
      for (int64_t d = 0; d < D; ++d) qs.set(r, d, q.get(cu_q[b] * H + r, d));
    for (int64_t r = 0; r < sk * Hk; ++r)
      for (int64_t d = 0; d < D; ++d) {
        ks.set(r, d, k.get(cu_k[b] * Hk + r, d));
        vs.set(r, d, v.get(cu_k[b] * Hk + r, d));
      }
    llmk::attention(os.view(), ls.view(), qs.view(), ks.view(), vs.view(), opt);
    for (int64_t r = 0; r < sq * H; ++r)
      for (int64_t d = 0; d < D; ++d) want[(cu_q[b] * H + r) * D + d] = os.get(r, d);
    for (int64_t h = 0; h < H; ++h)
      for (int64_t i = 0; i < sq; ++i) {
        const double a = lse.get(h, cu_q[b] + i), e = ls.get(h, i);
        if (std::isinf(e)) EXPECT_TRUE(std::isinf(a) && a < 0) << "sequence " << b << " row " << i;
        else lse_err = std::max(lse_err, std::isnan(a) ? INFINITY : std::fabs(a - e));
      }
  }
  const double rel = llmk_test::relative_error(out, want);
  std::printf("  [varlen %s mode %d] rel %.3g lse_max_abs %.3g\n", path_name(path), mode, rel, lse_err);
  EXPECT_LT(rel, gpu ? 4e-3 : 1e-6);
  EXPECT_LT(lse_err, gpu ? 2e-3 : 1e-6);
}

INSTANTIATE_TEST_SUITE_P(All, AttentionVarlen,
                         testing::Combine(testing::Values(Path::cpu, Path::mma, Path::mma_long, Path::portable, Path::hopper,
                                                          Path::hopper_pipe, Path::hopper_wg1, Path::hopper_ws),
                                          testing::Values(0, 1, 2)),
                         [](const testing::TestParamInfo<std::tuple<Path, int>>& info) {
                           const int mode = std::get<1>(info.param);
                           return std::string(path_name(std::get<0>(info.param))) +
                                  (mode == 0 ? "_full" : mode == 1 ? "_causal_tl" : "_causal_br");
                         });

// The wgmma primitives alone (gpu/wgmma.h: 128B-swizzled tiles, K-major and MN-major descriptors,
// the register-A fragment): one warpgroup computes S = Q K^T (64 x 128, Q and K from shared memory)
// and O = P V (P = S rounded to 16 bits in registers, V through the transpose bit), checked
// against float64 products of the same inputs. A layout bug shows here before the full kernel.
class WgmmaTile : public testing::TestWithParam<std::tuple<DType, int>> {};

TEST_P(WgmmaTile, MatchesFloat64) {
  const DType dt = std::get<0>(GetParam());
  const int d = std::get<1>(GetParam());
  SKIP_WITHOUT_GPU(true);
  SKIP_UNLESS_HOPPER(Path::hopper);
  constexpr int64_t kM = 64, kN = 128;
  Tensor q(dt, {kM, d}, true), k(dt, {kN, d}, true), v(dt, {kN, d}, true);
  Tensor s(DType::f32, {kM, kN}, true), o(DType::f32, {kM, d}, true);
  // Distinct small values per position (multiples of 1/8), so a swapped row, column or chunk
  // anywhere changes the products; S stays exact in fp32.
  auto fill = [](Tensor& t, int salt) {
    for (int64_t r = 0; r < t.rows(); ++r)
      for (int64_t c = 0; c < t.cols(); ++c) t.set(r, c, static_cast<double>((r * 7 + c * 13 + salt * 5 + r * c) % 17 - 8) / 8.0);
    t.upload();
  };
  fill(q, 1);
  fill(k, 2);
  fill(v, 3);
  s.poison();
  o.poison();
  ASSERT_TRUE(llmk::detail::wgmma_tile_selftest(dt, d, q.view().data, k.view().data, v.view().data,
                                                 static_cast<float*>(s.view().data), static_cast<float*>(o.view().data)));
  s.download();
  o.download();
  double s_err = 0;
  int s_bad = 0;  // the first few mismatches are printed (which rows / columns point at the layout)
  std::vector<double> p(kM * kN);
  for (int64_t i = 0; i < kM; ++i)
    for (int64_t j = 0; j < kN; ++j) {
      double dot = 0;
      for (int64_t x = 0; x < d; ++x) dot += q.get(i, x) * k.get(j, x);
      const double e = std::fabs(s.get(i, j) - dot);
      if (!(e == 0) && s_bad++ < 3) std::printf("  S(%d, %d) = %g, want %g\n", int(i), int(j), s.get(i, j), dot);
      s_err = std::isnan(e) ? INFINITY : std::max(s_err, e);
      p[i * kN + j] = llmk_test::rounded(dt, dot);  // P as the kernel rounds it to 16 bits
    }
  // O's largest error and the largest sum |P V| (fp32 accumulation of 128 products: a few ulp of it)
  auto o_error = [&](bool print) {
    double err = 0, scale = 0;
    int bad = 0;
    for (int64_t i = 0; i < kM; ++i)
      for (int64_t x = 0; x < d; ++x) {
        double acc = 0, abs_sum = 0;
        for (int64_t j = 0; j < kN; ++j) {
          acc += p[i * kN + j] * v.get(j, x);
          abs_sum += std::fabs(p[i * kN + j] * v.get(j, x));
        }
        const double e = std::fabs(o.get(i, x) - acc);
        if (print && !(e < 1e-5 * (abs_sum + 1)) && bad++ < 3)
          std::printf("  O(%d, %d) = %g, want %g\n", int(i), int(x), o.get(i, x), acc);
        err = std::isnan(e) ? INFINITY : std::max(err, e);
        scale = std::max(scale, abs_sum);
      }
    return std::pair{err, scale};
  };
  const auto [o_err, o_scale] = o_error(true);
  std::printf("  [wgmma tile %s d%d] S max_abs %.3g, O max_abs %.3g (sum |P V| up to %.3g)\n", llmk::dtype_name(dt), d, s_err,
              o_err, o_scale);
  EXPECT_EQ(s_err, 0) << "S = Q K^T (smem descriptors, K-major, 128B swizzle)";
  EXPECT_LT(o_err, 1e-5 * (o_scale + 1)) << "O = P V (register A, MN-major V descriptor)";
  if (s_err == 0 && !(o_err < 1e-5 * (o_scale + 1))) {  // diagnosis: V's descriptor with its byte offsets swapped
    o.poison();
    ASSERT_TRUE(llmk::detail::wgmma_tile_selftest(dt, d, q.view().data, k.view().data, v.view().data,
                                                   static_cast<float*>(s.view().data), static_cast<float*>(o.view().data), 1));
    o.download();
    const double swapped = o_error(false).first;
    std::printf("  DIAGNOSIS: with V's leading / stride byte offsets swapped O max_abs is %.3g: %s\n", swapped,
                swapped < 1e-5 * (o_scale + 1) ? "swap them in the kernel's V descriptors (issue_pv)"
                                               : "not the offsets; check the register-A fragment (pack_p)");
  }
}

INSTANTIATE_TEST_SUITE_P(All, WgmmaTile,
                         testing::Combine(testing::Values(DType::f16, DType::bf16), testing::Values(64, 128)),
                         [](const testing::TestParamInfo<std::tuple<DType, int>>& info) {
                           return std::string(llmk::dtype_name(std::get<0>(info.param))) + "_d" +
                                  std::to_string(std::get<1>(info.param));
                         });

// The ws tiling's TMA load alone: one 128-row tile of a strided matrix (row stride d + 24
// elements, so the tensor map's stride differs from its row length), loaded by TMA and by the
// cp.async path, must give the same shared-memory bytes, the cp.async path's being the layout the
// WgmmaTile test validates; rows past the end (the second tile of 200 rows) must read as zeros.
class TmaTile : public testing::TestWithParam<std::tuple<DType, int>> {};

TEST_P(TmaTile, MatchesCpAsyncLayout) {
  const DType dt = std::get<0>(GetParam());
  const int d = std::get<1>(GetParam());
  SKIP_WITHOUT_GPU(true);
  SKIP_UNLESS_HOPPER(Path::hopper_ws);
  const int rows = 200, stride = d + 24;
  Tensor src(dt, {rows, static_cast<int64_t>(stride)}, true);
  for (int64_t r = 0; r < rows; ++r)  // distinct values per (row, column)
    for (int64_t c = 0; c < stride; ++c) src.set(r, c, static_cast<double>((r * 131 + c * 7) % 509 - 254) / 64.0);
  src.upload();
  const int64_t bytes = 128 * d * 2;
  void* img_tma = llmk_test::gpu_alloc(bytes);
  void* img_cp = llmk_test::gpu_alloc(bytes);
  std::vector<unsigned char> a(bytes), b(bytes);
  for (int row0 : {0, 128}) {
    const bool ran = llmk::detail::tma_tile_selftest(dt, d, src.view().data, stride, rows, row0, img_tma, img_cp);
    EXPECT_TRUE(ran) << "TMA tile load not available (tensor map refused by the driver?)";
    if (!ran) break;
    llmk_test::copy_to_host(a.data(), img_tma, bytes);
    llmk_test::copy_to_host(b.data(), img_cp, bytes);
    int bad = 0;
    for (int64_t i = 0; i < bytes; ++i)
      if (a[i] != b[i] && bad++ < 4) {
        const int64_t cb = i / (128 * 128), r = (i % (128 * 128)) / 128, slot = (i % 128) / 16;
        std::printf("  byte %lld (column block %lld, row %lld, slot %lld): tma %02x cp.async %02x\n",
                    static_cast<long long>(i), static_cast<long long>(cb), static_cast<long long>(r),
                    static_cast<long long>(slot), a[i], b[i]);
      }
    EXPECT_EQ(bad, 0) << "row0 " << row0 << ": TMA's 128B-swizzled image differs from the cp.async layout";
    EXPECT_FALSE(llmk::detail::hopper_ws_timed_out()) << "the TMA load never completed its mbarrier (10 s)";
  }
  llmk_test::gpu_free(img_tma);
  llmk_test::gpu_free(img_cp);
}

INSTANTIATE_TEST_SUITE_P(All, TmaTile,
                         testing::Combine(testing::Values(DType::f16, DType::bf16), testing::Values(64, 128)),
                         [](const testing::TestParamInfo<std::tuple<DType, int>>& info) {
                           return std::string(llmk::dtype_name(std::get<0>(info.param))) + "_d" +
                                  std::to_string(std::get<1>(info.param));
                         });

// The grid order (grid_block) visits every (query tile, batch x head) pair exactly once for any
// section width, tile-major within each section: the blocks of a section cover its heads' first
// tiles before any second tile.
TEST(AttentionGrid, SectionsCoverEveryTileOnceInOrder) {
  for (int m_tiles : {1, 2, 7}) {
    for (int bh_count : {1, 5, 16}) {
      for (int section : {0, 1, 2, 3, 4, 16, 40}) {
        llmk::detail::AttentionParams p;
        p.grid_section = section;
        std::vector<int> seen(static_cast<size_t>(m_tiles * bh_count), 0);
        int previous_bh = -1, previous_rank = 0;
        for (int block = 0; block < m_tiles * bh_count; ++block) {
          const auto [rank, bh] = llmk::detail::grid_block(p, block, m_tiles, bh_count);
          ASSERT_TRUE(rank >= 0 && rank < m_tiles && bh >= 0 && bh < bh_count)
              << "block " << block << " of " << m_tiles << " x " << bh_count << ", section " << section;
          ++seen[static_cast<size_t>(rank * bh_count + bh)];
          const int width = section > 0 && section < bh_count ? section : bh_count;
          if (previous_bh >= 0 && bh / width == previous_bh / width) {  // same section: ranks never go back
            EXPECT_GE(rank, previous_rank) << "block " << block << ", section " << section;
          }
          previous_bh = bh;
          previous_rank = rank;
        }
        EXPECT_EQ(std::count(seen.begin(), seen.end(), 1), m_tiles * bh_count)
            << m_tiles << " x " << bh_count << ", section " << section;
      }
    }
  }
}

TEST(AttentionErrors, VarlenOffsetsAreCheckedOnTheCpu) {
  Tensor q(DType::f32, {7, 2, 64}, false), out(DType::f32, {7, 2, 64}, false);
  std::vector<int32_t> cu_q = {0, 3, 7}, cu_bad = {0, 5, 3};
  auto cu = [](std::vector<int32_t>& c) {
    return llmk::TensorView::contiguous(c.data(), DType::i32, {}, {static_cast<int64_t>(c.size())});
  };
  EXPECT_EQ(llmk_test::error_of([&] {
              llmk::attention_varlen(out.view(), {}, q.view(), q.view(), q.view(), cu(cu_q), cu(cu_bad), 4, {});
            }),
            "llmk::attention_varlen: cu_seqlens: sequence 1 spans q rows [3, 7) and k rows [5, 3); expected "
            "nondecreasing offsets within 7 q rows and 7 k rows, q lengths <= max_seqlen_q 4");
}

}  // namespace
