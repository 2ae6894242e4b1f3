"""The Monarch op (torch.ops.llm_kernels.monarch_matmul via llm_kernels.monarch.monarch_matmul):
forward vs the float64 dense equivalent, gradients vs float64 autograd of the two-bmm
formulation, odd and rectangular shapes, block sizes 16..256, leading dims, both GPU paths
(the cluster kernel on sm_90 where it fits, the tiled tensor-core kernels, LLMK_MONARCH_LEGACY=1 and
LLMK_MONARCH_PORTABLE=1), MonarchLinear on the op, fake impls / opcheck /
torch.compile, and bad inputs."""

import pytest
import torch

from conftest import HAS_GPU, TOL, at_thread_counts, poison_allocator, rel_err
from llm_kernels import monarch as M

DTYPES = [torch.float32, torch.float16, torch.bfloat16]

# (k, q, p, l, s, r) with k*q == l*r
SHAPES = [
    (4, 16, 16, 4, 16, 16),  # square n = 64
    (8, 32, 16, 16, 16, 16),  # rectangular: n = 128, m = 256
    (6, 5, 7, 3, 9, 10),  # odd: n = 6*7, m = 27
    (2, 256, 256, 2, 256, 256),  # block size 256
    (16, 64, 64, 16, 64, 64),  # n = 1024
    (4, 128, 96, 4, 128, 128),  # 128-output blocks (LLMK_MONARCH_WIDE's 128 x 128 tiles)
    (3, 200, 64, 3, 136, 200),  # block outputs 200 and 136: partial 128-column tiles
    (64, 64, 64, 64, 64, 64),  # n = 4096, 64 blocks: the cluster kernel on sm_90 (8 CTAs per cluster)
    (32, 64, 64, 32, 64, 64),  # n = 2048, 32 blocks: the cluster kernel, 4 CTAs
]

# (device, portable): the GPU four times: the tiled tensor-core default, the previous kernels
# (portable="legacy": LLMK_MONARCH_LEGACY=1), the forced portable path and the 128 x 128 tiles
# (portable="wide": LLMK_MONARCH_WIDE=1, 128-token tiles forced; the default takes them only for
# blocks of >= 512 outputs at >= 2048 tokens); on sm_90 the default takes the wgmma stage kernel
# for blocks of >= 64 x 64 at >= 128 tokens, "mmasync" (LLMK_MONARCH_WGMMA=0, cluster kernels
# off) the mma.sync tile kernels there, and "wide" turns the wgmma kernel off too; at up to 16
# tokens the default takes a one-launch few-token kernel (monarch_decode[_mma].cu) or the few-token
# stages (monarch_skinny.cu), which the others turn off; the forced portable path (True) runs the
# legacy portable kernels (LLMK_MONARCH_SIMT=0), "simt" its default, the CUDA-core tiled stage
# kernels with scalar loads (LLMK_MONARCH_SIMT_VEC=0), "simtvec" those reading 16-byte chunks (their
# default)
PATHS = [
    ("cpu", False),
    pytest.param("cuda", False, marks=pytest.mark.skipif(not HAS_GPU, reason="no GPU")),
    pytest.param("cuda", "legacy", marks=pytest.mark.skipif(not HAS_GPU, reason="no GPU")),
    pytest.param("cuda", True, marks=pytest.mark.skipif(not HAS_GPU, reason="no GPU")),
    pytest.param("cuda", "wide", marks=pytest.mark.skipif(not HAS_GPU, reason="no GPU")),
    pytest.param("cuda", "mmasync", marks=pytest.mark.skipif(not HAS_GPU, reason="no GPU")),
    pytest.param("cuda", "simt", marks=pytest.mark.skipif(not HAS_GPU, reason="no GPU")),
    pytest.param("cuda", "simtvec", marks=pytest.mark.skipif(not HAS_GPU, reason="no GPU")),
]


