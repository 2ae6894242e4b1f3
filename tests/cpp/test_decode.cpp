// Decode attention vs a float64 reference: contiguous and paged caches (shuffled block tables,
// block sizes that do not divide the lengths), GQA ratios 1, 4, 8, 32, T = 1..8 new tokens with the
// causal convention of decode.h, seq_lens 0 and 1 and odd lengths, forced and automatic KV splits
// on the GPU; attention masks (DecodeOptions::attn_mask: boolean and additive, shared and per
// token, every GPU kernel and the staged mask); write_kv_cache into both layouts; bad input.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "llmk/decode.h"
#include "support/tensors.h"
#include "support/testing.h"

using llmk::DType;
using llmk_test::Ints;
using llmk_test::Tensor;

namespace {

// GPU workspace sized by the query.
struct Workspace {
  void* ptr = nullptr;
  std::size_t bytes = 0;
  Workspace(std::size_t n, bool gpu) : bytes(n) { if (gpu && n) ptr = llmk_test::gpu_alloc(n); }
  ~Workspace() { if (ptr) llmk_test::gpu_free(ptr); }
};

struct Case {
  bool gpu;
  DType dtype;
  int64_t tokens, hq, hkv, head_dim;
  int64_t block_size;  // 0: contiguous cache
  std::vector<int64_t> lens;
  int splits;               // GPU: 0 automatic
  int64_t max_seq_len = 0;  // GPU heuristic hint (results must stay exact when it is too small)
};

std::string case_name(const testing::TestParamInfo<Case>& info) {
  const Case& c = info.param;
  std::string s = std::string(c.gpu ? "gpu_" : "cpu_") + llmk::dtype_name(c.dtype) + "_t" + std::to_string(c.tokens) +
                  "_q" + std::to_string(c.hq) + "kv" + std::to_string(c.hkv) + "_d" + std::to_string(c.head_dim) +
                  (c.block_size ? "_paged" + std::to_string(c.block_size) : std::string("_contig")) + "_b" +
                  std::to_string(c.lens.size()) + "_s" + std::to_string(c.splits) +
                  (c.max_seq_len ? "_hint" + std::to_string(c.max_seq_len) : std::string()) + "_i" + std::to_string(info.index);
  return s;
}

std::vector<Case> cases() {
  std::vector<Case> out;
  const std::vector<int64_t> lens = {0, 1, 77, 333};
  for (bool gpu : {false, true})
    for (DType dt : {DType::f32, DType::f16, DType::bf16}) {
      if (gpu && dt == DType::f32) continue;
      for (int64_t bs : {0, 16, 48, 256}) {
        out.push_back({gpu, dt, 1, 4, 4, 64, bs, lens, 0});        // MHA
        out.push_back({gpu, dt, 1, 32, 8, 128, bs, lens, 0});      // ratio 4 (LLaMA 3 8B)
        out.push_back({gpu, dt, 3, 16, 2, 128, bs, {5, 130}, 0});  // ratio 8, 3 tokens
        out.push_back({gpu, dt, 8, 32, 1, 64, bs, {9, 1, 200}, 0}); // ratio 32, 8 tokens (256 rows)
        out.push_back({gpu, dt, 2, 8, 2, 256, bs, {300, 2}, 0});
        out.push_back({gpu, dt, 2, 16, 2, 64, bs, {5, 130, 0}, 0});  // ratio 8, 2 tokens: a full m16 tile (mma)
      }
      out.push_back({gpu, dt, 1, 8, 2, 128, 16, {1000, 17}, 1});   // one split, no merge
      out.push_back({gpu, dt, 4, 8, 2, 128, 0, {1000, 600}, 7});   // forced splits
      out.push_back({gpu, dt, 1, 32, 8, 128, 16, {1000, 600, 5}, 7});  // forced splits, 4 rows
      out.push_back({gpu, dt, 8, 4, 1, 64, 32, {1}, 3});           // more tokens than keys
      out.push_back({gpu, dt, 2, 8, 2, 128, 16, {1000, 300}, 0, 100});  // hint far too small
      out.push_back({gpu, dt, 1, 8, 8, 64, 0, {1000, 999, 64}, 0, 1000});
      out.push_back({gpu, dt, 5, 6, 2, 128, 48, {7, 333, 1}, 0});      // ratio 3, 5 tokens: 15 rows
      out.push_back({gpu, dt, 8, 4, 2, 128, 16, {9, 700}, 5});         // 8 tokens x ratio 2, forced splits
      out.push_back({gpu, dt, 1, 16, 1, 128, 256, {4100, 3}, 0});      // ratio 16, long: many tiles and splits
      out.push_back({gpu, dt, 1, 32, 8, 128, 64, {1000, 130}, 0});     // pages of one 64-key tile
      out.push_back({gpu, dt, 1, 32, 8, 128, 0, {3001}, 16});          // batch 1: 16 splits of 4 tiles (workspace merge)
      out.push_back({gpu, dt, 1, 32, 8, 128, 16, {3001}, 16});         // the same paged: two groups, each its own pages
      out.push_back({gpu, dt, 2, 16, 4, 64, 0, {2500, 1900}, 8});      // 8 splits of many tiles, D = 64 (cluster merge)
      out.push_back({gpu, dt, 1, 8, 2, 64, 8, {333, 70}, 0});          // 8 pages per tile (TMA's smallest)
      out.push_back({gpu, dt, 1, 8, 2, 128, 128, {700, 3}, 4});        // two tiles per page
      if (!gpu) out.push_back({gpu, dt, 2, 6, 3, 40, 16, {50, 0}, 0});  // any head dim on the CPU
    }
  return out;
}

// The cache of a test: contiguous (B, Hkv, Smax = max_len + 5, D), or paged (num_blocks,
// block_size, Hkv, D) where each sequence gets ceil(max_len / bs) + 1 table entries, blocks
// shuffled over a pool with spare blocks.
struct CacheLayout {
  bool paged;
  int64_t hkv, bs, max_blocks, num_blocks, smax;
  std::vector<int64_t> table, shape;
  CacheLayout(int64_t B, int64_t hkv_, int64_t D, int64_t max_len, int64_t block_size)
      : paged(block_size > 0), hkv(hkv_), bs(paged ? block_size : 1),
        max_blocks(paged ? (max_len + bs - 1) / bs + 1 : 0), num_blocks(paged ? B * max_blocks + 3 : 0),
        smax(max_len + 5), table(B * max_blocks) {
    if (paged) {
      std::vector<int64_t> perm(num_blocks);
      std::iota(perm.begin(), perm.end(), 0);
      std::shuffle(perm.begin(), perm.end(), llmk_test::rng());
      std::copy(perm.begin(), perm.begin() + table.size(), table.begin());
    }
    shape = paged ? std::vector<int64_t>{num_blocks, bs, hkv, D} : std::vector<int64_t>{B, hkv, smax, D};
  }
  // the cache row of (sequence b, KV head h, position pos)
  int64_t row_of(int64_t b, int64_t h, int64_t pos) const {
    if (!paged) return (b * hkv + h) * smax + pos;
    return (table[b * max_blocks + pos / bs] * bs + pos % bs) * hkv + h;
  }
};

class DecodeTest : public testing::TestWithParam<Case> {};

TEST_P(DecodeTest, MatchesFloat64) {
  const Case& c = GetParam();
  SKIP_WITHOUT_GPU(c.gpu);
  const int64_t B = static_cast<int64_t>(c.lens.size()), D = c.head_dim;
  const int64_t max_len = *std::max_element(c.lens.begin(), c.lens.end());
  const CacheLayout L(B, c.hkv, D, max_len, c.block_size);
  const bool paged = L.paged;
  Tensor q(c.dtype, {B, c.tokens, c.hq, D}, c.gpu), out(c.dtype, {B, c.tokens, c.hq, D}, c.gpu);
  Tensor kc(c.dtype, L.shape, c.gpu), vc(c.dtype, L.shape, c.gpu);
  q.fill_random();
  kc.fill_random();
  vc.fill_random();
  auto row_of = [&](int64_t b, int64_t h, int64_t pos) { return L.row_of(b, h, pos); };
  // cache slots past a sequence's length hold NaN: no kernel may let them reach the output (a
  // TMA tile reads them, and a zero weight times NaN is NaN)
  const int64_t slots = paged ? L.max_blocks * L.bs : L.smax;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < c.hkv; ++h)
      for (int64_t pos = c.lens[b]; pos < slots; ++pos)
        for (int64_t i = 0; i < D; ++i) {
          kc.set(row_of(b, h, pos), i, std::numeric_limits<double>::quiet_NaN());
          vc.set(row_of(b, h, pos), i, std::numeric_limits<double>::quiet_NaN());
        }
  kc.upload();
  vc.upload();
  out.poison();
  Ints lens({B}, c.lens, c.gpu), tab({B, L.max_blocks}, L.table, c.gpu);
  std::vector<double> want(B * c.tokens * c.hq * D, 0.0);
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < c.tokens; ++t)
      for (int64_t h = 0; h < c.hq; ++h) {
        const int64_t hk = h / (c.hq / c.hkv), qrow = (b * c.tokens + t) * c.hq + h;
        const int64_t n = std::max<int64_t>(0, c.lens[b] - c.tokens + t + 1);
        std::vector<double> s(n);
        double mx = -std::numeric_limits<double>::infinity(), sum = 0;
        for (int64_t j = 0; j < n; ++j) {
          double d = 0;
          for (int64_t i = 0; i < D; ++i) d += q.get(qrow, i) * kc.get(row_of(b, hk, j), i);
          s[j] = d * scale;
          mx = std::max(mx, s[j]);
        }
        for (int64_t j = 0; j < n; ++j) sum += (s[j] = std::exp(s[j] - mx));
        for (int64_t j = 0; j < n; ++j)
          for (int64_t i = 0; i < D; ++i) want[qrow * D + i] += s[j] / sum * vc.get(row_of(b, hk, j), i);
      }
  llmk::DecodeOptions opt;
  opt.num_splits = c.splits;
  opt.max_seq_len = c.max_seq_len;
  const llmk::TensorView table_view = paged ? tab.view() : llmk::TensorView{};
  // GPU: each kernel forced by LLMK_DECODE_KERNEL (mma: tensor cores, the default, which falls
  // back to warp / split for shapes it does not serve; on the H200 with a contiguous cache its K/V
  // tiles come by TMA and its splits merge in a thread block cluster, "mma-workspace" merges them
  // through the workspace (LLMK_DECODE_CLUSTER=0), "mma-cp.async" loads as on other GPUs
  // (LLMK_DECODE_TMA=0), "mma-1group" / "mma-2groups" the TMA kernel with one or two warp groups
  // per block (LLMK_DECODE_GROUPS; by default two where the grid fits the multiprocessors and the
  // splits merge without a cluster, as "mma-workspace" does here; paged caches too); warp;
  // split: the previous one); three times each so that the in-kernel split counters are seen reset
  // by the kernel itself: the second and third calls skip their memset (workspace_zeroed), relying
  // on the call before to leave them zero.
  unsetenv("LLMK_DECODE_LEGACY");
  for (const std::string name : {"warp", "mma", "mma-workspace", "mma-cp.async", "mma-1group", "mma-2groups", "split"}) {
    if (!c.gpu && name != "warp") break;
    const std::string kernel = name.substr(0, name.find('-'));
    setenv("LLMK_DECODE_KERNEL", kernel.c_str(), 1);
    setenv("LLMK_DECODE_TMA", name == "mma-cp.async" ? "0" : "1", 1);
    setenv("LLMK_DECODE_CLUSTER", name == "mma-workspace" ? "0" : "1", 1);
    if (name == "mma-1group" || name == "mma-2groups") setenv("LLMK_DECODE_GROUPS", name == "mma-1group" ? "1" : "2", 1);
    else unsetenv("LLMK_DECODE_GROUPS");
    Workspace ws(llmk::decode_attention_workspace_size(q.view(), kc.view(), table_view, opt), c.gpu);
    if (c.gpu && c.splits > 1) {
      // A forced split count is an upper bound: short caches use fewer splits (one needs no workspace).
      const int64_t splits = llmk::decode_attention_num_splits(q.view(), kc.view(), table_view, opt);
      EXPECT_LE(splits, c.splits);
      if (splits > 1) EXPECT_GT(ws.bytes, 0u);
    }
    for (int rep = 0; rep < (c.gpu ? 3 : 1); ++rep) {
      out.poison();
      llmk::DecodeOptions call_opt = opt;
      call_opt.workspace_zeroed = rep > 0;
      llmk::decode_attention(out.view(), q.view(), kc.view(), vc.view(), lens.view(), table_view, call_opt, ws.ptr,
                             ws.bytes);
      out.download();
      EXPECT_LT(llmk_test::relative_error(out, want), llmk_test::tolerance(c.dtype)) << "kernel " << name << ", call " << rep;
      // rows that see no key are exactly zero
      for (int64_t b = 0; b < B; ++b)
        for (int64_t t = 0; t < c.tokens; ++t)
          if (c.lens[b] - c.tokens + t < 0)
            for (int64_t h = 0; h < c.hq; ++h) EXPECT_EQ(out.get((b * c.tokens + t) * c.hq + h, 0), 0.0);
    }
  }
  unsetenv("LLMK_DECODE_KERNEL");
  unsetenv("LLMK_DECODE_TMA");
  unsetenv("LLMK_DECODE_CLUSTER");
  unsetenv("LLMK_DECODE_GROUPS");
}

