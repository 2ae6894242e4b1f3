"""RoPE and a decode step's K/V cache write in one launch (decode.rope_write_kv_cache) for
kernelized Hugging Face decoder layers.

Hugging Face's attention forward rotates q and k (`apply_rotary_pos_emb`, kernelize's rope patch:
ops.apply_rotary_pos_emb), then hands k and v to `cache.update` (kernelize's StaticLayer patch:
one write_kv_cache launch), two launches per layer. While fuse.layer_forward runs such a layer at
one token per sequence, it arms this module for the layer's cache layer (`armed`): the rope call
then only allocates its outputs and returns them (`defer_rope`), and the cache update that receives
exactly that k runs one kernel that rotates q and k into those outputs, writes the rotated k and v
into the cache and advances its length (`take_update`). Attention reads q afterwards, in stream
order. Armed only when the attention class's forward assigns q, k = apply_rotary_pos_emb(...),
then passes that k to `.update(` with nothing reading q or k in between, then calls the attention
function (read from its source: _rope_then_update), outside torch.compile, and for a
patched StaticLayer that takes a one-token update; a rotation left pending when the attention
forward returns raises. LLMK_FUSE_ROPE_KV=0 (read at import) turns it off.

By default (LLMK_FUSE_ROPE_GEMM=0, read at import, turns it off) the rotation
and the cache write move one step earlier, into the fused q/k/v projection itself
(decode.skinny_gemm_rope_kv: the GEMM's epilogue, no launch of their own): `armed` also arms the
layer's fused q/k/v group (`gemm_qkv` then runs the projection), when the attention class computes
q, k and v as plain views of its q_proj / k_proj / v_proj outputs (no q/k norms in between, read from
its source: _plain_projections), its module's apply_rotary_pos_emb is ours (rotate-half, full head
dim), the group is [q; k; v] of whole heads and the layer's cache takes the step. The rope call then
checks that it got exactly those views and returns them (already rotated), and the cache update
that receives them only confirms it (the write and the length's advance are done).
"""
from __future__ import annotations

import ast
import contextlib
import inspect
import os
import textwrap
import weakref

import torch

from . import decode

ENABLED = os.environ.get("LLMK_FUSE_ROPE_KV", "1") != "0"
GEMM_ENABLED = ENABLED and os.environ.get("LLMK_FUSE_ROPE_GEMM", "1") != "0"


class _State:
    armed = None  # the cache layer whose update may take a deferred rotation
    pending = None  # (q_out, k_out, q, k, cos, sin) of the deferred rotation
    gemm = None  # the armed q/k/v projection's rotation: _gemm_rotation's tuple
    rotated = None  # its output, once the projection ran: (out, q_heads, kv_heads, head_dim)
    confirmed = None  # ... and the k view the rope call returned, for the cache update to confirm


_STATE = _State()
_ORDER_OK: dict[type, bool] = {}
_PLAIN_OK: dict[type, bool] = {}
_COUNTERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # cache layer -> zeroed int32 (GPU)


def _rope_then_update(cls: type) -> bool:
    """Whether cls.forward rotates q and k once (`q, k = apply_rotary_pos_emb(...)`), then hands
    that k to `.update(` with nothing reading q or k in between (Hunyuan's q/k norms after the
    rotation would read the deferred, still unfilled outputs), then calls the attention function."""
    if cls not in _ORDER_OK:
        _ORDER_OK[cls] = _source_order_ok(cls.forward)
    return _ORDER_OK[cls]


def _source_nodes(fn) -> list | None:
    """Every AST node of fn's source, or None where it cannot be read."""
    try:
        return list(ast.walk(ast.parse(textwrap.dedent(inspect.getsource(fn)))))
    except (OSError, TypeError, SyntaxError):
        return None


