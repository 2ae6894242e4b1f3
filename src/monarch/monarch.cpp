// Monarch entry points: argument checks, then dispatch to the CPU or GPU backend.
#include "llmk/monarch.h"

#include <string>

#include "core/backend.h"
#include "core/check.h"
#include "monarch/monarch_internal.h"

namespace llmk {

using namespace detail;

namespace {

constexpr const char* kOp = "monarch_matmul";

// The factors: 3-d, contiguous, x's dtype and device, k*p == n and k*q == l*r.
MonarchParams check_factors(const char* op, const TensorView& x, const TensorView& w1,
                            const TensorView& w2) {
  check_float(op, "x", x);
  check_rank(op, "x", x, 1, kMaxDims);
  check_same_dtype(op, "w1", w1, "x", x);
  check_same_device(op, "w1", w1, "x", x);
  check_same_dtype(op, "w2", w2, "x", x);
  check_same_device(op, "w2", w2, "x", x);
  check_rank(op, "w1", w1, 3, 3);
  check_rank(op, "w2", w2, 3, 3);
  for (const TensorView* w : {&w1, &w2})
    if (!is_contiguous(*w))
      fail(ErrorKind::value, op, std::string(w == &w1 ? "w1" : "w2") + ": expected a contiguous tensor");
  MonarchParams p;
  p.k = w1.shape[0]; p.q = w1.shape[1]; p.p = w1.shape[2];
  p.l = w2.shape[0]; p.s = w2.shape[1]; p.r = w2.shape[2];
  if (p.k < 1 || p.q < 1 || p.p < 1 || p.l < 1 || p.s < 1 || p.r < 1)
    fail(ErrorKind::value, op, "w1, w2: expected non-empty factors (k, q, p) and (l, s, r), got " +
                                   w1.shape_str() + " and " + w2.shape_str());
  const int64_t n = x.shape[x.ndim - 1];
  if (p.k * p.p != n)
    fail(ErrorKind::value, op,
         "x: expected a last dim of k*p = " + std::to_string(p.k * p.p) + " (w1 is " + w1.shape_str() +
             "), got " + std::to_string(n));
  if (p.k * p.q != p.l * p.r)
    fail(ErrorKind::value, op,
         "w2: expected l*r == k*q = " + std::to_string(p.k * p.q) + " (w1 is " + w1.shape_str() +
             "), got shape " + w2.shape_str() + " with l*r = " + std::to_string(p.l * p.r));
  const Rows rows = as_rows(op, "x", x);
  p.tokens = rows.rows;
  p.x = x.data;
  p.x_stride = rows.row_stride;
  p.w1 = w1.data;
  p.w2 = w2.data;
  p.dtype = x.dtype;
  p.device = x.device;
  return p;
}

// t: x's leading dims with a last dim of `last`, x's dtype and device, readable as rows.
Rows check_rows_like(const char* op, const char* name, const TensorView& t, const TensorView& x,
                     int64_t last) {
  check_same_dtype(op, name, t, "x", x);
  check_same_device(op, name, t, "x", x);
  bool ok = t.ndim == x.ndim && t.shape[t.ndim - 1] == last;
  for (int d = 0; ok && d + 1 < x.ndim; ++d) ok = t.shape[d] == x.shape[d];
  if (!ok) {
    std::string want = "(";
    for (int d = 0; d + 1 < x.ndim; ++d) want += std::to_string(x.shape[d]) + ", ";
    want += std::to_string(last) + ")";
    fail(ErrorKind::value, op, std::string(name) + ": expected shape " + want + ", got " + t.shape_str());
  }
  return as_rows(op, name, t);
}

void check_workspace(const char* op, const TensorView& ws, std::size_t need, const MonarchParams& p) {
  if (need == 0 || p.device.kind == DeviceKind::cpu) return;
  const std::size_t have = ws.data ? static_cast<std::size_t>(ws.numel()) * dtype_size(ws.dtype) : 0;
  if (have < need)
    fail(ErrorKind::value, op,
         "workspace: expected at least " + std::to_string(need) + " bytes, got " + std::to_string(have));
  if (ws.device != p.device)
    fail(ErrorKind::device, op, "workspace: expected a buffer on " + device_name(p.device) + ", got " +
                                    device_name(ws.device));
}

std::size_t forward_workspace(const MonarchParams& p) {
  if (p.device.kind == DeviceKind::cpu || p.tokens == 0) return 0;
#if defined(LLMK_WITH_GPU)
  return monarch_gpu_workspace_bytes(p);
#else
  return 0;
#endif
}

}  // namespace

std::size_t monarch_matmul_workspace_bytes(TensorView x, TensorView w1, TensorView w2) {
  return forward_workspace(check_factors(kOp, x, w1, w2));
}

void monarch_matmul(TensorView out, TensorView x, TensorView w1, TensorView w2, TensorView workspace,
                    Stream stream) {
  MonarchParams p = check_factors(kOp, x, w1, w2);
  const Rows o = check_rows_like(kOp, "out", out, x, p.m());
  if (out.numel() > 0 && (overlaps(out, x) || overlaps(out, w1) || overlaps(out, w2)))
    fail(ErrorKind::value, kOp, "out: expected memory that does not overlap x, w1 or w2");
  p.out = out.data;
  p.out_stride = o.row_stride;
  p.stream = stream;
  p.workspace = workspace.data;
  p.workspace_bytes = workspace.data ? workspace.numel() * dtype_size(workspace.dtype) : 0;
  if (p.tokens == 0) return;
  check_workspace(kOp, workspace, forward_workspace(p), p);
  run_on(kOp, p.device, [&] { monarch_cpu(p); }, [&] { monarch_gpu(p); });
}

std::size_t monarch_backward_workspace_bytes(TensorView x, TensorView w1, TensorView w2) {
  MonarchParams p = check_factors("monarch_matmul_backward", x, w1, w2);
  return p.device.kind == DeviceKind::cpu ? 0 : monarch_backward_bytes(p);
}

void monarch_matmul_backward(TensorView dx, TensorView dw1, TensorView dw2, TensorView dout,
                             TensorView x, TensorView w1, TensorView w2, TensorView workspace,
                             Stream stream) {
  const char* op = "monarch_matmul_backward";
  MonarchParams p = check_factors(op, x, w1, w2);
  const Rows d = check_rows_like(op, "dout", dout, x, p.m());
  const Rows g = check_rows_like(op, "dx", dx, x, p.n());
  check_same_dtype(op, "dw1", dw1, "x", x);
  check_same_device(op, "dw1", dw1, "x", x);
  check_same_shape(op, "dw1", dw1, "w1", w1);
  check_same_dtype(op, "dw2", dw2, "x", x);
  check_same_device(op, "dw2", dw2, "x", x);
  check_same_shape(op, "dw2", dw2, "w2", w2);
  for (const TensorView* w : {&dw1, &dw2})
    if (!is_contiguous(*w))
      fail(ErrorKind::value, op, std::string(w == &dw1 ? "dw1" : "dw2") + ": expected a contiguous tensor");
  const TensorView* outs[] = {&dx, &dw1, &dw2};
  const TensorView* ins[] = {&dout, &x, &w1, &w2};
  const char* out_names[] = {"dx", "dw1", "dw2"};
  for (int i = 0; i < 3; ++i) {
    if (outs[i]->numel() == 0) continue;
    for (const TensorView* in : ins)
      if (in->numel() > 0 && overlaps(*outs[i], *in))
        fail(ErrorKind::value, op, std::string(out_names[i]) + ": expected memory that does not overlap the inputs");
    for (int j = 0; j < i; ++j)
      if (outs[j]->numel() > 0 && overlaps(*outs[i], *outs[j]))
        fail(ErrorKind::value, op, std::string(out_names[i]) + ": expected memory that does not overlap " + out_names[j]);
  }
  p.dout = dout.data;
  p.dout_stride = d.row_stride;
  p.dx = dx.data;
  p.dx_stride = g.row_stride;
  p.dw1 = dw1.data;
  p.dw2 = dw2.data;
  p.stream = stream;
  p.workspace = workspace.data;
  p.workspace_bytes = workspace.data ? workspace.numel() * dtype_size(workspace.dtype) : 0;
  if (p.device.kind != DeviceKind::cpu) check_workspace(op, workspace, monarch_backward_bytes(p), p);
  run_on(op, p.device, [&] { monarch_backward_cpu(p); }, [&] { monarch_backward_gpu(p); });
}

namespace detail {

int64_t monarch_decode_mma_launches() {
#if defined(LLMK_WITH_GPU)
  return monarch_decode_mma_launches_gpu();
#else
  return 0;
#endif
}

int64_t monarch_simt_launches() {
#if defined(LLMK_WITH_GPU)
  return monarch_simt_launches_gpu();
#else
  return 0;
#endif
}

int64_t monarch_simt_vec_launches() {
#if defined(LLMK_WITH_GPU)
  return monarch_simt_vec_launches_gpu();
#else
  return 0;
#endif
}

}  // namespace detail

}  // namespace llmk
