"""Decode-time GEMM fusion for kernelize: gate_proj + up_proj as ONE skinny GEMM with the fused
SwiGLU epilogue (GEGLU-tanh for Gemma's MLP), and q_proj + k_proj + v_proj as ONE skinny GEMM,
without changing parameter names, parameter objects or the state dict.

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

Decoder layer (LLaMA's pre-norm layout: x + attn(norm1(x)), then h + mlp(norm2(h))): `layer_forward`
replaces the layer's forward at decode shapes so that neither RMSNorm nor either residual add is a
launch of its own: input_layernorm runs as the q/k/v GEMM's prologue (the group's `norm`, read by
the q call), the residual add as o_proj's epilogue (`residual_once` on the o_proj Linear, consumed by
its next call), post_attention_layernorm as the gate/up GEMM's prologue and the second residual
add as down_proj's epilogue. Everything else of the attention module (RoPE, q/k norms, the cache
update, the attention function) runs as before. Other shapes run the layer's own forward.
"""

from __future__ import annotations

import os
import warnings

import torch
from torch import nn

from . import decode, rope_kv

# Tests: also take the fused path on the CPU (our CPU skinny_gemm, any float dtype).
CPU_FUSED = False
# q/k/v hand-off also inside torch.compile (dynamo replays the Python-state mutations).
COMPILE_FUSED = True
# layer_forward's RMSNorms as GEMM prologues, or as launches of their own before plain GEMMs.
# input_layernorm: the q/k/v GEMM's prologue unless LLMK_FUSE_QKV_NORM=0.
# post_attention_layernorm: the gate/up GEMM's prologue while its weight is at most
# MLP_NORM_PROLOGUE_MAX_BYTES, else its own launch before the plain SwiGLU GEMM, which takes the mma
# kernel and is faster per call than the deep prologue kernel by more than the launch costs once the
# weight is large (H200, 2026-12-04, bench/results/h200-e2e-mlp-norm-rule-2026-12-04.md: the 7b
# config's 180 MB gate/up 47.8 us + 2.9 for the norm against 53.0, decode 238 against 226-227 tok/s;
# the 1b config's 67 MB 1107-1110 on its own launch against 1116-1117; the threshold sits between
# the two measured sizes). LLMK_FUSE_MLP_NORM=1 / =0 forces the prologue / the own launch.
# Both switches are read at import.
QKV_NORM_PROLOGUE = os.environ.get("LLMK_FUSE_QKV_NORM", "1") != "0"
_MLP_NORM_SETTING = os.environ.get("LLMK_FUSE_MLP_NORM", "")
if _MLP_NORM_SETTING not in ("", "0", "1"):
    warnings.warn(f"LLMK_FUSE_MLP_NORM={_MLP_NORM_SETTING!r} is not 0 or 1: choosing by weight size", stacklevel=1)
MLP_NORM_PROLOGUE: bool | None = {"1": True, "0": False}.get(_MLP_NORM_SETTING)
MLP_NORM_PROLOGUE_MAX_BYTES = 128 << 20


def mlp_norm_in_prologue(gate_up_weight: torch.Tensor) -> bool:
    """Whether layer_forward runs post_attention_layernorm as the gate/up GEMM's prologue."""
    if MLP_NORM_PROLOGUE is not None:
        return MLP_NORM_PROLOGUE
    return gate_up_weight.numel() * gate_up_weight.element_size() <= MLP_NORM_PROLOGUE_MAX_BYTES


