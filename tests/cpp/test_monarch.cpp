// Monarch product and its backward vs float64 references (the dense equivalent, and the
// gradients of the two-stage definition), on the CPU and the GPU (tensor-core and portable
// paths, fused and two-kernel forms; the cluster kernels forced on (LLMK_MONARCH_CLUSTER=resident /
// pipelined) and off (=0), the mma.sync tile kernels where the sm_90a wgmma one would run
// (LLMK_MONARCH_WGMMA=0), the wgmma kernel's block-ordered outputs without its TMA stores
// (LLMK_MONARCH_WG_TMA_STORE=0), LLMK_MONARCH_LEGACY=1, LLMK_MONARCH_WIDE=1 and the CUDA-core tiled
// stages (LLMK_MONARCH_PORTABLE=1, their default there; 128- and 64-token tiles, and reading 16-byte
// chunks, their default, which the other paths turn off), the legacy portable kernels (LLMK_MONARCH_SIMT=0)), odd and rectangular
// block shapes, strided rows, and bad inputs with their
// exact messages.
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>
#include <vector>

#include "attention/attention_internal.h"  // hopper_status: whether sm_90a kernels run here
#include "llmk/monarch.h"
#include "monarch/monarch_internal.h"  // monarch_decode_mma_launches, monarch_simt_launches
#include "support/tensors.h"
#include "support/testing.h"

using llmk::DType;
using llmk_test::Tensor;