INSTANTIATE_TEST_SUITE_P(Decode, DecodeTest, testing::ValuesIn(cases()), case_name);

TEST(DecodeTest, SplitHeuristicFillsTheGpuAtBatchOne) {
  SKIP_WITHOUT_GPU(true);
  Tensor q(DType::bf16, {1, 1, 32, 128}, true), kc(DType::bf16, {1, 8, 4096, 128}, true);
  // the plan without the cluster merge (see cluster_merge_wanted) fills the GPU with splits
  setenv("LLMK_DECODE_CLUSTER", "0", 1);
  for (const char* kernel : {"warp", "mma"}) {
    setenv("LLMK_DECODE_KERNEL", kernel, 1);
    const int splits = llmk::decode_attention_num_splits(q.view(), kc.view(), llmk::TensorView{});
    EXPECT_GE(splits * 8, 100) << kernel << ": 8 KV heads x " << splits << " splits cannot fill the GPU";
    EXPECT_GT(llmk::decode_attention_workspace_size(q.view(), kc.view(), llmk::TensorView{}), 0u) << kernel;
  }
  setenv("LLMK_DECODE_KERNEL", "mma", 1);
  // the mma kernel's rule (kMmaSplits) on the H200's 132 multiprocessors: one split below 512 keys
  // (the 1B model's step at 203 slots); 1080 keys make 9 splits of 2 tiles (the last one shorter),
  // 8 x 9 blocks; 4096 keys keep 16 of 4 tiles, the 256-key rule's count (32 of 2 tiles would be 2
  // blocks a multiprocessor)
  if (llmk_test::gpu_is_sm90()) {
    Tensor q64(DType::bf16, {1, 1, 32, 64}, true), kc203(DType::bf16, {1, 8, 203, 64}, true),
        kc1080(DType::bf16, {1, 8, 1080, 64}, true);
    EXPECT_EQ(llmk::decode_attention_num_splits(q64.view(), kc203.view(), llmk::TensorView{}), 1);
    EXPECT_EQ(llmk::decode_attention_num_splits(q64.view(), kc1080.view(), llmk::TensorView{}), 9);
    EXPECT_EQ(llmk::decode_attention_num_splits(q.view(), kc.view(), llmk::TensorView{}), 16);
  }
  // with the cluster merge (the default) on the H200 (TMA): exactly 8 clustered splits of 4096
  // keys, one block on each of 64 multiprocessors; a paged cache keeps the fill (block size 16: 8
  // clustered splits measured slower there)
  unsetenv("LLMK_DECODE_CLUSTER");
  const int64_t splits = llmk::decode_attention_num_splits(q.view(), kc.view(), llmk::TensorView{});
  if (llmk_test::gpu_is_sm90()) EXPECT_EQ(splits, 8);
  else EXPECT_GE(splits, 8);
  Tensor pages(DType::bf16, {256, 16, 8, 128}, true);
  Ints table({1, 256}, std::vector<int64_t>(256, 0), true);
  EXPECT_GE(llmk::decode_attention_num_splits(q.view(), pages.view(), table.view()) * 8, 100);
  // LLMK_DECODE_SPLITS forces the count where the call leaves it to the plan, for every kernel
  unsetenv("LLMK_DECODE_CLUSTER");
  for (const char* kernel : {"warp", "mma", "split"}) {
    setenv("LLMK_DECODE_KERNEL", kernel, 1);
    setenv("LLMK_DECODE_SPLITS", "3", 1);
    EXPECT_EQ(llmk::decode_attention_num_splits(q.view(), kc.view(), llmk::TensorView{}), 3) << kernel;
    llmk::DecodeOptions two;
    two.num_splits = 2;  // a count the caller asks for wins
    EXPECT_EQ(llmk::decode_attention_num_splits(q.view(), kc.view(), llmk::TensorView{}, two), 2) << kernel;
    setenv("LLMK_DECODE_SPLITS", "0", 1);
    EXPECT_GT(llmk::decode_attention_num_splits(q.view(), kc.view(), llmk::TensorView{}), 3) << kernel;
  }
  for (const char* bad : {"x", "-1", "257", "4x"}) {
    setenv("LLMK_DECODE_SPLITS", bad, 1);
    EXPECT_EQ(llmk_test::error_of([&] { llmk::decode_attention_num_splits(q.view(), kc.view(), llmk::TensorView{}); }),
              std::string("llmk::decode_attention: LLMK_DECODE_SPLITS: expected an integer in [0, 256], got '") + bad +
                  "'");
  }
  unsetenv("LLMK_DECODE_SPLITS");
  setenv("LLMK_DECODE_KERNEL", "tensor", 1);
  EXPECT_EQ(llmk_test::error_of([&] { llmk::decode_attention_num_splits(q.view(), kc.view(), llmk::TensorView{}); }),
            "llmk::decode_attention: LLMK_DECODE_KERNEL: expected warp, mma or split, got 'tensor'");
  unsetenv("LLMK_DECODE_KERNEL");
  unsetenv("LLMK_DECODE_CLUSTER");
}

