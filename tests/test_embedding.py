"""Embedding bags against ops.reference: forward, sparse backward, fused SGD/Adagrad, BF16 Split-SGD.

Hypothesis draws D only from widths outside SPECIALISED_D (they all share the generic runtime-D
kernel); each specialised width is compiled and checked once in test_specialised_widths.
"""
import re

import numba
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from jitkern.codegen.prefetch import prefetch, prefetch_l2, prefetch_write
from jitkern.ops import SplitBF16Table, embedding_bag_adagrad_, embedding_bag_backward, embedding_bag_forward
from jitkern.ops import embedding_bag_sgd_, reference
from jitkern.codegen import get_kernel
from jitkern.ops.embedding import SPECIALISED_D, adagrad, empty_table, forward, grouping, sgd
from jitkern.ops.embedding._validate import check_bag_args

EPS32 = 2.0 ** -23
GENERIC_D = [d for d in range(1, 301) if d not in SPECIALISED_D]


def _bags(rng, num_rows, sizes, hot, index_dtype, last):
    """indices (nnz,) with a few hot rows when `hot`, offsets (B,) or (B+1,)."""
    nnz = int(sum(sizes))
    idx = rng.integers(0, num_rows, nnz)
    if hot and nnz:
        hot_rows = rng.integers(0, num_rows, 3)
        mask = rng.random(nnz) < 0.7
        idx[mask] = hot_rows[rng.integers(0, 3, mask.sum())]
    starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    return idx.astype(index_dtype), (starts if last else starts[:-1])


def _tol(abs_sum, length):
    """Float32 summation bound: (n + 2) ulp-units of the sum of absolute terms."""
    return (length + 2) * EPS32 * abs_sum + 1e-30


PATHS = ("fast", "general", "hashed-parallel")


def _force_path(mp, path):
    """Whatever the sizes and thread count would choose -- fast: the serial forward, the serially
    hashed Adagrad and the serial SGD; general: the parallel forward, the radix-sorted Adagrad and
    SGD in 2 ownership parts; hashed-parallel: the parallel forward, hashed Adagrad applied in 3
    position ranges and SGD in 3 ownership parts."""
    kernels = forward._kernels  # (serial_max_work, serial, parallel): always or never serial
    mp.setattr(forward, "_kernels", lambda *a: (-1 if path != "fast" else 1 << 62,) + kernels(*a)[1:])
    parts = {"fast": 1, "general": 2, "hashed-parallel": 3}[path]
    mp.setattr(sgd, "_parts", lambda nnz, dim, table_bytes, threads, parallel: parts)
    update = {"fast": "hashed", "general": "sorted", "hashed-parallel": "hashed-parallel"}[path]
    mp.setattr(adagrad, "_update_path", lambda nnz, num_rows, threads, repeats, min_nnz: update)
    if path == "hashed-parallel":
        mp.setattr(adagrad, "num_threads", lambda: 3)


@pytest.fixture(params=PATHS)
def path(request, monkeypatch):
    _force_path(monkeypatch, request.param)
    return request.param


@st.composite
def problems(draw):
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    num_rows = draw(st.sampled_from([1, 2, 7, 31, 97, 300]))
    dim = draw(st.sampled_from(GENERIC_D))
    nbags = draw(st.integers(1, 12))
    sizes = [draw(st.sampled_from([0, 1, 2, 5, 13, 50])) for _ in range(nbags)]
    last = draw(st.booleans())
    idx, off = _bags(rng, num_rows, sizes, draw(st.booleans()), draw(st.sampled_from([np.int32, np.int64])), last)
    psw = rng.standard_normal(len(idx)).astype(np.float32) if draw(st.booleans()) else None
    mode = draw(st.sampled_from(["sum", "mean"]))
    w = rng.standard_normal((num_rows, dim)).astype(np.float32)
    dout = rng.standard_normal((nbags, dim)).astype(np.float32)
    kw = dict(mode=mode, per_sample_weights=psw, include_last_offset=last)
    return w, idx, off, dout, kw, max(sizes + [1])


@given(problems())
def test_forward_matches_reference(p):
    w, idx, off, _, kw, longest = p
    got = embedding_bag_forward(w, idx, off, **kw)
    want = reference.embedding_bag_forward(w, idx, off, **kw)
    kw_abs = dict(kw, per_sample_weights=None if kw["per_sample_weights"] is None else np.abs(kw["per_sample_weights"]))
    bound = _tol(reference.embedding_bag_forward(np.abs(w), idx, off, **kw_abs), longest)
    assert got.shape == want.shape and got.dtype == np.float32
    assert np.all(np.abs(got - want) <= bound)


