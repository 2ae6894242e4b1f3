// torch.library registration of RoPE (namespace llm_kernels). q and k arrive as (B, S, H, D)
// views (the Python layer transposes (B, H, S, D) tensors without copying); outputs keep the
// inputs' memory layout.
#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>
#include <torch/library.h>

#include <string>
#include <tuple>

#include "llmk/rope.h"
#include "torch/bridge.h"

namespace {

using llmk::torch_bridge::guarded;
using llmk::torch_bridge::last_dim_contiguous;
using llmk::torch_bridge::stream_of;
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

}  // namespace

TORCH_LIBRARY_FRAGMENT(llm_kernels, m) {
  m.def("rope_cached(Tensor q, Tensor k, Tensor cos_sin_cache, Tensor positions, str style, "
        "bool inverse=False) -> (Tensor, Tensor)");
  m.def("rope_cached_(Tensor(a!) q, Tensor(b!) k, Tensor cos_sin_cache, Tensor positions, "
        "str style) -> ()");
  m.def("rope_cos_sin(Tensor q, Tensor k, Tensor cos, Tensor sin, str style, bool inverse=False) "
        "-> (Tensor, Tensor)");
  m.def("rope_cos_sin_(Tensor(a!) q, Tensor(b!) k, Tensor cos, Tensor sin, str style) -> ()");
}

TORCH_LIBRARY_IMPL(llm_kernels, CPU, m) {
  m.impl("rope_cached", &rope_cached);
  m.impl("rope_cached_", &rope_cached_);
  m.impl("rope_cos_sin", &rope_cos_sin);
  m.impl("rope_cos_sin_", &rope_cos_sin_);
}

TORCH_LIBRARY_IMPL(llm_kernels, CUDA, m) {
  m.impl("rope_cached", &rope_cached);
  m.impl("rope_cached_", &rope_cached_);
  m.impl("rope_cos_sin", &rope_cos_sin);
  m.impl("rope_cos_sin_", &rope_cos_sin_);
}
