// torch.library registration of the RMSNorm family (namespace llm_kernels). The same functions
// serve CPU and GPU tensors: llmk dispatches by device. Autograd is registered here (see
// bridge.h); fake (meta) implementations in python/llm_kernels/ops.py.
#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>
#include <torch/library.h>

#include <tuple>

#include "llmk/rmsnorm.h"
#include "torch/bridge.h"

namespace {

using llmk::torch_bridge::AutogradContext;
using llmk::torch_bridge::find_op;
using llmk::torch_bridge::guarded;
using llmk::torch_bridge::rows_ready;
using llmk::torch_bridge::stream_of;
using llmk::torch_bridge::variable_list;
using llmk::torch_bridge::view_of;

at::Tensor rms_norm(const at::Tensor& x_in, const at::Tensor& weight, double eps, double offset) {
  c10::OptionalDeviceGuard guard(x_in.device());
  const at::Tensor x = rows_ready(x_in);
  at::Tensor y = at::empty(x.sizes(), x.options());
  guarded([&] {
    llmk::rms_norm(view_of(y), view_of(x), view_of(weight), static_cast<float>(eps),
                   static_cast<float>(offset), stream_of(x));
  });
  return y;
}

std::tuple<at::Tensor, at::Tensor> fused_add_rms_norm(const at::Tensor& x_in,
                                                      const at::Tensor& residual_in,
                                                      const at::Tensor& weight, double eps,
                                                      double offset) {
  c10::OptionalDeviceGuard guard(x_in.device());
  const at::Tensor x = rows_ready(x_in), residual = rows_ready(residual_in);
  at::Tensor y = at::empty(x.sizes(), x.options());
  at::Tensor residual_out = at::empty(x.sizes(), x.options());
  guarded([&] {
    llmk::fused_add_rms_norm(view_of(y), view_of(residual_out), view_of(x), view_of(residual),
                             view_of(weight), static_cast<float>(eps), static_cast<float>(offset),
                             stream_of(x));
  });
  return {y, residual_out};
}

// residual = x + residual in place; residual must be readable as rows with one stride as it is
// (a copy could not stand in for it), which llmk checks.
at::Tensor fused_add_rms_norm_(const at::Tensor& x_in, at::Tensor& residual,
                               const at::Tensor& weight, double eps, double offset) {
  c10::OptionalDeviceGuard guard(x_in.device());
  const at::Tensor x = rows_ready(x_in);
  at::Tensor y = at::empty(x.sizes(), x.options());
  guarded([&] {
    const llmk::TensorView res = view_of(residual);
    llmk::fused_add_rms_norm(view_of(y), res, view_of(x), res, view_of(weight),
                             static_cast<float>(eps), static_cast<float>(offset), stream_of(x));
  });
  return y;
}

std::tuple<at::Tensor, at::Tensor> rms_norm_backward(const at::Tensor& grad_y_in,
                                                     const at::Tensor& x_in,
                                                     const at::Tensor& weight, double eps,
                                                     double offset,
                                                     const std::optional<at::Tensor>& grad_extra) {
  c10::OptionalDeviceGuard guard(x_in.device());
  const at::Tensor x = rows_ready(x_in), grad_y = rows_ready(grad_y_in);
  at::Tensor grad_x = at::empty(x.sizes(), x.options());
  at::Tensor grad_weight = at::empty(weight.sizes(), weight.options());
  guarded([&] {
    const llmk::TensorView xv = view_of(x);
    const std::size_t ws_bytes = llmk::rms_norm_backward_workspace_size(xv);
    at::Tensor workspace;
    if (ws_bytes)
      workspace = at::empty({static_cast<int64_t>((ws_bytes + 3) / 4)}, x.options().dtype(at::kFloat));
    at::Tensor extra;
    llmk::TensorView ev;
    if (grad_extra) {
      extra = rows_ready(*grad_extra);
      ev = view_of(extra);
    }
    llmk::rms_norm_backward(view_of(grad_x), view_of(grad_weight), view_of(grad_y), xv,
                            view_of(weight), static_cast<float>(eps), static_cast<float>(offset),
                            grad_extra ? &ev : nullptr, ws_bytes ? workspace.data_ptr() : nullptr,
                            stream_of(x));
  });
  return {grad_x, grad_weight};
}

// d/dx and d/dweight of y = x / rms(x) * (weight + offset).
class RmsNormFunction : public torch::autograd::Function<RmsNormFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight, double eps,
                            double offset) {
    ctx->save_for_backward({x, weight});
    ctx->saved_data["eps"] = eps;
    ctx->saved_data["offset"] = offset;
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    static const auto op = find_op<decltype(rms_norm)>("llm_kernels::rms_norm");
    return op.call(x, weight, eps, offset);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    static const auto op = find_op<decltype(rms_norm_backward)>("llm_kernels::rms_norm_backward");
    auto [grad_x, grad_weight] = op.call(grads[0], saved[0], saved[1], ctx->saved_data["eps"].toDouble(),
                                         ctx->saved_data["offset"].toDouble(), std::nullopt);
    return {grad_x, grad_weight, at::Tensor(), at::Tensor()};
  }
};

