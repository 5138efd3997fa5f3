"""Row blocks between an array and a flat buffer (ops/blocks.py) against ops/reference.py."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jitkern import ops
from jitkern.ops import reference as ref
from jitkern.ops.blocks import bucket_by_shard, copy_segments


@st.composite
def layouts(draw):
    """(rows, w, bounds of each block's rows, offsets of non-overlapping blocks in a flat buffer)."""
    rows, w = draw(st.integers(0, 40)), draw(st.integers(1, 9))
    cuts = sorted(draw(st.lists(st.integers(0, rows), max_size=6)))
    bounds = [0] + cuts + [rows]                  # empty blocks included (a peer with no rows)
    starts, stops = np.array(bounds[:-1], np.int64), np.array(bounds[1:], np.int64)
    gaps = draw(st.lists(st.integers(0, 5), min_size=len(starts), max_size=len(starts)))
    order = draw(st.permutations(range(len(starts))))   # blocks in the buffer in any order
    offsets, o = np.zeros(len(starts), np.int64), 0
    for i in order:
        o += gaps[i]
        offsets[i] = o
        o += (stops[i] - starts[i]) * w
    return rows, w, starts, stops, offsets, o + draw(st.integers(0, 3))


@settings(max_examples=60, deadline=None)
@given(layouts(), st.integers(0, 2**31))
def test_scatter_and_gather_blocks_equal_the_reference(layout, seed):
    rows, w, starts, stops, offsets, size = layout
    rng = np.random.default_rng(seed)
    src = rng.standard_normal((rows, w), dtype=np.float32)
    fill = rng.standard_normal(size, dtype=np.float32)     # untouched between blocks
    dst = ops.scatter_blocks(src, fill.copy(), offsets, starts, stops)
    np.testing.assert_array_equal(dst, ref.scatter_blocks(src, fill.copy(), offsets, starts, stops))
    back = ops.gather_blocks(dst, offsets, starts, stops, np.zeros((rows, w), np.float32))
    np.testing.assert_array_equal(back, src)               # the blocks cover every row
    np.testing.assert_array_equal(back, ref.gather_blocks(dst, offsets, starts, stops, np.zeros((rows, w), np.float32)))


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 30), st.integers(1, 8), st.integers(1, 7), st.integers(0, 2**31))
def test_sum_blocks_adds_in_block_order_as_numpy(rows, w, k, seed):
    rng = np.random.default_rng(seed)
    n = rows * w
    src = (rng.standard_normal(k * n + 5, dtype=np.float32) * rng.choice([1e-3, 1.0, 1e4], k * n + 5)).astype(np.float32)
    src[rng.integers(0, src.size, 2)] = np.inf if seed % 3 == 0 else np.float32(-0.0)
    offsets = rng.permutation(k).astype(np.int64) * n + rng.integers(0, 6)
    offsets = np.minimum(offsets, src.size - n)
    got = ops.sum_blocks(src, offsets, np.empty((rows, w), np.float32))
    want = ref.sum_blocks(src, offsets, np.empty((rows, w), np.float32))
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))   # the same bits


def test_blocks_reject_bad_arguments():
    src, flat = np.ones((4, 2), np.float32), np.zeros(8, np.float32)
    one = np.array([0], np.int64)
    with pytest.raises(ValueError, match="block 0 does not fit"):
        ops.scatter_blocks(src, flat, one, np.array([3]), np.array([5]))     # past the rows
    with pytest.raises(ValueError, match="inside dst"):
        ops.scatter_blocks(src, flat, np.array([2]), np.array([0]), np.array([4]))
    with pytest.raises(ValueError, match="one entry per block"):
        ops.gather_blocks(flat, np.array([0, 1]), one, np.array([1]), np.zeros((4, 2), np.float32))
    with pytest.raises(TypeError, match="offsets must have dtype"):
        ops.sum_blocks(flat, np.array([0.0]), np.zeros(2, np.float32))
    with pytest.raises(ValueError, match="at least one block"):
        ops.sum_blocks(flat, np.zeros(0, np.int64), np.zeros(2, np.float32))
    with pytest.raises(ValueError, match="inside src"):
        ops.sum_blocks(flat, np.array([7]), np.zeros(2, np.float32))
    with pytest.raises(ValueError, match="must not overlap"):
        ops.gather_blocks(flat, one, one, np.array([1]), flat[:4].reshape(2, 2))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 30), st.integers(0, 12)), max_size=12), st.booleans(), st.integers(0, 2**31))
