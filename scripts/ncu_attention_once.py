"""A few attention forward calls of one shape after a warm-up, for Nsight Compute's warp-stall
breakdown of a Hopper tiling (LLMK_ATTENTION_HOPPER_CONFIG picks one), e.g.

    LLMK_ATTENTION_HOPPER_CONFIG=ws_pp ncu --kernel-name regex:attention_wgmma_ws --launch-skip 3 \\
        --launch-count 1 --set full -o ws_pp python scripts/ncu_attention_once.py --shape 1,32,4096,128

--device cpu runs the same calls on the CPU kernel (fp32), a smoke test of the script itself.
"""
import argparse

import torch

from llm_kernels import flash

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("--shape", default="1,32,4096,128", help="B,H,S,D")
ap.add_argument("--causal", action="store_true")
ap.add_argument("--dtype", choices=("fp16", "bf16"), default="fp16", help="on the GPU (the CPU runs fp32)")
ap.add_argument("--device", default="cuda")
ap.add_argument("--calls", type=int, default=4, help="warm-up included")
a = ap.parse_args()
b, h, s, d = (int(x) for x in a.shape.split(","))
dtype = torch.float32 if a.device == "cpu" else {"fp16": torch.float16, "bf16": torch.bfloat16}[a.dtype]
q, k, v = (torch.randn(b, h, s, d, device=a.device, dtype=dtype) for _ in range(3))
for _ in range(a.calls):
    out = flash.attention(q, k, v, causal=a.causal)
if a.device != "cpu":
    torch.cuda.synchronize()
print(f"{a.calls} calls of attention{tuple(out.shape)} {dtype} causal={a.causal} on {a.device}")
