"""Embedding-bag backward and the fused row-wise Adagrad update (SGD: ops/embedding_sgd.py).

Both compute "coalesce, then update": a row's gradient is the sum of its occurrences' scaled
dout rows, added in position order, and the row is then updated once (Adagrad's state takes
the square of the whole row gradient, so occurrences cannot be applied one by one as SGD's
are). The order is fixed by the data alone, so results are bit-identical run to run, path to
path and for any thread count. Two ways to find each row's occurrences:

- hashed (Adagrad when a batch touches few rows of the table, the usual case): one reverse
  pass over the entries inserts each row into an open-addressing table and threads its
  occurrences into a linked list headed by its first occurrence; a forward pass then visits the
  heads, sums each list's gradient in registers and updates the row once, prefetching rows
  ahead. Nothing is sorted and no per-row gradient is written to memory. With several threads
  the forward pass is cut into position ranges, one per thread: a row is updated by the range
  holding its head only, so no atomics.
- sorted (ops/embedding_sorted.py; the backward, whose rows come out sorted, and dense batches
  that touch a large share of the table): a stable LSD radix sort of (row, position) pairs,
  the groups cut into contiguous row ranges that prange hands to the threads. Applying the
  updates in row order streams through the table, which wins once the touched rows are dense.
"""
from __future__ import annotations

import functools
import operator
import threading

import numpy as np
from numba import prange

from ..codegen import KernelSpec, get_kernel, jit, kernel_factory
from ..codegen.prefetch import prefetch_l2
from ..codegen.rowvec import stack_f32
from .embedding import (
    _apply_row,
    _as_float_array,
    _check_common,
    _check_table,
    _d_class,
    _entry_scale,
    _finite,
    _madd_row,
    _num_threads,
    _prefetch_row,
    _raise_bag_error,
    _straddles,
    _validate_bags,
)
from .embedding_sorted import plan, sorted_update

UPDATE_PREFETCH = 32     # entries ahead whose rows the updates prefetch (16-32: within noise)
LINK_PREFETCH = 32       # entries ahead whose rows the linking pass prefetches
HASHED_MAX_DENSITY = 8   # hashed grouping while nnz * this <= rows (sparse batches); sorted beyond
SORTED_REPEATS = 0.2     # sorted grouping once this share of a sample repeats rows (skewed batches)
LIST_REPEATS = 16        # gather the list heads first once more than 1 entry in this many repeats a row
PARALLEL_MIN_NNZ = 8192  # below this many indices the hashed update runs on the calling thread
_CHUNKS = 64             # row-group parts of the sorted path
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)  # Fibonacci hashing: a row's slot is the top bits of row * this
_LO32 = (1 << 32) - 1
_MAX_ROWS, _MAX_NNZ = 1 << 32, (1 << 31) - 1
_NO_STATE = np.empty(0, np.float32)      # stand-ins for absent optional arrays (kernels never read them)
_NO_ROWS = np.empty((0, 0), np.float32)


def _update_path(nnz: int, num_rows: int, threads: int, repeats: float = 0.0) -> str:
    """'hashed', 'hashed-parallel' or 'sorted' for a fused update of nnz indices into num_rows rows,
    `repeats` the share of a sample of them that repeats a row (see _sample_repeats).

    Measured on Zen 4 with the fused SGD (which took these paths before ops/embedding_sgd.py),
    D=16..128, B=2048: hashed is 1.2-1.8x faster than sorted up to ~1 index
    per 8 rows (R=1e6, pooling 20, D=16: ~370 vs ~540 us), sorted ~6% faster at 1 per 5. Skewed
    batches sort better: Zipf(1.1) rows (a third of a sample repeats) 566 vs 780 us, R=1e6, fresh
    batches, where hashing walks long lists entry by entry."""
    if nnz > PARALLEL_MIN_NNZ and (nnz * HASHED_MAX_DENSITY > num_rows or repeats >= SORTED_REPEATS):
        return "sorted"
    return "hashed-parallel" if threads > 1 and nnz > PARALLEL_MIN_NNZ else "hashed"


