"""Monarch structured linear layers (Dao et al., ICML 2022), in the Monarch authors' factor layout.

x (..., n) with n = k*p; w1 (k, q, p); w2 (l, s, r) with k*q = l*r; out (..., m) with m = l*s:
    X[b,i,a] = x[b, i*p+a];  Y[b,i,c] = sum_a w1[i,c,a] X[b,i,a];  y[b, i*q+c] = Y[b,i,c]
    Z[b,u,t] = y[b, t*l+u];  O[b,u,v] = sum_t w2[u,v,t] Z[b,u,t];   out[b, v*l+u] = O[b,u,v]

This module holds the reference product (two batched matmuls with the permutation between),
the dense equivalent, the optimal projection of a dense weight onto Monarch factors (per-block
truncated SVD), the MonarchLinear layer and a converter for chosen nn.Linear layers.
monarch_matmul is the fast product (torch.ops.llm_kernels.monarch_matmul: one fused GPU kernel
with the intermediate in shared memory, a CPU kernel, and a backward giving dx, dw1, dw2 with
fp32 weight-gradient accumulation); MonarchLinear runs it.
"""

from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass

import torch
from torch import nn

from . import _library  # noqa: F401  (registers torch.ops.llm_kernels)

_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _check_factors(n: int, w1: torch.Tensor, w2: torch.Tensor) -> None:
    if w1.dim() != 3 or w2.dim() != 3:
        raise ValueError(
            f"llm_kernels.monarch: w1 and w2: expected 3 dims (k, q, p) and (l, s, r), got shapes "
            f"{tuple(w1.shape)} and {tuple(w2.shape)}"
        )
    k, q, p = w1.shape
    l, s, r = w2.shape
    if k * p != n:
        raise ValueError(f"llm_kernels.monarch: x: expected a last dim of k*p = {k * p} (w1 is {tuple(w1.shape)}), got {n}")
    if k * q != l * r:
        raise ValueError(
            f"llm_kernels.monarch: w2: expected l*r = k*q = {k * q} (w1 is {tuple(w1.shape)}), "
            f"got shape {tuple(w2.shape)} with l*r = {l * r}"
        )


