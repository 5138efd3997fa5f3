"""The passes around a GEMM: a result computed transposed written out with the linear epilogue
(`transpose_into`), and the ReLU backward as a pass of its own (`relu_mask_into`, `relu_grad`) where
it cannot ride a GEMM's epilogue (the matrix-vector and bf16 paths, the bias gradient)."""
from __future__ import annotations

import numpy as np
from numba import prange

from ..codegen import jit, uidx as _u
from ..codegen.bf16 import relu_keep, widen
from ..codegen.vec import addr_of, put, vtranspose16

_DUMMY = np.zeros(1, np.float32)


def transpose_into(src, dst, bias=None, relu=False):
    """dst (n, m) = src (m, n).T, then (optionally) the linear epilogue dst = relu?(dst + bias)
    with bias (m,): the output of a GEMM computed transposed, finished on its way out. With an
    epilogue, src is left holding its values (it is applied in place before the transpose)."""
    _transpose_kernel(src, dst, _DUMMY if bias is None else bias, bias is not None, bool(relu))
    return dst


@jit(parallel=True)
def _transpose_kernel(src, dst, bias, use_bias, relu):
    # 16 x 16 blocks transposed in registers (rows of 16 floats loaded, columns stored as
    # 16-float vectors), ragged edges element-wise
    m, n = src.shape
    sf, df = src.reshape(m * n), dst.reshape(m * n)
    rowaddr = addr_of(src) + 4 * n * np.arange(m, dtype=np.int64)  # byte address of each row of src
    mb, nb = m // 16 * 16, n // 16 * 16
    epi = use_bias or relu
    for bi in prange((m + 15) // 16):
        i0 = bi * 16
        i1 = min(m, i0 + 16)
        if epi:  # on the block's rows of src, contiguous, before they are transposed: the rows of
            for i in range(i0, i1):  # dst a block spans are 4 KiB apart as often as not (L1 set conflicts)
                row, b = i * n, bias[i] if use_bias else np.float32(0.0)
                if use_bias and relu:  # ordered compare, as the tile epilogue: NaN stays NaN
                    for j in range(n):
                        v = sf[_u(row + j)] + b
                        sf[_u(row + j)] = np.float32(0.0) if v < 0 else v
                elif use_bias:
                    for j in range(n):
                        sf[_u(row + j)] += b
                else:
                    for j in range(n):
                        v = sf[_u(row + j)]
                        sf[_u(row + j)] = np.float32(0.0) if v < 0 else v
        if i0 < mb:
            for j0 in range(0, nb, 16):
                vtranspose16(rowaddr, i0, 4 * j0, df, j0 * m + i0, m)
        for j in range(0 if i0 >= mb else nb, n):
            for i in range(i0, i1):
                df[_u(j * m + i)] = sf[_u(i * n + j)]


# --------------------------------------------------------------------------- ReLU gradient


@jit(parallel=True)
def relu_mask_into(d, y):
    """d = d where y > 0 else +0.0, in place (the backward of a ReLU whose output is y); d, y: C-
    contiguous, same shape, float32 or uint16 bf16 bits (y also a byte mask: nonzero keeps). -> d."""
    df, yf = d.reshape(d.size), y.reshape(y.size)
    for i in prange(d.size):
        put(df, i, relu_keep(widen(df[i]), yf[i]))
    return d

_GRAD_CHUNKS = 16  # row chunks of the ReLU-gradient pass: a fixed count, so sums never depend on threads


@jit(parallel=True)
def relu_grad(dy, y, g, db, flags):
    """g = dy where y > 0 else +0.0 (relu) or g = dy (write_g: a bf16 g from a float32 dy), db[j] =
    sum_i of the unrounded g[i, j]; flags = (relu, write_g): g is written if either is set (else
    dy is the GEMMs' operand as it is).

    One pass hands both backward GEMMs a plain operand (read in place, no masked packing twice).
    dy, y: (n, m) float32, or uint16 bf16 bits; g: (n, m) float32, or uint16 (rounded to bf16);
    db: (m,) float32. Each chunk of rows sums its rows in order (float64), then the chunks are
    added in order, so db never depends on the thread count.
    """
    relu, write_g = flags
    n, m = dy.shape
    dyf, yf, gf = dy.reshape(n * m), y.reshape(y.size), g.reshape(g.size)
    part = np.zeros((_GRAD_CHUNKS, m), np.float64)
    for c in prange(_GRAD_CHUNKS):
        acc = part[c]
        for i in range(c * n // _GRAD_CHUNKS, (c + 1) * n // _GRAD_CHUNKS):
            row = i * m
            if relu:  # bit arithmetic, not a select: vectorised on bf16 data too; NaN/inf in dy vanish
                for j in range(m):  # where the unit was inactive
                    v = relu_keep(widen(dyf[_u(row + j)]), yf[_u(row + j)])
                    put(gf, _u(row + j), v)
                    acc[_u(j)] += np.float64(v)
            elif write_g:
                for j in range(m):
                    v = widen(dyf[_u(row + j)])
                    put(gf, _u(row + j), v)
                    acc[_u(j)] += np.float64(v)
            else:
                for j in range(m):
                    acc[_u(j)] += np.float64(widen(dyf[_u(row + j)]))
    for j in range(m):
        t = 0.0
        for c in range(_GRAD_CHUNKS):
            t += part[c, j]
        db[j] = t
