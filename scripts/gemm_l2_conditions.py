"""How much does the state of L2 before a skinny GEMM change its time? The same product (our
skinny_gemm and F.linear, bf16) timed three ways:

  write-flush: do_bench's default, a 256 MB buffer zeroed before each call: L2 is full of DIRTY
               lines, which must be written back while the GEMM's weight streams in;
  read-flush:  a 256 MB buffer summed before each call: L2 full of clean, unrelated lines;
  rotate:      16 copies of the weight (more than L2 holds) read in turn, one CUDA graph of 16
               calls, time / 16: back-to-back GEMMs as in a decode step (clean L2, launch gaps in).

    python scripts/gemm_l2_conditions.py [--json out.json]
"""
import argparse
import json
import statistics

import torch
import torch.nn.functional as F

from llm_kernels import bench, decode


def rotate_us(call, x, weights):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for w in weights:
            call(x, w)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for w in weights:
            call(x, w)
    for _ in range(5):
        g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(9):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(10):
            g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / (10 * len(weights)))
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json")
    args = ap.parse_args()
    dev, dtype = "cuda", torch.bfloat16
    buf = torch.empty(256 * 2**20, dtype=torch.uint8, device=dev)
    buf_f = buf.view(torch.float32)
    sink = torch.empty((), dtype=torch.float32, device=dev)
    conditions = {"write-flush": lambda: buf.zero_(), "read-flush": lambda: torch.sum(buf_f, dim=0, out=sink)}
    impls = {"llm_kernels": lambda x, w: decode.skinny_gemm(x, w, fixed_weight=True), "F.linear": lambda x, w: F.linear(x, w)}
    rows = []
    for K, N in ((4096, 4096), (2048, 3072), (2048, 2048), (8192, 2048), (4096, 14336)):
        weights = [torch.randn(N, K, device=dev, dtype=dtype) for _ in range(16)]
        nbytes = weights[0].numel() * 2
        for M in (1, 4, 16):
            x = torch.randn(M, K, device=dev, dtype=dtype)
            for name, call in impls.items():
                r = {"K": K, "N": N, "M": M, "impl": name}
                for cond, before in conditions.items():
                    r[cond] = bench._event_timer(lambda: call(x, weights[0]), flush=before) * 1e3
                r["rotate"] = rotate_us(call, x, weights)
                rows.append(r)
                print(f"K{K} N{N} M{M} {name:12s} " + "  ".join(
                    f"{c} {r[c]:6.1f} us ({nbytes / r[c] / 1e6:.2f} TB/s)"
                    for c in ("write-flush", "read-flush", "rotate")), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
