"""Plain NumPy references of the bf16 ops (ops/reference.py re-exports them): bf16 operands as their
exact values, float64 sums, outputs rounded once to float32 or bf16 (round-to-nearest-even,
NaN-preserving), as the kernels promise.
"""
from __future__ import annotations

import numpy as np

from .bf16 import BF16Array

# --------------------------------------------------------------------------- rounding and the GEMM family


def bf16_round(x):
    """float32 x rounded to the nearest bf16 value, ties to even; NaN stays NaN (quiet bit set,
    sign and high payload kept); denormals round like any value. -> float32 (bf16-exact)."""
    bits = np.array(x, np.float32).view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    hi = np.where(np.isnan(np.asarray(x, np.float32)), (bits >> 16) | 0x40, rounded)
    return (hi.astype(np.uint32) << 16).view(np.float32)


def _values(x):
    """float64 values of a BF16Array or an array (a signalling NaN widens to a quiet one, as in fp32 adds)."""
    with np.errstate(invalid="ignore"):
        return np.asarray(x.to_float32() if isinstance(x, BF16Array) else x, np.float64)


def _result(y, dtype):
    """y (float64) as float32, or as a BF16Array rounded from that float32 (dtype "bfloat16")."""
    y32 = np.ascontiguousarray(y, np.float32)
    if dtype != "bfloat16":
        return y32
    return BF16Array((bf16_round(y32).view(np.uint32) >> 16).astype(np.uint16))


def gemm_bf16(a, b, out=None, *, trans_a=False, trans_b=False, alpha=1.0, beta=0.0, out_dtype=None):
    """gemm with BF16Array a, b (exact products, float64 sums) -> float32, or BF16Array for a BF16Array
    out or out_dtype="bfloat16"."""
    a64, b64 = _values(a), _values(b)
    c = alpha * ((a64.T if trans_a else a64) @ (b64.T if trans_b else b64))
    if out is not None and beta != 0.0:
        c = c + beta * _values(out)
    return _result(c, out_dtype or ("bfloat16" if isinstance(out, BF16Array) else "float32"))


def linear_forward_bf16(x, w, b=None, *, activation=None, out=None, out_dtype=None):
    """linear_forward with BF16Array x, w (b float32 or BF16Array) -> y float32 or BF16Array."""
    y = _values(x) @ _values(w).T
    if b is not None:
        y = y + _values(b)
    if activation == "relu":
        y = np.maximum(y, 0.0)
    return _result(y, out_dtype or ("bfloat16" if isinstance(out, BF16Array) else "float32"))


def linear_backward_bf16(dy, x, w, y=None, *, activation=None, need_dx=True, dx_dtype=None):
    """Gradients of linear_forward_bf16: the GEMMs read g = bf16(masked dy); db sums the masked dy
    unrounded -> dx (float32 or BF16Array, dx_dtype), dw, db float32."""
    g = _values(dy)
    if activation == "relu":
        g = np.where(_values(y) > 0, g, 0.0)
    gb = bf16_round(g.astype(np.float32)).astype(np.float64)
    dx = _result(gb @ _values(w), dx_dtype) if need_dx else None
    return dx, (gb.T @ _values(x)).astype(np.float32), g.sum(axis=0).astype(np.float32)


# --------------------------------------------------------------------------- Split tables


def bf16_split(w):
    """Split float32 (..., D) into (hi, lo) uint16 halves; hi is the truncated bf16 value."""
    bits = np.ascontiguousarray(w, np.float32).view(np.uint32)
    return (bits >> 16).astype(np.uint16), (bits & 0xFFFF).astype(np.uint16)


def bf16_join(hi, lo):
    """Reassemble the exact float32 from its split halves."""
    bits = (np.asarray(hi).astype(np.uint32) << 16) | np.asarray(lo).astype(np.uint32)
    return bits.view(np.float32)


def bf16_to_float32(hi):
    """The bf16 value the forward reads (the high half, low bits zero) as float32."""
    return (np.asarray(hi).astype(np.uint32) << 16).view(np.float32)


# --------------------------------------------------------------------------- cross layer


def cross_layer_forward_bf16(x0, xl, v, w, b, *, out=None, out_u=None, out_y=None):
    """cross_layer_forward on BF16Array x0, xl, v, w: u = bf16(xl @ v.T), x_next = bf16(x0 * (u @ w.T
    + b) + xl) from the float32 value; float64 inside -> (x_next, u) BF16Arrays."""
    x0, xl, v, w, b = (_values(a) for a in (x0, xl, v, w, b))
    u = _result(xl @ v.T, "bfloat16")
    y = _values(u) @ w.T + b
    return _result(x0 * y + xl, "bfloat16"), u


def cross_layer_backward_bf16(dx_next, x0, xl, u, v, w, b, *, y=None, accumulate_dx0=None, out_dxl=None):
    """(dx0, dxl, dv, dw, db) float32 of cross_layer_forward_bf16 (dx_next float32 or BF16Array): the
    GEMMs read dy = dx_next * x0 rounded to bf16 and du = bf16(dy @ w); db sums the unrounded dy."""
    d, x0, xl, u, v, w, b = (_values(a) for a in (dx_next, x0, xl, u, v, w, b))
    dy = (d * x0).astype(np.float32).astype(np.float64)
    dyb = bf16_round(dy.astype(np.float32)).astype(np.float64)
    du = _values(_result(dyb @ w, "bfloat16"))
    dx0 = d * (u @ w.T + b)
    if accumulate_dx0 is not None:
        dx0 = dx0 + accumulate_dx0
    f32 = np.float32
    return dx0.astype(f32), (d + du @ v).astype(f32), (du.T @ xl).astype(f32), (dyb.T @ u).astype(f32), \
        dy.sum(axis=0).astype(f32)
