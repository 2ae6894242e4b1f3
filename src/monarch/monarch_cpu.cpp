// Monarch on the CPU: token by token, both block-diagonal products in fp32 with the intermediate
// rounded to the dtype (as on the GPU and in the two-bmm formulation); weight gradients summed
// over all tokens in fp32. Every output element is a sum in index order; the loops run over the
// outputs innermost (factors transposed once per call), so that they vectorise without changing
// any sum's order. The forward splits its tokens over the installed threads (core/parallel.h);
// the backward, whose weight gradients sum over all tokens, runs on the calling thread.
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

// The factors in fp32, transposed so that their output index is the fastest:
// w1t[(i*p + a)*q + c] = w1[i, c, a], w2t[(u*r + t)*s + v] = w2[u, v, t].
template <typename T>
void transposed_factors(const MonarchParams& p, std::vector<float>& w1t, std::vector<float>& w2t) {
  const T* w1 = static_cast<const T*>(p.w1);
  const T* w2 = static_cast<const T*>(p.w2);
  w1t.resize(p.k * p.q * p.p);
  w2t.resize(p.l * p.s * p.r);
  for (int64_t i = 0; i < p.k; ++i)
    for (int64_t c = 0; c < p.q; ++c)
      for (int64_t a = 0; a < p.p; ++a) w1t[(i * p.p + a) * p.q + c] = to_float(w1[(i * p.q + c) * p.p + a]);
  for (int64_t u = 0; u < p.l; ++u)
    for (int64_t v = 0; v < p.s; ++v)
      for (int64_t t = 0; t < p.r; ++t) w2t[(u * p.r + t) * p.s + v] = to_float(w2[(u * p.s + v) * p.r + t]);
}

// y[i*q + c] = rnd(sum_a w1[i,c,a] xr[i*p + a]); acc: q floats of scratch.
template <typename T>
LLMK_CPU_CLONES void first_product(const MonarchParams& p, const float* w1t, const float* xr, float* y,
                                   float* acc) {
  for (int64_t i = 0; i < p.k; ++i) {
    std::fill(acc, acc + p.q, 0.f);
    for (int64_t a = 0; a < p.p; ++a) {
      const float xa = xr[i * p.p + a];
      const float* w = w1t + (i * p.p + a) * p.q;
      for (int64_t c = 0; c < p.q; ++c) acc[c] += w[c] * xa;
    }
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
      for (int64_t t = 0; t < p.r; ++t) {
        const float yt = y[t * p.l + u];
        const float* w = w2t + (u * p.r + t) * p.s;
        for (int64_t v = 0; v < p.s; ++v) acc[v] += w[v] * yt;
      }
      for (int64_t v = 0; v < p.s; ++v) out[v * p.l + u] = from_float<T>(acc[v]);
    }
  }
}

template <typename T>
void forward(const MonarchParams& p) {
  std::vector<float> w1t, w2t;
  transposed_factors<T>(p, w1t, w2t);
  parallel_rows(p.tokens, grain_for(p.k * p.q * p.p + p.l * p.s * p.r), [&](int64_t begin, int64_t end) {
    forward_tokens<T>(p, w1t.data(), w2t.data(), begin, end);
  });
}

template <typename T>
LLMK_CPU_CLONES void backward(const MonarchParams& p) {
  const T* w1 = static_cast<const T*>(p.w1);
  const T* w2 = static_cast<const T*>(p.w2);
  std::vector<float> fw1(p.k * p.q * p.p), fw2(p.l * p.s * p.r), g1(fw1.size(), 0.f), g2(fw2.size(), 0.f);
  std::vector<float> w1t, w2t;
  transposed_factors<T>(p, w1t, w2t);
  std::vector<float> xr(p.n()), y(p.mid()), dy(p.mid()), dor(p.m()), acc(std::max({p.q, p.r, p.p}));
  for (size_t i = 0; i < fw1.size(); ++i) fw1[i] = to_float(w1[i]);
  for (size_t i = 0; i < fw2.size(); ++i) fw2[i] = to_float(w2[i]);
  for (int64_t b = 0; b < p.tokens; ++b) {
    const T* x = static_cast<const T*>(p.x) + b * p.x_stride;
    const T* dout = static_cast<const T*>(p.dout) + b * p.dout_stride;
    T* dx = static_cast<T*>(p.dx) + b * p.dx_stride;
    for (int64_t e = 0; e < p.n(); ++e) xr[e] = to_float(x[e]);
    for (int64_t e = 0; e < p.m(); ++e) dor[e] = to_float(dout[e]);
    first_product<T>(p, w1t.data(), xr.data(), y.data(), acc.data());  // y, as in the forward
    // dZ[u,t] = sum_v w2[u,v,t] dO[u,v] (dO[u,v] = dout[v*l+u]) -> dy[t*l+u]; dw2 += dO z^T
    for (int64_t u = 0; u < p.l; ++u) {
      std::fill(acc.begin(), acc.begin() + p.r, 0.f);
      for (int64_t v = 0; v < p.s; ++v) {
        const float g = dor[v * p.l + u];
        const float* w = &fw2[(u * p.s + v) * p.r];
        for (int64_t t = 0; t < p.r; ++t) acc[t] += w[t] * g;
      }
      for (int64_t t = 0; t < p.r; ++t) dy[t * p.l + u] = rnd<T>(acc[t]);
      for (int64_t v = 0; v < p.s; ++v) {
        const float g = dor[v * p.l + u];
        for (int64_t t = 0; t < p.r; ++t) g2[(u * p.s + v) * p.r + t] += g * y[t * p.l + u];
      }
    }
    // dX[i,a] = sum_c w1[i,c,a] dy[i*q+c]; dw1 += dy x^T
    for (int64_t i = 0; i < p.k; ++i) {
      std::fill(acc.begin(), acc.begin() + p.p, 0.f);
      for (int64_t c = 0; c < p.q; ++c) {
        const float g = dy[i * p.q + c];
        const float* w = &fw1[(i * p.q + c) * p.p];
        for (int64_t a = 0; a < p.p; ++a) acc[a] += w[a] * g;
      }
      for (int64_t a = 0; a < p.p; ++a) dx[i * p.p + a] = from_float<T>(acc[a]);
      for (int64_t c = 0; c < p.q; ++c) {
        const float g = dy[i * p.q + c];
        for (int64_t a = 0; a < p.p; ++a) g1[(i * p.q + c) * p.p + a] += g * xr[i * p.p + a];
      }
    }
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
