// Decode attention and KV-cache writes on the CPU: plain loops, softmax and sums in double (this
// path doubles as the reference the GPU kernels are tested against). Decode attention splits its
// (sequence, token, query head) rows over the installed threads (core/parallel.h).
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "core/check.h"
#include "core/half.h"
#include "core/parallel.h"
#include "decode/decode_internal.h"

namespace llmk::detail {

namespace {

constexpr double kLog2e = 1.4426950408889634;

// Offset (elements) of position pos, head h of sequence b in a cache with `strides`.
int64_t cache_offset(const KvCache& c, const int64_t* strides, int64_t b, int64_t h, int64_t pos) {
  if (!c.paged) return b * strides[0] + h * strides[1] + pos * strides[2];
  const int64_t blk = c.block_table[b * c.table_stride + pos / c.block_size];
  return blk * strides[0] + (pos % c.block_size) * strides[1] + h * strides[2];
}

// The mask term of position pos for token t of sequence b (natural-log units): 0, the additive
// value, or -inf for a hidden key.
double mask_term(const KeyMask& m, int64_t b, int64_t t, int64_t pos) {
  if (m.data == nullptr) return 0.0;
  if (pos >= m.len) return -std::numeric_limits<double>::infinity();
  const int64_t i = b * m.strides[0] + t * m.strides[1] + pos * m.strides[2];
  switch (m.dtype) {
    case DType::boolean:
      return static_cast<const bool*>(m.data)[i] ? 0.0 : -std::numeric_limits<double>::infinity();
    case DType::f16: return to_float(static_cast<const Half*>(m.data)[i]);
    case DType::bf16: return to_float(static_cast<const BFloat16*>(m.data)[i]);
    default: return static_cast<const float*>(m.data)[i];
  }
}

template <typename T>
void decode_typed(const DecodeParams& p) {
  const T* q = static_cast<const T*>(p.q);
  const T* kc = static_cast<const T*>(p.cache.k);
  const T* vc = static_cast<const T*>(p.cache.v);
  T* out = static_cast<T*>(p.out);
  const int64_t D = p.head_dim, group = p.q_heads / p.kv_heads;
  const int64_t rows = p.batch * p.tokens * p.q_heads;
  parallel_rows(rows, grain_for(p.cache.capacity * D), [&](int64_t begin, int64_t end) {
    std::vector<double> qf(D), acc(D), scores;
    for (int64_t row = begin; row < end; ++row) {
      const int64_t b = row / (p.tokens * p.q_heads), t = row / p.q_heads % p.tokens;
      const int64_t h = row % p.q_heads, hk = h / group;
      const int64_t last = seq_len_at(p, b) - p.tokens + t;  // keys 0..last
      const T* qrow = q + b * p.q_strides[0] + t * p.q_strides[1] + h * p.q_strides[2];
      for (int64_t d = 0; d < D; ++d) qf[d] = to_float(qrow[d]);
      const int64_t n = last < 0 ? 0 : last + 1;
      scores.assign(n, 0.0);
      double mx = -std::numeric_limits<double>::infinity();
      for (int64_t j = 0; j < n; ++j) {
        const T* krow = kc + cache_offset(p.cache, p.cache.k_strides, b, hk, j);
        double s = 0;
        for (int64_t d = 0; d < D; ++d) s += qf[d] * to_float(krow[d]);
        // the GPU adds the mask in fp32 (log2 domain): so do we, so that the same values hide keys
        const double add = static_cast<double>(static_cast<float>(mask_term(p.mask, b, t, j) * kLog2e));
        scores[j] = std::isinf(add) && add < 0 ? add : s * p.scale + add / kLog2e;
        mx = std::max(mx, scores[j]);
      }
      double sum = 0;
      std::fill(acc.begin(), acc.end(), 0.0);
      const bool none = std::isinf(mx) && mx < 0;  // every key hidden (or none to see)
      for (int64_t j = 0; j < n && !none; ++j) {
        const double w = std::exp(scores[j] - mx);
        sum += w;
        const T* vrow = vc + cache_offset(p.cache, p.cache.v_strides, b, hk, j);
        for (int64_t d = 0; d < D; ++d) acc[d] += w * to_float(vrow[d]);
      }
      T* orow = out + b * p.out_strides[0] + t * p.out_strides[1] + h * p.out_strides[2];
      for (int64_t d = 0; d < D; ++d)
        orow[d] = from_float<T>(none ? 0.f : static_cast<float>(acc[d] / sum));
    }
  });
}

template <typename T>
void write_typed(const KvWriteParams& p) {
  const KvCache& c = p.cache;
  for (int64_t b = 0; b < p.batch; ++b)
    for (int64_t t = 0; t < p.tokens; ++t) {
      const int64_t pos = position_at(p, b, t);
      if (pos < 0) continue;  // padding
      if (pos >= c.capacity)
        fail(ErrorKind::value, "write_kv_cache",
             "positions: expected values below " + std::to_string(c.capacity) + " (the cache capacity), got " +
                 std::to_string(pos) + " at [" + std::to_string(b) + ", " + std::to_string(t) + "]");
      if (c.paged) {
        const int64_t blk = c.block_table[b * c.table_stride + pos / c.block_size];
        if (blk < 0 || blk >= c.num_blocks)
          fail(ErrorKind::value, "write_kv_cache",
               "block_table: expected block indices in [0, " + std::to_string(c.num_blocks) + "), got " +
                   std::to_string(blk) + " at [" + std::to_string(b) + ", " + std::to_string(pos / c.block_size) + "]");
      }
      for (int64_t h = 0; h < p.kv_heads; ++h) {
        const T* ks = static_cast<const T*>(p.k) + b * p.k_strides[0] + t * p.k_strides[1] + h * p.k_strides[2];
        const T* vs = static_cast<const T*>(p.v) + b * p.v_strides[0] + t * p.v_strides[1] + h * p.v_strides[2];
        T* kd = static_cast<T*>(p.k_cache) + cache_offset(c, c.k_strides, b, h, pos);
        T* vd = static_cast<T*>(p.v_cache) + cache_offset(c, c.v_strides, b, h, pos);
        for (int64_t d = 0; d < p.head_dim; ++d) {
          kd[d] = ks[d];
          vd[d] = vs[d];
        }
      }
    }
}

}  // namespace

void decode_attention_cpu(const DecodeParams& p) {
  switch (p.dtype) {
    case DType::f32: decode_typed<float>(p); break;
    case DType::f16: decode_typed<Half>(p); break;
    case DType::bf16: decode_typed<BFloat16>(p); break;
    default: fail(ErrorKind::type, "decode_attention", "unsupported dtype");
  }
}

void write_kv_cache_cpu(const KvWriteParams& p) {
  switch (p.dtype) {
    case DType::f32: write_typed<float>(p); break;
    case DType::f16: write_typed<Half>(p); break;
    case DType::bf16: write_typed<BFloat16>(p); break;
    default: fail(ErrorKind::type, "write_kv_cache", "unsupported dtype");
  }
  if (p.advance != nullptr) advance_length(p);  // after the write (a bad position threw before it)
}

}  // namespace llmk::detail
