// Skinny GEMM entry point: argument checks, then dispatch to the CPU or GPU backend.
#include "llmk/gemm.h"

#include <string>

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

void skinny_gemm(TensorView out, TensorView x, TensorView weight, TensorView bias,
                 const GemmOptions& options, Stream stream) {
  const char* op = "skinny_gemm";
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
  if (p.m == 0 || out_cols == 0) return;
  run_on(op, p.device, [&] { skinny_gemm_cpu(p); }, [&] { skinny_gemm_gpu(p); });
}

}  // namespace llmk
