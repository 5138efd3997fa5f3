"""The fused first-layer weight gradient (ops/weight_grad.py: fp32 linear_backward with need_dx=False
on a narrow input) against the reference, the two-pass GEMM route it replaces, and across threads."""
import contextlib
import importlib

import numba
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from jitkern.codegen import host_target
from jitkern.codegen.simd import tile_for
from jitkern.ops import linear_backward
from jitkern.ops import reference as ref
from isa_switch import isa

G = importlib.import_module("jitkern.ops.gemm")
WG = importlib.import_module("jitkern.ops.weight_grad")
EPS = np.finfo(np.float32).eps
ISAS = ["host", "scalar"] + (["avx2"] if host_target().detected_isa == "avx512" else [])


@contextlib.contextmanager
def two_pass_route():
    """linear_backward's ReLU pass + GEMM route, as before the fused kernel."""
    fits = G.masked_grad_fits
    G.masked_grad_fits = lambda *a: False
    try:
        yield
    finally:
        G.masked_grad_fits = fits


def layer(rng, n, k, m, dead=0.3):
    """x, w, y (a ReLU output with exact zeros), dy."""
    x = rng.standard_normal((n, k), dtype=np.float32)
    y = np.maximum(rng.standard_normal((n, m), dtype=np.float32), 0)
    y[rng.random((n, m)) < dead] = 0.0
    return x, np.zeros((m, k), np.float32), y, rng.standard_normal((n, m), dtype=np.float32)


@pytest.mark.parametrize("name", ["avx512", "avx2", "neon", "scalar"])
def test_the_fused_route_serves_narrow_inputs_on_every_tile(name):
    mr = tile_for(name)[0]
    assert WG.masked_grad_fits(13, mr)  # the dense features of the Criteo configs
    assert not WG.masked_grad_fits(4 * mr, mr)  # wider inputs keep the GEMM route


@pytest.mark.parametrize("path", ISAS)
@given(n=st.one_of(st.integers(1, 300), st.sampled_from([1, 16, 17, 513])), k=st.integers(1, 17),
       m=st.one_of(st.integers(1, 80), st.sampled_from([1, 31, 33, 100, 512, 520])), relu=st.booleans(),
       outs=st.booleans(), seed=st.integers(0, 99))
def test_fused_weight_grad_matches_reference(path, n, k, m, relu, outs, seed):
    # ragged column panels (m not a multiple of NR), several row chunks (m = 512: a chunk is a
    # quarter of L2), one sample, one output
    rng = np.random.default_rng(seed)
    x, w, y, dy = layer(rng, n, k, m)
    act = "relu" if relu else None
    given_dw = np.full((m, k), np.nan, np.float32) if outs else None
    with isa(path):
        dx, dw, db = linear_backward(dy, x, w, y, activation=act, need_dx=False, out_dw=given_dw)
    _, rdw, rdb = ref.linear_backward(dy, x, w, y, activation=act, need_dx=False)
    assert dx is None and (dw is given_dw if outs else dw.flags.c_contiguous)
    ady = np.abs(dy).astype(np.float64)
    for got, want, scale in ((dw, rdw, ady.T @ np.abs(x)), (db, rdb, ady.sum(axis=0))):
        assert got.dtype == np.float32 and got.shape == want.shape
        assert np.all(np.abs(got - want.astype(np.float64)) <= 2 * (n + 4) * EPS * scale + 1e-30)


@pytest.mark.parametrize("path", ISAS)
@pytest.mark.parametrize("act", ["relu", None])
def test_fused_dw_equals_the_two_pass_route_bit_for_bit(path, act):
    # the same fp32 FMAs in the same order as the GEMM's (db: fp32 there too, the ReLU pass float64);
    # without a ReLU dy's full panels are read in place and a ragged last one copied (m = 520)
    rng = np.random.default_rng(7)
    for n, k, m in ((2048, 13, 512), (1100, 13, 520), (300, 13, 200), (5, 1, 3)):
        x, w, y, dy = layer(rng, n, k, m)
        with isa(path):
            _, dw, db = linear_backward(dy, x, w, y, activation=act, need_dx=False)
            with two_pass_route():
                _, dw2, db2 = linear_backward(dy, x, w, y, activation=act, need_dx=False)
        assert np.array_equal(dw.view(np.uint32), dw2.view(np.uint32))
        bound = 2 * (n + 4) * EPS * np.abs(dy).astype(np.float64).sum(axis=0)
        assert np.all(np.abs(db - db2.astype(np.float64)) <= bound)


def test_fused_weight_grad_does_not_depend_on_threads():
    rng = np.random.default_rng(3)
    x, w, y, dy = layer(rng, 1000, 13, 520)
    before = numba.get_num_threads()
    runs = []
    try:
        for threads in sorted({1, numba.config.NUMBA_NUM_THREADS}) * 2:  # run to run, and across threads
            numba.set_num_threads(threads)
            runs.append(linear_backward(dy, x, w, y, activation="relu", need_dx=False)[1:])
    finally:
        numba.set_num_threads(before)
    for dw, db in runs[1:]:
        assert np.array_equal(dw.view(np.uint32), runs[0][0].view(np.uint32))
        assert np.array_equal(db.view(np.uint32), runs[0][1].view(np.uint32))


def test_fused_weight_grad_special_values():
    # y's mask is an ordered compare (NaN y and -0.0 y mask); dy's NaN and inf pass where y > 0 only
    n, k, m = 40, 3, 37
    x = np.ones((n, k), np.float32)
    y = np.ones((n, m), np.float32)
    dy = np.ones((n, m), np.float32)
    y[:, 0], y[:, 1], y[:, 2] = np.nan, -0.0, 0.0
    dy[:, 0] = dy[:, 1] = dy[:, 2] = np.nan
    dy[:, 3] = np.inf
    dy[5, 4] = np.nan
    _, dw, db = linear_backward(dy, x, np.zeros((m, k), np.float32), y, activation="relu", need_dx=False)
    assert np.all(dw[:3] == 0) and np.all(db[:3] == 0)
    assert np.all(np.isinf(dw[3])) and np.isinf(db[3])
    assert np.all(np.isnan(dw[4])) and np.isnan(db[4])
    assert np.all(dw[5:] == n) and np.all(db[5:] == n)

