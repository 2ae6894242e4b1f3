"""Attention (CPU kernel; GPU: the tensor-core and the portable kernel) vs float64, and the SDPA
drop-in's fallbacks."""

import pytest
import torch
import torch.nn.functional as F

import llm_kernels as lk
from llm_kernels import flash as A

from conftest import GPU_REASON, HAS_GPU, TOL, at_thread_counts, poison_allocator, rel_err


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
    # Integer q and k: every q.k is exact in float32 (|q.k| <= 64 * 40 * 40 < 2^24), so the logits
    # (hundreds to thousands after the 1/8 scale, far past exp's float32 range of 88) carry no
    # input rounding and the float32 tolerance applies. Random normal inputs * 100 round each logit
    # by ~1e-2, which moves the softmax by more than 1e-5 whenever two keys' logits come close
    # (CI failed on such a draw: 7.7e-5).
    q = torch.randint(-40, 41, (1, 9, 4, 64)).float()
    k = torch.randint(-40, 41, (1, 5, 2, 64)).float()
    v = torch.randn(1, 5, 2, 64)
    out = lk.attention(q, k, v, layout="bshd")  # logits ~1e2 to 1e3: no overflow
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


PORTABLE_REASON = "the portable FMA kernel (llm_kernels.flash.use_portable is off)"


def test_sdpa_gpu_rule_by_build(monkeypatch):
    """The GPU rule without a GPU: a HIP build's kernel is the portable one, so sdpa hands the call
    to PyTorch unless use_portable is set; a build without a GPU backend always does."""
    q = torch.randn(1, 2, 5, 64)
    monkeypatch.setattr(A, "_GPU_BACKEND", "hip")
    assert A._runs_portable_kernel(q, q, q)
    assert A._gpu_kernel_reason(q, q, q) == PORTABLE_REASON
    monkeypatch.setattr(A, "use_portable", True)
    assert A._gpu_kernel_reason(q, q, q) is None
    monkeypatch.setattr(A, "_GPU_BACKEND", "off")
    assert A._gpu_kernel_reason(q, q, q) == "a build of llm_kernels without a GPU backend"


def test_sdpa_gpu_rule_traces_in_one_graph(monkeypatch):
    """The CUDA build's rule (strides, data pointers) inside torch.compile(fullgraph=True), as a
    kernelized layer traces it: the data pointers are left out there, the strides still count.
    (CPU tensors standing in for GPU ones, with an sm_90 device major.)"""
    monkeypatch.setattr(A, "_GPU_BACKEND", "cuda")
    monkeypatch.setattr(A, "_device_major", lambda device: 9)
    monkeypatch.delenv("LLMK_ATTENTION_PORTABLE", raising=False)
    rule = torch.compile(lambda q: torch.tensor(A._runs_portable_kernel(q, q, q)), fullgraph=True, backend="eager")
    aligned = torch.randn(1, 2, 5, 64)
    assert not rule(aligned).item() and not A._runs_portable_kernel(aligned, aligned, aligned)
    odd_stride = torch.randn(1, 2, 5, 65)[..., :64]
    assert rule(odd_stride).item() and A._runs_portable_kernel(odd_stride, odd_stride, odd_stride)
    torch._dynamo.reset()


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


needs_gpu = pytest.mark.skipif(not HAS_GPU, reason=GPU_REASON)


@pytest.fixture(params=["mma", "mma_long", "portable"])
def gpu_kernel(request, monkeypatch):
    """The GPU kernels: the default (tensor cores on NVIDIA, its tiling chosen by grid size: small
    test shapes take 64-row blocks), the same forced to the 128-row blocks large problems run, and
    the portable one AMD runs."""
    monkeypatch.delenv("LLMK_ATTENTION_MMA_CONFIG", raising=False)
    monkeypatch.delenv("LLMK_ATTENTION_PORTABLE", raising=False)
    monkeypatch.setenv("LLMK_ATTENTION_HOPPER", "0")  # v2 (the wgmma kernel, sm_90's default, has its own tests)
    if request.param == "portable":
        monkeypatch.setenv("LLMK_ATTENTION_PORTABLE", "1")
    if request.param == "mma_long":
        monkeypatch.setenv("LLMK_ATTENTION_MMA_CONFIG", "long")
    return request.param


