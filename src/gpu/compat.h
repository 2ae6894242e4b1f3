// The portability layer: the only place in llmk that knows whether it is compiled by nvcc (CUDA)
// or hipcc (HIP). Kernels include this header and use the names below, never vendor names.
//
//   runtime     gpuStream_t, gpuError_t, gpu* runtime calls (see runtime.h for the checked forms)
//   types       llmk::gpu::half, llmk::gpu::bfloat16 and to_float / from_float<T>
//   warps       LLMK_WARP_SIZE (device code, compile-time per target), shfl_xor
//   reductions  warp_reduce_sum, warp_reduce_scatter (many sums at once), and group_reduce_sum for
//               thread groups of any warp multiple
//   vectors     Vec<T, N>: N elements loaded or stored as one (up to 16-byte) access, with a
//               cache policy (keep, or stream for data touched once); load_once (L1 bypass,
//               L2 evict-first and 256-byte L2 prefetch on NVIDIA sm_80+); copy16_async
//               (global to shared, cp.async on NVIDIA sm_80+)
#pragma once

#if defined(__HIPCC__) || defined(__HIP_PLATFORM_AMD__)
#define LLMK_HIP 1
#include <hip/hip_runtime.h>
#include <hip/hip_fp16.h>
#if __has_include(<hip/hip_bf16.h>)
#include <hip/hip_bf16.h>
#define LLMK_HIP_HAS_BF16_T 1
#else
#include <hip/hip_bfloat16.h>
#endif
#else
#define LLMK_CUDA 1
#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#endif

#include <cstdint>
#include <type_traits>

// ---------------------------------------------------------------- runtime API names
#if LLMK_HIP
using gpuStream_t = hipStream_t;
using gpuError_t = hipError_t;
using gpuDeviceProp = hipDeviceProp_t;
#define gpuSuccess hipSuccess
#define gpuGetErrorString hipGetErrorString
#define gpuGetLastError hipGetLastError
#define gpuGetDevice hipGetDevice
#define gpuSetDevice hipSetDevice
#define gpuGetDeviceCount hipGetDeviceCount
#define gpuGetDeviceProperties hipGetDeviceProperties
#define gpuDeviceGetAttribute hipDeviceGetAttribute
#define gpuDevAttrWarpSize hipDeviceAttributeWarpSize
#define gpuDevAttrMultiProcessorCount hipDeviceAttributeMultiprocessorCount
#define gpuDevAttrComputeCapabilityMajor hipDeviceAttributeComputeCapabilityMajor
#define gpuFuncSetAttribute(f, a, v) hipFuncSetAttribute(reinterpret_cast<const void*>(f), a, v)
#define gpuFuncAttributeMaxDynamicSharedMemorySize hipFuncAttributeMaxDynamicSharedMemorySize
#define gpuOccupancyMaxActiveBlocksPerMultiprocessor hipOccupancyMaxActiveBlocksPerMultiprocessor
#define gpuMemsetAsync hipMemsetAsync
#define gpuMalloc hipMalloc
#define gpuFree hipFree
#define gpuMemcpy hipMemcpy
#define gpuMemcpyHostToDevice hipMemcpyHostToDevice
#define gpuMemcpyDeviceToHost hipMemcpyDeviceToHost
#define gpuDeviceSynchronize hipDeviceSynchronize
#define gpuLaunchCooperativeKernel hipLaunchCooperativeKernel
using gpuEvent_t = hipEvent_t;
#define gpuEventCreate hipEventCreate
#define gpuEventDestroy hipEventDestroy
#define gpuEventRecord hipEventRecord
#define gpuEventElapsedTime hipEventElapsedTime
#else
using gpuStream_t = cudaStream_t;
using gpuError_t = cudaError_t;
using gpuDeviceProp = cudaDeviceProp;
#define gpuSuccess cudaSuccess
#define gpuGetErrorString cudaGetErrorString
#define gpuGetLastError cudaGetLastError
#define gpuGetDevice cudaGetDevice
#define gpuSetDevice cudaSetDevice
#define gpuGetDeviceCount cudaGetDeviceCount
#define gpuGetDeviceProperties cudaGetDeviceProperties
#define gpuDeviceGetAttribute cudaDeviceGetAttribute
#define gpuDevAttrWarpSize cudaDevAttrWarpSize
#define gpuDevAttrMultiProcessorCount cudaDevAttrMultiProcessorCount
#define gpuDevAttrComputeCapabilityMajor cudaDevAttrComputeCapabilityMajor
#define gpuFuncSetAttribute cudaFuncSetAttribute
#define gpuFuncAttributeMaxDynamicSharedMemorySize cudaFuncAttributeMaxDynamicSharedMemorySize
#define gpuOccupancyMaxActiveBlocksPerMultiprocessor cudaOccupancyMaxActiveBlocksPerMultiprocessor
#define gpuMemsetAsync cudaMemsetAsync
#define gpuMalloc cudaMalloc
#define gpuFree cudaFree
#define gpuMemcpy cudaMemcpy
#define gpuMemcpyHostToDevice cudaMemcpyHostToDevice
#define gpuMemcpyDeviceToHost cudaMemcpyDeviceToHost
#define gpuDeviceSynchronize cudaDeviceSynchronize
#define gpuLaunchCooperativeKernel cudaLaunchCooperativeKernel
using gpuEvent_t = cudaEvent_t;
#define gpuEventCreate cudaEventCreate
#define gpuEventDestroy cudaEventDestroy
#define gpuEventRecord cudaEventRecord
#define gpuEventElapsedTime cudaEventElapsedTime
#endif