namespace {

struct Shape {
  int64_t tokens, k, q, p, l, s, r;
};

// GPU paths besides the default, each forced by its switch set to 1.
// (The default forward takes the cluster kernel where it can: sm_90 and the weights on chip.)
enum class Path { standard, portable, simt, simt64, simtvec, legacy, wide, tiled, resident, pipelined, mmasync, wgfew, wgsync, skinny, decode, decodemma };
const char* path_switch(Path p) {
  switch (p) {
    case Path::portable: return "LLMK_MONARCH_PORTABLE";  // with LLMK_MONARCH_SIMT=0: the legacy portable kernels (see Env)
    case Path::simt: return "LLMK_MONARCH_PORTABLE";  // the portable path's default: the CUDA-core tiled stages
    case Path::simt64: return "LLMK_MONARCH_PORTABLE";  // the same on 64-token tiles (LLMK_MONARCH_SIMT_BM=64, see Env)
    case Path::simtvec: return "LLMK_MONARCH_PORTABLE";  // the same reading 16-byte chunks (the default; the other paths set LLMK_MONARCH_SIMT_VEC=0, see Env)
    case Path::legacy: return "LLMK_MONARCH_LEGACY";  // the previous tensor-core kernels
    case Path::wide: return "LLMK_MONARCH_WIDE";      // 128-token tiles
    case Path::tiled: return "LLMK_MONARCH_CLUSTER";  // set to 0: the tiled kernels, not the cluster kernel
    case Path::resident: return "LLMK_MONARCH_CLUSTER";  // "resident": the resident-weights cluster kernel
    case Path::pipelined: return "LLMK_MONARCH_CLUSTER";  // "pipelined": the pipelined one at any token count
    case Path::mmasync: return "LLMK_MONARCH_CLUSTER";  // set to 0, and LLMK_MONARCH_WGMMA=0 (see Env)
    case Path::wgfew: return "LLMK_MONARCH_WG_CTAS";  // 3 persistent wgmma CTAs: several tiles each
    case Path::wgsync: return "LLMK_MONARCH_WG_TMA_STORE";  // set to 0: block-ordered outputs by write_staging
    case Path::skinny: return "LLMK_MONARCH_CLUSTER";  // set to 0: the few-token stages also where the cluster kernel comes first
    case Path::decode: return "LLMK_MONARCH_DECODE";  // the one-launch few-token kernel wherever it can run
    case Path::decodemma: return "LLMK_MONARCH_DECODE_MMA";  // its tensor-core twin (sm_90a) wherever it can run
    default: return nullptr;
  }
}
bool is_simt(Path p) { return p == Path::simt || p == Path::simt64 || p == Path::simtvec; }

const char* path_value(Path p) {
  return p == Path::tiled || p == Path::mmasync || p == Path::wgsync || p == Path::skinny ? "0"
         : p == Path::resident                  ? "resident"
         : p == Path::pipelined                 ? "pipelined"
         : p == Path::wgfew                     ? "3"
                                                : "1";
}
const char* path_prefix(Path p) {
  switch (p) {
    case Path::portable: return "gpuportable_";
    case Path::simt: return "gpusimt_";
    case Path::simt64: return "gpusimt64_";
    case Path::simtvec: return "gpusimtvec_";
    case Path::legacy: return "gpulegacy_";
    case Path::wide: return "gpuwide_";
    case Path::tiled: return "gputiled_";
    case Path::resident: return "gpuresident_";
    case Path::pipelined: return "gpupipelined_";
    case Path::mmasync: return "gpummasync_";
    case Path::wgfew: return "gpuwgfew_";
    case Path::wgsync: return "gpuwgsync_";
    case Path::skinny: return "gpuskinny_";
    case Path::decode: return "gpudecode_";
    case Path::decodemma: return "gpudecodemma_";
    default: return "gpu_";
  }
}

struct Case {
  bool gpu;
  Path path;  // GPU only
  DType dtype;
  Shape sh;
  int64_t x_pad;  // extra elements per row of x (strided rows)
};

// How many CUDA-core tiled kernels a forward (2 stages) or backward (z, dy, dx and the two weight
// gradients: 5) launches where the route is fixed: all on the portable path (their default there),
// and in fp32 on the default path (no tensor cores run fp32); none on the legacy portable kernels
// (LLMK_MONARCH_SIMT=0) or LLMK_MONARCH_LEGACY=1, nor on the CPU. -1: not pinned (the tensor-core
// paths hand odd shapes to them, per stage).
int expected_simt_launches(const Case& c, int all) {
  if (!c.gpu || c.path == Path::portable || c.path == Path::legacy) return 0;
  if (is_simt(c.path) || (c.path == Path::standard && c.dtype == DType::f32)) return all;
  return -1;
}

// Of those, the stage launches that read 16-byte chunks (the simtvec path only: Env sets LLMK_MONARCH_SIMT_VEC=0 for the others): a stage
// whose K and input strides are multiples of 16 bytes' elements (ce). Forward: stage 1 (K = p, x's
// rows) and stage 2 (K = r, the workspace's k * q rows); backward: z (as stage 1), dy (K = s, the
// permuted dout's l * s rows) and dx (K = q, dy's k * q rows).
int expected_simt_vec_launches(const Case& c, bool backward) {
  if (!c.gpu || c.path != Path::simtvec) return 0;
  const Shape& s = c.sh;
  const int64_t ce = 16 / static_cast<int64_t>(llmk::dtype_size(c.dtype)), x_rs = s.k * s.p + c.x_pad;
  const int stage1 = s.p % ce == 0 && x_rs % ce == 0;
  if (!backward) return stage1 + (s.r % ce == 0 && (s.k * s.q) % ce == 0);
  return stage1 + (s.s % ce == 0) + (s.q % ce == 0);
}

std::string case_name(const testing::TestParamInfo<Case>& info) {
  const Case& c = info.param;
  const Shape& s = c.sh;
  return std::string(c.gpu ? path_prefix(c.path) : "cpu_") + llmk::dtype_name(c.dtype) +
         "_b" + std::to_string(s.tokens) + "_w1_" + std::to_string(s.k) + "x" + std::to_string(s.q) + "x" +
         std::to_string(s.p) + "_w2_" + std::to_string(s.l) + "x" + std::to_string(s.s) + "x" +
         std::to_string(s.r) + (c.x_pad ? "_strided" : "");
}

const std::vector<Shape>& shapes() {
  static const std::vector<Shape> v = {
      {5, 4, 16, 16, 4, 16, 16},         // square, n = 64
      {37, 8, 32, 16, 16, 16, 16},       // rectangular: n = 128, m = 256
      {9, 6, 5, 7, 3, 9, 10},            // odd: n = 6*7, k*q = 30 = l*r, m = 27 (portable only)
      {3, 2, 256, 256, 2, 256, 256},     // block size 256
      {1100, 16, 64, 64, 16, 64, 64},    // n = 1024: enough token tiles for the fused kernel
      {40, 128, 128, 128, 128, 128, 128}, // n = 16384: the intermediate does not fit, two kernels
      {300, 4, 128, 96, 4, 128, 128},    // 128-output blocks: 3 token tiles of 128, the last partial
      {130, 3, 200, 64, 3, 136, 200},    // block outputs 200 and 136: partial 128-column tiles
      // shapes the cluster kernel takes on sm_90 (cluster size C in the comment)
      {77, 64, 64, 64, 64, 64, 64},      // n = 4096, 64 blocks (C = 8): 3 token tiles, the last partial
      {1, 64, 64, 64, 64, 64, 64},       // the same at one token
      {45, 64, 32, 32, 64, 32, 32},      // n = 2048, 64 blocks (C = 4)
      {40, 32, 32, 32, 32, 32, 32},      // n = 1024, 32 blocks (C = 2), strided rows
      {33, 32, 64, 64, 32, 64, 64},      // n = 2048, 32 blocks (C = 4): one token past a tile
      {1000, 64, 64, 64, 64, 64, 64},    // n = 4096, 64 blocks, strided rows: several 16-token tiles per cluster
      // large blocks, the sm_90a wgmma stage kernel by default (128-token tiles, K steps of 64)
      {333, 4, 256, 256, 4, 256, 256},   // n = 1024, 4 blocks of 256: a partial last token tile, strided rows
      {257, 2, 192, 128, 4, 160, 96},    // rectangular: N 192 and 160 (partial 128-column tiles), K 96 (a partial K step)
      {130, 16, 384, 256, 16, 256, 384}, // n = 4096: stage 1 straight into stage-2 order on 256-wide tiles (N 384: a partial one)
      {150, 16, 128, 128, 16, 128, 128}, // n = 2048, 16 blocks of 128: stage 1 into stage-2 order on tiles of two blocks
      {150, 8, 64, 64, 8, 64, 64},       // the same with 64-wide tiles (n = 512, 8 blocks of 64)
      // few tokens: the skinny stages (monarch_skinny.cu) by default on NVIDIA sm_80+ (and the
      // 5-, 3- and 1-token shapes above)
      {16, 4, 1024, 1024, 4, 1024, 1024}, // n = 4096, 4 blocks of 1024: K split 8 ways
      {13, 16, 200, 96, 16, 120, 200},    // rectangular, strided rows: partial row groups (200, 120), partial trips (96, 200)
      {8, 2, 48, 40, 4, 24, 24},          // 8 tokens (one n8 tile), n = 80, m = 96
      {16, 64, 64, 64, 64, 64, 64},       // n = 4096, 64 blocks of 64 at 16 tokens (the decode benchmark row)
      // the one-launch few-token kernel (monarch_decode.cu; the shapes above at <= 16 tokens with
      // blocks p, r multiples of 8 up to 256 too)
      {3, 64, 32, 32, 64, 32, 32},        // n = 2048, 64 blocks of 32, 3 tokens
      {7, 64, 128, 128, 64, 128, 128},    // n = 8192, 64 blocks of 128, 7 tokens, strided rows
      {11, 8, 64, 32, 4, 48, 128},        // l = 4 < q = 64: several t per stage-1 block; r = 128, m = 192
      // the tensor-core one-launch few-token kernel (monarch_decode_mma.cu; also the shapes above
      // with l and q multiples of 8, p, s and r of 16)
      {16, 64, 128, 128, 64, 128, 128},   // n = 8192, 64 blocks of 128 at 16 tokens (the benchmark row; C = 8)
      {9, 16, 96, 48, 24, 64, 64},        // rectangular, strided rows: p = 48 (3 k-steps), l = 24, C = 4, n = 768, m = 1536
      {5, 8, 256, 64, 8, 128, 256},       // r = 256: 32 t per CTA (C = 8, two pairs of t per warp in stage 1), one cluster
  };
  return v;
}

std::vector<Case> cases() {
  std::vector<Case> out;
  for (DType dt : {DType::f32, DType::f16, DType::bf16}) {
    for (size_t i = 0; i < shapes().size(); ++i) {
      const Shape& s = shapes()[i];
      const bool big = s.tokens * s.k * s.p > 1000000;
      const bool strided = i == 1 || i == 11 || i == 13 || i == 14 || i == 21 || i == 24 || i == 26;
      // the pipelined cluster kernel's shapes (blocks of 64, 8 per CTA): both cluster kernels
      const bool pipelined = s.p == 64 && s.q == 64 && s.r == 64 && s.s == 64 && s.k == s.l && (s.k == 64 || s.k == 32);
      if (!big) out.push_back({false, Path::standard, dt, s, strided ? 3 : 0});
      out.push_back({true, Path::standard, dt, s, strided ? 8 : 0});
      if (dt != DType::f32 && i >= 8) out.push_back({true, Path::tiled, dt, s, strided ? 8 : 0});
      if (dt != DType::f32 && i >= 8 && pipelined) {
        out.push_back({true, Path::resident, dt, s, strided ? 8 : 0});
        out.push_back({true, Path::pipelined, dt, s, strided ? 8 : 0});
      }
      out.push_back({true, Path::portable, dt, s, 0});
      out.push_back({true, Path::simt, dt, s, strided ? 8 : 0});
      if (dt != DType::f16) out.push_back({true, Path::simt64, dt, s, strided ? 8 : 0});
      out.push_back({true, Path::simtvec, dt, s, strided ? 8 : 0});
      if (dt != DType::f32) out.push_back({true, Path::legacy, dt, s, i == 1 ? 8 : 0});
      if (dt != DType::f32) out.push_back({true, Path::wide, dt, s, i == 1 ? 8 : 0});
      if (dt != DType::f32 && i >= 3) out.push_back({true, Path::mmasync, dt, s, strided ? 8 : 0});
      if (dt != DType::f32 && (i == 4 || i == 6 || (i >= 14 && i < 20))) out.push_back({true, Path::wgfew, dt, s, strided ? 8 : 0});
      if (dt != DType::f32 && i >= 14 && i < 20) out.push_back({true, Path::wgsync, dt, s, strided ? 8 : 0});
      if (dt != DType::f32 && s.tokens <= 16) out.push_back({true, Path::skinny, dt, s, strided ? 8 : 0});
      if (dt != DType::f32 && s.tokens <= 16) out.push_back({true, Path::decode, dt, s, strided ? 8 : 0});
      if (dt != DType::f32 && s.tokens <= 16) out.push_back({true, Path::decodemma, dt, s, strided ? 8 : 0});
    }
  }
  return out;
}

// The path's switch for the test's duration; the wide and mma.sync paths also turn the sm_90a
// wgmma stage kernel off (it comes first where it can run), the few-CTA wgmma path the cluster
// kernels (so that the tiled kernels run); every path but the standard and skinny ones the few-token
// stages (which come before the others at up to 16 tokens, but after the cluster kernel where the
// blocks are narrower than 128), and every path but the standard and decode ones the one-launch
// few-token kernel (which comes first), every path but the standard and decodemma ones its
// tensor-core twin (first of all).
struct Env {
  explicit Env(const Case& c) : var(c.gpu ? path_switch(c.path) : nullptr) {
    if (var) setenv(var, path_value(c.path), 1);
    if (var && c.path != Path::skinny) setenv("LLMK_MONARCH_SKINNY", "0", 1);
    if (var && c.path != Path::decode) setenv("LLMK_MONARCH_DECODE", "0", 1);
    if (var && c.path != Path::decodemma) setenv("LLMK_MONARCH_DECODE_MMA", "0", 1);
    no_wgmma = c.gpu && (c.path == Path::wide || c.path == Path::mmasync);
    if (no_wgmma) setenv("LLMK_MONARCH_WGMMA", "0", 1);
    no_cluster = c.gpu && c.path == Path::wgfew;
    if (no_cluster) setenv("LLMK_MONARCH_CLUSTER", "0", 1);
    if (c.gpu && c.path == Path::portable) setenv("LLMK_MONARCH_SIMT", "0", 1);
    if (c.gpu && c.path == Path::simt64) setenv("LLMK_MONARCH_SIMT_BM", "64", 1);
    // 16-byte chunks (the default) only on the simtvec path; the others keep the scalar loads covered
    if (c.gpu) setenv("LLMK_MONARCH_SIMT_VEC", c.path == Path::simtvec ? "1" : "0", 1);
  }
  ~Env() {
    if (var) unsetenv(var);
    if (var) unsetenv("LLMK_MONARCH_SKINNY");
    if (var) unsetenv("LLMK_MONARCH_DECODE");
    if (var) unsetenv("LLMK_MONARCH_DECODE_MMA");
    if (no_wgmma) unsetenv("LLMK_MONARCH_WGMMA");
    if (no_cluster) unsetenv("LLMK_MONARCH_CLUSTER");
    unsetenv("LLMK_MONARCH_SIMT");
    unsetenv("LLMK_MONARCH_SIMT_BM");
    unsetenv("LLMK_MONARCH_SIMT_VEC");
  }
  const char* var;
  bool no_wgmma = false, no_cluster = false;
};

std::vector<double> values(const Tensor& t) {
  std::vector<double> v(t.rows() * t.cols());
  for (int64_t r = 0; r < t.rows(); ++r)
    for (int64_t c = 0; c < t.cols(); ++c) v[r * t.cols() + c] = t.get(r, c);
  return v;
}

// y[b, i*q+c] (float64, not rounded) and out[b, v*l+u] from the definition.
void forward_ref(const Shape& s, const std::vector<double>& x, const std::vector<double>& w1,
                 const std::vector<double>& w2, std::vector<double>& y, std::vector<double>& out) {
  const int64_t n = s.k * s.p, mid = s.k * s.q, m = s.l * s.s;
  y.assign(s.tokens * mid, 0.0);
  out.assign(s.tokens * m, 0.0);
  for (int64_t b = 0; b < s.tokens; ++b) {
    for (int64_t i = 0; i < s.k; ++i)
      for (int64_t c = 0; c < s.q; ++c) {
        double acc = 0;
        for (int64_t a = 0; a < s.p; ++a) acc += w1[(i * s.q + c) * s.p + a] * x[b * n + i * s.p + a];
        y[b * mid + i * s.q + c] = acc;
      }
    for (int64_t u = 0; u < s.l; ++u)
      for (int64_t v = 0; v < s.s; ++v) {
        double acc = 0;
        for (int64_t t = 0; t < s.r; ++t) acc += w2[(u * s.s + v) * s.r + t] * y[b * mid + t * s.l + u];
        out[b * m + v * s.l + u] = acc;
      }
  }
}

// The backward's float64 reference is cubic per token: the large shapes run forward only.
std::vector<Case> backward_cases() {
  std::vector<Case> out;
  for (const Case& c : cases())
    if (c.sh.tokens * c.sh.k * c.sh.p * c.sh.q <= 50000000) out.push_back(c);
  return out;
}

class MonarchTest : public testing::TestWithParam<Case> {};
class MonarchBackwardTest : public testing::TestWithParam<Case> {};

TEST_P(MonarchTest, ForwardMatchesDense) {
  const Case& c = GetParam();
  SKIP_WITHOUT_GPU(c.gpu);
  Env env(c);
  const Shape& s = c.sh;
  const int64_t n = s.k * s.p, m = s.l * s.s;
  Tensor x(c.dtype, {s.tokens, n}, c.gpu, n + c.x_pad), w1(c.dtype, {s.k, s.q, s.p}, c.gpu),
      w2(c.dtype, {s.l, s.s, s.r}, c.gpu), out(c.dtype, {s.tokens, m}, c.gpu);
  x.fill_random(-1, 1);
  w1.fill_random(-0.5, 0.5);
  w2.fill_random(-0.5, 0.5);
  out.poison();
  const std::size_t bytes = llmk::monarch_matmul_workspace_bytes(x.view(), w1.view(), w2.view());
  if (!c.gpu) EXPECT_EQ(bytes, 0u);
  Tensor ws(DType::u8, {static_cast<int64_t>(bytes > 0 ? bytes : 1)}, c.gpu);
  const int64_t simt_before = llmk::detail::monarch_simt_launches();
  const int64_t vec_before = llmk::detail::monarch_simt_vec_launches();
  llmk::monarch_matmul(out.view(), x.view(), w1.view(), w2.view(), bytes ? ws.view() : llmk::TensorView{});
  // the CUDA-core tiled kernel runs both stages where the route is fixed (above)
  if (const int want = expected_simt_launches(c, 2); want >= 0)
    EXPECT_EQ(llmk::detail::monarch_simt_launches() - simt_before, want);
  EXPECT_EQ(llmk::detail::monarch_simt_vec_launches() - vec_before, expected_simt_vec_launches(c, false));
  out.download();
  std::vector<double> xv(s.tokens * n);
  for (int64_t b = 0; b < s.tokens; ++b)
    for (int64_t e = 0; e < n; ++e) xv[b * n + e] = x.get(b, e);
  std::vector<double> y, ref;
  forward_ref(s, xv, values(w1), values(w2), y, ref);
  EXPECT_LE(llmk_test::relative_error(out, ref), llmk_test::tolerance(c.dtype));
}

TEST_P(MonarchBackwardTest, BackwardMatchesDefinition) {
  const Case& c = GetParam();
  SKIP_WITHOUT_GPU(c.gpu);
  const Shape& s = c.sh;
  Env env(c);
  const int64_t n = s.k * s.p, m = s.l * s.s, mid = s.k * s.q;
  Tensor x(c.dtype, {s.tokens, n}, c.gpu, n + c.x_pad), w1(c.dtype, {s.k, s.q, s.p}, c.gpu),
      w2(c.dtype, {s.l, s.s, s.r}, c.gpu), dout(c.dtype, {s.tokens, m}, c.gpu);
  Tensor dx(c.dtype, {s.tokens, n}, c.gpu), dw1(c.dtype, {s.k, s.q, s.p}, c.gpu), dw2(c.dtype, {s.l, s.s, s.r}, c.gpu);
  x.fill_random(-1, 1);
  w1.fill_random(-0.5, 0.5);
  w2.fill_random(-0.5, 0.5);
  dout.fill_random(-1, 1);
  dx.poison();
  dw1.poison();
  dw2.poison();
  const std::size_t bytes = llmk::monarch_backward_workspace_bytes(x.view(), w1.view(), w2.view());
  Tensor ws(DType::u8, {static_cast<int64_t>(bytes > 0 ? bytes : 1)}, c.gpu);
  const int64_t simt_before = llmk::detail::monarch_simt_launches();
  const int64_t vec_before = llmk::detail::monarch_simt_vec_launches();
  llmk::monarch_matmul_backward(dx.view(), dw1.view(), dw2.view(), dout.view(), x.view(), w1.view(), w2.view(),
                                bytes ? ws.view() : llmk::TensorView{});
  // where the route is fixed the CUDA-core tiled kernels take z, dy, dx and both weight gradients
  if (const int want = expected_simt_launches(c, 5); want >= 0)
    EXPECT_EQ(llmk::detail::monarch_simt_launches() - simt_before, want);
  EXPECT_EQ(llmk::detail::monarch_simt_vec_launches() - vec_before, expected_simt_vec_launches(c, true));
  dx.download();
  dw1.download();
  dw2.download();
  std::vector<double> xv(s.tokens * n);
  for (int64_t b = 0; b < s.tokens; ++b)
    for (int64_t e = 0; e < n; ++e) xv[b * n + e] = x.get(b, e);
  const std::vector<double> w1v = values(w1), w2v = values(w2), dov = values(dout);
  std::vector<double> y, out;
  forward_ref(s, xv, w1v, w2v, y, out);
  std::vector<double> rdx(s.tokens * n, 0.0), rdw1(w1v.size(), 0.0), rdw2(w2v.size(), 0.0), dy(mid);
  for (int64_t b = 0; b < s.tokens; ++b) {
    for (int64_t u = 0; u < s.l; ++u)
      for (int64_t t = 0; t < s.r; ++t) {
        double acc = 0;
        for (int64_t v = 0; v < s.s; ++v) {
          acc += w2v[(u * s.s + v) * s.r + t] * dov[b * m + v * s.l + u];
          rdw2[(u * s.s + v) * s.r + t] += dov[b * m + v * s.l + u] * y[b * mid + t * s.l + u];
        }
        dy[t * s.l + u] = acc;
      }
    for (int64_t i = 0; i < s.k; ++i)
      for (int64_t a = 0; a < s.p; ++a) {
        double acc = 0;
        for (int64_t cc = 0; cc < s.q; ++cc) {
          acc += w1v[(i * s.q + cc) * s.p + a] * dy[i * s.q + cc];
          rdw1[(i * s.q + cc) * s.p + a] += dy[i * s.q + cc] * xv[b * n + i * s.p + a];
        }
        rdx[b * n + i * s.p + a] = acc;
      }
  }
  const double tol = 2 * llmk_test::tolerance(c.dtype);
  EXPECT_LE(llmk_test::relative_error(dx, rdx), tol) << "dx";
  EXPECT_LE(llmk_test::relative_error(dw1, rdw1), tol) << "dw1";
  EXPECT_LE(llmk_test::relative_error(dw2, rdw2), tol) << "dw2";
}

INSTANTIATE_TEST_SUITE_P(Monarch, MonarchTest, testing::ValuesIn(cases()), case_name);
INSTANTIATE_TEST_SUITE_P(Monarch, MonarchBackwardTest, testing::ValuesIn(backward_cases()), case_name);

// Every (UB, TB) plan of the one-launch few-token kernel (LLMK_MONARCH_DECODE_PLAN), at 256 and 512
// threads per CTA (LLMK_MONARCH_DECODE_THREADS), on one shape
// that admits all of them (13 tokens: a partial last token group for every TB but 1; p = 40: 5
// chunks on groups of 8 lanes; strided rows of x), against float64; and a plan that does not fit
// is an error.
TEST(MonarchDecode, EveryPlan) {
  SKIP_WITHOUT_GPU(true);
  const Shape s{13, 8, 64, 40, 16, 24, 32};  // k*q = 512 = l*r; n = 320, m = 384
  const int64_t n = s.k * s.p, m = s.l * s.s;
  struct Restore {
    ~Restore() {
      unsetenv("LLMK_MONARCH_DECODE");
      unsetenv("LLMK_MONARCH_DECODE_PLAN");
      unsetenv("LLMK_MONARCH_DECODE_THREADS");
    }
  } restore;
  setenv("LLMK_MONARCH_DECODE", "1", 1);
  for (DType dt : {DType::f16, DType::bf16}) {
    Tensor x(dt, {s.tokens, n}, true, n + 8), w1(dt, {s.k, s.q, s.p}, true), w2(dt, {s.l, s.s, s.r}, true),
        out(dt, {s.tokens, m}, true);
    x.fill_random(-1, 1);
    w1.fill_random(-0.5, 0.5);
    w2.fill_random(-0.5, 0.5);
    std::vector<double> y, ref;
    forward_ref(s, values(x), values(w1), values(w2), y, ref);
    const std::size_t bytes = llmk::monarch_matmul_workspace_bytes(x.view(), w1.view(), w2.view());
    Tensor ws(DType::u8, {static_cast<int64_t>(bytes > 0 ? bytes : 1)}, true);
    for (const char* threads : {"256", "512"})
      for (int ub : {1, 2, 4})
        for (int tb : {1, 2, 4, 8, 16}) {
          if (ub * tb > 16) continue;
          const std::string plan = std::to_string(ub) + "x" + std::to_string(tb);
          setenv("LLMK_MONARCH_DECODE_THREADS", threads, 1);
          setenv("LLMK_MONARCH_DECODE_PLAN", plan.c_str(), 1);
          out.poison();
          llmk::monarch_matmul(out.view(), x.view(), w1.view(), w2.view(), bytes ? ws.view() : llmk::TensorView{});
          out.download();
          EXPECT_LE(llmk_test::relative_error(out, ref), llmk_test::tolerance(dt))
              << llmk::dtype_name(dt) << " plan " << plan << ", " << threads << " threads";
        }
    setenv("LLMK_MONARCH_DECODE_PLAN", "4x8", 1);
    EXPECT_EQ(llmk_test::error_of([&] {
                llmk::monarch_matmul(out.view(), x.view(), w1.view(), w2.view(), bytes ? ws.view() : llmk::TensorView{});
              }),
              "llmk::monarch_matmul: LLMK_MONARCH_DECODE_PLAN=4x8 does not suit this shape (UBxTB: UB in 1, 2, 4 "
              "dividing l and q, TB in 1, 2, 4, 8, 16, UB*TB <= 16, within shared memory)");
  }
}

// The tensor-core one-launch few-token kernel (LLMK_MONARCH_DECODE_MMA=1) runs, by its launch
// counter, on every shape it takes (on an sm_90 device with the sm_90a build; 1 to 16 tokens,
// clusters of C = 2, 4 and 8, 16 and 32 t per CTA, strided rows, p = 48) and matches float64;
// shapes outside it (l = 4; s = 120) take another path.
TEST(MonarchDecodeMma, RunsWhereItApplies) {
  SKIP_WITHOUT_GPU(true);
  if (llmk::detail::hopper_status(0) != llmk::detail::HopperStatus::available)
    GTEST_SKIP() << "not an sm_90 device with the sm_90a build";
  struct Restore {
    ~Restore() { unsetenv("LLMK_MONARCH_DECODE_MMA"); }
  } restore;
  setenv("LLMK_MONARCH_DECODE_MMA", "1", 1);
  struct Run {
    Shape s;
    bool takes;
  };
  const Run runs[] = {
      {{16, 64, 128, 128, 64, 128, 128}, true}, {{1, 64, 128, 128, 64, 128, 128}, true},
      {{13, 64, 64, 64, 64, 64, 64}, true},     {{2, 64, 32, 32, 64, 32, 32}, true},
      {{9, 16, 96, 48, 24, 64, 64}, true},      {{5, 8, 256, 64, 8, 128, 256}, true},
      {{8, 2, 48, 40, 4, 24, 24}, false},       {{13, 16, 200, 96, 16, 120, 200}, false},
  };
  for (const Run& run : runs) {
    const Shape& s = run.s;
    for (DType dt : {DType::f16, DType::bf16}) {
      const int64_t n = s.k * s.p, m = s.l * s.s;
      Tensor x(dt, {s.tokens, n}, true, n + 24), w1(dt, {s.k, s.q, s.p}, true), w2(dt, {s.l, s.s, s.r}, true),
          out(dt, {s.tokens, m}, true);
      x.fill_random(-1, 1);
      w1.fill_random(-0.5, 0.5);
      w2.fill_random(-0.5, 0.5);
      out.poison();
      std::vector<double> y, ref;
      forward_ref(s, values(x), values(w1), values(w2), y, ref);
      const std::size_t bytes = llmk::monarch_matmul_workspace_bytes(x.view(), w1.view(), w2.view());
      Tensor ws(DType::u8, {static_cast<int64_t>(bytes > 0 ? bytes : 1)}, true);
      const int64_t before = llmk::detail::monarch_decode_mma_launches();
      llmk::monarch_matmul(out.view(), x.view(), w1.view(), w2.view(), bytes ? ws.view() : llmk::TensorView{});
      out.download();
      const std::string name = std::string(llmk::dtype_name(dt)) + " tokens " + std::to_string(s.tokens) + " w1 " +
                               std::to_string(s.k) + "x" + std::to_string(s.q) + "x" + std::to_string(s.p) + " w2 " +
                               std::to_string(s.l) + "x" + std::to_string(s.s) + "x" + std::to_string(s.r);
      EXPECT_EQ(llmk::detail::monarch_decode_mma_launches(), before + (run.takes ? 1 : 0)) << name;
      EXPECT_LE(llmk_test::relative_error(out, ref), llmk_test::tolerance(dt)) << name;
    }
  }
}

TEST(MonarchErrors, BadInputs) {
  using llmk_test::error_of;
  Tensor x(DType::f32, {3, 64}, false), w1(DType::f32, {4, 16, 16}, false), w2(DType::f32, {4, 16, 16}, false),
      out(DType::f32, {3, 64}, false);
  Tensor w1_bad_p(DType::f32, {4, 16, 15}, false), w2_bad(DType::f32, {4, 16, 8}, false),
      w_2d(DType::f32, {4, 16}, false), x16(DType::f16, {3, 64}, false), out_bad(DType::f32, {3, 63}, false);
  EXPECT_EQ(error_of([&] { llmk::monarch_matmul(out.view(), x.view(), w1_bad_p.view(), w2.view()); }),
            "llmk::monarch_matmul: x: expected a last dim of k*p = 60 (w1 is (4, 16, 15)), got 64");
  EXPECT_EQ(error_of([&] { llmk::monarch_matmul(out.view(), x.view(), w1.view(), w2_bad.view()); }),
            "llmk::monarch_matmul: w2: expected l*r == k*q = 64 (w1 is (4, 16, 16)), got shape (4, 16, 8) with l*r = 32");
  EXPECT_EQ(error_of([&] { llmk::monarch_matmul(out.view(), x.view(), w_2d.view(), w2.view()); }),
            "llmk::monarch_matmul: w1: expected 3 dims, got 2 dims with shape (4, 16)");
  EXPECT_EQ(error_of([&] { llmk::monarch_matmul(out.view(), x16.view(), w1.view(), w2.view()); }),
            "llmk::monarch_matmul: w1: expected dtype float16 (the dtype of x), got float32");
  EXPECT_EQ(error_of([&] { llmk::monarch_matmul(out_bad.view(), x.view(), w1.view(), w2.view()); }),
            "llmk::monarch_matmul: out: expected shape (3, 64), got (3, 63)");
  Tensor dw1_bad(DType::f32, {4, 16, 15}, false), dx(DType::f32, {3, 64}, false), dw1(DType::f32, {4, 16, 16}, false),
      dw2(DType::f32, {4, 16, 16}, false);
  EXPECT_EQ(error_of([&] {
              llmk::monarch_matmul_backward(dx.view(), dw1_bad.view(), dw2.view(), out.view(), x.view(), w1.view(),
                                            w2.view());
            }),
            "llmk::monarch_matmul_backward: dw1: expected shape (4, 16, 16) (the shape of w1), got (4, 16, 15)");
  EXPECT_EQ(error_of([&] {
              llmk::monarch_matmul_backward(dx.view(), dw1.view(), dw2.view(), out.view(), x.view(), w1.view(),
                                            w2.view());
            }),
            "<no error>");
}

}  // namespace

