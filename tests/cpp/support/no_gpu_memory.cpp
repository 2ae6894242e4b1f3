#include <cstdlib>

#include "support/gpu_memory.h"

namespace llmk_test {
int gpu_count() { return 0; }
void* gpu_alloc(std::size_t) { std::abort(); }
void gpu_free(void*) { std::abort(); }
void copy_to_gpu(void*, const void*, std::size_t) { std::abort(); }
void copy_to_host(void*, const void*, std::size_t) { std::abort(); }
void gpu_sync() {}
bool gpu_is_sm90() { return false; }
int gpu_multiprocessors() { return 0; }
}  // namespace llmk_test
