// The activation functions and their derivatives, shared by the CPU and GPU backends
// (host and device). float in, float out.
#pragma once

#include <cmath>

#include "gpu/host_device.h"

namespace llmk::detail {

constexpr float kSqrtHalf = 0.70710678118654752f;        // 1/sqrt(2)
constexpr float kInvSqrt2Pi = 0.39894228040143268f;      // 1/sqrt(2 pi)
constexpr float kSqrt2OverPi = 0.79788456080286536f;     // sqrt(2/pi)
constexpr float kGeluTanhCubic = 0.044715f;

// act(x) and act'(x) for the three activations; ACT is the llmk::Activation value.
template <int ACT>
struct ActivationFn;

// silu(x) = x * sigmoid(x), with e^x from Exp::of (the CPU backend passes its vectorisable one).
template <typename Exp>
struct SiluWith {
  static LLMK_HOST_DEVICE float value(float x) { return x / (1.f + Exp::of(-x)); }
  static LLMK_HOST_DEVICE float derivative(float x) {
    const float s = 1.f / (1.f + Exp::of(-x));
    return s * (1.f + x * (1.f - s));
  }
};

struct LibmExp {
  static LLMK_HOST_DEVICE float of(float x) { return expf(x); }
};

template <>
struct ActivationFn<0> : SiluWith<LibmExp> {};

// The gelu forms are written so that no 1 + (something near -1) cancels: for large negative x the
// values are tiny but keep their relative accuracy (erfc, and 1 + tanh(z) = 2 sigmoid(2z)).
// gelu(x) = x/2 * (1 + erf(x / sqrt 2)) = x/2 * erfc(-x / sqrt 2), with erfc from Erfc::of and
// e^x from Exp::of (the CPU backend passes vectorisable ones).
template <typename Erfc, typename Exp>
struct GeluWith {
  static LLMK_HOST_DEVICE float value(float x) { return 0.5f * x * Erfc::of(-x * kSqrtHalf); }
  static LLMK_HOST_DEVICE float derivative(float x) {
    return 0.5f * Erfc::of(-x * kSqrtHalf) + x * kInvSqrt2Pi * Exp::of(-0.5f * x * x);
  }
};

struct LibmErfc {
  static LLMK_HOST_DEVICE float of(float x) { return erfcf(x); }
};

template <>
struct ActivationFn<1> : GeluWith<LibmErfc, LibmExp> {};

// gelu_tanh(x) = x/2 * (1 + tanh(z)) = x * sigmoid(2z), z = sqrt(2/pi) (x + 0.044715 x^3), with
// e^x from Exp::of as in SiluWith.
template <typename Exp>
struct GeluTanhWith {
  static LLMK_HOST_DEVICE float sigmoid_2z(float x) {
    return 1.f / (1.f + Exp::of(-2.f * kSqrt2OverPi * (x + kGeluTanhCubic * x * x * x)));
  }
  static LLMK_HOST_DEVICE float value(float x) { return x * sigmoid_2z(x); }
  static LLMK_HOST_DEVICE float derivative(float x) {
    const float s = sigmoid_2z(x);
    return s + x * s * (1.f - s) * 2.f * kSqrt2OverPi * (1.f + 3.f * kGeluTanhCubic * x * x);
  }
};

template <>
struct ActivationFn<2> : GeluTanhWith<LibmExp> {};

}  // namespace llmk::detail
