#include "core/check.h"

#include <cmath>
#include <cstdint>

namespace llmk::detail {

void fail(ErrorKind kind, const char* op, const std::string& message) {
  throw Error(kind, std::string("llmk::") + op + ": " + message);
}

void check_float(const char* op, const char* name, const TensorView& t) {
  if (t.dtype != DType::f32 && t.dtype != DType::f16 && t.dtype != DType::bf16)
    fail(ErrorKind::type, op,
         std::string(name) + ": expected dtype float32, float16 or bfloat16, got " +
             dtype_name(t.dtype));
}

void check_same_dtype(const char* op, const char* name, const TensorView& t, const char* ref_name,
                      const TensorView& ref) {
  if (t.dtype != ref.dtype)
    fail(ErrorKind::type, op,
         std::string(name) + ": expected dtype " + dtype_name(ref.dtype) + " (the dtype of " +
             ref_name + "), got " + dtype_name(t.dtype));
}

void check_same_device(const char* op, const char* name, const TensorView& t, const char* ref_name,
                       const TensorView& ref) {
  if (t.device != ref.device)
    fail(ErrorKind::device, op,
         std::string(name) + ": expected device " + device_name(ref.device) + " (the device of " +
             ref_name + "), got " + device_name(t.device));
}

void check_same_shape(const char* op, const char* name, const TensorView& t, const char* ref_name,
                      const TensorView& ref) {
  bool same = t.ndim == ref.ndim;
  for (int d = 0; same && d < t.ndim; ++d) same = t.shape[d] == ref.shape[d];
  if (!same)
    fail(ErrorKind::value, op,
         std::string(name) + ": expected shape " + ref.shape_str() + " (the shape of " + ref_name +
             "), got " + t.shape_str());
}

void check_rank(const char* op, const char* name, const TensorView& t, int min_rank, int max_rank) {
  if (t.ndim < min_rank || t.ndim > max_rank) {
    std::string want = min_rank == max_rank
                           ? std::to_string(min_rank)
                           : std::to_string(min_rank) + " to " + std::to_string(max_rank);
    fail(ErrorKind::value, op,
         std::string(name) + ": expected " + want + " dims, got " + std::to_string(t.ndim) +
             " dims with shape " + t.shape_str());
  }
}

void check_finite_nonnegative(const char* op, const char* name, float value) {
  if (!std::isfinite(value) || value < 0.f)
    fail(ErrorKind::value, op,
         std::string(name) + ": expected a finite value >= 0, got " + std::to_string(value));
}

bool is_contiguous(const TensorView& t) {
  int64_t expected = 1;
  for (int d = t.ndim - 1; d >= 0; --d) {
    if (t.shape[d] != 1 && t.strides[d] != expected) return false;
    expected *= t.shape[d];
  }
  return true;
}

std::string shape_string(std::initializer_list<int64_t> dims, const char* last) {
  std::string s = "(";
  bool first = true;
  for (int64_t x : dims) {
    s += (first ? "" : ", ") + (x < 0 ? std::string("*") : std::to_string(x));
    first = false;
  }
  if (last) s += std::string(first ? "" : ", ") + last;
  return s + ")";
}

void check_last_contiguous(const char* op, const char* name, const TensorView& t) {
  if (t.ndim > 0 && t.shape[t.ndim - 1] > 1 && t.strides[t.ndim - 1] != 1)
    fail(ErrorKind::value, op,
         std::string(name) + ": expected a contiguous last dim (stride 1), got stride " +
             std::to_string(t.strides[t.ndim - 1]));
}

void check_int(const char* op, const char* name, const TensorView& t, bool allow_int64) {
  if (t.dtype != DType::i32 && !(allow_int64 && t.dtype == DType::i64))
    fail(ErrorKind::type, op,
         std::string(name) + ": expected dtype " + (allow_int64 ? "int32 or int64" : "int32") +
             ", got " + dtype_name(t.dtype));
}

Rows as_rows(const char* op, const char* name, const TensorView& t) {
  Rows r;
  if (t.ndim < 1) fail(ErrorKind::value, op, std::string(name) + ": expected at least 1 dim, got 0");
  r.cols = t.shape[t.ndim - 1];
  r.rows = 1;
  for (int d = 0; d + 1 < t.ndim; ++d) r.rows *= t.shape[d];
  if (r.cols > 1 && t.strides[t.ndim - 1] != 1)
    fail(ErrorKind::value, op,
         std::string(name) + ": expected a contiguous last dim (stride 1), got stride " +
             std::to_string(t.strides[t.ndim - 1]));
  if (r.rows == 0) {
    r.row_stride = r.cols;
    return r;
  }
  // Collapse the leading dims: walking inwards, each dim of size > 1 must have
  // stride == (stride of the next non-trivial dim) * (its size).
  r.row_stride = r.cols;
  int64_t expected = -1;
  for (int d = t.ndim - 2; d >= 0; --d) {
    if (t.shape[d] == 1) continue;
    if (expected < 0) {
      r.row_stride = t.strides[d];
    } else if (t.strides[d] != expected) {
      fail(ErrorKind::value, op,
           std::string(name) + ": expected rows reachable with one stride (leading dims that "
                               "collapse), got shape " + t.shape_str() + "; make it contiguous first");
    }
    expected = t.strides[d] * t.shape[d];
  }
  if (r.rows > 1 && r.row_stride < r.cols)
    fail(ErrorKind::value, op,
         std::string(name) + ": expected a row stride >= " + std::to_string(r.cols) + ", got " +
             std::to_string(r.row_stride));
  return r;
}

Rows check_matches(const char* op, const char* name, const TensorView& t, const char* ref_name,
                   const TensorView& ref) {
  check_same_device(op, name, t, ref_name, ref);
  check_same_dtype(op, name, t, ref_name, ref);
  check_same_shape(op, name, t, ref_name, ref);
  return as_rows(op, name, t);
}

static void byte_range(const TensorView& t, uintptr_t& lo, uintptr_t& hi) {
  lo = reinterpret_cast<uintptr_t>(t.data);
  int64_t span = 1;
  for (int d = 0; d < t.ndim; ++d)
    if (t.shape[d] == 0) { hi = lo; return; } else span += (t.shape[d] - 1) * t.strides[d];
  hi = lo + static_cast<uintptr_t>(span) * dtype_size(t.dtype);
}

bool overlaps(const TensorView& a, const TensorView& b) {
  uintptr_t alo, ahi, blo, bhi;
  byte_range(a, alo, ahi);
  byte_range(b, blo, bhi);
  return alo < bhi && blo < ahi;
}

bool rows_overlap(const void* a, const Rows& ra, const void* b, const Rows& rb, std::size_t esize) {
  if (ra.rows == 0 || rb.rows == 0 || ra.cols == 0 || rb.cols == 0) return false;
  const auto lo_a = reinterpret_cast<intptr_t>(a), lo_b = reinterpret_cast<intptr_t>(b);
  const intptr_t hi_a = lo_a + static_cast<intptr_t>(((ra.rows - 1) * ra.row_stride + ra.cols) * esize);
  const intptr_t hi_b = lo_b + static_cast<intptr_t>(((rb.rows - 1) * rb.row_stride + rb.cols) * esize);
  if (!(lo_a < hi_b && lo_b < hi_a)) return false;  // disjoint spans
  if (ra.row_stride != rb.row_stride || ra.rows == 1 || rb.rows == 1) return true;
  const intptr_t delta_bytes = lo_b - lo_a;
  if (delta_bytes % static_cast<intptr_t>(esize) != 0) return true;
  const int64_t s = ra.row_stride, delta = delta_bytes / static_cast<intptr_t>(esize);
  const int64_t m = ((delta % s) + s) % s;  // where b's rows start within a's row period
  return m < ra.cols || m > s - rb.cols;
}

}  // namespace llmk::detail