@given(problems())
def test_backward_and_updates_match_reference(p):
    w, idx, off, dout, kw, _ = p
    rows, drows = embedding_bag_backward(idx, off, dout, w.shape[0], **kw)
    want_rows, want_drows = reference.embedding_bag_backward(idx, off, dout, w.shape[0], **kw)
    np.testing.assert_array_equal(rows, want_rows)
    assert rows.dtype == np.int64 and drows.shape == want_drows.shape and drows.dtype == np.float32
    kw_abs = dict(kw, per_sample_weights=None if kw["per_sample_weights"] is None else np.abs(kw["per_sample_weights"]))
    _, abs_drows = reference.embedding_bag_backward(idx, off, np.abs(dout), w.shape[0], **kw_abs)
    longest = int(np.bincount(idx.astype(np.int64)).max()) if len(idx) else 1
    gbound = _tol(abs_drows, longest)
    assert np.all(np.abs(drows - want_drows) <= gbound)

    lr = 0.3
    got_w, want_w = w.copy(), w.copy()
    assert embedding_bag_sgd_(got_w, idx, off, dout, lr, **kw) is got_w
    reference.embedding_bag_sgd_(want_w, idx, off, dout, lr, **kw)
    np.testing.assert_array_equal(got_w.view(np.uint32), want_w.view(np.uint32))  # np.add.at's, bit for bit
    # and "coalesce, then update" to float rounding: a row with k occurrences is rounded k times (k
    # steps of <= 1/2 ulp of |w| + lr |g|), the gradient's scaling and lr's product a few times more
    np.testing.assert_array_equal(np.delete(got_w, rows, axis=0), np.delete(w, rows, axis=0))
    lr32 = float(np.float32(lr))
    coalesced = w[rows].astype(np.float64) - lr32 * want_drows.astype(np.float64)
    k = np.bincount(idx.astype(np.int64))[rows][:, None]
    assert np.all(np.abs(got_w[rows] - coalesced) <= (k + 4) * EPS32 * (np.abs(w[rows]) + lr32 * abs_drows) + 1e-30)

    state = np.abs(np.random.default_rng(1).standard_normal(w.shape[0])).astype(np.float32)
    got_w, want_w, got_s, want_s = w.copy(), w.copy(), state.copy(), state.copy()
    embedding_bag_adagrad_(got_w, got_s, idx, off, dout, lr, 1e-3, **kw)
    reference.embedding_bag_adagrad_(want_w, want_s, idx, off, dout, lr, 1e-3, **kw)
    np.testing.assert_allclose(got_s, want_s, rtol=4 * longest * EPS32 * 4, atol=1e-30)
    untouched = np.setdiff1d(np.arange(w.shape[0]), rows)
    np.testing.assert_array_equal(got_w[untouched], w[untouched])
    np.testing.assert_allclose(got_w, want_w, rtol=1e-4, atol=1e-5 * lr * (1 + abs_drows.max(initial=0)) * longest)


@given(problems())
def test_all_paths_agree_bit_for_bit(p):
    """Serial and parallel forward; hashed updates applied in 1 or 3 position ranges and sorted ones:
    the same sums in the same order."""
    w, idx, off, dout, kw, _ = p
    results = []
    for path in PATHS:
        with pytest.MonkeyPatch.context() as mp:
            _force_path(mp, path)
            state = np.ones(w.shape[0], np.float32)
            split, pairs = (SplitBF16Table.from_float32(w, layout) for layout in ("split", "pairs"))
            results.append([embedding_bag_forward(w, idx, off, **kw),
                            embedding_bag_sgd_(w.copy(), idx, off, dout, 0.3, **kw),
                            embedding_bag_adagrad_(w.copy(), state, idx, off, dout, 0.3, **kw), state,
                            embedding_bag_forward(split, idx, off, **kw),
                            embedding_bag_sgd_(split, idx, off, dout, 0.3, **kw).to_float32()])
            # one path per example (each is drawn, at a third of the cost) and int64 indices (the layout
            # and the index type are independent types of the kernels: each combination is a compile)
            if path == PATHS[len(idx) % len(PATHS)] and idx.dtype == np.int64:
                # both layouts of a bf16 table: the same halves, so the same sums and updates
                np.testing.assert_array_equal(embedding_bag_forward(pairs, idx, off, **kw), results[-1][-2])
                embedding_bag_sgd_(pairs, idx, off, dout, 0.3, **kw)
                np.testing.assert_array_equal(pairs.hi, split.hi)
                np.testing.assert_array_equal(pairs.lo, split.lo)
    for other in results[1:]:
        for got, want in zip(other, results[0]):
            np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("dim", SPECIALISED_D)
