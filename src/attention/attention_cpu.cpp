// Attention on the CPU: for each (batch, query head, query), an online softmax over tiles of
// 64 keys (running max m, running sum l, running output o rescaled when m grows), so memory stays
// O(D) per query whatever the sequence length. fp32 arithmetic. The (batch, query head) pairs are
// split over the installed threads (core/parallel.h).
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "attention/attention_internal.h"
#include "core/check.h"
#include "core/half.h"
#include "core/parallel.h"

namespace llmk::detail {

namespace {

constexpr int64_t kTile = 64;

template <typename T>
void run(const AttentionParams& p) {
  const int64_t D = p.head_dim, group = p.q_heads / p.kv_heads;
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const int64_t pair_work = p.q_len * p.kv_len * D;  // a bound (varlen sequences may be shorter)
  parallel_rows(p.batch * p.q_heads, grain_for(pair_work), [&](int64_t begin, int64_t end) {
    std::vector<float> qrow(D), acc(D), scores(kTile);
    for (int64_t pair = begin; pair < end; ++pair) {
      const int64_t b = pair / p.q_heads, h = pair % p.q_heads, hk = h / group;
      const SeqSpan sp = seq_span(p, b);
      for (int64_t i = 0; i < sp.q_len; ++i) {
        const int64_t qi = sp.q_start + i;
        const T* q = static_cast<const T*>(p.q) + b * p.q_strides[0] + qi * p.q_strides[1] + h * p.q_strides[2];
        for (int64_t d = 0; d < D; ++d) qrow[d] = to_float(q[d]) * p.scale;
        const int64_t visible = p.causal ? std::clamp<int64_t>(i + sp.diagonal_offset + 1, 0, sp.kv_len) : sp.kv_len;
        float m = neg_inf, l = 0.f;
        std::fill(acc.begin(), acc.end(), 0.f);
        for (int64_t j0 = 0; j0 < visible; j0 += kTile) {
          const int64_t n = std::min(kTile, visible - j0);
          float tile_max = neg_inf;
          for (int64_t jj = 0; jj < n; ++jj) {
            const int64_t kj = sp.k_start + j0 + jj;
            const T* k = static_cast<const T*>(p.k) + b * p.k_strides[0] + kj * p.k_strides[1] + hk * p.k_strides[2];
            float s = 0.f;
            for (int64_t d = 0; d < D; ++d) s += qrow[d] * to_float(k[d]);
            scores[jj] = s;
            tile_max = std::max(tile_max, s);
          }
          const float m_new = std::max(m, tile_max);
          const float rescale = m == neg_inf ? 0.f : std::exp(m - m_new);
          l *= rescale;
          for (int64_t d = 0; d < D; ++d) acc[d] *= rescale;
          for (int64_t jj = 0; jj < n; ++jj) {
            const float w = std::exp(scores[jj] - m_new);
            l += w;
            const int64_t kj = sp.k_start + j0 + jj;
            const T* v = static_cast<const T*>(p.v) + b * p.v_strides[0] + kj * p.v_strides[1] + hk * p.v_strides[2];
            for (int64_t d = 0; d < D; ++d) acc[d] += w * to_float(v[d]);
          }
          m = m_new;
        }
        T* out = static_cast<T*>(p.out) + b * p.out_strides[0] + qi * p.out_strides[1] + h * p.out_strides[2];
        const float inv = l > 0.f ? 1.f / l : 0.f;  // no visible key: zeros, as PyTorch's SDPA gives
        for (int64_t d = 0; d < D; ++d) out[d] = from_float<T>(acc[d] * inv);
        if (p.lse)
          p.lse[b * p.lse_strides[0] + h * p.lse_strides[1] + qi * p.lse_strides[2]] =
              l > 0.f ? m + std::log(l) : neg_inf;
      }
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