def _check_gpu(q, k, v, causal=False, align="top_left", scale=None, tol=None):
    poison_allocator("cuda", 2 * q.numel() * q.element_size())
    out, lse = lk.attention(q, k, v, causal=causal, causal_align=align, scale=scale, return_lse=True)
    ref, ref_lse = A.attention_ref(q.double(), k.double(), v.double(), causal=causal, scale=scale, causal_align=align)
    err = rel_err(out, ref)
    max_abs = (out.double() - ref.double()).abs().max().item()
    finite = torch.isfinite(ref_lse)
    lse_err = (lse.double()[finite] - ref_lse[finite]).abs().max().item() if finite.any() else 0.0
    print(f"rel {err:.3g} max_abs {max_abs:.3g} lse_max_abs {lse_err:.3g}")
    assert out.shape == q.shape and out.dtype == q.dtype
    assert err < (tol or TOL[q.dtype]), f"rel {err} max_abs {max_abs}"
    assert torch.equal(torch.isfinite(lse), finite), "rows with no visible key must give lse -inf, others finite"
    assert lse_err < 2e-3 * max(1.0, ref_lse[finite].abs().max().item() / 10) if finite.any() else True
    return out, lse


@needs_gpu
@pytest.mark.parametrize("kernel", ["default", "v2"])
@pytest.mark.parametrize("dtype,causal,d", [(torch.float16, True, 128), (torch.bfloat16, False, 64)])
def test_gpu_32k_tokens_sampled_rows_match_float64(monkeypatch, kernel, dtype, causal, d):
    """Sq = Skv = 32768 (GQA 2:1): rows at the start, middle and end against float64 over all keys."""
    if kernel == "v2":
        monkeypatch.setenv("LLMK_ATTENTION_HOPPER", "0")
    S = 32768
    torch.manual_seed(d)
    q = torch.randn(1, 2, S, d, device="cuda", dtype=dtype)
    k, v = (torch.randn(1, 1, S, d, device="cuda", dtype=dtype) for _ in range(2))
    out, lse = lk.attention(q, k, v, causal=causal, return_lse=True)
    kd, vd = k[0, 0].double(), v[0, 0].double()
    for r0 in (0, S // 2 - 31, S - 64):
        rows = torch.arange(r0, r0 + 64, device="cuda")
        s = q[0, :, r0:r0 + 64].double() @ kd.T / d**0.5  # (2, 64, S)
        if causal:
            s = s.masked_fill(torch.arange(S, device="cuda")[None, None, :] > rows[None, :, None], float("-inf"))
        ref_lse = torch.logsumexp(s, -1)
        ref = torch.softmax(s, -1) @ vd
        assert rel_err(out[0, :, r0:r0 + 64], ref) < TOL[dtype], r0
        assert (lse[0, :, r0:r0 + 64].double() - ref_lse).abs().max().item() < 2e-3 * max(1.0, ref_lse.abs().max().item() / 10)


GRID_KERNELS = {  # every tensor-core kernel that orders its grid by sections (grid_block)
    "v2": {"LLMK_ATTENTION_HOPPER": "0"}, "v2_long": {"LLMK_ATTENTION_HOPPER": "0", "LLMK_ATTENTION_MMA_CONFIG": "long"},
    "hopper_plain": {"LLMK_ATTENTION_HOPPER_CONFIG": "plain"}, "hopper_pipe": {"LLMK_ATTENTION_HOPPER_CONFIG": "pipe"},
    "hopper_ws": {"LLMK_ATTENTION_HOPPER_CONFIG": "ws"}, "hopper_ws_pp": {"LLMK_ATTENTION_HOPPER_CONFIG": "ws_pp"},
    "hopper_ws3": {"LLMK_ATTENTION_HOPPER_CONFIG": "ws3"}, "hopper_ws_pp3": {"LLMK_ATTENTION_HOPPER_CONFIG": "ws_pp3"},
    "hopper_ws_pp160": {"LLMK_ATTENTION_HOPPER_CONFIG": "ws_pp160"},
    "hopper_ws_pp176": {"LLMK_ATTENTION_HOPPER_CONFIG": "ws_pp176"},
}


@needs_gpu
@pytest.mark.parametrize("grid", ["head", "3", "tile"])
@pytest.mark.parametrize("kernel", list(GRID_KERNELS))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128])
def test_gpu_grid_sections_match_float64(monkeypatch, grid, kernel, causal, d):
    # LLMK_ATTENTION_GRID forces the grid's section width (the default sizes it by L2, one section
    # at these sizes): one head per section, 3 (not a divisor of the 2 x 8 heads, nor of the GQA
    # group of 4: the last section is narrower), one section. Hopper tilings on other GPUs fall back.
    for name in ("LLMK_ATTENTION_PORTABLE", "LLMK_ATTENTION_MMA_CONFIG", "LLMK_ATTENTION_HOPPER",
                 "LLMK_ATTENTION_HOPPER_CONFIG"):
        monkeypatch.delenv(name, raising=False)
    for name, value in GRID_KERNELS[kernel].items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("LLMK_ATTENTION_GRID", grid)
    torch.manual_seed(d + causal)
    q = torch.randn(2, 8, 333, d, device="cuda", dtype=torch.float16)
    k, v = (torch.randn(2, 2, 400, d, device="cuda", dtype=torch.float16) for _ in range(2))
    _check_gpu(q, k, v, causal, "bottom_right" if causal else "top_left")
    lens_q, lens_k = [3, 0, 300, 77, 1, 129], [5, 2, 200, 77, 333, 0]
    q, k, v, cu_q, cu_k = _varlen_case("cuda", torch.float16, lens_q, lens_k, hq=8, hkv=2, d=d)
    _check_varlen(q, k, v, cu_q, cu_k, lens_q, causal, "bottom_right" if causal else "top_left", TOL[torch.float16])


