// Gated activations on the CPU: rows split over the installed threads (core/parallel.h), a
// plain loop over each row's columns, fp32 arithmetic. SiLU takes its exp from exp_vectorisable
// below, so that the compiler vectorises its loops (a libm expf call per element does not).
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#include "activation/activation_internal.h"
#include "activation/activation_math.h"
#include "core/check.h"
#include "core/half.h"
#include "core/parallel.h"

namespace llmk::detail {

namespace {

// e^x in plain float arithmetic (Cephes' expf: x = n ln2 + r, |r| <= ln2/2, a degree-7
// polynomial in r, times 2^n built in the exponent bits): within 2 ulp of libm's expf from -86.6
// to 88.72283; 0 below (libm's results there are under 2.7e-38), inf above, NaN stays NaN. No
// calls and no branches, so loops over it vectorise.
inline float exp_vectorisable(float x) {
  constexpr float kHi = 88.72283f, kLo = -86.6f;
  float xc = x > kLo ? x : kLo;  // NaN -> kLo here; restored below
  xc = xc < kHi ? xc : kHi;
  constexpr float kRound = 12582912.f;  // 1.5 * 2^23: adding it rounds to an integer
  const float n = (xc * 1.44269504088896341f + kRound) - kRound;  // in [-125, 128]
  const float r = (xc - n * 0.693359375f) - n * -2.12194440e-4f;   // ln2 in two parts
  float q = 1.9875691500e-4f;
  q = q * r + 1.3981999507e-3f;
  q = q * r + 8.3334519073e-3f;
  q = q * r + 4.1665795894e-2f;
  q = q * r + 1.6666665459e-1f;
  q = q * r + 5.0000001201e-1f;
  const float poly = q * r * r + r + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 126) << 23;  // 2^(n-1): a normal float
  float half_scale;
  std::memcpy(&half_scale, &bits, 4);
  const float y = poly * half_scale * 2.f;
  const float out_of_range = x < kLo ? 0.f : std::numeric_limits<float>::infinity();
  return x != x ? x : (x >= kLo && x <= kHi ? y : out_of_range);
}

struct VectorisableExp {
  static float of(float x) { return exp_vectorisable(x); }
};

// ActivationFn<ACT>, with SiLU's exp the vectorisable one.
template <int ACT>
using CpuFn = std::conditional_t<ACT == 0, SiluWith<VectorisableExp>, ActivationFn<ACT>>;

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
