#!/usr/bin/env python3
"""Emulates the few-token Monarch forward (src/monarch/monarch_skinny.cu) on the CPU: its K-split
plan, the (item, K slice) of every warp, the mma.sync C fragment each lane holds (as float64 dot
products over the warp's K slice, rows and tokens past the ends read as the kernel reads them),
the shared-memory sum over a group's warps and the output map (j % L) * R + j / L of both stages,
against the definition. A check of the index arithmetic that needs no GPU (max |error| ~1e-13 when
right, and no NaN: every output written). Keep it in step with the kernel.

    python3 scripts/emulate_monarch_skinny.py
"""
import numpy as np
def occupancy(MH):  # CTAs per SM (ptxas: 80 registers at MH = 1, 112 at MH = 2)
    return 3 if MH == 1 else 2

def stage(inp, in_rs, w, G, N, K, L, R, tokens, out, out_rs, sms=132):
    MH = 2 if tokens > 8 else 1
    groups_total = G * ((N + 15) // 16)
    slots = occupancy(MH) * sms
    trips = K // 128
    sk = 1
    for c in (8, 4, 2):
        if trips >= c and (groups_total * c + 7) // 8 <= slots:
            sk = c; break
    if sk == 1 and trips >= 8 and (MH == 1 or trips >= 64): sk = 8
    ctas = (groups_total * sk + 7) // 8
    groups = (N + 15) // 16
    cpb = 8 // sk
    for b in range(ctas):
        red = np.full((8, 16, 16), np.nan)
        accs = {}
        for warp in range(8):
            cg, ks = warp // sk, warp % sk
            item = b * cpb + cg
            live = item < G * groups
            blk = item // groups if live else 0
            row0 = (item % groups) * 16 if live else 0
            per = (K + sk - 1) // sk; per = (per + 31) // 32 * 32
            kb = ks * per; ke = min(kb + per, K)
            acc = np.zeros((MH, 4, 32))  # [h][r][lane]
            for lane in range(32):
                g, tq = lane >> 2, lane & 3
                for h in range(MH):
                    for r in range(4):
                        row = row0 + g + (r >> 1) * 8
                        row_read = row if row < N else row0
                        tok = h * 8 + 2 * tq + (r & 1)
                        tok_read = tok if tok < tokens else 0
                        if live and kb < ke:
                            wv = w[blk, row_read, kb:ke]
                            xv = inp[tok_read * in_rs + blk * K + kb: tok_read * in_rs + blk * K + ke]
                            acc[h, r, lane] = float(np.dot(wv, xv))
            accs[warp] = (acc, live, blk, row0)
            if sk > 1:
                for lane in range(32):
                    g, tq = lane >> 2, lane & 3
                    for h in range(MH):
                        for r in range(4):
                            red[warp, h * 8 + 2 * tq + (r & 1), g + (r >> 1) * 8] = acc[h, r, lane]
        def store(m, g_, nn, v):
            j = g_ * N + nn
            out[m * out_rs + (j % L) * R + j // L] = v
        if sk == 1:
            for warp, (acc, live, blk, row0) in accs.items():
                if not live: continue
                for lane in range(32):
                    g, tq = lane >> 2, lane & 3
                    for h in range(MH):
                        for r in range(4):
                            m = h * 8 + 2 * tq + (r & 1); nn = row0 + g + (r >> 1) * 8
                            if m < tokens and nn < N: store(m, blk, nn, acc[h, r, lane])
        else:
            for e in range(cpb * tokens * 16):
                grp = e // (tokens * 16); m = e // 16 % tokens; i = e % 16
                it = b * cpb + grp
                nn = (it % groups) * 16 + i
                if it >= G * groups or nn >= N: continue
                v = sum(red[grp * sk + k, m, i] for k in range(sk))
                store(m, it // groups, nn, v)
    return sk

def monarch_ref(x, w1, w2, k, q, p, l, s, r):
    T = x.shape[0]; n = k * p; mid = k * q; m = l * s
    y = np.zeros((T, mid)); out = np.zeros((T, m))
    for b in range(T):
        for i in range(k):
            y[b, i*q:(i+1)*q] = w1[i] @ x[b, i*p:(i+1)*p]
        for u in range(l):
            z = np.array([y[b, t*l+u] for t in range(r)])
            o = w2[u] @ z
            for v in range(s): out[b, v*l+u] = o[v]
    return out

rng = np.random.default_rng(0)
for (T, k, q, p, l, s, r, pad) in [(5, 4, 16, 16, 4, 16, 16, 0), (3, 2, 256, 256, 2, 256, 256, 0), (16, 4, 1024, 1024, 4, 1024, 1024, 0),
                                   (13, 16, 200, 96, 16, 120, 200, 8), (8, 2, 48, 40, 4, 24, 24, 0), (16, 64, 64, 64, 64, 64, 64, 0), (1, 64, 64, 64, 64, 64, 64, 0)]:
    n = k * p; mid = k * q; m = l * s
    x = rng.uniform(-1, 1, (T, n)); w1 = rng.uniform(-.5, .5, (k, q, p)); w2 = rng.uniform(-.5, .5, (l, s, r))
    xs = np.zeros(T * (n + pad)); 
    for b in range(T): xs[b*(n+pad):b*(n+pad)+n] = x[b]
    z = np.full(T * mid, np.nan); out = np.full(T * (m + 3), np.nan)
    sk1 = stage(xs, n + pad, w1, k, q, p, l, r, T, z, mid)
    sk2 = stage(z, mid, w2, l, s, r, s, l, T, out, m + 3)
    got = np.array([out[b*(m+3):b*(m+3)+m] for b in range(T)])
    ref = monarch_ref(x, w1, w2, k, q, p, l, s, r)
    print((T, k, q, p, l, s, r), "sk", sk1, sk2, "max err", np.nanmax(np.abs(got - ref)), "nan", np.isnan(got).sum())
