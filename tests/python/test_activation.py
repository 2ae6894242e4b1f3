"""Gated activations: values vs float64, packed forms, gradients, opcheck, torch.compile, modules,
bad input."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import llm_kernels as lk
from llm_kernels import reference

from conftest import HAS_GPU, TOL, at_thread_counts, poison_allocator, rel_err, rel_err_stored

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SHAPES = [(1, 1), (3, 7), (5, 77), (2, 4097), (33, 256), (2, 3, 14336)]
ACTS = [("silu", None), ("gelu", "none"), ("gelu", "tanh")]


def gelu64(g, approximate):
    """gelu in float64 without cancellation for negative inputs (F.gelu's 1 + tanh(z) loses the
    relative accuracy of tiny values, and our fp32 kernels keep it): x/2 erfc(-x/sqrt 2), and
    x sigmoid(2z) for the tanh form. The same functions, only evaluated stably."""
    if approximate == "tanh":
        z = (2.0 / torch.pi) ** 0.5 * (g + 0.044715 * g**3)
        return g * torch.sigmoid(2 * z)
    return 0.5 * g * torch.special.erfc(-g / 2**0.5)


def ref64(gate, up, act, approximate):
    g, u = gate.double(), up.double()
    a = F.silu(g) if act == "silu" else gelu64(g, approximate)
    return a * u


def ours(gate, up, act, approximate):
    return lk.swiglu(gate, up) if act == "silu" else lk.geglu(gate, up, approximate)


def ours_packed(x, act, approximate):
    return lk.silu_and_mul(x) if act == "silu" else lk.gelu_and_mul(x, approximate)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("act,approximate", ACTS)
def test_values_match_float64(device, dtype, shape, act, approximate):
    gate = torch.randn(shape, device=device, dtype=dtype) * 3
    up = torch.randn(shape, device=device, dtype=dtype)
    poison_allocator(device, gate.numel() * gate.element_size())
    out = ours(gate, up, act, approximate)
    assert out.shape == gate.shape and out.dtype == dtype
    assert rel_err_stored(out, ref64(gate, up, act, approximate)) < TOL[dtype]
    # the packed form reads both halves of one (..., 2d) tensor in place
    x = torch.cat([gate, up], dim=-1)
    packed = ours_packed(x, act, approximate)
    assert packed.shape == gate.shape
    assert torch.equal(packed, out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_non_contiguous_and_empty(device, dtype):
    base = torch.randn(6, 4, 300, device=device, dtype=dtype)
    gate, up = base[:, :, :100], base[:, :, 150:250]
    assert rel_err(lk.swiglu(gate, up), ref64(gate, up, "silu", None)) < TOL[dtype]
    assert rel_err(lk.swiglu(gate.transpose(0, 1), up.transpose(0, 1)), ref64(gate, up, "silu", None).transpose(0, 1)) < TOL[dtype]
    assert rel_err(lk.silu_and_mul(base[:, ::2, :]), reference.silu_and_mul_ref(base[:, ::2, :].double())) < TOL[dtype]
    empty = torch.empty(0, 64, device=device, dtype=dtype)
    assert lk.swiglu(empty, empty).shape == (0, 64)
    assert lk.gelu_and_mul(torch.empty(3, 0, device=device, dtype=dtype)).shape == (3, 0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act,approximate", ACTS)
@pytest.mark.parametrize("packed", [False, True])
def test_gradients_vs_float64_autograd(device, dtype, act, approximate, packed):
    shape = (7, 333)
    gate = torch.randn(shape, device=device, dtype=dtype, requires_grad=True)
    up = torch.randn(shape, device=device, dtype=dtype, requires_grad=True)
    g_out = torch.randn(shape, device=device, dtype=dtype)
    if packed:
        x = torch.cat([gate, up], -1).detach().requires_grad_()
        ours_packed(x, act, approximate).backward(g_out)
        grads = x.grad.chunk(2, -1)
    else:
        ours(gate, up, act, approximate).backward(g_out)
        grads = gate.grad, up.grad
    g64, u64 = gate.detach().double().requires_grad_(), up.detach().double().requires_grad_()
    ref64(g64, u64, act, approximate).backward(g_out.double())
    assert rel_err(grads[0], g64.grad) < TOL[dtype]
    assert rel_err(grads[1], u64.grad) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_opcheck(device, dtype):
    ops = torch.ops.llm_kernels
    g = torch.randn(3, 5, 64, device=device, dtype=dtype, requires_grad=True)
    u = torch.randn(3, 5, 64, device=device, dtype=dtype, requires_grad=True)
    x = torch.randn(3, 5, 128, device=device, dtype=dtype, requires_grad=True)
    for act in ("silu", "gelu", "gelu_tanh"):
        torch.library.opcheck(ops.gated_activation, (g, u, act))
        torch.library.opcheck(ops.gated_activation_packed, (x, act))
    go = torch.randn(3, 5, 64, device=device, dtype=dtype)
    torch.library.opcheck(ops.gated_activation_backward, (go, g.detach(), u.detach(), "gelu"))
    torch.library.opcheck(ops.gated_activation_packed_backward, (go, x.detach(), "silu"))


def test_torch_compile_fullgraph(device):
    torch._dynamo.reset()
    mlp = lk.LlamaMLP(64, 96).to(device)
    geglu = lk.GEGLU(64, 48, approximate="tanh").to(device)

    def f(x):
        return mlp(x) + lk.gelu_and_mul(geglu.proj(x), "tanh").sum(-1, keepdim=True)

    x = torch.randn(4, 64, device=device)
    torch.testing.assert_close(torch.compile(f, fullgraph=True)(x), f(x))


class HFLlamaMLP(nn.Module):
    """Hugging Face's LlamaMLP, as written in transformers (act_fn = SiLU)."""

    def __init__(self, hidden, inter):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class DiffusersGEGLU(nn.Module):
    """diffusers' GEGLU: proj to 2*dim_out, chunk, hidden * gelu(gate) (gate is the SECOND half there)."""

    def __init__(self, dim_in, dim_out):
        super().__init__()
        self.proj = nn.Linear(dim_in, dim_out * 2)

    def forward(self, x):
        hidden, gate = self.proj(x).chunk(2, dim=-1)
        return hidden * F.gelu(gate)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_llama_mlp_drop_in(device, dtype):
    hf = HFLlamaMLP(64, 160).to(device, dtype)
    ours_mlp = lk.LlamaMLP(64, 160).to(device, dtype)
    ours_mlp.load_state_dict(hf.state_dict())
    assert set(ours_mlp.state_dict()) == set(hf.state_dict())
    x = torch.randn(3, 9, 64, device=device, dtype=dtype)
    want = HFLlamaMLP.forward(hf.to(torch.float64), x.double())
    hf.to(dtype)
    assert rel_err(ours_mlp(x), want) < 2 * TOL[dtype]  # two bf16 matmuls either side
    shared = lk.LlamaMLP.from_module(hf)
    assert shared.gate_proj is hf.gate_proj
    torch.testing.assert_close(shared(x), ours_mlp(x))


