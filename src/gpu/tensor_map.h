// Host side of Hopper's TMA (part of the portability layer; CUDA builds only, included by .cu
// files): tensor maps for the bulk tensor copy engine (gpu/tma.h loads and stores through them on the device) and the
// check that a sm_90a-only kernel body was built into the loaded binary.
#pragma once

#include "gpu/mma.h"
#include "gpu/runtime.h"

#if LLMK_MMA_SYNC_BUILD
#include <cuda.h>  // CUtensorMap and its enums (types only: the encoder comes from the runtime)

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>

namespace llmk::gpu::tma {

using EncodeTiledFn = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                   const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                   CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

// cuTensorMapEncodeTiled from the driver through the runtime (no link-time libcuda dependency);
// null when the driver does not offer it.
inline EncodeTiledFn encode_tiled() {
  static const EncodeTiledFn fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult status{};
#if CUDART_VERSION >= 12050
    const cudaError_t e = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &status);
#else
    const cudaError_t e = cudaGetDriverEntryPoint("cuTensorMapEncodeTiled", &f, cudaEnableDefault, &status);
#endif
    if (e != cudaSuccess || status != cudaDriverEntryPointSuccess) {
      (void)cudaGetLastError();
      return EncodeTiledFn{nullptr};
    }
    return reinterpret_cast<EncodeTiledFn>(f);
  }();
  return fn;
}

