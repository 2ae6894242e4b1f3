// Monarch on the CPU: token by token, both block-diagonal products in fp32 with the intermediate
// rounded to the dtype (as on the GPU and in the two-bmm formulation); weight gradients summed
// over all tokens in fp32.
#include <vector>

#include "core/check.h"
#include "core/half.h"
#include "monarch/monarch_internal.h"

namespace llmk::detail {

namespace {

template <typename T>
float rnd(float v) { return to_float(from_float<T>(v)); }

template <typename T>
void forward(const MonarchParams& p) {
  const T* w1 = static_cast<const T*>(p.w1);
  const T* w2 = static_cast<const T*>(p.w2);
  std::vector<float> fw1(p.k * p.q * p.p), fw2(p.l * p.s * p.r), y(p.mid()), xr(p.n());
  for (size_t i = 0; i < fw1.size(); ++i) fw1[i] = to_float(w1[i]);
  for (size_t i = 0; i < fw2.size(); ++i) fw2[i] = to_float(w2[i]);
  for (int64_t b = 0; b < p.tokens; ++b) {
    const T* x = static_cast<const T*>(p.x) + b * p.x_stride;
    T* out = static_cast<T*>(p.out) + b * p.out_stride;
    for (int64_t e = 0; e < p.n(); ++e) xr[e] = to_float(x[e]);
    for (int64_t i = 0; i < p.k; ++i)
      for (int64_t c = 0; c < p.q; ++c) {
        const float* w = &fw1[(i * p.q + c) * p.p];
        float acc = 0.f;
        for (int64_t a = 0; a < p.p; ++a) acc += w[a] * xr[i * p.p + a];
        y[i * p.q + c] = rnd<T>(acc);
      }
    for (int64_t u = 0; u < p.l; ++u)
      for (int64_t v = 0; v < p.s; ++v) {
        const float* w = &fw2[(u * p.s + v) * p.r];
        float acc = 0.f;
        for (int64_t t = 0; t < p.r; ++t) acc += w[t] * y[t * p.l + u];
        out[v * p.l + u] = from_float<T>(acc);
      }
  }
}

template <typename T>
void backward(const MonarchParams& p) {
  const T* w1 = static_cast<const T*>(p.w1);
  const T* w2 = static_cast<const T*>(p.w2);
  std::vector<float> fw1(p.k * p.q * p.p), fw2(p.l * p.s * p.r), g1(fw1.size(), 0.f), g2(fw2.size(), 0.f);
  std::vector<float> xr(p.n()), y(p.mid()), dy(p.mid()), dor(p.m());
  for (size_t i = 0; i < fw1.size(); ++i) fw1[i] = to_float(w1[i]);
  for (size_t i = 0; i < fw2.size(); ++i) fw2[i] = to_float(w2[i]);
  for (int64_t b = 0; b < p.tokens; ++b) {
    const T* x = static_cast<const T*>(p.x) + b * p.x_stride;
    const T* dout = static_cast<const T*>(p.dout) + b * p.dout_stride;
    T* dx = static_cast<T*>(p.dx) + b * p.dx_stride;
    for (int64_t e = 0; e < p.n(); ++e) xr[e] = to_float(x[e]);
    for (int64_t e = 0; e < p.m(); ++e) dor[e] = to_float(dout[e]);
    for (int64_t i = 0; i < p.k; ++i)  // y, as in the forward
      for (int64_t c = 0; c < p.q; ++c) {
        float acc = 0.f;
        for (int64_t a = 0; a < p.p; ++a) acc += fw1[(i * p.q + c) * p.p + a] * xr[i * p.p + a];
        y[i * p.q + c] = rnd<T>(acc);
      }
    // dZ[u,t] = sum_v w2[u,v,t] dO[u,v] (dO[u,v] = dout[v*l+u]) -> dy[t*l+u]; dw2 += dO z^T
    for (int64_t u = 0; u < p.l; ++u) {
      for (int64_t t = 0; t < p.r; ++t) {
        float acc = 0.f;
        for (int64_t v = 0; v < p.s; ++v) acc += fw2[(u * p.s + v) * p.r + t] * dor[v * p.l + u];
        dy[t * p.l + u] = rnd<T>(acc);
      }
      for (int64_t v = 0; v < p.s; ++v) {
        const float g = dor[v * p.l + u];
        for (int64_t t = 0; t < p.r; ++t) g2[(u * p.s + v) * p.r + t] += g * y[t * p.l + u];
      }
    }
    // dX[i,a] = sum_c w1[i,c,a] dy[i*q+c]; dw1 += dy x^T
    for (int64_t i = 0; i < p.k; ++i) {
      for (int64_t a = 0; a < p.p; ++a) {
        float acc = 0.f;
        for (int64_t c = 0; c < p.q; ++c) acc += fw1[(i * p.q + c) * p.p + a] * dy[i * p.q + c];
        dx[i * p.p + a] = from_float<T>(acc);
      }
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
