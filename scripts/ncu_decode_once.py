"""A few decode_attention calls of one issue-5 row (32 query / 8 KV heads, D 128, one token, bf16,
contiguous cache) after a warm-up, for Nsight Compute, e.g.

    ncu --kernel-name regex:decode_mma --launch-skip 2 --launch-count 1 --set full \\
        --import-source no -o dec python scripts/ncu_decode_once.py --batch 1 --kv 4096
    ncu --import dec.ncu-rep --page source --csv --print-source sass > dec.csv
    python scripts/ncu_stalls.py dec.csv

LLMK_DECODE_* switches pick the kernel as usual; --splits forces a split count (0: the plan's).
"""
import argparse

import torch

from llm_kernels import decode

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("--batch", type=int, default=1)
ap.add_argument("--kv", type=int, default=4096, help="keys per sequence")
ap.add_argument("--splits", type=int, default=0)
ap.add_argument("--calls", type=int, default=3, help="warm-up included")
a = ap.parse_args()
H, Hkv, D, dt = 32, 8, 128, torch.bfloat16
q = torch.randn(a.batch, 1, H, D, device="cuda", dtype=dt)
k = torch.randn(a.batch, Hkv, a.kv, D, device="cuda", dtype=dt)
v = torch.randn_like(k)
lens = torch.full((a.batch,), a.kv, dtype=torch.int32, device="cuda")
for _ in range(a.calls):
    out = decode.decode_attention(q, k, v, lens, num_splits=a.splits)
torch.cuda.synchronize()
print(f"{a.calls} calls of decode_attention: batch {a.batch}, {a.kv} keys, splits {a.splits} -> {tuple(out.shape)}")
