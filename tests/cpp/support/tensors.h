// Test tensors: host storage in any llmk dtype, an optional GPU copy, fresh random fill,
// NaN poisoning, and float64 read-back for references.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "core/half.h"
#include "llmk/tensor.h"
#include "support/gpu_memory.h"

namespace llmk_test {

inline std::mt19937& rng() {
  static std::mt19937 gen(20261130);
  return gen;
}

inline double rounded(llmk::DType dt, double v) {
  using namespace llmk::detail;
  switch (dt) {
    case llmk::DType::f16: return to_float(from_float<Half>(static_cast<float>(v)));
    case llmk::DType::bf16: return to_float(from_float<BFloat16>(static_cast<float>(v)));
    default: return static_cast<float>(v);
  }
}

// A (rows x cols) matrix whose rows are `row_stride` elements apart, on the CPU or the GPU.
class Tensor {
 public:
  Tensor(llmk::DType dtype, std::vector<int64_t> shape, bool on_gpu, int64_t row_stride = -1)
      : dtype_(dtype), shape_(std::move(shape)), on_gpu_(on_gpu) {
    cols_ = shape_.back();
    rows_ = 1;
    for (size_t d = 0; d + 1 < shape_.size(); ++d) rows_ *= shape_[d];
    row_stride_ = row_stride < 0 ? cols_ : row_stride;
    elems_ = rows_ == 0 ? 0 : (rows_ - 1) * row_stride_ + cols_;
    host_.assign(elems_ * llmk::dtype_size(dtype), 0);
    if (on_gpu_) gpu_ = gpu_alloc(host_.size());
  }
  ~Tensor() { if (gpu_) gpu_free(gpu_); }
  Tensor(const Tensor&) = delete;
  Tensor& operator=(const Tensor&) = delete;

  llmk::TensorView view() const {
    llmk::TensorView v;
    v.data = on_gpu_ ? gpu_ : const_cast<char*>(host_.data());
    v.dtype = dtype_;
    v.device = on_gpu_ ? llmk::Device{llmk::DeviceKind::gpu, 0} : llmk::Device{};
    v.ndim = static_cast<int>(shape_.size());
    int64_t stride = 1;
    for (int d = v.ndim - 1; d >= 0; --d) {
      v.shape[d] = shape_[d];
      v.strides[d] = stride;
      stride *= (d == v.ndim - 1) ? row_stride_ : shape_[d];
    }
    return v;
  }

  double get(int64_t r, int64_t c) const { return get_flat(r * row_stride_ + c); }
  void set(int64_t r, int64_t c, double v) { set_flat(r * row_stride_ + c, v); }

  void fill_random(double lo = -2.0, double hi = 2.0) {
    std::uniform_real_distribution<double> dist(lo, hi);
    for (int64_t i = 0; i < elems_; ++i) set_flat(i, dist(rng()));
    upload();
  }
  void fill(double v) {
    for (int64_t i = 0; i < elems_; ++i) set_flat(i, v);
    upload();
  }
  void poison() { fill(std::numeric_limits<double>::quiet_NaN()); }

  void upload() { if (on_gpu_) copy_to_gpu(gpu_, host_.data(), host_.size()); }
  void download() { if (on_gpu_) { gpu_sync(); copy_to_host(host_.data(), gpu_, host_.size()); } }

  int64_t rows() const { return rows_; }
  int64_t cols() const { return cols_; }
  llmk::DType dtype() const { return dtype_; }

 private:
  double get_flat(int64_t i) const {
    using namespace llmk::detail;
    const char* p = host_.data() + i * llmk::dtype_size(dtype_);
    switch (dtype_) {
      case llmk::DType::f32: { float f; std::memcpy(&f, p, 4); return f; }
      case llmk::DType::f16: { Half h; std::memcpy(&h.bits, p, 2); return to_float(h); }
      case llmk::DType::bf16: { BFloat16 b; std::memcpy(&b.bits, p, 2); return to_float(b); }
      default: return std::numeric_limits<double>::quiet_NaN();
    }
  }
  void set_flat(int64_t i, double v) {
    using namespace llmk::detail;
    char* p = host_.data() + i * llmk::dtype_size(dtype_);
    const float f = static_cast<float>(v);
    switch (dtype_) {
      case llmk::DType::f32: std::memcpy(p, &f, 4); break;
      case llmk::DType::f16: { Half h = from_float<Half>(f); std::memcpy(p, &h.bits, 2); break; }
      case llmk::DType::bf16: { BFloat16 b = from_float<BFloat16>(f); std::memcpy(p, &b.bits, 2); break; }
      default: break;
    }
  }

