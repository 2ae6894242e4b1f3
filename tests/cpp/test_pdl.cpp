// Programmatic dependent launch (gpu::launch with PDL, gpu/pdl.h): a writer kernel lets its
// dependents launch at once and stores 42 only ~20 us later; a reader launched right after it with
// PDL must see 42 when it runs pdl_wait() first (the wait holds it until the writer is done), and
// sees 0 without the wait (proof that the two kernels really overlap on this GPU, so that the
// first test can fail). Needs compute capability 9.0+ and sm_90 code; elsewhere the self test
// reports -1 and the tests check that PDL is then unavailable everywhere it should be.
#include <cstdio>
#include <cstdlib>
#include <gtest/gtest.h>

#include "gpu/pdl.h"
#include "support/testing.h"

namespace {

TEST(Pdl, TheWaitHoldsTheReaderUntilTheWriterIsDone) {
  SKIP_WITHOUT_GPU(true);
  const int seen = llmk::gpu::pdl_selftest(0, true);
  if (seen == -1) GTEST_SKIP() << "PDL is not available on this GPU / build";
  EXPECT_EQ(seen, 42) << "the reader ran pdl_wait() and still read before the writer's store";
}

TEST(Pdl, WithoutTheWaitTheReaderRunsBeforeTheWriterEnds) {
  SKIP_WITHOUT_GPU(true);
  for (int attempt = 0; attempt < 3; ++attempt) {
    const int seen = llmk::gpu::pdl_selftest(0, false);
    if (seen == -1) GTEST_SKIP() << "PDL is not available on this GPU / build";
    if (seen == 0) return;  // the reader started while the writer was still running
  }
  ADD_FAILURE() << "three PDL launches never overlapped the writer: the driver serialised them, so the "
                   "wait test above cannot tell a missing wait";
}

// gpu::grid_barrier (the building block of a persistent decode-step kernel): 200 rounds of every
// resident block writing its slot and checking all others between two barriers; a barrier that
// let one block through early shows as stale slots.
TEST(GridBarrier, EveryBlockSeesEveryWriteOfTheRound) {
  SKIP_WITHOUT_GPU(true);
  EXPECT_EQ(llmk::gpu::grid_barrier_selftest(0, 200), 0);
}

// The same at the block counts of a persistent kernel (1 and 2 per SM); prints the time per
// barrier, the figure docs/decode-step-kernel.md budgets with.
TEST(GridBarrier, OneAndTwoBlocksPerSmAndTheirCost) {
  SKIP_WITHOUT_GPU(true);
  for (int per_sm : {1, 2}) {
    double ns = -1.0;
    EXPECT_EQ(llmk::gpu::grid_barrier_selftest(0, 2000, per_sm, &ns), 0) << per_sm << " blocks per SM";
    EXPECT_GT(ns, 0.0);
    std::printf("[ grid_barrier ] %d block(s) per SM: %.0f ns per barrier (2000 rounds)\n", per_sm, ns);
  }
}

TEST(GridBarrier, CpuBuildsReportIt) {
  if (llmk_test::gpu_count() == 0) EXPECT_EQ(llmk::gpu::grid_barrier_selftest(0, 1), -1);
}

// LLMK_SMEM_CARVEOUT (gpu/runtime.h): a launch through gpu::launch sets the kernel's preferred
// shared-memory carveout, sets it again when the value changes, and leaves it alone for a value
// outside 0-100; fit sets what the kernel's resident blocks need.
TEST(SmemCarveout, LaunchSetsThePreference) {
  SKIP_WITHOUT_GPU(true);
  setenv("LLMK_SMEM_CARVEOUT", "100", 1);
  const int first = llmk::gpu::smem_carveout_selftest(0);
  if (first == -2) {
    unsetenv("LLMK_SMEM_CARVEOUT");
    GTEST_SKIP() << "not a CUDA build (the switch does nothing on AMD)";
  }
  EXPECT_EQ(first, 100);
  setenv("LLMK_SMEM_CARVEOUT", "25", 1);
  EXPECT_EQ(llmk::gpu::smem_carveout_selftest(0), 25);
  setenv("LLMK_SMEM_CARVEOUT", "101", 1);
  EXPECT_EQ(llmk::gpu::smem_carveout_selftest(0), 25);
  setenv("LLMK_SMEM_CARVEOUT", "50%", 1);
  EXPECT_EQ(llmk::gpu::smem_carveout_selftest(0), 25);
  // fit: the probe (32 threads, no shared memory) needs only the per-block reserves of its
  // resident blocks (32 x 1 KB of 228 on an H100: 15%)
  setenv("LLMK_SMEM_CARVEOUT", "fit", 1);
  const int fit = llmk::gpu::smem_carveout_selftest(0);
  EXPECT_GT(fit, 0);
  EXPECT_LT(fit, 25);
  // off (anything not 0-100 or fit) sets nothing: the kernel keeps 25 from before
  setenv("LLMK_SMEM_CARVEOUT", "25", 1);
  EXPECT_EQ(llmk::gpu::smem_carveout_selftest(0), 25);
  setenv("LLMK_SMEM_CARVEOUT", "off", 1);
  EXPECT_EQ(llmk::gpu::smem_carveout_selftest(0), 25);
  // unset or empty: the default, fit
  unsetenv("LLMK_SMEM_CARVEOUT");
  EXPECT_EQ(llmk::gpu::smem_carveout_selftest(0), fit);
  setenv("LLMK_SMEM_CARVEOUT", "25", 1);
  EXPECT_EQ(llmk::gpu::smem_carveout_selftest(0), 25);
  setenv("LLMK_SMEM_CARVEOUT", "", 1);
  EXPECT_EQ(llmk::gpu::smem_carveout_selftest(0), fit);
  unsetenv("LLMK_SMEM_CARVEOUT");
}

TEST(Pdl, LaunchCounterAndCpuBuilds) {
  EXPECT_GE(llmk::gpu::pdl_launches(), 0);
  if (llmk_test::gpu_count() == 0) {
    EXPECT_EQ(llmk::gpu::pdl_selftest(0, true), -1);
    EXPECT_LT(llmk::gpu::smem_carveout_selftest(0), 0);
  }
}

}  // namespace
