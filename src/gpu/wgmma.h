// Hopper (sm_90a) warpgroup MMA building blocks (part of the portability layer; included only by
// GPU code): wgmma.mma_async with shared-memory matrix descriptors, the fence / commit / wait
// discipline, and the async-proxy fence that makes cp.async data visible to wgmma.
//
// LLMK_HAS_WGMMA (device code): the target being compiled is sm_90a (the arch-specific feature set:
//   __CUDA_ARCH_FEAT_SM90_ALL), so the instructions are emitted. Everywhere else (HIP, sm_80,
//   plain sm_90, host code) the helpers compile to nothing and kernels built on them must not be
//   launched: the host asks the kernel itself whether its body was built (see attention_hopper.cu).
//
// Shared memory layout used with these descriptors ("128-byte swizzle", 16-bit elements):
//   A tile of R rows x C columns (C a multiple of 64, R a multiple of 8, base 1024-byte aligned)
//   is stored as C / 64 column blocks of R rows x 128 bytes. Element (r, c) lives at byte
//     (c / 64) * (R * 128) + r * 128 + ((((c % 64) / 8) ^ (r % 8)) * 16) + (c % 8) * 2
//   i.e. each 128-byte row holds 8 chunks of 16 bytes and chunk j of row r is stored at slot
//   j ^ (r % 8) (address bits [4,7) XOR bits [7,10)): the pattern wgmma's 128B swizzle mode
//   expects, and what makes the cp.async stores and wgmma reads bank-conflict-free.
//
// Descriptor (64 bits): [0,14) start address >> 4, [16,30) leading byte offset >> 4, [32,46)
// stride byte offset >> 4, [49,52) base offset (0: atoms 1024-byte aligned), [62,64) layout
// (1 = 128B swizzle).
//   * K-major operand (A = Q rows x D, or B = K keys x D, the reduction dim contiguous): one
//     wgmma k16 step reads 16 columns = 32 bytes of every row, inside one 128-byte swizzle row, so
//     the leading byte offset is unused (1 by convention); stride byte offset = 1024 (the next
//     8-row group). Step kk of the reduction starts at column block kk / 4, plus (kk % 4) * 32 bytes
//     (the hardware applies the XOR to the final address bits, so the offset goes in unswizzled).
//   * MN-major operand (B = V stored keys x D, D contiguous; the transpose bit set): the
//     reduction dim (keys) is the row index. Stride byte offset = 1024 (the next 8 keys), leading
//     byte offset = R * 128 (the next 64 columns of D, i.e. the next column block). Step kk (keys
//     16kk..16kk+15) starts 16 * 128 * kk bytes in.
#pragma once

#include <cstdint>
#include <type_traits>

#include "gpu/compat.h"
#include "gpu/mma.h"

#if LLMK_CUDA && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define LLMK_HAS_WGMMA 1
#else
#define LLMK_HAS_WGMMA 0
#endif

#if LLMK_MMA_SYNC_BUILD

