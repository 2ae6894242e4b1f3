// From torch to llmk: tensor views, the current stream, device guards, and llmk::Error turned
// into the Python exception types torch users expect (ValueError, TypeError, ...).
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/autograd/custom_function.h>

#include <optional>
#include <string>

#include "llmk/error.h"
#include "llmk/tensor.h"
#include "llmk/threads.h"

namespace llmk::torch_bridge {

TensorView view_of(const at::Tensor& t);
TensorView optional_view(const std::optional<at::Tensor>& t);  // an undefined view for nullopt
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

// Autograd of our differentiable ops lives in C++ (each family's *_torch.cpp registers a
// torch::autograd::Function for the Autograd key): the dispatcher runs that kernel on every call
// outside inference mode (no_grad included), where a Python formula (torch.library.register_autograd)
// cost 4-6 us more host time per call (2-core CPU machine, 2026-12-02, best of 15 x 20000 calls of
// rms_norm on a 64-element CPU tensor: 10.5 us with grad enabled and 9.5 under no_grad with the
// Python formula, 6.4 and 6.8 with this one, about 4 under inference_mode), which eager decoding
// pays on every op.
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The dispatcher's handle of `name` ("llm_kernels::rms_norm") for the C++ signature Fn, which must
// be that of the op's kernels (decltype of the kernel function). Its call() goes through the
// dispatcher: under at::AutoDispatchBelowADInplaceOrView it reaches the CPU / CUDA kernel, or the
// fake implementation while torch.compile traces.
template <typename Fn>
c10::TypedOperatorHandle<Fn> find_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Fn>();
}

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
