"""RoPE: values vs float64, Hugging Face equivalence, layouts, GQA, partial rotary, in place,
gradients, opcheck, torch.compile, bad input."""

import pytest
import torch

import llm_kernels as lk
from llm_kernels import reference

from conftest import TOL, rel_err

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def angles(positions, rot_dim, dtype=torch.float32, base=10000.0):
    inv = 1.0 / (base ** (torch.arange(0, rot_dim, 2, dtype=torch.float64, device=positions.device) / rot_dim))
    f = positions.to(torch.float64)[..., None] * inv
    return f.cos().to(dtype), f.sin().to(dtype)


def cache(max_pos, rot_dim, device, dtype=torch.float32):
    c, s = angles(torch.arange(max_pos, device=device), rot_dim)
    return torch.cat([c, s], -1).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("style", ["neox", "gptj"])
@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
@pytest.mark.parametrize("hq,hk,d,rot", [(4, 4, 64, 64), (8, 2, 128, 64), (6, 1, 80, 80), (4, 2, 96, 32), (2, 2, 256, 256)])
def test_cache_form_matches_float64(device, dtype, style, layout, hq, hk, d, rot):
    B, S = 2, 13
    shape = lambda h: (B, S, h, d) if layout == "bshd" else (B, h, S, d)  # noqa: E731
    q, k = torch.randn(shape(hq), device=device, dtype=dtype), torch.randn(shape(hk), device=device, dtype=dtype)
    cs = cache(64, rot, device)
    positions = torch.randint(0, 64, (B, S), device=device)
    qo, ko = lk.rope(q, k, cos_sin_cache=cs, positions=positions, style=style, layout=layout)
    assert qo.shape == q.shape and qo.stride() == q.contiguous().stride()
    to_bshd = (lambda t: t) if layout == "bshd" else (lambda t: t.transpose(1, 2))
    rq, rk = reference.rope_cache_ref(to_bshd(q).double(), to_bshd(k).double(), cs.double(), positions, style)
    assert rel_err(to_bshd(qo), rq) < TOL[dtype]
    assert rel_err(to_bshd(ko), rk) < TOL[dtype]
    # in place gives the same values
    q2, k2 = q.clone(), k.clone()
    out = lk.rope(q2, k2, cos_sin_cache=cs, positions=positions, style=style, layout=layout, in_place=True)
    assert out[0] is q2 and torch.equal(q2, qo) and torch.equal(k2, ko)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("unsqueeze_dim", [1, 2])
def test_hf_apply_rotary_pos_emb_drop_in(device, dtype, unsqueeze_dim):
    B, S, hq, hk, D = 2, 9, 8, 2, 128
    shape = lambda h: (B, h, S, D) if unsqueeze_dim == 1 else (B, S, h, D)  # noqa: E731
    q, k = torch.randn(shape(hq), device=device, dtype=dtype), torch.randn(shape(hk), device=device, dtype=dtype)
    pos = torch.arange(S, device=device)[None].expand(B, S) + torch.tensor([[0], [5]], device=device)
    c, s = angles(pos, D)
    cos, sin = torch.cat([c, c], -1).to(dtype), torch.cat([s, s], -1).to(dtype)  # as HF makes them
    ours = lk.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)
    hf = reference.hf_apply_rotary_pos_emb(q.double(), k.double(), cos.double(), sin.double(), unsqueeze_dim=unsqueeze_dim)
    assert rel_err(ours[0], hf[0]) < TOL[dtype] and rel_err(ours[1], hf[1]) < TOL[dtype]
    hf_same_dtype = reference.hf_apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)
    assert rel_err(hf_same_dtype[0], hf[0]) < 2 * TOL[dtype]  # HF rounds in between; we do not


def _glm_form(q, k, cos, sin, unsqueeze_dim):
    """GLM's apply_rotary_pos_emb as transformers writes it: the first half of HF's duplicated
    tables repeated per pair, interleaved pairs rotated, dims past cos's width passed through."""
    cos = cos.unsqueeze(unsqueeze_dim)[..., : cos.shape[-1] // 2].repeat_interleave(2, -1)
    sin = sin.unsqueeze(unsqueeze_dim)[..., : sin.shape[-1] // 2].repeat_interleave(2, -1)
    rot = cos.shape[-1]

    def one(x):
        xr, xp = x[..., :rot], x[..., rot:]
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        turned = torch.stack((-x2, x1), -1).flatten(-2)
        return torch.cat((xr * cos + turned * sin, xp), -1)
    return one(q), one(k)


def _cohere_form(q, k, cos, sin, unsqueeze_dim):
    """Cohere's: cos / sin repeated per pair by its rotary embedding, interleaved pairs rotated."""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)

    def one(x):
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return x * cos + torch.stack((-x2, x1), -1).flatten(-2) * sin
    return one(q), one(k)


def _gpt_oss_form(q, k, cos, sin, unsqueeze_dim):
    """gpt-oss's: one cos / sin per pair (D / 2 wide), rotate-half pairs."""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)

    def one(x):
        a, b = x.chunk(2, -1)
        return torch.cat((a * cos - b * sin, b * cos + a * sin), -1)
    return one(q), one(k)


