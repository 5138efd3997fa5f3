"""Embedding bags: pooled-gather forward, coalesced sparse backward, fused race-free updates.

Layouts follow torch.nn.functional.embedding_bag: weight (R, D) float32 (or a SplitBF16Table),
flat indices (nnz,) int32/int64, offsets (B,) int64 bag starts (or (B+1,) with
include_last_offset=True); bag b is indices[offsets[b]:offsets[b+1]], the last runs to nnz.

Forward: parallel over chunks of bags; for common widths D (SPECIALISED_D) the row loop is one
<D x float> operation on a register-resident accumulator, other widths run a generic runtime-D
kernel; rows 16-32 entries ahead are prefetched, since random row reads are latency-bound.

Backward and the fused updates share one plan: a stable LSD radix sort of the (row, position)
pairs groups duplicates, and the sorted groups are cut into up to _CHUNKS contiguous parts, i.e.
disjoint row ranges, which prange hands to the threads (row ownership: one thread applies every
occurrence of its rows, so no atomics). A row's gradient is summed once, in position order, then
the row is written/updated once ("coalesce, then update"), so results are bit-identical run to
run and do not even depend on the thread count.
"""
from __future__ import annotations

import functools
import math
import mmap
import operator
import threading

import numba
import numpy as np
from numba import prange

from ..codegen import KernelSpec, get_kernel, jit, kernel_factory
from ..codegen.prefetch import prefetch, prefetch_write
from ..codegen.rowvec import row_axpy, row_set, stack_f32
from .optim import SplitBF16Table, as_float32, as_uint32, widen

SPECIALISED_D = (16, 32, 64, 128)  # widths that get a compile-time-D kernel
UPDATE_PREFETCH = 16               # row groups the updates prefetch (for writing) ahead
_RADIX_BITS = 12                   # digit width of the radix sort (4096-entry histogram)
SERIAL_WORK = 1 << 14              # nnz * D up to which a call runs serially even with several threads
SMALL_NNZ = 8192                   # indices up to which the fused updates group rows by hashing, not sorting
_CHUNKS = 64                       # work units per call: bag chunks (forward), row-group parts (updates)
_MODES = ("sum", "mean")
_I32, _I64, _F32DT = np.dtype(np.int32), np.dtype(np.int64), np.dtype(np.float32)
_NO_PSW = np.empty(0, np.float32)  # stand-ins for absent optional arrays (kernels never read them)
_NO_STATE = np.empty(0, np.float32)
_NO_LO = np.empty((0, 0), np.uint16)
_NO_ROWS = np.empty((0, 0), np.float32)
_UPDATES = ("grad", "sgd", "sgd_bf16", "adagrad")

# ----------------------------------------------------------------------------- table memory

_HUGE_PAGE = 2 << 20
_HUGE_MIN_BYTES = 16 << 20  # smaller tables mostly stay cached; not worth a private mapping


