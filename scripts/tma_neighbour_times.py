"""Per-kernel GPU times of an 8b-shaped MLP chain (o, gate/up SwiGLU, down) over distinct layers'
weights, then the head GEMM, eager, CUDA events around every launch, under each setting given:
which kernel slows when the TMA kernel runs gate/up (e2e --profile, H100 2026-12-07: the deep
kernels' average rose from 38 to 69 us with tma@4096x28672 while gate/up itself stayed at 82-83 us).

    LLMK_PDL=0 python3 scripts/tma_neighbour_times.py default tma@4096x28672
"""
import argparse
import os
import statistics

import torch

import llm_kernels as lk
from e2e_ab import apply_in_process

ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("settings", nargs="+",
                help="'default', an LLMK_GEMM_KERNEL value, or VAR=VALUE pairs joined by commas (each setting "
                     "starts from the environment the script was started with)")
ap.add_argument("--layers", type=int, default=16)
ap.add_argument("--reps", type=int, default=5)
ap.add_argument("--hidden", type=int, default=4096)
ap.add_argument("--inter", type=int, default=14336)
ap.add_argument("--vocab", type=int, default=128256, help="the head GEMM after the layers (0: none)")
args = ap.parse_args()

H, I, L = args.hidden, args.inter, args.layers
bf = dict(device="cuda", dtype=torch.bfloat16)
layers = [(torch.randn(H, H, **bf) / H ** 0.5, torch.randn(2 * I, H, **bf) / H ** 0.5,
           torch.randn(H, I, **bf) / I ** 0.5) for _ in range(L)]
x0 = torch.randn(1, H, **bf)
head = torch.randn(args.vocab, H, **bf) / H ** 0.5 if args.vocab > 0 else None
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
    eh = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    if head is not None:
        eh[0].record()
        lk.skinny_gemm(h, head, fixed_weight=True)
        eh[1].record()
    torch.cuda.synchronize()
    head_us = eh[0].elapsed_time(eh[1]) * 1e3 if head is not None else 0.0
    return [[e[i].elapsed_time(e[i + 1]) * 1e3 for i in range(3)] for e in ev], head_us


base_env = dict(os.environ)
for s in args.settings:
    apply_in_process(s, base_env)
    run_once()
    per, heads = [[] for _ in names], []
    for _ in range(args.reps):
        rows, head_us = run_once()
        heads.append(head_us)
        for row in rows[1:]:  # layer 0 follows the host's wait: left out
            for i, t in enumerate(row):
                per[i].append(t)
    med = [statistics.median(p) for p in per]
    print(f"{s:>24}: " + "  ".join(f"{n} {m:6.2f} us" for n, m in zip(names, med))
          + f"  layer {sum(med):6.2f} us  head {statistics.median(heads):7.2f} us", flush=True)
