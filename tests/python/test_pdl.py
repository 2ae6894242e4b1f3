"""Programmatic dependent launch (the default on NVIDIA compute capability 9.0+, LLMK_PDL=0 turns
it off): our decode-path
kernels may start while the kernel before them finishes, and must wait for it before reading its
output. A decode layer's chain of kernels, each reading the one before (RMSNorm, skinny GEMMs with
and without the SwiGLU epilogue, RoPE, the K/V cache write, decode attention over 4 splits with
their merge, the fused residual add + RMSNorm), fed new inputs at every step (so a kernel that
reads too early sees the previous step's values), must give bit for bit what it gives without PDL,
run eagerly and replayed from a CUDA graph (the chain is bench_decode.layer_step, the one
bench-decode times for the 1B model). The C++ test Pdl.* proves with a writer / reader pair
that the overlap happens and that the wait holds the reader back."""

import ctypes
import os
from pathlib import Path

import pytest
import torch

import llm_kernels
from llm_kernels import bench_decode, e2e

from conftest import HAS_GPU, GPU_REASON, skip_graphs_without_caching_allocator

needs_hopper = pytest.mark.skipif(not HAS_GPU or torch.cuda.get_device_capability() < (9, 0),
                                  reason=GPU_REASON if not HAS_GPU else "PDL needs compute capability 9.0+")
SHAPE = bench_decode.LayerShape(hidden=2048, inter=5632, heads=16, kv_heads=4, head_dim=128, cache=1200)
STEPS = 24


def pdl_launches() -> int:
    lib = ctypes.CDLL(str(Path(llm_kernels.__file__).parent / "libllmk.so"))
    lib.llmk_pdl_launches.restype = ctypes.c_int64
    return int(lib.llmk_pdl_launches())


def _inputs(step: int):
    """Step `step`'s token: a new hidden state, written at position 1000 + step of the cache."""
    g = torch.Generator(device="cuda").manual_seed(100 + step)
    x = torch.randn(1, SHAPE.hidden, device="cuda", dtype=torch.bfloat16, generator=g)
    pos = torch.tensor([[1000 + step]], device="cuda")
    return x, pos, (pos[:, 0] + 1).to(torch.int32)


def _run(pdl: str, graph: bool):
    old = os.environ.get("LLMK_PDL")
    os.environ["LLMK_PDL"] = pdl
    try:
        w = bench_decode.layer_weights(SHAPE, "cuda", torch.bfloat16, torch.Generator(device="cuda").manual_seed(5))
        outs = []
        if graph:
            x, pos, lens = _inputs(-1)
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                bench_decode.layer_step(w, x, pos, lens, num_splits=4)  # warm-up: workspaces, occupancy queries
            torch.cuda.current_stream().wait_stream(stream)
            cuda_graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(cuda_graph):
                out = bench_decode.layer_step(w, x, pos, lens, num_splits=4)
            for step in range(STEPS):
                for dst, src in zip((x, pos, lens), _inputs(step)):
                    dst.copy_(src)
                cuda_graph.replay()
                outs.append(out.clone())
        else:
            for step in range(STEPS):
                outs.append(bench_decode.layer_step(w, *_inputs(step), num_splits=4))
        outs.append(torch.cat([w["kc"], w["vc"]]))
        torch.cuda.synchronize()
        return outs
    finally:
        if old is None:
            os.environ.pop("LLMK_PDL", None)
        else:
            os.environ["LLMK_PDL"] = old


@needs_hopper
@pytest.mark.parametrize("graph", [False, True])
def test_pdl_chain_is_bitwise_the_same(graph):
    if graph:
        skip_graphs_without_caching_allocator()
    want = _run("0", graph)
    before = pdl_launches()
    got = _run("1", graph)
    assert pdl_launches() > before, "nothing was launched with PDL"
    assert all(torch.isfinite(t).all() for t in want)
    for step, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"step {step} differs from the run without PDL"


@needs_hopper
@pytest.mark.parametrize("env, used", [(None, True), ("0", False), ("1", True)])
def test_pdl_is_the_default_on_hopper(env, used, monkeypatch):
    """Unset LLMK_PDL: our kernels launch with PDL on Hopper; LLMK_PDL=0 turns it off."""
    if env is None:
        monkeypatch.delenv("LLMK_PDL", raising=False)
    else:
        monkeypatch.setenv("LLMK_PDL", env)
    w = bench_decode.layer_weights(SHAPE, "cuda", torch.bfloat16, torch.Generator(device="cuda").manual_seed(5))
    before = pdl_launches()
    bench_decode.layer_step(w, *_inputs(0), num_splits=4)
    torch.cuda.synchronize()
    assert (pdl_launches() > before) == used


def test_pdl_launch_counter_reads():
    assert pdl_launches() >= 0


def test_e2e_variants_pin_and_restore_the_switch(monkeypatch):
    monkeypatch.setenv("LLMK_PDL", "7")
    e2e._set_pdl(True)
    assert os.environ["LLMK_PDL"] == "1"
    e2e._set_pdl(False)  # a variant without PDL: off even though the caller had it on
    assert os.environ["LLMK_PDL"] == "0"
    e2e._restore_pdl()
    assert os.environ["LLMK_PDL"] == "7"
    monkeypatch.delenv("LLMK_PDL")
    e2e._set_pdl(True)
    e2e._restore_pdl()
    assert "LLMK_PDL" not in os.environ
    assert set(e2e.NO_PDL_VARIANTS) <= set(e2e.VARIANTS)


def test_layer_step_runs_on_the_cpu():
    """bench_decode.layer_step (the chain above and bench-decode's decoder-layer row) on the CPU
    kernels: the right shape, finite, and the new token's K/V written at its position."""
    s = bench_decode.LayerShape(hidden=64, inter=96, heads=4, kv_heads=2, head_dim=16, cache=12)
    w = bench_decode.layer_weights(s, "cpu", torch.float32, torch.Generator().manual_seed(1))
    before = w["kc"].clone()
    x = torch.randn(1, s.hidden)
    out = bench_decode.layer_step(w, x, torch.tensor([[7]]), torch.tensor([8], dtype=torch.int32))
    assert out.shape == x.shape and torch.isfinite(out).all() and not torch.equal(out, x)
    changed = (w["kc"] != before).any(-1)[0]  # (kv heads, positions)
    assert changed[:, 7].all() and not changed[:, :7].any() and not changed[:, 8:].any()
