// llmk tensor view: a non-owning description of memory (pointer, dtype, device, shape, strides).
// Every llmk op takes views in and throws llmk::Error (include/llmk/error.h) on bad input.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>

namespace llmk {

// Element types. Ops support f32/f16/bf16; the others exist so that a caller passing them gets
// a clear "unsupported dtype" error instead of a misread buffer.
enum class DType : int { f32, f16, bf16, f64, i8, u8, i16, i32, i64, boolean, other };

const char* dtype_name(DType dtype);
std::size_t dtype_size(DType dtype);  // 0 for DType::other

enum class DeviceKind : int { cpu, gpu };

struct Device {
  DeviceKind kind = DeviceKind::cpu;
  int index = 0;  // GPU ordinal; ignored on the CPU
  bool operator==(const Device& o) const {
    return kind == o.kind && (kind == DeviceKind::cpu || index == o.index);
  }
  bool operator!=(const Device& o) const { return !(*this == o); }
};

std::string device_name(Device device);

// A cudaStream_t or hipStream_t, or nullptr for the default stream. Ignored on the CPU.
using Stream = void*;

constexpr int kMaxDims = 8;

struct TensorView {
  void* data = nullptr;
  DType dtype = DType::f32;
  Device device{};
  int ndim = 0;
  int64_t shape[kMaxDims] = {};
  int64_t strides[kMaxDims] = {};  // in elements, not bytes

  int64_t numel() const;
  int64_t size(int dim) const;    // negative dims count from the end
  int64_t stride(int dim) const;  // negative dims count from the end
  bool defined() const { return ndim > 0 || data != nullptr; }
  std::string shape_str() const;  // "(2, 3, 4)"

  // A dense row-major view.
  static TensorView contiguous(void* data, DType dtype, Device device,
                               std::initializer_list<int64_t> shape);
};

}  // namespace llmk
