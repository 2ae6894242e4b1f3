// decode_layer_step: argument checks, the workspace layout, then the persistent GPU kernel
// (decode_layer_gpu.cu). GPU only.
#include "llmk/decode_layer.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>

#include "core/check.h"
#include "decode/decode_internal.h"

namespace llmk {

using namespace detail;

namespace {

constexpr const char* kOp = "decode_layer_step";

// A weight or norm: x's device and dtype, exactly `shape`, contiguous.
void check_weight(const char* name, const TensorView& t, std::initializer_list<int64_t> shape, const TensorView& x) {
  check_same_device(kOp, name, t, "x", x);
  check_same_dtype(kOp, name, t, "x", x);
  if (t.ndim != static_cast<int>(shape.size()) || !std::equal(shape.begin(), shape.end(), t.shape))
    fail(ErrorKind::value, kOp, std::string(name) + ": expected shape " + shape_string(shape) + ", got " + t.shape_str());
  if (!is_contiguous(t)) fail(ErrorKind::value, kOp, std::string(name) + ": expected a contiguous tensor");
}

// Every check; fills p's shapes and pointers (not the workspace).
DecodeLayerParams check_args(TensorView out, TensorView x, const DecoderLayerWeights& w, TensorView cos_sin,
                             TensorView k_cache, TensorView v_cache, TensorView position, const DecoderLayerOptions& o,
                             bool with_out) {
  if (x.dtype != DType::f16 && x.dtype != DType::bf16)
    fail(ErrorKind::type, kOp, std::string("x: expected dtype float16 or bfloat16, got ") + dtype_name(x.dtype));
  if (x.device.kind != DeviceKind::gpu)
    fail(ErrorKind::not_implemented, kOp,
         "x: the fused decode step runs on the GPU only, got " + device_name(x.device) +
             " (on the CPU, chain rms_norm, skinny_gemm, rope, write_kv_cache, decode_attention: "
             "llm_kernels.decode.decoder_layer_step does)");
  if (x.ndim < 1 || !is_contiguous(x) || x.numel() != x.shape[x.ndim - 1])
    fail(ErrorKind::value, kOp, "x: expected one contiguous row of the hidden size (batch 1, one token), got " + x.shape_str());
  DecodeLayerParams p;
  p.hidden = x.shape[x.ndim - 1];
  if (p.hidden < 1) fail(ErrorKind::value, kOp, "x: expected a hidden size of at least 1, got " + x.shape_str());
  // caches: (1, Hkv, S, D)
  for (const auto& [name, c] : {std::pair<const char*, const TensorView&>{"k_cache", k_cache}, {"v_cache", v_cache}}) {
    check_same_device(kOp, name, c, "x", x);
    check_same_dtype(kOp, name, c, "x", x);
    if (c.ndim != 4 || c.shape[0] != 1)
      fail(ErrorKind::value, kOp, std::string(name) + ": expected shape (1, Hkv, S, D), got " + c.shape_str());
    if (c.strides[3] != 1) fail(ErrorKind::value, kOp, std::string(name) + ": expected a contiguous last dim");
  }
  check_same_shape(kOp, "v_cache", v_cache, "k_cache", k_cache);
  p.kv_heads = k_cache.shape[1];
  p.cache_len = k_cache.shape[2];
  p.head_dim = k_cache.shape[3];
  if (p.head_dim != 64 && p.head_dim != 128 && p.head_dim != 256)
    fail(ErrorKind::not_implemented, kOp, "k_cache: expected head dim 64, 128 or 256, got " + k_cache.shape_str());
  if (p.kv_heads < 1 || p.cache_len < 1) fail(ErrorKind::value, kOp, "k_cache: expected at least one head and slot, got " + k_cache.shape_str());
  // qkv gives Hq
  if (w.qkv.ndim != 2 || w.qkv.shape[0] % p.head_dim != 0 || w.qkv.shape[0] / p.head_dim < 3 * p.kv_heads)
    fail(ErrorKind::value, kOp,
         "qkv: expected shape ((Hq + 2 Hkv) * " + std::to_string(p.head_dim) + ", H) with Hq a multiple of Hkv = " +
             std::to_string(p.kv_heads) + ", got " + w.qkv.shape_str());
  p.q_heads = w.qkv.shape[0] / p.head_dim - 2 * p.kv_heads;
  if (p.q_heads % p.kv_heads != 0 || p.q_heads / p.kv_heads > 16)
    fail(ErrorKind::value, kOp,
         "qkv: expected Hq (" + std::to_string(p.q_heads) + " from its rows) to be 1 to 16 times Hkv = " +
             std::to_string(p.kv_heads) + ", got " + w.qkv.shape_str());
  check_weight("qkv", w.qkv, {w.qkv.shape[0], p.hidden}, x);
  check_weight("o", w.o, {p.hidden, p.q_heads * p.head_dim}, x);
  if (w.gate_up.ndim != 2 || w.gate_up.shape[0] % 2 != 0 || w.gate_up.shape[0] == 0)
    fail(ErrorKind::value, kOp, "gate_up: expected shape (2 I, H), got " + w.gate_up.shape_str());
  p.inter = w.gate_up.shape[0] / 2;
  check_weight("gate_up", w.gate_up, {2 * p.inter, p.hidden}, x);
  check_weight("down", w.down, {p.hidden, p.inter}, x);
  check_weight("input_norm", w.input_norm, {p.hidden}, x);
  check_weight("post_norm", w.post_norm, {p.hidden}, x);
  check_same_device(kOp, "cos_sin_cache", cos_sin, "x", x);
  if (cos_sin.dtype != DType::f32)
    fail(ErrorKind::type, kOp, std::string("cos_sin_cache: expected dtype float32, got ") + dtype_name(cos_sin.dtype));
  if (cos_sin.ndim != 2 || cos_sin.shape[1] != p.head_dim || !is_contiguous(cos_sin))
    fail(ErrorKind::value, kOp,
         "cos_sin_cache: expected a contiguous (P, " + std::to_string(p.head_dim) + ") table, got " + cos_sin.shape_str());
  check_same_device(kOp, "position", position, "x", x);
  if (position.dtype != DType::i32 && position.dtype != DType::i64)
    fail(ErrorKind::type, kOp, std::string("position: expected dtype int32 or int64, got ") + dtype_name(position.dtype));
  if (position.numel() != 1) fail(ErrorKind::value, kOp, "position: expected one element, got " + position.shape_str());
  if (with_out) {
    check_same_device(kOp, "out", out, "x", x);
    check_same_dtype(kOp, "out", out, "x", x);
    if (!is_contiguous(out) || out.numel() != p.hidden)
      fail(ErrorKind::value, kOp, "out: expected a contiguous tensor of " + std::to_string(p.hidden) + " elements, got " + out.shape_str());
  }
  if (!(o.eps >= 0.f) || !std::isfinite(o.eps)) fail(ErrorKind::value, kOp, "eps: expected a finite value >= 0");
  if (!std::isfinite(o.scale)) fail(ErrorKind::value, kOp, "scale: expected a finite value");
  p.x = x.data;
  p.out = out.data;
  p.norm1 = w.input_norm.data;
  p.norm2 = w.post_norm.data;
  p.w_qkv = w.qkv.data;
  p.w_o = w.o.data;
  p.w_gate_up = w.gate_up.data;
  p.w_down = w.down.data;
  p.rope = static_cast<const float*>(cos_sin.data);
  p.rope_rows = cos_sin.shape[0];
  p.k_cache = k_cache.data;
  p.v_cache = v_cache.data;
  p.k_strides[0] = k_cache.strides[1];
  p.k_strides[1] = k_cache.strides[2];
  p.v_strides[0] = v_cache.strides[1];
  p.v_strides[1] = v_cache.strides[2];
  p.position = position.data;
  p.position_int64 = position.dtype == DType::i64;
  p.eps = o.eps;
  p.scale = o.scale != 0.f ? o.scale : 1.f / std::sqrt(static_cast<float>(p.head_dim));
  p.dtype = x.dtype;
  p.device = x.device;
  bool aligned = true;
  for (const void* ptr : {p.w_qkv, p.w_o, p.w_gate_up, p.w_down}) aligned = aligned && reinterpret_cast<uintptr_t>(ptr) % 16 == 0;
  p.vector_loads = aligned && p.hidden % 8 == 0 && p.inter % 8 == 0;
  return p;
}

// The workspace, in order: barrier (2 words, 16 bytes), block 0's trace (kLayerTraceStamps x 8 bytes), tickets, sums, qkv, attention partials
// (o, then max / sum), xm, u; each region a multiple of 16 bytes. Returns its size; with a base,
// points p's regions into it.
[[maybe_unused]] std::size_t layout(DecodeLayerParams& p, int64_t max_chunks, char* base) {
  auto up4 = [](int64_t n) { return (n + 3) / 4 * 4; };
  const int64_t n_qkv = (p.q_heads + 2 * p.kv_heads) * p.head_dim;
  const int64_t tickets = up4(std::max({(n_qkv + 1) / 2, (p.hidden + 1) / 2, p.inter}));
  const int64_t sums = up4(std::max({n_qkv, p.hidden, 2 * p.inter}));
  const int64_t part_o = up4(p.q_heads * max_chunks * p.head_dim), part_ml = up4(p.q_heads * max_chunks * 2);
  std::size_t at = 16 + up4(2 * kLayerTraceStamps) * 4;
  auto take = [&](int64_t words) {
    const std::size_t here = at;
    at += static_cast<std::size_t>(words) * 4;
    return base ? base + here : nullptr;
  };
  p.ws_tickets = reinterpret_cast<unsigned*>(take(tickets));
  p.ws_sums = reinterpret_cast<float*>(take(sums));
  p.ws_qkv = reinterpret_cast<float*>(take(up4(n_qkv)));
  p.ws_part_o = reinterpret_cast<float*>(take(part_o));
  p.ws_part_ml = reinterpret_cast<float*>(take(part_ml));
  p.ws_xmid = reinterpret_cast<float*>(take(up4(p.hidden)));
  p.ws_u = reinterpret_cast<float*>(take(up4(p.inter)));
  p.barrier = reinterpret_cast<unsigned*>(base);
  p.trace = reinterpret_cast<uint64_t*>(base ? base + 16 : nullptr);
  p.max_chunks = max_chunks;
  return at;
}

}  // namespace

std::size_t decode_layer_workspace_size(TensorView x, const DecoderLayerWeights& weights, TensorView cos_sin_cache,
                                        TensorView k_cache, TensorView v_cache) {
  TensorView position = TensorView::contiguous(nullptr, DType::i32, x.device, {1});
  [[maybe_unused]] DecodeLayerParams p = check_args({}, x, weights, cos_sin_cache, k_cache, v_cache, position, {}, false);
#if defined(LLMK_WITH_GPU)
  return layout(p, decode_layer_plan_gpu(p).max_chunks, nullptr);
#else
  fail(ErrorKind::device, kOp, "got a GPU tensor, but this build of llmk has no GPU backend");
#endif
}

void decode_layer_step(TensorView out, TensorView x, const DecoderLayerWeights& weights, TensorView cos_sin_cache,
                       TensorView k_cache, TensorView v_cache, TensorView position, const DecoderLayerOptions& options,
                       void* workspace, std::size_t workspace_bytes, Stream stream) {
  [[maybe_unused]] DecodeLayerParams p = check_args(out, x, weights, cos_sin_cache, k_cache, v_cache, position, options, true);
  p.stream = stream;
#if defined(LLMK_WITH_GPU)
  const DecodeLayerPlan plan = decode_layer_plan_gpu(p);
  const std::size_t need = layout(p, plan.max_chunks, nullptr);
  if (workspace == nullptr || workspace_bytes < need || reinterpret_cast<uintptr_t>(workspace) % 16 != 0)
    fail(ErrorKind::value, kOp,
         "workspace: expected " + std::to_string(need) + " bytes (decode_layer_workspace_size), 16-byte aligned, got " +
             std::to_string(workspace_bytes));
  layout(p, plan.max_chunks, static_cast<char*>(workspace));
  decode_layer_step_gpu(p, plan);
#else
  (void)workspace;
  (void)workspace_bytes;
  fail(ErrorKind::device, kOp, "got a GPU tensor, but this build of llmk has no GPU backend");
#endif
}

}  // namespace llmk
