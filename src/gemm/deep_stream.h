// The streaming loop of the skinny GEMM's deep kernel (gemm_gpu.cu), in a header of its own so
// that other skinny products (a Monarch factor's blocks at few tokens) can stream alike: one warp multiplies 16 W rows by up to 16 x rows over its K
// slice [kb, ke) on mma.sync m16n8k16 (NVIDIA sm_80+; fp32 accumulate), W as the A operand.
//
// Lane (g, tq) holds rows g and g + 8 of the warp's 16 (wlo[t], whi[t]: their starts; NT = 2 for a
// gate and an up matrix) and x rows 8 h + g (xr[h], h < MH). Per trip it issues U x 2 x NT
// independent 16-byte W loads (gpu::load_once: L1 skipped, L2 evict-first, 256-byte prefetch), 8
// consecutive K elements at kk = base + 32 j + 8 tq of each row, before the first mma.sync
// consumes one; x comes 16 bytes at a time through L1. The MMA's K order is permuted alike for A
// and B (8 elements a lane, two m16n8k16 per 32 of K), so no shuffles. Full trips have no bounds
// checks; the last, partial trip of a slice zero-fills past ke, so ke - kb must be a multiple of 8.
// zero: 8 zeros in T. x_fix(xv, kk, ok) may rewrite the x vectors (the RMSNorm prologue) before they are used.
// acc[t][h][r]: W row g + 8 (r >> 1), x row 8 h + 2 tq + (r & 1) (the C fragment).
#pragma once

#include <cstdint>
#include <initializer_list>
#include <type_traits>

#include "gpu/compat.h"
#include "gpu/mma.h"

