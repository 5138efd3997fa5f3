"""The GEMM driver's thin cases: C with one row or one column, i.e. a matrix-vector product, and
a product over K = 1, i.e. an outer product.

C = epilogue(alpha * op(A) @ op(B) + beta * C) with m == 1 or n == 1 is memory-bound: every
element of the matrix operand is used once, so the register tile's packing and its MR x NR
lanes (of which one row or column would be used) only cost. C is then a flat vector c of length
L (= m or n) and the product takes one of two forms, by the matrix operand's memory order:
  dot:  c[i] = sum_k R[i, k] v[k]   (R: (L, K) row-major; one vectorised dot product per row)
  axpy: c[j] = sum_k v[k] R[k, j]   (R: (K, L) row-major; rows streamed into L accumulators)
Each output element is summed in the same order whatever the thread split (chunks of c), so
results are bit-identical for any thread count.
"""
from __future__ import annotations

import numpy as np
from numba import prange

from ..codegen import jit
from ..codegen.bf16 import relu_keep

_CHUNK = 256  # outputs per parallel task: a dot task streams 256 rows, an axpy task keeps 1 KiB of sums


@jit(inline="always")
def _finish(s, c, bias, i, scale, flags):
    """c[i] = relu?(alpha * s + beta * c[i] + bias?); flags = (use_bias, bias stride, relu)."""
    alpha, beta = scale
    use_bias, bstride, relu = flags
    r = alpha * s
    if beta != 0.0:
        r += beta * c[i]
    if use_bias:
        r += bias[i * bstride]
    if relu and r < 0:  # x < 0 -> 0, else x: NaN stays NaN
        r = np.float32(0.0)
    c[i] = r


@jit(parallel=True)
def gemv_dot(r, v, c, bias, scale, flags):
    """c[i] = epilogue(sum_k r[i, k] v[k]); r: (L, K), v: (K,), c: (L,), bias: (L * bstride,) or
    (1,); scale = (alpha, beta) float32; flags = (use_bias, bias stride, relu)."""
    n, k = r.shape
    rf = r.reshape(n * k)
    for t in prange((n + _CHUNK - 1) // _CHUNK):
        for i in range(t * _CHUNK, min(n, (t + 1) * _CHUNK)):
            s = np.float32(0.0)
            base = i * k
            for kk in range(k):
                s += rf[np.uint64(base + kk)] * v[np.uint64(kk)]
            _finish(s, c, bias, i, scale, flags)


@jit(parallel=True)
def gemv_axpy(r, v, c, bias, scale, flags):
    """c[j] = epilogue(sum_k v[k] r[k, j]); r: (K, L), v: (K,), c: (L,); other arguments as gemv_dot's."""
    k, n = r.shape
    rf = r.reshape(k * n)
    for t in prange((n + _CHUNK - 1) // _CHUNK):
        j0, j1 = t * _CHUNK, min(n, (t + 1) * _CHUNK)
        acc = np.zeros(j1 - j0, np.float32)
        for kk in range(k):
            s = v[kk]
            base = kk * n
            for j in range(j1 - j0):
                acc[np.uint64(j)] += s * rf[np.uint64(base + j0 + j)]
        for j in range(j0, j1):
            _finish(acc[j - j0], c, bias, j, scale, flags)


def gemv_into(a, b, c, ta, tb, *, alpha, beta, bias, relu):
    """C (m, n) with m == 1 or n == 1 = epilogue(alpha * op(a) @ op(b) + beta * C), as gemm_into."""
    m, n = c.shape
    if n == 1:  # c[i] = sum_k op(a)[i, k] * op(b)[k]; op(b)'s one column is contiguous either way
        mat, vec, dot = a, b.reshape(b.size), not ta
    else:       # m == 1: c[j] = sum_k op(a)[k] * op(b)[k, j]; op(a)'s one row is contiguous
        mat, vec, dot = b, a.reshape(a.size), tb
    bstride = 1 if m == 1 else 0  # n == 1: every row takes bias[0]
    dummy = c.reshape(c.size) if bias is None else bias
    args = (mat, vec, c.reshape(c.size), dummy, (np.float32(alpha), np.float32(beta)),
            (bias is not None, bstride, bool(relu)))
    (gemv_dot if dot else gemv_axpy)(*args)
    return c


@jit(parallel=True, fastmath=())  # no contraction: the product and the bias add round apart, as in the tile
def _outer(u, v, c, bias, mask, alpha, flags):
    """c[i, j] = epilogue((alpha * u[i]) * v[j]): the register tile's arithmetic for K = 1 and beta
    = 0 (bit for bit), then bias, ReLU and mask as its epilogue; flags = (use_bias, relu, use_mask)."""
    m, n = c.shape
    cf, mf = c.reshape(m * n), mask.reshape(mask.size)
    use_bias, relu, use_mask = flags
    for t in prange((m + 15) // 16):
        for i in range(t * 16, min(m, t * 16 + 16)):
            s = alpha * u[i]
            base = i * n
            for j in range(n):
                r = s * v[j]
                if use_bias:
                    r += bias[j]
                if relu and r < 0:
                    r = np.float32(0.0)
                if use_mask:
                    r = relu_keep(r, mf[np.uint64(base + j)])
                cf[np.uint64(base + j)] = r


def outer_into(a, b, c, *, alpha, bias, relu, mask):
    """C (m, n) = epilogue(alpha * op(a) @ op(b)) over K = 1 (beta = 0), as gemm_into: C is written
    once, row by row, instead of as register tiles that each run a one-step K loop. op(a)'s column
    and op(b)'s row are contiguous whatever the transposition."""
    dummy = c if mask is None else mask
    _outer(a.reshape(a.size), b.reshape(b.size), c, c.reshape(c.size) if bias is None else bias, dummy,
           np.float32(alpha), (bias is not None, bool(relu), mask is not None))
    return c