@pytest.fixture
def portable_env(monkeypatch):
    def set_(on):
        monkeypatch.delenv("LLMK_MONARCH_PORTABLE", raising=False)
        monkeypatch.delenv("LLMK_MONARCH_LEGACY", raising=False)
        monkeypatch.delenv("LLMK_MONARCH_WIDE", raising=False)
        monkeypatch.delenv("LLMK_MONARCH_CLUSTER", raising=False)
        monkeypatch.delenv("LLMK_MONARCH_WGMMA", raising=False)
        monkeypatch.delenv("LLMK_MONARCH_WG_CTAS", raising=False)
        monkeypatch.delenv("LLMK_MONARCH_SKINNY", raising=False)
        monkeypatch.delenv("LLMK_MONARCH_DECODE", raising=False)
        monkeypatch.delenv("LLMK_MONARCH_DECODE_MMA", raising=False)
        monkeypatch.delenv("LLMK_MONARCH_SIMT", raising=False)
        monkeypatch.delenv("LLMK_MONARCH_SIMT_VEC", raising=False)
        if on is True:  # the legacy portable kernels ("simt": the portable path's default)
            monkeypatch.setenv("LLMK_MONARCH_SIMT", "0")
        if on == "simtvec":  # those kernels reading 16-byte chunks (their default)
            monkeypatch.setenv("LLMK_MONARCH_SIMT_VEC", "1")
        if on == "simt":  # the same kernels with scalar loads
            monkeypatch.setenv("LLMK_MONARCH_SIMT_VEC", "0")
        if on:  # the few-token kernels come first at <= 16 tokens: off for every forced path
            monkeypatch.setenv("LLMK_MONARCH_SKINNY", "0")
            monkeypatch.setenv("LLMK_MONARCH_DECODE", "0")
            monkeypatch.setenv("LLMK_MONARCH_DECODE_MMA", "0")
        if on == "wgfew":  # the wgmma stage kernel on 3 persistent CTAs: many tiles each
            monkeypatch.setenv("LLMK_MONARCH_WG_CTAS", "3")
        if on in ("wide", "mmasync"):
            monkeypatch.setenv("LLMK_MONARCH_WGMMA", "0")
        if on in ("mmasync", "wgfew"):
            monkeypatch.setenv("LLMK_MONARCH_CLUSTER", "0")
        elif on == "tiled":  # the tiled kernels where the cluster kernel would run
            monkeypatch.setenv("LLMK_MONARCH_CLUSTER", "0")
        elif on in ("resident", "pipelined"):  # that cluster kernel (where it has the shape)
            monkeypatch.setenv("LLMK_MONARCH_CLUSTER", on)
        elif on in ("legacy", "wide"):
            monkeypatch.setenv("LLMK_MONARCH_" + on.upper(), "1")
        elif on:
            monkeypatch.setenv("LLMK_MONARCH_PORTABLE", "1")

    return set_


def factors(shape, dtype, device, gen):
    k, q, p, l, s, r = shape
    w1 = (torch.rand(k, q, p, generator=gen, dtype=torch.float64) - 0.5) / p**0.5
    w2 = (torch.rand(l, s, r, generator=gen, dtype=torch.float64) - 0.5) / r**0.5
    return w1.to(dtype).to(device), w2.to(dtype).to(device)


