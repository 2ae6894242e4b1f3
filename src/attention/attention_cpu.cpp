// Attention on the CPU, flash-style: a work item is a block of up to kRows queries of one
// (batch, query head); it walks the keys in tiles of kKeys, computes the tile's scores for the
// whole block transposed (S^T = K Q^T: a key per row, the block's queries across it, with Q^T packed
// once per block, so K is only converted, never transposed), and folds them into each query's
// online softmax (running max m, running sum l, running output o rescaled when m grows), whose
// steps run across the queries, one vector of them at a time. Both products run in register
// tiles of 4 rows x 16 columns (core/cpu_tiles.h): S^T with K's rows against Q^T's panels, O += P V
// with P read from S^T. Memory stays O(kRows * D) per thread whatever the sequence length. fp32
// arithmetic; exp from core/vector_math.h so that its loop vectorises. Work items are split over
// the installed threads (core/parallel.h); each query's sums run in the same order whatever the
// thread count or SIMD clone.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "attention/attention_internal.h"
#include "core/check.h"
#include "core/cpu_tiles.h"
#include "core/half.h"
#include "core/parallel.h"
#include "core/vector_math.h"

namespace llmk::detail {

namespace {

constexpr int64_t kKeys = 64;  // keys per tile
constexpr int64_t kRows = 128;  // queries per work item (128: 15-25% faster than 32, fewer K / V packings)
constexpr int kSumLanes = 8;  // a query's tile sum runs in 8 lanes (key j in lane j % 8), then a fixed tree
static_assert(kSumLanes == 8, "attend_block's tree adds exactly 8 lanes");

// One thread's tiles: the block's scaled queries transposed (panels), the K tile, the V tile
// (panels), the transposed scores (kKeys x kRows), the running outputs, each query's softmax state
// (running max and sum; this tile's max, then the exps' base; rescale factor; count of visible
// keys) and the lanes of its tile sum.
struct Scratch {
  std::vector<float> qt, k, v, st, o, m, l, m_new, rescale, lanes;
  std::vector<int32_t> seen;
  explicit Scratch(int64_t D)
      : qt(panels_size(D, kRows)), k(kKeys * D), v(panels_size(kKeys, D)), st(kKeys * kRows), o(kRows * D), m(kRows),
        l(kRows), m_new(kRows), rescale(kRows), lanes(kSumLanes * kRows), seen(kRows) {}
};

// Queries [i0, i0 + rows) of (batch b, query head h), compiled per SIMD width (LLMK_CPU_CLONES).
template <typename T>
LLMK_CPU_CLONES void attend_block(const AttentionParams& p, int64_t b, int64_t h, int64_t i0, int64_t rows,
                                  Scratch& w) {
  const int64_t D = p.head_dim, hk = h / (p.q_heads / p.kv_heads);
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const SeqSpan sp = seq_span(p, b);
  // Keys query i sees: [0, visible(i)).
  auto visible = [&](int64_t i) {
    return p.causal ? std::clamp<int64_t>(i + sp.diagonal_offset + 1, 0, sp.kv_len) : sp.kv_len;
  };
  const T* q0 = static_cast<const T*>(p.q) + b * p.q_strides[0] + (sp.q_start + i0) * p.q_strides[1] +
                h * p.q_strides[2];
  pack_panels(D, rows, w.qt.data(), [&](int64_t d, int64_t r) { return to_float(q0[r * p.q_strides[1] + d]) * p.scale; });
  std::fill_n(w.o.data(), rows * D, 0.f);
  std::fill_n(w.m.data(), rows, neg_inf);
  std::fill_n(w.l.data(), rows, 0.f);
  float* st = w.st.data();
  const int64_t keys = visible(i0 + rows - 1);  // the block's last query sees the most
  for (int64_t j0 = 0; j0 < keys; j0 += kKeys) {
    const int64_t n = std::min(kKeys, keys - j0);
    for (int64_t jj = 0; jj < n; ++jj) {
      const int64_t kj = sp.k_start + j0 + jj;
      const T* k = static_cast<const T*>(p.k) + b * p.k_strides[0] + kj * p.k_strides[1] + hk * p.k_strides[2];
      const T* v = static_cast<const T*>(p.v) + b * p.v_strides[0] + kj * p.v_strides[1] + hk * p.v_strides[2];
      for (int64_t d = 0; d < D; ++d) w.k[jj * D + d] = to_float(k[d]);
      for (int64_t d0 = 0; d0 < D; d0 += kPanel) {  // V in panels (terms keys, columns d), a row at a time
        float* vp = &w.v[d0 / kPanel * kKeys * kPanel + jj * kPanel];
        for (int64_t c = 0; c < std::min(kPanel, D - d0); ++c) vp[c] = to_float(v[d0 + c]);
      }
    }
    // S^T (n keys x the block's queries) = K Q^T, each score summed over d in order.
    std::fill_n(st, n * kRows, 0.f);
    panels_accumulate(st, kRows, w.k.data(), 1, D, w.qt.data(), D, D, n, rows);
    // The online softmax, across the queries: keys a query does not see get weight exp(-inf) = 0.
    int32_t block_keys = 0, fewest_keys = static_cast<int32_t>(n);
    for (int64_t r = 0; r < rows; ++r) {
      w.seen[r] = static_cast<int32_t>(std::clamp<int64_t>(visible(i0 + r) - j0, 0, n));
      block_keys = std::max(block_keys, w.seen[r]);
      fewest_keys = std::min(fewest_keys, w.seen[r]);
    }
    if (fewest_keys < n)  // a tile on the causal diagonal
      for (int64_t jj = 0; jj < n; ++jj)
        for (int64_t r = 0; r < rows; ++r) st[jj * kRows + r] = jj < w.seen[r] ? st[jj * kRows + r] : neg_inf;
    std::copy_n(w.m.data(), rows, w.m_new.data());
    for (int64_t jj = 0; jj < n; ++jj)
      for (int64_t r = 0; r < rows; ++r) w.m_new[r] = std::max(w.m_new[r], st[jj * kRows + r]);
    for (int64_t r = 0; r < rows; ++r) {
      w.rescale[r] = w.m[r] == neg_inf ? 0.f : exp_vectorisable(w.m[r] - w.m_new[r]);
      w.m[r] = w.m_new[r];
      w.m_new[r] = w.m[r] == neg_inf ? 0.f : w.m[r];  // now the exps' base: 0 while nothing is seen (weights 0)
    }
    for (int64_t jj = 0; jj < n; ++jj)
      for (int64_t r = 0; r < rows; ++r) st[jj * kRows + r] = exp_vectorisable(st[jj * kRows + r] - w.m_new[r]);
    float* lanes = w.lanes.data();
    std::fill_n(lanes, kSumLanes * kRows, 0.f);
    for (int64_t jj = 0; jj < n; ++jj)
      for (int64_t r = 0; r < rows; ++r) lanes[jj % kSumLanes * kRows + r] += st[jj * kRows + r];
    for (int64_t r = 0; r < rows; ++r) {
      const float* x = lanes + r;
      const float sum = ((x[0] + x[kRows]) + (x[2 * kRows] + x[3 * kRows])) +
                        ((x[4 * kRows] + x[5 * kRows]) + (x[6 * kRows] + x[7 * kRows]));
      w.l[r] = w.l[r] * w.rescale[r] + sum;
    }
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t d = 0; d < D; ++d) w.o[r * D + d] *= w.rescale[r];
    panels_accumulate(w.o.data(), D, st, kRows, 1, w.v.data(), kKeys, block_keys, rows, D);  // O += P V
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t qi = sp.q_start + i0 + r;
    T* out = static_cast<T*>(p.out) + b * p.out_strides[0] + qi * p.out_strides[1] + h * p.out_strides[2];
    const float l = w.l[r], inv = l > 0.f ? 1.f / l : 0.f;  // no visible key: zeros, as PyTorch's SDPA gives
    for (int64_t d = 0; d < D; ++d) out[d] = from_float<T>(w.o[r * D + d] * inv);
    if (p.lse)
      p.lse[b * p.lse_strides[0] + h * p.lse_strides[1] + qi * p.lse_strides[2]] =
          l > 0.f ? w.m[r] + std::log(l) : neg_inf;
  }
}

template <typename T>
void run(const AttentionParams& p) {
  const int64_t blocks = (p.q_len + kRows - 1) / kRows;  // per (batch, head); q_len bounds varlen sequences
  const int64_t item_work = kRows * p.kv_len * p.head_dim;
  parallel_rows(p.batch * p.q_heads * blocks, grain_for(item_work), [&](int64_t begin, int64_t end) {
    Scratch scratch(p.head_dim);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t pair = item / blocks, i0 = item % blocks * kRows;
      const int64_t b = pair / p.q_heads, h = pair % p.q_heads;
      const int64_t rows = std::min(kRows, seq_span(p, b).q_len - i0);
      if (rows > 0) attend_block<T>(p, b, h, i0, rows, scratch);
    }
  });
}

}  // namespace

void attention_cpu(const AttentionParams& p) {
  switch (p.dtype) {
    case DType::f32: run<float>(p); break;
    case DType::f16: run<Half>(p); break;
    case DType::bf16: run<BFloat16>(p); break;
    default: fail(ErrorKind::type, "attention", "unsupported dtype");
  }
}

}  // namespace llmk::detail
