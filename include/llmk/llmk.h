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
#include "llmk/threads.h"

namespace llmk {
// The GPU backend this library was built with: "cuda", "hip" or "off".
const char* gpu_backend();
// The GPU targets it holds code for, comma-separated as the build named them: CUDA architectures
// ("80,90a": sm_80 code plus compute_80 PTX, sm_90a code) or AMD processors ("gfx90a,gfx942");
// "" without a GPU backend. An AMD GPU runs only code built for its exact processor.
const char* gpu_targets();
}  // namespace llmk

extern "C" const char* llmk_gpu_backend();  // the same, for dlopen/ctypes users
extern "C" const char* llmk_gpu_targets();
