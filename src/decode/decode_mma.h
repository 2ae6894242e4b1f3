// The tensor-core decode attention kernels (decode_mma_kernel, decode_mma_tma_kernel) and their
// launch, as templates over dtype and head dim; each decode_mma_<dtype>_d<D>.cu instantiates one
// pair (they compile in parallel), decode_gpu.cu plans and dispatches to them.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <type_traits>

#include "decode/decode_gpu_common.h"
#include "gpu/mma.h"
#include "gpu/tensor_map.h"
#include "gpu/tma.h"

#if LLMK_MMA_SYNC_BUILD
namespace llmk::detail {
namespace {

// The end of a split-KV block whose launch made the S = p.num_splits splits of each (sequence, KV
// head) one thread block cluster (rank = split; sm_90a code only): no workspace, no counter, no
// memset. Inputs as finish_split_block's (o_s unnormalised at the block's running maxima lse_s,
// row sums tot_s; wts: rows x kMaxSplits floats of shared scratch). After a cluster barrier, each
// block reads the S (lse, sum) pairs of its rows from the cluster's shared memory, turns them into
// merge weights, and writes the 16-byte quads of the output whose index is its rank modulo S,
// reading the S partial outputs remotely; a second cluster barrier keeps every block's shared
// memory alive until all have read it. A bad block (any_bad) makes the whole head's output NaN,
// rows that see no key anywhere are zero, as on the workspace path. Every remote read is unrolled
// over kMaxClusterSplits (predicated by j < S), so that a thread's S distributed-shared-memory
// loads are in flight together: one round trip per phase instead of S dependent ones.
template <typename T, int D, int NT>
__device__ __forceinline__ void cluster_finish(const DecodeParams& p, int64_t b, int64_t hk, int split, int rows,
                                               const float* o_s, const float* tot_s, const float* lse_s,
                                               bool any_bad, float* wts) {
  __shared__ int bad_s;
  const int tid = threadIdx.x;
  const int T_ = static_cast<int>(p.tokens);
  const int group = static_cast<int>(p.q_heads / p.kv_heads);
  const int S = p.num_splits;
  if (tid == 0) bad_s = any_bad ? 1 : 0;
  gpu::tma::cluster_sync();
  if (tid < rows) {
    float m[kMaxClusterSplits], tot[kMaxClusterSplits];
    int bad = 0;
#pragma unroll
    for (int j = 0; j < kMaxClusterSplits; ++j) {  // the S running maxima and row sums, the bad flags
      if (j < S) {
        m[j] = *gpu::tma::cluster_map(lse_s + tid, j);
        tot[j] = *gpu::tma::cluster_map(tot_s + tid, j);
        bad |= *gpu::tma::cluster_map(&bad_s, j);
      }
    }
    float mx = -INFINITY;
#pragma unroll
    for (int j = 0; j < kMaxClusterSplits; ++j)
      if (j < S) mx = fmaxf(mx, m[j]);
    float sum = 0.f;
#pragma unroll
    for (int j = 0; j < kMaxClusterSplits; ++j) {
      if (j < S) {
        m[j] = m[j] == -INFINITY ? 0.f : exp2f(m[j] - mx);
        sum += m[j] * tot[j];
      }
    }
    const float inv = bad ? __int_as_float(0x7fc00000) : (sum > 0.f ? 1.f / sum : 0.f);
    float* w = wts + tid * kMaxSplits;
#pragma unroll
    for (int j = 0; j < kMaxClusterSplits; ++j)
      if (j < S) w[j] = m[j] * inv;
  }
  __syncthreads();
  const int nq = rows * D / 4;
  for (int qd = split + S * tid; qd < nq; qd += S * NT) {
    const int r = qd / (D / 4), d = (qd % (D / 4)) * 4, g = r / T_, t = r % T_;
    float4 x[kMaxClusterSplits];
#pragma unroll
    for (int j = 0; j < kMaxClusterSplits; ++j)
      if (j < S) x[j] = *gpu::tma::cluster_map(reinterpret_cast<const float4*>(o_s + r * D + d), j);
    float4 a = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int j = 0; j < kMaxClusterSplits; ++j) {
      if (j < S) {
        const float w = wts[r * kMaxSplits + j];
        a.x += w * x[j].x;
        a.y += w * x[j].y;
        a.z += w * x[j].z;
        a.w += w * x[j].w;
      }
    }
    T* out = static_cast<T*>(p.out) + b * p.out_strides[0] + t * p.out_strides[1] +
             (hk * group + g) * p.out_strides[2] + d;
    gpu::from_float2<T>(a.x, a.y, out[0], out[1]);
    gpu::from_float2<T>(a.z, a.w, out[2], out[3]);
  }
  gpu::tma::cluster_sync();
}

// ------------------------------------------------------------ decode_mma_kernel (NVIDIA sm_80+)
// Split-KV decode attention on tensor cores (LLMK_DECODE_KERNEL=mma). Grid (num_splits, kv_heads,
// batch), 128 threads (4 warps). A block takes one KV head of one sequence and one chunk of its
// positions and serves all R = (Hq / Hkv) * T query rows of that head (R <= 16: one m16 tile; the
// padding rows see no key) from a single pass over K/V. The chunk is streamed in tiles of 64 keys
// through a ring of STAGES shared-memory stages filled by cp.async (16-byte pieces, zero-filled
// past the chunk or at a bad block; paged: every key's address from the block table, whose entries
// are read one tile ahead), rows padded to D + 8 elements so that ldmatrix is conflict-free; 3
// stages of 64 keys at D = 128 (102 KB, 2 blocks and 128 KB of K/V in flight per SM on an H100 /
// H200), 4 at D = 64. The warps split each tile (16 keys each):
// S = Q K^T by mma.m16n8k16 (Q as A fragments in registers, K as B through ldmatrix), masked to
// the chunk and to each token's causal limit, scaled into the log2 domain in fp32, an online
// softmax per warp (a row lives in a quad; each warp keeps its own running max and sum), P
// rounded to T as the A fragment of O += P V (V through ldmatrix.trans), O in fp32 registers
// (16 x D per warp). At the end the warps' (m, l, O) are combined through shared memory (the ring,
// no longer needed) and finish_split_block writes the output, or the split's partial result and,
// in the last block of the head, the merge of all splits (one launch, as decode_warp_kernel).
// The TMA kernel below merges 2 to 8 splits in a thread block cluster instead where that applies
// (cluster_finish, kMaxClusterSplits). Where its grid fits the multiprocessors without a cluster
// merge (e.g. the 1B model's decode step: 8 blocks) it runs two warp groups per block
// (mma_groups): each group takes every other tile of the chunk through its own ring slots, so that
// each multiprocessor has two tiles' dependent chains in flight instead of one.
// TMA (decode_mma_tma_kernel: sm_90a, a cache whose strides TMA can express, pages of a power-of-two
// size >= 8; on unless LLMK_DECODE_TMA=0): thread 0 fills each stage with the bulk tensor copy
// engine instead (per tile, D / 64 boxes of 64 keys x 64 columns of K and of V, or of a page's
// rows when pages are smaller than a tile, the block table read one tile ahead; 128B-swizzled,
// unpadded rows, completing on the stage's mbarrier; positions past the cache read as zeros, V
// rows past the chunk's end in its last tile are zeroed after arrival, as they may hold anything;
// no L2 promotion). Measured on
// the H200 (bench/micro/kv_stream.cu, a pure read of the b32 kv4096 cache in this kernel's
// pattern, 2026-12-01): 4.07 TB/s by these tensor maps against 3.83 with 16-byte cp.async pieces;
// the kernel itself (scripts/decode_split_sweep.py, do_bench) 142.1 us against 147.2 (with L2
// promotion, which the micro-benchmark then showed to cost 3-4%).
__host__ __device__ constexpr int mma_stages(int head_dim) { return head_dim <= 64 ? 4 : 3; }
// Staged mask (default; LLMK_DECODE_MASK_PREFETCH=0 turns it off): per stage, its rows (1 for a mask shared by the
// tokens, else T <= 8) of a window of 16-byte pieces that covers the tile's 64 positions from the
// 16-byte boundary at or below the first: 64 * size + 16 bytes per row (bool 80, f16 / bf16 144,
// f32 272), sized per launch (a shared bf16 mask adds 4 x 144 bytes at D = 64, which keeps its 3
// blocks per multiprocessor on the H200).
constexpr int kMMaskRows = 8;  // = decode.cpp's kMaxTokens (T <= 8: a per-token mask has T rows)
__host__ __device__ constexpr int mask_row_bytes(int elem_bytes) { return kMKeys * elem_bytes + 16; }
// tma: unpadded, 128B-swizzled K / V tiles from a 1024-byte aligned base (up to 1 KB of slack).
// groups: warp groups (decode_mma_body's NG), each with mma_stages ring slots.
__host__ __device__ constexpr std::size_t mma_smem_bytes(int head_dim, std::size_t mask_stage_bytes = 0, bool tma = false,
                                                         int groups = 1) {
  const std::size_t slots = static_cast<std::size_t>(groups) * mma_stages(head_dim);
  const std::size_t ring = slots * 2 * kMKeys * (head_dim + (tma ? 0 : 8)) * 2 + slots * mask_stage_bytes;
  const std::size_t tail = static_cast<std::size_t>(groups * kMWarps * kMRows * head_dim + kMRows * head_dim +
                                                    groups * kMWarps * kMRows + kMRows * kMaxSplits) * 4 +
                           static_cast<std::size_t>(groups) * kMThreads * 16;
  return (ring > tail ? ring : tail) + (tma ? 1024 : 0);
}

// Bytes of one mask element.
__host__ __device__ constexpr int mask_elem_bytes(DType t) {
  return t == DType::boolean ? 1 : (t == DType::f16 || t == DType::bf16) ? 2 : 4;
}

// Set (for this translation unit's kernels) when a block ran its chunk without the mask
// (p.mask_skip); read and cleared by the host (decode_mma_flags, tests).
static __device__ unsigned int g_mask_skipped = 0;

// Host: this translation unit's flags since the last call, clearing them (decode_mma_flags: bit 0
// a TMA wait timed out, bit 1 a block skipped the mask).
inline unsigned take_decode_mma_flags() {
  return (gpu::tma::take_mbar_timed_out() ? 1u : 0u) | (gpu::tma::take_device_flag(g_mask_skipped) ? 2u : 0u);
}

// The mask term (log2 domain) of the element at `e` (global or shared memory): -inf hides the key.
__device__ __forceinline__ float mask_term_at(const unsigned char* e, DType t) {
  switch (t) {
    case DType::boolean: return *e ? 0.f : -INFINITY;
    case DType::f16: return gpu::to_float(*reinterpret_cast<const half*>(e)) * kLog2e;
    case DType::bf16: return gpu::to_float(*reinterpret_cast<const bfloat16*>(e)) * kLog2e;
    default: return *reinterpret_cast<const float*>(e) * kLog2e;
  }
}

// MASK: 0 none; 1 each lane loads its 8 mask terms per tile from global memory (previous path);
// 2 (the default, LLMK_DECODE_MASK_PREFETCH unset or 1; a mask with a contiguous last dim): the mask rows of a tile ride
// the cp.async ring with its K/V (a window of 16-byte pieces from the 16-byte boundary at or below
// the tile's first position, so any element-aligned row works; pieces past the mask's positions or
// the chunk are zero-filled, never read), and each block first scans its chunk's mask once
// (coalesced, before it requests any K/V) and stops at one past its last visible key.
// The body of decode_mma_kernel (TMA false) and decode_mma_tma_kernel (TMA true: map_k and map_v
// are the tensor maps of the K and V caches, kernel parameters). NG warp groups of kMWarps warps:
// with NG = 2 (TMA; mma_groups) group g takes tiles g, g + 2, ... of the chunk through its own
// STAGES ring slots, its own issuing thread (with its own page-table entries) and its own named
// barrier, so that
// two tiles' dependent chains (S, softmax, P V) run at once on each multiprocessor; the groups
// meet only in the final combination, which covers all NG * kMWarps warps.
template <typename T, int D, bool PAGED, int MASK, bool TMA, int NG>
__device__ __forceinline__ void decode_mma_body(const DecodeParams& p, [[maybe_unused]] const void* map_k,
                                                [[maybe_unused]] const void* map_v) {
  static_assert(NG == 1 || (NG == 2 && TMA), "two warp groups: TMA loads");
  constexpr int KS = D + 8;  // padded row (elements; cp.async)
  constexpr int CH = D / 8;  // 16-byte pieces per row
  constexpr int STAGES = mma_stages(D);  // ring slots per group
  constexpr int SLOTS = NG * STAGES;
  constexpr int BT = NG * kMThreads, BW = NG * kMWarps;  // the block's threads and warps
  constexpr int LOADS = kMKeys * CH / kMThreads;
  constexpr int KT = D / 16;  // k steps of Q K^T
  constexpr int NT = D / 8;   // n tiles of O
  constexpr int ROW = TMA ? D : KS;         // elements from one key's row to the next in a tile
  constexpr int STAGE = 2 * kMKeys * ROW;   // elements of one stage (K tile, then V tile)
  static_assert(kMKeys * CH % kMThreads == 0, "tile must split evenly over the threads");
  static_assert(kMKeys == 16 * kMWarps, "16 keys per warp");

  extern __shared__ __align__(16) unsigned char smem_raw[];
  // TMA: 128B-swizzle atoms start on 1024-byte boundaries (mma_smem_bytes adds the slack)
  unsigned char* smem =
      TMA ? gpu::mma::align_smem_1024(smem_raw) : smem_raw;
  T* ring = reinterpret_cast<T*>(smem);
  __shared__ float m_s[BW][kMRows];
  __shared__ float tot_s[kMRows], lse_s[kMRows];
  __shared__ int last_s;
  __shared__ int eff_s[BW];
  [[maybe_unused]] __shared__ int nz_s[MASK == 2 ? BW : 1];
  __shared__ __align__(8) uint64_t full_s[TMA ? SLOTS : 1];  // TMA: a slot's K / V have landed

  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  // this thread's group, its index in the group, its warp's index in the group (16 keys of a tile)
  const int grp = NG == 1 ? 0 : warp / kMWarps;
  const int gtid = tid - grp * kMThreads, gwarp = warp - grp * kMWarps;
  const int g = lane / 4, tq = lane % 4;
  const int T_ = static_cast<int>(p.tokens);
  const int group = static_cast<int>(p.q_heads / p.kv_heads);
  const int rows = group * T_;  // <= kMRows (the plan guarantees it)
  const int64_t hk = blockIdx.y;
  const int64_t b = blockIdx.z;
  const int split = blockIdx.x;

  // PDL (gpu::launch): inputs only after the previous kernel. The next kernel may launch now, except
  // after a clustered launch: there it launches at this grid's exit. An early trigger from the
  // clusters cost the 1B model's decode step ~6 us a layer in its CUDA graph (H200, 2026-12-05,
  // scripts/decode_cluster_bisect.py: the whole layer 63.5 us with the cluster merge against 57.6
  // without, 54.8 with the trigger at exit; e2e at --context 1000 946 against 1081-1082 tok/s).
  if (!p.cluster_merge) gpu::pdl_trigger();
  gpu::pdl_wait();
  // Q rows g and g + 8 of the tile as A fragments (as given; the scale is applied to S in fp32),
  // loaded first: they depend on nothing else, so their round trip overlaps the sequence length's
  // and the first K/V tile's instead of following them.
  // Row r is query head hk * group + r / T of token r % T; rows >= `rows` are zero and masked.
  uint32_t qf[KT][4];
  {
    auto qrow = [&](int r) -> const T* {
      return r < rows ? static_cast<const T*>(p.q) + b * p.q_strides[0] + (r % T_) * p.q_strides[1] +
                            (hk * group + r / T_) * p.q_strides[2]
                      : nullptr;
    };
    const T* q0 = qrow(g);
    const T* q1 = qrow(g + 8);
    auto pair = [](const T* q, int d) -> uint32_t {
      if (q == nullptr) return 0u;
      uint32_t lo = 0, hi = 0;
      lo = *reinterpret_cast<const uint16_t*>(q + d);
      hi = *reinterpret_cast<const uint16_t*>(q + d + 1);
      return lo | (hi << 16);
    };
#pragma unroll
    for (int kt = 0; kt < KT; ++kt) {
      qf[kt][0] = pair(q0, kt * 16 + 2 * tq);
      qf[kt][1] = pair(q1, kt * 16 + 2 * tq);
      qf[kt][2] = pair(q0, kt * 16 + 2 * tq + 8);
      qf[kt][3] = pair(q1, kt * 16 + 2 * tq + 8);
    }
  }
  const SplitChunk chunk = split_chunk(p, b, split);
  const bool len_bad = chunk.len_bad;
  const int len = chunk.len, start = chunk.start;
  int end = chunk.end;

  const KvCache& cache = p.cache;
  const T* kbase = static_cast<const T*>(cache.k) +
                   (PAGED ? hk * cache.k_strides[2] : b * cache.k_strides[0] + hk * cache.k_strides[1]);
  const T* vbase = static_cast<const T*>(cache.v) +
                   (PAGED ? hk * cache.v_strides[2] : b * cache.v_strides[0] + hk * cache.v_strides[1]);
  const int32_t* table_row = PAGED ? cache.block_table + b * cache.table_stride : nullptr;
  const PageSize page(cache.block_size);
  const int num_blocks = static_cast<int>(cache.num_blocks < INT32_MAX ? cache.num_blocks : INT32_MAX);
  bool bad = len_bad;

  // paged: the block of each of this thread's keys in the next tile to load, read one tile ahead
  // so that the table reads are in flight while a tile is used (unused past the chunk). TMA: the
  // blocks of the tile's pages (read by the group's issuing thread; page_rows keys each, a power
  // of two >= 8 that divides the 64-key tile, as the host checks; -1 past the chunk).
  int tbl[LOADS];
  constexpr int kMaxPages = kMKeys / 8;
  const int page_rows = PAGED && TMA ? min(page.size, kMKeys) : kMKeys;
  int tpage[PAGED && TMA ? kMaxPages : 1];
  auto fetch_pages = [&](int tile, int* dst) {
    if (gtid == 0) {  // the group's issuing thread
#pragma unroll
      for (int i = 0; i < kMaxPages; ++i) {
        const int pos = start + tile * kMKeys + i * page_rows;
        dst[i] = i * page_rows < kMKeys && pos < end ? table_row[page.block_of(pos)] : -1;
      }
    }
  };
  auto fetch_table = [&](int tile) {
    if constexpr (PAGED && TMA) {
      fetch_pages(tile, tpage);
    } else if constexpr (PAGED) {
#pragma unroll
      for (int i = 0; i < LOADS; ++i) {
        const int pos = start + tile * kMKeys + (tid + i * kMThreads) / CH;
        tbl[i] = pos < end ? table_row[page.block_of(pos)] : 0;
      }
    }
  };
  // The 16-byte piece c (columns 8c .. 8c + 7) of key row kr of a K or V tile at `tile`: padded
  // rows (cp.async), or D / 64 column blocks of 64 rows x 128 bytes, piece c % 8 of row kr at slot
  // (c % 8) ^ (kr % 8) (TMA's 128B swizzle), so that ldmatrix's 8 rows hit 8 different bank groups.
  auto piece_at = [](const T* tile, int kr, int c) -> const T* {
    if constexpr (TMA) return tile + (c / 8) * (kMKeys * 64) + kr * 64 + ((c % 8) ^ (kr % 8)) * 8;
    else return tile + kr * KS + c * 8;
  };

  // tile `tile` of the chunk into stage `slot` (paged: with the entries fetch_table(tile) read):
  // piece (key, c) of K and V per thread; TMA: D / 64 boxes of K and of V issued by thread 0
  // (paged: one box per page and column block, page_rows x 128 bytes at row 8-aligned offsets, so
  // the 128B swizzle is the same as one 64-row box's; pages past the chunk read block 0, a bad
  // block reads block 0 and marks the head bad: those rows are masked, zeroed or make NaN).
  auto load_tile = [&](int tile, int slot) {
    if constexpr (TMA) {
      if (gtid == 0) {
        const uint32_t bar = gpu::mma::smem_u32(&full_s[slot]);
        const uint32_t ks = gpu::mma::smem_u32(ring + slot * STAGE), vs = ks + kMKeys * D * sizeof(T);
        gpu::tma::mbar_arrive_expect_tx(bar, STAGE * sizeof(T));
        const int pos = start + tile * kMKeys;
        if constexpr (PAGED) {
#pragma unroll
          for (int i = 0; i < kMaxPages; ++i) {
            if (i * page_rows >= kMKeys) break;
            int blk = tpage[i];
            if (blk < 0 || blk >= num_blocks) {
              bad |= pos + i * page_rows < end;  // (past the chunk: no entry was read)
              blk = 0;
            }
            const int off = page.offset_of(pos + i * page_rows);
#pragma unroll
            for (int h = 0; h < D / 64; ++h) {
              const uint32_t at = h * kMKeys * 128 + i * page_rows * 128;
              gpu::tma::load_4d(ks + at, map_k, bar, h * 64, off, static_cast<int>(hk), blk);
              gpu::tma::load_4d(vs + at, map_v, bar, h * 64, off, static_cast<int>(hk), blk);
            }
          }
        } else {
#pragma unroll
          for (int h = 0; h < D / 64; ++h) {
            gpu::tma::load_4d(ks + h * kMKeys * 128, map_k, bar, h * 64, pos, static_cast<int>(hk), static_cast<int>(b));
            gpu::tma::load_4d(vs + h * kMKeys * 128, map_v, bar, h * 64, pos, static_cast<int>(hk), static_cast<int>(b));
          }
        }
      }
      return;
    }
    T* ks = ring + slot * STAGE;
    T* vs = ks + kMKeys * KS;
    const int kb = start + tile * kMKeys;
#pragma unroll
    for (int i = 0; i < LOADS; ++i) {
      const int idx = tid + i * kMThreads, key = idx / CH, c = idx % CH;
      const int pos = kb + key;
      bool ok = pos < end;
      int64_t ko = 0, vo = 0;
      if (PAGED) {
        if (ok) {
          const int blk = tbl[i];
          if (blk < 0 || blk >= num_blocks) {
            bad = true;
            ok = false;
          } else {
            const int off = page.offset_of(pos);
            ko = static_cast<int64_t>(blk) * cache.k_strides[0] + off * cache.k_strides[1];
            vo = static_cast<int64_t>(blk) * cache.v_strides[0] + off * cache.v_strides[1];
          }
        }
      } else {
        ko = static_cast<int64_t>(pos) * cache.k_strides[2];
        vo = static_cast<int64_t>(pos) * cache.v_strides[2];
      }
      gpu::mma::cp_async16(ks + key * KS + c * 8, ok ? kbase + ko + c * 8 : kbase, ok ? 16 : 0);
      gpu::mma::cp_async16(vs + key * KS + c * 8, ok ? vbase + vo + c * 8 : vbase, ok ? 16 : 0);
    }
  };

  // MASK == 2: the staged mask. Row t (token t, or the one row of a shared mask) of tile `tile`:
  // 16-byte pieces from the boundary at or below the address of its first position; the piece that
  // holds position kb sits at byte delta = (row address % 16) of the stage row (kb * size is a
  // multiple of 64).
  const KeyMask& mask = p.mask;
  const DType mdt = mask.dtype;
  const int mE = MASK == 2 ? mask_elem_bytes(mdt) : 1;
  const int mrows = mask.strides[1] == 0 ? 1 : T_;
  const int mlen = mask.len < INT32_MAX ? static_cast<int>(mask.len) : INT32_MAX;
  const int mrowb = mask_row_bytes(mE), mstage = mrows * mrowb;  // bytes per stage row, per stage
  auto mask_row = [&](int t) -> const unsigned char* {
    return static_cast<const unsigned char*>(mask.data) + (b * mask.strides[0] + t * mask.strides[1]) * mE;
  };
  [[maybe_unused]] unsigned char* mring = smem + static_cast<std::size_t>(SLOTS) * STAGE * sizeof(T);
  // MASK == 2: false where the chunk's scan below found every row's terms 0 up to its effective end
  // (p.mask_skip): the loop then needs neither the staged pieces nor the terms (uniform per block)
  [[maybe_unused]] bool mask_live = true;
  auto load_mask = [&](int tile, int slot) {
    if constexpr (MASK == 2) {
      if (!mask_live) return;
      const int cpr = 4 * mE + 1;  // pieces per row
      const int kb = start + tile * kMKeys;
      const int lim = min(end, mlen);
      unsigned char* dst = mring + slot * mstage;
      for (int i = gtid; i < mrows * cpr; i += kMThreads) {
        const int t = i / cpr, c = i - t * cpr;
        const unsigned char* row = mask_row(t);
        const uintptr_t w = ((reinterpret_cast<uintptr_t>(row) + static_cast<uintptr_t>(kb) * mE) & ~uintptr_t{15}) +
                            16 * static_cast<uintptr_t>(c);
        const int64_t valid = static_cast<int64_t>(reinterpret_cast<uintptr_t>(row) + static_cast<uintptr_t>(lim) * mE) -
                              static_cast<int64_t>(w);
        const int nb = lim > kb ? static_cast<int>(valid < 0 ? 0 : (valid > 16 ? 16 : valid)) : 0;
        unsigned char* piece = dst + t * mrowb + 16 * c;
        // A piece whose 16 bytes pass the row's end (mlen) may pass the mask's allocation too, and
        // compute-sanitizer's memcheck counts a cp.async with src-size < 16 as a 16-byte read
        // (2026-12-06: a 4 x 290 bool mask, its last piece 8 bytes before the end). Such a piece
        // (only where the visible keys reach the row's last 16 bytes) is read by plain loads, zeros
        // after, stored before the barrier that precedes the tile's use like the copies' wait.
        const bool past_row = static_cast<int64_t>(w) + 16 >
                              static_cast<int64_t>(reinterpret_cast<uintptr_t>(row) + static_cast<uintptr_t>(mlen) * mE);
        if (nb == 16 || nb == 0 || !past_row) {
          // nothing to read: a valid 16-byte aligned address all the same (this head's K rows)
          gpu::mma::cp_async16(piece, nb > 0 ? reinterpret_cast<const void*>(w) : static_cast<const void*>(kbase), nb);
        } else {
          const unsigned char* src = reinterpret_cast<const unsigned char*>(w);
#pragma unroll
          for (int j = 0; j < 16; ++j) piece[j] = j < nb ? src[j] : 0;
        }
      }
    }
  };

  // MASK == 2: the effective end of the chunk, found before any K/V is requested: one past its
  // last key that the mask leaves visible to some row (keys past it are hidden for every row, so
  // they need not be read; a chunk with none reads nothing and writes lse -inf). One pass over the
  // chunk's mask rows (coalesced, 8 loads in flight per thread); for a chunk with visible keys it
  // delays the first K/V tile by about one mask read. With p.mask_skip the same pass finds the
  // first position whose term is not 0 in any row (hidden, a bias, NaN): none below the effective
  // end means the mask changes nothing there (a static cache's causal mask, one row or identical
  // rows), and the loop runs as without a mask (keys at or past the end are out of the loop's
  // `key < end` anyway).
  if constexpr (MASK == 2) {
    const int lim = min(end, mlen);
    const bool track_nz = p.mask_skip;
    int last = start, first_nz = lim;
    for (int t = 0; t < mrows; ++t) {
      const unsigned char* row = mask_row(t);
#pragma unroll 8
      for (int pos = start + tid; pos < lim; pos += BT) {
        const float term = mask_term_at(row + static_cast<int64_t>(pos) * mE, mdt);
        if (term != -INFINITY) last = max(last, pos + 1);  // NaN: visible
        if (track_nz && !(term == 0.f)) first_nz = min(first_nz, pos);
      }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) last = max(last, __shfl_xor_sync(0xffffffffu, last, o));
    if (track_nz) {
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) first_nz = min(first_nz, __shfl_xor_sync(0xffffffffu, first_nz, o));
      if (lane == 0) nz_s[warp] = first_nz;
    }
    if (lane == 0) eff_s[warp] = last;
    __syncthreads();
#pragma unroll
    for (int w = 0; w < BW; ++w) last = max(last, eff_s[w]);
    end = min(end, last);
    if (track_nz) {
#pragma unroll
      for (int w = 0; w < BW; ++w) first_nz = min(first_nz, nz_s[w]);
      mask_live = first_nz < end;
      if (!mask_live && tid == 0 && end > start) g_mask_skipped = 1u;  // (tests: _decode_stats)
    }
  }