# (ours, the form as its modeling file writes it, its tables from the per-pair angles (c, s), rot dims)
HF_FORMS = {
    "glm": (lambda: __import__("llm_kernels").ops.apply_rotary_pos_emb_interleaved, _glm_form,
            lambda t: torch.cat([t, t], -1), (128, 64)),
    "cohere": (lambda: __import__("llm_kernels").ops.apply_rotary_pos_emb_interleaved_pairs, _cohere_form,
               lambda t: t.repeat_interleave(2, -1), (128,)),
    "gpt_oss": (lambda: __import__("llm_kernels").ops.apply_rotary_pos_emb_halfwidth, _gpt_oss_form,
                lambda t: t, (128,)),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("unsqueeze_dim", [1, 2])
@pytest.mark.parametrize("form", HF_FORMS)
def test_hf_rope_forms_of_other_families(device, dtype, unsqueeze_dim, form):
    """The interleaved (GLM, partial rotary too), pair-repeated (Cohere) and half-width (gpt-oss)
    forms kernelize swaps in, against each family's own formula in float64."""
    ours, theirs, tables, rots = HF_FORMS[form]
    B, S, hq, hk, D = 2, 9, 8, 2, 128
    shape = lambda h: (B, h, S, D) if unsqueeze_dim == 1 else (B, S, h, D)  # noqa: E731
    q, k = torch.randn(shape(hq), device=device, dtype=dtype), torch.randn(shape(hk), device=device, dtype=dtype)
    pos = torch.arange(S, device=device)[None].expand(B, S) + torch.tensor([[0], [5]], device=device)
    for rot in rots:
        c, s = angles(pos, rot)
        cos, sin = tables(c).to(dtype), tables(s).to(dtype)
        got = ours()(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)
        want = theirs(q.double(), k.double(), cos.double(), sin.double(), unsqueeze_dim)
        assert rel_err(got[0], want[0]) < TOL[dtype] and rel_err(got[1], want[1]) < TOL[dtype], rot
    with pytest.raises(ValueError, match="unsqueeze_dim: expected 1 or 2"):
        ours()(q, k, cos, sin, unsqueeze_dim=3)


def test_decode_and_per_token_broadcast(device):
    # 32 sequences, one new token each at different positions; cos/sin given per token as (B, 1, r/2)
    B, D = 32, 128
    q, k = torch.randn(B, 1, 32, D, device=device), torch.randn(B, 1, 8, D, device=device)
    pos = torch.randint(0, 4096, (B, 1), device=device)
    c, s = angles(pos, D)
    qo, ko = lk.rope(q, k, cos=c, sin=s)
    rq, rk = reference.rope_ref(q.double(), k.double(), c.double(), s.double())
    assert rel_err(qo, rq) < 1e-5 and rel_err(ko, rk) < 1e-5
    # (S, r/2) angles shared by the batch, and 1-D positions
    c1, s1 = angles(torch.arange(7, device=device), 64)
    q7, k7 = torch.randn(3, 7, 2, 64, device=device), torch.randn(3, 7, 2, 64, device=device)
    a = lk.rope(q7, k7, cos=c1, sin=s1)
    b = lk.rope(q7, k7, cos_sin_cache=cache(7, 64, device), positions=torch.arange(7, device=device))
    torch.testing.assert_close(a[0], b[0])
    torch.testing.assert_close(a[1], b[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("style", ["neox", "gptj"])
def test_gradients_vs_float64_autograd(device, dtype, style):
    B, S, D, rot = 2, 5, 64, 32
    q = torch.randn(B, S, 4, D, device=device, dtype=dtype, requires_grad=True)
    k = torch.randn(B, S, 2, D, device=device, dtype=dtype, requires_grad=True)
    cs = cache(16, rot, device)
    pos = torch.randint(0, 16, (B, S), device=device)
    qo, ko = lk.rope(q, k, cos_sin_cache=cs, positions=pos, style=style)
    gq, gk = torch.randn_like(qo), torch.randn_like(ko)
    torch.autograd.backward([qo, ko], [gq, gk])
    q64, k64 = q.detach().double().requires_grad_(), k.detach().double().requires_grad_()
    rq, rk = reference.rope_cache_ref(q64, k64, cs.double(), pos, style)
    torch.autograd.backward([rq, rk], [gq.double(), gk.double()])
    assert rel_err(q.grad, q64.grad) < TOL[dtype] and rel_err(k.grad, k64.grad) < TOL[dtype]
    # only q used downstream: k's gradient is zero, not an error
    q.grad = k.grad = None
    qo, _ = lk.rope(q, k, cos_sin_cache=cs, positions=pos, style=style)
    qo.sum().backward()
    assert torch.count_nonzero(k.grad) == 0


def test_opcheck(device):
    ops = torch.ops.llm_kernels
    q = torch.randn(2, 3, 4, 64, device=device, requires_grad=True)
    k = torch.randn(2, 3, 2, 64, device=device, requires_grad=True)
    cs = cache(8, 32, device)
    pos = torch.randint(0, 8, (2, 3), device=device)
    c, s = angles(pos, 64)
    torch.library.opcheck(ops.rope_cached, (q, k, cs, pos, "neox", False))
    torch.library.opcheck(ops.rope_cos_sin, (q, k, c, s, "gptj", False))
    torch.library.opcheck(ops.rope_cached_, (q.detach().clone(), k.detach().clone(), cs, pos, "gptj"))
    torch.library.opcheck(ops.rope_cos_sin_, (q.detach().clone(), k.detach().clone(), c, s, "neox"))


def test_torch_compile_fullgraph(device):
    torch._dynamo.reset()
    cs = cache(32, 64, device)

    def f(q, k, pos):
        qo, ko = lk.rope(q, k, cos_sin_cache=cs, positions=pos, layout="bhsd")
        return qo * 2, ko + 1  # element-wise, so compiled and eager must agree exactly

    q, k = torch.randn(2, 4, 5, 64, device=device), torch.randn(2, 2, 5, 64, device=device)
    pos = torch.randint(0, 32, (2, 5), device=device)
    torch.testing.assert_close(torch.compile(f, fullgraph=True)(q, k, pos), f(q, k, pos), rtol=0, atol=0)


def test_bad_inputs(device):
    q, k = torch.randn(1, 4, 2, 64, device=device), torch.randn(1, 4, 1, 64, device=device)
    cs = cache(8, 64, device)
    if device == "cpu":  # the GPU writes NaN instead (no host synchronisation)
        with pytest.raises(ValueError, match=r"llmk::rope: positions: expected values in \[0, 8\) \(the rows of cos_sin_cache\), got 9 at \(0, 3\)"):
            lk.rope(q, k, cos_sin_cache=cs, positions=torch.tensor([[0, 1, 2, 9]], device=device))
    else:
        qo, _ = lk.rope(q, k, cos_sin_cache=cs, positions=torch.tensor([[0, 1, 2, 9]], device=device))
        assert torch.isnan(qo[0, 3]).all() and not torch.isnan(qo[0, :3]).any()
    with pytest.raises(ValueError, match=r"llmk::rope: cos_sin_cache: expected an even rotary dim between 2 and the head dim 64, got 66"):
        lk.rope(q, k, cos_sin_cache=cache(8, 66, device), positions=torch.zeros(1, 4, dtype=torch.long, device=device))
    with pytest.raises(ValueError, match=r"llmk::rope: k: expected shape \(1, 4, heads, 64\)"):
        lk.rope(q, k[:, :3], cos_sin_cache=cs, positions=torch.zeros(1, 4, dtype=torch.long, device=device))
    with pytest.raises(TypeError, match=r"llmk::rope: positions: expected dtype int64 or int32, got float32"):
        lk.rope(q, k, cos_sin_cache=cs, positions=torch.zeros(1, 4, device=device))
    with pytest.raises(TypeError, match=r"llmk::rope: k: expected dtype float32 \(the dtype of q\), got float16"):
        lk.rope(q, k.half(), cos_sin_cache=cs, positions=torch.zeros(1, 4, dtype=torch.long, device=device))
    with pytest.raises(ValueError, match=r"rope style: expected 'neox' or 'gptj', got 'llama'"):
        lk.rope(q, k, cos_sin_cache=cs, positions=torch.zeros(1, 4, dtype=torch.long, device=device), style="llama")
    with pytest.raises(ValueError, match=r"layout: expected 'bshd' or 'bhsd'"):
        lk.rope(q, k, cos_sin_cache=cs, positions=torch.zeros(1, 4, dtype=torch.long, device=device), layout="sbhd")
    # positions / cos / sin that do not broadcast to (B, S): named, with the shapes expected
    with pytest.raises(ValueError, match=r"llm_kernels.rope: positions: expected shape \(1, 2\) or \(2,\) for q of "
                                         r"\(1, 2, 4, 64\) \(B, S, H, D\), got \(1, 4\)"):
        lk.rope(q, k, cos_sin_cache=cs, positions=torch.zeros(1, 4, dtype=torch.long, device=device), layout="bhsd")
    with pytest.raises(ValueError, match=r"llm_kernels.rope: cos: expected shape \(1, 4, rot_dim / 2\)"):
        lk.rope(q, k, cos=torch.ones(3, 32, device=device), sin=torch.zeros(3, 32, device=device))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_in_place_inside_a_fused_qkv_buffer(device, dtype):
    """q and k as strided views into one (B, S, (Hq + 2 Hk) * D) projection output, rotated in
    place without copies; v and the gaps stay untouched."""
    B, S, hq, hk, D = 2, 11, 8, 2, 64
    qkv = torch.randn(B, S, (hq + 2 * hk) * D, device=device, dtype=dtype)
    before = qkv.clone()
    q = qkv[..., : hq * D].view(B, S, hq, D)
    k = qkv[..., hq * D : (hq + hk) * D].view(B, S, hk, D)
    assert not q.is_contiguous()
    cs = cache(32, D, device)
    pos = torch.randint(0, 32, (B, S), device=device)
    want_q, want_k = reference.rope_cache_ref(q.double(), k.double(), cs.double(), pos)
    lk.rope(q, k, cos_sin_cache=cs, positions=pos, in_place=True)
    assert rel_err(q, want_q) < TOL[dtype] and rel_err(k, want_k) < TOL[dtype]
    assert torch.equal(qkv[..., (hq + hk) * D :], before[..., (hq + hk) * D :])  # v untouched


def test_empty(device):
    q, k = torch.randn(2, 0, 4, 64, device=device), torch.randn(2, 0, 2, 64, device=device)
    cs = cache(8, 64, device)
    qo, ko = lk.rope(q, k, cos_sin_cache=cs, positions=torch.zeros(2, 0, dtype=torch.long, device=device))
    assert qo.shape == q.shape and ko.shape == k.shape


# ------------------------------------------------------------------------------ rope_angles
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("duplicate", [True, False])
@pytest.mark.parametrize("pos_dtype", [torch.int64, torch.int32])
def test_angles_match_float64(device, dtype, duplicate, pos_dtype):
    """cos / sin of the fp32 angle float(pos) * inv_freq (the op's definition), scaled, against
    float64, at positions past any table, odd batch / token / frequency counts."""
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 42, 2, dtype=torch.float32) / 42))  # 21 frequencies
    inv_freq = inv_freq.to(device)
    positions = torch.randint(0, 300000, (3, 7), dtype=pos_dtype, device=device)
    cos, sin = lk.rope_angles(inv_freq, positions, 0.75, dtype, duplicate=duplicate)
    f = 21 * (2 if duplicate else 1)
    assert cos.shape == sin.shape == (3, 7, f) and cos.dtype == sin.dtype == dtype and cos.device.type == device
    angle = (positions.float()[..., None] * inv_freq).double()  # the fp32 product, then float64
    if duplicate:
        angle = torch.cat((angle, angle), -1)
    assert rel_err(cos, angle.cos() * 0.75) < TOL[dtype]
    assert rel_err(sin, angle.sin() * 0.75) < TOL[dtype]
    if duplicate:
        assert torch.equal(cos[..., :21], cos[..., 21:]) and torch.equal(sin[..., :21], sin[..., 21:])


