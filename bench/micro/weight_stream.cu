// Micro-benchmark: how fast can a skinny GEMM's weight read go on this GPU, by load pattern, with no
// arithmetic? W is an (N, K) bf16 matrix in nn.Linear's layout, read once; every loaded word is
// folded into a register by an asm volatile xor (the consumer stands where gemm_deep_kernel's
// mma.sync is, so the loads of the next trip are not hoisted above it).
//   linear:   a grid-stride read of W as one flat array, 8 independent 16-byte loads per thread in
//             flight, whole warps on 512 contiguous bytes (the ceiling of a plain read)
//   deep:     gemm_deep_kernel's pattern: blocks of 8 warps, a warp owns 16 rows (lane (g, tq): rows
//             g and g + 8, 16 bytes at K offset 32 j + 8 tq), per trip L loads then the consumer;
//             sk warps split K per 16-row group; ld.global.nc.L1::no_allocate with an L2
//             evict-first hint and 256-byte L2 prefetch (gpu::load_once)
//   deep-plain: the same loads without the hint and prefetch (ld.global.nc.v4); deep-evf: the
//             evict-first hint only; deep-256B: the 256-byte L2 prefetch only
//   deep-pipe: the same pattern with two register sets: the loads of trip i + 1 are issued before
//             trip i is consumed, so a warp never drains to zero loads in flight
// Build and run: nvcc -O3 -arch=sm_90a -std=c++17 bench/micro/weight_stream.cu -o /tmp/ws && /tmp/ws
// Times: median of 30 launches between CUDA events, each after a 256 MB memset that flushes the L2
// (as triton's do_bench); TB/s of W read.
//
// Measured on the H200 (2026-12-02 01:51 UTC): the linear read 4.08 TB/s at 28672 x 8192 (470 MB);
// deep (gemm_deep_kernel's loads) 3.69 TB/s at sk = 1 (224 blocks, its plan then: the kernel
// itself took 129 us, 3.64 TB/s), 3.88 at sk = 8 (1792 blocks), which the plan now takes there;
// deep-plain 3.94 / 4.10 (4.36 at sk = 4 on 57344 x 8192), but below deep at <= 268 MB (2.18 against
// 2.44 at 4096 x 4096), and slower in the kernel itself at every shape (e.g. 134.6 against 123.2 us
// at sk = 8, 8192 x 28672: its L1-allocating W loads evict x, which the kernel reads through L1);
// deep-evf and deep-256B within 2% of deep. Smaller matrices stay below the linear read's rate for
// a fixed cost: 33.6 MB took 16.3 us linear (2.06 TB/s), 13.7 us deep at sk = 8.
#include <cuda_runtime.h>
#include <cstdint>
#include <cstdio>
#include <algorithm>
#include <vector>

#include "flush_timer.h"

struct U4 { uint32_t a, b, c, d; };

// Load flavours: 0 plain ld.global.nc; 1 L1::no_allocate + L2 evict-first hint + L2::256B prefetch
// (gpu::load_once); 2 the hint without the prefetch; 3 the prefetch without the hint.
template <int F>
__device__ __forceinline__ U4 load16(const uint16_t* p, uint64_t policy) {
  U4 r;
  if (F == 1)
    asm volatile("ld.global.nc.L1::no_allocate.L2::cache_hint.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4], %5;\n"
                 : "=r"(r.a), "=r"(r.b), "=r"(r.c), "=r"(r.d) : "l"(p), "l"(policy));
  else if (F == 2)
    asm volatile("ld.global.nc.L1::no_allocate.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;\n"
                 : "=r"(r.a), "=r"(r.b), "=r"(r.c), "=r"(r.d) : "l"(p), "l"(policy));
  else if (F == 3)
    asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r.a), "=r"(r.b), "=r"(r.c), "=r"(r.d) : "l"(p));
  else
    asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];\n" : "=r"(r.a), "=r"(r.b), "=r"(r.c), "=r"(r.d) : "l"(p));
  return r;
}

__device__ __forceinline__ void consume(uint32_t& acc, const U4& v) {
  asm volatile("xor.b32 %0, %0, %1;\n xor.b32 %0, %0, %2;\n xor.b32 %0, %0, %3;\n xor.b32 %0, %0, %4;\n"
               : "+r"(acc) : "r"(v.a), "r"(v.b), "r"(v.c), "r"(v.d));
}

__global__ void __launch_bounds__(256) linear_kernel(const uint16_t* w, int64_t chunks, int* sink) {
  uint32_t acc = 0;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (; i + 7 * stride < chunks; i += 8 * stride) {
    U4 v[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] = load16<0>(w + (i + j * stride) * 8, 0);
#pragma unroll
    for (int j = 0; j < 8; ++j) consume(acc, v[j]);
  }
  for (; i < chunks; i += stride) consume(acc, load16<0>(w + i * 8, 0));
  if (acc == 0x12345678u) *sink = 1;
}

