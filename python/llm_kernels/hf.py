"""Hugging Face integration: kernelize(model), one call that runs a Hugging Face model of one of
SUPPORTED_MODEL_TYPES (LLaMA, Mistral, Qwen, Gemma, Phi-3, GLM, OLMo, Mixtral, gpt-oss...) on our
kernels, in place, and unkernelize(model) that undoes it.

    report = llm_kernels.kernelize(model)            # mode="inference"
    report = llm_kernels.kernelize(model, mode="training", ops=["rms_norm", "mlp"])
    llm_kernels.unkernelize(model)

What is swapped (each family can be chosen with `ops=`):
  rms_norm   every *RMSNorm module (also Qwen3's q_norm/k_norm; Gemma's (1 + w) form) -> layers.RMSNorm
  mlp        gate/up/down MLPs: SiLU -> layers.LlamaMLP, GELU (erf or tanh) -> GatedMLP; MLPs with one
             gate_up_proj (Phi-3, GLM-4) -> layers.GateUpMLP
  rope       the modeling module's apply_rotary_pos_emb -> ops.apply_rotary_pos_emb (rotate-half),
             or the interleaved / half-width forms of ops (GLM, Cohere, gpt-oss), whichever of
             hf._ROPE_FORMS the original computes (probed); and each *RotaryEmbedding module whose
             forward computes one of hf._ROTARY_FORMS (probed; not the dynamic / longrope types)
             gets rotary_forward: cos and sin in one ops.rope_angles launch instead of ~9 kernels
  attention  config._attn_implementation -> "llm_kernels" (registered with transformers'
             AttentionInterface): flash.sdpa where our kernel takes the call, else what the model
             used before (HF's sdpa, or its modeling file's eager_attention_forward for a model
             that was on "eager": Gemma 2's soft-capping, gpt-oss's sinks)
  linear     nn.Linear -> layers.Linear (skinny-GEMM decode kernel), when that class exists
  kv_cache   (inference) transformers' StaticLayer.update: a one-token update (a decode step) as
             one write_kv_cache launch that also advances the length (at batch 1; a second
             launch otherwise), instead of HF's arange, add, add_ and two index_copy_; every
             other update runs HF's code
and, in inference mode with fuse=True (the default), the decode-shape GEMM fusion (report family
"fuse", see llm_kernels.fuse): gate_proj + up_proj of each swapped SiLU MLP as one skinny GEMM with
the SwiGLU epilogue (GELU-tanh MLPs, Gemma's, with the GEGLU-tanh one; LLMK_FUSE_GEGLU=0 turns
that off on the GPU), and q_proj + k_proj + v_proj of each attention module as one skinny GEMM; the
Parameters are re-pointed into one concatenated tensor (names, objects and state dict unchanged);
then each decoder layer whose parts are all fused (and whose forward is LLaMA's pre-norm layout,
probed) gets fuse.layer_forward as its forward: its two RMSNorms run as the q/k/v and gate/up
GEMMs' prologues and its two residual adds as the o_proj and down_proj GEMMs' epilogues.
and, with monarch_last=N, the q/k/v/o projections of the last N decoder layers -> MonarchLinear.

Nothing is taken on trust: before a module class or function is replaced, its forward is run on
small random CPU tensors (through a stand-in `self` with random weights) and compared with our
op; anything that does not match is left alone, with the reason in the report. Replacement
modules share the original parameter tensors, so names, state dict and devices are unchanged
(except the Monarch conversion, which changes those layers by design).

The rope patch replaces a module-level function of the model's modeling file, so while any model of
that family is kernelized, every model of that family in the process uses our rope (reference
counted, restored by the last unkernelize). The kv_cache patch likewise replaces a method of
transformers' StaticLayer class, for every static cache in the process while any model is
kernelized with it.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import sys
import types
import weakref
from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from . import decode, flash, layers, monarch, ops, rope_kv
from . import fuse as fusion

FAMILIES = ("rms_norm", "mlp", "rope", "attention", "linear", "kv_cache")
# Model types (config.model_type) kernelize takes; each has a tiny-config test of what is swapped and
# of its logits (tests/python/test_kernelize.py, test_kernelize_families.py).
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma",  # test_kernelize.py, in depth
                         "gemma2", "gemma3_text", "phi3", "glm", "glm4", "olmo2", "olmo3", "granite", "smollm3",
                         "ministral", "helium", "ernie4_5", "exaone4", "seed_oss", "hunyuan_v1_dense", "cohere2",
                         "qwen2_moe", "qwen3_moe", "mixtral", "gpt_oss",
                         # the text decoders of vision-language models (kernelize(vlm) takes its language model)
                         "qwen2_vl_text", "qwen2_5_vl_text", "qwen3_vl_text")
ATTN_NAME = "llm_kernels"
MODES = ("inference", "training")

# Families whose ops have a backward (ops.py registers autograd for rms_norm, gated_activation and
# rope_cos_sin; the attention kernel has none yet). Linear asks the class (`supports_backward`).
_HAS_BACKWARD = {"rms_norm": True, "mlp": True, "rope": True, "attention": False, "kv_cache": False}

_STATE_ATTR = "_llmk_kernelize_state"


# ------------------------------------------------------------------------------------ report
@dataclasses.dataclass
class Swap:
    """One line of the report: `name` (a module's qualified name, or the function / config field
    patched), its family, the original class or function, and the replacement, or None when it was
    left alone, with the reason."""

    name: str
    family: str
    original: str
    replacement: str | None
    reason: str = ""

    @property
    def swapped(self) -> bool:
        return self.replacement is not None


class KernelizeReport(list):
    """The list of Swap records kernelize returns; rich prints it as a table grouped by what was
    done (`rich.print(report)`), str() gives the same as text."""

    @property
    def swapped(self) -> list[Swap]:
        return [s for s in self if s.swapped]

    @property
    def left_alone(self) -> list[Swap]:
        return [s for s in self if not s.swapped]

    def by_family(self, family: str) -> list[Swap]:
        return [s for s in self if s.family == family]

    def grouped(self) -> list[tuple[Swap, list[str]]]:
        groups: dict[tuple, list[Swap]] = {}
        for s in self:
            groups.setdefault((s.family, s.original, s.replacement, s.reason), []).append(s)
        return [(v[0], [s.name for s in v]) for v in groups.values()]

    def __rich__(self):
        from rich.table import Table

        table = Table(title=f"llm_kernels.kernelize: {len(self.swapped)} swapped, {len(self.left_alone)} left alone")
        for col in ("family", "count", "modules", "original", "replacement / reason"):
            table.add_column(col)
        for s, names in self.grouped():
            shown = names[0] if len(names) == 1 else f"{names[0]} … {names[-1]}"
            what = f"[green]{_short(s.replacement)}[/green]" if s.swapped else f"[yellow]left alone[/yellow]: {s.reason}"
            if s.swapped and s.reason:
                what += f" ({s.reason})"
            table.add_row(s.family, str(len(names)), shown, _short(s.original), what)
        return table

    def __str__(self) -> str:
        from rich.console import Console

        console = Console(width=160, color_system=None, force_terminal=False)
        with console.capture() as cap:
            console.print(self)
        return cap.get()


def _short(qualname: str | None) -> str:
    """The last two dotted parts (modeling_llama.LlamaRMSNorm, layers.RMSNorm)."""
    return ".".join((qualname or "").split(".")[-2:])


def _qualname(obj) -> str:
    """module.Class for a module instance, module.name for a class or function."""
    target = type(obj) if isinstance(obj, nn.Module) else obj
    return f"{getattr(target, '__module__', '?')}.{getattr(target, '__qualname__', getattr(target, '__name__', '?'))}"


# ------------------------------------------------------------------------------- replacements
class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)) with act gelu (erf, approximate='none') or gelu tanh
    (approximate='tanh', Gemma's gelu_pytorch_tanh), children gate_proj, up_proj, down_proj as in
    Hugging Face's GemmaMLP, the gating fused in one kernel (ops.geglu). With GELU tanh,
    kernelize(fuse=True) may set `_fused` (a fuse.FusedGroup of gate and up): at decode shapes the
    product and the gating then run as one skinny GEMM with the GEGLU-tanh epilogue."""

    _fused = None  # kernelize(fuse=True) sets a fuse.FusedGroup here (not a parameter or buffer)

    def __init__(self, hidden_size: int, intermediate_size: int, approximate: str = "tanh", bias: bool = False,
                 device=None, dtype=None):
        super().__init__()
        kw = dict(bias=bias, device=device, dtype=dtype)
        self.hidden_size, self.intermediate_size, self.approximate = hidden_size, intermediate_size, approximate
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, **kw)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, **kw)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, **kw)

    @classmethod
    def from_module(cls, module: nn.Module, approximate: str) -> "GatedMLP":
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.gate_proj, new.up_proj, new.down_proj = module.gate_proj, module.up_proj, module.down_proj
        new.hidden_size, new.intermediate_size = module.gate_proj.in_features, module.gate_proj.out_features
        new.approximate = approximate
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._fused is not None:  # [gate; up] as one GEMM (llm_kernels.fuse)
            h = fusion.mlp_forward(self, x)
            if h is not None:
                return self.down_proj(h)
        return self.down_proj(ops.geglu(self.gate_proj(x), self.up_proj(x), self.approximate))

    def extra_repr(self) -> str:
        return f"approximate={self.approximate!r}"


