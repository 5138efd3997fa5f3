"""Adagrad: the dense update (adagrad_) and the fused element-wise table update
(embedding_bag_adagrad_exact_) against ops.reference, and against torch.optim.Adagrad where torch
is installed.

The element-wise table update runs on the row-wise Adagrad's paths (hashed, sorted, hashed in
position ranges); each is forced in turn as test_embedding does.
"""
import numba
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from jitkern.ops import SplitBF16Table, adagrad_, embedding_bag_adagrad_exact_, reference
from jitkern.ops.embedding import SPECIALISED_D, adagrad

try:
    import torch
except ImportError:  # the torch comparisons only are skipped
    torch = None

EPS32 = 2.0 ** -23
GENERIC_D = [d for d in range(1, 301) if d not in SPECIALISED_D]
PATHS = ("hashed", "sorted", "hashed-parallel")
needs_torch = pytest.mark.skipif(torch is None, reason="torch not installed")


def _force_path(mp, path):
    mp.setattr(adagrad, "_update_path", lambda nnz, num_rows, threads, repeats, min_nnz: path)
    if path == "hashed-parallel":
        mp.setattr(adagrad, "num_threads", lambda: 3)


# ----------------------------------------------------------------------------- dense


@given(st.sampled_from([(0,), (1,), (7,), (13, 17), (3, 1, 5), (70001,)]), st.integers(0, 2**32 - 1),
       st.sampled_from([0.0, 1e-3, 0.5]), st.sampled_from([0.0, 1e-10, 1e-8, 0.1]))
def test_dense_adagrad_matches_reference(shape, seed, lr, eps):
    rng = np.random.default_rng(seed)
    p = rng.standard_normal(shape).astype(np.float32)
    s = np.abs(rng.standard_normal(shape)).astype(np.float32) * (seed % 2)  # from zero, or a running state
    g = rng.standard_normal(shape).astype(np.float32)
    if seed % 3 == 0 and g.ndim:  # a strided gradient: copied by the op
        g = np.repeat(g, 2, axis=-1)[..., ::2]
    want_p, want_s = p.copy(), s.copy()
    reference.adagrad_(want_p, want_s, g, lr, eps)
    assert adagrad_(p, s, g, lr, eps) is p
    # the state: one rounding of the square and one of the sum; the step: a few roundings of a value <= lr
    assert np.all(np.abs(s - want_s) <= 2 * EPS32 * want_s)
    assert np.all(np.abs(p - want_p) <= 2 * EPS32 * np.abs(want_p) + 6 * EPS32 * lr)


@pytest.mark.parametrize("steps", [1, 3])
@needs_torch
def test_dense_adagrad_equals_torch(steps):
    """torch.optim.Adagrad's CPU update, in its operation order: the same state bit for bit, the same
    parameters up to torch's sqrt (MKL's, not correctly rounded: exact on the first step's sqrt(g*g))."""
    rng = np.random.default_rng(steps)
    p0 = rng.standard_normal((33, 65)).astype(np.float32)
    tp = torch.nn.Parameter(torch.from_numpy(p0.copy()))
    opt = torch.optim.Adagrad([tp], lr=0.05, eps=1e-8, foreach=False)
    p, s = p0.copy(), np.zeros_like(p0)
    for _ in range(steps):
        g = rng.standard_normal(p0.shape).astype(np.float32)
        tp.grad = torch.from_numpy(g.copy())
        opt.step()
        adagrad_(p, s, g, 0.05, 1e-8)
    np.testing.assert_array_equal(s.view(np.uint32), opt.state[tp]["sum"].numpy().view(np.uint32))
    want = tp.detach().numpy()
    if steps == 1:
        np.testing.assert_array_equal(p.view(np.uint32), want.view(np.uint32))
    assert np.all(np.abs(p - want) <= 2 * EPS32 * np.abs(want) + 4 * EPS32 * 0.05)


