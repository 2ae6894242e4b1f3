"""The `llm-kernels` command: `probe` (what this machine and torch can do), `bench` and
`bench-attention|decode|monarch` (our kernels beside PyTorch), `e2e` (whole-model speed) and
`perplexity` (Monarch conversion accuracy)."""

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


def _progress() -> Progress:
    """The progress bar every benchmark command shows (cleared when done)."""
    return Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        console=console, transient=True,
    )


def _save(mod, result: dict, json_path: Optional[str], md_path: Optional[str]) -> str:
    """Saves a benchmark module's result (JSON and Markdown, each optional) with the command that
    produced it, and returns that command."""
    command = "llm-kernels " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    mod.save(result, json_path, md_path, command)
    return command


def _save_and_show(mod, result: dict, json_path: Optional[str], md_path: Optional[str]) -> None:
    command = _save(mod, result, json_path, md_path)
    console.print(mod.to_markdown(result, command), markup=False, highlight=False)


@app.command()
def probe(as_json: bool = typer.Option(False, "--json", help="print JSON instead of a table")):
    """Device, vendor, arch, warp size, versions, the GPU targets the library was built for (and
    whether this GPU is one), and the SDPA backends torch really has and uses."""
    from . import probe as probe_mod

    info = probe_mod.collect()
    if as_json:
        print(json.dumps(info, indent=1))
        return
    table = Table(title="llm-kernels probe", show_header=False)
    for k, v in info.items():
        shown = json.dumps(v) if isinstance(v, dict) else ", ".join(v) if isinstance(v, list) else str(v)
        table.add_row(k, shown or "-")
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
    with _progress() as progress:
        result = bench_mod.run(ops, shapes=shapes, dtypes=tuple(dtype), progress=progress, peers=peers,
                               quick=quick)
    _save_and_show(bench_mod, result, json_path, md_path)


@app.command("perplexity")
def perplexity_cmd(
    model_dir: str = typer.Argument(..., help="a local Hugging Face causal-LM directory (nothing is downloaded)"),
    text_file: str = typer.Argument(..., help="the text to score"),
    targets: list[str] = typer.Option(..., help="fnmatch pattern(s) of the nn.Linear layers to convert; repeatable"),
    nblocks: int = typer.Option(4, help="Monarch blocks per factor"),
    window: Optional[int] = typer.Option(None, help="sliding-window length in tokens (default: the whole text)"),
    stride: Optional[int] = typer.Option(None, help="sliding-window step (default: window / 2)"),
    max_tokens: Optional[int] = typer.Option(None, help="score only the first N tokens"),
    device: str = typer.Option("cuda" if __import__("torch").cuda.is_available() else "cpu"),
    dtype: str = typer.Option("bf16", help="fp32, fp16 or bf16"),
):
    """Perplexity of a causal LM on a text before and after converting the chosen layers to Monarch."""
    import pathlib

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .perplexity import monarch_perplexity

    dtypes = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
    if dtype not in dtypes:
        raise typer.BadParameter(f"unknown dtype {dtype!r}; choose from {', '.join(dtypes)}")
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True, dtype=dtypes[dtype])
    model = model.to(device).eval()
    ids = tokenizer(pathlib.Path(text_file).read_text(), return_tensors="pt").input_ids[0]
    if max_tokens is not None:
        ids = ids[:max_tokens]
    result = monarch_perplexity(model, ids, targets, nblocks, window, stride)
    table = Table(title=f"Monarch conversion, {nblocks} blocks, {ids.numel()} tokens")
    table.add_column("layer", overflow="fold")
    for col in ("params before", "params after", "relative error"):
        table.add_column(col)
    for r in result.layers:
        table.add_row(r.name, str(r.params_before), str(r.params_after), f"{r.relative_error:.4f}")
    console.print(table)
    console.print(f"perplexity before {result.before:.4f}, after {result.after:.4f}; "
                  f"converted parameters {result.params_before} -> {result.params_after}")


