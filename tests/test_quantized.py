"""Row-wise quantized tables and the fused dequantizing bag forward, against ops.reference and torch.

Hypothesis draws D only from widths outside SPECIALISED_D (one generic kernel per bit width and
path); the compile-time-D kernels are checked in test_specialised_widths (16, 64, 128: each width
is a compile of its own, and they share their vector code) and against torch at D = 64.
"""
import numba
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from jitkern.codegen import knobs, tunedb
from jitkern.ops import QuantizedTable, embedding_bag_quantized_forward, quantize_rowwise, reference
from jitkern.ops.embedding import quantized as Q
from jitkern.ops.embedding._rows import SPECIALISED_D, prefetch_distance

EPS32 = 2.0 ** -23
GENERIC_D = [d for d in range(1, 150) if d not in SPECIALISED_D]
PATHS = ("serial", "parallel")


def _force_path(mp, path):
    mp.setattr(Q, "_serial", lambda work: path == "serial")


@pytest.fixture(params=PATHS)
def path(request, monkeypatch):
    _force_path(monkeypatch, request.param)
    return request.param


def _weights(rng, rows, dim, bits):
    """Rows of mixed magnitude and spread: normal, constant, tiny-range and all-zero rows."""
    w = rng.standard_normal((rows, dim)) * 10.0 ** rng.integers(-3, 3 if bits == 4 else 6, (rows, 1))
    kind = rng.integers(0, 6, rows)
    w[kind == 0] = w[kind == 0, :1]                                                       # constant
    w[kind == 1] = w[kind == 1, :1] + 1e-6 * rng.standard_normal((int((kind == 1).sum()), dim))  # tiny range
    w[kind == 2] = 0.0
    return w.astype(np.float32)


def _bags(rng, num_rows, sizes, last):
    starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    idx = rng.integers(0, num_rows, int(starts[-1]))
    if len(idx):  # duplicates: a hot row in most bags
        idx[rng.random(len(idx)) < 0.3] = rng.integers(0, num_rows)
    return idx, (starts if last else starts[:-1])


def _abs_table(table):
    """The table with |scale| and |bias| (their sign bits cleared): dequantizes to |s| q + |b|."""
    data = table.data.copy()
    nq = Q.q_bytes(table.dim, table.bits)
    signs = (nq + 3, nq + 7) if table.bits == 8 else (nq + 1, nq + 3)  # little-endian: sign in the last byte
    data[:, list(signs)] &= 0x7F
    return QuantizedTable(data, table.bits, table.dim)


def _bound(table, idx, off, kw, longest):
    """(n + 2) ulp-units of the sum of absolute terms: per row scale * w and bias * w are rounded once
    each, acc + bias and the fma once each, mean's 1 / n and product once more (2n + 4 <= 2 (n + 2))."""
    kw_abs = dict(kw, per_sample_weights=None if kw["per_sample_weights"] is None else np.abs(kw["per_sample_weights"]))
    abs_sum = reference.embedding_bag_quantized_forward(_abs_table(table), idx, off, **kw_abs).astype(np.float64)
    return (longest + 2) * EPS32 * abs_sum + 1e-30


# ----------------------------------------------------------------------------- quantization


@given(st.integers(0, 2**32 - 1), st.sampled_from([0, 1, 2, 5, 40]), st.sampled_from(GENERIC_D[:12] + [63, 101]),
       st.sampled_from(Q.BITS))
def test_quantize_matches_reference_and_bounds_the_error(seed, rows, dim, bits):
    rng = np.random.default_rng(seed)
    w = _weights(rng, rows, dim, bits)
    table = quantize_rowwise(w, bits)
    want = reference.quantize_rowwise(w, bits)
    assert isinstance(table, QuantizedTable) and table.shape == (rows, dim) and table.bits == bits
    assert table.data.shape == (rows, Q.row_bytes(dim, bits)) and table.data.dtype == np.uint8
    np.testing.assert_array_equal(table.data, want.data)
    np.testing.assert_array_equal(QuantizedTable.from_float32(w, bits).data, table.data)
    # to_float32: fma(scale, q, bias), one rounding of the exact value
    q, scale, bias = _decode(table)
    exact = q * scale + bias
    got = table.to_float32()
    assert got.dtype == np.float32 and got.shape == (rows, dim)
    np.testing.assert_array_equal(exact, reference.dequantize_rowwise(table))
    assert np.all(np.abs(got - exact) <= EPS32 / 2 * (np.abs(scale) * q + np.abs(bias)))
    # quantization error: half a step, plus for 4-bit the float16 rounding of bias and scale (half an ulp:
    # <= 2**-11 |x| + 2**-25, the last for subnormal halves; counted twice here), for 8-bit FBGEMM's 1e-8
    # added to the range in the inverse scale (shrinks x - min by at most 1e-8)
    if bits == 4:
        slack = 2.0 ** -10 * (np.abs(bias) + 16 * scale) + 17 * 2.0 ** -24
    else:
        slack = 1e-8 + 4 * EPS32 * (np.abs(w) + np.abs(bias))
    assert np.all(np.abs(w - exact) <= 0.5 * scale * (1 + 1e-5) + slack + 1e-30)


