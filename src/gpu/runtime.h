// Host-side helpers for GPU code: checked runtime calls, a device guard, and device properties
// read at run time (warp size, multiprocessor count), cached per device.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <utility>

#include "gpu/compat.h"
#include "llmk/tensor.h"

namespace llmk::gpu {

// Throws llmk::Error(runtime) naming the op and the failed call when err != gpuSuccess.
void check(gpuError_t err, const char* op, const char* what);
// Checks the launch that just happened (gpuGetLastError).
void check_launch(const char* op);

int warp_size(int device);
int multiprocessor_count(int device);

// Programmatic dependent launch (PDL, NVIDIA compute capability 9.0+; on by default since
// 2026-12-03, LLMK_PDL=0 turns it off: on the H200 it gained 4% in batch-1 e2e decode and 10% on
// the 1B model's 16 layers in a CUDA graph, bench/results/h200-e2e-2026-12-03-pdl.md): a kernel
// launched through launch() with pdl = true may start while the kernel before it in the stream is
// still running (once all of that kernel's blocks have started and run pdl_trigger(), or have
// exited), so its launch latency and whatever it does before pdl_wait() (e.g. loading weights)
// overlap the previous kernel. Every kernel launched this way must call
// gpu::pdl_wait() before it reads anything an earlier kernel wrote, and before it exits (so that
// the next dependent kernel's wait covers the whole chain). CUDA graphs keep the overlap (stream
// capture records programmatic edges). False on AMD, older GPUs and with LLMK_PDL=0;
// launch() also leaves out kernels whose loaded code is older than sm_90 (e.g. sm_80 code on a
// newer GPU), which have no wait compiled in.
bool pdl_enabled(int device);
// Whether `kernel`'s loaded code (its binary version, cached) has the PDL instructions (sm_90+).
bool kernel_supports_pdl(const void* kernel);
// Counts a launch made with the PDL attribute (gpu/pdl.h: pdl_launches).
void count_pdl_launch();
// LLMK_SMEM_CARVEOUT (read per launch; NVIDIA only): the share of the multiprocessor's unified L1 /
// shared-memory capacity that `kernel` prefers as shared memory
// (cudaFuncAttributePreferredSharedMemoryCarveout), set when it is first launched through launch()
// or launch_cluster() and again when the value changes.
// - anything but the values below (e.g. off): no preference of ours, the driver's choice (a kernel
//   keeps one set earlier in the process; the default until 2026-12-07).
// - fit (the default, also when unset or empty): what the kernel's resident blocks need at full
//   occupancy (blocks x (static + dynamic shared memory + the per-block reserve), rounded up), the
//   rest L1. Why: after a ~200 KB TMA GEMM the driver keeps that split for the small kernels
//   after it, which then run with ~28 KB of L1
//   (H100, 2026-12-07, the 7B's layer chain in a CUDA graph: the fused q/k/v GEMM after the TMA
//   down 52.9 us with the driver's split, 39.8 with fit; 7B decode with the TMA down 183-185 tok/s
//   against 200-201, the default 197; with the TMA kernel at every large weight, gemm_gpu.cu
//   default_kernel's LLMK_GEMM_TMA_DEFAULT=1, 7B 202-203, 8b 181-183 against 178). Without the TMA
//   kernel fit ties (1B 1083, 8b 178) or costs a little (7B 193 against 197, one round).
// - 0-100: that percentage for every kernel (measured slower with 100: H100, 2026-12-07, 1B decode
//   1054 against 1084 tok/s).
// Nothing on AMD.
void apply_smem_carveout(const void* kernel, int block_threads, std::size_t dynamic_smem);

// Makes `device` current for its lifetime and restores the previous one.
class DeviceGuard {
 public:
  DeviceGuard(Device device, const char* op);
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = -1;
  int device_ = -1;
};

inline gpuStream_t as_stream(Stream s) { return static_cast<gpuStream_t>(s); }

#if LLMK_CUDA
// The launch configuration of cudaLaunchKernelEx with attributes attrs[0 .. count).
inline cudaLaunchConfig_t launch_config(dim3 grid, dim3 block, std::size_t smem, gpuStream_t stream,
                                        cudaLaunchAttribute* attrs, unsigned count) {
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  config.attrs = attrs;
  config.numAttrs = count;
  return config;
}

// Launch attributes: programmatic stream serialization (PDL); a cluster of cluster_x x 1 x 1 blocks.
inline cudaLaunchAttribute pdl_attribute() {
  cudaLaunchAttribute a{};
  a.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  a.val.programmaticStreamSerializationAllowed = 1;
  return a;
}
inline cudaLaunchAttribute cluster_attribute(unsigned cluster_x) {
  cudaLaunchAttribute a{};
  a.id = cudaLaunchAttributeClusterDimension;
  a.val.clusterDim.x = cluster_x;
  a.val.clusterDim.y = 1;
  a.val.clusterDim.z = 1;
  return a;
}
#endif

// kernel<<<grid, block, smem, stream>>>(args...), with programmatic stream serialization when
// `pdl` (see pdl_enabled; the kernel must call pdl_wait()). Errors of a <<<>>> launch are left for
// check_launch; a failed PDL launch throws here.
template <typename... Params, typename... Args>
void launch(void (*kernel)(Params...), dim3 grid, dim3 block, std::size_t smem, gpuStream_t stream, bool pdl,
            Args&&... args) {
#if LLMK_CUDA
  apply_smem_carveout(reinterpret_cast<const void*>(kernel), static_cast<int>(block.x * block.y * block.z), smem);
  if (pdl && kernel_supports_pdl(reinterpret_cast<const void*>(kernel))) {
    cudaLaunchAttribute attribute[1] = {pdl_attribute()};
    const cudaLaunchConfig_t config = launch_config(grid, block, smem, stream, attribute, 1);
    check(cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...), "kernel launch", "cudaLaunchKernelEx");
    count_pdl_launch();
    return;
  }
#else
  (void)pdl;
#endif
  kernel<<<grid, block, smem, stream>>>(std::forward<Args>(args)...);
}

