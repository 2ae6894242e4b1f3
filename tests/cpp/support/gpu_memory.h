// GPU memory for the C++ tests, behind a host-only interface (the tests themselves are plain C++).
#pragma once

#include <cstddef>

namespace llmk_test {

int gpu_count();  // 0 when no GPU (or no GPU backend, or no driver) is usable
void* gpu_alloc(std::size_t bytes);
void gpu_free(void* p);
void copy_to_gpu(void* dst, const void* src, std::size_t bytes);
void copy_to_host(void* dst, const void* src, std::size_t bytes);
void gpu_sync();  // waits for the device and fails the test run on an asynchronous error
bool gpu_is_sm90();  // device 0 has compute capability 9.0 (H100, H200: the sm_90a kernels run)
int gpu_multiprocessors();  // device 0's multiprocessor count (0 without a GPU)

}  // namespace llmk_test