@pytest.mark.parametrize("device,portable", PATHS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("tokens", [1, 13, 37, 1100])
def test_forward_vs_dense(device, portable, dtype, shape, tokens, portable_env):
    if device == "cpu" and tokens == 1100 and shape[0] * shape[2] > 256:
        tokens = 64  # the CPU kernel is plain loops
    portable_env(portable)
    gen = torch.Generator().manual_seed(tokens + sum(shape))
    w1, w2 = factors(shape, dtype, device, gen)
    n = shape[0] * shape[2]
    x = torch.randn(tokens, n, generator=gen, dtype=torch.float64).to(dtype).to(device)
    poison_allocator(device, tokens * shape[3] * shape[4] * 4)
    out = M.monarch_matmul(x, w1, w2)
    assert out.shape == (tokens, shape[3] * shape[4]) and out.dtype == dtype and out.device == x.device
    ref = x.double() @ M.monarch_to_dense(w1.double(), w2.double()).T
    assert rel_err(out, ref) <= TOL[dtype]


@pytest.mark.parametrize("backward", ["default", "bmm"])
@pytest.mark.parametrize("device,portable", PATHS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES[:4])
def test_backward_vs_autograd_of_two_bmm(device, portable, dtype, shape, backward, portable_env, monkeypatch):
    """backward="bmm": LLMK_MONARCH_BACKWARD=bmm, the backward on at::bmm (what the GPU takes for
    blocks of 2048 and more) on every path's device."""
    if backward == "bmm" and portable:
        pytest.skip("the bmm backward does not depend on the kernel path")
    portable_env(portable)
    monkeypatch.delenv("LLMK_MONARCH_BACKWARD", raising=False)
    if backward == "bmm":
        monkeypatch.setenv("LLMK_MONARCH_BACKWARD", "bmm")
    gen = torch.Generator().manual_seed(7 + sum(shape))
    w1, w2 = factors(shape, dtype, device, gen)
    x = torch.randn(2, 19, shape[0] * shape[2], generator=gen, dtype=torch.float64).to(dtype).to(device)
    dout = torch.randn(2, 19, shape[3] * shape[4], generator=gen, dtype=torch.float64).to(dtype).to(device)
    leaves = [t.detach().clone().requires_grad_() for t in (x, w1, w2)]
    M.monarch_matmul(*leaves).backward(dout)
    ref_leaves = [t.detach().double().requires_grad_() for t in (x, w1, w2)]
    M.monarch_matmul_ref(*ref_leaves).backward(dout.double())
    tol = 2 * TOL[dtype]
    for name, got, want in zip(("dx", "dw1", "dw2"), leaves, ref_leaves):
        assert got.grad.dtype == dtype and got.grad.shape == want.grad.shape
        assert rel_err(got.grad, want.grad) <= tol, name


@pytest.mark.skipif(not HAS_GPU, reason="no GPU")
@pytest.mark.parametrize("tokens", [300, 4200])
def test_backward_of_wide_blocks_dispatch(tokens, monkeypatch):
    """Blocks of 2048: up to 4096 rows the GPU backward runs on at::bmm (seen in the profile), above
    it on our kernels; the gradients match float64 autograd of the two-bmm formulation either way,
    and a dout of the wrong shape gets a clear error on the bmm path."""
    monkeypatch.delenv("LLMK_MONARCH_BACKWARD", raising=False)
    shape = (2, 2048, 2048, 2, 2048, 2048)
    gen = torch.Generator().manual_seed(tokens)
    w1, w2 = factors(shape, torch.bfloat16, "cuda", gen)
    x = torch.randn(tokens, 4096, generator=gen, dtype=torch.float64).to(torch.bfloat16).cuda()
    dout = torch.randn(tokens, 4096, generator=gen, dtype=torch.float64).to(torch.bfloat16).cuda()
    leaves = [t.detach().clone().requires_grad_() for t in (x, w1, w2)]
    out = M.monarch_matmul(*leaves)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], acc_events=True) as prof:
        out.backward(dout)
    bmm_calls = sum(e.name == "aten::bmm" for e in prof.events())
    assert bmm_calls == (5 if tokens <= 4096 else 0), bmm_calls
    ref_leaves = [t.detach().double().requires_grad_() for t in (x, w1, w2)]
    M.monarch_matmul_ref(*ref_leaves).backward(dout.double())
    for name, got, want in zip(("dx", "dw1", "dw2"), leaves, ref_leaves):
        assert got.grad.dtype == torch.bfloat16
        assert rel_err(got.grad, want.grad) <= 2 * TOL[torch.bfloat16], name
    if tokens <= 4096:
        with pytest.raises(ValueError, match=r"monarch_matmul_backward: dout: expected shape \(300, 4096\), got \(300, 4095\)"):
            torch.ops.llm_kernels.monarch_matmul_backward(dout[:, 1:], x, w1, w2)