@needs_gpu
@pytest.mark.parametrize("value", ["0", "-2", "rows", "3x"])
def test_gpu_grid_switch_rejects_bad_values(monkeypatch, value):
    monkeypatch.setenv("LLMK_ATTENTION_GRID", value)
    q = torch.randn(1, 2, 8, 64, device="cuda", dtype=torch.float16)
    with pytest.raises(ValueError, match="LLMK_ATTENTION_GRID: expected tile, head or a positive width, got " + value):
        lk.attention(q, q, q)


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("causal,align", [(False, "top_left"), (True, "top_left"), (True, "bottom_right")])
@pytest.mark.parametrize("sq,skv,hq,hkv,d", [
    (1, 77, 4, 4, 64), (77, 333, 8, 2, 80), (333, 77, 4, 1, 96), (333, 333, 32, 1, 128),
    (77, 333, 32, 8, 256), (4097, 4097, 4, 4, 128), (333, 4097, 8, 1, 64), (4097, 1, 2, 1, 64),
])
def test_gpu_matches_float64(gpu_kernel, dtype, causal, align, sq, skv, hq, hkv, d):
    torch.manual_seed(sq * 7 + skv + d)
    q = torch.randn(2, hq, sq, d, device="cuda", dtype=dtype)
    k, v = (torch.randn(2, hkv, skv, d, device="cuda", dtype=dtype) for _ in range(2))
    _check_gpu(q, k, v, causal, align)


