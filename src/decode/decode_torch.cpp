// torch.library registration of decode attention and the KV-cache write (namespace llm_kernels).
// q is (B, T, Hq, D); caches are (B, Hkv, Smax, D) or, with a block table, (num_blocks,
// block_size, Hkv, D). The workspace, when not passed, comes from torch's caching allocator (no
// cudaMalloc per call); pass one (uint8, decode_workspace_size bytes) for CUDA-graph capture, and
// workspace_zeroed=True with one that is zeroed and kept for calls of one shape (no memset node).
#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>
#include <torch/library.h>

#include <optional>
#include <vector>

#include "decode/decode_internal.h"
#include "llmk/decode.h"
#include "llmk/decode_layer.h"
#include "torch/bridge.h"

namespace {

using llmk::torch_bridge::guarded;
using llmk::torch_bridge::last_dim_contiguous;
using llmk::torch_bridge::optional_view;
using llmk::torch_bridge::stream_of;
using llmk::torch_bridge::view_of;

llmk::DecodeOptions options(std::optional<double> scale, int64_t num_splits, int64_t max_seq_len) {
  llmk::DecodeOptions o;
  o.scale = scale ? static_cast<float>(*scale) : 0.f;
  o.num_splits = static_cast<int>(num_splits);
  o.max_seq_len = max_seq_len;
  return o;
}

int64_t decode_workspace_size(const at::Tensor& q, const at::Tensor& k_cache,
                              const std::optional<at::Tensor>& block_table, int64_t num_splits,
                              int64_t max_seq_len) {
  c10::OptionalDeviceGuard guard(q.device());
  return guarded([&] {
    return static_cast<int64_t>(llmk::decode_attention_workspace_size(
        view_of(q), view_of(k_cache), optional_view(block_table), options(std::nullopt, num_splits, max_seq_len)));
  });
}

at::Tensor decode_attention(const at::Tensor& q_in, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& seq_lens, const std::optional<at::Tensor>& block_table,
                            std::optional<double> scale, int64_t num_splits, int64_t max_seq_len,
                            const std::optional<at::Tensor>& workspace, const std::optional<at::Tensor>& attn_mask,
                            bool workspace_zeroed) {
  c10::OptionalDeviceGuard guard(q_in.device());
  TORCH_CHECK_VALUE(!workspace_zeroed || workspace,
                    "llm_kernels: decode_attention: workspace_zeroed=True vouches for a workspace, but none was passed");
  const at::Tensor q = last_dim_contiguous(q_in);
  at::Tensor out = at::empty(q.sizes(), q.options());
  llmk::DecodeOptions opt = options(scale, num_splits, max_seq_len);
  opt.attn_mask = optional_view(attn_mask);
  opt.workspace_zeroed = workspace_zeroed;
  guarded([&] {
    at::Tensor ws;
    void* ws_ptr = nullptr;
    std::size_t ws_bytes = 0;
    if (workspace) {
      TORCH_CHECK_VALUE(workspace->is_contiguous(), "llm_kernels: decode_attention: workspace: expected a contiguous tensor");
      ws_ptr = workspace->numel() ? workspace->data_ptr() : nullptr;
      ws_bytes = static_cast<std::size_t>(workspace->numel()) * workspace->element_size();
    } else if (q.device().is_cuda()) {
      ws_bytes = llmk::decode_attention_workspace_size(view_of(q), view_of(k_cache), optional_view(block_table), opt);
      if (ws_bytes) {
        ws = at::empty({static_cast<int64_t>(ws_bytes)}, q.options().dtype(at::kByte));
        ws_ptr = ws.data_ptr();
      }
    }
    llmk::decode_attention(view_of(out), view_of(q), view_of(last_dim_contiguous(k_cache)),
                           view_of(last_dim_contiguous(v_cache)), view_of(seq_lens), optional_view(block_table),
                           opt, ws_ptr, ws_bytes, stream_of(q));
  });
  return out;
}

void write_kv_cache_(at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& k, const at::Tensor& v,
                     const at::Tensor& positions, const std::optional<at::Tensor>& block_table,
                     const std::optional<at::Tensor>& advance) {
  c10::OptionalDeviceGuard guard(k.device());
  guarded([&] {
    llmk::write_kv_cache(view_of(k_cache), view_of(v_cache), view_of(last_dim_contiguous(k)),
                         view_of(last_dim_contiguous(v)), view_of(positions), optional_view(block_table),
                         stream_of(k), optional_view(advance));
  });
}

void rope_write_kv_cache_(at::Tensor& q_out, at::Tensor& k_out, at::Tensor& k_cache, at::Tensor& v_cache,
                          const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cos,
                          const at::Tensor& sin, const at::Tensor& positions, const std::optional<at::Tensor>& advance) {
  c10::OptionalDeviceGuard guard(k.device());
  guarded([&] {
    llmk::rope_write_kv_cache(view_of(q_out), view_of(k_out), view_of(k_cache), view_of(v_cache),
                              view_of(last_dim_contiguous(q)), view_of(last_dim_contiguous(k)),
                              view_of(last_dim_contiguous(v)), view_of(last_dim_contiguous(cos)),
                              view_of(last_dim_contiguous(sin)), view_of(positions), stream_of(k),
                              optional_view(advance));
  });
}

llmk::DecoderLayerWeights layer_weights(const at::Tensor& input_norm, const at::Tensor& qkv, const at::Tensor& o,
                                        const at::Tensor& post_norm, const at::Tensor& gate_up, const at::Tensor& down) {
  return {view_of(input_norm), view_of(qkv), view_of(o), view_of(post_norm), view_of(gate_up), view_of(down)};
}

int64_t decode_layer_workspace_size(const at::Tensor& x, const at::Tensor& input_norm, const at::Tensor& qkv,
                                    const at::Tensor& o, const at::Tensor& post_norm, const at::Tensor& gate_up,
                                    const at::Tensor& down, const at::Tensor& cos_sin_cache, const at::Tensor& k_cache,
                                    const at::Tensor& v_cache) {
  c10::OptionalDeviceGuard guard(x.device());
  return guarded([&] {
    return static_cast<int64_t>(llmk::decode_layer_workspace_size(
        view_of(x), layer_weights(input_norm, qkv, o, post_norm, gate_up, down), view_of(cos_sin_cache),
        view_of(k_cache), view_of(v_cache)));
  });
}

// The fused batch-1 decode step of one decoder layer (llmk/decode_layer.h). Without a workspace a
// zeroed one is allocated per call (not capturable: pass one from decode_layer_workspace_size).
at::Tensor decode_layer_step(const at::Tensor& x, const at::Tensor& input_norm, const at::Tensor& qkv,
                             const at::Tensor& o, const at::Tensor& post_norm, const at::Tensor& gate_up,
                             const at::Tensor& down, const at::Tensor& cos_sin_cache, at::Tensor& k_cache,
                             at::Tensor& v_cache, const at::Tensor& position, double eps, std::optional<double> scale,
                             const std::optional<at::Tensor>& workspace) {
  c10::OptionalDeviceGuard guard(x.device());
  at::Tensor out = at::empty(x.sizes(), x.options());
  llmk::DecoderLayerOptions opt;
  opt.eps = static_cast<float>(eps);
  opt.scale = scale ? static_cast<float>(*scale) : 0.f;
  const auto weights = layer_weights(input_norm, qkv, o, post_norm, gate_up, down);
  guarded([&] {
    at::Tensor ws;
    if (workspace) {
      TORCH_CHECK_VALUE(workspace->is_contiguous(), "llm_kernels: decode_layer_step: workspace: expected a contiguous tensor");
      ws = *workspace;
    } else {
      const auto bytes = llmk::decode_layer_workspace_size(view_of(x), weights, view_of(cos_sin_cache),
                                                           view_of(k_cache), view_of(v_cache));
      ws = at::zeros({static_cast<int64_t>(bytes)}, x.options().dtype(at::kByte));
    }
    llmk::decode_layer_step(view_of(out), view_of(x), weights, view_of(cos_sin_cache), view_of(k_cache),
                            view_of(v_cache), view_of(position), opt, ws.numel() ? ws.data_ptr() : nullptr,
                            static_cast<std::size_t>(ws.numel()) * ws.element_size(), stream_of(x));
  });
  return out;
}

// Tests: [timed out, mask skipped] since the last call (reading clears them), each 1 or 0: an
// mbarrier wait of the TMA decode kernels timed out; a block of the tensor-core kernel ran its
// chunk without the mask (the mask skip, LLMK_DECODE_MASK_SKIP).
std::vector<int64_t> decode_stats() {
  const unsigned flags = llmk::detail::decode_mma_flags();
  return {flags & 1u ? 1 : 0, flags & 2u ? 1 : 0};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llm_kernels, m) {
  m.def("_decode_stats() -> int[]", &decode_stats);
  m.def("decode_layer_step(Tensor x, Tensor input_norm, Tensor qkv, Tensor o, Tensor post_norm, Tensor gate_up, "
        "Tensor down, Tensor cos_sin_cache, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor position, float eps=1e-6, "
        "float? scale=None, Tensor? workspace=None) -> Tensor");
  m.def("decode_layer_workspace_size(Tensor x, Tensor input_norm, Tensor qkv, Tensor o, Tensor post_norm, "
        "Tensor gate_up, Tensor down, Tensor cos_sin_cache, Tensor k_cache, Tensor v_cache) -> int");
  m.def("decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor seq_lens, Tensor? block_table=None, "
        "float? scale=None, int num_splits=0, int max_seq_len=0, Tensor? workspace=None, Tensor? attn_mask=None, "
        "bool workspace_zeroed=False) -> Tensor");
  m.def("decode_workspace_size(Tensor q, Tensor k_cache, Tensor? block_table=None, int num_splits=0, "
        "int max_seq_len=0) -> int");
  m.def("write_kv_cache_(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor k, Tensor v, Tensor positions, "
        "Tensor? block_table=None, Tensor(c!)? advance=None) -> ()");
  m.def("rope_write_kv_cache_(Tensor(a!) q_out, Tensor(b!) k_out, Tensor(c!) k_cache, Tensor(d!) v_cache, Tensor q, "
        "Tensor k, Tensor v, Tensor cos, Tensor sin, Tensor positions, Tensor(e!)? advance=None) -> ()");
}

TORCH_LIBRARY_IMPL(llm_kernels, CPU, m) {
  m.impl("decode_attention", &decode_attention);
  m.impl("decode_workspace_size", &decode_workspace_size);
  m.impl("write_kv_cache_", &write_kv_cache_);
  m.impl("rope_write_kv_cache_", &rope_write_kv_cache_);
}

TORCH_LIBRARY_IMPL(llm_kernels, CUDA, m) {
  m.impl("decode_layer_step", &decode_layer_step);
  m.impl("decode_layer_workspace_size", &decode_layer_workspace_size);
  m.impl("decode_attention", &decode_attention);
  m.impl("decode_workspace_size", &decode_workspace_size);
  m.impl("write_kv_cache_", &write_kv_cache_);
  m.impl("rope_write_kv_cache_", &rope_write_kv_cache_);
}
