// From torch to llmk: tensor views, the current stream, device guards, and llmk::Error turned
// into the Python exception types torch users expect (ValueError, TypeError, ...).
#pragma once

#include <ATen/ATen.h>

#include <string>

#include "llmk/error.h"
#include "llmk/tensor.h"

namespace llmk::torch_bridge {

TensorView view_of(const at::Tensor& t);
Stream stream_of(const at::Tensor& t);  // the current stream of t's device (nullptr on the CPU)

// x itself when its last dim is contiguous, else a copy that keeps the shape (for ops that read
// any strides except the last: attention, RoPE).
at::Tensor last_dim_contiguous(const at::Tensor& x);

// x itself when llmk can read it as rows of its last dim with one row stride (contiguous tensors,
// row slices), else a contiguous copy. Only for inputs: outputs must never be copies.
at::Tensor rows_ready(const at::Tensor& x);

[[noreturn]] void rethrow(const llmk::Error& e);

// "(3, 7)". Error messages here are built from strings only: formatting integers through
// std::ostream (as c10::str does) crashed in this library inside torch's process on the H200
// machine (torch 2.11, 2026-11-30), so numbers go through std::to_string.
std::string shape_string(at::IntArrayRef sizes);

// Runs f, translating llmk::Error into torch's error types.
template <typename F>
decltype(auto) guarded(F&& f) {
  try {
    return f();
  } catch (const llmk::Error& e) {
    rethrow(e);
  }
}

}  // namespace llmk::torch_bridge
