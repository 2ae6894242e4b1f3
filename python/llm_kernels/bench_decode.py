"""What `llm-kernels bench-decode` measures: the two reads that bound token-by-token generation.

decode_attention: 32 query / 8 KV heads, head dim 128, bf16, one new token, at (batch, KV length)
  = (1, 4096), (32, 4096), (8, 32768), (64, 2048); ours on a contiguous cache and on a paged cache
  (block 16, shuffled block table), beside torch SDPA restricted to its flash and cuDNN backends
  (torch.nn.attention.sdpa_kernel), and ours again with the warp kernel (LLMK_DECODE_KERNEL=warp,
  columns "(warp)") and with the previous kernel (LLMK_DECODE_KERNEL=split, columns "(previous kernel)")
  so that one run compares them; the plain columns are the default kernel (mma, tensor cores). SDPA is given enable_gqa=True where the backend accepts it,
  else K/V expanded to 32 heads beforehand (outside the timing; it then reads 4x the bytes, and the
  record's note says so). TB/s counts the K and V bytes that must be read once.
skinny_gemm: M = 1, 4, 8, 16 rows x (K, N) = 4096x4096, 4096x14336, 14336x4096, 8192x28672, bf16,
  our default kernel ("llm_kernels": deep, mma for SwiGLU; on Hopper launched with programmatic
  dependent launch, the default: a call may start while the one before ends), the same without it
  ("llm_kernels no PDL", LLMK_PDL=0) and the TMA kernel ("llm_kernels tma", LLMK_GEMM_KERNEL=tma: W by the bulk tensor copy
  engine, split-K merged in thread block clusters; the H200), beside F.linear (cuBLAS); then the batch-1 decode GEMMs of the 1B model
  that `llm-kernels e2e` runs ("skinny_gemm (1B model decode)": fused qkv 2048x3072, o proj
  2048x2048, fused gate/up 2048x16384 with the SwiGLU epilogue, down 8192x2048, lm head
  2048x32000), the SwiGLU one beside F.linear followed by silu(g) * u; and (GPU, not --quick) the
  deep kernel at M = 1 with each K split forced (LLMK_GEMM_DEEP_SPLIT = 1..16: "skinny_gemm deep
  K-split sweep", to tune the host's plan). TB/s counts the weight bytes.
decoder layers (GPU): the 1B model's 16 layers of one batch-1 decode step on our kernels alone
  (layer_step: RMSNorm, fused qkv, RoPE, K/V write, decode attention, o, fused add + RMSNorm,
  gate/up with SwiGLU, down, add), one CUDA graph, with programmatic dependent launch (the
  default on Hopper) and without it ("llm_kernels no PDL"); TB/s counts the layers' weights.

Timing: bench.py's timer (triton.testing.do_bench median with L2 flushed on the GPU).
"""

from __future__ import annotations

import dataclasses
import os

import torch
import torch.nn.functional as F

from . import bench, decode, ops
from .bench import _meta, _timer, copy_bandwidth_gbps

ATTN_HEADS, ATTN_KV_HEADS, ATTN_DIM = 32, 8, 128
ATTN_SHAPES = [(1, 4096), (32, 4096), (8, 32768), (64, 2048)]
ATTN_QUICK = [(1, 4096), (8, 2048)]
GEMM_ROWS = [1, 4, 8, 16]
GEMM_SHAPES = [(4096, 4096), (4096, 14336), (14336, 4096), (8192, 28672)]
GEMM_QUICK_ROWS, GEMM_QUICK = [1, 16], [(4096, 4096)]
CPU_ATTN, CPU_GEMM = [(1, 256)], [(256, 256)]
# (K, N, activation) of the 1B model's decode GEMMs at batch 1 (hidden 2048, 32/8 heads of 64,
# intermediate 8192, vocabulary 32000)
GEMM_MODEL = [(2048, 3072, None), (2048, 2048, None), (2048, 16384, "swiglu"), (8192, 2048, None), (2048, 32000, None)]
GEMM_MODEL_QUICK = [(2048, 16384, "swiglu")]
GEMM_KERNEL_ENV = "LLMK_GEMM_KERNEL"  # read at every call: "default" or "deep" per column
GEMM_LOADS_ENV = "LLMK_GEMM_DEEP_LOADS"  # "16": the deep kernel with 16 W loads per lane per trip
GEMM_SPLIT_ENV = "LLMK_GEMM_DEEP_SPLIT"  # the deep kernel's K split forced (the sweep at M = 1)
PDL_ENV = "LLMK_PDL"  # "1": programmatic dependent launch (Hopper), read at every launch
GEMM_SPLITS = [1, 2, 4, 8, 16]
KERNEL_ENV = "LLMK_DECODE_KERNEL"  # mma (default on NVIDIA) | warp | split, read per call
KERNELS = (("mma", ""), ("warp", " (warp)"), ("split", " (previous kernel)"))
MASK_PREFETCH_ENV = "LLMK_DECODE_MASK_PREFETCH"  # "0": the mma kernel does not stage the mask (default "1"), per call


