"""Attention (CPU kernel so far) vs float64, and the SDPA drop-in's fallbacks."""

import pytest
import torch
import torch.nn.functional as F

import llm_kernels as lk
from llm_kernels import flash as A

from conftest import HAS_GPU, TOL, rel_err


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("causal,align", [(False, "top_left"), (True, "top_left"), (True, "bottom_right")])
@pytest.mark.parametrize("sq,skv,hq,hkv,d", [(1, 77, 4, 4, 64), (77, 77, 8, 2, 80), (33, 1, 4, 1, 96), (5, 333, 32, 1, 128), (13, 40, 8, 8, 256)])
def test_matches_float64(dtype, causal, align, sq, skv, hq, hkv, d):
    q = torch.randn(2, hq, sq, d, dtype=dtype)
    k, v = torch.randn(2, hkv, skv, d, dtype=dtype), torch.randn(2, hkv, skv, d, dtype=dtype)
    out, lse = lk.attention(q, k, v, causal=causal, causal_align=align, return_lse=True)
    ref, ref_lse = A.attention_ref(q, k, v, causal=causal, causal_align=align)
    ref64, _ = A.attention_ref(q.double(), k.double(), v.double(), causal=causal, causal_align=align)
    assert out.shape == q.shape and out.dtype == dtype
    assert rel_err(out, ref64) < TOL[dtype]
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    assert (lse.double()[finite] - ref_lse[finite]).abs().max() < 1e-4


def test_bshd_layout_large_logits_and_empty_rows():
    q, k, v = torch.randn(1, 9, 4, 64) * 100, torch.randn(1, 5, 2, 64) * 100, torch.randn(1, 5, 2, 64)
    out = lk.attention(q, k, v, layout="bshd")  # logits ~1e4: no overflow
    ref, _ = A.attention_ref(q.transpose(1, 2).double(), k.transpose(1, 2).double(), v.transpose(1, 2).double())
    assert torch.isfinite(out).all() and rel_err(out.transpose(1, 2), ref) < 1e-5
    # bottom-right causal with more queries than keys: the first 4 queries see nothing
    out, lse = lk.attention(q, k, v, causal=True, causal_align="bottom_right", layout="bshd", return_lse=True)
    assert torch.equal(out[:, :4], torch.zeros_like(out[:, :4])) and torch.isinf(lse[..., :4]).all()


def test_opcheck():
    q, k, v = torch.randn(2, 7, 4, 64), torch.randn(2, 9, 2, 64), torch.randn(2, 9, 2, 64)
    torch.library.opcheck(torch.ops.llm_kernels.attention, (q, k, v, True, None, False))
    torch.library.opcheck(torch.ops.llm_kernels.attention, (q, k, v, False, 0.3, True))


def test_sdpa_fallbacks_return_what_pytorch_returns(monkeypatch):
    q, k, v = torch.randn(2, 4, 9, 64), torch.randn(2, 4, 9, 64), torch.randn(2, 4, 9, 64)
    mask = torch.rand(9, 9) > 0.3
    monkeypatch.setattr(A, "use_on_cpu", True)
    assert A._why_not_ours(q, k, v, mask, 0.0, False, None, False) == "explicit attn_mask"
    assert A._why_not_ours(q, k, v, None, 0.1, False, None, False) == "dropout"
    q72 = torch.randn(2, 4, 9, 72)
    assert A._why_not_ours(q72, q72, q72, None, 0.0, False, None, False) == "head dim"
    qg = q.clone().requires_grad_()
    assert A._why_not_ours(qg, k, v, None, 0.0, False, None, False) == "needs a gradient (no backward yet)"
    k2 = torch.randn(2, 2, 9, 64)
    assert A._why_not_ours(q, k2, k2, None, 0.0, False, None, False) == "head counts (GQA needs enable_gqa=True)"
    assert A._why_not_ours(q, k2, k2, None, 0.0, False, None, True) is None
    # each fallback returns exactly PyTorch's answer
    torch.testing.assert_close(lk.sdpa(q, k, v, attn_mask=mask), F.scaled_dot_product_attention(q, k, v, attn_mask=mask), rtol=0, atol=0)
    torch.testing.assert_close(lk.sdpa(q72, q72, q72, is_causal=True), F.scaled_dot_product_attention(q72, q72, q72, is_causal=True), rtol=0, atol=0)
    torch.manual_seed(0)
    a = lk.sdpa(q, k, v, dropout_p=0.5)
    torch.manual_seed(0)
    torch.testing.assert_close(a, F.scaled_dot_product_attention(q, k, v, dropout_p=0.5), rtol=0, atol=0)
    out = lk.sdpa(qg, k, v)
    out.sum().backward()  # the fallback keeps autograd
    assert qg.grad is not None
    # supported: ours, equal to PyTorch within fp32 rounding, GQA too
    torch.testing.assert_close(lk.sdpa(q, k, v, is_causal=True), F.scaled_dot_product_attention(q, k, v, is_causal=True))
    torch.testing.assert_close(lk.sdpa(q, k2, k2, enable_gqa=True), F.scaled_dot_product_attention(q, k2, k2, enable_gqa=True))


def test_sdpa_on_cpu_is_pytorchs_unless_asked():
    q = torch.randn(1, 2, 5, 64)
    assert A._why_not_ours(q, q, q, None, 0.0, False, None, False) == "CPU tensors (llm_kernels.flash.use_on_cpu is off)"


def test_patch_sdpa_context_restores():
    original = F.scaled_dot_product_attention
    with lk.patch_sdpa():
        assert F.scaled_dot_product_attention is lk.sdpa
    assert F.scaled_dot_product_attention is original


def test_bad_inputs():
    q, k = torch.randn(1, 4, 5, 64), torch.randn(1, 3, 5, 64)
    with pytest.raises(ValueError, match=r"llmk::attention: k: expected a head count that divides q's 4 heads, got 3"):
        lk.attention(q, k, k)
    with pytest.raises(TypeError, match=r"llmk::attention: k: expected dtype float32 \(the dtype of q\), got float16"):
        lk.attention(q, q.half(), q.half())
    with pytest.raises(ValueError, match=r"llmk::attention: v: expected shape \(1, 5, 4, 64\) \(the shape of k\), got \(1, 6, 4, 64\)"):
        lk.attention(q, q, torch.randn(1, 4, 6, 64))
    with pytest.raises(ValueError, match=r"causal_align: expected 'top_left' or 'bottom_right'"):
        lk.attention(q, q, q, causal=True, causal_align="diagonal")


@pytest.mark.skipif(not HAS_GPU, reason="no GPU on this machine: GPU case not run")
def test_gpu_not_implemented_yet_and_sdpa_falls_back():
    q = torch.randn(1, 4, 5, 64, device="cuda", dtype=torch.float16)
    with pytest.raises(NotImplementedError, match=r"llmk::attention: q: GPU tensors are not supported yet"):
        lk.attention(q, q, q)
    torch.testing.assert_close(lk.sdpa(q, q, q), F.scaled_dot_product_attention(q, q, q), rtol=0, atol=0)