// residual_out = x + residual is the normalised input; x and residual both get its gradient, which
// also collects residual_out's own (grad_extra).
class FusedAddRmsNormFunction : public torch::autograd::Function<FusedAddRmsNormFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& residual,
                               const at::Tensor& weight, double eps, double offset) {
    static const auto op = find_op<decltype(fused_add_rms_norm)>("llm_kernels::fused_add_rms_norm");
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    auto [y, residual_out] = op.call(x, residual, weight, eps, offset);
    ctx->save_for_backward({residual_out, weight});
    ctx->saved_data["eps"] = eps;
    ctx->saved_data["offset"] = offset;
    return {y, residual_out};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    static const auto op = find_op<decltype(rms_norm_backward)>("llm_kernels::rms_norm_backward");
    auto [grad_sum, grad_weight] = op.call(grads[0], saved[0], saved[1], ctx->saved_data["eps"].toDouble(),
                                           ctx->saved_data["offset"].toDouble(), grads[1]);
    return {grad_sum, grad_sum, grad_weight, at::Tensor(), at::Tensor()};
  }
};

at::Tensor rms_norm_autograd(const at::Tensor& x, const at::Tensor& weight, double eps, double offset) {
  return RmsNormFunction::apply(x, weight, eps, offset);
}

std::tuple<at::Tensor, at::Tensor> fused_add_rms_norm_autograd(const at::Tensor& x, const at::Tensor& residual,
                                                               const at::Tensor& weight, double eps, double offset) {
  const variable_list out = FusedAddRmsNormFunction::apply(x, residual, weight, eps, offset);
  return {out[0], out[1]};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llm_kernels, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps, float offset=0.0) -> Tensor");
  m.def("fused_add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps, "
        "float offset=0.0) -> (Tensor, Tensor)");
  m.def("fused_add_rms_norm_(Tensor x, Tensor(a!) residual, Tensor weight, float eps, "
        "float offset=0.0) -> Tensor");
  m.def("rms_norm_backward(Tensor grad_y, Tensor x, Tensor weight, float eps, float offset, "
        "Tensor? grad_extra) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(llm_kernels, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("fused_add_rms_norm", &fused_add_rms_norm);
  m.impl("fused_add_rms_norm_", &fused_add_rms_norm_);
  m.impl("rms_norm_backward", &rms_norm_backward);
}

TORCH_LIBRARY_IMPL(llm_kernels, CUDA, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("fused_add_rms_norm", &fused_add_rms_norm);
  m.impl("fused_add_rms_norm_", &fused_add_rms_norm_);
  m.impl("rms_norm_backward", &rms_norm_backward);
}

TORCH_LIBRARY_IMPL(llm_kernels, Autograd, m) {
  m.impl("rms_norm", &rms_norm_autograd);
  m.impl("fused_add_rms_norm", &fused_add_rms_norm_autograd);
}
