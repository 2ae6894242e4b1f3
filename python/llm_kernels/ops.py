"""The op API: thin wrappers over torch.ops.llm_kernels.*, plus their fake (meta) implementations
and autograd formulas, so every op works with torch.compile(fullgraph=True) and in training."""

from __future__ import annotations

import torch

from . import _library  # noqa: F401  (registers torch.ops.llm_kernels)

_ops = torch.ops.llm_kernels


# ---------------------------------------------------------------------------------- RMSNorm
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, offset: float = 0.0) -> torch.Tensor:
    """y = x / sqrt(mean(x^2, -1) + eps) * (offset + weight), statistics in fp32.

    x: (..., N) float32/float16/bfloat16; weight: (N,) in x's dtype or float32.
    offset=1.0 gives Gemma's (1 + weight) form. Returns a tensor of x's shape and dtype.
    """
    return _ops.rms_norm(x, weight, float(eps), float(offset))


def fused_add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    offset: float = 0.0,
    *,
    in_place: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """residual = x + residual; y = rms_norm(residual), in one pass. Returns (y, residual).

    With in_place=True the sum is written into `residual` itself (as inference engines do) and
    that same tensor is returned; the in-place form has no autograd.
    """
    if in_place:
        y = _ops.fused_add_rms_norm_(x, residual, weight, float(eps), float(offset))
        return y, residual
    return _ops.fused_add_rms_norm(x, residual, weight, float(eps), float(offset))


@torch.library.register_fake("llm_kernels::rms_norm")
def _rms_norm_fake(x, weight, eps, offset=0.0):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.register_fake("llm_kernels::fused_add_rms_norm")
def _fused_add_rms_norm_fake(x, residual, weight, eps, offset=0.0):
    return (
        torch.empty_like(x, memory_format=torch.contiguous_format),
        torch.empty_like(x, memory_format=torch.contiguous_format),
    )


@torch.library.register_fake("llm_kernels::fused_add_rms_norm_")
def _fused_add_rms_norm_inplace_fake(x, residual, weight, eps, offset=0.0):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.register_fake("llm_kernels::rms_norm_backward")
def _rms_norm_backward_fake(grad_y, x, weight, eps, offset, grad_extra):
    return torch.empty_like(x, memory_format=torch.contiguous_format), torch.empty_like(weight)


def _rms_norm_setup(ctx, inputs, output):
    x, weight, eps, offset = inputs
    ctx.save_for_backward(x, weight)
    ctx.eps, ctx.offset = eps, offset


def _rms_norm_backward(ctx, grad_y):
    x, weight = ctx.saved_tensors
    grad_x, grad_w = _ops.rms_norm_backward(grad_y, x, weight, ctx.eps, ctx.offset, None)
    return grad_x, grad_w, None, None


torch.library.register_autograd("llm_kernels::rms_norm", _rms_norm_backward, setup_context=_rms_norm_setup)


def _fused_add_setup(ctx, inputs, output):
    _, _, weight, eps, offset = inputs
    ctx.save_for_backward(output[1], weight)  # the normalised input is residual_out
    ctx.eps, ctx.offset = eps, offset


def _fused_add_backward(ctx, grad_y, grad_residual_out):
    residual_out, weight = ctx.saved_tensors
    if grad_y is None:
        grad_y = torch.zeros_like(residual_out)
    grad_sum, grad_w = _ops.rms_norm_backward(
        grad_y, residual_out, weight, ctx.eps, ctx.offset, grad_residual_out
    )
    # x and residual both feed the sum, so both get its gradient.
    return grad_sum, grad_sum, grad_w, None, None


torch.library.register_autograd(
    "llm_kernels::fused_add_rms_norm", _fused_add_backward, setup_context=_fused_add_setup
)
