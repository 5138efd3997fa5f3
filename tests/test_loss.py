"""Fused sigmoid + BCE against the NumPy reference (and PyTorch's BCELoss where it does not saturate)."""
import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from jitkern.ops import loss as K
from jitkern.ops import reference as R

logits_st = st.floats(-1e4, 1e4, width=32)
labels_st = st.one_of(st.sampled_from([0.0, 1.0]), st.floats(0.0, 1.0, width=32))


@st.composite
def batches(draw, max_b=300):
    b = draw(st.integers(1, max_b))
    z = draw(hnp.arrays(np.float32, b, elements=logits_st))
    y = draw(hnp.arrays(np.float32, b, elements=labels_st))
    return z, y


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # the reference's 1/(1+exp(-z))
@given(batches())
def test_forward_backward_match_reference(zy):
    z, y = zy
    loss, probs = K.sigmoid_bce_forward(z, y)
    rloss, rprobs = R.sigmoid_bce_forward(z, y)
    assert isinstance(loss, float) and math.isfinite(loss)
    # float64 throughout; only the summation order differs from NumPy's pairwise mean
    assert loss == pytest.approx(rloss, rel=1e-12, abs=1e-12)
    assert probs.dtype == np.float32
    np.testing.assert_array_equal(probs, rprobs)
    np.testing.assert_array_equal(K.sigmoid_bce_backward(probs, y), R.sigmoid_bce_backward(probs, y))


def test_extreme_logits_are_finite_and_exact():
    z = np.array([1e4, 1e4, -1e4, -1e4, 88.0, -104.0, 0.0], np.float32)
    y = np.array([0.0, 1.0, 0.0, 1.0, 0.0, 1.0, 0.5], np.float32)
    loss, probs = K.sigmoid_bce_forward(z, y)
    per = [1e4, 0.0, 0.0, 1e4, 88.0 + math.log1p(math.exp(-88.0)), 104.0 + math.log1p(math.exp(-104.0)),
           math.log(2.0)]
    assert loss == pytest.approx(sum(per) / len(per), rel=1e-15)
    np.testing.assert_array_equal(probs[:4], [1.0, 1.0, 0.0, 0.0])
    assert probs[6] == 0.5
    for b in range(len(z)):   # one sample at a time: the exact per-sample value
        assert K.sigmoid_bce_forward(z[b:b + 1], y[b:b + 1])[0] == pytest.approx(per[b], rel=1e-15, abs=0)


def test_soft_labels_and_gradient():
    z = np.array([0.3, -2.0, 5.0], np.float32)
    y = np.array([0.25, 0.5, 0.9], np.float32)
    loss, probs = K.sigmoid_bce_forward(z, y)
    p = 1 / (1 + np.exp(-z.astype(np.float64)))
    yy = y.astype(np.float64)
    expect = -(yy * np.log(p) + (1 - yy) * np.log1p(-p)).mean()
    assert loss == pytest.approx(expect, rel=1e-12)
    # the gradient is the derivative of the mean loss: central differences in float64
    dl = K.sigmoid_bce_backward(probs, y)
    h = 1e-4
    for b in range(3):
        zp, zm = z.astype(np.float64).copy(), z.astype(np.float64).copy()
        zp[b] += h
        zm[b] -= h
        num = (R.sigmoid_bce_forward(zp, y)[0] - R.sigmoid_bce_forward(zm, y)[0]) / (2 * h)
        assert dl[b] == pytest.approx(num, rel=1e-5)


def test_matches_torch_bceloss_where_it_does_not_saturate():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    z = rng.uniform(-15, 15, 257).astype(np.float32)
    y = np.concatenate([rng.integers(0, 2, 200), rng.uniform(0, 1, 57)]).astype(np.float32)
    loss, probs = K.sigmoid_bce_forward(z, y)
    # torch in float64: in float32 its log(1 - sigmoid(z)) loses most digits once sigmoid(z)
    # rounds near 1 (z > ~8), which measures torch's rounding rather than ours
    zt = torch.from_numpy(z.astype(np.float64)).requires_grad_()
    pt = torch.sigmoid(zt)
    lt = torch.nn.BCELoss()(pt, torch.from_numpy(y.astype(np.float64)))
    lt.backward()
    assert loss == pytest.approx(lt.item(), rel=1e-12)
    np.testing.assert_allclose(probs, pt.detach().numpy(), rtol=np.finfo(np.float32).eps, atol=0)
    # dlogits = (probs - y) / B with probs rounded to float32
    np.testing.assert_allclose(K.sigmoid_bce_backward(probs, y), zt.grad.numpy(), rtol=0,
                               atol=2 * np.finfo(np.float32).eps / len(z))


def test_empty_batch_and_nan_logits():
    loss, probs = K.sigmoid_bce_forward(np.zeros(0, np.float32), np.zeros(0, np.float32))
    assert loss == 0.0 and probs.shape == (0,)
    assert K.sigmoid_bce_backward(probs, np.zeros(0, np.float32)).shape == (0,)
    loss, probs = K.sigmoid_bce_forward(np.array([np.nan, 1.0], np.float32), np.array([1.0, 0.0], np.float32))
    assert math.isnan(loss) and math.isnan(probs[0]) and probs[1] == pytest.approx(0.7310586)


def test_argument_errors():
    z = np.zeros(4, np.float32)
    y = np.ones(4, np.float32)
    with pytest.raises(ValueError, match="labels has B=3 but logits has B=4"):
        K.sigmoid_bce_forward(z, y[:3])
    with pytest.raises(ValueError, match="labels has B=5 but probs has B=4"):
        K.sigmoid_bce_backward(z, np.ones(5, np.float32))
    with pytest.raises(TypeError, match="logits must have dtype float32"):
        K.sigmoid_bce_forward(z.astype(np.float64), y)
    with pytest.raises(TypeError, match="labels must have dtype float32"):
        K.sigmoid_bce_forward(z, y.astype(np.int64))
    with pytest.raises(TypeError, match="probs must have dtype float32"):
        K.sigmoid_bce_backward(z.astype(np.float16), y)
    with pytest.raises(TypeError, match="logits must be a numpy.ndarray"):
        K.sigmoid_bce_forward([0.0] * 4, y)
    with pytest.raises(ValueError, match=r"logits must be 1-D"):
        K.sigmoid_bce_forward(z.reshape(2, 2), y)
    for bad in (np.nan, 1.5, -0.1, np.inf):
        y2 = y.copy()
        y2[2] = bad
        with pytest.raises(ValueError, match=r"labels must lie in \[0, 1\].*labels\[2\]"):
            K.sigmoid_bce_forward(z, y2)
        with pytest.raises(ValueError, match=r"labels must lie in \[0, 1\]"):
            K.sigmoid_bce_backward(z, y2)
