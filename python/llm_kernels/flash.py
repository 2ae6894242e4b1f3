"""Attention: our op, and an F.scaled_dot_product_attention drop-in that runs our kernel where it
supports the call and hands every other case to PyTorch, so it never returns wrong numbers.

On the GPU the drop-in runs ours for fp16 and bf16 where our kernel is a tensor-core one (NVIDIA
sm_80+, 16-byte aligned rows). Where it would be the portable FMA kernel (AMD GPUs, NVIDIA before
sm_80, rows not 16-byte aligned, LLMK_ATTENTION_PORTABLE=1) it hands the call to PyTorch, whose SDPA
has matrix-core kernels there, unless `use_portable` is set; on the CPU it runs ours only when
`use_on_cpu` is set (PyTorch's CPU flash attention is faster non-causal: docs/cpu.md).
`attention()` itself always runs ours.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F

from . import _library

_ops = torch.ops.llm_kernels
_torch_sdpa = F.scaled_dot_product_attention

SUPPORTED_HEAD_DIMS = (64, 80, 96, 128, 256)
use_on_cpu = False  # run our CPU kernel in sdpa() for CPU tensors
use_portable = False  # run our portable FMA GPU kernel in sdpa() where it is the one that would run
_GPU_BACKEND = _library.GPU_BACKEND  # 'cuda', 'hip' or 'off' (module attributes: tests replace them)
_device_major = _library.device_major


def attention(q, k, v, causal: bool = False, scale: float | None = None, return_lse: bool = False,
              layout: str = "bhsd", causal_align: str = "top_left"):
    """softmax(q k^T * scale (+ causal mask)) v without the S x S matrix.

    q (B, Hq, Sq, D) and k, v (B, Hkv, Skv, D) with layout='bhsd' (SDPA's), or (B, S, H, D) with
    layout='bshd' (flash_attn's); Hq a multiple of Hkv. causal_align 'top_left' (SDPA) or
    'bottom_right' (flash_attn). Returns out (same layout as q), and lse (B, Hq, Sq) float32 with
    return_lse=True. No autograd yet.
    """
    if layout not in ("bhsd", "bshd"):
        raise ValueError(f"llm_kernels.attention: layout: expected 'bhsd' or 'bshd', got {layout!r}")
    if causal_align not in ("top_left", "bottom_right"):
        raise ValueError(f"llm_kernels.attention: causal_align: expected 'top_left' or 'bottom_right', got {causal_align!r}")
    t = (lambda x: x.transpose(1, 2)) if layout == "bhsd" else (lambda x: x)
    out, lse = _ops.attention(t(q), t(k), t(v), causal, scale, causal_align == "bottom_right")
    out = t(out)
    return (out, lse) if return_lse else out


@torch.library.register_fake("llm_kernels::attention")
def _attention_fake(q, k, v, causal=False, scale=None, bottom_right=False):
    return torch.empty_like(q), q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32)


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, causal: bool = False,
                     scale: float | None = None, causal_align: str = "bottom_right", return_lse: bool = False):
    """Packed variable-length attention in one launch: q (total_q, Hq, D), k and v (total_k, Hkv, D),
    cu_seqlens_* int32 (batch + 1,) on the tensors' device, max_seqlen_q >= every q length.
    Causal masks align per sequence (bottom-right by default, as flash_attn). lse is (Hq, total_q)."""
    if causal_align not in ("top_left", "bottom_right"):
        raise ValueError(f"llm_kernels.attention_varlen: causal_align: expected 'top_left' or 'bottom_right', got {causal_align!r}")
    out, lse = _ops.attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), causal, scale,
                                     causal_align == "bottom_right")
    return (out, lse) if return_lse else out


@torch.library.register_fake("llm_kernels::attention_varlen")
def _attention_varlen_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, causal=False, scale=None, bottom_right=True):
    return torch.empty_like(q), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


def _why_not_ours(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa) -> str | None:
    """None when our kernel runs this call exactly; else the reason it goes to PyTorch."""
    if attn_mask is not None:
        return "explicit attn_mask"
    if dropout_p != 0.0:
        return "dropout"
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        return "not 4-D (B, H, S, D)"
    if query.device.type == "cpu" and not use_on_cpu:
        return "CPU tensors (llm_kernels.flash.use_on_cpu is off)"
    if query.device.type not in ("cpu", "cuda"):
        return f"device {query.device.type}"
    if any(t.device != query.device for t in (key, value)):
        return "tensors on different devices"
    if torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value)):
        return "needs a gradient (no backward yet)"
    if query.dtype not in (torch.float32, torch.float16, torch.bfloat16) or not (query.dtype == key.dtype == value.dtype):
        return "dtype"
    if query.device.type != "cpu" and query.dtype == torch.float32:
        return "fp32 on the GPU"
    if query.shape[-1] not in SUPPORTED_HEAD_DIMS or value.shape[-1] != query.shape[-1]:
        return "head dim"
    hq, hkv = query.shape[1], key.shape[1]
    if hq != hkv and not (enable_gqa and hkv > 0 and hq % hkv == 0):
        return "head counts (GQA needs enable_gqa=True)"
    if key.shape[:3] != value.shape[:3] or query.shape[0] != key.shape[0]:
        return "shapes"
    if query.device.type != "cpu" and (max(query.shape[2], key.shape[2]) >= 2**30 or max(query.shape[:2]) > 65535):
        return "sizes beyond the GPU kernel's limits"
    if query.device.type != "cpu":
        return _gpu_kernel_reason(query, key, value)
    return None


def _runs_portable_kernel(query, key, value) -> bool:
    """Whether our GPU attention for these (B, H, S, D) tensors would run the portable FMA kernel,
    by the rule of launch() in src/attention/attention_gpu.cu: an AMD GPU (a HIP build), an NVIDIA
    GPU before sm_80, rows not 16-byte aligned (a batch, head or row stride not a multiple of 8
    elements, or a data pointer; _library.eight_element_loads_ruled_out), or LLMK_ATTENTION_PORTABLE=1."""
    tensors = (query, key, value)
    if _GPU_BACKEND != "cuda" or _library.env_flag("LLMK_ATTENTION_PORTABLE") or _device_major(query.device) < 8:
        return True
    return _library.eight_element_loads_ruled_out(tensors, [s for t in tensors for s in t.stride()[:3]])


def _gpu_kernel_reason(query, key, value) -> str | None:
    """None when our GPU kernel should take the call; else why PyTorch's SDPA takes it."""
    if _GPU_BACKEND == "off":
        return "a build of llm_kernels without a GPU backend"
    if not use_portable and _runs_portable_kernel(query, key, value):
        # 16 query rows per block on FMA units, against PyTorch's matrix-core kernels: docs/attention.md
        return "the portable FMA kernel (llm_kernels.flash.use_portable is off)"
    return None


def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """torch.nn.functional.scaled_dot_product_attention, same signature and results: our kernel
    where it supports the call, PyTorch's otherwise (see _why_not_ours)."""
    if _why_not_ours(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa) is None:
        return attention(query, key, value, causal=is_causal, scale=scale)
    kwargs = {"enable_gqa": enable_gqa} if enable_gqa else {}
    return _torch_sdpa(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale, **kwargs)


@contextlib.contextmanager
def _restore(original):
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original


def patch_sdpa():
    """Installs sdpa as F.scaled_dot_product_attention. Use as a context manager to restore the
    original on exit (`with llm_kernels.patch_sdpa(): ...`); called plainly, it stays installed."""
    original = F.scaled_dot_product_attention
    F.scaled_dot_product_attention = sdpa
    return _restore(original)


def attention_ref(q, k, v, causal=False, scale=None, causal_align="top_left"):
    """Plain float64 attention in (B, H, S, D): the S x S matrix, masked rows giving zeros."""
    qd, kd, vd = q.double(), k.double(), v.double()
    group = qd.shape[1] // kd.shape[1]
    kd, vd = kd.repeat_interleave(group, 1), vd.repeat_interleave(group, 1)
    s = qd @ kd.transpose(-1, -2) * (scale if scale is not None else 1 / math.sqrt(q.shape[-1]))
    if causal:
        sq, skv = q.shape[2], k.shape[2]
        offset = skv - sq if causal_align == "bottom_right" else 0
        i = torch.arange(sq, device=q.device)[:, None]
        j = torch.arange(skv, device=q.device)[None, :]
        s = s.masked_fill(j > i + offset, float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0)
    return (p @ vd).to(q.dtype), torch.logsumexp(s, -1)
