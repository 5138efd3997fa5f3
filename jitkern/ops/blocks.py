"""Row blocks between a (rows, w) array and a flat buffer: the copies and sums of a message buffer.

An alltoallv buffer holds one block per peer; splitting an array's rows into P blocks, or adding P
received partial sums, costs P NumPy calls (about 0.7 us each) per table and step: at 64 ranks
more than the data moved. Each op here is one call, whatever P:

    scatter_blocks(src, dst, offsets, starts, stops)  dst[o_i : o_i + n_i] = src[start_i:stop_i]
    gather_blocks(src, offsets, starts, stops, out)   out[start_i:stop_i] = src[o_i : o_i + n_i]
    sum_blocks(src, offsets, out)                     out = src[o_0 : ...] + src[o_1 : ...] + ...

with n_i = (stop_i - start_i) * w elements, blocks row-major; sum_blocks adds in block order, in
float32, as repeated np.add does.

The row shards' lookups (dlrm/sharding.py, dlrm/layout.py) use two more, on int64 rows:

    copy_segments(src, starts, lens, out, at)         out[at_i : at_i + l_i] = src[s_i : s_i + l_i]
    bucket_by_shard(offsets, indices, bounds, ...)    one table's lookups grouped by row shard
"""
from __future__ import annotations

import numpy as np

from ..codegen import jit, uidx as _u
from . import _check


@jit()
def _bad_block(nrows, w, size, offsets, starts, stops):
    """The first block that does not fit (rows past nrows, elements past size), -2 for arrays of
    different lengths, or -1."""
    if starts.shape[0] != offsets.shape[0] or stops.shape[0] != offsets.shape[0]:
        return -2
    for i in range(offsets.shape[0]):
        a, b, o = starts[i], stops[i], offsets[i]
        if a < 0 or b < a or b > nrows or o < 0 or o + (b - a) * w > size:
            return i
    return -1


@jit()
def _move(rows, flat, offsets, starts, stops, shape, scatter):
    """Checks every block, then copies rows -> flat (scatter) or flat -> rows: -> _bad_block's code.
    rows: the (nrows, w) = shape array flattened."""
    nrows, w = shape
    bad = _bad_block(nrows, w, flat.shape[0], offsets, starts, stops)
    if bad != -1:
        return bad
    for i in range(offsets.shape[0]):
        a, o = starts[i] * w, offsets[i]
        for e in range((stops[i] - starts[i]) * w):
            if scatter:
                flat[_u(o + e)] = rows[_u(a + e)]
            else:
                rows[_u(a + e)] = flat[_u(o + e)]
    return -1


@jit(fastmath=frozenset())  # strict IEEE: the sums round as np.add's do
def _sum(src, offsets, out):
    """out = the blocks' sum, in block order; -> the first block past src's end (nothing written), or -1."""
    n = out.size
    for i in range(offsets.shape[0]):
        if offsets[i] < 0 or offsets[i] + n > src.shape[0]:
            return i
    flat = out.reshape(n)
    o0 = offsets[0]
    for e in range(n):
        flat[_u(e)] = src[_u(o0 + e)]
    for i in range(1, offsets.shape[0]):
        o = offsets[i]
        for e in range(n):
            flat[_u(e)] += src[_u(o + e)]
    return -1


def _ints(name, a):
    a = _check.index_array(name, a)
    return a if a.dtype == np.int64 else a.astype(np.int64)


def scatter_blocks(src, dst, offsets, starts, stops):
    """dst[offsets[i] : offsets[i] + (stops[i] - starts[i]) * w] = src[starts[i]:stops[i]] (row-major)
    for each block i; src: (rows, w) float32, dst: flat float32 (written in place). Returns dst."""
    return _blocks(("src", src), ("dst", dst), (offsets, starts, stops), scatter=True)[1]


