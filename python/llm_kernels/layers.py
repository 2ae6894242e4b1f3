"""nn.Module drop-ins that keep the original parameter names, so state dicts load unchanged."""

from __future__ import annotations

import torch
from torch import nn

from . import ops


class RMSNorm(nn.Module):
    """RMSNorm with a `weight` parameter, as Hugging Face's LlamaRMSNorm (and Gemma's with offset=1).

    Accepts `eps` or `variance_epsilon`; both names read and write the same value.
    forward(x) -> y; forward(x, residual) -> (y, x + residual) through the fused kernel.
    The output has x's dtype (HF would promote to the weight's dtype if they differed).
    """

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-6,
        *,
        variance_epsilon: float | None = None,
        offset: float = 0.0,
        device=None,
        dtype=None,
    ):
        super().__init__()
        init = torch.zeros if offset != 0.0 else torch.ones
        self.weight = nn.Parameter(init(hidden_size, device=device, dtype=dtype))
        self.eps = float(eps if variance_epsilon is None else variance_epsilon)
        self.offset = float(offset)

    @property
    def variance_epsilon(self) -> float:
        return self.eps

    @variance_epsilon.setter
    def variance_epsilon(self, value: float) -> None:
        self.eps = float(value)

    @classmethod
    def from_module(cls, module: nn.Module, offset: float | None = None) -> "RMSNorm":
        """A drop-in for `module` (LlamaRMSNorm, MistralRMSNorm, Qwen2RMSNorm, GemmaRMSNorm...),
        sharing its weight tensor. Gemma-style (1 + weight) is detected by class name."""
        eps = getattr(module, "variance_epsilon", getattr(module, "eps", 1e-6))
        if offset is None:
            offset = 1.0 if "gemma" in type(module).__name__.lower() else 0.0
        new = cls(module.weight.shape[0], eps, offset=offset, device="meta")
        new.weight = module.weight
        return new

    def _weight_for(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        return w if w.dtype in (x.dtype, torch.float32) else w.to(x.dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return ops.rms_norm(x, self._weight_for(x), self.eps, self.offset)
        return ops.fused_add_rms_norm(x, residual, self._weight_for(x), self.eps, self.offset)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}" + (f", offset={self.offset}" if self.offset else "")


class LlamaMLP(nn.Module):
    """LLaMA's MLP, down(silu(gate(x)) * up(x)), with the children gate_proj, up_proj, down_proj
    as in Hugging Face's LlamaMLP, so its state dict loads unchanged. The gating runs in one fused
    kernel."""

    _fused = None  # kernelize(fuse=True) sets a fuse.FusedGroup here (not a parameter or buffer)

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False, device=None, dtype=None):
        super().__init__()
        kw = dict(bias=bias, device=device, dtype=dtype)
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, **kw)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, **kw)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, **kw)

    @classmethod
    def from_module(cls, module: nn.Module) -> "LlamaMLP":
        """A drop-in for a Hugging Face LlamaMLP-style module (silu activation), sharing its Linears."""
        act = getattr(module, "act_fn", None)
        if act is not None and not isinstance(act, nn.SiLU) and type(act).__name__ != "SiLUActivation":
            raise ValueError(f"LlamaMLP.from_module: expected a SiLU activation, got {type(act).__name__}")
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.gate_proj, new.up_proj, new.down_proj = module.gate_proj, module.up_proj, module.down_proj
        new.hidden_size, new.intermediate_size = module.gate_proj.in_features, module.gate_proj.out_features
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._fused is not None:  # kernelize(fuse=True): [gate; up] as one GEMM (llm_kernels.fuse)
            from . import fuse

            h = fuse.mlp_forward(self, x)
            if h is not None:
                return self.down_proj(h)
        return self.down_proj(ops.swiglu(self.gate_proj(x), self.up_proj(x)))


class GateUpMLP(nn.Module):
    """An MLP with one concatenated gate/up projection, down(act(gate) * up) where
    [gate | up] = gate_up_proj(x), as Hugging Face's Phi3MLP and Glm4MLP write it: children
    gate_up_proj and down_proj, so their state dicts load unchanged. activation: 'silu' (SwiGLU),
    'gelu' or 'gelu_tanh' (GEGLU); the gating runs in one fused kernel. With `fuse_decode` set
    (kernelize's fuse=True), at decode shapes on the GPU (<= 16 rows of fp16/bf16, no autograd)
    a SiLU MLP's product and gating run as one skinny GEMM with the SwiGLU epilogue, its weight
    being [gate; up] already (a GELU-tanh one's with the GEGLU-tanh epilogue; LLMK_FUSE_GEGLU=0
    turns that off on the GPU)."""

    fuse_decode = False

    def __init__(self, hidden_size: int, intermediate_size: int, activation: str = "silu", bias: bool = False,
                 device=None, dtype=None):
        super().__init__()
        if activation not in ("silu", "gelu", "gelu_tanh"):
            raise ValueError(f"GateUpMLP: activation: expected 'silu', 'gelu' or 'gelu_tanh', got {activation!r}")
        kw = dict(bias=bias, device=device, dtype=dtype)
        self.hidden_size, self.intermediate_size, self.activation = hidden_size, intermediate_size, activation
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, **kw)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, **kw)

    @classmethod
    def from_module(cls, module: nn.Module, activation: str) -> "GateUpMLP":
        """A drop-in for a Phi3MLP-style module, sharing its Linears."""
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.gate_up_proj, new.down_proj = module.gate_up_proj, module.down_proj
        new.hidden_size, new.intermediate_size = module.gate_up_proj.in_features, module.down_proj.in_features
        new.activation = activation
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fuse_decode:
            from . import fuse

            h = fuse.mlp_forward(self, x)  # (None unless SiLU / GELU tanh and a decode shape)
            if h is not None:
                return self.down_proj(h)
        gate_up = self.gate_up_proj(x)
        if self.activation == "silu":
            return self.down_proj(ops.silu_and_mul(gate_up))
        return self.down_proj(ops.gelu_and_mul(gate_up, "tanh" if self.activation == "gelu_tanh" else "none"))

    def extra_repr(self) -> str:
        return f"activation={self.activation}" + (", fuse_decode=True" if self.fuse_decode else "")


class GEGLU(nn.Module):
    """GEGLU as in diffusers' attention MLPs: a `proj` Linear emitting 2*inner features, then
    gelu(first half) * second half, fused. Loads the original state dict unchanged."""

    def __init__(self, dim_in: int, dim_out: int, bias: bool = True, approximate: str = "none", device=None, dtype=None):
        super().__init__()
        self.proj = nn.Linear(dim_in, dim_out * 2, bias=bias, device=device, dtype=dtype)
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.gelu_and_mul(self.proj(x), self.approximate)
from .decode import Linear  # noqa: E402,F401  (skinny-GEMM nn.Linear drop-in, issue 5)
