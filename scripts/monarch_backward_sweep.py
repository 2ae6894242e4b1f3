"""Where is the Monarch backward faster on at::bmm (the two-bmm formulation on the vendor BLAS,
LLMK_MONARCH_BACKWARD=bmm, which recomputes y) than on our kernels (=kernel)? do_bench medians
(ms) of torch.ops.llm_kernels.monarch_matmul_backward both ways, beside the autograd of the
two-bmm reference (which keeps y from its forward), bf16, square blocks.

    python scripts/monarch_backward_sweep.py [--json out.json]
"""
import argparse
import json

import torch

from llm_kernels import bench, bench_monarch
from llm_kernels import monarch as M


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json")
    ap.add_argument("--tokens", type=int, nargs="*", default=[64, 256, 512, 1024, 2048, 8192])
    args = ap.parse_args()
    timer = bench_monarch._short_timer("cuda")
    rows = []
    for n, blocks in ((4096, 2), (8192, 4), (16384, 8), (4096, 4), (8192, 8)):
        for tokens in args.tokens:
            gen = torch.Generator(device="cuda").manual_seed(0)
            x, w1, w2, _ = bench_monarch.row_inputs(n, blocks, tokens, generator=gen)
            dout = torch.randn_like(x)
            call = lambda: torch.ops.llm_kernels.monarch_matmul_backward(dout, x, w1, w2)  # noqa: E731
            r = {"n": n, "blocks": blocks, "tokens": tokens}
            for how in ("kernel", "bmm"):
                with bench.env("LLMK_MONARCH_BACKWARD", how):
                    r[how] = timer(call)
            leaves = [t.detach().clone().requires_grad_() for t in (x, w1, w2)]
            out = M.monarch_matmul_ref(*leaves)
            r["two_bmm_autograd"] = timer(lambda: torch.autograd.grad(out, leaves, dout, retain_graph=True))
            rows.append(r)
            print(f"n {n:5d} blocks {blocks:2d} (block {n // blocks:4d}) tokens {tokens:5d}: kernel {r['kernel']:.4f}  "
                  f"bmm {r['bmm']:.4f}  two-bmm autograd {r['two_bmm_autograd']:.4f} ms  "
                  f"bmm / kernel {r['bmm'] / r['kernel']:.2f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
