"""The gradient of an embedding bag w.r.t. its per-sample weights (learned weighted pooling)."""
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from jitkern import ops
from jitkern.ops import reference as R


@st.composite
def bags(draw):
    rows, d = draw(st.integers(1, 60)), draw(st.integers(1, 40))
    b = draw(st.integers(0, 30))
    sizes = draw(st.lists(st.integers(0, 6), min_size=b, max_size=b))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    idx = rng.integers(0, rows, int(sum(sizes))).astype(draw(st.sampled_from([np.int32, np.int64])))
    starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    last = draw(st.booleans())
    w = rng.standard_normal((rows, d)).astype(np.float32)
    dout = rng.standard_normal((b, d)).astype(np.float32)
    return w, idx, starts if last else starts[:-1], dout, last, draw(st.sampled_from(["sum", "mean"]))


@given(bags())
def test_matches_reference(case):
    w, idx, off, dout, last, mode = case
    got = ops.embedding_bag_per_sample_weights_backward(w, idx, off, dout, mode=mode, include_last_offset=last)
    ref = R.embedding_bag_per_sample_weights_backward(w, idx, off, dout, mode=mode, include_last_offset=last)
    assert got.shape == (len(idx),) and got.dtype == np.float32
    np.testing.assert_allclose(got, ref, rtol=2.0 ** -23, atol=1e-37)      # float64 dots, rounded once


def test_is_the_derivative_of_the_weighted_forward():
    rng = np.random.default_rng(3)
    w = rng.standard_normal((20, 8)).astype(np.float32)
    idx = rng.integers(0, 20, 12)
    off = np.array([0, 5, 5, 9], np.int64)
    dout = rng.standard_normal((4, 8)).astype(np.float32)
    g = ops.embedding_bag_per_sample_weights_backward(w, idx, off, dout)
    for j in range(12):
        e = np.zeros(12, np.float32)
        e[j] = 1.0
        lin = (R.embedding_bag_forward(w, idx, off, per_sample_weights=e).astype(np.float64) * dout).sum()
        assert g[j] == pytest.approx(lin, rel=1e-6)


def test_matches_torch():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(4)
    w = rng.standard_normal((50, 16)).astype(np.float32)
    idx = rng.integers(0, 50, 40)
    off = np.array([0, 3, 10, 10, 25], np.int64)
    psw = torch.ones(40, requires_grad=True)
    out = torch.nn.functional.embedding_bag(torch.from_numpy(idx), torch.from_numpy(w), torch.from_numpy(off),
                                            mode="sum", per_sample_weights=psw)
    dout = rng.standard_normal(out.shape).astype(np.float32)
    out.backward(torch.from_numpy(dout))
    np.testing.assert_allclose(ops.embedding_bag_per_sample_weights_backward(w, idx, off, dout), psw.grad.numpy(),
                               rtol=1e-5, atol=1e-6)


def test_errors_name_the_argument():
    w = np.zeros((5, 4), np.float32)
    idx, off, dout = np.array([0, 7]), np.array([0], np.int64), np.zeros((1, 4), np.float32)
    with pytest.raises(IndexError, match=r"indices\[1\] = 7 is out of range"):
        ops.embedding_bag_per_sample_weights_backward(w, idx, off, dout)
    with pytest.raises(ValueError, match=r"dout must have shape \(1, 4\)"):
        ops.embedding_bag_per_sample_weights_backward(w, idx[:1], off, np.zeros((1, 3), np.float32))
    with pytest.raises(ValueError, match="mode must be one of"):
        ops.embedding_bag_per_sample_weights_backward(w, idx[:1], off, dout, mode="max")
