"""GEMM family: blocked float32 GEMM over an FMA register-tile microkernel, with fused epilogues.

One driver serves every op: C (M, N) = epilogue(alpha * op(A) @ op(B) + beta * C), with flags
for transposition, the bias + ReLU epilogue applied on the register tile after the last K pass
(forward), and the ReLU mask and bias-gradient reduction fused into the packing of A
(backward). Only the tile shape (MR, NR, vector width) is compiled in: one kernel per ISA.
Blocking (Goto/BLIS style): B is packed once into NR-wide k-major panels unless its rows can
be read in place; each C block (mc rows x nc columns) is one parallel task that, per KC pass,
packs its mc x kc slice of A (or reads a plain row-major A in place) and sweeps the tile
kernel over it. A C block belongs to one task and its K passes run in a fixed order, so
results are bit-identical run to run and for any thread count.
"""
from __future__ import annotations

import functools
import logging
import threading

import numba
import numpy as np
from numba import prange

from ..codegen import KernelSpec, get_kernel, host_target, jit, kernel_factory
from ..codegen.simd import SOURCE_TAG, fma_tile, tile_code, tile_for
from ..codegen import tunedb
from ..codegen.knobs import knob, pow2_class
from ..config import choice_token

log = logging.getLogger("jitkern")

_F32 = np.dtype(np.float32)


@jit(inline="always")
def _pack_value(a, y, i, j, alpha, mask):
    """a[i, j] (zeroed where the ReLU output y[i, j] <= 0 if mask), times alpha."""
    v = a[i, j]
    if mask and not y[i, j] > 0:
        v = np.float32(0.0)
    return v * alpha


@jit(inline="always")
def _u(i):
    """An index as unsigned: numba then skips the negative-index wraparound, whose selects
    otherwise turn contiguous copy loops into gathers and scatters."""
    return np.uint64(i)


@jit(inline="always")
def _relu_bits(ybits):
    """All ones if the float with these bits is > 0 (not NaN), else 0 -- integer arithmetic only,
    because a data-dependent branch or compare-and-select here mispredicts on random ReLU masks."""
    v = np.int64(ybits)
    return ((0 - v) >> 63) & ((v - 0x7F800001) >> 63)


_GRAD_CHUNKS = 16  # row chunks of the ReLU-gradient pass: a fixed count, so sums never depend on threads


