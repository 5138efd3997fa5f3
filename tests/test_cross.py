"""The low-rank cross layer (cross_layer_forward / cross_layer_backward) against ops.reference.

Bounds: float32 dot products of length K err by at most ~K ulp-units of the sum of absolute
terms, which the reference gives when run on absolute values.
"""
import numba
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from jitkern.ops import cross_layer_backward, cross_layer_forward, reference

EPS32 = 2.0 ** -23


def _arrays(rng, B, n, r):
    x0, xl, d = (rng.standard_normal((B, n)).astype(np.float32) for _ in range(3))
    v = rng.standard_normal((r, n)).astype(np.float32)
    w = rng.standard_normal((n, r)).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32)
    return x0, xl, v, w, b, d


def _strided(rng, a):
    """a as a non-contiguous view of a bigger array (the ops copy such inputs)."""
    big = np.zeros(a.shape + (2,), np.float32)
    big[..., 0] = a
    return big[..., 0]


@st.composite
def layer_shapes(draw):
    """(rng, B, n, r) of a cross layer: empty and one-row batches, widths and ranks off the tiles."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    return (rng, draw(st.sampled_from([0, 1, 2, 7, 33, 100])), draw(st.sampled_from([1, 3, 17, 64, 100])),
            draw(st.sampled_from([1, 2, 5, 16, 33])))


@st.composite
def layers(draw):
    rng, B, n, r = draw(layer_shapes())
    arrays = _arrays(rng, B, n, r)
    if draw(st.booleans()):
        arrays = tuple(_strided(rng, a) for a in arrays)
    return arrays


@given(layers())
def test_forward_matches_reference(p):
    x0, xl, v, w, b, _ = p
    B, n = x0.shape
    r = v.shape[0]
    x_next, u = cross_layer_forward(x0, xl, v, w, b)
    want_x, want_u = reference.cross_layer_forward(x0, xl, v, w, b)
    abs_x, abs_u = reference.cross_layer_forward(*(np.abs(a) for a in (x0, xl, v, w, b)))
    assert x_next.shape == (B, n) and u.shape == (B, r) and x_next.dtype == u.dtype == np.float32
    assert np.all(np.abs(u - want_u) <= (n + 2) * EPS32 * abs_u)
    assert np.all(np.abs(x_next - want_x) <= (n + r + 8) * EPS32 * abs_x)


@given(layers(), st.booleans(), st.booleans(), st.booleans())
def test_backward_matches_reference(p, accumulate, in_place, keep_y):
    x0, xl, v, w, b, d = p
    B, n = x0.shape
    r = v.shape[0]
    y = np.empty((B, n), np.float32) if keep_y else None
    u = cross_layer_forward(x0, xl, v, w, b, out_y=y)[1]
    acc = np.random.default_rng(1).standard_normal((B, n)).astype(np.float32) if accumulate else None
    acc0 = None if acc is None else acc.copy()
    dxn = np.array(d, order="C")  # a copy: it may be overwritten (out_dxl)
    kw = dict(y=y, accumulate_dx0=acc, out_dxl=dxn if in_place else None)
    got = cross_layer_backward(dxn, x0, xl, u, v, w, b, **kw)
    want = reference.cross_layer_backward(d, x0, xl, u, v, w, b, accumulate_dx0=acc0)
    absd = reference.cross_layer_backward(*(np.abs(a) for a in (d, x0, xl, u, v, w, b)),
                                          accumulate_dx0=None if acc0 is None else np.abs(acc0))
    shapes = [(B, n), (B, n), (r, n), (n, r), (n,)]
    ks = [r + 6, n + r + 8, n + B + 8, B + 4, B + 4]  # dx0, dxl, dv, dw, db
    for name, g, wv, a, shape, k in zip(("dx0", "dxl", "dv", "dw", "db"), got, want, absd, shapes, ks):
        assert g.shape == shape and g.dtype == np.float32, name
        assert np.all(np.abs(g - wv) <= k * EPS32 * a + 1e-30), name
    if accumulate:
        assert got[0] is acc
    elif keep_y:
        assert got[0] is y  # consumed: dx0 written over it
    if in_place:
        assert got[1] is dxn


def test_forward_and_backward_into_given_outputs():
    rng = np.random.default_rng(5)
    x0, xl, v, w, b, d = _arrays(rng, 19, 40, 7)
    out, out_u, out_y = np.empty((19, 40), np.float32), np.empty((19, 7), np.float32), np.empty((19, 40), np.float32)
    x_next, u = cross_layer_forward(x0, xl, v, w, b, out=out, out_u=out_u)
    assert x_next is out and u is out_u
    want_x, want_u = cross_layer_forward(x0, xl, v, w, b)
    np.testing.assert_array_equal(out, want_x)
    np.testing.assert_array_equal(out_u, want_u)
    kept = cross_layer_forward(x0, xl, v, w, b, out_y=out_y)  # the same results, y + b kept
    np.testing.assert_array_equal(kept[0], want_x)
    np.testing.assert_array_equal(kept[1], want_u)
    plain = cross_layer_backward(d, x0, xl, u, v, w, b)
    for g, p in zip(cross_layer_backward(d, x0, xl, u, v, w, b, y=out_y), plain):
        np.testing.assert_array_equal(g, p)  # the kept y + b is the recomputed one, bit for bit
    dxl = np.empty_like(d)
    acc = np.zeros_like(d)
    got = cross_layer_backward(d, x0, xl, u, v, w, b, accumulate_dx0=acc, out_dxl=dxl)
    assert got[0] is acc and got[1] is dxl
    for g, p in zip(got, plain):
        np.testing.assert_array_equal(g, p)  # 0 + x is x: the same bits as without accumulation


@pytest.mark.skipif(numba.config.NUMBA_NUM_THREADS < 2, reason="needs 2 numba threads")
def test_results_do_not_depend_on_the_thread_count():
    rng = np.random.default_rng(9)
    x0, xl, v, w, b, d = _arrays(rng, 300, 260, 48)
    before = numba.get_num_threads()
    runs = []
    try:
        for threads in (1, 2):
            numba.set_num_threads(threads)
            x_next, u = cross_layer_forward(x0, xl, v, w, b)
            runs.append((x_next, u) + cross_layer_backward(d, x0, xl, u, v, w, b))
    finally:
        numba.set_num_threads(before)
    for a, c in zip(*runs):
        np.testing.assert_array_equal(a.view(np.uint32), c.view(np.uint32))


def test_argument_checks():
    rng = np.random.default_rng(0)
    x0, xl, v, w, b, d = _arrays(rng, 4, 6, 3)
    u = cross_layer_forward(x0, xl, v, w, b)[1]
    bad_fwd = [
        (TypeError, "x0", dict(x0=x0.astype(np.float64))),
        (ValueError, "xl must have shape", dict(xl=xl[:3])),
        (ValueError, "v must have shape", dict(v=v[:, :5])),
        (ValueError, "w must have shape", dict(w=w[:, :2])),
        (ValueError, "b must have shape", dict(b=b[:5])),
        (ValueError, "x0 must be 2-D", dict(x0=x0[0])),
        (ValueError, "out must have shape", dict(out=np.empty((4, 5), np.float32))),
        (ValueError, "out must not overlap", dict(out=x0)),
        (ValueError, "out_u must have shape", dict(out_u=np.empty((4, 4), np.float32))),
        (ValueError, "out_y must not overlap", dict(out_y=xl)),
        (ValueError, "out must not overlap", dict(out=(shared := np.empty((4, 6), np.float32)), out_y=shared)),
    ]
    args = dict(x0=x0, xl=xl, v=v, w=w, b=b)
    for exc, match, change in bad_fwd:
        kw = {**args, **change}
        with pytest.raises(exc, match=match):
            cross_layer_forward(kw.pop("x0"), kw.pop("xl"), kw.pop("v"), kw.pop("w"), kw.pop("b"), **kw)
    shifted = np.zeros((5, 6), np.float32)  # dx_next and a dxl that overlaps it, one row apart
    saved = [a.copy() for a in (x0, xl, v, w, b, d, u)]
    bad_bwd = [
        (ValueError, "dx_next must have shape", lambda: cross_layer_backward(d[:3], x0, xl, u, v, w, b)),
        (ValueError, "u must have shape", lambda: cross_layer_backward(d, x0, xl, u[:, :2], v, w, b)),
        (ValueError, "y must have shape", lambda: cross_layer_backward(d, x0, xl, u, v, w, b, y=np.empty((4, 5),
                                                                                                       np.float32))),
        (ValueError, "y must not overlap", lambda: cross_layer_backward(d, x0, xl, u, v, w, b, y=x0)),
        (TypeError, "u", lambda: cross_layer_backward(d, x0, xl, u.astype(np.float64), v, w, b)),
        (ValueError, "accumulate_dx0 must not overlap", lambda: cross_layer_backward(d, x0, xl, u, v, w, b,
                                                                                     accumulate_dx0=d)),
        (ValueError, "out_dxl must not overlap", lambda: cross_layer_backward(d, x0, xl, u, v, w, b, out_dxl=x0)),
        (ValueError, "out_dxl must not overlap", lambda: cross_layer_backward(shifted[:4], x0, xl, u, v, w, b,
                                                                              out_dxl=shifted[1:])),
        (ValueError, "out_dxl must be C-contiguous", lambda: cross_layer_backward(
            d, x0, xl, u, v, w, b, out_dxl=np.empty((6, 4), np.float32).T)),
    ]
    for exc, match, call in bad_bwd:
        with pytest.raises(exc, match=match):
            call()
    for a, s in zip((x0, xl, v, w, b, d, u), saved):
        np.testing.assert_array_equal(a, s)


def test_bench_ops_runs_at_a_small_scale(capsys):
    """`python -m jitkern bench ops` (the new ops against NumPy) runs and prints every op's row."""
    from jitkern.bench.ops import main
    threads = numba.get_num_threads()
    assert main(["--scale", "0.01", "--min-time", "0.001"]) == 0   # no --threads: it sets them process-wide
    assert numba.get_num_threads() == threads
    out = capsys.readouterr().out
    for op in ("cross layer fwd", "cross layer bf16", "adagrad_", "split_sgd_", "embedding_bag_adagrad_exact_",
               "embedding_bag_per_sample_weights_backward", "sigmoid_forward"):
        assert op in out, out
