"""Per-thread scratch buffers for the GEMM, cross and weight-gradient drivers: 64-byte aligned,
grown geometrically and kept between calls, so multi-MB workspaces do not pay their page faults on
every call. A buffer's user is done with it before its op returns."""
from __future__ import annotations

import threading

import numpy as np

_SCRATCH = threading.local()


def thread_buffer(name: str, dtype, size: int) -> np.ndarray:
    """This thread's scratch `name` of `size` elements, 64-byte aligned, kept between calls (its
    user is done with it before returning): multi-MB buffers allocated per call would pay their
    page faults every time."""
    buf = getattr(_SCRATCH, name, None)
    if buf is None or buf.size < size:
        raw = np.empty(max(size, 2 * (0 if buf is None else buf.size)) + 64, dtype)
        skip = (-raw.ctypes.data % 64) // raw.itemsize
        buf = raw[skip:skip + raw.size - 64]
        setattr(_SCRATCH, name, buf)
    return buf[:size]


def grad_buffer(size: int) -> np.ndarray:
    """This thread's buffer for the masked output gradient (consumed before linear_backward returns)."""
    return thread_buffer("grad", np.float32, size)


def transposed_buffer(size: int) -> np.ndarray:
    """This thread's buffer for a GEMM result computed transposed (linear_forward_t, linear_dwt),
    consumed by the transpose into the caller's array before the op returns."""
    return thread_buffer("dwt", np.float32, size)
