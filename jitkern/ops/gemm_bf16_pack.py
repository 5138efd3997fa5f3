"""Packing for the bf16 GEMM driver (ops/gemm_bf16_kernel.py): A and B copied into the panels its
tiles read. Native (vdpbf16ps): bf16 values interleaved in k pairs, one 32-bit word per pair.
Widening: bf16 values widened to fp32, in the fp32 tile's k-major panels. Inlined into the
driver; everything works in elements of flat arrays, bf16 values as their uint16 bits."""
from __future__ import annotations

import numpy as np

from ..codegen import jit, uidx as _u
from ..codegen.simd_bf16 import widen_bf16
from .gemm_pack import prefetch_run, rows_ahead


# --------------------------------------------------------------------------- native packing (k pairs)


@jit(inline="always")
def pair_pack_b_columns(bp, bflat, p, geo, nr):
    """Panel p of B (n, k) (rows are C columns) k-pair-interleaved at p * ps: element (k, col r) at
    (k // 2) * 2 nr + 2 r + k % 2; an odd k's partner and columns past n zeroed. geo = (n, k, ps)."""
    n, k, ps = geo
    width = min(nr, n - p * nr)
    base = p * ps
    for r in range(width):
        row = (p * nr + r) * k
        for kk in range(k):
            bp[_u(base + (kk >> 1) * 2 * nr + 2 * r + (kk & 1))] = bflat[_u(row + kk)]
        if k & 1:
            bp[_u(base + (k >> 1) * 2 * nr + 2 * r + 1)] = 0
    for r in range(width, nr):
        for kk in range((k + 1) // 2 * 2):
            bp[_u(base + (kk >> 1) * 2 * nr + 2 * r + (kk & 1))] = 0


@jit(inline="always")
def _pair(lo, hi):
    """Two bf16 values as one 32-bit word, lo first in memory (the order vdpbf16ps pairs them in)."""
    return np.uint32(lo) | np.uint32(hi) << np.uint32(16)


@jit(inline="always")
def pair_pack_b_rows(bp32, bflat, kb, geo, nr):
    """k pairs 32 kb .. 32 kb + 31 of B (k, n), every panel: rows 2 kp and 2 kp + 1 interleaved
    column by column, as 32-bit words (bp32: the panels viewed as uint32); a missing odd row and
    columns past n zeroed. geo = (n, k, ps)."""
    n, k, ps = geo
    npan = (n + nr - 1) // nr
    ahead = rows_ahead(n * 2) * n
    for kp in range(kb * 32, min((k + 1) // 2, kb * 32 + 32)):
        r0, r1 = 2 * kp * n, (2 * kp + 1) * n
        for p in range(npan):
            base = (p * ps >> 1) + kp * nr
            col = p * nr
            width = min(nr, n - col)
            if r1 + col + ahead < k * n:
                prefetch_run(bflat, r0 + col + ahead, nr * 2)
                prefetch_run(bflat, r1 + col + ahead, nr * 2)
            if 2 * kp + 1 < k:
                for r in range(width):
                    bp32[_u(base + r)] = _pair(bflat[_u(r0 + col + r)], bflat[_u(r1 + col + r)])
            else:
                for r in range(width):
                    bp32[_u(base + r)] = np.uint32(bflat[_u(r0 + col + r)])
            for r in range(width, nr):
                bp32[_u(base + r)] = 0


@jit(inline="always")
def pair_pack_a_block(ap, aflat, blk, kpass, geo, ta, mr):
    """A[i0:i0+mcb, p0:p0+kcb] into ap as mr-row panels of k pairs (panel ip at ip * kcp * mr,
    element (r, k) at (k // 2) * 2 mr + 2 r + k % 2, kcp = kcb rounded up to even); rows past mcb
    zeroed. A plain A (not ta) is read in place except a ragged last panel. blk = (i0, mcb, j0, ncb),
    kpass = (p0, kcb), geo = (m, k): A is (m, k), or (k, m) if ta."""
    i0, mcb, _, _ = blk
    p0, kcb = kpass
    m, k = geo
    kcp = (kcb + 1) // 2 * 2
    for ip in range((mcb + mr - 1) // mr):
        dst = ip * kcp * mr
        rows = min(mr, mcb - ip * mr)
        ibase = i0 + ip * mr
        if not ta and rows == mr:
            continue  # read in place by the tile
        if ta:  # each k pair reads `rows` contiguous values from two rows of a
            ap32 = ap.view(np.uint32)
            for kp in range(kcb >> 1):
                src = (p0 + 2 * kp) * m + ibase
                d = (dst >> 1) + kp * mr
                for r in range(rows):
                    ap32[_u(d + r)] = _pair(aflat[_u(src + r)], aflat[_u(src + m + r)])
            if kcb & 1:
                src = (p0 + kcb - 1) * m + ibase
                for r in range(rows):
                    ap[_u(dst + (kcb >> 1) * 2 * mr + 2 * r)] = aflat[_u(src + r)]
        else:
            for r in range(rows):
                src = (ibase + r) * k + p0
                for kk in range(kcb):
                    ap[_u(dst + (kk >> 1) * 2 * mr + 2 * r + (kk & 1))] = aflat[_u(src + kk)]
        for r in range(rows, mr):
            for kk in range(kcp):
                ap[_u(dst + (kk >> 1) * 2 * mr + 2 * r + (kk & 1))] = 0


# --------------------------------------------------------------------------- widening packing (fp32 panels)


@jit(inline="always")
def widen_pack_b(bp, bflat, p, geo, tb, nr):
    """Panel p of B widened to fp32, k-major nr wide at p * ps (the fp32 tile's layout); columns
    past n zeroed. B is (n, k) if tb, else (k, n). geo = (n, k, ps)."""
    n, k, ps = geo
    width = min(nr, n - p * nr)
    base = p * ps
    if tb:
        for r in range(width):
            for kk in range(k):
                bp[_u(base + kk * nr + r)] = widen_bf16(bflat[_u((p * nr + r) * k + kk)])
    else:
        for kk in range(k):
            for r in range(width):
                bp[_u(base + kk * nr + r)] = widen_bf16(bflat[_u(kk * n + p * nr + r)])
    for kk in range(k):
        for r in range(width, nr):
            bp[_u(base + kk * nr + r)] = 0.0


@jit(inline="always")
def widen_pack_a_block(ap, aflat, blk, kpass, geo, ta, mr):
    """A[i0:i0+mcb, p0:p0+kcb] widened into ap as mr-row k-major panels (panel ip at ip * kcb * mr);
    rows past mcb zeroed. Arguments as pair_pack_a_block's."""
    i0, mcb, _, _ = blk
    p0, kcb = kpass
    m, k = geo
    for ip in range((mcb + mr - 1) // mr):
        dst = ip * kcb * mr
        rows = min(mr, mcb - ip * mr)
        ibase = i0 + ip * mr
        if ta:
            for kk in range(kcb):
                src = (p0 + kk) * m + ibase
                for r in range(rows):
                    ap[_u(dst + kk * mr + r)] = widen_bf16(aflat[_u(src + r)])
        else:
            for r in range(rows):
                src = (ibase + r) * k + p0
                for kk in range(kcb):
                    ap[_u(dst + kk * mr + r)] = widen_bf16(aflat[_u(src + kk)])
        for r in range(rows, mr):
            for kk in range(kcb):
                ap[_u(dst + kk * mr + r)] = 0.0
