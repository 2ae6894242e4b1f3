"""Monarch: the reference product vs the literal definition, the dense equivalent, the optimal
projection, MonarchLinear, monarchize, bad input. (The fused GPU kernel is not written yet.)"""

import math

import pytest
import torch
from torch import nn

from llm_kernels import monarch as M

# (k, q, p, l, s, r): square sqrt(n) blocks, square with fewer blocks, rectangular
SHAPES = [(4, 4, 4, 4, 4, 4), (2, 8, 8, 2, 8, 8), (4, 8, 6, 8, 5, 4), (3, 2, 5, 2, 7, 3)]


def literal(x, w1, w2):
    """The definition, index by index (float64)."""
    k, q, p = w1.shape
    l, s, r = w2.shape
    X = x.reshape(-1, k, p)
    y = torch.einsum("ica,bia->bic", w1, X).reshape(-1, k * q)
    Z = torch.stack([torch.stack([y[:, t * l + u] for t in range(r)], -1) for u in range(l)], 1)  # (B, l, r)
    O = torch.einsum("uvt,but->buv", w2, Z)
    out = torch.empty(x.shape[0], l * s, dtype=x.dtype)
    for u in range(l):
        for v in range(s):
            out[:, v * l + u] = O[:, u, v]
    return out


@pytest.mark.parametrize("k,q,p,l,s,r", SHAPES)
def test_reference_matches_definition_and_dense(k, q, p, l, s, r):
    w1, w2 = torch.randn(k, q, p, dtype=torch.float64), torch.randn(l, s, r, dtype=torch.float64)
    x = torch.randn(5, k * p, dtype=torch.float64)
    out = M.monarch_matmul_ref(x, w1, w2)
    torch.testing.assert_close(out, literal(x, w1, w2), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out, x @ M.monarch_to_dense(w1, w2).T, rtol=1e-12, atol=1e-12)
    x3 = torch.randn(2, 3, k * p, dtype=torch.float64)  # leading dims
    torch.testing.assert_close(M.monarch_matmul_ref(x3, w1, w2).reshape(6, -1), literal(x3.reshape(6, -1), w1, w2))