namespace llmk::gpu::wgmma {

// Byte offset of the 16-byte chunk `chunk` (columns 8 * chunk ..+7) of row r in an R-row tile
// laid out as above.
template <int R>
__device__ __forceinline__ uint32_t swizzled_chunk(int r, int chunk) {
  return static_cast<uint32_t>((chunk / 8) * (R * 128) + r * 128 + (((chunk % 8) ^ (r % 8)) * 16));
}

// Descriptor of a 128B-swizzled operand starting at shared address `addr` (bytes).
__device__ __forceinline__ uint64_t make_desc(uint32_t addr, uint32_t leading_bytes, uint32_t stride_bytes) {
  uint64_t d = 0;
  d |= static_cast<uint64_t>((addr >> 4) & 0x3FFF);
  d |= static_cast<uint64_t>((leading_bytes >> 4) & 0x3FFF) << 16;
  d |= static_cast<uint64_t>((stride_bytes >> 4) & 0x3FFF) << 32;
  d |= uint64_t{1} << 62;  // 128-byte swizzle
  return d;
}

// The descriptor `bytes` further on in shared memory: one 32-bit add to the address field (the
// low word; addresses stay below 2^18, so the 14-bit field does not carry into the leading byte
// offset). Loops over k-steps build one descriptor and step it with this, rather than building
// each with make_desc's shifts and masks (H200 profile, 2026-12-02: ~7 integer instructions and
// two register-to-uniform moves per wgmma in the attention consumers).
__device__ __forceinline__ uint64_t desc_offset(uint64_t desc, uint32_t bytes) {
  const uint32_t lo = static_cast<uint32_t>(desc) + (bytes >> 4), hi = static_cast<uint32_t>(desc >> 32);
  return (static_cast<uint64_t>(hi) << 32) | lo;
}

// Before the first wgmma of a batch (orders this thread's register / shared accesses before it).
__device__ __forceinline__ void fence() {
#if LLMK_HAS_WGMMA
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void commit() {
#if LLMK_HAS_WGMMA
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}

// Waits until at most N committed wgmma groups of this warpgroup are pending.
template <int N>
__device__ __forceinline__ void wait() {
#if LLMK_HAS_WGMMA
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
#endif
}

// Makes shared memory written through the generic proxy (st.shared, cp.async once waited for)
// visible to the async proxy (wgmma operand reads). Each writing thread, before the barrier.
__device__ __forceinline__ void fence_proxy_async() {
#if LLMK_HAS_WGMMA
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}

// Keeps the accumulator registers in place across the asynchronous wgmma (no reordering of their
// reads / writes around it by the compiler).
template <int R>
__device__ __forceinline__ void fence_regs(float (&d)[R]) {
#if LLMK_HAS_WGMMA
#pragma unroll
  for (int i = 0; i < R; ++i) asm volatile("" : "+f"(d[i])::"memory");
#else
  (void)d;
#endif
}

// The accumulator operands of a wgmma, "+f"(d[0]) .. "+f"(d[n - 1]) for n = N / 2 per thread.
#define LLMK_WGMMA_ACC8(i) \
  "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), "+f"(d[i + 6]), "+f"(d[i + 7])
#define LLMK_WGMMA_ACC32 LLMK_WGMMA_ACC8(0), LLMK_WGMMA_ACC8(8), LLMK_WGMMA_ACC8(16), LLMK_WGMMA_ACC8(24)
#define LLMK_WGMMA_ACC64 \
  LLMK_WGMMA_ACC32, LLMK_WGMMA_ACC8(32), LLMK_WGMMA_ACC8(40), LLMK_WGMMA_ACC8(48), LLMK_WGMMA_ACC8(56)
#define LLMK_WGMMA_ACC80 LLMK_WGMMA_ACC64, LLMK_WGMMA_ACC8(64), LLMK_WGMMA_ACC8(72)
#define LLMK_WGMMA_ACC88 LLMK_WGMMA_ACC80, LLMK_WGMMA_ACC8(80)

// One wgmma.mma_async per tile width, TYPE "f16" or "bf16" (the instruction text names the element
// type twice); SS: A and B from shared memory (descriptors desc_a, desc_b, transpose bits TRANS_A /
// TRANS_B); RS: A from registers a[0..3], B MN-major from shared memory (desc_b). scale_d == 0 sets
// d = A B instead of adding.
#define LLMK_WGMMA_SS_N64(TYPE) \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n" \
               "wgmma.mma_async.sync.aligned.m64n64k16.f32." TYPE "." TYPE \
               " {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, %32, %33, p, 1, 1, %35, %36;\n}\n" \
               : LLMK_WGMMA_ACC32 \
               : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(TRANS_A), "n"(TRANS_B))
#define LLMK_WGMMA_SS_N128(TYPE) \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n" \
               "wgmma.mma_async.sync.aligned.m64n128k16.f32." TYPE "." TYPE \
               " {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, %64, %65, p, 1, 1, %67, %68;\n}\n" \
               : LLMK_WGMMA_ACC64 \
               : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(TRANS_A), "n"(TRANS_B))
#define LLMK_WGMMA_SS_N160(TYPE) \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %82, 0;\n" \
               "wgmma.mma_async.sync.aligned.m64n160k16.f32." TYPE "." TYPE \
               " {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63,%64,%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79}, %80, %81, p, 1, 1, %83, %84;\n}\n" \
               : LLMK_WGMMA_ACC80 \
               : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(TRANS_A), "n"(TRANS_B))
#define LLMK_WGMMA_SS_N176(TYPE) \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %90, 0;\n" \
               "wgmma.mma_async.sync.aligned.m64n176k16.f32." TYPE "." TYPE \
               " {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63,%64,%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79,%80,%81,%82,%83,%84,%85,%86,%87}, %88, %89, p, 1, 1, %91, %92;\n}\n" \
               : LLMK_WGMMA_ACC88 \
               : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(TRANS_A), "n"(TRANS_B))