// ---------------------------------------------------------------- warp size
// Device code: a compile-time constant per target. 64 on CDNA (gfx9xx), 32 on RDNA and NVIDIA.
// Host code must never use this: one host binary serves wave32 and wave64 GPUs, so the host reads
// the warp size of the device at run time (llmk::gpu::warp_size(device) in runtime.h).
// CDNA is known by __GFX9__ first: __AMDGCN_WAVEFRONT_SIZE is deprecated in recent ROCm (6.3 on)
// and only consulted for other targets (RDNA built for wave64).
#if LLMK_HIP
#if defined(__GFX9__)
#define LLMK_WARP_SIZE 64
#elif defined(__AMDGCN_WAVEFRONT_SIZE)
#define LLMK_WARP_SIZE __AMDGCN_WAVEFRONT_SIZE
#else
#define LLMK_WARP_SIZE 32
#endif
#else
#define LLMK_WARP_SIZE 32
#endif

namespace llmk::gpu {

// ---------------------------------------------------------------- 16-bit float types
#if LLMK_HIP
using half = __half;
#if LLMK_HIP_HAS_BF16_T
using bfloat16 = __hip_bfloat16;
__device__ __forceinline__ float to_float(bfloat16 v) { return __bfloat162float(v); }
#else
using bfloat16 = hip_bfloat16;
__device__ __forceinline__ float to_float(bfloat16 v) { return static_cast<float>(v); }
#endif
#else
using half = __half;
using bfloat16 = __nv_bfloat16;
__device__ __forceinline__ float to_float(bfloat16 v) { return __bfloat162float(v); }
#endif

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(half v) { return __half2float(v); }

template <typename T> __device__ __forceinline__ T from_float(float v);
template <> __device__ __forceinline__ float from_float<float>(float v) { return v; }
template <> __device__ __forceinline__ half from_float<half>(float v) { return __float2half_rn(v); }
#if LLMK_HIP && !LLMK_HIP_HAS_BF16_T
template <> __device__ __forceinline__ bfloat16 from_float<bfloat16>(float v) {
  return bfloat16(v);  // hip_bfloat16 rounds to nearest even
}
#else
template <> __device__ __forceinline__ bfloat16 from_float<bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}
#endif

// ---------------------------------------------------------------- warp shuffles and reductions
__device__ __forceinline__ float shfl_xor(float v, int lane_mask) {
#if LLMK_HIP
  return __shfl_xor(v, lane_mask);
#else
  return __shfl_xor_sync(0xffffffffu, v, lane_mask);
#endif
}