@app.command()
def e2e(
    config: Optional[str] = typer.Option(None, help="tiny, 1b, 7b or 8b (default: 1b on the GPU, tiny on the CPU)"),
    family: str = typer.Option("llama", help="the Hugging Face model family built with the config's shapes: "
                                              "llama, mistral, qwen2, qwen3, gemma, gemma3, phi3, glm, olmo2"),
    device: Optional[str] = typer.Option(None, help="cuda or cpu (default: cuda when there is a GPU)"),
    dtype: Optional[str] = typer.Option(None, help="bf16, fp16 or fp32 (default: bf16 on the GPU, fp32 on the CPU)"),
    variant: Optional[list[str]] = typer.Option(
        None, help="hf_eager, hf_sdpa, compile, kernelized, kernelized_compile, kernelized_fused, "
                   "kernelized_fused_no_pdl, kernelized_fused_compile, kernelized_monarch, compile_reduce_overhead, "
                   "compile_max_autotune; repeatable (default: all)"),
    no_compile: bool = typer.Option(False, "--no-compile", help="leave out the torch.compile variants"),
    batch: Optional[list[int]] = typer.Option(None, help="decode batch sizes; repeatable (default: 1 and 32)"),
    prefill_len: Optional[int] = typer.Option(None, help="prefill tokens (default 2048)"),
    context: Optional[int] = typer.Option(None, help="tokens in the cache before the timed decode steps (default 128)"),
    steps: Optional[int] = typer.Option(None, help="timed decode steps (default 64)"),
    iters: Optional[int] = typer.Option(None, help="timed prefill runs (default 10)"),
    budget_s: Optional[float] = typer.Option(
        None, "--budget-s", help="skip measurements that would end past this many seconds (default 110)"),
    cuda_graphs: bool = typer.Option(True, help="capture decode steps in CUDA graphs"),
    step_mask: bool = typer.Option(True, help="decode steps pass their own 4-D mask (--no-step-mask: none, so "
                                   "the model builds its causal mask each step, as a call without one does)"),
    monarch_last: Optional[int] = typer.Option(
        None, help="kernelized_monarch: decoder layers whose q/k/v/o projections become Monarch (default 6)"),
    monarch_nblocks: Optional[int] = typer.Option(None, help="kernelized_monarch: Monarch blocks (default 4)"),
    quick: bool = typer.Option(False, help="small sizes and few iterations (a smoke run)"),
    profile: bool = typer.Option(False, "--profile",
                                 help="instead of the table: the kernels of one decode step per variant (GPU)"),
    json_path: Optional[str] = typer.Option(None, "--json", help="write the results to this JSON file"),
    md_path: Optional[str] = typer.Option(None, "--md", help="write the table to this Markdown file"),
):
    """A whole model (LLaMA by default, --family for others) with random weights: prefill latency,
    decode tokens/s (static cache, CUDA graphs) and peak memory for Hugging Face eager/sdpa,
    torch.compile, kernelized and kernelized + compile, with kernelized logits checked against
    Hugging Face eager."""
    import torch

    from . import e2e as e2e_mod

    dev = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if dev not in ("cuda", "cpu"):
        raise typer.BadParameter(f"unknown device {dev!r}; choose cuda or cpu")
    variants = tuple(variant) if variant else e2e_mod.VARIANTS
    if no_compile:
        variants = tuple(v for v in variants if v not in e2e_mod.COMPILED)
    for v in variants:
        if v not in e2e_mod.VARIANTS:
            raise typer.BadParameter(e2e_mod.unknown_variant(v))
    if config is not None and config not in e2e_mod.CONFIGS:
        raise typer.BadParameter(f"unknown config {config!r}; choose from {', '.join(e2e_mod.CONFIGS)}")
    if family not in e2e_mod.FAMILIES:
        raise typer.BadParameter(f"unknown family {family!r}; choose from {', '.join(e2e_mod.FAMILIES)}")
    if dtype is not None and dtype not in e2e_mod.DTYPES:
        raise typer.BadParameter(f"unknown dtype {dtype!r}; choose from {', '.join(e2e_mod.DTYPES)}")
    given = dict(config=config, dtype=dtype, prefill_len=prefill_len, context=context, steps=steps, iters=iters,
                 budget_s=budget_s, batches=tuple(batch) if batch else None, monarch_last=monarch_last,
                 monarch_nblocks=monarch_nblocks)
    if quick:
        s = e2e_mod.Settings.quick(dev, **given)
    else:
        defaults = dict(config="1b" if dev == "cuda" else "tiny")
        defaults.update({k: v for k, v in given.items() if v is not None})
        s = e2e_mod.Settings(device=dev, **defaults)
    if dtype is None:
        s.dtype = "bf16" if dev == "cuda" else "fp32"
    s.variants, s.cuda_graphs, s.family, s.step_mask = variants, cuda_graphs, family, step_mask
    if profile:
        if dev != "cuda":
            raise typer.BadParameter("--profile times the GPU's kernels; this run's device is the CPU")
        _e2e_profile(e2e_mod, s, variant or ["hf_sdpa", "kernelized_fused"], json_path)
        return
    with _progress() as progress:
        result = e2e_mod.run(s, progress=progress, log=lambda m: console.print(m, markup=False, highlight=False))
    _save(e2e_mod, result, json_path, md_path)
    console.print(e2e_mod.to_rich(result))
    for line in e2e_mod.notes(result):
        console.print(f"- {line}", markup=False, highlight=False)