@needs_gpu
@pytest.mark.parametrize("d", [64, 128])
def test_gpu_large_logits_scale_and_bshd_views(gpu_kernel, d):
    # logits ~ 1e3: exp would overflow without the running max
    q = torch.randn(1, 8, 200, d, device="cuda", dtype=torch.float16) * 10
    k, v = torch.randn(1, 2, 333, d, device="cuda", dtype=torch.float16) * 10, torch.randn(1, 2, 333, d, device="cuda", dtype=torch.float16)
    _check_gpu(q, k, v, causal=True, align="bottom_right")
    _check_gpu(q, k, v, scale=0.02)
    # (B, S, H, D) views of a packed qkv tensor (row strides 3 * H * D): read in place
    qkv = torch.randn(2, 130, 3, 4, d, device="cuda", dtype=torch.bfloat16)
    q, k, v = qkv.unbind(2)
    out = lk.attention(q, k, v, causal=True, layout="bshd")
    ref, _ = A.attention_ref(*(t.transpose(1, 2).double() for t in (q, k, v)), causal=True)
    assert rel_err(out.transpose(1, 2), ref) < TOL[torch.bfloat16]


@needs_gpu
def test_gpu_unaligned_strides_and_empty_rows():
    # row stride 67 elements: no 16-byte rows, so the library takes the portable kernel by itself
    base = torch.randn(1, 45, 2, 67, device="cuda", dtype=torch.float16)
    q = base[..., :64]
    out = lk.attention(q, q, q, causal=True, layout="bshd")
    ref, _ = A.attention_ref(*(q.transpose(1, 2).double(),) * 3, causal=True)
    assert rel_err(out.transpose(1, 2), ref) < TOL[torch.float16]
    # bottom-right with more queries than keys: the first 300 queries see nothing
    q = torch.randn(1, 2, 333, 128, device="cuda", dtype=torch.float16)
    k = torch.randn(1, 2, 33, 128, device="cuda", dtype=torch.float16)
    out, lse = _check_gpu(q, k, k, causal=True, align="bottom_right")
    assert torch.equal(out[:, :, :300], torch.zeros_like(out[:, :, :300])) and torch.isinf(lse[..., :300]).all()


@needs_gpu
def test_gpu_sdpa_runs_ours_and_falls_back_for_fp32():
    q = torch.randn(1, 8, 77, 64, device="cuda", dtype=torch.float16)
    k = torch.randn(1, 2, 77, 64, device="cuda", dtype=torch.float16)
    assert A._why_not_ours(q, k, k, None, 0.0, True, None, True) is None
    torch.testing.assert_close(lk.sdpa(q, k, k, is_causal=True, enable_gqa=True),
                               F.scaled_dot_product_attention(q, k, k, is_causal=True, enable_gqa=True),
                               rtol=2e-3, atol=2e-3)
    q32 = q.float()
    assert A._why_not_ours(q32, q32, q32, None, 0.0, False, None, False) == "fp32 on the GPU"
    torch.testing.assert_close(lk.sdpa(q32, q32, q32), F.scaled_dot_product_attention(q32, q32, q32), rtol=0, atol=0)
    with pytest.raises(TypeError, match=r"llmk::attention: q: expected dtype float16 or bfloat16 on the GPU, got float32"):
        lk.attention(q32, q32, q32)


