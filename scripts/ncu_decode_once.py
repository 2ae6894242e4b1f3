"""One decode_attention call of issue 5's rows (32 / 8 heads, D 128, bf16, contiguous) after a
warm-up, for Nsight Compute: `ncu --kernel-name regex:decode_mma --launch-skip 2 --launch-count 1
python scripts/ncu_decode_once.py --batch 32 --kv 4096`.
"""
import argparse

import torch

from llm_kernels import decode

ap = argparse.ArgumentParser()
ap.add_argument("--batch", type=int, default=32)
ap.add_argument("--kv", type=int, default=4096)
a = ap.parse_args()
q = torch.randn(a.batch, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
k = torch.randn(a.batch, 8, a.kv, 128, device="cuda", dtype=torch.bfloat16)
v = torch.randn_like(k)
lens = torch.full((a.batch,), a.kv, dtype=torch.int32, device="cuda")
for _ in range(3):
    decode.decode_attention(q, k, v, lens)
torch.cuda.synchronize()