def test_angles_opcheck_compile_and_bad_inputs(device):
    inv_freq = torch.rand(16, device=device)
    positions = torch.randint(0, 100, (2, 5), device=device)
    torch.library.opcheck(torch.ops.llm_kernels.rope_angles, (inv_freq, positions, 1.0, 32, torch.bfloat16))
    torch._dynamo.reset()

    def f(pos):
        cos, sin = lk.rope_angles(inv_freq, pos, 1.0, torch.float32)
        return cos * 2, sin + 1

    torch.testing.assert_close(torch.compile(f, fullgraph=True)(positions), f(positions), rtol=0, atol=0)
    with pytest.raises(TypeError, match=r"llmk::rope_angles: inv_freq: expected dtype float32, got bfloat16"):
        lk.rope_angles(inv_freq.bfloat16(), positions)
    with pytest.raises(TypeError, match=r"llmk::rope_angles: positions: expected dtype int64 or int32, got float32"):
        lk.rope_angles(inv_freq, positions.float())
    with pytest.raises(ValueError, match=r"llmk::rope_angles: inv_freq: expected 1 dims, got 2 dims"):
        lk.rope_angles(inv_freq.view(4, 4), positions)
    with pytest.raises(ValueError, match=r"llm_kernels: rope_angles: positions: expected \(batch, tokens\), got 1 dims"):
        lk.rope_angles(inv_freq, positions[0])
