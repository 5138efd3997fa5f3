"""Dense SGD and the BF16 Split-SGD table against ops.reference."""
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from jitkern.ops import BF16Array, SplitBF16Table, join_float32, reference, sgd_, split_float32, split_sgd_

EPS32 = 2.0 ** -23


@given(st.sampled_from([(0,), (1,), (7,), (13, 17), (3, 1, 5), (70001,)]), st.integers(0, 2**32 - 1),
       st.sampled_from([0.0, 1e-3, 0.5, -2.0]))
def test_sgd_matches_reference(shape, seed, lr):
    rng = np.random.default_rng(seed)
    p = rng.standard_normal(shape).astype(np.float32)
    g = rng.standard_normal(shape).astype(np.float32)
    want = reference.sgd_(p.copy(), g, lr)
    assert sgd_(p, g, lr) is p
    # one rounding of the product and one of the difference (or a single fused one)
    assert np.all(np.abs(p - want) <= 2 * EPS32 * (np.abs(want) + abs(lr) * np.abs(g)))


def test_sgd_checks_arguments():
    p = np.ones((4, 3), np.float32)
    with pytest.raises(TypeError, match="param"):
        sgd_(p.astype(np.float64), p, 0.1)
    with pytest.raises(TypeError, match="grad"):
        sgd_(p, p.astype(np.float64), 0.1)
    with pytest.raises(ValueError, match="shape"):
        sgd_(p, p[:2], 0.1)
    with pytest.raises(ValueError, match="lr must be finite"):
        sgd_(p, p, float("nan"))
    with pytest.raises(ValueError, match="contiguous"):
        sgd_(p.T, p.T, 0.1)
    np.testing.assert_array_equal(p, 1.0)
    g = np.ones((3, 8), np.float32)[:, ::2]  # a strided gradient is fine
    q = np.zeros((3, 4), np.float32)
    sgd_(q, g, 2.0)
    np.testing.assert_array_equal(q, -2.0)


@pytest.mark.parametrize("layout", ["split", "pairs"])
def test_split_table_roundtrip_is_exact_including_special_values(layout):
    specials = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-45, -3e-39, 3.4e38, 1.0, -1.5], np.float32)
    w = np.concatenate([specials, np.random.default_rng(0).standard_normal(90).astype(np.float32)]).reshape(20, 5)
    t = SplitBF16Table.from_float32(w, layout)
    assert t.layout == layout and layout in repr(t)
    if layout == "pairs":  # lo[r] right after hi[r]
        assert t.lo.ctypes.data - t.hi.ctypes.data == 10 and t.hi.strides == t.lo.strides == (20, 2)
    else:
        assert t.hi.flags.c_contiguous and t.lo.flags.c_contiguous
    hi, lo = reference.bf16_split(w)
    np.testing.assert_array_equal(t.hi, hi)
    np.testing.assert_array_equal(t.lo, lo)
    np.testing.assert_array_equal(t.to_float32().view(np.uint32), w.view(np.uint32))
    np.testing.assert_array_equal(reference.bf16_join(t.hi, t.lo).view(np.uint32), w.view(np.uint32))
    assert (t.shape, t.num_rows, t.dim) == ((20, 5), 20, 5) and "20" in repr(t)
    empty = SplitBF16Table.from_float32(np.empty((0, 4), np.float32))
    assert empty.to_float32().shape == (0, 4)


