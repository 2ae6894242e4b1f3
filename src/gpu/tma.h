// Hopper (sm_90a) asynchronous copy and synchronisation building blocks for warp-specialised
// kernels (part of the portability layer; included only by GPU code): mbarriers (init, arrive,
// arrive with an expected transaction count, parity wait, remote arrive), TMA tile loads
// (cp.async.bulk.tensor, completing on an mbarrier), cluster barriers and distributed shared
// memory (bulk copies completing on a remote mbarrier), TMA stores, stmatrix, register reallocation between warpgroups
// (setmaxnreg) and named barriers. Like gpu/wgmma.h, everything emits instructions only where
// LLMK_HAS_WGMMA is set (device code for sm_90a) and compiles to nothing elsewhere (HIP, sm_80,
// host code); kernels built on them must only be launched where their body was built.
//
// mbarrier phases: a barrier starts in phase 0; a phase completes when its pending arrival count
// reaches zero and its transaction count (bytes announced by expect_tx, paid off by the TMA
// unit's complete_tx) is zero. wait_parity(bar, P) returns once the phase with parity P has
// completed; called with the parity of the phase before the current one it returns at once (the
// "producer starts at parity 1" convention for empty-slot barriers).
//
// TMA with CU_TENSOR_MAP_SWIZZLE_128B and a box whose inner extent is 64 16-bit elements (128
// bytes) writes box row r's 16-byte chunk j at slot j ^ (r % 8) of the 128-byte row r of the
// destination (1024-byte aligned): exactly one column block of the layout gpu/wgmma.h describes.
#pragma once

#include <cstdint>

#include "gpu/wgmma.h"

#if LLMK_MMA_SYNC_BUILD

namespace llmk::gpu::tma {

__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
#if LLMK_HAS_WGMMA
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
#else
  (void)bar;
  (void)count;
#endif
}

// Makes barrier initialisations visible to the async proxy (TMA) and the other threads (with a
// __syncthreads after it).
__device__ __forceinline__ void fence_mbar_init() {
#if LLMK_HAS_WGMMA
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
#if LLMK_HAS_WGMMA
  asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.shared::cta.b64 st, [%0];\n}\n" ::"r"(bar) : "memory");
#else
  (void)bar;
#endif
}

// One arrival that also announces `bytes` of TMA traffic for the current phase.
__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
#if LLMK_HAS_WGMMA
  asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.expect_tx.shared::cta.b64 st, [%0], %1;\n}\n" ::"r"(bar), "r"(bytes)
               : "memory");
#else
  (void)bar;
  (void)bytes;
#endif
}

// One attempt (try_wait suspends the thread for a system-dependent time before failing): whether
// the phase of parity `parity` has completed.
// CLUSTER: with acquire semantics at cluster scope (for data or releases from other blocks of the
// cluster: bulk_copy_to_cluster, mbar_arrive_remote_relaxed); otherwise the default (acquire, CTA scope).
template <bool CLUSTER = false>
__device__ __forceinline__ bool mbar_try_wait(uint32_t bar, uint32_t parity) {
#if LLMK_HAS_WGMMA
  uint32_t done = 0;
  if constexpr (CLUSTER)
    asm volatile(
        "{\n.reg .pred p;\n"
        "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  else
    asm volatile(
        "{\n.reg .pred p;\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  return done != 0;
#else
  (void)bar;
  (void)parity;
  return true;
#endif
}

// Set (device-wide, for this translation unit's kernels) once a wait below has timed out; from
// then on waits that have not succeeded within 1 ms give up (a deadlocked grid finishes in ~10 s
// instead of 10 s per wait). Read and cleared by the host (hopper_ws_timed_out, tests). Covers
// mbarrier waits only: a named-barrier imbalance or a setmaxnreg.inc starved of registers still
// hangs.
static __device__ unsigned int g_mbar_timed_out = 0;

// Host: whether a device flag (an unsigned int __device__ variable of the calling translation
// unit) is set, clearing it; false where it cannot be read.
template <typename Symbol>
inline bool take_device_flag(const Symbol& flag_symbol) {
  unsigned int flag = 0;
  if (cudaMemcpyFromSymbol(&flag, flag_symbol, sizeof(flag)) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  const unsigned int zero = 0;
  if (flag != 0 && cudaMemcpyToSymbol(flag_symbol, &zero, sizeof(zero)) != cudaSuccess) (void)cudaGetLastError();
  return flag != 0;
}

// Host: whether a wait of this translation unit's kernels timed out since the last call (reading
// clears the flag); false where the flag cannot be read.
static inline bool take_mbar_timed_out() { return take_device_flag(g_mbar_timed_out); }

// Waits until the phase of parity `parity` has completed, or gives up after kTimeoutNs (10 s,
// far beyond any legitimate wait inside one kernel: a protocol bug, i.e. a deadlock) so that a
// broken pipeline finishes with wrong results (which the tests catch) instead of hanging the
// process. (Not __trap(): a trap on this path makes ptxas spill the consumers' accumulators.)
// The clock is read only once the first attempt has failed, the flag (an uncached system-scope
// load) only once a wait has lasted 1 ms, far off the path of a working pipeline.
template <bool CLUSTER = false>
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
#if LLMK_HAS_WGMMA
  constexpr uint64_t kTimeoutNs = 10'000'000'000ull, kFlagCheckNs = 1'000'000ull;
  if (mbar_try_wait<CLUSTER>(bar, parity)) return;
  const uint64_t t0 = global_timer_ns();
  bool checked = false;
  while (!mbar_try_wait<CLUSTER>(bar, parity)) {
    const uint64_t waited = global_timer_ns() - t0;
    if (!checked && waited > kFlagCheckNs) {
      checked = true;
      if (*static_cast<volatile unsigned int*>(&g_mbar_timed_out) != 0) return;
    }
    if (waited > kTimeoutNs) {
      *static_cast<volatile unsigned int*>(&g_mbar_timed_out) = 1;
      return;
    }
  }
#else
  (void)bar;
  (void)parity;
#endif
}

// Prefetches a tensor map (a __grid_constant__ kernel parameter) into the descriptor cache.
__device__ __forceinline__ void prefetch_map(const void* map) {
#if LLMK_HAS_WGMMA
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
#else
  (void)map;
#endif
}

// TMA: the box at coordinates (c0 innermost, c1, c2, c3) of a 4-D tensor map into shared memory
// at `dst`, completing `bar`'s transactions (the box's full size, out-of-bounds parts zero-filled).
__device__ __forceinline__ void load_4d(uint32_t dst, const void* map, uint32_t bar, int c0, int c1, int c2, int c3) {
#if LLMK_HAS_WGMMA
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5, %6}], "
      "[%2];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
      : "memory");
