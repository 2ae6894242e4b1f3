// Attention on the CPU, flash-style: a work item is a block of up to kRows queries of one
// (batch, query head); it walks the keys in tiles of kKeys, computes the block's scores against
// the tile (S = Q K^T, with K converted to fp32 and transposed so that the loops run over keys
// innermost), and folds them into each query's online softmax (running max m, running sum l,
// running output o rescaled when m grows). Groups of kGroup queries keep 4 x 16 tiles of their
// scores, then of their outputs, in SIMD registers while the sum over the head dim, then over
// the tile's keys, runs (tile_scores, tile_values). Memory stays O(kRows * D) per thread
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
#include "core/half.h"
#include "core/parallel.h"
#include "core/vector_math.h"

namespace llmk::detail {

namespace {

constexpr int64_t kKeys = 64;  // keys per tile
constexpr int64_t kRows = 32;  // queries per work item
constexpr int64_t kGroup = 4;  // queries whose sums stay in registers together

// One thread's tiles: the block's scaled queries, the K tile transposed, the V tile, the
// scores, the running outputs and the softmax state of each query.
struct Scratch {
  std::vector<float> q, kt, v, s, o, m, l;
  explicit Scratch(int64_t D)
      : q(kRows * D), kt(D * kKeys), v(kKeys * D), s(kRows * kKeys), o(kRows * D), m(kRows), l(kRows) {}
};

// 8 floats in one value (GCC / Clang vector extension): AVX registers in the AVX2 and AVX-512
// clones, pairs of SSE registers in the baseline one. The two loops below keep an R x 16 tile of
// sums in registers instead of reloading and storing a row of them for every term.
// (Inlined everywhere, so GCC's note that passing one by value changes the ABI does not apply.)
#if defined(__GNUC__)  // GCC and Clang
#pragma GCC diagnostic ignored "-Wpsabi"
#endif
using Float8 = float __attribute__((vector_size(32)));
[[gnu::always_inline]] inline Float8 load8(const float* p) {
  Float8 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
[[gnu::always_inline]] inline void store8(float* p, Float8 v) { std::memcpy(p, &v, sizeof v); }

// Scores of R queries against a tile: s[r][j] = sum over d (in order) of q[r][d] * kt[d][j].
template <int R>
[[gnu::always_inline]] inline void tile_scores(const float* q, int64_t D, const float* kt, float* s) {
  for (int64_t c = 0; c < kKeys; c += 16) {
    Float8 acc[R][2] = {};
    for (int64_t d = 0; d < D; ++d) {
      const Float8 k0 = load8(kt + d * kKeys + c), k1 = load8(kt + d * kKeys + c + 8);
      for (int r = 0; r < R; ++r) {
        acc[r][0] += q[r * D + d] * k0;
        acc[r][1] += q[r * D + d] * k1;
      }
    }
    for (int r = 0; r < R; ++r) {
      store8(s + r * kKeys + c, acc[r][0]);
      store8(s + r * kKeys + c + 8, acc[r][1]);
    }
  }
}

// R queries' outputs take a tile's values: o[r][d] += p[r][j] * v[j][d] over j < keys, in order.
template <int R>
[[gnu::always_inline]] inline void tile_values(const float* p, int64_t keys, const float* v, int64_t D, float* o) {
  int64_t c = 0;
  for (; c + 16 <= D; c += 16) {
    Float8 acc[R][2];
    for (int r = 0; r < R; ++r) {
      acc[r][0] = load8(o + r * D + c);
      acc[r][1] = load8(o + r * D + c + 8);
    }
    for (int64_t j = 0; j < keys; ++j) {
      const Float8 v0 = load8(v + j * D + c), v1 = load8(v + j * D + c + 8);
      for (int r = 0; r < R; ++r) {
        acc[r][0] += p[r * kKeys + j] * v0;
        acc[r][1] += p[r * kKeys + j] * v1;
      }
    }
    for (int r = 0; r < R; ++r) {
      store8(o + r * D + c, acc[r][0]);
      store8(o + r * D + c + 8, acc[r][1]);
    }
  }
  for (; c < D; ++c)  // head dims that are not a multiple of 16
    for (int r = 0; r < R; ++r)
      for (int64_t j = 0; j < keys; ++j) o[r * D + c] += p[r * kKeys + j] * v[j * D + c];
}

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
      for (int64_t d = 0; d < D; ++d) w.kt[d * kKeys + jj] = to_float(k[d]);
      for (int64_t d = 0; d < D; ++d) w.v[jj * D + d] = to_float(v[d]);
    }
    for (int64_t d = 0; d < D && n < kKeys; ++d) std::fill(&w.kt[d * kKeys + n], &w.kt[(d + 1) * kKeys], 0.f);
    for (int64_t r0 = 0; r0 < rows; r0 += kGroup) {
      const int64_t group = std::min(kGroup, rows - r0);
      const float* q = &w.q[r0 * D];
      float* s = &w.s[r0 * kKeys];
      switch (group) {
        case 4: tile_scores<4>(q, D, w.kt.data(), s); break;
        case 3: tile_scores<3>(q, D, w.kt.data(), s); break;
        case 2: tile_scores<2>(q, D, w.kt.data(), s); break;
        default: tile_scores<1>(q, D, w.kt.data(), s); break;
      }
      // Each query's online softmax over the keys it sees here; its weights replace its scores,
      // zeros past them, so that the group shares one pass over V.
      int64_t group_keys = 0;
      for (int64_t r = r0; r < r0 + group; ++r) {
        const int64_t seen = std::clamp<int64_t>(visible(i0 + r) - j0, 0, n);
        float* sr = &w.s[r * kKeys];
        group_keys = std::max(group_keys, seen);
        if (seen == 0) {
          std::fill_n(sr, kKeys, 0.f);
          continue;
        }
        std::fill(sr + seen, sr + kKeys, neg_inf);  // keys it does not see: weight exp(-inf) = 0
        const float m_new = std::max(w.m[r], lanes_max(sr));
        const float rescale = w.m[r] == neg_inf ? 0.f : exp_vectorisable(w.m[r] - m_new);
        for (int64_t jj = 0; jj < kKeys; ++jj) sr[jj] = exp_vectorisable(sr[jj] - m_new);
        const float l = w.l[r] * rescale + lanes_sum(sr);
        for (int64_t d = 0; d < D; ++d) w.o[r * D + d] *= rescale;
        w.m[r] = m_new;
        w.l[r] = l;
      }
      float* o = &w.o[r0 * D];
      switch (group) {
        case 4: tile_values<4>(s, group_keys, w.v.data(), D, o); break;
        case 3: tile_values<3>(s, group_keys, w.v.data(), D, o); break;
        case 2: tile_values<2>(s, group_keys, w.v.data(), D, o); break;
        default: tile_values<1>(s, group_keys, w.v.data(), D, o); break;
      }
    }
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
