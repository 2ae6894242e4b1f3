// Skinny GEMM entry point: argument checks, then dispatch to the CPU or GPU backend.
#include "llmk/gemm.h"

#include <string>
#include <utility>

#include "llmk/decode.h"

#include "core/backend.h"
#include "core/check.h"
#include "gemm/gemm_internal.h"

namespace llmk {

using namespace detail;

const char* gemm_activation_name(GemmActivation activation) {
  switch (activation) {
    case GemmActivation::none: return "none";
    case GemmActivation::swiglu: return "swiglu";
    case GemmActivation::geglu_tanh: return "geglu_tanh";
  }
  return "unknown";
}

namespace {

// skinny_gemm's checks and parameters (op: the name in errors).
GemmParams gemm_params(const char* op, TensorView out, TensorView x, TensorView weight, TensorView bias,
                       const GemmOptions& options, Stream stream) {
  check_float(op, "x", x);
  check_rank(op, "x", x, 1, kMaxDims);
  check_same_device(op, "weight", weight, "x", x);
  check_same_dtype(op, "weight", weight, "x", x);
  check_rank(op, "weight", weight, 2, 2);
  const int64_t k = x.shape[x.ndim - 1];
  if (weight.shape[1] != k)
    fail(ErrorKind::value, op,
         "weight: expected shape (out_features, " + std::to_string(k) + ") (in_features = the last dim of x), got " +
             weight.shape_str());
  const Rows wr = as_rows(op, "weight", weight);
  const Rows xr = as_rows(op, "x", x);
  GemmParams p;
  p.m = xr.rows;
  p.k = k;
  p.n = weight.shape[0];
  p.x_stride = xr.row_stride;
  p.w_stride = wr.row_stride;
  p.activation = options.activation;
  p.portable = options.portable;
  p.fixed_weight = options.fixed_weight;
  if (std::string(gemm_activation_name(options.activation)) == "unknown")
    fail(ErrorKind::value, op,
         "activation: expected none, swiglu or geglu_tanh, got " + std::to_string(static_cast<int>(options.activation)));
  int64_t out_cols = p.n;
  if (gemm_gated(options.activation)) {
    if (p.n % 2 != 0)
      fail(ErrorKind::value, op,
           std::string("weight: expected an even number of rows for ") + gemm_activation_name(options.activation) +
               " ([gate; up], 2 * inter), got shape " + weight.shape_str());
    out_cols = p.n / 2;
  }
  if (bias.defined()) {
    check_same_device(op, "bias", bias, "x", x);
    check_same_dtype(op, "bias", bias, "x", x);
    check_rank(op, "bias", bias, 1, 1);
    if (bias.shape[0] != p.n)
      fail(ErrorKind::value, op,
           "bias: expected shape (" + std::to_string(p.n) + ") (the rows of weight), got " + bias.shape_str());
    if (p.n > 1 && bias.strides[0] != 1)
      fail(ErrorKind::value, op, "bias: expected a contiguous tensor, got stride " + std::to_string(bias.strides[0]));
    p.bias = bias.data;
  }
  check_same_device(op, "out", out, "x", x);
  check_same_dtype(op, "out", out, "x", x);
  bool shape_ok = out.ndim == x.ndim && out.shape[out.ndim - 1] == out_cols;
  for (int d = 0; shape_ok && d + 1 < x.ndim; ++d) shape_ok = out.shape[d] == x.shape[d];
  if (!shape_ok) {
    TensorView want = x;
    want.shape[want.ndim - 1] = out_cols;
    fail(ErrorKind::value, op, "out: expected shape " + want.shape_str() + ", got " + out.shape_str());
  }
  const Rows orows = as_rows(op, "out", out);
  p.out_stride = orows.row_stride;
  if (out.numel() > 0 && (overlaps(out, x) || overlaps(out, weight)))
    fail(ErrorKind::value, op, "out: expected memory that overlaps neither x nor weight");
  if (options.norm_weight.defined()) {
    const TensorView& nw = options.norm_weight;
    check_same_device(op, "norm_weight", nw, "x", x);
    check_same_dtype(op, "norm_weight", nw, "x", x);
    check_rank(op, "norm_weight", nw, 1, 1);
    if (nw.shape[0] != k)
      fail(ErrorKind::value, op,
           "norm_weight: expected shape (" + std::to_string(k) + ") (the last dim of x), got " + nw.shape_str());
    if (k > 1 && nw.strides[0] != 1)
      fail(ErrorKind::value, op, "norm_weight: expected a contiguous tensor, got stride " + std::to_string(nw.strides[0]));
    check_finite_nonnegative(op, "norm_eps", options.norm_eps);
    if (out.numel() > 0 && overlaps(out, nw))
      fail(ErrorKind::value, op, "out: expected memory that does not overlap norm_weight");
    p.norm_w = nw.data;
    p.norm_eps = options.norm_eps;
    p.norm_offset = options.norm_offset;
  }
  if (options.residual.defined()) {
    const TensorView& res = options.residual;
    p.residual_stride = check_matches(op, "residual", res, "out", out).row_stride;
    // In place (the very memory of out) is fine: each element is read, then written, by one thread.
    if (out.numel() > 0 && overlaps(out, res) && !(res.data == out.data && p.residual_stride == p.out_stride))
      fail(ErrorKind::value, op, "residual: expected either out's very memory (in place) or memory that does not overlap it");
    p.residual = res.data;
  }
  p.x = x.data;
  p.w = weight.data;
  p.out = out.data;
  p.dtype = x.dtype;
  p.device = x.device;
  p.stream = stream;
  if (p.device.kind == DeviceKind::gpu && p.dtype == DType::f32)
    fail(ErrorKind::not_implemented, op, "x: the GPU path supports float16 and bfloat16, got float32");
  return p;
}

// skinny_gemm_rope_kv's own checks (after gemm_params'): the rope and cache arguments against x's
// rows (M) and W's rows (N = (Hq + 2 Hkv) D).
GemmRopeKvParams rope_kv_params(const char* op, const GemmParams& p, const TensorView& x, const GemmRopeKv& r) {
  GemmRopeKvParams q;
  for (const auto& [name, c] : {std::pair<const char*, const TensorView&>{"k_cache", r.k_cache}, {"v_cache", r.v_cache}}) {
    check_same_device(op, name, c, "x", x);
    check_same_dtype(op, name, c, "x", x);
    check_rank(op, name, c, 4, 4);
    check_last_contiguous(op, name, c);
  }
  check_same_shape(op, "v_cache", r.v_cache, "k_cache", r.k_cache);
  q.kv_heads = r.k_cache.shape[1];
  q.capacity = r.k_cache.shape[2];
  q.head_dim = r.k_cache.shape[3];
  q.q_heads = r.q_heads;
  if (r.k_cache.shape[0] != p.m)
    fail(ErrorKind::value, op,
         "k_cache: expected " + std::to_string(p.m) + " sequences (the rows of x), got shape " + r.k_cache.shape_str());
  if (q.head_dim % 2 != 0 || q.head_dim == 0)
    fail(ErrorKind::value, op,
         "k_cache: expected an even head dim of at least 2 (rotate-half pairs), got shape " + r.k_cache.shape_str());
  if (r.q_heads < 1) fail(ErrorKind::value, op, "q_heads: expected at least 1, got " + std::to_string(r.q_heads));
  if (p.n != (q.q_heads + 2 * q.kv_heads) * q.head_dim)
    fail(ErrorKind::value, op,
         "weight: expected (q_heads + 2 * kv_heads) * head_dim = " +
             std::to_string((q.q_heads + 2 * q.kv_heads) * q.head_dim) + " rows ([q; k; v]), got shape " +
             std::to_string(p.n) + " rows");
  q.k_cache = r.k_cache.data;
  q.v_cache = r.v_cache.data;
  for (int d = 0; d < 3; ++d) {
    q.k_strides[d] = r.k_cache.strides[d];
    q.v_strides[d] = r.v_cache.strides[d];
  }
  for (const auto& [name, t] : {std::pair<const char*, const TensorView&>{"cos", r.cos}, {"sin", r.sin}}) {
    check_same_device(op, name, t, "x", x);
    check_same_dtype(op, name, t, "x", x);
    check_rank(op, name, t, 2, 2);
    if (t.shape[0] != p.m || t.shape[1] != q.head_dim / 2)
      fail(ErrorKind::value, op,
           std::string(name) + ": expected shape " + shape_string({p.m, q.head_dim / 2}) +
               " (rows of x, head dim / 2), got " + t.shape_str());
    check_last_contiguous(op, name, t);
  }
  q.cos = r.cos.data;
  q.sin = r.sin.data;
  q.cos_stride = r.cos.strides[0];
  q.sin_stride = r.sin.strides[0];
  check_same_device(op, "positions", r.positions, "x", x);
  check_int(op, "positions", r.positions, true);
  check_rank(op, "positions", r.positions, 1, 1);
  if (r.positions.shape[0] != p.m)
    fail(ErrorKind::value, op,
         "positions: expected shape " + shape_string({p.m}) + " (the rows of x), got " + r.positions.shape_str());
  q.positions = r.positions.data;
  q.positions_int64 = r.positions.dtype == DType::i64;
  q.pos_stride = r.positions.strides[0];
  if (r.advance.defined()) {
    check_same_device(op, "advance", r.advance, "x", x);
    check_int(op, "advance", r.advance, true);
    if (r.advance.numel() != 1)
      fail(ErrorKind::value, op, "advance: expected one element (a length counter), got shape " + r.advance.shape_str());
    q.advance = r.advance.data;
    q.advance_int64 = r.advance.dtype == DType::i64;
    if (p.device.kind == DeviceKind::gpu) {
      if (!r.counter.defined())
        fail(ErrorKind::value, op, "counter: expected one int32 of GPU memory, zeroed once, with advance on the GPU");
      check_same_device(op, "counter", r.counter, "x", x);
      if (r.counter.dtype != DType::i32 || r.counter.numel() != 1)
        fail(ErrorKind::value, op,
             std::string("counter: expected one int32, got dtype ") + dtype_name(r.counter.dtype) + " and shape " +
                 r.counter.shape_str());
      q.counter = static_cast<unsigned*>(r.counter.data);
    }
  }
  return q;
}

}  // namespace

namespace detail {
int64_t skinny_gemm_rope_kv_launches() {
#if defined(LLMK_WITH_GPU)
  return skinny_gemm_rope_kv_launches_gpu();
#else
  return 0;
#endif
}
int64_t skinny_gemm_tma_tail_launches() {
#if defined(LLMK_WITH_GPU)
  return skinny_gemm_tma_tail_launches_gpu();
#else
  return 0;
#endif
}
int64_t skinny_gemm_tma_calls() {
#if defined(LLMK_WITH_GPU)
  return skinny_gemm_tma_calls_gpu();
#else
  return 0;
#endif
}
}  // namespace detail

void skinny_gemm(TensorView out, TensorView x, TensorView weight, TensorView bias,
                 const GemmOptions& options, Stream stream) {
  const char* op = "skinny_gemm";
  const GemmParams p = gemm_params(op, out, x, weight, bias, options, stream);
  if (p.m == 0 || p.n == 0) return;
  run_on(op, p.device, [&] { skinny_gemm_cpu(p); }, [&] { skinny_gemm_gpu(p); });
}

void skinny_gemm_rope_kv(TensorView out, TensorView x, TensorView weight, TensorView bias, const GemmRopeKv& rope,
                         const GemmOptions& options, Stream stream) {
  const char* op = "skinny_gemm_rope_kv";
  if (options.activation != GemmActivation::none)
    fail(ErrorKind::value, op, std::string("activation: expected none, got ") + gemm_activation_name(options.activation));
  if (options.residual.defined()) fail(ErrorKind::value, op, "residual: expected none (the epilogue is RoPE's)");
  GemmParams p = gemm_params(op, out, x, weight, bias, options, stream);
  const GemmRopeKvParams r = rope_kv_params(op, p, x, rope);
  for (const auto& [name, t] : {std::pair<const char*, const TensorView&>{"k_cache", rope.k_cache}, {"v_cache", rope.v_cache}})
    if (out.numel() > 0 && overlaps(out, t))
      fail(ErrorKind::value, op, std::string("out: expected memory that does not overlap ") + name);
  p.rope = &r;
#if defined(LLMK_WITH_GPU)
  if (p.device.kind == DeviceKind::gpu && skinny_gemm_rope_kv_gpu(p)) return;
#endif
  // Elsewhere (and for no rows: the length still advances, as rope_write_kv_cache's does) the two
  // calls it stands for: the product into out, then the rotation in place and the cache write
  // (rope_write_kv_cache's own checks and backends) on views of out's q, k and v.
  p.rope = nullptr;
  if (p.m > 0) run_on(op, p.device, [&] { skinny_gemm_cpu(p); }, [&] { skinny_gemm_gpu(p); });
  const int64_t hq = r.q_heads, hkv = r.kv_heads, d = r.head_dim, row = p.out_stride;
  const auto part = [&](int64_t col, int64_t heads) {
    TensorView v;
    v.data = static_cast<char*>(out.data) + col * static_cast<int64_t>(dtype_size(out.dtype));
    v.dtype = out.dtype;
    v.device = out.device;
    v.ndim = 4;
    const int64_t shape[4] = {p.m, 1, heads, d}, strides[4] = {row, row, d, 1};
    for (int i = 0; i < 4; ++i) v.shape[i] = shape[i], v.strides[i] = strides[i];
    return v;
  };
  const auto rows3 = [&](const TensorView& t) {  // (M, D / 2) -> (M, 1, D / 2)
    TensorView v = t;
    v.ndim = 3;
    v.shape[2] = t.shape[1], v.strides[2] = t.strides[1];
    v.shape[1] = 1, v.strides[1] = t.strides[0];
    return v;
  };
  TensorView positions = rope.positions;  // (M) -> (M, 1)
  positions.ndim = 2;
  positions.shape[1] = 1;
  positions.strides[1] = positions.strides[0];
  const TensorView q = part(0, hq), k = part(hq * d, hkv), v = part((hq + hkv) * d, hkv);
  rope_write_kv_cache(q, k, rope.k_cache, rope.v_cache, q, k, v, rows3(rope.cos), rows3(rope.sin), positions, stream,
                      rope.advance);
}

}  // namespace llmk
