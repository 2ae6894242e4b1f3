"""flash_attn's functions for the subset of their arguments llm_kernels supports, so code written
for flash_attn runs unchanged; anything else raises NotImplementedError naming the argument.

q, k, v are (batch, seqlen, heads, head_dim) (flash_attn's layout); causal masks align
bottom-right, as flash_attn's do. Runs where llm_kernels.attention runs (the CPU so far).
The varlen form runs all sequences in one launch (llm_kernels.flash.attention_varlen).
"""

from __future__ import annotations

import torch

from .flash import attention, attention_varlen


def _unsupported(condition: bool, what: str) -> None:
    if condition:
        raise NotImplementedError(f"llm_kernels.flash_attn_interface: {what} is not supported")


def _check(dropout_p, window_size, softcap, alibi_slopes, return_attn_probs):
    _unsupported(dropout_p != 0.0, f"dropout_p={dropout_p}")
    _unsupported(tuple(window_size) != (-1, -1), f"window_size={tuple(window_size)} (sliding windows)")
    _unsupported(softcap != 0.0, f"softcap={softcap}")
    _unsupported(alibi_slopes is not None, "alibi_slopes")
    _unsupported(return_attn_probs, "return_attn_probs=True")


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                    softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    _check(dropout_p, window_size, softcap, alibi_slopes, return_attn_probs)
    return attention(q, k, v, causal=causal, scale=softmax_scale, layout="bshd", causal_align="bottom_right")


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                           alibi_slopes=None, deterministic=False, return_attn_probs=False, block_table=None):
    """q (total_q, Hq, D), k and v (total_k, Hkv, D) packed; cu_seqlens_* (batch + 1,) int32."""
    _check(dropout_p, window_size, softcap, alibi_slopes, return_attn_probs)
    _unsupported(block_table is not None, "block_table (paged KV)")
    if cu_seqlens_q.shape != cu_seqlens_k.shape or cu_seqlens_q.dim() != 1:
        raise ValueError(
            "llm_kernels.flash_attn_varlen_func: cu_seqlens_q and cu_seqlens_k: expected two (batch + 1,) "
            f"tensors, got {tuple(cu_seqlens_q.shape)} and {tuple(cu_seqlens_k.shape)}"
        )
    return attention_varlen(q, k, v, cu_seqlens_q.to(torch.int32), cu_seqlens_k.to(torch.int32), int(max_seqlen_q),
                            causal=causal, scale=softmax_scale, causal_align="bottom_right")