def test_specialised_widths(dim):
    """The compile-time-D kernels (vector row ops, stack accumulator) agree with the reference."""
    rng = np.random.default_rng(dim)
    w = rng.standard_normal((500, dim)).astype(np.float32)
    idx, off = _bags(rng, 500, [0, 1, 3, 20, 50, 7, 0, 2], True, np.int64, False)
    dout = rng.standard_normal((len(off), dim)).astype(np.float32)
    np.testing.assert_allclose(embedding_bag_forward(w, idx, off),
                               reference.embedding_bag_forward(w, idx, off), rtol=1e-5, atol=1e-4)
    got, want = w.copy(), w.copy()
    embedding_bag_sgd_(got, idx, off, dout, 0.1)
    reference.embedding_bag_sgd_(want, idx, off, dout, 0.1)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    got_s, want_s = np.ones(500, np.float32), np.ones(500, np.float32)
    got, want = w.copy(), w.copy()
    embedding_bag_adagrad_(got, got_s, idx, off, dout, 0.1)
    reference.embedding_bag_adagrad_(want, want_s, idx, off, dout, 0.1)
    longest = int(np.bincount(idx).max())
    np.testing.assert_allclose(got_s, want_s, rtol=4 * longest * EPS32 * 4)  # as in the property test
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
    if dim == SPECIALISED_D[0]:
        rows, drows = embedding_bag_backward(idx, off, dout, 500)
        want_rows, want_drows = reference.embedding_bag_backward(idx, off, dout, 500)
        np.testing.assert_array_equal(rows, want_rows)
        np.testing.assert_allclose(drows, want_drows, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dim", [*SPECIALISED_D, 37])
def test_sums_of_signed_zeros_keep_the_reference_bits(dim):
    """Sums start from +0.0, as the reference's (and torch's): a bag of -0.0 rows sums to +0.0 (one
    row, or several); sum, mean and weighted, the pooling loop and the one-row copy; and the
    backward's coalesced gradient rows alike."""
    w = np.zeros((4, dim), np.float32)
    w[0], w[1], w[2, ::2], w[3] = -0.0, -0.0, -0.0, 1.0
    weights = np.array([1, 2, 3, 4, 5, 6, 0.5], np.float32)
    for table in (w, SplitBF16Table.from_float32(w)):  # the rows are bf16 values: the same reference
        for idx, off in ((np.array([0, 1, 0, 0, 2, 3, 1]), np.array([0, 1, 3, 5])),  # bags of 1, 2, 2, 2 rows
                         (np.array([0, 2, 1, 2]), np.arange(4))):                    # every bag one row: copied
            for kw in (dict(mode="sum"), dict(mode="mean"), dict(mode="sum", per_sample_weights=weights[:len(idx)])):
                got = embedding_bag_forward(table, idx.astype(np.int64), off.astype(np.int64), **kw)
                want = reference.embedding_bag_forward(w, idx, off, **kw)
                np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32),
                                              err_msg=f"{type(table).__name__} {idx} {kw}")
    # the backward's coalesced rows start from +0.0 too: a row whose occurrences' rows are -0.0
    idx, off = np.array([0, 1, 0, 2], np.int64), np.array([0, 1, 3], np.int64)
    dout = np.zeros((3, dim), np.float32)
    dout[0], dout[1, ::2] = -0.0, -0.0
    rows, drows = embedding_bag_backward(idx, off, dout, 4)
    want_rows, want_drows = reference.embedding_bag_backward(idx, off, dout, 4)
    np.testing.assert_array_equal(rows, want_rows)
    np.testing.assert_array_equal(drows.view(np.uint32), want_drows.view(np.uint32))