// A bad block index on the GPU: that sequence's output is NaN, the other sequence is exact.
TEST(DecodeTest, GpuBadBlockGivesNanForThatSequenceOnly) {
  SKIP_WITHOUT_GPU(true);
  const int64_t D = 64;
  Tensor q(DType::f16, {2, 1, 2, D}, true), out(DType::f16, {2, 1, 2, D}, true);
  Tensor kc(DType::f16, {4, 16, 1, D}, true), vc(DType::f16, {4, 16, 1, D}, true);
  q.fill_random();
  kc.fill_random();
  vc.fill_random();
  out.poison();
  Ints lens({2}, {20, 20}, true);
  // the previous kernel through its older switch (LLMK_DECODE_LEGACY=1), the default, the mma kernel
  // with its pages by TMA (on the H200) and by cp.async; a block past the pool and a negative one
  for (const int64_t bad_block : {99, -1})
  for (const std::string name : {"legacy", "warp", "mma", "mma-cp.async"})
  for (int splits : {1, 2}) {
    Ints tab({2, 2}, {0, 1, 2, bad_block}, true);
    const std::string kernel = name.substr(0, name.find('-'));
    const bool legacy = kernel == "legacy";
    setenv("LLMK_DECODE_LEGACY", legacy ? "1" : "0", 1);
    setenv("LLMK_DECODE_TMA", name == "mma-cp.async" ? "0" : "1", 1);
    if (legacy) unsetenv("LLMK_DECODE_KERNEL");
    else setenv("LLMK_DECODE_KERNEL", kernel.c_str(), 1);
    llmk::DecodeOptions opt;
    opt.num_splits = splits;
    Workspace ws(llmk::decode_attention_workspace_size(q.view(), kc.view(), tab.view(), opt), true);
    llmk::decode_attention(out.view(), q.view(), kc.view(), vc.view(), lens.view(), tab.view(), opt, ws.ptr, ws.bytes);
    out.download();
    for (int64_t h = 0; h < 2; ++h) {
      EXPECT_TRUE(std::isfinite(out.get(h, 0))) << name << " " << splits << " block " << bad_block;
      EXPECT_TRUE(std::isnan(out.get(2 + h, 0))) << name << " " << splits << " block " << bad_block;
    }
  }
  unsetenv("LLMK_DECODE_LEGACY");
  unsetenv("LLMK_DECODE_KERNEL");
  unsetenv("LLMK_DECODE_TMA");
}

// A sequence length past a contiguous cache on the GPU: that sequence's output is NaN (never read
// out of bounds), the other sequence is exact; every kernel and merge (one split, the workspace,
// the cluster), several split counts.
TEST(DecodeTest, GpuBadLengthGivesNanForThatSequenceOnly) {
  SKIP_WITHOUT_GPU(true);
  const int64_t B = 2, hq = 8, hkv = 2, D = 128, S = 600;
  Tensor q(DType::bf16, {B, 1, hq, D}, true), out(DType::bf16, {B, 1, hq, D}, true);
  Tensor kc(DType::bf16, {B, hkv, S, D}, true), vc(DType::bf16, {B, hkv, S, D}, true);
  q.fill_random();
  kc.fill_random();
  vc.fill_random();
  Ints lens({B}, {S, S + 7}, true);
  struct Config { const char* kernel; const char* tma; const char* cluster; const char* groups = "2"; };
  for (const Config& cfg : {Config{"mma", "1", "1"}, Config{"mma", "1", "0"}, Config{"mma", "0", "0"},
                            Config{"mma", "1", "1", "1"}, Config{"mma", "1", "0", "1"}, Config{"warp", "1", "1"}})
    for (int splits : {1, 2, 5}) {
      setenv("LLMK_DECODE_KERNEL", cfg.kernel, 1);
      setenv("LLMK_DECODE_TMA", cfg.tma, 1);
      setenv("LLMK_DECODE_CLUSTER", cfg.cluster, 1);
      setenv("LLMK_DECODE_GROUPS", cfg.groups, 1);
      llmk::DecodeOptions opt;
      opt.num_splits = splits;
      Workspace ws(llmk::decode_attention_workspace_size(q.view(), kc.view(), {}, opt), true);
      out.poison();
      llmk::decode_attention(out.view(), q.view(), kc.view(), vc.view(), lens.view(), {}, opt, ws.ptr, ws.bytes);
      out.download();
      const std::string what = std::string(cfg.kernel) + " tma " + cfg.tma + " cluster " + cfg.cluster + " groups " +
                               cfg.groups + ", num_splits " + std::to_string(splits);
      for (int64_t h = 0; h < hq; ++h)
        for (int64_t i = 0; i < D; i += 31) {
          EXPECT_TRUE(std::isfinite(out.get(h, i))) << what;
          EXPECT_TRUE(std::isnan(out.get(hq + h, i))) << what;
        }
    }
  unsetenv("LLMK_DECODE_KERNEL");
  unsetenv("LLMK_DECODE_TMA");
  unsetenv("LLMK_DECODE_CLUSTER");
  unsetenv("LLMK_DECODE_GROUPS");
  // an unknown warp-group count is an error, not a silent default
  setenv("LLMK_DECODE_GROUPS", "3", 1);
  Workspace ws(llmk::decode_attention_workspace_size(q.view(), kc.view(), {}, {}), true);
  EXPECT_EQ(llmk_test::error_of([&] {
              llmk::decode_attention(out.view(), q.view(), kc.view(), vc.view(), lens.view(), {}, {}, ws.ptr, ws.bytes);
            }),
            "llmk::decode_attention: LLMK_DECODE_GROUPS: expected 1 or 2, got '3'");
  unsetenv("LLMK_DECODE_GROUPS");
}

