// Attention entry point: argument checks, then the CPU or GPU backend.
#include "llmk/attention.h"

#include <cmath>
#include <initializer_list>
#include <string>
#include <utility>

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

namespace {

// Checks shared by the padded and the packed (varlen) forms, on (B, S, H, D) views.
AttentionParams checked(const char* op, const TensorView& out, const TensorView& q, const TensorView& k,
                        const TensorView& v, const AttentionOptions& options, Stream stream) {
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
  if (!(options.scale >= 0.f) || !std::isfinite(options.scale))
    fail(ErrorKind::value, op, "scale: expected a finite value > 0 (or 0 for 1/sqrt(D)), got " + std::to_string(options.scale));
  AttentionParams p;
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
  return p;
}

void set_lse(const char* op, AttentionParams& p, const TensorView& lse, const TensorView& q,
             std::initializer_list<int64_t> shape, const std::string& what) {
  if (!lse.defined()) return;
  check_same_device(op, "lse", lse, "q", q);
  if (lse.dtype != DType::f32)
    fail(ErrorKind::type, op, std::string("lse: expected dtype float32, got ") + dtype_name(lse.dtype));
  check_rank(op, "lse", lse, static_cast<int>(shape.size()), static_cast<int>(shape.size()));
  int d = 0;
  std::string want = "(";
  bool ok = true;
  for (int64_t n : shape) {
    ok = ok && lse.shape[d] == n;
    want += (d ? ", " : "") + std::to_string(n);
    ++d;
  }
  if (!ok) fail(ErrorKind::value, op, "lse: expected shape " + want + ") " + what + ", got " + lse.shape_str());
  p.lse = static_cast<float*>(lse.data);
  if (shape.size() == 3) {
    for (int i = 0; i < 3; ++i) p.lse_strides[i] = lse.strides[i];
  } else {  // (H, total_q): no batch dim
    p.lse_strides[0] = 0;
    p.lse_strides[1] = lse.strides[0];
    p.lse_strides[2] = lse.strides[1];
  }
}

TensorView as_bshd(const TensorView& t) {  // (total, H, D) -> (1, total, H, D)
  TensorView r = t;
  if (t.ndim != 3) return r;
  r.ndim = 4;
  r.shape[0] = 1;
  r.strides[0] = 0;
  for (int d = 0; d < 3; ++d) {
    r.shape[d + 1] = t.shape[d];
    r.strides[d + 1] = t.strides[d];
  }
  return r;
}

}  // namespace

void attention(TensorView out, TensorView lse, TensorView q, TensorView k, TensorView v,
               const AttentionOptions& options, Stream stream) {
  const char* op = "attention";
  AttentionParams p = checked(op, out, q, k, v, options, stream);
  set_lse(op, p, lse, q, {p.batch, p.q_heads, p.q_len}, "(batch, heads, queries)");
  if (p.batch == 0 || p.q_len == 0 || p.q_heads == 0) return;
  run_on(op, q.device, [&] { attention_cpu(p); }, [&] { attention_gpu(p); });
}

