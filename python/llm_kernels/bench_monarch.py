"""Monarch benchmark: our fused forward and our backward beside dense F.linear (the n x n layer
it replaces) and the two-bmm formulation (monarch_matmul_ref, the Monarch authors' code) with its
autograd backward, and our forward without the cluster kernel (LLMK_MONARCH_CLUSTER=0, column "tiled":
the tiled two-kernel path, or at up to 16 tokens the few-token kernels (the one-launch kernel for
blocks at most 64 wide, else the two skinny stages), which "ours" runs where the cluster kernel does
not fit or is slower). bf16, square n in {2048, 4096, 8192}, blocks in {4, 16, 64},
tokens in {16, 2048, 16384}. Times are medians from bench.py's timer, every variant of a row timed in
`rounds` rounds in alternating order and the median kept (bench.rotated_medians), forwards under
torch.inference_mode; JSON records and a Markdown table."""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F

from . import monarch as M
from . import bench
from .bench import _meta, _timer, copy_bandwidth_gbps

NS = (2048, 4096, 8192)
BLOCKS = (4, 16, 64)
TOKENS = (16, 2048, 16384)
QUICK = [(4096, 64, 16), (4096, 64, 16384), (2048, 16, 2048)]
IMPLS = ("ours", "tiled", "two_bmm", "dense")


@dataclasses.dataclass
class Row:
    n: int
    blocks: int
    tokens: int
    fwd_ms: dict  # impl -> ms
    bwd_ms: dict  # impl -> ms (backward alone: dx, dw for ours and the two-bmm autograd; dx, dW dense)
    bytes_floor_ms: float  # x + out (+ factors) at copy bandwidth


def _short_timer(device: str):
    """bench.py's timer with fewer repetitions (the whole grid stays within ~30 s on an H200)."""
    if device == "cuda":
        try:
            from triton.testing import do_bench

            return lambda fn: float(do_bench(fn, warmup=10, rep=40, return_mode="median"))
        except ImportError:
            pass
    return _timer(device)


def _grad_fn(out, inputs, dout):
    return lambda: torch.autograd.grad(out, inputs, dout, retain_graph=True)


def row_inputs(n: int, blocks: int, tokens: int, device: str = "cuda", dtype=torch.bfloat16, generator=None):
    """A benchmark row's operands: x (tokens, n), square-block factors w1 and w2 (blocks, n/blocks,
    n/blocks) and the dense weight wd (n, n) it replaces, scaled so that outputs have unit variance."""
    b = n // blocks
    x = torch.randn(tokens, n, device=device, dtype=dtype, generator=generator)
    w1 = torch.randn(blocks, b, b, device=device, dtype=dtype, generator=generator) / math.sqrt(b)
    w2 = torch.randn(blocks, b, b, device=device, dtype=dtype, generator=generator) / math.sqrt(b)
    wd = torch.randn(n, n, device=device, dtype=dtype, generator=generator) / math.sqrt(n)
    return x, w1, w2, wd


def _timed(timer, fns: dict, rounds: int, envs: dict | None = None) -> dict:
    """{name: ms} for {name: call}: each timed `rounds` times in alternating order, the median;
    envs: {name: {variable: value}} set around that call's timing (not inside the timed calls)."""
    measures = [bench.timed_in_env(timer, fn, (envs or {}).get(name, {})) for name, fn in fns.items()]
    return dict(zip(fns, bench.rotated_medians(measures, rounds)))