def test_backward_on_bmm_bad_dout(monkeypatch):
    """The bmm backward checks dout as the kernels do (x, w1 and w2 by the library's own checks)."""
    monkeypatch.setenv("LLMK_MONARCH_BACKWARD", "bmm")
    x, w1, w2 = torch.randn(5, 64), torch.randn(4, 16, 16), torch.randn(4, 16, 16)
    bwd = torch.ops.llm_kernels.monarch_matmul_backward
    with pytest.raises(ValueError, match=r"monarch_matmul_backward: dout: expected shape \(5, 64\), got \(5, 63\)"):
        bwd(torch.randn(5, 63), x, w1, w2)
    with pytest.raises(TypeError, match=r"monarch_matmul_backward: dout: expected the dtype and device of x"):
        bwd(torch.randn(5, 64, dtype=torch.float64), x, w1, w2)
    with pytest.raises(ValueError, match=r"monarch_matmul_backward"):
        bwd(torch.randn(5, 64), x, torch.randn(4, 16, 15), w2)
    with pytest.raises(ValueError, match=r"expected non-empty factors"):
        bwd(torch.randn(5, 0), torch.randn(5, 0), torch.randn(0, 16, 16), torch.randn(0, 16, 16))
    dx, dw1, dw2 = bwd(torch.randn(0, 64), torch.randn(0, 64), w1, w2)  # no tokens: zero weight gradients
    assert dx.shape == (0, 64) and not dw1.any() and not dw2.any() and dw1.shape == w1.shape


# Enough tokens that the tiled kernel puts several blocks in one CTA (staged, coalesced writes in
# all three write orders), with a partial last group of blocks and a one-row last token tile;
# forward and backward on the GPU against float64 (computed on the GPU). "wide": the 128-token
# tiles (2 blocks per CTA at 64 and 32 outputs; 11 blocks: a partial last group). The fifth and
# sixth shapes run a cluster kernel on sm_90 (by default the pipelined one at this token count);
# "tiled" turns it off, "resident" / "pipelined" force either cluster kernel (pipelined: n = 4096
# or 2048 with 64 or 32 blocks of 64, 31 or 15 tiles of 16 tokens per cluster). The default
# takes the sm_90a wgmma stage kernel for blocks of >= 64 x 64 (among them the last three shapes:
# 256-blocks, rectangular with partial 128-column tiles and a partial K step, and 16 blocks of
# 384 x 256 / 256 x 384), "mmasync" the mma.sync tiles,
# "wgfew" the wgmma kernel on 3 persistent CTAs (over 100 tiles each, the ring's phases wrapping
# across tiles). The last shape's stage 1 writes stage-2 order straight from 256-wide wgmma tiles.
# On the wgmma paths the backward's dy product writes block order and a row pass permutes it, and
# the weight gradients run on dw_wgmma_kernel; "mmasync" keeps the mma.sync kernels for both.
@pytest.mark.skipif(not HAS_GPU, reason="no GPU")
@pytest.mark.parametrize("path", [False, "legacy", "wide", "tiled", "resident", "pipelined", "mmasync", "wgfew"])
@pytest.mark.parametrize("shape", [(10, 64, 64, 10, 64, 64), (11, 64, 64, 11, 64, 64), (8, 128, 128, 8, 128, 128),
                                   (16, 32, 32, 16, 32, 32), (64, 64, 64, 64, 64, 64), (32, 64, 64, 32, 64, 64),
                                   (4, 256, 256, 4, 256, 256), (2, 192, 128, 4, 160, 96),
                                   (16, 384, 256, 16, 256, 384)])
