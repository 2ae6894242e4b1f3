"""flash_attn's functions for the subset of their arguments llm_kernels supports, so code written
for flash_attn runs unchanged; anything else raises NotImplementedError naming the argument.

q, k, v are (batch, seqlen, heads, head_dim) (flash_attn's layout); causal masks align
bottom-right, as flash_attn's do. Runs where llm_kernels.attention runs (GPU fp16 / bf16, CPU),
except that flash_attn_func hands a GPU call to PyTorch's SDPA where our kernel would be the
portable FMA one (AMD GPUs and the other cases of llm_kernels.flash.use_portable), as lk.sdpa does.
The varlen form runs all sequences in one launch (llm_kernels.flash.attention_varlen), always ours.
"""

from __future__ import annotations

import torch

from . import flash
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


def _pytorch_sdpa_bshd(q, k, v, causal: bool, scale):
    """flash_attn_func's result from PyTorch's SDPA: the (B, S, H, D) views transposed, the
    bottom-right causal mask as an explicit one where Sq != Sk, and rows that see no key (Sq > Sk)
    set to zero, flash_attn's convention (SDPA leaves NaN there)."""
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    sq, sk = q.shape[1], k.shape[1]
    mask = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril(sk - sq) if causal and sq != sk else None
    gqa = {"enable_gqa": True} if qt.shape[1] != kt.shape[1] else {}
    out = flash._torch_sdpa(qt, kt, vt, attn_mask=mask, is_causal=causal and mask is None, scale=scale, **gqa)
    if mask is not None and sq > sk:  # PyTorch 2.5+'s math backend gives zeros already; not every backend does
        out[:, :, : sq - sk] = 0
    return out.transpose(1, 2)


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                    softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    _check(dropout_p, window_size, softcap, alibi_slopes, return_attn_probs)
    if q.device.type != "cpu" and flash._gpu_kernel_reason(*(x.transpose(1, 2) for x in (q, k, v))) is not None:
        return _pytorch_sdpa_bshd(q, k, v, causal, softmax_scale)
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
