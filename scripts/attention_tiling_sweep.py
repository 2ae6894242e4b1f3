"""Times Hopper attention tilings (LLMK_ATTENTION_HOPPER_CONFIG: by default "ws" and "ws_pp") against
each other over batch x heads grids of different sizes, fp16, causal and not, in TFLOP/s
(triton.testing.do_bench medians of rounds in rotated order, bench.rotated_medians). For revisiting
the default rule in src/attention/attention_hopper.cu, or timing an experiment's switch:

    PYTHONPATH=python python3 scripts/attention_tiling_sweep.py [--configs ws,ws_pp] [--head-dim 64] [--rounds 2]

A config is "default" (no switch), a tiling name, or switches NAME=VALUE joined by "+", NAME
without its LLMK_ATTENTION_ prefix (e.g. "GRID=head+HOPPER_CONFIG=ws").
"""

import argparse

import torch
from triton.testing import do_bench

from llm_kernels import bench, flash

SHAPES = [(1, 32, 4096, 128), (2, 32, 4096, 128), (4, 32, 4096, 128), (8, 32, 4096, 128), (1, 32, 8192, 128),
          (2, 32, 8192, 128), (4, 32, 8192, 128), (1, 16, 8192, 64), (2, 16, 8192, 64), (4, 16, 8192, 64),
          (8, 16, 8192, 64), (2, 24, 4096, 64), (8, 24, 4096, 64), (16, 32, 2048, 128), (32, 32, 1024, 128)]


def timer(fn) -> float:
    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default="ws,ws_pp")
    ap.add_argument("--head-dim", type=int, choices=(64, 128), help="only the shapes of this head dim")
    ap.add_argument("--rounds", type=int, default=2, help="timing rounds per shape, in rotated order (bench.rotated_medians)")
    args = ap.parse_args()
    configs = args.configs.split(",")
    print("| causal | B, H, S, D | blocks of 128 rows | " + " | ".join(configs) + " | first / second |")
    print("|---" * (len(configs) + 4) + "|")
    for causal in (True, False):
        for b, h, s, d in SHAPES:
            if args.head_dim is not None and d != args.head_dim:
                continue
            q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.float16) for _ in range(3))
            flops = 4 * b * h * s * s * d * (0.5 if causal else 1)

            def measure(cfg):
                env = {} if cfg == "default" else {"HOPPER_CONFIG": cfg} if "=" not in cfg else dict(
                    kv.split("=") for kv in cfg.split("+"))
                return bench.timed_in_env(timer, lambda: flash.attention(q, k, v, causal=causal),
                                          {"LLMK_ATTENTION_" + key: value for key, value in env.items()})

            tflops = [flops / ms / 1e9 for ms in bench.rotated_medians([measure(c) for c in configs], args.rounds)]
            blocks = (s + 127) // 128 * h * b
            cells = " | ".join(f"{t:.1f}" for t in tflops)
            print(f"| {causal} | {b}, {h}, {s}, {d} | {blocks} | {cells} | {tflops[0] / tflops[1]:.3f} |", flush=True)


if __name__ == "__main__":
    main()
