"""RMSNorm family: values vs float64, gradients, opcheck, torch.compile, the module, bad input."""

import pytest
import torch
from torch import nn

import llm_kernels as lk
from llm_kernels import reference

from conftest import HAS_GPU, TOL, at_thread_counts, poison_allocator, rel_err

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SHAPES = [(1, 1), (3, 7), (5, 77), (4, 333), (2, 4097), (64, 4096), (2, 3, 5120), (2, 2, 3, 96), (1, 65536)]


def ref64(x, w, eps, offset=0.0):
    return reference.rms_norm_ref(x.double(), w.double(), eps, offset)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("weight_fp32", [False, True])
def test_rms_norm_matches_float64(device, dtype, shape, weight_fp32):
    if weight_fp32 and dtype == torch.float32:
        pytest.skip("same as the float32 weight case")
    x = torch.randn(shape, device=device, dtype=dtype) * 3
    w = torch.rand(shape[-1], device=device, dtype=torch.float32 if weight_fp32 else dtype) + 0.5
    poison_allocator(device, x.numel() * x.element_size())
    y = lk.rms_norm(x, w, eps=1e-6)
    assert y.shape == x.shape and y.dtype == dtype and y.device == x.device
    assert rel_err(y, ref64(x, w, 1e-6)) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_gemma_offset_and_known_answer(device, dtype):
    # A row of 2s has rms exactly 2: with eps=0, y = offset + w.
    x = torch.full((3, 333), 2.0, device=device, dtype=dtype)
    w = torch.randn(333, device=device, dtype=dtype)
    for offset in (0.0, 1.0):
        y = lk.rms_norm(x, w, eps=0.0, offset=offset)
        expect = (offset + w.double()).to(dtype)
        assert torch.equal(y, expect.expand_as(y)), f"offset={offset}"


@pytest.mark.parametrize("dtype", DTYPES)
def test_non_contiguous_inputs(device, dtype):
    base = torch.randn(6, 8, 300, device=device, dtype=dtype)
    w = torch.randn(150, device=device, dtype=dtype)
    for x in (base[:, :, :150], base[::2, :, 150:], base[:, :, ::2], base.transpose(0, 1)[:, :, :150]):
        assert rel_err(lk.rms_norm(x, w), ref64(x, w, 1e-6)) < TOL[dtype]


