// RoPE on the GPU (one source for CUDA and HIP, through src/gpu/ only).
//
// Vector kernel (the common case: 16-byte aligned rows, rot_dim and the pass-through width
// multiples of a 16-byte vector): block x = one token, its threads each own one 16-byte chunk
// of one head. neox: the chunk at i and its partner at i + rot_dim/2 (two vector loads, one
// vector of cosines and one of sines); gptj: one vector of adjacent pairs. Out of place, further
// threads copy the dims past rot_dim a vector at a time. Grid y covers heads that do not fit in
// one block.
//
// Scalar kernel (any other layout): one block per token (a grid-stride loop past the grid size): its threads walk the
// (heads of q + heads of k) x (rot_dim / 2) rotation pairs, each reading its pair's cos and sin
// (L1/L2-resident: every head of the token shares them) and the two elements, and writing the
// rotated pair; out of place, a second loop copies the dims past rot_dim. A position outside the
// cache writes NaN into the token's rotated dims (checking on the host would need a sync).
#include <algorithm>
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

// Work split of the vector kernel: per head, rot_chunks rotation chunks then pass_chunks copies.
struct VectorSplit {
  int rot_chunks = 0, pass_chunks = 0;
};

template <typename T, typename C, RopeStyle kStyle>
__global__ void __launch_bounds__(1024) rope_vector_kernel(RopeParams p, VectorSplit split) {
  constexpr int V = 16 / sizeof(T);                          // elements per data vector
  constexpr int A = kStyle == RopeStyle::neox ? V : V / 2;  // angles per chunk
  const int per_head = split.rot_chunks + split.pass_chunks;
  const int item = blockIdx.y * blockDim.x + threadIdx.x;
  gpu::pdl_begin();  // PDL (gpu::launch): inputs only after the previous kernel
  if (item >= per_head * (p.q.heads + p.k.heads)) return;
  const int h = item / per_head, chunk = item % per_head;
  const int64_t token = blockIdx.x, b = token / p.seq, s = token % p.seq;
  const RopeTensor& t = h < p.q.heads ? p.q : p.k;
  const int64_t hh = h < p.q.heads ? h : h - p.q.heads;
  const T* in = static_cast<const T*>(t.in) + b * t.in_strides[0] + s * t.in_strides[1] + hh * t.in_strides[2];
  T* out = static_cast<T*>(t.out) + b * t.out_strides[0] + s * t.out_strides[1] + hh * t.out_strides[2];
  using gpu::Cache;
  if (chunk >= split.rot_chunks) {  // dims past rot_dim, out of place only
    const int64_t d = p.rot_dim + int64_t(chunk - split.rot_chunks) * V;
    gpu::store<Cache::stream>(reinterpret_cast<gpu::Vec<T, V>*>(out + d), gpu::load_vec<T, V, Cache::stream>(in + d));
    return;
  }
  // The data loads go first: they do not depend on the position lookup, whose chain
  // (position, then cos/sin) would otherwise delay them.
  const int64_t i1 = int64_t(chunk) * V, i2 = kStyle == RopeStyle::neox ? i1 + p.rot_dim / 2 : i1;
  const gpu::Vec<T, V> raw1 = gpu::load_vec<T, V, Cache::stream>(in + i1);
  gpu::Vec<T, V> raw2{};
  if constexpr (kStyle == RopeStyle::neox) raw2 = gpu::load_vec<T, V, Cache::stream>(in + i2);
  const C* cos_row = nullptr;
  const C* sin_row = nullptr;
  const bool valid = angle_rows<C>(p, b, s, cos_row, sin_row);
  float c[A], sn[A];
  if (valid) {
    gpu::load_float<C, A>(cos_row + chunk * A, c);
    gpu::load_float<C, A>(sin_row + chunk * A, sn);
  }
  const float sign = p.inverse ? -1.f : 1.f;
  const float nan = __int_as_float(0x7fc00000);
  if constexpr (kStyle == RopeStyle::neox) {
    float x1[V], x2[V], y1[V], y2[V];
    gpu::to_float(raw1, x1);
    gpu::to_float(raw2, x2);
#pragma unroll
    for (int e = 0; e < V; ++e) {
      const float se = sign * sn[e];
      y1[e] = valid ? x1[e] * c[e] - x2[e] * se : nan;
      y2[e] = valid ? x2[e] * c[e] + x1[e] * se : nan;
    }
    gpu::store_float<T, V, Cache::stream>(out + i1, y1);
    gpu::store_float<T, V, Cache::stream>(out + i2, y2);
  } else {
    const int64_t i = i1;
    float x[V], y[V];
    gpu::to_float(raw1, x);
#pragma unroll
    for (int e = 0; e < A; ++e) {
      const float se = sign * sn[e];
      y[2 * e] = valid ? x[2 * e] * c[e] - x[2 * e + 1] * se : nan;
      y[2 * e + 1] = valid ? x[2 * e + 1] * c[e] + x[2 * e] * se : nan;
    }
    gpu::store_float<T, V, Cache::stream>(out + i, y);
  }
}

bool aligned(const void* ptr, int64_t bytes) {
  return ptr == nullptr || reinterpret_cast<uintptr_t>(ptr) % static_cast<uintptr_t>(bytes) == 0;
}