class HFPhi3MLP(nn.Module):
    """Hugging Face's Phi3MLP (GLM-4's MLP is the same), as written in transformers."""

    def __init__(self, hidden, inter, act):
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden, 2 * inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)
        self.activation_fn = act

    def forward(self, x):
        up_states = self.gate_up_proj(x)
        gate, up_states = up_states.chunk(2, dim=-1)
        return self.down_proj(up_states * self.activation_fn(gate))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("activation, act", [("silu", nn.SiLU()), ("gelu", nn.GELU()),
                                             ("gelu_tanh", nn.GELU(approximate="tanh"))])
def test_gate_up_mlp_drop_in(device, dtype, activation, act):
    hf = HFPhi3MLP(64, 96, act).to(device, dtype)
    ours_mlp = lk.GateUpMLP(64, 96, activation).to(device, dtype)
    ours_mlp.load_state_dict(hf.state_dict())
    assert set(ours_mlp.state_dict()) == set(hf.state_dict())
    x = torch.randn(3, 7, 64, device=device, dtype=dtype)
    want = HFPhi3MLP.forward(hf.to(torch.float64), x.double())
    hf.to(dtype)
    assert rel_err(ours_mlp(x), want) < 2 * TOL[dtype]
    shared = lk.GateUpMLP.from_module(hf, activation)
    assert shared.gate_up_proj is hf.gate_up_proj and shared.intermediate_size == 96
    torch.testing.assert_close(shared(x), ours_mlp(x))


def test_gate_up_mlp_decode_shape_runs_one_gemm(device, monkeypatch):
    """With fuse_decode (kernelize's fuse=True), <= 16 rows take one skinny GEMM with the SwiGLU
    epilogue over the [gate; up] weight (on the CPU with fuse.CPU_FUSED), same values."""
    from llm_kernels import decode, fuse

    monkeypatch.setattr(fuse, "CPU_FUSED", True)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    mlp = lk.GateUpMLP(64, 96).to(device, dtype)
    x = torch.randn(1, 3, 64, device=device, dtype=dtype)
    with torch.no_grad():
        plain = mlp(x)
        calls = []
        real = decode._ops.skinny_gemm

        class Counting:
            def __getattr__(self, name):
                return getattr(decode._ops, name)

            def skinny_gemm(self, *args, **kwargs):
                calls.append(args[3])
                return real(*args, **kwargs)

        monkeypatch.setattr(fuse.decode, "_ops", Counting())
        mlp.fuse_decode = True
        fused = mlp(x)
    assert calls == ["swiglu"]
    assert rel_err(fused, plain) < (1e-5 if dtype == torch.float32 else 2e-2)
    with pytest.raises(ValueError, match="activation: expected"):
        lk.GateUpMLP(64, 96, "relu")


def test_geglu_module_state_dict_and_convention(device):
    ours_geglu = lk.GEGLU(32, 48).to(device)
    assert set(ours_geglu.state_dict()) == {"proj.weight", "proj.bias"}
    x = torch.randn(5, 32, device=device)
    h = ours_geglu.proj(x)
    # our convention (vLLM, FlashInfer): the FIRST half is gated
    torch.testing.assert_close(ours_geglu(x), F.gelu(h[:, :48]) * h[:, 48:])


