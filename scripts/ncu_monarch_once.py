"""A few Monarch forward calls of one row (square blocks, bf16) after a warm-up, for Nsight Compute
(the pipelined cluster kernel at the headline row by default), e.g.

    ncu --kernel-name regex:monarch_pipe --launch-skip 2 --launch-count 1 --set full \\
        --import-source no --clock-control none -o pipe python scripts/ncu_monarch_once.py
    ncu --import pipe.ncu-rep --page source --csv --print-source sass > pipe.csv
    python scripts/ncu_stalls.py pipe.csv

LLMK_MONARCH_* switches pick the path as usual (e.g. LLMK_MONARCH_CLUSTER=0: the tiled kernels).
--device cpu runs the same calls on the CPU (fp32), a smoke test of the script itself.
"""
import argparse
import math

import torch

from llm_kernels import monarch

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("--row", default="4096x64x16384", help="NxBLOCKSxTOKENS (square blocks of N / BLOCKS)")
ap.add_argument("--device", default="cuda")
ap.add_argument("--calls", type=int, default=3, help="warm-up included")
a = ap.parse_args()
n, blocks, tokens = (int(v) for v in a.row.split("x"))
b = n // blocks
dtype = torch.float32 if a.device == "cpu" else torch.bfloat16
x = torch.randn(tokens, n, device=a.device, dtype=dtype)
w1 = torch.randn(blocks, b, b, device=a.device, dtype=dtype) / math.sqrt(b)
w2 = torch.randn(blocks, b, b, device=a.device, dtype=dtype) / math.sqrt(b)
with torch.inference_mode():
    for _ in range(a.calls):
        out = monarch.monarch_matmul(x, w1, w2)
if a.device != "cpu":
    torch.cuda.synchronize()
print(f"{a.calls} calls of monarch_matmul{tuple(x.shape)} -> {tuple(out.shape)} {dtype} on {a.device}")
