// Skinny GEMM entry point: argument checks, then dispatch to the CPU or GPU backend.
#include "llmk/gemm.h"

#include <string>

#include "core/backend.h"
#include "core/check.h"
#include "gemm/gemm_internal.h"

namespace llmk {

using namespace detail;

const char* gemm_activation_name(GemmActivation activation) {
  return activation == GemmActivation::none ? "none" : activation == GemmActivation::swiglu ? "swiglu" : "unknown";
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
  if (options.activation != GemmActivation::none && options.activation != GemmActivation::swiglu)
    fail(ErrorKind::value, op, "activation: expected none or swiglu, got " + std::to_string(static_cast<int>(options.activation)));
  int64_t out_cols = p.n;
  if (options.activation == GemmActivation::swiglu) {
    if (p.n % 2 != 0)
      fail(ErrorKind::value, op,
           "weight: expected an even number of rows for swiglu ([gate; up], 2 * inter), got shape " + weight.shape_str());
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