// A 4-D tiled tensor map over 16-bit elements (f16 when `f16`, else bf16) at `base`, dims
// (d, len, heads, batch) innermost first with element strides `strides` = {batch, len, heads} (d
// contiguous): boxes of 64 columns (128 bytes, the 128B swizzle) x box_rows rows of box_heads
// heads (default one) and one batch, out-of-bounds elements read as zeros. promote_l2: L2
// promotion to 256-byte requests (on for tiles read again from the L2, as prefill attention's
// K / V; off for a single streaming pass: on the H200 a decode-shaped read of a KV cache took
// 136.4 us with it against 131.8 without, bench/micro/kv_stream.cu). False when TMA cannot express
// it (an empty dim, a broadcast or negative stride, a stride not a multiple of 16 bytes, a base not
// 16-byte aligned, the driver refusing). The cases above are refused before the driver is asked:
// compute-sanitizer counts a refused cuTensorMapEncodeTiled as an error (2026-12-06, an empty cache).
inline bool make_tensor_map(CUtensorMap* map, bool f16, const void* base, int64_t d, int64_t len, int64_t heads,
                            int64_t batch, const int64_t (&strides)[3], int box_rows, bool promote_l2 = true,
                            int box_heads = 1) {
  const EncodeTiledFn encode = encode_tiled();
  if (encode == nullptr || reinterpret_cast<uintptr_t>(base) % 16 != 0) return false;
  const int64_t dims[4] = {d, len, heads, batch};
  for (const int64_t n : dims)
    if (n < 1) return false;
  int64_t bytes[4] = {2, strides[1] * 2, strides[2] * 2, strides[0] * 2};  // [0]: the element size
  int64_t span = d * 2;  // a stride for size-1 dims (never stepped along): past every element
  for (int i = 1; i < 4; ++i) {
    if (dims[i] == 1) continue;
    if (bytes[i] <= 0 || bytes[i] % 16 != 0 || bytes[i] >= (int64_t{1} << 40)) return false;
    span = std::max(span, bytes[i] * dims[i]);
  }
  span = (span + 15) / 16 * 16;
  if (span >= (int64_t{1} << 40)) return false;
  for (int i = 1; i < 4; ++i)
    if (dims[i] == 1) bytes[i] = span;
  const cuuint64_t gdim[4] = {static_cast<cuuint64_t>(dims[0]), static_cast<cuuint64_t>(dims[1]),
                              static_cast<cuuint64_t>(dims[2]), static_cast<cuuint64_t>(dims[3])};
  const cuuint64_t gstride[3] = {static_cast<cuuint64_t>(bytes[1]), static_cast<cuuint64_t>(bytes[2]),
                                 static_cast<cuuint64_t>(bytes[3])};
  const cuuint32_t box[4] = {64, static_cast<cuuint32_t>(box_rows), static_cast<cuuint32_t>(box_heads), 1};
  const cuuint32_t elem_strides[4] = {1, 1, 1, 1};
  const CUresult r = encode(map, f16 ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 4,
                            const_cast<void*>(base), gdim, gstride, box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                            CU_TENSOR_MAP_SWIZZLE_128B,
                            promote_l2 ? CU_TENSOR_MAP_L2_PROMOTION_L2_256B : CU_TENSOR_MAP_L2_PROMOTION_NONE,
                            CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS;
}

// A plain 3-D tiled tensor map over 16-bit elements (f16 when `f16`, else bf16) at `base`: dims
// innermost first, element strides of dims 1 and 2 (dim 0 contiguous), boxes of `box` elements, no
// swizzle (the shared-memory box is dense), no L2 promotion (for TMA stores and single passes).
// False when TMA cannot express it (an empty dim, a stride not a multiple of 16 bytes or past 2^40
// bytes, a base not 16-byte aligned, the driver refusing).
inline bool make_tensor_map_3d(CUtensorMap* map, bool f16, void* base, const int64_t (&dims)[3],
                               const int64_t (&strides)[2], const int (&box)[3],
                               CUtensorMapSwizzle swizzle = CU_TENSOR_MAP_SWIZZLE_NONE) {
  const EncodeTiledFn encode = encode_tiled();
  if (encode == nullptr || reinterpret_cast<uintptr_t>(base) % 16 != 0) return false;
  cuuint64_t gdim[3], gstride[2];
  cuuint32_t gbox[3];
  const cuuint32_t elem_strides[3] = {1, 1, 1};
  for (int i = 0; i < 3; ++i) {
    if (dims[i] < 1) return false;
    gdim[i] = static_cast<cuuint64_t>(dims[i]);
    gbox[i] = static_cast<cuuint32_t>(box[i]);
  }
  for (int i = 0; i < 2; ++i) {
    const int64_t bytes = strides[i] * 2;
    if (bytes <= 0 || bytes % 16 != 0 || bytes >= (int64_t{1} << 40)) return false;
    gstride[i] = static_cast<cuuint64_t>(bytes);
  }
  return encode(map, f16 ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 3, base, gdim, gstride,
                gbox, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle,
                CU_TENSOR_MAP_L2_PROMOTION_NONE, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

// Whether `device` has compute capability 9.0 (Hopper: H100, H200), the only one sm_90a code runs on.
inline bool is_sm90(int device) {
  int major = 0, minor = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return major == 9 && minor == 0;
}

// Whether `kernel`'s body was compiled for the device's architecture (sm_90a): a kernel whose
// body exists only where LLMK_HAS_WGMMA is set declares static shared memory there (a marker
// at least) and none in its stub.
template <typename K>
bool kernel_built(K kernel) {
  cudaFuncAttributes attr{};
  if (cudaFuncGetAttributes(&attr, kernel) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return attr.sharedSizeBytes > 0;
}

// Whether the sm_90a-only kernel `Kernel` can run on `device` (compute capability 9.0, its body
// built); the first time on a device, also its opt-in to `smem` bytes of dynamic shared memory
// (errors thrown naming `op`). Cached per kernel and device.
template <auto Kernel>
bool sm90_kernel_ready(int device, std::size_t smem, const char* op) {
  static std::atomic<int> state[64];  // per device: 0 not asked yet, 1 yes, -1 no
  if (device < 0 || device >= 64) return false;
  if (state[device].load() == 0) {
    const bool ok = is_sm90(device) && kernel_built(Kernel);
    if (ok)
      check(cudaFuncSetAttribute(Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)), op,
            "setting the shared memory size");
    state[device].store(ok ? 1 : -1);
  }
  return state[device].load() > 0;
}

}  // namespace llmk::gpu::tma

#endif  // LLMK_MMA_SYNC_BUILD
