"""The dot interaction's kernels, forward and backward (ops/interaction.py: arguments, dispatch, knobs).

Per sample the F x D block (F <= ~41, D <= ~256) fits in L1, so each thread copies one sample's
vectors into a small scratch and does all its work there; the batch is split across threads.
  forward:  row i of the lower triangle, z[i, j] for j < i (+1), is one vector over j: the scratch
            holds the sample transposed (D, Fp) so that z[i, j0:j0+W] += T[i, d] * Tt[d, j0:j0+W]
            is a broadcast FMA; a 4-row register tile shares every load. Rows go whole into a
            per-sample scratch, from which only the triangle is copied to z.
            The transpose is done 16 x 16 blocks at a time in registers when W = 16 and D % 16 == 0.
  forward, "pairs" scheme (interaction.forward): the sample's rows are gathered into a scratch
            (F, Dp) and a 3 x 4 tile of row pairs accumulates twelve W-lane products over D, whose
            lane sums (vhsum4) are four consecutive z entries of each of its three rows: fewer FMAs
            than the transposed scheme's 4 x W blocks of the triangle (no transpose, no padding to W
            pairs) where D spans several vectors.
  backward: dT = S @ T with S the symmetric F x F matrix of dz's triangle (instead of the
            reference's dZ @ T + dZ^T @ T), read from dz in place; a 4-row x W-lane register tile.
All three hint the rows of the sample `ahead` samples on into L2 (spec; 0: no hints), the knob
interaction.prefetch (interaction.py).
The vectors are LLVM `<W x float>` values made available to numba by codegen/vec.py, so LLVM keeps
the accumulators in registers. Kernels take F and D as literals for the DLRM shapes
(interaction._SPECIALISED) and read them from the arguments otherwise: one generic kernel serves
any shape.
bf16 (BF16Array inputs, a bf16 dz or z): the same kernels, typed for uint16 bits, widen every value
they gather (vec.vget, codegen.bf16.widen) and accumulate in fp32; a bf16 z is rounded once per value.
"""
from __future__ import annotations

import numba
import numpy as np

from ..codegen import jit, kernel_factory, uidx as _u
from ..codegen.bf16 import widen
from ..codegen.prefetch import prefetch_l2, prefetch_write
from ..codegen.vec import (
    addr_of,
    ptr_like,
    put,
    vadd,
    vfma,
    vget,
    vget_addr,
    vhsum4,
    vload,
    vload_addr,
    vput,
    vsplat,
    vstore,
    vtranspose16,
    vzero,
)


@jit(inline="always")
def _store_triangle(zf, base, zs, F, Fp, off):
    """zf[base:] = the lower triangle of the sample's dot matrix zs (F, Fp), row by row: row i's
    first i + off entries (off = 1 includes the diagonal)."""
    k = base
    for i in range(F):
        row = i * Fp
        for j in range(i + off):
            put(zf, np.uint64(k + j), zs[np.uint64(row + j)])
        k += i + off


@jit(inline="always")
def _transpose_sample(tt, x, addrs, b, stride, bufs, geo):
    """tt (D, Fp) = sample b's F vectors, transposed: x[b], then ly_t[b] at byte address addrs[t] +
    itemsize * b * stride. bufs = (rowaddr (Fp,) int64, wrows (F * D,) float32 or unused); geo =
    (F, D, Fp, blocks). With `blocks`, 16 x 16 blocks are transposed in registers from row
    addresses (bf16 rows are widened into wrows first); else element by element."""
    F, D, Fp, blocks = geo
    rowaddr, wrows = bufs
    item = x.itemsize
    if blocks:
        rowaddr[0] = addr_of(x) + item * b * D
        for t in range(F - 1):
            rowaddr[t + 1] = addrs[t] + item * b * stride
        if item != 4:  # bf16 rows, widened to float32 rows the transpose reads
            for q in range(F):
                for d0 in range(0, D, 16):
                    vstore(wrows, q * D + d0, vget_addr(x, rowaddr[q] + item * d0, 16))
                rowaddr[q] = addr_of(wrows) + 4 * q * D
        for r0 in range(0, Fp, 16):
            for d0 in range(0, D, 16):
                vtranspose16(rowaddr, r0, 4 * d0, tt, d0 * Fp + r0, Fp)
    else:
        for d in range(D):
            tt[d * Fp] = widen(x[b, d])
        for t in range(F - 1):
            row = numba.carray(ptr_like(x, addrs[t] + item * b * stride), (D,))
            for d in range(D):
                tt[d * Fp + t + 1] = widen(row[d])


