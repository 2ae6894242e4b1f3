"""Per-kernel GPU times of an 8b-shaped MLP chain (o, gate/up SwiGLU, down) over distinct layers'
weights, eager, CUDA events around every launch, under each LLMK_GEMM_KERNEL setting given: which
kernel slows when the TMA kernel runs gate/up (e2e --profile, H100 2026-12-07: the deep kernels'
average rose from 38 to 69 us with tma@4096x28672 while gate/up itself stayed at 82-83 us).

    LLMK_PDL=0 python3 scripts/tma_neighbour_times.py default tma@4096x28672
"""
import argparse
import os
import statistics

import torch

import llm_kernels as lk

ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("settings", nargs="+", help="LLMK_GEMM_KERNEL values ('default' = unset)")
ap.add_argument("--layers", type=int, default=16)
ap.add_argument("--reps", type=int, default=5)
ap.add_argument("--hidden", type=int, default=4096)
ap.add_argument("--inter", type=int, default=14336)
args = ap.parse_args()

H, I, L = args.hidden, args.inter, args.layers
bf = dict(device="cuda", dtype=torch.bfloat16)
layers = [(torch.randn(H, H, **bf) / H ** 0.5, torch.randn(2 * I, H, **bf) / H ** 0.5,
           torch.randn(H, I, **bf) / I ** 0.5) for _ in range(L)]
x0 = torch.randn(1, H, **bf)
names = ("o", "gate_up", "down")


def run_once():
    ev = [[torch.cuda.Event(enable_timing=True) for _ in range(4)] for _ in range(L)]
    h = x0
    for (wo, wgu, wd), e in zip(layers, ev):
        e[0].record()
        a = lk.skinny_gemm(h, wo, residual=h, fixed_weight=True)
        e[1].record()
        u = lk.skinny_gemm(a, wgu, activation="swiglu", fixed_weight=True)
        e[2].record()
        h = lk.skinny_gemm(u, wd, residual=a, fixed_weight=True)
        e[3].record()
    torch.cuda.synchronize()
    return [[e[i].elapsed_time(e[i + 1]) * 1e3 for i in range(3)] for e in ev]


for s in args.settings:
    if s == "default":
        os.environ.pop("LLMK_GEMM_KERNEL", None)
    else:
        os.environ["LLMK_GEMM_KERNEL"] = s
    run_once()
    per = [[] for _ in names]
    for _ in range(args.reps):
        for row in run_once()[1:]:  # layer 0 follows the host's wait: left out
            for i, t in enumerate(row):
                per[i].append(t)
    med = [statistics.median(p) for p in per]
    print(f"{s:>24}: " + "  ".join(f"{n} {m:6.2f} us" for n, m in zip(names, med))
          + f"  layer {sum(med):6.2f} us", flush=True)