def _source_order_ok(fn) -> bool:
    nodes = _source_nodes(fn)
    if nodes is None:
        return False

    def called(node, name):
        f = getattr(node, "func", None)
        return isinstance(node, ast.Call) and (getattr(f, "id", None) == name or getattr(f, "attr", None) == name)

    ropes = [n for n in nodes if isinstance(n, ast.Assign) and called(n.value, "apply_rotary_pos_emb")]
    if len(ropes) != 1 or sum(called(n, "apply_rotary_pos_emb") for n in nodes if isinstance(n, ast.Call)) != 1:
        return False
    target = ropes[0].targets[0]
    if len(ropes[0].targets) != 1 or not isinstance(target, ast.Tuple) or len(target.elts) != 2 or \
            not all(isinstance(e, ast.Name) for e in target.elts):
        return False
    q_name, k_name = (e.id for e in target.elts)
    after = ropes[0].end_lineno
    updates = sorted((n for n in nodes if isinstance(n, ast.Call) and called(n, "update") and n.lineno > after),
                     key=lambda n: n.lineno)
    if not updates or not updates[0].args or getattr(updates[0].args[0], "id", None) != k_name:
        return False
    update = updates[0].lineno
    if any(isinstance(n, ast.Name) and n.id in (q_name, k_name) and after < n.lineno < update for n in nodes):
        return False
    return any(called(n, "attention_interface") and n.lineno > update for n in nodes if isinstance(n, ast.Call))


def _plain_projections(cls: type) -> bool:
    """Whether cls.forward passes apply_rotary_pos_emb, as its q and k, and `.update(`, as its v,
    names assigned from self.q_proj(...) / self.k_proj(...) / self.v_proj(...) followed only by
    .view / .reshape / .transpose (LLaMA's form; Qwen3's q_norm / k_norm would come between)."""
    if cls not in _PLAIN_OK:
        _PLAIN_OK[cls] = _rope_then_update(cls) and _source_plain(cls.forward)
    return _PLAIN_OK[cls]


def _source_plain(fn) -> bool:
    nodes = _source_nodes(fn)
    if nodes is None:
        return False

    def call_named(name):
        return [n for n in nodes if isinstance(n, ast.Call) and getattr(n.func, "attr", getattr(n.func, "id", None)) == name]

    ropes, updates = call_named("apply_rotary_pos_emb"), call_named("update")
    if len(ropes) != 1 or len(ropes[0].args) < 2 or not updates or len(updates[0].args) < 2:
        return False
    wanted = {"q_proj": ropes[0].args[0], "k_proj": ropes[0].args[1], "v_proj": updates[0].args[1]}
    for proj, arg in wanted.items():
        if not isinstance(arg, ast.Name):
            return False
        assigns = [n for n in nodes if isinstance(n, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == arg.id for t in n.targets)]
        if len(assigns) != 1:
            return False
        e = assigns[0].value
        while isinstance(e, ast.Call) and isinstance(e.func, ast.Attribute) and e.func.attr in ("view", "reshape",
                                                                                                "transpose"):
            e = e.func.value
        f = getattr(e, "func", None)
        if not (isinstance(e, ast.Call) and isinstance(f, ast.Attribute) and f.attr == proj
                and isinstance(f.value, ast.Name) and f.value.id == "self"):
            return False
    return True


def _cache_layer(attn, cache, x: torch.Tensor):
    """The patched StaticLayer this attention call will update with one token, or None."""
    from . import hf

    if not ENABLED or torch.compiler.is_compiling() or not hf._KV_PATCH or x.dim() != 3 or x.shape[1] != 1:
        return None
    layers, idx = getattr(cache, "layers", None), getattr(attn, "layer_idx", None)
    if not isinstance(idx, int) or not isinstance(layers, (list, tuple)) or not 0 <= idx < len(layers):
        return None
    layer = layers[idx]
    if type(layer) is not hf._KV_PATCH[0] or not getattr(layer, "is_initialized", False):
        return None
    return layer if _rope_then_update(type(attn)) else None


