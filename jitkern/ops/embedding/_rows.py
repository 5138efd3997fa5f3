"""Row helpers every embedding kernel shares: table memory, per-thread scratch, and the njit
row operations (pooled adds, prefetches, the update of one row by SGD, Split-SGD or Adagrad).

Inside the kernels `D` is the row width and `DC` the same width as a compile-time constant
(or 0: the generic runtime-D kernel, whose loops are plain); with DC set a row is one
<DC x float> operation (codegen.rowvec). A batch of bags travels as one tuple,
`bags = (indices, offsets, psw, mean, last)`: flat indices (nnz,), offsets (B,) or (B+1,)
when `last` (include_last_offset), per-sample weights (nnz,) or empty, and the mean flag.
"""
from __future__ import annotations

import math
import threading

import numpy as np

from ...codegen import jit
from ...codegen.bf16 import as_float32, as_uint32, widen
from ...codegen.prefetch import HINTS, prefetch_at
from ...codegen.rowvec import SHUFFLE, row_axpy, row_set, row_split_axpy, row_sum_squares
from ...codegen.target import host_target
from ..workspace import empty_aligned

SPECIALISED_D = (16, 32, 64, 128)  # widths that get a compile-time-D kernel
L2 = HINTS["l2"]                   # the updates' prefetch level: the line arrives shared, written in place
GOLDEN = np.uint64(0x9E3779B97F4A7C15)  # Fibonacci hashing: a row's slot is the top bits of row * this
LO32 = (1 << 32) - 1
NO_PSW = np.empty(0, np.float32)   # stand-ins for absent optional arrays (kernels never read them)
NO_STATE = np.empty(0, np.float32)