@dataclasses.dataclass
class Record:
    op: str
    shape: str
    dtype: str
    impl: str
    median_us: float
    tbps: float
    note: str = ""


def _sdpa_peers(q, k, v, device):
    """[(name, fn, note)] for the SDPA flash and cuDNN backends (only those that run here)."""
    if device != "cuda":
        return [("sdpa (default)", lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True), "enable_gqa")]
    from torch.nn.attention import SDPBackend, sdpa_kernel

    rep = q.shape[1] // k.shape[1]
    k_exp, v_exp = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    peers = []
    for name, backend in (("sdpa flash", SDPBackend.FLASH_ATTENTION), ("sdpa cudnn", SDPBackend.CUDNN_ATTENTION)):
        for note, args, kw in (("enable_gqa", (q, k, v), {"enable_gqa": True}),
                               ("K/V expanded to 32 heads (reads 4x)", (q, k_exp, v_exp), {})):
            def fn(args=args, kw=kw, backend=backend):
                with sdpa_kernel([backend]):
                    return F.scaled_dot_product_attention(*args, **kw)
            try:
                fn()
                torch.cuda.synchronize()
            except RuntimeError:
                continue
            peers.append((name, fn, note))
            break
    return peers


def _attention(records, shapes, device, timer, dtype):
    H, Hkv, D = ATTN_HEADS, ATTN_KV_HEADS, ATTN_DIM
    for B, S in shapes:
        shape = f"b{B} kv{S}"
        kv_bytes = 2 * B * Hkv * S * D * torch.finfo(dtype).bits // 8
        q = torch.randn(B, 1, H, D, device=device, dtype=dtype)
        k = torch.randn(B, Hkv, S, D, device=device, dtype=dtype)
        v = torch.randn(B, Hkv, S, D, device=device, dtype=dtype)
        lens = torch.full((B,), S, dtype=torch.int32, device=device)
        bs = 16
        nblk = B * S // bs
        perm = torch.randperm(nblk, device=device)
        table = perm.view(B, S // bs).to(torch.int32)
        # paged copy of the same cache: block table[b, i] holds positions i*bs .. i*bs+bs-1 of b
        kp = torch.empty(nblk, bs, Hkv, D, device=device, dtype=dtype)
        vp = torch.empty_like(kp)
        kp[perm] = k.view(B, Hkv, S // bs, bs, D).permute(0, 2, 3, 1, 4).reshape(nblk, bs, Hkv, D)
        vp[perm] = v.view(B, Hkv, S // bs, bs, D).permute(0, 2, 3, 1, 4).reshape(nblk, bs, Hkv, D)
        impls = []
        os.environ.pop("LLMK_DECODE_LEGACY", None)
        for kernel, suffix in KERNELS if device == "cuda" else KERNELS[:1]:
            for name, kc, vc, tab in (("llm_kernels contiguous", k, v, None), ("llm_kernels paged16", kp, vp, table)):
                os.environ[KERNEL_ENV] = kernel  # read per call: plan, workspace size and launch
                nbytes = decode.decode_workspace_size(q, kc, tab)
                ws = torch.empty(nbytes, dtype=torch.uint8, device=device) if nbytes else None

                def fn(kc=kc, vc=vc, tab=tab, ws=ws, kernel=kernel):
                    os.environ[KERNEL_ENV] = kernel
                    return decode.decode_attention(q, kc, vc, lens, tab, workspace=ws)

                impls.append((name + suffix, fn, "split-KV" if nbytes else "one split"))
        os.environ.pop(KERNEL_ENV, None)
        qs = q.transpose(1, 2)  # (B, H, 1, D)
        impls += _sdpa_peers(qs, k, v, device)
        for name, fn, note in impls:
            us = timer(fn) * 1e3
            os.environ.pop(KERNEL_ENV, None)
            records.append(Record("decode_attention", shape, "bf16" if dtype == torch.bfloat16 else "fp16", name, us,
                                  kv_bytes / us / 1e6, note))


def _model_step_attention(records, device, timer, dtype, capacity=203, length=160):
    """The 1B model's decode step as `llm-kernels e2e` runs it: batch 1, 32 / 8 heads of 64, a static
    cache of `capacity` slots holding `length` keys, and HF's additive mask hiding the rest. Ours
    with the mask over the whole capacity (what kernelize does) and with exact seq_lens (no mask),
    per kernel, beside SDPA with the mask (HF's sdpa path). The tensor-core kernel stages the mask
    with K/V and cuts each chunk at its last visible key (the default); "masked (per-lane loads)":
    the same kernel with LLMK_DECODE_MASK_PREFETCH=0 (each lane reads its mask terms)."""
    H, Hkv, D, B = 32, 8, 64, 1
    q = torch.randn(B, 1, H, D, device=device, dtype=dtype)
    k = torch.randn(B, Hkv, capacity, D, device=device, dtype=dtype)
    v = torch.randn(B, Hkv, capacity, D, device=device, dtype=dtype)
    mask = torch.zeros(B, 1, 1, capacity, device=device, dtype=dtype)
    mask[..., length:] = torch.finfo(dtype).min
    full = torch.full((B,), capacity, dtype=torch.int32, device=device)
    exact = torch.full((B,), length, dtype=torch.int32, device=device)
    impls = []
    for kernel, suffix in KERNELS if device == "cuda" else KERNELS[:1]:
        variants = [("llm_kernels masked", full, mask, ""), ("llm_kernels seq_lens", exact, None, "")]
        if kernel == "mma" and device == "cuda":
            variants.insert(1, ("llm_kernels masked (per-lane loads)", full, mask, "0"))
        for name, lens, m, prefetch in variants:
            def fn(lens=lens, m=m, kernel=kernel, prefetch=prefetch):
                os.environ[KERNEL_ENV] = kernel
                os.environ[MASK_PREFETCH_ENV] = prefetch
                return decode.decode_attention(q, k, v, lens, attn_mask=m)
            impls.append((name + suffix, fn, ""))
    qs = q.transpose(1, 2)
    impls.append(("sdpa + mask", lambda: F.scaled_dot_product_attention(qs, k, v, attn_mask=mask, enable_gqa=True),
                  "the default backend, enable_gqa"))
    kv_bytes = 2 * B * Hkv * length * D * torch.finfo(dtype).bits // 8
    for name, fn, note in impls:
        us = timer(fn) * 1e3
        os.environ.pop(KERNEL_ENV, None)
        os.environ.pop(MASK_PREFETCH_ENV, None)
        records.append(Record("decode_attention (1B model step)", f"b1 cache{capacity} len{length} D64",
                              "bf16" if dtype == torch.bfloat16 else "fp16", name, us, kv_bytes / us / 1e6, note))


@dataclasses.dataclass
class LayerShape:
    """A decoder layer's decode-step shapes (defaults: the 1B model `llm-kernels e2e` builds)."""
    hidden: int = 2048
    inter: int = 8192
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 64
    cache: int = 203  # static cache slots


def layer_weights(s: LayerShape, device, dtype, gen: torch.Generator) -> dict:
    """Random weights of one layer for layer_step: norms, fused qkv, o, fused gate/up, down, the
    rotary [cos | sin] table (float32) and the layer's K/V cache."""
    def rand(*shape, scale=1.0):
        return torch.randn(*shape, device=device, dtype=dtype, generator=gen) * scale

    h, d = s.hidden, s.head_dim
    theta = torch.arange(s.cache, device=device)[:, None] * torch.rand(d // 2, device=device, generator=gen)
    return {
        "shape": s, "wn1": rand(h, scale=0.1) + 1, "wn2": rand(h, scale=0.1) + 1,
        "wqkv": rand((s.heads + 2 * s.kv_heads) * d, h, scale=h**-0.5),
        "wo": rand(h, s.heads * d, scale=(s.heads * d)**-0.5),
        "wgu": rand(2 * s.inter, h, scale=h**-0.5), "wd": rand(h, s.inter, scale=s.inter**-0.5),
        "rope": torch.cat([torch.cos(theta), torch.sin(theta)], -1),
        "kc": rand(1, s.kv_heads, s.cache, d), "vc": rand(1, s.kv_heads, s.cache, d),
    }


def layer_step(w: dict, x, pos, lens, num_splits: int = 0, fuse: bool = True):
    """One decoder layer's decode step (batch 1, one token at cache position `pos` (1, 1); lens (1,)
    int32) on our kernels alone, each reading the previous one's output. fuse=True (what kernelize
    runs): qkv GEMM with the RMSNorm prologue, RoPE, K/V write, decode attention, o GEMM with the
    residual epilogue, gate/up GEMM with the RMSNorm prologue and the SwiGLU epilogue, down GEMM
    with the residual epilogue. fuse=False: the same with separate RMSNorm and add launches."""
    s = w["shape"]
    hq, hkv, d = s.heads, s.kv_heads, s.head_dim
    if fuse:
        qkv = decode.skinny_gemm(x, w["wqkv"], norm_weight=w["wn1"], fixed_weight=True)
    else:
        qkv = decode.skinny_gemm(ops.rms_norm(x, w["wn1"]), w["wqkv"], fixed_weight=True)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], -1)
    q, k = ops.rope(q.view(1, 1, hq, d), k.view(1, 1, hkv, d), cos_sin_cache=w["rope"], positions=pos)
    decode.write_kv_cache(w["kc"], w["vc"], k, v.view(1, 1, hkv, d), pos)
    a = decode.decode_attention(q, w["kc"], w["vc"], lens, num_splits=num_splits)
    if fuse:
        x = decode.skinny_gemm(a.view(1, hq * d), w["wo"], residual=x, fixed_weight=True)
        u = decode.skinny_gemm(x, w["wgu"], activation="swiglu", norm_weight=w["wn2"], fixed_weight=True)
        return decode.skinny_gemm(u, w["wd"], residual=x, fixed_weight=True)
    h, x = ops.fused_add_rms_norm(decode.skinny_gemm(a.view(1, hq * d), w["wo"], fixed_weight=True), x, w["wn2"])
    u = decode.skinny_gemm(h, w["wgu"], activation="swiglu", fixed_weight=True)
    return x + decode.skinny_gemm(u, w["wd"], fixed_weight=True)


# decoder_layer_step's tensor arguments after x, by layer_weights' names (position comes after them)
_FUSED_ARGS = ("wn1", "wqkv", "wo", "wn2", "wgu", "wd", "rope", "kc", "vc")


def fused_layer_phases(workspace: torch.Tensor) -> str:
    """Block 0's timeline of the last decoder_layer_step that used `workspace` (global-timer stamps
    at byte 16, src/decode/decode_internal.h): us per phase, barrier waits in brackets."""
    t = workspace[16:16 + 8 * 14].view(torch.int64).cpu().tolist()
    names = ["norm", "qkv", "[b]", "attn", "[b]", "merge", "o", "[b]", "norm", "gate/up", "[b]", "stage", "down"]
    return "phases us: " + " ".join(f"{n} {(b - a) / 1e3:.1f}" for n, a, b in zip(names, t, t[1:]))


def _model_layers_graph(records, device, timer, dtype, layers: int = 16, length: int = 160):
    """The 1B model's 16 decoder layers of one batch-1 decode step on our kernels alone (no
    Hugging Face code: what the model's kernels cost without its glue), captured in one CUDA
    graph, with and without programmatic dependent launch (LLMK_PDL, read at capture). TB/s counts
    the layers' weights."""
    s = LayerShape()
    gen = torch.Generator(device=device).manual_seed(0)
    ws = [layer_weights(s, device, dtype, gen) for _ in range(layers)]
    x = torch.randn(1, s.hidden, device=device, dtype=dtype, generator=gen)
    pos = torch.tensor([[length - 1]], device=device)
    lens = torch.tensor([length], device=device, dtype=torch.int32)

    def step(fuse=True):
        y = x
        for w in ws:
            y = layer_step(w, y, pos, lens, fuse=fuse)
        return y

    wbytes = sum(w[n].numel() * w[n].element_size() for w in ws for n in ("wqkv", "wo", "wgu", "wd"))
    old = os.environ.get(PDL_ENV)
    try:
        for name, pdl, fuse in (("llm_kernels", "1", True), ("llm_kernels separate norm/add", "1", False),
                                ("llm_kernels no PDL", "0", True)):
            os.environ[PDL_ENV] = pdl
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                step(fuse)  # warm-up: occupancy queries, workspaces
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                step(fuse)
            us = timer(graph.replay) * 1e3
            records.append(Record("decoder layers (1B model decode step, CUDA graph)", f"b1 {layers} layers len{length}",
                                  "bf16" if dtype == torch.bfloat16 else "fp16", name, us, wbytes / us / 1e6,
                                  "our ops only"))
            del graph
        # the same 16 layers, each one persistent kernel (decode.decoder_layer_step), one workspace
        position = pos.reshape(1)
        layer_ws = decode.decoder_layer_workspace(x, *(ws[0][n] for n in _FUSED_ARGS[:-1]), ws[0]["vc"])

        def fused_step():
            y = x
            for w in ws:
                y = decode.decoder_layer_step(y, *(w[n] for n in _FUSED_ARGS), position, workspace=layer_ws)
            return y

        os.environ[PDL_ENV] = "0"
        fused_step()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fused_step()
        us = timer(graph.replay) * 1e3
        records.append(Record("decoder layers (1B model decode step, CUDA graph)", f"b1 {layers} layers len{length}",
                              "bf16" if dtype == torch.bfloat16 else "fp16", "llm_kernels fused layer", us,
                              wbytes / us / 1e6, "one persistent kernel per layer"))
        del graph
        records[-1] = dataclasses.replace(records[-1], note=records[-1].note + "; " + fused_layer_phases(layer_ws))
    finally:
        if old is None:
            os.environ.pop(PDL_ENV, None)
        else:
            os.environ[PDL_ENV] = old


def _linear_swiglu(x, w):
    g, u = F.linear(x, w).chunk(2, -1)
    return F.silu(g) * u


def _gemm(records, rows, shapes, device, timer, dtype, op="skinny_gemm", sweep=False):
    """shapes: (K, N) or (K, N, activation); ours with LLMK_GEMM_KERNEL = default and deep.
    sweep: instead, the deep kernel with each K split forced (LLMK_GEMM_DEEP_SPLIT), for tuning."""
    old_env = {k: os.environ.get(k) for k in (GEMM_KERNEL_ENV, GEMM_LOADS_ENV, GEMM_SPLIT_ENV, PDL_ENV)}
    try:
        for shape in shapes:
            K, N, act = (*shape, None)[:3]
            w = torch.randn(N, K, device=device, dtype=dtype) / K**0.5
            wbytes = N * K * torch.finfo(dtype).bits // 8
            for M in rows:
                x = torch.randn(M, K, device=device, dtype=dtype)
                # (name, kernel, loads, split, pdl); "no PDL": the default kernel launched without
                # programmatic dependent launch (the default on Hopper: a call may start while the
                # previous one ends)
                impls = [("llm_kernels", "default", "", "", ""), ("llm_kernels no PDL", "default", "", "", "0"),
                         ("llm_kernels tma", "tma", "", "", ""), ("F.linear", None, "", "", "")]
                if device != "cuda":
                    impls = impls[:1] + impls[3:]
                if sweep:
                    impls = [(f"llm_kernels deep sk={sk}", "deep", "", str(sk), "") for sk in GEMM_SPLITS]
                for name, kernel, loads, split, pdl in impls:
                    os.environ[GEMM_SPLIT_ENV] = split
                    os.environ[PDL_ENV] = pdl
                    if kernel is None:
                        fn = (lambda: _linear_swiglu(x, w)) if act == "swiglu" else (lambda: F.linear(x, w))
                    else:
                        os.environ[GEMM_KERNEL_ENV] = kernel
                        os.environ[GEMM_LOADS_ENV] = loads
                        fn = lambda: decode.skinny_gemm(x, w, activation=act, fixed_weight=True)  # noqa: E731
                    us = timer(fn) * 1e3
                    label = f"M{M} K{K} N{N}" + (f" {act}" if act else "")
                    records.append(Record(op, label, "bf16" if dtype == torch.bfloat16 else "fp16", name, us,
                                          wbytes / us / 1e6, "F.linear + silu(g) * u" if kernel is None and act else ""))
    finally:
        for k, v in old_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


PARTS = ("attention", "gemm", "model")  # decode attention; the skinny GEMM shapes; the 1B model's GEMMs and layers


class UnknownPart(ValueError):
    """run()'s parts named a table bench-decode does not have."""


def run(quick: bool = False, device: str | None = None, progress=None, parts: tuple[str, ...] = PARTS) -> dict:
    """parts: which tables to time (PARTS: decode attention at ATTN_SHAPES and a model step's call,
    the skinny GEMM at GEMM_SHAPES, the 1B model's decode GEMMs and its layers in a CUDA graph)."""
    unknown = set(parts) - set(PARTS)
    if unknown:
        raise UnknownPart(f"unknown part(s) {sorted(unknown)}; choose from {', '.join(PARTS)}")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    timer = _timer(device)
    copy_gbps = copy_bandwidth_gbps(device, timer)
    dtype = torch.bfloat16
    records: list[Record] = []
    if device == "cpu":
        attn, rows, gemm, model = CPU_ATTN, [1], CPU_GEMM, []
    else:
        attn = ATTN_QUICK if quick else ATTN_SHAPES
        rows, gemm = (GEMM_QUICK_ROWS, GEMM_QUICK) if quick else (GEMM_ROWS, GEMM_SHAPES)
        model = GEMM_MODEL_QUICK if quick else GEMM_MODEL
    if "attention" in parts:
        _attention(records, attn, device, timer, dtype)
        _model_step_attention(records, device, timer, dtype)
        if device == "cuda":  # a static cache of 4096 slots holding 160 keys (the prefetch's effective end)
            _model_step_attention(records, device, timer, dtype, capacity=4096)
    if "gemm" in parts:
        _gemm(records, rows, gemm, device, timer, dtype)
    if "model" in parts:
        _gemm(records, [1], model, device, timer, dtype, op="skinny_gemm (1B model decode)")
        if device == "cuda":
            _model_layers_graph(records, device, timer, dtype)
    if "gemm" in parts and device == "cuda" and not quick and os.environ.get("LLMK_BENCH_GEMM_SWEEP"):
        _gemm(records, [1], GEMM_SHAPES, device, timer, dtype, op="skinny_gemm deep K-split sweep", sweep=True)
    return {"meta": _meta(device, copy_gbps), "records": [dataclasses.asdict(r) for r in records]}


def to_markdown(result: dict, command: str = "") -> str:
    """A table per op: one row per shape, per implementation us and TB/s, and ours vs the best peer."""
    lines = bench.header_lines(result["meta"], command)
    by_op = bench.records_by_op(result["records"])
    for op, recs in by_op.items():
        unit = "KV read" if op == "decode_attention" else "weight read"
        impls = list(dict.fromkeys(r["impl"] for r in recs))
        ours = [i for i in impls if i.startswith("llm_kernels")]
        lines += ["", f"### {op} (us, median; TB/s of {unit})", ""]
        lines.append("| dtype | shape | " + " | ".join(impls) + " | " + " | ".join(f"{o} vs best peer" for o in ours) + " |")
        lines.append("|---" * (2 + len(impls) + len(ours)) + "|")
        for dt, shape in dict.fromkeys((r["dtype"], r["shape"]) for r in recs):
            row = {r["impl"]: r for r in recs if r["dtype"] == dt and r["shape"] == shape}
            cells = [f"{row[i]['median_us']:.1f} ({row[i]['tbps']:.2f})" if i in row else "-" for i in impls]
            peers = [v["median_us"] for k, v in row.items() if not k.startswith("llm_kernels")]
            vs = [f"{min(peers) / row[o]['median_us']:.2f}x" if peers and o in row else "-" for o in ours]
            lines.append(f"| {dt} | {shape} | " + " | ".join(cells) + " | " + " | ".join(vs) + " |")
        notes = {f"{r['impl']}: {r['note']}" for r in recs if r["note"] and not r["impl"].startswith("llm_kernels")}
        if notes:
            lines += ["", "Peers: " + "; ".join(sorted(notes)) + "."]
    return "\n".join(lines) + "\n"


def save(result: dict, json_path: str | None, md_path: str | None, command: str = "") -> None:
    bench.write_outputs(result, json_path, md_path, to_markdown(result, command))