def measure(n: int, blocks: int, tokens: int, timer, copy_gbps: float, device: str = "cuda",
            dtype=torch.bfloat16, rounds: int = 2) -> Row:
    """One row; every variant timed `rounds` times per row in alternating order (the median)."""
    gen = torch.Generator(device=device).manual_seed(0)
    x, w1, w2, wd = row_inputs(n, blocks, tokens, device, dtype, gen)
    dout = torch.randn(tokens, n, device=device, dtype=dtype, generator=gen)
    # Forwards under inference_mode: no autograd bookkeeping on the host, whose cost leaked into the
    # event times at 16 tokens (tens of us per call while the autograd formula was Python)
    with torch.inference_mode():
        fwd = _timed(timer, {
            "ours": lambda: M.monarch_matmul(x, w1, w2),
            "tiled": lambda: M.monarch_matmul(x, w1, w2),
            "two_bmm": lambda: M.monarch_matmul_ref(x, w1, w2),
            "dense": lambda: F.linear(x, wd),
        }, rounds, envs={"tiled": {"LLMK_MONARCH_CLUSTER": "0"}})
    leaves = [t.detach().clone().requires_grad_() for t in (x, w1, w2)]
    ref_out = M.monarch_matmul_ref(*leaves)
    xd, wdd = x.detach().clone().requires_grad_(), wd.detach().clone().requires_grad_()
    dense_out = F.linear(xd, wdd)
    bwd_ours = lambda: torch.ops.llm_kernels.monarch_matmul_backward(dout, x, w1, w2)  # noqa: E731
    bwd = _timed(timer, {
        "ours": bwd_ours,
        "two_bmm": _grad_fn(ref_out, leaves, dout),
        "dense": _grad_fn(dense_out, (xd, wdd), dout),
    }, rounds)
    esize = x.element_size()
    floor_bytes = 2 * tokens * n * esize + (w1.numel() + w2.numel()) * esize
    return Row(n, blocks, tokens, fwd, bwd, floor_bytes / (copy_gbps * 1e9) * 1e3)


def run(quick: bool = False, device: str | None = None, progress=None, rounds: int = 2) -> dict:
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    timer = _short_timer(device)
    copy_gbps = copy_bandwidth_gbps(device, timer)
    grid = QUICK if quick or device == "cpu" else [(n, k, t) for n in NS for k in BLOCKS for t in TOKENS]
    if device == "cpu":
        grid = [(256, 4, 16), (512, 16, 64)]
    task = progress.add_task("monarch", total=len(grid)) if progress else None
    rows = []
    for n, k, t in grid:
        rows.append(dataclasses.asdict(measure(n, k, t, timer, copy_gbps, device, rounds=rounds)))
        if progress:
            progress.advance(task)
    return {"meta": _meta(device, copy_gbps) | {"rounds": rounds}, "dtype": "bf16", "rows": rows}


def to_markdown(result: dict, command: str = "") -> str:
    meta = result["meta"]
    lines = [
        f"Monarch, {result['dtype']}, measured {meta['date']} on {meta.get('gpu', meta.get('cpu'))} "
        f"(torch {meta['torch']}), {meta['timer']}"
        + (f", median of {meta['rounds']} rounds over the variants in alternating order" if meta.get("rounds", 1) > 1 else "")
        + f"; copy bandwidth {meta['copy_gbps'] / 1000:.2f} TB/s.",
    ]
    if command:
        lines.append(f"Command: `{command}`")
    lines += [
        "",
        "Forward and backward in ms (median; forwards under torch.inference_mode). tiled: our forward with "
        "the cluster kernel turned off (LLMK_MONARCH_CLUSTER=0: the tiled path, at 16 tokens the few-token "
        "kernels; where the cluster kernel does not fit or is slower, ours is that path too). "
        "x2bmm / xdense: our speed-up over the two-bmm formulation and over dense F.linear. floor: x + out + "
        "factors at copy bandwidth.",
        "",
        "| n | blocks | tokens | fwd ours | fwd tiled | fwd 2bmm | fwd dense | floor | fwd x2bmm | fwd xdense "
        "| bwd ours | bwd 2bmm | bwd dense | bwd x2bmm |",
        "|---" * 14 + "|",
    ]
    for r in result["rows"]:
        f, b = r["fwd_ms"], r["bwd_ms"]
        lines.append(
            f"| {r['n']} | {r['blocks']} | {r['tokens']} | {f['ours']:.4f} | {f['tiled']:.4f} | {f['two_bmm']:.4f} "
            f"| {f['dense']:.4f} | {r['bytes_floor_ms']:.4f} | {f['two_bmm'] / f['ours']:.1f}x "
            f"| {f['dense'] / f['ours']:.1f}x | {b['ours']:.4f} "
            f"| {b['two_bmm']:.4f} | {b['dense']:.4f} | {b['two_bmm'] / b['ours']:.1f}x |"
        )
    return "\n".join(lines) + "\n"


def save(result: dict, json_path: str | None, md_path: str | None, command: str = "") -> None:
    bench.write_outputs(result, json_path, md_path, to_markdown(result, command))