def _decode(table):
    """(q (R, D), scale (R, 1), bias (R, 1)) as float64, straight from the bytes."""
    nq = Q.q_bytes(table.dim, table.bits)
    data = table.data
    if table.bits == 8:
        q = data[:, :nq]
        sb = data[:, nq:].copy().view(np.float32)
    else:
        q = np.stack([data[:, :nq] & 15, data[:, :nq] >> 4], axis=2).reshape(len(data), 2 * nq)[:, :table.dim]
        sb = data[:, nq:].copy().view(np.float16)
    return q.astype(np.float64), sb[:, :1].astype(np.float64), sb[:, 1:].astype(np.float64)


def test_quantize_bad_input_names_the_problem():
    w = np.ones((3, 4), np.float32)
    for bad, err, match in [(w.astype(np.float64), TypeError, "weight.*float32"), (w[0], ValueError, "weight.*2-D"),
                            (np.ones((3, 0), np.float32), ValueError, "at least one column")]:
        with pytest.raises(err, match=match):
            quantize_rowwise(bad, 8)
    with pytest.raises(ValueError, match="bits must be one of"):
        quantize_rowwise(w, 2)
    for v in (np.nan, np.inf):
        bad = w.copy()
        bad[2, 1] = v
        with pytest.raises(ValueError, match="weight row 2 holds a NaN or infinity"):
            quantize_rowwise(bad, 8)
    with pytest.raises(ValueError, match="float16.*65504"):
        quantize_rowwise(w * 1e5, 4)
    assert quantize_rowwise(w * 1e5, 8).shape == (3, 4)
    for data, bits, dim, err, match in [(np.zeros((2, 12), np.float32), 8, None, TypeError, "data.*uint8"),
                                        (np.zeros((2, 12), np.uint8), 8, 5, ValueError, "12 bytes.*dim 5"),
                                        (np.zeros((2, 4), np.uint8), 4, None, ValueError, "4 bytes"),
                                        (np.zeros((2, 12), np.uint8), 3, None, ValueError, "bits")]:
        with pytest.raises(err, match=match):
            QuantizedTable(data, bits, dim)
    assert QuantizedTable(np.zeros((2, 8), np.uint8), 4, 7).shape == (2, 7)  # odd D: 4 bytes of nibbles
    assert QuantizedTable(np.zeros((2, 8), np.uint8), 4).shape == (2, 8)


# ----------------------------------------------------------------------------- forward


@st.composite
def problems(draw):
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    bits = draw(st.sampled_from(Q.BITS))
    num_rows = draw(st.sampled_from([1, 2, 7, 97]))
    dim = draw(st.sampled_from(GENERIC_D))
    sizes = [draw(st.sampled_from([0, 1, 2, 5, 30])) for _ in range(draw(st.integers(1, 10)))]
    last = draw(st.booleans())
    idx, off = _bags(rng, num_rows, sizes, last)
    psw = rng.standard_normal(len(idx)).astype(np.float32) if draw(st.booleans()) else None
    kw = dict(mode=draw(st.sampled_from(["sum", "mean"])), per_sample_weights=psw, include_last_offset=last)
    return quantize_rowwise(_weights(rng, num_rows, dim, bits), bits), idx, off, kw, max(sizes)


@given(problems())
def test_forward_matches_reference_on_both_paths_bit_identically(p):
    table, idx, off, kw, longest = p
    want = reference.embedding_bag_quantized_forward(table, idx, off, **kw)
    results = []
    for path in PATHS:
        with pytest.MonkeyPatch.context() as mp:
            _force_path(mp, path)
            results.append(embedding_bag_quantized_forward(table, idx, off, **kw))
    got = results[0]
    assert got.shape == want.shape == (len(off) - kw["include_last_offset"], table.dim) and got.dtype == np.float32
    assert np.all(np.abs(got - want) <= _bound(table, idx, off, kw, longest))
    np.testing.assert_array_equal(results[1].view(np.uint32), got.view(np.uint32))


