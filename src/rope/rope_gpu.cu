// RoPE on the GPU (one source for CUDA and HIP, through src/gpu/ only).
//
// One block per token (a grid-stride loop past the grid size): its threads walk the
// (heads of q + heads of k) x (rot_dim / 2) rotation pairs, each reading its pair's cos and sin
// (L1/L2-resident: every head of the token shares them) and the two elements, and writing the
// rotated pair; out of place, a second loop copies the dims past rot_dim. A position outside the
// cache writes NaN into the token's rotated dims (checking on the host would need a sync).
#include <cstdint>

#include "core/check.h"
#include "gpu/compat.h"
#include "gpu/runtime.h"
#include "rope/rope_internal.h"
#include "rope/rope_math.h"

namespace llmk::detail {

using gpu::bfloat16;
using gpu::half;

namespace {

constexpr int kThreads = 256;

template <typename T, typename C>
__global__ void __launch_bounds__(kThreads) rope_kernel(RopeParams p) {
  const int64_t half_rot = p.rot_dim / 2;
  const int64_t heads = p.q.heads + p.k.heads;
  const int64_t pass = p.head_dim - p.rot_dim;
  const float sign = p.inverse ? -1.f : 1.f;
  for (int64_t token = blockIdx.x; token < p.batch * p.seq; token += gridDim.x) {
    const int64_t b = token / p.seq, s = token % p.seq;
    const C* cos_row = nullptr;
    const C* sin_row = nullptr;
    const bool valid = angle_rows<C>(p, b, s, cos_row, sin_row);
    for (int64_t idx = threadIdx.x; idx < heads * half_rot; idx += blockDim.x) {
      const int64_t h = idx / half_rot, i = idx % half_rot;
      const RopeTensor& t = h < p.q.heads ? p.q : p.k;
      const int64_t hh = h < p.q.heads ? h : h - p.q.heads;
      const T* in = static_cast<const T*>(t.in) + b * t.in_strides[0] + s * t.in_strides[1] + hh * t.in_strides[2];
      T* out = static_cast<T*>(t.out) + b * t.out_strides[0] + s * t.out_strides[1] + hh * t.out_strides[2];
      int64_t i1, i2;
      pair_index(p.style, i, p.rot_dim, i1, i2);
      if (!valid) {
        out[i1] = out[i2] = gpu::from_float<T>(__int_as_float(0x7fc00000));
        continue;
      }
      const float c = gpu::to_float(cos_row[i]), sn = sign * gpu::to_float(sin_row[i]);
      const float x1 = gpu::to_float(in[i1]), x2 = gpu::to_float(in[i2]);
      gpu::from_float2<T>(x1 * c - x2 * sn, x2 * c + x1 * sn, out[i1], out[i2]);
    }
    if (!p.in_place && pass > 0) {
      for (int64_t idx = threadIdx.x; idx < heads * pass; idx += blockDim.x) {
        const int64_t h = idx / pass, d = p.rot_dim + idx % pass;
        const RopeTensor& t = h < p.q.heads ? p.q : p.k;
        const int64_t hh = h < p.q.heads ? h : h - p.q.heads;
        static_cast<T*>(t.out)[b * t.out_strides[0] + s * t.out_strides[1] + hh * t.out_strides[2] + d] =
            static_cast<const T*>(t.in)[b * t.in_strides[0] + s * t.in_strides[1] + hh * t.in_strides[2] + d];
      }
    }
  }
}

template <typename T, typename C>
void launch(const RopeParams& p) {
  const int64_t tokens = p.batch * p.seq;
  const unsigned grid = static_cast<unsigned>(tokens < 65535 * 32 ? tokens : 65535 * 32);
  rope_kernel<T, C><<<grid, kThreads, 0, gpu::as_stream(p.stream)>>>(p);
}

template <typename T>
void with_angles(const RopeParams& p) {
  if (p.angle_dtype == DType::f32) launch<T, float>(p);
  else launch<T, T>(p);
}

}  // namespace

void rope_gpu(const RopeParams& p) {
  gpu::DeviceGuard guard(p.device, "rope");
  switch (p.dtype) {
    case DType::f32: launch<float, float>(p); break;
    case DType::f16: with_angles<half>(p); break;
    case DType::bf16: with_angles<bfloat16>(p); break;
    default: fail(ErrorKind::type, "rope", "unsupported dtype");
  }
  gpu::check_launch("rope");
}

}  // namespace llmk::detail