@pytest.mark.parametrize("k,q,p,l,s,r", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_projection_recovers_exact_monarch(k, q, p, l, s, r, dtype):
    w1, w2 = torch.randn(k, q, p, dtype=dtype), torch.randn(l, s, r, dtype=dtype)
    W = M.monarch_to_dense(w1, w2)
    proj = M.project_to_monarch(W, k, q, l, s, r, p)
    assert proj.relative_error < 1e-5
    assert (M.monarch_to_dense(proj.w1, proj.w2) - W).norm() / W.norm() < 1e-5


@pytest.mark.parametrize("k,q,p,l,s,r", SHAPES)
def test_projection_error_is_exactly_the_discarded_singular_values(k, q, p, l, s, r):
    W = torch.randn(l * s, k * p, dtype=torch.float64)
    proj = M.project_to_monarch(W, k, q, l, s, r, p)
    # independent count: per block (u, i), keep as many singular values as y indices couple them
    discarded = 0.0
    for u in range(l):
        for i in range(k):
            rank = sum(1 for j in range(k * q) if j % l == u and j // q == i)
            block = W.reshape(s, l, k, p)[:, u, i, :]
            sv = torch.linalg.svdvals(block)
            discarded += float((sv[rank:] ** 2).sum())
    assert proj.relative_error == pytest.approx(math.sqrt(discarded) / float(W.norm()), rel=1e-9)
    # and no other factors do better: a random perturbation of the optimum is worse
    w1 = proj.w1 + 1e-3 * torch.randn_like(proj.w1)
    assert (W - M.monarch_to_dense(w1, proj.w2)).norm() / W.norm() > proj.relative_error


@pytest.mark.parametrize("in_f,out_f,nblocks", [(64, 64, 8), (100, 70, 8), (48, 96, 4), (33, 17, 5)])
def test_monarch_linear(in_f, out_f, nblocks):
    layer = M.MonarchLinear(in_f, out_f, nblocks).double()
    assert set(layer.state_dict()) == {"blkdiag1", "blkdiag2", "bias"}
    x = torch.randn(3, 7, in_f, dtype=torch.float64, requires_grad=True)
    y = layer(x)
    assert y.shape == (3, 7, out_f)
    torch.testing.assert_close(y, x @ layer.to_dense().T + layer.bias)
    y.sum().backward()
    assert x.grad is not None and layer.blkdiag1.grad is not None
    # kaiming-uniform per block: every entry inside sqrt(3) * gain / sqrt(fan_in)
    for w in (layer.blkdiag1, layer.blkdiag2):
        bound = math.sqrt(3.0) * nn.init.calculate_gain("leaky_relu", math.sqrt(5)) / math.sqrt(w.shape[-1])
        assert w.abs().max() <= bound and w.std() > bound / 4


def test_from_dense_and_monarchize():
    torch.manual_seed(0)
    src = M.MonarchLinear(64, 64, 8).double()
    dense = nn.Linear(64, 64).double()
    with torch.no_grad():
        dense.weight.copy_(src.to_dense())
    layer, err = M.MonarchLinear.from_dense(dense, 8)
    assert err < 1e-10
    x = torch.randn(4, 64, dtype=torch.float64)
    torch.testing.assert_close(layer(x), dense(x))

    model = nn.ModuleDict({"layers": nn.ModuleList([nn.ModuleDict({"q_proj": nn.Linear(64, 64), "up": nn.Linear(64, 128)}) for _ in range(3)])})
    report = M.monarchize(model, ["layers.[12].q_proj"], nblocks=8)
    assert [r.name for r in report] == ["layers.1.q_proj", "layers.2.q_proj"]
    assert isinstance(model["layers"][1]["q_proj"], M.MonarchLinear)
    assert isinstance(model["layers"][0]["q_proj"], nn.Linear) and isinstance(model["layers"][1]["up"], nn.Linear)
    assert all(r.params_after < r.params_before and 0 < r.relative_error < 1 for r in report)


def test_bad_factor_shapes():
    x = torch.randn(2, 16)
    with pytest.raises(ValueError, match=r"x: expected a last dim of k\*p = 12"):
        M.monarch_matmul_ref(x, torch.randn(4, 4, 3), torch.randn(4, 4, 4))
    with pytest.raises(ValueError, match=r"w2: expected l\*r = k\*q = 16"):
        M.monarch_matmul_ref(x, torch.randn(4, 4, 4), torch.randn(4, 4, 3))
    with pytest.raises(ValueError, match=r"expected 3 dims"):
        M.monarch_matmul_ref(x, torch.randn(16, 16), torch.randn(4, 4, 4))
    with pytest.raises(ValueError, match=r"expected weight \(l\*s, k\*p\)"):
        M.project_to_monarch(torch.randn(10, 16), 4, 4, 4, 4, 4, 4)


def test_save_and_load_factors(tmp_path):
    pytest.importorskip("safetensors")

    def make():
        torch.manual_seed(1)
        return nn.Sequential(nn.Linear(48, 48), nn.ReLU(), nn.Linear(48, 40))

    model = make()
    M.monarchize(model, ["0", "2"], nblocks=4)
    path = str(tmp_path / "factors.safetensors")
    M.save_monarch(model, path)
    fresh = make()
    assert M.load_monarch(fresh, path) == ["0", "2"]
    x = torch.randn(5, 48)
    torch.testing.assert_close(fresh(x), model(x))
    with pytest.raises(ValueError, match=r"load_monarch: 0: expected nn.Linear\(48, 48\)"):
        M.load_monarch(nn.Sequential(nn.Linear(48, 40)), path)
