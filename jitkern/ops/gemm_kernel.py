"""The GEMM driver: blocked float32 GEMM over the FMA register-tile microkernel, fused epilogue.

One driver serves every GEMM op: C (M, N) = epilogue(alpha * op(A) @ op(B) + beta * C), with
flags for transposition and the bias + ReLU epilogue applied on the register tile after the last
K pass. Only the tile shape (MR, NR, vector width) is compiled in: one kernel per ISA.
Blocking (Goto/BLIS style): B is packed once into NR-wide k-major panels unless its rows can
be read in place; each C block (mc rows x nc columns) is one parallel task that, per KC pass,
packs its mc x kc slice of A (or reads a plain row-major A in place) and sweeps the tile
kernel over it. A C block belongs to one task and its K passes run in a fixed order, so
results are bit-identical run to run and for any thread count.

Helpers are inlined into the driver (inline="always"). The driver passes them the tile shape
(`code`, or MR / NR) from inside its prange loops: a value from outside a prange loop reaches the
loop body as a runtime argument, where LLVM could no longer fold it. Packing, the task workspace
layout and the prefetch hints live in gemm_pack.
"""
from __future__ import annotations

import functools
import logging

import numpy as np
from numba import prange

from ..codegen import KernelSpec, get_kernel, host_target, jit, kernel_factory, num_threads, target_isa, uidx as _u
from ..codegen import knobs
from ..codegen.simd import (MASK_BYTE, MASK_F32, MASK_OUT, NO_MASK, STREAM, fma_tile, short_rows, store_fence, tile_code,
                             tile_dims, tile_for)
from ..codegen.bf16 import relu_keep
from .gemm_pack import (a_panel, b_in_place, pack_a_block, pack_b_columns, pack_b_panel, pack_b_rows,
                        prefetch_c, prefetch_rows, task_floats, task_parts)
from .gemm_passes import relu_mask_into
from .gemv_kernel import gemv_into, outer_into
from .workspace import thread_buffer

log = logging.getLogger("jitkern")



# --------------------------------------------------------------------------- tiles


@jit(inline="always")
def _scale_block(cf, ldc, blk, beta):
    """C block *= beta (before its first K pass); cf: flat C, row stride ldc; blk = (i0, mcb, j0, ncb)."""
    i0, mcb, j0, ncb = blk
    for i in range(i0, i0 + mcb):
        for j in range(j0, j0 + ncb):
            cf[_u(i * ldc + j)] *= beta


@jit(inline="always")
def _edge_in(tile, nr, c_op, load, rows, cols):
    """An edge tile (only rows x cols inside C) runs in the scratch `tile` (row stride nr): C's
    current values copied in if they are accumulated onto (load). c_op = (flat C, offset, ldc)."""
    cf, coff, ldc = c_op
    if load:
        for r in range(rows):
            for q in range(cols):
                tile[_u(r * nr + q)] = cf[_u(coff + r * ldc + q)]


@jit(inline="always")
def _edge_out(tile, nr, c_op, mode, mask_op, rows, cols):
    """The valid part of an edge tile's scratch copied to C, masked on the way (mode MASK_F32 or
    MASK_BYTE), or its mask written (MASK_OUT; mask_op: as C's, at the same offset)."""
    cf, coff, ldc = c_op
    mf, mb, moff = mask_op
    if mode == MASK_F32:
        for r in range(rows):
            for q in range(cols):
                cf[_u(coff + r * ldc + q)] = relu_keep(tile[_u(r * nr + q)], mf[_u(moff + r * ldc + q)])
    elif mode == MASK_BYTE:
        for r in range(rows):
            for q in range(cols):
                cf[_u(coff + r * ldc + q)] = relu_keep(tile[_u(r * nr + q)], mb[_u(moff + r * ldc + q)])
    else:
        if mode == MASK_OUT:
            for r in range(rows):
                for q in range(cols):
                    mb[_u(moff + r * ldc + q)] = np.uint8(tile[_u(r * nr + q)] > 0)
        for r in range(rows):
            for q in range(cols):
                cf[_u(coff + r * ldc + q)] = tile[_u(r * nr + q)]