@pytest.mark.parametrize("sizes", [[1] * 9, [0, 2, 1, 1], [1, 1, 0, 2, 1], [2, 0, 1], [1, 1, 1, 0]])
def test_one_row_bags_are_copied_only_where_every_bag_has_one_row(sizes, path):
    """Batches of one-row bags take a plain copy; bag sizes that merely add up to the bag count
    (an empty bag beside a two-row one) must not, nor weighted bags."""
    dim = SPECIALISED_D[-1]
    rng = np.random.default_rng(len(sizes))
    w = rng.standard_normal((50, dim)).astype(np.float32)
    # a bf16 table's rows are widened on the way: its reference is the fp32 table of its high halves
    tables = [(w, w), (SplitBF16Table.from_float32(w), reference.bf16_to_float32(reference.bf16_split(w)[0]))]
    for last in (False, True):
        idx, off = _bags(rng, 50, sizes, False, np.int64, last)
        psw = rng.standard_normal(len(idx)).astype(np.float32)
        for kw in (dict(mode="sum"), dict(mode="mean"), dict(mode="sum", per_sample_weights=psw)):
            for table, ref_w in tables:
                want = reference.embedding_bag_forward(ref_w, idx, off, include_last_offset=last, **kw)
                got = embedding_bag_forward(table, idx, off, include_last_offset=last, **kw)
                np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6, err_msg=f"{sizes} {kw} last={last}")


@pytest.mark.parametrize("dim, layout", [(d, "split") for d in (*SPECIALISED_D, 37)]
                         + [(d, "pairs") for d in (SPECIALISED_D[0], SPECIALISED_D[-1], 37)])
def test_bf16_split_sgd_equals_fp32_sgd_bit_for_bit(dim, layout):
    rng = np.random.default_rng(dim)
    w = rng.standard_normal((300, dim)).astype(np.float32)
    table = SplitBF16Table.from_float32(w, layout)
    assert table.shape == (300, dim) and table.num_rows == 300 and table.dim == dim and table.layout == layout
    assert table.to_float32().view(np.uint32).tolist() == w.view(np.uint32).tolist()
    for step in range(4):
        idx, off = _bags(rng, 300, [3, 0, 20, 9, 1], step % 2 == 0, np.int64, False)
        dout = rng.standard_normal((len(off), dim)).astype(np.float32)
        assert embedding_bag_sgd_(table, idx, off, dout, 0.05) is table
        embedding_bag_sgd_(w, idx, off, dout, 0.05)
    np.testing.assert_array_equal(table.to_float32().view(np.uint32), w.view(np.uint32))
    hi, lo = reference.bf16_split(w)
    np.testing.assert_array_equal(table.hi, hi)
    np.testing.assert_array_equal(table.lo, lo)
    # the forward reads the bf16 halves only: equals the reference on the bf16-rounded table
    got = embedding_bag_forward(table, idx, off, mode="mean")
    want = reference.embedding_bag_forward(reference.bf16_to_float32(table.hi), idx, off, mode="mean")
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(numba.config.NUMBA_NUM_THREADS < 2, reason="needs 2 numba threads")
def test_parallel_update_is_deterministic_and_thread_count_independent(path):
    rng = np.random.default_rng(7)
    w0 = rng.standard_normal((5000, 37)).astype(np.float32)
    idx, off = _bags(rng, 5000, [20] * 450, True, np.int64, False)
    dout = rng.standard_normal((450, 37)).astype(np.float32)
    results = []
    before = numba.get_num_threads()
    try:
        for threads in (2, 2, 1):
            numba.set_num_threads(threads)
            w, s = w0.copy(), np.zeros(5000, np.float32)
            embedding_bag_sgd_(w, idx, off, dout, 0.1)
            embedding_bag_adagrad_(w, s, idx, off, dout, 0.1)
            results.append((w.view(np.uint32).copy(), s.view(np.uint32).copy()))
    finally:
        numba.set_num_threads(before)
    for w, s in results[1:]:
        np.testing.assert_array_equal(w, results[0][0])
        np.testing.assert_array_equal(s, results[0][1])


def test_sgd_threads_only_for_tables_beyond_the_caches():
    """A second thread pays where rows come from DRAM; small tables and batches stay serial."""
    parallel = sgd.PARALLEL.heuristic((1 << 22, 64, 20, 2048, 4, 4))
    assert sgd._parts(40960, 64, 1 << 30, 4, parallel) == 4
    assert sgd._parts(40960, 64, 1 << 20, 4, parallel) == 1
    assert sgd._parts(100, 64, 1 << 30, 4, parallel) == 1
    assert sgd._parts(40960, 64, 1 << 30, 1, parallel) == 1


