// Argument checks shared by every op. Each throws llmk::Error with a message of the form
//   "llmk::<op>: <argument>: expected <what>, got <what came>".
#pragma once

#include <initializer_list>
#include <string>

#include "llmk/error.h"
#include "llmk/tensor.h"

namespace llmk::detail {

[[noreturn]] void fail(ErrorKind kind, const char* op, const std::string& message);

// A tensor seen as rows of `cols` contiguous elements, `row_stride` elements apart.
struct Rows {
  int64_t rows = 0;
  int64_t cols = 0;
  int64_t row_stride = 0;
};

// f32, f16 or bf16.
void check_float(const char* op, const char* name, const TensorView& t);
void check_same_dtype(const char* op, const char* name, const TensorView& t, const char* ref_name,
                      const TensorView& ref);
void check_same_device(const char* op, const char* name, const TensorView& t, const char* ref_name,
                       const TensorView& ref);
void check_same_shape(const char* op, const char* name, const TensorView& t, const char* ref_name,
                      const TensorView& ref);
void check_rank(const char* op, const char* name, const TensorView& t, int min_rank, int max_rank);
void check_finite_nonnegative(const char* op, const char* name, float value);

// A last dim of stride 1 (any stride where it has one element).
void check_last_contiguous(const char* op, const char* name, const TensorView& t);
// int32, or int64 too when allow_int64.
void check_int(const char* op, const char* name, const TensorView& t, bool allow_int64);

// t must have ref's shape, dtype and device, and be readable as rows (as_rows).
Rows check_matches(const char* op, const char* name, const TensorView& t, const char* ref_name,
                   const TensorView& ref);

// Views t (..., N) as rows; the last dim must be contiguous and the leading dims must collapse
// into one stride. Throws otherwise.
Rows as_rows(const char* op, const char* name, const TensorView& t);

// True when t is dense row-major (size-1 dims may have any stride).
bool is_contiguous(const TensorView& t);

// "(2, 3, 4)" for an expected shape in a message; negative entries print as "*" (any size), and
// `last`, when given, is appended as a final named dim.
std::string shape_string(std::initializer_list<int64_t> dims, const char* last = nullptr);

// True when [a, a+bytes_a) and [b, b+bytes_b) overlap.
bool overlaps(const TensorView& a, const TensorView& b);

// True when two row views (data pointers, as_rows() layouts, same element size) share an element.
// Exact for equal row strides (e.g. the two halves of a packed (..., 2d) tensor), conservative
// otherwise.
bool rows_overlap(const void* a, const Rows& ra, const void* b, const Rows& rb, std::size_t esize);

}  // namespace llmk::detail
