#!/usr/bin/env python3
"""Emulates decode_mma_kernel (src/decode/decode_mma.h) on the CPU, lane by lane, for one block
(4 warps, D = 64, exact arithmetic): its ldmatrix addresses, the mma.m16n8k16 fragment layouts of
the PTX ISA, the masks, the per-warp online softmax and the combination of the warps, against a
plain reference. A check of the index arithmetic that needs no GPU (it prints max |error| per case,
~1e-16 when right). Keep it in step with the kernel when the kernel's indexing changes.

    python3 scripts/emulate_decode_mma.py
"""
import numpy as np
rng = np.random.default_rng(0)
D, KEYS, WARPS = 64, 64, 4
KS = D + 8

def ldmatrix_x4(smem, addr, trans=False):
    # addr[lane] = element offset of row (lane%8) of matrix lane//8; returns r[lane][i] = (lo, hi)
    r = [[None]*4 for _ in range(32)]
    for i in range(4):
        rows = [smem[addr[8*i+j]: addr[8*i+j]+8] for j in range(8)]
        M = np.array(rows)  # 8x8 (stored row, col)
        for lane in range(32):
            g, t = lane // 4, lane % 4
            if not trans: r[lane][i] = (M[g, 2*t], M[g, 2*t+1])
            else: r[lane][i] = (M[2*t, g], M[2*t+1, g])
    return r

def mma(c, a, b):
    # c[lane] = [4], a[lane] = 4 pairs, b[lane] = 2 pairs
    A = np.zeros((16, 16)); B = np.zeros((16, 8))
    for lane in range(32):
        g, t = lane // 4, lane % 4
        A[g, 2*t:2*t+2] = a[lane][0]; A[g+8, 2*t:2*t+2] = a[lane][1]
        A[g, 2*t+8:2*t+10] = a[lane][2]; A[g+8, 2*t+8:2*t+10] = a[lane][3]
        B[2*t:2*t+2, g] = b[lane][0]; B[2*t+8:2*t+10, g] = b[lane][1]
    C = np.zeros((16, 8))
    for lane in range(32):
        g, t = lane // 4, lane % 4
        C[g, 2*t:2*t+2] = c[lane][0:2]; C[g+8, 2*t:2*t+2] = c[lane][2:4]
    Dm = A @ B + C
    for lane in range(32):
        g, t = lane // 4, lane % 4
        c[lane][0:2] = Dm[g, 2*t:2*t+2]; c[lane][2:4] = Dm[g+8, 2*t:2*t+2]

