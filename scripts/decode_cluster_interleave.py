"""Where the clustered decode-attention split merge loses inside a model step (docs/next-steps.md
item 1): the 1B step's attention (32 / 8 heads, D 64, a 203-slot cache with HF's mask at 160) at
forced split counts, timed per call in one CUDA graph of `--layers` calls over distinct caches,
(a) back to back, as decode_split_sweep.py times it, and (b) with a skinny GEMM over a distinct
2048 x 2048 weight before each call (a non-cluster kernel between the cluster launches, as in the
model step). 4 splits merge in a cluster on the H200; `--workspace-merge` sets
LLMK_DECODE_CLUSTER=0 for the whole run (the same splits merged through the workspace).

    PYTHONPATH=python python3 scripts/decode_cluster_interleave.py [--splits 1,4] [--workspace-merge]

On 2026-12-04 the whole 1B decode lost 979 against 1138 tok/s with 4 clustered splits at this
cache (142 us a step, ~9 us a layer) while the kernel alone was faster (6.4 against 7.3 us a call
back to back). If (b) - (a) grows with clustered splits, the cost is in mixing cluster and
non-cluster launches in a graph. Prints us per call; `--device cpu` runs the calls once each
(a smoke test of the script: the CPU has no splits and no graphs).
"""
from __future__ import annotations

import argparse
import os

import torch

from llm_kernels import bench, decode


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--splits", default="1,4", help="comma-separated split counts (0: the plan's)")
    ap.add_argument("--layers", type=int, default=16, help="calls per graph, each over its own cache and weight")
    ap.add_argument("--capacity", type=int, default=203)
    ap.add_argument("--visible", type=int, default=160, help="keys the mask leaves visible")
    ap.add_argument("--workspace-merge", action="store_true", help="LLMK_DECODE_CLUSTER=0 for every call")
    ap.add_argument("--device", default="cuda")
    a = ap.parse_args()
    if a.workspace_merge:
        os.environ["LLMK_DECODE_CLUSTER"] = "0"
    dev, dt = a.device, torch.bfloat16 if a.device == "cuda" else torch.float32
    H, Hkv, D, hidden = 32, 8, 64, 2048
    gen = torch.Generator(device="cpu").manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(dev, dt)

    q = rand(1, 1, H, D)
    caches = [(rand(1, Hkv, a.capacity, D), rand(1, Hkv, a.capacity, D)) for _ in range(a.layers)]
    weights = [rand(hidden, hidden) * hidden**-0.5 for _ in range(a.layers)]
    x = rand(1, hidden)
    lens = torch.full((1,), a.capacity, dtype=torch.int32, device=dev)
    mask = torch.zeros(1, 1, a.capacity, device=dev, dtype=dt)
    mask[..., a.visible:] = torch.finfo(dt).min

    for splits in (int(s) for s in a.splits.split(",")):
        ws = torch.zeros(max(decode.decode_workspace_size(q, caches[0][0], num_splits=splits), 1), dtype=torch.uint8,
                         device=dev)

        def attend(i: int) -> torch.Tensor:
            return decode.decode_attention(q, *caches[i], lens, num_splits=splits, workspace=ws, attn_mask=mask)

        def alone() -> None:
            for i in range(a.layers):
                attend(i)

        def between() -> None:
            for i in range(a.layers):
                decode.skinny_gemm(x, weights[i], fixed_weight=True)
                attend(i)

        def gemms() -> None:
            for i in range(a.layers):
                decode.skinny_gemm(x, weights[i], fixed_weight=True)

        if dev != "cuda":
            alone(), between()
            print(f"splits {splits}: ran on {dev}")
            continue
        times = {name: bench.graph_us_per_call(fn, a.layers) for name, fn in (("alone", alone), ("between", between),
                                                                               ("gemms", gemms))}
        print(f"splits {splits}: attention alone {times['alone']:.2f} us/call; with a GEMM before each "
              f"{times['between']:.2f} us/call, GEMM alone {times['gemms']:.2f}, so the attention adds "
              f"{times['between'] - times['gemms']:.2f}", flush=True)


if __name__ == "__main__":
    main()
