"""Issue 18, findings 3 and 4: every in-place op checks its scalars in float32 (the precision the
kernels apply them in) and rejects inputs that alias the memory it updates (or computes what the
reference computes on copies). A rejected call leaves the table byte-identical.
"""
import numpy as np
import pytest

from jitkern import ops
from jitkern.ops import reference as ref

D = 16
HUGE = 1e39                      # finite as a float64, inf as a float32


def _table(rows=8, seed=0):
    return np.random.default_rng(seed).standard_normal((rows, D)).astype(np.float32)


def _bags():
    # two bags over rows 0..3: (indices, offsets)
    return np.array([0, 1, 1, 3], np.int64), np.array([0, 2], np.int64)


def _unchanged(before, after):
    for a, b in zip(before, after):
        assert a.tobytes() == b.tobytes(), "a rejected call modified the table"


# --------------------------------------------------------------------------- finding 3: float32 scalars


def test_issue_example_lr_overflowing_float32_is_rejected():
    w = _table()
    before = w.copy()
    with pytest.raises(ValueError, match="lr"):
        ops.embedding_bag_sgd_(w, np.array([1], np.int64), np.array([0], np.int64), np.ones((1, D), np.float32), HUGE)
    _unchanged([before], [w])


def _sgd_fp32(lr):
    w = _table()
    idx, off = _bags()
    return [w], lambda: ops.embedding_bag_sgd_(w, idx, off, np.ones((2, D), np.float32), lr)


def _sgd_bf16(lr):
    t = ops.SplitBF16Table.from_float32(_table())
    idx, off = _bags()
    return [t.hi, t.lo], lambda: ops.embedding_bag_sgd_(t, idx, off, np.ones((2, D), np.float32), lr)


def _adagrad(lr, eps=1e-8):
    w, state = _table(), np.zeros(8, np.float32)
    idx, off = _bags()
    return [w, state], lambda: ops.embedding_bag_adagrad_(w, state, idx, off, np.ones((2, D), np.float32), lr, eps)


def _dense_sgd(lr):
    p = _table()
    return [p], lambda: ops.sgd_(p, np.ones_like(p), lr)


@pytest.mark.parametrize("name,make", [
    ("lr", lambda: _sgd_fp32(HUGE)), ("lr", lambda: _sgd_fp32(-HUGE)), ("lr", lambda: _sgd_bf16(HUGE)),
    ("lr", lambda: _adagrad(HUGE)), ("lr", lambda: _dense_sgd(HUGE)),
])
def test_scalars_are_checked_in_float32_in_every_in_place_op(name, make):
    arrays, call = make()
    before = [a.copy() for a in arrays]
    with pytest.raises(ValueError, match=name):
        call()
    _unchanged(before, arrays)


def test_rowwise_adagrad_eps_is_applied_in_float64():
    """Row-wise Adagrad adds eps to a float64 square root (as the reference does): an eps beyond
    float32's range is a valid, if useless, value there, giving the reference's (tiny) steps, never
    an overflow. A negative or non-finite eps is refused."""
    (w, state), call = _adagrad(0.1, HUGE)
    want_w, want_s = w.copy(), state.copy()
    idx, off = _bags()
    ref.embedding_bag_adagrad_(want_w, want_s, idx, off, np.ones((2, D), np.float32), 0.1, HUGE)
    call()
    assert np.isfinite(w).all()
    np.testing.assert_array_equal(w, want_w)
    np.testing.assert_array_equal(state, want_s)
    for bad in (-1e-8, float("inf"), float("nan")):
        arrays, call = _adagrad(0.1, bad)
        before = [a.copy() for a in arrays]
        with pytest.raises(ValueError, match="eps"):
            call()
        _unchanged(before, arrays)


# --------------------------------------------------------------------------- finding 4: aliasing


def _rejected_or_as_on_copies(arrays, call, expected, argname):
    """The op either raises a ValueError naming `argname` (arrays untouched) or leaves `arrays`
    equal to what the reference computes on copies of its inputs."""
    before = [a.copy() for a in arrays]
    try:
        call()
    except ValueError as e:
        assert argname in str(e), e
        _unchanged(before, arrays)
        return
    for got, want in zip(arrays, expected):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_issue_example_dout_aliasing_the_table():
    w = _table()
    idx, off = _bags()
    want = ref.embedding_bag_sgd_(w.copy(), idx, off, w[0:2].copy(), 0.5)
    _rejected_or_as_on_copies([w], lambda: ops.embedding_bag_sgd_(w, idx, off, w[0:2], 0.5), [want], "dout")


def test_bf16_table_update_with_dout_aliasing_its_halves():
    t = ops.SplitBF16Table.from_float32(_table())
    idx, off = _bags()
    dout = t.hi.reshape(-1).view(np.float32)[:2 * D].reshape(2, D)      # the high halves' bytes
    w = t.to_float32()
    ref.embedding_bag_sgd_(w, idx, off, dout.copy(), 1e-3)
    _rejected_or_as_on_copies([t.to_float32()], lambda: ops.embedding_bag_sgd_(t, idx, off, dout, 1e-3), [w], "dout")


def test_adagrad_with_dout_or_state_aliasing_the_table():
    idx, off = _bags()
    w, state = _table(), np.zeros(8, np.float32)
    want_w, want_s = w.copy(), state.copy()
    ref.embedding_bag_adagrad_(want_w, want_s, idx, off, w[0:2].copy(), 0.5)
    _rejected_or_as_on_copies([w, state], lambda: ops.embedding_bag_adagrad_(w, state, idx, off, w[0:2], 0.5),
                              [want_w, want_s], "dout")
    w = _table()
    state = w.reshape(-1)[:8]                          # the state is the table's first row
    want_w, want_s = w.copy(), state.copy()
    ref.embedding_bag_adagrad_(want_w, want_s, idx, off, np.ones((2, D), np.float32), 0.5)
    _rejected_or_as_on_copies([w], lambda: ops.embedding_bag_adagrad_(w, state, idx, off, np.ones((2, D), np.float32),
                                                                      0.5), [want_w], "state")


def test_dense_sgd_with_grad_overlapping_param():
    flat = _table(4).reshape(-1)
    param, grad = flat[1:], flat[:-1]                  # grad runs one element behind the updates
    want = ref.sgd_(param.copy(), grad.copy(), 0.5)
    _rejected_or_as_on_copies([param], lambda: ops.sgd_(param, grad, 0.5), [want], "grad")
