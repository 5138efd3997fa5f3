"""Argument checks shared by every public op: each error names the argument and what was wrong.

The wrappers call these before any kernel runs, so a bad call changes nothing. Scalars are
checked in the dtype the kernel applies them in (an lr of 1e39 is finite as a Python float but
infinite as float32).
"""
from __future__ import annotations

import functools
import math

import numpy as np

from .bf16 import BF16Array

F32 = np.dtype(np.float32)
I32, I64 = np.dtype(np.int32), np.dtype(np.int64)


# what row_strided accepts, as the errors name it
ROWS = "contiguous rows (a C-contiguous array or a column slice of one)"


def _dtype_name(x) -> str:
    return str(getattr(x, "dtype", type(x).__name__))


def float_array(name, x, *, ndim=None, shape=None, copy=True, writeable=False, dtype=F32, rows=False):
    """x as an aligned C-contiguous array of `dtype` (float32 by default), or with `rows` any
    row_strided x as it is.

    ndim / shape: required rank / exact shape. A non-contiguous x is copied when `copy`, else an
    error (for arrays an op writes in place). `writeable`: x is an output or updated in place.
    """
    if not isinstance(x, np.ndarray):
        raise TypeError(f"{name} must be a numpy.ndarray of {np.dtype(dtype)}, got {type(x).__name__}")
    if x.dtype != dtype:
        raise TypeError(f"{name} must have dtype {np.dtype(dtype)}, got {x.dtype}")
    if ndim is not None and x.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {x.shape}")
    if shape is not None and x.shape != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {x.shape}")
    f = x.flags  # one flags object: these checks run per call per table
    if writeable and not f.writeable:
        raise ValueError(f"{name} must be writeable (it is written in place)")
    if f.aligned and (f.c_contiguous or rows and row_strided(x)):
        return x
    if not copy:
        what = f"have {ROWS}" if rows else "be C-contiguous"
        raise ValueError(f"{name} must {what} and be aligned (it is written in place)")
    return np.array(x, order="C")


def row_strided(x) -> bool:
    """Whether 2-D x keeps each row contiguous, its rows at any stride of whole elements no shorter than a
    row (a C-contiguous array, or a column slice of one): what the GEMM driver reads and writes
    in place, as BLAS's leading dimensions."""
    if x.ndim != 2:
        return False
    (r, w), (s0, s1), item = x.shape, x.strides, x.itemsize
    return (w <= 1 or s1 == item) and (r <= 1 or (s0 % item == 0 and s0 >= w * item))


def bf16_array(name, x, *, ndim=None, shape=None):
    """The aligned C-contiguous uint16 bits of a BF16Array x (copied if they are not); ndim / shape
    as float_array's. Bare integer arrays are refused: bf16 data travels in a BF16Array."""
    if not isinstance(x, BF16Array):
        raise TypeError(f"{name} must be a BF16Array (bf16 operands), got {_dtype_name(x)}")
    return float_array(name, x.bits, ndim=ndim, shape=shape, dtype=np.uint16)


def index_array(name, a):
    """a as a C-contiguous 1-D int32 or int64 array."""
    if not isinstance(a, np.ndarray):
        raise TypeError(f"{name} must be a numpy array of int32 or int64, got {type(a).__name__}")
    if a.dtype != I64 and a.dtype != I32:
        raise TypeError(f"{name} must have dtype int32 or int64, got {a.dtype}")
    if a.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {a.shape}")
    f = a.flags
    return a if f.c_contiguous and f.aligned else np.array(a, order="C")


def real(name, v) -> float:
    """v as a Python float, or a TypeError naming `name`."""
    if type(v) is float:  # the common case, checked per call by the ops
        return v
    if isinstance(v, (bool, np.bool_)) or isinstance(v, (str, bytes)):
        raise TypeError(f"{name} must be a real number, got {type(v).__name__}")
    try:
        return float(v)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a real number, got {type(v).__name__}") from None


@functools.lru_cache(maxsize=None)
def _largest(dtype) -> float:
    """The largest finite value of a float dtype (np.finfo costs ~0.5 us a call; ops check per call)."""
    return float(np.finfo(dtype).max)


_F32_MAX = _largest(F32)


def finite(name, v, *, dtype=F32, minimum=None, positive=False) -> float:
    """v as a float that is finite in `dtype` (the kernels apply it in float32), and >= minimum
    (or > 0 if positive) when given."""
    x = v if type(v) is float else real(name, v)
    if not math.isfinite(x):
        raise ValueError(f"{name} must be finite, got {x}")
    if dtype is not None and abs(x) > (_F32_MAX if dtype is F32 else _largest(dtype)):
        raise ValueError(f"{name} = {x:g} overflows {np.dtype(dtype)} (max {_largest(dtype):g}), "
                         "the precision it is applied in")
    if positive and not x > 0:
        raise ValueError(f"{name} must be > 0, got {x}")
    if minimum is not None and x < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {x}")
    return x


def choice(name, v, choices):
    """v if it is one of `choices`, else a ValueError listing them."""
    if v not in choices:
        raise ValueError(f"{name} must be one of {tuple(choices)}, got {v!r}")
    return v


def _overlap(a, b) -> bool:
    """Whether a and b share an element: their bounds decide for contiguous arrays; strided ones (a
    column slice beside another of the same buffer) are solved exactly, and count as overlapping
    where that is too hard."""
    if not np.may_share_memory(a, b):
        return False
    if a.flags.c_contiguous and b.flags.c_contiguous:
        return True
    try:
        return bool(np.shares_memory(a, b, max_work=1 << 16))
    except np.exceptions.TooHardError:
        return True


def no_overlap(name, out, *inputs, what="the inputs"):
    """Reject `out` sharing memory with any input (kernels write it while reading them)."""
    if any(x is not None and _overlap(out, x) for x in inputs):
        raise ValueError(f"{name} must not overlap {what}")
    return out


def output(name, out, shape, *inputs, dtype=F32, rows=False):
    """A caller-given output: exact dtype and shape, C-contiguous (or with `rows` row_strided and
    aligned), writeable, not overlapping inputs."""
    if not isinstance(out, np.ndarray) or out.dtype != dtype:
        raise TypeError(f"{name} must be a {np.dtype(dtype)} numpy.ndarray, got {_dtype_name(out)}")
    if out.shape != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {out.shape}")
    f = out.flags
    if not f.writeable:
        raise ValueError(f"{name} must be writeable")
    if not (f.c_contiguous or rows and f.aligned and row_strided(out)):
        raise ValueError(f"{name} must {f'have {ROWS} and be aligned' if rows else 'be C-contiguous'}")
    return no_overlap(name, out, *inputs)