  const int ntiles = (end - start + kMKeys - 1) / kMKeys;
  const int gtiles = (ntiles - grp + NG - 1) / NG;  // this group's tiles: grp, grp + NG, ...
  auto slot_of = [&](int li) { return grp * STAGES + li % STAGES; };  // slot of the group's li-th tile
  if constexpr (TMA) {
    if (tid == 0) {
#pragma unroll
      for (int s = 0; s < SLOTS; ++s) gpu::tma::mbar_init(gpu::mma::smem_u32(&full_s[s]), 1);
      gpu::tma::fence_mbar_init();
      gpu::tma::prefetch_map(map_k);
      gpu::tma::prefetch_map(map_v);
    }
    __syncthreads();
  }
  // (TMA, paged: the pages of the first tiles are read at once, not one round trip per tile)
  [[maybe_unused]] int first_pages[PAGED && TMA ? STAGES - 1 : 1][PAGED && TMA ? kMaxPages : 1];
  if constexpr (PAGED && TMA) {
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) fetch_pages(s * NG + grp, first_pages[s]);
  }
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < gtiles) {
      if constexpr (PAGED && TMA) {
#pragma unroll
        for (int i = 0; i < kMaxPages; ++i) tpage[i] = first_pages[s][i];
      } else {
        fetch_table(s);
      }
      load_tile(s * NG + grp, slot_of(s));
      load_mask(s * NG + grp, slot_of(s));
    }
    gpu::mma::cp_async_commit();
  }
  fetch_table((STAGES - 1) * NG + grp);  // the group's next tile after the prologue's

  const float qscale = p.scale * kLog2e;
  // row r (token t = r % T) sees keys 0 .. len - T + t; padding rows see none
  const int lim0 = g < rows ? len - T_ + g % T_ : -1;
  const int lim1 = g + 8 < rows ? len - T_ + (g + 8) % T_ : -1;

  // MASK == 2: this lane's two stage rows (rows g and g + 8)
  int mofs0 = 0, mofs1 = 0;
  if constexpr (MASK == 2) {
    const int t0 = mrows == 1 ? 0 : g % T_, t1 = mrows == 1 ? 0 : (g + 8) % T_;
    mofs0 = t0 * mrowb + static_cast<int>(reinterpret_cast<uintptr_t>(mask_row(t0)) & 15);
    mofs1 = t1 * mrowb + static_cast<int>(reinterpret_cast<uintptr_t>(mask_row(t1)) & 15);
  }

  float acc[NT][4];
