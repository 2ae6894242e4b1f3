// Micro-benchmark: how fast can a decode-attention-shaped read of a KV cache go on this GPU, by
// load method, with no attention math? Each block streams one (sequence, KV head, split) chunk of
// K and V rows (D = 128 bf16: 256 bytes a row) through shared memory, as decode_mma_kernel does,
// and touches what arrived (a xor into a register) so that the stages are really consumed.
//   cpasync: 16-byte cp.async pieces into a ring of STAGES x (64 K rows + 64 V rows), 128 threads
//   bulk:    one cp.async.bulk (TMA engine, no tensor map) per 256-byte row, mbarrier per stage
//   bulktile: one cp.async.bulk per 16 KB K tile and one per V tile (unpadded rows)
//   ldg:     256 threads, 16-byte register loads, 4 K + 4 V loads in flight per thread
//   tma*:    the bulk tensor copy engine (tensor maps), one thread issuing per stage:
//            tma64sw: D / 64 boxes of 64 keys x 64 columns per K / V tile, 128B swizzle (decode_mma_kernel's)
//            tma64sw-nopromo: the same without L2 promotion
//            tma128: one box of 64 keys x 128 columns, no swizzle
//            tma3d: one box over a (64, 2, keys) view of the rows, 128B swizzle
// Build and run: nvcc -O3 -arch=sm_90a -std=c++17 bench/micro/kv_stream.cu -lcuda -o /tmp/kv_stream && /tmp/kv_stream
// Times: median of 30 launches between CUDA events, each after a 256 MB memset that flushes the L2
// (as triton's do_bench); TB/s of K and V read.
#include <cuda.h>
#include <cuda_runtime.h>
#include <cstdint>
#include <cstdio>
#include <algorithm>
#include <vector>

#include "flush_timer.h"

constexpr int D = 128, KEYS = 64, KS = D + 8;

struct Shape { int batch, heads, len, splits; };

__device__ __forceinline__ uint32_t smem_u32(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }

template <int STAGES>
__global__ void __launch_bounds__(128, 2) cpasync_kernel(const uint16_t* k, const uint16_t* v, Shape s, int* sink) {
  extern __shared__ __align__(16) uint16_t ring[];
  const int per = s.len / s.splits;
  const int64_t head = static_cast<int64_t>(blockIdx.z) * s.heads + blockIdx.y;
  const uint16_t* kb = k + (head * s.len + blockIdx.x * per) * D;
  const uint16_t* vb = v + (head * s.len + blockIdx.x * per) * D;
  const int ntiles = per / KEYS, tid = threadIdx.x;
  auto load = [&](int tile, int slot) {
    uint16_t* ks = ring + slot * 2 * KEYS * KS;
    uint16_t* vs = ks + KEYS * KS;
#pragma unroll
    for (int i = 0; i < KEYS * 16 / 128; ++i) {
      const int idx = tid + i * 128, key = idx / 16, c = idx % 16;
      const int64_t off = static_cast<int64_t>(tile * KEYS + key) * D + c * 8;
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_u32(ks + key * KS + c * 8)), "l"(kb + off));
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_u32(vs + key * KS + c * 8)), "l"(vb + off));
    }
  };
  for (int t = 0; t < STAGES - 1; ++t) {
    if (t < ntiles) load(t, t);
    asm volatile("cp.async.commit_group;\n" ::: "memory");
  }
  uint32_t acc = 0;
  for (int it = 0; it < ntiles; ++it) {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(STAGES - 2) : "memory");
    __syncthreads();
    if (it + STAGES - 1 < ntiles) load(it + STAGES - 1, (it + STAGES - 1) % STAGES);
    asm volatile("cp.async.commit_group;\n" ::: "memory");
    const uint16_t* st = ring + (it % STAGES) * 2 * KEYS * KS;
    for (int i = tid; i < 2 * KEYS * 16; i += 128) acc ^= *reinterpret_cast<const uint32_t*>(st + (i / 16) * KS + (i % 16) * 8);
  }
  if (acc == 0x12345678u) *sink = acc;
}

