"""GPU time of a decode step's q/k/v projection with RoPE and the K/V cache write: skinny_gemm_rope_kv
(one launch) against skinny_gemm + rope_write_kv_cache (two), and the parts alone, as 16 layers'
calls (distinct weights and caches, so nothing stays in L2) captured in one CUDA graph.

    python3 scripts/rope_gemm_times.py [--configs 1b,7b] [--reps 20]

Prints us per layer for each variant: fused (with the length's advance: the blocks' count),
fused_noadv (no advance), two_calls, gemm (the plain product alone), rope_kv (rope_write_kv_cache
alone). With the RMSNorm prologue, batch 1, bf16, as kernelize's fused layers call them. Timing:
bench.graph_us_per_call (the median replay; the session-49 figures of 2026-12-05 22:53 UTC came from
this script at 750f5ba, which took the mean of 20 back-to-back replays)."""
from __future__ import annotations

import argparse

import torch

from llm_kernels import bench, decode

CONFIGS = {"1b": (2048, 32, 8, 64), "7b": (4096, 32, 32, 128)}  # hidden, q heads, kv heads, head dim


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default="1b,7b")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--reps", type=int, default=20)
    a = ap.parse_args()
    dev, dt = "cuda", torch.bfloat16
    for name in a.configs.split(","):
        hidden, hq, hkv, d = CONFIGS[name]
        n = (hq + 2 * hkv) * d
        layers = []
        for _ in range(a.layers):
            layers.append(dict(w=torch.randn(n, hidden, device=dev, dtype=dt) / hidden ** 0.5,
                               kc=torch.zeros(1, hkv, 256, d, device=dev, dtype=dt),
                               vc=torch.zeros(1, hkv, 256, d, device=dev, dtype=dt),
                               length=torch.tensor(100, device=dev), counter=torch.zeros(1, device=dev, dtype=torch.int32)))
        x = torch.randn(1, 1, hidden, device=dev, dtype=dt)
        nw = torch.rand(hidden, device=dev, dtype=dt) + 0.5
        ang = torch.rand(1, d // 2, device=dev)
        cos, sin = ang.cos().to(dt), ang.sin().to(dt)
        pos = torch.full((1,), 100, device=dev, dtype=torch.int64)

        def fused(L, advance=True):
            return decode.skinny_gemm_rope_kv(x, L["w"], None, hq, cos, sin, pos, L["kc"], L["vc"],
                                              advance=L["length"] if advance else None,
                                              counter=L["counter"] if advance else None, norm_weight=nw,
                                              fixed_weight=True)

        def two_calls(L):
            y = decode.skinny_gemm(x, L["w"], norm_weight=nw, fixed_weight=True)
            q, k, v = y.view(1, 1, hq + 2 * hkv, d).split([hq, hkv, hkv], 2)
            decode.rope_write_kv_cache(q, k, L["kc"], L["vc"], q, k, v, cos.unsqueeze(1), sin.unsqueeze(1),
                                       pos.view(1, 1), advance=L["length"])

        y0 = decode.skinny_gemm(x, layers[0]["w"], norm_weight=nw, fixed_weight=True)
        q0, k0, v0 = y0.view(1, 1, hq + 2 * hkv, d).split([hq, hkv, hkv], 2)
        variants = {
            "fused": lambda L: fused(L),
            "fused_noadv": lambda L: fused(L, False),
            "two_calls": two_calls,
            "gemm": lambda L: decode.skinny_gemm(x, L["w"], norm_weight=nw, fixed_weight=True),
            "rope_kv": lambda L: decode.rope_write_kv_cache(q0, k0, L["kc"], L["vc"], q0, k0, v0, cos.unsqueeze(1),
                                                            sin.unsqueeze(1), pos.view(1, 1), advance=L["length"]),
        }
        results = {}
        for rnd in range(2):
            for vname, fn in (variants.items() if rnd == 0 else reversed(list(variants.items()))):
                def step(fn=fn):
                    for L in layers:
                        fn(L)
                results.setdefault(vname, []).append(bench.graph_us_per_call(step, calls=a.layers, reps=a.reps))
        print(f"{name} (hidden {hidden}, {hq}/{hkv} heads of {d}, bf16, batch 1, {a.layers} layers in one graph), "
              "us per layer, two rounds:")
        for vname, ts in results.items():
            print(f"  {vname:12s} " + " / ".join(f"{t:.2f}" for t in ts))


if __name__ == "__main__":
    main()
