"""What `llm-kernels bench-attention` measures: attention forward, ours (the default kernel, the
mma.sync one ("v2", LLMK_ATTENTION_HOPPER=0) and on sm_90 the Hopper wgmma kernel's tilings,
LLMK_ATTENTION_HOPPER_CONFIG, for D 64 and 128) beside torch SDPA with each backend (math on the
CPU only, efficient, flash, cuDNN, forced through torch.nn.attention.sdpa_kernel), per shape
(B, H, S, D), causal or not, fp16 and bf16: median time, TFLOP/s (4 * B * H * S * S * D, halved
when causal) and, for ours, the peak memory the call adds (torch.cuda.max_memory_allocated delta)
beside the size of inputs plus output.

Timing is bench.py's (triton do_bench median, or its CUDA-event timer), every implementation of a
shape timed in `rounds` rounds in alternating order and the median kept (bench.rotated_medians:
one pass in a fixed order favoured whichever ran first). On the CPU (no GPU) it runs fp32 CPU
shapes (one tiny one with --quick): our CPU kernel beside the math and flash backends (the flash
one is PyTorch's CPU default).
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import torch.nn.functional as F

from . import bench
from .flash import attention

SHAPES = [(1, 32, 512, 128), (1, 32, 4096, 128), (2, 24, 4096, 64), (1, 16, 8192, 64), (4, 32, 8192, 128)]
QUICK_SHAPES = [(1, 32, 512, 128), (1, 32, 4096, 128)]
CPU_SHAPES = [(1, 8, 512, 64), (1, 8, 1024, 128), (2, 4, 333, 80)]
CPU_QUICK_SHAPES = [(1, 2, 128, 64)]
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


@dataclasses.dataclass
class Record:
    shape: str  # B,H,S,D
    dtype: str
    causal: bool
    impl: str
    median_ms: float | None
    tflops: float | None
    peak_mb: float | None = None  # ours: memory the call adds (output, lse, workspace)
    io_mb: float | None = None  # inputs plus output
    max_abs_vs_sdpa: float | None = None  # ours vs PyTorch's SDPA (default backend)
    note: str = ""


def flops(b: int, h: int, s: int, d: int, causal: bool) -> float:
    f = 4.0 * b * h * s * s * d
    return f / 2 if causal else f


def _sdpa_impls(device: str, s: int):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    # the math backend (it forms the S x S matrix) only on the CPU: on the GPU it is far behind and
    # the bench is kept short
    backends = [("math", SDPBackend.MATH), ("flash", SDPBackend.FLASH_ATTENTION)] if device == "cpu" else []
    if device == "cuda":
        backends += [("efficient", SDPBackend.EFFICIENT_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION),
                     ("cudnn", SDPBackend.CUDNN_ATTENTION)]

    def make(backend):
        def fn(q, k, v, causal):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        return fn

    return [(f"sdpa {name}", make(b)) for name, b in backends]


_KERNEL_ENV = ("LLMK_ATTENTION_HOPPER", "LLMK_ATTENTION_HOPPER_CONFIG")


def _ours_impls(device: str, d: int, dtype: torch.dtype):
    ours = lambda q, k, v, causal: attention(q, k, v, causal=causal)  # noqa: E731
    impls = [("llm_kernels", ours, {})]
    if device == "cuda":
        # v2 (the mma.sync kernel; the default before sm_90's wgmma kernel)
        impls.append(("llm_kernels (v2)", ours, {"LLMK_ATTENTION_HOPPER": "0"}))
        if d in (64, 128) and torch.cuda.get_device_capability() == (9, 0):
            # the Hopper kernel's tilings (LLMK_ATTENTION_HOPPER_CONFIG) beside its default choice;
            # "ws" / "ws_pp" the warp-specialised ones (TMA producer; ping-pong consumers); "ws3" their
            # 192-row blocks of three consumer warpgroups (D = 64 only)
            for config in ("pipe", "wg1", "ws", "ws_pp") + (("ws3",) if d == 64 else ()):
                impls.append((f"llm_kernels (wgmma {config})", ours,
                              {"LLMK_ATTENTION_HOPPER": "1", "LLMK_ATTENTION_HOPPER_CONFIG": config}))
    return impls


def _peak_mb(fn) -> float:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out
    return peak / 2**20


def _kernel_values(env: dict) -> dict:
    """Exactly this implementation's switches set, the others unset."""
    return {var: env.get(var) for var in _KERNEL_ENV}


