// torch.library registration of attention (namespace llm_kernels). q, k, v arrive as
// (B, S, H, D) views (the Python layer transposes (B, H, S, D) tensors without copying); out keeps
// q's memory layout; lse is (B, Hq, Sq) float32.
#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>
#include <torch/library.h>

#include <optional>
#include <tuple>
#include <vector>

#include "attention/attention_internal.h"
#include "llmk/attention.h"
#include "torch/bridge.h"

namespace {

using llmk::torch_bridge::guarded;
using llmk::torch_bridge::last_dim_contiguous;
using llmk::torch_bridge::stream_of;
using llmk::torch_bridge::view_of;


std::tuple<at::Tensor, at::Tensor> attention(const at::Tensor& q_in, const at::Tensor& k_in,
                                             const at::Tensor& v_in, bool causal,
                                             std::optional<double> scale, bool bottom_right) {
  c10::OptionalDeviceGuard guard(q_in.device());
  const at::Tensor q = last_dim_contiguous(q_in), k = last_dim_contiguous(k_in), v = last_dim_contiguous(v_in);
  at::Tensor out = at::empty_like(q);
  at::Tensor lse = at::empty({q.dim() == 4 ? q.size(0) : 0, q.dim() == 4 ? q.size(2) : 0, q.dim() == 4 ? q.size(1) : 0},
                             q.options().dtype(at::kFloat));
  llmk::AttentionOptions opt;
  opt.causal = causal;
  opt.align = bottom_right ? llmk::CausalAlign::bottom_right : llmk::CausalAlign::top_left;
  opt.scale = scale ? static_cast<float>(*scale) : 0.f;
  guarded([&] {
    llmk::attention(view_of(out), view_of(lse), view_of(q), view_of(k), view_of(v), opt, stream_of(q));
  });
  return {out, lse};
}

// q (total_q, Hq, D), k and v (total_k, Hkv, D) packed; cu_seqlens int32 (batch + 1,).
std::tuple<at::Tensor, at::Tensor> attention_varlen(const at::Tensor& q_in, const at::Tensor& k_in,
                                                    const at::Tensor& v_in, const at::Tensor& cu_q,
                                                    const at::Tensor& cu_k, int64_t max_seqlen_q, bool causal,
                                                    std::optional<double> scale, bool bottom_right) {
  c10::OptionalDeviceGuard guard(q_in.device());
  const at::Tensor q = last_dim_contiguous(q_in), k = last_dim_contiguous(k_in), v = last_dim_contiguous(v_in);
  at::Tensor out = at::empty_like(q);
  at::Tensor lse = at::empty({q.dim() == 3 ? q.size(1) : 0, q.dim() == 3 ? q.size(0) : 0}, q.options().dtype(at::kFloat));
  llmk::AttentionOptions opt;
  opt.causal = causal;
  opt.align = bottom_right ? llmk::CausalAlign::bottom_right : llmk::CausalAlign::top_left;
  opt.scale = scale ? static_cast<float>(*scale) : 0.f;
  guarded([&] {
    llmk::attention_varlen(view_of(out), view_of(lse), view_of(q), view_of(k), view_of(v), view_of(cu_q),
                           view_of(cu_k), max_seqlen_q, opt, stream_of(q));
  });
  return {out, lse};
}

// Tests: [launches of the "ws" attention tiling in this process, 1 if one of its mbarrier waits
// timed out since the last call (reading clears it)], so a test forcing ws can tell it from the
// "pipe" fallback.
std::vector<int64_t> hopper_ws_stats() {
  return {llmk::detail::hopper_ws_launches(), llmk::detail::hopper_ws_timed_out() ? 1 : 0};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llm_kernels, m) {
  m.def("_hopper_ws_stats() -> int[]", &hopper_ws_stats);
  m.def("attention(Tensor q, Tensor k, Tensor v, bool causal=False, float? scale=None, "
        "bool bottom_right=False) -> (Tensor, Tensor)");
  m.def("attention_varlen(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, "
        "int max_seqlen_q, bool causal=False, float? scale=None, bool bottom_right=True) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(llm_kernels, CPU, m) {
  m.impl("attention", &attention);
  m.impl("attention_varlen", &attention_varlen);
}
TORCH_LIBRARY_IMPL(llm_kernels, CUDA, m) {
  m.impl("attention", &attention);
  m.impl("attention_varlen", &attention_varlen);
}
