// Decode attention over a KV cache, and the helper that writes new K/V into the cache.
//
// Queries: q (B, T, Hq, D), T = 1..8 new tokens per sequence (one for plain decoding, up to 8 for
// speculative decoding), any strides except a contiguous last dim; out has q's shape.
// Caches, two layouts:
//   contiguous: k_cache, v_cache (B, Hkv, Smax, D); sequence b owns rows 0..seq_lens[b]-1.
//   paged (vLLM): k_cache, v_cache (num_blocks, block_size, Hkv, D) and block_table
//     (B, max_blocks) int32: position p of sequence b lives in block block_table[b][p / block_size]
//     at slot p % block_size. Block sizes 1..256 (16..256 in practice).
// seq_lens (B) int32 or int64: the number of cached positions of each sequence, INCLUDING its T new tokens
// (write them with write_kv_cache first).
//
// Causality convention: new token t (0-based) of sequence b sits at position
//   pos(b, t) = seq_lens[b] - T + t
// and attends to keys 0..pos(b, t) (so the last token sees the whole sequence, as in vLLM and
// flash_attn's bottom-right causal alignment). A token whose position is negative (seq_len < T),
// and every token of a sequence with seq_len 0, sees no key: its output is zeros, and the cache
// of that sequence is not read.
//
// GQA: Hq must be a multiple of Hkv; query head h reads KV head h / (Hq / Hkv).
// Softmax of q.k * scale (scale 0 means 1/sqrt(D)) in fp32.
//
// Backends: CPU (f32, f16, bf16, any D) and GPU (f16, bf16; D = 64, 128 or 256).
// Bad input on the CPU path (seq_lens beyond the cache, block_table entries outside
// [0, num_blocks)) throws llmk::Error. The GPU path cannot read device memory on the host without a
// synchronisation, so there these are checked in the kernel: an affected sequence gets NaN outputs
// (never an out-of-bounds read).
//
// GPU parallelisation: split-KV (flash-decoding). The KV length is cut into num_splits chunks so
// that batch 1 fills the GPU; each block reads one chunk of K/V once for all query heads of its
// GQA group and all T tokens, and writes a partial (o, lse) to a workspace; the last block of each
// (sequence, KV head) merges them in the same launch. Kernels: on NVIDIA sm_80+ a tensor-core
// kernel (up to 16 query rows per KV head, D 64 or 128; K/V by TMA on Hopper), else a warp kernel
// (up to 8 rows; what AMD runs), else the previous kernel, merged by a second kernel
// (LLMK_DECODE_KERNEL=mma|warp|split forces one; docs/decode.md). The call allocates nothing and
// never synchronises (capturable in a CUDA graph) when a workspace of
// decode_attention_workspace_size() bytes is passed; the number of splits depends only on shapes
// and options, never on the contents of seq_lens.
#pragma once

#include <cstddef>
#include <cstdint>

#include "llmk/tensor.h"

namespace llmk {

struct DecodeOptions {
  float scale = 0.f;        // 0: 1 / sqrt(D)
  int num_splits = 0;       // GPU: 0 picks by the heuristic; n > 0 forces (at most) n splits
  int64_t max_seq_len = 0;  // GPU: an upper bound of seq_lens (0: the cache capacity); only
                            // steers the heuristic, results stay exact if it is too small
  // Optional mask over cache positions, shape (B, Tm, S) with Tm = 1 (the same for every new token)
  // or T, any strides, on q's device: boolean (true = attend, as torch SDPA's boolean masks) or an
  // additive float mask (float32 or q's dtype) added to q.k * scale; -inf, and values that
  // overflow to it in fp32 (torch.finfo(bfloat16).min), hide a key. Positions >= S are hidden. The
  // causal convention and seq_lens apply as without a mask. A token that sees no key outputs zeros.
  // This is what a Hugging Face static cache hands to attention (its 4-D mask, head dim squeezed).
  // GPU (tensor-core kernel, a mask whose last dim is contiguous; LLMK_DECODE_MASK_PREFETCH=0
  // turns it off): the mask is staged with K/V and each split stops at its last visible key.
  TensorView attn_mask{};
  // GPU: the workspace's split counters are zero on entry, so the call skips their memset (one
  // node less in a CUDA graph, between the previous kernel and this one). Every call leaves its
  // counters at zero, so this holds for a workspace zeroed once (cudaMemset, torch.zeros) and
  // since used only by calls with the same shapes and options on one stream (the counters sit
  // behind the partial results, at an offset that depends on both). Breaking that contract gives
  // wrong results, not an error.
  bool workspace_zeroed = false;
};

// Bytes of GPU workspace decode_attention needs for these arguments (0 on the CPU, or when the
// heuristic picks a single split). Same argument checks as decode_attention; block_table may be an
// undefined view (contiguous cache).
std::size_t decode_attention_workspace_size(TensorView q, TensorView k_cache, TensorView block_table,
                                            const DecodeOptions& options = {});

// The number of KV splits the GPU path uses for these arguments (1 on the CPU).
int decode_attention_num_splits(TensorView q, TensorView k_cache, TensorView block_table,
                                const DecodeOptions& options = {});

// out = attention of q over the cache. block_table undefined (TensorView{}) selects the contiguous
// layout. workspace: workspace_bytes >= decode_attention_workspace_size(...) bytes of GPU memory,
// 16-byte aligned (ignored on the CPU).
void decode_attention(TensorView out, TensorView q, TensorView k_cache, TensorView v_cache,
                      TensorView seq_lens, TensorView block_table, const DecodeOptions& options,
                      void* workspace, std::size_t workspace_bytes, Stream stream = nullptr);

// Writes k, v (B, T, Hkv, D) into the caches at positions (B, T) int32 or int64:
//   contiguous (block_table undefined): cache[b, h, positions[b, t], :] = k[b, t, h, :]
//   paged: p = positions[b, t]; cache[block_table[b][p / bs], p % bs, h, :] = k[b, t, h, :]
// A negative position is padding and is skipped. A position beyond the cache (or a block table
// entry outside [0, num_blocks)) throws on the CPU and is skipped on the GPU.
// advance (optional): a cache's length counter, one int32 or int64 element on k's device, that is
// increased by T once the positions are read (positions may be views of it, as a Hugging Face
// static cache writes at its length). On the GPU this happens in the write's own launch when
// there is one sequence and one token (a batch-1 decode step), else in a second, one-thread one.
void write_kv_cache(TensorView k_cache, TensorView v_cache, TensorView k, TensorView v,
                    TensorView positions, TensorView block_table, Stream stream = nullptr,
                    TensorView advance = {});

// write_kv_cache with rotate-half ("neox") RoPE first, in one launch on the GPU: q_out = rope(q),
// k_out = rope(k), and the caches get k_out and v as write_kv_cache writes k and v (contiguous
// layout only). q (B, T, Hq, D), k and v (B, T, Hkv, D), q_out and k_out shaped as q and k (any
// strides with a contiguous last dim); cos, sin (B, T, D / 2) in the dtype of k: the first half of
// Hugging Face's duplicated tables. Each output element is x1 * cos - x2 * sin or x2 * cos + x1 *
// sin in fp32, rounded once, as rope computes it. A decode step's q/k/v hand-off, the rotation and
// the cache update in one kernel instead of two.
void rope_write_kv_cache(TensorView q_out, TensorView k_out, TensorView k_cache, TensorView v_cache,
                         TensorView q, TensorView k, TensorView v, TensorView cos, TensorView sin,
                         TensorView positions, Stream stream = nullptr, TensorView advance = {});

}  // namespace llmk