@jit()
def _sample_repeats(indices, slots):
    """The share of 1024 evenly spaced entries (all, if fewer) whose row an earlier one of them
    had: a ~3 us estimate of how skewed a batch is. slots: >= 4096 int64 scratch."""
    n = indices.shape[0]
    s = min(n, 1024)
    slots[:4096] = -1
    repeats = 0
    for k in range(s):
        r = np.int64(indices[k * n // s])
        h = (np.uint64(r) * _GOLDEN) >> np.uint64(52)
        while True:
            v = slots[h]
            if v == -1 or v == r:
                break
            h = (h + np.uint64(1)) & np.uint64(4095)
        repeats += v == r
        slots[h] = r
    return repeats / max(s, 1)


@functools.lru_cache(maxsize=None)
def _update_kernel(dim, kind, path):
    """get_kernel, memoised (its per-call config read costs ~20 us; the DLRM calls once per table)."""
    return get_kernel(KernelSpec.make("embedding_bag_update", D=_d_class(dim), pf=UPDATE_PREFETCH, kind=kind,
                                      path=path))


# ----------------------------------------------------------------------------- hashed path


@jit(inline="always")
def _slot_bits(n):
    """log2 of the hash table for n distinct rows at most: the first power of two >= 2 n."""
    bits = 1
    while (np.int64(1) << bits) < 2 * n:
        bits += 1
    return bits


@jit(inline="always")
def _insert(slots, bits, r, j, nxt, head):
    """Entry j (row r) joins its row's list, found through slots[:2**bits].

    Entries arrive in descending position and each is pushed at the front, so a row's list runs
    in ascending position from its head, its first occurrence. A slot holds (row << 32) | head:
    one load per probe. head[j] is 1 while j heads its list, nxt[j] the next entry or -1."""
    hmask = np.uint64((np.int64(1) << bits) - 1)
    h = (np.uint64(r) * _GOLDEN) >> np.uint64(64 - bits)
    while True:
        v = slots[h]
        if v == -1 or (v >> 32) & _LO32 == r:
            break
        h = (h + np.uint64(1)) & hmask
    slots[h] = (r << 32) | j
    head[j] = 1
    if v == -1:
        nxt[j] = -1
    else:
        nxt[j] = v & _LO32
        head[v & _LO32] = 0


@jit(inline="always")
def _scratch_views(scratch, n):
    """In scratch (>= 7 n int64): slots (4n,), then nxt, ebag and head (n,) per entry."""
    return scratch[:4 * n], scratch[4 * n:5 * n], scratch[5 * n:6 * n], scratch[6 * n:7 * n]


@jit()
def _link_rows(indices, offsets, nbags, last, table, row_bytes, scratch):
    """Thread every entry into its row's list (one reverse pass; see _insert), noting each entry's
    bag in ebag (tracked backwards from the last bag). Returns whether entry j is bag j for all j.

    Each entry's table row is prefetched LINK_PREFETCH entries before it is linked:
    the rows come in from memory while this pass hashes, instead of during the update walk."""
    n = indices.shape[0]
    slots, nxt, ebag, head = _scratch_views(scratch, n)
    bits = _slot_bits(min(n, table.shape[0]))
    slots[:np.int64(1) << bits] = -1
    unit = _one_per_bag(offsets, nbags, n)
    tail = _straddles(table, row_bytes)
    pf = LINK_PREFETCH if row_bytes > 0 else n  # row_bytes 0: no prefetch (a gradient; the parallel path)
    if unit:  # one-hot features, the common case: no bag to track or note
        for k in range(n):
            j = n - 1 - k
            if j >= pf:
                _prefetch_row(table, indices[j - pf], row_bytes, tail)
            _insert(slots, bits, np.int64(indices[j]), j, nxt, head)
        return unit
    b, s = nbags, n
    for k in range(n):
        j = n - 1 - k
        if j >= pf:
            _prefetch_row(table, indices[j - pf], row_bytes, tail)
        while j < s:
            b -= 1
            s = offsets[b]
        ebag[j] = b
        _insert(slots, bits, np.int64(indices[j]), j, nxt, head)
    return unit


@jit(inline="always")
def _one_per_bag(offsets, nbags, n):
    """Whether bag b is exactly entry b for every b (a branch-free reduction that vectorises)."""
    if nbags != n:
        return False
    same = True
    for b in range(nbags):
        same &= offsets[b] == b
    return same


@jit()
def _list_heads(j0, j1, scratch, n):
    """Gather the entries in [j0, j1) that head a list (branch-free) into the slots, free once the
    lists are linked; returns the list."""
    head = scratch[6 * n:7 * n]
    heads = scratch[j0:j1]
    m = 0
    for j in range(j0, j1):
        heads[m] = j
        m += head[j]
    return heads[:m]


@functools.lru_cache(maxsize=None)
def _walker(DC, PF, kind, listed):
    """The update loop for compile-time width DC (0: runtime D), prefetch distance PF and update
    kind: over a list of heads (listed), or over the entries j0 <= j < j0 + len(heads) that head
    a list (heads then only gives the count). Copies for unscaled and scaled (per-sample weights
    or mean) entries, so the common one tests nothing per entry."""
    assert kind == "adagrad"

    @jit(inline="always")
    def loop(heads, j0, unit, scaled, indices, offsets, psw, mean, last, dout, lr, eps, table, state, scratch):
        nbags, n = dout.shape[0], indices.shape[0]
        D = DC if DC else dout.shape[1]
        nxt, ebag, head = scratch[4 * n:5 * n], scratch[5 * n:6 * n], scratch[6 * n:7 * n]
        acc = stack_f32(DC) if DC else np.empty((1, D), np.float32)
        one = np.float32(1.0)
        m = heads.shape[0]
        tail = _straddles(table, D * 4)
        for i in range(m):
            if i + PF < m:  # rows are prefetched (the reads miss in DRAM); unlisted, a
                r = indices[heads[i + PF]] if listed else indices[j0 + i + PF]  # repeat's row at times
                _prefetch_row(table, r, D * 4, tail)
                prefetch_l2(state, r, 0)  # its Adagrad state: another miss per row otherwise
            j = heads[i] if listed else j0 + i
            if listed or head[j]:
                k = j
                first = True
                while k >= 0:  # the list, in ascending position; most lists have one entry
                    b = k if unit else ebag[k]
                    sc = _entry_scale(k, b, psw, mean, offsets, nbags, n, last) if scaled else one
                    _madd_row(acc, 0, dout, b, sc, D, DC, first)
                    first = False
                    k = nxt[k]
                _apply_row(table, table, state, indices[j], acc, 0, lr, eps, D, DC, False, False)  # no lo: fp32

    @jit(fastmath=frozenset())
    def walk(heads, j0, unit, indices, offsets, psw, mean, last, dout, lr, eps, table, state, scratch):
        if listed and (mean or psw.shape[0] > 0):  # scaled entries are always listed (see _applier)
            loop(heads, j0, unit, True, indices, offsets, psw, mean, last, dout, lr, eps, table, state, scratch)
        elif listed or not unit:
            loop(heads, j0, unit, False, indices, offsets, psw, mean, last, dout, lr, eps, table, state, scratch)
        else:  # one-hot bags, unscaled: the common case, nothing tested per entry but the head
            loop(heads, j0, True, False, indices, offsets, psw, mean, last, dout, lr, eps, table, state, scratch)
    return walk


@functools.lru_cache(maxsize=None)
def _applier(DC, PF, kind):
    """apply(j0, j1, ...): update the rows whose first occurrence is in [j0, j1); one per (DC, PF,
    kind), shared by the serial and parallel kernels."""
    walk_listed = _walker(DC, PF, kind, True)
    walk_range = _walker(DC, PF, kind, False)

    @jit(fastmath=frozenset())  # strict IEEE: every path and bf16/fp32 round identically
    def apply(j0, j1, unit, indices, offsets, psw, mean, last, dout, lr32, eps, table, state, scratch):
        # update the rows whose first occurrence is in [j0, j1): walk the entries, testing each for
        # a list head, or, when many repeat a row (the test then mispredicts often), list the heads
        # first. The walks are functions of their own: inlined here, or in a prange body, LLVM
        # compiled them several times slower, and compiling took minutes.
        n = indices.shape[0]
        # scaled entries (per-sample weights, mean) always take the listed walk: one loop copy fewer
        # to compile, for ~0.4 ns an entry
        if mean or psw.shape[0] > 0 or ((j1 - j0) - scratch[6 * n + j0:6 * n + j1].sum()) * LIST_REPEATS > j1 - j0:
            walk_listed(_list_heads(j0, j1, scratch, n), 0, unit, indices, offsets, psw, mean, last, dout, lr32,
                        eps, table, state, scratch)
        else:
            walk_range(scratch[j0:j1], j0, unit, indices, offsets, psw, mean, last, dout, lr32, eps, table, state,
                       scratch)
    return apply


@kernel_factory("embedding_bag_update")
def _update_factory(spec):
    DC, PF, kind, path = spec["D"], spec["pf"], spec["kind"], spec["path"]
    GRAD = kind == "grad"
    if path == "sorted":
        return sorted_update(DC, PF, GRAD)

    apply = _applier(DC, PF, kind)

    @jit(inline="always")
    def _row_bytes(dout):  # of the table rows the serial linking pass prefetches; none for a gradient
        return 0 if GRAD else (DC if DC else dout.shape[1]) * 4

    @jit(fastmath=frozenset())
    def hashed(indices, offsets, psw, mean, last, dout, lr, eps, table, state, scratch, nparts):
        # indices: (nnz,), offsets: (B,)|(B+1,), dout: (B, D), table: (R, D) float32, state: (R,)
        # Adagrad, scratch: (>= 7 nnz,) int64
        code, bad, value = _validate_bags(indices, offsets, dout.shape[0], table.shape[0], last)
        if code:
            return code, bad, value
        unit = _link_rows(indices, offsets, dout.shape[0], last, table, _row_bytes(dout), scratch)
        # lr arrives as a Python float: converting here costs less than np.float32() in the wrapper
        apply(0, indices.shape[0], unit, indices, offsets, psw, mean, last, dout, np.float32(lr), eps,
              table, state, scratch)
        return 0, 0, 0

    @jit(parallel=True, fastmath=frozenset())
    def hashed_parallel(indices, offsets, psw, mean, last, dout, lr, eps, table, state, scratch, nparts):
        # the same, the entries cut into nparts position ranges, one per thread: a row is updated
        # by the range holding its first occurrence only, so no two threads touch one. Linking
        # stays serial: split by owner (each thread scanning all entries for its rows, or a
        # counting scatter into owner buckets first) it cost more than it saved.
        code, bad, value = _validate_bags(indices, offsets, dout.shape[0], table.shape[0], last)
        if code:
            return code, bad, value
        n = indices.shape[0]
        # no row prefetch while linking: rows this core fetched would have to move to the core that
        # updates them (measured with SGD and write prefetches, 2 threads, R=1e7, pooling 20, D=16:
        # 0.99 ms with, vs 0.65 on one)
        unit = _link_rows(indices, offsets, dout.shape[0], last, table, 0, scratch)
        lr32 = np.float32(lr)
        for t in prange(nparts):
            apply(t * n // nparts, (t + 1) * n // nparts, unit, indices, offsets, psw, mean, last, dout, lr32, eps,
                  table, state, scratch)
        return 0, 0, 0
    return hashed_parallel if path == "hashed-parallel" else hashed


# ----------------------------------------------------------------------------- scratch and wrappers

_SCRATCH = threading.local()


def _scratch(n, per_entry):
    """Per-thread, grow-only int64 scratch of >= per_entry * n words, whole (views cost ~1 us a call).

    Fresh arrays of this size cost more than the work: glibc maps them anew on every call and
    returns them on free, so each page faults again. Thread-local, so concurrent callers never
    share it; kernels finish with it before the op returns (results handed out are copies)."""
    buf = getattr(_SCRATCH, "buf", None)
    need = per_entry * n
    if buf is None or buf.shape[0] < need:
        buf = _SCRATCH.buf = np.empty(max(need, 2 * (0 if buf is None else buf.shape[0]), 1024), np.int64)
    return buf


def _sparse_update(kind, table, state, indices, offsets, dout, num_rows, lr, eps, mode,
                   per_sample_weights, include_last_offset, table_name):
    """Validate, group and run one sparse kernel; returns (rows, drows) for kind "grad"."""
    if table is not None:
        D = table.shape[1]
    elif isinstance(dout, np.ndarray) and dout.ndim == 2:
        D = dout.shape[1]
    else:
        raise TypeError(f"dout must be a 2-D float32 ndarray, got "
                        f"{getattr(dout, 'dtype', type(dout).__name__)} {getattr(dout, 'shape', '')}")
    indices, offsets, nbags, psw, mean = _check_common(indices, offsets, mode, per_sample_weights,
                                                       include_last_offset)
    dout = _as_float_array("dout", dout, (nbags, D))
    nnz = indices.shape[0]
    if num_rows > _MAX_ROWS or nnz > _MAX_NNZ:  # rows and positions share one int64 word
        raise ValueError(f"embedding updates support up to 2**32 rows and 2**31 indices, got {num_rows} rows, "
                         f"{nnz} indices")
    last = bool(include_last_offset)
    state = _NO_STATE if state is None else state
    if kind != "grad":
        threads = _num_threads()
        sample = _sample_repeats(indices, _scratch(nnz, 7)) if nnz > PARALLEL_MIN_NNZ else 0.0
        path = _update_path(nnz, num_rows, threads, sample)
        if path != "sorted":
            code, pos, val = _update_kernel(D, kind, path)(
                indices, offsets, psw, mean, last, dout, lr, eps, table, state, _scratch(nnz, 7), threads)
            if code:
                _raise_bag_error(code, pos, val, table_name, num_rows, nnz)
            return None
    buf = _scratch(nnz + 1, 7)
    n = nnz + 1
    work, fwork = buf[:6 * n].reshape(6, n), buf[6 * n:7 * n].view(np.float32)[:n]
    err, rows, sbag, sscale, group, parts = plan(indices, offsets, psw, nbags, num_rows, last, mean,
                                                  max(1, min(_CHUNKS, nnz)), work, fwork)
    if err[0]:
        _raise_bag_error(*err, table_name, num_rows, nnz)
    ngroups = group.shape[0] - 1
    drows = np.empty((ngroups, D), np.float32) if kind == "grad" else _NO_ROWS
    if ngroups and D:
        _update_kernel(D, kind, "sorted")(
            rows, sbag, sscale, group, parts, dout, np.float32(lr), np.float64(eps),
            drows if table is None else table, state, drows)
    return (rows[group[:-1]], drows) if kind == "grad" else None


def embedding_bag_backward(indices, offsets, dout, num_rows, *, mode="sum", per_sample_weights=None,
                           include_last_offset=False):
    """Coalesced sparse gradient; dout: (B, D) -> rows (U,) sorted unique int64, drows (U, D) float32."""
    num_rows = operator.index(num_rows)
    if num_rows < 0:
        raise ValueError(f"num_rows must be >= 0, got {num_rows}")
    return _sparse_update("grad", None, None, indices, offsets, dout, num_rows, 0.0, 0.0, mode,
                          per_sample_weights, include_last_offset, "num_rows")


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
    _sparse_update("adagrad", w, state, indices, offsets, dout, w.shape[0], lr, eps, mode,
                   per_sample_weights, include_last_offset, "weight")
    return weight