@jit(parallel=True)
def _relu_grad(dy, y, g, db, relu):
    """g = dy where y > 0 else 0 (if relu; g untouched otherwise), db[j] = sum_i g[i, j].

    One pass hands both backward GEMMs a plain operand (read in place, no masked packing twice).
    Each chunk of rows sums its rows in order (float64), then the chunks are added in order.
    """
    # dy, y, g: (n, m) float32; db: (m,) float32
    n, m = dy.shape
    dyf, yf, gf = dy.reshape(n * m), y.reshape(y.size), g.reshape(g.size)
    part = np.zeros((_GRAD_CHUNKS, m), np.float64)
    for c in prange(_GRAD_CHUNKS):
        acc = part[c]
        for i in range(c * n // _GRAD_CHUNKS, (c + 1) * n // _GRAD_CHUNKS):
            row = i * m
            if relu:  # a select once vectorised; NaN/inf in dy vanish where the unit was inactive
                for j in range(m):
                    v = dyf[_u(row + j)] if yf[_u(row + j)] > 0 else np.float32(0.0)
                    gf[_u(row + j)] = v
                    acc[_u(j)] += np.float64(v)
            else:
                for j in range(m):
                    acc[_u(j)] += np.float64(dyf[_u(row + j)])
    for j in range(m):
        s = 0.0
        for c in range(_GRAD_CHUNKS):
            s += part[c, j]
        db[j] = s


def _lane_use(m: int, n: int, mr: int, nr: int) -> float:
    """Fraction of the register tile's lanes an (m, n) C keeps busy."""
    return m / (-(-m // mr) * mr) * n / (-(-n // nr) * nr)


@kernel_factory("gemm")
def _gemm_factory(spec: KernelSpec):
    # Only the register tile is compile-time: transposition and epilogue pick packing loops and
    # a once-per-tile select, which cost nothing as runtime flags, and one kernel per ISA keeps
    # compilation (about 10 s per parallel kernel here) to a single build.
    MR, NR = spec["mr"], spec["nr"]
    CODE = tile_code(MR, NR, spec["vw"])
    TAG = SOURCE_TAG  # in the closure, so a changed simd.py misses numba's disk cache

    @jit(parallel=True)
    def gemm_kernel(a, b, c, bias, y, db, ws, m, n, k, alpha, beta, mc, kc, nc,
                    ta, tb, use_bias, relu, mask, want_db):
        # a: (m, k) or (k, m) if ta; y: like a (ReLU output, if mask); b: (k, n) or (n, k) if tb
        # c: (m, n) C-contiguous; bias: (n,) if use_bias; db: (m,) out, row sums of masked A if want_db
        if TAG < 0:  # never: only here to put TAG in the closure
            return
        npan = (n + NR - 1) // NR
        # Pack B into k-major NR-wide panels (panel p at p * ps) when tb, or when B's row
        # stride is a multiple of 2 KiB (its rows would then fight over a few L1/L2 sets).
        # Otherwise B's rows are already k-major: full panels are read in place (row stride n)
        # and only a ragged last panel is packed, zero-padded, into panel 0 of bp.
        inplace = not tb and n % 512 != 0
        packed = (1 if n % NR else 0) if inplace else npan
        ps = k * NR + 16  # panel stride, one cache line more than needed: panels written side by
        #                   side would otherwise sit 4 KiB-aliased and collide in L1 sets
        bsize = (n + NR - 1) // NR * ps  # ws: [B panels (bsize) | one A block per task]
        bp = ws[:bsize]
        bflat = b.reshape(b.size)
        if tb:  # b rows are C columns: read each along k
            for p in prange(packed):
                width = min(NR, n - p * NR)
                for r in range(width):
                    for kk in range(k):
                        bp[_u(p * ps + kk * NR + r)] = bflat[_u((p * NR + r) * k + kk)]
                for r in range(width, NR):
                    for kk in range(k):
                        bp[_u(p * ps + kk * NR + r)] = 0.0
        elif packed > 0:  # b rows are k: scan them in memory order, scatter to the panels
            p_first = npan - packed
            for kb in prange((k + 63) // 64):
                for kk in range(kb * 64, min(k, kb * 64 + 64)):
                    row = kk * n
                    for p in range(p_first, npan):
                        base = (p - p_first) * ps + kk * NR
                        col = row + p * NR
                        if (p + 1) * NR <= n:
                            for r in range(NR):  # constant trip count: a vector copy
                                bp[_u(base + r)] = bflat[_u(col + r)]
                        else:
                            width = n - p * NR
                            for r in range(width):
                                bp[_u(base + r)] = bflat[_u(col + r)]
                            for r in range(width, NR):
                                bp[_u(base + r)] = 0.0
        biasp = np.zeros(npan * NR, np.float32)
        if use_bias:
            biasp[:n] = bias
        cf = c.reshape(m * n)
        aflat = a.reshape(a.size)
        ai = aflat.view(np.int32)  # with mask (linear_backward only) alpha is 1: packing moves bits
        yi = y.reshape(y.size).view(np.int32)
        # A plain row-major A (not masked, not scaled) is read in place: MR row streams that the
        # prefetcher follows; measured faster than packing for every DLRM shape, K = 1024 included
        a_inplace = not ta and not mask and alpha == 1.0
        nib = (m + mc - 1) // mc
        njb = (n + nc - 1) // nc
        npc = max(1, (k + kc - 1) // kc)
        for t in prange(nib * njb):
            ib = t // njb
            jb = t - ib * njb
            i0 = ib * mc
            mcb = min(mc, m - i0)
            nmp = (mcb + MR - 1) // MR
            j0 = jb * nc
            ncb = min(nc, n - j0)
            apsize = (mc + MR - 1) // MR * MR * max(kc, 1)
            ap = ws[bsize + t * apsize:bsize + (t + 1) * apsize]
            api = ap.view(np.int32)
            tile = np.empty(MR * NR, np.float32)
            dbacc = np.zeros(nmp * MR, np.float64)
            if beta != 0.0 and beta != 1.0:
                for i in range(i0, i0 + mcb):
                    for j in range(j0, j0 + ncb):
                        c[i, j] *= beta
            for pi in range(npc):
                p0 = pi * kc
                kcb = min(kc, k - p0)
                # pack A[i0:i0+mcb, p0:p0+kcb] as MR-row panels, k-major, zero-padded rows; the
                # loop order follows a's memory order (rows along k, or columns if ta)
                nfull = mcb // MR
                if ta:  # full panels row by row of a: each k reads mcb contiguous floats
                    for kk in range(kcb):
                        src = (p0 + kk) * m + i0
                        for ip in range(nfull):
                            d = (ip * kcb + kk) * MR
                            s0 = src + ip * MR
                            if mask:  # ReLU mask as a bit mask: branch-free, so it vectorises
                                for r in range(MR):
                                    api[_u(d + r)] = ai[_u(s0 + r)] & _relu_bits(yi[_u(s0 + r)])
                            else:
                                for r in range(MR):
                                    ap[_u(d + r)] = aflat[_u(s0 + r)] * alpha
                for ip in range(nmp):
                    dst = ip * kcb * MR
                    rows = min(MR, i0 + mcb - (i0 + ip * MR))
                    ibase = i0 + ip * MR
                    if ta and ip < nfull:
                        pass  # packed above
                    elif a_inplace and rows == MR:
                        pass  # read in place by the tile kernel
                    elif ta:
                        for kk in range(kcb):
                            for r in range(rows):
                                ap[_u(dst + kk * MR + r)] = _pack_value(a, y, p0 + kk, ibase + r, alpha, mask)
                    elif mask:
                        for r in range(rows):
                            src = (ibase + r) * k + p0
                            for kk in range(kcb):
                                api[_u(dst + kk * MR + r)] = ai[_u(src + kk)] & _relu_bits(yi[_u(src + kk)])
                    else:
                        for r in range(rows):
                            src = (ibase + r) * k + p0
                            for kk in range(kcb):
                                ap[_u(dst + kk * MR + r)] = aflat[_u(src + kk)] * alpha
                    for r in range(rows, MR):
                        for kk in range(kcb):
                            ap[_u(dst + kk * MR + r)] = 0.0
                    if want_db and jb == 0:  # bias gradient: row sums of the masked A, in k order
                        for kk in range(kcb):  # rows innermost: MR independent sums, vectorised
                            for r in range(MR):
                                dbacc[_u(ip * MR + r)] += ap[_u(dst + kk * MR + r)]
                load = beta != 0.0 or pi > 0
                epi = pi == npc - 1
                for jp in range(j0 // NR, (j0 + ncb + NR - 1) // NR):
                    jj = jp * NR
                    nrem = min(NR, n - jj)
                    if not inplace:
                        bsrc, boff, ldb = bp, jp * ps + p0 * NR, NR
                    elif nrem < NR:
                        bsrc, boff, ldb = bp, p0 * NR, NR
                    else:
                        bsrc, boff, ldb = bflat, p0 * n + jj, n
                    for ip in range(nmp):
                        ii = i0 + ip * MR
                        mrem = min(MR, i0 + mcb - ii)
                        if a_inplace and mrem == MR:
                            asrc, aoff, ak, ar = aflat, ii * k + p0, 1, k
                        else:
                            asrc, aoff, ak, ar = ap, ip * kcb * MR, MR, 1
                        if mrem == MR and nrem == NR:
                            fma_tile(CODE, kcb, asrc, aoff, ak, ar, bsrc, boff, ldb, cf, ii * n + jj, n, load, epi,
                                     biasp, jj, use_bias, relu)
                        else:  # edge tile: compute the full tile in a scratch buffer, copy the valid part
                            if load:
                                for r in range(mrem):
                                    for q in range(nrem):
                                        tile[_u(r * NR + q)] = cf[_u((ii + r) * n + jj + q)]
                            fma_tile(CODE, kcb, asrc, aoff, ak, ar, bsrc, boff, ldb, tile, 0, NR, load, epi,
                                     biasp, jj, use_bias, relu)
                            for r in range(mrem):
                                for q in range(nrem):
                                    cf[_u((ii + r) * n + jj + q)] = tile[_u(r * NR + q)]
            if want_db and jb == 0:
                for r in range(mcb):
                    db[i0 + r] = dbacc[_u(r)]
    return gemm_kernel


def tile_shape(isa: str | None = None) -> tuple[int, int, int]:
    """(MR, NR, vector width) the GEMM uses on `isa` (default: the current target ISA)."""
    return tile_for(isa or host_target().isa)


@functools.lru_cache(maxsize=None)
def _kernel(isa: str):
    mr, nr, vw = tile_for(isa)
    return get_kernel(KernelSpec.make("gemm", mr=mr, nr=nr, vw=vw))


# --------------------------------------------------------------------------- blocking knobs

VARIANTS = ("gemm", "linear_forward", "linear_dx", "linear_dw", "linear_dwt", "batch_reduce_gemm")


def _round_to(x: int, m: int) -> int:
    return max(m, (x + m - 1) // m * m)


def heuristic_blocks(variant: str, m: int, n: int, k: int, threads: int = 1) -> dict:
    """(mc, kc) from the target's caches and register tile. kc: a kc x NR B micro-panel of about
    twice L1 -- the tile kernel streams it in order, so the prefetcher keeps up, and long K
    loops amortise the C tile's load/store. mc: the mc x kc A block in an eighth of L2, leaving
    room for B panels. kc is then split evenly over K."""
    t = host_target()
    mr, nr, _ = tile_for(t.isa)
    kc0 = min(512, max(128, (2 * t.l1d) // (nr * 4) // 16 * 16))
    passes = max(1, -(-k // kc0))
    kc = _round_to(-(-k // passes), 4)
    mc = max(mr, min(288, (t.l2 // 8) // (kc * 4) // mr * mr))
    if variant in ("linear_dw", "linear_dwt") and n >= 512:
        # transposed A is packed from mc-float runs of its rows: longer runs stream better once
        # the A block is reused over many B panels
        mc = _round_to(384, mr)
    return {"mc": mc, "kc": kc}


def shape_blocks(params: dict, m: int, n: int, k: int, threads: int, isa: str | None = None) -> tuple[int, int, int]:
    """(mc, kc, nc) for a C (m x n) += A (m x k) B (k x n) GEMM from chosen (mc, kc): mc and nc are
    shaped so that `threads` threads get even work."""
    mr, nr, _ = tile_shape(isa)
    mc, kc = _round_to(int(params["mc"]), mr), max(1, int(params["kc"]))
    if k <= kc * 5 // 4:  # one pass over K beats a full pass plus a sliver
        kc = max(k, 1)
    nib = -(-m // mc)
    if threads > 1:
        nib = _round_to(nib, threads) if nib >= threads else nib
        mc = _round_to(-(-m // nib), mr)
        nib = -(-m // mc)
    nc = _round_to(n, nr)
    if nib < 2 * threads and threads > 1:  # too few row blocks: split the columns too
        njb = -(-2 * threads // nib)
        nc = _round_to(-(-n // njb), nr)
    return mc, kc, nc


def _problems(variant):
    """The (m, n, k, threads) GEMMs of `variant` that a workload's linear layers run."""
    def problems(w):
        mr, nr, _ = tile_shape()
        for batch, kin, kout in w.linears:
            for threads in w.threads:
                if variant == "linear_forward":
                    yield batch, kout, kin, threads
                elif variant == "linear_dx":
                    yield batch, kin, kout, threads
                elif variant == dw_variant(kout, kin, mr, nr):
                    yield (kout, kin, batch, threads) if variant == "linear_dw" else (kin, kout, batch, threads)
    return problems


def _candidates(problem, quick):
    mr, _, _ = tile_shape()
    kcs = (128, 256, 512) if quick else (96, 128, 192, 256, 384, 512)
    mcs = (mr * 6, mr * 12, mr * 24) if quick else (mr * 4, mr * 6, mr * 9, mr * 12, mr * 18, mr * 24, mr * 48)
    return [{"mc": mc, "kc": kc} for kc in kcs for mc in mcs]


def _runner(variant):
    def runner(problem, params):
        m, n, k, threads = problem
        ta, tb = variant in ("linear_dw", "linear_dwt"), variant == "linear_forward"
        rng = np.random.default_rng(0)
        a = rng.standard_normal((k, m) if ta else (m, k), dtype=np.float32)
        b = rng.standard_normal((n, k) if tb else (k, n), dtype=np.float32)
        c = np.empty((m, n), np.float32)
        blocks = shape_blocks(params, m, n, k, threads)
        return lambda: _gemm_into(a, b, c, ta, tb, blocks=blocks)
    return runner


BLOCKS = {v: knob(f"gemm.blocks.{v}", doc=f"(mc, kc) cache blocks of {v}",
                  heuristic=lambda p, v=v: heuristic_blocks(v, *p),
                  shape_class=lambda p: f"{pow2_class(*p[:3])}t{p[3]}",
                  problems=_problems(v), candidates=_candidates, runner=_runner(v))
          for v in VARIANTS}


def blocks_for(variant: str, m: int, n: int, k: int, threads: int) -> tuple[int, int, int]:
    """(mc, kc, nc) for one call: the knob's choice (tuned or heuristic), shaped for the threads."""
    key = (variant, m, n, k, threads, choice_token(), tunedb.generation())
    got = _SHAPED.get(key)
    if got is None:
        if len(_SHAPED) > 4096:
            _SHAPED.clear()
        got = _SHAPED[key] = shape_blocks(BLOCKS[variant].choose((m, n, k, threads)), m, n, k, threads)
    return got


_SHAPED: dict = {}


def dw_variant(m: int, k: int, mr: int, nr: int) -> str:
    """linear_backward's weight gradient (m out, k in): dw = g.T @ x ("linear_dw"), or
    dw.T = x.T @ g ("linear_dwt") when that fills the register tiles better (13 -> 512: 0.81 vs
    0.41 of the lanes); at equal use dw is the faster of the two."""
    return "linear_dwt" if _lane_use(k, m, mr, nr) > 1.02 * _lane_use(m, k, mr, nr) else "linear_dw"


_SCRATCH = threading.local()


def _workspace(size: int) -> np.ndarray:
    """This thread's packing scratch of at least `size` floats, kept between calls: freshly
    allocated multi-MB buffers come from mmap, and their page faults cost up to ~20% per call."""
    ws = getattr(_SCRATCH, "ws", None)
    if ws is None or ws.size < size:
        ws = np.empty(max(size, 2 * (0 if ws is None else ws.size)), np.float32)
        _SCRATCH.ws = ws
    return ws


def _grad_buffer(size: int) -> np.ndarray:
    """This thread's buffer for the masked output gradient (consumed before linear_backward returns)."""
    buf = getattr(_SCRATCH, "grad", None)
    if buf is None or buf.size < size:
        buf = _SCRATCH.grad = np.empty(max(size, 2 * (0 if buf is None else buf.size)), np.float32)
    return buf[:size]


_DUMMY = np.zeros(1, np.float32)
_DUMMY2 = np.zeros((1, 1), np.float32)


def _gemm_into(a, b, c, ta, tb, *, alpha=1.0, beta=0.0, bias=None, relu=False, y=None, db=None,
               op="gemm", blocks=None):
    """Run the driver on validated, C-contiguous float32 arrays (c is written)."""
    m, n = c.shape
    k = a.shape[0] if ta else a.shape[1]
    if m == 0 or n == 0:
        if db is not None:
            db[:] = 0.0
        return c
    isa = host_target().isa
    mc, kc, nc = blocks_for(op, m, n, k, numba.get_num_threads()) if blocks is None else blocks
    mr, nr, _ = tile_for(isa)
    need = -(-n // nr) * (k * nr + 16) + -(-m // mc) * -(-n // nc) * -(-mc // mr) * mr * max(kc, 1)
    ws = _workspace(need)
    args = (a, b, c, _DUMMY if bias is None else bias, _DUMMY2 if y is None else y,
            _DUMMY if db is None else db, ws, m, n, k, np.float32(alpha), np.float32(beta), mc, kc, nc,
            ta, tb, bias is not None, relu, y is not None, db is not None)
    kern = _kernel(isa)
    try:
        kern(*args)
    except Exception as e:  # dispatch never fails: if this ISA's kernel cannot build, go portable
        if isa == "scalar" or kern.signatures:
            raise
        log.warning("gemm %s kernel failed to build (%s); using the portable scalar kernel", isa, e)
        _kernel("scalar")(*args)
    return c


# --------------------------------------------------------------------------- validation


def _matrix(name, x, ndim=2):
    """x as a C-contiguous float32 ndim-array, or a TypeError/ValueError naming `name`."""
    if not isinstance(x, np.ndarray):
        raise TypeError(f"{name} must be a numpy.ndarray of float32, got {type(x).__name__}")
    if x.dtype != _F32:
        raise TypeError(f"{name} must have dtype float32, got {x.dtype}")
    if x.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {x.shape}")
    return x if x.flags.c_contiguous else np.ascontiguousarray(x)


def _operand(name, x, trans):
    """A 2-D float32 operand and its transposition flag; an F-ordered view flips the flag, no copy."""
    if isinstance(x, np.ndarray) and x.ndim == 2 and not x.flags.c_contiguous and x.T.flags.c_contiguous:
        return _matrix(name, x.T), not trans
    return _matrix(name, x), trans


def _out(name, out, shape, *inputs):
    if not isinstance(out, np.ndarray) or out.dtype != _F32:
        raise TypeError(f"{name} must be a float32 numpy.ndarray, got "
                        f"{getattr(out, 'dtype', type(out).__name__)}")
    if out.shape != shape:
        raise ValueError(f"{name} must have shape {shape}, got {out.shape}")
    if not out.flags.c_contiguous or not out.flags.writeable:
        raise ValueError(f"{name} must be C-contiguous and writeable")
    if any(np.may_share_memory(out, x) for x in inputs):  # tiles are written while inputs are read
        raise ValueError(f"{name} must not overlap the inputs")
    return out


def _scalar(name, v):
    try:
        return float(v)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a real number, got {v!r}") from None


def _activation(activation):
    if activation not in (None, "relu"):
        raise ValueError(f"activation must be None or 'relu', got {activation!r}")
    return activation == "relu"


# --------------------------------------------------------------------------- public ops


def gemm(a, b, out=None, *, trans_a=False, trans_b=False, alpha=1.0, beta=0.0):
    """out = alpha * op(a) @ op(b) + beta * out; a: (M, K) or (K, M), b: (K, N) or (N, K) float32."""
    a, ta = _operand("a", a, bool(trans_a))
    b, tb = _operand("b", b, bool(trans_b))
    alpha, beta = _scalar("alpha", alpha), _scalar("beta", beta)
    m, ka = (a.shape[1], a.shape[0]) if ta else a.shape
    kb, n = (b.shape[1], b.shape[0]) if tb else b.shape
    if ka != kb:
        raise ValueError(f"inner dimensions differ: op(a) is {m}x{ka} but op(b) is {kb}x{n}")
    if out is None:
        out, beta = np.empty((m, n), np.float32), 0.0
    else:
        _out("out", out, (m, n), a, b)
    return _gemm_into(a, b, out, ta, tb, alpha=alpha, beta=beta)


def linear_forward(x, w, b=None, *, activation=None, out=None):
    """y = act(x @ w.T + b); x: (N, K), w: (M, K), b: (M,) float32 -> y: (N, M)."""
    relu = _activation(activation)
    x, w = _matrix("x", x), _matrix("w", w)
    n, k = x.shape
    m = w.shape[0]
    if w.shape[1] != k:
        raise ValueError(f"w must have shape (M, {k}) to match x {x.shape}, got {w.shape}")
    if b is not None:
        b = _matrix("b", b, 1)
        if b.shape != (m,):
            raise ValueError(f"b must have shape ({m},), got {b.shape}")
    y = np.empty((n, m), np.float32) if out is None else _out("out", out, (n, m), x, w)
    return _gemm_into(x, w, y, False, True, bias=b, relu=relu, op="linear_forward")


def linear_backward(dy, x, w, y=None, *, activation=None, need_dx=True):
    """Gradients of linear_forward; dy, y: (N, M), x: (N, K), w: (M, K) -> dx (N, K), dw (M, K), db (M,).

    need_dx=False skips dx (returned as None): the first layer's input gradient is never used.
    """
    relu = _activation(activation)
    dy, x, w = _matrix("dy", dy), _matrix("x", x), _matrix("w", w)
    n, m = dy.shape
    k = x.shape[1]
    if x.shape[0] != n:
        raise ValueError(f"x must have {n} rows like dy {dy.shape}, got {x.shape}")
    if w.shape != (m, k):
        raise ValueError(f"w must have shape ({m}, {k}) for dy {dy.shape} and x {x.shape}, got {w.shape}")
    if relu:
        if y is None:
            raise ValueError("y (the forward output) is required with activation='relu'")
        y = _matrix("y", y)
        if y.shape != dy.shape:
            raise ValueError(f"y must have the shape of dy {dy.shape}, got {y.shape}")
    db = np.empty(m, np.float32)
    g = _grad_buffer(n * m).reshape(n, m) if relu and n * m else dy
    if n * m:
        _relu_grad(dy, y if relu else _DUMMY2, g, db, relu)
    else:
        db[:] = 0.0
    dx = _gemm_into(g, w, np.empty((n, k), np.float32), False, False, op="linear_dx") if need_dx else None
    mr, nr, _ = tile_shape()
    if dw_variant(m, k, mr, nr) == "linear_dwt":
        dw = np.ascontiguousarray(_gemm_into(x, g, np.empty((k, m), np.float32), True, False, op="linear_dwt").T)
    else:
        dw = _gemm_into(g, x, np.empty((m, k), np.float32), True, False, op="linear_dw")
    return dx, dw, db


def batch_reduce_gemm(a, b, out=None, *, alpha=1.0, beta=0.0):
    """out = alpha * sum_i a[i] @ b[i] + beta * out; a: (nb, M, K), b: (nb, K, N) float32 -> (M, N)."""
    a, b = _matrix("a", a, 3), _matrix("b", b, 3)
    alpha, beta = _scalar("alpha", alpha), _scalar("beta", beta)
    nb, m, k = a.shape
    if b.shape[0] != nb or b.shape[1] != k:
        raise ValueError(f"b must have shape ({nb}, {k}, N) to match a {a.shape}, got {b.shape}")
    n = b.shape[2]
    if out is None:
        out, beta = np.empty((m, n), np.float32), 0.0
    else:
        _out("out", out, (m, n), a, b)
    # the batch folds into one long reduction: [a_0 | a_1 | ...] (M, nb*K) @ [b_0; b_1; ...] (nb*K, N)
    a_cat = np.ascontiguousarray(a.transpose(1, 0, 2)).reshape(m, nb * k)
    return _gemm_into(a_cat, b.reshape(nb * k, n), out, False, False, alpha=alpha, beta=beta,
                      op="batch_reduce_gemm")
