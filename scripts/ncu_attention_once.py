"""A few attention forward calls of one shape after a warm-up, the last one inside an NVTX range
"profile", for Nsight Compute's warp-stall breakdown of a Hopper tiling (LLMK_ATTENTION_HOPPER_CONFIG
picks one) or of a PyTorch SDPA backend beside it (--impl), e.g.

    LLMK_ATTENTION_HOPPER_CONFIG=ws_pp ncu --nvtx --nvtx-include "profile/" --set full \\
        --clock-control none -o ws_pp python scripts/ncu_attention_once.py --shape 1,32,4096,128
    ncu --nvtx --nvtx-include "profile/" --set full --clock-control none -o cudnn \\
        python scripts/ncu_attention_once.py --shape 1,32,4096,128 --impl cudnn

--device cpu runs the same calls on the CPU kernel (fp32), a smoke test of the script itself.
"""
import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from llm_kernels import flash

SDPA_BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("--shape", default="1,32,4096,128", help="B,H,S,D")
ap.add_argument("--causal", action="store_true")
ap.add_argument("--dtype", choices=("fp16", "bf16"), default="fp16", help="on the GPU (the CPU runs fp32)")
ap.add_argument("--device", default="cuda")
ap.add_argument("--impl", choices=("ours", *SDPA_BACKENDS), default="ours")
ap.add_argument("--calls", type=int, default=4, help="warm-up included")
a = ap.parse_args()
b, h, s, d = (int(x) for x in a.shape.split(","))
dtype = torch.float32 if a.device == "cpu" else {"fp16": torch.float16, "bf16": torch.bfloat16}[a.dtype]
q, k, v = (torch.randn(b, h, s, d, device=a.device, dtype=dtype) for _ in range(3))


def call():
    if a.impl == "ours":
        return flash.attention(q, k, v, causal=a.causal)
    with sdpa_kernel(SDPA_BACKENDS[a.impl]):
        return F.scaled_dot_product_attention(q, k, v, is_causal=a.causal)


for i in range(a.calls):
    if i == a.calls - 1:
        torch.cuda.nvtx.range_push("profile")
    out = call()
    if i == a.calls - 1:
        torch.cuda.nvtx.range_pop()
if a.device != "cpu":
    torch.cuda.synchronize()
print(f"{a.calls} calls of {a.impl} attention{tuple(out.shape)} {dtype} causal={a.causal} on {a.device}")
