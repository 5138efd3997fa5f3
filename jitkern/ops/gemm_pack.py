"""The fp32 GEMM driver's data movement: packing A and B into the register tile's panels, the
per-task workspace layout, and the software prefetch hints the driver and its relatives
(weight_grad, the bf16 drivers) share. Helpers here are inlined into the drivers."""
from __future__ import annotations

from ..codegen import jit, uidx as _u
from ..codegen.prefetch import prefetch_l2, prefetch_write
from ..codegen.vec import vload, vstore


# --------------------------------------------------------------------------- packing

# The packing loops read their source in memory order and hint the lines this many bytes further
# on into L2: the hardware prefetchers stop at each 4 KiB page, and inside a training step the
# source (a layer's input, written by the forward) is usually in DRAM by the time the GEMM reads it
PACK_AHEAD = 8192


@jit(inline="always")
def rows_ahead(row_bytes):
    """How many rows of row_bytes bytes a packing loop prefetches ahead (at least one)."""
    return max(1, (PACK_AHEAD + row_bytes - 1) // row_bytes)


@jit(inline="always")
def prefetch_run(flat, i, nbytes):
    """Hint the cache lines of the nbytes bytes from flat[i] into L2."""
    for off in range(0, nbytes, 64):
        prefetch_l2(flat, i, off)


@jit(inline="always")
def prefetch_c(flat, off, ld, rows, nbytes):
    """Hint the `rows` rows of nbytes bytes from flat[off] (row stride ld elements) as soon written:
    a tile's C lines arrive while its K loop runs instead of stalling its stores (or loads)."""
    for r in range(rows):  # every line, as prefetch_rows
        for b in range(0, nbytes - 1, 64):
            prefetch_write(flat, off + r * ld, b)
        prefetch_write(flat, off + r * ld, nbytes - 1)


@jit(inline="always")
def b_in_place(tb, m, ldb, mr, nr):
    """Whether the driver reads B's full panels in place (row stride ldb) instead of packing them:
    B is (k, n) and few row tiles reuse each panel (under 16), unless its row stride is a multiple
    of 2 KiB (its rows all in a few L1 sets: each tile rereads them from L2), more than two row
    tiles reuse it and a panel's row is under two cache lines (too few FMAs per row to hide the
    rereads: the AVX2 tile lost 20-30% so, the AVX-512 one gained). The sweep hints each next
    panel's rows while it computes the current one (rows a stride apart: no hardware prefetcher
    follows them), and the blocking keeps a K pass's rows within L2 (ops/gemm_knobs.py)."""
    return not tb and m < 16 * mr and (ldb % 512 != 0 or m <= 2 * mr or nr * 4 >= 128)


@jit(inline="always")
def a_panel(kc, mr):
    """Floats from one packed A panel to the next: one cache line more than kc * mr, so that
    panels packed side by side (whose stride would often be a multiple of 4 KiB) do not all
    fall into the same L1 set while the transposed packing writes to all of them at once."""
    return kc * mr + 16


@jit()
def task_floats(mc, kc, mr, nr):
    """Workspace floats of one C block's task, each part in whole cache lines: the edge tiles'
    MR x NR scratch, its packed A block, and the B panel of kc rows of the fused pack."""
    return task_parts(mc, kc, mr, nr)[2] + b_panel(kc, nr)


@jit(inline="always")
def b_panel(kc, nr):
    """Floats of a task's fused-pack B panel, in whole cache lines (see a_panel)."""
    return max(kc, 1) * nr + 16


@jit(inline="always")
def panel_row(dst, d, src, s, width, nr):
    """dst[d:d + nr] = src[s:s + width] zero-padded to nr floats: one k row of a packed B panel. A
    full row moves as whole vectors (nr is a constant once inlined): an element loop stays a scalar
    load and store per float where LLVM cannot prove the two arrays apart."""
    if width >= nr:
        q = 0
        while q + 16 <= nr:
            vstore(dst, _u(d + q), vload(src, _u(s + q), 16))
            q += 16
        while q + 4 <= nr:
            vstore(dst, _u(d + q), vload(src, _u(s + q), 4))
            q += 4
        while q < nr:
            dst[_u(d + q)] = src[_u(s + q)]
            q += 1
    else:
        for r in range(width):
            dst[_u(d + r)] = src[_u(s + r)]
        for r in range(width, nr):
            dst[_u(d + r)] = 0.0


@jit(inline="always")
def task_parts(mc, kc, mr, nr):
    """(offset of the A block, its floats, offset of the B panel) in a task's workspace."""
    a0 = (mr * nr + 15) // 16 * 16
    asize = ((mc + mr - 1) // mr * a_panel(max(kc, 1), mr) + 15) // 16 * 16
    return a0, asize, a0 + asize


@jit(inline="always")
def pack_b_columns(bp, bflat, p, geo, nr):
    """Panel p of B when B is (n, k) (its rows are C columns): each row read along k, into the
    k-major nr-wide panel at p * ps; columns past n zeroed. geo = (n, k, ps, ldb: B's row stride)."""
    n, k, ps, ldb = geo
    width = min(nr, n - p * nr)
    for r in range(width):
        for kk in range(k):
            bp[_u(p * ps + kk * nr + r)] = bflat[_u((p * nr + r) * ldb + kk)]
    for r in range(width, nr):
        for kk in range(k):
            bp[_u(p * ps + kk * nr + r)] = 0.0


@jit(inline="always")
def pack_b_rows(bp, bflat, kb, geo, p_first, nr):
    """Rows 64 kb .. 64 kb + 63 of B when B is (k, n), scanned in memory order and scattered to
    panels p_first.. (panel p at (p - p_first) * ps); columns past n zeroed. geo = (n, k, ps, ldb:
    B's row stride)."""
    n, k, ps, ldb = geo
    npan = (n + nr - 1) // nr
    ahead = rows_ahead(ldb * 4) * ldb
    for kk in range(kb * 64, min(k, kb * 64 + 64)):
        row = kk * ldb
        for p in range(p_first, npan):
            base = (p - p_first) * ps + kk * nr
            col = row + p * nr
            if col + ahead < k * ldb:
                prefetch_run(bflat, col + ahead, nr * 4)
            panel_row(bp, base, bflat, col, n - p * nr, nr)


@jit(inline="always")
def pack_b_panel(bt, bflat, jp, kpass, geo, nr):
    """Columns p0 .. p0 + kcb - 1 of rows jp * nr .. of B (n, k), i.e. panel jp of B^T's K-pass
    slice, into bt (k-major, nr wide, columns past n zeroed), hinting the same slice of panel jp + 2
    into L2: the fused pack, right before the tiles read it. geo = (n, k, ldb: B's row stride)."""
    p0, kcb = kpass
    n, k, ldb = geo
    jj = jp * nr
    for r in range(min(nr, n - jj)):
        src = (jj + r) * ldb + p0
        if jj + r + 2 * nr < n:
            prefetch_run(bflat, src + 2 * nr * ldb, kcb * 4)
        for kk in range(kcb):
            bt[_u(kk * nr + r)] = bflat[_u(src + kk)]
    for r in range(min(nr, n - jj), nr):
        for kk in range(kcb):
            bt[_u(kk * nr + r)] = 0.0


@jit(inline="always")
def pack_a_block(ap, aflat, blk, kpass, geo, alpha, ta, a_inplace, mr):
    """alpha * A[i0:i0+mcb, p0:p0+kcb] into ap as mr-row panels, k-major, rows past mcb zeroed;
    panel ip at ip * a_panel(kcb, mr).

    The loops follow a's memory order (rows along k, or columns if ta); full panels that the
    tile kernel reads in place (a_inplace) are skipped. blk = (i0, mcb, j0, ncb),
    kpass = (p0, kcb), geo = (m, k, lda): A is (m, k), or (k, m) if ta, with row stride lda.
    """
    i0, mcb, _, _ = blk
    p0, kcb = kpass
    m, k, lda = geo
    nfull = mcb // mr
    if ta and not a_inplace:  # full panels row by row of a: each k reads mcb contiguous floats
        ahead = rows_ahead(lda * 4)
        for kk in range(kcb):
            src = (p0 + kk) * lda + i0
            if p0 + kk + ahead < k:
                prefetch_run(aflat, src + ahead * lda, nfull * mr * 4)
            for ip in range(nfull):
                d = ip * a_panel(kcb, mr) + kk * mr
                s0 = src + ip * mr
                for r in range(mr):
                    ap[_u(d + r)] = aflat[_u(s0 + r)] * alpha
    for ip in range((mcb + mr - 1) // mr):
        dst = ip * a_panel(kcb, mr)
        rows = min(mr, mcb - ip * mr)
        ibase = i0 + ip * mr
        if rows == mr and (ta or a_inplace):
            pass  # packed above, or read in place by the tile kernel
        elif ta:
            for kk in range(kcb):
                for r in range(rows):
                    ap[_u(dst + kk * mr + r)] = aflat[_u((p0 + kk) * lda + ibase + r)] * alpha
        else:
            for r in range(rows):
                src = (ibase + r) * lda + p0
                for kk in range(kcb):
                    ap[_u(dst + kk * mr + r)] = aflat[_u(src + kk)] * alpha
        for r in range(rows, mr):
            for kk in range(kcb):
                ap[_u(dst + kk * mr + r)] = 0.0


@jit(inline="always")
def prefetch_rows(flat, off, ld, rows, nbytes):
    """Hint the `rows` rows of nbytes bytes from flat[off] (row stride ld elements) as soon read."""
    for r in range(rows):  # every line: a run not aligned to lines spans one more than nbytes / 64
        for b in range(0, nbytes - 1, 64):
            prefetch_l2(flat, off + r * ld, b)
        prefetch_l2(flat, off + r * ld, nbytes - 1)