def test_empty_tensors(device):
    w = torch.randn(64, device=device)
    for shape in ((0, 64), (2, 0, 64)):
        x = torch.randn(shape, device=device)
        assert lk.rms_norm(x, w).shape == shape
        y, r = lk.fused_add_rms_norm(x, x.clone(), w)
        assert y.shape == shape and r.shape == shape


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(5, 77), (64, 4096), (2, 3, 5120), (1, 65536)])
@pytest.mark.parametrize("in_place", [False, True])
def test_fused_add_rms_norm(device, dtype, shape, in_place):
    x = torch.randn(shape, device=device, dtype=dtype)
    res = torch.randn(shape, device=device, dtype=dtype)
    w = torch.rand(shape[-1], device=device, dtype=dtype) + 0.5
    summed = (x.double() + res.double()).to(dtype)
    res_in = res.clone()
    poison_allocator(device, 2 * x.numel() * x.element_size())
    y, res_out = lk.fused_add_rms_norm(x, res_in, w, eps=1e-5, offset=0.0, in_place=in_place)
    if in_place:
        assert res_out is res_in
    else:
        assert torch.equal(res_in, res)  # untouched
    assert rel_err(res_out, summed) < TOL[dtype]
    assert rel_err(y, ref64(summed, w, 1e-5)) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1), (5, 77), (33, 4096), (3, 2, 333), (2, 40000)])
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_gradients_vs_float64_autograd(device, dtype, shape, offset):
    x = torch.randn(shape, device=device, dtype=dtype, requires_grad=True)
    w = (torch.rand(shape[-1], device=device, dtype=dtype) + 0.5).requires_grad_()
    g = torch.randn(shape, device=device, dtype=dtype)
    lk.rms_norm(x, w, 1e-6, offset).backward(g)
    x64 = x.detach().double().requires_grad_()
    w64 = w.detach().double().requires_grad_()
    reference.rms_norm_ref(x64, w64, 1e-6, offset).backward(g.double())
    # grad_x is a difference of two terms that can cancel: measure against the larger term.
    scale = (g.double() * (offset + w64.detach())) * torch.rsqrt(x64.detach().pow(2).mean(-1, keepdim=True) + 1e-6)
    assert rel_err(x.grad, x64.grad, scale) < TOL[dtype]
    assert rel_err(w.grad, w64.grad) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_add_gradients(device, dtype):
    shape = (7, 333)
    x = torch.randn(shape, device=device, dtype=dtype, requires_grad=True)
    r = torch.randn(shape, device=device, dtype=dtype, requires_grad=True)
    w = (torch.rand(333, device=device, dtype=dtype) + 0.5).requires_grad_()
    gy, gr = torch.randn(shape, device=device, dtype=dtype), torch.randn(shape, device=device, dtype=dtype)
    y, s = lk.fused_add_rms_norm(x, r, w)
    torch.autograd.backward([y, s], [gy, gr])
    leaves = [t.detach().double().requires_grad_() for t in (x, r, w)]
    y64, s64 = reference.fused_add_rms_norm_ref(*leaves)
    torch.autograd.backward([y64, s64], [gy.double(), gr.double()])
    for ours, ref in zip((x.grad, r.grad, w.grad), (l.grad for l in leaves)):
        assert rel_err(ours, ref) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_opcheck(device, dtype):
    x = torch.randn(4, 3, 64, device=device, dtype=dtype, requires_grad=True)
    w = torch.randn(64, device=device, dtype=dtype, requires_grad=True)
    res = torch.randn(4, 3, 64, device=device, dtype=dtype)
    g = torch.randn(4, 3, 64, device=device, dtype=dtype)
    ops = torch.ops.llm_kernels
    torch.library.opcheck(ops.rms_norm, (x, w, 1e-6, 0.0))
    torch.library.opcheck(ops.rms_norm, (x, w.detach().float(), 1e-6, 1.0))
    torch.library.opcheck(ops.fused_add_rms_norm, (x, res.requires_grad_(), w, 1e-6, 0.0))
    torch.library.opcheck(ops.fused_add_rms_norm_, (x.detach(), res.detach().clone(), w.detach(), 1e-6, 0.0))
    torch.library.opcheck(ops.rms_norm_backward, (g, x.detach(), w.detach(), 1e-6, 0.0, None))
    torch.library.opcheck(ops.rms_norm_backward, (g, x.detach(), w.detach(), 1e-6, 0.0, g.clone()))


def test_torch_compile_fullgraph(device):
    torch._dynamo.reset()
    norm = lk.RMSNorm(96, eps=1e-5).to(device)
    lin = nn.Linear(96, 96).to(device)

    def block(x, residual):
        h, residual = norm(x, residual)
        return lk.rms_norm(lin(h), norm.weight, 1e-5) + residual

    compiled = torch.compile(block, fullgraph=True)
    x, r = torch.randn(5, 96, device=device), torch.randn(5, 96, device=device)
    torch.testing.assert_close(compiled(x, r), block(x, r))


class HFLlamaRMSNorm(nn.Module):
    """Hugging Face's LlamaRMSNorm, as written in transformers."""

    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_module_drop_in_for_llama_rms_norm(device, dtype):
    hf = HFLlamaRMSNorm(333, eps=1e-5).to(device, dtype)
    with torch.no_grad():
        hf.weight.uniform_(0.5, 1.5)
    ours = lk.RMSNorm(333, variance_epsilon=1e-5).to(device, dtype)
    ours.load_state_dict(hf.state_dict())
    assert list(ours.state_dict()) == ["weight"] and ours.variance_epsilon == ours.eps == 1e-5
    x = torch.randn(2, 9, 333, device=device, dtype=dtype)
    assert rel_err(ours(x), ref64(x, hf.weight, 1e-5)) < TOL[dtype]
    assert rel_err(hf(x), ref64(x, hf.weight, 1e-5)) < 2 * TOL[dtype]  # HF rounds twice
    shared = lk.RMSNorm.from_module(hf)
    assert shared.weight is hf.weight and shared.eps == 1e-5
    torch.testing.assert_close(shared(x), ours(x))


