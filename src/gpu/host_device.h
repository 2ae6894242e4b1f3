// LLMK_HOST_DEVICE: marks a function for both the host and the GPU when the file is compiled as
// GPU code (nvcc, or clang in HIP mode), and as a plain inline function otherwise, so that math
// shared by the CPU and GPU backends can live in one header. Part of the portability layer.
#pragma once

#if defined(__CUDACC__)
#define LLMK_HOST_DEVICE __host__ __device__ inline
#elif defined(__HIP__)  // hipcc compiles .cpp files as HIP too, without the runtime headers
#define LLMK_HOST_DEVICE __attribute__((host, device)) inline
#else
#define LLMK_HOST_DEVICE inline
#endif
