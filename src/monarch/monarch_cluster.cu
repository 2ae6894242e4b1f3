// Monarch forward as ONE kernel on thread block clusters, weights resident on chip (sm_90a).
//
// out = monarch(x, w1, w2) (definition in include/llmk/monarch.h). A cluster of C CTAs (C in
// {1, 2, 4, 8}) splits both factors: CTA `rank` keeps stage-1 blocks [rank*k/C, (rank+1)*k/C) of
// w1 and stage-2 blocks [rank*l/C, (rank+1)*l/C) of w2 in shared memory for the whole kernel, so
// each weight is read from memory once per CTA, not once per token tile, and the intermediate y
// never leaves the chip. Clusters are persistent and stride over tiles of kTok = 32 tokens; per
// tile, every CTA:
//   1. multiplies the x columns of its stage-1 blocks (cp.async, prefetched while the previous
//      tile finished) by its w1 blocks on mma.sync, transposed (y^T = w1 x^T: a thread holds two
//      adjacent tokens of one y column), and stores the rounded y with stmatrix into a staging
//      tile in exchange order;
//   2. sends y on: y[b, j] (j = i*q + c) is element t = j / l of stage-2 block u = j % l, and the
//      CTA's j range [rank*k*q/C, ...) is elements [rank*r/C, (rank+1)*r/C) of EVERY block u (r a
//      multiple of C), so each (u, token) is one run of r/C contiguous t, written with 16-byte
//      stores into the distributed shared memory of u's owner;
//   3. after a cluster barrier holds z = y in stage-2 order for its own blocks u and all t, and
//      multiplies it by its w2 blocks (transposed again, z read with ldmatrix.trans);
//   4. writes out[b, v*l + u]: its l/C blocks u are contiguous for each (b, v), so the results,
//      staged in shared memory (2-byte stores, words rotated within each 16-byte run against bank
//      conflicts), leave as 16-byte stores.
// A second cluster barrier phase (arrive after step 3's reads of z, wait before the next tile's step 2)
// keeps a CTA from overwriting z that its owner is still reading. 16 warps per CTA take (block,
// 32-row group) items of each stage; the upper 8 warps send step 2, the lower 8 write step 4 (so
// the release that publishes z never waits on global stores); 1 CTA per SM.
//
// This is the "resident" kernel; from 2048 tokens the pipelined kernel below takes its 64 x 64
// shapes. Performance (H200, bf16, bench/results/h200-monarch.md): n = 4096, 64 blocks, 16384
// tokens 0.26-0.27 ms (the tiled two-kernel path 0.48, dense 0.71; the bytes floor 0.064):
// latency bound, not bandwidth bound. Nsight Compute: 16 warps on one CTA per SM issue once per ~12 cycles each
// (short-scoreboard, fixed-latency, barrier and cluster-fence stalls), ~1100 instructions per
// warp per tile; the phases of a tile run one after another, only the next tile's x load overlaps.
// What would help: several tiles in flight (warp-specialised producer / consumer stages), which
// needs the shared memory the resident weights now take.
//
// Shapes: the Shape<> instantiations listed at run_resident() (square blocks whose factors fit on
// one cluster); others, other GPUs and LLMK_MONARCH_CLUSTER=0 take the tiled kernels
// (monarch_gpu.cu). Also needs fp16/bf16, compute capability 9.0 with the sm_90a body built, and
// 16-byte aligned pointers and row strides.
#include <cstdint>
#include <cstdlib>
#include <cstring>

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

constexpr int kTok = 32;  // tokens per tile: the n dimension of every mma (4 n8 tiles)
constexpr int kThreads = 512;  // 16 warps: the phases are latency bound at 1 CTA per SM
constexpr int kRows = 32;       // rows (of q or s) per warp item: kRows / 16 m16 tiles

struct ClusterArgs {
  const void* x = nullptr;
  int64_t x_stride = 0;
  const void* w1 = nullptr;
  const void* w2 = nullptr;
  void* out = nullptr;
  int64_t out_stride = 0;
  int64_t tokens = 0;
};

// One instantiated shape: w1 (K, Q, P), w2 (L, S, R), clusters of C CTAs.
template <int K_, int Q_, int P_, int L_, int S_, int R_, int C_>
struct Shape {
  static constexpr int k = K_, q = Q_, p = P_, l = L_, s = S_, r = R_, C = C_;
  static constexpr int kb = k / C, lb = l / C, rc = r / C;  // per CTA: stage-1 blocks, stage-2 blocks, t run
  static_assert(k * q == l * r && k % C == 0 && l % C == 0 && r % C == 0, "block counts");
  static_assert(rc % 8 == 0 && lb % 8 == 0 && kb >= 1, "16-byte runs in the exchange and the output");
  static_assert((q < kRows ? q % 16 : q % kRows) == 0 && (s < kRows ? s % 16 : s % kRows) == 0,
                "items of kRows rows or one smaller");
  static_assert((p == 16 || p == 32 || p % 64 == 0) && (r == 16 || r == 32 || r % 64 == 0), "the swizzle");
};

// Shared-memory plan (elements): w1 blocks [k/C][q][p], w2 blocks [l/C][s][r], x [k/C][kTok][p],
// the staging tile (y in exchange order, then the output), z [l/C][r][kTok].
struct Layout {
  int w1 = 0, w2 = 0, x = 0, stage = 0, z = 0, total = 0;
};

__host__ __device__ constexpr Layout layout_of(int k, int q, int p, int l, int s, int r, int C) {
  Layout o;
  const int kb = k / C, lb = l / C;
  o.w2 = o.w1 + kb * q * p;
  o.x = o.w2 + lb * s * r;
  o.stage = o.x + kb * kTok * p;
  const int y_stage = kTok * (k * q / C), out_stage = kTok * s * lb;
  o.z = o.stage + (y_stage > out_stage ? y_stage : out_stage);
  o.total = o.z + lb * r * kTok;
  return o;
}

