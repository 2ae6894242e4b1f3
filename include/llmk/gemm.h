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
};

const char* gemm_activation_name(GemmActivation activation);

// out (..., N) or (..., N / 2) for the gated activations, with x's leading dims; any row strides (last dim
// contiguous). bias: undefined view for none.
void skinny_gemm(TensorView out, TensorView x, TensorView weight, TensorView bias,
                 const GemmOptions& options = {}, Stream stream = nullptr);

}  // namespace llmk
