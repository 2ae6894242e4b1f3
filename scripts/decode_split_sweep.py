"""Issue 5's decode-attention rows (32 query / 8 KV heads, D 128, one token, bf16) at forced split
counts (0: the plan's): do_bench (L2 flushed, as bench-decode) and one CUDA graph of 8 calls over
8 caches (us per call, L2 not flushed between calls but 8 caches > L2 at the larger rows), with the
relative error against the float64 reference. LLMK_DECODE_KERNEL picks the kernel as usual.

    PYTHONPATH=python python scripts/decode_split_sweep.py [--rows b1kv4096,b32kv4096] [--paged 16]
        [--dim 64] [--mask-len 160] [--splits 0,4,8] [--counters memset,zeroed]

A row not in ROWS is read as bBkvL (batch B, L keys).

--paged BS: vLLM's paged layout (num_blocks, BS, Hkv, D), each sequence's blocks shuffled over the
pool, instead of the contiguous (B, Hkv, L, D).

--counters memset,zeroed: each split count with the split counters zeroed by a memset before each
call (memset, the default) and without one (zeroed: decode_attention's workspace_zeroed, which the
kernels' own reset of the counters makes valid for this reused zeroed workspace).
"""
import argparse

import torch
import triton

from llm_kernels import bench_decode, decode

ROWS = {"b1kv4096": (1, 4096, (0, 4, 8, 16, 32, 64)), "b32kv4096": (32, 4096, (0, 1, 2)),
        "b8kv32768": (8, 32768, (0, 2, 4, 8)), "b64kv2048": (64, 2048, (0, 1, 2)),
        "b1kv8192": (1, 8192, (0, 8, 16, 32)), "b1kv16384": (1, 16384, (0, 8, 16, 24, 32, 64)),
        "b1kv32768": (1, 32768, (0, 16, 32, 64)), "b1kv131072": (1, 131072, (0, 32, 64, 128)),
        "b2kv4096": (2, 4096, (0, 4, 8)), "b4kv4096": (4, 4096, (0, 2, 4)),
        "b1kv203": (1, 203, (0, 1, 2, 3, 4))}  # the 1B e2e step's static cache (--dim 64 --mask-len 160)
ap = argparse.ArgumentParser()
ap.add_argument("--rows", default=",".join(ROWS))
ap.add_argument("--paged", type=int, default=0, help="block size of a paged cache (0: contiguous)")
ap.add_argument("--splits", default="", help="split counts to run, e.g. 0,8,16,0,8,16 (default: per row)")
ap.add_argument("--sdpa", action="store_true", help="also time SDPA's flash and cuDNN backends (do_bench), as bench-decode")
ap.add_argument("--dim", type=int, default=128, help="head dim")
ap.add_argument("--mask-len", type=int, default=0,
                help="Hugging Face's additive mask over the whole cache with keys from this position on hidden, "
                     "as kernelize's static-cache decode step passes it (0: no mask, seq_lens only)")
ap.add_argument("--counters", default="memset",
                help="comma-separated: memset (a memset node per call) and/or zeroed (workspace_zeroed=True)")
args = ap.parse_args()
COUNTER_MODES = args.counters.split(",")
if not set(COUNTER_MODES) <= {"memset", "zeroed"}:
    ap.error(f"--counters: expected memset and/or zeroed, got {args.counters}")


def cache(B, L):
    """(k, v, block_table or None), random."""
    if not args.paged:
        return (torch.randn(B, Hkv, L, D, device="cuda", dtype=dt), torch.randn(B, Hkv, L, D, device="cuda", dtype=dt),
                None)
    per = -(-L // args.paged)
    k = torch.randn(B * per, args.paged, Hkv, D, device="cuda", dtype=dt)
    v = torch.randn(B * per, args.paged, Hkv, D, device="cuda", dtype=dt)
    table = torch.randperm(B * per, device="cuda").to(torch.int32).view(B, per)
    return k, v, table



H, Hkv, D, dt = 32, 8, args.dim, torch.bfloat16
for row in args.rows.split(","):
    if row in ROWS:
        B, L, sweep = ROWS[row]
    else:  # any bBkvL, the plan's splits unless --splits
        B, L = (int(v) for v in row[1:].split("kv"))
        sweep = (0,)
    copies = 8 if B * L <= 32 * 4096 else 2
    q = torch.randn(B, 1, H, D, device="cuda", dtype=dt)
    ks, vs, tables = zip(*(cache(B, L) for _ in range(copies)))
    lens = torch.full((B,), L, dtype=torch.int32, device="cuda")
    mask = None
    if args.mask_len:
        mask = torch.zeros(B, 1, L, device="cuda", dtype=dt)
        mask[..., args.mask_len:] = torch.finfo(dt).min
    gbytes = 2 * B * Hkv * L * D * 2 / 1e9
    ref = decode.decode_attention_ref(q[:1].double(), ks[0].double(), vs[0].double(), lens[:1],
                                      block_table=None if tables[0] is None else tables[0][:1],
                                      attn_mask=None if mask is None else mask[:1].double())
    if args.sdpa:  # the peers bench-decode times, on the first cache, q as (B, H, 1, D)
        kq = ks[0] if tables[0] is None else None
        for name, fn, note in ([] if kq is None else bench_decode._sdpa_peers(q.transpose(1, 2), kq, vs[0], "cuda")):
            db = triton.testing.do_bench(fn, warmup=50, rep=300) * 1e3
            print(f"{row} {name} ({note}): do_bench {db:6.1f} us ({gbytes / db * 1e3:4.2f} TB/s)", flush=True)
    runs = [(s, m) for s in ([int(v) for v in args.splits.split(",")] if args.splits else sweep) for m in COUNTER_MODES]
    for splits, mode in runs:
        nbytes = decode.decode_workspace_size(q, ks[0], tables[0], num_splits=splits)
        ws = torch.zeros(max(nbytes, 1), dtype=torch.uint8, device="cuda")

        zeroed = {"workspace_zeroed": True} if mode == "zeroed" else {}  # (builds before the option: memset only)

        def one(i=0):
            return decode.decode_attention(q, ks[i], vs[i], lens, block_table=tables[i], num_splits=splits,
                                           workspace=ws, attn_mask=mask, **zeroed)
        err = ((one()[:1].double() - ref).abs().max() / ref.abs().max()).item()
        db = triton.testing.do_bench(one, warmup=50, rep=300) * 1e3
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for i in range(copies):
                one(i)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for i in range(copies):
                one(i)
        gt = triton.testing.do_bench(g.replay, warmup=20, rep=300) * 1e3 / copies
        # the plan's count, from its workspace: partials (B*H rows x S x (D+1) floats), then counters
        shown = splits or (nbytes // (B * H * (D + 1) * 4) if nbytes else 1)
        label = (f"{splits:2d}" if splits else f" 0 (plan: {shown})") + (f" {mode}" if len(COUNTER_MODES) > 1 else "")
        print(f"{row} splits {label}: do_bench {db:6.1f} us ({gbytes / db * 1e3:4.2f} TB/s), "
              f"graph {gt:6.2f} us/call ({gbytes / gt * 1e3:4.2f} TB/s), rel err {err:.1e}", flush=True)