#if LLMK_HAS_WGMMA  // the device helpers exist where the kernel body does (sm_90a device code)
constexpr int kWarps = kThreads / 32;

// Offset (elements) of 16-byte chunk `ch` of row `row` in a tile of rows of `len` 16-bit elements
// (len 16, 32 or a multiple of 64): chunks XOR-swizzled so that the same chunk of 8 consecutive
// rows lies in 8 different bank groups (ldmatrix and stmatrix without conflicts).
__device__ __forceinline__ int swz(int row, int ch, int len) {
  const int cpr = len / 8;
  const int x = cpr >= 8 ? (row & 7) : cpr == 4 ? ((row >> 1) & 3) : ((row >> 2) & 1);
  return row * len + ((ch ^ x) << 3);
}

// Word i % 4 of w (selects, not an indexed array in local memory).
__device__ __forceinline__ uint32_t word_at(const uint4& w, int i) {
  i &= 3;
  return i == 0 ? w.x : i == 1 ? w.y : i == 2 ? w.z : w.w;
}

// A contiguous (rows x LEN) global tile into a swizzled shared tile, 16 bytes per cp.async.
template <int LEN, typename T>
__device__ __forceinline__ void load_rows(T* dst, const T* src, int rows, int tid) {
  constexpr int cpr = LEN / 8;
  for (int c = tid; c < rows * cpr; c += kThreads) {
    const int row = c / cpr, ch = c % cpr;
    gpu::mma::cp_async16(dst + swz(row, ch, LEN), src + static_cast<int64_t>(row) * LEN + ch * 8, 16);
  }
}

// acc[m][nt] = W[m0 + 16m .., :] * B[:, 8nt ..] for m < MT: W rows of K elements (swizzled, A
// operand by ldmatrix), B = kTok tokens: TRANS_B false: rows are tokens with K contiguous
// (swizzled rows of K); true: rows are K with the tokens contiguous (rows of kTok, ldmatrix.trans).
template <typename T, bool TRANS_B, int K, int MT>
__device__ __forceinline__ void block_product(float (&acc)[kRows / 16][4][4], const T* W, int m0, const T* B, int lane) {
#pragma unroll
  for (int m = 0; m < kRows / 16; ++m)
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[m][nt][e] = 0.f;
#pragma unroll
  for (int kk = 0; kk < K; kk += 16) {
    uint32_t bf[2][4];
#pragma unroll
    for (int np = 0; np < 2; ++np) {
      if (TRANS_B)
        gpu::mma::ldmatrix_x4_trans(bf[np], B + swz(kk + ((lane >> 3) & 1) * 8 + (lane & 7), np * 2 + (lane >> 4), kTok));
      else
        gpu::mma::ldmatrix_x4(bf[np], B + swz(np * 16 + (lane & 7) + ((lane >> 4) << 3), kk / 8 + ((lane >> 3) & 1), K));
    }
#pragma unroll
    for (int m = 0; m < MT; ++m) {
      uint32_t a[4];
      gpu::mma::ldmatrix_x4(a, W + swz(m0 + m * 16 + (lane & 15), kk / 8 + (lane >> 4), K));
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) {
        const uint32_t b[2] = {bf[nt / 2][(nt & 1) * 2], bf[nt / 2][(nt & 1) * 2 + 1]};
        gpu::mma_m16n8k16<T>(acc[m][nt], a, b);
      }
    }
  }
}

#endif  // LLMK_HAS_WGMMA