@jit(inline="always")
def _prefetch_sample(x, addrs, b, stride, T, D):
    """Hint sample b's rows (x[b], then ly_t[b] at byte address addrs[t] + itemsize * b * stride)
    into L2."""
    item = x.itemsize
    base = addr_of(x)
    for off in range(0, D * item, 64):
        prefetch_l2(x, b, off)
        for t in range(T):
            prefetch_l2(x, 0, addrs[t] + item * b * stride - base + off)


@kernel_factory("interaction_dot_forward")
def _dot_forward_factory(spec):
    FC, DC, W = spec["F"], spec["D"], spec["W"]  # F, D: literals, or 0 = read from the arguments
    AHEAD = spec["ahead"]  # the sample whose rows are hinted, this many on; 0: none

    @jit()
    def dot_forward(b0, b1, x, addrs, stride, off, z):
        # samples b0 <= b < b1 of x: (B, D) float32 or bf16 bits (uint16), as every ly_t; addrs:
        # (T,) i64 byte address of ly_t[0, 0]; stride: elements from one sample of ly_t to the
        # next; off: 1 to include the diagonal; z: (B, D + P) output, float32 or bf16 bits
        D = DC if DC > 0 else x.shape[1]
        F = FC if FC > 0 else addrs.shape[0] + 1
        Q = max(W, 4)  # whole vectors and whole 4-row tiles
        Fp = (F + Q - 1) // Q * Q
        tt = np.zeros(D * Fp, np.float32)  # one sample transposed: (D, Fp), columns >= F stay 0
        zs = np.empty(Fp * Fp, np.float32)  # the sample's dot matrix, rows whole (only the triangle is kept)
        nz = z.shape[1]
        zf = z.reshape(z.size)
        blocks = W == 16 and D % 16 == 0  # transpose 16 x 16 blocks in registers
        rowaddr = np.empty(Fp, np.int64)   # byte address of each row of the sample; pad rows -> 0s
        zeros = np.zeros(D, np.float32)
        rowaddr[F:] = addr_of(zeros)
        wrows = np.empty(F * D if x.itemsize != 4 else 0, np.float32)
        for b in range(b0, b1):
            if AHEAD > 0 and b + AHEAD < b1:
                _prefetch_sample(x, addrs, b + AHEAD, stride, F - 1, D)
            for d in range(D):
                put(z, (b, d), widen(x[b, d]))
            _transpose_sample(tt, x, addrs, b, stride, (rowaddr, wrows), (F, D, Fp, blocks))
            for i0 in range(0, F, 4):
                # rows i0..i0+3 (those past F are zeros of tt, computed and never stored), the lanes
                # the tile's longest row needs; whole vectors into zs, no partial stores
                for j0 in range(0, i0 + 3 + off, W):
                    a0 = a1 = a2 = a3 = vzero(W)
                    for d in range(D):
                        col = d * Fp
                        v = vload(tt, col + j0, W)
                        a0 = vfma(vsplat(tt[col + i0], W), v, a0)
                        a1 = vfma(vsplat(tt[col + i0 + 1], W), v, a1)
                        a2 = vfma(vsplat(tt[col + i0 + 2], W), v, a2)
                        a3 = vfma(vsplat(tt[col + i0 + 3], W), v, a3)
                    vstore(zs, i0 * Fp + j0, a0)
                    vstore(zs, (i0 + 1) * Fp + j0, a1)
                    vstore(zs, (i0 + 2) * Fp + j0, a2)
                    vstore(zs, (i0 + 3) * Fp + j0, a3)
            _store_triangle(zf, b * nz + D, zs, F, Fp, off)
    return dot_forward


