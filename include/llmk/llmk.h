// llmk: everything in one include.
#pragma once

#include "llmk/activation.h"
#include "llmk/attention.h"
#include "llmk/decode.h"
#include "llmk/error.h"
#include "llmk/monarch.h"
#include "llmk/gemm.h"
#include "llmk/rmsnorm.h"
#include "llmk/rope.h"
#include "llmk/tensor.h"

namespace llmk {
// The GPU backend this library was built with: "cuda", "hip" or "off".
const char* gpu_backend();
}  // namespace llmk

extern "C" const char* llmk_gpu_backend();  // the same, for dlopen/ctypes users
