"""GEMM family against the NumPy references: shapes, transposes, alpha/beta, epilogues, backward."""
import importlib

import numba
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from jitkern.codegen import host_target
from jitkern.codegen.simd import SHORT_ROWS, TILES
from jitkern.ops import BF16Array, batch_reduce_gemm, gemm, linear_backward, linear_forward
from jitkern.ops import reference as ref

import isa_switch

G = importlib.import_module("jitkern.ops.gemm")
GB = importlib.import_module("jitkern.ops.gemm_knobs")
GK = importlib.import_module("jitkern.ops.gemm_kernel")
EPS = np.finfo(np.float32).eps
# 1..300 with the awkward sizes over-represented: 1, primes, around the tile sizes
dims = st.one_of(st.integers(1, 300), st.sampled_from([1, 2, 7, 13, 31, 33, 97, 127, 257, 293]))


def arrays(rng, *shape):
    return rng.standard_normal(shape, dtype=np.float32)


def assert_close(got, want, scale, k):
    """|got - want| within float32 rounding of a length-k reduction of terms bounded by `scale`."""
    assert got.dtype == np.float32 and got.shape == want.shape
    bound = 2 * (k + 4) * EPS * scale + 1e-30
    err = np.abs(got.astype(np.float64) - want.astype(np.float64))
    assert np.all(err <= bound), f"max err {err.max()} > bound {bound.ravel()[np.argmax(err)]}"


@given(m=dims, n=dims, k=dims, ta=st.booleans(), tb=st.booleans(),
       alpha=st.sampled_from([1.0, -0.5, 2.0]), beta=st.sampled_from([0.0, 1.0, -1.5]), seed=st.integers(0, 99))
def test_gemm_matches_reference(m, n, k, ta, tb, alpha, beta, seed):
    rng = np.random.default_rng(seed)
    a = arrays(rng, *((k, m) if ta else (m, k)))
    b = arrays(rng, *((n, k) if tb else (k, n)))
    c = arrays(rng, m, n)
    got = gemm(a, b, c.copy(), trans_a=ta, trans_b=tb, alpha=alpha, beta=beta)
    want = ref.gemm(a, b, c, trans_a=ta, trans_b=tb, alpha=alpha, beta=beta)
    opa, opb = (a.T if ta else a), (b.T if tb else b)
    scale = abs(alpha) * (np.abs(opa).astype(np.float64) @ np.abs(opb)) + abs(beta) * np.abs(c)
    assert_close(got, want, scale, k)


def test_gemm_beta_zero_ignores_out_and_out_none_allocates():
    rng = np.random.default_rng(0)
    a, b = arrays(rng, 9, 5), arrays(rng, 5, 40)
    out = np.full((9, 40), np.nan, np.float32)  # beta == 0: out is write-only, NaN must not leak
    res = gemm(a, b, out)
    assert res is out and np.isfinite(out).all()
    np.testing.assert_allclose(gemm(a, b), a.astype(np.float64) @ b, rtol=1e-5, atol=1e-5)


@given(n=dims, k=dims, m=dims, bias=st.booleans(), act=st.sampled_from([None, "relu"]), seed=st.integers(0, 99))
def test_linear_forward_matches_reference(n, k, m, bias, act, seed):
    rng = np.random.default_rng(seed)
    x, w = arrays(rng, n, k), arrays(rng, m, k)
    b = arrays(rng, m) if bias else None
    got = linear_forward(x, w, b, activation=act)
    want = ref.linear_forward(x, w, b, activation=act)
    scale = np.abs(x).astype(np.float64) @ np.abs(w).T + (np.abs(b) if bias else 0)
    assert_close(got, want, scale, k)
    if act == "relu":
        assert (got >= 0).all()


@given(n=dims, k=dims, m=dims, act=st.sampled_from([None, "relu"]), seed=st.integers(0, 99))
def test_linear_backward_matches_reference(n, k, m, act, seed):
    rng = np.random.default_rng(seed)
    x, w, b = arrays(rng, n, k), arrays(rng, m, k), arrays(rng, m)
    y = ref.linear_forward(x, w, b, activation=act)
    dy = arrays(rng, n, m)
    dx, dw, db = linear_backward(dy, x, w, y, activation=act)
    rdx, rdw, rdb = ref.linear_backward(dy, x, w, y, activation=act)
    ady = np.abs(dy).astype(np.float64)
    assert_close(dx, rdx, ady @ np.abs(w), m)
    assert_close(dw, rdw, ady.T @ np.abs(x), n)
    assert_close(db, rdb, ady.sum(axis=0), n)


@given(n=dims, k=st.sampled_from([1, 3, 13, 17]), m=st.sampled_from([1, 64, 200, 512]),
       act=st.sampled_from([None, "relu"]), need_dx=st.booleans(), outs=st.booleans(), seed=st.integers(0, 99))
def test_linear_backward_narrow_shapes_and_skipped_dx(n, k, m, act, need_dx, outs, seed):
    # narrow K against wide M takes the dw.T = x.T @ g route; M = 1 is the click-logit layer;
    # outs: into caller-given buffers (NaN-filled: every element must be written)
    rng = np.random.default_rng(seed)
    x, w, b = arrays(rng, n, k), arrays(rng, m, k), arrays(rng, m)
    y = ref.linear_forward(x, w, b, activation=act)
    dy = arrays(rng, n, m)
    given_dx = np.full((n, k), np.nan, np.float32) if outs and need_dx else None
    given_dw = np.full((m, k), np.nan, np.float32) if outs else None
    dx, dw, db = linear_backward(dy, x, w, y, activation=act, need_dx=need_dx, out_dx=given_dx, out_dw=given_dw)
    rdx, rdw, rdb = ref.linear_backward(dy, x, w, y, activation=act, need_dx=need_dx)
    ady = np.abs(dy).astype(np.float64)
    assert (dx is None) == (rdx is None) == (not need_dx)
    if outs:
        assert dw is given_dw and dx is given_dx
    if need_dx:
        assert_close(dx, rdx, ady @ np.abs(w), m)
    assert dw.flags.c_contiguous
    assert_close(dw, rdw, ady.T @ np.abs(x), n)
    assert_close(db, rdb, ady.sum(axis=0), n)


# lengths around the matrix-vector kernels' 256-output chunks, and K from empty to long
thin = st.one_of(st.integers(2, 300), st.sampled_from([255, 256, 257, 511, 513, 2048]))


@given(long=thin, k=st.one_of(st.integers(0, 40), st.sampled_from([255, 256, 2048])), column=st.booleans(),
       ta=st.booleans(), tb=st.booleans(), alpha=st.sampled_from([1.0, -0.5]),
       beta=st.sampled_from([0.0, 1.0, -1.5]), seed=st.integers(0, 99))
