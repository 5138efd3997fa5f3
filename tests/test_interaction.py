"""Dot and cat interaction kernels against the NumPy references.

Compile budget: hypothesis draws shapes the generic (runtime-shape) kernels take; the DLRM shapes
that get F/D-specialised kernels are a fixed handful, each compiled once and shared.
"""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jitkern.ops import interaction as K
from jitkern.ops import reference as R

EPS = np.finfo(np.float32).eps


def _inputs(rng, B, T, D, scale=1.0):
    x = (scale * rng.standard_normal((B, D))).astype(np.float32)
    ly = (scale * rng.standard_normal((B, T, D))).astype(np.float32)
    return x, ly


def _as_list(ly):
    return [np.ascontiguousarray(ly[:, t]) for t in range(ly.shape[1])]


def _check_forward(x, ly, self_interaction, ly_arg=None):
    z = K.interaction_dot_forward(x, ly if ly_arg is None else ly_arg, self_interaction=self_interaction)
    ref = R.interaction_dot_forward(x, ly, self_interaction=self_interaction)
    # float32 dot of D terms: error <= ~D eps * sum |t_i||t_j|, the same product on |inputs|
    bound = R.interaction_dot_forward(np.abs(x), np.abs(ly), self_interaction=self_interaction)
    assert z.shape == ref.shape and z.dtype == np.float32
    np.testing.assert_array_equal(z[:, :x.shape[1]], x)
    assert np.all(np.abs(z - ref) <= (x.shape[1] + 2) * EPS * bound + 1e-30)
    return z


def _check_backward(dz, x, ly, self_interaction, ly_arg=None):
    dx, dly = K.interaction_dot_backward(dz, x, ly if ly_arg is None else ly_arg,
                                         self_interaction=self_interaction)
    rdx, rdly = R.interaction_dot_backward(dz, x, ly, self_interaction=self_interaction)
    bdx, bdly = R.interaction_dot_backward(np.abs(dz), np.abs(x), np.abs(ly), self_interaction=self_interaction)
    tol = (ly.shape[1] + 4) * EPS
    assert dx.shape == rdx.shape and dly.shape == rdly.shape
    assert dx.dtype == dly.dtype == np.float32
    assert np.all(np.abs(dx - rdx) <= tol * bdx + 1e-30)
    assert np.all(np.abs(dly - rdly) <= tol * bdly + 1e-30)


