// Monarch forward for a few tokens (decode) in ONE launch on tensor cores and thread block
// clusters (NVIDIA sm_90a; monarch_decode.cu is the portable one-launch kernel).
//
// out[b, v*l + u] = sum_t w2[u, v, t] z[u][b, t] with z[u][b, t] = y[b, t*l + u] = (w1 row t*l + u)
// . x[b, i*p ..], i = (t*l + u) / q (the derivation is at the top of monarch_decode.cu). The 8 rows
// t*l + u0 .. t*l + u0 + 7 of w1 (u0 a multiple of 8) lie in one stage-1 block, so for each t
// they are the n8 side of an mma.sync m16n8k16 whose 16 rows are the tokens (up to 16). A cluster
// of C CTAs owns 8 consecutive stage-2 blocks u0 .. u0 + 7; CTA `rank` computes z for t in
// [rank TR, (rank + 1) TR) (TR = r / C, a multiple of 16) and the outputs of rows v in [rank VS,
// (rank + 1) VS) (VS = s / C, a multiple of 16). Per CTA, 8 warps:
//   1. copies the x columns of the stage-1 blocks its t read (all tokens), the 8 w1 rows of each
//      of its t and w2[u0 .. u0 + 7, its v, :] into shared memory, every 16-byte cp.async in
//      flight at once, and waits for the first two only (w2 arrives during stage 1);
//   2. stage 1: warp w takes t = w, w + 8, w + 16, ...: z[.., t] for the 8 blocks u (A = the x
//      columns of t's stage-1 block, B = its 8 w1 rows, p / 16 k-steps), rounded to the dtype
//      (as every path rounds the intermediate) into shared memory;
//   3. sends its slice of z (8 x 16 x TR elements) to the other CTAs of the cluster with 16-byte
//      stores into their shared memory (distributed shared memory); one cluster barrier;
//   4. stage 2: warp w takes block u0 + w: out[b, v*l + u] for its VS rows v (A = z of the block,
//      all r values of t; B = rows v of w2[u]), staged in shared memory so that the 8 blocks of
//      each (token, v) leave as one 16-byte store.
// Shared-memory rows are padded by 16 bytes so that ldmatrix's 8 row addresses meet 8 different
// bank groups.
//
// Performance (H200, bf16, do_bench with L2 flushed, 2026-12-03 11:40 UTC): n = 8192 with 64
// blocks of 128 (clusters of 8, 64 CTAs), 16 tokens 10.6 us (8.3 us of GPU time in a CUDA graph;
// dense 44.5, the few-token stages 16.0, the portable one-launch kernel 25.0), 8 tokens 11.9. At
// 11:31, before w2's copy overlapped stage 1: 11.4 us at 16 tokens, 11.8 at 8, 11.6 at one token:
// the time is a chain of dependent steps (weight loads, stage 1, the exchange and its cluster
// barrier, stage 2), nearly independent of the token count. A first version that split t the same
// way but summed fp32 partial outputs across the cluster (each CTA reading 8 partials per output
// from the others' shared memory) took 14.3 us at 16 tokens (10:21 UTC).
//
// Shapes: up to kMonarchSkinnyTokens tokens, fp16/bf16, l and q multiples of 8, p of 16, C the
// largest power of two up to 8 with r and s multiples of 16 C, the CTA's shared memory within the
// device's limit, 16-byte aligned x, w1, w2, out and row strides.
#include <atomic>
#include <cstdint>

#include "core/check.h"
#include "gpu/compat.h"
#include "gpu/mma.h"
#include "gpu/runtime.h"
#include "gpu/tensor_map.h"
#include "gpu/tma.h"
#include "monarch/monarch_internal.h"

