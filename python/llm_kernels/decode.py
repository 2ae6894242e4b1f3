"""The decode path: attention of a few new tokens over a KV cache (contiguous or paged), the KV-cache
write, and the skinny GEMM of decoding (y = x W^T for 1 to 16 rows of x), plus `Linear`, an
nn.Linear that dispatches to it.

Conventions (see include/llmk/decode.h):
  q (B, T, Hq, D), T = 1..8 new tokens; contiguous caches (B, Hkv, Smax, D), or paged caches
  (num_blocks, block_size, Hkv, D) with block_table (B, max_blocks) int32 (vLLM's layout);
  seq_lens (B) int32 or int64 counts every cached position INCLUDING the T new tokens. New token t of
  sequence b sits at position seq_lens[b] - T + t and sees keys 0..that position. A token with no key
  to see (seq_len 0, or seq_len < T) gets zeros.
"""

from __future__ import annotations

import math
import os

import torch
import torch.nn.functional as F
from torch import nn

from . import _library
from . import ops

_ops = torch.ops.llm_kernels

SKINNY_MAX_ROWS = 16
# Rows up to which the portable skinny GEMM (what AMD GPUs run) keeps F.linear's speed: past them
# its time grows with the rows (H100, 2026-12-05, 4096 x 14336: 48 / 56 / 82 / 160 / 319 us at
# 1 / 2 / 4 / 8 / 16 rows against F.linear's 54; bench/results/h100-decode-patches-portable-2026-12-05.md).
PORTABLE_MAX_ROWS = 2
_GPU_BACKEND = _library.GPU_BACKEND  # module attributes: tests replace them
_device_major = _library.device_major
LOG2E = 1.4426950408889634  # the GPU kernels add masks in the log2 domain


# ------------------------------------------------------------------------------ decode attention
def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor | None = None,
    *,
    scale: float | None = None,
    num_splits: int = 0,
    max_seq_len: int = 0,
    workspace: torch.Tensor | None = None,
    attn_mask: torch.Tensor | None = None,
    workspace_zeroed: bool = False,
) -> torch.Tensor:
    """Attention of q (B, T, Hq, D) over the cache; returns (B, T, Hq, D) in q's dtype.

    block_table=None reads a contiguous cache (B, Hkv, Smax, D); with a block table (B, max_blocks)
    int32 the caches are paged (num_blocks, block_size, Hkv, D). GQA: Hq a multiple of Hkv.
    num_splits (GPU): 0 lets the heuristic split the KV length so that batch 1 fills the GPU.
    max_seq_len (GPU): an upper bound of seq_lens that sharpens the heuristic (0: cache capacity).
    workspace (GPU): a uint8 tensor of decode_workspace_size(...) bytes; pass one to capture the call
    in a CUDA graph (without it the workspace comes from torch's caching allocator).
    workspace_zeroed (GPU): the workspace's split counters are zero, so the call skips their memset
    (one node less in a CUDA graph). Every call leaves them zero, so this holds for a workspace made
    with torch.zeros and since used only by calls with the same shapes and options on one stream;
    a workspace that breaks this gives wrong results, not an error.
    attn_mask: an optional mask over cache positions, (B, 1 or T, S) or SDPA's 4-D (B, 1, 1 or T, S):
    boolean (True = attend) or additive float (float32 or q's dtype), as torch SDPA takes it; keys
    at positions >= S are hidden; the causal convention and seq_lens still apply.
    """
    if attn_mask is not None and attn_mask.dim() == 4:
        if attn_mask.shape[1] != 1:
            raise ValueError("llm_kernels: decode_attention: attn_mask: expected (B, 1 or T, S) or (B, 1, 1 or T, S) "
                             f"(one mask for all heads), got shape {tuple(attn_mask.shape)}")
        attn_mask = attn_mask[:, 0]
    return _ops.decode_attention(q, k_cache, v_cache, seq_lens, block_table, scale, int(num_splits),
                                 int(max_seq_len), workspace, attn_mask, bool(workspace_zeroed))


def decode_workspace_size(q, k_cache, block_table=None, num_splits: int = 0, max_seq_len: int = 0) -> int:
    """Bytes of GPU workspace decode_attention needs for these shapes (0 on the CPU)."""
    return int(_ops.decode_workspace_size(q, k_cache, block_table, int(num_splits), int(max_seq_len)))


