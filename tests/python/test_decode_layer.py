"""The fused batch-1 decode step of one decoder layer (decode.decoder_layer_step): the persistent
GPU kernel and the chain of ops it replaces, against a float64 reference of the whole layer."""

import math

import pytest
import torch
import torch.nn.functional as F

from conftest import HAS_GPU, TOL, poison_allocator, rel_err, skip_graphs_without_caching_allocator
from llm_kernels import decode

DTYPES = [torch.float16, torch.bfloat16]
needs_gpu = pytest.mark.skipif(not HAS_GPU, reason="no GPU on this machine: GPU case not run")

# (hidden, inter, q heads, kv heads, head dim, cache slots, position)
SHAPES = [
    (256, 512, 8, 2, 64, 50, 37),        # a small LLaMA layer: GQA 4
    (203, 333, 4, 4, 64, 20, 0),         # odd H and I (scalar weight loads), MHA, the first token
    (128, 96, 8, 1, 128, 9, 8),          # GQA 8 (one KV head), the last cache slot
    (2304, 4100, 4, 2, 256, 40, 30),     # K over 2048 (atomic partial sums), I not a multiple of 8
    (256, 264, 4, 2, 64, 3000, 2500),    # a long cache: many key chunks
]


def make_layer(h, inter, hq, hkv, d, slots, device, dtype, gen):
    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).to(device=device, dtype=dtype)

    theta = torch.arange(slots + 3, dtype=torch.float64)[:, None] * torch.rand(d // 2, generator=gen, dtype=torch.float64)
    return {
        "input_norm": rand(h, scale=0.1) + 1, "qkv": rand((hq + 2 * hkv) * d, h, scale=h**-0.5),
        "o": rand(h, hq * d, scale=(hq * d)**-0.5), "post_norm": rand(h, scale=0.1) + 1,
        "gate_up": rand(2 * inter, h, scale=h**-0.5), "down": rand(h, inter, scale=inter**-0.5),
        "cos_sin_cache": torch.cat([torch.cos(theta), torch.sin(theta)], -1).float().to(device),
        "k_cache": rand(1, hkv, slots, d), "v_cache": rand(1, hkv, slots, d),
    }


def layer_ref(x, w, pos, eps=1e-6):
    """The layer in float64, no intermediate rounding; returns (out, new k, new v)."""
    f = {n: t.double().cpu() for n, t in w.items()}
    x = x.double().cpu().reshape(1, -1)
    d, hkv = f["k_cache"].shape[-1], f["k_cache"].shape[1]
    hq = f["qkv"].shape[0] // d - 2 * hkv

    def rms(v, g):
        return v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps) * g

    def rope(t):  # (heads, d), neox pairs
        cs = f["cos_sin_cache"][pos]
        c, s = cs[: d // 2], cs[d // 2:]
        a, b = t[:, : d // 2], t[:, d // 2:]
        return torch.cat([a * c - b * s, b * c + a * s], -1)

    q, k, v = (rms(x, f["input_norm"]) @ f["qkv"].t()).split([hq * d, hkv * d, hkv * d], -1)
    q, k, v = rope(q.view(hq, d)), rope(k.view(hkv, d)), v.view(hkv, d)
    kc, vc = f["k_cache"][0].clone(), f["v_cache"][0].clone()
    kc[:, pos], vc[:, pos] = k, v
    g = hq // hkv
    scores = torch.einsum("hd,hsd->hs", q, kc.repeat_interleave(g, 0)[:, : pos + 1]) / math.sqrt(d)
    a = torch.einsum("hs,hsd->hd", scores.softmax(-1), vc.repeat_interleave(g, 0)[:, : pos + 1])
    xm = x + a.reshape(1, -1) @ f["o"].t()
    gate, up = (rms(xm, f["post_norm"]) @ f["gate_up"].t()).chunk(2, -1)
    return xm + (F.silu(gate) * up) @ f["down"].t(), k, v


def run_step(fn, x, w, pos, device, **kw):
    position = torch.tensor([pos], device=device, dtype=torch.int32)
    return fn(x, w["input_norm"], w["qkv"], w["o"], w["post_norm"], w["gate_up"], w["down"], w["cos_sin_cache"],
              w["k_cache"], w["v_cache"], position, **kw)


def check_against_ref(out, x, w, pos, ref, dtype):
    """The layer's update (out - x) and the K/V written at pos, against the float64 reference. The
    update, not out: x dominates out's norm and would hide an error in either sublayer."""
    out_ref, k_ref, v_ref = ref
    x64 = x.double().cpu().reshape(1, -1)
    assert rel_err(out.reshape(1, -1).double().cpu() - x64, out_ref - x64) < TOL[dtype]
    assert rel_err(w["k_cache"][0, :, pos], k_ref) < TOL[dtype]
    assert rel_err(w["v_cache"][0, :, pos], v_ref) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES[:3])
def test_chain_matches_float64_cpu(shape, dtype):
    h, inter, hq, hkv, d, slots, pos = shape
    gen = torch.Generator().manual_seed(1)
    w = make_layer(h, inter, hq, hkv, d, slots, "cpu", dtype, gen)
    x = torch.randn(1, h, generator=gen).to(dtype)
    ref = layer_ref(x, w, pos)
    out = run_step(decode.decoder_layer_step, x, w, pos, "cpu")  # the CPU path is the chain
    check_against_ref(out, x, w, pos, ref, dtype)


@needs_gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_gpu_fused_matches_float64_and_chain(shape, dtype):
    h, inter, hq, hkv, d, slots, pos = shape
    gen = torch.Generator().manual_seed(2)
    w = make_layer(h, inter, hq, hkv, d, slots, "cuda", dtype, gen)
    x = torch.randn(1, h, generator=gen).to("cuda", dtype)
    ref = layer_ref(x, w, pos)
    chain_w = {n: t.clone() for n, t in w.items()}
    poison_allocator("cuda", 4 * h)
    out = run_step(decode.decoder_layer_step, x, w, pos, "cuda")
    check_against_ref(out, x, w, pos, ref, dtype)
    chain = run_step(decode.decoder_layer_chain, x, chain_w, pos, "cuda")
    # Not bitwise: both round the same intermediates, but a different fp32 summation order flips
    # some of those roundings, and a flip propagates (measured: the two differ by about as much as
    # each differs from float64). So: no less accurate than the chain of ops.
    x64, ref64 = x.double().cpu(), ref[0]
    fused_err, chain_err = rel_err(out.double().cpu() - x64, ref64 - x64), rel_err(chain.double().cpu() - x64, ref64 - x64)
    print(f"layer update error vs float64: fused {fused_err:.2e}, chain {chain_err:.2e}")
    assert fused_err < 2 * chain_err, (fused_err, chain_err)
    # the rest of the cache is untouched
    keep = torch.ones(slots, dtype=torch.bool)
    keep[pos] = False
    for n in ("k_cache", "v_cache"):
        assert torch.equal(w[n][:, :, keep], chain_w[n][:, :, keep])


@needs_gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_consecutive_steps_share_a_workspace_and_capture(dtype):
    """Three tokens in a row through one workspace (each call must leave it ready for the next),
    then the same three replayed from a CUDA graph."""
    h, inter, hq, hkv, d, slots = 256, 512, 8, 2, 64, 64
    gen = torch.Generator().manual_seed(3)
    w = make_layer(h, inter, hq, hkv, d, slots, "cuda", dtype, gen)
    w0 = {n: t.clone() for n, t in w.items()}
    xs = [torch.randn(1, h, generator=gen).to("cuda", dtype) for _ in range(3)]
    ws = decode.decoder_layer_workspace(
        xs[0], w["input_norm"], w["qkv"], w["o"], w["post_norm"], w["gate_up"], w["down"], w["cos_sin_cache"],
        w["k_cache"], w["v_cache"])
    eager = []
    for i, x in enumerate(xs):
        ref = layer_ref(x, w, 20 + i)
        eager.append(run_step(decode.decoder_layer_step, x, w, 20 + i, "cuda", workspace=ws))
        check_against_ref(eager[-1], x, w, 20 + i, ref, dtype)

    skip_graphs_without_caching_allocator("the eager steps ran")
    # the graph: restore the caches, capture the three calls, replay
    for n in ("k_cache", "v_cache"):
        w[n].copy_(w0[n])
    positions = [torch.tensor([20 + i], device="cuda", dtype=torch.int32) for i in range(3)]

    def step(i):
        return decode.decoder_layer_step(xs[i], w["input_norm"], w["qkv"], w["o"], w["post_norm"], w["gate_up"],
                                         w["down"], w["cos_sin_cache"], w["k_cache"], w["v_cache"], positions[i],
                                         workspace=ws)

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [step(i) for i in range(3)]
    for n in ("k_cache", "v_cache"):
        w[n].copy_(w0[n])
    graph.replay()
    torch.cuda.synchronize()
    for i in range(3):
        assert torch.equal(outs[i], eager[i]), i  # the same kernel on the same inputs: bitwise


def small_gpu_layer(seed, dtype):
    """A small layer (H 128, I 256, 4 / 2 heads of 64, 16 cache slots) and an x, on the GPU."""
    gen = torch.Generator().manual_seed(seed)
    w = make_layer(128, 256, 4, 2, 64, 16, "cuda", dtype, gen)
    return w, torch.randn(1, 128, generator=gen).to("cuda", dtype)


@needs_gpu
def test_gpu_position_outside_the_cache_gives_nan_and_leaves_the_cache():
    w, x = small_gpu_layer(4, torch.bfloat16)
    slots = w["k_cache"].shape[2]
    before = {n: w[n].clone() for n in ("k_cache", "v_cache")}
    for pos in (slots, -1):
        out = run_step(decode.decoder_layer_step, x, w, pos, "cuda")
        assert torch.isnan(out).all(), pos
        for n in before:
            assert torch.equal(w[n], before[n]), (pos, n)


@needs_gpu
def test_gpu_bad_arguments_get_clear_errors():
    w, x = small_gpu_layer(5, torch.float16)
    cases = {
        "cos_sin_cache: expected dtype float32": dict(cos_sin_cache=w["cos_sin_cache"].half()),
        "o: expected shape": dict(o=w["o"][:, :-8]),
        "qkv: expected": dict(qkv=w["qkv"][:-64]),
        "post_norm: expected": dict(post_norm=w["post_norm"].float()),
        "head dim 64, 128 or 256": dict(k_cache=w["k_cache"][..., :32].contiguous(),
                                        v_cache=w["v_cache"][..., :32].contiguous()),
        "gate_up: expected a contiguous": dict(gate_up=w["gate_up"].t().contiguous().t()),
    }
    for message, change in cases.items():
        args = {**w, **change}
        with pytest.raises((ValueError, TypeError, RuntimeError, NotImplementedError), match=message):
            run_step(decode.decoder_layer_step, x, args, 3, "cuda")
