"""Programmatic dependent launch (LLMK_PDL=1, NVIDIA compute capability 9.0+): our decode-path
kernels may start while the kernel before them finishes, and must wait for it before reading its
output. A chain in which every kernel reads the one before (RMSNorm, skinny GEMMs with and without
the SwiGLU epilogue, the K/V cache write, decode attention) must give bit for bit what it gives
without PDL, run eagerly and replayed from a CUDA graph, many times (a missing wait is a race: it
shows up as a run that differs)."""

import os

import pytest
import torch

from llm_kernels import decode, e2e, ops

from conftest import HAS_GPU, GPU_REASON

needs_hopper = pytest.mark.skipif(not HAS_GPU or torch.cuda.get_device_capability() < (9, 0),
                                  reason=GPU_REASON if not HAS_GPU else "PDL needs compute capability 9.0+")


def _chain_inputs(dtype=torch.bfloat16):
    g = torch.Generator(device="cuda").manual_seed(5)
    hidden, inter, hq, hkv, d, smax = 2048, 5632, 16, 4, 128, 300

    def rand(*shape, scale=1.0):
        return torch.randn(*shape, device="cuda", dtype=dtype, generator=g) * scale

    return {
        "x": rand(1, hidden), "wn1": rand(hidden, scale=0.1) + 1, "wn2": rand(hidden, scale=0.1) + 1,
        "wqkv": rand((hq + 2 * hkv) * d, hidden, scale=hidden**-0.5), "wo": rand(hidden, hq * d, scale=(hq * d)**-0.5),
        "wgu": rand(2 * inter, hidden, scale=hidden**-0.5), "wd": rand(hidden, inter, scale=inter**-0.5),
        "kc": rand(1, hkv, smax, d), "vc": rand(1, hkv, smax, d),
        "pos": torch.tensor([[217]], device="cuda"), "lens": torch.tensor([218], device="cuda", dtype=torch.int32),
        "dims": (hq, hkv, d),
    }


def _layer(t):
    """One decoder layer's decode step on our kernels, each reading the previous one's output."""
    hq, hkv, d = t["dims"]
    h = ops.rms_norm(t["x"], t["wn1"])
    qkv = decode.skinny_gemm(h, t["wqkv"])
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], -1)
    decode.write_kv_cache(t["kc"], t["vc"], k.view(1, 1, hkv, d), v.view(1, 1, hkv, d), t["pos"])
    a = decode.decode_attention(q.view(1, 1, hq, d), t["kc"], t["vc"], t["lens"])
    x = t["x"] + decode.skinny_gemm(a.view(1, hq * d), t["wo"])
    h = ops.rms_norm(x, t["wn2"])
    u = decode.skinny_gemm(h, t["wgu"], activation="swiglu")
    return x + decode.skinny_gemm(u, t["wd"])


def _run(pdl: str, graph: bool, reps: int):
    old = os.environ.get("LLMK_PDL")
    os.environ["LLMK_PDL"] = pdl
    try:
        t = _chain_inputs()
        outs = []
        if graph:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                _layer(t)  # warm-up: workspaces, occupancy queries
            torch.cuda.current_stream().wait_stream(stream)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                out = _layer(t)
            for _ in range(reps):
                g.replay()
                outs.append(out.clone())
        else:
            for _ in range(reps):
                outs.append(_layer(t))
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
    want = _run("0", graph, reps=2)
    got = _run("1", graph, reps=50)
    assert torch.isfinite(want[0]).all()
    for i, out in enumerate(got):
        assert torch.equal(out, want[0]), f"run {i} differs from the run without PDL"


def test_e2e_pdl_variant_sets_and_restores_the_switch(monkeypatch):
    monkeypatch.setenv("LLMK_PDL", "7")
    e2e._set_pdl(True)
    assert os.environ["LLMK_PDL"] == "1"
    e2e._set_pdl(True)  # again: still one saved value
    e2e._set_pdl(False)
    assert os.environ["LLMK_PDL"] == "7"
    monkeypatch.delenv("LLMK_PDL")
    e2e._set_pdl(True)
    e2e._set_pdl(False)
    assert "LLMK_PDL" not in os.environ
    assert set(e2e.PDL_VARIANTS) <= set(e2e.VARIANTS)