def write_kv_cache(k_cache, v_cache, k, v, positions, block_table=None, advance=None) -> None:
    """Writes k, v (B, T, Hkv, D) into the caches in place at positions (B, T) (int32/int64):
    contiguous: cache[b, :, positions[b, t]]; paged: through block_table. Negative positions are
    padding and are skipped. `advance`: a one-element int32/int64 length counter increased by T
    once the positions are read (they may be views of it); on the GPU in the same launch for one
    sequence and one token, else in a second one."""
    _ops.write_kv_cache_(k_cache, v_cache, k, v, positions, block_table, advance)


def rope_write_kv_cache(q_out, k_out, k_cache, v_cache, q, k, v, cos, sin, positions, advance=None) -> None:
    """write_kv_cache with rotate-half RoPE of q and k first, one launch on the GPU: q_out = rope(q),
    k_out = rope(k) (B, T, H, D; shaped as q and k), and k_out and v go into the (contiguous) caches
    at positions as write_kv_cache writes them (`advance` as there). cos, sin: (B, T, D / 2) in q's
    dtype (the first half of Hugging Face's duplicated tables); each element x1 * cos - x2 * sin or
    x2 * cos + x1 * sin in fp32, rounded once, as rope computes it."""
    _ops.rope_write_kv_cache_(q_out, k_out, k_cache, v_cache, q, k, v, cos, sin, positions, advance)


@torch.library.register_fake("llm_kernels::rope_write_kv_cache_")
def _rope_write_kv_cache_fake(q_out, k_out, k_cache, v_cache, q, k, v, cos, sin, positions, advance=None):
    return None


@torch.library.register_fake("llm_kernels::decode_attention")
def _decode_attention_fake(q, k_cache, v_cache, seq_lens, block_table=None, scale=None, num_splits=0,
                           max_seq_len=0, workspace=None, attn_mask=None, workspace_zeroed=False):
    return q.new_empty(q.shape)


@torch.library.register_fake("llm_kernels::write_kv_cache_")
def _write_kv_cache_fake(k_cache, v_cache, k, v, positions, block_table=None, advance=None):
    return None


