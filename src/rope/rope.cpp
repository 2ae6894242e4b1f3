// RoPE entry points: argument checks, then dispatch to the CPU or GPU backend.
#include "llmk/rope.h"

#include <cmath>
#include <string>

#include "core/backend.h"
#include "core/check.h"
#include "rope/rope_internal.h"

namespace llmk {

using namespace detail;

const char* rope_style_name(RopeStyle style) {
  return style == RopeStyle::neox ? "neox" : style == RopeStyle::gptj ? "gptj" : "unknown style";
}

namespace {

// q or k and its output: (B, S, H, D) views. Fills one RopeTensor.
RopeTensor check_head_tensor(const char* op, const char* name, const char* out_name,
                             const TensorView& t, const TensorView& out, const TensorView& q) {
  check_same_device(op, name, t, "q", q);
  check_same_dtype(op, name, t, "q", q);
  check_rank(op, name, t, 4, 4);
  check_last_contiguous(op, name, t);
  if (t.shape[0] != q.shape[0] || t.shape[1] != q.shape[1] || t.shape[3] != q.shape[3])
    fail(ErrorKind::value, op,
         std::string(name) + ": expected shape (" + std::to_string(q.shape[0]) + ", " +
             std::to_string(q.shape[1]) + ", heads, " + std::to_string(q.shape[3]) +
             ") (batch, tokens and head dim of q), got " + t.shape_str());
  check_same_device(op, out_name, out, name, t);
  check_same_dtype(op, out_name, out, name, t);
  check_same_shape(op, out_name, out, name, t);
  check_last_contiguous(op, out_name, out);
  RopeTensor r;
  r.in = t.data;
  r.out = out.data;
  r.heads = t.shape[2];
  bool same = out.data == t.data;
  for (int d = 0; d < 3; ++d) {
    r.in_strides[d] = t.strides[d];
    r.out_strides[d] = out.strides[d];
    same = same && (t.shape[d] <= 1 || out.strides[d] == t.strides[d]);
  }
  if (!same && out.numel() > 0 && overlaps(out, t))
    fail(ErrorKind::value, op,
         std::string(out_name) + ": expected " + name + " itself (in place) or memory that does not overlap it");
  return r;
}

RopeParams common(const char* op, const TensorView& q_out, const TensorView& k_out,
                  const TensorView& q, const TensorView& k, RopeStyle style, bool inverse,
                  Stream stream) {
  check_float(op, "q", q);
  check_rank(op, "q", q, 4, 4);
  if (style != RopeStyle::neox && style != RopeStyle::gptj)
    fail(ErrorKind::value, op, "style: expected neox or gptj, got " + std::to_string(static_cast<int>(style)));
  RopeParams p;
  p.q = check_head_tensor(op, "q", "q_out", q, q_out, q);
  p.k = check_head_tensor(op, "k", "k_out", k, k_out, q);
  if (p.q.out != p.q.in && p.k.out != nullptr && k_out.numel() > 0 && q_out.numel() > 0 &&
      overlaps(q_out, k_out))
    fail(ErrorKind::value, op, "k_out: expected memory that does not overlap q_out");
  p.in_place = p.q.out == p.q.in && p.k.out == p.k.in;
  p.batch = q.shape[0];
  p.seq = q.shape[1];
  p.head_dim = q.shape[3];
  p.dtype = q.dtype;
  p.style = style;
  p.inverse = inverse;
  p.device = q.device;
  p.stream = stream;
  return p;
}

void check_rot_dim(const char* op, const char* what, int64_t rot_dim, int64_t head_dim) {
  if (rot_dim < 2 || rot_dim % 2 != 0 || rot_dim > head_dim)
    fail(ErrorKind::value, op,
         std::string(what) + ": expected an even rotary dim between 2 and the head dim " +
             std::to_string(head_dim) + ", got " + std::to_string(rot_dim));
}

void check_angle_dtype(const char* op, const char* name, const TensorView& t, const TensorView& q) {
  check_same_device(op, name, t, "q", q);
  if (t.dtype != DType::f32 && t.dtype != q.dtype)
    fail(ErrorKind::type, op,
         std::string(name) + ": expected dtype float32 or " + dtype_name(q.dtype) +
             " (the dtype of q), got " + dtype_name(t.dtype));
}

// positions: (B, S) int64 / int32 on ref's device, B and S the first two dims of ref.
void check_positions(const char* op, const TensorView& positions, const TensorView& ref, const char* ref_name) {
  check_same_device(op, "positions", positions, ref_name, ref);
  if (positions.dtype != DType::i64 && positions.dtype != DType::i32)
    fail(ErrorKind::type, op,
         std::string("positions: expected dtype int64 or int32, got ") + dtype_name(positions.dtype));
  check_rank(op, "positions", positions, 2, 2);
  if (positions.shape[0] != ref.shape[0] || positions.shape[1] != ref.shape[1])
    fail(ErrorKind::value, op,
         "positions: expected shape (" + std::to_string(ref.shape[0]) + ", " + std::to_string(ref.shape[1]) +
             ") (batch and tokens of " + ref_name + "), got " + positions.shape_str());
}

void run(const RopeParams& p) {
  if (p.batch == 0 || p.seq == 0 || p.head_dim == 0 || (p.q.heads == 0 && p.k.heads == 0)) return;
  run_on("rope", p.device, [&] { rope_cpu(p); }, [&] { rope_gpu(p); });
}

}  // namespace

void rope_cached(TensorView q_out, TensorView k_out, TensorView q, TensorView k,
                 TensorView cos_sin_cache, TensorView positions, RopeStyle style, bool inverse,
                 Stream stream) {
  const char* op = "rope";
  RopeParams p = common(op, q_out, k_out, q, k, style, inverse, stream);
  check_angle_dtype(op, "cos_sin_cache", cos_sin_cache, q);
  check_rank(op, "cos_sin_cache", cos_sin_cache, 2, 2);
  check_last_contiguous(op, "cos_sin_cache", cos_sin_cache);
  p.rot_dim = cos_sin_cache.shape[1];
  check_rot_dim(op, "cos_sin_cache", p.rot_dim, p.head_dim);
  check_positions(op, positions, q, "q");
  p.cache = cos_sin_cache.data;
  p.cache_rows = cos_sin_cache.shape[0];
  p.cache_stride = cos_sin_cache.strides[0];
  p.angle_dtype = cos_sin_cache.dtype;
  p.positions = positions.data;
  p.positions_int64 = positions.dtype == DType::i64;
  p.pos_strides[0] = positions.strides[0];
  p.pos_strides[1] = positions.strides[1];
  run(p);
}

void rope_cos_sin(TensorView q_out, TensorView k_out, TensorView q, TensorView k, TensorView cos,
                  TensorView sin, RopeStyle style, bool inverse, Stream stream) {
  const char* op = "rope";
  RopeParams p = common(op, q_out, k_out, q, k, style, inverse, stream);
  for (const TensorView* t : {&cos, &sin}) {
    const char* name = t == &cos ? "cos" : "sin";
    check_angle_dtype(op, name, *t, q);
    check_rank(op, name, *t, 3, 3);
    check_last_contiguous(op, name, *t);
    if (t->shape[0] != p.batch || t->shape[1] != p.seq)
      fail(ErrorKind::value, op,
           std::string(name) + ": expected shape (" + std::to_string(p.batch) + ", " +
               std::to_string(p.seq) + ", rot_dim / 2) (batch and tokens of q), got " + t->shape_str());
  }
  check_same_dtype(op, "sin", sin, "cos", cos);
  if (sin.shape[2] != cos.shape[2])
    fail(ErrorKind::value, op, "sin: expected shape " + cos.shape_str() + " (the shape of cos), got " + sin.shape_str());
  p.rot_dim = 2 * cos.shape[2];
  check_rot_dim(op, "cos", p.rot_dim, p.head_dim);
  p.cos = cos.data;
  p.sin = sin.data;
  p.angle_dtype = cos.dtype;
  for (int d = 0; d < 2; ++d) {
    p.cos_strides[d] = cos.strides[d];
    p.sin_strides[d] = sin.strides[d];
  }
  run(p);
}

void rope_angles(TensorView cos_out, TensorView sin_out, TensorView inv_freq, TensorView positions,
                 float scaling, Stream stream) {
  const char* op = "rope_angles";
  check_float(op, "cos_out", cos_out);
  check_rank(op, "cos_out", cos_out, 3, 3);
  check_last_contiguous(op, "cos_out", cos_out);
  check_same_device(op, "sin_out", sin_out, "cos_out", cos_out);
  check_same_dtype(op, "sin_out", sin_out, "cos_out", cos_out);
  check_same_shape(op, "sin_out", sin_out, "cos_out", cos_out);
  check_last_contiguous(op, "sin_out", sin_out);
  check_same_device(op, "inv_freq", inv_freq, "cos_out", cos_out);
  if (inv_freq.dtype != DType::f32)
    fail(ErrorKind::type, op, std::string("inv_freq: expected dtype float32, got ") + dtype_name(inv_freq.dtype));
  check_rank(op, "inv_freq", inv_freq, 1, 1);
  check_last_contiguous(op, "inv_freq", inv_freq);
  check_positions(op, positions, cos_out, "cos_out");
  const int64_t freqs = inv_freq.shape[0], width = cos_out.shape[2];
  if (width != freqs && width != 2 * freqs)
    fail(ErrorKind::value, op,
         "cos_out: expected a last dim of " + std::to_string(freqs) + " or " + std::to_string(2 * freqs) +
             " (the frequencies of inv_freq, once or twice), got " + cos_out.shape_str());
  if (!std::isfinite(scaling))
    fail(ErrorKind::value, op, "scaling: expected a finite number, got " + std::to_string(scaling));
  if (cos_out.numel() > 0 && (overlaps(cos_out, sin_out) || overlaps(cos_out, inv_freq) ||
                              overlaps(sin_out, inv_freq) || overlaps(cos_out, positions) ||
                              overlaps(sin_out, positions)))
    fail(ErrorKind::value, op, "cos_out, sin_out: expected memory that overlaps no other argument");
  RopeAnglesParams p;
  p.cos = cos_out.data;
  p.sin = sin_out.data;
  p.inv_freq = static_cast<const float*>(inv_freq.data);
  p.positions = positions.data;
  p.positions_int64 = positions.dtype == DType::i64;
  for (int d = 0; d < 2; ++d) {
    p.cos_strides[d] = cos_out.strides[d];
    p.sin_strides[d] = sin_out.strides[d];
    p.pos_strides[d] = positions.strides[d];
  }
  p.batch = cos_out.shape[0];
  p.seq = cos_out.shape[1];
  p.freqs = freqs;
  p.width = width;
  p.scaling = scaling;
  p.dtype = cos_out.dtype;
  p.device = cos_out.device;
  p.stream = stream;
  if (p.batch == 0 || p.seq == 0 || p.freqs == 0) return;
  run_on(op, p.device, [&] { rope_angles_cpu(p); }, [&] { rope_angles_gpu(p); });
}

}  // namespace llmk