@pytest.mark.parametrize("dim", [16, 64, 128])
@pytest.mark.parametrize("bits", Q.BITS)
def test_specialised_widths(dim, bits, monkeypatch):
    """The compile-time-D kernels (one vector op per row; 4-bit in split element order) agree with the
    reference, and bit for bit with the generic kernel (the same operations per element)."""
    rng = np.random.default_rng(dim + bits)
    table = quantize_rowwise(_weights(rng, 300, dim, bits), bits)
    idx, off = _bags(rng, 300, [0, 1, 3, 20, 50, 7, 0, 2], False)
    psw = rng.standard_normal(len(idx)).astype(np.float32)
    monkeypatch.setattr(Q, "_serial", lambda work: True)
    for kw in (dict(mode="sum", per_sample_weights=None, include_last_offset=False),
               dict(mode="mean", per_sample_weights=psw, include_last_offset=False)):
        got = embedding_bag_quantized_forward(table, idx, off, **kw)
        want = reference.embedding_bag_quantized_forward(table, idx, off, **kw)
        assert np.all(np.abs(got - want) <= _bound(table, idx, off, kw, 50))
        with monkeypatch.context() as mp:
            mp.setattr(Q, "_d_class", lambda d: 0)
            generic = embedding_bag_quantized_forward(table, idx, off, **kw)
        np.testing.assert_array_equal(got.view(np.uint32), generic.view(np.uint32))
    # a one-row bag is the row as to_float32 gives it
    rows = np.arange(300)
    np.testing.assert_array_equal(embedding_bag_quantized_forward(table, rows, rows).view(np.uint32),
                                  table.to_float32().view(np.uint32))


def test_empty_bags_batches_and_batch_one(path):
    table = quantize_rowwise(np.arange(12, dtype=np.float32).reshape(4, 3), 8)
    rows = table.to_float32()
    idx = np.array([1, 1], np.int64)
    out = embedding_bag_quantized_forward(table, idx, np.array([0, 0, 2, 2], np.int64), mode="mean")
    np.testing.assert_array_equal(out, [[0, 0, 0], rows[1], [0, 0, 0], [0, 0, 0]])
    empty = np.empty(0, np.int64)
    assert embedding_bag_quantized_forward(table, empty, empty).shape == (0, 3)
    f = embedding_bag_quantized_forward
    assert f(table, empty, np.zeros(1, np.int64), include_last_offset=True).shape == (0, 3)
    np.testing.assert_array_equal(f(table, empty, np.zeros(3, np.int64)), np.zeros((3, 3)))
    dtype = np.int32 if path == "serial" else np.int64  # int32 indices: one more compile, on one path
    one = embedding_bag_quantized_forward(table, np.array([3, 0, 3], dtype), np.zeros(1, dtype))
    np.testing.assert_allclose(one, [2 * rows[3] + rows[0]], rtol=1e-6)
    out = np.full((1, 3), np.nan, np.float32)
    assert embedding_bag_quantized_forward(table, np.array([3, 0, 3]), np.zeros(1, np.int64), out=out) is out
    np.testing.assert_array_equal(out, one)


@pytest.mark.skipif(numba.config.NUMBA_NUM_THREADS < 2, reason="needs 2 numba threads")
def test_parallel_forward_is_thread_count_independent(monkeypatch):
    _force_path(monkeypatch, "parallel")
    rng = np.random.default_rng(5)
    table = quantize_rowwise(_weights(rng, 1000, 37, 4), 4)
    idx, off = _bags(rng, 1000, rng.integers(0, 40, 300), False)
    before = numba.get_num_threads()
    try:
        results = []
        for threads in (1, 2, 1):
            numba.set_num_threads(threads)
            results.append(embedding_bag_quantized_forward(table, idx, off).view(np.uint32))
    finally:
        numba.set_num_threads(before)
    for r in results[1:]:
        np.testing.assert_array_equal(r, results[0])


def _args(bits=8):
    rng = np.random.default_rng(3)
    table = quantize_rowwise(rng.standard_normal((10, 5)).astype(np.float32), bits)
    return table, np.array([1, 2, 9, 0, 4], np.int64), np.array([0, 2], np.int64)