def _eligible(x: torch.Tensor, w: torch.Tensor) -> bool:
    if torch.is_grad_enabled() and (x.requires_grad or w.requires_grad):
        return False
    if x.dim() < 1 or x.dtype != w.dtype or x.device != w.device or not decode.skinny_takes(x, w):
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
        # One contiguous weight (Phi-3's qkv_proj): a group of one for the norm prologue, no copy.
        self.shared = len(weights) == 1 and weights[0].is_contiguous()
        with torch.no_grad():
            if self.shared:
                self.weight = weights[0].data
                self.bias = biases[0].data if biases[0] is not None else None
            else:
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
        self.norm = None  # layer_forward: the RMSNorm module to apply to x first (prologue), or None
        self.norm_input = None  # ... and the layer input it is meant for

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
        if not self.shared:  # (a shared group's Parameters never left their own tensors)
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
        g = self._group
        norm = g.norm
        if norm is not None and x is not g.norm_input:
            raise RuntimeError("llm_kernels: fused decoder layer: the attention module called a q/k/v projection on "
                               "something other than the layer's input, which layer_forward does not model; "
                               "kernelize(model, fuse=False) runs this model")
        if (torch.compiler.is_compiling() and not COMPILE_FUSED) or g.weight is None or not _eligible(x, self.weight) \
                or not g.valid():
            g.x = g.out = None
            return super().forward(x if norm is None else norm(x))
        if self._index == 0:
            g.out = rope_kv.gemm_qkv(x, g, _norm_args(norm))  # RoPE + K/V write fused in, when armed
            if g.out is None:
                g.out = decode._ops.skinny_gemm(x, g.weight, g.bias, "none", False, *_norm_args(norm),
                                                fixed_weight=True)
            g.x = x
        elif g.x is not x:
            g.x = g.out = None
            return decode._ops.skinny_gemm(x, self.weight, self.bias, "none", False, *_norm_args(norm),
                                           fixed_weight=True)
        out = g.out[..., self._start:self._start + self.out_features]
        if self._index == len(g.sizes) - 1:
            g.x = g.out = None  # the last consumer: do not keep the tensors alive
        return out

    def extra_repr(self) -> str:
        return super().extra_repr() + f", fused part {self._index} of {len(self._group.sizes)}"


# ------------------------------------------------------------------------------- gate/up
def fuse_mlp(mlp: nn.Module) -> FusedGroup:
    """Re-points gate_proj / up_proj of a layers.LlamaMLP (or an hf.GatedMLP with GELU tanh) into
    one [gate; up] weight that its forward runs with the SwiGLU (GEGLU-tanh) epilogue at decode
    shapes."""
    group = FusedGroup([mlp.gate_proj.weight, mlp.up_proj.weight], [mlp.gate_proj.bias, mlp.up_proj.bias])
    mlp._fused = group
    return group


