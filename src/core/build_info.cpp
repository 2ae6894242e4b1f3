#include "llmk/llmk.h"

#ifndef LLMK_GPU_BACKEND_NAME
#define LLMK_GPU_BACKEND_NAME "off"
#endif

namespace llmk {
const char* gpu_backend() { return LLMK_GPU_BACKEND_NAME; }
}  // namespace llmk

extern "C" const char* llmk_gpu_backend() { return llmk::gpu_backend(); }