@kernel_factory("interaction_dot_forward_pairs")
def _pairs_forward_factory(spec):
    FC, W = spec["F"], spec["W"]  # F: a literal, or 0 = read from the arguments; D is always read:
    #                              a literal D lets LLVM unroll the D loop whole and spill the tile
    AHEAD = spec["ahead"]

    @jit(nrt=False)  # no reference counts in the tile loop
    def pairs(b0, b1, x, addrs, stride, off, zf, nz, buf, rowaddr, last):
        # the pairs of samples b0 <= b < b1 (arguments as dot_forward's) into zf, z's flat (B, nz)
        # view; buf: (F + 8, Dp) float32 zeros, rowaddr[r] its row r's byte address; last:
        # (max(Dp, nz + 3),) of z's dtype, where the slice's last samples are assembled
        D = x.shape[1]
        F = FC if FC > 0 else addrs.shape[0] + 1
        Dp = (D + W - 1) // W * W
        D0 = D // W * W
        item = x.itemsize
        step = 4 * W
        reach = max(Dp, nz + 3)  # how far past its start a sample's stores may reach
        for b in range(b0, b1):
            if AHEAD > 0 and b + AHEAD < b1:
                _prefetch_sample(x, addrs, b + AHEAD, stride, F - 1, D)
            for j0 in range(0, D0, W):  # the sample's rows into buf as float32
                vstore(buf, j0, vget(x, b * D + j0, W))
                for t in range(F - 1):
                    vstore(buf, (t + 1) * Dp + j0, vget_addr(x, addrs[_u(t)] + item * (b * stride + j0), W))
            for d in range(D0, D):  # lanes past the whole vectors; buf's pad lanes stay 0
                vstore(buf, d, vget(x, b * D + d, 1))
                for t in range(F - 1):
                    vstore(buf, (t + 1) * Dp + d, vget_addr(x, addrs[_u(t)] + item * (b * stride + d), 1))
            # whole vectors out: x[b]'s last one, and a short row's 4 lanes, may write past their
            # end, where rows stored later begin (row blocks ascending, j blocks descending, rows
            # ascending), this sample's or a later one's. A sample whose writes would pass the
            # slice's end (other threads' rows, or past z) is assembled in `last`, then copied
            direct = b * nz + reach <= b1 * nz
            dst, base = (zf, b * nz) if direct else (last, 0)
            for d0 in range(0, D, W):  # x[b] to z: before the pairs, whose extra lanes may cover it
                vput(dst, base + d0, vload(buf, d0, W))
            for i0 in range(1 - off, F, 3):  # rows past F read buf's zero rows, and are not stored
                r0, r1, r2 = rowaddr[_u(i0)], rowaddr[_u(i0 + 1)], rowaddr[_u(i0 + 2)]
                for j0 in range((i0 + 1 + off) // 4 * 4, -1, -4):
                    c0, c1, c2, c3 = rowaddr[_u(j0)], rowaddr[_u(j0 + 1)], rowaddr[_u(j0 + 2)], rowaddr[_u(j0 + 3)]
                    a00 = a01 = a02 = a03 = a10 = a11 = a12 = a13 = a20 = a21 = a22 = a23 = vzero(W)
                    for k in range(Dp // W):
                        o = k * step
                        u0, u1, u2 = vload_addr(r0 + o, W), vload_addr(r1 + o, W), vload_addr(r2 + o, W)
                        v = vload_addr(c0 + o, W)
                        a00, a10, a20 = vfma(u0, v, a00), vfma(u1, v, a10), vfma(u2, v, a20)
                        v = vload_addr(c1 + o, W)
                        a01, a11, a21 = vfma(u0, v, a01), vfma(u1, v, a11), vfma(u2, v, a21)
                        v = vload_addr(c2 + o, W)
                        a02, a12, a22 = vfma(u0, v, a02), vfma(u1, v, a12), vfma(u2, v, a22)
                        v = vload_addr(c3 + o, W)
                        a03, a13, a23 = vfma(u0, v, a03), vfma(u1, v, a13), vfma(u2, v, a23)
                    at = base + D + _tri(i0, off) + j0
                    if j0 < i0 + off:
                        vput(dst, at, vhsum4(a00, a01, a02, a03))
                    if i0 + 1 < F and j0 < i0 + 1 + off:
                        vput(dst, at + i0 + off, vhsum4(a10, a11, a12, a13))
                    if i0 + 2 < F:
                        vput(dst, at + 2 * (i0 + off) + 1, vhsum4(a20, a21, a22, a23))
            if not direct:
                for q in range(nz):
                    zf[b * nz + q] = last[q]

    @jit()
    def pairs_forward(b0, b1, x, addrs, stride, off, z):
        # dot_forward's arguments and result
        F = FC if FC > 0 else addrs.shape[0] + 1
        Dp = (x.shape[1] + W - 1) // W * W
        buf = np.zeros((F + 8) * Dp, np.float32)  # rows >= F stay 0: the tiles' pad rows and columns
        rowaddr = np.empty(F + 8, np.int64)
        for r in range(F + 8):
            rowaddr[r] = addr_of(buf) + 4 * r * Dp
        nz = z.shape[1]
        pairs(b0, b1, x, addrs, stride, off, z.reshape(z.size), nz, buf, rowaddr, np.empty(max(Dp, nz + 3), z.dtype))
    return pairs_forward


@jit(inline="always")
def _gather_sample(buf, x, addrs, b, stride, T, D, Dp, W):
    """buf (T + 1, Dp) = sample b's vectors as float32: x[b], then ly_t[b] at byte address addrs[t] +
    itemsize * b * stride; whole W-lane vectors when Dp == D, else element by element (pad lanes stay 0)."""
    item = x.itemsize  # float32 values, or bf16 bits (widened)
    if D == Dp:
        for j0 in range(0, D, W):
            vstore(buf, j0, vget(x, b * D + j0, W))
            for t in range(T):
                vstore(buf, (t + 1) * Dp + j0, vget_addr(x, addrs[t] + item * (b * stride + j0), W))
    else:
        for d in range(D):
            buf[d] = widen(x[b, d])
        for t in range(T):
            row = numba.carray(ptr_like(x, addrs[t] + item * b * stride), (D,))
            for d in range(D):
                buf[(t + 1) * Dp + d] = widen(row[d])



@jit(inline="always")
def _tri(i, off):
    """Where row i of the pair triangle starts in a sample's pair gradients (rows of i + off)."""
    return i * (i - 1) // 2 + i * off


@jit(inline="always")
def _diagonal_blocks(sd, dzf, base, F, off):
    """sd[16 t + 4 q + c] = S[4 t + q, 4 t + c]: the 4 x 4 diagonal blocks of the sample's symmetric
    pair-gradient matrix S (S[i, j] = S[j, i] = dz of pair (i, j), j < i; S[i, i] is twice the
    diagonal pair's with self-interaction (off = 1), else 0), whose triangle is at dzf[base:];
    entries of rows or columns >= F are 0."""
    sd[:] = 0.0
    for i in range(F):
        i0, q = i // 4 * 4, i % 4
        row = base + _tri(i, off) + i0
        for c in range(q):
            sd[_u(i0 * 4 + q * 4 + c)] = sd[_u(i0 * 4 + c * 4 + q)] = widen(dzf[_u(row + c)])
        if off:
            sd[_u(i0 * 4 + q * 5)] = 2 * widen(dzf[_u(row + q)])


@jit(inline="always")
def _store_rows(g, dzf, dx, dly, b, F, D, Dp):
    """Sample b's gradient rows, held in g (F, Dp) when D is not a whole number of vectors: row 0
    (plus dz's copy of x, at dzf[b * (D + P)]) to dx[b], row i to dly[i - 1, b], pad lanes not
    stored."""
    nz = dzf.size // dx.shape[0]
    for d in range(D):
        dx[b, d] = g[d] + widen(dzf[b * nz + d])
    for i in range(1, F):
        for d in range(D):
            dly[i - 1, b, d] = g[i * Dp + d]


@kernel_factory("interaction_dot_backward")
def _dot_backward_factory(spec):
    FC, DC, W = spec["F"], spec["D"], spec["W"]
    AHEAD = spec["ahead"]

    @jit()
    def dot_backward(b0, b1, dz, x, addrs, stride, off, dx, dly):
        # samples b0 <= b < b1 of dz: (B, D + P) float32 or bf16 bits; x, addrs, stride, off as in the forward;
        # dx: (B, D), dly: (T, B, D) outputs (table-major: each table's (B, D) gradient is contiguous).
        # dT = S @ T per sample, S read straight from dz's triangle: S[i, j] for j < i is row i of
        # the triangle, for j > i the 4 adjacent entries [i0, i0 + 4) of row j (a 4-row tile)
        D = DC if DC > 0 else x.shape[1]
        F = FC if FC > 0 else addrs.shape[0] + 1
        Dp = (D + W - 1) // W * W
        Fq = (F + 3) // 4 * 4
        buf = np.zeros(F * Dp, np.float32)  # one sample: (F, Dp), pad lanes stay 0
        g = np.empty(Fq * Dp, np.float32)   # its gradient rows (and up to 3 rows past F, not stored)
        sd = np.empty(Fq * 4, np.float32)   # S's 4 x 4 diagonal blocks
        nz, nb = dz.shape[1], dly.shape[1]
        dzf, dxf, dlyf = dz.reshape(dz.size), dx.reshape(dx.size), dly.reshape(dly.size)
        full = D == Dp  # rows go straight to dx / dly; else through g (pad lanes must not be stored)
        for b in range(b0, b1):
            if AHEAD > 0 and b + AHEAD < b1:
                _prefetch_sample(x, addrs, b + AHEAD, stride, F - 1, D)
                for t in range(F - 1):  # its gradient rows, one stream per table
                    for o in range(0, D * 4, 64):
                        prefetch_write(dlyf, (t * nb + b + AHEAD) * D, o)
            _gather_sample(buf, x, addrs, b, stride, F - 1, D, Dp, W)
            base = b * nz + D
            _diagonal_blocks(sd, dzf, base, F, off)
            for i0 in range(0, F, 4):
                # rows past F read row F-1's pairs: computed, never stored
                r0, r1 = base + _tri(i0, off), base + _tri(min(i0 + 1, F - 1), off)
                r2, r3 = base + _tri(min(i0 + 2, F - 1), off), base + _tri(min(i0 + 3, F - 1), off)
                for j0 in range(0, Dp, W):
                    a0 = a1 = a2 = a3 = vzero(W)
                    for j in range(i0):
                        v = vload(buf, j * Dp + j0, W)
                        a0, a1 = vfma(vsplat(widen(dzf[_u(r0 + j)]), W), v, a0), vfma(vsplat(widen(dzf[_u(r1 + j)]), W), v, a1)
                        a2, a3 = vfma(vsplat(widen(dzf[_u(r2 + j)]), W), v, a2), vfma(vsplat(widen(dzf[_u(r3 + j)]), W), v, a3)
                    for j in range(i0, min(i0 + 4, F)):
                        v, c = vload(buf, j * Dp + j0, W), i0 * 4 + j - i0
                        a0, a1 = vfma(vsplat(sd[_u(c)], W), v, a0), vfma(vsplat(sd[_u(c + 4)], W), v, a1)
                        a2, a3 = vfma(vsplat(sd[_u(c + 8)], W), v, a2), vfma(vsplat(sd[_u(c + 12)], W), v, a3)
                    for j in range(i0 + 4, F):
                        v, t = vload(buf, j * Dp + j0, W), base + _tri(j, off) + i0
                        a0, a1 = vfma(vsplat(widen(dzf[_u(t)]), W), v, a0), vfma(vsplat(widen(dzf[_u(t + 1)]), W), v, a1)
                        a2, a3 = vfma(vsplat(widen(dzf[_u(t + 2)]), W), v, a2), vfma(vsplat(widen(dzf[_u(t + 3)]), W), v, a3)
                    if full:  # straight to dx / dly, among the FMAs (rows past F are not stored)
                        if i0 == 0:
                            vstore(dxf, b * D + j0, vadd(a0, vget(dzf, b * nz + j0, W)))
                        else:
                            vstore(dlyf, ((i0 - 1) * nb + b) * D + j0, a0)
                        if i0 + 1 < F:
                            vstore(dlyf, (i0 * nb + b) * D + j0, a1)
                        if i0 + 2 < F:
                            vstore(dlyf, ((i0 + 1) * nb + b) * D + j0, a2)
                        if i0 + 3 < F:
                            vstore(dlyf, ((i0 + 2) * nb + b) * D + j0, a3)
                    else:
                        vstore(g, i0 * Dp + j0, a0)
                        vstore(g, (i0 + 1) * Dp + j0, a1)
                        vstore(g, (i0 + 2) * Dp + j0, a2)
                        vstore(g, (i0 + 3) * Dp + j0, a3)
            if not full:
                _store_rows(g, dzf, dx, dly, b, F, D, Dp)
    return dot_backward
