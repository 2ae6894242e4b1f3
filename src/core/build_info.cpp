#include "llmk/llmk.h"

#ifndef LLMK_GPU_BACKEND_NAME
#define LLMK_GPU_BACKEND_NAME "off"
#endif
#ifndef LLMK_GPU_TARGETS
#define LLMK_GPU_TARGETS ""
#endif

namespace llmk {
const char* gpu_backend() { return LLMK_GPU_BACKEND_NAME; }
const char* gpu_targets() { return LLMK_GPU_TARGETS; }
}  // namespace llmk

extern "C" const char* llmk_gpu_backend() { return llmk::gpu_backend(); }
extern "C" const char* llmk_gpu_targets() { return llmk::gpu_targets(); }