def run(T_, group, length, start, end, scale):
    rows = T_ * group
    q = rng.standard_normal((rows, D)).round(2)  # row r: token r % T, head r // T
    K = rng.standard_normal((length + 100, D)).round(2)
    V = rng.standard_normal((length + 100, D)).round(2)
    qscale = scale * np.log2(np.e)
    ntiles = (end - start + KEYS - 1) // KEYS
    # per-lane state, per warp
    state = []
    for w in range(WARPS):
        st = dict(acc=[[ [0.0]*4 for _ in range(D//8)] for _ in range(32)],
                  m0=[-np.inf]*32, m1=[-np.inf]*32, l0=[0.0]*32, l1=[0.0]*32)
        state.append(st)
    def qpair(r, d):
        return (q[r, d], q[r, d+1]) if r < rows else (0.0, 0.0)
    qf = [[[qpair(lane//4, kt*16+2*(lane%4)), qpair(lane//4+8, kt*16+2*(lane%4)),
            qpair(lane//4, kt*16+2*(lane%4)+8), qpair(lane//4+8, kt*16+2*(lane%4)+8)] for kt in range(D//16)] for lane in range(32)]
    for it in range(ntiles):
        smem = np.zeros(2 * KEYS * KS)
        kb = start + it * KEYS
        for key in range(KEYS):
            pos = kb + key
            if pos < end:
                smem[key*KS: key*KS+D] = K[pos]
                smem[KEYS*KS + key*KS: KEYS*KS + key*KS + D] = V[pos]
        for w in range(WARPS):
            st = state[w]
            ks = w * 16 * KS; vs = ks + KEYS * KS
            s = [[[0.0]*4 for _ in range(2)] for _ in range(32)]
            for kt in range(D // 16):
                addr = [ks + ((lane // 16) * 8 + lane % 8) * KS + kt * 16 + ((lane // 8) % 2) * 8 for lane in range(32)]
                kf = ldmatrix_x4(smem, addr)
                c0 = [s[l][0] for l in range(32)]; mma(c0, [qf[l][kt] for l in range(32)], [(kf[l][0], kf[l][1]) for l in range(32)])
                c1 = [s[l][1] for l in range(32)]; mma(c1, [qf[l][kt] for l in range(32)], [(kf[l][2], kf[l][3]) for l in range(32)])
            kw = start + it * KEYS + w * 16
            pa = [None]*32; alphas = [None]*32
            mx0 = [0]*32; mx1 = [0]*32
            for lane in range(32):
                g, tq = lane // 4, lane % 4
                lim0 = len_ - T_ + g % T_ if g < rows else -1
                lim1 = len_ - T_ + (g+8) % T_ if g + 8 < rows else -1
                a, b_ = -np.inf, -np.inf
                for j in range(2):
                    for e in range(2):
                        key = kw + 8*j + 2*tq + e
                        inn = key < end
                        s[lane][j][e] = s[lane][j][e]*qscale if inn and key <= lim0 else -np.inf
                        s[lane][j][2+e] = s[lane][j][2+e]*qscale if inn and key <= lim1 else -np.inf
                        a = max(a, s[lane][j][e]); b_ = max(b_, s[lane][j][2+e])
                mx0[lane], mx1[lane] = a, b_
            for lane in range(32):
                quad = [lane - lane % 4 + i for i in range(4)]
                M0 = max(mx0[x] for x in quad); M1 = max(mx1[x] for x in quad)
                mn0 = max(st['m0'][lane], M0); mn1 = max(st['m1'][lane], M1)
                b0 = 0.0 if mn0 == -np.inf else mn0; b1 = 0.0 if mn1 == -np.inf else mn1
                al0 = 2.0 ** (st['m0'][lane] - b0); al1 = 2.0 ** (st['m1'][lane] - b1)
                st['m0'][lane] = mn0; st['m1'][lane] = mn1
                ps0 = ps1 = 0.0
                for j in range(2):
                    for e in range(2):
                        s[lane][j][e] = 2.0 ** (s[lane][j][e] - b0); s[lane][j][2+e] = 2.0 ** (s[lane][j][2+e] - b1)
                        ps0 += s[lane][j][e]; ps1 += s[lane][j][2+e]
                st['l0'][lane] = st['l0'][lane]*al0 + ps0; st['l1'][lane] = st['l1'][lane]*al1 + ps1
                for n in range(D // 8):
                    acc = st['acc'][lane][n]
                    acc[0] *= al0; acc[1] *= al0; acc[2] *= al1; acc[3] *= al1
                pa[lane] = [(s[lane][0][0], s[lane][0][1]), (s[lane][0][2], s[lane][0][3]), (s[lane][1][0], s[lane][1][1]), (s[lane][1][2], s[lane][1][3])]
            for dp in range(D // 16):
                addr = [vs + (((lane // 8) % 2) * 8 + lane % 8) * KS + (dp * 2 + lane // 16) * 8 for lane in range(32)]
                vf = ldmatrix_x4(smem, addr, trans=True)
                c0 = [st['acc'][l][2*dp] for l in range(32)]; mma(c0, pa, [(vf[l][0], vf[l][1]) for l in range(32)])
                c1 = [st['acc'][l][2*dp+1] for l in range(32)]; mma(c1, pa, [(vf[l][2], vf[l][3]) for l in range(32)])
    # combine warps
    o_part = np.zeros((WARPS, 16, D)); l_part = np.zeros((WARPS, 16)); m_s = np.zeros((WARPS, 16))
    for w in range(WARPS):
        st = state[w]
        for lane in range(32):
            g = lane // 4
            m_s[w, g] = st['m0'][lane]; m_s[w, g+8] = st['m1'][lane]
    mb = m_s.max(axis=0)
    for w in range(WARPS):
        st = state[w]
        for lane in range(32):
            g, tq = lane // 4, lane % 4
            quad = [lane - tq + i for i in range(4)]
            l0 = sum(st['l0'][x] for x in quad); l1 = sum(st['l1'][x] for x in quad)
            f0 = 0.0 if st['m0'][lane] == -np.inf else 2.0 ** (st['m0'][lane] - mb[g])
            f1 = 0.0 if st['m1'][lane] == -np.inf else 2.0 ** (st['m1'][lane] - mb[g+8])
            for n in range(D // 8):
                o_part[w, g, n*8+2*tq: n*8+2*tq+2] = np.array(st['acc'][lane][n][0:2]) * f0
                o_part[w, g+8, n*8+2*tq: n*8+2*tq+2] = np.array(st['acc'][lane][n][2:4]) * f1
            if tq == 0:
                l_part[w, g] = l0 * f0; l_part[w, g+8] = l1 * f1
    o = o_part.sum(0)[:rows]; tot = l_part.sum(0)[:rows]
    out = np.where(tot[:, None] > 0, o / np.where(tot > 0, tot, 1)[:, None], 0.0)
    # reference: row r token t = r % T sees keys start .. min(end, len - T + t + 1) - 1 of this chunk
    ref = np.zeros((rows, D)); lse = np.full(rows, -np.inf)
    for r in range(rows):
        t = r % T_
        hi = min(end, len_ - T_ + t + 1)
        if hi <= start: continue
        sc = K[start:hi] @ q[r] * scale
        p = np.exp(sc - sc.max()); ref[r] = p @ V[start:hi] / p.sum()
    err = np.abs(out - ref).max()
    return err

for (T_, group, len_, start, end) in [(1, 4, 200, 0, 200), (2, 8, 130, 0, 130), (5, 3, 77, 64, 77), (1, 1, 1, 0, 1),
                                      (4, 4, 300, 128, 256), (3, 5, 2, 0, 2), (8, 2, 0, 0, 0)]:
    print(T_, group, len_, start, end, run(T_, group, len_, start, end, 1 / np.sqrt(D)))
