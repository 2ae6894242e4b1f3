// torch.library registration of the Monarch product (namespace llm_kernels): forward and the
// backward (dx, dw1, dw2), and its autograd (see bridge.h). Workspaces for the GPU come from
// torch's caching allocator.
#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>
#include <torch/library.h>

#include <tuple>
#include <vector>

#include "llmk/monarch.h"
#include "torch/bridge.h"

namespace {

using llmk::torch_bridge::AutogradContext;
using llmk::torch_bridge::find_op;
using llmk::torch_bridge::guarded;
using llmk::torch_bridge::rows_ready;
using llmk::torch_bridge::stream_of;
using llmk::torch_bridge::variable_list;
using llmk::torch_bridge::view_of;

std::vector<int64_t> out_shape(const at::Tensor& x, int64_t last) {
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  if (!shape.empty()) shape.back() = last;
  return shape;
}

at::Tensor workspace(const at::Tensor& x, std::size_t bytes) {
  return at::empty({static_cast<int64_t>(bytes)}, x.options().dtype(at::kByte));
}

at::Tensor monarch_matmul(const at::Tensor& x_in, const at::Tensor& w1_in, const at::Tensor& w2_in) {
  c10::OptionalDeviceGuard guard(x_in.device());
  const at::Tensor x = rows_ready(x_in), w1 = w1_in.contiguous(), w2 = w2_in.contiguous();
  const int64_t m = w2.dim() == 3 ? w2.size(0) * w2.size(1) : 0;
  at::Tensor out = at::empty(out_shape(x, m), x.options());
  guarded([&] {
    const std::size_t bytes = llmk::monarch_matmul_workspace_bytes(view_of(x), view_of(w1), view_of(w2));
    const at::Tensor ws = bytes ? workspace(x, bytes) : at::Tensor();
    llmk::monarch_matmul(view_of(out), view_of(x), view_of(w1), view_of(w2),
                         bytes ? view_of(ws) : llmk::TensorView{}, stream_of(x));
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> monarch_matmul_backward(const at::Tensor& dout_in,
                                                                       const at::Tensor& x_in,
                                                                       const at::Tensor& w1_in,
                                                                       const at::Tensor& w2_in) {
  c10::OptionalDeviceGuard guard(x_in.device());
  const at::Tensor x = rows_ready(x_in), dout = rows_ready(dout_in);
  const at::Tensor w1 = w1_in.contiguous(), w2 = w2_in.contiguous();
  at::Tensor dx = at::empty(x.sizes(), x.options());
  at::Tensor dw1 = at::empty(w1.sizes(), w1.options()), dw2 = at::empty(w2.sizes(), w2.options());
  guarded([&] {
    const std::size_t bytes = llmk::monarch_backward_workspace_bytes(view_of(x), view_of(w1), view_of(w2));
    const at::Tensor ws = bytes ? workspace(x, bytes) : at::Tensor();
    llmk::monarch_matmul_backward(view_of(dx), view_of(dw1), view_of(dw2), view_of(dout), view_of(x),
                                  view_of(w1), view_of(w2), bytes ? view_of(ws) : llmk::TensorView{},
                                  stream_of(x));
  });
  return {dx, dw1, dw2};
}

// dx, dw1 and dw2 from monarch_matmul_backward (weight gradients accumulated in fp32 there).
class MonarchFunction : public torch::autograd::Function<MonarchFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w1, const at::Tensor& w2) {
    ctx->save_for_backward({x, w1, w2});
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    static const auto op = find_op<decltype(monarch_matmul)>("llm_kernels::monarch_matmul");
    return op.call(x, w1, w2);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    static const auto op = find_op<decltype(monarch_matmul_backward)>("llm_kernels::monarch_matmul_backward");
    auto [dx, dw1, dw2] = op.call(grads[0], saved[0], saved[1], saved[2]);
    return {dx, dw1, dw2};
  }
};

at::Tensor monarch_matmul_autograd(const at::Tensor& x, const at::Tensor& w1, const at::Tensor& w2) {
  return MonarchFunction::apply(x, w1, w2);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llm_kernels, m) {
  m.def("monarch_matmul(Tensor x, Tensor w1, Tensor w2) -> Tensor");
  m.def("monarch_matmul_backward(Tensor grad_out, Tensor x, Tensor w1, Tensor w2) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(llm_kernels, CPU, m) {
  m.impl("monarch_matmul", &monarch_matmul);
  m.impl("monarch_matmul_backward", &monarch_matmul_backward);
}

TORCH_LIBRARY_IMPL(llm_kernels, CUDA, m) {
  m.impl("monarch_matmul", &monarch_matmul);
  m.impl("monarch_matmul_backward", &monarch_matmul_backward);
}

TORCH_LIBRARY_IMPL(llm_kernels, Autograd, m) {
  m.impl("monarch_matmul", &monarch_matmul_autograd);
}
