"""What `llm-kernels bench` measures: per op, dtype and shape, our median time beside the peers
users have today, with achieved bandwidth and its share of the device copy bandwidth measured in
the same run.

GPU timing: triton.testing.do_bench (CUDA events, L2 flushed between runs, median) when Triton is
installed, else an equivalent event timer of our own. CPU timing: wall clock, median.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import os
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


@dataclasses.dataclass
class Record:
    op: str
    shape: str
    dtype: str
    impl: str
    median_ms: float
    gbps: float
    pct_of_copy: float


@contextlib.contextmanager
def env(name: str, value: str | None):
    """Sets (None: unsets) the environment variable `name` for the block, then restores it: the
    library reads its LLMK_* switches at every call."""
    old = os.environ.get(name)
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


@contextlib.contextmanager
def envs(values: dict[str, str | None]):
    """bench.env for several variables at once (None: unset)."""
    with contextlib.ExitStack() as stack:
        for name, value in values.items():
            stack.enter_context(env(name, value))
        yield


def _timer(device: str) -> Callable[[Callable[[], object]], float]:
    if device == "cuda":
        try:
            from triton.testing import do_bench

            return lambda fn: float(do_bench(fn, warmup=25, rep=100, return_mode="median"))
        except ImportError:
            return _event_timer
    return _wall_timer


def cuda_graph(fn: Callable[[], object]) -> torch.cuda.CUDAGraph:
    """fn captured in a CUDA graph, after one warm-up call on a side stream (occupancy queries,
    workspaces and the caching allocator's first blocks happen there, outside the capture)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def _event_timer(fn, reps: int = 100, flush: Callable[[], object] | None = None) -> float:
    """Median of CUDA-event times of fn, each after `flush` (default: zeroing 256 MB, as do_bench
    does, which leaves L2 full of dirty lines)."""
    if flush is None:
        buf = torch.empty(256 * 1024 * 1024, dtype=torch.uint8, device="cuda")
        flush = buf.zero_
    for _ in range(5):
        fn()
    times = []
    for _ in range(reps):
        flush()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def graph_us_per_call(fn: Callable[[], object], calls: int, reps: int = 20) -> float:
    """us per call of `fn` (which makes `calls` calls) captured in one CUDA graph: the median of
    `reps` replays back to back (no flush between them), divided by `calls`."""
    graph = cuda_graph(fn)
    return _event_timer(graph.replay, reps=reps, flush=lambda: None) * 1e3 / calls


def _wall_timer(fn, reps: int = 20) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def timed_in_env(timer, fn: Callable[[], object], values: dict[str, str | None]) -> Callable[[], float]:
    """A measure for rotated_medians: timer(fn) with the environment variables `values` set (as
    bench.envs) around the timing only, e.g. one kernel's switches."""
    def measure() -> float:
        with envs(values):
            return timer(fn)
    return measure


def rotated_medians(measures: list[Callable[[], float]], rounds: int = 2) -> list[float]:
    """The median time of each of several measures (zero-argument functions returning ms, e.g. the
    implementations of one call), taken over `rounds` rounds that visit all of them in turn:
    forward on even rounds, backward on odd ones, each pair of rounds rotated by one more, so that
    no measure always runs first or last. One pass in a fixed order favoured whichever ran first
    on the H200: the same attention kernel timed first and seventh in one run measured 531.0 and
    433.7 TFLOP/s (2026-12-02 13:03), presumably the clocks recovering while the host prepared
    the shape."""
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")
    n = len(measures)
    times: list[list[float]] = [[] for _ in range(n)]
    for r in range(rounds):
        order = [(i + r // 2) % n for i in range(n)]
        if r % 2:
            order.reverse()
        for i in order:
            times[i].append(measures[i]())
    return [statistics.median(t) for t in times]


def copy_bandwidth_gbps(device: str, timer) -> float:
    """Device-to-device copy rate, bytes read + written: the bandwidth roof for memory-bound ops."""
    n = (1 << 30) if device == "cuda" else (1 << 26)
    src = torch.empty(n, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    ms = timer(lambda: dst.copy_(src))
    return 2 * n / ms / 1e6


SAME_BYTES_COPY = "copy, same bytes"


def same_bytes_copy(nbytes: int, device: str):
    """A torch device copy that reads and writes `nbytes` in all: the achievable time at this
    size (launch and ramp included), next to the 1 GiB copy bandwidth."""
    src = torch.empty(max(1, nbytes // 2), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return lambda *_: dst.copy_(src)


@dataclasses.dataclass
class OpSpec:
    """What to time for one op: its shapes, inputs, implementations and bytes that must move."""

    shapes: list
    quick: list
    make_inputs: Callable  # (rows, cols, dtype, device) -> tuple of tensors
    impls: Callable  # () -> [(name, fn(*inputs))], ours first
    nbytes: Callable  # (rows, cols, element size) -> int


def _rms_impls():
    eps = 1e-6
    eager = lambda x, w: reference.llama_rms_norm_ref(x, w, eps)  # noqa: E731
    return [
        ("llm_kernels", lambda x, w: ops.rms_norm(x, w, eps)),
        ("eager (HF LlamaRMSNorm)", eager),
        ("F.rms_norm", lambda x, w: F.rms_norm(x, (x.shape[-1],), w, eps)),
        ("torch.compile", torch.compile(eager, dynamic=False)),
    ]


def _fused_add_impls():
    eps = 1e-6

    def eager(x, r, w):
        s = x + r
        return reference.llama_rms_norm_ref(s, w, eps), s

    return [
        ("llm_kernels", lambda x, r, w: ops.fused_add_rms_norm(x, r, w, eps)),
        ("eager (add + HF LlamaRMSNorm)", eager),
        ("torch.compile", torch.compile(eager, dynamic=False)),
    ]


def _gated_impls(ours, eager_fn):
    return lambda: [
        ("llm_kernels", ours),
        ("eager", eager_fn),
        ("torch.compile", torch.compile(eager_fn, dynamic=False)),
    ]


def _rows_cols(rows, cols, dtype, device, n):
    return tuple(torch.randn(rows, cols, device=device, dtype=dtype) for _ in range(n))


ACT_SHAPES = [(1, 14336), (512, 8192), (2048, 8192), (4096, 4096), (4096, 14336)]
ACT_QUICK = [(1, 14336), (64, 4096)]

SPECS = {
    "rms_norm": OpSpec(
        RMS_SHAPES, QUICK_SHAPES,
        lambda r, c, dt, dev: (torch.randn(r, c, device=dev, dtype=dt), torch.rand(c, device=dev, dtype=dt) + 0.5),
        _rms_impls,
        lambda r, c, e: 2 * r * c * e + c * e,  # x read, y written, weight
    ),
    "fused_add_rms_norm": OpSpec(
        RMS_SHAPES, QUICK_SHAPES,
        lambda r, c, dt, dev: _rows_cols(r, c, dt, dev, 2) + (torch.rand(c, device=dev, dtype=dt) + 0.5,),
        _fused_add_impls,
        lambda r, c, e: 4 * r * c * e + c * e,  # x, residual read; residual, y written; weight
    ),
    "swiglu": OpSpec(
        ACT_SHAPES, ACT_QUICK,
        lambda r, c, dt, dev: _rows_cols(r, c, dt, dev, 2),
        _gated_impls(ops.swiglu, lambda g, u: F.silu(g) * u),
        lambda r, c, e: 3 * r * c * e,  # gate, up read; out written
    ),
    "geglu_tanh": OpSpec(
        ACT_SHAPES, ACT_QUICK,
        lambda r, c, dt, dev: _rows_cols(r, c, dt, dev, 2),
        _gated_impls(lambda g, u: ops.geglu(g, u, "tanh"), lambda g, u: F.gelu(g, approximate="tanh") * u),
        lambda r, c, e: 3 * r * c * e,
    ),
}
# RoPE: "rows x cols" is batch x tokens, with 32 query heads, 8 KV heads, head dim 128, the
# (B, H, S, D) layout and Hugging Face's duplicated cos/sin, as models call it.
ROPE_HEADS, ROPE_KV_HEADS, ROPE_DIM = 32, 8, 128


def _rope_inputs(batch, seq, dtype, device):
    q = torch.randn(batch, ROPE_HEADS, seq, ROPE_DIM, device=device, dtype=dtype)
    k = torch.randn(batch, ROPE_KV_HEADS, seq, ROPE_DIM, device=device, dtype=dtype)
    pos = torch.randint(0, 4096, (batch, seq), device=device).double()
    freqs = pos[..., None] / (10000.0 ** (torch.arange(0, ROPE_DIM, 2, device=device) / ROPE_DIM))
    emb = torch.cat([freqs, freqs], -1)
    return q, k, emb.cos().to(dtype), emb.sin().to(dtype)


def _rope_impls():
    eager = reference.hf_apply_rotary_pos_emb
    return [
        ("llm_kernels", ops.apply_rotary_pos_emb),
        ("eager (HF apply_rotary_pos_emb)", eager),
        ("torch.compile", torch.compile(eager, dynamic=False)),
    ]


SPECS["rope"] = OpSpec(
    [(1, 2048), (32, 1)], [(1, 64), (4, 1)],
    _rope_inputs,
    _rope_impls,
    # q and k read and written, and the (B, S, D) cos and sin read once each
    lambda b, s, e: 2 * (ROPE_HEADS + ROPE_KV_HEADS) * b * s * ROPE_DIM * e + 2 * b * s * ROPE_DIM * e,
)


# The rotary angles: "rows x cols" is batch x tokens, head dim 128, LLaMA's rotary embedding forward
# (Hugging Face's code, as transformers 5 writes it) against ops.rope_angles, one launch.
def _rope_angles_inputs(batch, seq, dtype, device):
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, ROPE_DIM, 2, dtype=torch.float32, device=device) / ROPE_DIM))
    return torch.zeros(1, device=device, dtype=dtype), inv_freq, torch.randint(0, 8192, (batch, seq), device=device)


def _hf_rotary_forward(x, inv_freq, position_ids, attention_scaling=1.0):
    freqs = position_ids[..., None].float() * inv_freq.to(device=x.device, dtype=torch.float)
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * attention_scaling).to(dtype=x.dtype), (emb.sin() * attention_scaling).to(dtype=x.dtype)


def _rope_angles_impls():
    return [
        ("llm_kernels", lambda x, inv, pos: ops.rope_angles(inv, pos, 1.0, x.dtype)),
        ("eager (HF LLaMA rotary forward)", _hf_rotary_forward),
        ("torch.compile", torch.compile(_hf_rotary_forward, dynamic=False)),
    ]


SPECS["rope_angles"] = OpSpec(
    [(1, 1), (32, 1), (1, 2048)], [(1, 1), (2, 64)],
    _rope_angles_inputs,
    _rope_angles_impls,
    lambda b, s, e: 2 * b * s * ROPE_DIM * e + 8 * b * s,  # cos and sin written, positions read
)
OPS = tuple(SPECS)


def run(op_names=OPS, shapes=None, dtypes=("fp16", "bf16"), device=None, progress=None, peers=True,
        quick=False) -> dict:
    """Runs the benchmark and returns {"meta": ..., "records": [...]}. `shapes` overrides every
    op's shapes; `quick` picks each op's small set (always on the CPU)."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 256)
    quick = quick or device == "cpu"
    timer = _timer(device)
    copy_gbps = copy_bandwidth_gbps(device, timer)
    records: list[Record] = []
    plan = [(op, shapes or (SPECS[op].quick if quick else SPECS[op].shapes)) for op in op_names]
    total = sum(len(s) for _, s in plan) * len(dtypes)
    task = progress.add_task("benchmarking", total=total) if progress else None
    for op, op_shapes in plan:
        spec = SPECS[op]
        impls = spec.impls() if peers else spec.impls()[:1]
        for dname in dtypes:
            dtype = DTYPES[dname]
            for rows, cols in op_shapes:
                inputs = spec.make_inputs(rows, cols, dtype, device)
                nbytes = spec.nbytes(rows, cols, torch.finfo(dtype).bits // 8)
                for impl, fn in [*impls, (SAME_BYTES_COPY, same_bytes_copy(nbytes, device))]:
                    ms = timer(lambda: fn(*inputs))
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


def header_lines(meta: dict, command: str = "") -> list[str]:
    """What a benchmark's Markdown starts with: when, where, how it was timed, and the command."""
    lines = [
        f"Measured {meta['date']} on {meta.get('gpu', meta.get('cpu'))} "
        f"(torch {meta['torch']}, driver {meta.get('driver', '-')}), {meta['timer']}; "
        f"copy bandwidth in the same run: {meta['copy_gbps'] / 1000:.2f} TB/s.",
    ]
    if command:
        lines.append(f"Command: `{command}`")
    return lines


def records_by_op(records: list[dict]) -> dict[str, list[dict]]:
    by_op: dict[str, list[dict]] = {}
    for r in records:
        by_op.setdefault(r["op"], []).append(r)
    return by_op


def to_markdown(result: dict, command: str = "") -> str:
    """A table per op: one row per (dtype, shape), one column per implementation (ms), then our
    GB/s, % of copy bandwidth, % of a copy moving the same bytes, and the speed-up over the best
    peer."""
    lines = header_lines(result["meta"], command)
    by_op = records_by_op(result["records"])
    for op, recs in by_op.items():
        impls = list(dict.fromkeys(r["impl"] for r in recs))
        lines += ["", f"### {op} (ms, median)", ""]
        lines.append("| dtype | shape | " + " | ".join(impls)
                     + " | ours GB/s | % of copy | % of same-bytes copy | vs best peer |")
        lines.append("|---" * (len(impls) + 6) + "|")
        keys = list(dict.fromkeys((r["dtype"], r["shape"]) for r in recs))
        for dt, shape in keys:
            row = {r["impl"]: r for r in recs if r["dtype"] == dt and r["shape"] == shape}
            ours = row["llm_kernels"]
            peer_ms = [v["median_ms"] for k, v in row.items() if k not in ("llm_kernels", SAME_BYTES_COPY)]
            vs_peer = f"{min(peer_ms) / ours['median_ms']:.2f}x" if peer_ms else "-"
            copy_row = row.get(SAME_BYTES_COPY)
            vs_copy = f"{100 * copy_row['median_ms'] / ours['median_ms']:.0f}%" if copy_row else "-"
            cells = [f"{row[i]['median_ms']:.4f}" if i in row else "-" for i in impls]
            lines.append(
                f"| {dt} | {shape} | " + " | ".join(cells)
                + f" | {ours['gbps']:.0f} | {ours['pct_of_copy']:.0f}% | {vs_copy} | {vs_peer} |"
            )
    return "\n".join(lines) + "\n"


def write_outputs(result: dict, json_path: str | None, md_path: str | None, markdown: str) -> None:
    """Writes a benchmark's result as JSON and its tables as Markdown (either path may be None);
    shared by every benchmark module."""
    if json_path:
        with open(json_path, "w") as f:
            json.dump(result, f, indent=1)
    if md_path:
        with open(md_path, "w") as f:
            f.write(markdown)


def save(result: dict, json_path: str | None, md_path: str | None, command: str = "") -> None:
    write_outputs(result, json_path, md_path, to_markdown(result, command))
