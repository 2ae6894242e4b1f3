// Exported wrappers of the PDL entry points (runtime.cu is compiled with hidden visibility).
#include "gpu/pdl.h"

namespace llmk::gpu {

#if defined(LLMK_WITH_GPU)
int64_t pdl_launches_gpu();
int pdl_selftest_gpu(int device, bool wait);
int smem_carveout_selftest_gpu(int device);
int64_t grid_barrier_selftest_gpu(int device, int rounds, int blocks_per_sm, double* ns_per_barrier);
#endif

int64_t pdl_launches() {
#if defined(LLMK_WITH_GPU)
  return pdl_launches_gpu();
#else
  return 0;
#endif
}

int pdl_selftest(int device, bool wait) {
#if defined(LLMK_WITH_GPU)
  return pdl_selftest_gpu(device, wait);
#else
  (void)device;
  (void)wait;
  return -1;
#endif
}

int smem_carveout_selftest(int device) {
#if defined(LLMK_WITH_GPU)
  return smem_carveout_selftest_gpu(device);
#else
  (void)device;
  return -2;
#endif
}

int64_t grid_barrier_selftest(int device, int rounds, int blocks_per_sm, double* ns_per_barrier) {
#if defined(LLMK_WITH_GPU)
  return grid_barrier_selftest_gpu(device, rounds, blocks_per_sm, ns_per_barrier);
#else
  (void)device;
  (void)rounds;
  (void)blocks_per_sm;
  (void)ns_per_barrier;
  return -1;
#endif
}

}  // namespace llmk::gpu

extern "C" int64_t llmk_pdl_launches() { return llmk::gpu::pdl_launches(); }
