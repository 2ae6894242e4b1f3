// Rotary position embedding (RoPE) for q and k, in place or out of place.
//
// q is (B, S, Hq, D) and k is (B, S, Hk, D) as views with any strides except a contiguous last
// dim, so both the (B, S, H, D) and the (B, H, S, D) layouts are read without copies (pass the
// latter transposed). Hq and Hk may differ (GQA/MQA). The first rot_dim (even, <= D) elements of
// each head are rotated, the rest are copied (out of place) or left alone (in place).
//
// Styles: neox rotates pairs (i, i + rot_dim/2) (GPT-NeoX, LLaMA: "rotate half");
//         gptj rotates pairs (2i, 2i + 1) (GPT-J: interleaved).
// For pair i at a token with angle theta_i: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin);
// inverse = true rotates by -theta (the backward pass).
//
// The angles come either from a cache, cos_sin_cache (P, rot_dim) = [cos | sin] per position
// (vLLM's layout), indexed by positions (B, S) of int32/int64; or per token from cos and sin
// (B, S, rot_dim/2) views (Hugging Face passes the halves duplicated: hand over the first half).
// cos/sin/cache are float32 or q's dtype. All math in fp32.
#pragma once

#include "llmk/tensor.h"

namespace llmk {

enum class RopeStyle : int { neox, gptj };

const char* rope_style_name(RopeStyle style);

// Positions outside [0, P) throw on the CPU; on the GPU they are not checked on the host (that
// would need a synchronisation): the token's rotated dims are written as NaN instead.
void rope_cached(TensorView q_out, TensorView k_out, TensorView q, TensorView k,
                 TensorView cos_sin_cache, TensorView positions, RopeStyle style, bool inverse,
                 Stream stream = nullptr);

void rope_cos_sin(TensorView q_out, TensorView k_out, TensorView q, TensorView k, TensorView cos,
                  TensorView sin, RopeStyle style, bool inverse, Stream stream = nullptr);

// The angles themselves, as Hugging Face's rotary embedding modules compute them, in one launch:
// for token (b, s) and frequency i, a = float(positions[b, s]) * inv_freq[i] (one fp32 product),
// cos_out[b, s, i] = T(cos(a) * scaling) and sin_out[b, s, i] = T(sin(a) * scaling).
// inv_freq (F,) float32; positions (B, S) int32/int64 (any value: angles need no table);
// cos_out, sin_out (B, S, W) views with a contiguous last dim, float32/float16/bfloat16, one dtype,
// W = F (half width) or 2 F (the halves duplicated: HF's cat((freqs, freqs), -1)).
void rope_angles(TensorView cos_out, TensorView sin_out, TensorView inv_freq, TensorView positions,
                 float scaling, Stream stream = nullptr);

}  // namespace llmk
