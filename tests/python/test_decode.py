"""Decode path: decode_attention (contiguous and paged caches, GQA, T = 1..8, seq_len 0), the
KV-cache write, skinny_gemm (bias, SwiGLU, > 16 rows), Linear; values vs float64, opcheck,
torch.compile, CUDA-graph capture, bad input."""

import pytest
import torch
import torch.nn.functional as F

import llm_kernels as lk
from llm_kernels import decode, ops
from llm_kernels.layers import Linear
from llm_kernels.reference import write_kv_cache_ref

from conftest import HAS_GPU, TOL, at_thread_counts, poison_allocator, rel_err

GPU_DTYPES = [torch.float16, torch.bfloat16]


def dtypes_for(device):
    return GPU_DTYPES if device == "cuda" else [torch.float32] + GPU_DTYPES


def make_cache(B, Hkv, D, lens, dtype, device, block_size=None, smax=None):
    """Random caches and, when paged, a shuffled block table with spare blocks."""
    max_len = max(max(lens), 1)
    lens_t = torch.tensor(lens, dtype=torch.int32, device=device)
    if block_size is None:
        smax = smax or max_len + 3
        k = torch.randn(B, Hkv, smax, D, device=device, dtype=dtype)
        v = torch.randn(B, Hkv, smax, D, device=device, dtype=dtype)
        return k, v, lens_t, None
    max_blocks = -(-max_len // block_size) + 1
    num_blocks = B * max_blocks + 5
    k = torch.randn(num_blocks, block_size, Hkv, D, device=device, dtype=dtype)
    v = torch.randn(num_blocks, block_size, Hkv, D, device=device, dtype=dtype)
    table = torch.randperm(num_blocks, device=device)[: B * max_blocks].view(B, max_blocks).to(torch.int32)
    return k, v, lens_t, table


@pytest.mark.parametrize("block_size", [None, 16, 48, 256])
@pytest.mark.parametrize("hq,hkv,T,D", [(4, 4, 1, 64), (32, 8, 1, 128), (16, 2, 3, 128), (32, 1, 8, 64), (8, 2, 2, 256)])
def test_decode_matches_float64(device, block_size, hq, hkv, T, D):
    lens = [0, 1, 77, 333]
    for dtype in dtypes_for(device):
        B = len(lens)
        k, v, lens_t, table = make_cache(B, hkv, D, lens, dtype, device, block_size)
        q = torch.randn(B, T, hq, D, device=device, dtype=dtype)
        poison_allocator(device, q.numel() * 8)
        out = lk.decode_attention(q, k, v, lens_t, table)
        ref = decode.decode_attention_ref(q.double(), k.double(), v.double(), lens_t, table)
        assert out.shape == q.shape and out.dtype == dtype
        assert rel_err(out, ref) < TOL[dtype], (dtype, block_size)
        assert (out[0] == 0).all()  # seq_len 0: zeros
        if block_size is None:  # int64 lengths, and one length shared by the batch (stride 0)
            assert rel_err(lk.decode_attention(q, k, v, lens_t.long(), table), ref) < TOL[dtype]
            one = lens_t[2:3].long()
            shared = lk.decode_attention(q, k, v, one.expand(B), table)
            ref_shared = decode.decode_attention_ref(q.double(), k.double(), v.double(), one.repeat(B).int(), table)
            assert rel_err(shared, ref_shared) < TOL[dtype]


@pytest.mark.skipif(not HAS_GPU, reason="no GPU on this machine: GPU case not run")
@pytest.mark.parametrize("kernel", ["warp", "mma", "split"])
@pytest.mark.parametrize("block_size", [None, 16])
@pytest.mark.parametrize("hq,hkv,T,D,num_splits,dtype", [
    (32, 8, 1, 128, 0, torch.bfloat16), (32, 8, 1, 128, 9, torch.bfloat16), (16, 2, 1, 64, 0, torch.float16),
    (8, 2, 2, 256, 3, torch.bfloat16), (16, 2, 2, 64, 5, torch.bfloat16), (12, 4, 4, 128, 0, torch.float16)])
def test_decode_each_kernel_matches_float64(monkeypatch, kernel, block_size, hq, hkv, T, D, num_splits, dtype):
    """Each kernel forced by LLMK_DECODE_KERNEL (warp: the default, mma: tensor cores, which hands
    16+ rows and D = 256 to the others, split: the previous one), with splits, odd lengths, 16 rows."""
    monkeypatch.delenv("LLMK_DECODE_LEGACY", raising=False)
    monkeypatch.setenv("LLMK_DECODE_KERNEL", kernel)
    lens = [0, 1, 77, 1333, 4096]
    k, v, lens_t, table = make_cache(len(lens), hkv, D, lens, dtype, "cuda", block_size)
    q = torch.randn(len(lens), T, hq, D, device="cuda", dtype=dtype)
    for _ in range(2):  # the second call reuses the split counters the kernel reset
        poison_allocator("cuda", q.numel() * 8)
        out = lk.decode_attention(q, k, v, lens_t, table, num_splits=num_splits)
        ref = decode.decode_attention_ref(q.double(), k.double(), v.double(), lens_t, table)
        assert rel_err(out, ref) < TOL[dtype], (kernel, block_size)
        assert (out[0] == 0).all()
    # int64 lengths (a Hugging Face static cache's counter) read the same (not bitwise: the warp
    # kernel sums its warps' outputs with shared-memory atomics)
    out64 = lk.decode_attention(q, k, v, lens_t.long(), table, num_splits=num_splits)
    assert rel_err(out64, ref) < TOL[dtype] and (out64[0] == 0).all()


@pytest.mark.parametrize("num_splits", [1, 2, 5, 0])
def test_decode_forced_splits_and_bhsd_query(device, num_splits):
    dtype = torch.bfloat16
    k, v, lens_t, table = make_cache(3, 2, 128, [1000, 3, 517], dtype, device, 16)
    q = torch.randn(3, 8, 4, 128, device=device, dtype=dtype).transpose(1, 2)  # (B, H, T, D) storage
    q = q.transpose(1, 2)  # back to (B, T, H, D) with non-contiguous strides
    out = lk.decode_attention(q, k, v, lens_t, table, num_splits=num_splits, max_seq_len=1000)
    ref = decode.decode_attention_ref(q.double(), k.double(), v.double(), lens_t, table)
    assert rel_err(out, ref) < TOL[dtype]


def test_decode_equals_sdpa_after_write(device):
    """Write a prompt and a step into a paged cache, decode, compare with causal SDPA."""
    B, Hq, Hkv, D, S, bs = 2, 8, 2, 64, 45, 16
    dtype = torch.float16 if device == "cuda" else torch.float32
    kfull = torch.randn(B, S, Hkv, D, device=device, dtype=dtype)
    vfull = torch.randn(B, S, Hkv, D, device=device, dtype=dtype)
    qfull = torch.randn(B, S, Hq, D, device=device, dtype=dtype)
    k_cache, v_cache, _, table = make_cache(B, Hkv, D, [S, S], dtype, device, bs)
    pos = torch.arange(S, device=device).expand(B, S)
    lk.write_kv_cache(k_cache, v_cache, kfull, vfull, pos, table)
    T = 4
    out = lk.decode_attention(qfull[:, -T:], k_cache, v_cache, torch.full((B,), S, dtype=torch.int32, device=device), table)
    sdpa = F.scaled_dot_product_attention(
        qfull.transpose(1, 2).double(), kfull.transpose(1, 2).double().repeat_interleave(Hq // Hkv, 1),
        vfull.transpose(1, 2).double().repeat_interleave(Hq // Hkv, 1), is_causal=True,
    ).transpose(1, 2)[:, -T:]
    assert rel_err(out, sdpa) < TOL[dtype]


def make_mask(kind, B, Tm, S, dtype, device, hidden_rows=(1,)):
    """A mask over S positions with ~30% holes (not a prefix) and sequences `hidden_rows` hidden."""
    gen = torch.Generator(device="cpu").manual_seed(7)
    keep = torch.rand(B, Tm, S, generator=gen) > 0.3
    for b in hidden_rows:
        keep[b] = False
    keep = keep.to(device)
    if kind == "bool":
        return keep
    mdtype = torch.float32 if kind == "f32" else dtype
    add = torch.randn(B, Tm, S, generator=gen).to(device=device, dtype=mdtype)
    hole = float("-inf") if kind == "f32" else torch.finfo(mdtype).min  # HF's additive masks use finfo.min
    add = add.masked_fill(~keep, hole)
    # hidden sequences: -inf, since fp16's finfo.min (-65504) shifts all their keys alike and hides none
    add[list(hidden_rows)] = float("-inf")
    return add


@pytest.mark.parametrize("kind", ["bool", "additive", "f32"])
@pytest.mark.parametrize("per_token", [False, True])
@pytest.mark.parametrize("block_size", [None, 16])
@pytest.mark.parametrize("kernel", ["default", "legacy"])
def test_decode_attn_mask_matches_float64(device, monkeypatch, kind, per_token, block_size, kernel):
    """Masks with holes, shorter than a sequence (positions past it hidden), a sequence whose keys
    are all hidden (zeros), shared by the tokens or per token, bool and additive, both kernels."""
    if kernel == "legacy" and device != "cuda":
        pytest.skip("the CPU has one path")
    monkeypatch.setenv("LLMK_DECODE_LEGACY", "1" if kernel == "legacy" else "0")
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    B, T, Hq, Hkv, D = 4, 3, 8, 2, 128
    lens = [0, 40, 77, 300]
    k, v, lens_t, table = make_cache(B, Hkv, D, lens, dtype, device, block_size)
    q = torch.randn(B, T, Hq, D, device=device, dtype=dtype)
    mask = make_mask(kind, B, T if per_token else 1, 290, dtype, device)
    poison_allocator(device, q.numel() * 8)
    out = lk.decode_attention(q, k, v, lens_t, table, attn_mask=mask)
    ref = decode.decode_attention_ref(q.double(), k.double(), v.double(), lens_t, table, attn_mask=mask)
    assert rel_err(out, ref) < TOL[dtype], (kind, per_token, block_size)
    assert (out[1] == 0).all() and (out[0] == 0).all()
    no_mask = decode.decode_attention_ref(q.double(), k.double(), v.double(), lens_t, table)
    assert rel_err(no_mask[2:], ref[2:]) > 0.05  # the mask changed the result


def test_decode_attn_mask_of_a_static_cache_equals_seq_lens(device):
    """What a Hugging Face static cache hands over: the whole capacity as seq_lens and SDPA's 4-D
    mask (B, 1, T, Smax) hiding the empty slots and the future: the same as exact seq_lens."""
    dtype = torch.float16 if device == "cuda" else torch.float32
    B, T, Hq, Hkv, D, smax = 3, 2, 8, 2, 64, 100
    lens = [9, 50, 99]
    k, v, lens_t, _ = make_cache(B, Hkv, D, lens, dtype, device, smax=smax)
    q = torch.randn(B, T, Hq, D, device=device, dtype=dtype)
    qpos = lens_t[:, None].long() - T + torch.arange(T, device=device)  # (B, T)
    visible = torch.arange(smax, device=device)[None, None, :] <= qpos[:, :, None]  # (B, T, Smax)
    additive = torch.zeros(B, 1, T, smax, device=device, dtype=dtype).masked_fill(~visible[:, None], torch.finfo(dtype).min)
    full = torch.full((B,), smax, dtype=torch.int32, device=device)
    want = lk.decode_attention(q, k, v, lens_t)
    for mask in (visible[:, None], additive):
        got = lk.decode_attention(q, k, v, full, attn_mask=mask)
        assert rel_err(got, want) < TOL[dtype]


MASK_PREFETCH_CASES = [  # Hq, Hkv, T, D, num_splits, per_token, dtype: GQA 4 / 2 / 1, rows 4..16
    (8, 2, 1, 64, 0, False, torch.bfloat16), (8, 2, 3, 128, 3, True, torch.float16),
    (8, 2, 3, 64, 1, False, torch.bfloat16), (4, 2, 8, 64, 1, True, torch.float16),
    (16, 4, 4, 128, 0, True, torch.bfloat16),
    (4, 4, 8, 128, 3, True, torch.float16)]  # MHA: 8 per-token mask rows, the most the stage holds


@pytest.mark.skipif(not HAS_GPU, reason="no GPU on this machine: GPU case not run")
@pytest.mark.parametrize("kind", ["bool", "additive", "f32"])
@pytest.mark.parametrize("block_size", [None, 16])
@pytest.mark.parametrize("Hq,Hkv,T,D,num_splits,per_token,dtype", MASK_PREFETCH_CASES)
def test_decode_attn_mask_prefetch_matches_float64(monkeypatch, kind, block_size, Hq, Hkv, T, D, num_splits,
                                                   per_token, dtype):
    """The tensor-core kernel with the mask staged through its cp.async ring and each chunk cut at
    its last visible key (LLMK_DECODE_MASK_PREFETCH=1): holes, a mask shorter than a sequence, a
    sequence fully hidden, a length-0 one, a mask hiding a long tail (the effective end), splits
    forced and automatic; the same as the per-lane loads (previous masked path); contiguous caches
    also with one warp group a block (LLMK_DECODE_GROUPS=1) and with LLMK_DECODE_MASK_SKIP=1 (these
    masks have holes or biases: the mask stays live)."""
    monkeypatch.delenv("LLMK_DECODE_LEGACY", raising=False)
    monkeypatch.setenv("LLMK_DECODE_KERNEL", "mma")
    B, lens, S = 5, [0, 40, 77, 300, 700], 290
    k, v, lens_t, table = make_cache(B, Hkv, D, lens, dtype, "cuda", block_size)
    q = torch.randn(B, T, Hq, D, device="cuda", dtype=dtype)
    mask = make_mask(kind, B, T if per_token else 1, S, dtype, "cuda")
    mask[4, :, 37:] = False if kind == "bool" else float("-inf")  # visible keys end at 37 of 700
    ref = decode.decode_attention_ref(q.double(), k.double(), v.double(), lens_t, table, attn_mask=mask)
    outs = {}
    torch.ops.llm_kernels._decode_stats()  # clears a timeout flag left by an earlier test
    modes = ("1", "1-skip", "0") if block_size else ("1", "1-1group", "1-skip", "0")
    for mode in modes:
        monkeypatch.setenv("LLMK_DECODE_MASK_PREFETCH", "0" if mode == "0" else "1")
        monkeypatch.setenv("LLMK_DECODE_MASK_SKIP", "1" if mode == "1-skip" else "0")
        if mode == "1-1group":
            monkeypatch.setenv("LLMK_DECODE_GROUPS", "1")
        else:
            monkeypatch.delenv("LLMK_DECODE_GROUPS", raising=False)
        poison_allocator("cuda", q.numel() * 8)
        outs[mode] = lk.decode_attention(q, k, v, lens_t, table, num_splits=num_splits, attn_mask=mask)
        # (a chunk whose keys the random holes all spare may skip the mask, rightly: results decide)
        assert torch.ops.llm_kernels._decode_stats()[0] == 0, mode
        assert rel_err(outs[mode], ref) < TOL[dtype], (mode, kind, block_size)
        assert (outs[mode][:2] == 0).all()  # seq_len 0, and a sequence whose keys are all hidden
    for mode in modes[:-1]:
        assert rel_err(outs[mode], outs["0"]) < TOL[dtype] / 4, mode
    assert torch.ops.llm_kernels._decode_stats()[0] == 0, "an mbarrier wait of the TMA decode kernel timed out"


@pytest.mark.skipif(not HAS_GPU, reason="no GPU on this machine: GPU case not run")
@pytest.mark.parametrize("view", ["shifted", "strided"])
@pytest.mark.parametrize("kind", ["bool", "additive", "f32"])
def test_decode_attn_mask_prefetch_of_a_view(monkeypatch, view, kind):
    """Mask views: rows starting at any element (mask[..., 1:] of a wider mask with an odd row
    length: staged from the 16-byte boundary below), and a non-contiguous last dim (the per-lane
    loads instead)."""
    monkeypatch.delenv("LLMK_DECODE_LEGACY", raising=False)
    monkeypatch.setenv("LLMK_DECODE_KERNEL", "mma")
    monkeypatch.setenv("LLMK_DECODE_MASK_PREFETCH", "1")
    dtype = torch.bfloat16
    B, T, Hq, Hkv, D, S = 3, 3, 8, 2, 128, 203
    k, v, lens_t, _ = make_cache(B, Hkv, D, [203, 150, 31], dtype, "cuda", smax=203)
    q = torch.randn(B, T, Hq, D, device="cuda", dtype=dtype)
    wide = make_mask(kind, B, T, 2 * S + 1, dtype, "cuda", hidden_rows=())
    mask = wide[..., 1:S + 1] if view == "shifted" else wide[..., 1::2]
    assert mask.shape == (B, T, S)
    for num_splits in (1, 3):  # 3: splits that start past 0, at an unaligned mask address
        poison_allocator("cuda", q.numel() * 8)
        out = lk.decode_attention(q, k, v, lens_t, num_splits=num_splits, attn_mask=mask)
        ref = decode.decode_attention_ref(q.double(), k.double(), v.double(), lens_t, attn_mask=mask.contiguous())
        assert rel_err(out, ref) < TOL[dtype], (view, kind, num_splits)


@pytest.mark.skipif(not HAS_GPU, reason="no GPU on this machine: GPU case not run")
@pytest.mark.parametrize("skip", ["0", "1"])
@pytest.mark.parametrize("loads", ["tma", "cp.async"])
@pytest.mark.parametrize("capacity", [203, 4096])
def test_decode_attn_mask_prefetch_static_cache_equals_seq_lens(monkeypatch, capacity, loads, skip):
    """The 1B model's decode step with a Hugging Face static cache (the mask over the whole
    capacity, seq_lens = capacity; bf16 additive and bool, T = 1 and 2) equals exact seq_lens; at
    capacity 4096 most splits see no visible key (the effective end: lse -inf, nothing read). The
    hidden slots hold NaN, so that a kernel using any of their K or V rows (a V row past the cut
    not zeroed: 0 x NaN) fails; exact seq_lens never read them. With LLMK_DECODE_MASK_SKIP=1 the
    T = 1 masks (0 up to the last visible key) run the loop without the mask (the kernels' skip flag
    says so); at T = 2 the rows differ (causal: only a chunk wholly below the first row's limit
    skips), and a mask of T identical rows (every
    token sees the same prefix) is skipped too, checked against the float64 reference."""
    monkeypatch.delenv("LLMK_DECODE_LEGACY", raising=False)
    monkeypatch.setenv("LLMK_DECODE_KERNEL", "mma")
    monkeypatch.setenv("LLMK_DECODE_MASK_PREFETCH", "1")
    monkeypatch.setenv("LLMK_DECODE_MASK_SKIP", skip)
    monkeypatch.setenv("LLMK_DECODE_TMA", "0" if loads == "cp.async" else "1")
    dtype = torch.bfloat16
    Hq, Hkv, D = 32, 8, 64
    torch.ops.llm_kernels._decode_stats()  # clears a timeout flag left by an earlier test
    for B, T, lens in ((1, 1, [160]), (2, 2, [160, 33])):
        k, v, lens_t, _ = make_cache(B, Hkv, D, lens, dtype, "cuda", smax=capacity)
        for b, n in enumerate(lens):
            k[b, :, n:] = float("nan")
            v[b, :, n:] = float("nan")
        q = torch.randn(B, T, Hq, D, device="cuda", dtype=dtype)
        qpos = lens_t[:, None].long() - T + torch.arange(T, device="cuda")
        visible = torch.arange(capacity, device="cuda")[None, None, :] <= qpos[:, :, None]  # (B, T, cap)
        additive = torch.zeros(B, 1, T, capacity, device="cuda", dtype=dtype).masked_fill(
            ~visible[:, None], torch.finfo(dtype).min)
        full = torch.full((B,), capacity, dtype=torch.int32, device="cuda")
        want = lk.decode_attention(q, k, v, lens_t)
        for mask in (visible[:, None], additive):
            for num_splits in (0, 1, 3):
                poison_allocator("cuda", q.numel() * 8)
                got = lk.decode_attention(q, k, v, full, num_splits=num_splits, attn_mask=mask)
                assert rel_err(got, want) < TOL[dtype], (B, T, mask.dtype, num_splits)
                timed_out, skipped = torch.ops.llm_kernels._decode_stats()
                assert timed_out == 0, (B, T, mask.dtype, num_splits)
                # T = 1: every chunk's terms are 0 up to its end. T = 2: the first row hides key
                # len - 1, so only a chunk ending at or before it runs unmasked: with 3 splits the
                # first chunk is ceil(ceil(capacity / 64) / 3) 64-key tiles (the plan), 128 keys at
                # capacity 203, below sequence 0's 159 (H100, 2026-12-06: the skip engaged there).
                # The automatic plan's chunks are not known here.
                if T == 1 or num_splits != 0 or skip == "0":
                    first_chunk = -(-(-(-capacity // 64)) // max(num_splits, 1)) * 64
                    whole_chunk = T == 1 or (num_splits > 1 and any(first_chunk <= n - 1 for n in lens))
                    assert skipped == int(skip == "1" and whole_chunk), (B, T, mask.dtype, num_splits)
        # every token the last token's prefix, as T identical mask rows
        same = visible[:, -1:].expand(B, T, capacity).contiguous()  # (B, T, capacity): T mask rows
        k0, v0 = torch.nan_to_num(k, nan=0.0), torch.nan_to_num(v, nan=0.0)  # (the reference reads every slot)
        ref = decode.decode_attention_ref(q.double(), k0.double(), v0.double(), full, attn_mask=same)
        for num_splits in (0, 3):
            poison_allocator("cuda", q.numel() * 8)
            got = lk.decode_attention(q, k, v, full, num_splits=num_splits, attn_mask=same)
            assert rel_err(got, ref) < TOL[dtype], (B, T, "same rows", num_splits)
            assert torch.ops.llm_kernels._decode_stats() == [0, int(skip == "1")], (B, T, "same rows", num_splits)


@pytest.mark.skipif(not HAS_GPU, reason="no GPU on this machine: GPU case not run")
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("D", [64, 128])
def test_decode_two_warp_groups_repeat_bitwise(monkeypatch, D, masked):
    """The TMA decode kernel with two warp groups (each syncs on its own named barrier in the loop;
    the combination after it on __syncthreads) gives the same bits on every one of 100 calls, the
    allocator poisoned before each: a race between the groups' partial results and their sum would
    show as calls that differ. compute-sanitizer racecheck reports hazards there with two groups
    and none with one (H100, 2026-12-06; named barrier ids as immediates changed nothing), so this
    is the check that does not depend on racecheck's model of the barriers. Tile counts per chunk
    are odd and even (the groups take different numbers of tiles), split and not."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the TMA decode kernel is built for sm_90a (Hopper) only")
    monkeypatch.delenv("LLMK_DECODE_LEGACY", raising=False)
    monkeypatch.setenv("LLMK_DECODE_KERNEL", "mma")
    monkeypatch.setenv("LLMK_DECODE_TMA", "1")
    monkeypatch.setenv("LLMK_DECODE_GROUPS", "2")
    dtype = torch.bfloat16
    B, T, Hq, Hkv = 5, 1, 32, 8
    lens = [1, 65, 150, 203, 1000]  # 1, 2, 3, 4 and 16 tiles of 64 keys: the groups' shares differ
    k, v, lens_t, _ = make_cache(B, Hkv, D, lens, dtype, "cuda")
    q = torch.randn(B, T, Hq, D, device="cuda", dtype=dtype)
    smax = k.shape[2]
    mask = None
    if masked:  # a padding hole in every sequence but the first
        mask = (torch.arange(smax, device="cuda")[None, :] < lens_t[:, None].long())
        mask[1:, :3] = False
        mask = mask[:, None, None, :].expand(B, 1, T, smax).contiguous()
    seq = torch.full((B,), smax, dtype=torch.int32, device="cuda") if masked else lens_t
    ref = decode.decode_attention_ref(q.double(), k.double(), v.double(), seq,
                                      attn_mask=None if mask is None else mask[:, 0])  # (B, T, S)
    for num_splits in (1, 3):
        first = lk.decode_attention(q, k, v, seq, num_splits=num_splits, attn_mask=mask)
        assert rel_err(first, ref) < TOL[dtype], num_splits
        differ = 0
        for _ in range(100):
            poison_allocator("cuda", first.numel() * 64)
            differ += not torch.equal(lk.decode_attention(q, k, v, seq, num_splits=num_splits, attn_mask=mask), first)
        assert differ == 0, (num_splits, differ)
    monkeypatch.setenv("LLMK_DECODE_GROUPS", "1")  # the one-group kernel agrees to rounding
    one = lk.decode_attention(q, k, v, seq, num_splits=3, attn_mask=mask)
    assert rel_err(one, first) < TOL[dtype]


def test_decode_attn_mask_bad_input(device):
    dtype = torch.float16 if device == "cuda" else torch.float32
    k, v, lens_t, _ = make_cache(2, 2, 64, [5, 6], dtype, device)
    q = torch.randn(2, 2, 4, 64, device=device, dtype=dtype)
    with pytest.raises(TypeError, match="attn_mask: expected dtype bool, float32 or q's"):
        lk.decode_attention(q, k, v, lens_t, attn_mask=torch.zeros(2, 1, 6, dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match=r"attn_mask: expected shape \(2, 1 or tokens, positions\)"):
        lk.decode_attention(q, k, v, lens_t, attn_mask=torch.ones(2, 3, 6, dtype=torch.bool, device=device))
    with pytest.raises(ValueError, match="one mask for all heads"):
        lk.decode_attention(q, k, v, lens_t, attn_mask=torch.ones(2, 4, 2, 6, dtype=torch.bool, device=device))


def test_decode_empty_cache_is_never_read(device):
    """seq_len 0 everywhere over a cache with no storage at all: zeros, and nothing is read."""
    dtype = torch.float16 if device == "cuda" else torch.float32
    q = torch.randn(2, 3, 4, 64, device=device, dtype=dtype)
    k = torch.empty(2, 2, 0, 64, device=device, dtype=dtype)
    out = lk.decode_attention(q, k, k, torch.zeros(2, dtype=torch.int32, device=device))
    assert torch.equal(out, torch.zeros_like(q))


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("H,D,strided", [(2, 32, False), (40, 128, True), (3, 20, False)])
def test_write_kv_cache(device, paged, H, D, strided):
    """GPU: 16-byte pieces (D 32, 128; 40 x 128 is more pieces than threads, and k, v strided
    slices of one qkv tensor) and single elements (D 20)."""
    B, T = 2, 3
    for dtype in dtypes_for(device):
        k_cache, v_cache, _, table = make_cache(B, H, D, [40, 40], dtype, device, 8 if paged else None, smax=40)
        k0, v0 = k_cache.clone(), v_cache.clone()
        k1, v1, k_before = k_cache.clone(), v_cache.clone(), k_cache.clone()
        if strided:
            qkv = torch.randn(B, T, 3 * H, D, device=device, dtype=dtype)
            k, v = qkv[:, :, H:2 * H], qkv[:, :, 2 * H:]
        else:
            k = torch.randn(B, T, H, D, device=device, dtype=dtype)
            v = torch.randn(B, T, H, D, device=device, dtype=dtype)
        pos = torch.tensor([[5, 6, 39], [-1, 17, 0]], device=device)
        lk.write_kv_cache(k_cache, v_cache, k, v, pos, table)
        for b in range(B):
            for t in range(T):
                p = int(pos[b, t])
                if p < 0:
                    continue
                if paged:
                    blk = int(table[b, p // 8])
                    k0[blk, p % 8], v0[blk, p % 8] = k[b, t], v[b, t]
                else:
                    k0[b, :, p], v0[b, :, p] = k[b, t], v[b, t]
        assert torch.equal(k_cache, k0) and torch.equal(v_cache, v0)
        # the exported reference writes the same, out of place
        k_ref, v_ref = write_kv_cache_ref(k1, v1, k, v, pos, table)
        assert torch.equal(k_ref, k0) and torch.equal(v_ref, v0) and torch.equal(k1, k_before)


@pytest.mark.parametrize("length_dtype", [torch.int32, torch.int64])
def test_write_kv_cache_advances_the_length(device, length_dtype):
    """advance: the counter moves by T once the positions are read: positions that are a view of
    the counter at one sequence and one token (a static cache's decode step: one launch on the
    GPU), and several sequences and tokens (a second launch); bad counters are refused."""
    for B, T in ((1, 1), (3, 2)):
        kc = torch.zeros(B, 2, 30, 64, device=device, dtype=torch.bfloat16)
        vc = torch.zeros_like(kc)
        k = torch.randn(B, T, 2, 64, device=device, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        length = torch.tensor(11, device=device, dtype=length_dtype)
        if T == 1:
            pos = length.view(1, 1).expand(B, 1)
        else:
            pos = torch.arange(11, 11 + T, device=device, dtype=length_dtype).expand(B, T)
        lk.write_kv_cache(kc, vc, k, v, pos, advance=length)
        assert int(length) == 11 + T, (B, T)
        assert torch.equal(kc[:, :, 11:11 + T], k.transpose(1, 2)) and torch.equal(vc[:, :, 11:11 + T], v.transpose(1, 2))
        assert not kc[:, :, :11].any() and not kc[:, :, 11 + T:].any()
    with pytest.raises(ValueError, match=r"advance: expected one element \(a length counter\), got shape \(2\)"):
        lk.write_kv_cache(kc, vc, k, v, pos, advance=torch.zeros(2, device=device, dtype=length_dtype))


@pytest.mark.parametrize("Hq,Hkv,D,strided", [(4, 2, 64, False), (32, 8, 128, True), (3, 3, 20, False)])
def test_rope_write_kv_cache(device, Hq, Hkv, D, strided):
    """rope_write_kv_cache against rope then write_kv_cache: q_out and k_out as rope gives them (to
    an fp32-order difference on the GPU), the cache gets k_out and v, padding (-1) and the length
    counter as write_kv_cache. GPU: 16-byte pieces (D 64, 128; 32 + 8 heads of 128 are more pieces
    than threads, q/k/v strided slices of one qkv tensor), single elements (D 20); one block with the
    counter advanced in it (B = T = 1) and several."""
    for dtype in dtypes_for(device):
        for B, T in ((1, 1), (2, 3)):
            if strided:
                qkv = torch.randn(B, T, Hq + 2 * Hkv, D, device=device, dtype=dtype)
                q, k, v = qkv[:, :, :Hq], qkv[:, :, Hq:Hq + Hkv], qkv[:, :, Hq + Hkv:]
            else:
                q = torch.randn(B, T, Hq, D, device=device, dtype=dtype)
                k, v = torch.randn(B, T, Hkv, D, device=device, dtype=dtype), torch.randn(B, T, Hkv, D, device=device, dtype=dtype)
            angles = torch.rand(B, T, D // 2, device=device) * 6.3
            cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
            kc = torch.randn(B, Hkv, 40, D, device=device, dtype=dtype)
            vc = torch.randn_like(kc)
            k0, v0 = kc.clone(), vc.clone()
            length = torch.tensor(7, device=device, dtype=torch.int32)
            pos = length.view(1, 1).expand(B, 1) if T == 1 else torch.tensor([[5, 6, 39], [-1, 17, 0]], device=device)
            q_out, k_out = torch.full_like(q, float("nan")), torch.full_like(k, float("nan"))
            decode.rope_write_kv_cache(q_out, k_out, kc, vc, q, k, v, cos, sin, pos, advance=length)
            q_ref, k_ref = ops.rope(q, k, cos=cos, sin=sin, style="neox", layout="bshd")
            tol = 0 if device == "cpu" else TOL[dtype]
            assert rel_err(q_out, q_ref) <= tol and rel_err(k_out, k_ref) <= tol, (dtype, B, T)
            assert int(length) == 7 + T
            positions = [[7]] * B if T == 1 else [[5, 6, 39], [-1, 17, 0]]
            for b in range(B):
                for t in range(T):
                    if positions[b][t] >= 0:
                        k0[b, :, positions[b][t]], v0[b, :, positions[b][t]] = k_out[b, t], v[b, t]
            assert torch.equal(kc, k0) and torch.equal(vc, v0)


@pytest.mark.parametrize("B,Hq,Hkv,D,norm,bias", [(1, 32, 8, 64, True, False), (3, 4, 2, 128, False, True),
                                                  (16, 2, 1, 256, True, True), (2, 3, 1, 40, True, False)])
def test_skinny_gemm_rope_kv(device, B, Hq, Hkv, D, norm, bias):
    """skinny_gemm_rope_kv against skinny_gemm then rope_write_kv_cache (the two calls it stands
    for): out bitwise on the CPU (where it runs as those two calls) and on the GPU (the fused deep
    kernel at D 64 / 128 / 256, the two calls at D 40); the caches at the length's slot, the length
    advanced (twice: the GPU's block count is back at zero), one cos / sin row for every sequence
    (an expand); with fixed_weight (the weight's first loads before the PDL wait) the same bits;
    opcheck."""
    K = 520 if D != 256 else 264
    for dtype in dtypes_for(device):
        x = torch.randn(B, 1, K, device=device, dtype=dtype)
        w = torch.randn((Hq + 2 * Hkv) * D, K, device=device, dtype=dtype) / K ** 0.5
        b = torch.randn(w.shape[0], device=device, dtype=dtype) if bias else None
        nw = torch.randn(K, device=device, dtype=dtype) if norm else None
        angles = torch.rand(1, D // 2, device=device) * 6.3
        cos, sin = (t.to(dtype).expand(B, D // 2) for t in (angles.cos(), angles.sin()))
        caches, lengths, outs = [], [], []
        for mode in ("fused", "fixed", "chain"):
            fused = mode != "chain"
            kc = torch.randn(B, Hkv, 11, D, device=device, dtype=dtype)
            if mode == "fused":
                kc0 = kc.clone()
            else:
                kc = kc0.clone()
            vc = torch.zeros_like(kc)
            length = torch.tensor(4, device=device, dtype=torch.int64)
            counter = torch.zeros(1, device=device, dtype=torch.int32)
            for _ in range(2):
                if fused:
                    out = decode.skinny_gemm_rope_kv(x, w, b, Hq, cos, sin, length.view(1).expand(B), kc, vc,
                                                     advance=length, counter=counter, norm_weight=nw,
                                                     fixed_weight=mode == "fixed")
                else:
                    out = decode.skinny_gemm(x, w, b, norm_weight=nw)
                    q, k, v = out.view(B, 1, Hq + 2 * Hkv, D).split([Hq, Hkv, Hkv], 2)
                    decode.rope_write_kv_cache(q, k, kc, vc, q, k, v, cos.unsqueeze(1), sin.unsqueeze(1),
                                               length.view(1, 1).expand(B, 1), advance=length)
            assert int(counter) == 0 and int(length) == 6
            caches.append((kc, vc))
            outs.append(out)
        for i in (1, 2):
            assert torch.equal(outs[0], outs[i]), (dtype, i)
            assert torch.equal(caches[0][0], caches[i][0]) and torch.equal(caches[0][1], caches[i][1]), (dtype, i)
        assert not torch.equal(caches[0][0][:, :, 5], kc0[:, :, 5])  # written
        assert torch.equal(caches[0][0][:, :, 6:], kc0[:, :, 6:])  # untouched
    length = torch.tensor(4, device=device, dtype=torch.int32)
    args = (x, w, b, Hq, cos.contiguous(), sin.contiguous(), torch.full((B,), 3, device=device, dtype=torch.int32),
            kc.clone(), vc.clone(), length, torch.zeros(1, device=device, dtype=torch.int32), nw, 1e-6, 0.0)
    torch.library.opcheck(torch.ops.llm_kernels.skinny_gemm_rope_kv.default, args)


def test_skinny_gemm_rope_kv_bad_input(device):
    dt = torch.bfloat16 if device == "cuda" else torch.float32  # (the GPU path takes fp16 / bf16)
    x = torch.randn(2, 64, device=device, dtype=dt)
    w = torch.randn(5 * 16, 64, device=device, dtype=dt)
    kc = torch.zeros(2, 1, 8, 16, device=device, dtype=dt)
    cos = torch.ones(2, 8, device=device, dtype=dt)
    pos = torch.zeros(2, dtype=torch.int64, device=device)
    with pytest.raises(ValueError, match=r"weight: expected \(q_heads \+ 2 \* kv_heads\) \* head_dim = 64 rows"):
        decode.skinny_gemm_rope_kv(x, w, None, 2, cos, cos, pos, kc, kc.clone())
    with pytest.raises(ValueError, match=r"positions: expected shape \(2\)"):
        decode.skinny_gemm_rope_kv(x, w, None, 3, cos, cos, pos[:1], kc, kc.clone())
    if device == "cuda":
        with pytest.raises(ValueError, match=r"counter: expected one int32 of GPU memory"):
            decode.skinny_gemm_rope_kv(x, w, None, 3, cos, cos, pos, kc, kc.clone(),
                                       advance=torch.zeros((), dtype=torch.int64, device=device))


def test_rope_write_kv_cache_bad_input(device):
    q = torch.randn(1, 1, 4, 64, device=device)
    k = torch.randn(1, 1, 2, 64, device=device)
    kc = torch.zeros(1, 2, 8, 64, device=device)
    cos = torch.ones(1, 1, 32, device=device)
    pos = torch.zeros(1, 1, dtype=torch.int64, device=device)

    def call(q_out=None, k_out=None, q_in=q, c=cos):
        q_out = torch.empty_like(q_in) if q_out is None else q_out
        k_out = torch.empty_like(k) if k_out is None else k_out
        decode.rope_write_kv_cache(q_out, k_out, kc, kc.clone(), q_in, k, k, c, c, pos)

    with pytest.raises(ValueError, match=r"cos: expected shape \(1, 1, 32\) \(batch, tokens, head dim / 2 of k\), got \(1, 1, 64\)"):
        call(c=torch.ones(1, 1, 64, device=device))
    with pytest.raises(ValueError, match=r"q: expected shape \(1, 1, heads, 64\)"):
        call(q_in=torch.randn(1, 1, 4, 32, device=device))
    with pytest.raises(ValueError, match=r"k_out: expected shape \(1, 1, 2, 64\)"):
        call(k_out=torch.empty(1, 1, 4, 64, device=device))
    with pytest.raises(TypeError, match=r"q_out: expected dtype"):
        call(q_out=torch.empty(1, 1, 4, 64, device=device, dtype=torch.float16))


def test_decode_bad_input():
    q = torch.randn(2, 1, 6, 64)
    k = torch.randn(2, 4, 10, 64)
    lens = torch.tensor([3, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"q: expected a number of heads that is a multiple of the KV heads 4"):
        lk.decode_attention(q, k, k, lens)
    q = torch.randn(2, 1, 8, 64)
    with pytest.raises(TypeError, match=r"k_cache: expected dtype float32 \(the dtype of q\), got float16"):
        lk.decode_attention(q, k.half(), k.half(), lens)
    with pytest.raises(TypeError, match=r"seq_lens: expected dtype int32 or int64, got float32"):
        lk.decode_attention(q, k, k, lens.float())
    with pytest.raises(ValueError, match=r"seq_lens: expected values in \[0, 10\]"):
        lk.decode_attention(q, k, k, torch.tensor([3, 11], dtype=torch.int32))
    pk = torch.randn(3, 16, 4, 64)
    table = torch.tensor([[0], [3]], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"block_table: expected block indices in \[0, 3\)"):
        lk.decode_attention(q, pk, pk, torch.tensor([5, 5], dtype=torch.int32), table)


@pytest.mark.skipif(not HAS_GPU, reason="no GPU on this machine: GPU case not run")
@pytest.mark.parametrize("zeroed", [False, True], ids=["memset", "workspace_zeroed"])
@pytest.mark.parametrize("kernel", ["warp", "mma", "legacy"])
def test_decode_cuda_graph_capture(monkeypatch, kernel, zeroed):
    """Replays of a captured call match float64; with workspace_zeroed the graph has no memset of
    the split counters, so each replay relies on the one before leaving them zero."""
    if kernel == "legacy":  # the older switch for the previous kernel
        monkeypatch.delenv("LLMK_DECODE_KERNEL", raising=False)
        monkeypatch.setenv("LLMK_DECODE_LEGACY", "1")
    else:
        monkeypatch.delenv("LLMK_DECODE_LEGACY", raising=False)
        monkeypatch.setenv("LLMK_DECODE_KERNEL", kernel)
    dtype = torch.bfloat16
    k, v, lens_t, table = make_cache(1, 8, 128, [4000], dtype, "cuda", 16)
    q = torch.randn(1, 1, 32, 128, device="cuda", dtype=dtype)
    nbytes = decode.decode_workspace_size(q, k, table)
    assert nbytes > 0  # batch 1 is split
    ws = (torch.zeros if zeroed else torch.empty)(nbytes, dtype=torch.uint8, device="cuda")
    out = lk.decode_attention(q, k, v, lens_t, table, workspace=ws, workspace_zeroed=zeroed)  # warm-up
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = lk.decode_attention(q, k, v, lens_t, table, workspace=ws, workspace_zeroed=zeroed)
    for n in (2500, 3999, 4000):  # replays reuse the split counters (reset by the kernel)
        q.copy_(torch.randn_like(q))
        lens_t.fill_(n)
        g.replay()
        torch.cuda.synchronize()
        ref = decode.decode_attention_ref(q.double(), k.double(), v.double(), lens_t, table)
        assert rel_err(out, ref) < TOL[dtype]


@pytest.mark.skipif(not HAS_GPU, reason="no GPU on this machine: GPU case not run")
def test_decode_attn_mask_prefetch_cuda_graph(monkeypatch):
    """A static-cache step as kernelize runs it, captured in a CUDA graph with the mask prefetch:
    the workspace sized without the mask (decode_workspace_size takes none) fits; replays with a
    moving mask (the effective end moves with it) match float64."""
    monkeypatch.delenv("LLMK_DECODE_LEGACY", raising=False)
    monkeypatch.setenv("LLMK_DECODE_KERNEL", "mma")
    monkeypatch.setenv("LLMK_DECODE_MASK_PREFETCH", "1")
    dtype, cap = torch.bfloat16, 2048
    k, v, _, _ = make_cache(1, 8, 64, [cap], dtype, "cuda", smax=cap)
    q = torch.randn(1, 1, 32, 64, device="cuda", dtype=dtype)
    full = torch.full((1,), cap, dtype=torch.int32, device="cuda")
    mask = torch.zeros(1, 1, 1, cap, device="cuda", dtype=dtype)
    nbytes = decode.decode_workspace_size(q, k)
    assert nbytes > 0  # batch 1 is split
    ws = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    out = lk.decode_attention(q, k, v, full, workspace=ws, attn_mask=mask)  # warm up outside the graph
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = lk.decode_attention(q, k, v, full, workspace=ws, attn_mask=mask)
    for n in (160, 1500, 7):
        q.copy_(torch.randn_like(q))
        mask.zero_()
        mask[..., n:] = torch.finfo(dtype).min
        g.replay()
        torch.cuda.synchronize()
        ref = decode.decode_attention_ref(q.double(), k.double(), v.double(),
                                          torch.full((1,), n, dtype=torch.int32, device="cuda"))
        assert rel_err(out, ref) < TOL[dtype], n


@pytest.mark.skipif(not HAS_GPU, reason="no GPU on this machine: GPU case not run")
@pytest.mark.parametrize("kernel", ["warp", "mma", "split"])
def test_decode_gpu_bad_block_is_nan_for_that_sequence(monkeypatch, kernel):
    monkeypatch.setenv("LLMK_DECODE_KERNEL", kernel)
    k, v, lens_t, table = make_cache(2, 1, 64, [20, 20], torch.float16, "cuda", 16)
    table[1, 1] = 10_000
    q = torch.randn(2, 1, 2, 64, device="cuda", dtype=torch.float16)
    out = lk.decode_attention(q, k, v, lens_t, table)
    assert torch.isfinite(out[0]).all() and torch.isnan(out[1]).all()


def test_decode_workspace_zeroed_needs_a_workspace(device):
    k, v, lens_t, _ = make_cache(1, 2, 64, [33], torch.float16 if device == "cuda" else torch.float32, device)
    q = torch.randn(1, 1, 4, 64, device=device, dtype=k.dtype)
    with pytest.raises(ValueError, match=r"workspace_zeroed=True vouches for a workspace, but none was passed"):
        lk.decode_attention(q, k, v, lens_t, workspace_zeroed=True)


def test_decode_opcheck_and_compile(device):
    dtype = torch.float16 if device == "cuda" else torch.float32
    k, v, lens_t, table = make_cache(2, 2, 64, [33, 7], dtype, device, 16)
    q = torch.randn(2, 2, 4, 64, device=device, dtype=dtype)
    torch.library.opcheck(torch.ops.llm_kernels.decode_attention, (q, k, v, lens_t, table, None, 0, 0, None))
    pos = torch.tensor([[31, 32], [5, 6]], device=device)
    kn = torch.randn(2, 2, 2, 64, device=device, dtype=dtype)
    torch.library.opcheck(torch.ops.llm_kernels.write_kv_cache_, (k.clone(), v.clone(), kn, kn, pos, table))
    length = torch.tensor(40, device=device)
    torch.library.opcheck(torch.ops.llm_kernels.write_kv_cache_, (k.clone(), v.clone(), kn, kn, pos, table, length))
    f = torch.compile(lambda q, k, v, l, t: lk.decode_attention(q, k, v, l, t), fullgraph=True)
    assert rel_err(f(q, k, v, lens_t, table), decode.decode_attention_ref(q.double(), k.double(), v.double(), lens_t, table)) < TOL[dtype]


# ---------------------------------------------------------------------------------- skinny GEMM
@pytest.mark.parametrize("M", [1, 3, 8, 16, 17, 40])
@pytest.mark.parametrize("K,N", [(256, 72), (77, 13), (1000, 264)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("activation", [None, "swiglu", "geglu_tanh"])
def test_skinny_gemm_matches_float64(device, M, K, N, bias, activation):
    if activation and N % 2:
        N += 1
    for dtype in dtypes_for(device):
        x = torch.randn(M, K, device=device, dtype=dtype)
        w = torch.randn(N, K, device=device, dtype=dtype) / K**0.5
        b = torch.randn(N, device=device, dtype=dtype) if bias else None
        poison_allocator(device, M * N * 4)
        y = lk.skinny_gemm(x, w, b, activation)
        ref = decode.skinny_gemm_ref(x.double(), w.double(), None if b is None else b.double(), activation)
        assert y.shape == ref.shape and y.dtype == dtype
        assert rel_err(y, ref) < TOL[dtype] * (2 if dtype == torch.float32 else 1), (dtype, M)


@pytest.mark.skipif(not HAS_GPU, reason="no GPU on this machine: GPU case not run")
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("activation", ["none", "swiglu", "geglu_tanh"])
def test_skinny_gemm_portable_path_on_gpu(dtype, activation, monkeypatch):
    """Every GPU kernel, forced with LLMK_GEMM_KERNEL: deep, mma, stream, tma (the H200's; deep
    elsewhere), and the portable one (portable=True); LLMK_GEMM_STREAM=1 still selects the
    streaming kernel."""
    kernels = (("deep", False), ("mma", False), ("stream", False), ("tma", False), ("mma", True))
    for M in (1, 5, 16):
        x = torch.randn(2, M, 520, device="cuda", dtype=dtype)  # leading dims flattened: 2M rows
        x = x[:, :, :512]  # strided rows
        w = torch.randn(96, 512, device="cuda", dtype=dtype) / 512**0.5
        b = torch.randn(96, device="cuda", dtype=dtype)
        ref = decode.skinny_gemm_ref(x.double(), w.double(), b.double(), activation if activation != "none" else None)
        for kernel, portable in kernels:
            monkeypatch.setenv("LLMK_GEMM_KERNEL", kernel)
            poison_allocator("cuda", 2 * M * 96 * 4)
            y = torch.ops.llm_kernels.skinny_gemm(x, w, b, activation, portable)
            assert rel_err(y, ref) < TOL[dtype], (M, kernel, portable)
    # N large enough for the streaming kernel's smaller K splits (1 and 2 warps per column group)
    # and the deep kernel's one-warp-per-group plan; then decode shapes of the 1B model (fused qkv,
    # down projection: 16-warp blocks) for the deep kernel
    for N, M, K, names in ((28680, 1, 64, ("deep", "mma", "stream", "tma")),
                           (14000, 12, 64, ("deep", "mma", "stream", "tma")),
                           (3072, 1, 2048, ("deep", "tma")), (2048, 4, 8192, ("deep", "tma"))):
        x = torch.randn(M, K, device="cuda", dtype=dtype)
        w = torch.randn(N, K, device="cuda", dtype=dtype) / K**0.5
        ref = decode.skinny_gemm_ref(x.double(), w.double(), None, activation if activation != "none" else None)
        for kernel in names:
            monkeypatch.setenv("LLMK_GEMM_KERNEL", kernel)
            poison_allocator("cuda", M * N * 4)
            y = torch.ops.llm_kernels.skinny_gemm(x, w, None, activation, False)
            assert rel_err(y, ref) < TOL[dtype], (N, M, kernel)
    monkeypatch.delenv("LLMK_GEMM_KERNEL")
    monkeypatch.setenv("LLMK_GEMM_STREAM", "1")  # the older switch, an alias of LLMK_GEMM_KERNEL=stream
    y = torch.ops.llm_kernels.skinny_gemm(x, w, None, activation, False)
    assert rel_err(y, ref) < TOL[dtype]
    monkeypatch.setenv("LLMK_GEMM_KERNEL", "bogus")
    with pytest.raises(ValueError, match=r"LLMK_GEMM_KERNEL: expected deep, mma, stream, tma, tma@SHAPES, portable or default, got 'bogus'"):
        torch.ops.llm_kernels.skinny_gemm(x, w, None, activation, False)


def test_portable_gemm_rule(monkeypatch):
    """Where the skinny GEMM would run its portable kernel (AMD; here CPU tensors stand in for GPU
    ones, with the device's capability replaced), the rule says so, and it traces inside
    torch.compile(fullgraph=True) as a kernelized layer's Linear does."""
    monkeypatch.setattr(decode, "_device_major", lambda device: 9)
    monkeypatch.delenv("LLMK_GEMM_KERNEL", raising=False)
    monkeypatch.delenv("LLMK_GEMM_PORTABLE", raising=False)
    x, w = torch.randn(5, 64, dtype=torch.bfloat16), torch.randn(32, 64, dtype=torch.bfloat16)
    monkeypatch.setattr(decode, "_GPU_BACKEND", "hip")
    assert decode._runs_portable_gemm(x, w)
    monkeypatch.setattr(decode, "_GPU_BACKEND", "cuda")
    assert not decode._runs_portable_gemm(x, w)
    assert decode._runs_portable_gemm(x.float(), w.float())  # fp32 runs the portable kernel
    odd = torch.randn(5, 68, dtype=torch.bfloat16)[:, :64]
    assert decode._runs_portable_gemm(x[:, :60], w[:, :60])  # K rules out 8-element loads
    assert decode._runs_portable_gemm(odd, w)  # so does a row stride of 68
    monkeypatch.setattr(decode, "_device_major", lambda device: 7)
    assert decode._runs_portable_gemm(x, w)
    monkeypatch.setattr(decode, "_device_major", lambda device: 9)
    monkeypatch.setenv("LLMK_GEMM_PORTABLE", "1")
    assert decode._runs_portable_gemm(x, w)
    monkeypatch.setenv("LLMK_GEMM_KERNEL", "deep")  # a named kernel wins over the older switch
    assert not decode._runs_portable_gemm(x, w)
    monkeypatch.setenv("LLMK_GEMM_KERNEL", "portable")
    assert decode._runs_portable_gemm(x, w)
    monkeypatch.delenv("LLMK_GEMM_KERNEL")
    monkeypatch.delenv("LLMK_GEMM_PORTABLE")
    rule = torch.compile(lambda x: torch.tensor(decode._runs_portable_gemm(x, w)), fullgraph=True, backend="eager")
    assert not rule(x).item() and rule(odd).item()
    torch._dynamo.reset()
    # the row limits: CPU tensors keep 16; 2 rows never pay for the check
    assert decode.skinny_takes(torch.randn(16, 64), w) and not decode.skinny_takes(torch.randn(17, 64), w)
    monkeypatch.setattr(decode, "_runs_portable_gemm", lambda x, w: pytest.fail("checked at 2 rows"))
    assert decode.skinny_takes(torch.randn(2, 64), w)


@pytest.mark.skipif(not HAS_GPU, reason="no GPU on this machine: GPU case not run")
def test_linear_keeps_the_portable_gemm_to_two_rows(monkeypatch):
    """With the portable kernel forced (as on AMD), decode.Linear runs F.linear past 2 rows (bit for
    bit its result) and the skinny kernel up to 2; without it, the skinny kernel up to 16."""
    lin = decode.Linear.from_module(torch.nn.Linear(512, 96, bias=True).cuda().to(torch.bfloat16))
    monkeypatch.setenv("LLMK_GEMM_KERNEL", "portable")
    for rows in (1, 2, 3, 16):
        x = torch.randn(rows, 512, device="cuda", dtype=torch.bfloat16)
        assert decode.skinny_takes(x, lin.weight) == (rows <= decode.PORTABLE_MAX_ROWS)
        with torch.no_grad():
            y = lin(x)
        if rows > decode.PORTABLE_MAX_ROWS:
            assert torch.equal(y, F.linear(x, lin.weight, lin.bias))
        ref = decode.skinny_gemm_ref(x.double(), lin.weight.double(), lin.bias.double(), None)
        assert rel_err(y, ref) < TOL[torch.bfloat16]
    monkeypatch.delenv("LLMK_GEMM_KERNEL")
    assert decode.skinny_takes(torch.randn(16, 512, device="cuda", dtype=torch.bfloat16), lin.weight)


def test_skinny_gemm_3d_and_opcheck_and_compile(device):
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    x = torch.randn(2, 3, 64, device=device, dtype=dtype)
    w = torch.randn(48, 64, device=device, dtype=dtype)
    b = torch.randn(48, device=device, dtype=dtype)
    torch.library.opcheck(torch.ops.llm_kernels.skinny_gemm, (x, w, b, "none", False))
    torch.library.opcheck(torch.ops.llm_kernels.skinny_gemm, (x, w, None, "swiglu", False))
    torch.library.opcheck(torch.ops.llm_kernels.skinny_gemm, (x, w, None, "geglu_tanh", False))
    f = torch.compile(lambda x, w, b: lk.skinny_gemm(x, w, b, "swiglu"), fullgraph=True)
    assert rel_err(f(x, w, b), decode.skinny_gemm_ref(x.double(), w.double(), b.double(), "swiglu")) < TOL[dtype] * 2


@pytest.mark.parametrize("M", [1, 5, 16, 20])
@pytest.mark.parametrize("K,N", [(256, 72), (77, 14), (2048, 3072)])
@pytest.mark.parametrize("activation", [None, "swiglu", "geglu_tanh"])
def test_skinny_gemm_fusions_match_float64_and_the_chain(device, M, K, N, activation):
    """RMSNorm prologue and residual epilogue: against float64, and no less accurate than the chain
    of our separate ops (rms_norm, skinny_gemm, add). (Not bitwise: bf16 on the tensor-core kernels
    rounds x * w and applies the rstd after the product, src/gemm/gemm_gpu.cu.)"""
    for dtype in dtypes_for(device):
        x = torch.randn(M, K, device=device, dtype=dtype) * 3
        nw = torch.randn(K, device=device, dtype=dtype)
        w = torch.randn(N, K, device=device, dtype=dtype) / K**0.5
        b = torch.randn(N, device=device, dtype=dtype)
        n_out = N // 2 if activation else N
        res = torch.randn(M, n_out, device=device, dtype=dtype) * 2
        for offset in (0.0, 1.0):
            poison_allocator(device, M * N * 4)
            y = lk.skinny_gemm(x, w, b, activation, norm_weight=nw, norm_eps=1e-5, norm_offset=offset, residual=res)
            ref = decode.skinny_gemm_ref(x.double(), w.double(), b.double(), activation, norm_weight=nw.double(),
                                         norm_eps=1e-5, norm_offset=offset, residual=res.double())
            chain = res + lk.skinny_gemm(ops.rms_norm(x, nw, 1e-5, offset), w, b, activation)
            assert y.shape == ref.shape and y.dtype == dtype
            assert rel_err(y, ref) < TOL[dtype], (dtype, offset)
            assert rel_err(y, ref) <= 1.25 * rel_err(chain, ref) + 1e-5, (dtype, offset)
        # each fusion alone
        y = lk.skinny_gemm(x, w, None, activation, norm_weight=nw)
        assert rel_err(y, decode.skinny_gemm_ref(x.double(), w.double(), None, activation, norm_weight=nw.double())) < TOL[dtype]
        y = lk.skinny_gemm(x, w, None, activation, residual=res)
        assert rel_err(y, decode.skinny_gemm_ref(x.double(), w.double(), None, activation, residual=res.double())) < TOL[dtype]


@pytest.mark.skipif(not HAS_GPU, reason="no GPU on this machine: GPU case not run")
@pytest.mark.parametrize("dtype", GPU_DTYPES)
def test_skinny_gemm_fusions_every_gpu_kernel(dtype, monkeypatch):
    """The fusions on deep, mma, stream (handed to mma) and portable, at the 1B model's decode shapes
    (qkv with the input norm, o and down with the residual, gate/up with the post-attention norm)."""
    for K, N, act, norm, residual in ((2048, 3072, "none", True, False), (2048, 2048, "none", False, True),
                                      (2048, 16384, "swiglu", True, False), (8192, 2048, "none", False, True),
                                      (520, 96, "none", True, True), (520, 96, "swiglu", True, True)):
        for M in (1, 7, 12):
            x = torch.randn(M, K, device="cuda", dtype=dtype)
            nw = torch.rand(K, device="cuda", dtype=dtype) + 0.5 if norm else None
            w = torch.randn(N, K, device="cuda", dtype=dtype) / K**0.5
            n_out = N // 2 if act == "swiglu" else N
            res = torch.randn(M, n_out, device="cuda", dtype=dtype) if residual else None
            ref = decode.skinny_gemm_ref(x.double(), w.double(), None, act if act != "none" else None,
                                         norm_weight=None if nw is None else nw.double(),
                                         residual=None if res is None else res.double())
            for kernel, portable in (("deep", False), ("mma", False), ("stream", False), ("mma", True)):
                monkeypatch.setenv("LLMK_GEMM_KERNEL", kernel)
                poison_allocator("cuda", M * N * 4)
                y = torch.ops.llm_kernels.skinny_gemm(x, w, None, act, portable, nw, 1e-6, 0.0, res)
                assert rel_err(y, ref) < TOL[dtype], (K, N, act, M, kernel, portable)
                # a fixed weight (the deep kernel reads its first trip before the PDL wait): same bits
                poison_allocator("cuda", M * N * 4)
                y_fixed = torch.ops.llm_kernels.skinny_gemm(x, w, None, act, portable, nw, 1e-6, 0.0, res,
                                                            fixed_weight=True)
                assert torch.equal(y_fixed, y), (K, N, act, M, kernel, portable)


@pytest.mark.skipif(not HAS_GPU, reason="no GPU on this machine: GPU case not run")
def test_skinny_gemm_weight_written_by_the_kernel_before():
    """A weight that the kernel just before writes (our rms_norm, which lets the next kernel launch
    at its start): skinny_gemm without fixed_weight reads it only after its PDL wait, so every call
    sees the new weight. 40 calls back to back, each after a new rms_norm into a fresh weight. (A
    race: whether fixed_weight=True, the wrong promise here, would show mismatches is not known.)"""
    K, N = 4096, 4096
    x = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
    g = torch.rand(K, device="cuda", dtype=torch.bfloat16) + 0.5
    outs, weights = [], []
    for i in range(40):
        a = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
        torch.cuda.synchronize()  # a's fill done: only rms_norm -> skinny_gemm run back to back
        w = ops.rms_norm(a, g)
        outs.append(lk.skinny_gemm(x, w))
        weights.append(w)
    torch.cuda.synchronize()
    for i, (y, w) in enumerate(zip(outs, weights)):
        assert torch.equal(y, lk.skinny_gemm(x, w)), i


def _gemm_chain(x, chain):
    """Each (weight, activation) of `chain` applied to the one before's output (fixed weights, as
    kernelize passes them), every output kept: a chain of dependent launches for the PDL tests."""
    y, outs = x, []
    for w, act in chain:
        y = lk.skinny_gemm(y, w, activation=act, fixed_weight=True)
        outs.append(y)
    return outs


@pytest.mark.skipif(not HAS_GPU, reason="no GPU on this machine: GPU case not run")
def test_skinny_gemm_pdl_trigger_placement_keeps_the_bits(monkeypatch):
    """LLMK_GEMM_PDL_LATE moves only the deep kernel's PDL trigger (after the streaming loop, at
    the start, at the start where the grid is one wave, of 16-warp launches only, or for some
    roles only, as the default does for gate/up and 16-warp launches): a chain of GEMMs, each
    reading the one before's output (one-wave and multi-wave plans: N = 26624 at K = 2048 takes
    sk = 8 over several waves; K = 26624, N = 2048 one 16-warp block per SM), gives the same bits
    under all of them, and matches float64; a value it does not know is an error, not the default."""
    torch.manual_seed(0)
    K, N = 2048, 26624
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
          for n, k in ((N, K), (K, N), (K, K), (3 * K, K))]
    x = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
    modes = ("1", "", "0", "wave", "wide", "early:plain", "early:rope,gated", "early:gated+wide")  # "": the default
    runs = {}
    for mode in modes:
        monkeypatch.setenv("LLMK_GEMM_PDL_LATE", mode)
        runs[mode] = _gemm_chain(x, [(w, None) for w in ws])
    ref = x.double()
    for i, w in enumerate(ws):
        ref = ref @ w.double().t()
        assert rel_err(runs["1"][i], ref) < TOL[torch.bfloat16], i
        ref = runs["1"][i].double()  # each step against its own bf16 input
        for mode in modes[1:]:
            assert torch.equal(runs[mode][i], runs["1"][i]), (mode, i)
    for bad in ("late", "early:", "early:plain,head", "early:gated,", "early:wide", "wide+", "early:gated+head"):
        monkeypatch.setenv("LLMK_GEMM_PDL_LATE", bad)
        with pytest.raises(ValueError, match="LLMK_GEMM_PDL_LATE: expected"):
            lk.skinny_gemm(x, ws[2], fixed_weight=True)


@pytest.mark.skipif(not HAS_GPU, reason="no GPU on this machine: GPU case not run")
def test_tma_gemm_trigger_placement_keeps_the_bits(monkeypatch):
    """LLMK_GEMM_TMA_PDL_LATE moves only the TMA kernel's PDL trigger (0: at its start; 1, the
    default: after each block's last W stage): a decode-like chain (a SwiGLU gate/up, its down
    projection, a square GEMM, each reading the one before's output), with the TMA kernel everywhere
    or only for gate/up (LLMK_GEMM_KERNEL=tma@..., the deep kernel next to it, as in the 8b model
    where the TMA gate/up lost), gives the same bits with either placement, with W's L2 lines plain
    or evict-first (LLMK_GEMM_TMA_W_EVICT_FIRST 0 or 1, the default), with the defaults and with the
    4-stage ring (LLMK_GEMM_TMA_STAGES=4), and matches float64. (Where the TMA kernel does not
    apply, off Hopper, the non-TMA default runs every way.)"""
    torch.manual_seed(0)
    K, inter = 2048, 8192
    gate_up = torch.randn(2 * inter, K, device="cuda", dtype=torch.bfloat16) / K ** 0.5
    down = torch.randn(K, inter, device="cuda", dtype=torch.bfloat16) / inter ** 0.5
    square = torch.randn(K, K, device="cuda", dtype=torch.bfloat16) / K ** 0.5
    x = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
    chain = ((gate_up, "swiglu"), (down, None), (square, None))
    for kernel in ("tma", f"tma@{K}x{2 * inter}"):
        monkeypatch.setenv("LLMK_GEMM_KERNEL", kernel)
        monkeypatch.delenv("LLMK_GEMM_TMA_PDL_LATE", raising=False)
        monkeypatch.delenv("LLMK_GEMM_TMA_W_EVICT_FIRST", raising=False)
        default = _gemm_chain(x, chain)
        monkeypatch.setenv("LLMK_GEMM_TMA_W_EVICT_FIRST", "0")  # W's L2 lines plain
        monkeypatch.setenv("LLMK_GEMM_TMA_PDL_LATE", "0")
        start = _gemm_chain(x, chain)
        monkeypatch.setenv("LLMK_GEMM_TMA_PDL_LATE", "1")
        late = _gemm_chain(x, chain)
        monkeypatch.setenv("LLMK_GEMM_TMA_W_EVICT_FIRST", "1")  # W's L2 lines evict-first
        hinted = _gemm_chain(x, chain)
        monkeypatch.setenv("LLMK_GEMM_TMA_STAGES", "4")  # the 4-stage ring: the same steps in order
        four = _gemm_chain(x, chain)
        monkeypatch.delenv("LLMK_GEMM_TMA_STAGES")
        y = x
        for i, (w, act) in enumerate(chain):
            ref = decode.skinny_gemm_ref(y.double(), w.double(), None, act)
            assert rel_err(start[i], ref) < TOL[torch.bfloat16], (kernel, i)
            for other in (late, hinted, default, four):
                assert torch.equal(other[i], start[i]), (kernel, i)
            y = start[i]  # each step against its own bf16 input


def test_skinny_gemm_fusions_opcheck_and_bad_input(device):
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    x = torch.randn(2, 3, 64, device=device, dtype=dtype)
    w = torch.randn(48, 64, device=device, dtype=dtype)
    nw = torch.randn(64, device=device, dtype=dtype)
    res = torch.randn(2, 3, 48, device=device, dtype=dtype)
    torch.library.opcheck(torch.ops.llm_kernels.skinny_gemm, (x, w, None, "none", False, nw, 1e-5, 0.0, res))
    torch.library.opcheck(torch.ops.llm_kernels.skinny_gemm, (x, w, None, "swiglu", False, nw, 1e-5, 1.0, res[..., :24]))
    torch.library.opcheck(torch.ops.llm_kernels.skinny_gemm, (x, w, None, "none", False, nw, 1e-5, 0.0, res, True))
    with pytest.raises(ValueError, match=r"norm_weight: expected shape \(64\) \(the last dim of x\), got \(63\)"):
        lk.skinny_gemm(x, w, norm_weight=nw[:63])
    with pytest.raises(ValueError, match=r"residual: expected shape \(2, 3, 48\) \(the shape of out\), got \(2, 3, 24\)"):
        lk.skinny_gemm(x, w, residual=res[..., :24])
    with pytest.raises(ValueError, match=r"norm_eps: expected a finite value >= 0"):
        lk.skinny_gemm(x, w, norm_weight=nw, norm_eps=-1.0)


def test_skinny_gemm_bad_input():
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match=r"weight: expected shape \(out_features, 64\)"):
        lk.skinny_gemm(x, torch.randn(10, 63))
    with pytest.raises(TypeError, match=r"weight: expected dtype float32 \(the dtype of x\), got float16"):
        lk.skinny_gemm(x, torch.randn(10, 64).half())
    with pytest.raises(ValueError, match=r"bias: expected shape \(10\)"):
        lk.skinny_gemm(x, torch.randn(10, 64), torch.randn(9))
    with pytest.raises(ValueError, match=r"an even number of rows for swiglu"):
        lk.skinny_gemm(x, torch.randn(9, 64), activation="swiglu")
    with pytest.raises(ValueError, match=r"an even number of rows for geglu_tanh"):
        lk.skinny_gemm(x, torch.randn(9, 64), activation="geglu_tanh")
    with pytest.raises(ValueError, match=r"activation: expected None, 'none', 'swiglu' or 'geglu_tanh'"):
        lk.skinny_gemm(x, torch.randn(10, 64), activation="gelu")


def test_linear_drop_in(device):
    dtype = torch.float16 if device == "cuda" else torch.float32
    torch.manual_seed(0)
    ref = torch.nn.Linear(96, 40, device=device, dtype=dtype)
    ours = Linear(96, 40, device=device, dtype=dtype)
    ours.load_state_dict(ref.state_dict())
    assert list(ours.state_dict()) == ["weight", "bias"] and isinstance(ours, torch.nn.Linear)
    shared = Linear.from_module(ref)
    assert shared.weight is ref.weight and shared.bias is ref.bias
    with torch.no_grad():
        for rows in (1, 7, 16, 33):
            x = torch.randn(rows, 96, device=device, dtype=dtype)
            want = F.linear(x.double(), ref.weight.double(), ref.bias.double())
            assert rel_err(ours(x), want) < TOL[dtype] * 2
            assert rel_err(shared(x), want) < TOL[dtype] * 2
    # with autograd it is F.linear, gradients flow
    x = torch.randn(3, 96, device=device, dtype=dtype)
    ours(x).sum().backward()
    assert ours.weight.grad is not None
    with torch.no_grad():
        f = torch.compile(ours, fullgraph=True)
        x = torch.randn(4, 96, device=device, dtype=dtype)
        assert rel_err(f(x), F.linear(x.double(), ref.weight.double(), ref.bias.double())) < TOL[dtype] * 2


def test_decode_cpu_results_do_not_depend_on_threads():
    """The CPU kernel splits (sequence, token, head) rows over torch's threads: no bit changes."""
    k, v, lens_t, table = make_cache(4, 2, 64, [0, 77, 333, 1000], torch.float32, "cpu", block_size=16)
    q = torch.randn(4, 3, 8, 64)
    first, second = at_thread_counts(lambda: lk.decode_attention(q, k, v, lens_t, table))
    assert torch.equal(first, second)