template <typename T, typename Sh>
__global__ void __launch_bounds__(kThreads, 1) monarch_cluster_kernel(const __grid_constant__ ClusterArgs args) {
#if LLMK_HAS_WGMMA
  // the tile count through static shared memory, which also marks the sm_90a body for the host
  // (gpu::tma::kernel_built)
  __shared__ int64_t tiles_s;
  if (threadIdx.x == 0) tiles_s = (args.tokens + kTok - 1) / kTok;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* sm = reinterpret_cast<T*>(smem_raw);
  constexpr int q = Sh::q, p = Sh::p, l = Sh::l, s = Sh::s, r = Sh::r, C = Sh::C;
  constexpr int kb = Sh::kb, lb = Sh::lb, rc = Sh::rc;
  constexpr Layout lay = layout_of(Sh::k, q, p, l, s, r, C);
  T* w1s = sm + lay.w1;
  T* w2s = sm + lay.w2;
  T* xs = sm + lay.x;
  T* stg = sm + lay.stage;
  T* z = sm + lay.z;
  const int rank = static_cast<int>(blockIdx.x) % C;
  const int64_t cluster = blockIdx.x / C, clusters = gridDim.x / C;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const T* x = static_cast<const T*>(args.x) + static_cast<int64_t>(rank) * kb * p;

  // x columns of this CTA's blocks for tile `t`: [block][token][p], token rows zero past the end
  auto load_x = [&](int64_t t) {
    const int64_t row0 = t * kTok;
    const int valid = static_cast<int>(args.tokens - row0 < kTok ? args.tokens - row0 : kTok);
    constexpr int cpr = p / 8;
#pragma unroll 4
    for (int c = tid; c < kTok * kb * cpr; c += kThreads) {
      const int ch = c % cpr, blk = (c / cpr) % kb, b = c / (cpr * kb);  // 16-byte runs along the row
      const bool ok = b < valid;
      const T* src = ok ? x + (row0 + b) * args.x_stride + blk * p + ch * 8 : x;
      gpu::mma::cp_async16(xs + blk * kTok * p + swz(b, ch, p), src, ok ? 16 : 0);
    }
  };

  load_rows<p>(w1s, static_cast<const T*>(args.w1) + static_cast<int64_t>(rank) * kb * q * p, kb * q, tid);
  load_rows<r>(w2s, static_cast<const T*>(args.w2) + static_cast<int64_t>(rank) * lb * s * r, lb * s, tid);
  __syncthreads();
  const int64_t tiles = tiles_s;
  if (cluster < tiles) load_x(cluster);
  gpu::mma::cp_async_commit();
  gpu::tma::cluster_arrive();  // phase "z free" for the first tile (and: every CTA has started)

  constexpr int q_groups = (q + kRows - 1) / kRows, s_groups = (s + kRows - 1) / kRows;
  constexpr int mt1 = q < kRows ? q / 16 : kRows / 16, mt2 = s < kRows ? s / 16 : kRows / 16;  // m16 tiles per item
  const int gq = lane >> 2, tq = lane & 3;
  float acc[kRows / 16][4][4];
  for (int64_t tile = cluster; tile < tiles; tile += clusters) {
    const int64_t row0 = tile * kTok;
    gpu::mma::cp_async_wait<0>();
    __syncthreads();  // x (and the first time the weights) landed; the last tile's staging read

    // 1. y^T = w1 x^T per (block, kRows rows of q), stored in exchange order: chunk (u, tl, token/8)
    //    at ((u * rc + tl) * 4 + token/8) ^ (u & 7), u = j % l, tl = j / l - rank*rc for this
    //    CTA's j = blk*q + c (j counted from its first block)
#pragma unroll 1
    for (int item = warp; item < kb * q_groups; item += kWarps) {
      const int blk = item / q_groups, m0 = (item % q_groups) * kRows;
      block_product<T, false, p, mt1>(acc, w1s + blk * q * p, m0, xs + blk * kTok * p, lane);
#pragma unroll
      for (int m = 0; m < mt1; ++m) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int j = blk * q + m0 + m * 16 + h * 8 + (lane & 7);  // this lane's row address
          const int u = j % l, tl = j / l;
          const int chunk = (((u * rc + tl) << 2) + (lane >> 3)) ^ (u & 7);
          uint32_t v[4];
#pragma unroll
          for (int nt = 0; nt < 4; ++nt) v[nt] = gpu::mma::pack2<T>(acc[m][nt][2 * h], acc[m][nt][2 * h + 1]);
          gpu::tma::stmatrix_x4(stg + chunk * 8, v);
        }
      }
    }
    __syncthreads();  // staging complete; x no longer read
    if (tile + clusters < tiles) load_x(tile + clusters);
    gpu::mma::cp_async_commit();

    // 2. exchange (the upper half of the warps; the lower half writes the output in step 4, so
    //    that the release below never waits for global stores): every owner's z is free once the
    //    previous tile's phase completes
    gpu::tma::cluster_wait();
    if (warp >= kWarps / 2) {
#pragma unroll
      for (int c = tid - kThreads / 2; c < l * rc * 4; c += kThreads / 2) {
        const int u = c / (rc * 4), logical = c ^ (u & 7);
        const int tl = (logical >> 2) % rc, b8 = logical & 3;
        const uint4 v = *reinterpret_cast<const uint4*>(stg + c * 8);
        const int owner = u / lb, t = rank * rc + tl;
        T* dst = gpu::tma::cluster_map(z, owner) + (u % lb) * r * kTok + swz(t, b8, kTok);
        *reinterpret_cast<uint4*>(dst) = v;
      }
      gpu::tma::cluster_arrive();  // release: the z writes above
    } else {
      gpu::tma::cluster_arrive_relaxed();
    }
    gpu::tma::cluster_wait();  // z complete in every CTA

    // 3. out^T = w2 z^T per (block u, kRows rows of s); staged as [token][v][u] runs of lb, each
    //    16-byte run's words rotated by (token / 2) % 4
#pragma unroll 1
    for (int item = warp; item < lb * s_groups; item += kWarps) {
      const int ub = item / s_groups, m0 = (item % s_groups) * kRows;
      block_product<T, true, r, mt2>(acc, w2s + ub * s * r, m0, z + ub * r * kTok, lane);
      const int word = (ub & 7) >> 1, half_sel = ub & 1;
#pragma unroll
      for (int m = 0; m < mt2; ++m) {
#pragma unroll
        for (int nt = 0; nt < 4; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int v = m0 + m * 16 + gq + 8 * (e >> 1), b = nt * 8 + 2 * tq + (e & 1);
            const int run = (b * s + v) * (lb / 8) + ub / 8;
            const int rot = (b >> 1) & 3;
            stg[run * 8 + ((word + rot) & 3) * 2 + half_sel] = gpu::from_float<T>(acc[m][nt][e]);
          }
      }
    }
    // this CTA's reads of z are done (their results were used above, so the reads have completed;
    // nothing written here needs ordering for the other blocks)
    gpu::tma::cluster_arrive_relaxed();
    __syncthreads();  // staging complete

    // 4. out[b, v*l + rank*lb ..] in 16-byte runs
    constexpr int runs_per_token = s * (lb / 8);
    T* out = static_cast<T*>(args.out) + rank * lb;
#pragma unroll
    for (int c = warp < kWarps / 2 ? tid : kTok * runs_per_token; c < kTok * runs_per_token; c += kThreads / 2) {
      const int b = c / runs_per_token;
      if (row0 + b >= args.tokens) break;  // c grows with b: the rest of this thread's runs are past the end
      const int v = (c % runs_per_token) / (lb / 8), part = c % (lb / 8);
      const uint4 w = *reinterpret_cast<const uint4*>(stg + c * 8);
      const int rot = (b >> 1) & 3;
      const uint4 o = {word_at(w, rot), word_at(w, rot + 1), word_at(w, rot + 2), word_at(w, rot + 3)};
      *reinterpret_cast<uint4*>(out + (row0 + b) * args.out_stride + v * l + part * 8) = o;
    }
  }
  gpu::mma::cp_async_wait<0>();
  gpu::tma::cluster_wait();  // pairs the last arrive; no CTA leaves while its z may be written
#else
  (void)args;
#endif
}

