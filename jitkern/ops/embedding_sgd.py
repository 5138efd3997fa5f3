"""Fused embedding-bag SGD and BF16 Split-SGD: each occurrence applied in place, in position order.

    weight[indices[j]] -= lr * (scale_j * dout[bag of j])      for j = 0, 1, ..., nnz - 1

in float32, which is exactly NumPy's np.add.at(weight, indices, -lr * g) (reference.py's
embedding_bag_sgd_). SGD is linear, so this equals "coalesce, then update" up to one rounding
of the row per repeated occurrence; row-wise Adagrad is not linear in the gradient and keeps
the coalescing paths of ops/embedding_update.py. No grouping pass: the rows are read and
written as the forward reads them, prefetched a few entries ahead, so on batches that miss in
the caches the update costs about what the forward does. (Coalescing first cost a hashing pass
and a walk over per-entry lists: 2.24 vs 1.50 ms at R=1e7, D=64, pooling 20, fresh batches.)

Parallel by row ownership: rows are dealt to parts in blocks of 16 by a hash of the block, so
the hot rows at the start of a frequency-ordered vocabulary still spread over the threads. Each
part lists its own entries in position order, then applies them. A row is written by one part
only, in position order: no atomics, and the result is bit-identical to the serial one for any
thread count.
"""
from __future__ import annotations

import functools

import numpy as np
from numba import prange