// v of lane `src_lane` of this warp (float or int; an int read from lane 0 is also how a kernel
// tells the compiler that a value is warp-uniform).
template <typename V>
__device__ __forceinline__ V shfl(V v, int src_lane) {
  static_assert(std::is_same_v<V, float> || std::is_same_v<V, int>, "shfl: float or int");
#if LLMK_HIP
  return __shfl(v, src_lane);
#else
  return __shfl_sync(0xffffffffu, v, src_lane);
#endif
}

__device__ __forceinline__ float warp_reduce_sum(float v) {
#pragma unroll
  for (int m = LLMK_WARP_SIZE / 2; m > 0; m >>= 1) v += shfl_xor(v, m);
  return v;
}

// Sums over the warp of N values per lane (N a power of two), scattered over the lanes: a butterfly
// in which each step halves the values a lane holds (it keeps one half and sends the other to lane
// ^ o), so the N sums cost about N shuffles instead of N * log2(warp size). Afterwards v[0 ..
// reduce_scatter_count<N>() - 1] hold the sums of values reduce_scatter_index<N>(lane) + j. Where N
// is below the warp size, the last steps are plain xor reductions and every lane of a run of
// warp size / N lanes holds the same sum (reduce_scatter_writer picks one of them).
template <int N>
constexpr int reduce_scatter_count() { return N > LLMK_WARP_SIZE ? N / LLMK_WARP_SIZE : 1; }

template <int N, int H = N, int O = LLMK_WARP_SIZE / 2>
__device__ __forceinline__ void warp_reduce_scatter(float (&v)[N], int lane) {
  static_assert(N > 0 && (N & (N - 1)) == 0, "warp_reduce_scatter: N a power of two");
  if constexpr (O > 0) {
    if constexpr (H > 1) {
      const bool upper = (lane & O) != 0;
#pragma unroll
      for (int i = 0; i < H / 2; ++i) {
        const float send = upper ? v[i] : v[i + H / 2];
        const float keep = upper ? v[i + H / 2] : v[i];
        v[i] = keep + shfl_xor(send, O);
      }
      warp_reduce_scatter<N, H / 2, O / 2>(v, lane);
    } else {
      v[0] += shfl_xor(v[0], O);
      warp_reduce_scatter<N, 1, O / 2>(v, lane);
    }
  }
}

template <int N>
__device__ __forceinline__ int reduce_scatter_index(int lane) {
  int index = 0;
#pragma unroll
  for (int o = LLMK_WARP_SIZE / 2, h = N / 2; o > 0 && h > 0; o >>= 1, h >>= 1)
    if (lane & o) index += h;
  return index;
}

template <int N>
__device__ __forceinline__ bool reduce_scatter_writer(int lane) {
  return N >= LLMK_WARP_SIZE || (lane & (LLMK_WARP_SIZE / N - 1)) == 0;
}

// Sum of `v` over a group of `group_threads` consecutive threads of a block (a multiple of the
// warp size, or one warp), for several groups at once: group g is threads with threadIdx.y == g.
// Every thread of the block must call it (it holds barriers). `scratch` needs one float per warp
// of the block. Returns the group's sum to every thread of the group. N values at once.
template <int N>
__device__ __forceinline__ void group_reduce_sum(float (&v)[N], float* scratch) {
  const int warps_per_group = (blockDim.x + LLMK_WARP_SIZE - 1) / LLMK_WARP_SIZE;
#pragma unroll
  for (int i = 0; i < N; ++i) v[i] = warp_reduce_sum(v[i]);
  if (warps_per_group == 1) return;
  const int lane = threadIdx.x % LLMK_WARP_SIZE;
  const int warp = threadIdx.x / LLMK_WARP_SIZE;
  float* mine = scratch + N * warps_per_group * threadIdx.y;
  __syncthreads();  // scratch may still be read by a previous call
  if (lane == 0) {
#pragma unroll
    for (int i = 0; i < N; ++i) mine[i * warps_per_group + warp] = v[i];
  }
  __syncthreads();
#pragma unroll
  for (int i = 0; i < N; ++i) {
    float s = 0.f;
    for (int w = 0; w < warps_per_group; ++w) s += mine[i * warps_per_group + w];
    v[i] = s;
  }
}

