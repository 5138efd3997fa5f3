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


# --------------------------------------------------------------------------- the reference's losses

KINDS = ("bce", "bce_prob", "mse", "wbce")
thresholds = st.one_of(st.just(0.0), st.floats(0.0009765625, 0.875, width=32))


@st.composite
def loss_cases(draw):
    z, y = draw(batches(max_b=200))
    kind = draw(st.sampled_from(KINDS))
    w = draw(st.tuples(st.floats(0, 5), st.floats(0, 5))) if kind == "wbce" else None
    return z, y, kind, w, draw(thresholds)


@pytest.mark.filterwarnings("ignore:overflow encountered")
@given(loss_cases())
def test_sigmoid_loss_matches_reference(case):
    z, y, kind, w, t = case
    kw = dict(loss=kind, class_weights=w, threshold=t)
    loss, probs = K.sigmoid_loss_forward(z, y, **kw)
    rloss, rprobs = R.sigmoid_loss_forward(z, y, **kw)
    assert math.isfinite(loss)
    assert loss == pytest.approx(rloss, rel=1e-7, abs=1e-12)
    np.testing.assert_array_equal(probs, rprobs)
    if 0 < t <= 0.5:
        assert (probs >= np.float32(t)).all() and (probs <= np.float32(1 - t)).all()
    elif t > 0.5:                                            # min > max: torch.clamp gives max
        assert (probs == np.float32(1 - t)).all()
    d, rd = K.sigmoid_loss_backward(z, y, **kw), R.sigmoid_loss_backward(z, y, **kw)
    np.testing.assert_allclose(d, rd, rtol=1e-6, atol=1e-30)


@pytest.mark.parametrize("kind", KINDS)
def test_sigmoid_loss_gradient_is_the_derivative_of_the_mean(kind):
    rng = np.random.default_rng(1)
    z = rng.uniform(-3, 3, 9).astype(np.float32)
    y = np.concatenate([rng.integers(0, 2, 5), rng.uniform(0, 1, 4)]).astype(np.float32)
    w = (0.3, 1.7) if kind == "wbce" else None
    d = K.sigmoid_loss_backward(z, y, loss=kind, class_weights=w, threshold=0.01)

    def mean_loss(zz):                     # in float64, without the float32 rounding of p
        p = 1 / (1 + np.exp(-zz))
        p = np.clip(p, 0.01, 0.99)
        if kind == "mse":
            return ((p - y) ** 2).mean()
        ww = np.asarray(w)[(y >= 1).astype(int)] if w else 1.0
        return (ww * -(y * np.log(p) + (1 - y) * np.log1p(-p))).mean()
    h = 1e-5
    for b in range(len(z)):
        zp, zm = z.astype(np.float64), z.astype(np.float64)
        zp[b] += h
        zm[b] -= h
        assert d[b] == pytest.approx((mean_loss(zp) - mean_loss(zm)) / (2 * h), rel=2e-4, abs=1e-9)


def test_clamped_probabilities_pass_no_gradient_and_bce_equals_sigmoid_bce():
    z = np.array([-6.0, -0.1, 0.0, 0.1, 6.0], np.float32)
    y = np.array([1, 0, 1, 0, 1], np.float32)
    d = K.sigmoid_loss_backward(z, y, loss="mse", threshold=0.4)
    assert d[0] == 0 and d[4] == 0 and (d[1:4] != 0).all()
    loss, probs = K.sigmoid_loss_forward(z, y, loss="bce")
    ref_loss, ref_probs = K.sigmoid_bce_forward(z, y)
    assert loss == pytest.approx(ref_loss, rel=1e-15)
    np.testing.assert_array_equal(probs, ref_probs)


def test_bce_prob_saturates_as_torch():
    # p rounds to 1 in float32: each log term clamps at -100 and no gradient passes
    z = np.array([30.0, 30.0, -100.0], np.float32)
    y = np.array([1.0, 0.0, 1.0], np.float32)
    loss, probs = K.sigmoid_loss_forward(z, y, loss="bce_prob")
    assert loss == pytest.approx((0.0 + 100.0 + 100.0) / 3)
    np.testing.assert_array_equal(probs, [1.0, 1.0, 0.0])
    np.testing.assert_array_equal(K.sigmoid_loss_backward(z, y, loss="bce_prob"), [0.0, 0.0, 0.0])


def test_matches_torch_losses():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(2)
    z = np.concatenate([rng.uniform(-20, 20, 300), rng.uniform(-2, 2, 100)]).astype(np.float32)
    y = np.concatenate([rng.integers(0, 2, 300), rng.uniform(0, 1, 100)]).astype(np.float32)
    for kind, t, w in (("bce_prob", 0.0, None), ("mse", 0.0, None), ("wbce", 0.0, (0.3, 0.7)),
                       ("bce_prob", 0.2, None), ("mse", 0.45, None)):
        zt = torch.from_numpy(z).requires_grad_()
        p = torch.sigmoid(zt)
        if t:
            p = torch.clamp(p, min=t, max=1 - t)
        yt = torch.from_numpy(y)
        if kind == "mse":
            lt = torch.nn.MSELoss()(p, yt)
        elif kind == "bce_prob":
            lt = torch.nn.BCELoss()(p, yt)
        else:
            lt = (torch.tensor(w, dtype=torch.float32)[yt.long()] * torch.nn.BCELoss(reduction="none")(p, yt)).mean()
        lt.backward()
        loss, probs = K.sigmoid_loss_forward(z, y, loss=kind, class_weights=w, threshold=t)
        assert loss == pytest.approx(lt.item(), rel=2e-6), kind
        # torch's exp (SLEEF's, within 1 ulp) is not rounded as ours: p within 2 ulp, and near 1,
        # where 1 - p decides BCE, the rounding of 1 + exp(-z) is torch's
        pt = p.detach().numpy()
        np.testing.assert_allclose(probs, pt, rtol=2.5e-7, atol=0)
        assert np.mean(probs[pt > 0.5] != pt[pt > 0.5]) < 0.02
        np.testing.assert_allclose(K.sigmoid_loss_backward(z, y, loss=kind, class_weights=w, threshold=t),
                                   zt.grad.numpy(), rtol=1e-5, atol=1e-9)


def test_sigmoid_loss_argument_errors():
    z, y = np.zeros(3, np.float32), np.ones(3, np.float32)
    with pytest.raises(ValueError, match="loss must be one of"):
        K.sigmoid_loss_forward(z, y, loss="hinge")
    with pytest.raises(ValueError, match="needs class_weights"):
        K.sigmoid_loss_forward(z, y, loss="wbce")
    with pytest.raises(ValueError, match="class_weights must be 2 finite"):
        K.sigmoid_loss_backward(z, y, loss="wbce", class_weights=(1.0,))
    with pytest.raises(ValueError, match="class_weights apply to loss='wbce' only"):
        K.sigmoid_loss_forward(z, y, loss="mse", class_weights=(1.0, 2.0))
    with pytest.raises(ValueError, match=r"threshold must be in \[0, 1\)"):
        K.sigmoid_loss_forward(z, y, threshold=1.0)
    with pytest.raises(ValueError, match="threshold must be >= 0"):
        K.sigmoid_loss_forward(z, y, threshold=-0.1)
    with pytest.raises(ValueError, match="labels has B=2 but logits has B=3"):
        K.sigmoid_loss_forward(z, y[:2], loss="mse")