def test_many_tokens_gpu(path, shape, portable_env):
    portable_env(path)
    gen = torch.Generator().manual_seed(11 + sum(shape))
    w1, w2 = factors(shape, torch.bfloat16, "cuda", gen)
    tokens = 8001
    x = torch.randn(tokens, shape[0] * shape[2], generator=gen).to(torch.bfloat16).cuda()
    dout = torch.randn(tokens, shape[3] * shape[4], generator=gen).to(torch.bfloat16).cuda()
    poison_allocator("cuda", tokens * shape[3] * shape[4] * 4)
    leaves = [t.detach().clone().requires_grad_() for t in (x, w1, w2)]
    out = M.monarch_matmul(*leaves)
    ref_leaves = [t.detach().double().requires_grad_() for t in (x, w1, w2)]
    ref = M.monarch_matmul_ref(*ref_leaves)
    assert rel_err(out, ref) <= TOL[torch.bfloat16]
    out.backward(dout)
    ref.backward(dout.double())
    for name, got, want in zip(("dx", "dw1", "dw2"), leaves, ref_leaves):
        assert rel_err(got.grad, want.grad) <= 2 * TOL[torch.bfloat16], name


@pytest.mark.parametrize("device,portable", PATHS)
def test_leading_dims_strided_rows_and_zero_tokens(device, portable, portable_env):
    portable_env(portable)
    gen = torch.Generator().manual_seed(3)
    w1, w2 = factors((4, 16, 16, 4, 16, 16), torch.bfloat16, device, gen)
    big = torch.randn(3, 5, 80, generator=gen).to(torch.bfloat16).to(device)
    x = big[..., :64]  # rows 80 apart
    out = M.monarch_matmul(x, w1, w2)
    assert out.shape == (3, 5, 64)
    assert rel_err(out, M.monarch_matmul_ref(x.double(), w1.double(), w2.double())) <= TOL[torch.bfloat16]
    empty = M.monarch_matmul(x[:0], w1, w2)
    assert empty.shape == (0, 5, 64)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not HAS_GPU, reason="no GPU"))])
def test_monarch_linear_uses_the_op_and_keeps_its_state_dict(device):
    torch.manual_seed(0)
    layer = M.MonarchLinear(100, 72, nblocks=4).to(device)
    assert set(layer.state_dict()) == {"blkdiag1", "blkdiag2", "bias"}
    x = torch.randn(6, 100, device=device, requires_grad=True)
    out = layer(x)
    ref = x.detach().double() @ layer.to_dense().double().T + layer.bias.double()
    assert rel_err(out, ref) <= 1e-5
    out.sum().backward()
    assert layer.blkdiag1.grad is not None and x.grad is not None
    layer64 = M.MonarchLinear(100, 72, nblocks=4, dtype=torch.float64)  # falls back to the reference
    assert layer64(torch.randn(2, 100, dtype=torch.float64)).dtype == torch.float64


def test_opcheck_and_compile():
    gen = torch.Generator().manual_seed(1)
    w1, w2 = factors((4, 16, 16, 4, 16, 16), torch.float32, "cpu", gen)
    x = torch.randn(5, 64, generator=gen)
    torch.library.opcheck(torch.ops.llm_kernels.monarch_matmul, (x, w1, w2))
    torch.library.opcheck(
        torch.ops.llm_kernels.monarch_matmul_backward, (torch.randn(5, 64, generator=gen), x, w1, w2)
    )
    compiled = torch.compile(M.monarch_matmul, fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(x, w1, w2), M.monarch_matmul(x, w1, w2))