def decode_attention_ref(q, k_cache, v_cache, seq_lens, block_table=None, scale=None, attn_mask=None) -> torch.Tensor:
    """Plain PyTorch decode attention (in q's dtype, or pass float64 tensors), for checks.
    attn_mask (B, 1 or T, S): boolean or additive, as decode_attention takes it."""
    B, T, Hq, D = q.shape
    paged = block_table is not None
    Hkv = k_cache.shape[2] if paged else k_cache.shape[1]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    out = torch.zeros_like(q)
    for b in range(B):
        n = int(seq_lens[b])
        if n == 0:
            continue
        if paged:
            bs = k_cache.shape[1]
            pos = torch.arange(n, device=q.device)
            blocks = block_table[b].long()[pos // bs]
            k = k_cache[blocks, pos % bs].transpose(0, 1)  # (Hkv, n, D)
            v = v_cache[blocks, pos % bs].transpose(0, 1)
        else:
            k, v = k_cache[b, :, :n], v_cache[b, :, :n]
        k = k.repeat_interleave(Hq // Hkv, 0)
        v = v.repeat_interleave(Hq // Hkv, 0)
        s = torch.einsum("thd,hnd->htn", q[b], k) * scale  # (Hq, T, n)
        qpos = n - T + torch.arange(T, device=q.device)
        mask = torch.arange(n, device=q.device)[None, :] <= qpos[:, None]  # (T, n)
        if attn_mask is not None:
            m = attn_mask[b, :, :n]
            visible = torch.arange(n, device=q.device) < attn_mask.shape[-1]
            if m.dtype == torch.bool:
                mask = mask & F.pad(m, (0, n - m.shape[-1]), value=False) & visible
            else:
                # the kernels add the mask in fp32 in the log2 domain: values overflowing there hide keys
                add = F.pad(m.to(torch.float64), (0, n - m.shape[-1]))
                hidden = torch.isinf((add * LOG2E).float()) & (add < 0)
                mask = mask & ~hidden & visible
                s = s + add.masked_fill(hidden, 0.0)[None].to(s.dtype)
        s = s.masked_fill(~mask[None], float("-inf"))
        p = torch.softmax(s, -1).nan_to_num(0.0)  # rows with no key: zeros
        out[b] = torch.einsum("htn,hnd->thd", p, v)
    return out


# ---------------------------------------------------------------------------------- skinny GEMM
def _rows(x: torch.Tensor) -> int:
    return x.numel() // x.shape[-1] if x.shape[-1] else 0


def _runs_portable_gemm(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the skinny GEMM of these GPU tensors would run its portable FMA kernel, by the rule
    of launch_nt() in src/gemm/gemm_gpu.cu: an AMD GPU (a HIP build), fp32, an NVIDIA GPU before
    sm_80, loads of 8 elements ruled out (K or a row stride not a multiple of 8, a data pointer not
    16-byte aligned: _library.eight_element_loads_ruled_out), or LLMK_GEMM_KERNEL=portable
    (LLMK_GEMM_PORTABLE=1 where LLMK_GEMM_KERNEL names no kernel)."""
    if _GPU_BACKEND != "cuda" or x.element_size() != 2 or _device_major(x.device) < 8:
        return True
    x_row = x.stride(-2) if x.dim() >= 2 else x.shape[-1]
    if _library.eight_element_loads_ruled_out((x, weight), (x.shape[-1], x_row, weight.stride(0))):
        return True
    kernel = os.environ.get("LLMK_GEMM_KERNEL", "")
    return kernel == "portable" or (kernel in ("", "default", "auto") and _library.env_flag("LLMK_GEMM_PORTABLE"))


def skinny_takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether x's rows (leading dims flattened) go to the skinny GEMM kernels rather than F.linear:
    up to SKINNY_MAX_ROWS, or up to PORTABLE_MAX_ROWS on the GPU where the kernel that would run is
    the portable one (checked only past those rows, so a batch-1 decode step pays nothing for it)."""
    rows = _rows(x)
    if rows <= PORTABLE_MAX_ROWS:
        return True
    return rows <= SKINNY_MAX_ROWS and (x.device.type == "cpu" or not _runs_portable_gemm(x, weight))


# The gated epilogues of skinny_gemm: the gate's activation, applied to the first half of x W^T.
GATED = {"swiglu": F.silu, "geglu_tanh": lambda g: F.gelu(g, approximate="tanh")}


def _gated(y: torch.Tensor, activation: str) -> torch.Tensor:
    """act(g) * u for y = [g | u] along the last dim under a gated activation, else y."""
    if activation not in GATED:
        return y
    g, u = y.chunk(2, -1)
    return GATED[activation](g) * u


def skinny_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                activation: str | None = None, *, norm_weight: torch.Tensor | None = None, norm_eps: float = 1e-6,
                norm_offset: float = 0.0, residual: torch.Tensor | None = None,
                fixed_weight: bool = False) -> torch.Tensor:
    """y = x W^T (+ bias) for W (N, K) in nn.Linear's layout; activation='swiglu' treats W as
    [gate; up] (N = 2 * inter) and returns silu(g) * u (..., inter); 'geglu_tanh' returns
    gelu_tanh(g) * u (Gemma's MLP, gelu_pytorch_tanh).

    Decode-step fusions: with `norm_weight` (K) the product is taken of
    rms_norm(x, norm_weight, norm_eps, norm_offset) instead of x (no separate RMSNorm launch, same
    roundings); with `residual` (the output's shape) the result is residual + y (y rounded to x's
    dtype first, as a separate add would see it).

    fixed_weight=True promises that no GPU work still in flight writes `weight` (a model's
    parameters at inference): on Hopper the kernel then loads its first weight bytes before it
    waits for the kernel before it (programmatic dependent launch), which took the 1B decode from
    933 to 1051 tok/s on an H100. Leave it False for a weight computed just before (by rms_norm,
    another GEMM, ...): the kernel then reads it only after that wait.

    Up to 16 rows of x (leading dims flattened; 2 where the portable kernel would run, AMD GPUs:
    skinny_takes) run our weight-streaming kernel; more rows go to F.linear (the vendor BLAS),
    with the norm and the activation as separate ops."""
    act = activation or "none"
    if act not in GATED and act != "none":
        raise ValueError("llm_kernels: skinny_gemm: activation: expected None, 'none', 'swiglu' or 'geglu_tanh', "
                         f"got {activation!r}")
    if x.dim() >= 1 and x.shape[-1] == weight.shape[-1] and not skinny_takes(x, weight):
        if norm_weight is not None:
            x = ops.rms_norm(x, norm_weight, norm_eps, norm_offset)
        y = _gated(F.linear(x, weight, bias), act)
        return y if residual is None else residual + y
    return _ops.skinny_gemm(x, weight, bias, act, False, norm_weight, float(norm_eps), float(norm_offset), residual,
                            bool(fixed_weight))


@torch.library.register_fake("llm_kernels::skinny_gemm")
def _skinny_gemm_fake(x, weight, bias=None, activation="none", portable=False, norm_weight=None, norm_eps=1e-6,
                      norm_offset=0.0, residual=None, fixed_weight=False):
    n = weight.shape[0] // 2 if activation in GATED else weight.shape[0]
    return x.new_empty((*x.shape[:-1], n))


def skinny_gemm_rope_kv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, q_heads: int,
                        cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, k_cache: torch.Tensor,
                        v_cache: torch.Tensor, *, advance: torch.Tensor | None = None,
                        counter: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None,
                        norm_eps: float = 1e-6, norm_offset: float = 0.0, fixed_weight: bool = False) -> torch.Tensor:
    """A decode step's q/k/v projection with RoPE and the K/V cache write fused in: for x (..., K)
    of M rows (one new token of each of M sequences) and W = [q; k; v] rows ((Hq + 2 Hkv) D, K), returns
    [rope(q) | rope(k) | v] (..., (Hq + 2 Hkv) D) and writes rope(k) and v of row m into
    k_cache / v_cache (M, Hkv, S, D) at slot positions[m] (negative: padding), exactly as skinny_gemm
    followed by rope_write_kv_cache would. cos, sin (M, D / 2): the first half of Hugging Face's
    duplicated tables (a stride-0 expand shares one row); positions (M) int32 / int64. `advance`, a
    length counter, is increased by 1 after every position is read (positions may be a view of it);
    on the GPU it needs `counter`, one int32 zeroed once (torch.zeros), which every call leaves at zero.
    norm_weight, fixed_weight: as in skinny_gemm. One launch on the GPU (NVIDIA's deep kernel, D
    a multiple of 16; the portable kernel, AMD's, D a multiple of 8); elsewhere the two calls."""
    return _ops.skinny_gemm_rope_kv(x, weight, bias, int(q_heads), cos, sin, positions, k_cache, v_cache, advance,
                                    counter, norm_weight, float(norm_eps), float(norm_offset), bool(fixed_weight))


@torch.library.register_fake("llm_kernels::skinny_gemm_rope_kv")
def _skinny_gemm_rope_kv_fake(x, weight, bias, q_heads, cos, sin, positions, k_cache, v_cache, advance=None,
                              counter=None, norm_weight=None, norm_eps=1e-6, norm_offset=0.0, fixed_weight=False):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def skinny_gemm_ref(x, weight, bias=None, activation=None, *, norm_weight=None, norm_eps=1e-6, norm_offset=0.0,
                    residual=None) -> torch.Tensor:
    """Plain PyTorch skinny_gemm (in x's dtype, or pass float64 tensors)."""
    if norm_weight is not None:
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm_eps) * (norm_offset + norm_weight)
    y = x @ weight.t()
    if bias is not None:
        y = y + bias
    y = _gated(y, activation or "none")
    return y if residual is None else residual + y


# ------------------------------------------------------------------------------ fused decoder layer
def decoder_layer_step(x, input_norm, qkv, o, post_norm, gate_up, down, cos_sin_cache, k_cache, v_cache, position,
                       *, eps: float = 1e-6, scale: float | None = None,
                       workspace: torch.Tensor | None = None) -> torch.Tensor:
    """One LLaMA-style decoder layer's decode step at batch 1 (include/llmk/decode_layer.h):
    RMSNorm, qkv projection, RoPE (neox), the new K/V written into the caches at `position`,
    attention over positions 0..position, o projection + residual, RMSNorm, SwiGLU MLP + residual.

    x (1, H) fp16/bf16; input_norm, post_norm (H); qkv ((Hq + 2 Hkv) D, H); o (H, Hq D);
    gate_up (2 I, H) = [gate; up]; down (H, I); cos_sin_cache (P, D) float32 [cos | sin];
    k_cache, v_cache (1, Hkv, S, D), updated in place; position: one int32/int64 element.
    On the GPU this is ONE persistent kernel (a cooperative launch; see the header for what that
    asks of the GPU); elsewhere the same step as a chain of our ops (decoder_layer_chain).
    workspace (GPU): decoder_layer_workspace(...) for CUDA-graph capture; without it a zeroed one
    is allocated per call."""
    if x.is_cuda:
        return _ops.decode_layer_step(x, input_norm, qkv, o, post_norm, gate_up, down, cos_sin_cache, k_cache,
                                      v_cache, position, float(eps), scale, workspace)
    return decoder_layer_chain(x, input_norm, qkv, o, post_norm, gate_up, down, cos_sin_cache, k_cache, v_cache,
                               position, eps=eps, scale=scale)


def decoder_layer_workspace(x, input_norm, qkv, o, post_norm, gate_up, down, cos_sin_cache, k_cache,
                            v_cache) -> torch.Tensor:
    """A zeroed uint8 workspace for decoder_layer_step on x's GPU (reusable by every layer of the
    same shapes, one call at a time)."""
    n = _ops.decode_layer_workspace_size(x, input_norm, qkv, o, post_norm, gate_up, down, cos_sin_cache, k_cache,
                                         v_cache)
    return torch.zeros(int(n), dtype=torch.uint8, device=x.device)


def decoder_layer_chain(x, input_norm, qkv, o, post_norm, gate_up, down, cos_sin_cache, k_cache, v_cache, position,
                        *, eps: float = 1e-6, scale: float | None = None) -> torch.Tensor:
    """decoder_layer_step as a chain of separate ops (the CPU path, and the GPU baseline)."""
    d, hkv = k_cache.shape[-1], k_cache.shape[1]
    hq = qkv.shape[0] // d - 2 * hkv
    pos = position.reshape(1, 1).to(torch.int64)
    h = ops.rms_norm(x.reshape(1, -1), input_norm, eps)
    q, k, v = skinny_gemm(h, qkv).split([hq * d, hkv * d, hkv * d], -1)
    q, k = ops.rope(q.reshape(1, 1, hq, d), k.reshape(1, 1, hkv, d), cos_sin_cache=cos_sin_cache, positions=pos)
    write_kv_cache(k_cache, v_cache, k, v.reshape(1, 1, hkv, d), pos)
    lens = (pos.reshape(1) + 1).to(torch.int32)
    a = decode_attention(q, k_cache, v_cache, lens, scale=scale)
    hh, xm = ops.fused_add_rms_norm(skinny_gemm(a.reshape(1, hq * d), o), x.reshape(1, -1), post_norm, eps)
    u = skinny_gemm(hh, gate_up, activation="swiglu")
    return (xm + skinny_gemm(u, down)).reshape(x.shape)


@torch.library.register_fake("llm_kernels::decode_layer_step")
def _decode_layer_step_fake(x, input_norm, qkv, o, post_norm, gate_up, down, cos_sin_cache, k_cache, v_cache,
                            position, eps=1e-6, scale=None, workspace=None):
    return x.new_empty(x.shape)


class Linear(nn.Linear):
    """nn.Linear with the same parameters and state dict, whose forward runs the skinny GEMM kernel
    for at most 16 rows of fp16/bf16 input on the GPU (decoding; 2 where that kernel would be the
    portable one, AMD GPUs: skinny_takes), and F.linear otherwise (more rows, CPU, fp32, or when
    autograd needs a graph: the kernel has no backward).

    The kernel takes the weight as fixed (skinny_gemm's fixed_weight: on Hopper it reads the weight
    before waiting for the kernel before it). Set `fixed_weight = False` on a module whose weight
    is rewritten on the GPU right before its forward (an in-place copy_ or LoRA merge just before)."""

    fixed_weight: bool = True

    @classmethod
    def from_module(cls, module: nn.Linear) -> "Linear":
        """A drop-in for `module`, sharing its weight and bias tensors."""
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = module.in_features, module.out_features
        new.weight = module.weight
        new.bias = module.bias
        return new

    # fuse.layer_forward: a residual to add to the next call's output (then cleared), or None
    residual_once: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, residual = self.weight, self.residual_once
        if residual is not None:
            self.residual_once = None
        if (x.is_cuda and x.dtype in (torch.float16, torch.bfloat16) and w.dtype == x.dtype
                and x.dim() >= 1 and skinny_takes(x, w)
                and not (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad))):
            return _ops.skinny_gemm(x, w, self.bias, "none", False, None, 1e-6, 0.0, residual,
                                    fixed_weight=self.fixed_weight)
        y = F.linear(x, w, self.bias)
        return y if residual is None else residual + y
