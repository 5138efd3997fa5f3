"""Element-wise activations outside the GEMM epilogue: sigmoid forward and backward (the DLRM's
--activation-function sigmoid; ReLU is fused into linear_forward/linear_backward)."""
from __future__ import annotations

import math

import numpy as np

from ..codegen import KernelSpec, get_kernel, jit, kernel_factory
from . import _check


@kernel_factory("sigmoid_forward")
def _forward_factory(spec):
    @jit()
    def sigmoid_forward(x, out):
        # x, out: (n,) float32 views of the whole arrays; out may be x (in place)
        for i in range(x.shape[0]):
            z = np.float64(x[i])
            e = math.exp(-abs(z))
            out[i] = 1.0 / (1.0 + e) if z >= 0.0 else e / (1.0 + e)
    return sigmoid_forward


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
    get_kernel(KernelSpec.make("sigmoid_forward"))(x.reshape(-1), out.reshape(-1))
    return out


def sigmoid_backward(dy, y):
    """dx = dy * y * (1 - y) from the forward output y; dy, y: same shape float32 -> dx."""
    dy = _check.float_array("dy", dy)
    y = _check.float_array("y", y, shape=dy.shape)
    dx = np.empty_like(dy)
    get_kernel(KernelSpec.make("sigmoid_backward"))(dy.reshape(-1), y.reshape(-1), dx.reshape(-1))
    return dx