namespace llmk::detail {

// The K split for blocks of 8 warps on this loop: sk warps per 16-row group of `groups`, each warp
// having `trips` full trips if it read all of K alone, `slots` blocks resident at once. The largest
// sk of 8, 4, 2 whose blocks fit one wave with a full trip per warp: every warp starts at once with
// the same bytes to read, no tail of short blocks. Where not even sk = 2 fits one wave (large N),
// sk = 8 over several waves if `trips` is 8 or more, i.e. a full trip per warp at that split (64,
// i.e. 8 per warp, with 16 x rows, whose epilogue costs more); else 1. Measured against sk = 1 on
// the H200 (2026-12-02, scripts/gemm_sweep.py --deep-splits, bf16, us): K x N = 8192 x 28672 at M = 1 / 16: 123.2 / 128.0
// against 129.0 / 130.4 (01:54 UTC), 124.8 / 128.3 against 130.0 / 131.5 (02:00); 4096 x 28672:
// 67.1 against 69.9 at M = 1, but 72.0 against 70.5 at M = 16 (4 trips a warp: hence the rule);
// 4096 x 128256 at M = 1: 262.4 against 275.5. sk = 2 and 4 (1.1 and 2.3 waves) were slower at
// 8192 x 28672.
inline int deep_split(int64_t groups, int64_t trips, int64_t slots, bool sixteen_rows) {
  for (int sk : {8, 4, 2})
    if (trips >= sk && (groups * sk + 7) / 8 <= slots) return sk;
  return trips >= 8 && (!sixteen_rows || trips >= 64) ? 8 : 1;
}

#if LLMK_MMA_SYNC_BUILD
// One trip's W fragments in registers: U 16-byte vectors of each of a lane's two rows per matrix.
template <typename T, int NT, int U>
struct DeepTrip {
  gpu::Vec<T, 8> wl[NT][U], wh[NT][U];
};

// Issues one trip's W loads (at base; FULL: no bounds checks, else zeros past ke). A kernel may
// issue a fixed weight's first trip (no kernel still running writes it: GemmOptions::fixed_weight)
// before gpu::pdl_wait, so that those bytes are in flight while it waits, and hand them to
// deep_stream_from.
template <typename T, int NT, int U, bool FULL>
__device__ __forceinline__ DeepTrip<T, NT, U> deep_load_trip(const T* const (&wlo)[NT], const T* const (&whi)[NT],
                                                             int base, int ke, int tq, uint64_t policy,
                                                             const gpu::Vec<T, 8>& zero) {
  using V8 = gpu::Vec<T, 8>;
  DeepTrip<T, NT, U> w;
#pragma unroll
  for (int j = 0; j < U; ++j) {
    const int kk = base + j * 32 + tq * 8;
    const bool ok = FULL || kk < ke;
#pragma unroll
    for (int t = 0; t < NT; ++t) {
      w.wl[t][j] = ok ? gpu::load_once(reinterpret_cast<const V8*>(wlo[t] + kk), policy) : zero;
      w.wh[t][j] = ok ? gpu::load_once(reinterpret_cast<const V8*>(whi[t] + kk), policy) : zero;
    }
  }
  return w;
}

// The products of one loaded trip with the x rows (loaded here, 16 bytes a lane per row and step).
template <typename T, int NT, int MH, int U, bool FULL, typename XFix>
__device__ __forceinline__ void deep_mma_trip(const DeepTrip<T, NT, U>& w, const T* const (&xr)[MH], int base, int ke,
                                              int tq, const gpu::Vec<T, 8>& zero, float (&acc)[NT][MH][4],
                                              XFix& x_fix) {
#if LLMK_HAS_MMA_SYNC
  using V8 = gpu::Vec<T, 8>;
#pragma unroll
  for (int j = 0; j < U; ++j) {
    const int kk = base + j * 32 + tq * 8;
    const bool ok = FULL || kk < ke;
    V8 xv[MH];
#pragma unroll
    for (int h = 0; h < MH; ++h) xv[h] = ok ? gpu::load_vec<T, 8>(xr[h] + kk) : zero;
    x_fix(xv, kk, ok);
#pragma unroll
    for (int t = 0; t < NT; ++t) {
      const uint32_t* lo = reinterpret_cast<const uint32_t*>(&w.wl[t][j]);
      const uint32_t* hi = reinterpret_cast<const uint32_t*>(&w.wh[t][j]);
      const uint32_t A1[4] = {lo[0], hi[0], lo[1], hi[1]};
      const uint32_t A2[4] = {lo[2], hi[2], lo[3], hi[3]};
#pragma unroll
      for (int h = 0; h < MH; ++h) {
        const uint32_t* b = reinterpret_cast<const uint32_t*>(&xv[h]);
        const uint32_t B1[2] = {b[0], b[1]};
        const uint32_t B2[2] = {b[2], b[3]};
        gpu::mma_m16n8k16<T>(acc[t][h], A1, B1);
        gpu::mma_m16n8k16<T>(acc[t][h], A2, B2);
      }
    }
  }
#else
  (void)w, (void)xr, (void)base, (void)ke, (void)tq, (void)zero, (void)acc, (void)x_fix;
#endif
}

// Whether the trip at base is a full one (no bounds checks).
template <int U>
__device__ __forceinline__ bool deep_trip_full(int base, int ke) {
  return base + 32 * U <= ke;
}

// Issues the trip at base, full or partial as deep_trip_full says.
template <typename T, int NT, int U>
__device__ __forceinline__ DeepTrip<T, NT, U> deep_load_any_trip(const T* const (&wlo)[NT], const T* const (&whi)[NT],
                                                                 int base, int ke, int tq, uint64_t policy,
                                                                 const gpu::Vec<T, 8>& zero) {
  return deep_trip_full<U>(base, ke) ? deep_load_trip<T, NT, U, true>(wlo, whi, base, ke, tq, policy, zero)
                                     : deep_load_trip<T, NT, U, false>(wlo, whi, base, ke, tq, policy, zero);
}

// The whole loop over [kb, ke): each trip's W loads, then its products.
template <typename T, int NT, int MH, int U, typename XFix>
__device__ __forceinline__ void deep_stream(const T* const (&wlo)[NT], const T* const (&whi)[NT],
                                            const T* const (&xr)[MH], int kb, int ke, int tq, uint64_t policy,
                                            const gpu::Vec<T, 8>& zero, float (&acc)[NT][MH][4], XFix&& x_fix) {
  int base = kb;
  for (; deep_trip_full<U>(base, ke); base += 32 * U)
    deep_mma_trip<T, NT, MH, U, true>(deep_load_trip<T, NT, U, true>(wlo, whi, base, ke, tq, policy, zero), xr, base,
                                      ke, tq, zero, acc, x_fix);
  if (base < ke)
    deep_mma_trip<T, NT, MH, U, false>(deep_load_trip<T, NT, U, false>(wlo, whi, base, ke, tq, policy, zero), xr,
                                       base, ke, tq, zero, acc, x_fix);
}

// The same loop with its first trip already loaded into w (deep_load_any_trip at kb; kb < ke):
// that trip's products, then deep_stream over the rest.
template <typename T, int NT, int MH, int U, typename XFix>
__device__ __forceinline__ void deep_stream_from(const DeepTrip<T, NT, U>& w, const T* const (&wlo)[NT],
                                                 const T* const (&whi)[NT], const T* const (&xr)[MH], int kb, int ke,
                                                 int tq, uint64_t policy, const gpu::Vec<T, 8>& zero,
                                                 float (&acc)[NT][MH][4], XFix&& x_fix) {
  if (!deep_trip_full<U>(kb, ke)) {  // a single, partial trip
    deep_mma_trip<T, NT, MH, U, false>(w, xr, kb, ke, tq, zero, acc, x_fix);
    return;
  }
  deep_mma_trip<T, NT, MH, U, true>(w, xr, kb, ke, tq, zero, acc, x_fix);
  deep_stream<T, NT, MH, U>(wlo, whi, xr, kb + 32 * U, ke, tq, policy, zero, acc, x_fix);
}
#endif

}  // namespace llmk::detail