#pragma unroll
  for (int n = 0; n < NT; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;
  float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.f, l1 = 0.f;  // rows g, g + 8 (l: this lane's part)

#pragma unroll 1
  for (int li = 0; li < gtiles; ++li) {  // the group's li-th tile: tile `it` of the chunk, in `slot`
    const int it = li * NG + grp, slot = slot_of(li);
    gpu::mma::cp_async_wait<STAGES - 2>();  // (TMA: the mask pieces)
    if constexpr (TMA) {
      gpu::tma::mbar_wait(gpu::mma::smem_u32(&full_s[slot]), (li / STAGES) & 1);
      // the chunk's last tile: V rows past its end may hold anything (NaN times a zero weight is NaN)
      const int valid = end - (start + it * kMKeys);
      if (valid < kMKeys) {
        T* vt = ring + slot * STAGE + kMKeys * D;
        for (int i = gtid; i < (kMKeys - valid) * CH; i += kMThreads) {
          const int kr = valid + i / CH, c = i % CH;
          *reinterpret_cast<uint4*>(const_cast<T*>(piece_at(vt, kr, c))) = make_uint4(0u, 0u, 0u, 0u);
        }
      }
    }
    // tile `it` is in shared memory for the group; the slot of its previous tile is free
    if constexpr (NG == 1) __syncthreads();
    else gpu::tma::named_sync(1 + grp, kMThreads);
    if (li + STAGES - 1 < gtiles) {
      load_tile(it + (STAGES - 1) * NG, slot_of(li + STAGES - 1));
      load_mask(it + (STAGES - 1) * NG, slot_of(li + STAGES - 1));
      fetch_table(it + STAGES * NG);  // the group's tile after the one just requested
    }
    gpu::mma::cp_async_commit();

    const T* ks = ring + slot * STAGE;
    const T* vs = ks + kMKeys * ROW;
    const int kw = start + it * kMKeys + gwarp * 16;  // this warp's first key

    // masked: the mask terms of this lane's 8 scores, loaded before the products that hide them
    float mk[MASK ? 2 : 1][MASK ? 4 : 1];
    if constexpr (MASK == 2) {
      if (!mask_live) {
#pragma unroll
        for (int j = 0; j < 2; ++j) mk[j][0] = mk[j][1] = mk[j][2] = mk[j][3] = 0.f;
      } else {
        const unsigned char* st = mring + slot * mstage + (gwarp * 16 + 2 * tq) * mE;
#pragma unroll
        for (int j = 0; j < 2; ++j)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int key = kw + 8 * j + 2 * tq + e;
            const bool in = key < mlen;
            mk[j][e] = in ? mask_term_at(st + mofs0 + (8 * j + e) * mE, mdt) : -INFINITY;
            mk[j][2 + e] = in ? mask_term_at(st + mofs1 + (8 * j + e) * mE, mdt) : -INFINITY;
          }
      }
    } else if constexpr (MASK == 1) {
#pragma unroll
      for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int key = kw + 8 * j + 2 * tq + e;
          mk[j][e] = key < end && g < rows ? mask_log2(p.mask, b, g % T_, key) : 0.f;
          mk[j][2 + e] = key < end && g + 8 < rows ? mask_log2(p.mask, b, (g + 8) % T_, key) : 0.f;
        }
    }

    // S = Q K^T for this warp's 16 keys: s[j] is keys 8j..8j+7 (c0 c1 row g, c2 c3 row g + 8); the
    // even and odd k steps accumulate apart (s and s_odd), two dependent chains of D / 32 mmas
    // instead of one of D / 16, added at the end
    float s[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
    float s_odd[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
    for (int kt = 0; kt < KT; ++kt) {
      uint32_t kf[4];
      gpu::mma::ldmatrix_x4(kf, piece_at(ks, gwarp * 16 + (lane / 16) * 8 + lane % 8, kt * 2 + (lane / 8) % 2));
      float (&acc_s)[2][4] = kt % 2 == 0 ? s : s_odd;
      gpu::mma::mma_16816<T>(acc_s[0], qf[kt], kf[0], kf[1]);
      gpu::mma::mma_16816<T>(acc_s[1], qf[kt], kf[2], kf[3]);
    }
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[j][e] += s_odd[j][e];

    // mask, log2 domain, online softmax (the quad of a row reduces with two shuffles)
    float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int key = kw + 8 * j + 2 * tq + e;
        const bool in = key < end;
        float m_lo = 0.f, m_hi = 0.f;
        if constexpr (MASK != 0) {
          m_lo = mk[j][e];
          m_hi = mk[j][2 + e];
        }
        s[j][e] = in && key <= lim0 ? s[j][e] * qscale + m_lo : -INFINITY;
        s[j][2 + e] = in && key <= lim1 ? s[j][2 + e] * qscale + m_hi : -INFINITY;
        mx0 = fmaxf(mx0, s[j][e]);
        mx1 = fmaxf(mx1, s[j][2 + e]);
      }
    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
    mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
    mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
    const float mn0 = fmaxf(m0, mx0), mn1 = fmaxf(m1, mx1);
    // a row that has seen no key yet keeps -inf; subtracting 0 then gives ex2(-inf) = 0
    const float base0 = mn0 == -INFINITY ? 0.f : mn0, base1 = mn1 == -INFINITY ? 0.f : mn1;
    const float alpha0 = gpu::mma::ex2_approx(m0 - base0), alpha1 = gpu::mma::ex2_approx(m1 - base1);
    m0 = mn0;
    m1 = mn1;
    float ps0 = 0.f, ps1 = 0.f;
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        s[j][e] = gpu::mma::ex2_approx(s[j][e] - base0);
        s[j][2 + e] = gpu::mma::ex2_approx(s[j][2 + e] - base1);
        ps0 += s[j][e];
        ps1 += s[j][2 + e];
      }
    l0 = l0 * alpha0 + ps0;
    l1 = l1 * alpha1 + ps1;
