// Gated activations on the CPU: rows split over the installed threads (core/parallel.h), a
// plain loop over each row's columns, fp32 arithmetic. The activations take exp and erfc from
// core/vector_math.h, so that the compiler vectorises their loops (a libm call per element does
// not).
#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "activation/activation_internal.h"
#include "activation/activation_math.h"
#include "core/check.h"
#include "core/half.h"
#include "core/parallel.h"
#include "core/vector_math.h"

namespace llmk::detail {

namespace {

struct VectorisableExp {
  static float of(float x) { return exp_vectorisable(x); }
};
struct VectorisableErfc {
  static float of(float x) { return erfc_vectorisable(x); }
};

// ActivationFn<ACT> with the vectorisable exp and erfc (core/vector_math.h) in place of libm's.
template <int ACT>
using CpuFn = std::conditional_t<ACT == 0, SiluWith<VectorisableExp>,
                                 std::conditional_t<ACT == 1, GeluWith<VectorisableErfc, VectorisableExp>,
                                                    GeluTanhWith<VectorisableExp>>>;

// out[c] = act(g[c]) * u[c] (forward), or the two gradients (backward), for c < n, in fp32 arrays.
template <typename Fn>
[[gnu::always_inline]] inline void forward_span(const float* g, const float* u, float* out, int64_t n) {
  for (int64_t c = 0; c < n; ++c) out[c] = Fn::value(g[c]) * u[c];
}
template <typename Fn>
[[gnu::always_inline]] inline void backward_span(const float* g, const float* u, const float* d, float* gg, float* gu,
                                                 int64_t n) {
  for (int64_t c = 0; c < n; ++c) {
    const float x = g[c], up = u[c], grad = d[c];  // read before either write: outputs may alias inputs
    gg[c] = grad * up * Fn::derivative(x);
    gu[c] = grad * Fn::value(x);
  }
}

constexpr int64_t kChunk = 256;  // fp16 / bf16 columns per pass through fp32 scratch

// Rows [begin, end) of the op, compiled per SIMD width (LLMK_CPU_CLONES). fp16 / bf16 rows go
// through fp32 scratch a chunk at a time: the conversions, the activation and the rounding then
// run as separate loops that vectorise at full width (one loop mixing 16- and 32-bit elements
// spilled its registers: bf16 SwiGLU took 2.2x the fp32 time). The arithmetic is the same.
template <typename T, int ACT>
LLMK_CPU_CLONES void run_rows(const GatedParams& p, int64_t begin, int64_t end) {
  using Fn = CpuFn<ACT>;
  float g[kChunk], u[kChunk], d[kChunk], out0[kChunk], out1[kChunk];
  auto load = [](const T* src, float* dst, int64_t n) {
    for (int64_t c = 0; c < n; ++c) dst[c] = to_float(src[c]);
  };
  auto store = [](const float* src, T* dst, int64_t n) {
    for (int64_t c = 0; c < n; ++c) dst[c] = from_float<T>(src[c]);
  };
  for (int64_t r = begin; r < end; ++r) {
    const T* gate = static_cast<const T*>(p.gate) + r * p.gate_stride;
    const T* up = static_cast<const T*>(p.up) + r * p.up_stride;
    T* out = p.backward() ? nullptr : static_cast<T*>(p.out) + r * p.out_stride;
    const T* go = p.backward() ? static_cast<const T*>(p.grad_out) + r * p.grad_out_stride : nullptr;
    T* gg = p.backward() ? static_cast<T*>(p.grad_gate) + r * p.grad_gate_stride : nullptr;
    T* gu = p.backward() ? static_cast<T*>(p.grad_up) + r * p.grad_up_stride : nullptr;
    if constexpr (std::is_same_v<T, float>) {
      if (!p.backward()) forward_span<Fn>(gate, up, out, p.cols);
      else backward_span<Fn>(gate, up, go, gg, gu, p.cols);
      continue;
    }
    for (int64_t c0 = 0; c0 < p.cols; c0 += kChunk) {
      const int64_t n = std::min(kChunk, p.cols - c0);
      load(gate + c0, g, n);
      load(up + c0, u, n);
      if (!p.backward()) {
        forward_span<Fn>(g, u, out0, n);
        store(out0, out + c0, n);
      } else {
        load(go + c0, d, n);
        backward_span<Fn>(g, u, d, out0, out1, n);
        store(out0, gg + c0, n);
        store(out1, gu + c0, n);
      }
    }
  }
}

template <typename T, int ACT>
void run(const GatedParams& p) {
  parallel_rows(p.rows, grain_for(p.cols),
                [&](int64_t begin, int64_t end) { run_rows<T, ACT>(p, begin, end); });
}

template <typename T>
void with_activation(const GatedParams& p) {
  switch (p.act) {
    case Activation::silu: run<T, 0>(p); break;
    case Activation::gelu: run<T, 1>(p); break;
    case Activation::gelu_tanh: run<T, 2>(p); break;
  }
}

}  // namespace

void gated_activation_cpu(const GatedParams& p) {
  switch (p.dtype) {
    case DType::f32: with_activation<float>(p); break;
    case DType::f16: with_activation<Half>(p); break;
    case DType::bf16: with_activation<BFloat16>(p); break;
    default: fail(ErrorKind::type, "gated_activation", "unsupported dtype");
  }
}

}  // namespace llmk::detail
