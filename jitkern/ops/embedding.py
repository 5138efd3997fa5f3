"""Embedding bags: the pooled-gather forward, and the validation and row helpers the sparse
backward and fused updates (ops/embedding_update.py) share with it.

Layouts follow torch.nn.functional.embedding_bag: weight (R, D) float32 (or a SplitBF16Table),
flat indices (nnz,) int32/int64, offsets (B,) int64 bag starts (or (B+1,) with
include_last_offset=True); bag b is indices[offsets[b]:offsets[b+1]], the last runs to nnz.

Forward: parallel over chunks of bags; for common widths D (SPECIALISED_D) the row loop is one
<D x float> operation on a register-resident accumulator, other widths run a generic runtime-D
kernel; rows 16-32 entries ahead are prefetched, since random row reads are latency-bound.
"""
from __future__ import annotations

import functools
import math
import mmap

import numba
import numpy as np
from numba import prange

from ..codegen import KernelSpec, get_kernel, jit, kernel_factory
from ..codegen.prefetch import prefetch_l2
from ..codegen.rowvec import row_axpy, row_set, row_split_axpy, row_sum_squares, stack_f32
from .optim import SplitBF16Table, as_float32, as_uint32, widen

SPECIALISED_D = (16, 32, 64, 128)  # widths that get a compile-time-D kernel
SERIAL_WORK = 1 << 14              # nnz * D up to which a call runs serially even with several threads
_CHUNKS = 64                       # bag chunks of the parallel forward
_MODES = ("sum", "mean")
_I32, _I64, _F32DT = np.dtype(np.int32), np.dtype(np.int64), np.dtype(np.float32)
_NO_PSW = np.empty(0, np.float32)  # stand-in for absent per-sample weights (kernels never read it)

# ----------------------------------------------------------------------------- table memory

_LINE = 64
_HUGE_PAGE = 2 << 20
_HUGE_MIN_BYTES = 16 << 20  # smaller tables mostly stay cached; not worth a private mapping


