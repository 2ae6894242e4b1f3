"""A decoder layer's GEMM chain without the model, replayed from a CUDA graph, per-kernel GPU times
by role (torch.profiler) under each setting: to reproduce outside the e2e model what session 64
found inside the 7B's graph (H100, 2026-12-07: with the TMA down, the next layer's fused q/k/v
GEMM took 49-56 against 39-40 us, PDL off too, while eager steps and a bare o -> gate/up -> down
chain showed nothing), and then to bisect it quickly. Per layer, as kernelize runs a LLaMA layer at
batch 1 (attention left out unless --attention):

    q/k/v with the input RMSNorm as prologue and RoPE + the K/V cache write as epilogue
    (skinny_gemm_rope_kv) -> [decode attention] -> o + residual -> [RMSNorm] -> gate/up SwiGLU
    (the norm as its prologue unless --separate-mlp-norm, as kernelize does for gate/up weights
    above 128 MiB, the 7B's) -> down + residual

    LLMK_PDL=0 python3 scripts/layer_chain_graph.py --separate-mlp-norm -- default tma@11008x4096

Settings as scripts/e2e_ab.py takes them ("default", an LLMK_GEMM_KERNEL value, or VAR=VALUE pairs
joined by commas); each captures its own graph. Defaults: the e2e 7b config's shapes. Prints the
median time of each role per setting (layer 0 left out) and the graph's replay time per layer.
--device cpu runs the chain once eagerly at the given shapes (a dry run of the script's calls).
"""
import argparse
import os
import statistics

import torch
from torch.profiler import ProfilerActivity, profile

import llm_kernels as lk
from e2e_ab import apply_in_process, kernel_name

ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("settings", nargs="*", default=["default"])
ap.add_argument("--layers", type=int, default=16)
ap.add_argument("--hidden", type=int, default=4096)
ap.add_argument("--inter", type=int, default=11008)
ap.add_argument("--heads", type=int, default=32)
ap.add_argument("--kv-heads", type=int, default=32)
ap.add_argument("--context", type=int, default=128, help="the cache position written (and keys attended)")
ap.add_argument("--separate-mlp-norm", action="store_true", help="the post-attention RMSNorm as its own launch")
ap.add_argument("--attention", action="store_true", help="decode attention between q/k/v and o")
ap.add_argument("--masked-capacity", type=int, default=0,
                help="with --attention: caches of this many slots read with a boolean mask (keys up to the "
                     "context visible) and a kept zeroed workspace, as kernelize's static-cache decode calls it "
                     "(0: caches of context + 1 slots, unmasked)")
ap.add_argument("--replays", type=int, default=20, help="graph replays timed with events")
ap.add_argument("--device", default="cuda", help="cpu: run the chain once eagerly (a dry run)")
args = ap.parse_args()

H, I, L, Hq, Hkv = args.hidden, args.inter, args.layers, args.heads, args.kv_heads
D = H // Hq
cuda = args.device == "cuda"
dt = dict(device=args.device, dtype=torch.bfloat16 if cuda else torch.float32)
gen = torch.Generator(device=args.device).manual_seed(0)


def rand(*shape, scale=1.0):
    return torch.randn(*shape, generator=gen, **dt) * scale


S = max(args.masked_capacity, args.context + 1)  # cache slots
layers = [dict(n1=1 + 0.1 * rand(H), qkv=rand((Hq + 2 * Hkv) * D, H, scale=H ** -0.5), o=rand(H, Hq * D, scale=H ** -0.5),
               n2=1 + 0.1 * rand(H), gu=rand(2 * I, H, scale=H ** -0.5), down=rand(H, I, scale=I ** -0.5),
               k=torch.zeros(1, Hkv, S, D, **dt), v=torch.zeros(1, Hkv, S, D, **dt))
          for _ in range(L)]
