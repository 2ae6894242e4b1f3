"""The op API: thin wrappers over torch.ops.llm_kernels.*, plus their fake (meta) implementations,
so every op works with torch.compile(fullgraph=True); their autograd formulas are registered in C++
(src/*/*_torch.cpp, see src/torch/bridge.h), where they cost no Python time per call."""

from __future__ import annotations

import torch

from . import _library  # noqa: F401  (registers torch.ops.llm_kernels)
from . import rope_kv

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


# ------------------------------------------------------------------------------------ RoPE
def _bshd(t: torch.Tensor, layout: str) -> torch.Tensor:
    if layout == "bshd":
        return t
    if layout == "bhsd":
        return t.transpose(1, 2)
    raise ValueError(f"llm_kernels.rope: layout: expected 'bshd' or 'bhsd', got {layout!r}")


def _expand_or_fail(t: torch.Tensor, shape: tuple, name: str, expected: str) -> torch.Tensor:
    """t broadcast to shape, or a ValueError naming the argument (torch's own expand error names none)."""
    try:
        return t.expand(*shape)
    except RuntimeError:
        raise ValueError(f"llm_kernels.rope: {name}: expected shape {expected}, got {tuple(t.shape)}") from None


def rope(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    cos_sin_cache: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
    cos: torch.Tensor | None = None,
    sin: torch.Tensor | None = None,
    style: str = "neox",
    layout: str = "bshd",
    in_place: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary position embedding of q (B, S, Hq, D) and k (B, S, Hk, D) (layout='bhsd' for
    (B, H, S, D)), read in place whatever the layout.

    Angles from `cos_sin_cache` (P, rot_dim) = [cos | sin] per position plus `positions` (B, S)
    or (S,) of int32/int64, or from per-token `cos` and `sin` (B, S, rot_dim/2), (S, rot_dim/2).
    style 'neox' rotates (i, i + rot_dim/2), 'gptj' rotates (2i, 2i+1); dims past rot_dim pass
    through. Returns (q_rot, k_rot); with in_place=True they are q and k themselves (no autograd).
    """
    qv, kv = _bshd(q, layout), _bshd(k, layout)
    batch, seq = qv.shape[0], qv.shape[1]
    if cos_sin_cache is not None:
        if positions is None:
            raise ValueError("llm_kernels.rope: positions: expected a tensor with cos_sin_cache, got None")
        if positions.dim() == 1:
            positions = positions.unsqueeze(0)
        positions = _expand_or_fail(positions, (batch, seq), "positions",
                                    f"({batch}, {seq}) or ({seq},) for q of {tuple(qv.shape)} (B, S, H, D)")
        if in_place:
            _ops.rope_cached_(qv, kv, cos_sin_cache, positions, style)
            return q, k
        qo, ko = _ops.rope_cached(qv, kv, cos_sin_cache, positions, style)
    else:
        if cos is None or sin is None:
            raise ValueError("llm_kernels.rope: expected cos_sin_cache and positions, or cos and sin")
        cos, sin = (t.unsqueeze(0) if t.dim() == 2 else t for t in (cos, sin))
        want = f"({batch}, {seq}, rot_dim / 2) or ({seq}, rot_dim / 2) for q of {tuple(qv.shape)} (B, S, H, D)"
        cos = _expand_or_fail(cos, (batch, seq, cos.shape[-1]), "cos", want)
        sin = _expand_or_fail(sin, (batch, seq, sin.shape[-1]), "sin", want)
        if in_place:
            _ops.rope_cos_sin_(qv, kv, cos, sin, style)
            return q, k
        qo, ko = _ops.rope_cos_sin(qv, kv, cos, sin, style)
    return (qo, ko) if layout == "bshd" else (qo.transpose(1, 2), ko.transpose(1, 2))


def apply_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim: int = 1):
    """Hugging Face's apply_rotary_pos_emb (LLaMA, Mistral, Qwen...): same signature and results.

    q, k: (B, H, S, D) with unsqueeze_dim=1, (B, S, H, D) with unsqueeze_dim=2; cos, sin:
    (B, S, rot_dim) or (S, rot_dim) with the halves duplicated, as HF's rotary embedding makes them
    (only the first half is read). position_ids is ignored, as in transformers.
    """
    if unsqueeze_dim not in (1, 2):
        raise ValueError(f"llm_kernels.apply_rotary_pos_emb: unsqueeze_dim: expected 1 or 2, got {unsqueeze_dim}")
    deferred = rope_kv.defer_rope(q, k, cos, sin, unsqueeze_dim)  # a fused decode layer's step (rope_kv.py)
    if deferred is not None:
        return deferred
    half = cos.shape[-1] // 2
    return rope(q, k, cos=cos[..., :half], sin=sin[..., :half], style="neox",
                layout="bhsd" if unsqueeze_dim == 1 else "bshd")


def _hf_form(q, k, cos, sin, unsqueeze_dim: int, style: str, one_per_pair, name: str):
    """One of Hugging Face's apply_rotary_pos_emb forms on our rope: `one_per_pair` picks the
    rot_dim / 2 angles' cos / sin out of what the form takes."""
    if unsqueeze_dim not in (1, 2):
        raise ValueError(f"llm_kernels.{name}: unsqueeze_dim: expected 1 or 2, got {unsqueeze_dim}")
    return rope(q, k, cos=one_per_pair(cos), sin=one_per_pair(sin), style=style,
                layout="bhsd" if unsqueeze_dim == 1 else "bshd")


def apply_rotary_pos_emb_interleaved(q, k, cos, sin, position_ids=None, unsqueeze_dim: int = 1):
    """The interleaved (GPT-J) form of Hugging Face's apply_rotary_pos_emb, as GLM, GLM-4, Helium
    and ERNIE 4.5 write it: pairs (2i, 2i + 1) rotated by angle i, taking cos and sin as
    apply_rotary_pos_emb does (rot_dim wide, halves duplicated; the first half is read); dims past
    rot_dim pass through."""
    return _hf_form(q, k, cos, sin, unsqueeze_dim, "gptj", lambda t: t[..., :t.shape[-1] // 2],
                    "apply_rotary_pos_emb_interleaved")


def apply_rotary_pos_emb_interleaved_pairs(q, k, cos, sin, position_ids=None, unsqueeze_dim: int = 1):
    """The interleaved form with cos and sin repeated per pair (angle i at 2i and 2i + 1), as
    Cohere's (Command R) rotary embedding makes them and its apply_rotary_pos_emb takes them."""
    return _hf_form(q, k, cos, sin, unsqueeze_dim, "gptj", lambda t: t[..., ::2],
                    "apply_rotary_pos_emb_interleaved_pairs")


def apply_rotary_pos_emb_halfwidth(q, k, cos, sin, position_ids=None, unsqueeze_dim: int = 1):
    """The rotate-half form with cos and sin of one value per pair (rot_dim / 2 wide, no duplicated
    halves), as gpt-oss writes it."""
    return _hf_form(q, k, cos, sin, unsqueeze_dim, "neox", lambda t: t, "apply_rotary_pos_emb_halfwidth")


def rope_angles(inv_freq: torch.Tensor, positions: torch.Tensor, scaling: float = 1.0,
                dtype: torch.dtype = torch.float32, duplicate: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotary angles, as Hugging Face's rotary embedding modules make them, in
    one launch: angle = positions.float() * inv_freq (one fp32 product), cos = (cos(angle) *
    scaling).to(dtype), likewise sin.

    inv_freq: (F,) float32; positions: (B, S) int64/int32 (any value: no table behind it), on
    inv_freq's device. Returns cos, sin of shape (B, S, 2 F) with the halves duplicated (HF's
    cat((freqs, freqs), -1)), or (B, S, F) with duplicate=False.
    """
    width = inv_freq.shape[-1] * (2 if duplicate else 1)
    return _ops.rope_angles(inv_freq, positions, float(scaling), width, dtype)


@torch.library.register_fake("llm_kernels::rope_angles")
def _rope_angles_fake(inv_freq, positions, scaling, width, dtype):
    shape = (positions.shape[0], positions.shape[1], width)
    return (torch.empty(shape, dtype=dtype, device=positions.device),
            torch.empty(shape, dtype=dtype, device=positions.device))


for _name in ("rope_cached", "rope_cos_sin"):
    @torch.library.register_fake(f"llm_kernels::{_name}")
    def _rope_fake(q, k, a, b, style, inverse=False):
        return torch.empty_like(q), torch.empty_like(k)


@torch.library.register_fake("llm_kernels::rope_cached_")
def _rope_cached_inplace_fake(q, k, cache, positions, style):
    return None


@torch.library.register_fake("llm_kernels::rope_cos_sin_")
def _rope_cos_sin_inplace_fake(q, k, cos, sin, style):
    return None