TEST(DecodeTest, BadInput) {
  using llmk_test::error_of;
  const int64_t D = 64;
  Tensor q(DType::f32, {2, 1, 6, D}, false), out(DType::f32, {2, 1, 6, D}, false);
  Tensor kc(DType::f32, {2, 4, 10, D}, false), vc(DType::f32, {2, 4, 10, D}, false);
  Tensor k16(DType::f16, {2, 4, 10, D}, false);
  Tensor out8(DType::f32, {2, 1, 8, D}, false);
  Ints lens({2}, {3, 4}, false), lens64({2}, {3, 4}, false, true), long_lens({2}, {3, 11}, false);
  auto call = [&](const Tensor& qq, const Tensor& kk, const Ints& ll, llmk::TensorView table = {}) {
    const Tensor& o = qq.view().shape[2] == 8 ? out8 : out;
    return error_of([&] {
      llmk::decode_attention(o.view(), qq.view(), kk.view(), vc.view(), ll.view(), table, {}, nullptr, 0);
    });
  };
  EXPECT_EQ(call(q, kc, lens),
            "llmk::decode_attention: q: expected a number of heads that is a multiple of the KV heads 4 (GQA), "
            "got 6 heads in shape (2, 1, 6, 64)");
  Tensor q4(DType::f32, {2, 1, 8, D}, false);
  EXPECT_EQ(call(q4, k16, lens), "llmk::decode_attention: k_cache: expected dtype float32 (the dtype of q), got float16");
  EXPECT_EQ(call(q4, kc, lens64), "<no error>");  // int32 or int64
  Tensor flens(DType::f32, {2}, false);
  EXPECT_EQ(error_of([&] {
              llmk::decode_attention(out8.view(), q4.view(), kc.view(), vc.view(), flens.view(), {}, {}, nullptr, 0);
            }),
            "llmk::decode_attention: seq_lens: expected dtype int32 or int64, got float32");
  EXPECT_EQ(error_of([&] {
              llmk::decode_attention(out.view(), q4.view(), kc.view(), vc.view(), lens.view(), {}, {}, nullptr, 0);
            }),
            "llmk::decode_attention: out: expected shape (2, 1, 8, 64) (the shape of q), got (2, 1, 6, 64)");
  EXPECT_EQ(error_of([&] {
              llmk::decode_attention(out8.view(), q4.view(), kc.view(), vc.view(), long_lens.view(), {}, {}, nullptr, 0);
            }),
            "llmk::decode_attention: seq_lens: expected values in [0, 10] (the cache capacity), got 11 for sequence 1");
  Tensor q9(DType::f32, {2, 9, 8, D}, false);
  EXPECT_EQ(call(q9, kc, lens),
            "llmk::decode_attention: q: expected (batch, tokens, heads, head_dim) with 1 to 8 tokens, got shape "
            "(2, 9, 8, 64)");
  // paged: a block index outside the cache
  Tensor pk(DType::f32, {3, 16, 4, D}, false), pv(DType::f32, {3, 16, 4, D}, false);
  Ints table({2, 1}, {0, 3}, false), lens2({2}, {5, 5}, false);
  EXPECT_EQ(error_of([&] {
              llmk::decode_attention(out8.view(), q4.view(), pk.view(), pv.view(), lens2.view(), table.view(), {},
                                     nullptr, 0);
            }),
            "llmk::decode_attention: block_table: expected block indices in [0, 3) (the cache's blocks), got 3 at [1, 0]");
  Ints table3({3, 1}, {0, 1, 2}, false);
  EXPECT_EQ(error_of([&] {
              llmk::decode_attention(out8.view(), q4.view(), pk.view(), pv.view(), lens2.view(), table3.view(), {},
                                     nullptr, 0);
            }),
            "llmk::decode_attention: block_table: expected shape (2, max_blocks) (the batch of q), got (3, 1)");
  // write_kv_cache: a position beyond the cache
  Tensor k(DType::f32, {2, 1, 4, D}, false), v(DType::f32, {2, 1, 4, D}, false);
  Ints pos({2, 1}, {0, 10}, false);
  EXPECT_EQ(error_of([&] { llmk::write_kv_cache(kc.view(), vc.view(), k.view(), v.view(), pos.view(), {}); }),
            "llmk::write_kv_cache: positions: expected values below 10 (the cache capacity), got 10 at [1, 0]");
  Tensor k3(DType::f32, {2, 1, 3, D}, false);
  EXPECT_EQ(error_of([&] { llmk::write_kv_cache(kc.view(), vc.view(), k3.view(), k3.view(), pos.view(), {}); }),
            "llmk::write_kv_cache: k: expected 4 heads (the KV heads of k_cache), got shape (2, 1, 3, 64)");
}

struct WriteCase {
  bool gpu;
  DType dtype;
  int64_t block_size;  // 0: contiguous
  bool int64_positions;
  int64_t head_dim = 24;  // 24: 16-byte pieces on the GPU (8 of f16/bf16, 4 of f32); 20: elements (f16/bf16)
};

class WriteKvTest : public testing::TestWithParam<WriteCase> {};

TEST_P(WriteKvTest, WritesEveryLayout) {
  const WriteCase& c = GetParam();
  SKIP_WITHOUT_GPU(c.gpu);
  const int64_t B = 2, T = 3, H = 2, D = c.head_dim, smax = 40, bs = c.block_size ? c.block_size : 1;
  const bool paged = c.block_size > 0;
  const int64_t max_blocks = paged ? (smax + bs - 1) / bs : 0, num_blocks = paged ? B * max_blocks : 0;
  std::vector<int64_t> table(B * max_blocks);
  std::iota(table.begin(), table.end(), 0);
  std::shuffle(table.begin(), table.end(), llmk_test::rng());
  std::vector<int64_t> shape = paged ? std::vector<int64_t>{num_blocks, bs, H, D} : std::vector<int64_t>{B, H, smax, D};
  Tensor kc(c.dtype, shape, c.gpu), vc(c.dtype, shape, c.gpu), k(c.dtype, {B, T, H, D}, c.gpu), v(c.dtype, {B, T, H, D}, c.gpu);
  kc.fill_random();
  vc.fill_random();
  k.fill_random();
  v.fill_random();
  std::vector<double> want_k(kc.rows() * D), want_v(vc.rows() * D);
  for (int64_t r = 0; r < kc.rows(); ++r)
    for (int64_t d = 0; d < D; ++d) {
      want_k[r * D + d] = kc.get(r, d);
      want_v[r * D + d] = vc.get(r, d);
    }
  const std::vector<int64_t> positions = {5, 6, 39, -1, 17, 0};  // -1: padding, skipped
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t) {
      const int64_t p = positions[b * T + t];
      if (p < 0) continue;
      for (int64_t h = 0; h < H; ++h) {
        const int64_t row = paged ? (table[b * max_blocks + p / bs] * bs + p % bs) * H + h : (b * H + h) * smax + p;
        for (int64_t d = 0; d < D; ++d) {
          want_k[row * D + d] = k.get((b * T + t) * H + h, d);
          want_v[row * D + d] = v.get((b * T + t) * H + h, d);
        }
      }
    }
  Ints pos({B, T}, positions, c.gpu, c.int64_positions), tab({B, max_blocks}, table, c.gpu);
  llmk::write_kv_cache(kc.view(), vc.view(), k.view(), v.view(), pos.view(), paged ? tab.view() : llmk::TensorView{});
  kc.download();
  vc.download();
  EXPECT_EQ(llmk_test::relative_error(kc, want_k), 0.0);
  EXPECT_EQ(llmk_test::relative_error(vc, want_v), 0.0);
}

// write_kv_cache's `advance`: the length counter moves by T once the positions are read: in the
// write's launch for one sequence and one token, where the positions are a view of the counter
// itself (as a Hugging Face static cache has them), and in a second launch for several blocks;
// int32 and int64 counters, CPU and GPU; bad counters.
class WriteKvAdvanceTest : public testing::TestWithParam<bool> {};