// L loads per lane per trip (U = L / 2 K steps of 32), sk warps per 16-row group, PIPE: double buffer.
template <int L, int HINT, bool PIPE>
__global__ void __launch_bounds__(256, L == 8 && !PIPE ? 3 : 2)
    deep_kernel(const uint16_t* w, int n, int k, int sk, int* sink) {
  constexpr int U = L / 2;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane >> 2, tq = lane & 3;
  const int cg = warp / sk, ks = warp % sk;
  const int64_t col0 = (static_cast<int64_t>(blockIdx.x) * (8 / sk) + cg) * 16;
  if (col0 >= n) return;
  const uint16_t* wlo = w + (col0 + g < n ? col0 + g : 0) * static_cast<int64_t>(k);
  const uint16_t* whi = w + (col0 + g + 8 < n ? col0 + g + 8 : 0) * static_cast<int64_t>(k);
  int per = (k + sk - 1) / sk;
  per = (per + 31) / 32 * 32;
  const int kb = ks * per, ke = kb + per < k ? kb + per : k;
  uint64_t policy = 0;
  if (HINT == 1 || HINT == 2) asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(policy));
  uint32_t acc = 0;
  U4 a[2 * U], b[2 * U];
  auto issue = [&](U4* r, int base) {
#pragma unroll
    for (int j = 0; j < U; ++j) {
      r[2 * j] = load16<HINT>(wlo + base + j * 32 + tq * 8, policy);
      r[2 * j + 1] = load16<HINT>(whi + base + j * 32 + tq * 8, policy);
    }
  };
  auto eat = [&](const U4* r) {
#pragma unroll
    for (int j = 0; j < 2 * U; ++j) consume(acc, r[j]);
  };
  const int step = 32 * U;
  int base = kb;
  if (!PIPE) {
    for (; base + step <= ke; base += step) {
      issue(a, base);
      eat(a);
    }
  } else if (base + step <= ke) {
    issue(a, base);
    base += step;
    for (; base + 2 * step <= ke; base += 2 * step) {
      issue(b, base);
      eat(a);
      issue(a, base + step);
      eat(b);
    }
    if (base + step <= ke) {
      issue(b, base);
      eat(a);
      eat(b);
      base += step;
    } else {
      eat(a);
    }
  }
  for (; base < ke; base += 32) consume(acc, load16<HINT>(wlo + base + tq * 8, policy));  // tail (not timed apart)
  if (acc == 0x12345678u) *sink = 1;
}

int main() {
  struct Shape { int n, k; };
  const Shape shapes[] = {{28672, 8192}, {4096, 4096}, {14336, 4096}, {4096, 14336}, {8192, 8192},
                          {14336, 8192}, {16384, 8192}, {57344, 8192}, {128256, 4096}};
  std::size_t max_elems = 0;
  for (const Shape& s : shapes) max_elems = std::max(max_elems, std::size_t{1} * s.n * s.k);
  uint16_t* w;
  int* sink;
  CK(cudaMalloc(&w, max_elems * 2));
  CK(cudaMalloc(&sink, 4));
  CK(cudaMemset(w, 1, max_elems * 2));
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  FlushTimer timer;
  CK(timer.init());
  auto occ = [&](auto kernel) {
    int b = 0;
    cudaOccupancyMaxActiveBlocksPerMultiprocessor(&b, kernel, 256, 0);
    return b;
  };
  printf("SMs %d; blocks per SM: deep L8 %d, deep-pipe L8 %d, deep L16 %d\n", sms, occ(deep_kernel<8, 1, false>),
         occ(deep_kernel<8, 1, true>), occ(deep_kernel<16, 1, false>));
  for (const Shape& s : shapes) {
    const double bytes = 2.0 * s.n * s.k;
    printf("W %d x %d (%.1f MB):\n", s.n, s.k, bytes / 1e6);
    auto report = [&](const char* name, float ms) { printf("  %-28s %7.1f us %5.2f TB/s\n", name, ms * 1e3, bytes / ms / 1e9); };
    for (int bps : {4, 8}) {
      const int64_t chunks = static_cast<int64_t>(s.n) * s.k / 8;
      char name[64];
      snprintf(name, sizeof name, "linear %d blocks/SM", bps);
      report(name, timer.median_ms([&] { linear_kernel<<<sms * bps, 256>>>(w, chunks, sink); }));
      CK(cudaGetLastError());
    }
    const int groups = (s.n + 15) / 16;
    for (int sk : {1, 2, 4, 8}) {
      const int grid = (groups * sk + 7) / 8;
      char name[64];
      auto run = [&](const char* tag, auto kernel) {
        snprintf(name, sizeof name, "%s sk%d (%d blocks)", tag, sk, grid);
        report(name, timer.median_ms([&] { kernel<<<grid, 256>>>(w, s.n, s.k, sk, sink); }));
      };
      run("deep L8", deep_kernel<8, 1, false>);
      run("deep-plain L8", deep_kernel<8, 0, false>);
      run("deep-evf L8", deep_kernel<8, 2, false>);
      run("deep-256B L8", deep_kernel<8, 3, false>);
      if (sk <= 2) run("deep-pipe L8", deep_kernel<8, 1, true>);
      CK(cudaGetLastError());
    }
  }
  return 0;
}