def empty_table(rows: int, dim: int, dtype=np.float32) -> np.ndarray:
    """An uninitialised C-contiguous (rows, dim) table starting on a 64-byte cache line (as torch's
    tensors do; NumPy's start 16 bytes in), so rows of whole lines need one prefetch per line,
    and on transparent huge pages where the OS offers them (Linux madvise): random row reads then
    stop missing the TLB on every row (measured on a 1M x 64 fp32 table: forward -18%, fused SGD -7%)."""
    dtype = np.dtype(dtype)
    nbytes = int(rows) * int(dim) * dtype.itemsize
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    m = None
    if advice is not None and nbytes >= _HUGE_MIN_BYTES:
        try:  # private anonymous memory (shared mappings would be shmem, which THP leaves alone)
            m = mmap.mmap(-1, nbytes + _HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            m.madvise(advice)
        except (OSError, ValueError, AttributeError):
            m = None
    if m is None:
        raw = np.empty(nbytes + _LINE, np.uint8)
        start = -raw.ctypes.data % _LINE
        return raw[start:start + nbytes].view(dtype).reshape(rows, dim)
    raw = np.frombuffer(m, np.uint8)  # the array keeps the mapping alive
    start = -raw.ctypes.data % _HUGE_PAGE  # 2 MiB aligned, so every whole huge page can be one
    return raw[start:start + nbytes].view(dtype).reshape(rows, dim)


# ----------------------------------------------------------------------------- validation


@jit(inline="always")
def _check_bags(indices, offsets, nbags, num_rows, last):
    """(code, position, value) of the first problem, code 0 if none.

    Branch-free reductions first (they vectorise); positions are searched only on failure.
    """
    nnz = indices.shape[0]
    if nbags > 0 and offsets[0] != 0:
        return 1, 0, offsets[0]
    decreasing = False
    for b in range(1, offsets.shape[0]):
        decreasing |= offsets[b] < offsets[b - 1]
    if decreasing:
        for b in range(1, offsets.shape[0]):
            if offsets[b] < offsets[b - 1]:
                return 2, b, offsets[b]
    n_off = offsets.shape[0]
    if n_off > 0 and offsets[n_off - 1] > nnz:
        return 3, n_off - 1, offsets[n_off - 1]
    if last and n_off > 0 and offsets[n_off - 1] != nnz:
        return 4, n_off - 1, offsets[n_off - 1]
    if nbags == 0 and nnz > 0:
        return 5, 0, nnz
    outside = False
    for j in range(nnz):  # unsigned compare: negative indices wrap to huge values
        outside |= np.uint64(np.int64(indices[j])) >= np.uint64(num_rows)
    if outside:
        for j in range(nnz):
            if indices[j] < 0 or indices[j] >= num_rows:
                return 6, j, np.int64(indices[j])
    return 0, 0, 0


@jit()
def _validate_bags(indices, offsets, nbags, num_rows, last):
    """_check_bags as a call of its own: inlined next to a serial gather loop, it made LLVM compile
    that loop ~5x slower (measured: 41 us instead of 8 us at 2048 rows, D=16)."""
    return _check_bags(indices, offsets, nbags, num_rows, last)


def _raise_bag_error(code, pos, val, table, num_rows, nnz):
    if code == 1:
        raise ValueError(f"offsets[0] must be 0, got {val}")
    if code == 2:
        raise ValueError(f"offsets must be non-decreasing: offsets[{pos}] = {val} < offsets[{pos - 1}]")
    if code == 3:
        raise ValueError(f"offsets[{pos}] = {val} is beyond the number of indices ({nnz})")
    if code == 4:
        raise ValueError(f"with include_last_offset the last offset must equal len(indices) = {nnz}, got {val}")
    if code == 5:
        raise ValueError(f"offsets defines no bags but indices has {nnz} entries")
    raise IndexError(f"indices[{pos}] = {val} is out of range for {table} with {num_rows} rows")


def _as_index_array(name, a):
    if not isinstance(a, np.ndarray):
        raise TypeError(f"{name} must be a numpy array of int32 or int64, got {type(a).__name__}")
    if a.dtype != _I64 and a.dtype != _I32:
        raise TypeError(f"{name} must have dtype int32 or int64, got {a.dtype}")
    if a.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {a.shape}")
    f = a.flags  # one flags object (each a.flags builds a new one): these checks run per call per table
    return a if f.c_contiguous and f.aligned else np.array(a, order="C")


def _as_float_array(name, a, shape):
    if not isinstance(a, np.ndarray) or a.dtype != _F32DT:
        raise TypeError(f"{name} must be a float32 numpy array, got {getattr(a, 'dtype', type(a).__name__)}")
    if a.shape != shape:
        raise ValueError(f"{name} must have shape {shape}, got {a.shape}")
    f = a.flags
    return a if f.c_contiguous and f.aligned else np.array(a, order="C")


def _check_table(weight, name="weight", *, writeable=False, bf16_ok=True):
    """(rows array, is_bf16): the float32 (R, D) table or the `hi` half of a SplitBF16Table."""
    if isinstance(weight, SplitBF16Table):
        if not bf16_ok:
            raise TypeError(f"{name} must be a float32 ndarray here; SplitBF16Table is supported by "
                            "embedding_bag_forward and embedding_bag_sgd_ only")
        if writeable and not (weight.hi.flags.writeable and weight.lo.flags.writeable):
            raise ValueError(f"{name} halves must be writeable (updated in place)")
        return weight.hi, True
    if not isinstance(weight, np.ndarray) or weight.dtype != _F32DT:
        raise TypeError(f"{name} must be a float32 ndarray or SplitBF16Table, "
                        f"got {getattr(weight, 'dtype', type(weight).__name__)}")
    if weight.ndim != 2:
        raise ValueError(f"{name} must be 2-D (R, D), got shape {weight.shape}")
    f = weight.flags
    if not (f.c_contiguous and f.aligned):
        raise ValueError(f"{name} must be C-contiguous and aligned")
    if writeable and not f.writeable:
        raise ValueError(f"{name} must be writeable (updated in place)")
    return weight, False


def _check_common(indices, offsets, mode, per_sample_weights, include_last_offset):
    """Check the bag arrays' types and shapes; returns (indices, offsets, nbags, psw or empty, mean flag).
    Their values (offsets order, index range) are checked by the kernels before they write anything."""
    if mode not in _MODES:
        raise ValueError(f"mode must be one of {_MODES}, got {mode!r}")
    indices = _as_index_array("indices", indices)
    offsets = _as_index_array("offsets", offsets)
    if offsets.dtype != _I64:
        offsets = offsets.astype(np.int64)
    last = bool(include_last_offset)
    if last and offsets.shape[0] == 0:
        raise ValueError("with include_last_offset, offsets must have B + 1 >= 1 entries")
    nbags = offsets.shape[0] - 1 if last else offsets.shape[0]
    nnz = indices.shape[0]
    if per_sample_weights is None:
        psw = _NO_PSW
    else:
        psw = _as_float_array("per_sample_weights", per_sample_weights, (nnz,))
    return indices, offsets, nbags, psw, mode == "mean"


def _finite(name, x):
    try:
        x = float(x)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a real number, got {type(x).__name__}") from None
    if not math.isfinite(x):
        raise ValueError(f"{name} must be finite, got {x}")
    return x


def _prefetch_distance(row_bytes):
    """Rows to prefetch ahead: far enough to cover a DRAM miss, near enough that wide rows do not
    overflow the outstanding-miss buffers (measured on Zen 4; a hint, never a correctness matter)."""
    return 32 if row_bytes <= 256 else 16


@functools.lru_cache(maxsize=None)
def _forward_kernel(dclass, bf16, serial):
    """get_kernel, memoised here too: its per-call config read costs ~20 us, and the DLRM calls
    these ops once per table per step (JITKERN_DEBUG logs the first choice of each spec only)."""
    pf = _prefetch_distance(dclass * (2 if bf16 else 4)) if dclass else 16  # one generic kernel per dtype
    return get_kernel(KernelSpec.make("embedding_bag_forward", D=dclass, bf16=bf16, pf=pf, serial=serial))


def _num_threads() -> int:
    """numba.get_num_threads() (this thread's setting), through the threading layer's C getter once
    that is launched: the public call costs ~0.65 us, 6% of a small forward."""
    global _get_threads
    if _get_threads is numba.get_num_threads:
        from numba.np.ufunc import parallel
        n = numba.get_num_threads()  # launches the threading layer
        _get_threads = getattr(parallel, "_get_num_threads", numba.get_num_threads)
        return n
    return _get_threads()


_get_threads = numba.get_num_threads


def _serial(work: int, dim: int) -> bool:
    """Whether the forward runs on the calling thread: one thread, or too little work to pay for
    starting others (~1.5 us). Rows wider than 64 stay parallel: serially compiled, their gather
    is ~2x slower (measured at D=128, pooling 1; numba marks parallel bodies' arrays noalias)."""
    return dim <= 64 and (work <= SERIAL_WORK or _num_threads() == 1)


def _d_class(d: int) -> int:
    """The compile-time width for D, or 0 for the generic runtime-D kernel."""
    return d if d in SPECIALISED_D else 0


# ----------------------------------------------------------------------------- forward


@jit(inline="always")
def _bag_end(offsets, b, nbags, nnz, last):
    return offsets[b + 1] if (last or b + 1 < nbags) else nnz


@jit(inline="always")
def _madd_row(dst, i, src, j, sc, D, DC, first):
    """dst[i] = sc * src[j] if first else dst[i] + sc * src[j]; one vector op when DC (= D) is set."""
    if DC:
        if first:
            row_set(dst, i, src, j, sc, DC)
        else:
            row_axpy(dst, i, src, j, sc, DC)
    elif first:
        for d in range(D):
            dst[i, d] = widen(src[j, d]) * sc
    else:
        for d in range(D):
            dst[i, d] += widen(src[j, d]) * sc


@jit(inline="always")
def _straddles(table, row_bytes):
    """Whether a row can end in a cache line its 64-byte steps miss: unless the table starts on a
    line and rows are whole lines (jitkern's empty_table, torch's allocator), a row of 64 bytes
    spans two lines. A loop-invariant flag: a second prefetch into an already-requested line is
    not free (measured at D=16 on line-aligned rows, R=1e6, Zipf pooling 20: 92 -> 72 us without it)."""
    return row_bytes % 64 != 0 or table.ctypes.data % 64 != 0


@jit(inline="always")
def _prefetch_row(table, r, row_bytes, tail):
    """Prefetch every line of row r into L2: one per 64 bytes, and the line of its last byte if `tail`.

    Into L2, for reads and updates alike: an L1 prefetch (or a prefetch for writing) holds one of
    the L1's fill buffers until its line arrives, and those cap the misses in flight. Measured on
    Zen 4, fresh rows, pooling 20, 1 thread: forward 1.30 -> 0.93 ms at D=64, fused SGD 3.0 -> 2.2
    ms at D=128 (R=1e7). An update's row then arrives shared and is written in place."""
    for k in range(0, row_bytes, 64):
        prefetch_l2(table, r, k)
    if tail:
        prefetch_l2(table, r, row_bytes - 1)


@jit(inline="always")
def _pool_bag(acc, weight, indices, psw, s, e, nnz, pf, row_bytes, D, DC, weighted):
    """acc[0] = sum of psw[j] * weight[indices[j]] over j in [s, e), prefetching pf entries ahead."""
    far = np.uint64(nnz - 1)
    tail = _straddles(weight, row_bytes)
    for j in range(s, e):
        u = np.uint64(j)  # validated and non-negative: unsigned indexing skips numba's wraparound code
        _prefetch_row(weight, indices[min(u + np.uint64(pf), far)], row_bytes, tail)
        _madd_row(acc, 0, weight, indices[u], psw[u] if weighted else np.float32(1.0), D, DC, j == s)


@jit(inline="always")
def _pool_bags(weight, indices, offsets, psw, mean, last, out, b0, b1, D, DC, PF, ITEM):
    """out[b] = the pooled rows of bag b, for the bags b0 <= b < b1 (one work unit of the forward)."""
    nbags, nnz = out.shape[0], indices.shape[0]
    has_psw = psw.shape[0] > 0
    acc = stack_f32(DC) if DC else np.empty((1, D), np.float32)
    for b in range(b0, b1):
        s, e = offsets[b], _bag_end(offsets, b, nbags, nnz, last)
        if has_psw:  # two copies of the row loop, so the common unweighted one has no per-row test
            _pool_bag(acc, weight, indices, psw, s, e, nnz, PF, D * ITEM, D, DC, True)
        else:
            _pool_bag(acc, weight, indices, psw, s, e, nnz, PF, D * ITEM, D, DC, False)
        if e > s:
            inv = np.float32(1.0) / np.float32(e - s) if mean else np.float32(1.0)
            _madd_row(out, b, acc, 0, inv, D, DC, True)
        else:
            for d in range(D):
                out[b, d] = 0.0


@kernel_factory("embedding_bag_forward")
def _forward_factory(spec):
    DC, PF = spec["D"], spec["pf"]
    ITEM = 2 if spec["bf16"] else 4  # bytes per table element, a constant so prefetch loops unroll

    @jit(parallel=True)
    def forward(weight, indices, offsets, psw, mean, last, nchunks, out):
        # weight: (R, D) float32 or bf16 bits uint16, indices: (nnz,), offsets: (B,)|(B+1,), out: (B, D)
        nbags = out.shape[0]
        code, bad, value = _check_bags(indices, offsets, nbags, weight.shape[0], last)
        if code:
            return code, bad, value
        D = DC if DC else out.shape[1]
        for c in prange(nchunks):
            _pool_bags(weight, indices, offsets, psw, mean, last, out, c * nbags // nchunks,
                       (c + 1) * nbags // nchunks, D, DC, PF, ITEM)
        return 0, 0, 0

    @jit()
    def pool(weight, indices, offsets, psw, mean, last, out):
        _pool_bags(weight, indices, offsets, psw, mean, last, out, 0, out.shape[0], DC if DC else out.shape[1],
                   DC, PF, ITEM)

    @jit()
    def forward_serial(weight, indices, offsets, psw, mean, last, nchunks, out):
        # the same on the calling thread: starting a parallel region costs ~1.5 us, 10-15% of a small call
        code, bad, value = _validate_bags(indices, offsets, out.shape[0], weight.shape[0], last)
        if code:
            return code, bad, value
        pool(weight, indices, offsets, psw, mean, last, out)
        return 0, 0, 0
    return forward_serial if spec["serial"] else forward


def embedding_bag_forward(weight, indices, offsets, *, mode="sum", per_sample_weights=None,
                          include_last_offset=False, out=None):
    """Pooled rows per bag; weight: (R, D) float32 or SplitBF16Table, indices: (nnz,), offsets: (B,) -> (B, D)."""
    w, bf16 = _check_table(weight)
    R, D = w.shape
    indices, offsets, nbags, psw, mean = _check_common(indices, offsets, mode, per_sample_weights,
                                                       include_last_offset)
    dest = out
    if out is None:
        dest = out = np.empty((nbags, D), np.float32)
    else:
        if not isinstance(out, np.ndarray) or out.dtype != np.float32:
            raise TypeError(f"out must be a float32 ndarray, got {getattr(out, 'dtype', type(out).__name__)}")
        if out.shape != (nbags, D) or not out.flags.writeable:
            raise ValueError(f"out must be a writeable ({nbags}, {D}) array, got shape {out.shape}")
        if not (out.flags.c_contiguous and out.flags.aligned):  # a strided view: pool, then copy in
            dest = np.empty((nbags, D), np.float32)
    kern = _forward_kernel(_d_class(D), bf16, _serial(indices.shape[0] * D, D))
    # contiguous chunks of bags, spread over the threads by prange (independent of the thread count)
    code, pos, val = kern(w, indices, offsets, psw, mean, bool(include_last_offset), min(_CHUNKS, nbags), dest)
    if code:
        _raise_bag_error(code, pos, val, "weight", R, indices.shape[0])
    if dest is not out:
        np.copyto(out, dest)
    return out


# ----------------------------------------------------------------------------- row updates (shared by the sparse paths)


@jit(inline="always")
def _sum_squares(x, a, D):
    """sum(x[a, :D] ** 2) in float64, as 8 interleaved partial sums added pairwise at the end: one
    running sum waits ~4 cycles on every add (strict IEEE keeps LLVM from splitting it), which
    at D=64 made the row-wise Adagrad update several times slower than SGD. The order depends on
    D only, so every path and thread count still rounds alike."""
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
def _apply_row(table, lo, state, r, acc, a, lr, eps, D, DC, SGD, BF16):
    """Row r of the table takes its coalesced gradient acc[a]: SGD, bf16 Split-SGD or row-wise Adagrad."""
    if SGD:
        _madd_row(table, r, acc, a, -lr, D, DC, False)  # w + (-lr * g): exactly w - lr * g
    elif BF16:
        if DC:
            row_split_axpy(table, lo, r, acc, a, -lr, DC)  # w + (-lr * g): exactly w - lr * g, as below
        else:
            for d in range(D):
                w = as_float32((np.uint32(table[r, d]) << np.uint32(16)) | np.uint32(lo[r, d]))
                bits = as_uint32(w - lr * acc[a, d])
                table[r, d] = np.uint16(bits >> np.uint32(16))
                lo[r, d] = np.uint16(bits & np.uint32(0xFFFF))
    else:
        ss = row_sum_squares(acc, a, DC) if DC else _sum_squares(acc, a, D)
        s_new = np.float32(state[r] + ss / D)
        state[r] = s_new
        step = np.float32(lr / (math.sqrt(np.float64(s_new)) + eps))
        _madd_row(table, r, acc, a, -step, D, DC, False)


@jit(inline="always")
def _entry_scale(j, b, psw, mean, offsets, nbags, nnz, last):
    """Entry j's weight in bag b's gradient: its per-sample weight, over the bag size for mean."""
    sc = psw[j] if psw.shape[0] > 0 else np.float32(1.0)
    if mean:
        sc = sc * (np.float32(1.0) / np.float32(_bag_end(offsets, b, nbags, nnz, last) - offsets[b]))
    return sc