TEST_P(WriteKvAdvanceTest, MovesTheLengthAfterTheWrite) {
  const bool gpu = GetParam();
  SKIP_WITHOUT_GPU(gpu);
  for (bool wide : {false, true})
    for (int64_t B : {1, 3}) {
      SCOPED_TRACE(std::string(wide ? "int64" : "int32") + " B=" + std::to_string(B));
      const int64_t T = B == 1 ? 1 : 2, H = 2, D = 64, smax = 30, start = 11;
      Tensor kc(DType::bf16, {B, H, smax, D}, gpu), vc(DType::bf16, {B, H, smax, D}, gpu);
      Tensor k(DType::bf16, {B, T, H, D}, gpu), v(DType::bf16, {B, T, H, D}, gpu);
      kc.fill(0);
      vc.fill(0);
      k.fill_random();
      v.fill_random();
      Ints length({1}, {start}, gpu, wide);
      std::vector<int64_t> positions(B * T);
      for (int64_t i = 0; i < B * T; ++i) positions[i] = start + i % T;
      Ints pos({B, T}, positions, gpu, wide);
      llmk::TensorView pv = pos.view();
      if (B == 1) {  // the counter itself as the (1, 1) positions
        pv = length.view();
        pv.ndim = 2;
        pv.shape[0] = pv.shape[1] = 1;
        pv.strides[0] = pv.strides[1] = 0;
      }
      llmk::write_kv_cache(kc.view(), vc.view(), k.view(), v.view(), pv, {}, nullptr, length.view());
      EXPECT_EQ(length.current(0), start + T);
      kc.download();
      vc.download();
      for (int64_t b = 0; b < B; ++b)
        for (int64_t t = 0; t < T; ++t)
          for (int64_t h = 0; h < H; ++h)
            for (int64_t d = 0; d < D; ++d) {
              ASSERT_EQ(kc.get((b * H + h) * smax + start + t, d), k.get((b * T + t) * H + h, d));
              ASSERT_EQ(vc.get((b * H + h) * smax + start + t, d), v.get((b * T + t) * H + h, d));
            }
      EXPECT_EQ(kc.get(smax, 0), 0.0);  // (b 0, h 1, position 0): untouched
    }
  Tensor kc(DType::bf16, {1, 2, 30, 64}, gpu), k(DType::bf16, {1, 1, 2, 64}, gpu);
  Ints pos({1, 1}, {3}, gpu), two({2}, {3, 4}, gpu);
  Tensor fl(DType::f32, {1}, gpu);
  const auto err = [&](const llmk::TensorView& advance) {
    return llmk_test::error_of(
        [&] { llmk::write_kv_cache(kc.view(), kc.view(), k.view(), k.view(), pos.view(), {}, nullptr, advance); });
  };
  EXPECT_EQ(err(two.view()), "llmk::write_kv_cache: advance: expected one element (a length counter), got shape (2)");
  EXPECT_EQ(err(fl.view()), "llmk::write_kv_cache: advance: expected dtype int32 or int64, got float32");
}

INSTANTIATE_TEST_SUITE_P(WriteKv, WriteKvAdvanceTest, testing::Values(false, true),
                         [](const testing::TestParamInfo<bool>& i) { return std::string(i.param ? "gpu" : "cpu"); });

// rope_write_kv_cache: q_out and k_out against the float64 rotation of q and k (rotate-half pairs
// d, d + D / 2), the cache gets k_out (bitwise) and v; padding skipped; one block (B = T = 1,
// the counter advanced in it) and several; 16-byte pieces (D 24: 12 per half is not a multiple of
// 8, so elements for f16/bf16; D 64) and elements; more pieces than threads (32 + 8 heads of 128).
struct RopeKvCase {
  bool gpu;
  DType dtype;
  int64_t hq, hkv, head_dim;
};

class RopeWriteKvTest : public testing::TestWithParam<RopeKvCase> {};

TEST_P(RopeWriteKvTest, RotatesAndWrites) {
  const RopeKvCase& c = GetParam();
  SKIP_WITHOUT_GPU(c.gpu);
  for (int64_t B : {1, 2}) {
    SCOPED_TRACE("B=" + std::to_string(B));
    const int64_t T = B == 1 ? 1 : 3, Hq = c.hq, H = c.hkv, D = c.head_dim, half = D / 2, smax = 40, start = 9;
    Tensor kc(c.dtype, {B, H, smax, D}, c.gpu), vc(c.dtype, {B, H, smax, D}, c.gpu);
    Tensor q(c.dtype, {B, T, Hq, D}, c.gpu), k(c.dtype, {B, T, H, D}, c.gpu), v(c.dtype, {B, T, H, D}, c.gpu);
    Tensor q_out(c.dtype, {B, T, Hq, D}, c.gpu), k_out(c.dtype, {B, T, H, D}, c.gpu);
    Tensor cs(c.dtype, {B, T, half}, c.gpu), sn(c.dtype, {B, T, half}, c.gpu);
    for (Tensor* t : {&kc, &vc, &q, &k, &v}) t->fill_random();
    q_out.poison();
    k_out.poison();
    for (int64_t r = 0; r < B * T; ++r)
      for (int64_t d = 0; d < half; ++d) {
        const double a = 0.37 * static_cast<double>(r * half + d);
        cs.set(r, d, std::cos(a));
        sn.set(r, d, std::sin(a));
      }
    cs.upload();
    sn.upload();
    // float64 rotations of what the rounded inputs hold
    const auto rotated = [&](const Tensor& x, int64_t heads, int64_t row, int64_t h, int64_t d) {
      const int64_t r = row * heads + h, dd = d % half;
      const double c0 = cs.get(row, dd), s0 = sn.get(row, dd), x1 = x.get(r, dd), x2 = x.get(r, dd + half);
      return d < half ? x1 * c0 - x2 * s0 : x2 * c0 + x1 * s0;
    };
    std::vector<double> want_q(B * T * Hq * D), want_k(B * T * H * D);
    for (int64_t row = 0; row < B * T; ++row)
      for (int64_t d = 0; d < D; ++d) {
        for (int64_t h = 0; h < Hq; ++h) want_q[(row * Hq + h) * D + d] = rotated(q, Hq, row, h, d);
        for (int64_t h = 0; h < H; ++h) want_k[(row * H + h) * D + d] = rotated(k, H, row, h, d);
      }
    std::vector<int64_t> positions = B == 1 ? std::vector<int64_t>{start} : std::vector<int64_t>{5, 6, 39, -1, 17, 0};
    Ints pos({B, T}, positions, c.gpu), length({1}, {start}, c.gpu);
    llmk::rope_write_kv_cache(q_out.view(), k_out.view(), kc.view(), vc.view(), q.view(), k.view(), v.view(), cs.view(),
                              sn.view(), pos.view(), nullptr, length.view());
    q_out.download();
    k_out.download();
    kc.download();
    vc.download();
    EXPECT_LT(llmk_test::relative_error(q_out, want_q), llmk_test::tolerance(c.dtype));
    EXPECT_LT(llmk_test::relative_error(k_out, want_k), llmk_test::tolerance(c.dtype));
    EXPECT_EQ(length.current(0), start + T);
    for (int64_t b = 0; b < B; ++b)
      for (int64_t t = 0; t < T; ++t) {
        const int64_t p = positions[b * T + t];
        if (p < 0) continue;
        for (int64_t h = 0; h < H; ++h)
          for (int64_t d = 0; d < D; ++d) {
            ASSERT_EQ(kc.get((b * H + h) * smax + p, d), k_out.get((b * T + t) * H + h, d));
            ASSERT_EQ(vc.get((b * H + h) * smax + p, d), v.get((b * T + t) * H + h, d));
          }
      }
  }
}

INSTANTIATE_TEST_SUITE_P(RopeWriteKv, RopeWriteKvTest,
                         testing::Values(RopeKvCase{false, DType::f32, 4, 2, 24}, RopeKvCase{false, DType::bf16, 4, 2, 64},
                                         RopeKvCase{true, DType::f32, 4, 2, 24}, RopeKvCase{true, DType::f16, 4, 2, 24},
                                         RopeKvCase{true, DType::bf16, 4, 2, 64}, RopeKvCase{true, DType::f16, 3, 3, 20},
                                         RopeKvCase{true, DType::bf16, 32, 8, 128}),
                         [](const testing::TestParamInfo<RopeKvCase>& i) {
                           return std::string(i.param.gpu ? "gpu_" : "cpu_") + llmk::dtype_name(i.param.dtype) + "_q" +
                                  std::to_string(i.param.hq) + "kv" + std::to_string(i.param.hkv) + "d" +
                                  std::to_string(i.param.head_dim);
                         });

std::vector<WriteCase> write_cases() {
  std::vector<WriteCase> out;
  for (bool gpu : {false, true})
    for (DType dt : {DType::f32, DType::f16, DType::bf16})
      for (int64_t bs : {0, 16, 7}) {
        out.push_back({gpu, dt, bs, bs == 7});
        if (dt != DType::f32) out.push_back({gpu, dt, bs, bs != 7, 20});
      }
  return out;
}

