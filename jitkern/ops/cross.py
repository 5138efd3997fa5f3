"""Low-rank cross layer of DCNv2 (TorchRec's LowRankCrossNet, DLRM-DCNv2's interaction):

    u = xl @ v.T;  x_next = x0 * (u @ w.T + b) + xl      v: (r, n), w: (n, r), b: (n,)

Forward: two GEMMs, the bias in the second one's epilogue (ops.gemm), then one elementwise pass
x0 * (y + b) + xl, in place over y + b, or into x_next while y + b is kept for the backward
(out_y). Backward: y + b is the kept one, or recomputed by one GEMM from u; one fused pass over
the (B, n) arrays gives dx0 = dx_next * (y + b) (over y + b, or added into a running sum),
dy = dx_next * x0, db = column sums of dy, and dxl's first term dx_next; then du = dy @ w,
dw = dy.T @ u, dv = du.T @ xl, and dxl += du @ v accumulates in the last GEMM (beta = 1). The
elementwise passes are numba loops over row chunks, since the GEMM's register-tile epilogue
takes only bias and ReLU. The layer is two linear layers (V: n -> r, W: r -> n), so its GEMMs
run with the linear ops' blocking knobs (their shapes are in the DLRM's workload, for tuning).
"""
from __future__ import annotations

import numpy as np
from numba import prange

from ..codegen import jit, num_threads
from ..codegen.bf16 import widen
from ..codegen.vec import put
from . import _check, cross_bf16
from .bf16 import BF16Array
from .gemm import linear_forward
from .gemm_blocking import dw_variant
from .gemm_knobs import blocks_for, tile_shape
from .gemm_kernel import gemm_into
from .gemm_passes import transpose_into
from .workspace import thread_buffer

_CHUNKS = 16  # row chunks of the fused passes: a fixed count, so db's sums never depend on threads