void attention_varlen(TensorView out, TensorView lse, TensorView q, TensorView k, TensorView v,
                      TensorView cu_seqlens_q, TensorView cu_seqlens_k, int64_t max_seqlen_q,
                      const AttentionOptions& options, Stream stream) {
  const char* op = "attention_varlen";
  for (const auto& [name, t] : {std::pair<const char*, const TensorView*>{"q", &q}, {"k", &k}, {"v", &v}, {"out", &out}})
    check_rank(op, name, *t, 3, 3);
  AttentionParams p = checked(op, as_bshd(out), as_bshd(q), as_bshd(k), as_bshd(v), options, stream);
  const int64_t total_q = q.shape[0], total_k = k.shape[0];
  for (const auto& [name, t] : {std::pair<const char*, const TensorView*>{"cu_seqlens_q", &cu_seqlens_q},
                                {"cu_seqlens_k", &cu_seqlens_k}}) {
    check_same_device(op, name, *t, "q", q);
    if (t->dtype != DType::i32)
      fail(ErrorKind::type, op, std::string(name) + ": expected dtype int32, got " + dtype_name(t->dtype));
    check_rank(op, name, *t, 1, 1);
    if (t->shape[0] < 1 || (t->shape[0] > 1 && t->strides[0] != 1))
      fail(ErrorKind::value, op, std::string(name) + ": expected a contiguous (batch + 1,) tensor, got " + t->shape_str());
  }
  if (cu_seqlens_k.shape[0] != cu_seqlens_q.shape[0])
    fail(ErrorKind::value, op,
         "cu_seqlens_k: expected shape " + cu_seqlens_q.shape_str() + " (that of cu_seqlens_q), got " + cu_seqlens_k.shape_str());
  if (max_seqlen_q < 0 || max_seqlen_q > total_q)
    fail(ErrorKind::value, op,
         "max_seqlen_q: expected a value in [0, " + std::to_string(total_q) + "] (the rows of q), got " + std::to_string(max_seqlen_q));
  const int64_t n = cu_seqlens_q.shape[0] - 1;
  p.cu_seqlens_q = static_cast<const int32_t*>(cu_seqlens_q.data);
  p.cu_seqlens_k = static_cast<const int32_t*>(cu_seqlens_k.data);
  p.varlen_bottom_right = options.causal && options.align == CausalAlign::bottom_right;
  p.diagonal_offset = 0;
  p.batch = n;
  p.q_len = max_seqlen_q;
  p.kv_len = total_k;
  if (q.device.kind == DeviceKind::cpu) {  // on the GPU the offsets live in device memory: unchecked
    for (int64_t b = 0; b < n; ++b) {
      const int64_t q0 = p.cu_seqlens_q[b], q1 = p.cu_seqlens_q[b + 1];
      const int64_t k0 = p.cu_seqlens_k[b], k1 = p.cu_seqlens_k[b + 1];
      if (q0 < 0 || q1 < q0 || q1 > total_q || q1 - q0 > max_seqlen_q || k0 < 0 || k1 < k0 || k1 > total_k)
        fail(ErrorKind::value, op,
             "cu_seqlens: sequence " + std::to_string(b) + " spans q rows [" + std::to_string(q0) + ", " +
                 std::to_string(q1) + ") and k rows [" + std::to_string(k0) + ", " + std::to_string(k1) +
                 "); expected nondecreasing offsets within " + std::to_string(total_q) + " q rows and " +
                 std::to_string(total_k) + " k rows, q lengths <= max_seqlen_q " + std::to_string(max_seqlen_q));
    }
  } else if (n > 65535) {
    fail(ErrorKind::not_implemented, op, "cu_seqlens_q: expected at most 65535 sequences on the GPU, got " + std::to_string(n));
  }
  set_lse(op, p, lse, q, {p.q_heads, total_q}, "(heads, total queries)");
  if (n == 0 || max_seqlen_q == 0 || p.q_heads == 0) return;
  run_on(op, q.device, [&] { attention_cpu(p); }, [&] { attention_gpu(p); });
}

}  // namespace llmk

namespace llmk::detail {

HopperStatus hopper_status(int device) {
#if defined(LLMK_WITH_GPU)
  return hopper_status_gpu(device);
#else
  (void)device;
  return HopperStatus::no_device;
#endif
}

bool wgmma_tile_selftest(DType dtype, int d, const void* q, const void* k, const void* v, float* s, float* o,
                         int variant) {
#if defined(LLMK_WITH_GPU)
  return wgmma_tile_selftest_gpu(dtype, d, q, k, v, s, o, variant);
#else
  (void)dtype, (void)d, (void)q, (void)k, (void)v, (void)s, (void)o, (void)variant;
  return false;
#endif
}

int64_t hopper_ws_launches() {
#if defined(LLMK_WITH_GPU)
  return hopper_ws_launches_gpu();
#else
  return 0;
#endif
}

bool hopper_ws_timed_out() {
#if defined(LLMK_WITH_GPU)
  return hopper_ws_timed_out_gpu();
#else
  return false;
#endif
}

bool tma_tile_selftest(DType dtype, int d, const void* src, int64_t stride, int rows, int row0, void* out_tma,
                       void* out_cp) {
#if defined(LLMK_WITH_GPU)
  return tma_tile_selftest_gpu(dtype, d, src, stride, rows, row0, out_tma, out_cp);
#else
  (void)dtype, (void)d, (void)src, (void)stride, (void)rows, (void)row0, (void)out_tma, (void)out_cp;
  return false;
#endif
}

}  // namespace llmk::detail