def test_module_gemma_offset_and_residual(device):
    m = lk.RMSNorm(64, eps=1e-6, offset=1.0).to(device)
    assert torch.count_nonzero(m.weight) == 0  # Gemma initialises w to 0: (1 + w) = 1
    x, r = torch.randn(3, 64, device=device), torch.randn(3, 64, device=device)
    y, s = m(x, r)
    torch.testing.assert_close(s, x + r)
    torch.testing.assert_close(y, reference.rms_norm_ref(x + r, m.weight, 1e-6, 1.0))


# ------------------------------------------------------------------------- bad input
def test_bad_inputs_raise_clear_errors(device):
    x = torch.randn(4, 64, device=device, dtype=torch.float16)
    w = torch.randn(64, device=device, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"llmk::rms_norm: weight: expected shape \(64\) \(the last dim of x\), got \(63\)"):
        lk.rms_norm(x, w[:63])
    with pytest.raises(TypeError, match=r"llmk::rms_norm: weight: expected dtype float16 \(the dtype of x\) or float32, got bfloat16"):
        lk.rms_norm(x, w.bfloat16())
    with pytest.raises(TypeError, match=r"llmk::rms_norm: x: expected dtype float32, float16 or bfloat16, got int64"):
        lk.rms_norm(torch.ones(4, 64, dtype=torch.long, device=device), w)
    with pytest.raises(TypeError, match=r"got float64"):
        lk.rms_norm(x.double(), w.double())
    with pytest.raises(ValueError, match=r"llmk::rms_norm: eps: expected a finite value >= 0, got -1"):
        lk.rms_norm(x, w, eps=-1.0)
    with pytest.raises(ValueError, match=r"llmk::rms_norm: x: expected at least 1 dim, got 0"):
        lk.rms_norm(torch.tensor(1.0, device=device, dtype=torch.float16), w)
    with pytest.raises(ValueError, match=r"llmk::rms_norm: weight: expected 1 dims, got 2 dims"):
        lk.rms_norm(x, w[None])
    with pytest.raises(ValueError, match=r"llmk::fused_add_rms_norm: residual: expected shape \(4, 64\)"):
        lk.fused_add_rms_norm(x, x[:2], w)
    with pytest.raises(TypeError, match=r"llmk::fused_add_rms_norm: residual: expected dtype float16"):
        lk.fused_add_rms_norm(x, x.float(), w)
    with pytest.raises(ValueError, match=r"llmk::fused_add_rms_norm: residual: expected rows reachable with one stride"):
        res = torch.randn(8, 4, 64, device=device, dtype=torch.float16)[:, :2]  # rows 64 and 192 apart
        lk.fused_add_rms_norm(torch.randn(8, 2, 64, device=device, dtype=torch.float16), res, w, in_place=True)
    with pytest.raises(ValueError, match=r"llmk::fused_add_rms_norm: residual: expected a contiguous last dim"):
        lk.fused_add_rms_norm(x, torch.randn(64, 4, device=device, dtype=torch.float16).t(), w, in_place=True)


@pytest.mark.skipif(not HAS_GPU, reason="no GPU on this machine: GPU case not run")
def test_device_mismatch():
    x = torch.randn(4, 64, device="cuda")
    with pytest.raises(RuntimeError, match=r"llmk::rms_norm: weight: expected device gpu:0 \(the device of x\), got cpu"):
        lk.rms_norm(x, torch.randn(64))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_results_do_not_depend_on_threads(dtype):
    """The CPU kernels split rows over torch's threads; the weight gradient is summed over fixed
    row groups, so the thread count changes no bit of any output."""
    x, res = torch.randn(301, 2049, dtype=dtype), torch.randn(301, 2049, dtype=dtype)
    w = torch.rand(2049, dtype=dtype) + 0.5
    grad = torch.randn(301, 2049, dtype=dtype)

    def run():
        xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = lk.rms_norm(xg, wg, 1e-6)
        y.backward(grad)
        return (y.detach(), xg.grad, wg.grad, *lk.fused_add_rms_norm(x, res, w, 1e-6))

    results = at_thread_counts(run)
    for a, b in zip(*results):
        assert torch.equal(a, b)