def test_bad_inputs():
    x = torch.randn(3, 64)
    with pytest.raises(ValueError, match=r"llmk::monarch_matmul: x: expected a last dim of k\*p = 60 \(w1 is \(4, 16, 15\)\), got 64"):
        M.monarch_matmul(x, torch.randn(4, 16, 15), torch.randn(4, 16, 16))
    with pytest.raises(ValueError, match=r"w2: expected l\*r == k\*q = 64 \(w1 is \(4, 16, 16\)\), got shape \(4, 16, 8\) with l\*r = 32"):
        M.monarch_matmul(x, torch.randn(4, 16, 16), torch.randn(4, 16, 8))
    with pytest.raises(ValueError, match=r"w1: expected 3 dims, got 2 dims with shape \(4, 16\)"):
        M.monarch_matmul(x, torch.randn(4, 16), torch.randn(4, 16, 16))
    with pytest.raises(TypeError, match=r"w1: expected dtype float16 \(the dtype of x\), got float32"):
        M.monarch_matmul(x.half(), torch.randn(4, 16, 16), torch.randn(4, 16, 16))
    with pytest.raises(TypeError, match=r"x: expected dtype float32, float16 or bfloat16, got float64"):
        M.monarch_matmul(x.double(), torch.randn(4, 16, 16).double(), torch.randn(4, 16, 16).double())


def test_cli_bench_monarch_quick_writes_json_and_markdown(tmp_path):
    import json

    from typer.testing import CliRunner

    from llm_kernels.cli import app

    out_json, out_md = tmp_path / "m.json", tmp_path / "m.md"
    result = CliRunner().invoke(app, ["bench-monarch", "--quick", "--json", str(out_json), "--md", str(out_md)])
    assert result.exit_code == 0, result.output
    rows = json.loads(out_json.read_text())["rows"]
    assert rows and all(set(r["fwd_ms"]) == {"ours", "tiled", "two_bmm", "dense"} for r in rows)
    assert all(v > 0 for r in rows for v in (*r["fwd_ms"].values(), *r["bwd_ms"].values()))
    assert "| n | blocks | tokens |" in out_md.read_text()
    assert json.loads(out_json.read_text())["meta"]["rounds"] == 2  # every variant timed twice, in turn
    assert "median of 2 rounds" in out_md.read_text()


def test_cpu_forward_sums_in_index_order_at_any_thread_count():
    """The CPU forward is a reference: each output an fp32 sum in index order, each product and
    addition rounded on its own (no FMA contraction, which the vectorised AVX-512 build would
    otherwise use), whatever the number of threads. Emulated here one index step at a time."""
    k, q, p, l, s, r = 3, 24, 20, 4, 10, 18
    x, w1, w2 = torch.randn(29, k * p), torch.randn(k, q, p), torch.randn(l, s, r)
    xb = x.view(-1, k, p)
    y = torch.zeros(x.shape[0], k, q)
    for a in range(p):
        y = y + w1[:, :, a] * xb[:, :, a, None]
    z = y.reshape(-1, r, l)  # z[b, t, u] = y[b, t*l + u]
    out = torch.zeros(x.shape[0], l, s)
    for t in range(r):
        out = out + w2[:, :, t] * z[:, t, :, None]
    expected = out.transpose(1, 2).reshape(x.shape[0], s * l)  # out[b, v*l + u]
    for got in at_thread_counts(lambda: M.monarch_matmul(x, w1, w2)):
        assert torch.equal(got, expected)


def test_cpu_backward_does_not_depend_on_threads():
    """The CPU backward splits tokens (dx) and weight-gradient blocks (each summed over the tokens
    in order, in slabs of 256) over torch's threads: no bit changes."""
    x, w1, w2 = torch.randn(600, 96), torch.randn(3, 40, 32), torch.randn(5, 16, 24)
    grad = torch.randn(600, 80)

    def run():
        xs, a, b = (t.clone().requires_grad_() for t in (x, w1, w2))
        M.monarch_matmul(xs, a, b).backward(grad)
        return xs.grad, a.grad, b.grad

    first, second = at_thread_counts(run)
    assert all(torch.equal(a, b) for a, b in zip(first, second))