def monarch_matmul_ref(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """The Monarch product as two batched matmuls with the permutation between (the authors'
    formulation; also the peer in benchmarks). x: (..., n) -> (..., l*s)."""
    _check_factors(x.shape[-1], w1, w2)
    k, q, p = w1.shape
    l, s, r = w2.shape
    lead = x.shape[:-1]
    xb = x.reshape(-1, k, p).transpose(0, 1)  # (k, B, p)
    y = torch.bmm(xb, w1.transpose(1, 2))  # (k, B, q): Y[b,i,c]
    z = y.transpose(0, 1).reshape(-1, r, l).permute(2, 0, 1)  # (l, B, r): Z[b,u,t] = y[b, t*l+u]
    o = torch.bmm(z, w2.transpose(1, 2))  # (l, B, s): O[b,u,v]
    return o.permute(1, 2, 0).reshape(*lead, s * l)  # out[b, v*l+u]


def monarch_matmul(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """The Monarch product x (..., n) -> (..., l*s) with our kernels (CPU or GPU), same result
    as monarch_matmul_ref up to rounding; differentiable in x, w1 and w2 (weight gradients are
    accumulated in fp32). x, w1, w2: one dtype (float32, float16 or bfloat16) and device.
    On NVIDIA GPUs the tensor-core path runs for fp16/bf16 when every block size is a multiple
    of 16 (q and s of 8); set LLMK_MONARCH_PORTABLE=1 to force the portable FMA path."""
    return torch.ops.llm_kernels.monarch_matmul(x, w1, w2)


@torch.library.register_fake("llm_kernels::monarch_matmul")
def _monarch_matmul_fake(x, w1, w2):
    _check_factors(x.shape[-1], w1, w2)
    return x.new_empty((*x.shape[:-1], w2.shape[0] * w2.shape[1]))


@torch.library.register_fake("llm_kernels::monarch_matmul_backward")
def _monarch_matmul_backward_fake(grad_out, x, w1, w2):
    return x.new_empty(x.shape), w1.new_empty(w1.shape), w2.new_empty(w2.shape)


def monarch_to_dense(w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """The dense (m, n) weight W with monarch_matmul_ref(x, w1, w2) == x @ W.T."""
    k, q, p = w1.shape
    eye = torch.eye(k * p, dtype=w1.dtype, device=w1.device)
    return monarch_matmul_ref(eye, w1, w2).T.contiguous()


def _block_pairs(k: int, q: int, l: int, r: int):
    """For each block (u, i) of the dense weight (rows v*l+u, cols i*p+a), the (t, c) pairs that
    couple w2[u, :, t] with w1[i, c, :]: the y indices j = i*q + c = t*l + u."""
    pairs: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for j in range(k * q):
        u, t = j % l, j // l
        i, c = j // q, j % q
        pairs.setdefault((u, i), []).append((t, c))
    return pairs


@dataclass
class Projection:
    w1: torch.Tensor
    w2: torch.Tensor
    relative_error: float  # ||W - to_dense(w1, w2)||_F / ||W||_F


def project_to_monarch(weight: torch.Tensor, k: int, q: int, l: int, s: int, r: int, p: int) -> Projection:
    """The Monarch factors (w1 (k, q, p), w2 (l, s, r)) closest to `weight` (m = l*s, n = k*p) in
    Frobenius norm. Each block (u, i) of W (rows v*l+u, columns i*p+a) depends only on its own
    factor slices, as a sum of R rank-1 terms (R = number of y indices j with j % l == u and
    j // q == i), so the optimum is the rank-R truncated SVD of every block. Blocks of equal R
    are decomposed in one batched SVD (on weight's device)."""
    m, n = weight.shape
    if m != l * s or n != k * p or k * q != l * r:
        raise ValueError(
            f"llm_kernels.project_to_monarch: expected weight (l*s, k*p) = ({l * s}, {k * p}) with "
            f"k*q == l*r, got {tuple(weight.shape)} and k*q = {k * q}, l*r = {l * r}"
        )
    w = weight.detach().to(torch.float64 if weight.dtype == torch.float64 else torch.float32)
    blocks = w.reshape(s, l, k, p).permute(1, 2, 0, 3)  # (u, i, v, a) = W[v*l+u, i*p+a]
    w1 = torch.zeros(k, q, p, dtype=w.dtype, device=w.device)
    w2 = torch.zeros(l, s, r, dtype=w.dtype, device=w.device)
    by_rank: dict[int, list[tuple[int, int, list[tuple[int, int]]]]] = {}
    for (u, i), tc in _block_pairs(k, q, l, r).items():
        by_rank.setdefault(len(tc), []).append((u, i, tc))
    for rank, group in by_rank.items():
        us = torch.tensor([g[0] for g in group], device=w.device)
        is_ = torch.tensor([g[1] for g in group], device=w.device)
        U, S, Vh = torch.linalg.svd(blocks[us, is_], full_matrices=False)  # (G, s, ·), (G, ·), (G, ·, p)
        root = S[:, :rank].sqrt()
        left = U[:, :, :rank] * root[:, None, :]  # (G, s, rank)
        right = Vh[:, :rank, :] * root[:, :, None]  # (G, rank, p)
        for g, (u, i, tc) in enumerate(group):
            for rho, (t, c) in enumerate(tc):
                w2[u, :, t] = left[g, :, rho]
                w1[i, c, :] = right[g, rho, :]
    err = (w - monarch_to_dense(w1, w2)).norm() / w.norm().clamp_min(torch.finfo(w.dtype).tiny)
    return Projection(w1.to(weight.dtype), w2.to(weight.dtype), float(err))


def _shapes(in_features: int, out_features: int, nblocks: int):
    """The authors' MonarchLinear factor shapes, padding in/out features up to multiples of nblocks."""
    in_blk = math.ceil(in_features / nblocks)
    out_blk = math.ceil(out_features / nblocks)
    if in_blk * nblocks < out_blk * nblocks:
        return (nblocks, in_blk, in_blk), (nblocks, out_blk, in_blk), in_blk * nblocks, out_blk * nblocks
    return (nblocks, out_blk, in_blk), (nblocks, out_blk, out_blk), in_blk * nblocks, out_blk * nblocks


class MonarchLinear(nn.Module):
    """A drop-in for nn.Linear(in_features, out_features) with a Monarch weight of `nblocks`
    blocks: parameters `blkdiag1` (w1), `blkdiag2` (w2) and `bias`, as in the authors' code, so
    their checkpoints load. Inputs are zero-padded to nblocks * ceil(in / nblocks) features and
    outputs truncated to out_features when the dims do not divide."""

    def __init__(self, in_features: int, out_features: int, nblocks: int, bias: bool = True, device=None, dtype=None):
        super().__init__()
        if nblocks < 1:
            raise ValueError(f"MonarchLinear: nblocks: expected >= 1, got {nblocks}")
        self.in_features, self.out_features, self.nblocks = in_features, out_features, nblocks
        s1, s2, self.in_features_extended, self.out_features_extended = _shapes(in_features, out_features, nblocks)
        kw = dict(device=device, dtype=dtype)
        self.blkdiag1 = nn.Parameter(torch.empty(s1, **kw))
        self.blkdiag2 = nn.Parameter(torch.empty(s2, **kw))
        self.bias = nn.Parameter(torch.empty(out_features, **kw)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # kaiming-uniform per block, as nn.Linear does for its whole weight (a = sqrt 5)
        for w in (self.blkdiag1, self.blkdiag2):
            fan_in = w.shape[-1]
            bound = math.sqrt(3.0) * nn.init.calculate_gain("leaky_relu", math.sqrt(5)) / math.sqrt(fan_in)
            nn.init.uniform_(w, -bound, bound)
        if self.bias is not None:
            bound = 1 / math.sqrt(self.in_features)
            nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"MonarchLinear: x: expected a last dim of {self.in_features}, got {x.shape[-1]}")
        pad = self.in_features_extended - self.in_features
        if pad:
            x = nn.functional.pad(x, (0, pad))
        w1, w2 = self.blkdiag1, self.blkdiag2
        if x.dtype in _KERNEL_DTYPES and w1.dtype == x.dtype and w2.dtype == x.dtype and x.device == w1.device:
            out = monarch_matmul(x, w1, w2)
        else:  # float64, mixed dtypes: the reference product
            out = monarch_matmul_ref(x, w1, w2)
        out = out[..., : self.out_features]
        return out + self.bias if self.bias is not None else out

    def to_dense(self) -> torch.Tensor:
        """The (out_features, in_features) dense weight this layer applies."""
        full = monarch_to_dense(self.blkdiag1, self.blkdiag2)
        return full[: self.out_features, : self.in_features]

    @classmethod
    def from_dense(cls, linear: nn.Linear, nblocks: int) -> tuple["MonarchLinear", float]:
        """The MonarchLinear closest to `linear` (optimal projection, see project_to_monarch), and
        the relative Frobenius error of its weight. The bias is copied."""
        w = linear.weight
        layer = cls(linear.in_features, linear.out_features, nblocks, bias=linear.bias is not None,
                    device=w.device, dtype=w.dtype)
        padded = torch.zeros(layer.out_features_extended, layer.in_features_extended, dtype=w.dtype, device=w.device)
        padded[: linear.out_features, : linear.in_features] = w.detach()
        k, q, p = layer.blkdiag1.shape
        l, s, r = layer.blkdiag2.shape
        proj = project_to_monarch(padded, k, q, l, s, r, p)
        with torch.no_grad():
            layer.blkdiag1.copy_(proj.w1)
            layer.blkdiag2.copy_(proj.w2)
            if linear.bias is not None:
                layer.bias.copy_(linear.bias)
            err = float((w.detach().double() - layer.to_dense().double()).norm() / w.detach().double().norm())
        return layer, err


@dataclass
class ConversionRecord:
    name: str
    params_before: int
    params_after: int
    relative_error: float


def monarchize(model: nn.Module, targets: list[str] | str, nblocks: int) -> list[ConversionRecord]:
    """Replaces, in place, every nn.Linear whose qualified name matches one of `targets` (fnmatch
    patterns, e.g. "model.layers.2[89].self_attn.*_proj") by its Monarch projection. Returns a
    record per converted layer: parameters before and after, and the projection error."""
    patterns = [targets] if isinstance(targets, str) else list(targets)
    chosen = [
        (name, mod)
        for name, mod in model.named_modules()
        if isinstance(mod, nn.Linear) and any(fnmatch.fnmatchcase(name, pat) for pat in patterns)
    ]
    report = []
    for name, linear in chosen:
        layer, err = MonarchLinear.from_dense(linear, nblocks)
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, layer)
        report.append(
            ConversionRecord(name, sum(t.numel() for t in linear.parameters()), sum(t.numel() for t in layer.parameters()), err)
        )
    return report


def save_monarch(model: nn.Module, path: str) -> None:
    """Saves the factors and biases of every MonarchLinear in `model` to a safetensors file, with
    each layer's (in_features, out_features, nblocks) in the metadata, so that load_monarch can
    convert a fresh copy of the original model without projecting again."""
    from safetensors.torch import save_file

    tensors, meta = {}, {}
    for name, mod in model.named_modules():
        if isinstance(mod, MonarchLinear):
            for pname, t in mod.state_dict().items():
                tensors[f"{name}.{pname}"] = t.detach().contiguous().cpu()
            meta[name] = f"{mod.in_features},{mod.out_features},{mod.nblocks}"
    save_file(tensors, path, metadata=meta)


def load_monarch(model: nn.Module, path: str) -> list[str]:
    """Replaces, in place, each nn.Linear named in a save_monarch file by a MonarchLinear holding
    the saved factors (on the Linear's device and dtype). Returns the names converted."""
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        meta = f.metadata() or {}
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    done = []
    for name, spec in sorted(meta.items()):
        in_f, out_f, nblocks = (int(v) for v in spec.split(","))
        try:
            old = model.get_submodule(name)
        except AttributeError:
            old = None
        if not isinstance(old, nn.Linear) or (old.in_features, old.out_features) != (in_f, out_f):
            raise ValueError(f"llm_kernels.load_monarch: {name}: expected nn.Linear({in_f}, {out_f}), got {old}")
        w = old.weight
        layer = MonarchLinear(in_f, out_f, nblocks, bias=f"{name}.bias" in tensors, device=w.device, dtype=w.dtype)
        layer.load_state_dict({p: tensors[f"{name}.{p}"] for p in layer.state_dict()})
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, layer)
        done.append(name)
    return done
