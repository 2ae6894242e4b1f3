// torch.library registration of the gated activations (namespace llm_kernels). The packed ops
// slice x (..., 2d) into two row-strided views and call the same llmk functions: no copies.
// Autograd is registered here (see bridge.h), fake implementations in python/llm_kernels/ops.py.
#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>
#include <torch/library.h>

#include <string>
#include <tuple>

#include "llmk/activation.h"
#include "torch/bridge.h"

namespace {

using llmk::torch_bridge::AutogradContext;
using llmk::torch_bridge::find_op;
using llmk::torch_bridge::guarded;
using llmk::torch_bridge::rows_ready;
using llmk::torch_bridge::stream_of;
using llmk::torch_bridge::variable_list;
using llmk::torch_bridge::view_of;

llmk::Activation parse(const std::string& name) {
  if (name == "silu") return llmk::Activation::silu;
  if (name == "gelu") return llmk::Activation::gelu;
  if (name == "gelu_tanh") return llmk::Activation::gelu_tanh;
  TORCH_CHECK_VALUE(false, "llm_kernels: activation: expected 'silu', 'gelu' or 'gelu_tanh', got '" +
                               name + "'");
}

// The two halves of x (..., 2d) along the last dim.
std::tuple<at::Tensor, at::Tensor> halves(const at::Tensor& x, const char* op) {
  TORCH_CHECK_VALUE(x.dim() >= 1 && x.size(-1) % 2 == 0,
                    std::string("llmk::") + op + ": x: expected a last dim of even size (2 * d), got shape " +
                        llmk::torch_bridge::shape_string(x.sizes()));
  const int64_t d = x.size(-1) / 2;
  return {x.narrow(-1, 0, d), x.narrow(-1, d, d)};
}

at::Tensor gated_activation(const at::Tensor& gate_in, const at::Tensor& up_in,
                            const std::string& activation) {
  c10::OptionalDeviceGuard guard(gate_in.device());
  const at::Tensor gate = rows_ready(gate_in), up = rows_ready(up_in);
  at::Tensor out = at::empty(gate.sizes(), gate.options());
  guarded([&] {
    llmk::gated_activation(view_of(out), view_of(gate), view_of(up), parse(activation), stream_of(gate));
  });
  return out;
}

at::Tensor gated_activation_packed(const at::Tensor& x_in, const std::string& activation) {
  c10::OptionalDeviceGuard guard(x_in.device());
  const at::Tensor x = rows_ready(x_in);
  auto [gate, up] = halves(x, "gated_activation_packed");
  at::Tensor out = at::empty(gate.sizes(), x.options());
  guarded([&] {
    llmk::gated_activation(view_of(out), view_of(gate), view_of(up), parse(activation), stream_of(x));
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> gated_activation_backward(const at::Tensor& grad_out_in,
                                                             const at::Tensor& gate_in,
                                                             const at::Tensor& up_in,
                                                             const std::string& activation) {
  c10::OptionalDeviceGuard guard(gate_in.device());
  const at::Tensor gate = rows_ready(gate_in), up = rows_ready(up_in), grad_out = rows_ready(grad_out_in);
  at::Tensor grad_gate = at::empty(gate.sizes(), gate.options());
  at::Tensor grad_up = at::empty(gate.sizes(), gate.options());
  guarded([&] {
    llmk::gated_activation_backward(view_of(grad_gate), view_of(grad_up), view_of(grad_out),
                                    view_of(gate), view_of(up), parse(activation), stream_of(gate));
  });
  return {grad_gate, grad_up};
}

at::Tensor gated_activation_packed_backward(const at::Tensor& grad_out_in, const at::Tensor& x_in,
                                            const std::string& activation) {
  c10::OptionalDeviceGuard guard(x_in.device());
  const at::Tensor x = rows_ready(x_in), grad_out = rows_ready(grad_out_in);
  auto [gate, up] = halves(x, "gated_activation_packed_backward");
  at::Tensor grad_x = at::empty(x.sizes(), x.options());
  auto [grad_gate, grad_up] = halves(grad_x, "gated_activation_packed_backward");
  guarded([&] {
    llmk::gated_activation_backward(view_of(grad_gate), view_of(grad_up), view_of(grad_out),
                                    view_of(gate), view_of(up), parse(activation), stream_of(x));
  });
  return grad_x;
}

// act(gate) * up: gradients for gate and up.
class GatedFunction : public torch::autograd::Function<GatedFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& gate, const at::Tensor& up,
                            const std::string& activation) {
    ctx->save_for_backward({gate, up});
    ctx->saved_data["activation"] = activation;
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    static const auto op = find_op<decltype(gated_activation)>("llm_kernels::gated_activation");
    return op.call(gate, up, activation);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    static const auto op = find_op<decltype(gated_activation_backward)>("llm_kernels::gated_activation_backward");
    auto [grad_gate, grad_up] = op.call(grads[0], saved[0], saved[1], ctx->saved_data["activation"].toStringRef());
    return {grad_gate, grad_up, at::Tensor()};
  }
};

// The packed form: one gradient for x (..., 2d), its halves those of gate and up.
class GatedPackedFunction : public torch::autograd::Function<GatedPackedFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const std::string& activation) {
    ctx->save_for_backward({x});
    ctx->saved_data["activation"] = activation;
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    static const auto op = find_op<decltype(gated_activation_packed)>("llm_kernels::gated_activation_packed");
    return op.call(x, activation);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    static const auto op =
        find_op<decltype(gated_activation_packed_backward)>("llm_kernels::gated_activation_packed_backward");
    return {op.call(grads[0], saved[0], ctx->saved_data["activation"].toStringRef()), at::Tensor()};
  }
};

at::Tensor gated_activation_autograd(const at::Tensor& gate, const at::Tensor& up, const std::string& activation) {
  return GatedFunction::apply(gate, up, activation);
}

at::Tensor gated_activation_packed_autograd(const at::Tensor& x, const std::string& activation) {
  return GatedPackedFunction::apply(x, activation);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llm_kernels, m) {
  m.def("gated_activation(Tensor gate, Tensor up, str activation) -> Tensor");
  m.def("gated_activation_packed(Tensor x, str activation) -> Tensor");
  m.def("gated_activation_backward(Tensor grad_out, Tensor gate, Tensor up, str activation) "
        "-> (Tensor, Tensor)");
  m.def("gated_activation_packed_backward(Tensor grad_out, Tensor x, str activation) -> Tensor");
}

TORCH_LIBRARY_IMPL(llm_kernels, CPU, m) {
  m.impl("gated_activation", &gated_activation);
  m.impl("gated_activation_packed", &gated_activation_packed);
  m.impl("gated_activation_backward", &gated_activation_backward);
  m.impl("gated_activation_packed_backward", &gated_activation_packed_backward);
}

TORCH_LIBRARY_IMPL(llm_kernels, CUDA, m) {
  m.impl("gated_activation", &gated_activation);
  m.impl("gated_activation_packed", &gated_activation_packed);
  m.impl("gated_activation_backward", &gated_activation_backward);
  m.impl("gated_activation_packed_backward", &gated_activation_packed_backward);
}

TORCH_LIBRARY_IMPL(llm_kernels, Autograd, m) {
  m.impl("gated_activation", &gated_activation_autograd);
  m.impl("gated_activation_packed", &gated_activation_packed_autograd);
}