#if LLMK_CUDA
// kernel<<<grid, block, smem, stream>>>(args...) in thread block clusters of cluster_x x 1 x 1
// blocks (compute capability 9.0+; grid.x a multiple of cluster_x; above 8 the kernel must allow
// non-portable cluster sizes, see cluster_fits), with programmatic stream serialization when `pdl`.
template <typename... Params, typename... Args>
void launch_cluster(void (*kernel)(Params...), dim3 grid, dim3 block, std::size_t smem, gpuStream_t stream,
                    unsigned cluster_x, bool pdl, Args&&... args) {
  apply_smem_carveout(reinterpret_cast<const void*>(kernel), static_cast<int>(block.x * block.y * block.z), smem);
  cudaLaunchAttribute attribute[2] = {cluster_attribute(cluster_x), pdl_attribute()};
  const bool with_pdl = pdl && kernel_supports_pdl(reinterpret_cast<const void*>(kernel));
  const cudaLaunchConfig_t config = launch_config(grid, block, smem, stream, attribute, with_pdl ? 2 : 1);
  check(cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...), "kernel launch", "cudaLaunchKernelEx (cluster)");
  if (with_pdl) count_pdl_launch();
}

// How many clusters of cluster_x x 1 x 1 blocks of `kernel` (block threads, smem dynamic bytes
// each) can be resident on `device` at once (0: none, or before compute capability 9.0); allows
// non-portable sizes (9 to 16) for the kernel first.
template <typename... Params>
int active_clusters(void (*kernel)(Params...), int device, unsigned cluster_x, dim3 block, std::size_t smem) {
  int major = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess || major < 9) {
    (void)cudaGetLastError();
    return 0;
  }
  if (cluster_x > 8 && cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  cudaLaunchAttribute attribute[1] = {cluster_attribute(cluster_x)};
  const cudaLaunchConfig_t config = launch_config(dim3(cluster_x, 1, 1), block, smem, nullptr, attribute, 1);
  int clusters = 0;
  if (cudaOccupancyMaxActiveClusters(&clusters, kernel, &config) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return clusters;
}

// active_clusters for one kernel whose block and shared memory never change, asked once per
// device and cluster size (1..16; the occupancy query costs host time at every call).
template <auto Kernel>
int resident_clusters(int device, unsigned cluster_x, dim3 block, std::size_t smem) {
  static std::atomic<int> cached[64][17];  // 1 + the count; 0: not asked yet
  if (device < 0 || device >= 64 || cluster_x < 1 || cluster_x > 16) return 0;
  std::atomic<int>& slot = cached[device][cluster_x];
  if (slot.load() == 0) slot.store(1 + active_clusters(Kernel, device, cluster_x, block, smem));
  return slot.load() - 1;
}

// Whether at least one such cluster can be resident (see active_clusters).
template <typename... Params>
bool cluster_fits(void (*kernel)(Params...), int device, unsigned cluster_x, dim3 block, std::size_t smem) {
  return active_clusters(kernel, device, cluster_x, block, smem) > 0;
}
#endif

// A cooperative launch: the runtime refuses it (an error, never a hang) unless every block of the
// grid can be resident at once, which gpu::grid_barrier (compat.h) needs. Throws naming `op`.
template <typename... Params>
void launch_cooperative(void (*kernel)(Params...), dim3 grid, dim3 block, std::size_t smem, gpuStream_t stream,
                        const char* op, Params... args) {
  void* argv[] = {static_cast<void*>(&args)...};
  check(gpuLaunchCooperativeKernel(reinterpret_cast<const void*>(kernel), grid, block, argv,
                                   static_cast<unsigned>(smem), stream),
        op, "launching the cooperative (persistent) kernel");
}

// Allows `kernel` `bytes` of dynamic shared memory (needed above 48 KB).
template <typename Kernel>
void allow_dynamic_smem(Kernel kernel, std::size_t bytes, const char* op) {
  check(gpuFuncSetAttribute(kernel, gpuFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)), op,
        "allowing the dynamic shared memory");
}