@given(B=st.integers(1, 300), T=st.integers(1, 40), D=st.integers(1, 200), self_interaction=st.booleans(),
       as_list=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_dot_matches_reference(B, T, D, self_interaction, as_list, seed):
    rng = np.random.default_rng(seed)
    x, ly = _inputs(rng, B, T, D)
    z = _check_forward(x, ly, self_interaction, _as_list(ly) if as_list else None)
    dz = rng.standard_normal(z.shape).astype(np.float32)
    _check_backward(dz, x, ly, self_interaction, _as_list(ly) if as_list else None)


@pytest.mark.parametrize("T, D", [(26, 16), (26, 64), (26, 128), (8, 64)])
def test_dot_specialised_shapes(T, D):
    """The F/D-literal kernels the DLRM uses: B not a multiple of the chunk, both modes, both inputs."""
    assert (T + 1, D) in K._SPECIALISED
    rng = np.random.default_rng(T * 1000 + D)
    x, ly = _inputs(rng, 67, T, D)
    for self_interaction in (False, True):
        z = _check_forward(x, ly, self_interaction)
        _check_forward(x, ly, self_interaction, _as_list(ly))
        dz = rng.standard_normal(z.shape).astype(np.float32)
        _check_backward(dz, x, ly, self_interaction)
        _check_backward(dz, x, ly, self_interaction, _as_list(ly))


def test_dot_pair_order_is_the_reference_dlrm_order():
    """z[:, D + p] is the dot of vectors (li[p], lj[p]), i ascending then j ascending."""
    B, T, D = 3, 5, 4
    x, ly = _inputs(np.random.default_rng(1), B, T, D)
    t = np.concatenate([x[:, None], ly], axis=1).astype(np.float64)
    for self_interaction in (False, True):
        z = K.interaction_dot_forward(x, ly, self_interaction=self_interaction)
        li, lj = R.interaction_pairs(T + 1, self_interaction)
        assert z.shape[1] - D == len(li) == K.num_pairs(T + 1, self_interaction)
        for p, (i, j) in enumerate(zip(li, lj)):
            assert (j <= i) if self_interaction else (j < i)
            np.testing.assert_allclose(z[:, D + p], (t[:, i] * t[:, j]).sum(1), rtol=1e-5)


def test_dot_strided_list_is_read_in_place_and_odd_layouts_work():
    rng = np.random.default_rng(2)
    B, T, D = 45, 7, 32  # D % 16 == 0: the in-register transposes read the strided rows
    x, ly = _inputs(rng, B, T, D)
    wide = np.ascontiguousarray(ly.reshape(B, T * D))              # column blocks of one array
    blocks = [wide[:, t * D:(t + 1) * D] for t in range(T)]
    _check_forward(x, ly, False, blocks)
    _check_backward(rng.standard_normal((B, D + K.num_pairs(T + 1))).astype(np.float32), x, ly, False, blocks)
    mixed = [ly[:, t] if t % 2 else ly[:, t].copy() for t in range(T)]   # different strides -> copied
    _check_forward(x, ly, True, mixed)
    big = np.zeros((B, 2 * T, D), np.float32)
    big[:, ::2] = ly
    _check_forward(np.asfortranarray(x), ly, False, big[:, ::2])     # non-contiguous x and ly


def test_dot_edge_shapes_and_determinism():
    rng = np.random.default_rng(3)
    for B, T, D in [(0, 3, 5), (4, 0, 3), (1, 1, 1), (2, 40, 200), (3, 17, 48), (2, 0, 16)]:
        x, ly = _inputs(rng, B, T, D)
        for self_interaction in (False, True):
            z = _check_forward(x, ly, self_interaction)
            dz = rng.standard_normal(z.shape).astype(np.float32)
            _check_backward(dz, x, ly, self_interaction)
    x, ly = _inputs(rng, 300, 26, 64)
    z1 = K.interaction_dot_forward(x, ly)
    dz = rng.standard_normal(z1.shape).astype(np.float32)
    np.testing.assert_array_equal(z1, K.interaction_dot_forward(x, _as_list(ly)))
    a, b = K.interaction_dot_backward(dz, x, ly), K.interaction_dot_backward(dz, x, _as_list(ly))
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[1], b[1])


def test_dot_bit_identical_for_any_thread_count():
    import numba
    rng = np.random.default_rng(6)
    x, ly = _inputs(rng, 203, 26, 16)
    dz = rng.standard_normal((203, 16 + K.num_pairs(27))).astype(np.float32)
    before = numba.get_num_threads()
    try:
        outs = []
        for n in sorted({1, min(2, numba.config.NUMBA_NUM_THREADS)}):
            numba.set_num_threads(n)
            outs.append((K.interaction_dot_forward(x, ly), *K.interaction_dot_backward(dz, x, ly)))
    finally:
        numba.set_num_threads(before)
    for a, b in zip(outs[0], outs[-1]):
        np.testing.assert_array_equal(a, b)


def test_dot_large_and_special_values():
    """Big magnitudes stay accurate relative to the reference; NaN and inf propagate."""
    rng = np.random.default_rng(4)
    x, ly = _inputs(rng, 9, 6, 33, scale=1e15)
    _check_forward(x, ly, True)
    x[2, 3] = np.nan
    ly[5, 1, 0] = np.inf
    z = K.interaction_dot_forward(x, ly)
    ref = R.interaction_dot_forward(x, ly)
    np.testing.assert_array_equal(np.isnan(z), np.isnan(ref))
    np.testing.assert_array_equal(np.isinf(z), np.isinf(ref))


@pytest.mark.parametrize("isa", ["avx2", "scalar"])
def test_dot_lower_isa_paths(monkeypatch, isa):
    from jitkern.codegen import host_target
    if isa == "avx2" and host_target().detected_isa not in ("avx2", "avx512"):
        pytest.skip("host has no AVX2")
    monkeypatch.setenv("JITKERN_ISA", isa)
    # scalar compiles the width-1 generic kernels; avx2 keeps 16-lane vectors (LLVM splits them
    # into ymm pairs on an AVX2-only host), so it shares the native kernels here
    assert K.LANES.choose((37, 26, 16)) == {"lanes": 1 if isa == "scalar" else 16}
    rng = np.random.default_rng(5)
    for B, T, D, self_interaction in [(37, 25, 16, False), (5, 11, 13, True)]:
        x, ly = _inputs(rng, B, T, D)
        z = _check_forward(x, ly, self_interaction, _as_list(ly) if D == 13 else None)
        _check_backward(rng.standard_normal(z.shape).astype(np.float32), x, ly, self_interaction)


