"""GPU times of the Monarch forward at few tokens: the tensor-core one-launch few-token kernel
(forced: LLMK_MONARCH_DECODE_MMA=1, monarch_decode_mma.cu), the portable one (forced:
LLMK_MONARCH_DECODE=1, monarch_decode.cu), the few-token stages (forced: those kernels and the
cluster kernel off), the path without any of them (the cluster kernel where it has the shape, else the
tiled kernels) and dense F.linear, each as

  do_bench      triton.testing.do_bench median (L2 flushed before every call);
  inference     the same under torch.inference_mode (no autograd bookkeeping on the host);
  graph         a CUDA graph of --reps (256 MB zeroing, call) pairs minus a graph of the zeroings
                alone, per call: GPU time with a cold L2 and no host in the way.

    PYTHONPATH=python python3 scripts/monarch_few_token_times.py --rows 4096x64x16,8192x4x16

Rows are NxBLOCKSxTOKENS (square blocks), bf16. The 2026-12-02 04:31 UTC H200 table of
docs/monarch.md came from --rows 2048x4x16,4096x4x16,4096x16x16,4096x64x16,8192x64x16 (before the one-launch kernel).
"""

import argparse
import contextlib

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from llm_kernels import monarch as M
from llm_kernels.bench import env
from llm_kernels.bench_monarch import row_inputs

ROWS = ("2048x4x16,2048x16x16,2048x64x16,4096x4x16,4096x16x16,4096x64x16,8192x4x16,8192x16x16,"
        "8192x64x16,4096x64x8,4096x64x1,4096x4x1")


def graph_us(fn, flush: torch.Tensor, reps: int) -> float:
    """Per-call GPU time of fn after a flush, from two captured graphs (with and without fn)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up outside the capture (allocator, lazy init)
        fn()
        flush.zero_()
    torch.cuda.current_stream().wait_stream(side)
    with_fn, flush_only = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(with_fn):
        for _ in range(reps):
            flush.zero_()
            fn()
    with torch.cuda.graph(flush_only):
        for _ in range(reps):
            flush.zero_()

    def median_ms(graph: torch.cuda.CUDAGraph) -> float:
        graph.replay()
        times = []
        for _ in range(10):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        return sorted(times)[len(times) // 2]

    return (median_ms(with_fn) - median_ms(flush_only)) / reps * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default=ROWS)
    ap.add_argument("--reps", type=int, default=20, help="calls per captured graph")
    args = ap.parse_args()
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    print("row | path | do_bench us | inference us | graph us")
    # the switches of each path (LLMK_MONARCH_ + name; None: unset, the default)
    paths = {
        "one-launch mma": {"DECODE_MMA": "1", "DECODE": None, "SKINNY": None, "CLUSTER": None},
        "one-launch": {"DECODE_MMA": "0", "DECODE": "1", "SKINNY": None, "CLUSTER": None},
        "few-token": {"DECODE_MMA": "0", "DECODE": "0", "SKINNY": None, "CLUSTER": "0"},
        "without": {"DECODE_MMA": "0", "DECODE": "0", "SKINNY": "0", "CLUSTER": None},
        "dense": {},
    }
    for row in args.rows.split(","):
        n, blocks, tokens = (int(v) for v in row.split("x"))
        x, w1, w2, wd = row_inputs(n, blocks, tokens)
        for path, switches in paths.items():
            fn = (lambda: F.linear(x, wd)) if path == "dense" else (lambda: M.monarch_matmul(x, w1, w2))
            with contextlib.ExitStack() as stack:
                for name, value in switches.items():
                    stack.enter_context(env("LLMK_MONARCH_" + name, value))
                plain = do_bench(fn, warmup=10, rep=40, return_mode="median") * 1e3
                with torch.inference_mode():
                    inference = do_bench(fn, warmup=10, rep=40, return_mode="median") * 1e3
                graph = graph_us(fn, flush, args.reps)
            print(f"{row} | {path} | {plain:.1f} | {inference:.1f} | {graph:.1f}", flush=True)


if __name__ == "__main__":
    main()