def test_split_table_checks_arguments():
    with pytest.raises(TypeError, match="float32"):
        SplitBF16Table.from_float32(np.ones((2, 2)))
    with pytest.raises(TypeError, match="float32"):
        SplitBF16Table.from_float32(np.ones(4, np.float32))
    with pytest.raises(TypeError, match="hi"):
        SplitBF16Table(np.ones((2, 2), np.int16), np.ones((2, 2), np.uint16))
    with pytest.raises(ValueError, match="differ"):
        SplitBF16Table(np.ones((2, 2), np.uint16), np.ones((2, 3), np.uint16))
    with pytest.raises(ValueError, match="2-D"):
        SplitBF16Table(np.ones(4, np.uint16), np.ones(4, np.uint16))
    with pytest.raises(ValueError, match="layout"):
        SplitBF16Table.from_float32(np.ones((2, 2), np.float32), "interleaved")
    buf = np.zeros((3, 8), np.uint16)
    with pytest.raises(ValueError, match="dense rows"):  # elements two apart
        SplitBF16Table(buf[:, ::2], buf[:, 1::2])
    for hi, lo in [(buf[:, :4], buf[:, 2:6]), (buf[:, :4], buf[:, :4]), (buf[:2, :6], buf[1:, 2:])]:
        with pytest.raises(ValueError, match="overlap"):
            SplitBF16Table(hi, lo)
    # any two disjoint sets of dense rows are accepted: column halves, in either order, or row halves
    assert SplitBF16Table(buf[:, :4], buf[:, 4:]).layout == "pairs"
    assert SplitBF16Table(buf[:, 4:], buf[:, :4]).layout == "split"
    tall = np.zeros((4, 4), np.uint16)
    assert SplitBF16Table(tall[:2], tall[2:]).layout == "split"


# --------------------------------------------------------------------------- Split-SGD on dense pairs

_SPECIALS = np.array([0.0, -0.0, np.inf, -np.inf, 1e-45, -3e-39, 3.4e38, 1.0, -1.5], np.float32)


@given(st.sampled_from([(0,), (1,), (9,), (13, 17), (3, 1, 5), (70001,)]), st.integers(0, 2**32 - 1),
       st.sampled_from([0.0, 1e-3, 0.5, -2.0]))
def test_split_sgd_matches_reference_and_fp32_sgd(shape, seed, lr):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal(shape).astype(np.float32)
    if w.size >= len(_SPECIALS):
        w.reshape(-1)[:len(_SPECIALS)] = _SPECIALS
    g = rng.standard_normal(shape).astype(np.float32)
    hi, lo = split_float32(w)
    rhi, rlo = BF16Array(hi.bits.copy()), lo.copy()
    reference.split_sgd_(rhi, rlo, g, lr)
    assert split_sgd_(hi, lo, g, lr)[0] is hi
    want = sgd_(w.copy(), g, lr)      # the fp32 update, bit for bit: no precision lost to the split
    with np.errstate(invalid="ignore"):
        np.testing.assert_array_equal(join_float32(hi, lo).view(np.uint32), want.view(np.uint32))
    np.testing.assert_array_equal(reference.bf16_join(rhi.bits, rlo), reference.sgd_(w.copy(), g, lr))
    np.testing.assert_array_equal(hi.bits, reference.bf16_split(want)[0])


def test_split_roundtrip_is_exact():
    w = np.concatenate([_SPECIALS, [np.nan]]).astype(np.float32).reshape(2, 5)
    hi, lo = split_float32(w)
    assert isinstance(hi, BF16Array) and hi.shape == (2, 5) and lo.dtype == np.uint16
    np.testing.assert_array_equal(join_float32(hi, lo).view(np.uint32), w.view(np.uint32))
    rh, rl = reference.bf16_split(w)
    np.testing.assert_array_equal(hi.bits, rh)
    np.testing.assert_array_equal(lo, rl)


def test_split_sgd_checks_arguments():
    hi, lo = split_float32(np.ones((4, 3), np.float32))
    g = np.ones((4, 3), np.float32)
    with pytest.raises(TypeError, match="hi must be a BF16Array"):
        split_sgd_(hi.bits, lo, g, 0.1)
    with pytest.raises(TypeError, match="lo"):
        split_sgd_(hi, lo.astype(np.int16), g, 0.1)
    with pytest.raises(ValueError, match="lo must have shape"):
        split_sgd_(hi, lo[:2], g, 0.1)
    with pytest.raises(TypeError, match="grad"):
        split_sgd_(hi, lo, g.astype(np.float64), 0.1)
    with pytest.raises(ValueError, match="lr must be finite"):
        split_sgd_(hi, lo, g, float("inf"))
    with pytest.raises(ValueError, match="lo must not overlap"):
        split_sgd_(hi, hi.bits, g, 0.1)
    with pytest.raises(TypeError, match="x must be a float32"):
        split_float32(np.ones(3))
    np.testing.assert_array_equal(join_float32(hi, lo), 1.0)