def _gemm_rotation(attn, group, layer, x: torch.Tensor, position_embeddings):
    """(group, layer, cos half, sin half, q_heads, kv_heads, head_dim, (cos, sin)) for the q/k/v
    projection's fused rotation (on unless LLMK_FUSE_ROPE_GEMM=0), or None where it does not apply (see the top
    of this file); the last entry: the tables themselves, which the rope call must then get."""
    from . import hf, ops

    if not GEMM_ENABLED or group is None or group.weight is None or len(group.sizes) != 3 or \
            not isinstance(position_embeddings, (tuple, list)) or len(position_embeddings) != 2:
        return None
    cos, sin = position_embeddings
    keys = layer.keys
    B, D = x.shape[0], keys.shape[-1]
    if not isinstance(cos, torch.Tensor) or not isinstance(sin, torch.Tensor) or cos.shape != sin.shape:
        return None
    if cos.dim() != 3 or cos.shape[1:] != (1, D) or cos.shape[0] not in (1, B) or D % 2:
        return None
    if any(t.dtype != x.dtype or t.device != x.device for t in (cos, sin, keys)) or keys.shape[0] != B:
        return None
    # the cache takes a one-token step as write_kv_cache would (its length counter, layout, dtypes)
    if not hf._one_token_update(layer, keys[:, :, :1], layer.values[:, :, :1]):
        return None
    q_size, k_size, v_size = group.sizes
    if q_size % D or k_size != keys.shape[1] * D or v_size != k_size:
        return None
    if getattr(inspect.getmodule(type(attn)), "apply_rotary_pos_emb", None) is not ops.apply_rotary_pos_emb:
        return None
    if not _plain_projections(type(attn)):
        return None
    half = D // 2
    return group, layer, cos[:, 0, :half].expand(B, half), sin[:, 0, :half].expand(B, half), q_size // D, \
        keys.shape[1], D, (cos, sin)


def _counter(layer, device: torch.device) -> torch.Tensor | None:
    """The zeroed int32 the fused projection's blocks count in (GPU), kept per cache layer: every
    call leaves it zero, so it is made once (before a CUDA graph captures the step)."""
    if device.type != "cuda":
        return None
    c = _COUNTERS.get(layer)
    if c is None or c.device != device:
        c = _COUNTERS[layer] = torch.zeros(1, dtype=torch.int32, device=device)
    return c


def gemm_qkv(x: torch.Tensor, group, norm_args: tuple) -> torch.Tensor | None:
    """The armed q/k/v projection (fuse.FusedProjection's q call): [rope(q) | rope(k) | v] with k and
    v written into the cache and its length advanced (decode.skinny_gemm_rope_kv), or None when this
    group is not the armed one (the caller runs the plain product)."""
    armed = _STATE.gemm
    if armed is None or armed[0] is not group or _STATE.rotated is not None:
        return None
    _, layer, cos, sin, hq, hkv, d, _ = armed
    length = layer.cumulative_length
    out = decode.skinny_gemm_rope_kv(x, group.weight, group.bias, hq, cos, sin, length.view(1).expand(x.shape[0]),
                                     layer.keys, layer.values, advance=length, counter=_counter(layer, x.device),
                                     norm_weight=norm_args[0], norm_eps=norm_args[1], norm_offset=norm_args[2],
                                     fixed_weight=True)
    _STATE.rotated = (out, hq, hkv, d)
    return out


def _is_view(t: torch.Tensor, out: torch.Tensor, col: int, heads: int, d: int) -> bool:
    """Whether t is out[..., col:col + heads * d].view(B, 1, heads, d).transpose(1, 2)."""
    want = out[..., col:col + heads * d].reshape(out.shape[0], 1, heads, d).transpose(1, 2)
    return t.data_ptr() == want.data_ptr() and t.shape == want.shape and t.stride() == want.stride()


@contextlib.contextmanager
def armed(attn, cache, x: torch.Tensor, group=None, position_embeddings=None):
    """fuse.layer_forward around the attention call: arms the deferred rotation when it applies, and
    by default the q/k/v projection's (group: the layer's fused q/k/v group)."""
    layer = _cache_layer(attn, cache, x)
    if layer is None:
        yield
        return
    try:
        _STATE.armed, _STATE.pending, _STATE.rotated, _STATE.confirmed = layer, None, None, None
        _STATE.gemm = _gemm_rotation(attn, group, layer, x, position_embeddings)
        yield
    except BaseException:  # the forward's own error (or the rope call's) goes up unchanged
        _disarm()
        raise
    left = _STATE.pending is not None or (_STATE.rotated is not None and _STATE.confirmed is not True)
    _disarm()
    if left:
        raise RuntimeError("llm_kernels: the attention forward rotated q and k but did not update the cache "
                           "with them; LLMK_FUSE_ROPE_KV=0 turns the fused rotation off")