def test_empty_bags_and_batches(path):
    w = np.arange(12, dtype=np.float32).reshape(4, 3)
    off = np.array([0, 0, 2, 2], np.int64)
    idx = np.array([1, 1], np.int64)
    out = embedding_bag_forward(w, idx, off, mode="mean")
    np.testing.assert_array_equal(out, [[0, 0, 0], [3, 4, 5], [0, 0, 0], [0, 0, 0]])
    empty = np.empty(0, np.int64)
    assert embedding_bag_forward(w, empty, empty).shape == (0, 3)
    rows, drows = embedding_bag_backward(empty, np.zeros(3, np.int64), np.ones((3, 3), np.float32), 4)
    assert rows.shape == (0,) and drows.shape == (0, 3)
    w2 = w.copy()
    embedding_bag_sgd_(w2, empty, np.zeros(3, np.int64), np.ones((3, 3), np.float32), 1.0)
    np.testing.assert_array_equal(w2, w)
    out = np.full((4, 3), np.nan, np.float32)
    assert embedding_bag_forward(w, idx, off, out=out) is out and np.isfinite(out).all()
    strided = np.full((4, 2, 3), np.nan, np.float32)[:, 1]  # e.g. one table's slice of a (B, T, D) buffer
    assert embedding_bag_forward(w, idx, off, out=strided) is strided
    np.testing.assert_array_equal(strided, out)


def test_backward_rows_up_to_two_to_the_32():
    # the plan packs (row << 32 | position) in one int64: rows with bit 31 set make it negative
    top = 2**32 - 1
    idx = np.array([top, 5, 2**31, top, 2**31 + 7, 5], np.int64)
    off = np.array([0, 2, 3], np.int64)
    dout = np.arange(9, dtype=np.float32).reshape(3, 3)
    rows, drows = embedding_bag_backward(idx, off, dout, 2**32)
    want_rows, want_drows = reference.embedding_bag_backward(idx, off, dout, 2**32)
    np.testing.assert_array_equal(rows, want_rows)
    np.testing.assert_array_equal(drows, want_drows)
    with pytest.raises(ValueError, match="2\\*\\*32 rows"):
        embedding_bag_backward(idx, off, dout, 2**32 + 1)


@pytest.mark.parametrize("rows", [3, 300_000])  # below and above the huge-page threshold (16 MiB)
def test_empty_table_is_a_plain_writeable_table(rows):
    w = empty_table(rows, 16)
    assert w.shape == (rows, 16) and w.dtype == np.float32
    assert w.flags.c_contiguous and w.flags.writeable and w.flags.aligned
    assert w.ctypes.data % 64 == 0  # rows of whole cache lines
    assert empty_table(0, 5).shape == (0, 5)
    w[:] = np.arange(16, dtype=np.float32)
    idx, off = np.array([rows - 1, 0, 1], np.int64), np.array([0, 1], np.int64)
    np.testing.assert_array_equal(embedding_bag_forward(w, idx, off), [np.arange(16), 2 * np.arange(16)])
    embedding_bag_sgd_(w, idx, off, np.ones((2, 16), np.float32), 0.5)
    assert (w[rows - 1] == np.arange(16) - 0.5).all() and (w[2:rows - 1] == np.arange(16)).all()


def _args():
    rng = np.random.default_rng(3)
    w = rng.standard_normal((10, 5)).astype(np.float32)
    idx = np.array([1, 2, 9, 0, 4], np.int64)
    off = np.array([0, 2], np.int64)
    return w, idx, off, rng.standard_normal((2, 5)).astype(np.float32)


@pytest.mark.parametrize("bad", [10, -1, 2**40])
def test_out_of_range_index_names_argument_position_value_and_changes_nothing(bad, path):
    w, idx, off, dout = _args()
    idx[3] = bad
    w0 = w.copy()
    state = np.zeros(10, np.float32)
    table = SplitBF16Table.from_float32(w)
    for call in (lambda: embedding_bag_forward(w, idx, off),
                 lambda: embedding_bag_forward(table, idx, off),
                 lambda: embedding_bag_sgd_(w, idx, off, dout, 0.1),
                 lambda: embedding_bag_sgd_(table, idx, off, dout, 0.1),
                 lambda: embedding_bag_adagrad_(w, state, idx, off, dout, 0.1)):
        with pytest.raises(IndexError, match=rf"indices\[3\] = {bad} .*weight.* 10 rows"):
            call()
    with pytest.raises(IndexError, match=r"indices\[3\]"):
        embedding_bag_backward(idx, off, dout, 10)
    np.testing.assert_array_equal(w, w0)
    np.testing.assert_array_equal(table.to_float32(), w0)
    assert not state.any()