@needs_gpu
def test_gpu_sdpa_hands_portable_cases_to_pytorch(monkeypatch):
    """Where our kernel would be the portable FMA one (here: rows not 16-byte aligned, or
    LLMK_ATTENTION_PORTABLE=1, what AMD runs), sdpa returns PyTorch's answer bit for bit; with
    use_portable set it runs ours (the portable kernel), within fp16 rounding of PyTorch."""
    monkeypatch.delenv("LLMK_ATTENTION_PORTABLE", raising=False)
    big = torch.randn(1, 4, 77, 65, device="cuda", dtype=torch.float16)
    q = big[..., 1:]  # data pointer 2 bytes past 16-byte alignment, row stride 65 elements
    assert A._why_not_ours(q, q, q, None, 0.0, True, None, False) == PORTABLE_REASON
    torch.testing.assert_close(lk.sdpa(q, q, q, is_causal=True), F.scaled_dot_product_attention(q, q, q, is_causal=True),
                               rtol=0, atol=0)
    aligned = torch.randn(1, 4, 77, 64, device="cuda", dtype=torch.float16)
    assert A._why_not_ours(aligned, aligned, aligned, None, 0.0, True, None, False) is None
    monkeypatch.setenv("LLMK_ATTENTION_PORTABLE", "1")
    assert A._why_not_ours(aligned, aligned, aligned, None, 0.0, True, None, False) == PORTABLE_REASON
    monkeypatch.setattr(A, "use_portable", True)
    assert A._why_not_ours(aligned, aligned, aligned, None, 0.0, True, None, False) is None
    for x in (q, aligned):
        ref = A.attention_ref(x.double(), x.double(), x.double(), causal=True)[0]
        assert rel_err(lk.sdpa(x, x, x, is_causal=True), ref) < TOL[torch.float16]


needs_hopper = pytest.mark.skipif(not HAS_GPU or torch.cuda.get_device_capability() != (9, 0),
                                  reason=GPU_REASON if not HAS_GPU else "the wgmma kernel needs an sm_90 GPU")


@pytest.fixture
def hopper_kernel(monkeypatch):
    """The Hopper wgmma kernel (sm_90's default; D 64 and 128), its plain tiling."""
    monkeypatch.delenv("LLMK_ATTENTION_MMA_CONFIG", raising=False)
    monkeypatch.delenv("LLMK_ATTENTION_PORTABLE", raising=False)
    monkeypatch.setenv("LLMK_ATTENTION_HOPPER", "1")
    monkeypatch.setenv("LLMK_ATTENTION_HOPPER_CONFIG", "plain")


@needs_hopper
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("causal,align", [(False, "top_left"), (True, "top_left"), (True, "bottom_right")])
@pytest.mark.parametrize("sq,skv,hq,hkv,d", [
    (1, 77, 4, 4, 64), (333, 333, 32, 1, 128), (1000, 1077, 8, 2, 64), (333, 77, 4, 1, 128), (4097, 1, 2, 1, 64),
])
def test_gpu_hopper_matches_float64(hopper_kernel, dtype, causal, align, sq, skv, hq, hkv, d):
    torch.manual_seed(sq * 7 + skv + d)
    q = torch.randn(2, hq, sq, d, device="cuda", dtype=dtype)
    k, v = (torch.randn(2, hkv, skv, d, device="cuda", dtype=dtype) for _ in range(2))
    _check_gpu(q, k, v, causal, align)


@needs_hopper
@pytest.mark.parametrize("d", [64, 128])
def test_gpu_hopper_large_logits_and_bshd_views(hopper_kernel, d):
    # the same checks as for the other kernels (logits ~1e3, a scale, packed-qkv bshd views)
    test_gpu_large_logits_scale_and_bshd_views("hopper", d)


def _varlen_case(device, dtype, lens_q, lens_k, hq=4, hkv=2, d=64):
    cu_q = torch.tensor([0] + torch.tensor(lens_q).cumsum(0).tolist(), dtype=torch.int32, device=device)
    cu_k = torch.tensor([0] + torch.tensor(lens_k).cumsum(0).tolist(), dtype=torch.int32, device=device)
    q = torch.randn(sum(lens_q), hq, d, device=device, dtype=dtype)
    k, v = (torch.randn(sum(lens_k), hkv, d, device=device, dtype=dtype) for _ in range(2))
    return q, k, v, cu_q, cu_k