# ---------------------------------------------------------------------------- probing helpers
class _Stand(object):
    """A stand-in `self` for calling a module class's forward with other attributes: `overrides`
    first, then the module's own attributes; methods of the class are bound to the stand-in so
    that they see the overrides too."""

    def __init__(self, module: nn.Module, **overrides):
        object.__setattr__(self, "_module", module)
        object.__setattr__(self, "_overrides", overrides)

    def __getattr__(self, name):
        overrides = object.__getattribute__(self, "_overrides")
        if name in overrides:
            return overrides[name]
        module = object.__getattribute__(self, "_module")
        attr = inspect.getattr_static(type(module), name, None)
        if isinstance(attr, types.FunctionType):
            return types.MethodType(attr, self)
        return getattr(module, name)


def _close(a: torch.Tensor, b: torch.Tensor, tol: float = 1e-5) -> bool:
    a, b = a.detach().double(), b.detach().double()
    return a.shape == b.shape and bool(torch.isfinite(a).all()) and float((a - b).abs().max()) <= tol * max(1.0, float(b.abs().max()))


def _generator() -> torch.Generator:
    return torch.Generator().manual_seed(1234)


def _eps_of(module: nn.Module) -> float | None:
    for attr in ("variance_epsilon", "eps", "epsilon"):
        v = getattr(module, attr, None)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return float(v)
    return None


def _probe_rms_norm(module: nn.Module) -> tuple[float | None, str]:
    """(offset, "") when the module's forward is rms_norm with weight (offset 0) or 1 + weight
    (offset 1), else (None, reason)."""
    weight = getattr(module, "weight", None)
    if not isinstance(weight, nn.Parameter) or weight.dim() != 1:
        return None, "no 1-D weight parameter"
    if getattr(module, "bias", None) is not None:
        return None, "has a bias"
    eps = _eps_of(module)
    if eps is None:
        return None, "no eps / variance_epsilon attribute"
    n, g = weight.shape[0], _generator()
    w = torch.randn(n, generator=g) * 0.5
    x = torch.randn(3, n, generator=g) * 2.0
    try:
        with torch.no_grad():
            out = type(module).forward(_Stand(module, weight=w), x)
    except Exception as e:  # noqa: BLE001 - any failure means "not the form we know"
        return None, f"its forward failed on a probe ({type(e).__name__})"
    if not isinstance(out, torch.Tensor):
        return None, "its forward does not return one tensor"
    for offset in (0.0, 1.0):
        if _close(out, ops.rms_norm(x, w, eps, offset)):
            return offset, ""
    return None, "its forward is not rms_norm(x) * weight or * (1 + weight)"


def _activation_of(act: nn.Module | None) -> str | None:
    """'silu', 'gelu' (erf) or 'gelu_tanh' when `act` computes that function (probed), else None."""
    if act is None or not callable(act):
        return None
    x = torch.linspace(-6, 6, 97, dtype=torch.float32)
    try:
        with torch.no_grad():
            y = act(x)
    except Exception:  # noqa: BLE001
        return None
    candidates = {"silu": F.silu(x), "gelu": F.gelu(x), "gelu_tanh": F.gelu(x, approximate="tanh")}
    for name, ref in candidates.items():
        if isinstance(y, torch.Tensor) and _close(y, ref, 1e-6):
            return name
    return None