def test_matrix_vector_gemm_matches_reference(long, k, column, ta, tb, alpha, beta, seed):
    # a C with one column (m x 1) or one row (1 x n) takes the matrix-vector kernels
    m, n = (long, 1) if column else (1, long)
    rng = np.random.default_rng(seed)
    a = arrays(rng, *((k, m) if ta else (m, k)))
    b = arrays(rng, *((n, k) if tb else (k, n)))
    c = arrays(rng, m, n)
    c[0, 0] = np.nan if beta == 0.0 else c[0, 0]  # beta == 0: C is never read
    got = gemm(a, b, c.copy(), trans_a=ta, trans_b=tb, alpha=alpha, beta=beta)
    want = ref.gemm(a, b, np.nan_to_num(c), trans_a=ta, trans_b=tb, alpha=alpha, beta=beta)
    opa, opb = (a.T if ta else a), (b.T if tb else b)
    scale = abs(alpha) * (np.abs(opa).astype(np.float64) @ np.abs(opb)) + abs(beta) * np.abs(np.nan_to_num(c))
    assert_close(got, want, scale, k)


@given(long=thin, k=st.integers(1, 300), act=st.sampled_from([None, "relu"]), one_out=st.booleans(),
       seed=st.integers(0, 99))
def test_linear_layers_with_one_output_or_one_sample(long, k, act, one_out, seed):
    # 256 -> 1 (the click logit) forward and backward, and a batch of one sample
    n, m = (long, 1) if one_out else (1, long)
    rng = np.random.default_rng(seed)
    x, w, b = arrays(rng, n, k), arrays(rng, m, k), arrays(rng, m)
    y = linear_forward(x, w, b, activation=act)
    scale = np.abs(x).astype(np.float64) @ np.abs(w).T + np.abs(b)
    assert_close(y, ref.linear_forward(x, w, b, activation=act), scale, k)
    dy = arrays(rng, n, m)
    dx, dw, db = linear_backward(dy, x, w, y, activation=act)
    rdx, rdw, rdb = ref.linear_backward(dy, x, w, y, activation=act)
    ady = np.abs(dy).astype(np.float64)
    assert_close(dx, rdx, ady @ np.abs(w), m)
    assert_close(dw, rdw, ady.T @ np.abs(x), n)
    assert_close(db, rdb, ady.sum(axis=0), n)


def test_matrix_vector_relu_keeps_nan_and_results_do_not_depend_on_threads():
    rng = np.random.default_rng(5)
    x, w, b = arrays(rng, 1000, 70), arrays(rng, 1, 70), arrays(rng, 1)
    x[3, 5] = np.nan
    before = numba.get_num_threads()
    try:
        runs = []
        for threads in sorted({1, numba.config.NUMBA_NUM_THREADS}):
            numba.set_num_threads(threads)
            runs.append((linear_forward(x, w, b, activation="relu"), gemm(x, x[:1], trans_b=True),
                         gemm(x, x[:, :1], trans_a=True)))
    finally:
        numba.set_num_threads(before)
    assert np.isnan(runs[0][0][3, 0]) and (np.nan_to_num(runs[0][0]) >= 0).all()
    for got, first in zip(runs[-1], runs[0]):
        np.testing.assert_array_equal(got, first)


@given(m=dims, n=dims, bias=st.booleans(), relu=st.booleans(), seed=st.integers(0, 9))
def test_transpose_into_matches_numpy(m, n, bias, relu, seed):
    rng = np.random.default_rng(seed)
    src, b = arrays(rng, m, n), arrays(rng, m)
    src[rng.integers(m), rng.integers(n)] = np.nan
    dst = np.full((n, m), np.inf, np.float32)
    want = src.T + b if bias else src.T.copy()  # src is scratch: an epilogue is applied to it in place
    G.transpose_into(src, dst, b if bias else None, relu)
    np.testing.assert_array_equal(dst, np.where(want < 0, 0, want) if relu else want)  # NaN stays NaN


@given(n=dims, k=dims, m=dims, bias=st.booleans(), act=st.sampled_from([None, "relu"]), seed=st.integers(0, 99))
def test_forward_layouts_give_identical_bits(n, k, m, bias, act, seed):
    # y = x @ w.T and y.T = w @ x.T run the same FMA chain per element: which one the layout knob
    # picks (small batches: transposed) must not change a bit
    rng = np.random.default_rng(seed)
    x, w, b = arrays(rng, n, k), arrays(rng, m, k), arrays(rng, m) if bias else None
    x[rng.integers(n), rng.integers(k)] = np.nan
    direct, transposed = (G._forward(x, w, b, np.empty((n, m), np.float32), act == "relu", t) for t in (False, True))
    np.testing.assert_array_equal(direct, transposed)


@given(n=dims, k=dims, m=dims, seed=st.integers(0, 99))
def test_weight_grad_layouts_give_identical_bits(n, k, m, seed):
    # dw = g.T @ x and dw.T = x.T @ g run the same FMA chain per element: the layout knob's choice
    # (gemm.layout.linear_dw) must not change a bit
    rng = np.random.default_rng(seed)
    g, x = arrays(rng, n, m), arrays(rng, n, k)
    direct, transposed = (G._weight_grad(g, x, np.empty((m, k), np.float32), t) for t in (False, True))
    np.testing.assert_array_equal(direct, transposed)
    assert_close(direct, g.T.astype(np.float64) @ x, np.abs(g.T).astype(np.float64) @ np.abs(x), n)