// ---------------------------------------------------------------- vector loads and stores
// N elements of T as one aligned access (16 bytes at most per instruction; wider vectors such as
// 8 floats become two 16-byte accesses).
template <typename T, int N>
struct alignas(sizeof(T) * N > 16 ? 16 : sizeof(T) * N) Vec {
  T v[N];
};

// Cache policy of a global access: keep (default) or stream (data read or written once, marked
// evict-first so it does not push reused data such as weights out of L2).
enum class Cache { keep, stream };

template <Cache C, typename V>
__device__ __forceinline__ V load(const V* p) {
#if LLMK_CUDA
  if constexpr (C == Cache::stream && sizeof(V) == 16) {
    const int4 r = __ldcs(reinterpret_cast<const int4*>(p));
    return *reinterpret_cast<const V*>(&r);
  }
#endif
  return *p;
}

// 16 bytes from global to shared memory, zeros where !valid (gmem is not read then). NVIDIA sm_80+:
// cp.async (no register round trip, all of a thread's copies in flight at once); elsewhere a
// plain 16-byte load and store. copy16_async_wait() waits for this thread's copies; a block
// barrier after it publishes them to the other threads.
__device__ __forceinline__ void copy16_async(void* smem, const void* gmem, bool valid) {
#if LLMK_CUDA && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(
                   static_cast<unsigned>(__cvta_generic_to_shared(smem))),
               "l"(gmem), "r"(valid ? 16 : 0)
               : "memory");
#else
  *static_cast<uint4*>(smem) = valid ? *static_cast<const uint4*>(gmem) : uint4{0u, 0u, 0u, 0u};
#endif
}
__device__ __forceinline__ void copy16_async_wait() {
#if LLMK_CUDA && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_all;\n" ::: "memory");
#endif
}

// Programmatic dependent launch, device side (see gpu::launch and pdl_enabled in runtime.h):
// pdl_wait() blocks until the kernels this one depends on have completed and their writes are
// visible; pdl_trigger() lets the next kernel in the stream launch once every block of this one has
// run it. Both are no-ops when the kernel was launched without PDL, before sm_90 and on AMD.
__device__ __forceinline__ void pdl_wait() {
#if LLMK_CUDA && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_trigger() {
#if LLMK_CUDA && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}
// The usual start of a PDL-launched kernel that reads its inputs at once: let the next kernel
// launch, then wait for the previous one. (Waiting first, with the skinny GEMMs prefetching all
// of their W slices, measured worse on the H200 on 2026-11-30 23:00: the 1B model's e2e decode
// 838 tok/s with PDL against 900 without, where this order gave 926 against 904 at 22:47.)
__device__ __forceinline__ void pdl_begin() {
  pdl_trigger();
  pdl_wait();
}

// Nanoseconds of the GPU's global timer (NVIDIA; 0 elsewhere): for timeouts and test delays.
__device__ __forceinline__ uint64_t global_timer_ns() {
#if LLMK_CUDA && defined(__CUDA_ARCH__)
  uint64_t t = 0;
  asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(t));
  return t;
#else
  return 0;
#endif
}

// Asks L2 (or L1 and L2) for the line holding `p` (no registers, no wait; NVIDIA only, a no-op
// elsewhere).
__device__ __forceinline__ void prefetch_l2(const void* p) {
#if LLMK_CUDA && defined(__CUDA_ARCH__)
  asm volatile("prefetch.global.L2 [%0];\n" ::"l"(p));
#else
  (void)p;
#endif
}
__device__ __forceinline__ void prefetch_l1(const void* p) {
#if LLMK_CUDA && defined(__CUDA_ARCH__)
  asm volatile("prefetch.global.L1 [%0];\n" ::"l"(p));
#else
  (void)p;
#endif
}

// Data read exactly once by a memory-bound kernel (the weights of a GEMV): 16-byte loads that skip
// L1 (so the small operands reused by every block stay there), mark their L2 lines evict-first,
// and ask L2 for the surrounding 256 bytes at once. NVIDIA sm_80+: ld.global.nc.L1::no_allocate
// .L2::cache_hint.L2::256B with a createpolicy evict-first policy (the data must not be written
// during the kernel); elsewhere a Cache::stream load. `policy` comes from l2_evict_first_policy()
// (computed once per thread, 0 where unused).
__device__ __forceinline__ uint64_t l2_evict_first_policy() {
#if LLMK_CUDA && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(policy));
  return policy;
#else
  return 0;
#endif
}