@pytest.mark.parametrize("dim", [SPECIALISED_D[0], SPECIALISED_D[-1]])
@pytest.mark.parametrize("cols", [1, 2, 4])
def test_forward_checks_each_index_where_it_reads_the_row(dim, cols, monkeypatch):
    """The serial forward checks an index as it pools its bag: the first bad one in position order
    is named, wherever it lies (first, middle, last; one-row bags copied, pooled in column blocks,
    weighted), and only out's earlier bags are written. (The parallel one checks all first: the
    out-of-range test above covers it.)"""
    _force_path(monkeypatch, "fast")
    path = "fast"
    rng = np.random.default_rng(dim + cols)
    w = rng.standard_normal((20, dim)).astype(np.float32)
    cases = [(np.arange(6), np.arange(6)), (np.arange(8), np.array([0, 2, 4, 6]))]  # one-row bags; bags of two
    for idx0, off in cases:
        for at, bad in ((0, 20), (3, -1), (len(idx0) - 1, 2**40), (2, 25)):
            idx = (idx0 * 3 % 20).astype(np.int64)
            idx[at] = bad
            if at == 2:
                idx[4] = -5  # a second bad index, later: the first is reported
            kern = get_kernel(forward._spec(dim, False, path == "fast", forward.PREFETCH.heuristic(
                (20, dim, 1, len(off), 4, 1)), {"scheme": "shift"}, cols))
            for psw in (None, rng.standard_normal(len(idx)).astype(np.float32)):
                bags = check_bag_args(idx, off.astype(np.int64), "sum", psw, False)[0]
                out = np.full((len(off), dim), 7.0, np.float32)
                assert kern(w, bags, 4, out) == (6, at, bad)
                assert np.all(out[at // (len(idx) // len(off)) + 1:] == 7.0)  # no later bag written
            with pytest.raises(IndexError, match=rf"indices\[{at}\] = {bad} "):
                embedding_bag_forward(w, idx, off.astype(np.int64))


@pytest.mark.parametrize("offsets, last, match", [
    ([1, 2], False, r"offsets\[0\] must be 0"),
    ([0, 3, 2], False, r"non-decreasing: offsets\[2\]"),
    ([0, 6], False, r"offsets\[1\] = 6 is beyond"),
    ([0, 2, 4], True, "last offset must equal"),
    ([], True, "B \\+ 1"),
])
def test_bad_offsets(offsets, last, match, path):
    w, idx, _, _ = _args()
    w0 = w.copy()
    off = np.array(offsets, np.int64)
    dout = np.ones((max(len(off) - last, 0), 5), np.float32)
    with pytest.raises(ValueError, match=match):
        embedding_bag_forward(w, idx, off, include_last_offset=last)
    with pytest.raises(ValueError, match=match):
        embedding_bag_sgd_(w, idx, off, dout, 0.1, include_last_offset=last)
    np.testing.assert_array_equal(w, w0)


def test_argument_checks():
    w, idx, off, dout = _args()
    w0 = w.copy()
    state = np.zeros(10, np.float32)
    with pytest.raises(TypeError, match="weight"):
        embedding_bag_forward(w.astype(np.float64), idx, off)
    with pytest.raises(ValueError, match="weight"):
        embedding_bag_forward(w[:, ::2], idx, off)
    with pytest.raises(TypeError, match="indices"):
        embedding_bag_forward(w, idx.astype(np.float32), off)
    with pytest.raises(TypeError, match="indices"):
        embedding_bag_forward(w, list(idx), off)
    with pytest.raises(ValueError, match="mode"):
        embedding_bag_forward(w, idx, off, mode="max")
    with pytest.raises(ValueError, match="per_sample_weights"):
        embedding_bag_forward(w, idx, off, per_sample_weights=np.ones(4, np.float32))
    with pytest.raises(ValueError, match="out"):
        embedding_bag_forward(w, idx, off, out=np.empty((3, 5), np.float32))
    with pytest.raises(TypeError, match="out"):
        embedding_bag_forward(w, idx, off, out=np.empty((2, 5)))
    with pytest.raises(ValueError, match="offsets defines no bags"):
        embedding_bag_forward(w, idx, np.empty(0, np.int64))
    with pytest.raises(ValueError, match="lr must be finite"):
        embedding_bag_sgd_(w, idx, off, dout, float("nan"))
    with pytest.raises(ValueError, match="lr must be finite"):
        embedding_bag_adagrad_(w, state, idx, off, dout, float("inf"))
    with pytest.raises(TypeError, match="dout"):
        embedding_bag_sgd_(w, idx, off, dout.astype(np.float64), 0.1)
    with pytest.raises(ValueError, match="dout"):
        embedding_bag_sgd_(w, idx, off, dout[:, :4], 0.1)
    with pytest.raises(ValueError, match="state"):
        embedding_bag_adagrad_(w, state[:9], idx, off, dout, 0.1)
    with pytest.raises(TypeError, match="SplitBF16Table"):
        embedding_bag_adagrad_(SplitBF16Table.from_float32(w), state, idx, off, dout, 0.1)
    with pytest.raises(ValueError, match="num_rows"):
        embedding_bag_backward(idx, off, dout, -1)
    frozen = w.copy()
    frozen.flags.writeable = False
    with pytest.raises(ValueError, match="writeable"):
        embedding_bag_sgd_(frozen, idx, off, dout, 0.1)
    np.testing.assert_array_equal(w, w0)
    assert not state.any()


def test_int32_offsets_and_strided_indices_are_accepted():
    w, idx, off, _ = _args()
    strided = np.repeat(idx, 2)[::2]
    np.testing.assert_array_equal(embedding_bag_forward(w, strided, off.astype(np.int32)),
                                  embedding_bag_forward(w, idx, off))


@numba.njit
def _prefetched_sum(w, v, idx):
    s = 0.0
    for j in range(idx.shape[0]):
        prefetch(w, idx[(j + 4) % idx.shape[0]], 0)
        prefetch_write(v, idx[j] * 1000, 64)  # hints may point anywhere: never dereferenced
        prefetch_l2(w, idx[j] - 7, 4)
        s += w[idx[j], 0]
    return s


def test_prefetch_intrinsic_emits_llvm_prefetch_and_changes_nothing():
    w = np.arange(20, dtype=np.float32).reshape(10, 2)
    v = np.zeros(3, np.float32)
    idx = np.array([3, 1, 4, 1, 5, 9, 2, 6], np.int64)
    assert _prefetched_sum(w, v, idx) == w[idx, 0].sum()
    llvm_ir = _prefetched_sum.inspect_llvm(_prefetched_sum.signatures[0])
    assert "@llvm.prefetch" in llvm_ir
    # read into L1, write, read into L2: (rw, locality) = (0, 3), (1, 3), (0, 2)
    calls = re.findall(r"call void @llvm\.prefetch[.\w]*\([^,]+, i32 (\d), i32 (\d), i32 1\)", llvm_ir)
    assert sorted(set(calls)) == [("0", "2"), ("0", "3"), ("1", "3")]


def test_skewed_batches_take_the_sorted_update():
    rng = np.random.default_rng(5)
    nnz, rows = 20_000, 1_000_000
    uniform = rng.integers(0, rows, nnz)
    skewed = np.where(rng.random(nnz) < 0.5, rng.integers(0, 50, nnz), uniform)  # half the entries on 50 rows
    scratch = np.empty(4096, np.int64)
    share_u = grouping.sample_repeats(uniform, scratch)
    share_s = grouping.sample_repeats(skewed.astype(np.int32), scratch)
    assert share_u < 0.01 and share_s > 0.4
    min_nnz = adagrad.PARALLEL_MIN_NNZ
    assert adagrad._update_path(nnz, rows, 1, share_u, min_nnz) == "hashed"
    assert adagrad._update_path(nnz, rows, 1, share_s, min_nnz) == "sorted"
    assert adagrad._update_path(100, rows, 1, 1.0, min_nnz) == "hashed"  # small batches: never worth sorting
    assert adagrad._update_path(nnz, rows, 2, share_u, min_nnz) == "hashed-parallel"
