"""dW and db of a linear layer whose input gradient is not needed (an MLP's first layer), in one
pass over dy and the forward's output y.

linear_backward(..., need_dx=False) on a narrow input (a dozen dense features against hundreds
of outputs) would otherwise write the masked gradient g (N x M) to memory in the ReLU pass (which
also sums db) and read it back in a GEMM with few FLOPs. Here g is made a chunk of rows at a time
into a buffer that stays in L2, laid out as the GEMM register tile's k-major panels
(codegen/simd.py); without a ReLU (g = dy) the tiles read dy's full panels where they lie, the
next panel's rows hinted ahead, so that reading dy overlaps the FMAs instead of preceding them.
db comes out of the same tiles as one more row of A, all ones:

    C (KP, M) = [x | 1 | 0 ...]^T @ g,   dW = C[:K]^T,   db = C[K]

KP rounds K + 1 up to whole tiles (for 13 dense features the ones row fills padding the tiles
would compute anyway). Every sum over N runs in order in fp32 (dW bit for bit as the GEMM
route's; db in fp32 as dW, where the ReLU pass sums in float64), and each column panel belongs to
one task: results do not depend on the thread count.
"""
from __future__ import annotations

import functools
import logging

import numpy as np
from numba import prange

from ..codegen import KernelSpec, get_kernel, host_target, jit, kernel_factory, num_threads, target_isa, uidx as _u
from ..codegen.bf16 import relu_keep
from ..codegen.simd import NO_MASK, fma_tile, tile_code, tile_for
from .gemm_kernel import NO_BYTES
from .gemm_pack import prefetch_rows, prefetch_run, rows_ahead
from .workspace import thread_buffer

log = logging.getLogger("jitkern")


def masked_grad_fits(k: int, mr: int) -> bool:
    """Whether a layer of k inputs takes the fused route on a tile of mr rows: x and the ones row
    span at most four row tiles, so each masked chunk is re-read from cache at most four times."""
    return k + 1 <= 4 * mr


@jit(inline="always")
def _mask_rows(gp, src, nr, rows, geo, relu):
    """Rows p0 .. p0 + rows of dy masked by y > 0 (or dy as it is), columns of panels pfirst .. pend,
    into gp as k-major panels of nr columns (panel p at (p - pfirst) * rows * nr), columns past m
    zeroed. Rows are read in memory order, the rows PACK_AHEAD bytes on hinted into L2.
    src = (dy, y) flat; geo = (p0, pfirst, pend, m, n)."""
    dyf, yf = src
    p0, pfirst, pend, m, n = geo
    j0 = pfirst * nr
    width = min(pend * nr, m) - j0
    ahead = rows_ahead(m * 4)
    for i in range(rows):
        row = p0 + i
        s = row * m + j0
        if row + ahead < n:
            prefetch_run(dyf, s + ahead * m, width * 4)
            if relu:
                prefetch_run(yf, s + ahead * m, width * 4)
        for p in range(pend - pfirst):
            d = (p * rows + i) * nr
            c = s + p * nr
            w = min(nr, width - p * nr)  # a runtime trip count: LLVM vectorises the loop (a constant
            if relu:                     # one it unrolls into scalar compares first)
                for q in range(w):
                    gp[_u(d + q)] = relu_keep(dyf[_u(c + q)], yf[_u(c + q)])
            else:
                for q in range(w):
                    gp[_u(d + q)] = dyf[_u(c + q)]
            for q in range(w, nr):  # the ragged last panel's columns past m
                gp[_u(d + q)] = 0.0


