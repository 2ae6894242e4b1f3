"""Per-block phase timeline of batch-1 decode attention (32 query / 8 KV heads, D 128, bf16,
contiguous cache, the plan's splits): each call follows a 256 MB write that flushes L2. Needs a
build with scripts/patches/decode-timeline.patch applied and LLMK_DECODE_TRACE=1, which makes the
library print the phases' percentiles (us from the earliest block) to stderr after each launch:

    git apply scripts/patches/decode-timeline.patch    # then build as usual
    LLMK_DECODE_TRACE=1 LLMK_PDL=0 PYTHONPATH=python python3 scripts/decode_timeline.py --kv 16384,4096

bench/results/h200-diagnostics-2026-12-03-1830.md reads one such run. The 1B model's static-cache
step (head dim 64, 203 slots, Hugging Face's additive mask hiding the slots from 160 on, seq_lens
the whole cache, as kernelize calls it): `--kv 203 --dim 64 --mask-len 160`.
"""
import argparse

import torch

from llm_kernels import decode

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("--kv", default="16384,4096,32768", help="KV lengths, comma-separated")
ap.add_argument("--calls", type=int, default=3, help="calls per length (the first warms up)")
ap.add_argument("--dim", type=int, default=128, help="head dim")
ap.add_argument("--mask-len", type=int, default=0,
                help="an additive mask over the whole cache hiding the keys from this position on (0: none)")
a = ap.parse_args()
H, Hkv, D, dt = 32, 8, a.dim, torch.bfloat16
flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
for kv in (int(v) for v in a.kv.split(",")):
    q = torch.randn(1, 1, H, D, device="cuda", dtype=dt)
    k = torch.randn(1, Hkv, kv, D, device="cuda", dtype=dt)
    v = torch.randn_like(k)
    lens = torch.full((1,), kv, dtype=torch.int32, device="cuda")
    mask = None
    if a.mask_len:
        mask = torch.zeros(1, 1, kv, device="cuda", dtype=dt)
        mask[..., a.mask_len:] = torch.finfo(dt).min
    for i in range(a.calls):
        flush.zero_()
        torch.cuda.synchronize()
        print(f"== kv {kv} call {i}", flush=True)
        decode.decode_attention(q, k, v, lens, attn_mask=mask)
        torch.cuda.synchronize()