def test_bad_inputs(device):
    g = torch.randn(4, 64, device=device, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"llmk::gated_activation: up: expected shape \(4, 64\) \(the shape of gate\), got \(4, 63\)"):
        lk.swiglu(g, g[:, :63])
    with pytest.raises(TypeError, match=r"llmk::gated_activation: up: expected dtype bfloat16 \(the dtype of gate\), got float16"):
        lk.swiglu(g, g.half())
    with pytest.raises(TypeError, match=r"llmk::gated_activation: gate: expected dtype float32, float16 or bfloat16, got int32"):
        lk.swiglu(g.int(), g.int())
    with pytest.raises(ValueError, match=r"llmk::gated_activation_packed: x: expected a last dim of even size"):
        lk.silu_and_mul(torch.randn(3, 7, device=device))
    with pytest.raises(ValueError, match=r"approximate: expected 'none' or 'tanh', got 'fast'"):
        lk.geglu(g, g, approximate="fast")
    with pytest.raises(ValueError, match=r"activation: expected 'silu', 'gelu' or 'gelu_tanh', got 'relu'"):
        torch.ops.llm_kernels.gated_activation(g, g, "relu")


@pytest.mark.skipif(not HAS_GPU, reason="no GPU on this machine: GPU case not run")
def test_device_mismatch():
    g = torch.randn(4, 64, device="cuda")
    with pytest.raises(RuntimeError, match=r"llmk::gated_activation: up: expected device gpu:0 \(the device of gate\), got cpu"):
        lk.swiglu(g, torch.randn(4, 64))


def test_silu_cpu_extremes_match_float64():
    """The CPU kernel's own exp (activation_cpu.cpp, vectorised): relative error against float64
    over the whole float range of the gate, and torch's answers at +-inf and NaN."""
    gate = torch.cat([torch.linspace(-120, 120, 200001), torch.tensor([-86.61, -86.59, 88.72, 88.73])])
    gate = torch.cat([gate, -gate.flip(0)])
    up = torch.rand_like(gate) + 0.5
    out, ref = lk.swiglu(gate, up), ref64(gate, up, "silu", None)
    err = (out.double() - ref).abs()
    big = ref.abs() > 1e-36  # below: g < -88.7, where e^-g overflows and the kernel returns -0
    assert (err[big] / ref.abs()[big]).max() < 4 * torch.finfo(torch.float32).eps
    assert err[~big].max() < 1e-36
    special = torch.tensor([float("inf"), -float("inf"), float("nan")])
    torch.testing.assert_close(lk.swiglu(special, torch.ones(3)), F.silu(special), equal_nan=True)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_cpu_extremes_match_float64(approximate):
    """The CPU kernel's own erfc and exp (core/vector_math.h, vectorised) against float64, element by
    element over the gate's useful range. The bounds grow with the inputs' condition numbers: the
    erf form rounds -g/sqrt(2) to float first (as libm's erfcf path does), and erfc's relative
    condition number at z is ~2 z^2 = g^2; the tanh form's sigmoid(w), w = 2 sqrt(2/pi) (g +
    0.044715 g^3), has ~|w| for negative w, and w is rounded too."""
    gate = torch.cat([torch.linspace(-20, 20, 400001), torch.tensor([-13.2, -9.0, -1e-30, 1e-30, 0.0])])
    up = torch.rand_like(gate) + 0.5
    out, ref = lk.geglu(gate, up, approximate), ref64(gate, up, "gelu", approximate)
    err = (out.double() - ref).abs()
    eps = torch.finfo(torch.float32).eps
    big = ref.abs() > 1e-36  # below: the gate is so negative that the value underflows float
    g = gate.double()
    w = 2 * (2 / torch.pi) ** 0.5 * (g + 0.044715 * g**3)
    bound = 4 * eps * (1 + (g**2 if approximate == "none" else w.abs()))
    assert (err[big] / ref.abs()[big] <= bound[big]).all()
    assert err[~big].max() < 1e-36
    # +-inf and NaN as the float64 formula gives them (gelu(inf) = inf, where F.gelu's erf form says NaN)
    special = torch.tensor([float("inf"), -float("inf"), float("nan")])
    torch.testing.assert_close(lk.geglu(special, torch.ones(3), approximate).double(),
                               ref64(special, torch.ones(3), "gelu", approximate), equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_results_do_not_depend_on_threads(dtype):
    """The CPU kernels split rows over torch's threads; each row's arithmetic stays the same."""
    gate, up = torch.randn(67, 4099, dtype=dtype) * 3, torch.randn(67, 4099, dtype=dtype)
    grad = torch.randn(67, 4099, dtype=dtype)

    def run():
        g, u = gate.clone().requires_grad_(), up.clone().requires_grad_()
        out = lk.swiglu(g, u)
        out.backward(grad)
        return out.detach(), g.grad, u.grad

    results = at_thread_counts(run)
    for a, b in zip(*results):
        assert torch.equal(a, b)
