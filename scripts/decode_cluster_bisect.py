"""Which neighbour makes the clustered decode-attention merge lose inside the 1B model's CUDA graph
(docs/next-steps.md item 1), without Hugging Face: the 16 layers' kernels as kernelize runs them
at a real context, captured in one graph per chain of stages, with the cluster merge off and on
(LLMK_DECODE_CLUSTER, read per call), us per layer.

Stages of a layer, in order (a chain runs the ones it names; a stage whose producer is left out
reads a fixed tensor instead):
  qkv      skinny GEMM with the RMSNorm prologue (q/k/v 2048 -> 3072)
  rope_kv  rope_write_kv_cache: RoPE of q and k, K/V into the static cache
  attn     decode_attention over the cache with HF's additive mask, seq_lens = the capacity, and
           a kept zeroed workspace per layer (`workspace_zeroed`, as kernelize's static-cache
           steps since 2026-12-05: no counters' memset node); `--workspace none` passes none (the
           caching allocator's, with the memset, as kernelize's calls before)
  o        o GEMM with the residual epilogue
  mlp      gate/up GEMM (RMSNorm prologue, SwiGLU) and down GEMM (residual)

    PYTHONPATH=python python3 scripts/decode_cluster_bisect.py [--context 1000] \
        [--chains attn,rope_kv+attn,qkv+rope_kv+attn,attn+o,attn+mlp,layer]

On 2026-12-04 (bench/results/h200-decode-cluster-default-2026-12-04.md) the 1B e2e at context
1000 took ~7 us a layer more with the cluster merge though the kernel alone was faster; if a
chain's "on - off" grows past the attention-only chain's, the stage it adds is the company that
costs. On 2026-12-05 (H200, bench/results/h200-session44-attention-tiles-decode-cluster-2026-12-05.md,
then without a workspace) it found the cost: the clustered grid's early PDL trigger (removed since).
`--device cpu` runs each chain once (a smoke test: no graphs, no clusters).
"""
from __future__ import annotations

import argparse

import torch

from llm_kernels import bench, decode

STAGES = ("qkv", "rope_kv", "attn", "o", "mlp")


def parse_chain(text: str) -> tuple[str, ...]:
    parts = STAGES if text == "layer" else tuple(text.split("+"))
    bad = [p for p in parts if p not in STAGES]
    if bad or not parts:
        raise SystemExit(f"--chains: unknown stage(s) {bad} in {text!r}; stages: {', '.join(STAGES)} or 'layer'")
    return parts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", type=int, default=1000, help="keys the mask leaves visible")
    ap.add_argument("--capacity", type=int, default=0, help="static cache slots (default: context + 80)")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--chains", default="attn,rope_kv+attn,qkv+rope_kv+attn,attn+o,attn+mlp,layer")
    ap.add_argument("--reps", type=int, default=50, help="graph replays timed per setting (median)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--workspace", choices=("kept", "none"), default="kept",
                    help="kept: a zeroed workspace per layer (workspace_zeroed=True); none: the allocator's per call")
    a = ap.parse_args()
    chains = [parse_chain(c) for c in a.chains.split(",")]
    dev = a.device
    dt = torch.bfloat16 if dev == "cuda" else torch.float32
    cap = a.capacity or a.context + 80
    hidden, inter, H, Hkv, D = 2048, 8192, 32, 8, 64
    gen = torch.Generator(device="cpu").manual_seed(0)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(dev, dt)

    layers = [dict(wn1=rand(hidden), wqkv=rand((H + 2 * Hkv) * D, hidden, scale=hidden**-0.5),
                   wo=rand(hidden, H * D, scale=(H * D)**-0.5), wn2=rand(hidden),
                   wgu=rand(2 * inter, hidden, scale=hidden**-0.5), wd=rand(hidden, inter, scale=inter**-0.5),
                   kc=rand(1, Hkv, cap, D), vc=rand(1, Hkv, cap, D)) for _ in range(a.layers)]
    x0 = rand(1, hidden)
    qkv0 = rand(1, (H + 2 * Hkv) * D)
    q_rot0 = rand(1, 1, H, D)
    attn0 = rand(1, H * D)
    cos, sin = rand(1, 1, D // 2), rand(1, 1, D // 2)
    position = torch.full((1, 1), a.context - 1, dtype=torch.int64, device=dev)
    full = torch.full((1,), cap, dtype=torch.int32, device=dev)
    mask = torch.zeros(1, 1, 1, cap, device=dev, dtype=dt)
    mask[..., a.context:] = torch.finfo(dt).min
    q_out, k_out = torch.empty(1, 1, H, D, device=dev, dtype=dt), torch.empty(1, 1, Hkv, D, device=dev, dtype=dt)

    def keep_workspaces() -> None:
        nbytes = decode.decode_workspace_size(q_rot0, layers[0]["kc"]) if a.workspace == "kept" else 0
        for w in layers:
            w["ws"] = torch.zeros(nbytes, dtype=torch.uint8, device=dev) if nbytes > 0 else None

    keep_workspaces()

    def step(parts: tuple[str, ...]) -> None:
        x = x0
        for w in layers:
            qkv = decode.skinny_gemm(x, w["wqkv"], norm_weight=w["wn1"], fixed_weight=True) if "qkv" in parts else qkv0
            q_rot = q_rot0
            if "rope_kv" in parts:
                q, k, v = qkv.split([H * D, Hkv * D, Hkv * D], -1)
                decode.rope_write_kv_cache(q_out, k_out, w["kc"], w["vc"], q.view(1, 1, H, D), k.view(1, 1, Hkv, D),
                                           v.view(1, 1, Hkv, D), cos, sin, position)
                q_rot = q_out
            out = (decode.decode_attention(q_rot, w["kc"], w["vc"], full, attn_mask=mask, workspace=w["ws"],
                                           workspace_zeroed=w["ws"] is not None) if "attn" in parts else None)
            h = x
            if "o" in parts:
                h = decode.skinny_gemm(attn0 if out is None else out.view(1, H * D), w["wo"], residual=x, fixed_weight=True)
            if "mlp" in parts:
                u = decode.skinny_gemm(h, w["wgu"], activation="swiglu", norm_weight=w["wn2"], fixed_weight=True)
                h = decode.skinny_gemm(u, w["wd"], residual=h, fixed_weight=True)
            x = h

    for parts in chains:
        name = "+".join(parts)
        if dev != "cuda":
            step(parts)
            print(f"{name}: ran once on {dev}")
            continue
        per_layer = {}
        for cluster in ("0", "1"):
            with bench.env("LLMK_DECODE_CLUSTER", cluster):
                keep_workspaces()  # sized by this setting's plan
                per_layer[cluster] = bench.graph_us_per_call(lambda: step(parts), a.layers, reps=a.reps)
        print(f"{name:32s} cluster off {per_layer['0']:7.2f} us/layer, on {per_layer['1']:7.2f}, "
              f"on - off {per_layer['1'] - per_layer['0']:+6.2f}", flush=True)


if __name__ == "__main__":
    main()
