"""Sigmoid forward/backward (the MLPs' --activation-function sigmoid) against the NumPy reference."""
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from jitkern import ops
from jitkern.ops import reference as R

arrays = hnp.arrays(np.float32, hnp.array_shapes(min_dims=1, max_dims=2, max_side=40),
                    elements=st.floats(-200, 200, width=32))


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")
@given(arrays, st.data())
def test_sigmoid_matches_reference(x, data):
    y = ops.sigmoid_forward(x)
    np.testing.assert_array_equal(y, R.sigmoid_forward(x))
    assert ((y >= 0) & (y <= 1)).all()
    dy = data.draw(hnp.arrays(np.float32, x.shape, elements=st.floats(-10, 10, width=32)))
    np.testing.assert_allclose(ops.sigmoid_backward(dy, y), R.sigmoid_backward(dy, y), rtol=1e-6, atol=1e-30)


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")
def test_sigmoid_is_the_float64_result_rounded_once_over_the_whole_range():
    # the kernel's own exp (vectorised, parallel at this size) against NumPy's float64 exp: every
    # float32 result identical, from the underflow to 0 through the saturation at 1
    x = np.random.default_rng(0).uniform(-120, 120, 1 << 20).astype(np.float32)
    x[:12] = [np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-30, -1e-30, 88.72, -88.72, -103.28, -103.98, 16.64]
    y = ops.sigmoid_forward(x)
    np.testing.assert_array_equal(y.view(np.uint32)[1:], R.sigmoid_forward(x).view(np.uint32)[1:])
    assert np.isnan(y[0]) and y[1] == 1 and y[2] == 0 and y[3] == y[4] == 0.5


def test_in_place_and_errors():
    x = np.linspace(-5, 5, 12, dtype=np.float32).reshape(3, 4)
    expect = R.sigmoid_forward(x)
    assert ops.sigmoid_forward(x, out=x) is x
    np.testing.assert_array_equal(x, expect)
    with pytest.raises(TypeError, match="x must have dtype float32"):
        ops.sigmoid_forward(x.astype(np.float64))
    with pytest.raises(ValueError, match=r"y must have shape \(3, 4\)"):
        ops.sigmoid_backward(x, x[:2])
    with pytest.raises(ValueError, match="out must have shape"):
        ops.sigmoid_forward(x, out=np.empty((4, 3), np.float32))