__device__ __forceinline__ void mbar_init(uint64_t* b, int n) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_u32(b)), "r"(n));
}
__device__ __forceinline__ void mbar_expect(uint64_t* b, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_u32(b)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* b, uint32_t parity) {
  asm volatile(
      "{\n .reg .pred p;\n WAIT_%=:\n mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n @!p bra WAIT_%=;\n}\n" ::"r"(
          smem_u32(b)),
      "r"(parity)
      : "memory");
}
__device__ __forceinline__ void bulk_copy(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
                   smem_u32(dst)),
               "l"(src), "r"(bytes), "r"(smem_u32(bar))
               : "memory");
}

// The consumer side of an mbarrier-completed ring of STAGES stages (bars[slot] completes when the
// stage's bytes have landed): load(tile, slot) issues a tile, consume(slot) reads a landed stage
// and returns a value folded into the result (so the reads are not optimised away).
template <int STAGES, typename Load, typename Consume>
__device__ uint32_t mbar_ring(uint64_t* bars, int ntiles, Load load, Consume consume) {
  for (int t = 0; t < STAGES - 1; ++t)
    if (t < ntiles) load(t, t);
  uint32_t acc = 0;
  for (int it = 0; it < ntiles; ++it) {
    const int slot = it % STAGES;
    mbar_wait(&bars[slot], (it / STAGES) & 1);
    acc ^= consume(slot);
    __syncthreads();  // everyone is done with the stage that the next load refills
    if (it + STAGES - 1 < ntiles) load(it + STAGES - 1, (it + STAGES - 1) % STAGES);
  }
  return acc;
}

