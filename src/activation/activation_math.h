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

template <>
struct ActivationFn<0> {  // silu(x) = x * sigmoid(x)
  static LLMK_HOST_DEVICE float value(float x) { return x / (1.f + expf(-x)); }
  static LLMK_HOST_DEVICE float derivative(float x) {
    const float s = 1.f / (1.f + expf(-x));
    return s * (1.f + x * (1.f - s));
  }
};

template <>
struct ActivationFn<1> {  // gelu(x) = x/2 * (1 + erf(x / sqrt 2))
  static LLMK_HOST_DEVICE float value(float x) { return 0.5f * x * (1.f + erff(x * kSqrtHalf)); }
  static LLMK_HOST_DEVICE float derivative(float x) {
    return 0.5f * (1.f + erff(x * kSqrtHalf)) + x * kInvSqrt2Pi * expf(-0.5f * x * x);
  }
};

template <>
struct ActivationFn<2> {  // gelu_tanh(x) = x/2 * (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
  static LLMK_HOST_DEVICE float value(float x) {
    return 0.5f * x * (1.f + tanhf(kSqrt2OverPi * (x + kGeluTanhCubic * x * x * x)));
  }
  static LLMK_HOST_DEVICE float derivative(float x) {
    const float t = tanhf(kSqrt2OverPi * (x + kGeluTanhCubic * x * x * x));
    return 0.5f * (1.f + t) +
           0.5f * x * (1.f - t * t) * kSqrt2OverPi * (1.f + 3.f * kGeluTanhCubic * x * x);
  }
};

}  // namespace llmk::detail
