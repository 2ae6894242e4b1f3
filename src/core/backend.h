// Runs an op's CPU or GPU backend by the device of its tensors. In a build without a GPU
// backend (LLMK_WITH_GPU undefined) a GPU tensor gets a clear error instead of a link failure.
#pragma once

#include "core/check.h"

namespace llmk::detail {

template <typename CpuFn, typename GpuFn>
void run_on(const char* op, Device device, CpuFn&& cpu, GpuFn&& gpu) {
  if (device.kind == DeviceKind::cpu) {
    cpu();
    return;
  }
#if defined(LLMK_WITH_GPU)
  (void)op;
  gpu();
#else
  (void)gpu;
  fail(ErrorKind::device, op, "got a GPU tensor, but this build of llmk has no GPU backend");
#endif
}

}  // namespace llmk::detail
