// Programmatic dependent launch (PDL), and the grid-wide barrier of persistent kernels: host entry
// points that need no GPU headers (tests, the Python package through ctypes). The machinery is
// gpu::launch / pdl_enabled in runtime.h and gpu::grid_barrier in compat.h.
#pragma once

#include <cstdint>

namespace llmk::gpu {

// Launches made with the PDL attribute in this process (0 in builds without a GPU).
int64_t pdl_launches();

// Self test on GPU `device`: a writer kernel lets its dependents launch, spins ~20 us, then
// stores 42; a reader launched right after it with PDL reads the value, after pdl_wait() when
// `wait`. Returns what the reader saw (42, or 0 when it read before the store), or -1 when PDL is
// not available here (no GPU build, compute capability < 9.0, kernels not built for sm_90+).
int pdl_selftest(int device, bool wait);

// Self test of LLMK_SMEM_CARVEOUT (gpu/runtime.h, apply_smem_carveout) on GPU `device`: launches
// a probe kernel through gpu::launch and returns its preferred shared-memory carveout as the
// runtime reports it afterwards (cudaFuncAttributes::preferredShmemCarveout; -1 is the driver's
// choice), -1 without that GPU, or -2 in builds other than CUDA.
int smem_carveout_selftest(int device);

// Self test of gpu::grid_barrier (compat.h) on GPU `device`: a persistent kernel of as many
// blocks as fit at once runs `rounds` rounds; in each, every block writes the round number to its
// slot, passes the barrier, checks every other block's slot, and passes it again. Returns the
// number of stale slots seen (0 when the barrier holds), or -1 without a GPU build.
// `blocks_per_sm` > 0 caps the blocks per SM (a persistent kernel's usual 1 or 2); when
// `ns_per_barrier` is given it receives the kernel's time per barrier (an upper bound: the slot
// checks between barriers are included).
int64_t grid_barrier_selftest(int device, int rounds, int blocks_per_sm = 0, double* ns_per_barrier = nullptr);

}  // namespace llmk::gpu