// ROWS: one bulk copy per row (padded rows) issued by 128 threads, else one per 16 KB tile.
template <int STAGES, bool ROWS>
__global__ void __launch_bounds__(128, 2) bulk_kernel(const uint16_t* k, const uint16_t* v, Shape s, int* sink) {
  extern __shared__ __align__(16) uint16_t bulk_ring[];
  uint16_t* ring = bulk_ring;
  __shared__ __align__(8) uint64_t bars[STAGES];
  constexpr int RS = ROWS ? KS : D;
  const int per = s.len / s.splits;
  const int64_t head = static_cast<int64_t>(blockIdx.z) * s.heads + blockIdx.y;
  const uint16_t* kb = k + (head * s.len + blockIdx.x * per) * D;
  const uint16_t* vb = v + (head * s.len + blockIdx.x * per) * D;
  const int ntiles = per / KEYS, tid = threadIdx.x;
  if (tid == 0) {
    for (int i = 0; i < STAGES; ++i) mbar_init(&bars[i], 1);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  auto load = [&](int tile, int slot) {
    uint16_t* ks = ring + slot * 2 * KEYS * RS;
    uint16_t* vs = ks + KEYS * RS;
    if (tid == 0) mbar_expect(&bars[slot], 2 * KEYS * D * 2);
    if (ROWS) {
      const int key = tid % KEYS;
      const bool isv = tid >= KEYS;
      bulk_copy((isv ? vs : ks) + key * RS, (isv ? vb : kb) + static_cast<int64_t>(tile * KEYS + key) * D, D * 2, &bars[slot]);
    } else if (tid == 0) {
      bulk_copy(ks, kb + static_cast<int64_t>(tile) * KEYS * D, KEYS * D * 2, &bars[slot]);
      bulk_copy(vs, vb + static_cast<int64_t>(tile) * KEYS * D, KEYS * D * 2, &bars[slot]);
    }
  };
  const uint32_t acc = mbar_ring<STAGES>(bars, ntiles, load, [&](int slot) {
    uint32_t x = 0;
    const uint16_t* st = ring + slot * 2 * KEYS * RS;
    for (int i = tid; i < 2 * KEYS * 16; i += 128) x ^= *reinterpret_cast<const uint32_t*>(st + (i / 16) * RS + (i % 16) * 8);
    return x;
  });
  if (acc == 0x12345678u) *sink = acc;
}

__global__ void __launch_bounds__(256, 2) ldg_kernel(const uint16_t* k, const uint16_t* v, Shape s, int* sink) {
  const int per = s.len / s.splits;
  const int64_t head = static_cast<int64_t>(blockIdx.z) * s.heads + blockIdx.y;
  const uint4* kb = reinterpret_cast<const uint4*>(k + (head * s.len + blockIdx.x * per) * D);
  const uint4* vb = reinterpret_cast<const uint4*>(v + (head * s.len + blockIdx.x * per) * D);
  const int n = per * D / 8;  // 16-byte pieces
  uint32_t acc = 0;
  for (int i = threadIdx.x; i < n; i += 256 * 4) {
    uint4 a[4], b[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int idx = i + j * 256;
      a[j] = idx < n ? __ldcs(kb + idx) : make_uint4(0, 0, 0, 0);
      b[j] = idx < n ? __ldcs(vb + idx) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) acc ^= a[j].x ^ a[j].w ^ b[j].y ^ b[j].z;
  }
  if (acc == 0x12345678u) *sink = acc;
}

// MODE 0: D / 64 boxes (64 columns x 64 keys) per tile of K and of V; 1: one box (128 columns x 64
// keys); 2: one box (64 x 2 x 64) of a rank-5 view. Stages of 32 KB from a 1024-byte aligned base.
template <int STAGES, int MODE>
__global__ void __launch_bounds__(128, 2) tma_kernel(const __grid_constant__ CUtensorMap mk,
                                                     const __grid_constant__ CUtensorMap mv, Shape s, int* sink) {
  extern __shared__ __align__(16) unsigned char tma_raw[];
  unsigned char* base = tma_raw + ((1024u - (smem_u32(tma_raw) & 1023u)) & 1023u);
  __shared__ __align__(8) uint64_t bars[STAGES];
  constexpr uint32_t kStage = 2 * KEYS * D * 2;
  const int per = s.len / s.splits;
  const int ntiles = per / KEYS, tid = threadIdx.x;
  const int head = blockIdx.y, batch = blockIdx.z;
  if (tid == 0) {
    for (int i = 0; i < STAGES; ++i) mbar_init(&bars[i], 1);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  auto box4 = [&](uint32_t dst, const CUtensorMap* m, uint64_t* bar, int c0, int c1) {
    asm volatile("cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5, %6}], [%2];\n"
                 ::"r"(dst), "l"(reinterpret_cast<uint64_t>(m)), "r"(smem_u32(bar)), "r"(c0), "r"(c1), "r"(head), "r"(batch) : "memory");
  };
  auto box5 = [&](uint32_t dst, const CUtensorMap* m, uint64_t* bar, int c2) {
    asm volatile("cp.async.bulk.tensor.5d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5, %6, %7}], [%2];\n"
                 ::"r"(dst), "l"(reinterpret_cast<uint64_t>(m)), "r"(smem_u32(bar)), "r"(0), "r"(0), "r"(c2), "r"(head), "r"(batch) : "memory");
  };
  auto load = [&](int tile, int slot) {
    if (tid != 0) return;
    const uint32_t ks = smem_u32(base + slot * kStage), vs = ks + kStage / 2;
    mbar_expect(&bars[slot], kStage);
    const int pos = blockIdx.x * per + tile * KEYS;
    if (MODE == 0) {
      for (int h = 0; h < D / 64; ++h) {
        box4(ks + h * KEYS * 128, &mk, &bars[slot], h * 64, pos);
        box4(vs + h * KEYS * 128, &mv, &bars[slot], h * 64, pos);
      }
    } else if (MODE == 1) {
      box4(ks, &mk, &bars[slot], 0, pos);
      box4(vs, &mv, &bars[slot], 0, pos);
    } else {
      box5(ks, &mk, &bars[slot], pos);
      box5(vs, &mv, &bars[slot], pos);
    }
  };
  const uint32_t acc = mbar_ring<STAGES>(bars, ntiles, load, [&](int slot) {
    uint32_t x = 0;
    const unsigned char* st = base + slot * kStage;
    for (int i = tid; i < int(kStage / 16); i += 128) x ^= *reinterpret_cast<const uint32_t*>(st + i * 16);
    return x;
  });
  if (acc == 0x12345678u) *sink = acc;
}

// Tensor map over a (batch, heads, len, D) cache: MODE 0 / 1 rank 4 (D, len, heads, batch), MODE 2
// rank 5 (64, 2, len, heads, batch).
bool make_map(CUtensorMap* m, const void* p, Shape s, int mode, bool promote) {
  const cuuint64_t row = D * 2, head = row * s.len, batch = head * s.heads;
  CUresult r;
  if (mode < 2) {
    const cuuint64_t dims[4] = {D, (cuuint64_t)s.len, (cuuint64_t)s.heads, (cuuint64_t)s.batch};
    const cuuint64_t strides[3] = {row, head, batch};
    const cuuint32_t box[4] = {mode == 0 ? 64u : 128u, KEYS, 1, 1}, es[4] = {1, 1, 1, 1};
    r = cuTensorMapEncodeTiled(m, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 4, const_cast<void*>(p), dims, strides, box, es,
                               CU_TENSOR_MAP_INTERLEAVE_NONE, mode == 0 ? CU_TENSOR_MAP_SWIZZLE_128B : CU_TENSOR_MAP_SWIZZLE_NONE,
                               promote ? CU_TENSOR_MAP_L2_PROMOTION_L2_256B : CU_TENSOR_MAP_L2_PROMOTION_NONE,
                               CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  } else {
    const cuuint64_t dims[5] = {64, 2, (cuuint64_t)s.len, (cuuint64_t)s.heads, (cuuint64_t)s.batch};
    const cuuint64_t strides[4] = {128, row, head, batch};
    const cuuint32_t box[5] = {64, 2, KEYS, 1, 1}, es[5] = {1, 1, 1, 1, 1};
    r = cuTensorMapEncodeTiled(m, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 5, const_cast<void*>(p), dims, strides, box, es,
                               CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                               promote ? CU_TENSOR_MAP_L2_PROMOTION_L2_256B : CU_TENSOR_MAP_L2_PROMOTION_NONE,
                               CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  }
  if (r != CUDA_SUCCESS) printf("cuTensorMapEncodeTiled mode %d: error %d\n", mode, (int)r);
  return r == CUDA_SUCCESS;
}

int main() {
  const Shape shapes[] = {{1, 8, 4096, 16}, {1, 8, 4096, 32}, {32, 8, 4096, 1}, {32, 8, 4096, 2},
                          {8, 8, 32768, 4}, {8, 8, 32768, 8}, {64, 8, 2048, 1}};
  std::size_t max_elems = 0;  // elements of each of K and V for the largest shape
  for (const Shape& s : shapes) max_elems = std::max(max_elems, std::size_t{1} * s.batch * s.heads * s.len * D);
  uint16_t *k, *v;
  int* sink;
  CK(cudaMalloc(&k, max_elems * 2));
  CK(cudaMalloc(&v, max_elems * 2));
  CK(cudaMalloc(&sink, 4));
  CK(cudaMemset(k, 1, max_elems * 2));
  CK(cudaMemset(v, 2, max_elems * 2));
  FlushTimer timer;
  CK(timer.init());
  // copy bandwidth (read + write bytes / time), as the benchmark's copy reference
  {
    float best = 1e9f;
    for (int r = 0; r < 10; ++r) {
      cudaEventRecord(timer.e0);
      cudaMemcpyAsync(k, v, max_elems * 2, cudaMemcpyDeviceToDevice);
      cudaEventRecord(timer.e1);
      cudaEventSynchronize(timer.e1);
      float ms;
      cudaEventElapsedTime(&ms, timer.e0, timer.e1);
      best = ms < best ? ms : best;
    }
    printf("memcpy D2D %.0f MB: %.3f ms, %.2f TB/s (read + write)\n", max_elems * 2 / 1e6, best, 2.0 * max_elems * 2 / best / 1e9);
  }
  struct Method { const char* name; int threads; std::size_t smem; void (*launch)(dim3, int, std::size_t, const uint16_t*, const uint16_t*, Shape, int*); };
  auto cp3 = [](dim3 g, int t, std::size_t sm, const uint16_t* k, const uint16_t* v, Shape s, int* o) { cpasync_kernel<3><<<g, t, sm>>>(k, v, s, o); };
  auto cp4 = [](dim3 g, int t, std::size_t sm, const uint16_t* k, const uint16_t* v, Shape s, int* o) { cpasync_kernel<4><<<g, t, sm>>>(k, v, s, o); };
  auto br3 = [](dim3 g, int t, std::size_t sm, const uint16_t* k, const uint16_t* v, Shape s, int* o) { bulk_kernel<3, true><<<g, t, sm>>>(k, v, s, o); };
  auto bt3 = [](dim3 g, int t, std::size_t sm, const uint16_t* k, const uint16_t* v, Shape s, int* o) { bulk_kernel<3, false><<<g, t, sm>>>(k, v, s, o); };
  auto ldg = [](dim3 g, int t, std::size_t sm, const uint16_t* k, const uint16_t* v, Shape s, int* o) { ldg_kernel<<<g, t, sm>>>(k, v, s, o); };
  const Method methods[] = {
      {"cpasync3", 128, 3 * 2 * KEYS * KS * 2, cp3}, {"cpasync4(1/SM)", 128, 4 * 2 * KEYS * KS * 2, cp4},
      {"bulkrows3", 128, 3 * 2 * KEYS * KS * 2, br3}, {"bulktile3", 128, 3 * 2 * KEYS * D * 2, bt3},
      {"ldg", 256, 0, ldg}};
  CK(cudaFuncSetAttribute(cpasync_kernel<3>, cudaFuncAttributeMaxDynamicSharedMemorySize, 3 * 2 * KEYS * KS * 2));
  CK(cudaFuncSetAttribute(cpasync_kernel<4>, cudaFuncAttributeMaxDynamicSharedMemorySize, 4 * 2 * KEYS * KS * 2));
  CK(cudaFuncSetAttribute(bulk_kernel<3, true>, cudaFuncAttributeMaxDynamicSharedMemorySize, 3 * 2 * KEYS * KS * 2));
  CK(cudaFuncSetAttribute(bulk_kernel<3, false>, cudaFuncAttributeMaxDynamicSharedMemorySize, 3 * 2 * KEYS * D * 2));
  CK(cudaFuncSetAttribute(tma_kernel<3, 0>, cudaFuncAttributeMaxDynamicSharedMemorySize, 3 * 2 * KEYS * D * 2 + 1024));
  CK(cudaFuncSetAttribute(tma_kernel<3, 1>, cudaFuncAttributeMaxDynamicSharedMemorySize, 3 * 2 * KEYS * D * 2 + 1024));
  CK(cudaFuncSetAttribute(tma_kernel<3, 2>, cudaFuncAttributeMaxDynamicSharedMemorySize, 3 * 2 * KEYS * D * 2 + 1024));
  for (const Shape& s : shapes) {
    const double bytes = 2.0 * s.batch * s.heads * s.len * D * 2;
    printf("shape b%d h%d len%d splits%d (%.1f MB):", s.batch, s.heads, s.len, s.splits, bytes / 1e6);
    for (const Method& m : methods) {
      const dim3 grid(s.splits, s.heads, s.batch);
      const float med = timer.median_ms([&] { m.launch(grid, m.threads, m.smem, k, v, s, sink); });
      CK(cudaGetLastError());
      printf("  %s %.1f us %.2f TB/s |", m.name, med * 1e3, bytes / med / 1e9);
    }
    struct TmaMethod { const char* name; int mode; bool promote; };
    for (const TmaMethod& tm : {TmaMethod{"tma64sw", 0, true}, TmaMethod{"tma64sw-nopromo", 0, false},
                                TmaMethod{"tma128", 1, true}, TmaMethod{"tma3d", 2, true}}) {
      CUtensorMap mk, mv;
      if (!make_map(&mk, k, s, tm.mode, tm.promote) || !make_map(&mv, v, s, tm.mode, tm.promote)) continue;
      const dim3 grid(s.splits, s.heads, s.batch);
      const int smem = 3 * 2 * KEYS * D * 2 + 1024;
      const float med = timer.median_ms([&] {
        if (tm.mode == 0) tma_kernel<3, 0><<<grid, 128, smem>>>(mk, mv, s, sink);
        else if (tm.mode == 1) tma_kernel<3, 1><<<grid, 128, smem>>>(mk, mv, s, sink);
        else tma_kernel<3, 2><<<grid, 128, smem>>>(mk, mv, s, sink);
      });
      CK(cudaGetLastError());
      printf("  %s %.1f us %.2f TB/s |", tm.name, med * 1e3, bytes / med / 1e9);
    }
    printf("\n");
  }
  return 0;
}
