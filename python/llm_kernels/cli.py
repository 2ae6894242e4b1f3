"""The `llm-kernels` command: `probe` (what this machine and torch can do), `bench` and
`bench-attention`."""

from __future__ import annotations

import json
import shlex
import sys
from typing import Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

app = typer.Typer(add_completion=False, help="llm-kernels: fused GPU kernels for LLM inference.")
console = Console()


@app.command()
def probe(as_json: bool = typer.Option(False, "--json", help="print JSON instead of a table")):
    """Device, vendor, arch, warp size, versions, and the SDPA backends torch really has and uses."""
    from . import probe as probe_mod

    info = probe_mod.collect()
    if as_json:
        print(json.dumps(info, indent=1))
        return
    table = Table(title="llm-kernels probe", show_header=False)
    for k, v in info.items():
        table.add_row(k, json.dumps(v) if isinstance(v, dict) else str(v))
    console.print(table)


@app.command()
def bench(
    op: Optional[list[str]] = typer.Option(
        None, help="rms_norm, fused_add_rms_norm, swiglu, geglu_tanh or rope; repeatable (default: all)"
    ),
    json_path: Optional[str] = typer.Option(None, "--json", help="write records to this JSON file"),
    md_path: Optional[str] = typer.Option(None, "--md", help="write the tables to this Markdown file"),
    quick: bool = typer.Option(False, help="a few small shapes per op (a smoke run; always so on the CPU)"),
    large: bool = typer.Option(False, help="three large shapes only (for tuning runs)"),
    peers: bool = typer.Option(True, help="also time the peers (eager, F.rms_norm, torch.compile)"),
    dtype: list[str] = typer.Option(["fp16", "bf16"], help="fp16 and/or bf16"),
):
    """Our median time per op, dtype and shape beside eager PyTorch, PyTorch's fused op where one
    exists, and torch.compile, with GB/s and the share of copy bandwidth."""
    from . import bench as bench_mod

    ops = tuple(op) if op else bench_mod.OPS
    for name in ops:
        if name not in bench_mod.OPS:
            raise typer.BadParameter(f"unknown op {name!r}; choose from {', '.join(bench_mod.OPS)}")
    for d in dtype:
        if d not in bench_mod.DTYPES:
            raise typer.BadParameter(f"unknown dtype {d!r}; choose from fp16, bf16")
    shapes = bench_mod.SHAPES["large"] if large else None
    with Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        console=console, transient=True,
    ) as progress:
        result = bench_mod.run(ops, shapes=shapes, dtypes=tuple(dtype), progress=progress, peers=peers,
                               quick=quick)
    command = "llm-kernels " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    bench_mod.save(result, json_path, md_path, command)
    console.print(bench_mod.to_markdown(result, command), markup=False, highlight=False)


@app.command("bench-attention")
def bench_attention(
    json_path: Optional[str] = typer.Option(None, "--json", help="write records to this JSON file"),
    md_path: Optional[str] = typer.Option(None, "--md", help="write the tables to this Markdown file"),
    quick: bool = typer.Option(False, help="two shapes only (a smoke run; a tiny CPU set without a GPU)"),
    dtype: list[str] = typer.Option(["fp16", "bf16"], help="fp16 and/or bf16"),
):
    """Attention forward: ours beside torch SDPA's math, efficient, flash and cuDNN backends, in
    TFLOP/s, with our peak memory."""
    from . import bench_attention as ba

    for d in dtype:
        if d not in ba.DTYPES:
            raise typer.BadParameter(f"unknown dtype {d!r}; choose from fp16, bf16")
    with Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        console=console, transient=True,
    ) as progress:
        result = ba.run(dtypes=tuple(dtype), progress=progress, quick=quick)
    command = "llm-kernels " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    ba.save(result, json_path, md_path, command)
    console.print(ba.to_markdown(result, command), markup=False, highlight=False)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
