// Monarch forward for a few tokens (decode) in ONE launch, by stage-2 block (portable: NVIDIA and
// AMD, fp16/bf16).
//
// out[b, v*l + u] = sum_t w2[u, v, t] * y[b, j] with j = t*l + u, and y[b, j] is row j of w1 viewed
// as (k*q, p) (block i = j / q, row c = j % q) times x[b, i*p ..]. So the outputs of stage-2 block
// u need only the r rows of w1 at j = t*l + u (t < r) and w2[u]: the l blocks u are independent
// problems that share x, and one kernel computes both stages without the intermediate leaving the
// CTA (the skinny stages of monarch_skinny.cu are two launches through a workspace, the cluster
// kernels need sm_90a and keep every weight on chip). A CTA of 256 threads owns UB consecutive
// blocks u (UB divides l and q, so for each t their w1 rows are UB consecutive rows of one block,
// read against the same x) and TB tokens:
//   1. copies its x rows (TB x n), the UB w1 rows of every t and w2[u0 .. u0+UB) into shared
//      memory with 16-byte copies that are all in flight at once (cp.async on NVIDIA);
//   2. stage 1: a group of LP lanes per t (p / 8 16-byte chunks across the group, LP that rounded
//      up to a power of two) forms the UB x TB dot products of its w1 rows with the x rows,
//      reduces them across the group with shuffles and stores them rounded to the dtype (as every
//      path rounds y) as z[ub][b][t] in shared memory;
//   3. stage 2: a group per output row v the same with w2[u0 + ub, v, :] and z, and stores the UB
//      adjacent outputs out[b, v*l + u0 ..] of each token as one vector.
// The CTA's bytes (x TB rows, UB r p + UB s r weights) come from L2 except the first reads of each
// weight; decode_plan picks (UB, TB) to keep them small while the grid fills the GPU.
//
// Performance (H200, bf16, do_bench with L2 flushed, 2026-12-03): n = 4096 with 64 blocks, 16
// tokens 8.8-9.9 us (the resident cluster kernel 12.0, dense 18.9; 6.8 us of GPU time in a CUDA
// graph), one token 6.4-7.3; one launch after the flush takes ~4.4 us however little it reads.
// The rest is the dot products on 8 warps per SM (with the conversions ~2 instructions per
// multiply-add, plus the shuffles); at blocks of 128 they dominate (n = 8192 with 64 blocks: 25 us
// against the skinny stages' 16), so wider blocks do not come here by default (decode_wanted in
// monarch_gpu.cu). LLMK_MONARCH_DECODE_THREADS=512 runs CTAs of 512 threads (not clearly faster
// where the default rule applies; 20% faster at n = 8192).
//
// Shapes: tokens <= kMonarchSkinnyTokens, p and r multiples of 8 and at most 256, the CTA's
// shared memory within the device's limit; 16-byte aligned x (row stride a multiple of 8), w1, w2.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "core/check.h"
#include "gpu/compat.h"
#include "gpu/mma.h"
#include "gpu/runtime.h"
#include "monarch/monarch_internal.h"