#else
  (void)dst;
  (void)map;
  (void)bar;
  (void)c0;
  (void)c1;
  (void)c2;
  (void)c3;
#endif
}

// load_4d with an L2 cache policy (`policy` from gpu::l2_evict_first_policy(): lines read once
// then leave L2 before other kernels' lines, as gpu::load_once's weight loads do).
__device__ __forceinline__ void load_4d_hint(uint32_t dst, const void* map, uint32_t bar, int c0, int c1, int c2,
                                             int c3, uint64_t policy) {
#if LLMK_HAS_WGMMA
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.L2::cache_hint [%0], "
      "[%1, {%3, %4, %5, %6}], [%2], %7;\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "l"(policy)
      : "memory");
#else
  load_4d(dst, map, bar, c0, c1, c2, c3);
  (void)policy;
#endif
}

// TMA store: the box at coordinates (c0 innermost, c1, c2) of a 3-D tensor map from shared
// memory at `src` (the box's dense layout; written by the generic proxy before: fence_proxy_async
// by the writers, then a barrier), in this thread's bulk group. Out-of-bounds parts are not written.
__device__ __forceinline__ void store_3d(const void* map, uint32_t src, int c0, int c1, int c2) {
#if LLMK_HAS_WGMMA
  asm volatile("cp.async.bulk.tensor.3d.global.shared::cta.bulk_group [%0, {%2, %3, %4}], [%1];\n" ::"l"(
                   reinterpret_cast<uint64_t>(map)),
               "r"(src), "r"(c0), "r"(c1), "r"(c2)
               : "memory");
#else
  (void)map;
  (void)src;
  (void)c0;
  (void)c1;
  (void)c2;
#endif
}
// The same for a 4-D tensor map (coordinates c0 innermost .. c3).
__device__ __forceinline__ void store_4d(const void* map, uint32_t src, int c0, int c1, int c2, int c3) {
#if LLMK_HAS_WGMMA
  asm volatile("cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [%0, {%2, %3, %4, %5}], [%1];\n" ::"l"(
                   reinterpret_cast<uint64_t>(map)),
               "r"(src), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
               : "memory");
#else
  (void)map;
  (void)src;
  (void)c0;
  (void)c1;
  (void)c2;
  (void)c3;
#endif
}
__device__ __forceinline__ void bulk_commit() {
#if LLMK_HAS_WGMMA
  asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
#endif
}
// Waits until at most N of this thread's bulk groups are still reading shared memory (READ) or,
// otherwise, still in flight at all.
template <int N, bool READ>
__device__ __forceinline__ void bulk_wait() {
#if LLMK_HAS_WGMMA
  if constexpr (READ)
    asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory");
  else
    asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(N) : "memory");
#endif
}