#pragma unroll
    for (int n = 0; n < NT; ++n) {
      acc[n][0] *= alpha0;
      acc[n][1] *= alpha0;
      acc[n][2] *= alpha1;
      acc[n][3] *= alpha1;
    }

    // O += P V: P (16 rows x 16 keys) as one A fragment, V^T pieces through ldmatrix.trans
    const uint32_t pa[4] = {gpu::mma::pack2<T>(s[0][0], s[0][1]), gpu::mma::pack2<T>(s[0][2], s[0][3]),
                            gpu::mma::pack2<T>(s[1][0], s[1][1]), gpu::mma::pack2<T>(s[1][2], s[1][3])};
#pragma unroll
    for (int dp = 0; dp < NT / 2; ++dp) {
      uint32_t vf[4];
      gpu::mma::ldmatrix_x4_trans(vf, piece_at(vs, gwarp * 16 + ((lane / 8) % 2) * 8 + lane % 8, dp * 2 + lane / 16));
      gpu::mma::mma_16816<T>(acc[2 * dp], pa, vf[0], vf[1]);
      gpu::mma::mma_16816<T>(acc[2 * dp + 1], pa, vf[2], vf[3]);
    }
  }
  gpu::mma::cp_async_wait<0>();
  __syncthreads();  // the ring is free: reused for the combination below

  // combine the warps (all groups'): a common max per row, then the sum of the rescaled (l, O)
  float* o_part = reinterpret_cast<float*>(smem);   // [BW][kMRows][D]
  float* o_s = o_part + BW * kMRows * D;            // [kMRows][D]
  float* l_part = o_s + kMRows * D;                 // [BW][kMRows]
  float* wts = l_part + BW * kMRows;                // [kMRows][kMaxSplits]
  float4* part_s = reinterpret_cast<float4*>(wts + kMRows * kMaxSplits);  // [BT]
  l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
  l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
  l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
  l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
  if (tq == 0) {
    m_s[warp][g] = m0;
    m_s[warp][g + 8] = m1;
  }
  const bool any_bad = __syncthreads_or(bad ? 1 : 0) != 0;
  float mb0 = -INFINITY, mb1 = -INFINITY;