// ---------------------------------------------------------------------------------------------
// The pipelined kernel: factors in registers, warp-specialised stages (blocks of 64 x 64, 8 blocks
// of each factor per CTA: n = 512 C with k = l = 8 C blocks; instantiated for C = 8 and 4).
//
// Same split as above (CTA `rank` owns stage-1 blocks i and stage-2 blocks u in [8 rank, 8 rank +
// 8)), but each of the 16 warps holds ONE 64 x 64 block of its factor as mma A fragments in 64
// registers for the whole kernel, so no weight is re-read per tile, and the two stages run
// concurrently on different tiles of 16 tokens:
//   producer warps 0-7 (block i = 8 rank + warp): x[:, 64 i ..] of the tile (their own cp.async
//     ring, 2 tiles ahead) -> y^T = w1[i] x^T (mma.sync) -> y staged with stmatrix in z's layout
//     ([t][8 blocks][16 tokens]), one part per owner of the blocks u = j % l of its columns j ->
//     each other owner's part (256 contiguous bytes at C = 8) by one bulk copy into the owner's z,
//     completing on the owner's "full" mbarrier for that buffer; its own part by plain copies and
//     an arrival;
//   consumer warps 8-15 (block u = 8 rank + warp - 8): wait "full" (the tile's 16 KiB of z from
//     every CTA), load their block's z^T fragments (ldmatrix.trans), release the buffer to every
//     CTA's producers (remote arrive on their "empty" mbarrier) once the first product has used
//     the fragments, out^T = w2[u] z^T. The output leaves in 32-byte runs: CTAs 2c and 2c + 1 (a
//     pair) own the 16 consecutive blocks u of every output row's 32 bytes at 16 c, so CTA
//     h = rank & 1 of the pair writes the tile's tokens 8h .. 8h + 7 for both: it stages its own
//     8 blocks of those tokens in place ([8 tokens][v][16 blocks]) and its other 8 tokens
//     ([8 tokens][v][8 blocks]) for the pair, sends those by one bulk copy into the pair's receive
//     buffer, and goes on to the next tile; after staging that one it copies what the pair sent
//     for this tile into the other half of its staged rows and writes the box (16, 64, 8) of
//     out[b, v*l + 16 c ..] with one TMA store (so the exchange's round trip overlaps a tile's
//     work; 3 output staging buffers).
// z has 3 buffers per CTA; "full" needs the consumers' re-arm (with the remote byte count), the 8
// own producer warps and the bytes; "empty" needs the 8 C consumer warps of the cluster (and also
// frees the producers' staging of that buffer, which the bulk copies have read by then). The
// output exchange has 2 buffers: "recv_full" (this CTA's arrive.expect_tx and the pair's bytes),
// "send_free" (the pair's arrival once it has copied out what this CTA sent: the send buffer and
// the pair's receive buffer may both be reused).
// The output staging is 32B-swizzled like the TMA store reads it (swz32): the kept half's 2-byte
// stores then meet 8 banks for a warp's 8 v instead of 4.
// 512 threads, 1 CTA per SM, 128 registers, 224 KiB of shared memory (+1 KiB to align it to 1024).
//
// Performance (H200, bf16, n = 4096, 64 blocks, dense 0.74-0.81 ms, the bytes floor 0.064): 0.160
// ms at 16384 tokens with the swizzled staging (0.188 without, same run, 2026-12-02 10:23), 0.179
// with the pair exchange alone, 0.232 when each CTA wrote its own 8 blocks (16-byte runs 128 bytes
// apart). The same kernel storing into a scratch layout where its box is contiguous took
// 0.148 ms, and storing 32-byte runs (wrong values, no exchange) 0.151: 16-byte runs are what cost,
// 32 are enough (2026-12-02, scripts/monarch_sweep.py). An exchange through distributed shared
// memory of single elements, so that each CTA wrote whole rows, was slower still (0.29 ms).
// Finishing each tile's output one tile later (the exchange overlapped), with 3-deep x and z rings
// (were 2 and 4): 0.146 against 0.157 ms in the same run (2026-12-03, ring sizes alone: 0.153-0.166).
// Nsight Compute then: ~0.5 eligible warps per scheduler, stalls spread over waits on the "full"
// and "empty" barriers (each side waiting for the other CTAs), short-scoreboard (shared memory:
// the output staging's 2-byte stores meet ~5-way bank conflicts) and fixed-latency dependencies.
namespace pipe {

constexpr int kTok = 16;      // tokens per tile: the n dimension (2 n8 tiles)
constexpr int kBlk = 64;      // block size: p = q = r = s
constexpr int kBlocks = 8;    // blocks of each factor per CTA: one per producer and consumer warp
constexpr int kThreads = 2 * kBlocks * 32;
constexpr int kSliceElems = kTok * kBlk;            // one warp's x slice, y staging or z block (2 KiB)
constexpr int kZElems = kBlocks * kBlk * kTok;      // one z buffer (16 KiB)
constexpr int kOutElems = kTok * kBlk * kBlocks;    // one output staging tile (16 KiB)
constexpr int kHalfElems = kOutElems / 2;           // half a tile's output (8 tokens), sent to the pair CTA
// dynamic shared memory (elements): x rings [warp][stage], y staging [warp][z buffer], z [buffer],
// output staging [3] ([8 tokens][64 v][16 blocks]), send [2] and receive [2] ([8 tokens][64 v][8
// blocks]): 224 KiB
constexpr int kXStages = 3;   // x tiles in each producer warp's cp.async ring
constexpr int kZBufs = 3;     // z buffers per CTA (and producer staging slots)
constexpr int kOutBufs = 3;   // output staging: a tile is finished while the next one is staged
constexpr int kXOff = 0;
constexpr int kYOff = kXOff + kBlocks * kXStages * kSliceElems;
constexpr int kZOff = kYOff + kBlocks * kZBufs * kSliceElems;
constexpr int kOutOff = kZOff + kZBufs * kZElems;
constexpr int kSendOff = kOutOff + kOutBufs * kOutElems;
constexpr int kRecvOff = kSendOff + 2 * kHalfElems;
constexpr int kSmemElems = kRecvOff + 2 * kHalfElems;

#if LLMK_HAS_WGMMA
// The 32-byte TMA swizzle of a 16-bit element offset from a 1024-byte aligned base: the 16-byte
// half of each 32-byte row flips every 4 rows (byte address bit 4 ^= bit 7), so that the 8 v of a
// warp's staging store meet 8 banks instead of 4.
__device__ constexpr int swz32(int elem) { return elem ^ (((elem >> 6) & 1) << 3); }

// Element offset of (block ub, tokens 8 half ..) within row t of a z buffer ([t][8 blocks][16
// tokens], 256-byte rows): the block's 32-byte slot XOR t % 8, its 16-byte half XOR (t / 4) % 2,
// so that ldmatrix.trans over 8 consecutive rows of one block meets no bank conflict.
__device__ __forceinline__ int z_in_row(int t, int ub, int half) {
  return ((ub ^ (t & 7)) * kTok) + ((half ^ ((t >> 2) & 1)) * 8);
}

// This lane's mma A fragments of a 64 x 64 block (rows = M, 64 K elements each) from global memory:
// frag[mi][ki] is the m16k16 tile (16 mi .., 16 ki ..).
template <typename T>
__device__ __forceinline__ void load_block_fragments(uint32_t (&frag)[4][4][4], const T* block, int lane) {
  const uint32_t* w = reinterpret_cast<const uint32_t*>(block);  // 32 words per row
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int mi = 0; mi < 4; ++mi)
#pragma unroll
    for (int ki = 0; ki < 4; ++ki) {
      const int at = (mi * 16 + g) * 32 + ki * 8 + t;
      frag[mi][ki][0] = w[at];
      frag[mi][ki][1] = w[at + 8 * 32];
      frag[mi][ki][2] = w[at + 4];
      frag[mi][ki][3] = w[at + 8 * 32 + 4];
    }
}

