"""Element-wise activations outside the GEMM epilogue: sigmoid forward and backward (the DLRM's
--activation-function sigmoid; ReLU is fused into linear_forward/linear_backward)."""
from __future__ import annotations

import math

import numpy as np
from numba import prange

from ..codegen import KernelSpec, get_kernel, jit, kernel_factory
from ..codegen.vec import f64_from_bits
from . import _check


_PARALLEL_MIN = 1 << 14   # elements from which sigmoid_forward splits over threads (~5 cycles each)
_LOG2E, _LN2_HI, _LN2_LO = 1.4426950408889634, 0.6931471803691238, 1.9082149292705877e-10
_INV_FACT = tuple(1.0 / math.factorial(i) for i in range(14))


@jit(inline="always")
def _sigmoid(x):
    """sigmoid(x) for a float32 x, computed in float64 as 1 / (1 + e) or e / (1 + e), e = exp(-|x|),
    then rounded once to float32. exp is inlined arithmetic (no libm call, so the loop vectorises):
    e = 2^k * exp(r), |r| <= ln2 / 2, exp(r) by its degree-13 Taylor polynomial (truncation below
    float64 rounding), 2^k built from its bits. |x| is capped at 110, where float32 results are
    already 0 or 1. NaN stays NaN (the cap's compare is false for it; k is made 0 before the bits)."""
    z = np.float64(x)
    a = -abs(z)
    if a < -110.0:
        a = -110.0
    k = np.floor(a * _LOG2E + 0.5)
    r = (a - k * _LN2_HI) - k * _LN2_LO
    p = _INV_FACT[13]
    p = p * r + _INV_FACT[12]
    p = p * r + _INV_FACT[11]
    p = p * r + _INV_FACT[10]
    p = p * r + _INV_FACT[9]
    p = p * r + _INV_FACT[8]
    p = p * r + _INV_FACT[7]
    p = p * r + _INV_FACT[6]
    p = p * r + _INV_FACT[5]
    p = p * r + _INV_FACT[4]
    p = p * r + _INV_FACT[3]
    p = p * r + _INV_FACT[2]
    p = p * r + 1.0
    p = p * r + 1.0
    k = k if k == k else 0.0
    e = p * f64_from_bits((np.int64(k) + 1023) << 52)
    q = 1.0 / (1.0 + e)
    return np.float32(q if z >= 0.0 else e * q)


@kernel_factory("sigmoid_forward")
def _forward_factory(spec):
    if spec["parallel"]:
        @jit(parallel=True)
        def sigmoid_forward(x, out):
            # x, out: (n,) float32 views of the whole arrays; out may be x (in place)
            for i in prange(x.shape[0]):
                out[i] = _sigmoid(x[i])
        return sigmoid_forward

    @jit()
    def sigmoid_forward_serial(x, out):
        for i in range(x.shape[0]):
            out[i] = _sigmoid(x[i])
    return sigmoid_forward_serial


@kernel_factory("sigmoid_backward")
def _backward_factory(spec):
    @jit()
    def sigmoid_backward(dy, y, dx):
        # dy, y, dx: (n,) float32; dx = dy * y * (1 - y)
        for i in range(dy.shape[0]):
            v = np.float64(y[i])
            dx[i] = np.float64(dy[i]) * (v * (1.0 - v))
    return sigmoid_backward


def sigmoid_forward(x, *, out=None):
    """y = 1 / (1 + exp(-x)), element-wise; x: any shape float32 -> y (same shape). out may be x."""
    x = _check.float_array("x", x)
    if out is None:
        out = np.empty_like(x)
    elif out is not x:
        _check.output("out", out, x.shape, x)
    else:
        _check.float_array("out", out, copy=False, writeable=True)
    get_kernel(KernelSpec.make("sigmoid_forward", parallel=x.size >= _PARALLEL_MIN))(x.reshape(-1), out.reshape(-1))
    return out


def sigmoid_backward(dy, y):
    """dx = dy * y * (1 - y) from the forward output y; dy, y: same shape float32 -> dx."""
    dy = _check.float_array("dy", dy)
    y = _check.float_array("y", y, shape=dy.shape)
    dx = np.empty_like(dy)
    get_kernel(KernelSpec.make("sigmoid_backward"))(dy.reshape(-1), y.reshape(-1), dx.reshape(-1))
    return dx