def test_copy_segments_equals_the_reference(segments, placed, seed):
    """The row shards' id segments (int64, empty ones included), end to end or at given places."""
    rng = np.random.default_rng(seed)
    src = rng.integers(-2**40, 2**40, 50, dtype=np.int64)
    starts = np.array([min(a, 50 - n) for a, n in segments], np.int64).reshape(-1)
    lens = np.array([n for _, n in segments], np.int64).reshape(-1)
    at, size = None, int(lens.sum())
    if placed:   # in reverse order, a gap of 2 before each
        at, o = np.zeros(len(lens), np.int64), 0
        for i in reversed(range(len(lens))):
            at[i], o = o + 2, o + 2 + lens[i]
        size = o
    got = copy_segments(src, starts, lens, np.full(size, -1, np.int64), at)
    np.testing.assert_array_equal(got, ref.copy_segments(src, starts, lens, np.full(size, -1, np.int64), at))


def test_copy_segments_rejects_what_does_not_fit():
    src = np.arange(10, dtype=np.int64)
    with pytest.raises(ValueError, match="segment 1 does not fit"):
        copy_segments(src, np.array([0, 8]), np.array([2, 3]), np.empty(5, np.int64))
    with pytest.raises(ValueError, match="segment 0 does not fit"):
        copy_segments(src, np.array([0]), np.array([3]), np.empty(2, np.int64))
    with pytest.raises(ValueError, match="one dtype"):
        copy_segments(src, np.array([0]), np.array([2]), np.empty(2, np.int32))


def _bucket(offsets, indices, bounds):
    k, b, n = len(bounds) - 1, len(offsets), len(indices)
    outs = (np.empty((k, b), np.int64), np.empty(n, np.int64), np.empty(k + 1, np.int64), np.empty(n, np.int32))
    return bucket_by_shard(offsets, indices, bounds, *outs)


@settings(max_examples=80, deadline=None)
@given(st.integers(1, 5000), st.integers(1, 70), st.lists(st.integers(0, 6), min_size=1, max_size=40),
       st.booleans(), st.integers(0, 2**31))
def test_bucket_by_shard_equals_the_reference(rows, k, sizes, hot, seed):
    """Every shard count up to 70 (more shards than rows included), empty bags, repeated rows."""
    rng = np.random.default_rng(seed)
    sizes = np.array(sizes, np.int64)
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    n = int(sizes.sum())
    indices = (rng.integers(0, min(rows, 3), n) if hot else rng.integers(0, rows, n)).astype(np.int64)
    indices[:1] = rows - 1 if n and seed % 2 else indices[:1]      # the last row
    bounds = -(-np.arange(k + 1) * rows // k)
    got = _bucket(offsets, indices, bounds)
    k, b = len(bounds) - 1, len(offsets)
    want = ref.bucket_by_shard(offsets, indices, bounds, np.empty((k, b), np.int64), np.empty(n, np.int64),
                               np.empty(k + 1, np.int64), np.empty(n, np.int32))
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


def test_bucket_by_shard_rejects_bad_arguments():
    off, idx, bounds = np.array([0, 2], np.int64), np.array([1, 5, 9], np.int64), np.array([0, 5, 10], np.int64)
    with pytest.raises(ValueError, match=r"indices\[2\] = 10 is out of range for a table of 10 rows"):
        _bucket(off, np.array([1, 5, 10], np.int64), bounds)
    with pytest.raises(ValueError, match=r"indices\[0\] = -1"):
        _bucket(off, np.array([-1, 5, 9], np.int64), bounds)
    with pytest.raises(ValueError, match=r"offsets must start at 0.*offsets\[0\] = 1"):
        _bucket(np.array([1, 2], np.int64), idx, bounds)
    with pytest.raises(ValueError, match=r"offsets\[1\] = 4"):
        _bucket(np.array([0, 4], np.int64), idx, bounds)
    with pytest.raises(ValueError, match="even row bounds"):      # row 50: shard 0, two below its estimate
        _bucket(np.array([0], np.int64), np.array([50], np.int64), np.array([0, 97, 98, 99, 100], np.int64))
    with pytest.raises(ValueError, match="no bags"):
        _bucket(np.zeros(0, np.int64), idx, bounds)
    with pytest.raises(ValueError, match="rows must be a C-contiguous int64 array of shape"):
        bucket_by_shard(off, idx, bounds, np.empty((2, 2), np.int64), np.empty(2, np.int64), np.empty(3, np.int64),
                        np.empty(3, np.int32))