namespace llmk::detail {

#if LLMK_MMA_SYNC_BUILD
namespace {

using gpu::bfloat16;
using gpu::half;

constexpr int kThreads = 256;  // 8 warps: stage 2 gives each one of the 8 blocks u
constexpr int kUb = 8;         // stage-2 blocks per cluster: the n8 side of stage 1's mma
constexpr int kTok = 16;       // token rows of every mma (zeros past the last token)
constexpr int kPad = 8;        // elements added to each row in shared memory (16 bytes)

std::atomic<int64_t> g_launches{0};

struct MmaArgs : FewTokenOperands {
  int tokens = 0, q = 0, p = 0, l = 0, s = 0, r = 0;
  int C = 0, tr = 0, vs = 0;  // CTAs per cluster; t and v per CTA
  int x_cols = 0;             // x row stride in shared memory (elements)
  int off_w1 = 0, off_w2 = 0, off_z = 0, off_out = 0;  // byte offsets in shared memory
};

// The shared-memory plan of one shape (byte offsets; x at 0): x [kTok][x_cols], w1 [TR][8][p +
// kPad], w2 [8][VS][r + kPad], z [8][kTok][r + kPad], output staging [kTok][VS][8].
struct MmaLayout {
  int C = 0, tr = 0, vs = 0, x_cols = 0;
  int64_t w1 = 0, w2 = 0, z = 0, out = 0, total = 0;
};

MmaLayout mma_layout(const MonarchParams& p) {
  MmaLayout o;
  int C = 8;
  while (C > 1 && (p.r % (16 * C) != 0 || p.s % (16 * C) != 0)) C /= 2;
  o.C = C;
  o.tr = static_cast<int>(p.r / C);
  o.vs = static_cast<int>(p.s / C);
  // stage-1 blocks a CTA's t range reads: floor((t0 + d) l + u0) / q) - floor((t0 l + u0) / q) is
  // at most ceil(d l / q) for d = TR - 1
  const int64_t blocks = ((o.tr - 1) * p.l + p.q - 1) / p.q + 1;
  o.x_cols = static_cast<int>(blocks * p.p + kPad);
  const int64_t e = dtype_size(p.dtype);
  o.w1 = int64_t{kTok} * o.x_cols * e;
  o.w2 = o.w1 + int64_t{o.tr} * kUb * (p.p + kPad) * e;
  o.z = o.w2 + int64_t{kUb} * o.vs * (p.r + kPad) * e;
  o.out = o.z + int64_t{kUb} * kTok * (p.r + kPad) * e;
  o.total = o.out + int64_t{kTok} * o.vs * kUb * e;
  return o;
}

#if LLMK_HAS_WGMMA
// The lane's ldmatrix row address within a 16 x 16 A tile (rows = tokens) at `tile` (row stride
// `stride`): matrices (rows 0-7, k 0-7), (8-15, 0-7), (0-7, 8-15), (8-15, 8-15) = a0 .. a3.
template <typename T>
__device__ __forceinline__ const T* a_row(const T* tile, int stride, int lane) {
  return tile + ((lane & 7) + 8 * ((lane >> 3) & 1)) * stride + 8 * (lane >> 4);
}
#endif

template <typename T>
__global__ void __launch_bounds__(kThreads, 1) monarch_decode_mma_kernel(const MmaArgs a) {
#if LLMK_HAS_WGMMA
  __shared__ int built_marker[4];  // see gpu::tma::kernel_built
  if (threadIdx.x == 0) static_cast<volatile int*>(built_marker)[0] = 1;
  // every CTA of the cluster has started before any writes into another's shared memory (the
  // wait is before step 3)
  gpu::tma::cluster_arrive_relaxed();
  extern __shared__ __align__(16) unsigned char mma_smem[];
  T* xs = reinterpret_cast<T*>(mma_smem);
  T* w1s = reinterpret_cast<T*>(mma_smem + a.off_w1);
  T* w2s = reinterpret_cast<T*>(mma_smem + a.off_w2);
  T* zs = reinterpret_cast<T*>(mma_smem + a.off_z);
  T* os = reinterpret_cast<T*>(mma_smem + a.off_out);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, tig = lane & 3;
  const int rank = static_cast<int>(blockIdx.x) % a.C, TR = a.tr, VS = a.vs;
  const int u0 = static_cast<int>(blockIdx.x) / a.C * kUb, t0 = rank * TR, v0 = rank * VS;
  const int i_lo = (t0 * a.l + u0) / a.q;
  const int i_hi = ((t0 + TR - 1) * a.l + u0) / a.q;
  const int w1_stride = a.p + kPad, zs_stride = a.r + kPad;  // (w2 rows have z's stride)

  // 1. x columns of blocks i_lo .. i_hi (zeros in the token rows past the last), w1 rows, w2 rows
  {
    const T* x = static_cast<const T*>(a.x) + static_cast<int64_t>(i_lo) * a.p;
    const int x_chunks = (i_hi - i_lo + 1) * a.p / 8;
    for (int c = tid; c < kTok * x_chunks; c += kThreads) {
      const int b = c / x_chunks, ch = c % x_chunks;
      const bool ok = b < a.tokens;
      gpu::mma::cp_async16(xs + b * a.x_cols + ch * 8, ok ? x + b * a.x_stride + ch * 8 : x, ok ? 16 : 0);
    }
    const T* w1 = static_cast<const T*>(a.w1);
    const int w1_chunks = a.p / 8;  // per row
    for (int c = tid; c < TR * kUb * w1_chunks; c += kThreads) {
      const int row = c / w1_chunks, ch = c % w1_chunks;  // row = t_local * 8 + (u - u0)
      const int64_t j = static_cast<int64_t>(t0 + row / kUb) * a.l + u0 + row % kUb;
      gpu::mma::cp_async16(w1s + row * w1_stride + ch * 8, w1 + j * a.p + ch * 8, 16);
    }
    gpu::mma::cp_async_commit();  // group: what stage 1 reads
    const T* w2 = static_cast<const T*>(a.w2);
    const int w2_chunks = a.r / 8;  // per row
    for (int c = tid; c < kUb * VS * w2_chunks; c += kThreads) {
      const int row = c / w2_chunks, ch = c % w2_chunks;  // row = (u - u0) * VS + v - v0
      const int64_t src_row = static_cast<int64_t>(u0 + row / VS) * a.s + v0 + row % VS;
      gpu::mma::cp_async16(w2s + row * zs_stride + ch * 8, w2 + src_row * a.r + ch * 8, 16);
    }
    gpu::mma::cp_async_commit();  // group: w2, waited for before step 3's cluster barrier
    gpu::mma::cp_async_wait<1>();
    __syncthreads();
  }

  // 2. stage 1: t_local = tl and tl + 8 at once (one ldmatrix.x4 holds both t's B fragments)
  for (int tl = warp; tl < TR; tl += 16) {
    float acc[2][4] = {};
    const T* xa[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int i = ((t0 + tl + 8 * h) * a.l + u0) / a.q;
      xa[h] = a_row(xs + (i - i_lo) * a.p, a.x_cols, lane);
    }
    // matrices (t tl, k 0-7), (tl, 8-15), (tl + 8, 0-7), (tl + 8, 8-15): b0 b1 of each t
    const T* wb = w1s + ((tl + 8 * (lane >> 4)) * kUb + (lane & 7)) * w1_stride + 8 * ((lane >> 3) & 1);
#pragma unroll 4
    for (int kk = 0; kk < a.p / 16; ++kk) {
      uint32_t bf[4];
      gpu::mma::ldmatrix_x4(bf, wb + 16 * kk);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        uint32_t af[4];
        gpu::mma::ldmatrix_x4(af, xa[h] + 16 * kk);
        const uint32_t b[2] = {bf[2 * h], bf[2 * h + 1]};
        gpu::mma_m16n8k16<T>(acc[h], af, b);
      }
    }
    // acc: (token g, blocks 2 tig, 2 tig + 1), (token g + 8, ..) -> z[u][b][t]
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int t = t0 + tl + 8 * h;
#pragma unroll
      for (int e = 0; e < 4; ++e)
        zs[((2 * tig + (e & 1)) * kTok + g + 8 * (e >> 1)) * zs_stride + t] = gpu::from_float<T>(acc[h][e]);
    }
  }
  __syncthreads();