@jit(parallel=True)
def _combine(x0, xl, y, out):
    """out = x0 * y + xl, element-wise in float32 (out may be y); all (B, n), y float32, x0, xl and
    out float32 or bf16 bits (widened on load, out rounded once on store)."""
    B, n = y.shape
    for c in prange(_CHUNKS):
        for i in range(c * B // _CHUNKS, (c + 1) * B // _CHUNKS):
            for j in range(n):
                put(out, (i, j), widen(x0[i, j]) * y[i, j] + widen(xl[i, j]))


@jit(inline="always")
def _grad_row(i, arrays, acc, flags):
    """Row i of the fused backward pass (see _grad); acc: this chunk's float64 column sums of dy."""
    dxn, x0, yb, dy, dxl, dx0 = arrays
    accumulate, copy = flags
    for j in range(dxn.shape[1]):
        d = dxn[i, j]
        g = d * widen(x0[i, j])                 # x0: float32, or bf16 bits (the bf16 layer)
        put(dy, (i, j), g)                      # dy: float32, or bf16 bits (what bf16 GEMMs read)
        acc[j] += np.float64(g)
        if accumulate:
            dx0[i, j] += d * yb[i, j]
        else:
            yb[i, j] = d * yb[i, j]
        if copy:
            dxl[i, j] = d


@jit(parallel=True)
def _grad(arrays, db, flags):
    """arrays = (dx_next, x0, yb, dy, dxl, dx0), all (B, n) float32 (x0 and dy may be bf16 bits: dy is
    then rounded, db still sums the unrounded values): dy = dx_next * x0; dx0 +=
    dx_next * yb (flags[0], accumulate) or yb = dx_next * yb (in place); dxl = dx_next (flags[1]);
    db (n,) = column sums of dy, each chunk's rows in order (float64), then the chunks in order."""
    B, n = arrays[0].shape
    part = np.zeros((_CHUNKS, n), np.float64)
    for c in prange(_CHUNKS):
        acc = part[c]
        for i in range(c * B // _CHUNKS, (c + 1) * B // _CHUNKS):
            _grad_row(i, arrays, acc, flags)
    for j in range(n):
        s = 0.0
        for c in range(_CHUNKS):
            s += part[c, j]
        db[j] = s


def _fused_backward(dx_next, x0, inputs, y, recompute, accumulate_dx0, out_dxl, dy_dtype=np.float32):
    """The backward's outputs checked (inputs: the layer's arrays, for overlap checks), then the
    fused pass -> (dy, dxl, dx0, db); y + b is y, or recompute() (over which dx0 is then written
    unless accumulated). x0 float32 or bf16 bits; dy is this thread's buffer, float32 or (dy_dtype
    uint16) bf16 bits."""
    B, n = dx_next.shape
    if y is not None:
        _check.output("y", y, (B, n), dx_next, *inputs)
    if accumulate_dx0 is not None:
        _check.output("accumulate_dx0", accumulate_dx0, (B, n), dx_next, *inputs, y)
    if out_dxl is not None:
        _check.output("out_dxl", out_dxl, (B, n), *inputs, accumulate_dx0, y)
        if out_dxl is not dx_next:
            _check.no_overlap("out_dxl", out_dxl, dx_next, what="dx_next (unless it is dx_next itself)")
    yb = recompute() if y is None else y
    dy = thread_buffer(f"cross_dy_{np.dtype(dy_dtype).name}", dy_dtype, B * n).reshape(B, n)
    dxl = np.empty((B, n), np.float32) if out_dxl is None else out_dxl
    dx0 = yb if accumulate_dx0 is None else accumulate_dx0
    db = np.zeros(n, np.float32)
    if B and n:
        _grad((dx_next, x0, yb, dy, dxl, dx0), db, (accumulate_dx0 is not None, dxl is not dx_next))
    return dy, dxl, dx0, db


def _gemm(a, b, c, ta, variant, beta=0.0):
    """c = op(a) @ b (+ c if beta), a transposed if ta, with the blocks of a linear op's variant."""
    m, n = c.shape
    k = a.shape[0] if ta else a.shape[1]
    if m and n:
        gemm_into(a, b, c, ta, False, blocks_for(variant, m, n, k, num_threads()), beta=beta)
    return c


def _weight_grad(g, x):
    """g.T @ x ((m, k) from g (B, m), x (B, k)) as linear_backward's dw: directly, or as the transpose
    of x.T @ g where that fills the register tiles better."""
    m, k = g.shape[1], x.shape[1]
    mr, nr, _ = tile_shape()
    out = np.empty((m, k), np.float32)
    if dw_variant(m, k, mr, nr) == "linear_dw":
        return _gemm(g, x, out, True, "linear_dw")
    transpose_into(_gemm(x, g, np.empty((k, m), np.float32), True, "linear_dwt"), out)
    return out


def _check_layer(x0, xl, v, w, b):
    """The layer's arrays checked: x0, xl (B, n), v (r, n), w (n, r), b (n,) float32."""
    x0 = _check.float_array("x0", x0, ndim=2)
    B, n = x0.shape
    xl = _check.float_array("xl", xl, shape=(B, n))
    v = _check.float_array("v", v, ndim=2)
    if v.shape[1] != n:
        raise ValueError(f"v must have shape (r, {n}) for x0 {x0.shape}, got {v.shape}")
    w = _check.float_array("w", w, shape=(n, v.shape[0]))
    b = _check.float_array("b", b, shape=(n,))
    return x0, xl, v, w, b


def cross_layer_forward(x0, xl, v, w, b, *, out=None, out_u=None, out_y=None):
    """(x_next, u): u = xl @ v.T, x_next = x0 * (u @ w.T + b) + xl.

    x0, xl: (B, n) float32, v: (r, n), w: (n, r), b: (n,) -> x_next (B, n), u (B, r);
    out, out_u: caller-given outputs (reused buffers); out_y: a (B, n) buffer that keeps
    u @ w.T + b for cross_layer_backward(y=...), which then need not recompute it.
    With BF16Array x0, xl, v, w (b float32): bf16 GEMM operands, fp32 accumulation and
    elementwise math, x_next and u BF16Arrays (rounded once), out_y float32 (ops/cross_bf16.py)."""
    if isinstance(x0, BF16Array):
        return cross_bf16.forward(x0, xl, v, w, b, _combine, out=out, out_u=out_u, out_y=out_y)
    x0, xl, v, w, b = _check_layer(x0, xl, v, w, b)
    B, n = x0.shape
    r = v.shape[0]
    if out_u is not None:
        _check.output("out_u", out_u, (B, r), x0, xl, v, w, b)
    if out_y is not None:
        _check.output("out_y", out_y, (B, n), x0, xl, v, w, b, out_u)
    if out is not None:
        _check.output("out", out, (B, n), x0, xl, v, w, b, out_u, out_y)
    u = linear_forward(xl, v, out=out_u)
    if out_y is None:
        y = x_next = linear_forward(u, w, b, out=out)
    else:
        y = linear_forward(u, w, b, out=out_y)
        x_next = np.empty((B, n), np.float32) if out is None else out
    if y.size:
        _combine(x0, xl, y, x_next)
    return x_next, u


def cross_layer_backward(dx_next, x0, xl, u, v, w, b, *, y=None, accumulate_dx0=None, out_dxl=None):
    """(dx0, dxl, dv, dw, db): the gradients of cross_layer_forward given dx_next (B, n) and the
    forward's u (B, r); y + b is recomputed from u (so the layer's bias b (n,) is needed too)
    unless given as y (the forward's out_y), which is then consumed: dx0 is written over it.

    accumulate_dx0: a (B, n) float32 array dx0 is added into (and returned as dx0), for the
    cross network's running sum over layers. out_dxl: a caller-given output for dxl; it may be
    dx_next itself (its values are read before dxl is written).
    bf16 layer (BF16Array x0, xl, u, v, w): dx_next float32 or BF16Array, every gradient float32;
    the GEMMs read dy and du rounded to bf16, db sums the unrounded dy."""
    if isinstance(x0, BF16Array):
        return cross_bf16.backward(dx_next, x0, xl, u, v, w, b, y, _fused_backward, accumulate_dx0, out_dxl)
    x0, xl, v, w, b = _check_layer(x0, xl, v, w, b)
    B, n = x0.shape
    r = v.shape[0]
    dx_next = _check.float_array("dx_next", dx_next, shape=(B, n))
    u = _check.float_array("u", u, shape=(B, r))
    dy, dxl, dx0, db = _fused_backward(dx_next, x0, (x0, xl, u, v, w, b), y, lambda: linear_forward(u, w, b),
                                       accumulate_dx0, out_dxl)
    # the W layer's (r -> n) input and weight gradients, then the V layer's (n -> r)
    du = _gemm(dy, w, np.empty((B, r), np.float32), False, "linear_dx")           # (B, r)
    dw = _weight_grad(dy, u)                                                      # (n, r)
    dv = _weight_grad(du, xl)                                                     # (r, n)
    _gemm(du, v, dxl, False, "linear_dx", beta=1.0)                               # dxl = dx_next + du @ v
    return dx0, dxl, dv, dw, db
