"""Per-kernel GPU times of the Monarch forward (torch.profiler over --iters calls), to see where a
row's time goes (stage GEMMs, permutation passes, cluster kernels):

    PYTHONPATH=python python3 scripts/profile_monarch.py --rows 4096x16x16384,8192x64x16384

Rows are NxBLOCKSxTOKENS (square blocks), bf16; --backward adds the autograd backward. Set
LLMK_MONARCH_* switches in the environment to profile another path. --flush zeroes 256 MB before
every call, as triton's do_bench does, so that the factors come from HBM (the zeroing kernel is
listed too); --dense profiles F.linear with an n x n weight beside it. "host" is the wall time per
call of --iters calls issued back to back and synchronised once: where it exceeds the GPU time, a
timer that waits on events measures the host.
"""

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from llm_kernels import monarch as M
from llm_kernels.bench_monarch import row_inputs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="4096x16x16384,4096x4x16384,8192x64x16384")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--backward", action="store_true", help="profile forward + backward (autograd) instead")
    ap.add_argument("--flush", action="store_true", help="zero 256 MB before every call (cold L2)")
    ap.add_argument("--dense", action="store_true", help="profile F.linear with an n x n weight too")
    args = ap.parse_args()
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda") if args.flush else None
    for row in args.rows.split(","):
        n, blocks, tokens = (int(v) for v in row.split("x"))
        b = n // blocks
        x, w1, w2, wd = row_inputs(n, blocks, tokens)
        if args.backward:
            for t in (x, w1, w2):
                t.requires_grad_(True)
            grad = torch.randn_like(x)

        def call() -> None:
            out = M.monarch_matmul(x, w1, w2)
            if args.backward:
                torch.autograd.grad(out, (x, w1, w2), grad)

        calls = {"monarch": call}
        if args.dense:
            calls["dense"] = lambda: torch.nn.functional.linear(x, wd)
        print(f"== {row}: {2 * tokens * n * b / 1e9:.1f} GFLOP per stage, {tokens * n * 2 / 1e6:.0f} MB per activation")
        for name, fn in calls.items():
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(args.iters):
                fn()
            torch.cuda.synchronize()
            host_us = (time.perf_counter() - t0) / args.iters * 1e6
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(args.iters):
                    if flush is not None:
                        flush.zero_()
                    fn()
                torch.cuda.synchronize()
            print(f" {name}: host {host_us:.1f} us per call")
            for e in prof.key_averages():
                if e.device_type.name == "CUDA" and e.count >= args.iters:
                    print(f"  {e.count // args.iters} per call, {e.device_time_total / e.count:9.1f} us  {e.key[:110]}")


if __name__ == "__main__":
    main()
