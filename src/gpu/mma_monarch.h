// Tensor-core helpers for the Monarch kernels (kept apart from the attention branch's mma
// helpers until the two are unified): one warp-wide D += A * B of m16n8k16 with fp32
// accumulators and 16-bit inputs, behind LLMK_HAS_MMA_SYNC (CUDA, compiled for sm_80 or newer).
// Fragment layout (g = lane / 4, t = lane % 4), each 32-bit register two consecutive-k elements,
// the lower k in the low half:
//   a[0] (row g, k 2t)  a[1] (row g+8, k 2t)  a[2] (row g, k 2t+8)  a[3] (row g+8, k 2t+8)
//   b[0] (k 2t, col g)  b[1] (k 2t+8, col g)
//   d[0..1] (row g, cols 2t, 2t+1)  d[2..3] (row g+8, cols 2t, 2t+1)
// Other targets (HIP, older NVIDIA) get LLMK_HAS_MMA_SYNC 0 and must use their portable path;
// the host asks mma_sync_available(device) before choosing a tensor-core kernel.
#pragma once

#include <cstdint>
#include <type_traits>

#include "gpu/compat.h"

#if LLMK_CUDA && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
#define LLMK_HAS_MMA_SYNC 1
#else
#define LLMK_HAS_MMA_SYNC 0
#endif

namespace llmk::gpu {

template <typename T>
__device__ __forceinline__ void mma_m16n8k16(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
#if LLMK_HAS_MMA_SYNC
  if constexpr (std::is_same_v<T, bfloat16>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
#else
  (void)d; (void)a; (void)b;
#if defined(__HIP_DEVICE_COMPILE__)
  __builtin_trap();  // never launched: the host checks mma_sync_available first
#elif defined(__CUDA_ARCH__)
  __trap();
#endif
#endif
}

// Whether this build has tensor-core (mma.sync) kernels for the device: CUDA, compute >= 8.0.
inline bool mma_sync_available(int device) {
#if LLMK_CUDA
  int major = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess) return false;
  return major >= 8;
#else
  (void)device;
  return false;
#endif
}

// Largest dynamic shared memory one block may opt in to on the device.
inline int max_shared_memory_optin(int device) {
#if LLMK_CUDA
  int bytes = 48 * 1024;
  cudaDeviceGetAttribute(&bytes, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  return bytes;
#else
  (void)device;
  return 64 * 1024;  // LDS per workgroup on CDNA and RDNA
#endif
}

}  // namespace llmk::gpu
