// torch.library registration of the Monarch product (namespace llm_kernels): forward and the
// backward (dx, dw1, dw2), and its autograd (see bridge.h). Workspaces for the GPU come from
// torch's caching allocator.
#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <tuple>
#include <vector>

#include "llmk/monarch.h"
#include "torch/bridge.h"

namespace {

using llmk::torch_bridge::AutogradContext;
using llmk::torch_bridge::find_op;
using llmk::torch_bridge::guarded;
using llmk::torch_bridge::rows_ready;
using llmk::torch_bridge::shape_string;
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

// The backward as the two-bmm formulation's (python/llm_kernels/monarch.py, monarch_matmul_ref),
// on at::bmm (the vendor BLAS): recompute y = x_b w1_b^T, then dz = dO w2, dw2 = dO^T z,
// dy = dz in block order, dw1 = dy^T x_b, dx = dy w1. w1 (k, q, p), w2 (l, s, r); x (B, k*p) and
// dout (B, l*s) already row-major with the leading dims flattened.
std::tuple<at::Tensor, at::Tensor, at::Tensor> backward_bmm(const at::Tensor& dout, const at::Tensor& x,
                                                             const at::Tensor& w1, const at::Tensor& w2) {
  const int64_t k = w1.size(0), q = w1.size(1), p = w1.size(2);
  const int64_t l = w2.size(0), s = w2.size(1), r = w2.size(2);
  const int64_t rows = x.numel() / (k * p);
  const at::Tensor xb = x.reshape({rows, k, p}).transpose(0, 1);                         // (k, B, p)
  const at::Tensor z = at::bmm(xb, w1.transpose(1, 2))                                   // (k, B, q)
                           .transpose(0, 1).reshape({rows, r, l}).permute({2, 0, 1});    // (l, B, r)
  const at::Tensor d_o = dout.reshape({rows, s, l}).permute({2, 0, 1});                  // (l, B, s)
  const at::Tensor dz = at::bmm(d_o, w2);                                                // (l, B, r)
  const at::Tensor dw2 = at::bmm(d_o.transpose(1, 2), z);                                // (l, s, r)
  const at::Tensor dy = dz.permute({1, 2, 0}).reshape({rows, k, q}).transpose(0, 1);     // (k, B, q)
  const at::Tensor dw1 = at::bmm(dy.transpose(1, 2), xb);                                // (k, q, p)
  const at::Tensor dx = at::bmm(dy, w1).transpose(0, 1).reshape(x.sizes());              // (B, k*p)
  return {dx, dw1, dw2};
}

// Blocks this wide (p and r) take backward_bmm on the GPU up to kBmmBackwardMaxRows rows, where
// cuBLAS's batched GEMMs beat our backward kernels even with y recomputed
// (scripts/monarch_backward_sweep.py, H200, 2026-12-02, bf16, blocks of 2048 at n = 4096, 8192 and
// 16384: 0.25-0.33x our time at 64 tokens, 0.42-0.74x at 256, 0.93-0.95x at 2048, but 1.09-1.21x
// at 8192). Blocks of 1024 stay on our kernels (0.63-1.80x there: no clear winner below 2048).
// LLMK_MONARCH_BACKWARD=bmm or =kernel forces either, on any device.
constexpr int64_t kBmmBackwardMinBlock = 2048;
constexpr int64_t kBmmBackwardMaxRows = 4096;

bool backward_on_bmm(const at::Tensor& x, const at::Tensor& w1, const at::Tensor& w2) {
  // bad ranks and empty factors: the kernel path's checks and its empty cases
  if (w1.dim() != 3 || w2.dim() != 3 || w1.numel() == 0 || w2.numel() == 0) return false;
  const char* force = std::getenv("LLMK_MONARCH_BACKWARD");
  if (force != nullptr && std::strcmp(force, "bmm") == 0) return true;
  if (force != nullptr && std::strcmp(force, "kernel") == 0) return false;
  if (!x.is_cuda()) return false;
  const int64_t rows = x.numel() / (w1.size(0) * w1.size(2));
  return std::min(w1.size(2), w2.size(2)) >= kBmmBackwardMinBlock && rows <= kBmmBackwardMaxRows;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> monarch_matmul_backward(const at::Tensor& dout_in,
                                                                       const at::Tensor& x_in,
                                                                       const at::Tensor& w1_in,
                                                                       const at::Tensor& w2_in) {
  c10::OptionalDeviceGuard guard(x_in.device());
  const at::Tensor x = rows_ready(x_in), dout = rows_ready(dout_in);
  const at::Tensor w1 = w1_in.contiguous(), w2 = w2_in.contiguous();
  if (backward_on_bmm(x, w1, w2)) {
    // the library's checks of x, w1 and w2 (the workspace query runs them), then dout's
    guarded([&] { llmk::monarch_backward_workspace_bytes(view_of(x), view_of(w1), view_of(w2)); });
    const auto want = out_shape(x, w2.size(0) * w2.size(1));
    TORCH_CHECK_TYPE(dout.scalar_type() == x.scalar_type() && dout.device() == x.device(),
                     "llm_kernels: monarch_matmul_backward: dout: expected the dtype and device of x");
    TORCH_CHECK_VALUE(dout.sizes() == at::IntArrayRef(want), "llm_kernels: monarch_matmul_backward: dout: expected shape " +
                      shape_string(want) + ", got " + shape_string(dout.sizes()));
    return backward_bmm(dout, x, w1, w2);
  }
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