def mlp_forward(mlp: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
    """The fused gated product act(gate(x)) * up(x) as one skinny GEMM over the MLP's [gate; up]
    weight (gate_up_of: a fused layers.LlamaMLP's or hf.GatedMLP's group, or a layers.GateUpMLP's
    own gate_up_proj) when it has one and x is a decode shape, else None (the caller runs the usual
    path)."""
    gate_up = gate_up_of(mlp)
    if gate_up is None or not _eligible(x, gate_up[0]):
        return None
    return decode._ops.skinny_gemm(x, gate_up[0], gate_up[1], gate_up[2], False, fixed_weight=True)


def _norm_args(norm) -> tuple:
    """skinny_gemm's (norm_weight, norm_eps, norm_offset) for an RMSNorm module, or none."""
    if norm is None:
        return (None, 1e-6, 0.0)
    return (norm.weight, float(norm.eps), float(norm.offset))


# --------------------------------------------------------------------------- decoder layer
def qkv_group(attn: nn.Module) -> FusedGroup | None:
    """The fused group of an attention module's first projection: q_proj of a fused q/k/v, or a
    single qkv_proj (Phi-3) made a group of one; None when neither is fused."""
    proj = getattr(attn, "q_proj", None) or getattr(attn, "qkv_proj", None)
    return proj._group if isinstance(proj, FusedProjection) else None


# skinny_gemm's gated epilogue for an MLP activation (GateUpMLP's names).
EPILOGUES = {"silu": "swiglu", "gelu_tanh": "geglu_tanh"}


def mlp_epilogue(mlp: nn.Module) -> str | None:
    """skinny_gemm's gated epilogue for one of our MLP modules ('swiglu': layers.LlamaMLP or a SiLU
    layers.GateUpMLP; 'geglu_tanh': an hf.GatedMLP or layers.GateUpMLP with GELU tanh), or None."""
    from . import layers
    from .hf import GatedMLP

    if type(mlp) is layers.LlamaMLP:
        return "swiglu"
    if type(mlp) is GatedMLP:
        return "geglu_tanh" if mlp.approximate == "tanh" else None
    if type(mlp) is layers.GateUpMLP:
        return EPILOGUES.get(mlp.activation)
    return None


def gate_up_of(mlp: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None, str] | None:
    """The [gate; up] weight, bias and skinny_gemm epilogue ('swiglu' or 'geglu_tanh') that
    layer_forward and mlp_forward run: a fused layers.LlamaMLP's or hf.GatedMLP's (GELU tanh,
    Gemma's) group, or a layers.GateUpMLP's own gate_up_proj (SiLU or GELU tanh, fuse_decode set);
    None when the MLP has none (or its group was re-pointed), and for the GEGLU epilogue on the GPU
    with LLMK_FUSE_GEGLU=0."""
    from . import layers

    epilogue = mlp_epilogue(mlp)
    if epilogue is None:
        return None
    if type(mlp) is layers.GateUpMLP:
        if not mlp.fuse_decode:
            return None
        weight, bias = mlp.gate_up_proj.weight, mlp.gate_up_proj.bias
    else:
        g = getattr(mlp, "_fused", None)
        if g is None or g.weight is None or not g.valid():
            return None
        weight, bias = g.weight, g.bias
    if epilogue == "geglu_tanh" and not geglu_on(weight.device):
        return None
    return weight, bias, epilogue


def geglu_on(device: torch.device) -> bool:
    """Whether the GEGLU-tanh epilogue runs fused on this device (always, unless LLMK_FUSE_GEGLU=0
    on the GPU: the switch keeps the unfused Gemma layers there for an A/B)."""
    return device.type != "cuda" or os.environ.get("LLMK_FUSE_GEGLU", "1") != "0"


def layer_ready(layer: nn.Module, x: torch.Tensor) -> bool:
    """Whether layer_forward can take its fused path for this input (what kernelize checked once,
    plus what can change: the input's shape, dtype and device, autograd, re-pointed parameters,
    training mode)."""
    attn, mlp = layer.self_attn, layer.mlp
    ln1, ln2 = layer.input_layernorm, layer.post_attention_layernorm
    g, gate_up = qkv_group(attn), gate_up_of(mlp)
    if layer.training or g is None or g.weight is None or gate_up is None:
        return False
    if ln1.weight.dtype != x.dtype or ln2.weight.dtype != x.dtype:
        return False
    return (_eligible(x, g.weight) and _eligible(x, gate_up[0]) and _eligible(x, attn.o_proj.weight)
            and _eligible(x, mlp.down_proj.weight) and g.valid())


def layer_forward(layer: nn.Module, hidden_states: torch.Tensor, *args, **kwargs):
    """A LLaMA-layout decoder layer's forward with its RMSNorms and residual adds fused into the
    GEMMs (see the top of this file); the layer's own forward for anything else."""
    if args or (torch.compiler.is_compiling() and not COMPILE_FUSED) or not layer_ready(layer, hidden_states):
        return type(layer).forward(layer, hidden_states, *args, **kwargs)
    attn, mlp = layer.self_attn, layer.mlp
    ln2 = layer.post_attention_layernorm
    g, o_proj = qkv_group(attn), attn.o_proj
    x_attn = hidden_states
    if QKV_NORM_PROLOGUE:
        g.norm, g.norm_input = layer.input_layernorm, hidden_states
    else:
        x_attn = layer.input_layernorm(hidden_states)
    o_proj.residual_once = hidden_states
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    try:
        # RoPE + K/V write in one launch, or in the q/k/v projection's (rope_kv.py)
        with rope_kv.armed(attn, cache, hidden_states, g, kwargs.get("position_embeddings")):
            h = attn(hidden_states=x_attn, **kwargs)[0]
        if o_proj.residual_once is not None:  # the attention module did not call o_proj: add it here
            h = hidden_states + h
    finally:
        g.norm = g.norm_input = None
        o_proj.residual_once = None
    gate_up_weight, gate_up_bias, epilogue = gate_up_of(mlp)
    prologue = mlp_norm_in_prologue(gate_up_weight)
    x_mlp, mlp_norm = (h, ln2) if prologue else (ln2(h), None)
    u = decode._ops.skinny_gemm(x_mlp, gate_up_weight, gate_up_bias, epilogue, False, *_norm_args(mlp_norm),
                                fixed_weight=True)
    down = mlp.down_proj
    return decode._ops.skinny_gemm(u, down.weight, down.bias, "none", False, None, 1e-6, 0.0, h, fixed_weight=True)


def unfuse_mlp(mlp: nn.Module) -> None:
    g = mlp.__dict__.pop("_fused", None)  # the class attribute (None) shows again
    if g is not None:
        g.unfuse()


__all__ = ["EPILOGUES", "FusedGroup", "FusedProjection", "fusable", "fuse_mlp", "gate_up_of", "geglu_on",
           "layer_forward", "layer_ready", "mlp_epilogue",
           "mlp_forward", "mlp_norm_in_prologue", "qkv_group", "unfuse_mlp"]