@jit(inline="always")
def tail_tiles(mcb, mr, sr):
    """(full, short): a row block of mcb rows as `full` MR-row tiles, the last one an edge tile if
    they overrun mcb, then `short` whole SR-row tiles. An edge tile costs a whole tile whatever rows
    it keeps, so a remainder of rows that short tiles cover exactly (with one full tile's rows
    added if need be: 32 = 4 x 6 + 2 x 4) goes to them. Their A rows are read in place."""
    nf = mcb // mr
    r = mcb - nf * mr
    if r == 0:
        return nf, 0
    if r % sr == 0:
        return nf, r // sr
    if nf > 0 and (r + mr) % sr == 0:
        return nf - 1, (r + mr) // sr
    return nf + 1, 0


@jit(inline="always")
def _sweep_tiles(code, scode, a_src, b_src, c_dst, tile, biasp, blk, kpass, geo, mode, tiles):
    """One K pass of one C block: the register tile over each of its MR x NR tiles.

    a_src = (flat A, packed A block), b_src = (packed B panels, flat B), c_dst = (flat C, flat
    float32 mask, flat byte mask, both laid out as C), tile: MR * NR scratch for edge tiles, biasp:
    bias zero-padded to whole panels; blk = (i0, mcb, j0, ncb), kpass = (p0, kcb), geo = (m, n, k,
    ps, bp0, jp0: the first row and panel of B in its packed panels, lda, ldb, ldc: the row strides
    of A's, B's and C's storage; the masks are laid out as C); mode = (a_inplace, ta,
    b_inplace, b_fused, load, epi, use_bias, relu, mask_mode); b_fused: B is (n, k), each panel's
    K-pass slice packed into bp right before its tiles; scode: the short
    tile, tiles = (full, short): the block's row tiles (tail_tiles; short ones need A in place).
    """
    mr, nr = tile_dims(code)
    sr, _ = tile_dims(scode)
    aflat, ap = a_src
    bp, bflat = b_src
    cf, maskf, maskb = c_dst
    i0, mcb, j0, ncb = blk
    p0, kcb = kpass
    m, n, k, ps, bp0, jp0, lda, ldb, ldc = geo
    a_inplace, ta, b_inplace, b_fused, load, epi, use_bias, relu, mask_mode = mode
    masking = mask_mode & (STREAM - 1) if epi else NO_MASK  # STREAM: full tiles only, in the last pass
    full_flags = (load, epi, use_bias, relu, mask_mode if epi else NO_MASK)
    nfull, nshort = tiles
    nip = nfull + nshort
    for jp in range(j0 // nr, (j0 + ncb + nr - 1) // nr):
        jj = jp * nr
        nrem = min(nr, n - jj)
        if b_fused:  # bp: this task's one-panel buffer
            pack_b_panel(bp, bflat, jp, kpass, (n, k, ldb), nr)
            b_op = (bp, 0, nr)
        elif not b_inplace:
            b_op = (bp, (jp - jp0) * ps + (p0 - bp0) * nr, nr)
        elif nrem < nr:  # the ragged last panel, packed alone
            b_op = (bp, p0 * nr, nr)
        else:
            b_op = (bflat, p0 * ldb + jj, ldb)
        ahead = b_inplace and not b_fused and jj + 2 * nr <= min(n, j0 + ncb)  # the next panel: full, ours
        for ip in range(nip):
            short = ip >= nfull
            ii = i0 + (nfull * mr + (ip - nfull) * sr if short else ip * mr)
            mrem = sr if short else min(mr, i0 + mcb - ii)
            if ahead:  # a share of the next panel's rows before each row tile: a burst of them all
                r0 = ip * kcb // nip  # would fill the queue of misses the tile's own loads wait in
                prefetch_rows(bflat, (p0 + r0) * ldb + jj + nr, ldb, (ip + 1) * kcb // nip - r0, nr * 4)
            if a_inplace and (short or mrem == mr):
                a_op = (aflat, p0 * lda + ii, lda, 1) if ta else (aflat, ii * lda + p0, 1, lda)
            else:
                a_op = (ap, ip * a_panel(kcb, mr), mr, 1)
            coff = ii * ldc + jj
            mask_op = (maskf, maskb, coff)
            if masking == MASK_F32:  # read at the tile's end: in flight while its K loop runs
                prefetch_rows(maskf, coff, ldc, mrem, nrem * 4)
            elif masking == MASK_BYTE:
                prefetch_rows(maskb, coff, ldc, mrem, nrem)
            # one call site per tile code (each is inlined whole): edge tiles run in the scratch
            whole = (short or mrem == mr) and nrem == nr
            c_op = (cf, coff, ldc)
            if whole:
                if not full_flags[4] & STREAM:  # streamed C lines are never read
                    prefetch_c(cf, coff, ldc, mrem, nr * 4)
                out, tile_flags = c_op, full_flags
            else:
                _edge_in(tile, nr, c_op, load, mrem, nrem)
                out, tile_flags = (tile, 0, nr), (load, epi, use_bias, relu, NO_MASK)
            if short:
                fma_tile(scode, kcb, a_op, b_op, out, (biasp, jj), tile_flags, mask_op)
            else:
                fma_tile(code, kcb, a_op, b_op, out, (biasp, jj), tile_flags, mask_op)
            if not whole:
                _edge_out(tile, nr, c_op, masking, mask_op, mrem, nrem)


# --------------------------------------------------------------------------- the driver


@kernel_factory("gemm")
def _gemm_factory(spec: KernelSpec):
    # Only the register tile is compile-time: transposition and epilogue pick packing loops and
    # a once-per-tile select, which cost nothing as runtime flags, and one kernel per ISA keeps
    # compilation to a single build.
    MR, NR = spec["mr"], spec["nr"]
    CODE, SHORT = tile_code(MR, NR, spec["vw"]), tile_code(spec["sr"], NR, spec["vw"])

    # No numba runtime (nothing allocated: the padded bias lives in ws): the tile loop would
    # otherwise pay atomic reference counts on the arrays in its operand tuples, 6-8% at K = 32
    @jit(parallel=True, nrt=False)
    def gemm_kernel(a, b, c, bias, mask, maskb, ws, dims, scale, blocks, flags):
        # a, b, c: flat float32 storage of A (m, k) or (k, m) if ta, B (k, n) or (n, k) if tb and C
        # (m, n), rows lda, ldb and ldc floats apart; bias: (n,) if use_bias; mask: flat float32 if
        # mask_mode is MASK_F32, maskb: flat uint8 if MASK_BYTE or MASK_OUT, both laid out as C; ws:
        # float32 scratch; dims = (m, n, k, lda, ldb, ldc); scale = (alpha,
        # beta) float32; blocks = (mc, kc, nc); flags = (ta, tb, use_bias, relu, mask_mode: | STREAM
        # stores C's full tiles non-temporally, each task fenced at its end)
        m, n, k, lda, ldb, ldc = dims
        alpha, beta = scale
        mc, kc, nc = blocks
        ta, tb, use_bias, relu, mask_mode = flags
        npan = (n + NR - 1) // NR
        # Pack B into k-major NR-wide panels (panel p at p * ps) unless b_in_place: packed, one
        # aligned cache line per NR floats instead of lines split at B's row stride, and the copy
        # is a small share once 16 row tiles reuse a panel (for fewer, reading the panels where they
        # lie costs less than copying them). In place, only a ragged last panel is packed,
        # zero-padded, into panel 0 of bp.
        inplace = b_in_place(tb, m, ldb, MR, NR)
        packed = (1 if n % NR else 0) if inplace else npan
        npc = max(1, (k + kc - 1) // kc)
        nib, njb = (m + mc - 1) // mc, (n + nc - 1) // nc
        # A transposed B under one row block (a small batch's forward) packs each panel's K-pass
        # slice right before its tiles, into the task's own buffer: the copy stays in L1 and its
        # reads overlap the tiles of the panel before, where B packed whole is written out and read
        # back (a B read by rows gains nothing so: its panel's rows are a row stride apart)
        fused = tb and nib == 1
        # A long K against a small C (a weight gradient, whose K is the batch; a small batch's dx)
        # packs B one K pass at a time into one region that each pass rewrites: B packed whole goes
        # to lines long evicted, each store a miss to memory first; C's blocks, revisited per pass
        # instead, are the smaller operand
        by_pass = npc > 1 and not tb and not inplace and m < k
        ps = (kc if by_pass else k) * NR + 16  # panel stride, one cache line more than needed: panels
        #                                        side by side would otherwise collide in L1 sets
        bsize = 0 if fused else npan * ps  # ws: [B panels | bias | per task: A block, B panel(s)]
        bp, bflat = ws[:bsize], b
        if tb and not fused:
            for p in prange(packed):
                pack_b_columns(bp, bflat, p, (n, k, ps, ldb), NR)
        elif not tb and packed > 0 and not by_pass:
            for kb in prange((k + 63) // 64):
                pack_b_rows(bp, bflat, kb, (n, k, ps, ldb), npan - packed, NR)
        nbias = (npan * NR + 15) // 16 * 16  # ws after the B panels: the bias, zero-padded to whole panels
        biasp = ws[bsize:bsize + nbias]
        for j in range(nbias):
            biasp[j] = bias[j] if use_bias and j < n else np.float32(0.0)
        bsize += nbias
        cf, aflat = c, a
        # A (not scaled) is read in place when plain row-major (MR row streams the prefetcher
        # follows), or transposed when each C block has one column panel (its packed copy would
        # be read only once)
        a_inplace = alpha == 1.0 and (not ta or nc <= NR)
        tsize = task_floats(mc, kc, MR, NR)
        srcs = (aflat, bp, bflat, cf, mask, maskb, biasp)
        mode = (alpha, beta, a_inplace, ta, inplace, fused, use_bias, relu, mask_mode)
        geo = (m, n, k, mc, kc, nc, ps, lda, ldb, ldc)
        for step in range(npc if by_pass else 1):  # one call site: the tile code is inlined once
            passes = (step, step + 1, npc, step * kc) if by_pass else (0, npc, npc, 0)
            if by_pass:
                p0 = step * kc
                rows = min(kc, k - p0)
                for kb in prange((rows + 63) // 64):
                    pack_b_rows(bp, bflat[p0 * ldb:], kb, (n, rows, ps, ldb), 0, NR)
            for t in prange(nib * njb):
                _block_passes(CODE, SHORT, srcs, ws[bsize + t * tsize:bsize + (t + 1) * tsize], t, passes, geo, mode)
    return gemm_kernel


@jit(inline="always")
def _block_passes(code, scode, srcs, region, t, passes, geo, mode):
    """K passes pa .. pb - 1 (of npc) of C block t (row block t // njb, column block t % njb): A
    packed into the task's region per pass (and B's panels too if b_fused), then the tiles.
    srcs = (flat A, packed B, flat B, flat C, flat float32 mask, flat byte mask, padded bias);
    passes = (pa, pb, npc, bp0: B's first row in its packed panels); geo = (m, n, k, mc, kc, nc,
    ps, lda, ldb, ldc); mode = (alpha, beta, a_inplace, ta, b_inplace, b_fused, use_bias, relu, mask_mode)."""
    mr, nr = tile_dims(code)
    aflat, bp, bflat, cf, maskf, maskb, biasp = srcs
    pa, pb, npc, bp0 = passes
    m, n, k, mc, kc, nc, ps, lda, ldb, ldc = geo
    alpha, beta, a_inplace, ta, inplace, fused, use_bias, relu, mask_mode = mode
    a0, asize, b0 = task_parts(mc, kc, mr, nr)
    tile = region[:mr * nr]  # scratch from the workspace: an allocation per task costs ~0.5 us
    ap = region[a0:a0 + asize]
    if fused:
        bp = region[b0:]
    njb = (n + nc - 1) // nc
    ib = t // njb
    i0, j0 = ib * mc, (t - ib * njb) * nc
    blk = (i0, min(mc, m - i0), j0, min(nc, n - j0))
    if pa == 0 and beta != 0.0 and beta != 1.0:
        _scale_block(cf, ldc, blk, beta)
    tiles = tail_tiles(blk[1], mr, tile_dims(scode)[0]) if a_inplace else ((blk[1] + mr - 1) // mr, 0)
    ablk = (blk[0], tiles[0] * mr, blk[2], blk[3]) if tiles[1] else blk  # short tiles: nothing to pack
    for pi in range(pa, pb):
        kpass = (pi * kc, min(kc, k - pi * kc))
        pack_a_block(ap, aflat, ablk, kpass, (m, k, lda), alpha, ta, a_inplace, mr)
        flags = (a_inplace, ta, inplace, fused, beta != 0.0 or pi > 0, pi == npc - 1, use_bias, relu, mask_mode)
        _sweep_tiles(code, scode, (aflat, ap), (bp, bflat), (cf, maskf, maskb), tile, biasp, blk, kpass,
                     (m, n, k, ps, bp0, 0, lda, ldb, ldc), flags, tiles)
    if mask_mode & STREAM:
        store_fence()


@functools.lru_cache(maxsize=None)
def _kernel(isa: str):
    mr, nr, vw = tile_for(isa)
    return get_kernel(KernelSpec.make("gemm", mr=mr, nr=nr, vw=vw, sr=short_rows(isa)))


_DUMMY = np.zeros(1, np.float32)


NO_BYTES = np.zeros(1, np.uint8)  # the tile's byte mask operand where no byte mask is used


# C may be stored non-temporally when each element takes at most this many FMAs (a write-bound
# GEMM: a layer on the 13 dense features, a small batch's weight gradient) and C does not fit in
# L2: its lines would be read from memory only to be overwritten. Whether that pays is the
# gemm.stream knob's choice, per CPU (declared in ops.gemm_knobs, with its tuning runner)
STREAM_MAX_K = 32
STREAM_KNOB = "gemm.stream"


def stream_heuristic(problem) -> dict:
    """Stream where one vector store writes a whole cache line (AVX-512): on Zen 4 a write-bound C
    gained from it. A 32-byte store writes half a line, and on Zen 3 (AVX2) streaming made a K=13
    layer 1.3-2x slower (1.6x in the DLRM step) and a 32-row weight gradient 1.3-1.5x."""
    return {"max_k": STREAM_MAX_K if host_target().vector_width * 4 >= 64 else 0}


def _streamable(c, beta, isa):
    """Whether the driver can store C non-temporally: written whole (beta 0, a vector ISA), beyond
    L2, its tile rows aligned to whole cache lines."""
    return (beta == 0.0 and isa in ("avx2", "avx512") and c.nbytes > host_target().l2 and c.shape[1] % 16 == 0
            and c.ctypes.data % 64 == 0 and c.flags.c_contiguous)


def _streams(c, k, beta, isa):
    """Whether the driver stores C non-temporally: write-bound (k <= STREAM_MAX_K), streamable,
    and the gemm.stream knob's choice for it."""
    return (k <= STREAM_MAX_K and _streamable(c, beta, isa)
            and k <= knobs.get(STREAM_KNOB).choose((c.shape[0], c.shape[1], k, num_threads()))["max_k"])


def _mask_args(mask, mask_out):
    """(float32 mask, byte mask, mode) of the driver: flat views, dummies where unused."""
    if mask_out is not None:
        return _DUMMY, mask_out.reshape(-1).view(np.uint8), MASK_OUT
    if mask is None:
        return _DUMMY, NO_BYTES, NO_MASK
    if mask.dtype == np.float32:
        return mask.reshape(-1), NO_BYTES, MASK_F32
    return _DUMMY, mask.reshape(-1).view(np.uint8), MASK_BYTE


def gemm_into(a, b, c, ta, tb, blocks, *, alpha=1.0, beta=0.0, bias=None, relu=False, mask=None, mask_out=None,
              stream=None):
    """Run the driver with blocks = (mc, kc, nc) on validated float32 arrays whose rows are
    contiguous (_check.row_strided: C-contiguous, or column slices read and written in place at
    their row strides); c is written and returned. mask: a C-contiguous array of c's shape, float32
    (c is kept where mask > 0: the backward of a ReLU whose output is mask) or bytes (bool or uint8:
    kept where nonzero), else c is +0.0 there, in the epilogue. mask_out: a C-contiguous bool or
    uint8 array of c's shape, written with c > 0 (the byte mask of this ReLU's output; not with
    mask). A C of one row or column goes to the matrix-vector kernels instead. stream: whether
    full tiles store C non-temporally (None: _streams decides; True applies only where
    _streams's shape conditions hold)."""
    m, n = c.shape
    if m == 0 or n == 0:
        return c
    k = a.shape[0] if ta else a.shape[1]
    vector = m == 1 or n == 1 or k == 1 and beta == 0.0  # the matrix-vector and outer-product kernels
    if (not c.flags.c_contiguous and (vector or mask is not None or mask_out is not None)
            or vector and not (a.flags.c_contiguous and b.flags.c_contiguous)):
        # those kernels take contiguous operands, and the masks C's layout: contiguous copies there
        out = np.ascontiguousarray(c)
        a, b = (np.ascontiguousarray(a), np.ascontiguousarray(b)) if vector else (a, b)
        gemm_into(a, b, out, ta, tb, blocks, alpha=alpha, beta=beta, bias=bias, relu=relu, mask=mask,
                  mask_out=mask_out, stream=stream)
        if out is not c:
            np.copyto(c, out)
        return c
    if m == 1 or n == 1:  # a matrix-vector product: no tile would be more than one row or column full
        gemv_into(a, b, c, ta, tb, alpha=alpha, beta=beta, bias=bias, relu=relu)
        if mask is not None:
            relu_mask_into(c, mask)
        return c if mask_out is None else write_mask(c, mask_out)
    if k == 1 and beta == 0.0:
        outer_into(a, b, c, alpha=alpha, bias=bias, relu=relu, mask=mask)
        return c if mask_out is None else write_mask(c, mask_out)
    isa = target_isa()
    mc, kc, nc = blocks
    mr, nr, _ = tile_for(isa)
    mf, mb, mode = _mask_args(mask, mask_out)
    if _streams(c, k, beta, isa) if stream is None else (stream and _streamable(c, beta, isa)):
        mode |= STREAM
    (af, lda), (bf, ldb), (cf, ldc) = _storage(a), _storage(b), _storage(c)
    npan = -(-n // nr)  # B's panels, the padded bias, then the tasks' regions
    need = npan * (k * nr + 16) + npan * nr + 16 + -(-m // mc) * -(-n // nc) * task_floats(mc, kc, mr, nr)
    flags = (bool(ta), bool(tb), bias is not None, bool(relu), mode)
    args = (af, bf, cf, _DUMMY if bias is None else bias, mf, mb, thread_buffer("ws", np.float32, need),
            (m, n, k, lda, ldb, ldc), (np.float32(alpha), np.float32(beta)), (mc, kc, nc), flags)
    kern = _kernel(isa)
    try:
        kern(*args)
    except Exception as e:  # dispatch never fails: if this ISA's kernel cannot build, go portable
        if isa == "scalar" or kern.signatures:
            raise
        log.warning("gemm %s kernel failed to build (%s); using the portable scalar kernel", isa, e)
        _kernel("scalar")(*args)
    return c


def _storage(x):
    """(flat, ld): the float32 storage of a row_strided 2-D x as one flat array from its first
    element, and its row stride in elements (a view: the driver reads and writes x in place)."""
    r, w = x.shape
    if x.flags.c_contiguous:
        return x.reshape(x.size), w
    ld = x.strides[0] // x.itemsize
    return np.lib.stride_tricks.as_strided(x, shape=(max((r - 1) * ld + w, 0),), strides=(x.itemsize,)), ld


def write_mask(c, mask_out):
    """mask_out = c > 0 (NaN: False), as the tile's MASK_OUT writes it. -> c."""
    np.greater(c, 0, out=mask_out.view(np.bool_))
    return c
