"""Where the time of a batch-1 decode step goes: the 1B model's 16 decoder layers on our kernels
alone (bench_decode.layer_step), captured in one CUDA graph and replayed under torch.profiler.
Prints each kernel's time per step (device time from CUPTI) and the sum against the step's wall
time: the difference is the gaps between kernels (launch latency inside the graph, ramp-up).

    python scripts/profile_decode_layers.py [--pdl] [--separate] [--steps 20] [--json out.json]

--separate: RMSNorm and residual adds as their own launches (layer_step(fuse=False)).
"""
import argparse
import json
import os
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from llm_kernels import bench
from llm_kernels import bench_decode as bd


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pdl", action="store_true", help="LLMK_PDL=1 at capture")
    ap.add_argument("--separate", action="store_true", help="RMSNorm and adds as separate launches")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--json", help="write the table here")
    args = ap.parse_args()
    os.environ["LLMK_PDL"] = "1" if args.pdl else "0"
    dev, dtype = "cuda", torch.bfloat16
    s = bd.LayerShape()
    gen = torch.Generator(device=dev).manual_seed(0)
    ws = [bd.layer_weights(s, dev, dtype, gen) for _ in range(args.layers)]
    x = torch.randn(1, s.hidden, device=dev, dtype=dtype, generator=gen)
    pos = torch.tensor([[159]], device=dev)
    lens = torch.tensor([160], device=dev, dtype=torch.int32)

    def step():
        y = x
        for w in ws:
            y = bd.layer_step(w, y, pos, lens, fuse=not args.separate)
        return y

    graph = bench.cuda_graph(step)
    for _ in range(5):
        graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(args.steps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    wall_us = start.elapsed_time(end) * 1e3 / args.steps

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            graph.replay()
        torch.cuda.synchronize()
    per = defaultdict(lambda: [0, 0.0])  # name -> [count, total us]
    spans = []
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time_total > 0:
            name = e.name[:90]
            per[name][0] += 1
            per[name][1] += e.device_time_total
            spans.append((e.time_range.start, e.time_range.end))
    kernel_us = sum(t for _, t in per.values()) / args.steps
    rows = sorted(((n, c / args.steps, t / args.steps, t / c) for n, (c, t) in per.items()), key=lambda r: -r[2])
    print(f"step wall {wall_us:.1f} us (events, {args.steps} replays), kernels {kernel_us:.1f} us, "
          f"gaps {wall_us - kernel_us:.1f} us, PDL {args.pdl}, separate norm/add {args.separate}")
    print(f"{'us/step':>9} {'count':>6} {'us each':>8}  kernel")
    for n, c, t, each in rows:
        print(f"{t:9.1f} {c:6.1f} {each:8.2f}  {n}")
    spans.sort()
    gaps = [b[0] - a[1] for a, b in zip(spans, spans[1:]) if 0 <= b[0] - a[1] < 50]
    if gaps:
        gaps.sort()
        print(f"gaps between consecutive kernels: median {gaps[len(gaps) // 2]:.2f} us, "
              f"mean {sum(gaps) / len(gaps):.2f} us over {len(gaps)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"wall_us": wall_us, "kernel_us": kernel_us, "pdl": args.pdl,
                       "kernels": [dict(name=n, per_step=c, us_per_step=t, us_each=e) for n, c, t, e in rows]}, f, indent=1)


if __name__ == "__main__":
    main()