def _check_varlen(q, k, v, cu_q, cu_k, lens_q, causal, align, tol):
    out, lse = lk.attention_varlen(q, k, v, cu_q, cu_k, max(lens_q), causal=causal, causal_align=align, return_lse=True)
    assert out.shape == q.shape and lse.shape == (q.shape[1], q.shape[0])
    bq, bk = cu_q.tolist(), cu_k.tolist()
    for i in range(len(lens_q)):
        if lens_q[i] == 0:
            continue
        qs, ks = slice(bq[i], bq[i + 1]), slice(bk[i], bk[i + 1])
        ref, ref_lse = A.attention_ref(*(t[None, s].transpose(1, 2).double() for t, s in ((q, qs), (k, ks), (v, ks))),
                                       causal=causal, causal_align=align)
        assert rel_err(out[qs], ref[0].transpose(0, 1)) < tol, i
        finite = torch.isfinite(ref_lse[0])
        got = lse[:, qs].double().cpu()
        assert torch.equal(torch.isfinite(got), finite.cpu())
        assert (got[finite.cpu()] - ref_lse[0][finite].cpu()).abs().max() < 2e-3 if finite.any() else True


@pytest.mark.parametrize("causal,align", [(False, "top_left"), (True, "top_left"), (True, "bottom_right")])
def test_varlen_cpu_matches_per_sequence(causal, align):
    lens_q, lens_k = [3, 0, 7, 1, 20], [5, 2, 7, 9, 4]
    q, k, v, cu_q, cu_k = _varlen_case("cpu", torch.float32, lens_q, lens_k)
    _check_varlen(q, k, v, cu_q, cu_k, lens_q, causal, align, 1e-5)


def test_varlen_bad_inputs():
    q, k, v, cu_q, cu_k = _varlen_case("cpu", torch.float32, [3, 4], [3, 4])
    with pytest.raises(TypeError, match=r"llmk::attention_varlen: cu_seqlens_q: expected dtype int32, got int64"):
        lk.attention_varlen(q, k, v, cu_q.long(), cu_k, 4)
    with pytest.raises(ValueError, match=r"llmk::attention_varlen: cu_seqlens: sequence 1 spans q rows \[3, 7\)"):
        lk.attention_varlen(q, k, v, cu_q, cu_k, 3)  # the second sequence is longer than max_seqlen_q
    with pytest.raises(ValueError, match=r"cu_seqlens_k: expected shape \(3\) \(that of cu_seqlens_q\), got \(2\)"):
        lk.attention_varlen(q, k, v, cu_q, cu_k[:2], 4)


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("causal,align", [(False, "top_left"), (True, "top_left"), (True, "bottom_right")])
def test_varlen_gpu_matches_per_sequence(gpu_kernel, dtype, causal, align):
    lens_q, lens_k = [3, 0, 300, 77, 1, 129], [5, 2, 200, 77, 333, 0]
    q, k, v, cu_q, cu_k = _varlen_case("cuda", dtype, lens_q, lens_k, hq=8, hkv=2, d=128)
    poison_allocator("cuda", 4 * q.numel() * q.element_size())
    _check_varlen(q, k, v, cu_q, cu_k, lens_q, causal, align, TOL[dtype])


@needs_hopper
@pytest.mark.parametrize("causal,align", [(False, "top_left"), (True, "bottom_right")])
def test_varlen_hopper_matches_per_sequence(hopper_kernel, causal, align):
    lens_q, lens_k = [3, 0, 300, 77, 1, 129], [5, 2, 200, 77, 333, 0]
    q, k, v, cu_q, cu_k = _varlen_case("cuda", torch.bfloat16, lens_q, lens_k, hq=8, hkv=2, d=128)
    poison_allocator("cuda", 4 * q.numel() * q.element_size())
    _check_varlen(q, k, v, cu_q, cu_k, lens_q, causal, align, TOL[torch.bfloat16])


