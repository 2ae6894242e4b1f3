"""Times the Monarch forward under each LLMK_MONARCH_CLUSTER mode beside dense F.linear, with the
relative error of each mode against float64 (bf16, GPU). For comparing the cluster kernels:

    PYTHONPATH=python python3 scripts/monarch_sweep.py --rows 4096x64x16384,4096x64x16 --modes 1,resident,0

Rows are NxBLOCKSxTOKENS (square blocks). Modes: "1" the default (the pipelined cluster kernel where
it has the shape), "resident" the resident-weights cluster kernel, "0" the tiled kernels; or
switches NAME=VALUE joined by "+", NAME without its LLMK_MONARCH_ prefix (e.g. "CLUSTER=0+WGMMA=0":
the mma.sync tile kernels). --backward times monarch_matmul_backward instead (the error: dx's on the
first rows, against float64 autograd of the two-bmm definition), beside autograd of two bf16 bmm.
"""

import argparse
import math
import os

import torch
import torch.nn.functional as F

from llm_kernels import bench
from llm_kernels import monarch as M


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="4096x64x16384,4096x64x2048,4096x64x16,2048x32x16384")
    ap.add_argument("--modes", default="1,resident,0")
    ap.add_argument("--backward", action="store_true", help="time the backward (dx, dw1, dw2)")
    args = ap.parse_args()
    timer = bench._timer("cuda")
    modes = args.modes.split(",")
    peer = "two-bmm autograd ms" if args.backward else "dense ms"
    print("| n, blocks, tokens | " + " | ".join(f"mode {m} ms (rel err)" for m in modes) + f" | {peer} |")
    print("|---" * (len(modes) + 2) + "|")
    for row in args.rows.split(","):
        n, blocks, tokens = (int(v) for v in row.split("x"))
        b = n // blocks
        gen = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(tokens, n, device="cuda", dtype=torch.bfloat16, generator=gen)
        w1 = torch.randn(blocks, b, b, device="cuda", dtype=torch.bfloat16, generator=gen) / math.sqrt(b)
        w2 = torch.randn(blocks, b, b, device="cuda", dtype=torch.bfloat16, generator=gen) / math.sqrt(b)
        wd = torch.randn(n, n, device="cuda", dtype=torch.bfloat16, generator=gen) / math.sqrt(n)
        check = min(tokens, 2048)  # the float64 reference on the first rows
        if args.backward:
            dout = torch.randn(tokens, n, device="cuda", dtype=torch.bfloat16, generator=gen)
            leaves = [t.double().requires_grad_() for t in (x[:check], w1, w2)]
            ref = torch.autograd.grad(M.monarch_matmul_ref(*leaves), leaves[0], dout[:check].double())[0]
            call = lambda: torch.ops.llm_kernels.monarch_matmul_backward(dout, x, w1, w2)  # noqa: E731
            first = lambda: call()[0][:check]  # noqa: E731
            bf = [t.detach().clone().requires_grad_() for t in (x, w1, w2)]
            out_bf = M.monarch_matmul_ref(*bf)
            peer = lambda: torch.autograd.grad(out_bf, bf, dout, retain_graph=True)  # noqa: E731
        else:
            ref = M.monarch_matmul_ref(x[:check].double(), w1.double(), w2.double())
            call = lambda: M.monarch_matmul(x, w1, w2)  # noqa: E731
            first = lambda: call()[:check]  # noqa: E731
            peer = lambda: F.linear(x, wd)  # noqa: E731
        cells = []
        for mode in modes:
            env = dict(kv.split("=") for kv in mode.split("+")) if "=" in mode else {"CLUSTER": mode}
            env = {"LLMK_MONARCH_" + k: v for k, v in env.items()}
            os.environ.update(env)
            err = ((first().double() - ref).norm() / ref.norm()).item()
            cells.append(f"{timer(call):.4f} ({err:.1e})")
            for k in env:
                os.environ.pop(k)
        print(f"| {n}, {blocks}, {tokens} | " + " | ".join(cells) + f" | {timer(peer):.4f} |", flush=True)


if __name__ == "__main__":
    main()
