"""Dense optimizer updates, the in-place steps of MLP (and cross) parameters: `sgd_`, `adagrad_`,
and `split_sgd_`, the SGD step on a bf16 Split pair (the weight's bf16 high halves and uint16 low
halves): the halves are rejoined to the exact fp32 weight, updated in fp32 and split again, in one pass.

The BF16 Split-SGD table of the embeddings is ops/embedding/split_bf16.py.
"""
from __future__ import annotations

import numba
import numpy as np
from numba import prange

from ..codegen import jit, num_threads
from ..codegen.bf16 import as_float32, as_uint32
from ..codegen.knobs import knob, numba_threads
from ..codegen.qrowvec import fma_f32
from . import _check
from .bf16 import BF16Array

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


@jit(inline="always")
def _split_sgd_at(hi, lo, g, lr, i):
    w = as_float32((np.uint32(hi[i]) << np.uint32(16)) | np.uint32(lo[i]))
    bits = as_uint32(w - lr * g[i])
    hi[i] = np.uint16(bits >> np.uint32(16))
    lo[i] = np.uint16(bits & np.uint32(0xFFFF))


@jit(parallel=True)
def _split_sgd_parallel(hi, lo, g, lr):
    for i in prange(g.shape[0]):
        _split_sgd_at(hi, lo, g, lr, i)


@jit()
def _split_sgd_serial(hi, lo, g, lr):
    for i in range(g.shape[0]):
        _split_sgd_at(hi, lo, g, lr, i)


def _sgd_search(problem, quick, timer):
    """The fewest elements at which the parallel update (on the problem's threads) beats the serial one."""
    threads = min(problem[0], numba.config.NUMBA_NUM_THREADS)
    if threads < 2:
        return {"min_size": _PARALLEL_MIN}  # one thread: nothing to split
    sizes = [1 << e for e in (range(13, 19) if quick else range(12, 21))]
    with numba_threads(threads):
        for size in sizes:
            p, g, lr = np.zeros(size, np.float32), np.ones(size, np.float32), np.float32(1e-3)
            if timer(lambda: _sgd_parallel(p, g, lr)) < timer(lambda: _sgd_serial(p, g, lr)):
                return {"min_size": size}
    return {"min_size": 2 * sizes[-1]}


SGD_PARALLEL = knob("optim.sgd.parallel", doc="fewest elements for which sgd_ runs in parallel",
                    heuristic=lambda p: {"min_size": _PARALLEL_MIN}, shape_class=lambda p: f"t{p[0]}",
                    problems=lambda w: ((t,) for t in w.threads) if w.linears else (), search=_sgd_search)


def sgd_(param, grad, lr):
    """In place: param -= lr * grad; param, grad: same shape, float32. Returns param.

    A grad that partly overlaps param is copied first (the update is elementwise, so grad being
    param itself is fine)."""
    param = _check.float_array("param", param, copy=False, writeable=True)
    grad = _check.float_array("grad", grad, shape=param.shape)
    lr = _check.finite("lr", lr)
    if grad.ctypes.data != param.ctypes.data and np.may_share_memory(grad, param):
        grad = grad.copy()
    if param.size:
        p, g = param.reshape(-1), grad.reshape(-1)
        parallel = p.shape[0] >= SGD_PARALLEL.choose((num_threads(),))["min_size"]
        (_sgd_parallel if parallel else _sgd_serial)(p, g, np.float32(lr))
    return param


def split_sgd_(hi, lo, grad, lr):
    """In place on a bf16 Split pair: w -= lr * grad with w the exact fp32 weight that hi (BF16Array,
    its high halves) and lo (uint16 ndarray, its low halves) hold; grad float32 of their shape.
    The fp32 result is split again: hi stays w truncated to bf16. Returns (hi, lo)."""
    if not isinstance(hi, BF16Array):
        raise TypeError(f"hi must be a BF16Array (the bf16 high halves), got {type(hi).__name__}")
    hb = _check.float_array("hi", hi.bits, copy=False, writeable=True, dtype=np.uint16)
    lo = _check.float_array("lo", lo, shape=hb.shape, copy=False, writeable=True, dtype=np.uint16)
    grad = _check.float_array("grad", grad, shape=hb.shape)
    lr = _check.finite("lr", lr)
    _check.no_overlap("lo", lo, hb, what="hi")
    _check.no_overlap("grad", grad, hb, lo, what="hi or lo")
    if hb.size:
        h, l, g = hb.reshape(-1), lo.reshape(-1), grad.reshape(-1)
        parallel = h.shape[0] >= SGD_PARALLEL.choose((num_threads(),))["min_size"]
        (_split_sgd_parallel if parallel else _split_sgd_serial)(h, l, g, np.float32(lr))
    return hi, lo


@jit(inline="always")
def _adagrad_elem(p, s, g, i, lr, eps):
    """torch.optim.Adagrad's element update, in its float32 operations: s = fma(g, g, s) (its
    addcmul_ rounds once), then p += (-lr * g) / (sqrt(s) + eps)."""
    gi = g[i]
    si = fma_f32(gi, gi, s[i])
    s[i] = si
    p[i] = p[i] + (-lr * gi) / (np.sqrt(si) + eps)


@jit(parallel=True, fastmath=frozenset())  # strict IEEE: no contraction, bit-identical to torch's
def _adagrad_parallel(p, s, g, lr, eps):
    for i in prange(p.shape[0]):
        _adagrad_elem(p, s, g, i, lr, eps)


@jit(fastmath=frozenset())
def _adagrad_serial(p, s, g, lr, eps):
    for i in range(p.shape[0]):
        _adagrad_elem(p, s, g, i, lr, eps)


def adagrad_(param, state, grad, lr, eps):
    """In place Adagrad (torch.optim.Adagrad, lr_decay 0): state += grad**2;
    param -= lr * grad / (sqrt(state) + eps); param, state, grad: same shape, float32. Returns param.

    state and grad must not overlap param or each other."""
    param = _check.float_array("param", param, copy=False, writeable=True)
    state = _check.float_array("state", state, shape=param.shape, copy=False, writeable=True)
    grad = _check.float_array("grad", grad, shape=param.shape)
    lr = _check.finite("lr", lr)
    eps = _check.finite("eps", eps, minimum=0.0)
    _check.no_overlap("state", state, param, what="param")
    _check.no_overlap("grad", grad, param, state, what="param or state (the arrays the update writes)")
    if param.size:
        p, s, g = param.reshape(-1), state.reshape(-1), grad.reshape(-1)
        # the update reads and writes 3 arrays where SGD does 2: the same threshold serves
        parallel = p.shape[0] >= SGD_PARALLEL.choose((num_threads(),))["min_size"]
        (_adagrad_parallel if parallel else _adagrad_serial)(p, s, g, np.float32(lr), np.float32(eps))
    return param
