// Programmatic dependent launch (PDL): host entry points that need no GPU headers (tests, the
// Python package through ctypes). The machinery is gpu::launch / pdl_enabled in runtime.h.
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

}  // namespace llmk::gpu
