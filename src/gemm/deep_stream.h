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
template <typename T, int NT, int MH, int U, typename XFix>
__device__ __forceinline__ void deep_stream(const T* const (&wlo)[NT], const T* const (&whi)[NT],
                                            const T* const (&xr)[MH], int kb, int ke, int tq, uint64_t policy,
                                            const gpu::Vec<T, 8>& zero, float (&acc)[NT][MH][4], XFix&& x_fix) {
#if LLMK_HAS_MMA_SYNC
  using V8 = gpu::Vec<T, 8>;
  const auto trip = [&](int base, auto full_tag) {
    constexpr bool FULL = decltype(full_tag)::value;
    V8 wl[NT][U], wh[NT][U];
#pragma unroll
    for (int j = 0; j < U; ++j) {
      const int kk = base + j * 32 + tq * 8;
      const bool ok = FULL || kk < ke;
#pragma unroll
      for (int t = 0; t < NT; ++t) {
        wl[t][j] = ok ? gpu::load_once(reinterpret_cast<const V8*>(wlo[t] + kk), policy) : zero;
        wh[t][j] = ok ? gpu::load_once(reinterpret_cast<const V8*>(whi[t] + kk), policy) : zero;
      }
    }
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
        const uint32_t* lo = reinterpret_cast<const uint32_t*>(&wl[t][j]);
        const uint32_t* hi = reinterpret_cast<const uint32_t*>(&wh[t][j]);
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
  };
  int base = kb;
  for (; base + 32 * U <= ke; base += 32 * U) trip(base, std::true_type{});
  if (base < ke) trip(base, std::false_type{});
#else
  (void)wlo, (void)whi, (void)xr, (void)kb, (void)ke, (void)tq, (void)policy, (void)zero, (void)acc, (void)x_fix;
#endif
}
#endif

}  // namespace llmk::detail