from ..codegen import KernelSpec, get_kernel, jit, kernel_factory
from ..codegen.rowvec import stack_f32
from .embedding import (
    _apply_row,
    _as_float_array,
    _bag_end,
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
from .embedding_update import _GOLDEN, _LO32, _MAX_NNZ, _NO_STATE, _scratch  # (_MAX_NNZ: position and bag share a word)

SGD_PREFETCH = 32           # entries ahead whose rows are prefetched (16-64: within 10%)
PARALLEL_MIN_WORK = 1 << 16  # nnz * D below which the update runs on the calling thread
PARALLEL_MIN_TABLE = 16 << 20  # table bytes below which it does too: rows then come from the caches
OWNER_BLOCK = 4             # log2 of the rows per ownership block: 16, whole lines of an aligned table
_NO_LO = np.empty((0, 0), np.uint16)
_NO_SCRATCH = np.empty(0, np.int64)


def _parts(nnz: int, dim: int, table_bytes: int) -> int:
    """How many ownership parts an update of nnz rows of width dim is cut into (1: serial).

    Threads pay off where rows come from DRAM: each core then keeps its own misses in flight.
    Measured, 2 threads against 1, pooling 20, fresh batches: R=1e7 x 64 fp32 (2.4 GiB) 1.5x,
    R=1e5 x 64 (24 MiB) 1.4x, R=1e5 x 16 (6 MiB) 0.7x, R=1e3 x 16 0.5x (each part's pass over
    all entries costs about as much as a cache-resident update); R=1e7, pooling 1: 1.4x at D=64,
    1.0x at D=16."""
    if nnz * max(dim, 1) < PARALLEL_MIN_WORK or table_bytes < PARALLEL_MIN_TABLE:
        return 1
    return _num_threads()


@functools.lru_cache(maxsize=None)
def _sgd_kernel(dim, bf16, parallel):
    """get_kernel, memoised (its per-call config read costs ~20 us; the DLRM calls once per table)."""
    return get_kernel(KernelSpec.make("embedding_bag_sgd", D=_d_class(dim), pf=SGD_PREFETCH, bf16=bf16,
                                      parallel=parallel))


@jit(inline="always")
def _owner(r, nparts):
    """The part that owns row r: a multiplicative hash of its 16-row block, reduced to [0, nparts)."""
    h = (np.uint64(r >> OWNER_BLOCK) * _GOLDEN) >> np.uint64(32)
    return np.int64((h * np.uint64(nparts)) >> np.uint64(32))


@functools.lru_cache(maxsize=None)
def _loops(DC, PF, BF16, scaled):
    """(serial, owned) update loops for compile-time width DC (0: runtime D): the whole batch, or the
    entries of one ownership part. `scaled`: per-sample weights or mean (else nothing per entry
    is multiplied: g is dout's row itself)."""
    ITEM = 2 if BF16 else 4
    SGD = not BF16  # a closure constant, so the other kind's branch of _apply_row is pruned before typing

    @jit(inline="always")
    def prefetch_rows(table, lo, r, D, tail, lo_tail):
        _prefetch_row(table, r, D * ITEM, tail)
        if BF16:
            _prefetch_row(lo, r, D * ITEM, lo_tail)

    @jit(inline="always")
    def apply_entry(table, lo, state, r, j, b, indices, offsets, psw, mean, last, dout, lr, acc, D):
        if scaled:  # g = scale * dout[b], rounded once, as the reference computes it
            sc = _entry_scale(j, b, psw, mean, offsets, dout.shape[0], indices.shape[0], last)
            _madd_row(acc, 0, dout, b, sc, D, DC, True)
            _apply_row(table, lo, state, r, acc, 0, lr, 0.0, D, DC, SGD, BF16)
        else:
            _apply_row(table, lo, state, r, dout, b, lr, 0.0, D, DC, SGD, BF16)

    @jit(fastmath=frozenset())  # strict IEEE: bit-identical to the reference's np.add.at
    def serial(indices, offsets, psw, mean, last, dout, lr, table, lo, state):
        nbags, n = dout.shape[0], indices.shape[0]
        D = DC if DC else dout.shape[1]
        acc = stack_f32(DC) if DC else np.empty((1, D), np.float32)
        tail, lo_tail = _straddles(table, D * ITEM), _straddles(lo, D * ITEM)
        far = np.uint64(max(n - 1, 0))
        for b in range(nbags):
            for j in range(offsets[b], _bag_end(offsets, b, nbags, n, last)):
                u = np.uint64(j)  # validated, non-negative: unsigned indexing skips wraparound code
                prefetch_rows(table, lo, indices[min(u + np.uint64(PF), far)], D, tail, lo_tail)
                apply_entry(table, lo, state, indices[u], j, b, indices, offsets, psw, mean, last, dout, lr, acc, D)

    @jit(fastmath=frozenset())
    def owned(t, nparts, indices, offsets, psw, mean, last, dout, lr, table, lo, state, scratch):
        # part t: list its entries, (bag << 32) | position, in position order (branch-free), then
        # apply them, prefetching rows PF listed entries ahead. Every part reads all entries: one
        # parallel region. Bucketing slices of them in a first region instead read each entry once,
        # but with numba's workers asleep between regions (config.sleep_idle_workers) the second
        # start cost more (2 threads, R=1e7, D=16, pooling 20: 317 vs 277 us).
        nbags, n = dout.shape[0], indices.shape[0]
        D = DC if DC else dout.shape[1]
        mine = scratch[t * n:(t + 1) * n]
        m = 0
        b = 0
        end = _bag_end(offsets, 0, nbags, n, last) if nbags else n
        for j in range(n):
            while j >= end:  # the bag holding entry j (empty bags are stepped over)
                b += 1
                end = _bag_end(offsets, b, nbags, n, last)
            mine[m] = (np.int64(b) << 32) | j
            m += _owner(indices[j], nparts) == t
        acc = stack_f32(DC) if DC else np.empty((1, D), np.float32)
        tail, lo_tail = _straddles(table, D * ITEM), _straddles(lo, D * ITEM)
        for i in range(m):
            if i + PF < m:
                prefetch_rows(table, lo, indices[mine[i + PF] & _LO32], D, tail, lo_tail)
            j = mine[i] & _LO32
            apply_entry(table, lo, state, indices[j], j, mine[i] >> 32, indices, offsets, psw, mean, last, dout,
                        lr, acc, D)
    return serial, owned


@kernel_factory("embedding_bag_sgd")
def _sgd_factory(spec):
    DC, PF, BF16 = spec["D"], spec["pf"], spec["bf16"]
    serial_plain, owned_plain = _loops(DC, PF, BF16, False)
    serial_scaled, owned_scaled = _loops(DC, PF, BF16, True)

    @jit(fastmath=frozenset())
    def serial(indices, offsets, psw, mean, last, dout, lr, table, lo, state, scratch, nparts):
        # indices: (nnz,), offsets: (B,)|(B+1,), dout: (B, D) float32, table: (R, D) float32, or the
        # bf16 hi bits with lo (R, D) their low halves; scratch: (nparts * nnz,) int64 (parallel only)
        code, bad, value = _validate_bags(indices, offsets, dout.shape[0], table.shape[0], last)
        if code:
            return code, bad, value
        lr32 = np.float32(lr)  # lr arrives as a Python float: converting here is cheaper than in the wrapper
        if mean or psw.shape[0] > 0:
            serial_scaled(indices, offsets, psw, mean, last, dout, lr32, table, lo, state)
        else:
            serial_plain(indices, offsets, psw, mean, last, dout, lr32, table, lo, state)
        return 0, 0, 0

    @jit(parallel=True, fastmath=frozenset())
    def parallel(indices, offsets, psw, mean, last, dout, lr, table, lo, state, scratch, nparts):
        code, bad, value = _validate_bags(indices, offsets, dout.shape[0], table.shape[0], last)
        if code:
            return code, bad, value
        lr32 = np.float32(lr)
        scaled = mean or psw.shape[0] > 0
        for t in prange(nparts):
            if scaled:
                owned_scaled(t, nparts, indices, offsets, psw, mean, last, dout, lr32, table, lo, state, scratch)
            else:
                owned_plain(t, nparts, indices, offsets, psw, mean, last, dout, lr32, table, lo, state, scratch)
        return 0, 0, 0
    return parallel if spec["parallel"] else serial


def embedding_bag_sgd_(weight, indices, offsets, dout, lr, *, mode="sum", per_sample_weights=None,
                       include_last_offset=False):
    """In place, fused: weight[indices[j]] -= lr * g_j for every entry j in order (np.add.at's
    result; "coalesce, then update" to float rounding). weight: (R, D) float32 or SplitBF16Table,
    indices: (nnz,) int32|int64, offsets: (B,)|(B+1,) int64, dout: (B, D) float32. Returns weight."""
    w, bf16 = _check_table(weight, writeable=True)
    lr = _finite("lr", lr)
    indices, offsets, nbags, psw, mean = _check_common(indices, offsets, mode, per_sample_weights,
                                                       include_last_offset)
    dout = _as_float_array("dout", dout, (nbags, w.shape[1]))
    nnz = indices.shape[0]
    if nnz > _MAX_NNZ:
        raise ValueError(f"embedding_bag_sgd_ supports up to 2**31 - 1 indices, got {nnz}")
    nparts = _parts(nnz, w.shape[1], w.size * 4)  # bytes a row update touches: fp32, or both bf16 halves
    scratch = _scratch(nnz, nparts) if nparts > 1 else _NO_SCRATCH
    code, pos, val = _sgd_kernel(w.shape[1], bf16, nparts > 1)(
        indices, offsets, psw, mean, bool(include_last_offset), dout, lr, w, weight.lo if bf16 else _NO_LO,
        _NO_STATE, scratch, nparts)
    if code:
        _raise_bag_error(code, pos, val, "weight", w.shape[0], nnz)
    return weight
