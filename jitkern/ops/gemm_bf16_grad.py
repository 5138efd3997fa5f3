"""The bf16 backward's ReLU-gradient pass: dy masked by y > 0 and rounded to bf16 for both GEMMs of
linear_backward (ops/gemm_bf16.py), its unrounded column sums into db; the bf16 counterpart of
ops/gemm_kernel.relu_grad.
"""
from __future__ import annotations

import numpy as np
from numba import prange

from ..codegen import jit
from ..codegen.bf16 import relu_keep, widen
from ..codegen.simd_bf16 import round_bf16
from .gemm_kernel import _GRAD_CHUNKS, _u, add_chunks


@jit(parallel=True)
def relu_grad_bf16(dy, y, g, db, flags):
    """g = bf16(dy where y > 0 else 0) (or bf16(dy) without relu), db[j] = sum_i of the unrounded
    masked dy[i, j]; flags = (relu, write_g): g is written if relu or write_g (without either, dy
    is bf16 already and is the GEMMs' operand).

    dy, y: (n, m) float32 or uint16 bf16 bits; g: (n, m) uint16; db: (m,) float32. Chunks of rows
    sum in order (float64), then the chunks are added in order, as relu_grad.
    """
    relu, write_g = flags
    n, m = dy.shape
    dyf, yf, gf = dy.reshape(n * m), y.reshape(y.size), g.reshape(g.size)
    part = np.zeros((_GRAD_CHUNKS, m), np.float64)
    for c in prange(_GRAD_CHUNKS):
        acc = part[c]
        for i in range(c * n // _GRAD_CHUNKS, (c + 1) * n // _GRAD_CHUNKS):
            row = i * m
            if relu:  # a select once vectorised; NaN/inf in dy vanish where the unit was inactive
                for j in range(m):
                    v = relu_keep(widen(dyf[_u(row + j)]), widen(yf[_u(row + j)]))
                    gf[_u(row + j)] = round_bf16(v)
                    acc[_u(j)] += np.float64(v)
            elif write_g:
                for j in range(m):
                    v = widen(dyf[_u(row + j)])
                    gf[_u(row + j)] = round_bf16(v)
                    acc[_u(j)] += np.float64(v)
            else:
                for j in range(m):
                    acc[_u(j)] += np.float64(widen(dyf[_u(row + j)]))
    add_chunks(part, db)
