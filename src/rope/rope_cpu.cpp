// RoPE on the CPU: tokens split over the installed threads (core/parallel.h), then head by head;
// fp32 math, loops vectorised (rotate_tokens).
#include <cmath>
#include <limits>
#include <vector>

#include "core/check.h"
#include "core/half.h"
#include "core/parallel.h"
#include "rope/rope_internal.h"
#include "rope/rope_math.h"

namespace llmk::detail {

namespace {

// Tokens [begin, end), compiled per SIMD width (LLMK_CPU_CLONES) and per pair layout. Each token's
// angles, then each head's rotated dims, go through fp32 scratch first: the loops then read
// memory that the outputs cannot alias (in place, in == out), so they vectorise.
template <typename T, typename C, RopeStyle STYLE>
LLMK_CPU_CLONES void rotate_tokens(const RopeParams& p, int64_t begin, int64_t end) {
  const int64_t half = p.rot_dim / 2;
  const float sign = p.inverse ? -1.f : 1.f;
  std::vector<float> cos_f(half), sin_f(half), x(p.rot_dim);
  for (int64_t token = begin; token < end; ++token) {
    const int64_t b = token / p.seq, s = token % p.seq;
    const C* cos_row = nullptr;
    const C* sin_row = nullptr;
    angle_rows<C>(p, b, s, cos_row, sin_row);  // checked by run()
    for (int64_t i = 0; i < half; ++i) {
      cos_f[i] = to_float(cos_row[i]);
      sin_f[i] = sign * to_float(sin_row[i]);
    }
    for (const RopeTensor* t : {&p.q, &p.k})
      for (int64_t h = 0; h < t->heads; ++h) {
        const T* in = static_cast<const T*>(t->in) + b * t->in_strides[0] + s * t->in_strides[1] +
                      h * t->in_strides[2];
        T* out = static_cast<T*>(t->out) + b * t->out_strides[0] + s * t->out_strides[1] + h * t->out_strides[2];
        for (int64_t d = 0; d < p.rot_dim; ++d) x[d] = to_float(in[d]);
        for (int64_t i = 0; i < half; ++i) {
          // pair i: (i, i + half) in the neox layout, (2i, 2i + 1) in the gptj one (pair_index)
          const int64_t i1 = STYLE == RopeStyle::neox ? i : 2 * i, i2 = STYLE == RopeStyle::neox ? i + half : 2 * i + 1;
          const float c = cos_f[i], sn = sin_f[i], x1 = x[i1], x2 = x[i2];
          out[i1] = from_float<T>(x1 * c - x2 * sn);
          out[i2] = from_float<T>(x2 * c + x1 * sn);
        }
        if (!p.in_place)
          for (int64_t d = p.rot_dim; d < p.head_dim; ++d) out[d] = in[d];
      }
  }
}

template <typename T, typename C>
void run(const RopeParams& p) {
  // positions checked first, in token order, so that the error names the first bad one
  for (int64_t token = 0; token < p.batch * p.seq; ++token) {
    const int64_t b = token / p.seq, s = token % p.seq;
    const C* cos_row = nullptr;
    const C* sin_row = nullptr;
    if (!angle_rows<C>(p, b, s, cos_row, sin_row)) {
      const int64_t at = b * p.pos_strides[0] + s * p.pos_strides[1];
      const int64_t pos = p.positions_int64 ? static_cast<const int64_t*>(p.positions)[at]
                                            : static_cast<const int32_t*>(p.positions)[at];
      fail(ErrorKind::value, "rope",
           "positions: expected values in [0, " + std::to_string(p.cache_rows) +
               ") (the rows of cos_sin_cache), got " + std::to_string(pos) + " at (" +
               std::to_string(b) + ", " + std::to_string(s) + ")");
    }
  }
  const int64_t per_token = (p.q.heads + p.k.heads) * p.head_dim;
  parallel_rows(p.batch * p.seq, grain_for(per_token), [&](int64_t begin, int64_t end) {
    if (p.style == RopeStyle::neox) rotate_tokens<T, C, RopeStyle::neox>(p, begin, end);
    else rotate_tokens<T, C, RopeStyle::gptj>(p, begin, end);
  });
}

template <typename T>
void with_angles(const RopeParams& p) {
  if (p.angle_dtype == DType::f32) run<T, float>(p);
  else run<T, T>(p);
}

// rope_angles: tokens over the threads; per token the F angles' cos and sin (fp32, std::cos / std::sin),
// scaled, rounded to T, written once or (width 2 F) twice.
template <typename T>
void angles(const RopeAnglesParams& p) {
  parallel_rows(p.batch * p.seq, grain_for(p.freqs * 8), [&](int64_t begin, int64_t end) {
    for (int64_t token = begin; token < end; ++token) {
      const int64_t b = token / p.seq, s = token % p.seq;
      const float pos = angle_position(p, b, s);
      T* cos_row = static_cast<T*>(p.cos) + b * p.cos_strides[0] + s * p.cos_strides[1];
      T* sin_row = static_cast<T*>(p.sin) + b * p.sin_strides[0] + s * p.sin_strides[1];
      for (int64_t i = 0; i < p.freqs; ++i) {
        const float a = pos * p.inv_freq[i];
        const T c = from_float<T>(std::cos(a) * p.scaling), sn = from_float<T>(std::sin(a) * p.scaling);
        cos_row[i] = c;
        sin_row[i] = sn;
        if (p.width > p.freqs) {
          cos_row[p.freqs + i] = c;
          sin_row[p.freqs + i] = sn;
        }
      }
    }
  });
}

}  // namespace

void rope_angles_cpu(const RopeAnglesParams& p) {
  switch (p.dtype) {
    case DType::f32: angles<float>(p); break;
    case DType::f16: angles<Half>(p); break;
    case DType::bf16: angles<BFloat16>(p); break;
    default: fail(ErrorKind::type, "rope_angles", "unsupported dtype");
  }
}

void rope_cpu(const RopeParams& p) {
  switch (p.dtype) {
    case DType::f32: run<float, float>(p); break;
    case DType::f16: with_angles<Half>(p); break;
    case DType::bf16: with_angles<BFloat16>(p); break;
    default: fail(ErrorKind::type, "rope", "unsupported dtype");
  }
}

}  // namespace llmk::detail
