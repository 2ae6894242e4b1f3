// llmk::set_cpu_parallel_for: the CPU kernels hand their rows to the installed function, which
// may run the pieces in any order on any threads; the results must not change by a bit.
#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "llmk/activation.h"
#include "llmk/rmsnorm.h"
#include "llmk/threads.h"
#include "support/tensors.h"

using llmk::DType;
using llmk_test::Tensor;

namespace {

std::atomic<int> pieces_run{0};

// Pieces of `grain` items, last first, each on its own thread.
void threads_backwards(int64_t n, int64_t grain, void* ctx,
                       void (*chunk)(void* ctx, int64_t begin, int64_t end)) {
  std::vector<std::thread> threads;
  for (int64_t end = n; end > 0; end -= grain) {
    const int64_t begin = end > grain ? end - grain : 0;
    threads.emplace_back([=] { chunk(ctx, begin, end); });
    ++pieces_run;
  }
  for (auto& t : threads) t.join();
}

bool same_bits(const Tensor& a, const Tensor& b) {
  for (int64_t r = 0; r < a.rows(); ++r)
    for (int64_t c = 0; c < a.cols(); ++c) {
      const double x = a.get(r, c), y = b.get(r, c);
      if (std::memcmp(&x, &y, sizeof x) != 0) return false;
    }
  return true;
}

// Runs op(outputs) twice, on fresh poisoned outputs of the given shapes: with no parallel_for
// installed, then with threads_backwards; expects the same bits.
template <typename Op>
void expect_same_with_threads(DType dtype, const std::vector<std::vector<int64_t>>& shapes,
                              Op&& op) {
  std::vector<std::vector<std::unique_ptr<Tensor>>> runs(2);
  for (int run = 0; run < 2; ++run) {
    for (const auto& shape : shapes) {
      runs[run].push_back(std::make_unique<Tensor>(dtype, shape, false));
      runs[run].back()->poison();
    }
    pieces_run = 0;
    llmk::set_cpu_parallel_for(run == 0 ? nullptr : threads_backwards);
    op(runs[run]);
    llmk::set_cpu_parallel_for(nullptr);
    if (run == 1) EXPECT_GT(pieces_run.load(), 1) << "the kernel did not split its rows";
  }
  for (size_t i = 0; i < shapes.size(); ++i)
    EXPECT_TRUE(same_bits(*runs[0][i], *runs[1][i])) << "output " << i;
}

}  // namespace

class CpuThreads : public ::testing::TestWithParam<DType> {};

TEST_P(CpuThreads, RmsNormForwardAndBackward) {
  const DType dt = GetParam();
  Tensor x(dt, {301, 2049}, false), w(dt, {2049}, false), gy(dt, {301, 2049}, false);
  x.fill_random();
  w.fill_random(0.5, 1.5);
  gy.fill_random();
  expect_same_with_threads(dt, {{301, 2049}}, [&](auto& out) {
    llmk::rms_norm(out[0]->view(), x.view(), w.view(), 1e-6f);
  });
  expect_same_with_threads(dt, {{301, 2049}, {2049}}, [&](auto& out) {  // grad_x, grad_weight
    llmk::rms_norm_backward(out[0]->view(), out[1]->view(), gy.view(), x.view(), w.view(), 1e-6f,
                            0.f, nullptr, nullptr);
  });
}

TEST_P(CpuThreads, SwiGluForward) {
  const DType dt = GetParam();
  Tensor g(dt, {67, 4099}, false), u(dt, {67, 4099}, false);
  g.fill_random(-8, 8);
  u.fill_random();
  expect_same_with_threads(dt, {{67, 4099}}, [&](auto& out) {
    llmk::gated_activation(out[0]->view(), g.view(), u.view(), llmk::Activation::silu);
  });
}

INSTANTIATE_TEST_SUITE_P(Dtypes, CpuThreads, ::testing::Values(DType::f32, DType::bf16));
