// Monarch on the CPU: token by token, both block-diagonal products in fp32 with the intermediate
// rounded to the dtype (as on the GPU and in the two-bmm formulation); weight gradients summed
// over all tokens in fp32. Every output element is a sum in index order; the loops run over the
// outputs innermost (factors transposed once per call), so that they vectorise without changing
// any sum's order. Tokens are split over the installed threads (core/parallel.h); the backward's
// weight gradients are split by block, each summed over the tokens in order.
#include <algorithm>
#include <vector>

#include "core/check.h"
#include "core/half.h"
#include "core/parallel.h"
#include "monarch/monarch_internal.h"

namespace llmk::detail {

namespace {

template <typename T>
float rnd(float v) { return to_float(from_float<T>(v)); }

// A factor of `blocks` (rows x cols) blocks in fp32, each block transposed so that its row index
// is the fastest: out[(b*cols + c)*rows + r] = w[b, r, c]. For w1 (k, q, p) that makes the first
// product's output index c fastest, for w2 (l, s, r) the second's v.
template <typename T>
std::vector<float> transposed_blocks(const void* factor, int64_t blocks, int64_t rows, int64_t cols) {
  const T* w = static_cast<const T*>(factor);
  std::vector<float> out(blocks * rows * cols);
  for (int64_t b = 0; b < blocks; ++b)
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c) out[(b * cols + c) * rows + r] = to_float(w[(b * rows + r) * cols + c]);
  return out;
}

// acc[j] += w[j] * g for j < n: each product summed into its own output, so a loop of these over
// an index sums every output in that index's order.
inline void accumulate(float* acc, const float* w, float g, int64_t n) {
  for (int64_t j = 0; j < n; ++j) acc[j] += w[j] * g;
}

// y[i*q + c] = rnd(sum_a w1[i,c,a] xr[i*p + a]); acc: q floats of scratch.
template <typename T>
LLMK_CPU_CLONES void first_product(const MonarchParams& p, const float* w1t, const float* xr, float* y,
                                   float* acc) {
  for (int64_t i = 0; i < p.k; ++i) {
    std::fill(acc, acc + p.q, 0.f);
    for (int64_t a = 0; a < p.p; ++a) accumulate(acc, w1t + (i * p.p + a) * p.q, xr[i * p.p + a], p.q);
    for (int64_t c = 0; c < p.q; ++c) y[i * p.q + c] = rnd<T>(acc[c]);
  }
}

template <typename T>
LLMK_CPU_CLONES void forward_tokens(const MonarchParams& p, const float* w1t, const float* w2t,
                                    int64_t begin, int64_t end) {
  std::vector<float> xr(p.n()), y(p.mid()), acc(std::max(p.q, p.s));
  for (int64_t b = begin; b < end; ++b) {
    const T* x = static_cast<const T*>(p.x) + b * p.x_stride;
    T* out = static_cast<T*>(p.out) + b * p.out_stride;
    for (int64_t e = 0; e < p.n(); ++e) xr[e] = to_float(x[e]);
    first_product<T>(p, w1t, xr.data(), y.data(), acc.data());
    for (int64_t u = 0; u < p.l; ++u) {  // out[v*l + u] = sum_t w2[u,v,t] y[t*l + u]
      std::fill(acc.begin(), acc.begin() + p.s, 0.f);
      for (int64_t t = 0; t < p.r; ++t)
        accumulate(acc.data(), w2t + (u * p.r + t) * p.s, y[t * p.l + u], p.s);
      for (int64_t v = 0; v < p.s; ++v) out[v * p.l + u] = from_float<T>(acc[v]);
    }
  }
}

template <typename T>
void forward(const MonarchParams& p) {
  const std::vector<float> w1t = transposed_blocks<T>(p.w1, p.k, p.q, p.p);
  const std::vector<float> w2t = transposed_blocks<T>(p.w2, p.l, p.s, p.r);
  parallel_rows(p.tokens, grain_for(p.k * p.q * p.p + p.l * p.s * p.r), [&](int64_t begin, int64_t end) {
    forward_tokens<T>(p, w1t.data(), w2t.data(), begin, end);
  });
}

// Tokens [begin, end) of a slab starting at token `first`: y and dy into the slab's rows of ys
// and dys (mid floats each), and dx.
template <typename T>
LLMK_CPU_CLONES void backward_tokens(const MonarchParams& p, const float* w1t, const float* fw1,
                                     const float* fw2, int64_t first, int64_t begin, int64_t end,
                                     float* ys, float* dys) {
  std::vector<float> xr(p.n()), dor(p.m()), acc(std::max({p.q, p.r, p.p}));
  for (int64_t b = begin; b < end; ++b) {
    const int64_t token = first + b;
    const T* x = static_cast<const T*>(p.x) + token * p.x_stride;
    const T* dout = static_cast<const T*>(p.dout) + token * p.dout_stride;
    T* dx = static_cast<T*>(p.dx) + token * p.dx_stride;
    float* y = ys + b * p.mid();
    float* dy = dys + b * p.mid();
    for (int64_t e = 0; e < p.n(); ++e) xr[e] = to_float(x[e]);
    for (int64_t e = 0; e < p.m(); ++e) dor[e] = to_float(dout[e]);
    first_product<T>(p, w1t, xr.data(), y, acc.data());  // y, as in the forward
    // dZ[u,t] = sum_v w2[u,v,t] dO[u,v] (dO[u,v] = dout[v*l+u]) -> dy[t*l+u]
    for (int64_t u = 0; u < p.l; ++u) {
      std::fill(acc.begin(), acc.begin() + p.r, 0.f);
      for (int64_t v = 0; v < p.s; ++v)
        accumulate(acc.data(), fw2 + (u * p.s + v) * p.r, dor[v * p.l + u], p.r);
      for (int64_t t = 0; t < p.r; ++t) dy[t * p.l + u] = rnd<T>(acc[t]);
    }
    // dX[i,a] = sum_c w1[i,c,a] dy[i*q+c]
    for (int64_t i = 0; i < p.k; ++i) {
      std::fill(acc.begin(), acc.begin() + p.p, 0.f);
      for (int64_t c = 0; c < p.q; ++c)
        accumulate(acc.data(), fw1 + (i * p.q + c) * p.p, dy[i * p.q + c], p.p);
      for (int64_t a = 0; a < p.p; ++a) dx[i * p.p + a] = from_float<T>(acc[a]);
    }
  }
}

// Weight-gradient blocks [begin, end) (the l blocks of w2, then the k blocks of w1) summed over
// the slab's n tokens in token order: dw2 += dO z^T, dw1 += dy x^T.
template <typename T>
LLMK_CPU_CLONES void weight_gradient_blocks(const MonarchParams& p, int64_t first, int64_t n,
                                            const float* ys, const float* dys, int64_t begin,
                                            int64_t end, float* g1, float* g2) {
  for (int64_t j = begin; j < end; ++j)
    for (int64_t b = 0; b < n; ++b) {
      if (j < p.l) {
        const int64_t u = j;
        const T* dout = static_cast<const T*>(p.dout) + (first + b) * p.dout_stride;
        const float* y = ys + b * p.mid();
        for (int64_t v = 0; v < p.s; ++v) {
          const float g = to_float(dout[v * p.l + u]);
          float* gw = g2 + (u * p.s + v) * p.r;
          for (int64_t t = 0; t < p.r; ++t) gw[t] += g * y[t * p.l + u];
        }
      } else {
        const int64_t i = j - p.l;
        const T* x = static_cast<const T*>(p.x) + (first + b) * p.x_stride + i * p.p;
        const float* dy = dys + b * p.mid();
        for (int64_t c = 0; c < p.q; ++c) {
          const float g = dy[i * p.q + c];
          float* gw = g1 + (i * p.q + c) * p.p;
          for (int64_t a = 0; a < p.p; ++a) gw[a] += g * to_float(x[a]);
        }
      }
    }
}

// Slabs of tokens: each slab's tokens split over the threads (y, dy, dx), then its weight-gradient
// blocks (each a sum over tokens in order, so no result depends on the thread count).
template <typename T>
void backward(const MonarchParams& p) {
  const T* w1 = static_cast<const T*>(p.w1);
  const T* w2 = static_cast<const T*>(p.w2);
  std::vector<float> fw1(p.k * p.q * p.p), fw2(p.l * p.s * p.r), g1(fw1.size(), 0.f), g2(fw2.size(), 0.f);
  for (size_t i = 0; i < fw1.size(); ++i) fw1[i] = to_float(w1[i]);
  for (size_t i = 0; i < fw2.size(); ++i) fw2[i] = to_float(w2[i]);
  const std::vector<float> w1t = transposed_blocks<T>(p.w1, p.k, p.q, p.p);  // for y (the forward's)
  constexpr int64_t kSlab = 256;
  const int64_t slab = std::min(kSlab, p.tokens);
  std::vector<float> ys(slab * p.mid()), dys(slab * p.mid());
  const int64_t token_work = 2 * (fw1.size() + fw2.size());
  for (int64_t first = 0; first < p.tokens; first += slab) {
    const int64_t n = std::min(slab, p.tokens - first);
    parallel_rows(n, grain_for(token_work), [&](int64_t begin, int64_t end) {
      backward_tokens<T>(p, w1t.data(), fw1.data(), fw2.data(), first, begin, end, ys.data(), dys.data());
    });
    const int64_t block_work = n * std::max(p.s * p.r, p.q * p.p);
    parallel_rows(p.l + p.k, grain_for(block_work), [&](int64_t begin, int64_t end) {
      weight_gradient_blocks<T>(p, first, n, ys.data(), dys.data(), begin, end, g1.data(), g2.data());
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
