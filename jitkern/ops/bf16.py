"""BF16Array: bf16 values as their uint16 bit patterns, typed so integer data is never read as bf16.

Ops that take bf16 operands (the GEMM family, the dot interaction) accept a BF16Array where they
accept a float32 array; a bare uint16 array is rejected like any other non-float32 input.
Conversion from float32 rounds to nearest even and keeps NaN NaN (codegen.simd_bf16.round_bf16,
the rounding every bf16-producing kernel applies; reference.bf16_round is its NumPy twin).
"""
from __future__ import annotations

import numpy as np
from numba import prange

from ..codegen import jit
from ..codegen.bf16 import as_float32, as_uint32
from ..codegen.simd_bf16 import round_bf16, widen_bf16

_PARALLEL_MIN = 1 << 16  # elements below which a conversion runs serially


@jit(parallel=True)
def _round_parallel(x, bits):
    for i in prange(x.shape[0]):
        bits[i] = round_bf16(x[i])


@jit()
def _round_serial(x, bits):
    for i in range(x.shape[0]):
        bits[i] = round_bf16(x[i])


@jit(parallel=True)
def _widen_parallel(bits, x):
    for i in prange(x.shape[0]):
        x[i] = widen_bf16(bits[i])


@jit()
def _widen_serial(bits, x):
    for i in range(x.shape[0]):
        x[i] = widen_bf16(bits[i])


@jit(parallel=True)
def _split(x, hi, lo):
    for i in prange(x.shape[0]):
        bits = as_uint32(x[i])
        hi[i] = np.uint16(bits >> np.uint32(16))
        lo[i] = np.uint16(bits & np.uint32(0xFFFF))


@jit(parallel=True)
def _join(hi, lo, x):
    for i in prange(x.shape[0]):
        x[i] = as_float32((np.uint32(hi[i]) << np.uint32(16)) | np.uint32(lo[i]))


class BF16Array:
    """An array of bf16 values: `bits` is a uint16 ndarray of their bit patterns (the high halves
    of the float32 values), with the array's logical shape."""
    __slots__ = ("bits",)

    def __init__(self, bits):
        if not isinstance(bits, np.ndarray) or bits.dtype != np.uint16:
            raise TypeError(f"bits must be a uint16 numpy.ndarray, got {getattr(bits, 'dtype', type(bits).__name__)}")
        self.bits = bits

    @classmethod
    def from_float32(cls, x, out=None) -> "BF16Array":
        """x (any shape, float32) rounded to bf16: nearest, ties to even; NaN stays NaN (quieted).
        out: an optional BF16Array of x's shape to write into."""
        if not isinstance(x, np.ndarray) or x.dtype != np.float32:
            raise TypeError(f"x must be a float32 numpy.ndarray, got {getattr(x, 'dtype', type(x).__name__)}")
        if out is None:
            out = cls(np.empty(x.shape, np.uint16))
        elif not isinstance(out, BF16Array) or out.shape != x.shape or not out.bits.flags.c_contiguous:
            raise ValueError(f"out must be a C-contiguous BF16Array of shape {x.shape}")
        if x.size:
            flat = np.ascontiguousarray(x).reshape(-1)
            (_round_parallel if flat.size >= _PARALLEL_MIN else _round_serial)(flat, out.bits.reshape(-1))
        return out

    def to_float32(self) -> np.ndarray:
        """The exact float32 values (a new C-contiguous array of this shape)."""
        out = np.empty(self.shape, np.float32)
        if out.size:
            flat = np.ascontiguousarray(self.bits).reshape(-1)
            (_widen_parallel if flat.size >= _PARALLEL_MIN else _widen_serial)(flat, out.reshape(-1))
        return out

    @property
    def shape(self) -> tuple:
        return self.bits.shape

    @property
    def ndim(self) -> int:
        return self.bits.ndim

    @property
    def size(self) -> int:
        return self.bits.size

    @property
    def nbytes(self) -> int:
        return self.bits.nbytes

    @property
    def dtype(self) -> str:
        return "bfloat16"

    def __len__(self) -> int:
        return len(self.bits)

    def __getitem__(self, key) -> "BF16Array":
        """A view of the selected elements, still bf16 (row slices for per-rank batch slices)."""
        return BF16Array(np.asarray(self.bits[key]))

    def reshape(self, *shape) -> "BF16Array":
        return BF16Array(self.bits.reshape(*shape))

    def copy(self) -> "BF16Array":
        return BF16Array(self.bits.copy())

    def __repr__(self) -> str:
        return f"BF16Array(shape={self.shape})"


def split_float32(x) -> tuple[BF16Array, np.ndarray]:
    """x (float32, any shape) held exactly as a Split pair: (hi, lo), hi the BF16Array of x's high
    halves (x truncated to bf16), lo the uint16 low halves; join_float32 gives x back bit for bit."""
    if not isinstance(x, np.ndarray) or x.dtype != np.float32:
        raise TypeError(f"x must be a float32 numpy.ndarray, got {getattr(x, 'dtype', type(x).__name__)}")
    hi, lo = np.empty(x.shape, np.uint16), np.empty(x.shape, np.uint16)
    if x.size:
        _split(np.ascontiguousarray(x).reshape(-1), hi.reshape(-1), lo.reshape(-1))
    return BF16Array(hi), lo


def join_float32(hi, lo) -> np.ndarray:
    """The exact float32 values of a Split pair (hi: BF16Array, lo: uint16 of its shape): a new array."""
    if not isinstance(hi, BF16Array):
        raise TypeError(f"hi must be a BF16Array, got {type(hi).__name__}")
    if not isinstance(lo, np.ndarray) or lo.dtype != np.uint16 or lo.shape != hi.shape:
        raise TypeError(f"lo must be a uint16 numpy.ndarray of shape {hi.shape}")
    x = np.empty(hi.shape, np.float32)
    if x.size:
        _join(np.ascontiguousarray(hi.bits).reshape(-1), np.ascontiguousarray(lo).reshape(-1), x.reshape(-1))
    return x