#pragma unroll
  for (int w = 0; w < BW; ++w) {
    mb0 = fmaxf(mb0, m_s[w][g]);
    mb1 = fmaxf(mb1, m_s[w][g + 8]);
  }
  const float f0 = m0 == -INFINITY ? 0.f : gpu::mma::ex2_approx(m0 - mb0);
  const float f1 = m1 == -INFINITY ? 0.f : gpu::mma::ex2_approx(m1 - mb1);
  float* op0 = o_part + (warp * kMRows + g) * D + 2 * tq;
  float* op1 = op0 + 8 * D;
#pragma unroll
  for (int n = 0; n < NT; ++n) {
    *reinterpret_cast<float2*>(op0 + n * 8) = make_float2(acc[n][0] * f0, acc[n][1] * f0);
    *reinterpret_cast<float2*>(op1 + n * 8) = make_float2(acc[n][2] * f1, acc[n][3] * f1);
  }
  if (tq == 0) {
    l_part[warp * kMRows + g] = l0 * f0;
    l_part[warp * kMRows + g + 8] = l1 * f1;
  }
  if (warp == 0 && tq == 0) {
    lse_s[g] = mb0;
    lse_s[g + 8] = mb1;
  }
  __syncthreads();
  for (int i = tid; i < rows * D; i += BT) {
    float a = 0.f;
#pragma unroll
    for (int w = 0; w < BW; ++w) a += o_part[w * kMRows * D + i];
    o_s[i] = a;
  }
  if (tid < rows) {
    float lb = 0.f;
#pragma unroll
    for (int w = 0; w < BW; ++w) lb += l_part[w * kMRows + tid];
    tot_s[tid] = lb;
  }
  __syncthreads();
  if constexpr (TMA) {
    if (p.cluster_merge) {
      cluster_finish<T, D, BT>(p, b, hk, split, rows, o_s, tot_s, lse_s, any_bad, wts);
      return;
    }
  }
  finish_split_block<T, D, BT>(p, b, hk, split, rows, o_s, tot_s, lse_s, any_bad, wts, part_s, last_s);
}

