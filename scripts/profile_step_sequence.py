"""Every kernel of one decode step in launch order with its GPU time (torch.profiler), under each
of several environment settings side by side, for finding which calls of a kernel slow under a
setting (e2e --profile only sums by name). The step runs eager, or with --graph as the replay of a
CUDA graph of it (as the e2e times it: kernels back to back, no launch gaps):

    LLMK_PDL=0 python3 scripts/profile_step_sequence.py --config 8b -- default tma@4096x28672 \
        LLMK_GEMM_KERNEL=tma@4096x28672,LLMK_GEMM_TMA_W_EVICT_FIRST=1

A setting is "default", an LLMK_GEMM_KERNEL value, or NAME=VALUE pairs joined by commas (as
scripts/e2e_ab.py takes them; each starts from the environment the script was started with). The
switches must be ones read per call: one model is built and kernelized, and each setting runs a few
warm-up steps, then the profiled one. Prints each launch's time per setting (the names of the
first setting, and any other's where it differs), then the calls whose time differs from the first
setting's by more than --threshold us, then the totals by kernel name.
"""
import argparse
import dataclasses
import os
import statistics
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from e2e_ab import apply_in_process, kernel_name
from llm_kernels import e2e

ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("--config", default="8b")
ap.add_argument("--variant", default="kernelized_fused")
ap.add_argument("--device", default="cuda", help="cpu: the ops of a CPU step instead (a dry run of this script)")
ap.add_argument("--threshold", type=float, default=2.0, help="us: list the calls that differ by more")
ap.add_argument("--all", action="store_true", help="print every launch, not only the differing ones")
ap.add_argument("--graph", action="store_true", help="profile the replay of a CUDA graph of the step (cuda only)")
ap.add_argument("settings", nargs="*", default=["default"])
args = ap.parse_args()

cuda = args.device == "cuda"
sync = torch.cuda.synchronize if cuda else (lambda: None)
s = dataclasses.replace(e2e.Settings(), config=args.config, device=args.device, context=128)
model = e2e.build_model(s.config, s.device, e2e.DTYPES[s.dtype], family=s.family)
fn = e2e.activate(model, args.variant, s=s)
prompt = torch.randint(0, model.config.vocab_size, (1, s.context), device=args.device)
base_env = dict(os.environ)


def one_step():
    """[(kernel name, us)] of one step after three warm-up steps (and, with --graph, two replays),
    in launch order."""
    loop = e2e.DecodeLoop(model, fn, prompt, max_len=s.context + 16, step_mask=s.step_mask)
    for _ in range(3):
        loop.step()
    run = loop.step
    if args.graph:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            loop.step()
        for _ in range(2):
            graph.replay()
        run = graph.replay
    sync()
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        run()
        sync()
    kind = torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU
    evs = sorted((e for e in prof.events() if e.device_type == kind), key=lambda e: e.time_range.start)
    return [(kernel_name(e.name), e.time_range.elapsed_us()) for e in evs]


runs = {}
for setting in args.settings:
    apply_in_process(setting, base_env)
    runs[setting] = one_step()

n = max(len(r) for r in runs.values())
print(f"{'#':>4}  " + "  ".join(f"{st[:22]:>22}" for st in args.settings) + "  kernel (first setting's; others' if they differ)")
for i in range(n):
    row = [runs[st][i] if i < len(runs[st]) else ("-", float("nan")) for st in args.settings]
    base = row[0][1]
    differs = any(abs(t - base) > args.threshold for _, t in row[1:])
    if args.all or differs:
        names = row[0][0][:70] + "".join(f" | {nm[:50]}" for nm, _ in row[1:] if nm != row[0][0])
        print(f"{i:4d}  " + "  ".join(f"{t:22.2f}" for _, t in row) + f"  {names}" + ("  <" if differs else ""))
print("\nlaunches per step: " + ", ".join(f"{st}: {len(r)}" for st, r in runs.items()))
print("totals by kernel name, us per step (calls; median us per call):")
for st, r in runs.items():
    by = defaultdict(list)
    for nm, t in r:
        by[nm].append(t)
    print(f"  {st}: {sum(t for _, t in r):.1f} us")
    for nm, ts in sorted(by.items(), key=lambda kv: -sum(kv[1]))[:8]:
        print(f"    {sum(ts):9.1f}  ({len(ts):3d}; {statistics.median(ts):7.2f})  {nm[:90]}")
