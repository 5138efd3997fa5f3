"""The cross layer on bf16 operands (BF16Array x0, xl, v, w) against ops.reference's bf16 twins.

Bounds: an fp32 dot product of K terms errs by at most 2 (K + 4) eps of the sum of absolute terms
(the reference run on absolute values); a bf16 result may also land one rounding away on each side
of the float64 value (2^-8 relative). The backward is checked on the kernel's own forward outputs
(u, y), so the only internal bf16 value is du, whose bound is carried into dv and dxl.
"""
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from test_cross import layer_shapes

from jitkern.ops import BF16Array, cross_layer_backward, cross_layer_forward, reference

EPS32 = 2.0 ** -23
U_BF16 = 2.0 ** -8


def acc(k, scale):
    return 2 * (k + 4) * EPS32 * scale + 1e-30


def bf16(rng, *shape):
    return BF16Array.from_float32(rng.standard_normal(shape, dtype=np.float32))


def values(a):
    return (a.to_float32() if isinstance(a, BF16Array) else np.asarray(a)).astype(np.float64)


def assert_within(got, want, bound, what):
    err = np.abs(values(got) - values(want))
    assert err.shape == np.shape(bound) and np.all(err <= bound), f"{what}: max excess {(err - bound).max()}"


@st.composite
def layers(draw):
    rng, B, n, r = draw(layer_shapes())
    x0, xl, v, w = bf16(rng, B, n), bf16(rng, B, n), bf16(rng, r, n), bf16(rng, n, r)
    return x0, xl, v, w, rng.standard_normal(n).astype(np.float32), rng


@given(layers())
def test_forward_matches_reference(p):
    x0, xl, v, w, b, _ = p
    B, n = x0.shape
    r = v.shape[0]
    x_next, u = cross_layer_forward(x0, xl, v, w, b)
    assert isinstance(x_next, BF16Array) and isinstance(u, BF16Array)
    assert x_next.shape == (B, n) and u.shape == (B, r)
    want_u = values(reference.cross_layer_forward_bf16(x0, xl, v, w, b)[1])
    bu = acc(n, np.abs(values(xl)) @ np.abs(values(v)).T)
    assert_within(u, want_u, bu + 2 * U_BF16 * (np.abs(want_u) + bu), "u")
    # x_next from the kernel's own u: y's fp32 dot of r terms, then x0 * y + xl in fp32, rounded to bf16
    x0v, xlv, uv = values(x0), values(xl), values(u)
    want = x0v * (uv @ values(w).T + b) + xlv
    mag = np.abs(x0v) * (np.abs(uv) @ np.abs(values(w)).T + np.abs(b)) + np.abs(xlv)
    bx = acc(r + 2, mag)
    assert_within(x_next, want, bx + 2 * U_BF16 * (np.abs(want) + bx), "x_next")


@given(layers(), st.booleans(), st.booleans(), st.booleans(), st.booleans())
def test_backward_matches_reference(p, accumulate, keep_y, in_place, dx_bf16):
    x0, xl, v, w, b, rng = p
    B, n = x0.shape
    r = v.shape[0]
    y = np.empty((B, n), np.float32) if keep_y else None
    x_next, u = cross_layer_forward(x0, xl, v, w, b, out_y=y)
    d = bf16(rng, B, n) if dx_bf16 else rng.standard_normal((B, n), dtype=np.float32)
    acc0 = rng.standard_normal((B, n), dtype=np.float32) if accumulate else None
    want = reference.cross_layer_backward_bf16(d, x0, xl, u, v, w, b, accumulate_dx0=acc0)
    d_in = d.to_float32() if dx_bf16 and in_place else d.copy() if in_place else d   # in place: d stays intact
    out_dxl = d_in if in_place and not dx_bf16 else None
    got = cross_layer_backward(d_in, x0, xl, u, v, w, b, y=y,
                               accumulate_dx0=None if acc0 is None else acc0.copy(), out_dxl=out_dxl)
    assert all(g.dtype == np.float32 for g in got)
    dx0, dxl, dv, dw, db = got
    dv_, x0v, xlv, uv, vv, wv = (values(a) for a in (d, x0, xl, u, v, w))
    dyb = values(BF16Array.from_float32((dv_ * x0v).astype(np.float32)))      # what the GEMMs read
    # dx0 = d * (y + b): y's fp32 dot of r terms
    mag0 = np.abs(dv_) * (np.abs(uv) @ np.abs(wv).T + np.abs(b)) + (0 if acc0 is None else np.abs(acc0))
    assert_within(dx0, want[0], acc(r + 2, mag0), "dx0")
    assert_within(dw, want[3], acc(B, np.abs(dyb).T @ np.abs(uv)), "dw")
    assert_within(db, want[4], acc(B, np.abs(dv_ * x0v).sum(axis=0)), "db")
    # du = bf16(dyb @ w): within one rounding each side plus its fp32 dot of n terms
    du = dyb @ wv
    bdu = acc(n, np.abs(dyb) @ np.abs(wv))
    bdu = bdu + 2 * U_BF16 * (np.abs(du) + bdu)
    du_mag = np.abs(du) + bdu
    assert_within(dv, want[2], bdu.T @ np.abs(xlv) + acc(B, du_mag.T @ np.abs(xlv)), "dv")
    assert_within(dxl, want[1], bdu @ np.abs(vv) + acc(r + 2, du_mag @ np.abs(vv) + np.abs(dv_)), "dxl")
    if out_dxl is not None:
        assert dxl is out_dxl


def test_bf16_layer_errors():
    rng = np.random.default_rng(0)
    x0, xl, v, w = bf16(rng, 4, 8), bf16(rng, 4, 8), bf16(rng, 2, 8), bf16(rng, 8, 2)
    b = np.zeros(8, np.float32)
    with pytest.raises(TypeError, match="xl must be a BF16Array"):
        cross_layer_forward(x0, xl.to_float32(), v, w, b)
    with pytest.raises(TypeError, match="v must be a BF16Array"):
        cross_layer_forward(x0, xl, v.to_float32(), w, b)
    with pytest.raises(ValueError, match=r"w must have shape \(8, 2\)"):
        cross_layer_forward(x0, xl, v, bf16(rng, 2, 8), b)
    with pytest.raises(TypeError, match="out must be a BF16Array"):
        cross_layer_forward(x0, xl, v, w, b, out=np.empty((4, 8), np.float32))
    x_next, u = cross_layer_forward(x0, xl, v, w, b)
    with pytest.raises(ValueError, match=r"dx_next must have shape \(4, 8\)"):
        cross_layer_backward(np.zeros((4, 7), np.float32), x0, xl, u, v, w, b)
    with pytest.raises(TypeError, match="u must be a BF16Array"):
        cross_layer_backward(np.zeros((4, 8), np.float32), x0, xl, u.to_float32(), v, w, b)
