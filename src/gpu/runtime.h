// Host-side helpers for GPU code: checked runtime calls, a device guard, and device properties
// read at run time (warp size, multiprocessor count), cached per device.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <initializer_list>

#include "gpu/compat.h"
#include "llmk/tensor.h"

namespace llmk::gpu {

// Throws llmk::Error(runtime) naming the op and the failed call when err != gpuSuccess.
void check(gpuError_t err, const char* op, const char* what);
// Checks the launch that just happened (gpuGetLastError).
void check_launch(const char* op);

int warp_size(int device);
int multiprocessor_count(int device);

// Makes `device` current for its lifetime and restores the previous one.
class DeviceGuard {
 public:
  DeviceGuard(Device device, const char* op);
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = -1;
  int device_ = -1;
};

inline gpuStream_t as_stream(Stream s) { return static_cast<gpuStream_t>(s); }

// Resident blocks of `kernel` per multiprocessor at `threads` threads and `smem` bytes of dynamic
// shared memory, at least 1; throws naming `op` when the query fails.
template <typename Kernel>
int resident_blocks(Kernel kernel, int threads, std::size_t smem, const char* op) {
  int blocks = 0;
  check(gpuOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, threads, smem), op, "reading the occupancy");
  return blocks > 0 ? blocks : 1;
}

// The same, returning `fallback` (and clearing the error) when the query fails.
template <typename Kernel>
int resident_blocks_or(Kernel kernel, int threads, std::size_t smem, int fallback) {
  int blocks = 0;
  if (gpuOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, threads, smem) != gpuSuccess || blocks < 1) {
    (void)gpuGetLastError();
    return fallback;
  }
  return blocks;
}

// Host: whether the environment switch `name` is on (set, non-empty and not "0"). Kernel
// choices read it per call (a getenv is nothing beside a launch) so tests can flip it.
inline bool env_flag(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' && std::strcmp(v, "0") != 0;
}

// Elements of T per 16-byte vector access when a row of `cols` elements allows it: cols a
// multiple of it, every pointer (nullptr = unused) 16-byte aligned, every row stride a multiple
// of it. Otherwise 1 (scalar accesses).
template <typename T>
int vector_width(int64_t cols, std::initializer_list<const void*> ptrs,
                 std::initializer_list<int64_t> strides) {
  constexpr int full = 16 / sizeof(T);
  if (cols % full != 0) return 1;
  for (const void* q : ptrs)
    if (q != nullptr && reinterpret_cast<uintptr_t>(q) % 16 != 0) return 1;
  for (int64_t s : strides)
    if (s % full != 0) return 1;
  return full;
}

}  // namespace llmk::gpu
