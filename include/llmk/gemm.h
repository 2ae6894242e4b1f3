// Skinny GEMM for decoding: y = x W^T (+ bias), optionally with a fused SwiGLU or GEGLU epilogue.
//
// x (..., K): leading dims flattened to M rows (any M; the GPU kernel is built for M <= 16 and
// runs larger M in groups of 16 rows, where a vendor BLAS is the better choice). W (N, K) in
// nn.Linear's layout (rows contiguous, any row stride). bias (N) or undefined. Same dtype for all:
// f16 or bf16 (f32 too on the CPU); fp32 accumulation; any K (a K that is not a multiple of 8
// takes a scalar-load path).
//
// activation none:   y (..., N)         = x W^T + bias
// activation swiglu: W holds [gate; up] (N = 2 * inter, gate rows first);
//                    y (..., inter) = silu(g) * u with g, u = the two halves of x W^T + bias.
// activation geglu_tanh: the same with gelu_tanh(g) * u (Gemma's MLP: gelu_pytorch_tanh).
//
// GPU parallelisation: memory-bound weight streaming, W rows read once with 16-byte streaming
// loads, x through L1, fp32 accumulation. On NVIDIA sm_80+ the products run on tensor cores
// (mma.sync m16n8k16, any M <= 16 for the price of one); the portable kernel (fp32 FMA, warp
// reductions, rows in groups of 4) runs everywhere else (AMD), and on NVIDIA when
// GemmOptions::portable is set. LLMK_GEMM_KERNEL (read at every call) picks the NVIDIA kernel:
//   deep (the default): W as the tensor-core A operand, 16 columns per warp, 8 independent 16-byte
//     W loads per lane in flight, the warps of a column group splitting K so that all blocks run
//     in one wave;
//   mma (the default for the SwiGLU epilogue): a block owns 8 output columns (8 gate and 8 up
//     rows) and its 8 warps split K, their partial sums meeting in shared memory, where the bias
//     and the activation are applied;
//   tma (Hopper, opt-in): W by the bulk tensor copy engine into a 5-stage shared-memory ring, the
//     blocks of a thread block cluster splitting K and adding through distributed shared memory;
//   stream (an earlier streaming kernel) or portable; LLMK_GEMM_PORTABLE=1 and LLMK_GEMM_STREAM=1
//     are older spellings of the last two.
// Nothing goes through a workspace. How each measured: docs/decode.md.
// GemmOptions::norm_weight and ::residual fuse the RMSNorm before the product and the residual add
// after it (each block computes the few rows' statistics itself: one extra L2 round trip, no
// extra launch).
// No allocation and no synchronisation inside the call (capturable in a CUDA graph).
#pragma once

#include "llmk/tensor.h"

namespace llmk {

enum class GemmActivation : int { none, swiglu, geglu_tanh };

// Whether the activation is a gated one (W holds [gate; up], out has N / 2 columns).
inline bool gemm_gated(GemmActivation activation) { return activation != GemmActivation::none; }

struct GemmOptions {
  GemmActivation activation = GemmActivation::none;
  bool portable = false;  // GPU: force the portable (non tensor-core) kernel
  // Decode-step fusions (each optional), so that a decoder layer needs no separate RMSNorm or
  // residual-add launches:
  // RMSNorm prologue: with norm_weight (K) defined, every row of x is first replaced by
  // rms_norm(x, norm_weight, norm_eps, norm_offset) rounded to x's dtype, exactly as rms_norm
  // computes and rounds it (fp32 statistics); norm_weight in x's dtype, contiguous.
  TensorView norm_weight;
  float norm_eps = 1e-6f;
  float norm_offset = 0.f;
  // Residual epilogue: with residual defined (out's shape and dtype), out = residual + y, where y
  // (the product, bias and activation) is rounded to out's dtype before the add, as a separate
  // add of the rounded product would. residual may be the very memory of out (in place), but
  // must not partly overlap it.
  TensorView residual;
  // The weight is fixed: no kernel enqueued before this call on the stream may still be writing it
  // (a model's parameters at inference). On Hopper, with programmatic dependent launch, the GPU
  // kernel then loads its first weight bytes before it waits for the kernel before it, so that they
  // stream during that kernel's end (the 1B decode: 1051 against 933 tok/s, H100, 2026-12-06).
  // Leave it false for a weight computed just before (by rms_norm, another GEMM, ...): the kernel
  // then reads it only after that wait, as every other input.
  bool fixed_weight = false;
};

// A decode step's q/k/v projection with rotate-half RoPE and the K/V cache write as its epilogue
// (skinny_gemm_rope_kv). x row m is sequence m's one new token.
struct GemmRopeKv {
  int64_t q_heads = 0;  // Hq; the KV heads Hkv and the head dim D come from k_cache
  // (M, D / 2) in x's dtype: the first half of Hugging Face's duplicated cos / sin tables, row m
  // for x row m (any row stride, 0 included: one row for every sequence).
  TensorView cos, sin;
  // (M) int32 or int64 (any stride): the cache slot of x row m. Negative: padding, not written;
  // past the cache: an error on the CPU, skipped on the GPU (as write_kv_cache).
  TensorView positions;
  // (M, Hkv, S, D), last dim contiguous (write_kv_cache's contiguous layout), x's dtype.
  TensorView k_cache, v_cache;
  // Optional: a length counter (one int32 or int64) increased by 1 once every position is read,
  // so positions may be a view of it (a Hugging Face static cache writes at its length).
  TensorView advance;
  // GPU with advance: one int32 of GPU memory, zero before the first call (torch.zeros); every call
  // leaves it zero again (the blocks draw tickets there, the last ticket's block moves the length). Calls
  // sharing it must not run at the same time (one stream).
  TensorView counter;
};

const char* gemm_activation_name(GemmActivation activation);

// out (..., N) or (..., N / 2) for the gated activations, with x's leading dims; any row strides (last dim
// contiguous). bias: undefined view for none.
void skinny_gemm(TensorView out, TensorView x, TensorView weight, TensorView bias,
                 const GemmOptions& options = {}, Stream stream = nullptr);

// out (..., N) = [rope(q) | rope(k) | v] for y = [q | k | v] = x W^T (+ bias), x (..., K) of M rows
// (leading dims flattened: M sequences of one token), W holding [q; k; v] rows (N = (Hq + 2 Hkv) D), and k_cache[m, h, positions[m], :] = rope(k)
// and v_cache[...] = v of row m, as skinny_gemm followed by rope_write_kv_cache (llmk/decode.h)
// computes them: y rounded to x's dtype, then each rotated pair x1 * cos - x2 * sin, x2 * cos +
// x1 * sin in fp32, rounded once. options: the RMSNorm prologue (norm_weight) is allowed; the
// activation must be none and residual undefined.
// One launch on the GPU where the kernel that runs the product has the epilogue: the deep kernel
// (NVIDIA's default; D a multiple of 16: each warp's 16 W rows are 8 rotation pairs (j, j + D / 2)
// of a head, so a lane holds both halves of its pairs) or the portable one (AMD, and NVIDIA where it
// runs; D a multiple of 8: a block's 8 W rows are 4 pairs). Elsewhere (the CPU, the mma / stream /
// tma kernels asked for by LLMK_GEMM_KERNEL, other D) it runs as those two calls.
void skinny_gemm_rope_kv(TensorView out, TensorView x, TensorView weight, TensorView bias, const GemmRopeKv& rope,
                         const GemmOptions& options = {}, Stream stream = nullptr);

}  // namespace llmk
