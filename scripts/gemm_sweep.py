"""Skinny GEMM kernels and their plans at one shape (bf16): do_bench (L2 flushed, as bench-decode)
of F.linear and of our kernels (LLMK_GEMM_KERNEL), the TMA kernel at each forced cluster size
(LLMK_GEMM_TMA_SPLIT), with TB/s of weight read and the error against F.linear in float64. Our
kernels are called through the op itself (torch.ops.llm_kernels.skinny_gemm), not decode.skinny_gemm,
whose routing hands the portable kernel's calls above decode.PORTABLE_MAX_ROWS rows to F.linear (so
a sweep through it timed F.linear there: 2026-12-05's H200 figures at 3-16 rows).

    PYTHONPATH=python python scripts/gemm_sweep.py --k 8192 --n 28672 --m 1,16
    PYTHONPATH=python python scripts/gemm_sweep.py --k 8192 --n 28672 --m 1,16 --deep-splits 0,1,2,4,8,16
    PYTHONPATH=python python scripts/gemm_sweep.py --k 8192 --n 28672 --m 1 --deep-loads 8,16 --rounds 2
    ncu --kernel-name regex:gemm_tma --launch-skip 2 --launch-count 1 python scripts/gemm_sweep.py --once tma
"""
import argparse
import os

import torch
import torch.nn.functional as F
import triton

from llm_kernels import decode

ap = argparse.ArgumentParser()
ap.add_argument("--k", type=int, default=8192)
ap.add_argument("--n", type=int, default=28672)
ap.add_argument("--m", default="1,16")
ap.add_argument("--splits", default="0,1,2,4,8", help="TMA cluster sizes (0: the plan)")
ap.add_argument("--once", default="", help="run this kernel 3 times at the first M and stop (for ncu)")
ap.add_argument("--deep-splits", default="", help="instead of the kernels: the deep kernel at each of these "
                "LLMK_GEMM_DEEP_SPLIT values (0: the plan), e.g. 0,1,2,4,8,16")
ap.add_argument("--deep-loads", default="", help="instead of the kernels: the deep kernel at each of these "
                "LLMK_GEMM_DEEP_LOADS values (8: the default), e.g. 8,16")
ap.add_argument("--kernels", default="deep,mma,portable,tma", help="which of our kernels to time beside "
                "F.linear (LLMK_GEMM_KERNEL values; tma at each of --splits)")
ap.add_argument("--portable-rows", default="", help="instead of the kernels: the portable kernel at each of these "
                "LLMK_GEMM_PORTABLE_ROWS values (x rows per pass, 16: the default), e.g. 4,16")
ap.add_argument("--rounds", type=int, default=1, help="time the runs this many times, every other round in "
                "reverse order (the order favours whichever runs first)")
a = ap.parse_args()


def kernel(x, w):
    """Our skinny GEMM kernel at any row count (the op, without decode.skinny_gemm's routing)."""
    return decode._ops.skinny_gemm(x, w, None, "none", False, None, 1e-6, 0.0, None, fixed_weight=True)


w = torch.randn(a.n, a.k, device="cuda", dtype=torch.bfloat16) / a.k**0.5
gb = a.n * a.k * 2 / 1e9
for M in [int(v) for v in a.m.split(",")]:
    x = torch.randn(M, a.k, device="cuda", dtype=torch.bfloat16)
    if a.once:
        os.environ["LLMK_GEMM_KERNEL"] = a.once
        for _ in range(3):
            kernel(x, w)
        torch.cuda.synchronize()
        break
    ref = F.linear(x.double(), w.double())
    # (name, environment of the call; None: F.linear)
    if a.deep_splits:
        runs = [("F.linear", None)] + [
            (f"deep sk={s if s != '0' else 'plan'}", {"LLMK_GEMM_KERNEL": "deep", "LLMK_GEMM_DEEP_SPLIT": s})
            for s in a.deep_splits.split(",")]
    elif a.deep_loads:
        runs = [("F.linear", None)] + [
            (f"deep loads={s}", {"LLMK_GEMM_KERNEL": "deep", "LLMK_GEMM_DEEP_LOADS": s}) for s in a.deep_loads.split(",")]
    elif a.portable_rows:
        runs = [("F.linear", None)] + [
            (f"portable rows={s}", {"LLMK_GEMM_KERNEL": "portable", "LLMK_GEMM_PORTABLE_ROWS": s})
            for s in a.portable_rows.split(",")]
    else:
        kernels = a.kernels.split(",")
        runs = [("F.linear", None)] + [(k, {"LLMK_GEMM_KERNEL": k}) for k in kernels if k != "tma"] + [
            (f"tma S={s or 'plan'}", {"LLMK_GEMM_KERNEL": "tma", "LLMK_GEMM_TMA_SPLIT": str(s) if s else ""})
            for s in ([int(v) for v in a.splits.split(",")] if "tma" in kernels else [])]
    for name, env in [r for i in range(a.rounds) for r in (runs if i % 2 == 0 else runs[::-1])]:
        if env is None:
            fn = lambda: F.linear(x, w)  # noqa: E731
        else:
            os.environ.update(env)
            fn = lambda: kernel(x, w)  # noqa: E731
        err = ((fn().double() - ref).abs().max() / ref.abs().max()).item()
        us = triton.testing.do_bench(fn, warmup=50, rep=300) * 1e3
        print(f"M{M} K{a.k} N{a.n} {name:24s} {us:7.1f} us ({gb / us * 1e3:4.2f} TB/s) err {err:.1e}", flush=True)