template <typename T, int D, bool PAGED, int MASK>
__global__ void __launch_bounds__(kMThreads, 2) decode_mma_kernel(DecodeParams p) {
  decode_mma_body<T, D, PAGED, MASK, false, 1>(p, nullptr, nullptr);
}

// Its body exists only in sm_90a code (gpu::tma::kernel_built tells the host); a stub elsewhere.
// NG warp groups of 4 warps (decode_mma_body; 2: one block per multiprocessor).
template <typename T, int D, bool PAGED, int MASK, int NG>
__global__ void __launch_bounds__(kMThreads * NG, NG == 1 ? 2 : 1)
    decode_mma_tma_kernel(DecodeParams p, const __grid_constant__ CUtensorMap map_k,
                          const __grid_constant__ CUtensorMap map_v) {
#if LLMK_HAS_WGMMA
  decode_mma_body<T, D, PAGED, MASK, true, NG>(p, &map_k, &map_v);
#else
  (void)p;
  (void)map_k;
  (void)map_v;
#endif
}

// The warp groups of decode_mma_tma_kernel for this launch: 2 (one block of 8 warps per
// multiprocessor, two tiles in flight through the math at once) where the grid has no more blocks
// than multiprocessors (so that each would run one block of 4 warps, a single dependent chain per
// scheduler) and the splits do not merge in a cluster; else 1. Paged caches too (each group's
// issuing thread reads its own tiles' pages): H100 2026-12-05, b1 kv4096 pages of 16, 16.68 against
// 16.93-16.95 us a call in a CUDA graph; forced at b2 (beyond this rule) 29.0 against 22.4
// (bench/results/h100-decode-patches-portable-2026-12-05.md).
// Measured on the H200 (2026-12-03 13:31 UTC, do_bench us, two rounds each): the 1B model's step
// (8 blocks, D 64, 160 keys; bench_decode._model_step_attention) with HF's mask 10.4 / 11.0 with
// two groups against 11.4 / 12.4 with one (a 4096-slot cache: 13.1 / 13.1 against 14.0 / 14.0),
// with exact seq_lens 8.4 / 9.0 against 8.8 / 8.2 (10.8 against 10.4 at 4096 slots); but with
// the cluster merge no gain at b1 kv4096 (13.0 against 12.7-12.8 us a call in a CUDA graph) and a
// loss at b2 kv4096 (24.9 against 16.7; likely because 16 clusters of 8 one-block
// multiprocessors do not all fit at once, not verified). LLMK_DECODE_GROUPS=1 / 2 forces it (read
// at every call).
int mma_groups(const DecodeParams& p, dim3 grid) {
  const char* v = std::getenv("LLMK_DECODE_GROUPS");
  if (v != nullptr && *v != '\0') {
    if (std::strcmp(v, "1") == 0) return 1;
    if (std::strcmp(v, "2") == 0) return 2;
    fail(ErrorKind::value, "decode_attention", std::string("LLMK_DECODE_GROUPS: expected 1 or 2, got '") + v + "'");
  }
  const int64_t blocks = static_cast<int64_t>(grid.x) * grid.y * grid.z;
  return blocks <= gpu::multiprocessor_count(p.device.index) && !cluster_merge_applies(p) ? 2 : 1;
}