INSTANTIATE_TEST_SUITE_P(WriteKv, WriteKvTest, testing::ValuesIn(write_cases()),
                         [](const testing::TestParamInfo<WriteCase>& i) {
                           return std::string(i.param.gpu ? "gpu_" : "cpu_") + llmk::dtype_name(i.param.dtype) + "_bs" +
                                  std::to_string(i.param.block_size) + (i.param.int64_positions ? "_i64" : "_i32") +
                                  "_d" + std::to_string(i.param.head_dim);
                         });

// ------------------------------------------------------------------------- attention masks
// DecodeOptions::attn_mask (B, 1 or T, S), boolean or additive (float32 or q's dtype), against a
// float64 reference with python/llm_kernels/decode.py's decode_attention_ref semantics: softmax of
// q.k * scale + the mask term over the keys a token sees (causal limit and seq_lens as without a
// mask); false, -inf, and additive values that overflow to -inf in fp32 after the kernels' scaling
// by log2(e) (bfloat16's and float32's lowest) hide a key, positions >= S are hidden, and a token
// that sees no key outputs exact zeros. Each case: seq_len 0, a sequence fully hidden, one longer
// than the mask, ~30% holes (not a prefix), a sequence shorter than T; on the GPU every kernel
// (mma, warp, the previous split kernel through LLMK_DECODE_LEGACY=1, mma with the staged mask
// LLMK_DECODE_MASK_PREFETCH=1), automatic and forced splits (a split starting past 0).

// A mask (B, Tm, S) in any of its dtypes; element (b, t, pos) at (b * Tm + t) * row_stride + pos *
// pos_stride; term() is what the reference adds (read back from the stored value: 0 or -inf for a
// boolean mask).
class Mask {
 public:
  Mask(DType dtype, int64_t batch, int64_t rows, int64_t len, bool on_gpu, int64_t row_pad = 0, int64_t pos_stride = 1)
      : dtype_(dtype), batch_(batch), rows_(rows), len_(len), pos_stride_(pos_stride),
        row_stride_(len * pos_stride + row_pad), on_gpu_(on_gpu) {
    const int64_t elems = batch * rows * row_stride_;
    bytes_.assign(static_cast<size_t>(elems * llmk::dtype_size(dtype)), 0);
    if (on_gpu_ && !bytes_.empty()) gpu_ = llmk_test::gpu_alloc(bytes_.size());
  }
  ~Mask() { if (gpu_) llmk_test::gpu_free(gpu_); }
  Mask(const Mask&) = delete;
  Mask& operator=(const Mask&) = delete;

  // term: 0 (attend), -inf (hide) or an additive value (float masks); boolean: visible unless -inf
  void set(int64_t b, int64_t t, int64_t pos, double term) {
    using namespace llmk::detail;
    char* e = bytes_.data() + offset(b, t, pos) * llmk::dtype_size(dtype_);
    const float f = static_cast<float>(term);
    switch (dtype_) {
      case DType::boolean: *reinterpret_cast<bool*>(e) = !(std::isinf(term) && term < 0); break;
      case DType::f32: std::memcpy(e, &f, 4); break;
      case DType::f16: { Half h = from_float<Half>(f); std::memcpy(e, &h.bits, 2); break; }
      case DType::bf16: { BFloat16 x = from_float<BFloat16>(f); std::memcpy(e, &x.bits, 2); break; }
      default: break;
    }
  }
  double term(int64_t b, int64_t t, int64_t pos) const {
    using namespace llmk::detail;
    if (pos >= len_) return -std::numeric_limits<double>::infinity();
    const char* e = bytes_.data() + offset(b, rows_ == 1 ? 0 : t, pos) * llmk::dtype_size(dtype_);
    switch (dtype_) {
      case DType::boolean: return *reinterpret_cast<const bool*>(e) ? 0.0 : -std::numeric_limits<double>::infinity();
      case DType::f32: { float f; std::memcpy(&f, e, 4); return f; }
      case DType::f16: { Half h; std::memcpy(&h.bits, e, 2); return to_float(h); }
      case DType::bf16: { BFloat16 x; std::memcpy(&x.bits, e, 2); return to_float(x); }
      default: return std::numeric_limits<double>::quiet_NaN();
    }
  }
  void upload() { if (gpu_) llmk_test::copy_to_gpu(gpu_, bytes_.data(), bytes_.size()); }
  llmk::TensorView view() const {
    llmk::TensorView v;
    v.data = on_gpu_ ? gpu_ : const_cast<char*>(bytes_.data());
    v.dtype = dtype_;
    v.device = on_gpu_ ? llmk::Device{llmk::DeviceKind::gpu, 0} : llmk::Device{};
    v.ndim = 3;
    v.shape[0] = batch_;
    v.shape[1] = rows_;
    v.shape[2] = len_;
    v.strides[0] = rows_ * row_stride_;
    v.strides[1] = row_stride_;
    v.strides[2] = pos_stride_;
    return v;
  }
  int64_t rows() const { return rows_; }
  int64_t len() const { return len_; }

 private:
  int64_t offset(int64_t b, int64_t t, int64_t pos) const { return (b * rows_ + t) * row_stride_ + pos * pos_stride_; }
  DType dtype_;
  int64_t batch_, rows_, len_, pos_stride_, row_stride_;
  bool on_gpu_;
  std::vector<char> bytes_;
  void* gpu_ = nullptr;
};

constexpr double kLog2eTest = 1.4426950408889634;

// True when the kernels treat this mask term as a hidden key: -inf, or a negative value that
// overflows to -inf in fp32 once scaled by log2(e) (decode_attention_ref's `hidden`).
bool hides(double term) { return term < 0 && std::isinf(static_cast<float>(term * kLog2eTest)); }

// Float64 decode attention of q over a cache (row_of(b, kv_head, pos) = the cache row), with an
// optional mask; rows without a visible key are zeros.
template <typename RowOf>
std::vector<double> masked_reference(const Tensor& q, const Tensor& kc, const Tensor& vc, const std::vector<int64_t>& lens,
                                     int64_t T, int64_t hq, int64_t hkv, int64_t D, RowOf row_of, const Mask* mask) {
  const int64_t B = static_cast<int64_t>(lens.size());
  std::vector<double> want(B * T * hq * D, 0.0);
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t)
      for (int64_t h = 0; h < hq; ++h) {
        const int64_t hk = h / (hq / hkv), qrow = (b * T + t) * hq + h;
        const int64_t n = std::max<int64_t>(0, lens[b] - T + t + 1);  // keys 0..pos(b, t)
        std::vector<double> s;
        std::vector<int64_t> keys;
        double mx = -std::numeric_limits<double>::infinity();
        for (int64_t j = 0; j < n; ++j) {
          const double term = mask ? mask->term(b, t, j) : 0.0;
          if (hides(term)) continue;
          double d = 0;
          for (int64_t i = 0; i < D; ++i) d += q.get(qrow, i) * kc.get(row_of(b, hk, j), i);
          s.push_back(d * scale + term);
          keys.push_back(j);
          mx = std::max(mx, s.back());
        }
        double sum = 0;
        for (double& x : s) sum += (x = std::exp(x - mx));
        for (size_t k = 0; k < keys.size(); ++k)
          for (int64_t i = 0; i < D; ++i) want[qrow * D + i] += s[k] / sum * vc.get(row_of(b, hk, keys[k]), i);
      }
  return want;
}

// Sets the decode kernel switches for one scope and clears them all after.
struct DecodeEnv {
  DecodeEnv(const char* kernel, bool legacy, bool prefetch, bool tma = true, const char* groups = nullptr) {
    clear();
    if (groups) setenv("LLMK_DECODE_GROUPS", groups, 1);
    if (kernel) setenv("LLMK_DECODE_KERNEL", kernel, 1);
    if (legacy) setenv("LLMK_DECODE_LEGACY", "1", 1);
    setenv("LLMK_DECODE_MASK_PREFETCH", prefetch ? "1" : "0", 1);  // on by default
    setenv("LLMK_DECODE_TMA", tma ? "1" : "0", 1);                 // on by default
  }
  ~DecodeEnv() { clear(); }
  static void clear() {
    unsetenv("LLMK_DECODE_KERNEL");
    unsetenv("LLMK_DECODE_LEGACY");
    unsetenv("LLMK_DECODE_MASK_PREFETCH");
    unsetenv("LLMK_DECODE_TMA");
    unsetenv("LLMK_DECODE_GROUPS");
  }
};

enum class MaskLayout { contiguous, padded_rows, strided };  // strided: last-dim stride 2