def gather_blocks(src, offsets, starts, stops, out):
    """out[starts[i]:stops[i]] = src[offsets[i] : offsets[i] + (stops[i] - starts[i]) * w] for each
    block i; src: flat float32, out: (rows, w) float32 (written in place). Returns out."""
    return _blocks(("out", out), ("src", src), (offsets, starts, stops), scatter=False)[0]


def _blocks(rows_arg, flat_arg, blocks, scatter):
    """Check the (name, array) of the 2-D side and the flat side (the written one in place) and the
    blocks, then move them; -> (rows, flat). Raises naming the block that does not fit."""
    (rname, rows), (fname, flat) = rows_arg, flat_arg
    rows = _check.float_array(rname, rows, ndim=2, copy=scatter, writeable=not scatter)
    flat = _check.float_array(fname, flat, ndim=1, copy=not scatter, writeable=scatter)
    if scatter:
        _check.no_overlap(fname, flat, rows, what=rname)
    else:
        _check.no_overlap(rname, rows, flat, what=fname)
    offsets, starts, stops = (_ints(n, a) for n, a in zip(("offsets", "starts", "stops"), blocks))
    bad = _move(rows.reshape(-1), flat, offsets, starts, stops, rows.shape, scatter)
    if bad == -2:
        raise ValueError(f"offsets, starts and stops must have one entry per block, got shapes "
                         f"{offsets.shape}, {starts.shape}, {stops.shape}")
    if bad >= 0:
        a, b, o = int(starts[bad]), int(stops[bad]), int(offsets[bad])
        raise ValueError(f"block {bad} does not fit: starts and stops must satisfy 0 <= start <= stop <= "
                         f"{rows.shape[0]} (the array's rows), and offsets must place it inside {fname} "
                         f"({flat.size} elements); got start {a}, stop {b}, offset {o}")
    return rows, flat


def sum_blocks(src, offsets, out):
    """out = the sum of the blocks src[offsets[i] : offsets[i] + out.size] (out's shape, row-major),
    added in block order in float32; src: flat float32, out float32 (written). Returns out."""
    src = _check.float_array("src", src, ndim=1)
    out = _check.float_array("out", out, copy=False, writeable=True)
    _check.no_overlap("out", out, src, what="src")
    offsets = _ints("offsets", offsets)
    if offsets.size == 0:
        raise ValueError("offsets must name at least one block")
    bad = _sum(src, offsets, out)
    if bad >= 0:
        raise ValueError(f"offsets must place every block inside src ({src.size} elements); "
                         f"block {bad} at {int(offsets[bad])} does not fit")
    return out


def copy_segments(src, starts, lens, out, at=None):
    """out[at[i] : at[i] + lens[i]] = src[starts[i] : starts[i] + lens[i]] for each segment i, for
    1-D arrays of one dtype (the row shards' lookups: int64 rows); at: where they go (default: end
    to end from 0). One call for any number of segments; checked as the block ops are. Returns out."""
    starts, lens = _ints("starts", starts), _ints("lens", lens)
    if src.ndim != 1 or out.ndim != 1 or src.dtype != out.dtype:
        raise ValueError(f"src and out must be 1-D arrays of one dtype, got {src.dtype}{src.shape} and "
                         f"{out.dtype}{out.shape}")
    if at is None:
        at = np.zeros(len(lens), np.int64)
        np.cumsum(lens[:-1], out=at[1:])
    else:
        at = _ints("at", at)
    bad = _move(out, src, starts, at, at + lens, (len(out), 1), False) if len(lens) else -1
    if bad != -1:
        raise ValueError(f"segment {bad} does not fit: starts, lens and at must place every segment "
                         f"inside src ({src.size} elements) and out ({out.size})")
    return out


@jit(inline="always")
def _shard_of(row, bounds, k, scale):
    """The shard of `row` under even bounds: row * k // R by a float64 product, corrected by one
    bound either way (a 64-bit division costs several times the rest of a lookup's bucketing)."""
    j = min(int(row * scale), k - 1)
    if row >= bounds[j + 1]:
        j += 1
    elif row < bounds[j]:
        j -= 1
    return j