@pytest.mark.parametrize("bad", [10, -1, 2**40])
@pytest.mark.parametrize("bits", Q.BITS)
def test_out_of_range_index_names_table_position_value_and_writes_nothing(bad, bits, path):
    table, idx, off = _args(bits)
    idx[3] = bad
    out = np.full((2, 5), 7.0, np.float32)
    data = table.data.copy()
    with pytest.raises(IndexError, match=rf"indices\[3\] = {bad} is out of range for table with 10 rows"):
        embedding_bag_quantized_forward(table, idx, off, out=out)
    assert (out == 7).all()
    np.testing.assert_array_equal(table.data, data)


@pytest.mark.parametrize("offsets, last, match", [
    ([1, 2], False, r"offsets\[0\] must be 0"),
    ([0, 3, 2], False, r"non-decreasing: offsets\[2\]"),
    ([0, 6], False, r"offsets\[1\] = 6 is beyond"),
    ([0, 2, 4], True, "last offset must equal"),
    ([], True, "B \\+ 1"),
    ([], False, "no bags but indices has 5"),
])
def test_bad_offsets(offsets, last, match, path):
    table, idx, _ = _args()
    off = np.array(offsets, np.int64)
    out = np.full((max(len(off) - last, 0), 5), 7.0, np.float32)
    with pytest.raises(ValueError, match=match):
        embedding_bag_quantized_forward(table, idx, off, include_last_offset=last, out=out)
    assert (out == 7).all()


def test_argument_checks():
    table, idx, off = _args()
    f = embedding_bag_quantized_forward
    out = np.full((2, 5), 7.0, np.float32)
    alias = table.data.reshape(-1)[:40].view(np.float32).reshape(2, 5)  # out over the table's own bytes
    cases = [
        (lambda: f(table.to_float32(), idx, off), TypeError, "table must be a QuantizedTable"),
        (lambda: f(table, idx.astype(np.float32), off), TypeError, "indices.*int32 or int64"),
        (lambda: f(table, idx[None], off), ValueError, "indices must be 1-D"),
        (lambda: f(table, list(idx), off), TypeError, "indices must be a numpy array"),
        (lambda: f(table, idx, off.astype(np.uint64)), TypeError, "offsets"),
        (lambda: f(table, idx, off, mode="max"), ValueError, "mode must be one of"),
        (lambda: f(table, idx, off, per_sample_weights=np.ones(4, np.float32)), ValueError, "per_sample_weights.*(5,)"),
        (lambda: f(table, idx, off, per_sample_weights=np.ones(5)), TypeError, "per_sample_weights.*float32"),
        (lambda: f(table, idx, off, out=np.empty((2, 5))), TypeError, "out must be a float32"),
        (lambda: f(table, idx, off, out=np.empty((3, 5), np.float32)), ValueError, r"out must have shape \(2, 5\)"),
        (lambda: f(table, idx, off, out=np.empty((5, 2), np.float32).T), ValueError, "out must be C-contiguous"),
        (lambda: f(table, idx, off, out=alias), ValueError, "out must not overlap"),
        (lambda: f(table, idx, off, out=out, per_sample_weights=out.ravel()[:5]), ValueError, "out must not overlap"),
    ]
    for call, err, match in cases:
        with pytest.raises(err, match=match):
            call()
    assert (out == 7).all()
    # strided indices and int32 offsets are taken (copied / widened)
    got = f(table, np.repeat(idx, 2)[::2], off.astype(np.int32))
    np.testing.assert_array_equal(got, f(table, idx, off))


def _every_half_table(column):
    """A 4-bit D = 2 table with one row per finite float16 h: q = (1, 0), and h as its scale (column 0)
    or its bias (column 1), the other 0."""
    h = np.arange(65536, dtype=np.uint16)
    h = h[np.isfinite(h.view(np.float16))]
    pair = np.zeros((len(h), 2), np.uint16)
    pair[:, column] = h
    data = np.concatenate([np.ones((len(h), 1), np.uint8), pair.view(np.uint8)], axis=1)
    return QuantizedTable(np.ascontiguousarray(data), 4, 2), h.view(np.float16).astype(np.float32)


def test_every_float16_scale_and_bias_decodes_exactly(monkeypatch):
    """4-bit scales and biases are decoded with integer ops (no F16C); subnormal halves without a float32
    denormal on the way, so they survive a denormals-are-zero flag (torch.set_flush_denormal; it holds
    for the calling thread, so the serial path runs)."""
    _force_path(monkeypatch, "serial")
    torch = _torch_or_none()
    flush = [False, True] if torch is not None and torch.set_flush_denormal(True) else [False]
    try:
        for daz in flush:
            if torch is not None:
                torch.set_flush_denormal(daz)
            for column in (0, 1):
                table, h = _every_half_table(column)
                rows = np.arange(table.num_rows)
                got = embedding_bag_quantized_forward(table, rows, rows)
                want = h + np.float32(0)  # fma(s, 1, 0 + 0) = s + 0 and fma(0, q, 0 + b) = 0 + b
                np.testing.assert_array_equal(got[:, column].view(np.uint32), want.view(np.uint32))
    finally:
        if torch is not None:
            torch.set_flush_denormal(False)