// Resident blocks of `kernel` per multiprocessor at `threads` threads and `smem` bytes of dynamic
// shared memory, at least 1; throws naming `op` when the query fails.
template <typename Kernel>
int resident_blocks(Kernel kernel, int threads, std::size_t smem, const char* op) {
  int blocks = 0;
  check(gpuOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, threads, smem), op, "reading the occupancy");
  return blocks > 0 ? blocks : 1;
}

// The same, returning `fallback` (and clearing the error) when the query fails.
template <typename Kernel>
int resident_blocks_or(Kernel kernel, int threads, std::size_t smem, int fallback) {
  int blocks = 0;
  if (gpuOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, threads, smem) != gpuSuccess || blocks < 1) {
    (void)gpuGetLastError();
    return fallback;
  }
  return blocks;
}

// Host: whether the environment switch `name` is on (set, non-empty and not "0"). Kernel
// choices read it per call (a getenv is nothing beside a launch) so tests can flip it.
// With a fallback: unset or empty gives `fallback` (a default-on switch is turned off by "0").
inline bool env_flag(const char* name, bool fallback = false) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return fallback;
  return std::strcmp(v, "0") != 0;
}

// Elements of T per 16-byte vector access when a row of `cols` elements allows it: cols a
// multiple of it, every pointer (nullptr = unused) 16-byte aligned, every row stride a multiple
// of it. Otherwise 1 (scalar accesses).
template <typename T>
int vector_width(int64_t cols, std::initializer_list<const void*> ptrs,
                 std::initializer_list<int64_t> strides) {
  constexpr int full = 16 / sizeof(T);
  if (cols % full != 0) return 1;
  for (const void* q : ptrs)
    if (q != nullptr && reinterpret_cast<uintptr_t>(q) % 16 != 0) return 1;
  for (int64_t s : strides)
    if (s % full != 0) return 1;
  return full;
}

}  // namespace llmk::gpu