// The two halves of cluster_sync, for work in between: arrive (release: this thread's earlier
// shared-memory reads and writes, local and remote, are ordered before it) and wait (acquire:
// returns once every thread of every block of the cluster has arrived in this phase). Each thread
// alternates them, starting with arrive.
__device__ __forceinline__ void cluster_arrive() {
#if LLMK_HAS_WGMMA
  asm volatile("barrier.cluster.arrive.release.aligned;\n" ::: "memory");
#endif
}
// arrive without ordering memory (for threads with no writes the other blocks must see; it does not
// wait for this thread's outstanding global stores, as the release form does)
__device__ __forceinline__ void cluster_arrive_relaxed() {
#if LLMK_HAS_WGMMA
  asm volatile("barrier.cluster.arrive.relaxed.aligned;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void cluster_wait() {
#if LLMK_HAS_WGMMA
  asm volatile("barrier.cluster.wait.acquire.aligned;\n" ::: "memory");
#endif
}

// Thread block clusters: every thread of every block of the cluster arrives (release) and waits
// (acquire), so shared-memory writes made before it are visible to the cluster's blocks after it.
__device__ __forceinline__ void cluster_sync() {
  cluster_arrive();
  cluster_wait();
}

// The address of the same shared-memory object in block `rank` of this cluster (distributed
// shared memory; ordinary loads and stores through the returned pointer reach it).
template <typename T>
__device__ __forceinline__ T* cluster_map(T* p, int rank) {
#if LLMK_HAS_WGMMA
  uint64_t out = 0;
  asm volatile("mapa.u64 %0, %1, %2;\n" : "=l"(out) : "l"(reinterpret_cast<uint64_t>(p)), "r"(rank));
  return reinterpret_cast<T*>(out);
#else
  (void)rank;
  return p;
#endif
}

// The shared::cluster address of shared::cta address `addr` in block `rank` of this cluster (for
// bulk_copy_to_cluster and mbar_arrive_remote_relaxed).
__device__ __forceinline__ uint32_t cluster_map_u32(uint32_t addr, int rank) {
#if LLMK_HAS_WGMMA
  uint32_t out = 0;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(out) : "r"(addr), "r"(rank));
  return out;
#else
  (void)rank;
  return addr;
#endif
}

// `bytes` (a multiple of 16) from this block's shared memory at `src` to shared::cluster address
// `dst` (usually another block's), by the bulk copy engine, paying them off the transaction count of
// the mbarrier at shared::cluster address `bar` in the destination's block. The source was written
// by the generic proxy: fence_proxy_async by its writers first; it may be rewritten only once that
// barrier's phase has completed.
__device__ __forceinline__ void bulk_copy_to_cluster(uint32_t dst, uint32_t src, uint32_t bytes, uint32_t bar) {
#if LLMK_HAS_WGMMA
  asm volatile("cp.async.bulk.shared::cluster.shared::cta.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(dst),
               "r"(src), "r"(bytes), "r"(bar)
               : "memory");
#else
  (void)dst;
  (void)src;
  (void)bytes;
  (void)bar;
#endif
}

// One arrival on the mbarrier at shared::cluster address `bar` (any block of the cluster), relaxed:
// for a thread whose earlier reads the waiters depend on have provably completed (their values
// already used), without the fence (hundreds of cycles) that a release arrive costs.
__device__ __forceinline__ void mbar_arrive_remote_relaxed(uint32_t bar) {
#if LLMK_HAS_WGMMA
  asm volatile("mbarrier.arrive.relaxed.cluster.shared::cluster.b64 _, [%0];\n" ::"r"(bar) : "memory");
#else
  (void)bar;
#endif
}

// Four 8x8 b16 matrices to shared memory, the mirror of mma::ldmatrix_x4: lanes 8i..8i+7 give the
// row addresses (16 bytes each) of matrix i; r[i] is this lane's (lane / 4, 2 * (lane % 4) ..+1)
// pair of matrix i, i.e. the layout of an mma accumulator tile packed to 16 bits.
__device__ __forceinline__ void stmatrix_x4(void* smem, const uint32_t (&r)[4]) {
#if LLMK_HAS_WGMMA
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(mma::smem_u32(smem)),
               "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3])
               : "memory");
#else
  (void)smem;
  (void)r;
#endif
}

// Register reallocation (all threads of a warpgroup, uniformly): lowers / raises this warp-
// group's per-thread register budget to N (a multiple of 8 in [24, 256]).
template <int N>
__device__ __forceinline__ void regs_dealloc() {
#if LLMK_HAS_WGMMA
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
#endif
}
template <int N>
__device__ __forceinline__ void regs_alloc() {
#if LLMK_HAS_WGMMA
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
#endif
}

// Named barrier `id` (1..15; 0 is __syncthreads) over `threads` threads (a multiple of 32).
__device__ __forceinline__ void named_sync(int id, int threads) {
#if LLMK_HAS_WGMMA
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
#else
  (void)id;
  (void)threads;
#endif
}
__device__ __forceinline__ void named_arrive(int id, int threads) {
#if LLMK_HAS_WGMMA
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
#else
  (void)id;
  (void)threads;
#endif
}

}  // namespace llmk::gpu::tma

#endif  // LLMK_MMA_SYNC_BUILD