def test_dense_adagrad_checks_arguments_and_changes_nothing_on_error():
    p, s, g = np.ones((4, 3), np.float32), np.zeros((4, 3), np.float32), np.ones((4, 3), np.float32)
    bad = [
        (TypeError, "param", lambda: adagrad_(p.astype(np.float64), s, g, 0.1, 1e-8)),
        (TypeError, "state", lambda: adagrad_(p, s.astype(np.float64), g, 0.1, 1e-8)),
        (TypeError, "grad", lambda: adagrad_(p, s, g.astype(np.float64), 0.1, 1e-8)),
        (ValueError, "state must have shape", lambda: adagrad_(p, s[:2], g, 0.1, 1e-8)),
        (ValueError, "grad must have shape", lambda: adagrad_(p, s, g[:2], 0.1, 1e-8)),
        (ValueError, "lr must be finite", lambda: adagrad_(p, s, g, float("nan"), 1e-8)),
        (ValueError, "lr", lambda: adagrad_(p, s, g, 1e39, 1e-8)),
        (ValueError, "eps must be >= 0", lambda: adagrad_(p, s, g, 0.1, -1.0)),
        (ValueError, "eps must be finite", lambda: adagrad_(p, s, g, 0.1, float("inf"))),
        (ValueError, "param must be C-contiguous", lambda: adagrad_(p.T, s.T, g.T, 0.1, 1e-8)),
        (ValueError, "state must not overlap", lambda: adagrad_(p, p, g, 0.1, 1e-8)),
        (ValueError, "grad must not overlap", lambda: adagrad_(p, s, p, 0.1, 1e-8)),
        (ValueError, "grad must not overlap", lambda: adagrad_(p, s, s, 0.1, 1e-8)),
    ]
    for exc, match, call in bad:
        with pytest.raises(exc, match=match):
            call()
    np.testing.assert_array_equal(p, 1.0)
    np.testing.assert_array_equal(s, 0.0)
    g = np.ones((4, 6), np.float32)[:, ::2]  # a strided gradient is copied
    adagrad_(p, s, g, 0.5, 0.0)
    np.testing.assert_array_equal(p, 0.5)
    np.testing.assert_array_equal(s, 1.0)


# ----------------------------------------------------------------------------- element-wise table update


def _bags(rng, num_rows, sizes, hot, index_dtype, last):
    """indices (nnz,) with a few hot rows when `hot` (duplicates within and across bags), offsets."""
    nnz = int(sum(sizes))
    idx = rng.integers(0, num_rows, nnz)
    if hot and nnz:
        hot_rows = rng.integers(0, num_rows, 3)
        mask = rng.random(nnz) < 0.7
        idx[mask] = hot_rows[rng.integers(0, 3, mask.sum())]
    starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    return idx.astype(index_dtype), (starts if last else starts[:-1])