def _probe_mlp(module: nn.Module, act: str | None) -> tuple[str | None, str]:
    """(act, "") when the module is down(act(gate(x)) * up(x)) with `act` (what its act_fn
    computes, see _activation_of) one of ours, else (None, reason)."""
    children = [getattr(module, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
    if not all(isinstance(c, nn.Linear) for c in children):
        return None, "no gate_proj/up_proj/down_proj Linear children"
    if act is None:
        return None, f"activation {type(_act_module(module)).__name__} is not SiLU or GELU"
    g = _generator()
    gate, up, down = (nn.Linear(8, 16), nn.Linear(8, 16), nn.Linear(16, 8))
    for lin in (gate, up, down):
        nn.init.normal_(lin.weight, generator=g)
        nn.init.normal_(lin.bias, generator=g)
    x = torch.randn(3, 8, generator=g)
    actf = {"silu": F.silu, "gelu": F.gelu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh")}[act]
    try:
        with torch.no_grad():
            out = type(module).forward(_Stand(module, gate_proj=gate, up_proj=up, down_proj=down), x)
            ref = down(actf(gate(x)) * up(x))
    except Exception as e:  # noqa: BLE001
        return None, f"its forward failed on a probe ({type(e).__name__})"
    if not isinstance(out, torch.Tensor) or not _close(out, ref):
        return None, "its forward is not down(act(gate(x)) * up(x))"
    return act, ""


def _probe_gate_up_mlp(module: nn.Module, act: str | None) -> tuple[str | None, str]:
    """(act, "") when the module is down(act(gate) * up) with [gate | up] = gate_up_proj(x)
    (Phi3MLP, Glm4MLP) and `act` one of ours, else (None, reason)."""
    children = [getattr(module, n, None) for n in ("gate_up_proj", "down_proj")]
    if any(isinstance(c, torch.Tensor) and c.dim() == 3 for c in children):
        return None, "mixture-of-experts weights (one 3-D tensor for all experts): Hugging Face's code runs them"
    if not all(isinstance(c, nn.Linear) for c in children):
        return None, "no gate_up_proj/down_proj Linear children"
    if act is None:
        return None, f"activation {type(_act_module(module)).__name__} is not SiLU or GELU"
    g = _generator()
    gate_up, down = nn.Linear(8, 32), nn.Linear(16, 8)
    for lin in (gate_up, down):
        nn.init.normal_(lin.weight, generator=g)
        nn.init.normal_(lin.bias, generator=g)
    x = torch.randn(3, 8, generator=g)
    actf = {"silu": F.silu, "gelu": F.gelu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh")}[act]
    try:
        with torch.no_grad():
            out = type(module).forward(_Stand(module, gate_up_proj=gate_up, down_proj=down), x)
            gu = gate_up(x)
            ref = down(actf(gu[..., :16]) * gu[..., 16:])
    except Exception as e:  # noqa: BLE001
        return None, f"its forward failed on a probe ({type(e).__name__})"
    if not isinstance(out, torch.Tensor) or not _close(out, ref):
        return None, "its forward is not down(act(gate) * up) with [gate | up] = gate_up_proj(x)"
    return act, ""


def _act_module(module: nn.Module):
    """The activation module of an MLP: act_fn (LLaMA's name) or activation_fn (Phi-3's)."""
    act = getattr(module, "act_fn", None)
    return act if act is not None else getattr(module, "activation_fn", None)


# The rope forms ours computes: (name, our function with HF's signature, the cos/sin it takes from
# the angles (B, S, rot_dim / 2)). A modeling module's apply_rotary_pos_emb is replaced by the first
# form it agrees with (_probe_rope).
_ROPE_FORMS = (
    ("rotate-half", "apply_rotary_pos_emb", lambda ang: torch.cat((ang, ang), -1)),
    ("interleaved", "apply_rotary_pos_emb_interleaved", lambda ang: torch.cat((ang, ang), -1)),
    ("interleaved, cos/sin repeated per pair", "apply_rotary_pos_emb_interleaved_pairs",
     lambda ang: ang.repeat_interleave(2, -1)),
    ("rotate-half, half-width cos/sin", "apply_rotary_pos_emb_halfwidth", lambda ang: ang),
)


def _probe_rope(fn) -> tuple[object | None, str]:
    """(our function, "") for the first of _ROPE_FORMS that fn(q, k, cos, sin) computes, else
    (None, reason). Probed with the form's cos/sin over all of the head dim and, for partial rotary
    (Phi-4-mini, GLM), over half of it: there fn must agree too, or refuse the call (raise)."""
    g = _generator()
    d = 64
    q, k = torch.randn(2, 4, 5, d, generator=g), torch.randn(2, 2, 5, d, generator=g)
    failed = ""
    for name, ours, layout in _ROPE_FORMS:
        ours = getattr(ops, ours)
        agrees = True
        for rot_dim in (d, d // 2):
            ang = torch.rand(2, 5, rot_dim // 2, generator=g) * 6.0
            emb = layout(ang)
            cos, sin = emb.cos(), emb.sin()
            try:
                with torch.no_grad():
                    qh, kh = fn(q, k, cos, sin)
            except Exception as e:  # noqa: BLE001
                if rot_dim == d:
                    agrees, failed = False, failed or type(e).__name__
                    break
                continue  # fn takes no partial rotary in this form: the model cannot call it so
            with torch.no_grad():
                qo, ko = ours(q, k, cos, sin)
            if not (_close(qh, qo) and _close(kh, ko)):
                agrees = False
                break
        if agrees:
            return ours, ""
    forms = ", ".join(f[0] for f in _ROPE_FORMS)
    return None, f"it is none of the forms ours computes ({forms})" + (f"; it failed on some probes ({failed})"
                                                                       if failed else "")


# The rotary embedding forms ops.rope_angles computes: (name, duplicated halves?, float32 out?),
# i.e. emb = cat((freqs, freqs)) or freqs, cast to x's dtype or kept in float32.
_ROTARY_FORMS = (("LLaMA's", True, False), ("kept in float32 (OLMo 2, ERNIE 4.5)", True, True),
                 ("half width (gpt-oss)", False, False))


def rotary_forward(self, x: torch.Tensor, position_ids: torch.Tensor, duplicate: bool = True, fp32: bool = False):
    """A rotary embedding module's forward under kernelize: (cos, sin) from self.inv_freq and the
    positions in one launch (ops.rope_angles: the fp32 angle, cos / sin times attention_scaling,
    in x's dtype or float32, halves duplicated or not, as the probed form of the class's forward)
    where our kernels take the call, else the class's own forward (always with
    LLMK_ROTARY_ANGLES=0). An inv_freq cast to 16 bits (`model.to(torch.bfloat16)` casts buffers) is
    upcast first, as the classes' forwards do (`self.inv_freq[None, :, None].float()`)."""
    inv = self.inv_freq
    if (isinstance(position_ids, torch.Tensor) and position_ids.dim() == 2
            and os.environ.get("LLMK_ROTARY_ANGLES") != "0"
            and position_ids.dtype in (torch.int64, torch.int32) and inv.is_floating_point() and inv.dim() == 1
            and x.dtype in (torch.float32, torch.float16, torch.bfloat16)
            and inv.device == position_ids.device == x.device and inv.device.type in ("cpu", "cuda")
            and not (torch.is_grad_enabled() and inv.requires_grad)):
        return ops.rope_angles(inv.float(), position_ids, float(self.attention_scaling),
                               torch.float32 if fp32 else x.dtype, duplicate=duplicate)
    return type(self).forward(self, x, position_ids)


def _rotary_forward_of(duplicate: bool, fp32: bool):
    """rotary_forward for one form, as a plain function (torch.compile traces it; a
    functools.partial bound as a method it does not)."""
    def forward(self, x, position_ids):
        return rotary_forward(self, x, position_ids, duplicate, fp32)
    return forward


def _probe_rotary(module: nn.Module) -> tuple[tuple | None, str]:
    """((duplicate, fp32), "") for the first of _ROTARY_FORMS that the module's forward(x,
    position_ids) computes, checked on CPU tensors; else (None, the reason)."""
    rope_type = str(getattr(module, "rope_type", "default"))
    if "dynamic" in rope_type or "longrope" in rope_type:
        return None, f"its angles change with the sequence length (rope_type {rope_type!r})"
    inv, scaling = getattr(module, "inv_freq", None), getattr(module, "attention_scaling", None)
    if not isinstance(inv, torch.Tensor) or inv.dim() != 1 or not inv.is_floating_point():
        return None, "it has no inv_freq vector"
    if not isinstance(scaling, (int, float)) or isinstance(scaling, bool):
        return None, "it has no attention_scaling number"
    if list(inspect.signature(type(module).forward).parameters) != ["self", "x", "position_ids"]:
        return None, f"its forward takes {inspect.signature(type(module).forward)}, not (x, position_ids)"
    g = _generator()
    positions = torch.randint(0, 5000, (2, 5), generator=g)
    stand = _Stand(module, inv_freq=inv.detach().cpu())
    results = {}
    for dtype in (torch.float32, torch.bfloat16):
        try:
            with torch.no_grad():
                results[dtype] = type(module).forward(stand, torch.zeros(2, 5, 8, dtype=dtype), positions)
        except Exception as e:  # noqa: BLE001
            return None, f"its forward failed on a probe ({type(e).__name__})"
    for _, duplicate, fp32 in _ROTARY_FORMS:
        agrees = True
        for dtype, got in results.items():
            out_dtype = torch.float32 if fp32 else dtype
            with torch.no_grad():
                ours = ops.rope_angles(stand.inv_freq.float(), positions, float(scaling), out_dtype, duplicate=duplicate)
            tol = 1e-5 if out_dtype == torch.float32 else 1e-2
            agrees = agrees and isinstance(got, tuple) and len(got) == 2 and all(
                isinstance(t, torch.Tensor) and t.dtype == out_dtype and _close(t, o, tol) for t, o in zip(got, ours))
        if agrees:
            return (duplicate, fp32), ""
    forms = ", ".join(f[0] for f in _ROTARY_FORMS)
    return None, f"its angles are none of the forms ours computes ({forms})"


def _code_names(fn) -> set[str]:
    fn = inspect.unwrap(fn)
    code = getattr(fn, "__code__", None)
    return set(code.co_names) if code is not None else set()


def _has_hooks(module: nn.Module) -> str:
    if "forward" in module.__dict__ or hasattr(module, "_hf_hook"):
        return "its forward is patched on the instance (accelerate offload hooks?)"
    if module._forward_hooks or module._forward_pre_hooks:
        return "it has forward hooks"
    return ""


# ------------------------------------------------------------------------------------- state
@dataclasses.dataclass
class _State:
    modules: list  # (qualified name, original module), in swap order
    rope: list  # modeling module names patched
    attn_config: object | None = None
    attn_original: str | None = None
    mode: str = "inference"
    fused: list = dataclasses.field(default_factory=list)  # fusion.FusedGroup, undone first
    kv_cache: bool = False  # holds a reference on the StaticLayer.update patch
    layer_forwards: list = dataclasses.field(default_factory=list)  # layers given fuse.layer_forward
    rotary_forwards: list = dataclasses.field(default_factory=list)  # (name, module) given rotary_forward
    inner: tuple | None = None  # (name, module): a composite model's language model, kernelized on its own


_ROPE_PATCHES: dict[str, list] = {}  # modeling module name -> [original function, count]


def _patch_rope(modname: str, ours) -> None:
    mod = sys.modules[modname]
    entry = _ROPE_PATCHES.get(modname)
    if entry is None:
        _ROPE_PATCHES[modname] = [mod.apply_rotary_pos_emb, 1]
        mod.apply_rotary_pos_emb = ours
    else:
        entry[1] += 1


def _unpatch_rope(modname: str) -> None:
    entry = _ROPE_PATCHES.get(modname)
    if entry is None:
        return
    entry[1] -= 1
    if entry[1] == 0:
        sys.modules[modname].apply_rotary_pos_emb = entry[0]
        del _ROPE_PATCHES[modname]


def _original_rope(modname: str):
    entry = _ROPE_PATCHES.get(modname)
    return entry[0] if entry else getattr(sys.modules[modname], "apply_rotary_pos_emb", None)


# ------------------------------------------------------------------------------- kv cache
_KV_PATCH: list = []  # [StaticLayer, its original update, reference count] while patched


def _static_layer_class():
    try:
        from transformers.cache_utils import StaticLayer
    except ImportError:  # pragma: no cover - transformers without per-layer caches
        return None
    return StaticLayer


def _one_token_update(layer, key_states: torch.Tensor, value_states: torch.Tensor) -> bool:
    """Whether write_kv_cache can do this StaticLayer.update exactly as HF's code would: one new
    position per sequence, written at cumulative_length, into the layer's (B, Hkv, Smax, D) tensors."""
    if type(layer) is not _KV_PATCH[0] or not getattr(layer, "is_initialized", False):
        return False
    keys, values, length = getattr(layer, "keys", None), getattr(layer, "values", None), getattr(layer, "cumulative_length", None)
    if not all(isinstance(t, torch.Tensor) for t in (keys, values, length)):
        return False
    if length.dim() != 0 or length.dtype not in (torch.int32, torch.int64) or length.device != keys.device:
        return False
    if key_states.dim() != 4 or key_states.shape[2] != 1 or key_states.shape != value_states.shape:
        return False
    if keys.shape != values.shape or key_states.shape[:2] != keys.shape[:2] or key_states.shape[3] != keys.shape[3]:
        return False
    if any(t.dtype != keys.dtype or t.device != keys.device for t in (values, key_states, value_states)):
        return False
    if keys.device.type not in ("cpu", "cuda"):  # our kernels' devices (CUDA and ROCm torch)
        return False
    if keys.dtype not in (torch.float16, torch.bfloat16, torch.float32) or keys.stride(-1) != 1 or values.stride(-1) != 1:
        return False
    return not (torch.is_grad_enabled() and (key_states.requires_grad or value_states.requires_grad))


def _static_layer_update(self, key_states, value_states, *args, **kwargs):
    """transformers' StaticLayer.update while kernelize's kv_cache patch is on: a decode step's
    update (one token) writes K and V at position cumulative_length and advances the length in one
    launch (at batch 1; torch.compile: a separate add_); anything else runs the original. (Past the
    capacity the GPU kernel skips the write where index_copy_ fails; the CPU raises.) Inside a fused
    decoder layer the rotation of q and k may come with this write (rope_kv.py)."""
    if rope_kv.take_update(self, key_states, value_states):
        return self.keys, self.values
    if not _one_token_update(self, key_states, value_states):
        return _KV_PATCH[1](self, key_states, value_states, *args, **kwargs)
    positions = self.cumulative_length.view(1, 1).expand(key_states.shape[0], 1)
    k_new, v_new = key_states.transpose(1, 2), value_states.transpose(1, 2)
    if torch.compiler.is_compiling():  # the counter aliases the positions: keep the mutation plain
        decode.write_kv_cache(self.keys, self.values, k_new, v_new, positions)
        self.cumulative_length.add_(1)
    else:  # the length moves in the write's launch at batch 1 (no add_ launch)
        decode.write_kv_cache(self.keys, self.values, k_new, v_new, positions, advance=self.cumulative_length)
    return self.keys, self.values


def _patch_kv_cache() -> str:
    """Takes a reference on the StaticLayer.update patch; the reason when it cannot apply."""
    if _KV_PATCH:
        _KV_PATCH[2] += 1
        return ""
    cls = _static_layer_class()
    if cls is None:
        return "this transformers has no transformers.cache_utils.StaticLayer"
    original = cls.__dict__.get("update")
    missing = [n for n in ("update", "lazy_initialization") if not callable(getattr(cls, n, None))]
    if original is None or missing:
        return f"StaticLayer lacks {', '.join(missing) or 'its own update'}"
    try:  # transformers 5.x keeps the write position in a device tensor; 4.x takes cache_position
        counted = isinstance(getattr(cls(max_cache_len=1), "cumulative_length", None), torch.Tensor)
    except Exception:  # noqa: BLE001 - another constructor: not the layer this patch knows
        counted = False
    if not counted:
        return "StaticLayer has no cumulative_length tensor (transformers < 5): HF's update is kept"
    _KV_PATCH[:] = [cls, original, 1]
    cls.update = _static_layer_update
    return ""


def _unpatch_kv_cache() -> None:
    if not _KV_PATCH:
        return
    _KV_PATCH[2] -= 1
    if _KV_PATCH[2] == 0:
        _KV_PATCH[0].update = _KV_PATCH[1]
        _KV_PATCH.clear()


def _set_child(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, new)


def _same_parameters(old: nn.Module, new: nn.Module) -> str:
    a, b = old.state_dict(keep_vars=True), new.state_dict(keep_vars=True)
    if list(a) != list(b) and sorted(a) != sorted(b):
        return f"the replacement's state dict keys differ ({sorted(a)} vs {sorted(b)})"
    for key in a:
        if a[key] is not b[key]:
            return f"the replacement does not share {key}"
    return ""


# -------------------------------------------------------------------------------- attention
def _hf_sdpa_forward():
    try:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
    except ImportError:  # pragma: no cover - transformers < 4.48
        return None
    return sdpa_attention_forward


_HF_SDPA = None
# id(config) -> count, for models kernelized from the "eager" implementation (or none set): the
# calls our kernels do not take go to their modeling module's own eager_attention_forward, which
# may do more than HF's sdpa can (Gemma 2's logit soft-capping, gpt-oss's attention sinks).
_EAGER_CONFIGS: dict[int, int] = {}
_FULL_LENGTHS: dict = {}  # (batch, kv_len, device) -> int32 seq_lens tensor, made once (graph-safe)


def _full_lengths(batch: int, kv_len: int, device: torch.device) -> torch.Tensor:
    key = (batch, kv_len, device)
    if key not in _FULL_LENGTHS:
        _FULL_LENGTHS[key] = torch.full((batch,), kv_len, dtype=torch.int32, device=device)
    return _FULL_LENGTHS[key]


# Decode workspaces kept per attention module (LLMK_DECODE_KEEP_WORKSPACE=0, read at import: one
# from torch's caching allocator per call, whose split counters need a memset node each call):
# module -> {(device, dtype, q shape, cache shape): zeroed uint8 tensor, or None where the call
# needs no workspace}. decode_attention leaves the counters zero, and their offset (behind rows x
# splits partial results) follows from the shapes, so a kept workspace stays valid for every call
# of its key, whose size is asked for once (not at every step); one per module, so a workspace is
# shared by no more than the module's own KV cache is. Never evicted: a CUDA graph may hold its
# address (a handful of entries a module: the query shapes of prefill's last tokens and decode).
KEEP_DECODE_WORKSPACE = os.environ.get("LLMK_DECODE_KEEP_WORKSPACE", "1") != "0"
_KEPT_WORKSPACES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _kept_workspace(module: nn.Module, q: torch.Tensor, k_cache: torch.Tensor) -> torch.Tensor | None:
    """The zeroed workspace kept on `module` for decode_attention(q (B, T, Hq, D), k_cache), or None
    where it does not apply (off, the CPU, torch.compile tracing, or one split: no workspace)."""
    if not KEEP_DECODE_WORKSPACE or not q.is_cuda or module is None or torch.compiler.is_compiling():
        return None
    kept = _KEPT_WORKSPACES.setdefault(module, {})
    key = (q.device, q.dtype, tuple(q.shape), tuple(k_cache.shape))
    if key not in kept:
        nbytes = decode.decode_workspace_size(q, k_cache)
        kept[key] = torch.zeros(nbytes, dtype=torch.uint8, device=q.device) if nbytes else None
    return kept[key]


def _masked_decode(module, query, key, value, attention_mask, scaling):
    """Decode steps with a mask (a static cache: the mask hides the empty slots and the future) on
    our decode kernel, which reads the cache (B, Hkv, Smax, D) in place with the mask, or without it
    up to the sequences' exact lengths where our mask function tagged it as the plain causal mask
    (_exact_lengths); None when the call is not one it takes (then HF's sdpa runs it)."""
    B, Hq, T, D = query.shape
    m = attention_mask
    if T > 8 or m.dim() != 4 or m.shape[1] != 1 or m.shape[0] != B or m.shape[2] != T or m.shape[3] != key.shape[2]:
        return None
    if m.dtype not in (torch.bool, torch.float32, query.dtype) or Hq % key.shape[1] != 0:
        return None
    if query.is_cuda and (query.dtype not in (torch.float16, torch.bfloat16) or D not in (64, 128, 256)
                          or key.stride(-1) != 1 or value.stride(-1) != 1):
        return None
    if query.requires_grad or key.requires_grad or value.requires_grad:
        return None
    if not query.is_cuda and not flash.use_on_cpu:
        return None
    q = query.transpose(1, 2)
    workspace = _kept_workspace(module, q, key)
    exact = getattr(m, _EXACT_LENGTHS_ATTR, None)  # set only with EXACT_LENGTHS on
    if exact is not None and exact.device == query.device:
        # the mask is causal_mask_function's alone: keys 0 .. position of token t, which is what
        # seq_lens = last position + 1 with the kernel's causal limit (seq_lens - T + t) shows
        seq_lens, m = exact, None
    else:
        # seq_lens = the whole cache: the T new tokens are its last written positions or earlier,
        # so the kernel's causal limit (position Smax - T + t) never hides a key the mask shows.
        seq_lens = _full_lengths(B, key.shape[2], query.device)
    out = decode.decode_attention(q, key, value, seq_lens, scale=scaling, attn_mask=m, workspace=workspace,
                                  workspace_zeroed=workspace is not None)
    return out  # (B, T, Hq, D): the layout HF wants back


# Attention-function arguments that change what is computed and that our kernels do not take:
# soft-capping (Gemma 2), sinks (gpt-oss's s_aux; sinks elsewhere), a position bias (T5-style),
# packed sequences (cu_seq_lens_q: flash-attention's varlen form).
_UNUSUAL = ("softcap", "s_aux", "sinks", "position_bias", "cu_seq_lens_q")


def attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    """The "llm_kernels" attention implementation for transformers' AttentionInterface: query
    (B, Hq, Sq, D), key/value (B, Hkv, Skv, D) -> ((B, Sq, Hq, D), None). Calls without a mask,
    dropout or extras go to flash.sdpa (our kernel where it takes them); decode steps (up to 8 new
    tokens) with a mask of one row per token (a static cache) to decode_attention with the mask;
    the rest to the model's original implementation (_eager_fallback, else HF's sdpa)."""
    unusual = any(kwargs.get(k) is not None for k in _UNUSUAL) or kwargs.get("output_attentions")
    if attention_mask is None and dropout == 0.0 and not unusual:
        q_len, kv_len = query.shape[2], key.shape[2]
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        causal = bool(causal) and q_len > 1
        if causal and kv_len > q_len:
            # Only reached for prefill into an empty static cache (HF's masks skip to None then
            # and no further): the slots past q_len are empty, as HF's sdpa path also assumes.
            key, value = key[:, :, :q_len], value[:, :, :q_len]
            kv_len = q_len
        if not causal or q_len == kv_len:
            out = flash.sdpa(query, key, value, is_causal=causal, scale=scaling,
                             enable_gqa=query.shape[1] != key.shape[1])
            return out.transpose(1, 2).contiguous(), None
    if attention_mask is not None and dropout == 0.0 and not unusual:
        out = _masked_decode(module, query, key, value, attention_mask, scaling)
        if out is not None:
            return out, None
    eager = _eager_fallback(module, unusual)
    if eager is not None:
        mask = _additive_mask(module, query, key, attention_mask, is_causal, kwargs)
        kwargs.pop("is_causal", None)
        return eager(module, query, key, value, mask, dropout=dropout, scaling=scaling, **kwargs)
    return _HF_SDPA(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal,
                    **kwargs)


def _eager_fallback(module, unusual: bool):
    """The modeling module's eager_attention_forward when module belongs to a model kernelized
    from the eager implementation, or when the call carries what HF's sdpa cannot do (soft-capping,
    sinks, a position bias, attention weights to return: a model built with
    attn_implementation="llm_kernels" directly, Gemma 2 or gpt-oss, say); else None (HF's sdpa
    takes the call)."""
    if not unusual and id(getattr(module, "config", None)) not in _EAGER_CONFIGS:
        return None
    return getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)


def _additive_mask(module, query, key, attention_mask, is_causal, kwargs):
    """The mask for an eager attention function, which adds it to the scores: our registered mask
    rules are sdpa's (a boolean mask, True = attend, or None where sdpa's own causal flag does the
    masking), so None becomes the causal mask HF's sdpa forward applies then (torch's is_causal:
    top-left aligned, which is right for the one case of q_len < kv_len that gets there, a prefill
    into an empty static cache) and a boolean mask 0 / the dtype's lowest value."""
    q_len, kv_len = query.shape[2], key.shape[2]
    if attention_mask is None:
        causal = kwargs.get("is_causal", is_causal)
        causal = getattr(module, "is_causal", True) if causal is None else causal
        if not causal or q_len == 1:
            return None
        attention_mask = torch.ones(1, 1, q_len, kv_len, dtype=torch.bool, device=query.device).tril()
    if attention_mask.dtype == torch.bool:
        low = torch.finfo(query.dtype).min
        attention_mask = torch.zeros(attention_mask.shape, dtype=query.dtype, device=query.device).masked_fill(
            ~attention_mask, low)
    return attention_mask


def register_attention() -> str:
    """Registers "llm_kernels" with transformers' AttentionInterface and its AttentionMaskInterface
    (sdpa's mask rules, so maskless causal calls reach us without a mask). Returns '' or why it
    cannot: without the mask interface (transformers < 4.53 or so) every call would carry a 4-D
    mask and go to HF's sdpa anyway, so there is nothing to gain."""
    global _HF_SDPA
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask  # noqa: F401 (_causal_mask_with_lengths calls it)
    except ImportError:
        return "this transformers has no AttentionInterface / AttentionMaskInterface (needs a 2025 release, 4.53+)"
    _HF_SDPA = _hf_sdpa_forward()
    if _HF_SDPA is None:
        return "this transformers has no integrations.sdpa_attention"
    AttentionInterface.register(ATTN_NAME, attention_forward)
    AttentionMaskInterface.register(ATTN_NAME, _causal_mask_with_lengths)
    return ""


# Decode steps over a static cache without a padding mask (a model called with no attention_mask):
# HF's mask is then causal_mask_function's alone, so our mask function tags it with the exact
# lengths (last query position + 1, a device tensor: graph-safe) and _masked_decode runs the
# unmasked kernel up to them instead of the masked one over the whole capacity (H200, 2026-12-03:
# 8.4-9.0 against 10.4-11.0 us a 1B-model call; the 1B e2e without step masks on an H100,
# 2026-12-06: 936 against 912-914 tok/s after 128 tokens, 910-911 against 869-871 after 1000).
# LLMK_DECODE_EXACT_LENGTHS=0 (read at import) turns it off. A mask with a padding mask, another mask
# function (sliding windows, packing) or an offset is not tagged; every call our kernel does not
# take uses the mask itself.
EXACT_LENGTHS = os.environ.get("LLMK_DECODE_EXACT_LENGTHS", "1") != "0"
_EXACT_LENGTHS_ATTR = "_llmk_exact_seq_lens"


def _causal_mask_with_lengths(*args, **kwargs):
    """sdpa's mask function (registered for "llm_kernels"), its mask tagged with the exact lengths
    where _exact_lengths finds them."""
    from transformers.masking_utils import sdpa_mask

    mask = sdpa_mask(*args, **kwargs)
    if EXACT_LENGTHS and not args:
        lengths = _exact_lengths(mask, kwargs)
        if lengths is not None:
            setattr(mask, _EXACT_LENGTHS_ATTR, lengths)
    return mask


def _exact_lengths(mask, kw: dict) -> torch.Tensor | None:
    """int32 (B,) lengths (last query position + 1) where `mask` (sdpa_mask's, from keyword
    arguments kw) is the plain causal mask of a decode step (up to 8 new tokens) over a cache:
    no padding mask, causal_mask_function, no key offset, the positions in a tensor (static caches:
    q_offset in transformers 5; cache_position in 4.5x, one token only, since its mask uses every
    token's position and the tag only the last), and not while torch.compile traces; else None."""
    from transformers.masking_utils import causal_mask_function

    if not isinstance(mask, torch.Tensor) or mask.dim() != 4 or mask.dtype != torch.bool:
        return None
    if kw.get("attention_mask") is not None or kw.get("mask_function", causal_mask_function) is not causal_mask_function:
        return None
    if kw.get("kv_offset", 0) != 0 or kw.get("local_size") is not None or torch.compiler.is_compiling():
        return None
    batch, q_len = mask.shape[0], mask.shape[2]
    if q_len > 8:
        return None
    if isinstance(kw.get("q_offset"), torch.Tensor):  # transformers 5: the first query's position
        last = kw["q_offset"].reshape(-1)[:1] + q_len
    elif isinstance(kw.get("cache_position"), torch.Tensor) and kw["cache_position"].numel() == q_len == 1:
        last = kw["cache_position"].reshape(-1)[-1:] + 1
    else:
        return None
    return last.to(device=mask.device, dtype=torch.int32).expand(batch).contiguous()


# --------------------------------------------------------------------------------- kernelize
def _model_type(model: nn.Module) -> str | None:
    config = getattr(model, "config", None)
    return getattr(config, "model_type", None)


def _decoder_layers(model: nn.Module) -> tuple[str, nn.ModuleList] | None:
    for name, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList) and name.split(".")[-1] == "layers" and len(mod) > 0:
            return name, mod
    return None


def _linear_class():
    return getattr(layers, "Linear", None)


def _make_linear(cls, linear: nn.Linear):
    for factory in ("from_module", "from_linear", "from_dense"):
        fn = getattr(cls, factory, None)
        if fn is not None:
            made = fn(linear)
            return made[0] if isinstance(made, tuple) else made
    return None


def kernelize(
    model: nn.Module,
    mode: str = "inference",
    ops: Iterable[str] | None = None,
    monarch_last: int | None = None,
    monarch_nblocks: int = 4,
    fuse: bool = True,
) -> KernelizeReport:
    """Swaps, in place, the RMSNorm, MLP, rotary embedding, attention and (when layers.Linear exists)
    Linear layers of a Hugging Face model (one of SUPPORTED_MODEL_TYPES) for ours.

    mode: "inference", or "training" (only ops with a backward: rms_norm, mlp, rope).
    ops: the families to swap, a subset of FAMILIES (default all).
    monarch_last: convert the q/k/v/o projections of the last N decoder layers to MonarchLinear
    with `monarch_nblocks` blocks (lossy: changes those layers' parameters; unkernelize restores).
    fuse: (inference mode) run gate+up and q+k+v as one skinny GEMM each at decode shapes.
    Returns the report: one Swap per module or function considered. A model already kernelized is
    unkernelized first. Unsupported models are left alone (one record saying why).
    """
    if mode not in MODES:
        raise ValueError(f"llm_kernels.kernelize: mode: expected 'inference' or 'training', got {mode!r}")
    families = FAMILIES if ops is None else tuple([ops] if isinstance(ops, str) else ops)
    for f in families:
        if f not in FAMILIES:
            raise ValueError(f"llm_kernels.kernelize: ops: unknown family {f!r}; expected some of {', '.join(FAMILIES)}")
    if monarch_last is not None and monarch_last < 0:
        raise ValueError(f"llm_kernels.kernelize: monarch_last: expected >= 0, got {monarch_last}")
    if getattr(model, _STATE_ATTR, None) is not None:
        unkernelize(model)

    report = KernelizeReport()

    def allowed(family: str) -> str:
        if family not in families:
            return "not in ops="
        if mode == "training":
            if family == "linear":
                cls = _linear_class()
                if cls is not None and not getattr(cls, "supports_backward", False):
                    return "mode='training': layers.Linear has no backward"
            elif not _HAS_BACKWARD[family]:
                return "mode='training': this op has no backward yet"
        return ""

    model_type = _model_type(model)
    if model_type not in SUPPORTED_MODEL_TYPES:
        inner = _language_model(model)
        if inner is not None:  # a vision-language model: its text decoder is one we take
            return _kernelize_language_model(model, *inner, report, allowed, mode=mode, ops=ops,
                                             monarch_last=monarch_last, monarch_nblocks=monarch_nblocks, fuse=fuse)
        what = f"model type {model_type!r}" if model_type else f"{type(model).__name__} (not a transformers model)"
        report.append(Swap("", "model", _qualname(model), None,
                           f"{what} is not supported (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"))
        return report

    state = _State(modules=[], rope=[], mode=mode)
    object.__setattr__(model, _STATE_ATTR, state)

    def swap(name: str, family: str, old: nn.Module, new: nn.Module) -> None:
        _swap(model, state, report, name, family, old, new)

    # Monarch first: those projections then stay out of the Linear swap.
    if monarch_last:
        found = _decoder_layers(model)
        if found is None:
            report.append(Swap("", "monarch", _qualname(model), None, "no decoder layer list found"))
        else:
            prefix, layer_list = found
            n = len(layer_list)
            names = []
            for i in range(max(0, n - monarch_last), n):
                for proj in ("q_proj", "k_proj", "v_proj", "qkv_proj", "o_proj"):  # qkv_proj: Phi-3
                    name = f"{prefix}.{i}.self_attn.{proj}"
                    try:
                        mod = model.get_submodule(name)
                    except AttributeError:
                        continue
                    if type(mod) is nn.Linear:
                        names.append((name, mod))
            records = {r.name: r for r in monarch.monarchize(model, [n for n, _ in names], monarch_nblocks)}
            for name, old in names:
                rec = records.get(name)
                if rec is None:
                    report.append(Swap(name, "monarch", _qualname(old), None, "not converted"))
                    continue
                state.modules.append((name, old))
                report.append(Swap(name, "monarch", _qualname(old), _qualname(model.get_submodule(name)),
                                   f"relative weight error {rec.relative_error:.3g}"))

    named = list(model.named_modules())

    # RMSNorm
    probed: dict[type, tuple] = {}
    for name, mod in named:
        if not type(mod).__name__.endswith("RMSNorm") or isinstance(mod, layers.RMSNorm):
            continue
        why = allowed("rms_norm") or _has_hooks(mod)
        if not why:
            if type(mod) not in probed:
                probed[type(mod)] = _probe_rms_norm(mod)
            offset, why = probed[type(mod)]
        if why:
            report.append(Swap(name, "rms_norm", _qualname(mod), None, why))
            continue
        swap(name, "rms_norm", mod, layers.RMSNorm.from_module(mod, offset=offset))

    # MLP: separate gate_proj / up_proj (LLaMA), or one gate_up_proj (Phi-3, GLM-4)
    probed = {}
    for name, mod in named:
        packed = hasattr(mod, "gate_up_proj") and hasattr(mod, "down_proj")
        if not packed and not (hasattr(mod, "gate_proj") and hasattr(mod, "up_proj") and hasattr(mod, "down_proj")):
            continue
        if isinstance(mod, (layers.LlamaMLP, GatedMLP, layers.GateUpMLP)):
            continue
        why = allowed("mlp") or _has_hooks(mod)
        if not why:
            act = _activation_of(_act_module(mod))  # per instance; the structure per class
            if (type(mod), act) not in probed:
                probed[(type(mod), act)] = (_probe_gate_up_mlp if packed else _probe_mlp)(mod, act)
            act, why = probed[(type(mod), act)]
        if why:
            report.append(Swap(name, "mlp", _qualname(mod), None, why))
            continue
        if packed:
            new = layers.GateUpMLP.from_module(mod, act)
        elif act == "silu":
            new = layers.LlamaMLP.from_module(mod)
        else:
            new = GatedMLP.from_module(mod, "tanh" if act == "gelu_tanh" else "none")
        swap(name, "mlp", mod, new)

    # Rotary embedding: the modeling modules whose attention forward calls apply_rotary_pos_emb.
    attn_classes = {}
    for name, mod in named:
        names_used = _code_names(type(mod).forward) if type(mod).__name__.endswith("Attention") else set()
        if "apply_rotary_pos_emb" in names_used or "ALL_ATTENTION_FUNCTIONS" in names_used:
            attn_classes.setdefault(type(mod), (name, names_used))
    for cls, (first, names_used) in attn_classes.items():
        if "apply_rotary_pos_emb" not in names_used:
            continue
        modname = cls.__module__
        label = f"{modname}.apply_rotary_pos_emb"
        original = _original_rope(modname)
        why = allowed("rope")
        if not why and original is None:
            why = "the modeling module has no apply_rotary_pos_emb"
        ours = None
        if not why:
            ours, why = _probe_rope(original)
        if why:
            report.append(Swap(label, "rope", _qualname(original) if original else label, None, why))
            continue
        _patch_rope(modname, ours)
        state.rope.append(modname)
        report.append(Swap(label, "rope", _qualname(original), f"llm_kernels.ops.{ours.__name__}"))

    # Rotary angles: each *RotaryEmbedding module whose forward computes one of _ROTARY_FORMS gets
    # rotary_forward (the instance's forward; the module object and its buffers stay).
    probed = {}
    for name, mod in named:
        if not type(mod).__name__.endswith("RotaryEmbedding"):
            continue
        why, form = allowed("rope") or _has_hooks(mod), None
        if not why:
            key = (type(mod), str(getattr(mod, "rope_type", None)))
            if key not in probed:
                probed[key] = _probe_rotary(mod)
            form, why = probed[key]
        if why:
            report.append(Swap(name, "rope", _qualname(mod), None, why))
            continue
        object.__setattr__(mod, "forward", types.MethodType(_rotary_forward_of(*form), mod))
        state.rotary_forwards.append((name, mod))
        report.append(Swap(name, "rope", _qualname(mod), "llm_kernels.hf.rotary_forward",
                           "cos and sin in one launch (ops.rope_angles)"))

    # Attention
    config = getattr(model, "config", None)
    current = getattr(config, "_attn_implementation", None)
    label = "config._attn_implementation"
    why = allowed("attention")
    if not why and not any("ALL_ATTENTION_FUNCTIONS" in n for _, n in attn_classes.values()):
        why = "the attention modules do not dispatch through ALL_ATTENTION_FUNCTIONS"
    if not why and current not in (None, "eager", "sdpa"):
        why = f"the model uses {current!r}; only eager and sdpa are replaced"
    if not why:
        why = register_attention()
    if why:
        report.append(Swap(label, "attention", str(current), None, why))
    else:
        state.attn_config, state.attn_original = config, current
        if current != "sdpa":
            _EAGER_CONFIGS[id(config)] = _EAGER_CONFIGS.get(id(config), 0) + 1
        config._attn_implementation = ATTN_NAME
        report.append(Swap(label, "attention", str(current), ATTN_NAME))

    # Linear (decode-shape GEMM), when layers.Linear exists.
    _swap_linears(model, state, report, allowed, list(model.named_modules()))

    # The static cache's decode-step update.
    label = "transformers.cache_utils.StaticLayer.update"
    why = allowed("kv_cache") or _patch_kv_cache()
    if why:
        report.append(Swap(label, "kv_cache", label, None, why))
    else:
        state.kv_cache = True
        report.append(Swap(label, "kv_cache", label, "llm_kernels.write_kv_cache",
                           "one-token updates in one launch (static caches of every model in this process)"))

    # Decode-shape GEMM fusion: [gate; up] with the SwiGLU epilogue, [q; k; v].
    if fuse:
        _fuse(model, report, state, swap, "" if mode == "inference" else "mode='training': fusion is for inference",
              allowed("linear"))
    return report


def _language_model(model: nn.Module) -> tuple[str, nn.Module] | None:
    """(name, module) of a composite model's text decoder (a vision-language model's
    `language_model`: the submodule whose config is the model's text config) when that text
    config's model type is one of ours; else None."""
    config = getattr(model, "config", None)
    try:
        text = config.get_text_config()
    except Exception:  # noqa: BLE001 - no text config: not a composite model
        return None
    if text is config or getattr(text, "model_type", None) not in SUPPORTED_MODEL_TYPES:
        return None
    for same in (lambda c: c is text, lambda c: c == text):  # (older transformers gave the submodule a copy)
        for name, mod in model.named_modules():
            if name and same(getattr(mod, "config", None)) and _decoder_layers(mod) is not None:
                return name, mod
    return None


# Report families whose records name modules (prefixed with the language model's name when kernelize
# takes a composite model's text decoder).
_MODULE_FAMILIES = ("rms_norm", "mlp", "linear", "fuse", "monarch")


def _kernelize_language_model(model: nn.Module, name: str, lm: nn.Module, report: KernelizeReport, allowed,
                              **kwargs) -> KernelizeReport:
    """kernelize of a vision-language model: its language model as a model of its own, plus the
    top-level Linear heads (lm_head) outside it; the vision tower and projector are left as they are."""
    inner = kernelize(lm, **kwargs)
    state = _State(modules=[], rope=[], mode=kwargs["mode"], inner=(name, lm))
    object.__setattr__(model, _STATE_ATTR, state)
    report.append(Swap(name, "model", _qualname(model), _qualname(lm),
                       f"its language model ({lm.config.model_type}) kernelized; the vision tower and projector "
                       "are left as they are"))
    for rec in inner:
        if rec.family in _MODULE_FAMILIES and rec.name:
            rec = dataclasses.replace(rec, name=f"{name}.{rec.name}")
        report.append(rec)
    _swap_linears(model, state, report, allowed, list(model.named_children()))
    return report


def _swap(model: nn.Module, state: _State, report: KernelizeReport, name: str, family: str, old: nn.Module,
          new: nn.Module) -> None:
    """Puts `new` in the place of `old` (recorded in state for unkernelize) when it shares old's
    parameters; either way one report line."""
    why = _same_parameters(old, new)
    if why:
        report.append(Swap(name, family, _qualname(old), None, why))
        return
    new.train(old.training)
    _set_child(model, name, new)
    state.modules.append((name, old))
    report.append(Swap(name, family, _qualname(old), _qualname(new)))


def _swap_linears(model: nn.Module, state: _State, report: KernelizeReport, allowed, named) -> None:
    """The linear family: every plain nn.Linear of `named` (name, module) -> layers.Linear."""
    lin_cls = _linear_class()
    for name, mod in named:
        if type(mod) is not nn.Linear:
            continue
        why = allowed("linear") or ("" if lin_cls is not None else "llm_kernels.layers.Linear does not exist yet")
        why = why or _has_hooks(mod)
        new = None
        if not why:
            try:
                new = _make_linear(lin_cls, mod)
            except Exception as e:  # noqa: BLE001
                why = f"layers.Linear refused it ({type(e).__name__}: {e})"
            if new is None and not why:
                why = "layers.Linear has no from_module(nn.Linear)"
        if why:
            report.append(Swap(name, "linear", _qualname(mod), None, why))
            continue
        _swap(model, state, report, name, "linear", mod, new)


_EPILOGUE_NAMES = {"swiglu": "SwiGLU", "geglu_tanh": "GEGLU-tanh"}


def _fuse(model: nn.Module, report: KernelizeReport, state: _State, swap, why_not: str, why_not_qkv: str) -> None:
    """gate+up of every swapped SiLU or GELU-tanh MLP (layers.LlamaMLP, GatedMLP; a layers.GateUpMLP's
    one weight runs as is); q+k+v of every *Attention module when the linear family is allowed (a single qkv_proj
    becomes a group of one, so that layer_forward can put the input norm in its prologue)."""
    for name, mod in list(model.named_modules()):
        epilogue = _EPILOGUE_NAMES.get(fusion.mlp_epilogue(mod))
        if type(mod) is layers.GateUpMLP and epilogue:
            label = f"{name}.gate_up_proj"
            why = why_not or fusion.fusable([mod.gate_up_proj]) or _has_hooks(mod.gate_up_proj)
            if why:
                report.append(Swap(label, "fuse", _qualname(mod), None, why))
                continue
            mod.fuse_decode = True
            report.append(Swap(label, "fuse", _qualname(mod), "llm_kernels.fuse.mlp_forward",
                               f"its gate/up weight as one skinny GEMM with the {epilogue} epilogue at <= 16 rows"))
        elif type(mod) in (layers.LlamaMLP, GatedMLP) and epilogue:
            label = f"{name}.gate_proj+up_proj"
            why = why_not or fusion.fusable([mod.gate_proj, mod.up_proj])
            why = why or _has_hooks(mod.gate_proj) or _has_hooks(mod.up_proj)
            if why:
                report.append(Swap(label, "fuse", _qualname(mod), None, why))
                continue
            state.fused.append(fusion.fuse_mlp(mod))
            report.append(Swap(label, "fuse", _qualname(mod), "llm_kernels.fuse.mlp_forward",
                               f"one skinny GEMM with the {epilogue} epilogue at <= 16 rows"))
        elif type(mod).__name__.endswith("Attention"):
            names = ("q_proj", "k_proj", "v_proj")
            if not hasattr(mod, "q_proj") and isinstance(getattr(mod, "qkv_proj", None), nn.Linear):
                names = ("qkv_proj",)  # one projection already (Phi-3): a group of one, for the norm prologue
            projs = [getattr(mod, n, None) for n in names]
            if not all(isinstance(p, nn.Linear) for p in projs):
                continue
            why = why_not or why_not_qkv or fusion.fusable(projs) or next((h for h in map(_has_hooks, projs) if h), "")
            if why:
                report.append(Swap(f"{name}.{'+'.join(names)}", "fuse", _qualname(mod), None, why))
                continue
            group = fusion.FusedGroup([p.weight for p in projs], [p.bias for p in projs])
            state.fused.append(group)
            for i, (n, p) in enumerate(zip(names, projs)):
                swap(f"{name}.{n}", "fuse", p, fusion.FusedProjection.from_group(p, group, i))
    # Decoder layers whose parts are all fused: RMSNorms and residual adds into the GEMMs.
    for name, mod in list(model.named_modules()):
        if not type(mod).__name__.endswith("DecoderLayer"):
            continue
        why = why_not or why_not_qkv or _layer_fusable(mod) or _probe_layer(mod)
        if why:
            report.append(Swap(name, "fuse", _qualname(mod), None, why))
            continue
        object.__setattr__(mod, "forward", types.MethodType(fusion.layer_forward, mod))
        state.layer_forwards.append(mod)
        report.append(Swap(name, "fuse", _qualname(mod), "llm_kernels.fuse.layer_forward",
                           "RMSNorms in the q/k/v and gate/up GEMMs, residual adds in o_proj and down_proj, "
                           "at <= 16 rows"))


def _layer_fusable(layer: nn.Module) -> str:
    """'' when every part layer_forward fuses is ours and fused, else the reason."""
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    norms = [getattr(layer, n, None) for n in ("input_layernorm", "post_attention_layernorm")]
    if not all(isinstance(n, layers.RMSNorm) for n in norms):
        return "its norms are not (both) llm_kernels RMSNorm"
    if fusion.qkv_group(attn) is None:
        return "its q/k/v projections are not fused"
    if fusion.gate_up_of(mlp) is None:
        if getattr(mlp, "_fused", None) is not None and not fusion.geglu_on(mlp._fused.weight.device):
            return "its MLP's GEGLU-tanh epilogue is off on the GPU (LLMK_FUSE_GEGLU=0)"
        return "its MLP is not a fused SwiGLU or GEGLU-tanh MLP"
    if type(getattr(attn, "o_proj", None)) is not decode.Linear or type(getattr(mlp, "down_proj", None)) is not decode.Linear:
        return "o_proj / down_proj are not llm_kernels Linear"
    return _has_hooks(layer) or next((h for h in map(_has_hooks, norms) if h), "")


def _probe_layer(layer: nn.Module) -> str:
    """'' when the layer's forward is x + attn(norm1(x)) = h, then h + mlp(norm2(h)) (LLaMA's
    pre-norm layout, what layer_forward computes), checked by running it with stand-in parts."""
    g = _generator()
    x = torch.randn(2, 3, 4, generator=g)

    def attn(hidden_states, **kwargs):
        return hidden_states * 3 + 1, None

    parts = dict(input_layernorm=lambda t: t * 2, self_attn=attn, post_attention_layernorm=lambda t: t * 5 - 2,
                 mlp=lambda t: t.sin())
    try:
        with torch.no_grad():
            forward = inspect.unwrap(type(layer).forward)  # past transformers' checkpointing wrapper
            out = forward(_Stand(layer, **parts), x, attention_mask=None, position_embeddings=None)
    except Exception as e:  # noqa: BLE001
        return f"its forward failed on a probe ({type(e).__name__})"
    h = x + (x * 2 * 3 + 1)
    ref = h + (h * 5 - 2).sin()
    if not isinstance(out, torch.Tensor) or not _close(out, ref):
        return "its forward is not LLaMA's pre-norm layout (h = x + attn(norm1(x)); h + mlp(norm2(h)))"
    return ""


def unkernelize(model: nn.Module) -> list[str]:
    """Undoes kernelize: the original modules (the very objects, with their parameters) go back,
    the rope patch is released and the attention implementation restored. Returns the names of
    what was restored; a model that is not kernelized is left as it is."""
    state: _State | None = getattr(model, _STATE_ATTR, None)
    if state is None:
        return []
    restored = []
    if state.inner is not None:
        name, lm = state.inner
        restored = [r if r.startswith(("transformers.", "config.")) else f"{name}.{r}" for r in unkernelize(lm)]
    for layer in state.layer_forwards:  # the class's forward again
        layer.__dict__.pop("forward", None)
    for name, mod in state.rotary_forwards:
        mod.__dict__.pop("forward", None)
        restored.append(name)
    for group in state.fused:  # independent tensors again (values and Parameter objects kept)
        group.unfuse()
    for name, mod in model.named_modules():
        if type(mod) in (layers.LlamaMLP, GatedMLP):
            fusion.unfuse_mlp(mod)
        elif type(mod) is layers.GateUpMLP:
            mod.__dict__.pop("fuse_decode", None)
    for name, old in reversed(state.modules):
        _set_child(model, name, old)
        restored.append(name)
    for modname in state.rope:
        _unpatch_rope(modname)
        restored.append(f"{modname}.apply_rotary_pos_emb")
    if state.attn_config is not None:
        state.attn_config._attn_implementation = state.attn_original
        key = id(state.attn_config)
        if state.attn_original != "sdpa" and key in _EAGER_CONFIGS:
            _EAGER_CONFIGS[key] -= 1
            if not _EAGER_CONFIGS[key]:
                del _EAGER_CONFIGS[key]
        restored.append("config._attn_implementation")
    if state.kv_cache:
        _unpatch_kv_cache()
        restored.append("transformers.cache_utils.StaticLayer.update")
    object.__delattr__(model, _STATE_ATTR)
    return restored


def is_kernelized(model: nn.Module) -> bool:
    return getattr(model, _STATE_ATTR, None) is not None
