#include "torch/bridge.h"

#include <ATen/Parallel.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/Exception.h>

namespace llmk::torch_bridge {

namespace {
DType dtype_of(at::ScalarType s) {
  switch (s) {
    case at::kFloat: return DType::f32;
    case at::kHalf: return DType::f16;
    case at::kBFloat16: return DType::bf16;
    case at::kDouble: return DType::f64;
    case at::kChar: return DType::i8;
    case at::kByte: return DType::u8;
    case at::kShort: return DType::i16;
    case at::kInt: return DType::i32;
    case at::kLong: return DType::i64;
    case at::kBool: return DType::boolean;
    default: return DType::other;
  }
}
}  // namespace

TensorView view_of(const at::Tensor& t) {
  TensorView v;
  TORCH_CHECK_VALUE(t.dim() <= kMaxDims,
                    "llm_kernels: tensors of more than " + std::to_string(kMaxDims) +
                        " dims are not supported, got shape " + shape_string(t.sizes()));
  v.data = t.numel() ? const_cast<void*>(t.data_ptr()) : nullptr;
  v.dtype = dtype_of(t.scalar_type());
  if (t.device().is_cpu()) {
    v.device = Device{DeviceKind::cpu, 0};
  } else if (t.device().is_cuda()) {  // ROCm builds of torch report HIP devices as "cuda" too
    v.device = Device{DeviceKind::gpu, t.device().index()};
  } else {
    TORCH_CHECK(false, "llm_kernels: unsupported device " + t.device().str());
  }
  v.ndim = static_cast<int>(t.dim());
  for (int d = 0; d < v.ndim; ++d) {
    v.shape[d] = t.size(d);
    v.strides[d] = t.stride(d);
  }
  return v;
}

TensorView optional_view(const std::optional<at::Tensor>& t) { return t ? view_of(*t) : TensorView{}; }

Stream stream_of(const at::Tensor& t) {
  if (!t.device().is_cuda()) return nullptr;
  const auto* impl = c10::impl::getDeviceGuardImpl(t.device().type());
  return impl->getStream(t.device()).native_handle();
}

at::Tensor last_dim_contiguous(const at::Tensor& x) {
  return x.dim() == 0 || x.size(-1) <= 1 || x.stride(-1) == 1 ? x : x.contiguous();
}

at::Tensor rows_ready(const at::Tensor& x) {
  if (x.dim() == 0) return x;  // llmk names the problem
  bool ok = x.size(-1) <= 1 || x.stride(-1) == 1;
  int64_t expected = -1;
  for (int64_t d = x.dim() - 2; ok && d >= 0; --d) {
    if (x.size(d) == 1) continue;
    ok = expected < 0 || x.stride(d) == expected;
    expected = x.stride(d) * x.size(d);
  }
  return ok ? x : x.contiguous();
}

std::string shape_string(at::IntArrayRef sizes) {
  std::string s = "(";
  for (size_t d = 0; d < sizes.size(); ++d) s += (d ? ", " : "") + std::to_string(sizes[d]);
  return s + ")";
}

void rethrow(const llmk::Error& e) {
  switch (e.kind()) {
    case ErrorKind::value: TORCH_CHECK_VALUE(false, e.what());
    case ErrorKind::type: TORCH_CHECK_TYPE(false, e.what());
    case ErrorKind::not_implemented: TORCH_CHECK_NOT_IMPLEMENTED(false, e.what());
    default: TORCH_CHECK(false, e.what());
  }
  TORCH_CHECK(false, e.what());
}

namespace {
// llmk's CPU kernels run their rows on torch's intra-op threads (include/llmk/threads.h),
// installed when this extension loads.
void torch_parallel_for(int64_t n, int64_t grain, void* ctx,
                        void (*chunk)(void* ctx, int64_t begin, int64_t end)) {
  at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) { chunk(ctx, begin, end); });
}
const bool parallel_for_installed = (llmk::set_cpu_parallel_for(torch_parallel_for), true);
}  // namespace

}  // namespace llmk::torch_bridge
