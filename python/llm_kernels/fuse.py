"""Decode-time GEMM fusion for kernelize: gate_proj + up_proj as ONE skinny GEMM with the fused
SwiGLU epilogue, and q_proj + k_proj + v_proj as ONE skinny GEMM, without changing parameter names,
parameter objects or the state dict.

How: the weights (and biases) of a group are copied into one concatenated tensor, and each original
Parameter's `.data` is re-pointed to its rows of it (the Parameter objects, their names and
`state_dict()` stay the same; the values are views into the shared storage, so load_state_dict and
in-place updates write into the fused tensor). `unfuse` gives each Parameter an independent copy
again.

At run time the fused GEMM is used for at most 16 rows of fp16/bf16 input on the GPU without
autograd (decoding); otherwise every projection runs as before. A group whose Parameters no longer
point into the fused tensor (moved with .to(), replaced) silently runs unfused.

q/k/v: HF attention calls q_proj(x), k_proj(x), v_proj(x) in turn. The q module runs the fused GEMM
and keeps its output; k and v return their column slices when they are called with the very same x
(else they compute their own product). Under torch.compile dynamo traces the hand-off (Python
attribute mutations, replayed after the graph) into one graph with the single GEMM
(fullgraph=True works); COMPILE_FUSED = False runs the projections unfused there instead.
"""

from __future__ import annotations

import torch
from torch import nn

from . import decode

# Tests: also take the fused path on the CPU (our CPU skinny_gemm, any float dtype).
CPU_FUSED = False
# q/k/v hand-off also inside torch.compile (dynamo replays the Python-state mutations).
COMPILE_FUSED = True


def _eligible(x: torch.Tensor, w: torch.Tensor) -> bool:
    if torch.is_grad_enabled() and (x.requires_grad or w.requires_grad):
        return False
    if x.dim() < 1 or decode._rows(x) > decode.SKINNY_MAX_ROWS or x.dtype != w.dtype or x.device != w.device:
        return False
    if x.is_cuda:
        return x.dtype in (torch.float16, torch.bfloat16)
    return CPU_FUSED and x.device.type == "cpu"


class FusedGroup:
    """Parameters re-pointed into one concatenated weight (and bias). Not a Module: it owns no
    state-dict entries; the modules keep their Parameters."""

    def __init__(self, weights: list[nn.Parameter], biases: list[nn.Parameter | None]):
        self.weights, self.biases = weights, biases
        self.sizes = [w.shape[0] for w in weights]
        with torch.no_grad():
            self.weight = torch.cat([w.detach() for w in weights], 0).contiguous()
            has_bias = [b is not None for b in biases]
            self.bias = torch.cat([b.detach() for b in biases], 0).contiguous() if all(has_bias) else None
            row = 0
            for i, w in enumerate(weights):
                w.data = self.weight[row:row + self.sizes[i]]
                if self.bias is not None:
                    biases[i].data = self.bias[row:row + self.sizes[i]]
                row += self.sizes[i]
        self._ptrs = self._current_ptrs()
        self.x = None  # q/k/v hand-off: the input and the fused output of the last q call
        self.out = None

    def _current_ptrs(self):
        return tuple(p.data_ptr() for p in self.weights + [b for b in self.biases if b is not None])

    def valid(self) -> bool:
        """The Parameters still live in the fused tensors (checked outside torch.compile)."""
        if torch.compiler.is_compiling():
            return True
        return self._current_ptrs() == self._ptrs and self.weight.dtype == self.weights[0].dtype

    def unfuse(self) -> None:
        """Each Parameter gets an independent copy of its values again (once)."""
        if self.weight is None:
            return
        with torch.no_grad():
            for p in self.weights + [b for b in self.biases if b is not None]:
                p.data = p.data.clone()
        self.weight = self.bias = self.x = self.out = None


def fusable(linears: list[nn.Module]) -> str:
    """'' when these Linear-like modules can share one fused weight, else the reason."""
    ws = [getattr(m, "weight", None) for m in linears]
    if not all(isinstance(w, nn.Parameter) and w.dim() == 2 for w in ws):
        return "not all are Linear layers with a 2-D weight"
    if len({(w.shape[1], w.dtype, w.device) for w in ws}) != 1:
        return "in_features, dtype or device differ"
    if any(w.device.type == "meta" for w in ws):
        return "weights on the meta device"
    bs = [getattr(m, "bias", None) for m in linears]
    if any(b is not None for b in bs) and not all(b is not None for b in bs):
        return "some have a bias and some do not"
    return ""


# ----------------------------------------------------------------------------------- q/k/v
class FusedProjection(decode.Linear):
    """One of q_proj / k_proj / v_proj (index 0, 1, 2) of a fused group: same `weight` and `bias`
    Parameters as the Linear it replaces; at decode shapes the q module runs the group's single
    GEMM and k, v take their slices of it."""

    @classmethod
    def from_group(cls, module: nn.Module, group: FusedGroup, index: int) -> "FusedProjection":
        new = cls.from_module(module)
        new._group, new._index = group, index
        new._start = sum(group.sizes[:index])
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling() and not COMPILE_FUSED:
            return super().forward(x)
        g = self._group
        if g.weight is None or not _eligible(x, self.weight) or not g.valid():
            g.x = g.out = None
            return super().forward(x)
        if self._index == 0:
            g.out = decode._ops.skinny_gemm(x, g.weight, g.bias, "none", False)
            g.x = x
        elif g.x is not x:
            g.x = g.out = None
            return decode._ops.skinny_gemm(x, self.weight, self.bias, "none", False)
        out = g.out[..., self._start:self._start + self.out_features]
        if self._index == len(g.sizes) - 1:
            g.x = g.out = None  # the last consumer: do not keep the tensors alive
        return out

    def extra_repr(self) -> str:
        return super().extra_repr() + f", fused part {self._index} of {len(self._group.sizes)}"


# ------------------------------------------------------------------------------- gate/up
def fuse_mlp(mlp: nn.Module) -> FusedGroup:
    """Re-points gate_proj / up_proj of a layers.LlamaMLP into one [gate; up] weight that its
    forward runs with the SwiGLU epilogue at decode shapes."""
    group = FusedGroup([mlp.gate_proj.weight, mlp.up_proj.weight], [mlp.gate_proj.bias, mlp.up_proj.bias])
    mlp._fused = group
    return group


def mlp_forward(mlp: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
    """The fused SwiGLU product silu(gate(x)) * up(x) when mlp has a usable fused group and x is a
    decode shape, else None (the caller runs the usual path)."""
    g = getattr(mlp, "_fused", None)
    if g is None or g.weight is None or not _eligible(x, g.weight) or not g.valid():
        return None
    return decode._ops.skinny_gemm(x, g.weight, g.bias, "swiglu", False)


def unfuse_mlp(mlp: nn.Module) -> None:
    g = mlp.__dict__.pop("_fused", None)  # the class attribute (None) shows again
    if g is not None:
        g.unfuse()


__all__ = ["FusedGroup", "FusedProjection", "fusable", "fuse_mlp", "mlp_forward", "unfuse_mlp"]