def test_weight_grad_layout_follows_the_register_tile():
    # dw.T where it fills many more of the tile's lanes (an input MR wide: dw.T's rows fill one row
    # tile, dw's columns MR of NR lanes); dw at equal use
    mr, nr, _ = GB.tile_shape()
    t = numba.get_num_threads()
    assert G.DW_LAYOUT.heuristic((4 * nr, mr, 2048, t))["transposed"] == (nr > mr)
    assert not G.DW_LAYOUT.heuristic((4 * nr, 8 * nr, 2048, t))["transposed"]
    assert not G.DW_LAYOUT.heuristic((nr // 2 + 1, 4 * nr, 2048, t))["transposed"]


def test_small_batches_run_transposed_large_ones_directly():
    threads = numba.get_num_threads()
    assert G.FORWARD_LAYOUT.heuristic((32, 1024, 1024, threads))["transposed"]
    assert not G.FORWARD_LAYOUT.heuristic((2048, 1024, 1024, threads))["transposed"]
    assert not G.FORWARD_LAYOUT.heuristic((1, 1024, 1024, threads))["transposed"]  # the matrix-vector kernel


@given(nb=st.integers(1, 5), m=dims, k=st.integers(1, 80), n=dims, beta=st.sampled_from([0.0, 0.5]),
       seed=st.integers(0, 99))
def test_batch_reduce_gemm_matches_reference(nb, m, k, n, beta, seed):
    rng = np.random.default_rng(seed)
    a, b, c = arrays(rng, nb, m, k), arrays(rng, nb, k, n), arrays(rng, m, n)
    got = batch_reduce_gemm(a, b, c.copy(), alpha=2.0, beta=beta)
    want = ref.batch_reduce_gemm(a, b, c, alpha=2.0, beta=beta)
    scale = 2 * np.einsum("imk,ikn->mn", np.abs(a).astype(np.float64), np.abs(b)) + beta * np.abs(c)
    assert_close(got, want, scale, nb * k)


def test_views_and_layouts_are_accepted():
    rng = np.random.default_rng(1)
    a = arrays(rng, 40, 60)
    b = arrays(rng, 30, 60)
    want = a.astype(np.float64) @ b.T
    # an F-ordered operand flips the transposition flag instead of copying; a strided view is copied
    np.testing.assert_allclose(gemm(a, np.asfortranarray(b.T)), want, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(gemm(a[:, ::2], b[:, ::2].T), a[:, ::2].astype(np.float64) @ b[:, ::2].T,
                               rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(linear_forward(a[::2], b), want[::2], rtol=1e-4, atol=1e-4)


def test_empty_dimensions():
    z = np.zeros((0, 5), np.float32)
    assert gemm(z, np.ones((5, 3), np.float32)).shape == (0, 3)
    out = gemm(np.ones((4, 0), np.float32), np.ones((0, 3), np.float32))
    np.testing.assert_array_equal(out, np.zeros((4, 3)))
    y = linear_forward(np.ones((4, 0), np.float32), np.ones((3, 0), np.float32), np.full(3, -1, np.float32),
                       activation="relu")
    np.testing.assert_array_equal(y, np.zeros((4, 3)))
    dx, dw, db = linear_backward(np.ones((0, 3), np.float32), np.ones((0, 2), np.float32),
                                 np.ones((3, 2), np.float32))
    assert dx.shape == (0, 2) and (dw == 0).all() and (db == 0).all()
    for need_dx in (True, False):  # a layer of no outputs, and one of no inputs
        dx, dw, db = linear_backward(np.ones((5, 0), np.float32), np.ones((5, 2), np.float32),
                                     np.ones((0, 2), np.float32), need_dx=need_dx)
        assert dw.shape == (0, 2) and db.shape == (0,) and (dx is None or (dx.shape == (5, 2) and (dx == 0).all()))
        dx, dw, db = linear_backward(np.ones((5, 3), np.float32), np.ones((5, 0), np.float32),
                                     np.ones((3, 0), np.float32), np.ones((5, 3), np.float32), activation="relu",
                                     need_dx=need_dx)
        assert dw.shape == (3, 0) and (db == 5).all() and (dx is None or dx.shape == (5, 0))


def test_nan_and_inf_propagate():
    rng = np.random.default_rng(2)
    x, w, b = arrays(rng, 20, 50), arrays(rng, 40, 50), arrays(rng, 40)
    x[3, 7] = np.nan
    x[5, 1] = np.inf
    y = linear_forward(x, w, b, activation="relu")
    assert np.isnan(y[3]).all()  # relu(NaN) stays NaN
    want = ref.linear_forward(x, w, b, activation="relu")
    np.testing.assert_array_equal(np.isnan(y), np.isnan(want))
    np.testing.assert_array_equal(np.isinf(y), np.isinf(want))
    ok = np.isfinite(want)
    np.testing.assert_allclose(y[ok], want[ok], rtol=1e-4, atol=1e-4)


def test_relu_mask_zeroes_nan_gradients_where_inactive():
    x, w = np.ones((2, 3), np.float32), np.ones((2, 3), np.float32)
    y = np.array([[1.0, 0.0], [0.0, 2.0]], np.float32)
    dy = np.array([[1.0, np.nan], [np.inf, 3.0]], np.float32)  # non-finite only where y <= 0
    dx, dw, db = linear_backward(dy, x, w, y, activation="relu")
    np.testing.assert_array_equal(db, [1.0, 3.0])
    np.testing.assert_array_equal(dx, [[1, 1, 1], [3, 3, 3]])
    np.testing.assert_array_equal(dw, [[1, 1, 1], [3, 3, 3]])


def relu_output(rng, n, k):
    """A ReLU's output: positive values, exact +0.0 and -0.0, and a NaN (masked like an inactive unit)."""
    x = np.maximum(arrays(rng, n, k), np.float32(0.0))
    x[rng.random((n, k)) < 0.1] = np.float32(-0.0)
    x.flat[rng.integers(0, n * k)] = np.nan
    return x


@given(n=dims, k=dims, m=dims, act=st.sampled_from([None, "relu"]), outs=st.booleans(), by_mask=st.booleans(),
       seed=st.integers(0, 99))
def test_input_relu_masks_dx_exactly_as_a_separate_relu_backward(n, k, m, act, outs, by_mask, seed):
    # dx masked in the dx GEMM's epilogue (or after the matrix-vector kernels), by x or by its
    # byte mask x > 0, = the unmasked dx with x's inactive units (x <= 0 or NaN) set to +0.0, bit
    # for bit; dw and db unchanged
    rng = np.random.default_rng(seed)
    x, w = relu_output(rng, n, k), arrays(rng, m, k)
    y, dy = np.maximum(arrays(rng, n, m), 0), arrays(rng, n, m)
    given_dx = np.full((n, k), np.nan, np.float32) if outs else None
    x_mask = x > 0 if by_mask else None
    dx, dw, db = linear_backward(dy, x, w, y, activation=act, input_relu=True, out_dx=given_dx, x_mask=x_mask)
    pdx, pdw, pdb = linear_backward(dy, x, w, y, activation=act)
    want = np.where(x > 0, pdx, np.float32(0.0))
    np.testing.assert_array_equal(dx.view(np.uint32), want.view(np.uint32))
    np.testing.assert_array_equal(dw, pdw)
    np.testing.assert_array_equal(db, pdb)
    rdx = ref.linear_backward(dy, x, w, y, activation=act, input_relu=True, x_mask=x_mask)[0]
    assert_close(dx, rdx, np.abs(dy).astype(np.float64) @ np.abs(w), m)


@given(m=dims, n=dims, k=st.integers(1, 200), mc=st.sampled_from([6, 12, 30]), kc=st.sampled_from([4, 16, 64]),
       nc=st.sampled_from([16, 48, 512]), kind=st.sampled_from(["float32", "bool", "uint8"]), seed=st.integers(0, 99))
def test_gemm_mask_over_k_passes_blocks_and_edge_tiles(m, n, k, mc, kc, nc, kind, seed):
    # small blocks: several K passes (the mask must not cut partial sums), row and column blocks,
    # and edge tiles (masked in the scalar copy-out); a ReLU output, or its byte mask (uint8: any
    # nonzero byte keeps)
    rng = np.random.default_rng(seed)
    a, b, mask = arrays(rng, m, k), arrays(rng, k, n), relu_output(rng, m, n)
    given = {"float32": mask, "bool": mask > 0, "uint8": (mask > 0) * rng.integers(1, 256, (m, n)).astype(np.uint8)}
    blocks = GB.shape_blocks({"mc": mc, "kc": kc}, m, n, k, 1)
    plain = GB.gemm_into(a, b, np.empty((m, n), np.float32), False, False, blocks)
    got = GB.gemm_into(a, b, np.empty((m, n), np.float32), False, False, blocks, mask=given[kind])
    np.testing.assert_array_equal(got.view(np.uint32), np.where(mask > 0, plain, np.float32(0.0)).view(np.uint32))


@given(m=dims, n=dims, k=st.integers(1, 200), mc=st.sampled_from([6, 12, 30]), kc=st.sampled_from([4, 16, 64]),
       bias=st.booleans(), relu=st.booleans(), seed=st.integers(0, 99))
def test_gemm_mask_out_is_the_outputs_sign_over_blocks_and_edge_tiles(m, n, k, mc, kc, bias, relu, seed):
    # the epilogue writes C > 0 (NaN: False) as bytes, in full and edge tiles, after the last K
    # pass only; C itself is bit for bit what it is without the mask
    rng = np.random.default_rng(seed)
    a, b, bv = arrays(rng, m, k), arrays(rng, k, n), arrays(rng, n) if bias else None
    a[rng.integers(0, m), rng.integers(0, k)] = np.nan
    blocks = GB.shape_blocks({"mc": mc, "kc": kc}, m, n, k, 1)
    plain = GB.gemm_into(a, b, np.empty((m, n), np.float32), False, False, blocks, bias=bv, relu=relu)
    mask = np.ones((m, n), np.bool_)
    got = GB.gemm_into(a, b, np.empty((m, n), np.float32), False, False, blocks, bias=bv, relu=relu, mask_out=mask)
    np.testing.assert_array_equal(got.view(np.uint32), plain.view(np.uint32))
    np.testing.assert_array_equal(mask, plain > 0)


@given(n=dims, k=dims, m=dims, bias=st.booleans(), transposed=st.booleans(), seed=st.integers(0, 99))
def test_linear_forward_out_mask_in_both_layouts(n, k, m, bias, transposed, seed):
    # out_mask = y > 0 whichever layout ran the GEMM, and y unchanged by asking for it
    rng = np.random.default_rng(seed)
    x, w, b = arrays(rng, n, k), arrays(rng, m, k), arrays(rng, m) if bias else None
    want = G._forward(x, w, b, np.empty((n, m), np.float32), True, transposed)
    mask = np.zeros((n, m), np.bool_)
    got = G._forward(x, w, b, np.empty((n, m), np.float32), True, transposed, mask)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    np.testing.assert_array_equal(mask, want > 0)
    public = np.zeros((n, m), np.bool_)
    linear_forward(x, w, b, activation="relu", out_mask=public)
    np.testing.assert_array_equal(public, want > 0)


@given(m=st.integers(1, 40), n=st.integers(2, 300), k=st.integers(2, 200), kc=st.sampled_from([4, 16, 64]),
       ta=st.booleans(), alpha=st.sampled_from([1.0, -0.5]), beta=st.sampled_from([0.0, 1.0, -1.5]), bias=st.booleans(),
       relu=st.booleans(), seed=st.integers(0, 99))
def test_fused_b_pack_of_one_row_block_matches_b_packed_whole(m, n, k, kc, ta, alpha, beta, bias, relu, seed):
    # a transposed B under one row block is packed panel by panel as the tiles need it (ragged
    # panels zero-padded, each K pass its own slice); several row blocks pack it whole first.
    # Both run the same FMA chains: identical bits, and the reference within rounding
    m += GB.tile_shape()[0]  # more rows than one tile: a second row block exists
    rng = np.random.default_rng(seed)
    a, b = arrays(rng, k, m) if ta else arrays(rng, m, k), arrays(rng, n, k)
    c0, bv = arrays(rng, m, n), arrays(rng, n) if bias else None
    kw = dict(alpha=alpha, beta=beta, bias=bv, relu=relu)
    one = GB.shape_blocks({"mc": m, "kc": kc}, m, n, k, 1)
    many = GB.shape_blocks({"mc": 1, "kc": kc}, m, n, k, 1)
    assert one[0] >= m and many[0] < m
    fused = GB.gemm_into(a, b, c0.copy(), ta, True, one, **kw)
    whole = GB.gemm_into(a, b, c0.copy(), ta, True, many, **kw)
    np.testing.assert_array_equal(fused.view(np.uint32), whole.view(np.uint32))
    want = alpha * ((a.T if ta else a).astype(np.float64) @ b.T.astype(np.float64)) + beta * c0
    want = want + bv if bias else want
    want = np.maximum(want, 0) if relu else want
    assert_close(fused, want.astype(np.float32), np.abs(a).max() * np.abs(b).max() * k + np.abs(c0).max() + 1, k)


@pytest.mark.parametrize("isa", ["avx2", "scalar"])
@given(rows=st.integers(0, 40), n=st.sampled_from([512, 1024, 300, 1000]), k=st.integers(2, 700),
       kc=st.sampled_from([16, 64, 256]), ncp=st.sampled_from([1, 3, 1000]), ta=st.booleans(),
       alpha=st.sampled_from([1.0, -0.5]), beta=st.sampled_from([0.0, 1.0, -1.5]), bias=st.booleans(),
       relu=st.booleans(), seed=st.integers(0, 99))
def test_one_row_block_packs_b_by_pass_with_the_bits_of_b_packed_whole(isa, rows, n, k, kc, ncp, ta, alpha, beta,
                                                                        bias, relu, seed):
    # one row block over a packed (k, n) B in K passes (a small batch's dx): the driver packs B a
    # pass at a time (ragged last panels, several column blocks); in one pass it packs B whole
    # first. The same FMA chains: identical bits
    if isa == "avx2" and host_target().detected_isa not in ("avx2", "avx512"):
        pytest.skip("host has no AVX2")
    with isa_switch.isa(isa):
        mr, nr, _ = GB.tile_shape()
        # B is read in place for fewer than 16 row tiles unless its row stride is 2 KiB-aligned
        m = rows + (2 * mr + 1 if n % 512 == 0 else 16 * mr)
        rng = np.random.default_rng(seed)
        a, b = arrays(rng, k, m) if ta else arrays(rng, m, k), arrays(rng, k, n)
        c0, bv = arrays(rng, m, n), arrays(rng, n) if bias else None
        kw = dict(alpha=alpha, beta=beta, bias=bv, relu=relu)
        assert not GB.b_in_place(False, m, n, mr, nr)
        passes = GB.gemm_into(a, b, c0.copy(), ta, False, (GB._round_to(m, mr), kc, ncp * nr), **kw)
        whole = GB.gemm_into(a, b, c0.copy(), ta, False, (GB._round_to(m, mr), k, ncp * nr), **kw)
    np.testing.assert_array_equal(passes.view(np.uint32), whole.view(np.uint32))
    want = alpha * ((a.T if ta else a).astype(np.float64) @ b.astype(np.float64)) + beta * c0
    want = want + bv if bias else want
    want = np.maximum(want, 0) if relu else want
    assert_close(passes, want.astype(np.float32), np.abs(a).max() * np.abs(b).max() * k + np.abs(c0).max() + 1, k)


@pytest.mark.parametrize("n", [512, 1024, 1000])
@pytest.mark.parametrize("k", [300, 1100])
def test_b_read_in_place_matches_b_packed(n, k):
    # a small batch's dx reads B's rows where they lie (2 KiB-multiple strides included, the next
    # panel hinted ahead, K passes that keep a pass's rows in L2); B given transposed is packed
    # instead. The same FMA chains either way: identical bits, for the heuristic's blocks and others
    mr, nr, _ = GB.tile_shape()
    rng = np.random.default_rng(n + k)
    for m in (3 * mr + 1, 40):
        a, b = arrays(rng, m, k), arrays(rng, k, n)
        packed = GB.gemm_into(a, np.ascontiguousarray(b.T), np.empty((m, n), np.float32), False, True,
                             GB.shape_blocks({"mc": m, "kc": k}, m, n, k, 1))
        for blocks in (GB.blocks_for("linear_dx", m, n, k, 1), GB.shape_blocks({"mc": 2 * mr, "kc": 64}, m, n, k, 1)):
            got = GB.gemm_into(a, b, np.empty((m, n), np.float32), False, False, blocks)
            np.testing.assert_array_equal(got.view(np.uint32), packed.view(np.uint32))
        assert_close(packed, a.astype(np.float64) @ b.astype(np.float64), np.abs(a).max() * np.abs(b).max(), k)


STRIDED_ISAS = ["host", "scalar"] + (["avx2"] if host_target().detected_isa == "avx512" else [])


def _in_wider(rng, x, pad):
    """x copied into columns off .. off + w of a wider random array: a view whose rows are
    pad floats further apart than its width (pad 0: x itself)."""
    if pad == 0:
        return x
    rows, w = x.shape
    off = int(rng.integers(0, pad + 1))
    wide = arrays(rng, rows, w + pad)
    view = wide[:, off:off + w]
    view[...] = x
    return view


@pytest.mark.parametrize("isa", STRIDED_ISAS)
@given(m=dims, n=dims, k=dims, ta=st.booleans(), tb=st.booleans(), pads=st.tuples(*[st.sampled_from([0, 1, 3, 16, 29])] * 3),
       stride512=st.booleans(), mc=st.sampled_from([1, 2, 1000]), kc=st.sampled_from([8, 64, 512]),
       ncp=st.sampled_from([1, 3, 1000]), alpha=st.sampled_from([1.0, -0.5]), beta=st.sampled_from([0.0, 1.0, -1.5]),
       bias=st.booleans(), relu=st.booleans(), masked=st.sampled_from([None, "mask", "mask_out"]), seed=st.integers(0, 99))
def test_row_strided_operands_give_the_bits_of_their_contiguous_copies(isa, m, n, k, ta, tb, pads, stride512, mc, kc,
                                                                        ncp, alpha, beta, bias, relu, masked, seed):
    # A, B and C as column slices of wider arrays are read and written at their row strides (B's
    # stride, a 2 KiB multiple or not, decides whether its rows are read in place or packed; a
    # transposed B under one row block packs fused panels, long K passes by pass): the same
    # FMA chains as on contiguous copies with the same blocks, so the same bits, and nothing
    # outside C's columns is written. Masks and the matrix-vector paths take contiguous copies.
    rng = np.random.default_rng(seed)
    a, b = arrays(rng, k, m) if ta else arrays(rng, m, k), arrays(rng, n, k) if tb else arrays(rng, k, n)
    c0, bv = arrays(rng, m, n), arrays(rng, n) if bias else None
    pa, pb, pc = pads
    if stride512 and not tb:  # B's rows 512 floats apart: packed where a contiguous B of n columns is read in place
        pb = 512 - n % 512 if n % 512 else 0
    with isa_switch.isa(isa):
        mr, nr, _ = GB.tile_shape()
        blocks = GB.shape_blocks({"mc": mc * mr, "kc": kc}, m, n, k, 1)
        blocks = (blocks[0], blocks[1], min(blocks[2], ncp * nr))
        mask = arrays(rng, m, n) if masked == "mask" else None
        outs = [np.zeros((m, n), np.bool_) if masked == "mask_out" else None for _ in range(2)]
        kw = dict(alpha=alpha, beta=beta, bias=bv, relu=relu, mask=mask)
        want = GB.gemm_into(a, b, c0.copy(), ta, tb, blocks, mask_out=outs[0], **kw)
        av, bv_, cv = _in_wider(rng, a, pa), _in_wider(rng, b, pb), _in_wider(rng, c0.copy(), pc)
        around = None if cv.base is None else cv.base.copy()
        got = GB.gemm_into(av, bv_, cv, ta, tb, blocks, mask_out=outs[1], **kw)
    assert got is cv
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    if masked == "mask_out":
        np.testing.assert_array_equal(outs[1], outs[0])
    if around is not None:  # the wider array changed in C's columns only
        off = (cv.ctypes.data - cv.base.ctypes.data) // 4
        around[:, off:off + n] = cv
        np.testing.assert_array_equal(cv.base.view(np.uint32), around.view(np.uint32))


# (m, n, k, tb, row blocks, kc, B's row stride - n): one case per way the driver takes B
B_PATHS = {"in place": (40, 300, 260, False, 1, 64, 10), "2 KiB rows packed": (40, 300, 260, False, 1, 64, 212),
           "one row block by pass": (200, 300, 260, False, 1, 64, 10), "packed whole": (200, 300, 260, False, 9, 64, 10),
           "packed by pass": (120, 300, 700, False, 5, 64, 10), "fused transposed": (40, 70, 300, True, 1, 64, 9),
           "transposed packed whole": (200, 70, 300, True, 9, 64, 9)}


@pytest.mark.parametrize("isa", STRIDED_ISAS)
@pytest.mark.parametrize("path", B_PATHS)
@pytest.mark.parametrize("ta", [False, True])
def test_every_b_path_reads_row_strided_operands(isa, path, ta):
    # each of the driver's ways to take B (read in place, packed whole, by K pass under one row block
    # or several, per panel when transposed) on operands and an output whose rows are wider apart than they
    # are long: the bits of their contiguous copies
    m, n, k, tb, nblocks, kc, pad = B_PATHS[path]
    rng = np.random.default_rng(len(path))
    with isa_switch.isa(isa):
        mr, nr, _ = GB.tile_shape()
        blocks = GB.shape_blocks({"mc": GB._round_to(-(-m // nblocks), mr), "kc": kc}, m, n, k, 1)
        a, b = arrays(rng, k, m) if ta else arrays(rng, m, k), arrays(rng, n, k) if tb else arrays(rng, k, n)
        c0 = arrays(rng, m, n)
        kw = dict(alpha=-0.5, beta=1.0, bias=arrays(rng, n), relu=True)
        want = GB.gemm_into(a, b, c0.copy(), ta, tb, blocks, **kw)
        got = GB.gemm_into(_in_wider(rng, a, 5), _in_wider(rng, b, pad), _in_wider(rng, c0.copy(), 3), ta, tb, blocks,
                          **kw)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("isa", ["avx512", "avx2", "neon", "scalar"])
def test_tail_tiles_cover_a_block_in_whole_short_tiles_or_not_at_all(isa):
    # a block's rows: full tiles, the last of them an edge tile, or full tiles and then short ones
    # that end exactly at the block's last row, never costing more rows of FMAs than the edge tile
    mr, sr = TILES[isa][0], SHORT_ROWS[isa]
    for mcb in range(1, 100):
        full, short = GK.tail_tiles(mcb, mr, sr)
        if short:
            assert full * mr + short * sr == mcb
        else:
            assert full == -(-mcb // mr)
        assert full * mr + short * sr <= -(-mcb // mr) * mr
    if isa == "avx2":  # the 32-row GEMMs of a data-parallel step on 64 ranks
        assert GK.tail_tiles(32, mr, sr) == (4, 2)


@pytest.mark.parametrize("isa", STRIDED_ISAS)
@given(m=st.integers(2, 70), n=st.integers(2, 300), k=st.integers(2, 300), blocks=st.sampled_from([1, 2, 3]),
       kc=st.sampled_from([8, 64, 512]), ta=st.booleans(), one_panel=st.booleans(), beta=st.sampled_from([0.0, 1.0, -1.5]),
       bias=st.booleans(), relu=st.booleans(), masked=st.sampled_from([None, "mask", "mask_out"]), seed=st.integers(0, 99))
def test_rows_in_short_tail_tiles_get_the_bits_of_full_tiles(isa, m, n, k, blocks, kc, ta, one_panel, beta, bias, relu,
                                                             masked, seed):
    # the rows a block ends with (read in place from A: plain, or transposed with one column panel
    # per block) run short tiles where tail_tiles says so; each C row must keep the bits it gets
    # when its block is whole tiles (A and C with rows appended), masks and epilogues included
    # (one row, one column or K = 1 take the matrix-vector and outer-product paths, no tile)
    rng = np.random.default_rng(seed)
    with isa_switch.isa(isa):
        mr, nr, _ = GB.tile_shape()
        mc = GB._round_to(-(-m // blocks), mr)
        tall = -(-m // mc) * mc + mr  # every block of the tall GEMM is whole tiles
        a, b = arrays(rng, k, tall) if ta else arrays(rng, tall, k), arrays(rng, k, n)
        c0, bv, mask = arrays(rng, tall, n), arrays(rng, n) if bias else None, arrays(rng, tall, n)
        ncap = nr if one_panel or ta else n
        outs = [np.zeros((rows, n), np.bool_) if masked == "mask_out" else None for rows in (tall, m)]
        kw = dict(beta=beta, bias=bv, relu=relu)
        shaped = [GB.shape_blocks({"mc": mc, "kc": kc}, rows, n, k, 1) for rows in (tall, m)]
        shaped = [(mcb, kcb, min(ncb, ncap)) for mcb, kcb, ncb in shaped]
        want = GB.gemm_into(a, b, c0.copy(), ta, False, shaped[0], mask_out=outs[0],
                            mask=mask if masked == "mask" else None, **kw)
        a_m = a[:, :m] if ta else a[:m]
        got = GB.gemm_into(np.ascontiguousarray(a_m), b, c0[:m].copy(), ta, False, shaped[1], mask_out=outs[1],
                           mask=mask[:m].copy() if masked == "mask" else None, **kw)
    np.testing.assert_array_equal(got.view(np.uint32), want[:m].view(np.uint32))
    if masked == "mask_out":
        np.testing.assert_array_equal(outs[1], outs[0][:m])


def test_gemm_op_takes_column_slices_in_place():
    # the public op reads column slices of a wider array (or their transposes) and writes into one:
    # out is the view itself, every other column keeps its bits, and the overlap check tells
    # sibling slices of one array from overlapping ones
    rng = np.random.default_rng(5)
    buf = arrays(rng, 70, 300)
    a, b, out = buf[:, :40], buf[:40, 100:140], buf[:, 250:290]
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    before = buf.copy()
    assert gemm(a, b, out=out) is out
    before[:, 250:290] = out
    np.testing.assert_array_equal(buf.view(np.uint32), before.view(np.uint32))
    assert_close(out, a64 @ b64, np.abs(a64) @ np.abs(b64), 40)
    with pytest.raises(ValueError, match="out must not overlap the inputs"):
        gemm(a, b, out=buf[:, 20:60])
    t = buf[:40, 100:233].T  # (133, 40), its columns contiguous: taken transposed, in place
    t64 = t.astype(np.float64)
    assert_close(gemm(t, t, trans_b=True), t64 @ t64.T, np.abs(t64) @ np.abs(t64).T, 40)
    with pytest.raises(ValueError, match="out must have contiguous rows"):
        gemm(a, b, out=np.zeros((70, 80), np.float32)[:, ::2])


@pytest.mark.parametrize("m,n", [(2048, 256), (7, 33), (2, 2)])
@pytest.mark.parametrize("alpha", [1.0, -0.5])
def test_k1_outer_product_path_with_every_epilogue(m, n, alpha):
    # K = 1 (the click-logit layer's dx) runs as an outer product: C written once, NaN-filled first
    rng = np.random.default_rng(m + n)
    a, b, bias, mask = arrays(rng, m, 1), arrays(rng, 1, n), arrays(rng, n), relu_output(rng, m, n)
    for kw in ({}, {"bias": bias}, {"bias": bias, "relu": True}, {"mask": mask}, {"bias": bias, "mask": mask},
               {"mask": mask > 0}, {"bias": bias, "relu": True, "mask_out": np.zeros((m, n), np.bool_)}):
        c = np.full((m, n), np.nan, np.float32)
        got = GB.gemm_into(a, b, c, False, False, GB.shape_blocks({"mc": 12, "kc": 1}, m, n, 1, 1), alpha=alpha, **kw)
        want = (np.float32(alpha) * a) * b  # one rounding of each product, as the register tile's
        want = want + bias if "bias" in kw else want
        want = np.maximum(want, 0) if kw.get("relu") else want
        want = np.where(mask > 0, want, np.float32(0.0)) if "mask" in kw else want
        np.testing.assert_array_equal(got.view(np.uint32), want.astype(np.float32).view(np.uint32))
        if "mask_out" in kw:
            np.testing.assert_array_equal(kw["mask_out"], want > 0)


def test_input_relu_needs_dx():
    f32 = np.ones((4, 3), np.float32)
    with pytest.raises(ValueError, match="input_relu=True masks dx, but need_dx is False"):
        linear_backward(np.ones((4, 2), np.float32), f32, np.ones((2, 3), np.float32), need_dx=False,
                        input_relu=True)


def test_relu_masks_are_checked():
    x, w, dy = np.ones((4, 3), np.float32), np.ones((2, 3), np.float32), np.ones((4, 2), np.float32)
    with pytest.raises(ValueError, match="out_mask .* needs activation='relu'"):
        linear_forward(x, w, out_mask=np.zeros((4, 2), np.bool_))
    with pytest.raises(TypeError, match="out_mask must be a bool"):
        linear_forward(x, w, activation="relu", out_mask=np.zeros((4, 2), np.uint8))
    with pytest.raises(ValueError, match=r"out_mask must have shape \(4, 2\)"):
        linear_forward(x, w, activation="relu", out_mask=np.zeros((2, 4), np.bool_))
    with pytest.raises(ValueError, match="x_mask .* needs input_relu=True"):
        linear_backward(dy, x, w, x_mask=np.ones((4, 3), np.bool_))
    with pytest.raises(TypeError, match="x_mask must have dtype bool"):
        linear_backward(dy, x, w, input_relu=True, x_mask=x)
    with pytest.raises(ValueError, match=r"x_mask must have shape \(4, 3\)"):
        linear_backward(dy, x, w, input_relu=True, x_mask=np.ones((3, 4), np.bool_))
    xb, wb = BF16Array.from_float32(x), BF16Array.from_float32(w)
    with pytest.raises(ValueError, match="out_mask is for float32 layers"):
        linear_forward(xb, wb, activation="relu", out_mask=np.zeros((4, 2), np.bool_))
    with pytest.raises(ValueError, match="x_mask is for float32 layers"):
        linear_backward(dy, xb, wb, input_relu=True, x_mask=np.ones((4, 3), np.bool_))


def test_parallel_results_are_deterministic_across_thread_counts():
    rng = np.random.default_rng(3)
    x, w, b = arrays(rng, 700, 333), arrays(rng, 130, 333), arrays(rng, 130)
    dy = arrays(rng, 700, 130)
    before = numba.get_num_threads()
    try:
        runs = []
        for threads in sorted({1, numba.config.NUMBA_NUM_THREADS}) * 2:
            numba.set_num_threads(threads)
            y = linear_forward(x, w, b, activation="relu")
            runs.append((y, *linear_backward(dy, x, w, y, activation="relu"),
                         *linear_backward(dy, x[:, :9], w[:, :9], y, activation="relu", need_dx=False)[1:]))
    finally:
        numba.set_num_threads(before)
    for other in runs[1:]:
        for got, first in zip(other, runs[0]):
            np.testing.assert_array_equal(got, first)


@pytest.mark.parametrize("isa", ["avx2", "scalar"])
def test_lower_isa_paths(monkeypatch, isa):
    if isa == "avx2" and host_target().detected_isa not in ("avx2", "avx512"):
        pytest.skip("host has no AVX2")
    monkeypatch.setenv("JITKERN_ISA", isa)
    assert GB.tile_shape()[2] == (8 if isa == "avx2" else 1)
    rng = np.random.default_rng(4)
    x, w, b = arrays(rng, 67, 129), arrays(rng, 45, 129), arrays(rng, 45)
    y = linear_forward(x, w, b, activation="relu")
    assert_close(y, ref.linear_forward(x, w, b, activation="relu"),
                 np.abs(x).astype(np.float64) @ np.abs(w).T + np.abs(b), 129)
    dy = arrays(rng, 67, 45)
    for got, want in zip(linear_backward(dy, x, w, y, activation="relu"),
                         ref.linear_backward(dy, x, w, y, activation="relu")):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-3)
    mask = np.zeros((67, 45), np.bool_)  # the byte masks of this ISA's tile, edge tiles included
    np.testing.assert_array_equal(linear_forward(x, w, b, activation="relu", out_mask=mask), y)
    np.testing.assert_array_equal(mask, y > 0)
    w2 = arrays(rng, 45, 45)
    dx = linear_backward(dy, y, w2, input_relu=True, x_mask=mask)[0]
    np.testing.assert_array_equal(dx, linear_backward(dy, y, w2, input_relu=True)[0])


def test_validation_names_the_argument():
    f32 = np.ones((4, 3), np.float32)
    with pytest.raises(TypeError, match="a must have dtype float32"):
        gemm(f32.astype(np.float64), f32.T)
    with pytest.raises(TypeError, match="b must be a numpy.ndarray"):
        gemm(f32, [[1.0]])
    with pytest.raises(ValueError, match="a must be 2-D"):
        gemm(np.ones(3, np.float32), f32)
    with pytest.raises(ValueError, match="inner dimensions"):
        gemm(f32, f32)
    with pytest.raises(ValueError, match="out must have shape"):
        gemm(f32, f32.T, np.empty((3, 3), np.float32))
    with pytest.raises(ValueError, match="out must have contiguous rows"):
        gemm(f32, f32.T, np.empty((4, 8), np.float32)[:, ::2])
    sq = np.ones((4, 4), np.float32)
    with pytest.raises(ValueError, match="out must not overlap"):
        gemm(sq, sq, sq)
    with pytest.raises(TypeError, match="alpha"):
        gemm(f32, f32.T, alpha="x")
    with pytest.raises(ValueError, match="w must have shape"):
        linear_forward(f32, np.ones((2, 5), np.float32))
    with pytest.raises(ValueError, match="b must have shape"):
        linear_forward(f32, f32, np.ones(3, np.float32))
    with pytest.raises(ValueError, match="activation"):
        linear_forward(f32, f32, activation="tanh")
    with pytest.raises(ValueError, match="y .*required"):
        linear_backward(np.ones((4, 4), np.float32), f32, f32, activation="relu")
    with pytest.raises(ValueError, match="x must have 4 rows"):
        linear_backward(np.ones((4, 4), np.float32), np.ones((5, 3), np.float32), f32)
    with pytest.raises(ValueError, match="b must have shape"):
        batch_reduce_gemm(np.ones((2, 3, 4), np.float32), np.ones((3, 4, 5), np.float32))
    with pytest.raises(ValueError, match="a must be 3-D"):
        batch_reduce_gemm(f32, np.ones((2, 3, 4), np.float32))


def test_gemm_kernel_loads_from_disk_cache_in_a_new_process():
    """The driver closes over plain ints only (tile_code), so a second process finds it on disk."""
    import os
    import subprocess
    import sys

    from jitkern.config import get_config
    if not get_config().disk_cache:
        pytest.skip("disk cache disabled")
    code = ("import numpy as np; from jitkern.ops import gemm; "
            "gemm(np.ones((3, 2), np.float32), np.ones((2, 5), np.float32))")
    env = {**os.environ, "JITKERN_DEBUG": "1"}
    runs = [subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
            for _ in range(2)]
    assert all(r.returncode == 0 for r in runs), runs[-1].stderr
    assert any("gemm[" in line and "loaded from disk cache" in line for line in runs[1].stderr.splitlines()), \
        runs[1].stderr


def test_linear_backward_rejects_bad_outputs():
    rng = np.random.default_rng(0)
    x, w, dy = arrays(rng, 8, 5), arrays(rng, 3, 5), arrays(rng, 8, 3)
    with pytest.raises(ValueError, match="out_dx must have shape"):
        linear_backward(dy, x, w, out_dx=np.empty((8, 4), np.float32))
    with pytest.raises(TypeError, match="out_dw must be a float32"):
        linear_backward(dy, x, w, out_dw=np.empty((3, 5), np.float64))
    with pytest.raises(ValueError, match="out_dw must not overlap"):
        linear_backward(dy, x, w, out_dw=w)
    with pytest.raises(ValueError, match="out_dx is given but need_dx is False"):
        linear_backward(dy, x, w, need_dx=False, out_dx=np.empty((8, 5), np.float32))


@pytest.mark.parametrize("huge_from", [0, 1 << 40])  # the huge-page mapping, and NumPy's memory
def test_empty_aligned_gives_plain_line_aligned_arrays(huge_from):
    from jitkern.ops.workspace import empty_aligned
    for shape, dtype in (((3, 5, 7), np.float32), (100, np.uint16), ((0, 4), np.float32), ((2, 1 << 20), np.float32)):
        a = empty_aligned(shape, dtype, huge_from=huge_from)
        assert a.shape == tuple(np.atleast_1d(shape)) and a.dtype == dtype
        assert a.flags.c_contiguous and a.flags.writeable
        assert a.size == 0 or a.ctypes.data % 64 == 0  # (an empty array's pointer is NumPy's placeholder)
        a[...] = 7  # every byte of it is ours
        assert (a == 7).all()


def test_staggered_blocks_are_contiguous_blocks_on_distinct_cache_sets():
    from jitkern.ops.workspace import staggered_blocks
    for count, shape, dtype in ((26, (2048, 128), np.float32), (3, (5, 7), np.uint16), (0, (4, 4), np.float32),
                                (2, (0, 16), np.float32), (4, (3, 1024), np.float32)):
        a = staggered_blocks(count, shape, dtype)
        assert a.shape == (count, *shape) and a.dtype == dtype and a.flags.writeable
        assert all(a[k].flags.c_contiguous for k in range(count))
        a[...] = np.arange(a.size, dtype=np.int64).reshape(a.shape).astype(dtype)  # blocks do not overlap
        assert (a.reshape(-1) == np.arange(a.size).astype(dtype)).all()
    a = staggered_blocks(26, (2048, 128))
    # row b of every block: 26 distinct offsets in L1's and L2's set periods (4 KiB, 64 KiB), each
    # at least a row apart, so their lines fall in distinct sets
    offsets = sorted(a[k, 5].ctypes.data % 65536 for k in range(26))
    assert min(np.diff(offsets)) >= 512
    assert len({a[k, 5].ctypes.data % 4096 // 64 for k in range(26)}) == 26


def test_stream_knob_poses_the_write_bound_gemms_and_times_both_choices():
    # the knob's problems are a workload's forwards on <= STREAM_MAX_K inputs and weight gradients
    # of <= STREAM_MAX_K rows, as (m, n, k, threads) with C (m, n); the heuristic is a candidate
    # and the runner runs each (the bits are the same either way: the test below)
    from jitkern.codegen.knobs import Workload
    GM = importlib.import_module("jitkern.ops.gemm_knobs")
    l2 = host_target().l2
    wide = 2 * l2 // (4 * 1024)  # the weight gradient (wide x 1024) of a 32-row batch is beyond L2
    w = Workload(linears=((2048, 13, 512), (32, 1024, wide), (2048, 512, 256), (32, 13, 16)), threads=(1, 2))
    assert list(GM.STREAMING.problems(w)) == [(2048, 512, 13, 1), (2048, 512, 13, 2), (wide, 1024, 32, 1),
                                              (wide, 1024, 32, 2)]
    assert list(GM.STREAMING.problems(Workload(linears=((2048, 13, 512),), precisions=("bf16",)))) == []
    problem = (host_target().l2 // (4 * 64) + 64, 64, 13, 1)  # C beyond L2
    assert GM.STREAMING.heuristic(problem) in GM.STREAMING.candidates(problem, True)
    for params in GM.STREAMING.candidates(problem, False):
        GM.STREAMING.runner(problem, params)()


def test_write_bound_gemm_streams_c_with_the_same_bits(monkeypatch):
    # k <= STREAM_MAX_K, C beyond L2 and the gemm.stream knob choosing it: C is stored
    # non-temporally (full tiles; the edge panel and the ReLU mask as usual), on every thread
    # count, with the same bits as cached stores
    from jitkern.codegen import target_isa
    from jitkern.ops.workspace import empty_aligned
    GK, GM = importlib.import_module("jitkern.ops.gemm_kernel"), importlib.import_module("jitkern.ops.gemm_knobs")
    rng = np.random.default_rng(3)
    n, k = 1024, 13
    m = (host_target().l2 // (4 * n) + 64) // 64 * 64 + 16  # C beyond L2; a half panel at the edge
    x, w, b = arrays(rng, n, k), arrays(rng, m, k), arrays(rng, m)
    want = np.maximum(x.astype(np.float64) @ w.T + b, 0)
    got = {}
    for limit in (GK.STREAM_MAX_K, 0):
        monkeypatch.setattr(GM.STREAMING, "choose", lambda problem, limit=limit: {"max_k": limit})
        for threads in sorted({1, numba.config.NUMBA_NUM_THREADS}):
            y, mask = empty_aligned((n, m)), np.empty((n, m), np.bool_)
            assert GK._streams(y, k, 0.0, target_isa()) == (limit > 0 and target_isa() in ("avx2", "avx512"))
            before = numba.get_num_threads()
            numba.set_num_threads(threads)
            try:
                linear_forward(x, w, b, activation="relu", out=y, out_mask=mask)
            finally:
                numba.set_num_threads(before)
            got[limit, threads] = y, mask
    for y, mask in got.values():
        np.testing.assert_array_equal(y, got[0, 1][0])
        np.testing.assert_array_equal(mask, y > 0)
    assert_close(got[0, 1][0], want, np.abs(x).astype(np.float64) @ np.abs(w).T + np.abs(b), k)
