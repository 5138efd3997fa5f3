"""Memory for the kernels: per-thread scratch buffers for the GEMM, cross and weight-gradient
drivers (64-byte aligned, grown geometrically and kept between calls, so multi-MB workspaces do not
pay their page faults on every call; a buffer's user is done with it before its op returns), and
long-lived arrays on cache lines and, where large, on transparent huge pages (empty_aligned)."""
from __future__ import annotations

import mmap
import threading

import numpy as np

_SCRATCH = threading.local()
LINE = 64  # bytes in a cache line (x86 and most aarch64 cores)
_HUGE_PAGE = 2 << 20
HUGE_STREAMED = _HUGE_PAGE  # arrays read whole every step (MLP weights, their gradients) gain from here


def empty_aligned(shape, dtype=np.float32, *, huge_from: int = HUGE_STREAMED) -> np.ndarray:
    """An uninitialised C-contiguous array starting on a 64-byte cache line (NumPy's start 16 bytes
    in), and from huge_from bytes on transparent huge pages where the OS offers them (Linux
    madvise): one TLB entry per 2 MiB instead of per 4 KiB page, for an array whose pages are each
    touched every step (a 4 MB weight read by column panels walks a page table per row)."""
    dtype = np.dtype(dtype)
    shape = tuple(int(s) for s in np.atleast_1d(shape))
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    m = None
    if advice is not None and nbytes >= huge_from:
        try:  # private anonymous memory (shared mappings would be shmem, which THP leaves alone)
            m = mmap.mmap(-1, nbytes + _HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            m.madvise(advice)
        except (OSError, ValueError, AttributeError):
            m = None
    if m is None:
        raw = np.empty(nbytes + LINE, np.uint8)
        start = -raw.ctypes.data % LINE
    else:
        raw = np.frombuffer(m, np.uint8)  # the array keeps the mapping alive
        start = -raw.ctypes.data % _HUGE_PAGE  # 2 MiB aligned, so every whole huge page can be one
    return raw[start:start + nbytes].view(dtype).reshape(shape)


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


def staggered_blocks(count: int, shape, dtype=np.float32) -> np.ndarray:
    """A (count, *shape) array of C-contiguous blocks whose starts are staggered across the cache
    sets: block k begins k * (one row + one line) past a 4 KiB multiple. Kernels that read or write
    row b of every block together (the interaction over the tables' pooled rows) would otherwise
    hit addresses equal modulo the caches' set period, as many as there are blocks, in sets of
    8 ways: each block's rows then evict the others' before they are used."""
    dtype = np.dtype(dtype)
    shape = tuple(int(s) for s in np.atleast_1d(shape))
    size = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    row = (shape[-1] if shape else 1) * dtype.itemsize
    step = (-(-row // LINE) * LINE + LINE) % 4096 or LINE
    stride = -(-size // 4096) * 4096 + step
    total = max(count - 1, 0) * stride + size
    raw = np.empty(total + 4096, np.uint8)  # malloc's: reused from call to call, unlike a mapping
    start = -raw.ctypes.data % 4096
    flat = raw[start:start + total].view(dtype)
    inner = flat[:size // dtype.itemsize].reshape(shape).strides  # one block's own strides
    return np.lib.stride_tricks.as_strided(flat, (count, *shape), (stride, *inner), writeable=True)
