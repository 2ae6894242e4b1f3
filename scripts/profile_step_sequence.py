"""Every kernel of one eager decode step in launch order with its GPU time (torch.profiler), for
finding which call of a kernel name slows under a setting (e2e --profile only sums by name).

    LLMK_PDL=0 python3 scripts/profile_step_sequence.py --config 8b [--grep gemm]
"""
import argparse
import dataclasses

import torch
from torch.profiler import ProfilerActivity, profile

from llm_kernels import e2e

ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("--config", default="8b")
ap.add_argument("--variant", default="kernelized_fused")
ap.add_argument("--grep", default="", help="only kernels whose name contains this")
ap.add_argument("--device", default="cuda", help="cpu: the ops of a CPU step instead (a dry run of this script)")
args = ap.parse_args()

s = dataclasses.replace(e2e.Settings(), config=args.config, device=args.device, context=128)
cuda = args.device == "cuda"
sync = torch.cuda.synchronize if cuda else (lambda: None)
model = e2e.build_model(s.config, s.device, e2e.DTYPES[s.dtype], family=s.family)
fn = e2e.activate(model, args.variant, s=s)
prompt = torch.randint(0, model.config.vocab_size, (1, s.context), device=args.device)
loop = e2e.DecodeLoop(model, fn, prompt, max_len=s.context + 16, step_mask=s.step_mask)
for _ in range(3):
    loop.step()
sync()
with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
    loop.step()
    sync()
kind = torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU
evs = sorted((e for e in prof.events() if e.device_type == kind), key=lambda e: e.time_range.start)
for e in evs:
    name = e.name.split("(")[0].replace("void llmk::detail::(anonymous namespace)::", "")
    if args.grep in name:
        print(f"{e.time_range.elapsed_us():8.2f}  {name[:90]}")
