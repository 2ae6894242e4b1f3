#include "llmk/tensor.h"

#include <string>

namespace llmk {

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::f32: return "float32";
    case DType::f16: return "float16";
    case DType::bf16: return "bfloat16";
    case DType::f64: return "float64";
    case DType::i8: return "int8";
    case DType::u8: return "uint8";
    case DType::i16: return "int16";
    case DType::i32: return "int32";
    case DType::i64: return "int64";
    case DType::boolean: return "bool";
    case DType::other: break;
  }
  return "unknown dtype";
}

std::size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::f64: case DType::i64: return 8;
    case DType::f32: case DType::i32: return 4;
    case DType::f16: case DType::bf16: case DType::i16: return 2;
    case DType::i8: case DType::u8: case DType::boolean: return 1;
    case DType::other: break;
  }
  return 0;
}

std::string device_name(Device device) {
  return device.kind == DeviceKind::cpu ? std::string("cpu") : "gpu:" + std::to_string(device.index);
}

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (int d = 0; d < ndim; ++d) n *= shape[d];
  return n;
}

int64_t TensorView::size(int dim) const { return shape[dim < 0 ? dim + ndim : dim]; }
int64_t TensorView::stride(int dim) const { return strides[dim < 0 ? dim + ndim : dim]; }

// No iostreams here: inside a Python process with torch loaded, ostringstream's number
// formatting crashed in libllmk (H200 machine, torch 2.11, 2026-11-30), while std::to_string is
// plain C.
std::string TensorView::shape_str() const {
  std::string s = "(";
  for (int d = 0; d < ndim; ++d) s += (d ? ", " : "") + std::to_string(shape[d]);
  return s + ")";
}

TensorView TensorView::contiguous(void* data, DType dtype, Device device,
                                  std::initializer_list<int64_t> shape) {
  TensorView v;
  v.data = data;
  v.dtype = dtype;
  v.device = device;
  v.ndim = static_cast<int>(shape.size());
  int d = 0;
  for (int64_t s : shape) v.shape[d++] = s;
  int64_t stride = 1;
  for (d = v.ndim - 1; d >= 0; --d) {
    v.strides[d] = stride;
    stride *= v.shape[d];
  }
  return v;
}

}  // namespace llmk