// The launch of decode_mma_tma_kernel (grid and mask stage bytes as decode_mma_kernel's), or false
// where it does not apply: a device other than compute capability 9.0 with its sm_90a body loaded,
// cache strides or a base TMA cannot express, positions past 32-bit coordinates, pages that
// tma_pages rules out.
template <typename T, int D, bool PAGED, int MASK, int NG>
bool mma_tma_launch_groups(const DecodeParams& p, dim3 grid, std::size_t mask_stage_bytes) {
  constexpr auto kernel = decode_mma_tma_kernel<T, D, PAGED, MASK, NG>;
  constexpr int threads = kMThreads * NG;
  // the opt-in covers the largest staged mask, as in mma_run
  constexpr std::size_t smem_max = mma_smem_bytes(D, MASK == 2 ? kMMaskRows * mask_row_bytes(4) : 0, true, NG);
  const int dev = p.device.index;
  const KvCache& c = p.cache;
  if (!gpu::tma::sm90_kernel_ready<kernel>(dev, smem_max, "decode_attention") || c.capacity >= (int64_t{1} << 31) ||
      (PAGED && !tma_pages(c)))
    return false;
  CUtensorMap map_k{}, map_v{};
  const bool f16 = std::is_same_v<T, half>;
  // one streaming pass: no L2 promotion (see make_tensor_map). Contiguous (B, Hkv, Smax, D): dims
  // (D, position, head, sequence), 64-row boxes; paged (num_blocks, block_size, Hkv, D): dims (D,
  // offset in the block, head, block), boxes of min(block size, 64) rows.
  const auto make = [&](CUtensorMap* map, const void* base, const int64_t* st) {
    if constexpr (PAGED) {
      const int64_t strides[3] = {st[0], st[1], st[2]};  // block, offset, head
      return gpu::tma::make_tensor_map(map, f16, base, D, c.block_size, p.kv_heads, c.num_blocks, strides,
                                       static_cast<int>(std::min<int64_t>(c.block_size, kMKeys)), false);
    } else {
      const int64_t strides[3] = {st[0], st[2], st[1]};  // sequence, position, head
      return gpu::tma::make_tensor_map(map, f16, base, D, c.capacity, p.kv_heads, p.batch, strides, kMKeys, false);
    }
  };
  if (!make(&map_k, c.k, c.k_strides) || !make(&map_v, c.v, c.v_strides)) return false;
  const std::size_t smem = mma_smem_bytes(D, mask_stage_bytes, true, NG);
  const int S = p.num_splits;
  if (cluster_merge_applies(p)) {
    // the splits of a head as one cluster, merged through distributed shared memory (cluster_finish)
    if (gpu::resident_clusters<kernel>(dev, static_cast<unsigned>(S), dim3(threads), smem_max) > 0) {
      DecodeParams q = p;
      q.cluster_merge = true;
      gpu::launch_cluster(kernel, grid, threads, smem, gpu::as_stream(p.stream), static_cast<unsigned>(S),
                          gpu::pdl_enabled(dev), q, map_k, map_v);
      gpu::check_launch("decode_attention");
      return true;
    }
  }
  zero_split_counters(p);
  gpu::launch(kernel, grid, threads, smem, gpu::as_stream(p.stream), gpu::pdl_enabled(dev), p, map_k, map_v);
  gpu::check_launch("decode_attention");
  return true;
}