// acc (2 n8 tiles) = rows 16 mi .. of the block (A fragments) times the tile's B fragments
// (bf[ki] = {n-tile 0 k-lo, n-tile 0 k-hi, n-tile 1 k-lo, n-tile 1 k-hi}).
template <typename T>
__device__ __forceinline__ void rows_product(float (&acc)[2][4], const uint32_t (&a)[4][4], const uint32_t (&bf)[4][4]) {
#pragma unroll
  for (int nt = 0; nt < 2; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[nt][e] = 0.f;
#pragma unroll
  for (int ki = 0; ki < 4; ++ki)
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      const uint32_t b[2] = {bf[ki][2 * nt], bf[ki][2 * nt + 1]};
      gpu::mma_m16n8k16<T>(acc[nt], a[ki], b);
    }
}
#endif  // LLMK_HAS_WGMMA

template <typename T, int C>
__global__ void __launch_bounds__(kThreads, 1)
    monarch_pipe_kernel(const __grid_constant__ ClusterArgs args, const __grid_constant__ CUtensorMap out_map) {
#if LLMK_HAS_WGMMA
  // full[b], empty[b] per z buffer; static shared memory also marks the sm_90a body for the host
  __shared__ __align__(8) uint64_t bars[2 * kZBufs + 4];  // full, empty, recv_full[2], send_free[2]
  extern __shared__ __align__(128) unsigned char smem_raw[];
  constexpr int l = kBlocks * C;  // stage-2 blocks (= stage-1 blocks)
  // a z buffer's bytes from the other CTAs (bulk copies); the own producers write the rest
  constexpr uint32_t kZRemoteBytes = kZElems * sizeof(T) * (C - 1) / C;
  // 1024-byte aligned: the output staging is 32B-swizzled (bit 4 ^= bit 7 of the address)
  T* sm = reinterpret_cast<T*>(gpu::mma::align_smem_1024(smem_raw));
  const int rank = static_cast<int>(blockIdx.x) % C;
  const int cluster = static_cast<int>(blockIdx.x) / C, clusters = static_cast<int>(gridDim.x) / C;
  const int tiles = static_cast<int>((args.tokens + kTok - 1) / kTok);  // (the host checks the range)
  const int my_tiles = (tiles - cluster + clusters - 1) / clusters;       // >= 1: clusters <= tiles
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const uint32_t full0 = gpu::mma::smem_u32(&bars[0]), empty0 = gpu::mma::smem_u32(&bars[kZBufs]);
  const uint32_t z0 = gpu::mma::smem_u32(sm + kZOff);
  const uint32_t recv_full0 = gpu::mma::smem_u32(&bars[2 * kZBufs]), send_free0 = recv_full0 + 16;
  const uint32_t recv0 = gpu::mma::smem_u32(sm + kRecvOff);
  if (tid == 0) {
    for (int b = 0; b < kZBufs; ++b) {
      gpu::tma::mbar_init(full0 + 8 * b, 1 + kBlocks);  // the consumers' re-arm, the own producers
      gpu::tma::mbar_init(empty0 + 8 * b, kBlocks * C);
    }
    for (int b = 0; b < 4; ++b) gpu::tma::mbar_init(recv_full0 + 8 * b, 1);  // recv_full, send_free
    gpu::tma::fence_mbar_init();
    for (int b = 0; b < kZBufs; ++b) gpu::tma::mbar_arrive_expect_tx(full0 + 8 * b, kZRemoteBytes);
  }
  // this warp's block of its factor, in registers for the whole kernel
  const int own = warp % kBlocks;  // block index within the CTA (stage 1: i; stage 2: u)
  uint32_t frag[4][4][4];
  load_block_fragments(frag, static_cast<const T*>(warp < kBlocks ? args.w1 : args.w2) +
                                 static_cast<int64_t>(rank * kBlocks + own) * kBlk * kBlk, lane);
  gpu::tma::cluster_arrive();  // every block's barriers are initialised before any remote access
  gpu::tma::cluster_wait();

  if (warp < kBlocks) {
    // ---- producer: stage 1 and the exchange for block i
    const int i = rank * kBlocks + own;
    T* xring = sm + kXOff + own * kXStages * kSliceElems;
    T* ystage = sm + kYOff + own * kZBufs * kSliceElems;
    constexpr int rows_per_owner = kBlk / l;  // rows t of each owner's z that this block fills
    constexpr int kOwnerRowsElems = rows_per_owner * kBlocks * kTok;
    const int t0 = i * rows_per_owner;
    const T* xcol = static_cast<const T*>(args.x) + static_cast<int64_t>(i) * kBlk;
    auto load_x = [&](int it) {  // 16 rows x 64 of tile `it` (rows past the end zero), one group
      if (it < my_tiles) {
        const int64_t row0 = static_cast<int64_t>(cluster + it * clusters) * kTok;
        T* dst = xring + (it % kXStages) * kSliceElems;
#pragma unroll
        for (int e = 0; e < kSliceElems / 8 / 32; ++e) {
          const int c = lane + 32 * e, row = c / 8, ch = c % 8;
          const bool ok = row0 + row < args.tokens;
          gpu::mma::cp_async16(dst + swz(row, ch, kBlk), ok ? xcol + (row0 + row) * args.x_stride + ch * 8 : xcol,
                               ok ? 16 : 0);
        }
      }
      gpu::mma::cp_async_commit();
    };
#pragma unroll
    for (int s = 0; s < kXStages - 1; ++s) load_x(s);
    int zb = 0;
    uint32_t empty_phase = 0;
#pragma unroll 1
    for (int it = 0; it < my_tiles; ++it) {
      gpu::mma::cp_async_wait<kXStages - 2>();
      __syncwarp();  // the tile's x from every lane; the last tile's staging reads done
      const T* xs = xring + (it % kXStages) * kSliceElems;
      uint32_t bf[4][4];  // x^T as B: rows = tokens with K contiguous
#pragma unroll
      for (int ki = 0; ki < 4; ++ki)
        gpu::mma::ldmatrix_x4(bf[ki], xs + swz((lane & 7) + ((lane >> 4) << 3), ki * 2 + ((lane >> 3) & 1), kBlk));
      load_x(it + kXStages - 1);  // into the slot read by the previous tile
      if (it >= kZBufs) {  // the buffer's previous tile has landed in (so left this staging) and been read by every owner
        gpu::tma::mbar_wait(empty0 + 8 * zb, empty_phase);
        if (zb == kZBufs - 1) empty_phase ^= 1;
      }
      T* ys = ystage + zb * kSliceElems;  // [owner][rows_per_owner rows of z] in z's layout
#pragma unroll
      for (int mi = 0; mi < 4; ++mi) {
        float acc[2][4];
        rows_product<T>(acc, frag[mi], bf);
        // matrix m = 2 h + nt (rows 16 mi + 8 h .., tokens 8 nt ..); this lane's row address: y column
        // j = 64 i + c is row t = j / l of block u = j % l (owner u / 8)
        const uint32_t v[4] = {gpu::mma::pack2<T>(acc[0][0], acc[0][1]), gpu::mma::pack2<T>(acc[1][0], acc[1][1]),
                               gpu::mma::pack2<T>(acc[0][2], acc[0][3]), gpu::mma::pack2<T>(acc[1][2], acc[1][3])};
        const int m = lane >> 3, c = mi * 16 + (m >> 1) * 8 + (lane & 7);
        const int j = i * kBlk + c, u = j % l, t = j / l;
        const int owner = u / kBlocks;
        gpu::tma::stmatrix_x4(ys + (owner * rows_per_owner + t - t0) * (kBlocks * kTok) + z_in_row(t, u % kBlocks, m & 1), v);
      }
      gpu::wgmma::fence_proxy_async();  // the staging writes before the bulk copies read them
      __syncwarp();
      if (lane < C && lane != rank) {  // each other owner's rows of z: one bulk copy, completing on its "full" barrier
        const uint32_t src = gpu::mma::smem_u32(ys + lane * kOwnerRowsElems);
        const uint32_t dst = z0 + (zb * kZElems + t0 * (kBlocks * kTok)) * sizeof(T);
        gpu::tma::bulk_copy_to_cluster(gpu::tma::cluster_map_u32(dst, lane), src, kOwnerRowsElems * sizeof(T),
                                       gpu::tma::cluster_map_u32(full0 + 8 * zb, lane));
      }
      // this CTA's own rows: copied by the warp (a bulk copy to the issuing block's own shared
      // memory through a cluster address works but is outside what compute-sanitizer accepts),
      // then one arrival (release) on the local "full" barrier
      {
        const T* own_src = ys + rank * kOwnerRowsElems;
        T* own_dst = sm + kZOff + zb * kZElems + t0 * (kBlocks * kTok);
#pragma unroll
        for (int r = lane; r < kOwnerRowsElems / 8; r += 32)
          *reinterpret_cast<uint4*>(own_dst + r * 8) = *reinterpret_cast<const uint4*>(own_src + r * 8);
        __syncwarp();
        if (lane == 0) gpu::tma::mbar_arrive(full0 + 8 * zb);
      }
      zb = zb + 1 == kZBufs ? 0 : zb + 1;
    }
    gpu::mma::cp_async_wait<0>();
  } else {
    // ---- consumer: stage 2 and the output for block u
    const int ub = own;
    const int ctid = tid - kThreads / 2;
    int zb = 0;
    uint32_t full_phase = 0;
    // completes tile jt's output: the pair's 8 blocks of the kept tokens into the other half of
    // the staged rows, then one TMA store of the kept 8 rows
    auto finish = [&](int jt) {
      const int h = rank & 1, fb = jt & 1;
      T* ostage = sm + kOutOff + (jt % kOutBufs) * kOutElems;
      gpu::tma::mbar_wait<true>(recv_full0 + 8 * fb, (jt >> 1) & 1);
      const T* recv = sm + kRecvOff + fb * kHalfElems;
      for (int c = ctid; c < kHalfElems / 8; c += kThreads / 2)
        *reinterpret_cast<uint4*>(ostage + swz32(c * 16 + 8 * (1 - h))) = *reinterpret_cast<const uint4*>(recv + c * 8);
      gpu::wgmma::fence_proxy_async();
      // the store of tile jt - 1 has read its staging buffer, which tile jt + 2 writes (after the
      // barrier below); this tile's staging is complete after it
      if (ctid == 0) gpu::tma::bulk_wait<0, true>();
      gpu::tma::named_sync(1, kThreads / 2);
      if (ctid == 0) {
        // this CTA's reads of the receive buffer are done (their values stored above): the pair
        // may send its next half there
        gpu::tma::mbar_arrive_remote_relaxed(gpu::tma::cluster_map_u32(send_free0 + 8 * fb, rank ^ 1));
        // out[b, v*l + 16 (rank / 2) ..] for the kept 8 rows (rows past the end are not written)
        const int64_t row0 = static_cast<int64_t>(cluster + jt * clusters) * kTok;
        gpu::tma::store_3d(&out_map, gpu::mma::smem_u32(ostage), 2 * kBlocks * (rank >> 1), 0,
                           static_cast<int>(row0) + 8 * h);
        gpu::tma::bulk_commit();
      }
    };
#pragma unroll 1
    for (int it = 0; it < my_tiles; ++it) {
      gpu::tma::mbar_wait<true>(full0 + 8 * zb, full_phase);  // acquire at cluster scope: the st.async data of every CTA
      const T* zs = sm + kZOff + zb * kZElems;
      uint32_t bf[4][4];  // z^T as B: rows = K (t) with the tokens contiguous
#pragma unroll
      for (int ki = 0; ki < 4; ++ki) {
        const int t = ki * 16 + ((lane >> 3) & 1) * 8 + (lane & 7);
        gpu::mma::ldmatrix_x4_trans(bf[ki], zs + t * (kBlocks * kTok) + z_in_row(t, ub, lane >> 4));
      }

      // out^T = w2[u] z^T: the kept tokens staged in place, the others for the pair (see above)
      const int h = rank & 1, fb = it & 1;
      T* ostage = sm + kOutOff + (it % kOutBufs) * kOutElems;
      T* send = sm + kSendOff + fb * kHalfElems;
      if (it >= 2)  // the pair has copied tile it - 2's half out of its receive buffer
        gpu::tma::mbar_wait<true>(send_free0 + 8 * fb, ((it >> 1) - 1) & 1);
      const int g = lane >> 2, tq = lane & 3;
#pragma unroll
      for (int mi = 0; mi < 4; ++mi) {
        float acc[2][4];
        rows_product<T>(acc, frag[mi], bf);
        if (mi == 0) {
          // release the z buffer: the first product has used every fragment, so this warp's reads
          // of it are complete (a relaxed arrive, no fence); the producers of every CTA wait for
          // the 8 C consumer warps. No one waits for a buffer's release after its last use.
          __syncwarp();
          if (it + kZBufs < my_tiles && lane < C)
            gpu::tma::mbar_arrive_remote_relaxed(gpu::tma::cluster_map_u32(empty0 + 8 * zb, lane));
          if (ub == 0 && lane == 0) gpu::tma::mbar_arrive_expect_tx(full0 + 8 * zb, kZRemoteBytes);  // next use
          if (zb == kZBufs - 1) full_phase ^= 1;
          zb = zb + 1 == kZBufs ? 0 : zb + 1;
        }
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {  // tokens 8 nt ..: kept (rows of 16 blocks) or sent (rows of 8)
          // kept: the 32B swizzle flips the 16-byte half of rows whose v has bit 2 set, i.e. g & 4
          const bool kept = nt == h;
          T* dst = kept ? ostage + ((8 * h + ub) ^ ((g & 4) << 1)) : send + ub;
          const int row_elems = kept ? 2 * kBlocks : kBlocks;
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int v = mi * 16 + g + 8 * (e >> 1), b = 2 * tq + (e & 1);
            dst[(b * kBlk + v) * row_elems] = gpu::from_float<T>(acc[nt][e]);
          }
        }
      }
      gpu::wgmma::fence_proxy_async();  // the staging writes before the bulk copy and the TMA store read them
      constexpr uint32_t kHalfBytes = kHalfElems * sizeof(T);
      gpu::tma::named_sync(1, kThreads / 2);
      if (ctid == 0) {
        gpu::tma::mbar_arrive_expect_tx(recv_full0 + 8 * fb, kHalfBytes);  // this tile's half from the pair
        gpu::tma::bulk_copy_to_cluster(gpu::tma::cluster_map_u32(recv0 + fb * kHalfBytes, rank ^ 1),
                                       gpu::mma::smem_u32(send), kHalfBytes,
                                       gpu::tma::cluster_map_u32(recv_full0 + 8 * fb, rank ^ 1));
      }
      if (it >= 1) finish(it - 1);  // the previous tile's half from the pair has had this tile's time to arrive
    }
    finish(my_tiles - 1);
    if (ctid == 0) gpu::tma::bulk_wait<0, false>();  // the stores complete before the block exits
  }
  gpu::tma::cluster_arrive();  // no block leaves while another may still write its shared memory
  gpu::tma::cluster_wait();
