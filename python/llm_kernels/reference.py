"""Plain PyTorch reference implementations of every op, for users' own checks.

Each computes in float32 (float64 when given float64 inputs) and returns the input's dtype.
"""

from __future__ import annotations

import torch


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, offset: float = 0.0) -> torch.Tensor:
    """y = x / sqrt(mean(x^2) + eps) * (offset + weight)."""
    ct = _compute_dtype(x)
    xf = x.to(ct)
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * (offset + weight.to(ct))
    return y.to(x.dtype)


def fused_add_rms_norm_ref(x, residual, weight, eps: float = 1e-6, offset: float = 0.0):
    """(rms_norm(x + residual), x + residual), the sum rounded to x's dtype first."""
    ct = _compute_dtype(x)
    summed = (x.to(ct) + residual.to(ct)).to(x.dtype)
    return rms_norm_ref(summed, weight, eps, offset), summed


def llama_rms_norm_ref(hidden_states: torch.Tensor, weight: torch.Tensor, variance_epsilon: float = 1e-6):
    """The Hugging Face LlamaRMSNorm forward, verbatim in formula (the eager peer in benchmarks)."""
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + variance_epsilon)
    return weight * hidden_states.to(input_dtype)


def _gelu(x: torch.Tensor, approximate: str) -> torch.Tensor:
    return torch.nn.functional.gelu(x, approximate=approximate)


def swiglu_ref(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    ct = _compute_dtype(gate)
    return (torch.nn.functional.silu(gate.to(ct)) * up.to(ct)).to(gate.dtype)


def geglu_ref(gate: torch.Tensor, up: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    ct = _compute_dtype(gate)
    return (_gelu(gate.to(ct), approximate) * up.to(ct)).to(gate.dtype)


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return swiglu_ref(gate, up)


def gelu_and_mul_ref(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return geglu_ref(gate, up, approximate)


def rope_ref(q, k, cos, sin, style: str = "neox"):
    """q (B, S, Hq, D), k (B, S, Hk, D); cos, sin (B, S, rot_dim/2). Returns (q_rot, k_rot)."""

    def rotate(x):
        ct = _compute_dtype(x)
        r = 2 * cos.shape[-1]
        c, s = cos.to(ct)[:, :, None, :], sin.to(ct)[:, :, None, :]
        xr, xp = x.to(ct)[..., :r], x.to(ct)[..., r:]
        if style == "neox":
            x1, x2 = xr[..., : r // 2], xr[..., r // 2 :]
            out = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)
        else:
            x1, x2 = xr[..., 0::2], xr[..., 1::2]
            out = torch.stack([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).flatten(-2)
        return torch.cat([out, xp], dim=-1).to(x.dtype)

    return rotate(q), rotate(k)


def rope_cache_ref(q, k, cos_sin_cache, positions, style: str = "neox"):
    """The cache form: cos_sin_cache (P, rot_dim) = [cos | sin], positions (B, S)."""
    half = cos_sin_cache.shape[-1] // 2
    rows = cos_sin_cache[positions]
    return rope_ref(q, k, rows[..., :half], rows[..., half:], style)


def hf_rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def hf_apply_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim: int = 1):
    """Hugging Face's apply_rotary_pos_emb, verbatim in formula (the eager peer in benchmarks)."""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return (q * cos) + (hf_rotate_half(q) * sin), (k * cos) + (hf_rotate_half(k) * sin)


def write_kv_cache_ref(k_cache, v_cache, k, v, positions, block_table=None):
    """What write_kv_cache writes, out of place: copies of the caches holding k, v (B, T, Hkv, D) at
    positions (B, T): contiguous caches (B, Hkv, S, D) at [b, :, p], paged caches (num_blocks,
    block_size, Hkv, D) at [block_table[b, p // block_size], p % block_size]. Negative positions
    are padding and are skipped."""
    k_out, v_out = k_cache.clone(), v_cache.clone()
    b, t = torch.nonzero(positions >= 0, as_tuple=True)
    p = positions[b, t].long()
    if block_table is None:
        k_out[b, :, p], v_out[b, :, p] = k[b, t], v[b, t]
    else:
        size = k_cache.shape[1]
        blk = block_table[b, p // size].long()
        k_out[blk, p % size], v_out[blk, p % size] = k[b, t], v[b, t]
    return k_out, v_out


# The other op families keep their references beside their ops; all of them are importable from here.
from .decode import decode_attention_ref, skinny_gemm_ref  # noqa: E402,F401
from .flash import attention_ref  # noqa: E402,F401
from .monarch import monarch_matmul_ref  # noqa: E402,F401

__all__ = [name for name in dir() if name.endswith("_ref") or name in ("hf_rotate_half", "hf_apply_rotary_pos_emb")]
