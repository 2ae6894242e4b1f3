"""What `llm-kernels bench` measures: per op, dtype and shape, our median time beside the peers
users have today, with achieved bandwidth and its share of the device copy bandwidth measured in
the same run.

GPU timing: triton.testing.do_bench (CUDA events, L2 flushed between runs, median) when Triton is
installed, else an equivalent event timer of our own. CPU timing: wall clock, median.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import platform
import statistics
import time
from typing import Callable

import torch
import torch.nn.functional as F

from . import ops, reference

SHAPES = {"large": [(2048, 4096), (4096, 5120), (16384, 8192)]}
RMS_SHAPES = [(1, 4096), (32, 4096), (512, 4096), (2048, 4096), (4096, 5120), (8192, 2048), (16384, 8192)]
QUICK_SHAPES = [(1, 4096), (32, 4096), (512, 4096)]
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
OPS = ("rms_norm", "fused_add_rms_norm")


@dataclasses.dataclass
class Record:
    op: str
    shape: str
    dtype: str
    impl: str
    median_ms: float
    gbps: float
    pct_of_copy: float


def _timer(device: str) -> Callable[[Callable[[], object]], float]:
    if device == "cuda":
        try:
            from triton.testing import do_bench

            return lambda fn: float(do_bench(fn, warmup=25, rep=100, return_mode="median"))
        except ImportError:
            return _event_timer
    return _wall_timer


def _event_timer(fn, reps: int = 100) -> float:
    flush = torch.empty(256 * 1024 * 1024, dtype=torch.uint8, device="cuda")
    for _ in range(5):
        fn()
    times = []
    for _ in range(reps):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _wall_timer(fn, reps: int = 20) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def copy_bandwidth_gbps(device: str, timer) -> float:
    """Device-to-device copy rate, bytes read + written: the bandwidth roof for memory-bound ops."""
    n = (1 << 30) if device == "cuda" else (1 << 26)
    src = torch.empty(n, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    ms = timer(lambda: dst.copy_(src))
    return 2 * n / ms / 1e6


def _peers(op: str, device: str):
    """(name, fn(x, residual, weight)) for each peer of op."""
    eps = 1e-6
    if op == "rms_norm":
        eager = lambda x, r, w: reference.llama_rms_norm_ref(x, w, eps)  # noqa: E731
        peers = [
            ("llm_kernels", lambda x, r, w: ops.rms_norm(x, w, eps)),
            ("eager (HF LlamaRMSNorm)", eager),
            ("F.rms_norm", lambda x, r, w: F.rms_norm(x, (x.shape[-1],), w, eps)),
        ]
    else:
        def eager(x, r, w):
            s = x + r
            return reference.llama_rms_norm_ref(s, w, eps), s

        peers = [
            ("llm_kernels", lambda x, r, w: ops.fused_add_rms_norm(x, r, w, eps)),
            ("eager (add + HF LlamaRMSNorm)", eager),
        ]
    peers.append(("torch.compile", torch.compile(eager, dynamic=False)))
    return peers


def _bytes(op: str, rows: int, cols: int, dtype: torch.dtype) -> int:
    e = torch.finfo(dtype).bits // 8
    tensors = 2 if op == "rms_norm" else 4  # x read, y written (+ residual read and written)
    return tensors * rows * cols * e + cols * e


def run(op_names=OPS, shapes=None, dtypes=("fp16", "bf16"), device=None, progress=None, peers=True) -> dict:
    """Runs the benchmark and returns {"meta": ..., "records": [...]}."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 256)
    if device == "cpu" and shapes is None:
        shapes = QUICK_SHAPES
    shapes = shapes or RMS_SHAPES
    timer = _timer(device)
    copy_gbps = copy_bandwidth_gbps(device, timer)
    records: list[Record] = []
    total = len(op_names) * len(shapes) * len(dtypes)
    task = progress.add_task("benchmarking", total=total) if progress else None
    for op in op_names:
        impls = _peers(op, device) if peers else _peers(op, device)[:1]
        for dname in dtypes:
            dtype = DTYPES[dname]
            for rows, cols in shapes:
                x = torch.randn(rows, cols, device=device, dtype=dtype)
                r = torch.randn(rows, cols, device=device, dtype=dtype)
                w = torch.rand(cols, device=device, dtype=dtype) + 0.5
                nbytes = _bytes(op, rows, cols, dtype)
                for impl, fn in impls:
                    ms = timer(lambda: fn(x, r, w))
                    gbps = nbytes / ms / 1e6
                    records.append(Record(op, f"{rows}x{cols}", dname, impl, ms, gbps, 100 * gbps / copy_gbps))
                if progress:
                    progress.advance(task)
    return {"meta": _meta(device, copy_gbps), "records": [dataclasses.asdict(r) for r in records]}


def _meta(device: str, copy_gbps: float) -> dict:
    meta = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "device": device,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "copy_gbps": copy_gbps,
        "timer": "triton.testing.do_bench median" if device == "cuda" else "wall clock median",
    }
    if device == "cuda":
        p = torch.cuda.get_device_properties(0)
        meta.update(gpu=p.name, cuda=torch.version.cuda, hip=torch.version.hip)
        try:
            import subprocess

            meta["driver"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=20,
            ).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            pass
    else:
        meta["cpu"] = platform.processor() or platform.machine()
    return meta


def to_markdown(result: dict, command: str = "") -> str:
    """A table per op: one row per (dtype, shape), one column per implementation (ms), then our
    GB/s, % of copy bandwidth, and the speed-up over the best peer."""
    meta = result["meta"]
    lines = [
        f"Measured {meta['date']} on {meta.get('gpu', meta.get('cpu'))} "
        f"(torch {meta['torch']}, driver {meta.get('driver', '-')}), {meta['timer']}; "
        f"copy bandwidth in the same run: {meta['copy_gbps'] / 1000:.2f} TB/s.",
    ]
    if command:
        lines.append(f"Command: `{command}`")
    by_op: dict[str, list[dict]] = {}
    for r in result["records"]:
        by_op.setdefault(r["op"], []).append(r)
    for op, recs in by_op.items():
        impls = list(dict.fromkeys(r["impl"] for r in recs))
        lines += ["", f"### {op} (ms, median)", ""]
        lines.append("| dtype | shape | " + " | ".join(impls) + " | ours GB/s | % of copy | vs best peer |")
        lines.append("|---" * (len(impls) + 5) + "|")
        keys = list(dict.fromkeys((r["dtype"], r["shape"]) for r in recs))
        for dt, shape in keys:
            row = {r["impl"]: r for r in recs if r["dtype"] == dt and r["shape"] == shape}
            ours = row["llm_kernels"]
            peer_ms = [v["median_ms"] for k, v in row.items() if k != "llm_kernels"]
            vs_peer = f"{min(peer_ms) / ours['median_ms']:.2f}x" if peer_ms else "-"
            cells = [f"{row[i]['median_ms']:.4f}" for i in impls]
            lines.append(
                f"| {dt} | {shape} | " + " | ".join(cells)
                + f" | {ours['gbps']:.0f} | {ours['pct_of_copy']:.0f}% | {vs_peer} |"
            )
    return "\n".join(lines) + "\n"


def save(result: dict, json_path: str | None, md_path: str | None, command: str = "") -> None:
    if json_path:
        with open(json_path, "w") as f:
            json.dump(result, f, indent=1)
    if md_path:
        with open(md_path, "w") as f:
            f.write(to_markdown(result, command))
