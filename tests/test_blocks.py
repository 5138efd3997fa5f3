"""Row blocks between an array and a flat buffer (ops/blocks.py) against ops/reference.py."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jitkern import ops
from jitkern.ops import reference as ref


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
def test_copy_segments_equals_slices_laid_end_to_end(segments, placed, seed):
    """The row shards' id segments (int64, empty ones included), end to end or at given places."""
    from jitkern.ops.blocks import copy_segments
    rng = np.random.default_rng(seed)
    src = rng.integers(-2**40, 2**40, 50, dtype=np.int64)
    starts = np.array([min(a, 50 - n) for a, n in segments], np.int64).reshape(-1)
    lens = np.array([n for _, n in segments], np.int64).reshape(-1)
    parts = [src[a:a + n] for a, n in zip(starts, lens)]
    if placed:   # in reverse order, a gap of 2 before each
        at, o = np.zeros(len(lens), np.int64), 0
        for i in reversed(range(len(lens))):
            at[i], o = o + 2, o + 2 + lens[i]
        out = np.full(o, -1, np.int64)
        want = out.copy()
        for a, p in zip(at, parts):
            want[a:a + len(p)] = p
        got = copy_segments(src, starts, lens, out, at)
    else:
        want = np.concatenate(parts) if parts else np.zeros(0, np.int64)
        got = copy_segments(src, starts, lens, np.empty(len(want), np.int64))
    np.testing.assert_array_equal(got, want)


def test_copy_segments_rejects_what_does_not_fit():
    from jitkern.ops.blocks import copy_segments
    src = np.arange(10, dtype=np.int64)
    with pytest.raises(ValueError, match="segment 1 does not fit"):
        copy_segments(src, np.array([0, 8]), np.array([2, 3]), np.empty(5, np.int64))
    with pytest.raises(ValueError, match="segment 0 does not fit"):
        copy_segments(src, np.array([0]), np.array([3]), np.empty(2, np.int64))
    with pytest.raises(ValueError, match="one dtype"):
        copy_segments(src, np.array([0]), np.array([2]), np.empty(2, np.int32))
