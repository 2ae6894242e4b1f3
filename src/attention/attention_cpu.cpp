// Attention on the CPU, flash-style: a work item is a block of up to kRows queries of one
// (batch, query head); it walks the keys in tiles of kKeys, computes the block's scores against
// the tile (S = Q K^T, with K converted to fp32 and transposed so that the loops run over keys
// innermost), and folds them into each query's online softmax (running max m, running sum l,
// running output o rescaled when m grows). Both products run in register tiles of 4 queries x 16
// scores or output dims (core/cpu_tiles.h). Memory stays O(kRows * D) per thread
// whatever the sequence length. fp32 arithmetic; exp from core/vector_math.h so that its loop
// vectorises. Work items are split over the installed threads (core/parallel.h); each query's
// sums run in the same order whatever the thread count or SIMD clone.
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

// One thread's tiles: the block's scaled queries, the K tile transposed, the V tile, the
// scores, the running outputs and the softmax state of each query (running max and sum; the
// current tile's new max, rescale factor and count of visible keys).
struct Scratch {
  std::vector<float> q, kt, v, s, o, m, l, m_new, rescale;
  std::vector<int64_t> seen;
  explicit Scratch(int64_t D)
      : q(kRows * D), kt(panels_size(D, kKeys)), v(panels_size(kKeys, D)), s(kRows * kKeys), o(kRows * D),
        m(kRows), l(kRows), m_new(kRows), rescale(kRows), seen(kRows) {}
};

// The max and the sum of a tile's kKeys values, in 8 lanes (element j in lane j % 8) combined
// in a fixed order: vectorised, and the same rounding in every clone. (A running sum in key order
// would be a chain of dependent adds as long as the tile.)
[[gnu::always_inline]] inline float lanes_max(const float* x) {
  float lane[8];
  std::copy(x, x + 8, lane);
  for (int64_t c = 8; c < kKeys; c += 8)
    for (int i = 0; i < 8; ++i) lane[i] = std::max(lane[i], x[c + i]);
  return std::max(std::max(std::max(lane[0], lane[1]), std::max(lane[2], lane[3])),
                  std::max(std::max(lane[4], lane[5]), std::max(lane[6], lane[7])));
}
[[gnu::always_inline]] inline float lanes_sum(const float* x) {
  float lane[8];
  std::copy(x, x + 8, lane);
  for (int64_t c = 8; c < kKeys; c += 8)
    for (int i = 0; i < 8; ++i) lane[i] += x[c + i];
  return ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
}

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
  for (int64_t r = 0; r < rows; ++r) {
    const T* q = static_cast<const T*>(p.q) + b * p.q_strides[0] + (sp.q_start + i0 + r) * p.q_strides[1] +
                 h * p.q_strides[2];
    for (int64_t d = 0; d < D; ++d) w.q[r * D + d] = to_float(q[d]) * p.scale;
    std::fill_n(&w.o[r * D], D, 0.f);
    w.m[r] = neg_inf;
    w.l[r] = 0.f;
  }
  const int64_t keys = visible(i0 + rows - 1);  // the block's last query sees the most
  for (int64_t j0 = 0; j0 < keys; j0 += kKeys) {
    const int64_t n = std::min(kKeys, keys - j0);
    for (int64_t jj = 0; jj < n; ++jj) {
      const int64_t kj = sp.k_start + j0 + jj;
      const T* k = static_cast<const T*>(p.k) + b * p.k_strides[0] + kj * p.k_strides[1] + hk * p.k_strides[2];
      const T* v = static_cast<const T*>(p.v) + b * p.v_strides[0] + kj * p.v_strides[1] + hk * p.v_strides[2];
      // K^T in panels (terms d, columns keys), V in panels (terms keys, columns d): cpu_tiles.h
      float* kt = &w.kt[jj / kPanel * D * kPanel + jj % kPanel];
      for (int64_t d = 0; d < D; ++d) kt[d * kPanel] = to_float(k[d]);
      for (int64_t d0 = 0; d0 < D; d0 += kPanel) {  // a panel's row at a time: a vector copy
        float* vp = &w.v[d0 / kPanel * kKeys * kPanel + jj * kPanel];
        for (int64_t c = 0; c < std::min(kPanel, D - d0); ++c) vp[c] = to_float(v[d0 + c]);
      }
    }
    // S = Q K^T over the whole tile; the columns past its n keys (stale K) are never read: the
    // softmax below hides every key a query does not see, and P V sums at most n keys.
    std::fill_n(w.s.data(), rows * kKeys, 0.f);
    panels_accumulate(w.s.data(), kKeys, w.q.data(), 1, D, w.kt.data(), D, D, rows, kKeys);
    // Each query's online softmax over the keys it sees here; its weights replace its scores,
    // zeros past them, so that the block shares one pass over V. In passes over the block's rows
    // (new maxima, rescale factors, weights, outputs rescaled), so that the rows' exps vectorise.
    int64_t block_keys = 0;
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t seen = std::clamp<int64_t>(visible(i0 + r) - j0, 0, n);
      float* sr = &w.s[r * kKeys];
      block_keys = std::max(block_keys, seen);
      w.seen[r] = seen;
      if (seen == 0) {  // keeps its state: rescale 1 (or 0 while it has seen nothing), weights 0
        std::fill_n(sr, kKeys, 0.f);
        w.m_new[r] = w.m[r];
        continue;
      }
      std::fill(sr + seen, sr + kKeys, neg_inf);  // keys it does not see: weight exp(-inf) = 0
      w.m_new[r] = std::max(w.m[r], lanes_max(sr));
    }
    for (int64_t r = 0; r < rows; ++r)
      w.rescale[r] = w.m[r] == neg_inf ? 0.f : exp_vectorisable(w.m[r] - w.m_new[r]);
    for (int64_t r = 0; r < rows; ++r) {
      if (w.seen[r] == 0) continue;
      float* sr = &w.s[r * kKeys];
      const float m_new = w.m_new[r];
      for (int64_t jj = 0; jj < kKeys; ++jj) sr[jj] = exp_vectorisable(sr[jj] - m_new);
      w.l[r] = w.l[r] * w.rescale[r] + lanes_sum(sr);
      w.m[r] = m_new;
    }
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t d = 0; d < D; ++d) w.o[r * D + d] *= w.rescale[r];
    panels_accumulate(w.o.data(), D, w.s.data(), 1, kKeys, w.v.data(), kKeys, block_keys, rows, D);  // O += P V
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
