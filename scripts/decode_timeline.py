"""Per-block phase timeline of batch-1 decode attention (32 query / 8 KV heads, D 128, bf16,
contiguous cache, the plan's splits): each call follows a 256 MB write that flushes L2. Needs a
build with scripts/patches/decode-timeline.patch applied and LLMK_DECODE_TRACE=1, which makes the
library print the phases' percentiles (us from the earliest block) to stderr after each launch:

    git apply scripts/patches/decode-timeline.patch    # then build as usual
    LLMK_DECODE_TRACE=1 LLMK_PDL=0 PYTHONPATH=python python3 scripts/decode_timeline.py --kv 16384,4096

bench/results/h200-diagnostics-2026-12-03-1830.md reads one such run.
"""
import argparse

import torch

from llm_kernels import decode

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("--kv", default="16384,4096,32768", help="KV lengths, comma-separated")
ap.add_argument("--calls", type=int, default=3, help="calls per length (the first warms up)")
a = ap.parse_args()
H, Hkv, D, dt = 32, 8, 128, torch.bfloat16
flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
for kv in (int(v) for v in a.kv.split(",")):
    q = torch.randn(1, 1, H, D, device="cuda", dtype=dt)
    k = torch.randn(1, Hkv, kv, D, device="cuda", dtype=dt)
    v = torch.randn_like(k)
    lens = torch.full((1,), kv, dtype=torch.int32, device="cuda")
    for i in range(a.calls):
        flush.zero_()
        torch.cuda.synchronize()
        print(f"== kv {kv} call {i}", flush=True)
        decode.decode_attention(q, k, v, lens)
        torch.cuda.synchronize()