  llmk::DType dtype_;
  std::vector<int64_t> shape_;
  bool on_gpu_;
  int64_t rows_ = 0, cols_ = 0, row_stride_ = 0, elems_ = 0;
  std::vector<char> host_;
  void* gpu_ = nullptr;
};

// int32 (or int64) values on the host and, for GPU cases, a device copy.
class Ints {
 public:
  Ints(std::vector<int64_t> shape, std::vector<int64_t> values, bool on_gpu, bool as_int64 = false)
      : shape_(std::move(shape)), values_(std::move(values)), on_gpu_(on_gpu), int64_(as_int64) {
    bytes_.resize(values_.size() * (int64_ ? 8 : 4));
    for (size_t i = 0; i < values_.size(); ++i) {
      if (int64_) reinterpret_cast<int64_t*>(bytes_.data())[i] = values_[i];
      else reinterpret_cast<int32_t*>(bytes_.data())[i] = static_cast<int32_t>(values_[i]);
    }
    if (on_gpu_ && !bytes_.empty()) {
      gpu_ = gpu_alloc(bytes_.size());
      copy_to_gpu(gpu_, bytes_.data(), bytes_.size());
    }
  }
  ~Ints() { if (gpu_) gpu_free(gpu_); }
  Ints(const Ints&) = delete;
  Ints& operator=(const Ints&) = delete;
  llmk::TensorView view() const {
    llmk::TensorView v;
    v.data = on_gpu_ ? gpu_ : const_cast<char*>(bytes_.data());
    v.dtype = int64_ ? llmk::DType::i64 : llmk::DType::i32;
    v.device = on_gpu_ ? llmk::Device{llmk::DeviceKind::gpu, 0} : llmk::Device{};
    v.ndim = static_cast<int>(shape_.size());
    int64_t s = 1;
    for (int d = v.ndim - 1; d >= 0; --d) {
      v.shape[d] = shape_[d];
      v.strides[d] = s;
      s *= shape_[d];
    }
    return v;
  }
  int64_t operator[](size_t i) const { return values_[i]; }
  // Element i as it is in memory now (read back from the GPU: after a kernel changed it).
  int64_t current(size_t i) {
    if (on_gpu_) {
      gpu_sync();
      copy_to_host(bytes_.data(), gpu_, bytes_.size());
    }
    return int64_ ? reinterpret_cast<const int64_t*>(bytes_.data())[i] : reinterpret_cast<const int32_t*>(bytes_.data())[i];
  }

 private:
  std::vector<int64_t> shape_, values_;
  bool on_gpu_, int64_;
  std::vector<char> bytes_;
  void* gpu_ = nullptr;
};

// ||out - ref|| / ||scale|| over a (rows x cols) region, scale = ref unless given (a gradient
// that cancels to ~0 is measured against the size of its terms); NaN anywhere gives +inf.
inline double relative_error(const Tensor& out, const std::vector<double>& ref,
                             const std::vector<double>* scale = nullptr) {
  double num = 0, den = 0;
  for (int64_t r = 0; r < out.rows(); ++r)
    for (int64_t c = 0; c < out.cols(); ++c) {
      const int64_t i = r * out.cols() + c;
      const double o = out.get(r, c), e = ref[i], s = scale ? (*scale)[i] : e;
      if (!std::isfinite(o)) return std::numeric_limits<double>::infinity();
      num += (o - e) * (o - e);
      den += s * s;
    }
  return den == 0 ? std::sqrt(num) : std::sqrt(num / den);
}

// DESIGN.md tolerances for ||out - ref|| / ||ref||.
inline double tolerance(llmk::DType dt) {
  return dt == llmk::DType::f32 ? 1e-5 : dt == llmk::DType::f16 ? 2e-3 : 1e-2;
}

}  // namespace llmk_test