def test_dot_argument_errors():
    x = np.zeros((4, 8), np.float32)
    ly = np.zeros((4, 3, 8), np.float32)
    dz = np.zeros((4, 8 + 6), np.float32)
    with pytest.raises(TypeError, match="x must have dtype float32"):
        K.interaction_dot_forward(x.astype(np.float64), ly)
    with pytest.raises(TypeError, match="ly must have dtype float32"):
        K.interaction_dot_forward(x, ly.astype(np.float16))
    with pytest.raises(TypeError, match=r"ly\[1\] must have dtype float32"):
        K.interaction_dot_forward(x, [ly[:, 0], ly[:, 1].astype(np.float64)])
    with pytest.raises(TypeError, match="x must be a numpy.ndarray"):
        K.interaction_dot_forward(x.tolist(), ly)
    with pytest.raises(ValueError, match="ly must have shape"):
        K.interaction_dot_forward(x, np.zeros((5, 3, 8), np.float32))   # B mismatch
    with pytest.raises(ValueError, match="ly must have shape"):
        K.interaction_dot_forward(x, np.zeros((4, 3, 7), np.float32))   # D mismatch
    with pytest.raises(ValueError, match=r"ly\[2\] must have shape"):
        K.interaction_dot_forward(x, [ly[:, 0], ly[:, 1], np.zeros((3, 8), np.float32)])
    with pytest.raises(ValueError, match="ly must be 3-D"):
        K.interaction_dot_forward(x, np.zeros((4, 8), np.float32))
    with pytest.raises(ValueError, match="x must be 2-D"):
        K.interaction_dot_forward(np.zeros(8, np.float32), ly)
    with pytest.raises(ValueError, match="dz must have shape"):
        K.interaction_dot_backward(dz[:, :-1], x, ly)
    with pytest.raises(ValueError, match="dz must have shape"):
        K.interaction_dot_backward(dz, x, ly, self_interaction=True)   # needs P = 10, not 6
    with pytest.raises(TypeError, match="dz must have dtype float32"):
        K.interaction_dot_backward(dz.astype(np.float64), x, ly)


@given(B=st.integers(0, 50), T=st.integers(0, 9), D=st.integers(1, 40), as_list=st.booleans())
@settings(max_examples=20)
def test_cat_matches_reference(B, T, D, as_list):
    rng = np.random.default_rng(B * 100 + T * 10 + D)
    x, ly = _inputs(rng, B, T, D)
    arg = _as_list(ly) if as_list else ly
    z = K.interaction_cat_forward(x, arg)
    np.testing.assert_array_equal(z, R.interaction_cat_forward(x, ly))
    dz = rng.standard_normal(z.shape).astype(np.float32)
    dx, dly = K.interaction_cat_backward(dz, x, arg)
    rdx, rdly = R.interaction_cat_backward(dz, x, ly)
    np.testing.assert_array_equal(dx, rdx)
    np.testing.assert_array_equal(dly, rdly)


def test_cat_argument_errors():
    x = np.zeros((4, 8), np.float32)
    ly = np.zeros((4, 3, 8), np.float32)
    with pytest.raises(ValueError, match="dz must have shape"):
        K.interaction_cat_backward(np.zeros((4, 31), np.float32), x, ly)
    with pytest.raises(TypeError, match="x must have dtype float32"):
        K.interaction_cat_forward(x.astype(np.int32), ly)


def test_fma_probe_of_the_interaction_bench_runs():
    # the peak probe (codegen.peaks) uses codegen.vec directly: keep it compiling
    from jitkern.codegen.peaks import _fma_loop8, _fma_loop16

    # chains of m*c+m from c = 0, m = 0.5: each step c -> 0.5 c + 0.5, summed over 8 (16 lanes) or
    # 12 (8 lanes) chains
    c = 0.0
    for _ in range(3):
        c = 0.5 * c + 0.5
    assert _fma_loop16(np.float32(0.5), 3) == np.float32(8 * c)
    assert _fma_loop8(np.float32(0.5), 3) == np.float32(12 * c)


# --------------------------------------------------------------------------- knobs


@pytest.fixture
def db(tmp_path, monkeypatch):
    monkeypatch.setenv("JITKERN_TUNE_DB", str(tmp_path / "tune.json"))
    monkeypatch.delenv("JITKERN_NO_TUNE", raising=False)