def _e2e_profile(e2e_mod, s, variants, json_path) -> None:
    """`llm-kernels e2e --profile`: a kernel table per variant for one decode step at batch 1."""
    import json

    from rich.table import Table

    results = []
    for v in variants:
        r = e2e_mod.profile_decode(s, v, batch=s.batches[0])
        results.append(r)
        graph = r["graph_step_us"]
        title = (f"{v}, batch {r['batch']}: {r['kernels_per_step']:.0f} kernels, {r['kernel_us_per_step']:.0f} us of "
                 f"kernels per step; {graph:.0f} us per step in a CUDA graph")
        t = Table(title=title)
        for col in ("kernel", "calls/step", "us/step", "us/call"):
            t.add_column(col, justify="left" if col == "kernel" else "right")
        for k in r["top"]:
            t.add_row(k["name"][:100], f"{k['calls_per_step']:.0f}", f"{k['us_per_step']:.1f}", f"{k['us_per_call']:.2f}")
        console.print(t)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(results, f, indent=1)


@app.command("bench-monarch")
def bench_monarch(
    json_path: Optional[str] = typer.Option(None, "--json", help="write the rows to this JSON file"),
    md_path: Optional[str] = typer.Option(None, "--md", help="write the table to this Markdown file"),
    quick: bool = typer.Option(False, help="three rows only (a smoke run; always small on the CPU)"),
    rounds: int = typer.Option(2, min=1, help="time every variant this many times per row, in alternating "
                                              "order, and keep the median"),
):
    """Monarch (bf16): our fused forward and backward beside dense F.linear and the two-bmm
    formulation with its autograd backward, n in {2048, 4096, 8192}, blocks {4, 16, 64}, tokens
    {16, 2048, 16384}."""
    from . import bench_monarch as bm

    with _progress() as progress:
        result = bm.run(quick=quick, progress=progress, rounds=rounds)
    _save_and_show(bm, result, json_path, md_path)


@app.command("bench-decode")
def bench_decode(
    json_path: Optional[str] = typer.Option(None, "--json", help="write records to this JSON file"),
    md_path: Optional[str] = typer.Option(None, "--md", help="write the tables to this Markdown file"),
    quick: bool = typer.Option(False, help="two attention shapes and one GEMM shape (a smoke run)"),
    part: Optional[list[str]] = typer.Option(None, help="which tables (default: all): attention (decode "
                                             "attention), gemm (the skinny GEMM shapes), model (the 1B model's "
                                             "decode GEMMs and layers); repeatable"),
):
    """Decode attention (contiguous and paged KV cache) beside SDPA flash/cuDNN, and the skinny GEMM
    beside F.linear: us and TB/s of KV or weight read."""
    from . import bench_decode as bench_mod

    try:
        result = bench_mod.run(quick=quick, parts=tuple(part) if part else bench_mod.PARTS)
    except bench_mod.UnknownPart as e:  # checked before anything is timed
        raise typer.BadParameter(str(e)) from None
    _save_and_show(bench_mod, result, json_path, md_path)


@app.command("bench-attention")
def bench_attention(
    json_path: Optional[str] = typer.Option(None, "--json", help="write records to this JSON file"),
    md_path: Optional[str] = typer.Option(None, "--md", help="write the tables to this Markdown file"),
    quick: bool = typer.Option(False, help="two shapes only (a smoke run; a tiny CPU set without a GPU)"),
    dtype: list[str] = typer.Option(["fp16", "bf16"], help="fp16 and/or bf16"),
    rounds: int = typer.Option(2, min=1, help="time every implementation this many times per shape, "
                                              "in alternating order, and keep the median"),
):
    """Attention forward: ours beside torch SDPA's math, efficient, flash and cuDNN backends, in
    TFLOP/s, with our peak memory."""
    from . import bench_attention as ba

    for d in dtype:
        if d not in ba.DTYPES:
            raise typer.BadParameter(f"unknown dtype {d!r}; choose from fp16, bf16")
    with _progress() as progress:
        result = ba.run(dtypes=tuple(dtype), progress=progress, quick=quick, rounds=rounds)
    _save_and_show(ba, result, json_path, md_path)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