@jit()
def _bucket(offsets, indices, bounds, lengths, rows, ends, shard):
    """bucket_by_shard's two passes; -> (0, -1), or (1, e): indices[e] is not a row of the table,
    (2, bag): offsets[bag] is out of order or past the lookups, (3, e): bounds are not the even
    ones (indices[e] is not in the shard they give); nothing placed in rows then."""
    b, n, k = offsets.shape[0], indices.shape[0], bounds.shape[0] - 1
    R = bounds[k]
    scale = k / R if R > 0 else 0.0
    for bag in range(b):
        if offsets[bag] < (0 if bag == 0 else offsets[bag - 1]) or offsets[bag] > n or (bag == 0 and offsets[0]):
            return 2, bag
    lengths[:, :] = 0
    for bag in range(b):
        stop = offsets[bag + 1] if bag + 1 < b else n
        for e in range(offsets[bag], stop):
            row = indices[e]
            if row < 0 or row >= R:
                return 1, e
            j = _shard_of(row, bounds, k, scale)
            if row < bounds[j] or row >= bounds[j + 1]:
                return 3, e
            shard[e] = j
            lengths[j, bag] += 1
    ends[0] = 0
    for j in range(k):
        total = 0
        for bag in range(b):
            total += lengths[j, bag]
        ends[j + 1] = ends[j] + total
    at = ends[:k].copy()
    for e in range(n):
        j = shard[e]
        rows[at[j]] = indices[e] - bounds[j]
        at[j] += 1
    return 0, -1


def bucket_by_shard(offsets, indices, bounds, lengths, rows, ends, shard):
    """A counting sort of one table's lookups by row shard (row-wise sharding's bucketing): shard
    j holds rows bounds[j]:bounds[j + 1], the planner's even bounds ceil(j R / k) (so j = row * k // R).
    offsets (b,) int64 from 0 and indices (n,) int64 rows of the table -> written: lengths (k, b):
    each bag's lookups in each shard; rows (n,): rows minus their shard's first row, grouped by
    shard, each shard's in position order; ends (k + 1,): where each shard's group ends. shard:
    (n,) int32 scratch. Two passes over the lookups. Returns (lengths, rows, ends)."""
    offsets, indices, bounds = (_ints(name, a) for name, a in (("offsets", offsets), ("indices", indices),
                                                                 ("bounds", bounds)))
    k, b, n = len(bounds) - 1, len(offsets), len(indices)
    if b == 0 and n:
        raise ValueError(f"{n} indices but no bags: offsets is empty")
    if k < 1 or bounds[0] != 0:
        raise ValueError(f"bounds must start at 0 and name at least one shard, got {bounds.tolist()[:8]}")
    for name, a, shape, dtype in (("lengths", lengths, (k, b), np.int64), ("rows", rows, (n,), np.int64),
                                  ("ends", ends, (k + 1,), np.int64), ("shard", shard, (n,), np.int32)):
        if not isinstance(a, np.ndarray) or a.shape != shape or a.dtype != dtype or not a.flags.c_contiguous:
            raise ValueError(f"{name} must be a C-contiguous {np.dtype(dtype).name} array of shape {shape}, got "
                             f"{getattr(a, 'dtype', type(a))}{getattr(a, 'shape', '')}")
    code, at = _bucket(offsets, indices, bounds, lengths, rows, ends, shard)
    if code == 1:
        raise ValueError(f"indices[{at}] = {int(indices[at])} is out of range for a table of {int(bounds[-1])} rows")
    if code == 2:
        raise ValueError(f"offsets must start at 0 and rise to at most len(indices) = {n}; offsets[{at}] = "
                         f"{int(offsets[at])} does not")
    if code == 3:
        raise ValueError(f"bounds must be the even row bounds ceil(j * rows / k) of the planner; row "
                         f"{int(indices[at])} does not fall in the shard they give")
    return lengths, rows, ends
