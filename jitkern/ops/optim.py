"""Dense optimizer updates: `sgd_` is the in-place SGD step for MLP parameters.

The BF16 Split-SGD table of the embeddings is ops/embedding/split_bf16.py.
"""
from __future__ import annotations

import math

import numpy as np
from numba import prange

from ..codegen import jit

# below this many elements a parallel region costs more than it saves
_PARALLEL_MIN = 1 << 16


@jit(parallel=True)
def _sgd_parallel(p, g, lr):
    for i in prange(p.shape[0]):
        p[i] -= lr * g[i]


@jit()
def _sgd_serial(p, g, lr):
    for i in range(p.shape[0]):
        p[i] -= lr * g[i]


def sgd_(param, grad, lr):
    """In place: param -= lr * grad; param, grad: same shape, float32. Returns param."""
    if not isinstance(param, np.ndarray) or param.dtype != np.float32:
        raise TypeError(f"param must be a float32 ndarray, got {getattr(param, 'dtype', type(param))}")
    if not isinstance(grad, np.ndarray) or grad.dtype != np.float32:
        raise TypeError(f"grad must be a float32 ndarray, got {getattr(grad, 'dtype', type(grad))}")
    if grad.shape != param.shape:
        raise ValueError(f"grad shape {grad.shape} does not match param shape {param.shape}")
    if not param.flags.c_contiguous or not param.flags.writeable:
        raise ValueError("param must be C-contiguous and writeable (it is updated in place)")
    lr = float(lr)
    if not math.isfinite(lr):
        raise ValueError(f"lr must be finite, got {lr}")
    if param.size:
        p, g = param.reshape(-1), np.ascontiguousarray(grad).reshape(-1)
        (_sgd_parallel if p.shape[0] >= _PARALLEL_MIN else _sgd_serial)(p, g, np.float32(lr))
    return param
