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