template <typename V>
__device__ __forceinline__ V load_once(const V* p, uint64_t policy) {
  static_assert(sizeof(V) == 16, "load_once: 16-byte vectors only");
#if LLMK_CUDA && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  uint32_t r0, r1, r2, r3;
  asm volatile("ld.global.nc.L1::no_allocate.L2::cache_hint.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4], %5;\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "l"(p), "l"(policy));
  const uint32_t words[4] = {r0, r1, r2, r3};
  V out;
  static_assert(sizeof(words) == sizeof(V), "load_once: size");
  __builtin_memcpy(&out, words, sizeof(V));
  return out;
#else
  (void)policy;
  return load<Cache::stream>(p);
#endif
}

template <Cache C, typename V>
__device__ __forceinline__ void store(V* p, const V& v) {
#if LLMK_CUDA
  if constexpr (C == Cache::stream && sizeof(V) == 16) {
    __stcs(reinterpret_cast<int4*>(p), *reinterpret_cast<const int4*>(&v));
    return;
  }
#endif
  *p = v;
}

template <typename T, int N, Cache C = Cache::keep>
__device__ __forceinline__ Vec<T, N> load_vec(const T* p) {
  return load<C>(reinterpret_cast<const Vec<T, N>*>(p));
}

template <typename T, int N>
__device__ __forceinline__ void to_float(const Vec<T, N>& in, float (&out)[N]) {
  if constexpr (std::is_same_v<T, bfloat16> && N % 2 == 0) {
    // bf16 is the top half of a float: widen pairs with a shift and a mask, no conversion.
    const uint32_t* words = reinterpret_cast<const uint32_t*>(&in);
#pragma unroll
    for (int i = 0; i < N / 2; ++i) {
      out[2 * i] = __uint_as_float(words[i] << 16);
      out[2 * i + 1] = __uint_as_float(words[i] & 0xffff0000u);
    }
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) out[i] = to_float(in.v[i]);
  }
}

// Two floats to two 16-bit values with one packed conversion where the vendor has one.
template <typename T>
__device__ __forceinline__ void from_float2(float a, float b, T& x, T& y) {
  x = from_float<T>(a);
  y = from_float<T>(b);
}
#if LLMK_CUDA
template <>
__device__ __forceinline__ void from_float2<half>(float a, float b, half& x, half& y) {
  const __half2 r = __floats2half2_rn(a, b);
  x = r.x;
  y = r.y;
}
template <>
__device__ __forceinline__ void from_float2<bfloat16>(float a, float b, bfloat16& x, bfloat16& y) {
  const __nv_bfloat162 r = __floats2bfloat162_rn(a, b);
  x = r.x;
  y = r.y;
}
#endif

template <typename T, int N>
__device__ __forceinline__ Vec<T, N> from_float(const float (&in)[N]) {
  Vec<T, N> out;
#pragma unroll
  for (int i = 0; i + 1 < N; i += 2) from_float2<T>(in[i], in[i + 1], out.v[i], out.v[i + 1]);
  if constexpr (N % 2 == 1) out.v[N - 1] = from_float<T>(in[N - 1]);
  return out;
}

template <typename T, int N, Cache C = Cache::keep>
__device__ __forceinline__ void load_float(const T* p, float (&out)[N]) {
  to_float(load_vec<T, N, C>(p), out);
}

template <typename T, int N, Cache C = Cache::keep>
__device__ __forceinline__ void store_float(T* p, const float (&in)[N]) {
  store<C>(reinterpret_cast<Vec<T, N>*>(p), from_float<T, N>(in));
}

// A float written by another block of the same kernel (after that block's __threadfence and an
// atomic handshake, or atomic_add_acq_rel): read from L2, never from a possibly stale L1 line. On
// AMD the reader's agent-scope __threadfence or acquire already invalidates its L1, so a plain load
// is coherent.
__device__ __forceinline__ float load_coherent(const float* p) {
#if LLMK_CUDA
  return __ldcg(p);
#else
  return *p;
#endif
}
__device__ __forceinline__ float4 load_coherent(const float4* p) {
#if LLMK_CUDA
  return __ldcg(p);
#else
  return *p;
#endif
}