def _disarm() -> None:
    _STATE.armed = _STATE.pending = _STATE.gemm = _STATE.rotated = _STATE.confirmed = None


def defer_rope(q, k, cos, sin, unsqueeze_dim: int):
    """ops.apply_rotary_pos_emb's first step: (q_out, k_out) to return unfilled when armed and the
    shapes are a one-token step's ((B, H, 1, D), full-width cos/sin (B or 1, 1, D) in q's dtype),
    else None."""
    layer = _STATE.armed
    if _STATE.rotated is not None:  # the projection rotated them already: they must be its views
        out, hq, hkv, d = _STATE.rotated
        tables = _STATE.gemm[-1]
        if _STATE.confirmed is not None or unsqueeze_dim != 1 or not _is_view(q, out, 0, hq, d) or \
                not _is_view(k, out, hq * d, hkv, d) or cos is not tables[0] or sin is not tables[1]:
            raise RuntimeError("llm_kernels: the fused q/k/v projection rotated q and k and wrote the cache, but "
                               "apply_rotary_pos_emb got other tensors or tables; LLMK_FUSE_ROPE_GEMM=0 turns that "
                               "fusion off")
        _STATE.confirmed = k
        return q, k
    if layer is None or _STATE.pending is not None or unsqueeze_dim != 1:
        return None
    if q.dim() != 4 or k.dim() != 4 or q.shape[2] != 1 or q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        return None
    if cos.dim() != 3 or cos.shape != sin.shape or cos.shape[1:] != (1, q.shape[3]) or q.shape[3] % 2:
        return None
    if cos.shape[0] not in (1, q.shape[0]):  # one row for every sequence (shared positions), or one each
        return None
    if any(t.dtype != q.dtype or t.device != q.device for t in (k, cos, sin)):
        return None
    from . import hf

    if not hf._one_token_update(layer, k, k):
        return None
    q_out, k_out = torch.empty(q.shape, dtype=q.dtype, device=q.device), torch.empty(k.shape, dtype=k.dtype, device=k.device)
    _STATE.pending = (q_out, k_out, q, k, cos, sin)
    return q_out, k_out


def take_update(layer, key_states: torch.Tensor, value_states: torch.Tensor) -> bool:
    """The patched StaticLayer.update's first step: True when it wrote this update with the deferred
    rotation (one launch; the length advanced), False when the update is not that one."""
    if _STATE.rotated is not None and layer is _STATE.armed and key_states is _STATE.confirmed:
        out, hq, hkv, d = _STATE.rotated
        if not _is_view(value_states, out, (hq + hkv) * d, hkv, d):
            raise RuntimeError("llm_kernels: the fused q/k/v projection wrote v into the cache, but the cache "
                               "update got another v; LLMK_FUSE_ROPE_GEMM=0 turns that fusion off")
        _STATE.confirmed = True  # written and advanced by the projection
        return True
    pend = _STATE.pending
    if pend is None or layer is not _STATE.armed or key_states is not pend[1]:
        return False
    q_out, k_out, q, k, cos, sin = pend
    if value_states.shape != k.shape or value_states.dtype != k.dtype or value_states.device != k.device:
        return False
    _STATE.pending = None
    B, half = k.shape[0], cos.shape[-1] // 2
    cos, sin = (t[..., :half].expand(B, 1, half) for t in (cos, sin))
    positions = layer.cumulative_length.view(1, 1).expand(B, 1)
    decode.rope_write_kv_cache(q_out.transpose(1, 2), k_out.transpose(1, 2), layer.keys, layer.values,
                               q.transpose(1, 2), k.transpose(1, 2), value_states.transpose(1, 2),
                               cos, sin, positions, advance=layer.cumulative_length)
    return True