  // 3. this CTA's z columns t0 .. t0 + TR into every other CTA of the cluster
  gpu::tma::cluster_wait();
  {
    const int chunks = TR / 8;  // per (u, token) row
    for (int dst = 1; dst < a.C; ++dst) {
      T* remote = gpu::tma::cluster_map(zs, (rank + dst) % a.C);
      for (int c = tid; c < kUb * kTok * chunks; c += kThreads) {
        const int at = (c / chunks) * zs_stride + t0 + (c % chunks) * 8;
        *reinterpret_cast<uint4*>(remote + at) = *reinterpret_cast<const uint4*>(zs + at);
      }
    }
  }
  gpu::mma::cp_async_wait<0>();  // w2 (it arrived while stage 1 ran)
  gpu::tma::cluster_sync();       // all of z (and w2) here; no writes into this CTA's shared memory after it

  // 4. stage 2: block u0 + warp, two n8 tiles of v per ldmatrix.x4 of w2
  {
    const T* za = a_row(zs + warp * kTok * zs_stride, zs_stride, lane);
    // matrices (v 0-7, k 0-7), (0-7, 8-15), (8-15, 0-7), (8-15, 8-15) of a 16-row group of v
    const T* wb = w2s + (warp * VS + 8 * (lane >> 4) + (lane & 7)) * zs_stride + 8 * ((lane >> 3) & 1);
    for (int vp = 0; vp < VS; vp += 16) {
      float acc[2][4] = {};
#pragma unroll 4
      for (int kt = 0; kt < a.r / 16; ++kt) {
        uint32_t af[4], bf[4];
        gpu::mma::ldmatrix_x4(af, za + 16 * kt);
        gpu::mma::ldmatrix_x4(bf, wb + vp * zs_stride + 16 * kt);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const uint32_t b[2] = {bf[2 * h], bf[2 * h + 1]};
          gpu::mma_m16n8k16<T>(acc[h], af, b);
        }
      }
      // acc: (token g, v 2 tig, 2 tig + 1 of tile h), (token g + 8, ..) -> staging [b][v][u]
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int b = g + 8 * (e >> 1), v = vp + 8 * h + 2 * tig + (e & 1);
          os[(b * VS + v) * kUb + warp] = gpu::from_float<T>(acc[h][e]);
        }
    }
  }
  __syncthreads();
  {
    T* out = static_cast<T*>(a.out) + u0;
    for (int idx = tid; idx < a.tokens * VS; idx += kThreads) {
      const int b = idx / VS, v = v0 + idx % VS;
      *reinterpret_cast<uint4*>(out + b * a.out_stride + static_cast<int64_t>(v) * a.l) =
          *reinterpret_cast<const uint4*>(os + idx * kUb);
    }
  }