#else
  (void)args;
#endif
}

}  // namespace pipe

// From this many tokens the pipelined kernel runs where it has the shape (H200, bf16, 2026-12-02,
// with the pair exchange: n = 4096 with 64 blocks 0.037 ms against the resident kernel's 0.046 at
// 2048 tokens; before it, 0.046 against 0.045 there and 0.029 against 0.027 at n = 2048 with 32
// blocks, so the threshold was 8192).
constexpr int64_t kPipelinedTokens = 2048;

// Launches `Kernel` (clusters of C CTAs of `threads` threads, `smem` bytes of dynamic shared
// memory) persistently: as many clusters as fit at once, at most one per tile of `tile_tokens`
// tokens. False (nothing launched) where it cannot run on p's device.
template <auto Kernel, typename... Extra>
bool launch_clusters(const MonarchParams& p, int C, int threads, std::size_t smem, int tile_tokens, const Extra&... extra) {
  const int dev = p.device.index;
  if (!gpu::tma::sm90_kernel_ready<Kernel>(dev, smem, "monarch_matmul")) return false;
  const int fit = gpu::resident_clusters<Kernel>(dev, static_cast<unsigned>(C), dim3(threads), smem);
  if (fit <= 0) return false;
  const int64_t tiles = (p.tokens + tile_tokens - 1) / tile_tokens;
  const int clusters = static_cast<int>(tiles < fit ? tiles : fit);
  const ClusterArgs a{p.x, p.x_stride, p.w1, p.w2, p.out, p.out_stride, p.tokens};
  gpu::launch_cluster(Kernel, dim3(static_cast<unsigned>(clusters * C)), dim3(threads), smem, gpu::as_stream(p.stream),
                      static_cast<unsigned>(C), false, a, extra...);
  gpu::check_launch("monarch_matmul");
  return true;
}