namespace {

// A few tokens run as two kernels through a workspace (too few tiles for the fused kernel): a
// missing or short workspace is an error, not a crash.
TEST(MonarchErrors, GpuWorkspaceRequired) {
  SKIP_WITHOUT_GPU(true);
  Tensor x(DType::bf16, {3, 64}, true), w1(DType::bf16, {4, 16, 16}, true), w2(DType::bf16, {4, 16, 16}, true),
      out(DType::bf16, {3, 64}, true);
  const std::size_t bytes = llmk::monarch_matmul_workspace_bytes(x.view(), w1.view(), w2.view());
  EXPECT_EQ(bytes, 3u * 64u * 2u);
  EXPECT_EQ(llmk_test::error_of([&] { llmk::monarch_matmul(out.view(), x.view(), w1.view(), w2.view()); }),
            "llmk::monarch_matmul: workspace: expected at least " + std::to_string(bytes) + " bytes, got 0");
  Tensor dx(DType::bf16, {3, 64}, true), dw1(DType::bf16, {4, 16, 16}, true), dw2(DType::bf16, {4, 16, 16}, true);
  EXPECT_NE(llmk_test::error_of([&] {
              llmk::monarch_matmul_backward(dx.view(), dw1.view(), dw2.view(), out.view(), x.view(), w1.view(),
                                            w2.view());
            }).find("monarch_matmul_backward: workspace: expected at least"),
            std::string::npos);
}

}  // namespace
