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
"""
from __future__ import annotations

import ast
import contextlib
import inspect
import os
import textwrap

import torch

from . import decode

ENABLED = os.environ.get("LLMK_FUSE_ROPE_KV", "1") != "0"


class _State:
    armed = None  # the cache layer whose update may take a deferred rotation
    pending = None  # (q_out, k_out, q, k, cos, sin) of the deferred rotation


_STATE = _State()
_ORDER_OK: dict[type, bool] = {}


def _rope_then_update(cls: type) -> bool:
    """Whether cls.forward rotates q and k once (`q, k = apply_rotary_pos_emb(...)`), then hands
    that k to `.update(` with nothing reading q or k in between (Hunyuan's q/k norms after the
    rotation would read the deferred, still unfilled outputs), then calls the attention function."""
    if cls not in _ORDER_OK:
        _ORDER_OK[cls] = _source_order_ok(cls.forward)
    return _ORDER_OK[cls]


def _source_order_ok(fn) -> bool:
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError):
        return False

    def called(node, name):
        f = getattr(node, "func", None)
        return isinstance(node, ast.Call) and (getattr(f, "id", None) == name or getattr(f, "attr", None) == name)

    nodes = list(ast.walk(tree))
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


@contextlib.contextmanager
def armed(attn, cache, x: torch.Tensor):
    """fuse.layer_forward around the attention call: arms the deferred rotation when it applies."""
    layer = _cache_layer(attn, cache, x)
    if layer is None:
        yield
        return
    _STATE.armed, _STATE.pending = layer, None
    try:
        yield
    finally:
        left = _STATE.pending is not None
        _STATE.armed = _STATE.pending = None
        if left:
            raise RuntimeError("llm_kernels: the attention forward rotated q and k but did not update the cache "
                               "with them; LLMK_FUSE_ROPE_KV=0 turns the fused rotation off")


def defer_rope(q, k, cos, sin, unsqueeze_dim: int):
    """ops.apply_rotary_pos_emb's first step: (q_out, k_out) to return unfilled when armed and the
    shapes are a one-token step's ((B, H, 1, D), full-width cos/sin (B or 1, 1, D) in q's dtype),
    else None."""
    layer = _STATE.armed
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