namespace llmk::detail {

using gpu::bfloat16;
using gpu::half;

namespace {

constexpr int kChunk = 8;  // 16-bit elements per 16-byte copy and per lane of a dot product

struct DecodeArgs : FewTokenOperands {
  int tokens = 0, n = 0, q = 0, p = 0, l = 0, s = 0, r = 0;
  int lanes1 = 0, lanes2 = 0;  // lanes per dot product: p / 8 and r / 8 rounded up to powers of two
};

// Shared memory (elements): x [TB][n], w1 rows [r][UB][p], w2 [UB][s][r], z [UB][TB][r]; every
// piece a multiple of 8 elements, so each starts 16-byte aligned.
struct DecodeLayout {
  int64_t x = 0, w1 = 0, w2 = 0, z = 0, total = 0;
};

__host__ __device__ inline DecodeLayout decode_layout(int ub, int tb, int n, int p, int s, int r) {
  DecodeLayout o;
  o.w1 = static_cast<int64_t>(tb) * n;
  o.w2 = o.w1 + static_cast<int64_t>(r) * ub * p;
  o.z = o.w2 + static_cast<int64_t>(ub) * s * r;
  o.total = o.z + static_cast<int64_t>(ub) * tb * r;
  return o;
}

// sums[ub][b] += dot(w_ub[chunk], v_ub,b[chunk]) for the lane's chunk of 8 elements: UB rows of w
// at w + ub * w_step; the v rows at v + b * v_step, the same for every ub (SHARED_V: stage 1's x)
// or at v + (ub * TB + b) * v_step (stage 2's z).
template <typename T, int UB, int TB, bool SHARED_V>
__device__ __forceinline__ void chunk_dots(float (&sums)[UB][TB], const T* w, int w_step, const T* v, int v_step) {
  float wf[UB][kChunk];
#pragma unroll
  for (int ub = 0; ub < UB; ++ub) gpu::load_float<T, kChunk>(w + ub * w_step, wf[ub]);
#pragma unroll
  for (int b = 0; b < TB; ++b) {
    float vf[kChunk];
#pragma unroll
    for (int ub = 0; ub < UB; ++ub) {
      if (!SHARED_V || ub == 0) gpu::load_float<T, kChunk>(v + (SHARED_V ? b : ub * TB + b) * v_step, vf);
#pragma unroll
      for (int e = 0; e < kChunk; ++e) sums[ub][b] = fmaf(wf[ub][e], vf[e], sums[ub][b]);
    }
  }
}

// Sum over each group of `lanes` consecutive lanes (a power of two, at most 32); every lane of the
// warp calls it.
template <int UB, int TB>
__device__ __forceinline__ void group_sums(float (&sums)[UB][TB], int lanes) {
  for (int m = lanes / 2; m > 0; m >>= 1)
#pragma unroll
    for (int ub = 0; ub < UB; ++ub)
#pragma unroll
      for (int b = 0; b < TB; ++b) sums[ub][b] += gpu::shfl_xor(sums[ub][b], m);
}

template <typename T, int UB, int TB, int THREADS>
__global__ void __launch_bounds__(THREADS) monarch_decode_kernel(const DecodeArgs a) {
  extern __shared__ __align__(16) unsigned char decode_smem[];
  T* sm = reinterpret_cast<T*>(decode_smem);
  const DecodeLayout lay = decode_layout(UB, TB, a.n, a.p, a.s, a.r);
  T* xs = sm + lay.x;
  T* w1s = sm + lay.w1;
  T* w2s = sm + lay.w2;
  T* zs = sm + lay.z;
  const int tid = threadIdx.x;
  const int u0 = static_cast<int>(blockIdx.x) * UB;
  const int64_t b0 = static_cast<int64_t>(blockIdx.y) * TB;
  const int valid = static_cast<int>(a.tokens - b0 < TB ? a.tokens - b0 : TB);  // tokens of this CTA

  // 1. x rows (zeros past the last token), the w1 rows of every t, w2 blocks u0 ..
  const T* x = static_cast<const T*>(a.x);
  const int x_chunks = a.n / kChunk;
  for (int c = tid; c < TB * x_chunks; c += THREADS) {
    const int b = c / x_chunks, ch = c % x_chunks;
    const bool ok = b < valid;
    gpu::copy16_async(xs + static_cast<int64_t>(b) * a.n + ch * kChunk,
                      ok ? x + (b0 + b) * a.x_stride + ch * kChunk : x, ok);
  }
  const T* w1 = static_cast<const T*>(a.w1);
  const int w1_chunks = UB * a.p / kChunk;  // per t: rows j .. j + UB - 1, contiguous
  for (int c = tid; c < a.r * w1_chunks; c += THREADS) {
    const int t = c / w1_chunks, ch = c % w1_chunks;
    const int64_t j = static_cast<int64_t>(t) * a.l + u0;
    gpu::copy16_async(w1s + static_cast<int64_t>(t) * UB * a.p + ch * kChunk, w1 + j * a.p + ch * kChunk, true);
  }
  const T* w2 = static_cast<const T*>(a.w2) + static_cast<int64_t>(u0) * a.s * a.r;
  const int w2_chunks = UB * a.s * a.r / kChunk;
  for (int c = tid; c < w2_chunks; c += THREADS)
    gpu::copy16_async(w2s + static_cast<int64_t>(c) * kChunk, w2 + static_cast<int64_t>(c) * kChunk, true);
  gpu::copy16_async_wait();
  __syncthreads();

  // 2. z[ub][b][t] = w1 row (t*l + u0 + ub) . x[b, i*p ..], i = (t*l + u0) / q; the loop bound is
  //    uniform over the warp (the shuffles need every lane)
  {
    const int lanes = a.lanes1, gl = tid % lanes, groups = THREADS / lanes;
    for (int t0 = 0; t0 < a.r; t0 += groups) {
      const int t = t0 + tid / lanes;
      float sums[UB][TB] = {};
      if (t < a.r && gl * kChunk < a.p) {
        const int i = (t * a.l + u0) / a.q;
        chunk_dots<T, UB, TB, true>(sums, w1s + static_cast<int64_t>(t) * UB * a.p + gl * kChunk, a.p,
                                    xs + static_cast<int64_t>(i) * a.p + gl * kChunk, a.n);
      }
      group_sums<UB, TB>(sums, lanes);
      if (t < a.r) {
#pragma unroll
        for (int ub = 0; ub < UB; ++ub)
#pragma unroll
          for (int b = 0; b < TB; ++b)
            if ((ub * TB + b) % lanes == gl) zs[(ub * TB + b) * a.r + t] = gpu::from_float<T>(sums[ub][b]);
      }
    }
  }
  __syncthreads();

  // 3. out[b, v*l + u0 + ub] = w2[u0 + ub, v, :] . z[ub][b][:]
  {
    const int lanes = a.lanes2, gl = tid % lanes, groups = THREADS / lanes;
    T* out = static_cast<T*>(a.out) + u0;
    for (int v0 = 0; v0 < a.s; v0 += groups) {
      const int v = v0 + tid / lanes;
      float sums[UB][TB] = {};
      if (v < a.s && gl * kChunk < a.r)
        chunk_dots<T, UB, TB, false>(sums, w2s + static_cast<int64_t>(v) * a.r + gl * kChunk, a.s * a.r,
                                     zs + gl * kChunk, a.r);
      group_sums<UB, TB>(sums, lanes);
      if (v < a.s) {
#pragma unroll
        for (int b = 0; b < TB; ++b)
          if (b < valid && b % lanes == gl) {
            float o[UB];
#pragma unroll
            for (int ub = 0; ub < UB; ++ub) o[ub] = sums[ub][b];
            gpu::store_float<T, UB>(out + (b0 + b) * a.out_stride + static_cast<int64_t>(v) * a.l, o);
          }
      }
    }
  }
}

// (UB, TB) with UB * TB <= 16: the instantiated kernels.
constexpr int kUbs[] = {1, 2, 4};
constexpr int kTbs[] = {1, 2, 4, 8, 16};

struct DecodePlan {
  int ub = 0, tb = 0;  // 0: none
  std::size_t smem = 0;
};

int pow2_ceil(int v) {
  int p = 1;
  while (p < v) p *= 2;
  return p;
}

// Whether (ub, tb) suits p's shape and pointers; the CTA's shared memory in `smem`.
bool plan_fits(const MonarchParams& p, int ub, int tb, int max_smem, std::size_t& smem) {
  if (ub * tb > 16 || p.l % ub != 0 || p.q % ub != 0) return false;
  // the UB outputs of a token are one vector store: out's row stride and address must allow it
  if (p.out_stride % ub != 0 || reinterpret_cast<uintptr_t>(p.out) % (ub * dtype_size(p.dtype)) != 0) return false;
  const DecodeLayout lay = decode_layout(ub, tb, static_cast<int>(p.n()), static_cast<int>(p.p),
                                         static_cast<int>(p.s), static_cast<int>(p.r));
  smem = static_cast<std::size_t>(lay.total) * dtype_size(p.dtype);
  return smem <= static_cast<std::size_t>(max_smem);
}

// The plan: the fewest bytes per multiprocessor (a CTA's x and weight bytes times the CTAs each
// multiprocessor runs, ceil(CTAs / SMs)); ties to less traffic in all. TB at most the token count
// rounded up to a power of two. LLMK_MONARCH_DECODE_PLAN=UBxTB forces one (an error where it does
// not fit).
DecodePlan decode_plan(const MonarchParams& p) {
  const int dev = p.device.index;
  const int sms = gpu::multiprocessor_count(dev), max_smem = gpu::mma::max_shared_memory(dev);
  DecodePlan best;
  if (const char* forced = std::getenv("LLMK_MONARCH_DECODE_PLAN"); forced != nullptr && *forced != '\0') {
    int ub = 0, tb = 0;
    std::size_t smem = 0;
    const bool known = std::sscanf(forced, "%dx%d", &ub, &tb) == 2 &&
                       std::find(std::begin(kUbs), std::end(kUbs), ub) != std::end(kUbs) &&
                       std::find(std::begin(kTbs), std::end(kTbs), tb) != std::end(kTbs);
    if (!known || !plan_fits(p, ub, tb, max_smem, smem))
      fail(ErrorKind::value, "monarch_matmul",
           std::string("LLMK_MONARCH_DECODE_PLAN=") + forced +
               " does not suit this shape (UBxTB: UB in 1, 2, 4 dividing l and q, TB in 1, 2, 4, 8, 16, UB*TB "
               "<= 16, within shared memory)");
    return {ub, tb, smem};
  }
  double best_cost = 0, best_traffic = 0;
  const int tb_max = pow2_ceil(static_cast<int>(p.tokens));
  for (int ub : kUbs)
    for (int tb : kTbs) {
      std::size_t smem = 0;
      if (tb > tb_max || !plan_fits(p, ub, tb, max_smem, smem)) continue;
      const double bytes = static_cast<double>(tb * p.n() + p.r * ub * p.p + ub * p.s * p.r) * dtype_size(p.dtype);
      const int64_t ctas = (p.l / ub) * ((p.tokens + tb - 1) / tb);
      const double cost = static_cast<double>((ctas + sms - 1) / sms) * bytes, traffic = ctas * bytes;
      if (best.ub == 0 || cost < best_cost || (cost == best_cost && traffic < best_traffic)) {
        best = {ub, tb, smem};
        best_cost = cost;
        best_traffic = traffic;
      }
    }
  return best;
}

template <typename T, int UB, int TB, int THREADS>
void launch_decode(const MonarchParams& p, const DecodeArgs& a, std::size_t smem) {
  const auto kernel = monarch_decode_kernel<T, UB, TB, THREADS>;
  if (smem > 48 * 1024) gpu::allow_dynamic_smem(kernel, smem, "monarch_matmul");
  const dim3 grid(static_cast<unsigned>(p.l / UB), static_cast<unsigned>((p.tokens + TB - 1) / TB));
  gpu::launch(kernel, grid, dim3(THREADS), smem, gpu::as_stream(p.stream), false, a);
  gpu::check_launch("monarch_matmul");
}

template <typename T, int UB, int THREADS>
void launch_tb(const MonarchParams& p, const DecodeArgs& a, const DecodePlan& plan) {
  if (plan.tb == 1) return launch_decode<T, UB, 1, THREADS>(p, a, plan.smem);
  if (plan.tb == 2) return launch_decode<T, UB, 2, THREADS>(p, a, plan.smem);
  if (plan.tb == 4) return launch_decode<T, UB, 4, THREADS>(p, a, plan.smem);
  if constexpr (UB <= 2)
    if (plan.tb == 8) return launch_decode<T, UB, 8, THREADS>(p, a, plan.smem);
  if constexpr (UB == 1)
    if (plan.tb == 16) return launch_decode<T, UB, 16, THREADS>(p, a, plan.smem);
  fail(ErrorKind::not_implemented, "monarch_matmul", "no few-token kernel for this plan");  // (plan_fits excludes it)
}

template <typename T, int THREADS>
void launch_ub(const MonarchParams& p, const DecodeArgs& a, const DecodePlan& plan) {
  if (plan.ub == 1) launch_tb<T, 1, THREADS>(p, a, plan);
  else if (plan.ub == 2) launch_tb<T, 2, THREADS>(p, a, plan);
  else launch_tb<T, 4, THREADS>(p, a, plan);
}

template <typename T>
void run_decode(const MonarchParams& p, const DecodePlan& plan) {
  DecodeArgs a;
  set_operands(a, p);
  a.tokens = static_cast<int>(p.tokens), a.n = static_cast<int>(p.n()), a.q = static_cast<int>(p.q);
  a.p = static_cast<int>(p.p), a.l = static_cast<int>(p.l), a.s = static_cast<int>(p.s), a.r = static_cast<int>(p.r);
  a.lanes1 = pow2_ceil(a.p / kChunk), a.lanes2 = pow2_ceil(a.r / kChunk);
  // threads per CTA: 256, or 512 with LLMK_MONARCH_DECODE_THREADS=512 (read per call)
  const char* threads = std::getenv("LLMK_MONARCH_DECODE_THREADS");
  if (threads != nullptr && std::strcmp(threads, "512") == 0) launch_ub<T, 512>(p, a, plan);
  else launch_ub<T, 256>(p, a, plan);
}

// Whether p's shape and dtype suit the kernel (pointers aside).
bool monarch_decode_shape(const MonarchParams& p) {
  return p.tokens > 0 && p.tokens <= kMonarchSkinnyTokens && (p.dtype == DType::f16 || p.dtype == DType::bf16) &&
         p.p % kChunk == 0 && p.r % kChunk == 0 && p.p <= 32 * kChunk && p.r <= 32 * kChunk &&
         p.n() < (int64_t{1} << 31) / kMonarchSkinnyTokens && p.k * p.q * p.p < (int64_t{1} << 31) &&
         p.l * p.s * p.r < (int64_t{1} << 31);
}

}  // namespace

bool monarch_decode_forward(const MonarchParams& p) {
  if (!monarch_decode_shape(p) || p.x_stride % kChunk != 0 || !aligned16(p.x) || !aligned16(p.w1) || !aligned16(p.w2))
    return false;
  const DecodePlan plan = decode_plan(p);
  if (plan.ub == 0) return false;
  if (p.dtype == DType::f16) run_decode<half>(p, plan);
  else run_decode<bfloat16>(p, plan);
  return true;
}

}  // namespace llmk::detail
