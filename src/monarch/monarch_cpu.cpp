// Monarch on the CPU: both block-diagonal products in fp32 with the intermediate rounded to the
// dtype (as on the GPU and in the two-bmm formulation); weight gradients summed over all tokens
// in fp32. Groups of up to kTokens tokens go through each block's product together, in register
// tiles of 4 tokens (or weight rows) x 16 outputs against the block packed in panels
// (core/cpu_tiles.h; factors packed once per call). Every output element is a sum in index order,
// so results do not depend on the tiling, the SIMD clone or the thread count. Tokens are split
// over the installed threads (core/parallel.h); the backward's weight gradients are split by
// block, each summed over the tokens in order.
#include <algorithm>
#include <vector>

#include "core/check.h"
#include "core/cpu_tiles.h"
#include "core/half.h"
#include "core/parallel.h"
#include "monarch/monarch_internal.h"

namespace llmk::detail {

namespace {

template <typename T>
float rnd(float v) { return to_float(from_float<T>(v)); }

// A factor's blocks (blocks x rows x cols, as stored) packed for cpu_tiles.h, one after another:
// with `by_rows` the products' terms run over a block's rows (B[j, c] = w[b, j, c]), otherwise
// over its columns (B[j, c] = w[b, c, j]). The first product takes w1 by columns (terms a,
// outputs c), the second w2 by columns (terms t, outputs v); the backward w2 by rows (terms v,
// outputs t) and w1 by rows (terms c, outputs a).
template <typename T>
std::vector<float> block_panels(const void* factor, int64_t blocks, int64_t rows, int64_t cols, bool by_rows) {
  const T* w = static_cast<const T*>(factor);
  const int64_t terms = by_rows ? rows : cols, outputs = by_rows ? cols : rows, size = panels_size(terms, outputs);
  std::vector<float> out(blocks * size);
  for (int64_t b = 0; b < blocks; ++b) {
    const T* block = w + b * rows * cols;
    pack_panels(terms, outputs, out.data() + b * size, [&](int64_t j, int64_t c) {
      return to_float(by_rows ? block[j * cols + c] : block[c * cols + j]);
    });
  }
  return out;
}

constexpr int64_t kTokens = 16;  // tokens whose products run together

// Tokens' rows as fp32: dst[t * cols + e] = src row (first + t), element e, for t < count.
template <typename T>
void rows_to_float(const void* src, int64_t stride, int64_t first, int64_t count, int64_t cols, float* dst) {
  for (int64_t t = 0; t < count; ++t) {
    const T* row = static_cast<const T*>(src) + (first + t) * stride;
    for (int64_t e = 0; e < cols; ++e) dst[t * cols + e] = to_float(row[e]);
  }
}

// y[t * mid + i*q + c] = rnd(sum_a w1[i,c,a] xr[t * n + i*p + a]) for `count` tokens; acc: count * q.
// Inlined into its callers, which are compiled per SIMD width (cpu_tiles.h: a function of its own
// would be built without AVX and run the AVX tiles there, spilling: 4.5 GFLOP/s).
template <typename T>
[[gnu::always_inline]] inline void first_product(const MonarchParams& p, const float* w1p, const float* xr,
                                                 int64_t count, float* y, float* acc) {
  const int64_t block = panels_size(p.p, p.q);
  for (int64_t i = 0; i < p.k; ++i) {
    std::fill_n(acc, count * p.q, 0.f);
    panels_accumulate(acc, p.q, xr + i * p.p, 1, p.n(), w1p + i * block, p.p, p.p, count, p.q);
    for (int64_t t = 0; t < count; ++t)
      for (int64_t c = 0; c < p.q; ++c) y[t * p.mid() + i * p.q + c] = rnd<T>(acc[t * p.q + c]);
  }
}

template <typename T>
LLMK_CPU_CLONES void forward_tokens(const MonarchParams& p, const float* w1p, const float* w2p,
                                    int64_t begin, int64_t end) {
  const int64_t block2 = panels_size(p.r, p.s);
  std::vector<float> xr(kTokens * p.n()), y(kTokens * p.mid()), acc(kTokens * std::max(p.q, p.s));
  for (int64_t first = begin; first < end; first += kTokens) {
    const int64_t count = std::min(kTokens, end - first);
    rows_to_float<T>(p.x, p.x_stride, first, count, p.n(), xr.data());
    first_product<T>(p, w1p, xr.data(), count, y.data(), acc.data());
    for (int64_t u = 0; u < p.l; ++u) {  // out[v*l + u] = sum_t w2[u,v,t] y[t*l + u]
      std::fill_n(acc.data(), count * p.s, 0.f);
      panels_accumulate(acc.data(), p.s, y.data() + u, p.l, p.mid(), w2p + u * block2, p.r, p.r, count, p.s);
      for (int64_t t = 0; t < count; ++t) {
        T* out = static_cast<T*>(p.out) + (first + t) * p.out_stride;
        for (int64_t v = 0; v < p.s; ++v) out[v * p.l + u] = from_float<T>(acc[t * p.s + v]);
      }
    }
  }
}

template <typename T>
void forward(const MonarchParams& p) {
  const std::vector<float> w1p = block_panels<T>(p.w1, p.k, p.q, p.p, false);
  const std::vector<float> w2p = block_panels<T>(p.w2, p.l, p.s, p.r, false);
  parallel_rows(p.tokens, grain_for(p.k * p.q * p.p + p.l * p.s * p.r), [&](int64_t begin, int64_t end) {
    forward_tokens<T>(p, w1p.data(), w2p.data(), begin, end);
  });
}

// Tokens [begin, end) of a slab starting at token `first`: x, y and dy into the slab's rows of
// xs (n floats each), ys and dys (mid floats each), and dx.
template <typename T>
LLMK_CPU_CLONES void backward_tokens(const MonarchParams& p, const float* w1p, const float* w1rows,
                                     const float* w2rows, int64_t first, int64_t begin, int64_t end,
                                     float* xs, float* ys, float* dys) {
  const int64_t block1 = panels_size(p.q, p.p), block2 = panels_size(p.s, p.r);
  std::vector<float> dor(kTokens * p.m()), acc(kTokens * std::max({p.q, p.r, p.p}));
  for (int64_t b0 = begin; b0 < end; b0 += kTokens) {
    const int64_t count = std::min(kTokens, end - b0);
    float* xr = xs + b0 * p.n();
    float* y = ys + b0 * p.mid();
    float* dy = dys + b0 * p.mid();
    rows_to_float<T>(p.x, p.x_stride, first + b0, count, p.n(), xr);
    rows_to_float<T>(p.dout, p.dout_stride, first + b0, count, p.m(), dor.data());
    first_product<T>(p, w1p, xr, count, y, acc.data());  // y, as in the forward
    // dZ[u,t] = sum_v w2[u,v,t] dO[u,v] (dO[u,v] = dout[v*l+u]) -> dy[t*l+u]
    for (int64_t u = 0; u < p.l; ++u) {
      std::fill_n(acc.data(), count * p.r, 0.f);
      panels_accumulate(acc.data(), p.r, dor.data() + u, p.l, p.m(), w2rows + u * block2, p.s, p.s, count, p.r);
      for (int64_t t = 0; t < count; ++t)
        for (int64_t tt = 0; tt < p.r; ++tt) dy[t * p.mid() + tt * p.l + u] = rnd<T>(acc[t * p.r + tt]);
    }
    // dX[i,a] = sum_c w1[i,c,a] dy[i*q+c]
    for (int64_t i = 0; i < p.k; ++i) {
      std::fill_n(acc.data(), count * p.p, 0.f);
      panels_accumulate(acc.data(), p.p, dy + i * p.q, 1, p.mid(), w1rows + i * block1, p.q, p.q, count, p.p);
      for (int64_t t = 0; t < count; ++t) {
        T* dx = static_cast<T*>(p.dx) + (first + b0 + t) * p.dx_stride;
        for (int64_t a = 0; a < p.p; ++a) dx[i * p.p + a] = from_float<T>(acc[t * p.p + a]);
      }
    }
  }
}

// Weight-gradient blocks [begin, end) (the l blocks of w2, then the k blocks of w1), each summed
// over the slab's n tokens in token order: dw2 += dO z^T, dw1 += dy x^T. A w2 block's dO is
// strided by l in the tokens' rows, so it is gathered first; z (and x for w1) are packed in panels.
template <typename T>
LLMK_CPU_CLONES void weight_gradient_blocks(const MonarchParams& p, int64_t first, int64_t n,
                                            const float* xs, const float* ys, const float* dys,
                                            int64_t begin, int64_t end, float* g1, float* g2) {
  std::vector<float> dO, packed;
  for (int64_t j = begin; j < end; ++j) {
    if (j < p.l) {
      const int64_t u = j;
      dO.resize(n * p.s);  // dO[b * s + v] = dout[b][v*l + u]
      for (int64_t b = 0; b < n; ++b) {
        const T* dout = static_cast<const T*>(p.dout) + (first + b) * p.dout_stride;
        for (int64_t v = 0; v < p.s; ++v) dO[b * p.s + v] = to_float(dout[v * p.l + u]);
      }
      packed.resize(panels_size(n, p.r));  // z[b, t] = y[b][t*l + u]
      pack_panels(n, p.r, packed.data(), [&](int64_t b, int64_t t) { return ys[b * p.mid() + t * p.l + u]; });
      panels_accumulate(g2 + u * p.s * p.r, p.r, dO.data(), p.s, 1, packed.data(), n, n, p.s, p.r);
    } else {
      const int64_t i = j - p.l;
      packed.resize(panels_size(n, p.p));  // x[b, a] = x[b][i*p + a]
      pack_panels(n, p.p, packed.data(), [&](int64_t b, int64_t a) { return xs[b * p.n() + i * p.p + a]; });
      panels_accumulate(g1 + i * p.q * p.p, p.p, dys + i * p.q, p.mid(), 1, packed.data(), n, n, p.q, p.p);
    }
  }
}

// Slabs of tokens: each slab's tokens split over the threads (y, dy, dx), then its weight-gradient
// blocks (each a sum over tokens in order, so no result depends on the thread count).
template <typename T>
void backward(const MonarchParams& p) {
  std::vector<float> g1(p.k * p.q * p.p, 0.f), g2(p.l * p.s * p.r, 0.f);
  const std::vector<float> w1p = block_panels<T>(p.w1, p.k, p.q, p.p, false);  // for y (the forward's)
  const std::vector<float> w1rows = block_panels<T>(p.w1, p.k, p.q, p.p, true);
  const std::vector<float> w2rows = block_panels<T>(p.w2, p.l, p.s, p.r, true);
  constexpr int64_t kSlab = 256;
  const int64_t slab = std::min(kSlab, p.tokens);
  std::vector<float> xs(slab * p.n()), ys(slab * p.mid()), dys(slab * p.mid());
  const int64_t token_work = 2 * (g1.size() + g2.size());
  for (int64_t first = 0; first < p.tokens; first += slab) {
    const int64_t n = std::min(slab, p.tokens - first);
    parallel_rows(n, grain_for(token_work), [&](int64_t begin, int64_t end) {
      backward_tokens<T>(p, w1p.data(), w1rows.data(), w2rows.data(), first, begin, end, xs.data(), ys.data(),
                         dys.data());
    });
    const int64_t block_work = n * std::max(p.s * p.r, p.q * p.p);
    parallel_rows(p.l + p.k, grain_for(block_work), [&](int64_t begin, int64_t end) {
      weight_gradient_blocks<T>(p, first, n, xs.data(), ys.data(), dys.data(), begin, end, g1.data(), g2.data());
    });
  }
  T* dw1 = static_cast<T*>(p.dw1);
  T* dw2 = static_cast<T*>(p.dw2);
  for (size_t i = 0; i < g1.size(); ++i) dw1[i] = from_float<T>(g1[i]);
  for (size_t i = 0; i < g2.size(); ++i) dw2[i] = from_float<T>(g2[i]);
}

}  // namespace

void monarch_cpu(const MonarchParams& p) {
  switch (p.dtype) {
    case DType::f32: forward<float>(p); break;
    case DType::f16: forward<Half>(p); break;
    case DType::bf16: forward<BFloat16>(p); break;
    default: fail(ErrorKind::type, "monarch_matmul", "unsupported dtype");
  }
}

void monarch_backward_cpu(const MonarchParams& p) {
  switch (p.dtype) {
    case DType::f32: backward<float>(p); break;
    case DType::f16: backward<Half>(p); break;
    case DType::bf16: backward<BFloat16>(p); break;
    default: fail(ErrorKind::type, "monarch_matmul_backward", "unsupported dtype");
  }
}

}  // namespace llmk::detail
