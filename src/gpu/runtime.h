// Host-side helpers for GPU code: checked runtime calls, a device guard, and device properties
// read at run time (warp size, multiprocessor count), cached per device.
#pragma once

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

}  // namespace llmk::gpu