def run(shapes=None, dtypes=("fp16", "bf16"), causals=(False, True), device=None, progress=None,
        quick=False, rounds: int = 2) -> dict:
    """rounds: each implementation is timed this many times per shape, the implementations in
    alternating order (bench.rotated_medians), and the median kept."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    timer = bench._timer(device)
    if device == "cpu":
        shapes = shapes or (CPU_QUICK_SHAPES if quick else CPU_SHAPES)
        dtypes = ("fp32",)  # what the CPU kernel runs
    shapes = shapes or (QUICK_SHAPES if quick else SHAPES)
    records: list[Record] = []
    task = progress.add_task("attention", total=len(shapes) * len(dtypes) * len(causals)) if progress else None
    for b, h, s, d in shapes:
        for dname in dtypes:
            dtype = DTYPES[dname] if device == "cuda" else torch.float32
            q, k, v = (torch.randn(b, h, s, d, device=device, dtype=dtype) for _ in range(3))
            io_mb = 4 * q.numel() * q.element_size() / 2**20
            for causal in causals:
                fl = flops(b, h, s, d, causal)
                shape = f"{b},{h},{s},{d}"
                want = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                timed = []  # (record without its time, zero-argument timer call)
                for name, fn, env in _ours_impls(device, d, dtype):
                    call = functools.partial(fn, q, k, v, causal)
                    with bench.envs(_kernel_values(env)):
                        got = call()
                        err = (got.float() - want.float()).abs().max().item()
                        del got
                        peak = _peak_mb(call) if device == "cuda" else None
                    rec = Record(shape, dname, causal, name, None, None, peak, io_mb, err)
                    timed.append((rec, bench.timed_in_env(timer, call, _kernel_values(env))))
                    records.append(rec)
                for name, fn in _sdpa_impls(device, s):
                    call = functools.partial(fn, q, k, v, causal)
                    rec = Record(shape, dname, causal, name, None, None)
                    records.append(rec)
                    try:
                        call()
                    except RuntimeError as e:  # backend not available for this shape/dtype/GPU
                        rec.note = str(e).split("\n")[0][:120]
                        continue
                    timed.append((rec, functools.partial(timer, call)))
                for (rec, _), ms in zip(timed, bench.rotated_medians([m for _, m in timed], rounds)):
                    rec.median_ms, rec.tflops = ms, fl / ms / 1e9
                del want
                if progress:
                    progress.advance(task)
            del q, k, v
    meta = bench._meta(device, bench.copy_bandwidth_gbps(device, timer))
    meta["rounds"] = rounds
    return {"meta": meta, "records": [dataclasses.asdict(r) for r in records]}


def _fmt(tflops: float) -> str:
    return f"{tflops:.1f}" if tflops >= 1 else f"{tflops:.3g}"


def to_markdown(result: dict, command: str = "") -> str:
    """One table per (dtype, causal): TFLOP/s per implementation, our peak memory beside inputs
    plus output, and our speed over the best SDPA backend."""
    meta = result["meta"]
    lines = [
        f"Attention forward, measured {meta['date']} on {meta.get('gpu', meta.get('cpu'))} "
        f"(torch {meta['torch']}, driver {meta.get('driver', '-')}), {meta['timer']}"
        + (f", median of {meta['rounds']} rounds over the implementations in alternating order"
           if meta.get("rounds", 1) > 1 else "")
        + ". TFLOP/s = 4*B*H*S*S*D / time (halved when causal); '-' = backend unavailable.",
    ]
    if command:
        lines.append(f"Command: `{command}`")
    recs = result["records"]
    impls = list(dict.fromkeys(r["impl"] for r in recs))
    for dt in dict.fromkeys(r["dtype"] for r in recs):
        for causal in dict.fromkeys(r["causal"] for r in recs):
            sub = [r for r in recs if r["dtype"] == dt and r["causal"] == causal]
            lines += ["", f"### {dt}, {'causal' if causal else 'non-causal'} (TFLOP/s)", ""]
            lines.append("| B,H,S,D | " + " | ".join(impls) + " | ours peak MB (in+out MB) | ours max abs vs SDPA | vs best SDPA |")
            lines.append("|---" * (len(impls) + 4) + "|")
            for shape in dict.fromkeys(r["shape"] for r in sub):
                row = {r["impl"]: r for r in sub if r["shape"] == shape}
                cells = [_fmt(row[i]["tflops"]) if i in row and row[i]["tflops"] else "-" for i in impls]
                ours = row["llm_kernels"]
                peers = [r["tflops"] for name, r in row.items() if name.startswith("sdpa") and r["tflops"]]
                vs = f"{ours['tflops'] / max(peers):.2f}x" if peers else "-"
                peak = f"{ours['peak_mb']:.1f} ({ours['io_mb']:.1f})" if ours["peak_mb"] is not None else "-"
                lines.append(f"| {shape} | " + " | ".join(cells) + f" | {peak} | {ours['max_abs_vs_sdpa']:.2g} | {vs} |")
            # the other kernels of ours: their worst difference from SDPA over this table's shapes
            others = {}
            for r in sub:
                if r["impl"].startswith("llm_kernels (") and r["max_abs_vs_sdpa"] is not None:
                    others[r["impl"]] = max(others.get(r["impl"], 0.0), r["max_abs_vs_sdpa"])
            if others:
                lines += ["", "Max abs vs SDPA: " + ", ".join(f"{k} {v:.2g}" for k, v in others.items())]
    notes = [r for r in recs if r["note"]]
    if notes:
        lines += ["", "Unavailable:", ""]
        lines += [f"- {r['impl']} {r['dtype']} {r['shape']} causal={r['causal']}: {r['note']}" for r in notes]
    return "\n".join(lines) + "\n"


def save(result: dict, json_path: str | None, md_path: str | None, command: str = "") -> None:
    bench.write_outputs(result, json_path, md_path, to_markdown(result, command))