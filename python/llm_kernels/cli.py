"""The `llm-kernels` command: `probe` (what this machine and torch can do) and `bench`."""

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


@app.command("bench-monarch")
def bench_monarch(
    json_path: Optional[str] = typer.Option(None, "--json", help="write the rows to this JSON file"),
    md_path: Optional[str] = typer.Option(None, "--md", help="write the table to this Markdown file"),
    quick: bool = typer.Option(False, help="three rows only (a smoke run; always small on the CPU)"),
):
    """Monarch (bf16): our fused forward and backward beside dense F.linear and the two-bmm
    formulation with its autograd backward, n in {2048, 4096, 8192}, blocks {4, 16, 64}, tokens
    {16, 2048, 16384}."""
    from . import bench_monarch as bm

    with Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        console=console, transient=True,
    ) as progress:
        result = bm.run(quick=quick, progress=progress)
    command = "llm-kernels " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    bm.save(result, json_path, md_path, command)
    console.print(bm.to_markdown(result, command), markup=False, highlight=False)


@app.command("monarch-ppl")
def monarch_ppl(
    model_dir: str = typer.Argument(..., help="a local Hugging Face causal LM (from_pretrained directory)"),
    text_file: str = typer.Argument(..., help="the text to score"),
    target: list[str] = typer.Option(..., help="fnmatch pattern of nn.Linear names to convert; repeatable"),
    nblocks: int = typer.Option(4, help="Monarch blocks per converted layer"),
    window: int = typer.Option(512, help="tokens per scored window"),
    device: str = typer.Option("cuda" if __import__("torch").cuda.is_available() else "cpu"),
    as_json: bool = typer.Option(False, "--json", help="print JSON instead of a table"),
):
    """Perplexity of a causal LM on a text before and after converting the chosen layers to
    Monarch (optimal projection), with the per-layer parameters and projection errors. Without a
    tokenizer in MODEL_DIR the text's bytes are the tokens."""
    import pathlib

    import torch
    from transformers import AutoModelForCausalLM

    from .monarch_eval import compare_perplexity

    model = AutoModelForCausalLM.from_pretrained(model_dir).to(device)
    text = pathlib.Path(text_file).read_bytes()
    try:
        from transformers import AutoTokenizer

        ids = AutoTokenizer.from_pretrained(model_dir)(text.decode("utf-8"), return_tensors="pt").input_ids[0]
    except (OSError, ValueError):
        ids = torch.tensor(list(text), dtype=torch.long)
    result = compare_perplexity(model, ids, target, nblocks, window=window)
    if as_json:
        print(json.dumps({"before": result.before, "after": result.after,
                          "layers": [r.__dict__ for r in result.report]}, indent=1))
        return
    table = Table(title=f"perplexity {result.before:.3f} -> {result.after:.3f} ({result.ratio:.3f}x)")
    for col in ("layer", "params before", "params after", "projection error"):
        table.add_column(col)
    for r in result.report:
        table.add_row(r.name, str(r.params_before), str(r.params_after), f"{r.relative_error:.4f}")
    console.print(table)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