def _spy(monkeypatch, name):
    """Record the arguments of K.<name> while calling it."""
    calls, real = [], getattr(K, name)

    def spy(*args):
        calls.append(args)
        return real(*args)
    monkeypatch.setattr(K, name, spy)
    return calls


def test_knob_heuristics_are_the_fixed_choices(monkeypatch):
    from jitkern.codegen import host_target
    monkeypatch.setenv("JITKERN_NO_TUNE", "1")
    vw = host_target().vector_width
    assert K.LANES.choose((300, 27, 16)) == {"lanes": 1 if vw == 1 else 16}
    assert K.PARALLEL.choose((300, 27, 16, 2)) == {"min_per_thread": 32}
    assert {"lanes": 16} in K.LANES.candidates((300, 27, 16), False)
    assert {"lanes": vw} in K.LANES.candidates((300, 27, 16), False)
    # pairs where a row is 4 vectors or more
    assert K.FORWARD.choose((300, 27, 16)) == {"scheme": "transpose"}
    assert K.FORWARD.choose((300, 27, 128)) == {"scheme": "pairs" if vw > 1 and 128 >= 4 * vw else "transpose"}
    assert {"scheme": "transpose"} in K.FORWARD.candidates((300, 27, 128), False)
    # hints where a row is one cache line
    assert K.PREFETCH.choose((300, 27, 16)) == {"ahead": 2}
    assert K.PREFETCH.choose((300, 27, 32)) == K.PREFETCH.choose((300, 27, 128)) == {"ahead": 0}
    assert {"ahead": 0} in K.PREFETCH.candidates((300, 27, 16), True)
    assert {"ahead": 2} in K.PREFETCH.candidates((300, 27, 128), True)


@pytest.mark.parametrize("T, D", [(5, 13), (6, 32)])
def test_every_lane_width_matches_the_reference_and_tuned_lanes_are_used(db, monkeypatch, T, D):
    """Each width a CPU's candidates hold (1, 4, 8 native; 16), forced through the tuning DB: same
    results as the reference, and bit-identical to each other (every lane sums its dot in d order).
    Generic kernels (both shapes share one per width, the tuned prefetch distance pinned alike; the
    heuristic's differs between them); D = 32 takes the 16 x 16 register transpose at 16 lanes,
    D = 13 the padded rows at every width."""
    from jitkern.codegen import tunedb
    specs = _spy(monkeypatch, "_spec")
    rng = np.random.default_rng(T + D)
    x, ly = _inputs(rng, 67, T, D)
    dz = rng.standard_normal((67, D + K.num_pairs(T + 1))).astype(np.float32)
    first = None
    tunedb.store("interaction.forward", K.FORWARD.shape_class((67, T + 1, D)), {"scheme": "transpose"})
    tunedb.store("interaction.prefetch", K.PREFETCH.shape_class((67, T + 1, D)), {"ahead": 2})
    for w in (16, 8, 4, 1):
        tunedb.store("interaction.lanes", K.LANES.shape_class((67, T + 1, D)), {"lanes": w})
        specs.clear()
        z = _check_forward(x, ly, False, _as_list(ly))
        _check_backward(dz, x, ly, False)
        assert {args[3:] for args in specs} == {(w, 2)}
        got = (z, *K.interaction_dot_backward(dz, x, ly))
        for a, b in zip(got, first or got):
            np.testing.assert_array_equal(a, b)
        first = first or got


@given(B=st.integers(1, 30), T=st.integers(0, 30), D=st.integers(1, 140), self_interaction=st.booleans(),
       slices=st.integers(1, 4), bf16=st.booleans(), ahead=st.sampled_from([0, 2]), seed=st.integers(0, 2**16))