def prefetch_distance(row_bytes: int, l2: int | None = None) -> int:
    """Rows a gather prefetches ahead (the knobs' heuristic; tuning replaces it per CPU): far
    enough to cover a DRAM miss, near enough that wide rows do not overflow the outstanding-miss
    buffers, and in proportion to the L2 the prefetches fill (`l2`, default the host's), from 32.
    Measured best: 32 rows up to 256 bytes and 16 beyond on a 1 MiB-L2 Zen 4, 64 and 32 on a
    2 MiB-L2 Xeon; on a 512 KiB-L2 Zen 3 32 rows beat 16 at 64-byte rows."""
    l2 = host_target().l2 if l2 is None else l2
    base = min(max(l2 // (32 << 10), 32), 64)
    return base if row_bytes <= 256 else max(base // 2, 16)


def d_class(d: int) -> int:
    """The compile-time width for D, or 0 for the generic runtime-D kernel."""
    return d if d in SPECIALISED_D else 0


# ----------------------------------------------------------------------------- table memory

_HUGE_MIN_BYTES = 16 << 20  # smaller tables mostly stay cached; not worth a private mapping


def empty_table(rows: int, dim: int, dtype=np.float32) -> np.ndarray:
    """An uninitialised C-contiguous (rows, dim) table starting on a 64-byte cache line (as torch's
    tensors do; NumPy's start 16 bytes in), so rows of whole lines need one prefetch per line,
    and on transparent huge pages where the OS offers them (Linux madvise) from 16 MiB: random row
    reads then stop missing the TLB on every row."""
    return empty_aligned((int(rows), int(dim)), dtype, huge_from=_HUGE_MIN_BYTES)


# ----------------------------------------------------------------------------- scratch and threads

_SCRATCH = threading.local()


def scratch(n, per_entry, dtype=np.int64):
    """Per-thread, grow-only scratch of >= per_entry * n elements (int64 or float32), whole (views
    cost ~1 us a call).

    Fresh arrays of this size cost more than the work: glibc maps them anew on every call and
    returns them on free, so each page faults again. Thread-local, so concurrent callers never
    share it; kernels finish with it before the op returns (results handed out are copies)."""
    bufs = getattr(_SCRATCH, "bufs", None)
    if bufs is None:
        bufs = _SCRATCH.bufs = {}
    key = np.dtype(dtype).char
    buf = bufs.get(key)
    need = per_entry * n
    if buf is None or buf.shape[0] < need:
        buf = bufs[key] = np.empty(max(need, 2 * (0 if buf is None else buf.shape[0]), 1024), dtype)
    return buf


# ----------------------------------------------------------------------------- njit row helpers


@jit(inline="always")
def bag_end(offsets, b, nbags, nnz, last):
    return offsets[b + 1] if (last or b + 1 < nbags) else nnz


@jit(inline="always")
def bag_size(offsets, b, nbags, nnz, last):
    return bag_end(offsets, b, nbags, nnz, last) - offsets[b]


@jit(inline="always")
def entry_scale(psw, j, mean, size):
    """Entry j's weight in its bag's gradient: its per-sample weight (psw: empty if none), over the
    bag's size for mean. Takes the bags' fields, never the tuple: unpacking a tuple of arrays in
    a loop costs NRT reference counts (atomic calls) per entry."""
    sc = psw[j] if psw.shape[0] > 0 else np.float32(1.0)
    if mean:
        sc = sc * (np.float32(1.0) / np.float32(size))
    return sc


@jit(inline="always")
def add_row(dst, i, src, j, c, sc, D, DC, first, scheme):
    """dst[i, :D] = sc * src[j, c:c + D] if first else dst[i, :D] + sc * src[j, c:c + D]; one
    vector op when DC (= D) is set. src: float32, or bf16 bits widened by `scheme` (codegen.rowvec)."""
    if DC:
        if first:
            row_set(dst, i, src, j, c, sc, DC, scheme)
        else:
            row_axpy(dst, i, src, j, c, sc, DC, scheme)
    elif first:
        for d in range(D):
            dst[i, d] = widen(src[j, c + d]) * sc
    else:
        for d in range(D):
            dst[i, d] += widen(src[j, c + d]) * sc


@jit(inline="always")
def madd_row(dst, i, src, j, sc, D, DC, first):
    """add_row for a float32 src."""
    add_row(dst, i, src, j, 0, sc, D, DC, first, SHUFFLE)


@jit(inline="always")
def straddles(table, row_bytes):
    """Whether a row can end in a cache line its 64-byte steps miss: unless the table starts on a
    line and rows are whole lines (empty_table, torch's allocator), a row of 64 bytes spans two
    lines. A loop-invariant flag, since a second prefetch of an already requested line is not free."""
    return row_bytes % 64 != 0 or table.ctypes.data % 64 != 0


@jit(inline="always")
def prefetch_lines(table, r, row_bytes, tail, locality, step):
    """Prefetch a line of row r every `step` bytes (and the line of its last byte if `tail`) with the
    compile-time `locality` (codegen.prefetch.HINTS). step 128 hints one line of each 128-byte pair,
    which an adjacent-line prefetcher completes: half the prefetches in flight."""
    for k in range(0, row_bytes, step):
        prefetch_at(table, r, k, locality)
    if tail:
        prefetch_at(table, r, row_bytes - 1, locality)


@jit(inline="always")
def prefetch_row(table, r, row_bytes, tail, locality):
    """Prefetch every line of row r (prefetch_lines, one per 64 bytes)."""
    prefetch_lines(table, r, row_bytes, tail, locality, 64)


@jit(inline="always")
def sgd_row(table, r, g, a, lr, D, DC):
    """table[r] -= lr * g[a], as w + (-lr * g): exactly w - lr * g."""
    madd_row(table, r, g, a, -lr, D, DC, False)


@jit(inline="always")
def split_sgd_row(hi, lo, r, g, a, lr, D, DC, scheme):
    """BF16 Split-SGD of row r: the fp32 weight the halves hi[r], lo[r] hold takes w - lr * g[a]."""
    if DC:
        row_split_axpy(hi, lo, r, g, a, -lr, DC, scheme)
    else:
        for d in range(D):
            w = as_float32((np.uint32(hi[r, d]) << np.uint32(16)) | np.uint32(lo[r, d]))
            bits = as_uint32(w - lr * g[a, d])
            hi[r, d] = np.uint16(bits >> np.uint32(16))
            lo[r, d] = np.uint16(bits & np.uint32(0xFFFF))


@jit(inline="always")
def sum_squares(x, a, D):
    """sum(x[a, :D] ** 2) in float64, as 8 interleaved partial sums added pairwise at the end: one
    strict-IEEE running sum would wait on every add. The order depends on D only, so every path
    and thread count rounds alike."""
    s0 = s1 = s2 = s3 = s4 = s5 = s6 = s7 = 0.0
    d = 0
    while d + 8 <= D:
        v0, v1, v2, v3 = np.float64(x[a, d]), np.float64(x[a, d + 1]), np.float64(x[a, d + 2]), np.float64(x[a, d + 3])
        v4, v5, v6, v7 = np.float64(x[a, d + 4]), np.float64(x[a, d + 5]), np.float64(x[a, d + 6]), np.float64(x[a, d + 7])
        s0 += v0 * v0
        s1 += v1 * v1
        s2 += v2 * v2
        s3 += v3 * v3
        s4 += v4 * v4
        s5 += v5 * v5
        s6 += v6 * v6
        s7 += v7 * v7
        d += 8
    rest = 0.0
    while d < D:
        v = np.float64(x[a, d])
        rest += v * v
        d += 1
    return (((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7))) + rest


@jit(inline="always")
def adagrad_row(table, state, r, g, a, lr, eps, D, DC):
    """Row-wise Adagrad of row r with its coalesced gradient g[a]: state[r] += mean(g**2), then
    table[r] -= lr / (sqrt(state[r]) + eps) * g[a]."""
    ss = row_sum_squares(g, a, DC) if DC else sum_squares(g, a, D)
    s_new = np.float32(state[r] + ss / D)
    state[r] = s_new
    step = np.float32(lr / (math.sqrt(np.float64(s_new)) + eps))
    madd_row(table, r, g, a, -step, D, DC, False)


@jit(inline="always")
def adagrad_exact_row(table, state, r, g, a, lr, eps, D, DC):
    """Element-wise Adagrad of row r with its coalesced gradient g[a] (FBGEMM's EXACT_ADAGRAD, float32
    throughout): state[r] += g**2, then table[r] -= lr * g / (sqrt(state[r]) + eps); state: (R, D)."""
    for d in range(DC if DC else D):
        gd = g[a, d]
        s = state[r, d] + gd * gd
        state[r, d] = s
        table[r, d] = table[r, d] - (lr * gd) / (np.sqrt(s) + eps)


@jit(inline="always")
def prefetch_state_entry(state, r, row_bytes, tail):
    """Prefetch row r's row-wise Adagrad state (one float of state (R,))."""
    prefetch_at(state, r, 0, L2)


@jit(inline="always")
def prefetch_state_row(state, r, row_bytes, tail):
    """Prefetch row r's element-wise Adagrad state (a row of state (R, D))."""
    prefetch_row(state, r, row_bytes, tail, L2)