def test_varlen_opcheck():
    q, k, v, cu_q, cu_k = _varlen_case("cpu", torch.float32, [3, 4], [5, 1])
    torch.library.opcheck(torch.ops.llm_kernels.attention_varlen, (q, k, v, cu_q, cu_k, 4, True, None, True))


@pytest.fixture
def hopper_ws_kernel(monkeypatch):
    """The Hopper kernel's warp-specialised tiling (LLMK_ATTENTION_HOPPER_CONFIG=ws: TMA producer
    warpgroup, mbarrier ring, two consumer warpgroups; forced here, the default picks ws_pp, or ws3
    at D = 64).
    Afterwards: no
    mbarrier wait timed out (a deadlocked pipeline gives up after 10 s with garbage)."""
    monkeypatch.delenv("LLMK_ATTENTION_MMA_CONFIG", raising=False)
    monkeypatch.delenv("LLMK_ATTENTION_PORTABLE", raising=False)
    monkeypatch.setenv("LLMK_ATTENTION_HOPPER", "1")
    monkeypatch.setenv("LLMK_ATTENTION_HOPPER_CONFIG", "ws")
    torch.ops.llm_kernels._hopper_ws_stats()  # clears a timeout left by an earlier test
    yield
    assert torch.ops.llm_kernels._hopper_ws_stats()[1] == 0, "an mbarrier wait of the ws tiling timed out"


def _ws_launches() -> int:
    return torch.ops.llm_kernels._hopper_ws_stats()[0]


@needs_hopper
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("causal,align", [(False, "top_left"), (True, "top_left"), (True, "bottom_right")])
@pytest.mark.parametrize("b,sq,skv,hq,hkv,d,stored", [
    (2, 1, 77, 4, 4, 64, "bhsd"), (2, 77, 333, 8, 2, 128, "bshd"), (1, 333, 1100, 8, 1, 128, "bhsd"),
    (2, 1100, 333, 4, 1, 64, "bshd"), (1, 4097, 4097, 8, 1, 128, "bshd"),
])
def test_gpu_hopper_ws_matches_float64(hopper_ws_kernel, dtype, causal, align, b, sq, skv, hq, hkv, d, stored):
    # "bshd": stored (B, S, H, D), passed as (B, H, S, D) views (the tensor maps' other stride order)
    torch.manual_seed(sq * 7 + skv + d)

    def make(h, s):
        if stored == "bshd":
            return torch.randn(b, s, h, d, device="cuda", dtype=dtype).transpose(1, 2)
        return torch.randn(b, h, s, d, device="cuda", dtype=dtype)

    q, k, v = make(hq, sq), make(hkv, skv), make(hkv, skv)
    before = _ws_launches()
    _check_gpu(q, k, v, causal, align)
    assert _ws_launches() > before, "the ws tiling fell back to pipe"


@needs_hopper
@pytest.mark.parametrize("causal,align", [(False, "top_left"), (True, "top_left"), (True, "bottom_right")])
@pytest.mark.parametrize("b,sq,skv,hq,hkv,d,stored", [
    (2, 77, 333, 8, 2, 128, "bshd"), (2, 1100, 333, 4, 1, 64, "bhsd"), (1, 4097, 4097, 8, 1, 128, "bshd"),
])
def test_gpu_hopper_ws_pingpong_matches_float64(hopper_ws_kernel, monkeypatch, causal, align, b, sq, skv, hq, hkv, d, stored):
    # "ws_pp": the ws tiling with the consumers' ping-pong schedule (named barriers)
    monkeypatch.setenv("LLMK_ATTENTION_HOPPER_CONFIG", "ws_pp")
    test_gpu_hopper_ws_matches_float64(None, torch.float16, causal, align, b, sq, skv, hq, hkv, d, stored)