@settings(max_examples=40, deadline=None)
def test_pairs_forward_matches_the_reference_on_any_batch_split(B, T, D, self_interaction, slices, bf16, ahead, seed):
    """The pairs scheme, whatever the knob would choose here: every D (whole vectors or not, the
    diagonal or not), bf16 inputs, rows hinted or not; batch slices run last to first, so a slice
    that wrote past its last sample's pairs would spoil the next slice's first row; z's next row is
    a sentinel."""
    from jitkern.ops import BF16Array
    rng = np.random.default_rng(seed)
    x, ly = _inputs(rng, B, T, D)
    if bf16:
        x, ly = BF16Array.from_float32(x), BF16Array.from_float32(ly)
    xx, keep, addrs, stride, _ = K._features(x, ly)
    if bf16:
        x, ly = x.to_float32(), ly.to_float32()
    off = int(self_interaction)
    full = np.full((B + 1, D + K.num_pairs(T + 1, self_interaction)), 7.0, np.float32)
    kernel = K.get_kernel(K._pairs_spec(T + 1, ahead))
    cuts = [B * k // min(slices, B) for k in range(min(slices, B) + 1)]
    for b0, b1 in reversed(list(zip(cuts, cuts[1:]))):
        kernel(b0, b1, xx, addrs, stride, off, full[:B])
    assert np.all(full[B] == 7.0)
    ref = R.interaction_dot_forward(x, ly, self_interaction=self_interaction)
    bound = R.interaction_dot_forward(np.abs(x), np.abs(ly), self_interaction=self_interaction)
    np.testing.assert_array_equal(full[:B, :D], x)
    assert np.all(np.abs(full[:B] - ref) <= (D + 2) * EPS * bound + 1e-30)


@pytest.mark.parametrize("W", [4, 16])
def test_pairs_forward_at_other_vector_widths(W):
    """The pairs kernel at the widths of other CPUs (SSE/NEON 4, AVX-512 16; LLVM splits or packs
    them here): vhsum4's other reduction trees, whole vectors and a partial last one."""
    from jitkern.codegen import KernelSpec
    kernel = K.get_kernel(KernelSpec.make("interaction_dot_forward_pairs", F=0, W=W, ahead=2))
    rng = np.random.default_rng(W)
    for B, T, D, off in [(5, 5, 2 * W, 0), (4, 8, W + 3, 1), (3, 2, 1, 0), (6, 11, 3 * W - 1, 1)]:
        x, ly = _inputs(rng, B, T, D)
        xx, keep, addrs, stride, _ = K._features(x, ly)
        full = np.full((B + 1, D + K.num_pairs(T + 1, off)), 7.0, np.float32)
        kernel(0, B // 2, xx, addrs, stride, off, full[:B])
        kernel(B // 2, B, xx, addrs, stride, off, full[:B])
        assert np.all(full[B] == 7.0)
        ref = R.interaction_dot_forward(x, ly, self_interaction=bool(off))
        bound = R.interaction_dot_forward(np.abs(x), np.abs(ly), self_interaction=bool(off))
        np.testing.assert_array_equal(full[:B, :D], x)
        assert np.all(np.abs(full[:B] - ref) <= (D + 2) * EPS * bound + 1e-30)


def test_tuned_per_thread_minimum_sets_the_split(db, monkeypatch):
    import numba
    from jitkern.codegen import tunedb
    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("one thread only")
    splits = _spy(monkeypatch, "_over_batch")
    x, ly = _inputs(np.random.default_rng(7), 100, 26, 16)
    before = numba.get_num_threads()
    try:
        numba.set_num_threads(2)
        z = K.interaction_dot_forward(x, ly)
        assert splits[-1][2] == 2                      # 100 // 32 >= 2: split
        tunedb.store("interaction.parallel", K.PARALLEL.shape_class((100, 27, 16, 2)), {"min_per_thread": 64})
        np.testing.assert_array_equal(K.interaction_dot_forward(x, ly), z)
        assert splits[-1][2] == 1                      # 100 // 64 == 1: one thread
    finally:
        numba.set_num_threads(before)


def test_tuner_stores_interaction_entries(db):
    import numba
    from jitkern.codegen import knobs, tune, tunedb
    tune_knob = knobs.get
    threads = (1, 2) if numba.config.NUMBA_NUM_THREADS >= 2 else (1,)
    results = tune.tune(knobs.Workload(interactions=((256, 27, 16),), threads=threads), quick=True,
                        select="interaction.*", min_time=0, out=None)
    assert {r.knob for r in results} == {"interaction.lanes", "interaction.forward", "interaction.prefetch",
                                         "interaction.parallel"}
    stored = tunedb.entries()
    assert stored["interaction.lanes"] and stored["interaction.forward"] and stored["interaction.prefetch"]
    assert len(stored["interaction.parallel"]) == len(threads)
    for r in results:
        if r.knob == "interaction.parallel":
            assert r.best["min_per_thread"] in (*K._PER_THREAD, 2 * K._PER_THREAD[-1])
        else:
            assert r.best in tune_knob(r.knob).candidates(r.problem, True)
