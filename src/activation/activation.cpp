// Gated activation entry points: argument checks, then dispatch to the CPU or GPU backend.
#include "llmk/activation.h"

#include <string>

#include "activation/activation_internal.h"
#include "core/backend.h"
#include "core/check.h"

namespace llmk {

using namespace detail;

const char* activation_name(Activation act) {
  switch (act) {
    case Activation::silu: return "silu";
    case Activation::gelu: return "gelu";
    case Activation::gelu_tanh: return "gelu_tanh";
  }
  return "unknown activation";
}

namespace {

void check_activation(const char* op, Activation act) {
  if (act != Activation::silu && act != Activation::gelu && act != Activation::gelu_tanh)
    fail(ErrorKind::value, op,
         "act: expected silu, gelu or gelu_tanh, got " + std::to_string(static_cast<int>(act)));
}

// Outputs may be exactly an input (in place, elementwise) but must not partly overlap an input,
// and must not overlap each other.
void check_output(const char* op, const char* name, const void* out, const Rows& ro,
                  const char* in_name, const void* in, const Rows& ri, std::size_t esize) {
  const bool same = out == in && ro.row_stride == ri.row_stride;
  if (!same && rows_overlap(out, ro, in, ri, esize))
    fail(ErrorKind::value, op,
         std::string(name) + ": expected memory that is " + in_name + " itself or does not overlap it");
}

// Checks shared by forward and backward; fills the input half of the parameters.
GatedParams input_params(const char* op, const TensorView& gate, const TensorView& up,
                         Activation act, Stream stream, Rows& rg, Rows& ru) {
  check_float(op, "gate", gate);
  check_activation(op, act);
  rg = as_rows(op, "gate", gate);
  ru = check_matches(op, "up", up, "gate", gate);
  GatedParams p;
  p.gate = gate.data; p.gate_stride = rg.row_stride;
  p.up = up.data; p.up_stride = ru.row_stride;
  p.rows = rg.rows; p.cols = rg.cols;
  p.dtype = gate.dtype; p.act = act;
  p.device = gate.device; p.stream = stream;
  return p;
}

void run(const char* op, const GatedParams& p) {
  if (p.rows == 0 || p.cols == 0) return;
  run_on(op, p.device, [&] { gated_activation_cpu(p); }, [&] { gated_activation_gpu(p); });
}

}  // namespace

void gated_activation(TensorView out, TensorView gate, TensorView up, Activation act,
                      Stream stream) {
  const char* op = "gated_activation";
  Rows rg, ru;
  GatedParams p = input_params(op, gate, up, act, stream, rg, ru);
  const Rows ro = check_matches(op, "out", out, "gate", gate);
  const std::size_t es = dtype_size(gate.dtype);
  check_output(op, "out", out.data, ro, "gate", gate.data, rg, es);
  check_output(op, "out", out.data, ro, "up", up.data, ru, es);
  p.out = out.data; p.out_stride = ro.row_stride;
  run(op, p);
}

void gated_activation_backward(TensorView grad_gate, TensorView grad_up, TensorView grad_out,
                               TensorView gate, TensorView up, Activation act, Stream stream) {
  const char* op = "gated_activation_backward";
  Rows rg, ru;
  GatedParams p = input_params(op, gate, up, act, stream, rg, ru);
  const Rows rgo = check_matches(op, "grad_out", grad_out, "gate", gate);
  const Rows rgg = check_matches(op, "grad_gate", grad_gate, "gate", gate);
  const Rows rgu = check_matches(op, "grad_up", grad_up, "gate", gate);
  const std::size_t es = dtype_size(gate.dtype);
  if (rows_overlap(grad_gate.data, rgg, grad_up.data, rgu, es))
    fail(ErrorKind::value, op, "grad_up: expected memory that does not overlap grad_gate");
  auto check_against_inputs = [&](const char* name, const void* data, const Rows& rows) {
    check_output(op, name, data, rows, "gate", gate.data, rg, es);
    check_output(op, name, data, rows, "up", up.data, ru, es);
    check_output(op, name, data, rows, "grad_out", grad_out.data, rgo, es);
  };
  check_against_inputs("grad_gate", grad_gate.data, rgg);
  check_against_inputs("grad_up", grad_up.data, rgu);
  p.grad_out = grad_out.data; p.grad_out_stride = rgo.row_stride;
  p.grad_gate = grad_gate.data; p.grad_gate_stride = rgg.row_stride;
  p.grad_up = grad_up.data; p.grad_up_stride = rgu.row_stride;
  run(op, p);
}

}  // namespace llmk
