// torch.library registration of RoPE (namespace llm_kernels). q and k arrive as (B, S, H, D)
// views (the Python layer transposes (B, H, S, D) tensors without copying); outputs keep the
// inputs' memory layout. Autograd is registered here (see bridge.h), fake implementations in
// python/llm_kernels/ops.py.
#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>
#include <torch/library.h>

#include <string>
#include <tuple>

#include "llmk/rope.h"
#include "torch/bridge.h"

namespace {

using llmk::torch_bridge::AutogradContext;
using llmk::torch_bridge::find_op;
using llmk::torch_bridge::guarded;
using llmk::torch_bridge::last_dim_contiguous;
using llmk::torch_bridge::stream_of;
using llmk::torch_bridge::variable_list;
using llmk::torch_bridge::view_of;

llmk::RopeStyle parse(const std::string& style) {
  if (style == "neox") return llmk::RopeStyle::neox;
  if (style == "gptj") return llmk::RopeStyle::gptj;
  TORCH_CHECK_VALUE(false, "llm_kernels: rope style: expected 'neox' or 'gptj', got '" + style + "'");
}


std::tuple<at::Tensor, at::Tensor> rope_cached(const at::Tensor& q_in, const at::Tensor& k_in,
                                               const at::Tensor& cache, const at::Tensor& positions,
                                               const std::string& style, bool inverse) {
  c10::OptionalDeviceGuard guard(q_in.device());
  const at::Tensor q = last_dim_contiguous(q_in), k = last_dim_contiguous(k_in);
  at::Tensor q_out = at::empty_like(q), k_out = at::empty_like(k);
  guarded([&] {
    llmk::rope_cached(view_of(q_out), view_of(k_out), view_of(q), view_of(k),
                      view_of(last_dim_contiguous(cache)), view_of(positions), parse(style), inverse,
                      stream_of(q));
  });
  return {q_out, k_out};
}

void rope_cached_(at::Tensor& q, at::Tensor& k, const at::Tensor& cache, const at::Tensor& positions,
                  const std::string& style) {
  c10::OptionalDeviceGuard guard(q.device());
  guarded([&] {
    llmk::rope_cached(view_of(q), view_of(k), view_of(q), view_of(k), view_of(last_dim_contiguous(cache)),
                      view_of(positions), parse(style), false, stream_of(q));
  });
}

std::tuple<at::Tensor, at::Tensor> rope_cos_sin(const at::Tensor& q_in, const at::Tensor& k_in,
                                                const at::Tensor& cos, const at::Tensor& sin,
                                                const std::string& style, bool inverse) {
  c10::OptionalDeviceGuard guard(q_in.device());
  const at::Tensor q = last_dim_contiguous(q_in), k = last_dim_contiguous(k_in);
  at::Tensor q_out = at::empty_like(q), k_out = at::empty_like(k);
  guarded([&] {
    llmk::rope_cos_sin(view_of(q_out), view_of(k_out), view_of(q), view_of(k),
                       view_of(last_dim_contiguous(cos)), view_of(last_dim_contiguous(sin)),
                       parse(style), inverse, stream_of(q));
  });
  return {q_out, k_out};
}

void rope_cos_sin_(at::Tensor& q, at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin,
                   const std::string& style) {
  c10::OptionalDeviceGuard guard(q.device());
  guarded([&] {
    llmk::rope_cos_sin(view_of(q), view_of(k), view_of(q), view_of(k), view_of(last_dim_contiguous(cos)),
                       view_of(last_dim_contiguous(sin)), parse(style), false, stream_of(q));
  });
}

// cos and sin (B, S, width) of `dtype` from inv_freq (F,) float32 and positions (B, S) (see
// llmk::rope_angles), on positions' device.
std::tuple<at::Tensor, at::Tensor> rope_angles(const at::Tensor& inv_freq, const at::Tensor& positions, double scaling,
                                               int64_t width, at::ScalarType dtype) {
  c10::OptionalDeviceGuard guard(positions.device());
  TORCH_CHECK_VALUE(positions.dim() == 2, "llm_kernels: rope_angles: positions: expected (batch, tokens), got " +
                                               std::to_string(positions.dim()) + " dims");
  const auto options = positions.options().dtype(dtype);
  at::Tensor cos = at::empty({positions.size(0), positions.size(1), width}, options);
  at::Tensor sin = at::empty({positions.size(0), positions.size(1), width}, options);
  guarded([&] {
    llmk::rope_angles(view_of(cos), view_of(sin), view_of(inv_freq), view_of(positions), static_cast<float>(scaling),
                      stream_of(positions));
  });
  return {cos, sin};
}

// The rotation's gradient is the inverse rotation of the output gradients (the same op, inverse
// flipped). Op names the op (rope_cached or rope_cos_sin: one signature; a and b are its angle
// inputs: cos_sin_cache and positions, or cos and sin).
struct RopeCached {
  static constexpr const char* name = "llm_kernels::rope_cached";
};
struct RopeCosSin {
  static constexpr const char* name = "llm_kernels::rope_cos_sin";
};
using RopeKernel = decltype(rope_cached);

template <typename Op>
class RopeFunction : public torch::autograd::Function<RopeFunction<Op>> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k, const at::Tensor& a,
                               const at::Tensor& b, const std::string& style, bool inverse) {
    ctx->save_for_backward({a, b});
    ctx->saved_data["style"] = style;
    ctx->saved_data["inverse"] = inverse;
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    auto [q_out, k_out] = op().call(q, k, a, b, style, inverse);
    return {q_out, k_out};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    auto [grad_q, grad_k] = op().call(grads[0], grads[1], saved[0], saved[1], ctx->saved_data["style"].toStringRef(),
                                      !ctx->saved_data["inverse"].toBool());
    return {grad_q, grad_k, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }

 private:
  static const c10::TypedOperatorHandle<RopeKernel>& op() {
    static const auto handle = find_op<RopeKernel>(Op::name);
    return handle;
  }
};