// decode_mma_tma_kernel with the warp groups mma_groups asks for.
template <typename T, int D, bool PAGED, int MASK>
bool mma_tma_launch(const DecodeParams& p, dim3 grid, std::size_t mask_stage_bytes) {
  if (mma_groups(p, grid) == 2) return mma_tma_launch_groups<T, D, PAGED, MASK, 2>(p, grid, mask_stage_bytes);
  return mma_tma_launch_groups<T, D, PAGED, MASK, 1>(p, grid, mask_stage_bytes);
}

// Blocks of decode_mma_kernel per multiprocessor (launch == false), or its launch (that of
// decode_mma_tma_kernel where p.tma asks for it and it applies). The opt-in to its dynamic shared
// memory and the occupancy are set / read once per device.
template <typename T, int D, bool PAGED, int MASK>
int mma_run(const DecodeParams& p, bool launch) {
  auto kernel = decode_mma_kernel<T, D, PAGED, MASK>;
  // MASK 2: the opt-in covers the largest staged mask (8 rows of f32); a launch asks for its own
  constexpr std::size_t smem_max = mma_smem_bytes(D, MASK == 2 ? kMMaskRows * mask_row_bytes(4) : 0);
  const std::size_t mask_stage =
      MASK == 2 ? static_cast<std::size_t>(p.mask.strides[1] == 0 ? 1 : p.tokens) * mask_row_bytes(mask_elem_bytes(p.mask.dtype))
                : 0;
  const std::size_t smem = MASK == 2 ? mma_smem_bytes(D, mask_stage) : smem_max;
  static std::atomic<int> per_sm[64];  // 0: not prepared on that device yet
  const int dev = p.device.index;
  int blocks = dev >= 0 && dev < 64 ? per_sm[dev].load() : 0;
  if (blocks == 0) {
    gpu::check(gpuFuncSetAttribute(kernel, gpuFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem_max)),
               "decode_attention", "setting the shared memory size");
    blocks = gpu::resident_blocks(kernel, kMThreads, smem, "decode_attention");
    if (dev >= 0 && dev < 64) per_sm[dev].store(blocks);
  }
  if (!launch) return blocks;
  const dim3 grid(p.num_splits, static_cast<unsigned>(p.kv_heads), static_cast<unsigned>(p.batch));
  if (p.tma && mma_tma_launch<T, D, PAGED, MASK>(p, grid, mask_stage)) return 0;
  zero_split_counters(p);
  gpu::launch(kernel, grid, kMThreads, smem, gpu::as_stream(p.stream), gpu::pdl_enabled(p.device.index), p);
  gpu::check_launch("decode_attention");
  return 0;
}

// The staged mask (MASK 2) needs a contiguous last dim and element-aligned rows; other masks take
// the per-lane loads (MASK 1). The plan (launch == false) reads the unmasked kernel's occupancy, so
// that the split plan and the workspace size never depend on the mask (decode_workspace_size
// takes none); the masked kernels fit the same blocks per multiprocessor (same launch bounds,
// shared memory within the same count).
template <typename T, int D>
int mma_layout(const DecodeParams& p, bool launch) {
  if (launch && p.mask.data) {
    const bool staged = p.mask_prefetch && (p.mask.strides[2] == 1 || p.mask.len <= 1) &&
                        reinterpret_cast<uintptr_t>(p.mask.data) % mask_elem_bytes(p.mask.dtype) == 0;
    if (staged) return p.cache.paged ? mma_run<T, D, true, 2>(p, launch) : mma_run<T, D, false, 2>(p, launch);
    return p.cache.paged ? mma_run<T, D, true, 1>(p, launch) : mma_run<T, D, false, 1>(p, launch);
  }
  return p.cache.paged ? mma_run<T, D, true, 0>(p, launch) : mma_run<T, D, false, 0>(p, launch);
}

template <typename T>
int mma_dim(const DecodeParams& p, bool launch) {
  return p.head_dim == 64 ? mma_layout<T, 64>(p, launch) : mma_layout<T, 128>(p, launch);
}

}  // namespace
}  // namespace llmk::detail
#endif  // LLMK_MMA_SYNC_BUILD
