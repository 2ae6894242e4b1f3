#include <cstdio>
#include <cstdlib>

#include "gpu/compat.h"
#include "support/gpu_memory.h"

namespace llmk_test {

static void must(gpuError_t err, const char* what) {
  if (err != gpuSuccess) {
    std::fprintf(stderr, "%s failed: %s\n", what, gpuGetErrorString(err));
    std::abort();
  }
}

int gpu_count() {
  int n = 0;
  if (gpuGetDeviceCount(&n) != gpuSuccess) {
    (void)gpuGetLastError();
    return 0;
  }
  return n;
}

void* gpu_alloc(std::size_t bytes) {
  void* p = nullptr;
  must(gpuMalloc(&p, bytes ? bytes : 1), "gpuMalloc");
  return p;
}
void gpu_free(void* p) { must(gpuFree(p), "gpuFree"); }
void copy_to_gpu(void* dst, const void* src, std::size_t bytes) {
  must(gpuMemcpy(dst, src, bytes, gpuMemcpyHostToDevice), "copy to GPU");
}
void copy_to_host(void* dst, const void* src, std::size_t bytes) {
  must(gpuMemcpy(dst, src, bytes, gpuMemcpyDeviceToHost), "copy to host");
}
void gpu_sync() { must(gpuDeviceSynchronize(), "synchronize"); }
bool gpu_is_sm90() {
  gpuDeviceProp prop{};
  if (gpu_count() == 0 || gpuGetDeviceProperties(&prop, 0) != gpuSuccess) return false;
#if LLMK_CUDA
  return prop.major == 9 && prop.minor == 0;
#else
  return false;
#endif
}

int gpu_multiprocessors() {
  gpuDeviceProp prop{};
  if (gpu_count() == 0 || gpuGetDeviceProperties(&prop, 0) != gpuSuccess) return 0;
  return prop.multiProcessorCount;
}

}  // namespace llmk_test