struct MaskCase {
  bool gpu;
  DType dtype;       // q, caches, out
  DType mask_dtype;  // boolean, f32 or dtype
  bool per_token;    // (B, T, S) instead of (B, 1, S)
  int64_t tokens, hq, hkv, head_dim;
  int64_t block_size;  // 0: contiguous cache
  MaskLayout layout = MaskLayout::contiguous;
};

std::string describe(const MaskCase& c) {
  const char* layout[] = {"", "_padrows", "_strided"};
  return std::string(c.gpu ? "gpu_" : "cpu_") + llmk::dtype_name(c.dtype) + "_mask_" + llmk::dtype_name(c.mask_dtype) +
         (c.per_token ? "_pertoken" : "_shared") + "_t" + std::to_string(c.tokens) + "_q" + std::to_string(c.hq) + "kv" +
         std::to_string(c.hkv) + "_d" + std::to_string(c.head_dim) +
         (c.block_size ? "_paged" + std::to_string(c.block_size) : std::string("_contig")) +
         layout[static_cast<int>(c.layout)];
}

std::string mask_case_name(const testing::TestParamInfo<MaskCase>& info) {
  return describe(info.param) + "_i" + std::to_string(info.index);
}

void PrintTo(const MaskCase& c, std::ostream* os) { *os << describe(c); }  // readable failures

std::vector<MaskCase> mask_cases() {
  const DType b = DType::boolean, f32 = DType::f32;
  const auto padded = MaskLayout::padded_rows, strided = MaskLayout::strided;
  std::vector<MaskCase> out = {
      // CPU: float32 q (bool, additive float32 = q's dtype), one bfloat16 q with a bfloat16 mask
      {false, f32, b, false, 1, 8, 2, 64, 0},
      {false, f32, b, true, 3, 8, 2, 128, 16},
      {false, f32, f32, false, 3, 8, 2, 64, 16},
      {false, f32, f32, true, 3, 8, 2, 128, 0, strided},
      {false, f32, f32, true, 1, 8, 2, 64, 16, padded},
      {false, DType::bf16, DType::bf16, true, 3, 8, 2, 64, 16},
  };
  for (DType dt : {DType::f16, DType::bf16}) {
    // GQA 8/2: 4 rows per KV head at T = 1, 12 at T = 3 (the warp kernel serves <= 8 rows: at T = 3
    // LLMK_DECODE_KERNEL=warp falls back to the split kernel, hence the 4/2 cases: 6 rows)
    out.push_back({true, dt, b, false, 1, 8, 2, 128, 0});
    out.push_back({true, dt, b, true, 3, 8, 2, 64, 16});
    out.push_back({true, dt, b, true, 3, 4, 2, 128, 0, padded});
    out.push_back({true, dt, dt, false, 3, 8, 2, 128, 16});
    out.push_back({true, dt, dt, true, 3, 4, 2, 64, 0});
    out.push_back({true, dt, f32, true, 3, 8, 2, 128, 0, padded});
    out.push_back({true, dt, f32, false, 1, 8, 2, 64, 16, strided});  // the staged path falls back
  }
  return out;
}

class DecodeMaskTest : public testing::TestWithParam<MaskCase> {};

TEST_P(DecodeMaskTest, MatchesFloat64) {
  const MaskCase& c = GetParam();
  SKIP_WITHOUT_GPU(c.gpu);
  // 0: seq_len 0; 1: fully hidden; 2: longer than the mask (keys 170..189 hidden by its length);
  // 3: holes; 4: shorter than T = 3 (its first tokens see no key)
  const std::vector<int64_t> lens = {0, 120, 190, 37, 2};
  const int64_t B = static_cast<int64_t>(lens.size()), T = c.tokens, D = c.head_dim, S = 170, max_len = 190;
  const CacheLayout L(B, c.hkv, D, max_len, c.block_size);
  const bool paged = L.paged;
  Tensor q(c.dtype, {B, T, c.hq, D}, c.gpu), out(c.dtype, {B, T, c.hq, D}, c.gpu);
  Tensor kc(c.dtype, L.shape, c.gpu), vc(c.dtype, L.shape, c.gpu);
  q.fill_random();
  kc.fill_random();
  vc.fill_random();
  Ints lens_t({B}, lens, c.gpu), tab({B, L.max_blocks}, L.table, c.gpu);
  auto row_of = [&](int64_t b, int64_t h, int64_t pos) { return L.row_of(b, h, pos); };

  // ~30% holes anywhere (not a prefix), additive values in [-3, 1] elsewhere; holes are -inf, or
  // the dtype's lowest where that hides a key (float32, bfloat16: Hugging Face's finfo.min)
  const int64_t rows = c.per_token ? T : 1;
  const int64_t pad = c.layout == MaskLayout::padded_rows ? 7 : 0, pstride = c.layout == MaskLayout::strided ? 2 : 1;
  Mask mask(c.mask_dtype, B, rows, S, c.gpu, pad, pstride);
  std::bernoulli_distribution hole(0.3);
  std::uniform_real_distribution<double> add(-3.0, 1.0);
  const double inf = std::numeric_limits<double>::infinity();
  const double lowest = c.mask_dtype == DType::f32    ? std::numeric_limits<float>::lowest()
                        : c.mask_dtype == DType::bf16 ? -3.3895313892515355e38
                                                      : -inf;
  int64_t holes = 0;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < rows; ++t)
      for (int64_t pos = 0; pos < S; ++pos) {
        const bool hidden = b == 1 || hole(llmk_test::rng());
        holes += hidden && b != 1;
        const double term = hidden ? ((pos % 2) ? lowest : -inf) : c.mask_dtype == DType::boolean ? 0.0 : add(llmk_test::rng());
        mask.set(b, t, pos, term);
        ASSERT_EQ(hides(mask.term(b, t, pos)), hidden) << "hole value " << term;
      }
  ASSERT_GT(holes, 0);
  mask.upload();
  const std::vector<double> want = masked_reference(q, kc, vc, lens, T, c.hq, c.hkv, D, row_of, &mask);
  // the mask matters: the unmasked result is far from it
  const std::vector<double> unmasked = masked_reference(q, kc, vc, lens, T, c.hq, c.hkv, D, row_of, nullptr);
  Tensor probe(c.dtype, {B, T, c.hq, D}, false);
  for (int64_t r = 0; r < probe.rows(); ++r)
    for (int64_t i = 0; i < D; ++i) probe.set(r, i, unmasked[r * D + i]);
  ASSERT_GT(llmk_test::relative_error(probe, want), 0.05);

  const llmk::TensorView table_view = paged ? tab.view() : llmk::TensorView{};
  struct Config { const char* name; const char* kernel; bool legacy, prefetch, tma; const char* groups = nullptr; };
  const std::vector<Config> configs =
      c.gpu ? std::vector<Config>{{"mma", "mma", false, false, true}, {"warp", "warp", false, false, true},
                                  {"legacy", nullptr, true, false, true}, {"mma+prefetch", "mma", false, true, true},
                                  {"mma+prefetch, one warp group", "mma", false, true, true, "1"},
                                  {"mma, one warp group", "mma", false, false, true, "1"},
                                  {"mma+prefetch, cp.async", "mma", false, true, false}}
            : std::vector<Config>{{"cpu", nullptr, false, false, true}};
  for (const Config& cfg : configs)
    for (int splits : {0, 3}) {  // 3: forced; a 195- or 208-position cache gives 2 or 3 splits of 64-key tiles
      if (!c.gpu && splits) continue;
      DecodeEnv env(cfg.kernel, cfg.legacy, cfg.prefetch, cfg.tma, cfg.groups);
      llmk::DecodeOptions opt;
      opt.num_splits = splits;
      opt.attn_mask = mask.view();
      Workspace ws(llmk::decode_attention_workspace_size(q.view(), kc.view(), table_view, opt), c.gpu);
      if (c.gpu && splits) {
        EXPECT_GT(llmk::decode_attention_num_splits(q.view(), kc.view(), table_view, opt), 1) << cfg.name;
      }
      out.poison();
      llmk::decode_attention(out.view(), q.view(), kc.view(), vc.view(), lens_t.view(), table_view, opt, ws.ptr, ws.bytes);
      out.download();
      EXPECT_LT(llmk_test::relative_error(out, want), llmk_test::tolerance(c.dtype))
          << cfg.name << ", num_splits " << splits;
      // tokens that see no key (seq_len 0, the hidden sequence, positions < 0) are exact zeros
      for (int64_t b = 0; b < B; ++b)
        for (int64_t t = 0; t < T; ++t)
          if (b <= 1 || lens[b] - T + t < 0) {
            for (int64_t h = 0; h < c.hq; ++h)
              for (int64_t i = 0; i < D; i += 17)
                EXPECT_EQ(out.get((b * T + t) * c.hq + h, i), 0.0) << cfg.name << " b " << b << " t " << t;
          }
    }
}