#else
  (void)a;
#endif
}

template <typename T>
bool launch_mma(const MonarchParams& p, const MmaLayout& lay) {
  constexpr auto kernel = monarch_decode_mma_kernel<T>;
  const int dev = p.device.index;
  const int max_smem = gpu::mma::max_shared_memory(dev) - 1024;  // (room for the static marker)
  if (lay.total > max_smem || !gpu::tma::sm90_kernel_ready<kernel>(dev, static_cast<std::size_t>(max_smem), "monarch_matmul"))
    return false;
  const std::size_t smem = static_cast<std::size_t>(lay.total);  // (clusters of up to 8 CTAs, one per SM, always fit)
  MmaArgs a;
  set_operands(a, p);
  a.tokens = static_cast<int>(p.tokens), a.q = static_cast<int>(p.q), a.p = static_cast<int>(p.p);
  a.l = static_cast<int>(p.l), a.s = static_cast<int>(p.s), a.r = static_cast<int>(p.r);
  a.C = lay.C, a.tr = lay.tr, a.vs = lay.vs, a.x_cols = lay.x_cols;
  a.off_w1 = static_cast<int>(lay.w1), a.off_w2 = static_cast<int>(lay.w2), a.off_z = static_cast<int>(lay.z);
  a.off_out = static_cast<int>(lay.out);
  const unsigned ctas = static_cast<unsigned>(p.l / kUb * lay.C);
  gpu::launch_cluster(kernel, dim3(ctas), dim3(kThreads), smem, gpu::as_stream(p.stream), static_cast<unsigned>(lay.C),
                      false, a);
  gpu::check_launch("monarch_matmul");
  g_launches.fetch_add(1, std::memory_order_relaxed);
  return true;
}

}  // namespace
#endif

bool monarch_decode_mma_forward(const MonarchParams& p) {
#if LLMK_MMA_SYNC_BUILD
  if (p.tokens <= 0 || p.tokens > kMonarchSkinnyTokens || (p.dtype != DType::f16 && p.dtype != DType::bf16)) return false;
  if (p.l % kUb || p.q % 8 || p.p % 16 || p.s % 16 || p.r % 16) return false;  // (C = 1 at least)
  if (p.x_stride % 8 || p.out_stride % 8 || !aligned16(p.x) || !aligned16(p.w1) || !aligned16(p.w2) || !aligned16(p.out))
    return false;
  // int indexing inside the kernel (elements of x rows, of w1 and w2, of out rows)
  if (p.n() >= (int64_t{1} << 31) / kTok || p.k * p.q * p.p >= (int64_t{1} << 31) || p.l * p.s * p.r >= (int64_t{1} << 31) ||
      p.m() >= (int64_t{1} << 31) / kTok || p.x_stride >= (int64_t{1} << 31) / kTok || p.out_stride >= (int64_t{1} << 31) / kTok)
    return false;
  const MmaLayout lay = mma_layout(p);
  if (lay.total >= (int64_t{1} << 31)) return false;
  return p.dtype == DType::f16 ? launch_mma<half>(p, lay) : launch_mma<bfloat16>(p, lay);
#else
  (void)p;
  return false;
#endif
}

int64_t monarch_decode_mma_launches_gpu() {
#if LLMK_MMA_SYNC_BUILD
  return g_launches.load(std::memory_order_relaxed);
#else
  return 0;
#endif
}

}  // namespace llmk::detail