@st.composite
def problems(draw, dims=st.sampled_from(GENERIC_D)):
    """A table, a running state (>= 0.5, so the step is a smooth function of the gradient), bags
    (empty ones, batch 1, duplicates, long ones) and their pooled gradient."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    num_rows = draw(st.sampled_from([1, 2, 7, 31, 97, 300]))
    dim = draw(dims)
    nbags = draw(st.sampled_from([1, 2, 5, 12]))
    sizes = [draw(st.sampled_from([0, 1, 2, 5, 13, 50])) for _ in range(nbags)]
    last = draw(st.booleans())
    idx, off = _bags(rng, num_rows, sizes, draw(st.booleans()), draw(st.sampled_from([np.int32, np.int64])), last)
    psw = rng.standard_normal(len(idx)).astype(np.float32) if draw(st.booleans()) else None
    w = rng.standard_normal((num_rows, dim)).astype(np.float32)
    state = (0.5 + np.abs(rng.standard_normal((num_rows, dim)))).astype(np.float32)
    dout = rng.standard_normal((nbags, dim)).astype(np.float32)
    if draw(st.booleans()):  # strided dout, indices and weights: the op copies them
        dout = np.repeat(dout, 2, axis=1)[:, ::2]
        idx = np.repeat(idx, 2)[::2]
        psw = None if psw is None else np.repeat(psw, 2)[::2]
    kw = dict(mode=draw(st.sampled_from(["sum", "mean"])), per_sample_weights=psw, include_last_offset=last)
    return w, state, idx, off, dout, kw


def _check_against_reference(w, state, idx, off, dout, kw, lr=0.3, eps=1e-3):
    got_w, got_s, want_w, want_s = w.copy(), state.copy(), w.copy(), state.copy()
    assert embedding_bag_adagrad_exact_(got_w, got_s, idx, off, dout, lr, eps, **kw) is got_w
    reference.embedding_bag_adagrad_exact_(want_w, want_s, idx, off, dout, lr, eps, **kw)
    rows, g = reference.embedding_bag_backward(idx, off, dout, w.shape[0], **kw)
    kw_abs = dict(kw, per_sample_weights=None if kw["per_sample_weights"] is None else np.abs(kw["per_sample_weights"]))
    _, g_abs = reference.embedding_bag_backward(idx, off, np.abs(dout), w.shape[0], **kw_abs)
    longest = int(np.bincount(idx.astype(np.int64)).max()) if len(idx) else 1
    gerr = (longest + 2) * EPS32 * g_abs.astype(np.float64) + 1e-30  # the float32 coalesced sum's error
    untouched = np.setdiff1d(np.arange(w.shape[0]), rows)
    np.testing.assert_array_equal(got_w[untouched], w[untouched])
    np.testing.assert_array_equal(got_s[untouched], state[untouched])
    s_bound = (2 * np.abs(g) + gerr) * gerr + 4 * EPS32 * want_s[rows]
    assert np.all(np.abs(got_s[rows] - want_s[rows]) <= s_bound)
    # d(step)/dg <= lr / sqrt(state) <= lr / sqrt(0.5); then a few float32 roundings of w and the step
    w_bound = 2 * lr * gerr / np.sqrt(0.5) + 8 * EPS32 * (np.abs(want_w[rows]) + lr)
    assert np.all(np.abs(got_w[rows] - want_w[rows]) <= w_bound)


@pytest.mark.parametrize("path", PATHS)
@given(p=problems())
def test_exact_adagrad_matches_reference(path, p):
    with pytest.MonkeyPatch.context() as mp:
        _force_path(mp, path)
        _check_against_reference(*p)


@given(problems())
def test_exact_adagrad_paths_agree_bit_for_bit(p):
    """Hashed, sorted and hashed in 3 position ranges: the same sums in the same order."""
    w, state, idx, off, dout, kw = p
    results = []
    for path in PATHS:
        with pytest.MonkeyPatch.context() as mp:
            _force_path(mp, path)
            got_w, got_s = w.copy(), state.copy()
            embedding_bag_adagrad_exact_(got_w, got_s, idx, off, dout, 0.3, 1e-8, **kw)
            results.append((got_w.view(np.uint32), got_s.view(np.uint32)))
    for got in results[1:]:
        np.testing.assert_array_equal(got[0], results[0][0])
        np.testing.assert_array_equal(got[1], results[0][1])


@pytest.mark.parametrize("dim", SPECIALISED_D)
def test_exact_adagrad_specialised_widths(dim):
    """The compile-time-D kernels on every path."""
    rng = np.random.default_rng(dim)
    w = rng.standard_normal((500, dim)).astype(np.float32)
    state = (0.5 + np.abs(rng.standard_normal((500, dim)))).astype(np.float32)
    idx, off = _bags(rng, 500, [0, 1, 3, 20, 50, 7, 0, 2], True, np.int64, False)
    dout = rng.standard_normal((len(off), dim)).astype(np.float32)
    for path in PATHS:
        with pytest.MonkeyPatch.context() as mp:
            _force_path(mp, path)
            _check_against_reference(w, state, idx, off, dout, {"mode": "sum", "per_sample_weights": None,
                                                                 "include_last_offset": False})


def test_exact_adagrad_edge_cases():
    """Batch 1, every bag empty, no indices at all, one row hit by every lookup, from a zero state."""
    rng = np.random.default_rng(3)
    w = rng.standard_normal((10, 5)).astype(np.float32)
    plain = {"mode": "sum", "per_sample_weights": None, "include_last_offset": False}
    ones = np.full((10, 5), 1.0, np.float32)
    _check_against_reference(w, ones, np.array([4], np.int64), np.array([0], np.int64),
                             rng.standard_normal((1, 5)).astype(np.float32), plain)
    for idx, off in ((np.empty(0, np.int64), np.zeros(3, np.int64)), (np.full(40, 7, np.int32), np.array([0, 10, 25]))):
        got_w, got_s = w.copy(), np.zeros((10, 5), np.float32)
        dout = rng.standard_normal((len(off), 5)).astype(np.float32)
        embedding_bag_adagrad_exact_(got_w, got_s, idx, off, dout, 0.1, 1e-8)
        want_w, want_s = w.copy(), np.zeros((10, 5), np.float32)
        reference.embedding_bag_adagrad_exact_(want_w, want_s, idx, off, dout, 0.1, 1e-8)
        np.testing.assert_allclose(got_s, want_s, rtol=1e-5)
        np.testing.assert_allclose(got_w, want_w, rtol=1e-6, atol=1e-6)
    # from zero state, a row's first step is lr * g / (|g| + eps): lr in magnitude
    got_w, got_s = w.copy(), np.zeros((10, 5), np.float32)
    embedding_bag_adagrad_exact_(got_w, got_s, np.array([2], np.int64), np.array([0], np.int64),
                                 np.full((1, 5), 3.0, np.float32), 0.25, 0.0)
    np.testing.assert_array_equal(got_w[2], w[2] - np.float32(0.25))
    np.testing.assert_array_equal(got_s[2], 9.0)


@pytest.mark.skipif(numba.config.NUMBA_NUM_THREADS < 2, reason="needs 2 numba threads")
def test_exact_adagrad_is_thread_count_independent():
    rng = np.random.default_rng(7)
    w0 = rng.standard_normal((5000, 37)).astype(np.float32)
    idx, off = _bags(rng, 5000, [20] * 450, True, np.int64, False)
    dout = rng.standard_normal((450, 37)).astype(np.float32)
    results = []
    before = numba.get_num_threads()
    try:
        for threads in (2, 2, 1):
            numba.set_num_threads(threads)
            w, s = w0.copy(), np.zeros((5000, 37), np.float32)
            embedding_bag_adagrad_exact_(w, s, idx, off, dout, 0.1)
            results.append((w.view(np.uint32).copy(), s.view(np.uint32).copy()))
    finally:
        numba.set_num_threads(before)
    for w, s in results[1:]:
        np.testing.assert_array_equal(w, results[0][0])
        np.testing.assert_array_equal(s, results[0][1])


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("bad", [10, -1, 2**40])
def test_exact_adagrad_bad_index_changes_nothing(path, bad, monkeypatch):
    _force_path(monkeypatch, path)
    rng = np.random.default_rng(0)
    w = rng.standard_normal((10, 5)).astype(np.float32)
    w0, state = w.copy(), np.zeros((10, 5), np.float32)
    idx, off = np.array([1, 2, 9, bad, 4], np.int64), np.array([0, 2], np.int64)
    with pytest.raises(IndexError, match=rf"indices\[3\] = {bad} .*weight.* 10 rows"):
        embedding_bag_adagrad_exact_(w, state, idx, off, np.ones((2, 5), np.float32), 0.1)
    with pytest.raises(ValueError, match=r"non-decreasing"):
        embedding_bag_adagrad_exact_(w, state, idx[:3], np.array([0, 3, 2]), np.ones((3, 5), np.float32), 0.1)
    np.testing.assert_array_equal(w, w0)
    assert not state.any()


def test_exact_adagrad_argument_checks():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((10, 5)).astype(np.float32)
    w0, state = w.copy(), np.zeros((10, 5), np.float32)
    idx, off, dout = np.array([1, 2, 9], np.int64), np.array([0, 2], np.int64), np.ones((2, 5), np.float32)
    bad = [
        (ValueError, "state must have shape", lambda: embedding_bag_adagrad_exact_(w, state[:, 0].copy(), idx, off,
                                                                                  dout, 0.1)),
        (TypeError, "state", lambda: embedding_bag_adagrad_exact_(w, state.astype(np.float64), idx, off, dout, 0.1)),
        (ValueError, "state must be C-contiguous", lambda: embedding_bag_adagrad_exact_(
            w, np.zeros((5, 10), np.float32).T, idx, off, dout, 0.1)),
        (ValueError, "lr must be finite", lambda: embedding_bag_adagrad_exact_(w, state, idx, off, dout, float("inf"))),
        (ValueError, "lr", lambda: embedding_bag_adagrad_exact_(w, state, idx, off, dout, 1e39)),
        (ValueError, "eps", lambda: embedding_bag_adagrad_exact_(w, state, idx, off, dout, 0.1, -1e-8)),
        (ValueError, "eps", lambda: embedding_bag_adagrad_exact_(w, state, idx, off, dout, 0.1, 1e39)),
        (ValueError, "dout", lambda: embedding_bag_adagrad_exact_(w, state, idx, off, dout[:, :4], 0.1)),
        (ValueError, "state must not overlap", lambda: embedding_bag_adagrad_exact_(w, w, idx, off, dout, 0.1)),
        (ValueError, "dout must not overlap", lambda: embedding_bag_adagrad_exact_(w, state, idx, off, state[:2], 0.1)),
        (ValueError, "dout must not overlap", lambda: embedding_bag_adagrad_exact_(w, state, idx, off, w[:2], 0.1)),
        (ValueError, "per_sample_weights must not overlap", lambda: embedding_bag_adagrad_exact_(
            w, state, idx, off, dout, 0.1, per_sample_weights=state.reshape(-1)[:3])),
        (ValueError, "mode", lambda: embedding_bag_adagrad_exact_(w, state, idx, off, dout, 0.1, mode="max")),
        (TypeError, "SplitBF16Table", lambda: embedding_bag_adagrad_exact_(SplitBF16Table.from_float32(w), state,
                                                                           idx, off, dout, 0.1)),
    ]
    for exc, match, call in bad:
        with pytest.raises(exc, match=match):
            call()
    np.testing.assert_array_equal(w, w0)
    assert not state.any()


@needs_torch
@pytest.mark.parametrize("psw", [False, True])
def test_exact_adagrad_equals_torch_sparse_adagrad(psw):
    """nn.EmbeddingBag(sparse=True) + torch.optim.Adagrad, 3 steps of multi-hot bags with duplicates."""
    rng = np.random.default_rng(11)
    R, D, B = 200, 16, 64
    w0 = rng.standard_normal((R, D)).astype(np.float32)
    bag = torch.nn.EmbeddingBag(R, D, mode="sum", sparse=True)
    with torch.no_grad():
        bag.weight.copy_(torch.from_numpy(w0))
    opt = torch.optim.Adagrad(bag.parameters(), lr=0.05, eps=1e-8)
    w, s = w0.copy(), np.zeros((R, D), np.float32)
    for _ in range(3):
        sizes = rng.integers(0, 6, B)
        idx, off = _bags(rng, R, sizes, True, np.int64, False)
        weights = rng.standard_normal(len(idx)).astype(np.float32) if psw else None
        dout = rng.standard_normal((B, D)).astype(np.float32)
        opt.zero_grad()
        out = bag(torch.from_numpy(idx), torch.from_numpy(off),
                  per_sample_weights=None if weights is None else torch.from_numpy(weights))
        out.backward(torch.from_numpy(dout))
        opt.step()
        embedding_bag_adagrad_exact_(w, s, idx, off, dout, 0.05, 1e-8, per_sample_weights=weights)
    want_w, want_s = bag.weight.detach().numpy(), opt.state[bag.weight]["sum"].numpy()
    assert np.linalg.norm(w - want_w) / np.linalg.norm(want_w) <= 1e-6
    np.testing.assert_allclose(s, want_s, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(w, want_w, rtol=1e-5, atol=1e-6)
