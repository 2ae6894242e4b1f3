"""Programmatic dependent launch (LLMK_PDL=1, NVIDIA compute capability 9.0+): our decode-path
kernels may start while the kernel before them finishes, and must wait for it before reading its
output. A decode layer's chain of kernels, each reading the one before (RMSNorm, skinny GEMMs with
and without the SwiGLU epilogue, RoPE, the K/V cache write, decode attention over 4 splits with
their merge, the fused residual add + RMSNorm), fed new inputs at every step (so a kernel that
reads too early sees the previous step's values), must give bit for bit what it gives without PDL,
run eagerly and replayed from a CUDA graph. The C++ test Pdl.* proves with a writer / reader pair
that the overlap happens and that the wait holds the reader back."""

import ctypes
import os
from pathlib import Path

import pytest
import torch

import llm_kernels
from llm_kernels import decode, e2e, ops

from conftest import HAS_GPU, GPU_REASON

needs_hopper = pytest.mark.skipif(not HAS_GPU or torch.cuda.get_device_capability() < (9, 0),
                                  reason=GPU_REASON if not HAS_GPU else "PDL needs compute capability 9.0+")
HQ, HKV, D, HIDDEN, INTER, SMAX, STEPS = 16, 4, 128, 2048, 5632, 1200, 24


def pdl_launches() -> int:
    lib = ctypes.CDLL(str(Path(llm_kernels.__file__).parent / "libllmk.so"))
    lib.llmk_pdl_launches.restype = ctypes.c_int64
    return int(lib.llmk_pdl_launches())


def _weights():
    g = torch.Generator(device="cuda").manual_seed(5)

    def rand(*shape, scale=1.0):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=g) * scale

    return {
        "wn1": rand(HIDDEN, scale=0.1) + 1, "wn2": rand(HIDDEN, scale=0.1) + 1,
        "wqkv": rand((HQ + 2 * HKV) * D, HIDDEN, scale=HIDDEN**-0.5), "wo": rand(HIDDEN, HQ * D, scale=(HQ * D)**-0.5),
        "wgu": rand(2 * INTER, HIDDEN, scale=HIDDEN**-0.5), "wd": rand(HIDDEN, INTER, scale=INTER**-0.5),
        "rope": _angles(g),
    }


def _angles(g):
    """A (SMAX, D) float32 [cos | sin] cache of neox rotary angles."""
    theta = torch.arange(SMAX, device="cuda")[:, None] * torch.rand(D // 2, device="cuda", generator=g)
    return torch.cat([torch.cos(theta), torch.sin(theta)], -1)


def _inputs(step: int):
    """Step `step`'s token: a new hidden state, written at position 1000 + step of the cache."""
    g = torch.Generator(device="cuda").manual_seed(100 + step)
    x = torch.randn(1, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=g)
    pos = torch.tensor([[1000 + step]], device="cuda")
    return x, pos, (pos[:, 0] + 1).to(torch.int32)


def _layer(w, kc, vc, x, pos, lens):
    """One decoder layer's decode step on our kernels, each reading the previous one's output."""
    h = ops.rms_norm(x, w["wn1"])
    qkv = decode.skinny_gemm(h, w["wqkv"])
    q, k, v = qkv.split([HQ * D, HKV * D, HKV * D], -1)
    q, k = ops.rope(q.view(1, 1, HQ, D), k.view(1, 1, HKV, D), cos_sin_cache=w["rope"], positions=pos)
    decode.write_kv_cache(kc, vc, k, v.view(1, 1, HKV, D), pos)
    a = decode.decode_attention(q, kc, vc, lens, num_splits=4)
    h, x = ops.fused_add_rms_norm(decode.skinny_gemm(a.view(1, HQ * D), w["wo"]), x, w["wn2"])
    u = decode.skinny_gemm(h, w["wgu"], activation="swiglu")
    return x + decode.skinny_gemm(u, w["wd"])


def _run(pdl: str, graph: bool):
    old = os.environ.get("LLMK_PDL")
    os.environ["LLMK_PDL"] = pdl
    try:
        w = _weights()
        g = torch.Generator(device="cuda").manual_seed(9)
        kc = torch.randn(1, HKV, SMAX, D, device="cuda", dtype=torch.bfloat16, generator=g)
        vc = torch.randn(1, HKV, SMAX, D, device="cuda", dtype=torch.bfloat16, generator=g)
        outs = []
        if graph:
            x, pos, lens = _inputs(-1)
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                _layer(w, kc, vc, x, pos, lens)  # warm-up: workspaces, occupancy queries
            torch.cuda.current_stream().wait_stream(stream)
            cuda_graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(cuda_graph):
                out = _layer(w, kc, vc, x, pos, lens)
            for step in range(STEPS):
                for dst, src in zip((x, pos, lens), _inputs(step)):
                    dst.copy_(src)
                cuda_graph.replay()
                outs.append(out.clone())
        else:
            for step in range(STEPS):
                outs.append(_layer(w, kc, vc, *_inputs(step)))
        outs.append(torch.cat([kc, vc]))
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
    if graph and os.environ.get("PYTORCH_NO_CUDA_MEMORY_CACHING"):
        pytest.skip("CUDA graphs need the caching allocator (gpu_check's memcheck run turns it off)")
    want = _run("0", graph)
    before = pdl_launches()
    got = _run("1", graph)
    assert pdl_launches() > before, "nothing was launched with PDL"
    assert all(torch.isfinite(t).all() for t in want)
    for step, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"step {step} differs from the run without PDL"


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
    assert set(e2e.PDL_VARIANTS) <= set(e2e.VARIANTS)