// The vector kernel's split, or rot_chunks == 0 when the layout needs the scalar kernel.
template <typename T, typename C>
VectorSplit vector_split(const RopeParams& p) {
  constexpr int64_t V = 16 / sizeof(T);
  const int64_t angles = p.style == RopeStyle::neox ? V : V / 2;
  const int64_t angle_bytes = std::min<int64_t>(16, angles * int64_t(sizeof(C)));
  const int64_t rotated = p.style == RopeStyle::neox ? p.rot_dim / 2 : p.rot_dim;
  const int64_t pass = p.in_place ? 0 : p.head_dim - p.rot_dim;
  bool ok = rotated % V == 0 && pass % V == 0;
  for (const RopeTensor* t : {&p.q, &p.k}) {
    ok = ok && aligned(t->in, 16) && aligned(t->out, 16);
    for (int d = 0; d < 3; ++d) ok = ok && t->in_strides[d] % V == 0 && t->out_strides[d] % V == 0;
  }
  const int64_t angle_elems = angle_bytes / int64_t(sizeof(C));
  if (p.positions != nullptr) {
    ok = ok && aligned(p.cache, angle_bytes) && p.cache_stride % angle_elems == 0 &&
         (p.rot_dim / 2) % angle_elems == 0;
  } else {
    ok = ok && aligned(p.cos, angle_bytes) && aligned(p.sin, angle_bytes);
    for (int d = 0; d < 2; ++d) ok = ok && p.cos_strides[d] % angle_elems == 0 && p.sin_strides[d] % angle_elems == 0;
  }
  VectorSplit split;
  const int64_t per_token = (rotated / V + pass / V) * (p.q.heads + p.k.heads);
  if (!ok || per_token > (int64_t(1) << 30)) return split;
  split.rot_chunks = static_cast<int>(rotated / V);
  split.pass_chunks = static_cast<int>(pass / V);
  return split;
}

template <typename T, typename C>
void launch(const RopeParams& p) {
  const int64_t tokens = p.batch * p.seq;
  const VectorSplit split = vector_split<T, C>(p);
  if (split.rot_chunks > 0 && tokens < (int64_t(1) << 31)) {
    const int64_t items = int64_t(split.rot_chunks + split.pass_chunks) * (p.q.heads + p.k.heads);
    const int threads = static_cast<int>(std::min<int64_t>(512, (items + 31) / 32 * 32));
    const dim3 grid(static_cast<unsigned>(tokens), static_cast<unsigned>((items + threads - 1) / threads));
    const bool pdl = gpu::pdl_enabled(p.device.index);
    if (p.style == RopeStyle::neox)
      gpu::launch(rope_vector_kernel<T, C, RopeStyle::neox>, grid, threads, 0, gpu::as_stream(p.stream), pdl, p, split);
    else
      gpu::launch(rope_vector_kernel<T, C, RopeStyle::gptj>, grid, threads, 0, gpu::as_stream(p.stream), pdl, p, split);
    return;
  }
  const unsigned grid = static_cast<unsigned>(tokens < 65535 * 32 ? tokens : 65535 * 32);
  rope_kernel<T, C><<<grid, kThreads, 0, gpu::as_stream(p.stream)>>>(p);
}

template <typename T>
void with_angles(const RopeParams& p) {
  if (p.angle_dtype == DType::f32) launch<T, float>(p);
  else launch<T, T>(p);
}

// rope_angles: one thread per (token, frequency): the angle in fp32, cosf and sinf (the functions
// PyTorch's cos and sin call, not the fast intrinsics), scaled, rounded to T, written once or twice.
template <typename T>
__global__ void __launch_bounds__(kThreads) rope_angles_kernel(RopeAnglesParams p) {
  gpu::pdl_begin();  // PDL (gpu::launch): positions only after the previous kernel
  const int64_t items = p.batch * p.seq * p.freqs;
  for (int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; idx < items;
       idx += int64_t(gridDim.x) * blockDim.x) {
    const int64_t i = idx % p.freqs, token = idx / p.freqs;
    const int64_t b = token / p.seq, s = token % p.seq;
    const float a = angle_position(p, b, s) * p.inv_freq[i];
    const T c = gpu::from_float<T>(cosf(a) * p.scaling), sn = gpu::from_float<T>(sinf(a) * p.scaling);
    T* cos_row = static_cast<T*>(p.cos) + b * p.cos_strides[0] + s * p.cos_strides[1];
    T* sin_row = static_cast<T*>(p.sin) + b * p.sin_strides[0] + s * p.sin_strides[1];
    cos_row[i] = c;
    sin_row[i] = sn;
    if (p.width > p.freqs) {
      cos_row[p.freqs + i] = c;
      sin_row[p.freqs + i] = sn;
    }
  }
}

template <typename T>
void launch_angles(const RopeAnglesParams& p) {
  const int64_t items = p.batch * p.seq * p.freqs;
  const unsigned grid = static_cast<unsigned>(std::min<int64_t>((items + kThreads - 1) / kThreads, 65535 * 32));
  gpu::launch(rope_angles_kernel<T>, grid, kThreads, 0, gpu::as_stream(p.stream), gpu::pdl_enabled(p.device.index), p);
}

}  // namespace

void rope_angles_gpu(const RopeAnglesParams& p) {
  gpu::DeviceGuard guard(p.device, "rope_angles");
  switch (p.dtype) {
    case DType::f32: launch_angles<float>(p); break;
    case DType::f16: launch_angles<half>(p); break;
    case DType::bf16: launch_angles<bfloat16>(p); break;
    default: fail(ErrorKind::type, "rope_angles", "unsupported dtype");
  }
  gpu::check_launch("rope_angles");
}

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