def _torch_or_none():
    try:
        import torch
        return torch
    except ImportError:
        return None


# ----------------------------------------------------------------------------- against torch


def _torch_tables(rng):
    """Float tables (R, D) for torch's prepack: even D (torch packs only those for 4-bit), a
    specialised and generic widths, rows of every kind _weights makes, and a row of mixed huge values."""
    for rows, dim in ((1, 2), (7, 6), (300, 64), (50, 22)):
        for bits in Q.BITS:
            w = _weights(rng, rows, dim, bits)
            if rows > 1:
                w[-1] = rng.standard_normal(dim) * (1e4 if bits == 4 else 1e30)
            yield bits, w


def test_quantization_and_lookups_equal_torch_bit_for_bit():
    """Against torch.ops.quantized (FBGEMM): prepacked bytes equal, and lookups (sum; torch's ops
    ignore `mode`) equal bit for bit -- tolerance 0, because both pool a bag as FBGEMM does, in index
    order, acc = fma(scale * w, q, acc + bias * w) in float32, with scales and biases decoded exactly.
    (Rows whose minimum is a zero of both signs are left out: which sign FBGEMM's SIMD min keeps
    depends on its lane order; _weights makes only +0.0 rows.)"""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(11)
    prepack = {8: torch.ops.quantized.embedding_bag_byte_prepack, 4: torch.ops.quantized.embedding_bag_4bit_prepack}
    lookup = {8: torch.ops.quantized.embedding_bag_byte_rowwise_offsets,
              4: torch.ops.quantized.embedding_bag_4bit_rowwise_offsets}
    for bits, w in _torch_tables(rng):
        packed = prepack[bits](torch.from_numpy(w)).numpy()
        table = quantize_rowwise(w, bits)
        np.testing.assert_array_equal(table.data, packed, err_msg=f"{bits}-bit prepack of {w.shape}")
        R = len(w)
        for last in (False, True):
            idx, off = _bags(rng, R, [0, 1, 20, 3, 0, 7], last)
            psw = rng.standard_normal(len(idx)).astype(np.float32)
            for weights in (None, psw):
                want = lookup[bits](torch.from_numpy(packed), torch.from_numpy(idx), torch.from_numpy(off), False, 0,
                                    False, None if weights is None else torch.from_numpy(weights), None, last).numpy()
                got = embedding_bag_quantized_forward(QuantizedTable(packed, bits), idx, off,
                                                      per_sample_weights=weights, include_last_offset=last)
                np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32),
                                              err_msg=f"{bits}-bit lookup, {w.shape}, last={last}")


# ----------------------------------------------------------------------------- prefetch knob


def test_prefetch_knob_declaration_and_tuned_entry(tmp_path, monkeypatch):
    monkeypatch.setenv("JITKERN_TUNE_DB", str(tmp_path / "tune.json"))
    monkeypatch.delenv("JITKERN_NO_TUNE", raising=False)
    k = knobs.get("embedding.quantized.prefetch")
    assert k is Q.PREFETCH
    for dim, bits in ((64, 8), (128, 4), (300, 8)):
        assert k.heuristic((10**6, dim, bits)) == {"pf": prefetch_distance(Q.row_bytes(dim, bits))}
    work = knobs.Workload(tables=((1000, 16, 20, 64, 1), (1000, 16, 20, 64, 0.5), (1000, 16, 20, 64, 4)))
    assert list(k.problems(work)) == [(1000, 16, 8), (1000, 16, 4)]
    assert k.shape_class((1000, 16, 8)) == "8bit1024x32" and k.shape_class((1000, 16, 4)) == "4bit1024x16"
    assert {"pf": 32} in k.candidates((1000, 16, 8), True)
    problem = (1000, 37, 4)
    k.runner(problem, k.heuristic(problem))()  # the generic kernel the property tests compiled
    assert Q._prefetch_for(*problem, tunedb.generation()) == prefetch_distance(Q.row_bytes(37, 4))
    tunedb.store(k.name, k.shape_class(problem), {"pf": 8})
    assert Q._prefetch_for(*problem, tunedb.generation()) == 8
