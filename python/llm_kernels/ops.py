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


# ---------------------------------------------------------------------------- gated activations
_APPROXIMATE = {"none": "gelu", "tanh": "gelu_tanh"}


def _gelu_name(approximate: str) -> str:
    if approximate not in _APPROXIMATE:
        raise ValueError(f"llm_kernels: approximate: expected 'none' or 'tanh', got {approximate!r}")
    return _APPROXIMATE[approximate]


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up (LLaMA's MLP), fp32 math. gate and up: same shape and dtype."""
    return _ops.gated_activation(gate, up, "silu")


def geglu(gate: torch.Tensor, up: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """gelu(gate) * up with the exact erf form (approximate='none') or the tanh form."""
    return _ops.gated_activation(gate, up, _gelu_name(approximate))


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: (..., 2d). silu(x[..., :d]) * x[..., d:] (vLLM's and FlashInfer's convention)."""
    return _ops.gated_activation_packed(x, "silu")


def gelu_and_mul(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """x: (..., 2d). gelu(x[..., :d]) * x[..., d:]."""
    return _ops.gated_activation_packed(x, _gelu_name(approximate))


geglu_chunked = gelu_and_mul


@torch.library.register_fake("llm_kernels::gated_activation")
def _gated_fake(gate, up, activation):
    return torch.empty_like(gate, memory_format=torch.contiguous_format)


@torch.library.register_fake("llm_kernels::gated_activation_packed")
def _gated_packed_fake(x, activation):
    torch._check(x.shape[-1] % 2 == 0, lambda: "llmk::gated_activation_packed: x: expected an even last dim")
    return x.new_empty((*x.shape[:-1], x.shape[-1] // 2))


@torch.library.register_fake("llm_kernels::gated_activation_backward")
def _gated_backward_fake(grad_out, gate, up, activation):
    return (
        torch.empty_like(gate, memory_format=torch.contiguous_format),
        torch.empty_like(gate, memory_format=torch.contiguous_format),
    )


@torch.library.register_fake("llm_kernels::gated_activation_packed_backward")
def _gated_packed_backward_fake(grad_out, x, activation):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _gated_setup(ctx, inputs, output):
    gate, up, activation = inputs
    ctx.save_for_backward(gate, up)
    ctx.activation = activation


def _gated_backward(ctx, grad_out):
    gate, up = ctx.saved_tensors
    grad_gate, grad_up = _ops.gated_activation_backward(grad_out, gate, up, ctx.activation)
    return grad_gate, grad_up, None


torch.library.register_autograd("llm_kernels::gated_activation", _gated_backward, setup_context=_gated_setup)


def _gated_packed_setup(ctx, inputs, output):
    x, activation = inputs
    ctx.save_for_backward(x)
    ctx.activation = activation


def _gated_packed_backward(ctx, grad_out):
    (x,) = ctx.saved_tensors
    return _ops.gated_activation_packed_backward(grad_out, x, ctx.activation), None


torch.library.register_autograd(
    "llm_kernels::gated_activation_packed", _gated_packed_backward, setup_context=_gated_packed_setup
)