@needs_hopper
@pytest.mark.parametrize("config", ["ws3", "ws_pp3"])
@pytest.mark.parametrize("causal,align", [(False, "top_left"), (True, "top_left"), (True, "bottom_right")])
@pytest.mark.parametrize("b,sq,skv,hq,hkv,stored", [
    (2, 77, 333, 8, 2, "bshd"), (1, 333, 1100, 8, 1, "bhsd"), (2, 200, 100, 4, 4, "bshd"), (1, 4097, 4097, 8, 1, "bshd"),
])
def test_gpu_hopper_ws3_matches_float64(hopper_ws_kernel, monkeypatch, config, causal, align, b, sq, skv, hq, hkv, stored):
    # 192-row blocks of three consumer warpgroups (D = 64 only; ws3 rescales O at the end of each
    # iteration, ws_pp3 between the issues of S_t and P V): fewer queries than a block,
    # between one and two blocks, the K / V ring wrapping
    monkeypatch.setenv("LLMK_ATTENTION_HOPPER_CONFIG", config)
    for dtype in (torch.float16, torch.bfloat16):
        test_gpu_hopper_ws_matches_float64(None, dtype, causal, align, b, sq, skv, hq, hkv, 64, stored)


@needs_hopper
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", [(2, 8, 600, 128), (2, 8, 600, 64), (2, 16, 1100, 64)])
def test_gpu_hopper_default_is_ws(hopper_ws_kernel, monkeypatch, causal, shape):
    # no tiling forced: ws_pp, or ws3 at D = 64 with two 128-row blocks per SM (the last shape on
    # an H200's 132 SMs); never pipe here
    monkeypatch.delenv("LLMK_ATTENTION_HOPPER_CONFIG")
    q, k, v = (torch.randn(*shape, device="cuda", dtype=torch.float16) for _ in range(3))
    before = _ws_launches()
    _check_gpu(q, k, v, causal, "top_left")
    assert _ws_launches() > before, "the default tiling was not a ws one"


@needs_hopper
@pytest.mark.parametrize("d", [64, 128])
def test_gpu_hopper_ws_large_logits_and_bshd_views(hopper_ws_kernel, d):
    # logits ~1e3, a scale, packed-qkv views (row strides 3 * H * D) through the tensor maps
    before = _ws_launches()
    test_gpu_large_logits_scale_and_bshd_views("hopper_ws", d)
    assert _ws_launches() > before, "the ws tiling fell back to pipe"


@needs_hopper
@pytest.mark.parametrize("causal,align", [(False, "top_left"), (True, "bottom_right")])
def test_varlen_hopper_ws_falls_back_to_pipe(hopper_ws_kernel, causal, align):
    # packed sequences are not for the ws tiling (no per-sequence tensor maps): it takes "pipe"
    lens_q, lens_k = [3, 0, 300, 77, 1, 129], [5, 2, 200, 77, 333, 0]
    q, k, v, cu_q, cu_k = _varlen_case("cuda", torch.float16, lens_q, lens_k, hq=8, hkv=2, d=128)
    poison_allocator("cuda", 4 * q.numel() * q.element_size())
    before = _ws_launches()
    _check_varlen(q, k, v, cu_q, cu_k, lens_q, causal, align, TOL[torch.float16])
    assert _ws_launches() == before


def test_hopper_ws_stats_op():
    # launches of the ws tiling and the timeout flag (read and cleared): never negative, 0 / 1
    launches, timed_out = torch.ops.llm_kernels._hopper_ws_stats()
    assert launches >= 0 and timed_out in (0, 1)
    assert torch.ops.llm_kernels._hopper_ws_stats()[1] == 0


def test_cpu_results_do_not_depend_on_threads():
    """The CPU kernel splits (batch, head) pairs over torch's threads: no bit changes."""
    q, k, v = torch.randn(3, 8, 67, 64), torch.randn(3, 2, 131, 64), torch.randn(3, 2, 131, 64)
    first, second = at_thread_counts(lambda: lk.attention(q, k, v, causal=True, return_lse=True))
    assert all(torch.equal(a, b) for a, b in zip(first, second))
