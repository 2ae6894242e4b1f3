// NVIDIA tensor-core building blocks for sm_80+ (part of the portability layer; included only by
// GPU code): mma.sync m16n8k16 with fp32 accumulation, ldmatrix, cp.async with zero fill, and the
// host checks that choose between a tensor-core kernel and its portable twin.
//
// LLMK_MMA_SYNC_BUILD (host and device code): this build can hold mma.sync kernels (CUDA). Tensor-core
//   kernels and their launchers sit behind it; HIP builds compile only the portable kernels.
// LLMK_HAS_MMA_SYNC (device code): the target being compiled is sm_80 or newer, so the instructions
//   are emitted; elsewhere the helpers compile to nothing (mma_m16n8k16 traps: never launched,
//   because the host asks mma::available(device) first).
//
// Fragment layouts (PTX ISA, mma.m16n8k16, g = lane / 4, t = lane % 4):
//   A 16x16 (row major): a0 (g, 2t..2t+1), a1 (g+8, 2t..), a2 (g, 2t+8..), a3 (g+8, 2t+8..)
//   B 16x8  (k x n):     b0 (k 2t..2t+1, n g), b1 (k 2t+8..2t+9, n g)
//   C 16x8  fp32:        c0 c1 (g, 2t..2t+1), c2 c3 (g+8, 2t..2t+1)
#pragma once

#include <cstdint>

#include "gpu/compat.h"

#include <type_traits>

#if LLMK_CUDA
#define LLMK_MMA_SYNC_BUILD 1
#else
#define LLMK_MMA_SYNC_BUILD 0
#endif
#if LLMK_CUDA && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
#define LLMK_HAS_MMA_SYNC 1
#else
#define LLMK_HAS_MMA_SYNC 0
#endif

namespace llmk::gpu {

// d += a b for one m16n8k16 tile, fp32 accumulate, T = half or bfloat16 inputs (fragments as
// above: a = 4 registers of A, b = 2 registers of B, d = 4 floats of C).
template <typename T>
__device__ __forceinline__ void mma_m16n8k16(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
#if LLMK_HAS_MMA_SYNC
  if constexpr (std::is_same_v<T, half>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
#else
  (void)d;
  (void)a;
  (void)b;
#if defined(__HIP_DEVICE_COMPILE__)
  __builtin_trap();
#elif defined(__CUDA_ARCH__)
  __trap();
#endif
#endif
}

}  // namespace llmk::gpu

namespace llmk::gpu::mma {

// Host: whether `device` runs mma.sync / ldmatrix / cp.async (a CUDA build, compute capability
// 8.0 or newer).
inline bool available(int device) {
#if LLMK_MMA_SYNC_BUILD
  int major = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess) return false;
  return major >= 8;
#else
  (void)device;
  return false;
#endif
}

// Host: the most dynamic shared memory one block of `device` may opt in to (bytes).
inline int max_shared_memory(int device) {
  int bytes = 64 * 1024;  // LDS per workgroup on CDNA and RDNA
#if LLMK_CUDA
  bytes = 48 * 1024;
  cudaDeviceGetAttribute(&bytes, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
#else
  (void)device;
#endif
  return bytes;
}

}  // namespace llmk::gpu::mma

#if LLMK_MMA_SYNC_BUILD

namespace llmk::gpu::mma {

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// The first 1024-byte aligned shared-memory address at or after p. TMA's swizzled boxes and the
// wgmma descriptors (base offset 0) need swizzle atoms on 1024-byte boundaries; a kernel that
// uses this reserves 1 KiB of slack in its dynamic shared memory.
__device__ __forceinline__ unsigned char* align_smem_1024(unsigned char* p) {
  return p + ((1024u - (smem_u32(p) & 1023u)) & 1023u);
}

// 16 bytes global -> shared without going through registers. src_bytes 0 writes 16 zero bytes
// (nothing is read, but `gmem` must still be a valid address).
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, int src_bytes) {
#if LLMK_HAS_MMA_SYNC
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(smem)), "l"(gmem),
               "r"(src_bytes)
               : "memory");
#endif
}

__device__ __forceinline__ void cp_async_commit() {
#if LLMK_HAS_MMA_SYNC
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}

// Waits until at most N committed groups of this thread are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
#if LLMK_HAS_MMA_SYNC
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
#endif
}

// A STAGES-deep cp.async pipeline over `steps` steps of a block's main loop: load(step, buffer)
// issues step's copies into ring buffer `buffer` (= step % STAGES), compute(step, buffer) uses
// them once they have landed for every thread of the block; the copies of step + STAGES - 1 are
// issued (into the buffer every thread finished with at step - 1) before step's compute runs.
// Every thread of the block must call it (it holds __syncthreads); copies of the last steps may
// still be committed-but-empty groups at the end, so a caller that reuses the buffers afterwards
// waits for them (cp_async_wait<0>).
template <int STAGES, typename Load, typename Compute>
__device__ __forceinline__ void cp_async_pipeline(int steps, Load&& load, Compute&& compute) {
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < steps) load(s, s);
    cp_async_commit();
  }
  for (int it = 0; it < steps; ++it) {
    cp_async_wait<STAGES - 2>();
    __syncthreads();  // step `it` landed for all threads; buffer (it - 1) % STAGES is free
    if (it + STAGES - 1 < steps) load(it + STAGES - 1, (it + STAGES - 1) % STAGES);
    cp_async_commit();
    compute(it, it % STAGES);
  }
}

// Four 8x8 b16 matrices; lanes 8i..8i+7 give the row addresses of matrix i; r[i] is matrix i's
// (lane / 4, 2 * (lane % 4) ..+1) pair, or with _trans its (2 * (lane % 4) ..+1, lane / 4) pair.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* smem) {
#if LLMK_HAS_MMA_SYNC
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(smem)));
#endif
}

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* smem) {
#if LLMK_HAS_MMA_SYNC
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(smem)));
#endif
}

// d += a * b (16x8x16) with B given as two registers (the attention kernel's form).
template <typename T>
__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  const uint32_t b[2] = {b0, b1};
  mma_m16n8k16<T>(d, a, b);
}

// 2^x by the special-function unit alone (ex2.approx.ftz: ~2 ulp, subnormal results flushed to 0;
// exp2f adds a range fix-up around it). ex2(-inf) = 0.
__device__ __forceinline__ float ex2_approx(float x) {
#if LLMK_HAS_MMA_SYNC
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
#else
  return exp2f(x);
#endif
}

// Two floats as one 32-bit register of two T (lo in the low half), rounded to nearest.
template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  if constexpr (std::is_same_v<T, half>) {
    const __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&h);
  } else {
    const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&h);
  }
}

}  // namespace llmk::gpu::mma

#endif  // LLMK_MMA_SYNC_BUILD
