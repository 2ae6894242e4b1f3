// Attention entry point: argument checks, then the CPU or GPU backend.
#include "llmk/attention.h"

#include <cmath>
#include <string>

#include "attention/attention_internal.h"
#include "core/backend.h"
#include "core/check.h"

namespace llmk {

using namespace detail;

namespace {

void check_bshd(const char* op, const char* name, const TensorView& t) {
  check_rank(op, name, t, 4, 4);
  if (t.shape[3] > 1 && t.strides[3] != 1)
    fail(ErrorKind::value, op,
         std::string(name) + ": expected a contiguous last dim (stride 1), got stride " +
             std::to_string(t.strides[3]));
}

std::string bshd(int64_t b, const std::string& s, const std::string& h, int64_t d) {
  return "(" + std::to_string(b) + ", " + s + ", " + h + ", " + std::to_string(d) + ")";
}

}  // namespace

void attention(TensorView out, TensorView lse, TensorView q, TensorView k, TensorView v,
               const AttentionOptions& options, Stream stream) {
  const char* op = "attention";
  check_float(op, "q", q);
  check_bshd(op, "q", q);
  for (const auto& [name, t] : {std::pair<const char*, const TensorView*>{"k", &k}, {"v", &v}}) {
    check_same_device(op, name, *t, "q", q);
    check_same_dtype(op, name, *t, "q", q);
    check_bshd(op, name, *t);
  }
  const int64_t B = q.shape[0], Sq = q.shape[1], Hq = q.shape[2], D = q.shape[3];
  const int64_t Skv = k.shape[1], Hkv = k.shape[2];
  if (k.shape[0] != B || k.shape[3] != D)
    fail(ErrorKind::value, op,
         "k: expected shape " + bshd(B, "kv_len", "kv_heads", D) + " (batch and head dim of q), got " + k.shape_str());
  check_same_shape(op, "v", v, "k", k);
  if (Hkv == 0 || Hq % Hkv != 0)
    fail(ErrorKind::value, op,
         "k: expected a head count that divides q's " + std::to_string(Hq) + " heads, got " + std::to_string(Hkv));
  check_same_device(op, "out", out, "q", q);
  check_same_dtype(op, "out", out, "q", q);
  check_same_shape(op, "out", out, "q", q);
  check_bshd(op, "out", out);
  AttentionParams p;
  if (lse.defined()) {
    check_same_device(op, "lse", lse, "q", q);
    if (lse.dtype != DType::f32)
      fail(ErrorKind::type, op, std::string("lse: expected dtype float32, got ") + dtype_name(lse.dtype));
    check_rank(op, "lse", lse, 3, 3);
    if (lse.shape[0] != B || lse.shape[1] != Hq || lse.shape[2] != Sq)
      fail(ErrorKind::value, op,
           "lse: expected shape (" + std::to_string(B) + ", " + std::to_string(Hq) + ", " +
               std::to_string(Sq) + ") (batch, heads, queries), got " + lse.shape_str());
    p.lse = static_cast<float*>(lse.data);
    for (int d = 0; d < 3; ++d) p.lse_strides[d] = lse.strides[d];
  }
  if (!(options.scale >= 0.f) || !std::isfinite(options.scale))
    fail(ErrorKind::value, op, "scale: expected a finite value > 0 (or 0 for 1/sqrt(D)), got " + std::to_string(options.scale));
  p.q = q.data; p.k = k.data; p.v = v.data; p.out = out.data;
  for (int d = 0; d < 3; ++d) {
    p.q_strides[d] = q.strides[d];
    p.k_strides[d] = k.strides[d];
    p.v_strides[d] = v.strides[d];
    p.out_strides[d] = out.strides[d];
  }
  p.batch = B; p.q_len = Sq; p.kv_len = Skv; p.q_heads = Hq; p.kv_heads = Hkv; p.head_dim = D;
  p.scale = options.scale > 0.f ? options.scale : (D > 0 ? 1.f / std::sqrt(static_cast<float>(D)) : 1.f);
  p.causal = options.causal;
  p.diagonal_offset = options.causal && options.align == CausalAlign::bottom_right ? Skv - Sq : 0;
  p.dtype = q.dtype;
  p.device = q.device;
  p.stream = stream;
  if (q.device.kind != DeviceKind::cpu) {
    if (q.dtype != DType::f16 && q.dtype != DType::bf16)
      fail(ErrorKind::type, op, std::string("q: expected dtype float16 or bfloat16 on the GPU, got ") + dtype_name(q.dtype));
    if (!gpu_head_dim_supported(D))
      fail(ErrorKind::not_implemented, op,
           "q: head dim " + std::to_string(D) + " is not supported on the GPU (64, 80, 96, 128 or 256)");
    constexpr int64_t kMaxLen = int64_t{1} << 30;
    if (Sq >= kMaxLen || Skv >= kMaxLen || Hq > 65535 || B > 65535)
      fail(ErrorKind::not_implemented, op,
           "q: expected fewer than 2^30 queries and keys and at most 65535 heads and batches on the GPU, got " +
               q.shape_str() + " and k " + k.shape_str());
  }
  if (B == 0 || Sq == 0 || Hq == 0) return;
  run_on(op, q.device, [&] { attention_cpu(p); }, [&] { attention_gpu(p); });
}

}  // namespace llmk