INSTANTIATE_TEST_SUITE_P(DecodeMask, DecodeMaskTest, testing::ValuesIn(mask_cases()), mask_case_name);

// Per-token mask rows whose visible keys end at different places, the earliest-ending row last:
// the staged mask's scan must keep the latest end over all rows (it once kept the last row's, which
// cut the earlier rows' keys; the H200 run of 2026-11-30 22:30 caught that only through a random
// case). Every GPU path and the CPU.
class DecodeMaskEndsTest : public testing::TestWithParam<bool> {};

TEST_P(DecodeMaskEndsTest, LatestEndOverRowsIsKept) {
  const bool gpu = GetParam();
  SKIP_WITHOUT_GPU(gpu);
  const DType dt = gpu ? DType::bf16 : DType::f32;
  const int64_t B = 2, T = 4, hq = 8, hkv = 2, D = 64, S = 300;
  const std::vector<int64_t> lens = {300, 257};
  const CacheLayout L(B, hkv, D, S, 0);
  Tensor q(dt, {B, T, hq, D}, gpu), out(dt, {B, T, hq, D}, gpu);
  Tensor kc(dt, L.shape, gpu), vc(dt, L.shape, gpu);
  q.fill_random();
  kc.fill_random();
  vc.fill_random();
  Ints lens_t({B}, lens, gpu);
  Mask mask(DType::boolean, B, T, S, gpu);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t)
      for (int64_t pos = 0; pos < S; ++pos)  // row t sees keys below 280 - 60 t (and hides every 7th)
        mask.set(b, t, pos, pos < 280 - 60 * t && pos % 7 != 3 ? 0.0 : -std::numeric_limits<double>::infinity());
  mask.upload();
  auto row_of = [&](int64_t b, int64_t h, int64_t pos) { return L.row_of(b, h, pos); };
  const std::vector<double> want = masked_reference(q, kc, vc, lens, T, hq, hkv, D, row_of, &mask);
  struct Config { const char* kernel; bool prefetch, tma; const char* groups = nullptr; };
  const std::vector<Config> configs = gpu ? std::vector<Config>{{"mma", true, true}, {"mma", true, true, "1"},
                                                                {"mma", true, false}, {"mma", false, true},
                                                                {"warp", false, true}}
                                          : std::vector<Config>{{nullptr, false, true}};
  for (const Config& cfg : configs)
    for (int splits : {0, 1, 3}) {
      if (!gpu && splits) continue;
      DecodeEnv env(cfg.kernel, false, cfg.prefetch, cfg.tma, cfg.groups);
      llmk::DecodeOptions opt;
      opt.num_splits = splits;
      opt.attn_mask = mask.view();
      Workspace ws(llmk::decode_attention_workspace_size(q.view(), kc.view(), {}, opt), gpu);
      out.poison();
      llmk::decode_attention(out.view(), q.view(), kc.view(), vc.view(), lens_t.view(), {}, opt, ws.ptr, ws.bytes);
      out.download();
      EXPECT_LT(llmk_test::relative_error(out, want), llmk_test::tolerance(dt))
          << (cfg.kernel ? cfg.kernel : "cpu") << (cfg.prefetch ? "+prefetch" : "") << (cfg.tma ? "" : ", cp.async")
          << ", num_splits " << splits;
    }
}

INSTANTIATE_TEST_SUITE_P(DecodeMaskEnds, DecodeMaskEndsTest, testing::Values(false, true),
                         [](const testing::TestParamInfo<bool>& info) { return info.param ? "gpu" : "cpu"; });

TEST(DecodeMaskTest, BadInput) {
  using llmk_test::error_of;
  const int64_t D = 64;
  Tensor q(DType::f16, {2, 2, 4, D}, false), out(DType::f16, {2, 2, 4, D}, false);
  Tensor kc(DType::f16, {2, 2, 10, D}, false), vc(DType::f16, {2, 2, 10, D}, false);
  Ints lens({2}, {3, 4}, false);
  auto call = [&](llmk::TensorView m) {
    llmk::DecodeOptions opt;
    opt.attn_mask = m;
    return error_of([&] {
      llmk::decode_attention(out.view(), q.view(), kc.view(), vc.view(), lens.view(), {}, opt, nullptr, 0);
    });
  };
  Mask ok(DType::boolean, 2, 2, 10, false);
  EXPECT_EQ(call(ok.view()), "<no error>");
  Mask bf(DType::bf16, 2, 1, 10, false);
  EXPECT_EQ(call(bf.view()), "llmk::decode_attention: attn_mask: expected dtype bool, float32 or q's float16, got bfloat16");
  Ints int_mask({2, 1, 10}, std::vector<int64_t>(20, 1), false);
  EXPECT_EQ(call(int_mask.view()), "llmk::decode_attention: attn_mask: expected dtype bool, float32 or q's float16, got int32");
  Mask three(DType::boolean, 2, 3, 10, false), batch3(DType::f32, 3, 1, 10, false);
  EXPECT_EQ(call(three.view()),
            "llmk::decode_attention: attn_mask: expected shape (2, 1 or tokens, positions) with tokens = 2 (q's), got (2, 3, 10)");
  EXPECT_EQ(call(batch3.view()),
            "llmk::decode_attention: attn_mask: expected shape (2, 1 or tokens, positions) with tokens = 2 (q's), got (3, 1, 10)");
  // SDPA's 4-D (B, 1, 1 or T, S) is the Python wrapper's (it drops the head dim); the C++ API takes 3-D
  llmk::TensorView four = ok.view();
  four.ndim = 4;
  four.shape[3] = four.shape[2];
  four.shape[2] = four.shape[1];
  four.shape[1] = 1;
  four.strides[3] = 1;
  four.strides[2] = 10;
  four.strides[1] = 20;
  EXPECT_EQ(call(four), "llmk::decode_attention: attn_mask: expected 3 dims, got 4 dims with shape (2, 1, 2, 10)");
  // a mask on another device than q (checked before anything is read)
  llmk::TensorView elsewhere = ok.view();
  elsewhere.device = llmk::Device{llmk::DeviceKind::gpu, 0};
  EXPECT_EQ(call(elsewhere), "llmk::decode_attention: attn_mask: expected device cpu (the device of q), got gpu:0");
  // the planning queries check the mask too
  llmk::DecodeOptions opt;
  opt.attn_mask = bf.view();
  EXPECT_EQ(error_of([&] { llmk::decode_attention_workspace_size(q.view(), kc.view(), {}, opt); }),
            "llmk::decode_attention: attn_mask: expected dtype bool, float32 or q's float16, got bfloat16");
}

TEST(DecodeMaskTest, GpuRejectsAHostMask) {
  SKIP_WITHOUT_GPU(true);
  const int64_t D = 64;
  Tensor q(DType::bf16, {2, 1, 4, D}, true), out(DType::bf16, {2, 1, 4, D}, true);
  Tensor kc(DType::bf16, {2, 2, 16, D}, true), vc(DType::bf16, {2, 2, 16, D}, true);
  Ints lens({2}, {3, 4}, true);
  Mask host(DType::boolean, 2, 1, 16, false), wrong(DType::f16, 2, 1, 16, true);
  for (const Mask* m : {&host, &wrong}) {
    llmk::DecodeOptions opt;
    opt.attn_mask = m->view();
    const std::string err = llmk_test::error_of([&] {
      llmk::decode_attention(out.view(), q.view(), kc.view(), vc.view(), lens.view(), {}, opt, nullptr, 0);
    });
    EXPECT_EQ(err, m == &host ? "llmk::decode_attention: attn_mask: expected device gpu:0 (the device of q), got cpu"
                              : "llmk::decode_attention: attn_mask: expected dtype bool, float32 or q's bfloat16, got float16");
  }
}

}  // namespace