// Launches the pipelined kernel if p has its shape (blocks of 64, k = l = 8 C) and one cluster fits.
template <typename T, int C>
bool run_pipe(const MonarchParams& p) {
  constexpr int64_t blocks = pipe::kBlocks * C, b = pipe::kBlk;
  if (p.k != blocks || p.l != blocks || p.q != b || p.p != b || p.s != b || p.r != b) return false;
  if (p.tokens > INT32_MAX) return false;  // the kernel counts tiles and TMA rows in int
  // out viewed as (u: l, v: s, token), boxes of (16 blocks, 64 v, 8 tokens): a pair of CTAs' blocks
  CUtensorMap out_map;
  if (!gpu::tma::make_tensor_map_3d(&out_map, p.dtype == DType::f16, p.out, {p.l, p.s, p.tokens}, {p.l, p.out_stride},
                                    {2 * pipe::kBlocks, pipe::kBlk, pipe::kTok / 2}, CU_TENSOR_MAP_SWIZZLE_32B))
    return false;
  return launch_clusters<pipe::monarch_pipe_kernel<T, C>>(p, C, pipe::kThreads, pipe::kSmemElems * sizeof(T) + 1024,
                                                          pipe::kTok, out_map);
}

// Launches Sh's kernel if p has its shape and one cluster fits; false otherwise.
template <typename T, typename Sh>
bool run_shape(const MonarchParams& p) {
  if (p.k != Sh::k || p.q != Sh::q || p.p != Sh::p || p.l != Sh::l || p.s != Sh::s || p.r != Sh::r) return false;
  constexpr std::size_t smem = static_cast<std::size_t>(layout_of(Sh::k, Sh::q, Sh::p, Sh::l, Sh::s, Sh::r, Sh::C).total) *
                               sizeof(T);
  return launch_clusters<monarch_cluster_kernel<T, Sh>>(p, Sh::C, kThreads, smem, kTok);
}