angle = torch.arange(D // 2, device=args.device, dtype=torch.float32) * 0.01 * args.context
cos, sin = angle.cos().to(dt["dtype"]).view(1, -1), angle.sin().to(dt["dtype"]).view(1, -1)
pos = torch.tensor([args.context], device=args.device, dtype=torch.int64)
seq_lens = (pos + 1).to(torch.int32)
mask = None
if args.masked_capacity:  # kernelize's static cache: lengths = the capacity, the mask hides the rest
    seq_lens = torch.full((1,), S, device=args.device, dtype=torch.int32)
    mask = (torch.arange(S, device=args.device) <= args.context).view(1, 1, S)
x0 = rand(1, H)

roles = ["qkv"] + (["attention"] if args.attention else []) + ["o"] + (["mlp_norm"] if args.separate_mlp_norm else []) \
    + ["gate_up", "down"]


if args.masked_capacity and cuda:
    for w in layers:  # kernelize keeps one zeroed workspace per attention module
        nbytes = lk.decode.decode_workspace_size(torch.empty(1, 1, Hq, D, **dt), w["k"])
        w["ws"] = torch.zeros(nbytes, dtype=torch.uint8, device=args.device) if nbytes else None


def chain(h):
    for w in layers:
        qkv = lk.skinny_gemm_rope_kv(h, w["qkv"], None, Hq, cos, sin, pos, w["k"], w["v"], norm_weight=w["n1"],
                                     fixed_weight=True)
        q = qkv[:, :Hq * D]
        if args.attention:
            q = lk.decode_attention(q.reshape(1, 1, Hq, D), w["k"], w["v"], seq_lens, attn_mask=mask,
                                    workspace=w.get("ws"), workspace_zeroed=w.get("ws") is not None).reshape(1, Hq * D)
        a = lk.skinny_gemm(q, w["o"], residual=h, fixed_weight=True)
        if args.separate_mlp_norm:
            u = lk.skinny_gemm(lk.rms_norm(a, w["n2"]), w["gu"], activation="swiglu", fixed_weight=True)
        else:
            u = lk.skinny_gemm(a, w["gu"], activation="swiglu", norm_weight=w["n2"], fixed_weight=True)
        h = lk.skinny_gemm(u, w["down"], residual=a, fixed_weight=True)
    return h


if not cuda:
    out = chain(x0)
    print(f"cpu dry run: {L} layers of roles {', '.join(roles)}; output {tuple(out.shape)}, finite {bool(out.isfinite().all())}")
    raise SystemExit(0)

base_env = dict(os.environ)
results = {}
for setting in args.settings:
    apply_in_process(setting, base_env)
    chain(x0)  # warm-up: plans, tensor maps, workspaces
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chain(x0)
    for _ in range(3):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(args.replays):
        graph.replay()
    end.record()
    end.synchronize()
    per_layer = start.elapsed_time(end) * 1e3 / args.replays / L
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    evs = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                 key=lambda e: e.time_range.start)
    times = [e.time_range.elapsed_us() for e in evs]
    if len(times) % L != 0:
        print(f"{setting}: {len(times)} kernels for {L} layers, not a multiple: roles not assigned")
        results[setting] = (per_layer, None)
        continue
    per = len(times) // L
    names = [kernel_name(e.name)[:70] for e in evs[per:2 * per]]
    by_slot = [statistics.median(times[layer * per + j] for layer in range(1, L)) for j in range(per)]
    results[setting] = (per_layer, list(zip(names, by_slot)))

# the setting last and whole (long VAR=VALUE lists would lose their tail in a fixed-width column)
print(f"{'us/layer (graph)':>16}  per kernel of a layer, median us (layers 1..{L - 1}); setting")
for setting, (per_layer, slots) in results.items():
    detail = "  ".join(f"{j}:{t:6.2f}" for j, (_, t) in enumerate(slots)) if slots else "-"
    print(f"{per_layer:16.2f}  {detail}  {setting}")
for setting, (_, slots) in results.items():
    if slots:
        print(f"\n{setting}: " + "; ".join(f"{j} {name}" for j, (name, _) in enumerate(slots)))
print(f"\nroles in order (one kernel each unless a call takes two): {', '.join(roles)}")
