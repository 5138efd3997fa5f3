"""BF16 Split-SGD storage: an fp32 embedding table held as two uint16 halves (the SC20 paper's
Split-SGD). `hi` is exactly the bf16 weight that lookups read (half the bytes of fp32), `lo` the
low 16 mantissa bits the update needs to reassemble the exact fp32 value, so BF16 training
matches fp32 SGD bit for bit.
"""
from __future__ import annotations

import numpy as np
from numba import prange

from ...codegen import jit
from ...codegen.bf16 import as_float32, as_uint32
from ._rows import empty_table


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
    __slots__ = ("hi", "lo", "__weakref__")  # weakly held by the tuner's table memo

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
