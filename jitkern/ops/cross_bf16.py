"""The low-rank cross layer on bf16 operands (ops.cross_layer_forward/backward with BF16Array x0,
xl, v, w): the precision="bf16" DCNv2 interaction.

Forward: u = bf16(xl @ v.T) and y = u @ w.T + b (fp32) by the bf16 linear ops, then one pass
x_next = bf16(x0 * y + xl), the fp32 value rounded once (x_next is the next layer's GEMM operand
and the top MLP's input). Backward: the fp32 layer's fused pass (dy = dx_next * x0, written
rounded to bf16; dx0; dxl's first term dx_next; x0 widened on the fly; db from the unrounded dy),
then the W layer's (r -> n) and V layer's (n -> r) backward by the bf16 linear_backward (du is
bf16; fp32 weight gradients), and dxl += du @ v in fp32.
"""
from __future__ import annotations

import numpy as np
from . import _check, gemm_bf16
from .bf16 import BF16Array
from .workspace import thread_buffer


def check_layer(x0, xl, v, w, b):
    """The layer's arrays checked: x0, xl (B, n), v (r, n), w (n, r) BF16Array, b (n,) float32."""
    x0 = BF16Array(_check.bf16_array("x0", x0, ndim=2))
    B, n = x0.shape
    xl = BF16Array(_check.bf16_array("xl", xl, shape=(B, n)))
    v = BF16Array(_check.bf16_array("v", v, ndim=2))
    if v.shape[1] != n:
        raise ValueError(f"v must have shape (r, {n}) for x0 {x0.shape}, got {v.shape}")
    w = BF16Array(_check.bf16_array("w", w, shape=(n, v.shape[0])))
    b = _check.float_array("b", b, shape=(n,))
    return x0, xl, v, w, b


def forward(x0, xl, v, w, b, combine, *, out=None, out_u=None, out_y=None):
    """(x_next, u) as BF16Arrays; out, out_u: BF16Array outputs, out_y: a float32 (B, n) buffer
    that keeps u @ w.T + b for the backward; combine: the fp32 layer's elementwise kernel
    (ops.cross._combine), which widens x0, xl and rounds x_next."""
    x0, xl, v, w, b = check_layer(x0, xl, v, w, b)
    B, n = x0.shape
    r = v.shape[0]
    inputs = (x0.bits, xl.bits, v.bits, w.bits, b)
    for name, o in (("out_u", out_u), ("out", out)):
        if o is not None and not isinstance(o, BF16Array):
            raise TypeError(f"{name} must be a BF16Array for bf16 inputs, got {type(o).__name__}")
    if out_u is not None:
        _check.output("out_u", out_u.bits, (B, r), *inputs, dtype=np.uint16)
    if out_y is not None:
        _check.output("out_y", out_y, (B, n), *inputs, getattr(out_u, "bits", None))
    if out is not None:
        _check.output("out", out.bits, (B, n), *inputs, getattr(out_u, "bits", None), out_y, dtype=np.uint16)
    u = gemm_bf16.linear_forward(xl, v, out=out_u, out_dtype="bfloat16")
    y = gemm_bf16.linear_forward(u, w, b, out=out_y)
    x_next = BF16Array(np.empty((B, n), np.uint16)) if out is None else out
    if y.size:
        combine(x0.bits, xl.bits, y, x_next.bits)
    return x_next, u


def backward(dx_next, x0, xl, u, v, w, b, y, fused, accumulate_dx0, out_dxl):
    """(dx0, dxl, dv, dw, db) of `forward`, all float32; dx_next float32 or BF16Array; y: the kept
    y + b or None; fused: the fp32 layer's checks and fused pass (ops.cross._fused_backward), which
    reads x0's bits widened. Arguments as ops.cross_layer_backward's."""
    x0, xl, v, w, b = check_layer(x0, xl, v, w, b)
    B, n = x0.shape
    r = v.shape[0]
    u = BF16Array(_check.bf16_array("u", u, shape=(B, r)))
    if isinstance(dx_next, BF16Array):
        dx_next = BF16Array(_check.bf16_array("dx_next", dx_next, shape=(B, n))).to_float32()
    dx_next = _check.float_array("dx_next", dx_next, shape=(B, n))
    dy, dxl, dx0, db = fused(dx_next, x0.bits, (x0.bits, xl.bits, u.bits, v.bits, w.bits, b), y,
                             lambda: gemm_bf16.linear_forward(u, w, b), accumulate_dx0, out_dxl, np.uint16)
    # the W layer (r -> n): du (bf16, what the V layer's GEMMs read) and dw from dy rounded in the
    # fused pass; then the V layer (n -> r)
    du, dw, _ = gemm_bf16.linear_backward(BF16Array(dy), u, w, dx_dtype="bfloat16")
    dvx = thread_buffer("cross_dvx", np.float32, B * n).reshape(B, n)
    _, dv, _ = gemm_bf16.linear_backward(du, xl, v, out_dx=dvx)
    np.add(dxl, dvx, out=dxl)
    return dx0, dxl, dv, dw, db