// The instantiated shapes: square blocks (n = blocks x block size) whose factors fit on one
// cluster's chips: n = 4096 with 64 blocks (C = 8), n = 2048 with 64 or 32 blocks (C = 4), n =
// 1024 with 32 blocks (C = 2).
template <typename T>
bool run_resident(const MonarchParams& p) {
  return run_shape<T, Shape<64, 64, 64, 64, 64, 64, 8>>(p) || run_shape<T, Shape<64, 32, 32, 64, 32, 32, 4>>(p) ||
         run_shape<T, Shape<32, 64, 64, 32, 64, 64, 4>>(p) || run_shape<T, Shape<32, 32, 32, 32, 32, 32, 2>>(p);
}

}  // namespace
#endif

bool monarch_cluster_forward(const MonarchParams& p) {
#if LLMK_MMA_SYNC_BUILD
  if (p.tokens <= 0 || (p.dtype != DType::f16 && p.dtype != DType::bf16)) return false;
  // LLMK_MONARCH_CLUSTER: "0" off; "resident" / "pipelined" that kernel only (where it has the
  // shape); otherwise the pipelined kernel from kPipelinedTokens tokens where it has the shape, else
  // the resident one (the device: sm90_kernel_ready, cached)
  if (!gpu::env_flag("LLMK_MONARCH_CLUSTER", true)) return false;
  const char* mode = std::getenv("LLMK_MONARCH_CLUSTER");
  const bool resident = mode != nullptr && std::strcmp(mode, "resident") == 0;
  const bool pipelined = mode != nullptr && std::strcmp(mode, "pipelined") == 0;
  if (p.x_stride % 8 || p.out_stride % 8 || !aligned16(p.x) || !aligned16(p.w1) || !aligned16(p.w2) ||
      !aligned16(p.out))
    return false;
  const bool try_pipe = pipelined || (!resident && p.tokens >= kPipelinedTokens);
  if (p.dtype == DType::f16)
    return (try_pipe && (run_pipe<half, 8>(p) || run_pipe<half, 4>(p))) || (!pipelined && run_resident<half>(p));
  return (try_pipe && (run_pipe<bfloat16, 8>(p) || run_pipe<bfloat16, 4>(p))) ||
         (!pipelined && run_resident<bfloat16>(p));
#else
  (void)p;
  return false;
#endif
}

}  // namespace llmk::detail
