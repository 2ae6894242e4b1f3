// Monarch structured matrices (Dao et al., ICML 2022) in the authors' factor layout.
//
// x (..., n) with n = k*p; w1 (k, q, p); w2 (l, s, r) with k*q = l*r; out (..., m), m = l*s:
//   X[b,i,a] = x[b, i*p+a];  Y[b,i,c] = sum_a w1[i,c,a] X[b,i,a];  y[b, i*q+c] = Y[b,i,c]
//   Z[b,u,t] = y[b, t*l+u];  O[b,u,v] = sum_t w2[u,v,t] Z[b,u,t];   out[b, v*l+u] = O[b,u,v]
// Leading dims of x are flattened (x must be readable as rows: contiguous last dim, one row
// stride). x, w1, w2 and out share one dtype (f32, f16 or bf16) and device; w1, w2 contiguous.
// All products accumulate in fp32; the intermediate y is rounded to the dtype (as the two-bmm
// formulation does).
//
// GPU, chosen by shape (docs/monarch.md): on Hopper, square blocks whose factors fit in a thread
// block cluster run as one kernel (y exchanged through distributed shared memory); up to 16 tokens,
// one-launch few-token kernels (portable for blocks at most 64 wide, AMD included) or two
// block-diagonal skinny GEMMs; otherwise two batched-GEMM stages on tensor cores (mma.sync on
// NVIDIA sm_80+, wgmma on Hopper) with y in global memory, which needs a workspace (see
// monarch_matmul_workspace_bytes); fp32, odd block sizes and AMD beyond that take the portable FMA
// path (forced with LLMK_MONARCH_PORTABLE=1).
#pragma once

#include <cstddef>

#include "llmk/tensor.h"

namespace llmk {

// Bytes of device workspace monarch_matmul needs on the GPU for these shapes (0 when the fused
// kernel applies, or on the CPU). tokens = rows of x.
std::size_t monarch_matmul_workspace_bytes(TensorView x, TensorView w1, TensorView w2);

// out = monarch(x; w1, w2). out: x's leading dims and m = l*s. workspace: a u8 device buffer of
// at least monarch_matmul_workspace_bytes(...) bytes (an empty view when that is 0).
void monarch_matmul(TensorView out, TensorView x, TensorView w1, TensorView w2,
                    TensorView workspace = {}, Stream stream = nullptr);

// Gradients of out = monarch(x; w1, w2) for the upstream gradient dout (x's leading dims, m):
// dx (x's shape), dw1 (w1's shape), dw2 (w2's shape), in the dtype of x; weight gradients are
// accumulated in fp32 over all tokens. workspace: a u8 buffer of at least
// monarch_backward_workspace_bytes(...) bytes on the GPU (ignored on the CPU).
std::size_t monarch_backward_workspace_bytes(TensorView x, TensorView w1, TensorView w2);
void monarch_matmul_backward(TensorView dx, TensorView dw1, TensorView dw2, TensorView dout,
                             TensorView x, TensorView w1, TensorView w2, TensorView workspace = {},
                             Stream stream = nullptr);

}  // namespace llmk