def empty_table(rows: int, dim: int, dtype=np.float32) -> np.ndarray:
    """An uninitialised C-contiguous (rows, dim) table, on transparent huge pages where the OS
    offers them (Linux madvise): random row reads then stop missing the TLB on every row
    (measured on a 1M x 64 fp32 table: forward -18%, fused SGD -7%). Plain np.empty otherwise."""
    dtype = np.dtype(dtype)
    nbytes = int(rows) * int(dim) * dtype.itemsize
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is None or nbytes < _HUGE_MIN_BYTES:
        return np.empty((rows, dim), dtype)
    try:  # private anonymous memory (shared mappings would be shmem, which THP leaves alone)
        m = mmap.mmap(-1, nbytes + _HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        m.madvise(advice)
    except (OSError, ValueError, AttributeError):
        return np.empty((rows, dim), dtype)
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
    return a if a.flags.c_contiguous and a.flags.aligned else np.array(a, order="C")


def _as_float_array(name, a, shape):
    if not isinstance(a, np.ndarray) or a.dtype != _F32DT:
        raise TypeError(f"{name} must be a float32 numpy array, got {getattr(a, 'dtype', type(a).__name__)}")
    if a.shape != shape:
        raise ValueError(f"{name} must have shape {shape}, got {a.shape}")
    return a if a.flags.c_contiguous and a.flags.aligned else np.array(a, order="C")


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
    if not (weight.flags.c_contiguous and weight.flags.aligned):
        raise ValueError(f"{name} must be C-contiguous and aligned")
    if writeable and not weight.flags.writeable:
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


@functools.lru_cache(maxsize=None)
def _update_kernel(dclass, kind, small):
    op = "embedding_bag_update_small" if small else "embedding_bag_update"
    return get_kernel(KernelSpec.make(op, D=dclass, pf=UPDATE_PREFETCH, kind=kind))


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
def _prefetch_row(table, r, row_bytes, write):
    for k in range(0, row_bytes, 64):  # every line of the row, and its last byte (rows need not be aligned)
        if write:
            prefetch_write(table, r, k)
        else:
            prefetch(table, r, k)
    if write:
        prefetch_write(table, r, row_bytes - 1)
    else:
        prefetch(table, r, row_bytes - 1)


@jit(inline="always")
def _pool_bag(acc, weight, indices, psw, s, e, nnz, pf, row_bytes, D, DC, weighted):
    """acc[0] = sum of psw[j] * weight[indices[j]] over j in [s, e), prefetching pf entries ahead."""
    far = np.uint64(nnz - 1)
    for j in range(s, e):
        u = np.uint64(j)  # validated and non-negative: unsigned indexing skips numba's wraparound code
        _prefetch_row(weight, indices[min(u + np.uint64(pf), far)], row_bytes, False)
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


# ----------------------------------------------------------------------------- sparse plan


@jit()
def _plan(indices, offsets, psw, nbags, num_rows, last, mean, nparts, work, fwork):
    """Sort (row, position) pairs by row (stable LSD radix sort) and cut the groups of equal rows
    into nparts contiguous ranges of about equal length.

    Returns the (code, position, value) of _check_bags, then in sorted order rows (nnz,), the bag
    (nnz,) and the scale (nnz,) float32 (per-sample weight / bag size for mean) of each entry, so
    the update reads them sequentially, then group (U + 1,) the start of each group of equal
    rows and parts (nparts + 1,) the group cuts. work (6, nnz + 1) int64 and fwork (nnz + 1,)
    float32 are scratch the results are views of.
    """
    nnz = indices.shape[0]
    code, bad, value = _check_bags(indices, offsets, nbags, num_rows, last)
    if code:
        none = np.empty(0, np.int64)
        return (code, bad, value), none, none, np.empty(0, np.float32), none, none
    bag_of = work[0, :nnz]
    inv_len = np.ones(nbags, np.float32)
    for b in range(nbags):
        s, e = offsets[b], _bag_end(offsets, b, nbags, nnz, last)
        if mean and e > s:
            inv_len[b] = np.float32(1.0) / np.float32(e - s)
        for j in range(s, e):
            bag_of[j] = b
    nbits = 0
    while (np.int64(1) << nbits) < num_rows:
        nbits += 1
    npass = max(1, (nbits + _RADIX_BITS - 1) // _RADIX_BITS)
    digit = (nbits + npass - 1) // npass
    mask = (np.int64(1) << digit) - 1
    # the histograms of every pass in one read of the indices
    count = np.zeros((npass, (np.int64(1) << digit) + 1), np.int64)
    for j in range(nnz):
        r = np.int64(indices[j])
        for p in range(npass):
            count[p, ((r >> (p * digit)) & mask) + 1] += 1
    for p in range(npass):
        for k in range(1, count.shape[1]):
            count[p, k] += count[p, k - 1]
    # Each entry moves as one word, (row << 32) | position: half the traffic of separate row and
    # position arrays. Rows < 2**32 (the wrapper checks); bit 63 may make the word negative, so a
    # digit is read from the row recovered with a mask (a shift alone would drag the sign in).
    lo32 = (np.int64(1) << 32) - 1
    keys, keys2 = work[1, :nnz], work[3, :nnz]
    for j in range(nnz):  # pass 0 scatters straight from the indices, later passes ping-pong
        r = np.int64(indices[j])
        k = r & mask
        t = count[0, k]
        count[0, k] = t + 1
        keys[t] = (r << 32) | j
    for p in range(1, npass):
        shift = p * digit
        for j in range(nnz):
            key = keys[j]
            k = (((key >> 32) & lo32) >> shift) & mask
            t = count[p, k]
            count[p, k] = t + 1
            keys2[t] = key
        keys, keys2 = keys2, keys
    # unpack in one sweep: rows, group starts, and each entry's bag and scale
    rows, starts, sbag, sscale = work[2, :nnz], work[4], work[5, :nnz], fwork[:nnz]
    has_psw = psw.shape[0] > 0
    ngroups = 0
    for k in range(nnz):
        key = keys[k]
        r = (key >> 32) & lo32
        j = key & lo32
        rows[k] = r
        if k == 0 or r != rows[k - 1]:
            starts[ngroups] = k
            ngroups += 1
        b = bag_of[j]
        sbag[k] = b
        sscale[k] = (psw[j] if has_psw else np.float32(1.0)) * inv_len[b]
    starts[ngroups] = nnz
    group = starts[:ngroups + 1]
    parts = np.empty(nparts + 1, np.int64)
    for t in range(nparts + 1):
        parts[t] = np.searchsorted(group, t * nnz // nparts)  # first group starting at or after the cut
    parts[nparts] = ngroups
    return (code, bad, value), rows, sbag, sscale, group, parts


@jit(inline="always")
def _apply_row(table, lo, state, r, acc, a, lr, eps, D, DC, SGD, BF16):
    """Row r of the table takes its coalesced gradient acc[a]: SGD, bf16 Split-SGD or row-wise Adagrad."""
    if SGD:
        _madd_row(table, r, acc, a, -lr, D, DC, False)  # w + (-lr * g): exactly w - lr * g
    elif BF16:
        for d in range(D):
            w = as_float32((np.uint32(table[r, d]) << np.uint32(16)) | np.uint32(lo[r, d]))
            bits = as_uint32(w - lr * acc[a, d])
            table[r, d] = np.uint16(bits >> np.uint32(16))
            lo[r, d] = np.uint16(bits & np.uint32(0xFFFF))
    else:
        ss = 0.0
        for d in range(D):
            ss += np.float64(acc[a, d]) * np.float64(acc[a, d])
        s_new = np.float32(state[r] + ss / D)
        state[r] = s_new
        step = np.float32(lr / (math.sqrt(np.float64(s_new)) + eps))
        _madd_row(table, r, acc, a, -step, D, DC, False)


@kernel_factory("embedding_bag_update_small")
def _small_update_factory(spec):
    DC, PF, kind = spec["D"], spec["pf"], spec["kind"]
    ITEM = 2 if kind == "sgd_bf16" else 4
    SGD, BF16 = kind == "sgd", kind == "sgd_bf16"

    @jit(fastmath=frozenset())
    def apply(indices, offsets, psw, mean, last, dout, lr, eps, table, lo, state, slots, urows, acc):
        # Serial, sort-free: an open-addressing hash (slots)
        # numbers the distinct rows in order of first occurrence; acc[g] (nnz, D) sums group g's
        # gradient in position order (set at its first occurrence, then added), exactly as the
        # sorted path does, then each row is updated once.
        nbags, nnz = dout.shape[0], indices.shape[0]
        D = DC if DC else dout.shape[1]
        bits = 1
        while (np.int64(1) << bits) < 2 * nnz:  # the table: the first 2**bits >= 2 nnz slots
            bits += 1
        shift = np.uint64(64 - bits)
        hmask = np.uint64((np.int64(1) << bits) - 1)
        slots[:np.int64(1) << bits] = -1  # empty (rows and groups are < 2**32 - 1: never a real slot)
        lo32 = (np.int64(1) << 32) - 1
        has_psw = psw.shape[0] > 0
        ngroups = 0
        for b in range(nbags):
            s, e = offsets[b], _bag_end(offsets, b, nbags, nnz, last)
            inv = np.float32(1.0) / np.float32(e - s) if mean and e > s else np.float32(1.0)
            for j in range(s, e):
                u = np.uint64(j)
                r = np.int64(indices[u])
                h = (np.uint64(r) * np.uint64(0x9E3779B97F4A7C15)) >> shift  # Fibonacci hashing
                while True:  # a slot holds (row << 32) | group: one load per probe
                    v = slots[h]
                    if v == -1 or (v >> 32) & lo32 == r:
                        break
                    h = (h + np.uint64(1)) & hmask
                first = v == -1
                if first:
                    g = ngroups
                    slots[h] = (r << 32) | g
                    urows[g] = r
                    ngroups += 1
                else:
                    g = v & lo32
                sc = (psw[u] if has_psw else np.float32(1.0)) * inv
                _madd_row(acc, g, dout, b, sc, D, DC, first)
        for g in range(ngroups):
            # prefetching here, not while hashing, measured 15-25% faster (D=16 and 128, R=1e6 and 1e7)
            if g + PF < ngroups:
                _prefetch_row(table, urows[g + PF], D * ITEM, True)
                if BF16:
                    _prefetch_row(lo, urows[g + PF], D * ITEM, True)
            _apply_row(table, lo, state, urows[g], acc, g, lr, eps, D, DC, SGD, BF16)

    @jit(fastmath=frozenset())  # strict IEEE, as the sorted path: both give the same bits
    def update_small(indices, offsets, psw, mean, last, dout, lr, eps, table, lo, state, slots, urows, acc):
        code, bad, value = _validate_bags(indices, offsets, dout.shape[0], table.shape[0], last)
        if code:
            return code, bad, value
        apply(indices, offsets, psw, mean, last, dout, lr, eps, table, lo, state, slots, urows, acc)
        return 0, 0, 0
    return update_small


@kernel_factory("embedding_bag_update")
def _update_factory(spec):
    DC, PF, kind = spec["D"], spec["pf"], spec["kind"]
    ITEM = 2 if kind == "sgd_bf16" else 4
    GRAD, SGD, BF16, _ = (kind == k for k in _UPDATES)

    @jit(parallel=True, fastmath=frozenset())  # strict IEEE: bf16 and fp32 SGD round identically
    def update(rows, sbag, sscale, group, parts, dout, lr, eps, table, lo, state, drows):
        # table: (R, D) float32 weight, or bf16 hi bits with lo the low halves; state: (R,) Adagrad;
        # drows: (U, D) output of kind "grad". Part t (one thread's) owns the row groups parts[t]:parts[t+1].
        D = DC if DC else dout.shape[1]
        ngroups = group.shape[0] - 1
        for t in prange(parts.shape[0] - 1):
            acc = stack_f32(DC) if DC else np.empty((1, D), np.float32)
            g0, g1 = parts[t], parts[t + 1]
            for g in range(g0, g1):
                if not GRAD and g + PF < ngroups:  # a hint only: may touch the next part's rows
                    _prefetch_row(table, rows[group[g + PF]], D * ITEM, True)
                    if BF16:
                        _prefetch_row(lo, rows[group[g + PF]], D * ITEM, True)
                # the coalesced gradient of this row: its occurrences in position order
                for k in range(group[g], group[g + 1]):
                    _madd_row(acc, 0, dout, sbag[k], sscale[k], D, DC, k == group[g])
                r = rows[group[g]]
                if GRAD:
                    _madd_row(drows, g, acc, 0, np.float32(1.0), D, DC, True)
                else:
                    _apply_row(table, lo, state, r, acc, 0, lr, eps, D, DC, SGD, BF16)
    return update


_SCRATCH = threading.local()


def _scratch(n):
    """Per-thread, grow-only scratch for the plan: work (6, n) int64 and fwork (n,) float32.

    Fresh arrays of this size cost more than the whole sort: glibc maps them anew on every call
    and returns them on free, so each page faults again. Thread-local, so concurrent callers never
    share it; kernels finish with it before the op returns (results handed out are copies).
    """
    buf = getattr(_SCRATCH, "buf", None)
    if buf is None or buf.shape[0] < 7 * n:
        buf = _SCRATCH.buf = np.empty(max(7 * n, 2 * (0 if buf is None else buf.shape[0])), np.int64)
    return buf[:6 * n].reshape(6, n), buf[6 * n:7 * n].view(np.float32)[:n]


def _small_scratch(nnz, dim):
    """Per-thread, grow-only scratch of the sort-free update, per width (see _scratch for why it is
    kept): slots (>= 2 nnz, a power of two) int64, urows (>= nnz,) int64, acc (>= nnz, dim) float32.
    Whole arrays, no views: the kernel uses their first entries (views cost ~1 us a call here)."""
    cache = getattr(_SCRATCH, "small", None)
    if cache is None:
        cache = _SCRATCH.small = {}
    bufs = cache.get(dim)
    if bufs is None or bufs[1].shape[0] < nnz:
        n = max(nnz, 2 * (0 if bufs is None else bufs[1].shape[0]), 64)
        bufs = cache[dim] = (np.empty(1 << (2 * n - 1).bit_length(), np.int64), np.empty(n, np.int64),
                             np.empty((n, dim), np.float32))
    return bufs


def _sparse_update(kind, table, lo, state, indices, offsets, dout, num_rows, lr, eps, mode,
                   per_sample_weights, include_last_offset, table_name):
    """Validate, plan and run one sparse kernel; returns (rows, drows) for kind "grad"."""
    if not isinstance(dout, np.ndarray) or dout.dtype != np.float32 or dout.ndim != 2:
        raise TypeError(f"dout must be a 2-D float32 ndarray, got "
                        f"{getattr(dout, 'dtype', type(dout).__name__)} {getattr(dout, 'shape', '')}")
    D = dout.shape[1] if table is None else table.shape[1]
    indices, offsets, nbags, psw, mean = _check_common(indices, offsets, mode, per_sample_weights,
                                                       include_last_offset)
    dout = _as_float_array("dout", dout, (nbags, D))
    # row-group parts spread over the threads by prange: ownership and results do not depend on the thread count
    nnz = indices.shape[0]
    if num_rows > 1 << 32 or nnz >= 1 << 32:  # the plan packs a row and a position into one int64
        raise ValueError(f"embedding updates support up to 2**32 rows and indices, got {num_rows} rows, "
                         f"{nnz} indices")
    lo = _NO_LO if lo is None else lo
    state = _NO_STATE if state is None else state
    if kind != "grad" and nnz <= SMALL_NNZ:
        slots, urows, acc = _small_scratch(nnz, D)
        code, pos, val = _update_kernel(_d_class(D), kind, True)(
            indices, offsets, psw, mean, bool(include_last_offset), dout, np.float32(lr), np.float64(eps),
            table, lo, state, slots, urows, acc)
        if code:
            _raise_bag_error(code, pos, val, table_name, num_rows, nnz)
        return None
    work, fwork = _scratch(nnz + 1)
    err, rows, sbag, sscale, group, parts = _plan(indices, offsets, psw, nbags, num_rows, bool(include_last_offset),
                                                  mean, max(1, min(_CHUNKS, nnz)), work, fwork)
    if err[0]:
        _raise_bag_error(*err, table_name, num_rows, indices.shape[0])
    ngroups = group.shape[0] - 1
    drows = np.empty((ngroups, D), np.float32) if kind == "grad" else _NO_ROWS
    if ngroups and D:
        _update_kernel(_d_class(D), kind, False)(
            rows, sbag, sscale, group, parts, dout, np.float32(lr), np.float64(eps),
            drows if table is None else table, lo, state, drows)
    return (rows[group[:-1]], drows) if kind == "grad" else None


def embedding_bag_backward(indices, offsets, dout, num_rows, *, mode="sum", per_sample_weights=None,
                           include_last_offset=False):
    """Coalesced sparse gradient; dout: (B, D) -> rows (U,) sorted unique int64, drows (U, D) float32."""
    num_rows = operator.index(num_rows)
    if num_rows < 0:
        raise ValueError(f"num_rows must be >= 0, got {num_rows}")
    return _sparse_update("grad", None, None, None, indices, offsets, dout, num_rows, 0.0, 0.0, mode,
                          per_sample_weights, include_last_offset, "num_rows")


def embedding_bag_sgd_(weight, indices, offsets, dout, lr, *, mode="sum", per_sample_weights=None,
                       include_last_offset=False):
    """In place, fused: weight[rows] -= lr * drows (coalesce, then update). Returns weight."""
    w, bf16 = _check_table(weight, writeable=True)
    lr = _finite("lr", lr)
    _sparse_update("sgd_bf16" if bf16 else "sgd", w, weight.lo if bf16 else None, None, indices, offsets,
                   dout, w.shape[0], lr, 0.0, mode, per_sample_weights, include_last_offset, "weight")
    return weight


def embedding_bag_adagrad_(weight, state, indices, offsets, dout, lr, eps=1e-8, *, mode="sum",
                           per_sample_weights=None, include_last_offset=False):
    """In place, fused row-wise Adagrad; weight: (R, D), state: (R,) float32. Returns weight."""
    w, _ = _check_table(weight, writeable=True, bf16_ok=False)
    if not isinstance(state, np.ndarray) or state.dtype != np.float32:
        raise TypeError(f"state must be a float32 ndarray, got {getattr(state, 'dtype', type(state).__name__)}")
    if state.shape != (w.shape[0],) or not state.flags.c_contiguous or not state.flags.writeable:
        raise ValueError(f"state must be a writeable contiguous ({w.shape[0]},) array, got shape {state.shape}")
    lr = _finite("lr", lr)
    eps = _finite("eps", eps)
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    _sparse_update("adagrad", w, None, state, indices, offsets, dout, w.shape[0], lr, eps, mode,
                   per_sample_weights, include_last_offset, "weight")
    return weight
