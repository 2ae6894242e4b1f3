// Gated activations on the CPU: rows split over the installed threads (core/parallel.h), a
// plain loop over each row's columns, fp32 arithmetic. The activations take exp and erfc from
// core/vector_math.h, so that the compiler vectorises their loops (a libm call per element does
// not).
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

// Rows [begin, end) of the op, compiled per SIMD width (LLMK_CPU_CLONES).
template <typename T, int ACT>
LLMK_CPU_CLONES void run_rows(const GatedParams& p, int64_t begin, int64_t end) {
  using Fn = CpuFn<ACT>;
  for (int64_t r = begin; r < end; ++r) {
    const T* g = static_cast<const T*>(p.gate) + r * p.gate_stride;
    const T* u = static_cast<const T*>(p.up) + r * p.up_stride;
    if (!p.backward()) {
      T* out = static_cast<T*>(p.out) + r * p.out_stride;
      for (int64_t c = 0; c < p.cols; ++c)
        out[c] = from_float<T>(Fn::value(to_float(g[c])) * to_float(u[c]));
    } else {
      const T* go = static_cast<const T*>(p.grad_out) + r * p.grad_out_stride;
      T* gg = static_cast<T*>(p.grad_gate) + r * p.grad_gate_stride;
      T* gu = static_cast<T*>(p.grad_up) + r * p.grad_up_stride;
      for (int64_t c = 0; c < p.cols; ++c) {
        const float x = to_float(g[c]), up = to_float(u[c]), d = to_float(go[c]);
        gg[c] = from_float<T>(d * up * Fn::derivative(x));
        gu[c] = from_float<T>(d * Fn::value(x));
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
