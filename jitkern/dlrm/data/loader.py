"""Mini-batches in the DLRM's input format from any CriteoDataset, with no per-sample Python.

Rows are read a block at a time (one contiguous slice per array); with shuffle=True the
block order is permuted and the rows inside each block too (a block-local shuffle, as
large-scale loaders do: random enough for SGD, sequential on disk). Batches run across
block boundaries, so every batch but the last has exactly batch_size rows.
"""
from __future__ import annotations

import numpy as np

from ..batch import Batch

DEFAULT_BLOCK = 1 << 16


def _pos_int(name, v):
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
        raise ValueError(f"{name} must be a positive int, got {v!r}")
    return int(v)


def table_sizes(ds, max_ind_range=None) -> list:
    """Embedding rows per table for `ds` when batches are made with `max_ind_range`."""
    cards = [int(c) for c in ds.cardinalities]
    return cards if max_ind_range is None else [min(c, int(max_ind_range)) for c in cards]


def make_batch(dense, sparse, labels, max_ind_range=None) -> Batch:
    """Batch from row-aligned (B, 13) dense, (B, T) sparse ids, (B,) labels (copies; the inputs may be memmaps)."""
    b, t = sparse.shape
    idx = np.empty((t, b), np.int64)
    idx[...] = sparse.T
    if max_ind_range is not None:
        np.remainder(idx, max_ind_range, out=idx)
    offsets = np.empty((t, b), np.int64)
    offsets[...] = np.arange(b, dtype=np.int64)
    return Batch(dense=np.array(dense, dtype=np.float32, order="C"), offsets=offsets,
                 indices=list(idx), labels=np.array(labels, dtype=np.float32).reshape(b))


def _blocks(ds, n, block_size, rng):
    """(dense, sparse, labels) ndarrays of each block, in (shuffled) order."""
    starts = np.arange(0, n, block_size)
    if rng is not None:
        starts = starts[rng.permutation(len(starts))]
    for a in starts:
        b = min(int(a) + block_size, n)
        arrs = (np.asarray(ds.dense[a:b]), np.asarray(ds.sparse[a:b]), np.asarray(ds.labels[a:b]))
        if rng is not None:
            perm = rng.permutation(b - int(a))
            arrs = tuple(x[perm] for x in arrs)
        yield arrs


def iterate_batches(ds, batch_size, *, shuffle: bool = False, seed: int = 0, block_size: int = DEFAULT_BLOCK,
                    max_ind_range=None, drop_last: bool = False):
    """Iterator of Batch (dense (B, 13) f32, offsets (26, B) i64 = arange(B), indices 26 x (B,) i64,
    labels (B,) f32) over `ds`; ids taken modulo max_ind_range when given."""
    batch_size = _pos_int("batch_size", batch_size)
    block_size = _pos_int("block_size", block_size)
    if max_ind_range is not None:
        max_ind_range = _pos_int("max_ind_range", max_ind_range)
    n = len(ds)
    for name in ("dense", "sparse"):
        if len(getattr(ds, name)) != n:
            raise ValueError(f"ds.{name} has {len(getattr(ds, name))} rows, ds.labels {n}")
    rng = np.random.default_rng(seed) if shuffle else None
    left = None                           # rows carried from the previous block
    for arrs in _blocks(ds, n, block_size, rng):
        i = 0
        if left is not None:
            need = batch_size - len(left[0])
            left = tuple(np.concatenate([x, y[:need]]) for x, y in zip(left, arrs))
            i = min(need, len(arrs[0]))
            if len(left[0]) < batch_size:
                continue
            yield make_batch(*left, max_ind_range)
            left = None
        m = len(arrs[0])
        while m - i >= batch_size:
            yield make_batch(*(x[i:i + batch_size] for x in arrs), max_ind_range)
            i += batch_size
        if i < m:
            left = tuple(x[i:] for x in arrs)
    if left is not None and not drop_last:
        yield make_batch(*left, max_ind_range)
