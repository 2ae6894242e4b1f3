"""flash_attn-compatible functions: results vs float64 attention, and clear errors for the rest."""

import re

import pytest
import torch

from llm_kernels import flash, flash_attn_interface as fai
from llm_kernels.flash import attention_ref

from conftest import rel_err


@pytest.mark.parametrize("causal", [False, True])
def test_flash_attn_func_bottom_right(causal):
    q, k, v = torch.randn(2, 9, 8, 64), torch.randn(2, 13, 2, 64), torch.randn(2, 13, 2, 64)
    out = fai.flash_attn_func(q, k, v, causal=causal, softmax_scale=0.2)
    ref, _ = attention_ref(*(t.transpose(1, 2).double() for t in (q, k, v)), causal=causal, scale=0.2, causal_align="bottom_right")
    assert out.shape == q.shape and rel_err(out.transpose(1, 2), ref) < 1e-5


@pytest.mark.parametrize("sq,sk,causal", [(9, 13, True), (13, 9, True), (9, 9, True), (9, 13, False)])
def test_pytorch_route_keeps_flash_attn_semantics(sq, sk, causal):
    """The SDPA route (what AMD GPUs get): bottom-right causal masks, GQA, and zeros for rows that
    see no key (the first Sq - Sk rows when Sq > Sk), as flash_attn gives."""
    q, k, v = torch.randn(2, sq, 8, 64), torch.randn(2, sk, 2, 64), torch.randn(2, sk, 2, 64)
    out = fai._pytorch_sdpa_bshd(q, k, v, causal, 0.2)
    ref, _ = attention_ref(*(t.transpose(1, 2).double() for t in (q, k, v)), causal=causal, scale=0.2, causal_align="bottom_right")
    assert out.shape == q.shape and rel_err(out.transpose(1, 2), ref) < 1e-5
    if causal and sq > sk:
        assert torch.equal(out[:, : sq - sk], torch.zeros_like(out[:, : sq - sk]))


def test_flash_attn_varlen_func_matches_per_sequence():
    lens_q, lens_k = [3, 0, 7, 1], [5, 2, 7, 9]
    cu_q = torch.tensor([0] + torch.tensor(lens_q).cumsum(0).tolist(), dtype=torch.int32)
    cu_k = torch.tensor([0] + torch.tensor(lens_k).cumsum(0).tolist(), dtype=torch.int32)
    q, k, v = torch.randn(sum(lens_q), 4, 64), torch.randn(sum(lens_k), 2, 64), torch.randn(sum(lens_k), 2, 64)
    out = fai.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=True)
    for i in range(4):
        if lens_q[i] == 0:
            continue
        qs, ks = slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])
        ref, _ = attention_ref(q[None, qs].transpose(1, 2).double(), k[None, ks].transpose(1, 2).double(),
                               v[None, ks].transpose(1, 2).double(), causal=True, causal_align="bottom_right")
        assert rel_err(out[qs], ref[0].transpose(0, 1)) < 1e-5


@pytest.mark.parametrize("kwargs,name", [
    (dict(dropout_p=0.1), "dropout_p=0.1"),
    (dict(window_size=(128, 0)), "window_size=(128, 0)"),
    (dict(alibi_slopes=torch.ones(4)), "alibi_slopes"),
    (dict(softcap=30.0), "softcap=30.0"),
    (dict(return_attn_probs=True), "return_attn_probs=True"),
])
def test_unsupported_arguments_raise(kwargs, name):
    q = torch.randn(1, 4, 4, 64)
    with pytest.raises(NotImplementedError, match=re.escape(f"flash_attn_interface: {name}")):
        fai.flash_attn_func(q, q, q, **kwargs)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU on this machine: GPU case not run")
def test_gpu_portable_cases_go_to_pytorch(monkeypatch):
    """With our GPU kernel the portable one (LLMK_ATTENTION_PORTABLE=1 stands in for an AMD GPU),
    flash_attn_func returns the SDPA route's result bit for bit; with use_portable, ours."""
    q = torch.randn(1, 77, 8, 64, device="cuda", dtype=torch.float16)
    k, v = (torch.randn(1, 50, 2, 64, device="cuda", dtype=torch.float16) for _ in range(2))
    monkeypatch.setenv("LLMK_ATTENTION_PORTABLE", "1")
    route = fai._pytorch_sdpa_bshd(q, k, v, True, None)
    assert torch.equal(fai.flash_attn_func(q, k, v, causal=True), route)
    monkeypatch.setattr(flash, "use_portable", True)
    ours = fai.flash_attn_func(q, k, v, causal=True)
    ref, _ = attention_ref(*(t.transpose(1, 2).double() for t in (q, k, v)), causal=True, causal_align="bottom_right")
    assert rel_err(ours.transpose(1, 2), ref) < 2e-3 and rel_err(route.transpose(1, 2), ref) < 2e-3


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU on this machine: GPU case not run")
def test_varlen_on_gpu_matches_per_sequence():
    lens_q, lens_k = [3, 0, 130, 77], [5, 2, 200, 77]
    cu_q = torch.tensor([0] + torch.tensor(lens_q).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0] + torch.tensor(lens_k).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    q = torch.randn(sum(lens_q), 8, 128, device="cuda", dtype=torch.float16)
    k, v = (torch.randn(sum(lens_k), 2, 128, device="cuda", dtype=torch.float16) for _ in range(2))
    out = fai.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=True)
    bq, bk = cu_q.tolist(), cu_k.tolist()
    for i in range(4):
        if lens_q[i] == 0:
            continue
        qs, ks = slice(bq[i], bq[i + 1]), slice(bk[i], bk[i + 1])
        ref, _ = attention_ref(q[None, qs].transpose(1, 2).double(), k[None, ks].transpose(1, 2).double(),
                               v[None, ks].transpose(1, 2).double(), causal=True, causal_align="bottom_right")
        assert rel_err(out[qs], ref[0].transpose(0, 1)) < 2e-3