__device__ __forceinline__ float rsqrt(float v) { return ::rsqrtf(v); }

// Adds v to *counter at device (agent) scope with acquire-release order and returns the old value:
// one atomic where a fence and a relaxed atomic would be. After a block barrier, one thread's call
// publishes the whole block's earlier global writes (release is cumulative), and a block barrier
// after it hands the writes released with the value it read to the whole block (acquire; on AMD
// the acquire also invalidates the compute unit's L1, so plain loads see them).
__device__ __forceinline__ unsigned atomic_add_acq_rel(unsigned* counter, unsigned v) {
#if LLMK_CUDA
  unsigned old;
  asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], %2;\n" : "=r"(old) : "l"(counter), "r"(v) : "memory");
  return old;
#else
  return __hip_atomic_fetch_add(counter, v, __ATOMIC_ACQ_REL, __HIP_MEMORY_SCOPE_AGENT);
#endif
}

// Draws a ticket from a counter of `tickets` values at device (agent) scope with no ordering:
// returns the count before this draw, and the draw that returns tickets - 1 puts the counter back
// to zero (atom.inc's wrap), so a launch whose blocks each draw once leaves it zero. For a count
// whose value is needed much later (its round trip runs under other work; an add would be
// aggregated across the warp by ptxas and its value shuffled at once), where the caller orders
// what matters itself (skinny_gemm_rope_kv's rope_positions says how).
__device__ __forceinline__ unsigned atomic_ticket(unsigned* counter, unsigned tickets) {
#if LLMK_CUDA
  unsigned old;
  asm volatile("atom.relaxed.gpu.global.inc.u32 %0, [%1], %2;\n" : "=r"(old) : "l"(counter), "r"(tickets - 1) : "memory");
  return old;
#else
  return atomicInc(counter, tickets - 1);  // (HIP: relaxed, agent scope)
#endif
}

// A barrier across every block of a grid, for persistent kernels whose phases depend on each
// other's results (e.g. the layers of a decode step in one launch). Every block of the grid must
// be resident at once (grid size at most the resident blocks, see resident_blocks in runtime.h):
// otherwise it never returns. `state` is two unsigned words in global memory, zero before the
// first launch that uses them and left zero-and-generation-counted after it (reusable by the next
// launch without a reset). Writes before the barrier by any block are visible to every block after
// it. Cost: one atomic per block and a spin on one word: measured 2.3 us per barrier at one block per
// SM on the H200's 132 SMs, 2.8 us at two (upper bounds: GridBarrier.OneAndTwoBlocksPerSmAndTheirCost,
// 2026-12-01, includes its slot checks).
// timeout_ns > 0 (tests; NVIDIA only, global_timer_ns is 0 elsewhere): give up waiting after that
// long; returns false then (for every thread of the block), true when the barrier was passed.
__device__ __forceinline__ bool grid_barrier(unsigned* state, unsigned blocks, uint64_t timeout_ns = 0) {
  __shared__ int passed;
  __syncthreads();
  if (threadIdx.x == 0 && threadIdx.y == 0 && threadIdx.z == 0) {
    passed = 1;
    unsigned* count = state;
    volatile unsigned* generation = state + 1;
    const unsigned gen = *generation;  // read before arriving: the last arrival bumps it
    __threadfence();                   // this block's writes before its arrival
    if (atomicAdd(count, 1u) == blocks - 1) {
      atomicExch(count, 0u);
      __threadfence();
      atomicAdd(state + 1, 1u);  // releases the others
    } else {
      const uint64_t t0 = timeout_ns ? global_timer_ns() : 0;
      while (*generation == gen) {
#if LLMK_CUDA && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 700
        __nanosleep(32);
#endif
        if (timeout_ns && global_timer_ns() - t0 > timeout_ns) {
          passed = 0;
          break;
        }
      }
    }
    __threadfence();  // the other blocks' writes, after the release
  }
  __syncthreads();
  return passed != 0;
}

}  // namespace llmk::gpu