@kernel_factory("masked_weight_grad")
def _factory(spec: KernelSpec):
    MR, NR = spec["mr"], spec["nr"]
    CODE = tile_code(MR, NR, spec["vw"])

    @jit(parallel=True)
    def masked_weight_grad_kernel(x, dy, y, dw, db, ws, geo, relu):
        # x: (n, k), dy and y: (n, m) float32 (y unread without relu); dw: (m, k), db: (m,) out;
        # ws: float32 scratch (A, C, one masked chunk per task); geo = (kp, kc, tasks): A's rows
        # (x's and the ones row) padded to whole tiles, rows per chunk, parallel tasks
        n, m = dy.shape
        k = x.shape[1]
        kp, kc, tasks = geo
        npan = (m + NR - 1) // NR
        ldc = npan * NR
        per_task = (npan + tasks - 1) // tasks * kc * NR
        xa, ct, chunks = ws[:n * kp], ws[n * kp:n * kp + kp * ldc], ws[n * kp + kp * ldc:]
        xf, dyf, yf = x.reshape(x.size), dy.reshape(dy.size), y.reshape(y.size)
        for i in prange(n):  # A's k-major panels: x's row, a one, zeros to kp
            for r in range(k):
                xa[_u(i * kp + r)] = xf[_u(i * k + r)]
            xa[_u(i * kp + k)] = 1.0
            for r in range(k + 1, kp):
                xa[_u(i * kp + r)] = 0.0
        nothing = np.zeros(NR, np.float32)
        for t in prange(tasks):  # a task: consecutive column panels (a panel's sums: one task's order)
            gp = chunks[t * per_task:(t + 1) * per_task]
            pfirst, pend = t * npan // tasks, (t + 1) * npan // tasks
            # without a mask, dy's full panels are read where they lie, each panel's chunk rows
            # hinted while the panel before computes; only a ragged last panel is copied, padded
            copied = pfirst if relu else (pend - 1 if m % NR and pend == npan else pend)
            for p0 in range(0, n, kc):
                rows = min(kc, n - p0)
                if copied < pend:
                    _mask_rows(gp, (dyf, yf), NR, rows, (p0, copied, pend, m, n), relu)
                for p in range(pfirst, pend):
                    q0, q = n, pfirst  # the panel hinted next: none
                    if p < copied:
                        b_op = (dyf, p0 * m + p * NR, m)
                        q0, q = (p0, p + 1) if p + 1 < copied else (p0 + kc, pfirst)
                    else:
                        b_op = (gp, (p - copied) * rows * NR, NR)
                    for ip in range(kp // MR):
                        if q0 < n:
                            part = min(kc, n - q0)
                            r0, r1 = ip * part * MR // kp, (ip + 1) * part * MR // kp
                            prefetch_rows(dyf, (q0 + r0) * m + q * NR, m, r1 - r0, NR * 4)
                        fma_tile(CODE, rows, (xa, p0 * kp + ip * MR, kp, 1), b_op,
                                 (ct, ip * MR * ldc + p * NR, ldc), (nothing, 0), (p0 > 0, False, False, False, NO_MASK),
                                 (nothing, NO_BYTES, 0))
            for j in range(pfirst * NR, min(m, pend * NR)):
                for r in range(k):
                    dw[_u(j), _u(r)] = ct[_u(r * ldc + j)]
                db[_u(j)] = ct[_u(k * ldc + j)]
    return masked_weight_grad_kernel


@functools.lru_cache(maxsize=None)
def _kernel(isa: str):
    mr, nr, vw = tile_for(isa)
    return get_kernel(KernelSpec.make("masked_weight_grad", mr=mr, nr=nr, vw=vw))


def masked_weight_grad(dy, x, y, relu, dw, db):
    """dw (M, K) = g^T x and db (M,) = g summed over rows, g = dy where y > 0 else 0 (relu) or dy;
    dy, y: (N, M), x: (N, K) validated C-contiguous float32 arrays (y unread without relu); dw,
    db: float32 outputs, written and returned."""
    isa = target_isa()
    try:
        _run(isa, dy, x, y, bool(relu), dw, db)
    except Exception as e:  # as gemm_into: an ISA kernel that cannot build falls back to portable code
        if isa == "scalar" or _kernel(isa).signatures:
            raise
        log.warning("masked weight-gradient %s kernel failed to build (%s); using the scalar kernel", isa, e)
        _run("scalar", dy, x, y, bool(relu), dw, db)
    return dw, db


def _run(isa, dy, x, y, relu, dw, db):
    n, m = dy.shape
    if n == 0:
        dw[...], db[...] = 0.0, 0.0
        return
    mr, nr, _ = tile_for(isa)
    kp = -(-(x.shape[1] + 1) // mr) * mr
    npan = -(-m // nr)
    tasks = min(npan, num_threads())
    # a task's masked chunk in a quarter of L2, from which its row tiles read each panel
    cols = -(-npan // tasks) * nr
    kc = min(512, max(16, host_target().l2 // 4 // (cols * 4)))
    size = n * kp + kp * npan * nr + tasks * cols * kc
    _kernel(isa)(x, dy, y, dw, db, thread_buffer("masked_grad", np.float32, size), (kp, kc, tasks), relu)

