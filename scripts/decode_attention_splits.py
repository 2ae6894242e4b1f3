"""The 1B model's decode attention (batch 1, 32 / 8 heads of 64, a static cache of 203 slots holding
160 keys) with HF's mask (seq_lens = capacity) and with exact seq_lens, at forced split counts
(0: the plan's); do_bench (L2 flushed) and one CUDA graph of 16 calls over 16 caches (us per call).
The figures in docs/decode-step-kernel.md come from it (LLMK_DECODE_KERNEL unset, then =warp).

    PYTHONPATH=python python scripts/decode_attention_splits.py
"""
import torch
import triton
from llm_kernels import decode
H, Hkv, D, cap, L = 32, 8, 64, 203, 160
dt = torch.bfloat16
q = torch.randn(1, 1, H, D, device="cuda", dtype=dt)
ks = [torch.randn(1, Hkv, cap, D, device="cuda", dtype=dt) for _ in range(16)]
vs = [torch.randn(1, Hkv, cap, D, device="cuda", dtype=dt) for _ in range(16)]
mask = torch.zeros(1, 1, 1, cap, device="cuda", dtype=dt)
mask[..., L:] = torch.finfo(dt).min
full = torch.full((1,), cap, dtype=torch.int32, device="cuda")
exact = torch.full((1,), L, dtype=torch.int32, device="cuda")
for splits in (0, 1, 2, 3, 4):
    for name, lens, m in (("masked", full, mask), ("seq_lens", exact, None)):
        def one(i=0):
            return decode.decode_attention(q, ks[i], vs[i], lens, attn_mask=m, num_splits=splits)
        ref = decode.decode_attention_ref(q.double(), ks[0].double(), vs[0].double(), exact)
        err = ((one().double() - ref).abs().max() / ref.abs().max()).item()
        db = triton.testing.do_bench(one, warmup=50, rep=300) * 1e3
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for i in range(16):
                one(i)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for i in range(16):
                one(i)
        gt = triton.testing.do_bench(g.replay, warmup=20, rep=300) * 1e3 / 16
        print(f"splits {splits} {name:9s}: do_bench {db:6.1f} us, in a graph {gt:5.2f} us/call, rel err {err:.1e}")
