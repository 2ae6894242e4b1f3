// RMSNorm family entry points: argument checks, then dispatch to the CPU or GPU backend.
#include "llmk/rmsnorm.h"

#include <string>

#include "core/backend.h"
#include "core/check.h"
#include "rmsnorm/rmsnorm_internal.h"

namespace llmk {

using namespace detail;

namespace {

// Checks shared by forward and backward: x (..., N) float, weight (N) in x's dtype or f32.
Rows check_x_and_weight(const char* op, const TensorView& x, const TensorView& weight, float eps) {
  check_float(op, "x", x);
  Rows r = as_rows(op, "x", x);
  check_same_device(op, "weight", weight, "x", x);
  check_rank(op, "weight", weight, 1, 1);
  if (weight.shape[0] != r.cols)
    fail(ErrorKind::value, op,
         "weight: expected shape (" + std::to_string(r.cols) + ") (the last dim of x), got " +
             weight.shape_str());
  if (weight.dtype != x.dtype && weight.dtype != DType::f32)
    fail(ErrorKind::type, op,
         std::string("weight: expected dtype ") + dtype_name(x.dtype) +
             " (the dtype of x) or float32, got " + dtype_name(weight.dtype));
  if (r.cols > 1 && weight.strides[0] != 1)
    fail(ErrorKind::value, op,
         "weight: expected a contiguous tensor, got stride " + std::to_string(weight.strides[0]));
  check_finite_nonnegative(op, "eps", eps);
  return r;
}

void check_offset(const char* op, float offset) {
  if (!(offset == offset) || offset == 1.f / 0.f || offset == -1.f / 0.f)
    fail(ErrorKind::value, op, "offset: expected a finite value, got " + std::to_string(offset));
}

void check_no_overlap(const char* op, const char* a_name, const TensorView& a, const char* b_name,
                      const TensorView& b) {
  if (a.numel() > 0 && b.numel() > 0 && overlaps(a, b))
    fail(ErrorKind::value, op,
         std::string(a_name) + ": expected memory that does not overlap " + b_name);
}

}  // namespace

namespace {

// Checks what both forward ops share and fills the parameters for y = rms_norm(x).
RmsNormParams forward_params(const char* op, const TensorView& y, const TensorView& x,
                             const TensorView& weight, float eps, float offset, Stream stream) {
  const Rows xr = check_x_and_weight(op, x, weight, eps);
  check_offset(op, offset);
  const Rows yr = check_matches(op, "y", y, "x", x);
  RmsNormParams p;
  p.y = y.data; p.y_stride = yr.row_stride;
  p.x = x.data; p.x_stride = xr.row_stride;
  p.weight = weight.data;
  p.rows = xr.rows; p.cols = xr.cols;
  p.dtype = x.dtype; p.weight_dtype = weight.dtype;
  p.eps = eps; p.offset = offset;
  p.device = x.device; p.stream = stream;
  return p;
}

void run_forward(const char* op, const RmsNormParams& p) {
  if (p.rows == 0 || p.cols == 0) return;
  run_on(op, p.device, [&] { rms_norm_cpu(p); }, [&] { rms_norm_gpu(p); });
}

}  // namespace

void rms_norm(TensorView y, TensorView x, TensorView weight, float eps, float offset,
              Stream stream) {
  run_forward("rms_norm", forward_params("rms_norm", y, x, weight, eps, offset, stream));
}

void fused_add_rms_norm(TensorView y, TensorView residual_out, TensorView x, TensorView residual,
                        TensorView weight, float eps, float offset, Stream stream) {
  const char* op = "fused_add_rms_norm";
  RmsNormParams p = forward_params(op, y, x, weight, eps, offset, stream);
  const Rows rr = check_matches(op, "residual", residual, "x", x);
  const Rows ror = check_matches(op, "residual_out", residual_out, "x", x);
  const bool in_place = residual_out.data == residual.data && ror.row_stride == rr.row_stride;
  if (!in_place) check_no_overlap(op, "residual_out", residual_out, "residual", residual);
  check_no_overlap(op, "residual_out", residual_out, "x", x);
  check_no_overlap(op, "y", y, "residual_out", residual_out);
  p.residual = residual.data; p.residual_stride = rr.row_stride;
  p.residual_out = residual_out.data; p.residual_out_stride = ror.row_stride;
  run_forward(op, p);
}

std::size_t rms_norm_backward_workspace_size(TensorView x) {
  const char* op = "rms_norm_backward";
  check_float(op, "x", x);
  Rows xr = as_rows(op, "x", x);
  if (x.device.kind == DeviceKind::cpu || xr.rows == 0 || xr.cols == 0) return 0;
  std::size_t bytes = 0;
  run_on(op, x.device, [] {},
         [&] { bytes = rms_norm_backward_workspace_gpu(xr.rows, xr.cols, x.dtype, x.device); });
  return bytes;
}

void rms_norm_backward(TensorView grad_x, TensorView grad_weight, TensorView grad_y, TensorView x,
                       TensorView weight, float eps, float offset, const TensorView* grad_extra,
                       void* workspace, Stream stream) {
  const char* op = "rms_norm_backward";
  Rows xr = check_x_and_weight(op, x, weight, eps);
  check_offset(op, offset);
  Rows gyr = check_matches(op, "grad_y", grad_y, "x", x);
  Rows gxr = check_matches(op, "grad_x", grad_x, "x", x);
  check_same_device(op, "grad_weight", grad_weight, "weight", weight);
  check_same_dtype(op, "grad_weight", grad_weight, "weight", weight);
  check_same_shape(op, "grad_weight", grad_weight, "weight", weight);
  if (xr.cols > 1 && grad_weight.strides[0] != 1)
    fail(ErrorKind::value, op, "grad_weight: expected a contiguous tensor");
  RmsNormBackwardParams p;
  if (grad_extra != nullptr && grad_extra->defined()) {
    Rows ger = check_matches(op, "grad_extra", *grad_extra, "x", x);
    p.grad_extra = grad_extra->data;
    p.grad_extra_stride = ger.row_stride;
  }
  p.grad_x = grad_x.data; p.grad_x_stride = gxr.row_stride;
  p.grad_weight = grad_weight.data;
  p.grad_y = grad_y.data; p.grad_y_stride = gyr.row_stride;
  p.x = x.data; p.x_stride = xr.row_stride;
  p.weight = weight.data;
  p.rows = xr.rows; p.cols = xr.cols;
  p.dtype = x.dtype; p.weight_dtype = weight.dtype;
  p.eps = eps; p.offset = offset;
  p.workspace = static_cast<float*>(workspace);
  p.device = x.device; p.stream = stream;
  if (p.cols == 0) return;
  if (x.device.kind == DeviceKind::gpu && p.rows > 0 && workspace == nullptr)
    fail(ErrorKind::value, op,
         "workspace: expected rms_norm_backward_workspace_size(x) bytes of GPU memory, got nullptr");
  run_on(op, x.device, [&] { rms_norm_backward_cpu(p); }, [&] { rms_norm_backward_gpu(p); });
}

}  // namespace llmk