#define LLMK_WGMMA_RS_N64(TYPE) \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n" \
               "wgmma.mma_async.sync.aligned.m64n64k16.f32." TYPE "." TYPE \
               " {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, {%32,%33,%34,%35}, %36, p, 1, 1, 1;\n}\n" \
               : LLMK_WGMMA_ACC32 \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d))
#define LLMK_WGMMA_RS_N128(TYPE) \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n" \
               "wgmma.mma_async.sync.aligned.m64n128k16.f32." TYPE "." TYPE \
               " {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, {%64,%65,%66,%67}, %68, p, 1, 1, 1;\n}\n" \
               : LLMK_WGMMA_ACC64 \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d))

// d (64 x N fp32, the accumulator fragment below) = A B^T (+ d when scale_d != 0), one k16 step,
// A (64 x 16) and B (N x 16) both K-major in shared memory, or MN-major where TRANS_A / TRANS_B is
// 1 (the transpose bits; A stored 16 x 64, B 16 x N, see the layout notes above). T = half or
// bfloat16. N = 160 and 176 serve the D = 128 attention's wider key tiles.
// Accumulator fragment (per warp w of the warpgroup, g = lane / 4, t = lane % 4): d[4j + e] is
// (row 16w + g, column 8j + 2t + e), d[4j + 2 + e] is (row 16w + g + 8, column 8j + 2t + e).
template <typename T, int N, int TRANS_A = 0, int TRANS_B = 0>
__device__ __forceinline__ void mma_ss(float (&d)[N / 2], uint64_t desc_a, uint64_t desc_b, int scale_d) {
  static_assert(N == 64 || N == 128 || N == 160 || N == 176, "wgmma tile widths built: 64, 128, 160, 176");
#if LLMK_HAS_WGMMA
  constexpr bool kF16 = std::is_same_v<T, half>;
  if constexpr (N == 64) {
    if constexpr (kF16) LLMK_WGMMA_SS_N64("f16"); else LLMK_WGMMA_SS_N64("bf16");
  } else if constexpr (N == 128) {
    if constexpr (kF16) LLMK_WGMMA_SS_N128("f16"); else LLMK_WGMMA_SS_N128("bf16");
  } else if constexpr (N == 160) {
    if constexpr (kF16) LLMK_WGMMA_SS_N160("f16"); else LLMK_WGMMA_SS_N160("bf16");
  } else {
    if constexpr (kF16) LLMK_WGMMA_SS_N176("f16"); else LLMK_WGMMA_SS_N176("bf16");
  }
#else
  (void)d;
  (void)desc_a;
  (void)desc_b;
  (void)scale_d;
#endif
}

// d (64 x N fp32) += A B, one k16 step: A (64 x 16) from registers in the mma.sync m16n8k16 A
// layout per warp (a[0] (g, 2t..), a[1] (g+8, 2t..), a[2] (g, 2t+8..), a[3] (g+8, 2t+8..) of the
// warp's 16 rows: the accumulator fragment of two adjacent 8-column chunks, packed), B (16 x N)
// MN-major in shared memory (transpose bit set).
template <typename T, int N>
__device__ __forceinline__ void mma_rs(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t desc_b, int scale_d) {
  static_assert(N == 64 || N == 128, "wgmma tile widths built: 64, 128");
#if LLMK_HAS_WGMMA
  constexpr bool kF16 = std::is_same_v<T, half>;
  if constexpr (N == 64) {
    if constexpr (kF16) LLMK_WGMMA_RS_N64("f16"); else LLMK_WGMMA_RS_N64("bf16");
  } else {
    if constexpr (kF16) LLMK_WGMMA_RS_N128("f16"); else LLMK_WGMMA_RS_N128("bf16");
  }
#else
  (void)d;
  (void)a;
  (void)desc_b;
  (void)scale_d;
#endif
}

// The asm macros name mma_ss / mma_rs's parameters (d, a, desc_a, desc_b, scale_d): not for use
// outside them.
#undef LLMK_WGMMA_SS_N64
#undef LLMK_WGMMA_SS_N128
#undef LLMK_WGMMA_SS_N160
#undef LLMK_WGMMA_SS_N176
#undef LLMK_WGMMA_RS_N64
#undef LLMK_WGMMA_RS_N128
#undef LLMK_WGMMA_ACC88
#undef LLMK_WGMMA_ACC80
#undef LLMK_WGMMA_ACC64
#undef LLMK_WGMMA_ACC32
#undef LLMK_WGMMA_ACC8

}  // namespace llmk::gpu::wgmma

#endif  // LLMK_MMA_SYNC_BUILD
