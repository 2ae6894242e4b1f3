// torch.library registration of the skinny GEMM (namespace llm_kernels): y = x W^T (+ bias), or
// silu(g) * u of it with activation "swiglu" (gelu_tanh(g) * u with "geglu_tanh"), optionally with the RMSNorm prologue (norm_weight)
// and the residual epilogue (residual; the result is a new tensor); fixed_weight: the weight is no
// kernel's output still in flight (a parameter), so the GPU kernel may read it before its PDL wait
// (GemmOptions::fixed_weight). Any M here; the Python wrapper sends M > 16 to F.linear / torch.matmul.
#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>
#include <torch/library.h>

#include <optional>
#include <string>
#include <vector>

#include "llmk/gemm.h"
#include "torch/bridge.h"

namespace {

using llmk::torch_bridge::guarded;
using llmk::torch_bridge::last_dim_contiguous;
using llmk::torch_bridge::optional_view;
using llmk::torch_bridge::rows_ready;
using llmk::torch_bridge::stream_of;
using llmk::torch_bridge::view_of;

llmk::GemmActivation parse(const std::string& a) {
  if (a == "none") return llmk::GemmActivation::none;
  if (a == "swiglu") return llmk::GemmActivation::swiglu;
  if (a == "geglu_tanh") return llmk::GemmActivation::geglu_tanh;
  TORCH_CHECK_VALUE(false, "llm_kernels: skinny_gemm: activation: expected 'none', 'swiglu' or 'geglu_tanh', got '" +
                               a + "'");
}

at::Tensor skinny_gemm(const at::Tensor& x_in, const at::Tensor& weight_in, const std::optional<at::Tensor>& bias,
                       const std::string& activation, bool portable, const std::optional<at::Tensor>& norm_weight,
                       double norm_eps, double norm_offset, const std::optional<at::Tensor>& residual,
                       bool fixed_weight) {
  c10::OptionalDeviceGuard guard(x_in.device());
  const llmk::GemmActivation act = parse(activation);
  const at::Tensor x = rows_ready(x_in), weight = rows_ready(weight_in);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  if (!shape.empty() && weight.dim() == 2)
    shape.back() = llmk::gemm_gated(act) ? weight.size(0) / 2 : weight.size(0);
  at::Tensor out = at::empty(shape, x.options());
  llmk::GemmOptions opt;
  opt.activation = act;
  opt.portable = portable;
  opt.fixed_weight = fixed_weight;
  const at::Tensor nw = norm_weight ? norm_weight->contiguous() : at::Tensor();
  const at::Tensor res = residual ? rows_ready(*residual) : at::Tensor();
  if (nw.defined()) opt.norm_weight = view_of(nw);
  opt.norm_eps = static_cast<float>(norm_eps);
  opt.norm_offset = static_cast<float>(norm_offset);
  if (res.defined()) opt.residual = view_of(res);
  guarded([&] {
    llmk::skinny_gemm(view_of(out), view_of(x), view_of(weight),
                      bias ? view_of(bias->contiguous()) : llmk::TensorView{}, opt, stream_of(x));
  });
  return out;
}

// skinny_gemm_rope_kv (llmk/gemm.h): a new out (x's leading dims, N) = [rope(q) | rope(k) | v], the
// caches written in place (and the length counter advanced). cos, sin (M, D / 2), positions (M): any
// row stride (0: shared by every row).
at::Tensor skinny_gemm_rope_kv(const at::Tensor& x_in, const at::Tensor& weight_in, const std::optional<at::Tensor>& bias,
                               int64_t q_heads, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& positions,
                               at::Tensor& k_cache, at::Tensor& v_cache, const std::optional<at::Tensor>& advance,
                               const std::optional<at::Tensor>& counter, const std::optional<at::Tensor>& norm_weight,
                               double norm_eps, double norm_offset, bool fixed_weight) {
  c10::OptionalDeviceGuard guard(x_in.device());
  const at::Tensor x = rows_ready(x_in), weight = rows_ready(weight_in);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  if (!shape.empty() && weight.dim() == 2) shape.back() = weight.size(0);
  at::Tensor out = at::empty(shape, x.options());
  llmk::GemmOptions opt;
  const at::Tensor nw = norm_weight ? norm_weight->contiguous() : at::Tensor();
  if (nw.defined()) opt.norm_weight = view_of(nw);
  opt.norm_eps = static_cast<float>(norm_eps);
  opt.norm_offset = static_cast<float>(norm_offset);
  opt.fixed_weight = fixed_weight;
  llmk::GemmRopeKv rope;
  rope.q_heads = q_heads;
  const at::Tensor c = last_dim_contiguous(cos), s = last_dim_contiguous(sin);
  rope.cos = view_of(c);
  rope.sin = view_of(s);
  rope.positions = view_of(positions);
  rope.k_cache = view_of(k_cache);
  rope.v_cache = view_of(v_cache);
  rope.advance = optional_view(advance);
  rope.counter = optional_view(counter);
  guarded([&] {
    llmk::skinny_gemm_rope_kv(view_of(out), view_of(x), view_of(weight),
                              bias ? view_of(bias->contiguous()) : llmk::TensorView{}, rope, opt, stream_of(x));
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llm_kernels, m) {
  m.def(
      "skinny_gemm(Tensor x, Tensor weight, Tensor? bias=None, str activation='none', bool portable=False, "
      "Tensor? norm_weight=None, float norm_eps=1e-6, float norm_offset=0., Tensor? residual=None, "
      "bool fixed_weight=False) -> Tensor");
  m.def(
      "skinny_gemm_rope_kv(Tensor x, Tensor weight, Tensor? bias, int q_heads, Tensor cos, Tensor sin, "
      "Tensor positions, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor(c!)? advance=None, Tensor(d!)? counter=None, "
      "Tensor? norm_weight=None, float norm_eps=1e-6, float norm_offset=0., bool fixed_weight=False) -> Tensor");
}

TORCH_LIBRARY_IMPL(llm_kernels, CPU, m) {
  m.impl("skinny_gemm", &skinny_gemm);
  m.impl("skinny_gemm_rope_kv", &skinny_gemm_rope_kv);
}
TORCH_LIBRARY_IMPL(llm_kernels, CUDA, m) {
  m.impl("skinny_gemm", &skinny_gemm);
  m.impl("skinny_gemm_rope_kv", &skinny_gemm_rope_kv);
}