template <typename Op>
std::tuple<at::Tensor, at::Tensor> rope_autograd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& a,
                                                 const at::Tensor& b, const std::string& style, bool inverse) {
  const variable_list out = RopeFunction<Op>::apply(q, k, a, b, style, inverse);
  return {out[0], out[1]};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llm_kernels, m) {
  m.def("rope_cached(Tensor q, Tensor k, Tensor cos_sin_cache, Tensor positions, str style, "
        "bool inverse=False) -> (Tensor, Tensor)");
  m.def("rope_cached_(Tensor(a!) q, Tensor(b!) k, Tensor cos_sin_cache, Tensor positions, "
        "str style) -> ()");
  m.def("rope_cos_sin(Tensor q, Tensor k, Tensor cos, Tensor sin, str style, bool inverse=False) "
        "-> (Tensor, Tensor)");
  m.def("rope_cos_sin_(Tensor(a!) q, Tensor(b!) k, Tensor cos, Tensor sin, str style) -> ()");
  m.def("rope_angles(Tensor inv_freq, Tensor positions, float scaling, int width, ScalarType dtype) "
        "-> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(llm_kernels, CPU, m) {
  m.impl("rope_angles", &rope_angles);
  m.impl("rope_cached", &rope_cached);
  m.impl("rope_cached_", &rope_cached_);
  m.impl("rope_cos_sin", &rope_cos_sin);
  m.impl("rope_cos_sin_", &rope_cos_sin_);
}

TORCH_LIBRARY_IMPL(llm_kernels, CUDA, m) {
  m.impl("rope_angles", &rope_angles);
  m.impl("rope_cached", &rope_cached);
  m.impl("rope_cached_", &rope_cached_);
  m.impl("rope_cos_sin", &rope_cos_sin);
  m.impl("rope_cos_sin_", &rope_cos_sin_);
}

TORCH_LIBRARY_IMPL(llm_kernels, Autograd, m) {
  m.impl("rope_cached", &rope_autograd<RopeCached>);
  m.impl("rope_cos_sin", &rope_autograd<RopeCosSin>);
}
