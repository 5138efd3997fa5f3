"""Dense optimizer updates and BF16 Split-SGD storage.

`sgd_` is the dense in-place SGD step for MLP parameters. `SplitBF16Table` stores an fp32
embedding table as two uint16 halves (the SC20 paper's Split-SGD): `hi` is exactly the bf16
weight that lookups read (half the bytes of fp32), `lo` the low 16 mantissa bits the update
needs to reassemble the exact fp32 value, so BF16 training matches fp32 SGD bit for bit.
"""
from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import prange
from numba.core import types
from numba.extending import intrinsic, overload

from ..codegen import jit
from ..codegen.knobs import knob
from . import _check

# below this many elements a parallel region costs more than it saves
_PARALLEL_MIN = 1 << 16


@intrinsic
def as_float32(typingctx, bits):
    """The float32 whose bits are the low 32 bits of an integer (njit only)."""
    if not isinstance(bits, types.Integer) or bits.bitwidth < 32:
        return None

    def codegen(context, builder, sig, args):
        low = builder.trunc(args[0], ir.IntType(32)) if sig.args[0].bitwidth > 32 else args[0]
        return builder.bitcast(low, ir.FloatType())
    return types.float32(bits), codegen


@intrinsic
def as_uint32(typingctx, value):
    """Reinterpret a float32 as the uint32 with the same bits (njit only)."""
    if value != types.float32:
        return None

    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.IntType(32))
    return types.uint32(value), codegen


def widen(x):
    """float32 value of a table element: float32 as is, uint16 as the bf16 it holds (njit only)."""
    raise NotImplementedError("widen is callable from njit code only")


@overload(widen, inline="always")
def _widen_impl(x):
    if x == types.uint16:
        return lambda x: as_float32(np.uint32(x) << np.uint32(16))
    if x == types.float32:
        return lambda x: x
    return None


@jit(parallel=True)
def _sgd_parallel(p, g, lr):
    for i in prange(p.shape[0]):
        p[i] -= lr * g[i]


@jit()
def _sgd_serial(p, g, lr):
    for i in range(p.shape[0]):
        p[i] -= lr * g[i]


def _sgd_search(problem, quick, timer):
    """The fewest elements at which the parallel update (on the problem's threads) beats the serial one."""
    threads = min(problem[0], numba.config.NUMBA_NUM_THREADS)
    if threads < 2:
        return {"min_size": _PARALLEL_MIN}  # one thread: nothing to split
    sizes = [1 << e for e in (range(13, 19) if quick else range(12, 21))]
    before = numba.get_num_threads()
    numba.set_num_threads(threads)
    try:
        for size in sizes:
            p, g, lr = np.zeros(size, np.float32), np.ones(size, np.float32), np.float32(1e-3)
            if timer(lambda: _sgd_parallel(p, g, lr)) < timer(lambda: _sgd_serial(p, g, lr)):
                return {"min_size": size}
    finally:
        numba.set_num_threads(before)
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
        parallel = p.shape[0] >= SGD_PARALLEL.choose((numba.get_num_threads(),))["min_size"]
        (_sgd_parallel if parallel else _sgd_serial)(p, g, np.float32(lr))
    return param


@jit(parallel=True)
def _split(w, hi, lo):
    for i in prange(w.shape[0]):
        for j in range(w.shape[1]):
            bits = as_uint32(w[i, j])
            hi[i, j] = np.uint16(bits >> np.uint32(16))
            lo[i, j] = np.uint16(bits & np.uint32(0xFFFF))


@jit(parallel=True)
def _join(hi, lo, w):
    for i in prange(w.shape[0]):
        for j in range(w.shape[1]):
            w[i, j] = as_float32((np.uint32(hi[i, j]) << np.uint32(16)) | np.uint32(lo[i, j]))


class SplitBF16Table:
    """An fp32 (R, D) table held as bf16 high halves `hi` (R, D) uint16 and low halves `lo` (R, D) uint16.

    Accepted as `weight` by embedding_bag_forward (reads `hi` only, as bf16) and by
    embedding_bag_sgd_ (reassembles fp32, applies SGD, splits again: exact fp32 SGD).
    """
    __slots__ = ("hi", "lo")

    def __init__(self, hi, lo):
        for name, a in (("hi", hi), ("lo", lo)):
            if not isinstance(a, np.ndarray) or a.dtype != np.uint16:
                raise TypeError(f"{name} must be a uint16 ndarray, got {getattr(a, 'dtype', type(a))}")
            if a.ndim != 2 or not (a.flags.c_contiguous and a.flags.aligned):
                raise ValueError(f"{name} must be an aligned C-contiguous 2-D array, got shape {a.shape}")
        if hi.shape != lo.shape:
            raise ValueError(f"hi shape {hi.shape} and lo shape {lo.shape} differ")
        self.hi, self.lo = hi, lo

    @classmethod
    def from_float32(cls, weight) -> "SplitBF16Table":
        """Split a float32 (R, D) table exactly into its high and low halves."""
        w = np.ascontiguousarray(weight)
        if w.dtype != np.float32 or w.ndim != 2:
            raise TypeError(f"weight must be a 2-D float32 array, got {w.dtype} with shape {w.shape}")
        from .embedding import empty_table  # (embedding imports this module)
        # line-aligned halves on huge pages, as fp32 tables: rows are read and written at random
        hi, lo = (empty_table(w.shape[0], w.shape[1], np.uint16) for _ in range(2))
        if w.size:
            _split(w, hi, lo)
        return cls(hi, lo)

    def to_float32(self) -> np.ndarray:
        """The exact float32 table (R, D) reassembled from both halves."""
        w = np.empty(self.hi.shape, np.float32)
        if w.size:
            _join(self.hi, self.lo, w)
        return w

    @property
    def shape(self) -> tuple:
        return self.hi.shape

    @property
    def num_rows(self) -> int:
        return self.hi.shape[0]

    @property
    def dim(self) -> int:
        return self.hi.shape[1]

    def __repr__(self) -> str:
        return f"SplitBF16Table(num_rows={self.num_rows}, dim={self.dim})"
