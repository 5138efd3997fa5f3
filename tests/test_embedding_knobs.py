"""The embedding knobs: heuristics are the choices the kernels made before they were knobs, every
candidate computes what the default does (bit for bit), tuned DB entries reach the ops, and the
tuner runs them for a workload.

Compile cost: the candidates run at D=64 with one thread (the serial kernels the tuner test
times as well), the parallel thresholds at a generic width whose kernels the property tests
of test_embedding.py compile anyway.
"""
import gc

import numba
import numpy as np
import pytest

from jitkern.codegen import host_target, knobs, tune, tunedb
from jitkern.ops import SplitBF16Table, embedding_bag_adagrad_, embedding_bag_forward, embedding_bag_sgd_, reference
from jitkern.config import CACHE_PRESETS
from jitkern.ops.embedding import _knobs, adagrad, forward, sgd
from jitkern.ops.embedding._rows import prefetch_distance
from jitkern.ops.embedding.layout import PAIRS_FROM_L3
from jitkern.ops.embedding.split_bf16 import layout_for

ROWS, DIM, POOLING, BATCH = 5000, 64, 4, 256
WORKLOAD = knobs.Workload(tables=((ROWS, DIM, POOLING, BATCH, 4),))


@pytest.fixture
def db(tmp_path, monkeypatch):
    path = tmp_path / "tune.json"
    monkeypatch.setenv("JITKERN_TUNE_DB", str(path))
    monkeypatch.delenv("JITKERN_NO_TUNE", raising=False)
    return path


@pytest.fixture
def one_thread():
    before = numba.get_num_threads()
    numba.set_num_threads(1)
    yield
    numba.set_num_threads(before)


def _batch(seed=0, rows=ROWS, dim=DIM, weighted=False):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((rows, dim)).astype(np.float32)
    idx = rng.integers(0, rows, POOLING * BATCH)
    off = np.arange(BATCH, dtype=np.int64) * POOLING
    dout = rng.standard_normal((BATCH, dim)).astype(np.float32)
    psw = rng.standard_normal(len(idx)).astype(np.float32) if weighted else None
    return w, idx, off, dout, psw


def _run_ops(w, idx, off, dout, psw, bf16=False):
    """forward, SGD, Adagrad (fp32) or forward, Split-SGD (bf16) results as uint32 bits."""
    if bf16:
        table = SplitBF16Table.from_float32(w)
        fwd = embedding_bag_forward(table, idx, off, per_sample_weights=psw)
        return [fwd.view(np.uint32), embedding_bag_sgd_(table, idx, off, dout, 0.1, per_sample_weights=psw)
                .to_float32().view(np.uint32)]
    state = np.ones(w.shape[0], np.float32)
    return [embedding_bag_forward(w, idx, off, per_sample_weights=psw).view(np.uint32),
            embedding_bag_sgd_(w.copy(), idx, off, dout, 0.1, per_sample_weights=psw).view(np.uint32),
            embedding_bag_adagrad_(w.copy(), state, idx, off, dout, 0.1, per_sample_weights=psw).view(np.uint32),
            state.view(np.uint32)]


@pytest.mark.parametrize("caches", [None, *sorted(CACHE_PRESETS)], ids=lambda c: c or "host")
def test_forward_prefetch_follows_the_cache_model(caches, monkeypatch):
    if caches:
        monkeypatch.setenv("JITKERN_CACHE_SIZES", caches)
    else:
        monkeypatch.delenv("JITKERN_CACHE_SIZES", raising=False)
    l2 = host_target().l2
    pf = forward.PREFETCH.heuristic
    near = min(max(l2 // (32 << 10), 32), 64)  # rows ahead, in proportion to L2 from 32: Zen 4's 1 MiB gives 32
    assert prefetch_distance(256) == near and prefetch_distance(512) == max(near // 2, 16)
    # rows up to 256 bytes get `near`, wider rows half of it (16 at least); the generic kernel 16
    assert pf((10**6, 16, POOLING, BATCH, 4, 1)) == pf((10**6, 128, POOLING, BATCH, 2, 1)) == {"distance": near,
                                                                                             "hint": "l2"}
    assert pf((10**6, 128, POOLING, BATCH, 4, 1))["distance"] == max(near // 2, 16)
    assert pf((10**6, 37, POOLING, BATCH, 4, 1))["distance"] == 16
    # the hint follows where the rows come from: L1 for a table within L2, L2 beyond
    l2_rows = l2 // (64 * 4)
    assert pf((l2_rows, 64, POOLING, BATCH, 4, 1))["hint"] == "l1"
    assert pf((l2_rows + 1, 64, POOLING, BATCH, 4, 1))["hint"] == "l2"
    if caches == "zen4":  # the choices measured there before the rule scaled them
        assert prefetch_distance(256, l2) == 32 and prefetch_distance(512, l2) == 16


@pytest.mark.parametrize("caches", [None, *sorted(CACHE_PRESETS)], ids=lambda c: c or "host")
def test_bf16_tables_far_beyond_the_caches_are_built_as_pairs_on_amd(caches, db, monkeypatch):
    if caches:
        monkeypatch.setenv("JITKERN_CACHE_SIZES", caches)
    else:
        monkeypatch.delenv("JITKERN_CACHE_SIZES", raising=False)
    first = PAIRS_FROM_L3 * host_target().l3 // (4 * 128)  # rows of 512 bytes (both halves, D=128) from which
    pairs = "split" if host_target().page_streams else "pairs"  # Intel's (and others'): split at any size
    assert layout_for(first - 1, 128) == "split" and layout_for(first, 128) == pairs
    assert layout_for(2 * first, 64) == pairs and layout_for(2 * first - 1, 64) == "split"
    tunedb.store("embedding.bf16.layout", _knobs.shape_class((10, 16, 1, 1, 2, numba.get_num_threads())),
                 {"layout": "pairs"})  # a tuned entry decides for the tables of its class
    w = np.ones((10, 16), np.float32)
    assert SplitBF16Table.from_float32(w).layout == "pairs" and SplitBF16Table.from_float32(w, "split").layout == "split"


def test_heuristics_are_the_choices_before_knobs():
    def p(dim, itemsize=4, threads=1):
        return (ROWS, dim, POOLING, BATCH, itemsize, threads)
    par = forward.PARALLEL.heuristic
    assert par(p(64, threads=2)) == {"serial_max_work": 1 << 14}
    assert par(p(64))["serial_max_work"] >= 1 << 60  # one thread: always serial
    assert par(p(128, threads=2)) == {"serial_max_work": 1 << 14}  # wide rows alike
    assert par(p(128))["serial_max_work"] >= 1 << 60
    assert sgd.PREFETCH.heuristic(p(64)) == {"distance": 32}
    assert sgd.PARALLEL.heuristic(p(64, threads=2)) == {"min_work": 1 << 16, "min_table": 16 << 20}
    assert adagrad.PREFETCH.heuristic(p(64)) == {"distance": 32, "link": 32}
    assert adagrad.PARALLEL.heuristic(p(64, threads=2)) == {"min_nnz": 8192}
    assert forward.WIDEN.heuristic(p(64, 2)) == _knobs.widen_heuristic(p(64, 2))
    assert sgd.WIDEN.heuristic(p(64, 2)) == _knobs.split_heuristic(p(64, 2))
    assert {k for k in knobs.registered() if k.startswith("embedding.")} == {
        "embedding.forward.prefetch", "embedding.update.prefetch.sgd", "embedding.update.prefetch.adagrad",
        "embedding.parallel.forward", "embedding.parallel.sgd", "embedding.parallel.adagrad",
        "embedding.bf16.widen.forward", "embedding.bf16.widen.sgd", "embedding.quantized.prefetch",
        "embedding.forward.columns", "embedding.bf16.layout"}
    assert forward.COLUMNS.heuristic(p(64)) == _knobs.columns_heuristic(p(64))


@pytest.mark.parametrize("isa, dim, scheme, split", [("avx512", 128, "shuffle", "shuffle"),
                                                     ("avx2", 128, "shift", "unpack8"),
                                                     ("avx2", 64, "parity", "unpack8"),
                                                     ("scalar", 64, "shift", "shift")])
def test_bf16_rows_widen_by_a_cross_lane_shuffle_only_with_avx512(isa, dim, scheme, split, monkeypatch):
    # a choice, no kernel: any ISA can be posed on any host. AVX2's forward widens by parity while
    # the accumulator leaves registers for it (D=128 fills all 16); its Split-SGD keeps its 16-bit
    # unpacks within 128-bit lanes and permutes dout's row to match instead
    monkeypatch.setattr(_knobs, "target_isa", lambda: isa)
    problem = (1 << 20, dim, 20, 2048, 2, 1)
    assert forward.WIDEN.heuristic(problem) == {"scheme": scheme}
    assert sgd.WIDEN.heuristic(problem) == {"scheme": split}


@pytest.mark.parametrize("isa, dim, cols", [("avx512", 128, 1), ("avx2", 128, 2), ("avx2", 64, 1), ("avx2", 100, 1),
                                            ("neon", 128, 2), ("neon", 64, 1), ("scalar", 128, 1)])
def test_forward_pools_in_column_blocks_when_the_accumulator_fills_the_registers(isa, dim, cols, monkeypatch):
    # a choice, no kernel: the fewest blocks whose accumulator takes at most half the registers
    # (AVX2: 16 of 8 floats, AVX-512: 32 of 16, NEON: 32 of 4); the generic width has one block
    monkeypatch.setattr(_knobs, "target_isa", lambda: isa)
    for itemsize in (4, 2):
        problem = (1 << 20, dim, 20, 2048, itemsize, 1)
        assert forward.COLUMNS.heuristic(problem) == {"cols": cols}
        assert {"cols": cols} in forward.COLUMNS.candidates(problem, True)


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_every_column_split_pools_the_same_bits(bf16, db, one_thread):
    """Column blocks change which registers hold a bag's sum, not the order of its additions: at
    D=128 (where AVX2 splits), weighted, mean and empty bags, every candidate gives the same bits
    as one block, and the reference's sums to rounding."""
    dim = 128
    w, idx, off, _, psw = _batch(5, dim=dim, weighted=True)
    off = off.copy()
    off[4] = off[3]  # bag 3 empty
    table = SplitBF16Table.from_float32(w) if bf16 else w
    problem = (ROWS, dim, POOLING, BATCH, 2 if bf16 else 4, 1)
    cands = forward.COLUMNS.candidates(problem, False)
    assert len(cands) > 1
    seen = []
    for params in cands + [{"cols": 3}]:  # 3 does not divide D (a hand-edited DB): one block, not lost columns
        tunedb.store(forward.COLUMNS.name, forward.COLUMNS.shape_class(problem), params)
        seen.append([embedding_bag_forward(table, idx, off, mode=mode, per_sample_weights=p).view(np.uint32)
                     for mode, p in (("sum", psw), ("mean", None))])
    for got in seen[1:]:
        for a, b in zip(got, seen[0]):
            np.testing.assert_array_equal(a, b)
    rows = reference.bf16_to_float32(table.hi) if bf16 else w
    want = reference.embedding_bag_forward(rows, idx, off, per_sample_weights=psw)
    np.testing.assert_allclose(seen[0][0].view(np.float32), want, rtol=1e-5, atol=1e-4)
    assert not seen[0][1].view(np.float32)[3].any()  # the empty bag


@pytest.mark.parametrize("dim", [16, 32, 128])
def test_every_widening_pools_the_same_bits_at_every_width(dim, db, one_thread):
    """PARITY sums rows in parity order and puts the sum back once per bag: at every specialised
    width (D=64 is the candidates' test below), weighted and mean bags, the same bits as every
    other scheme, and the reference's sums of the bf16 rows to rounding."""
    w, idx, off, _, psw = _batch(4, dim=dim, weighted=True)
    off = off.copy()
    off[4] = off[3]  # bag 3 empty, bag 4 twice the pooling
    table = SplitBF16Table.from_float32(w)
    problem = (ROWS, dim, POOLING, BATCH, 2, 1)
    seen = []
    for params in forward.WIDEN.candidates(problem, False):
        tunedb.store(forward.WIDEN.name, forward.WIDEN.shape_class(problem), params)
        seen.append([embedding_bag_forward(table, idx, off, mode=mode, per_sample_weights=p).view(np.uint32)
                     for mode, p in (("sum", psw), ("mean", None))])
    assert {p["scheme"] for p in forward.WIDEN.candidates(problem, False)} >= {"parity", "shift", "shuffle"}
    for got in seen[1:]:
        for a, b in zip(got, seen[0]):
            np.testing.assert_array_equal(a, b)
    rows = reference.bf16_to_float32(table.hi)
    want = reference.embedding_bag_forward(rows, idx, off, per_sample_weights=psw)
    np.testing.assert_allclose(seen[0][0].view(np.float32), want, rtol=1e-5, atol=1e-4)
    assert not seen[0][1].view(np.float32)[3].any()  # the empty bag


@pytest.mark.parametrize("dim", [16, 32, 128])
def test_every_split_scheme_is_exact_fp32_sgd_at_every_width(dim, db, one_thread):
    """The lane-order schemes permute dout's row and undo the permutation on the split: at every
    specialised width (D=64 is the candidates' test below; UNPACK16 at D=16 uses 8-float vectors),
    against the reference fp32 update bit for bit."""
    w, idx, off, dout, psw = _batch(3, dim=dim, weighted=True)
    ref_w = w.copy()
    reference.embedding_bag_sgd_(ref_w, idx, off, dout, 0.1, per_sample_weights=psw)
    problem = (ROWS, dim, POOLING, BATCH, 2, 1)
    for params in sgd.WIDEN.candidates(problem, False):
        tunedb.store(sgd.WIDEN.name, sgd.WIDEN.shape_class(problem), params)
        table = SplitBF16Table.from_float32(w)
        embedding_bag_sgd_(table, idx, off, dout, 0.1, per_sample_weights=psw)
        np.testing.assert_array_equal(table.to_float32().view(np.uint32), ref_w.view(np.uint32), err_msg=str(params))


@pytest.mark.parametrize("name, bf16", [("embedding.forward.prefetch", False), ("embedding.update.prefetch.sgd", False),
                                        ("embedding.update.prefetch.adagrad", False),
                                        ("embedding.bf16.widen.forward", True), ("embedding.bf16.widen.sgd", True),
                                        ("embedding.forward.columns", False), ("embedding.forward.columns", True),
                                        ("embedding.bf16.layout", True)])
def test_every_candidate_computes_the_default_results(name, bf16, db, one_thread):
    knob = knobs.get(name)
    problem = (ROWS, DIM, POOLING, BATCH, 2 if bf16 else 4, 1)
    batches = [_batch(0), _batch(1, weighted=True)]
    default = [_run_ops(*b, bf16=bf16) for b in batches]
    w, idx, off, dout, psw = batches[1]  # against the reference too (the forward to rounding)
    want = reference.embedding_bag_forward(reference.bf16_to_float32(reference.bf16_split(w)[0]) if bf16 else w,
                                           idx, off, per_sample_weights=psw)
    np.testing.assert_allclose(default[1][0].view(np.float32), want, rtol=1e-5, atol=1e-4)
    ref_w = w.copy()
    reference.embedding_bag_sgd_(ref_w, idx, off, dout, 0.1, per_sample_weights=psw)
    np.testing.assert_array_equal(default[1][1], ref_w.view(np.uint32))
    candidates = knob.candidates(problem, True)
    assert len(candidates) > 1 and knob.heuristic(problem) in candidates
    for params in candidates:
        tunedb.store(name, knob.shape_class(problem), params)
        assert knob.choose(problem) == params
        for b, want_bits in zip(batches, default):
            for got, want in zip(_run_ops(*b, bf16=bf16), want_bits):
                np.testing.assert_array_equal(got, want)


def test_forward_prefetch_line_step_is_64_or_128():
    """A prefetch choice without a step (an entry tuned before it was one) hints every line; one
    that is neither 64 nor 128 (a hand-edited DB) too, never a loop that does not advance. The
    HintChooser's alternative keeps the tuned step."""
    def spec(prefetch):
        return forward._spec(64, False, True, prefetch, {"scheme": "shift"})["pstep"]
    assert spec({"distance": 16, "hint": "l1"}) == 64
    assert spec({"distance": 16, "hint": "l1", "step": 128}) == 128
    assert spec({"distance": 16, "hint": "l1", "step": 0}) == spec({"distance": 16, "hint": "l1", "step": 96}) == 64
    assert forward._other_hint({"distance": 16, "hint": "l1", "step": 128}, 256)["step"] == 128
    assert "step" not in forward._other_hint({"distance": 16, "hint": "l2"}, 256)


def test_tuned_entries_reach_the_kernels(db, one_thread, monkeypatch, caplog):
    problem = (ROWS, DIM, POOLING, BATCH, 4, 1)
    tunedb.store("embedding.forward.prefetch", _knobs.shape_class(problem),
                 {"distance": 16, "hint": "nta", "step": 128})
    tunedb.store("embedding.update.prefetch.sgd", _knobs.shape_class(problem), {"distance": 64})
    tunedb.store("embedding.forward.columns", _knobs.shape_class(problem), {"cols": 2})
    w, idx, off, dout, _ = _batch()
    monkeypatch.setenv("JITKERN_DEBUG", "1")
    with caplog.at_level("DEBUG", logger="jitkern"):
        embedding_bag_forward(w, idx, off)
        embedding_bag_sgd_(w, idx, off, dout, 0.1)
    assert "embedding_bag_forward[float32](D=64,bf16=False,cols=2,hint=nta,pf=16,pstep=128,serial=True" in caplog.text
    assert "embedding_bag_sgd[float32](D=64,bf16=False,parallel=False,pf=64," in caplog.text
    assert adagrad._kernels(ROWS, DIM, 1, POOLING * BATCH, BATCH)[:2] == (8192, 32)
    tunedb.store("embedding.update.prefetch.adagrad", _knobs.shape_class(problem), {"distance": 32, "link": 8})
    assert adagrad._kernels(ROWS, DIM, 1, POOLING * BATCH, BATCH)[:2] == (8192, 8)


@pytest.mark.skipif(numba.config.NUMBA_NUM_THREADS < 2, reason="needs 2 numba threads")
def test_parallel_thresholds_from_the_db_keep_results(db):
    """Tuned thresholds that send every call to the parallel kernels (or keep all on the calling
    thread) change nothing in the results; the generic width's kernels, as the property tests'."""
    dim, threads = 5, numba.get_num_threads()
    problem = (ROWS, dim, POOLING, BATCH, 4, threads)
    batch = _batch(2, dim=dim)
    default = _run_ops(*batch)
    assert threads > 1
    for fwd, upd, ada in (({"serial_max_work": -1}, {"min_work": 0, "min_table": 0}, {"min_nnz": 0}),
                          ({"serial_max_work": _knobs.NEVER}, {"min_work": _knobs.NEVER, "min_table": 0},
                           {"min_nnz": _knobs.NEVER})):
        cls = _knobs.shape_class(problem)
        tunedb.store_many([("embedding.parallel.forward", cls, fwd), ("embedding.parallel.sgd", cls, upd),
                           ("embedding.parallel.adagrad", cls, ada)])
        for got, want in zip(_run_ops(*batch), default):
            np.testing.assert_array_equal(got, want)


@pytest.mark.skipif(numba.config.NUMBA_NUM_THREADS < 2, reason="needs 2 numba threads")
def test_parallel_searches_return_thresholds():
    problem = (ROWS, 5, POOLING, BATCH, 4, 2)
    for knob, key in ((forward.PARALLEL, "serial_max_work"), (sgd.PARALLEL, "min_work"), (adagrad.PARALLEL, "min_nnz")):
        r = tune.tune_problem(knob, problem, quick=True, min_time=0.0)
        assert set(r.best) == set(knob.heuristic(problem)) and isinstance(r.best[key], int)
        one = knob.search(problem[:-1] + (1,), True, lambda fn: 0.0)  # one thread: nothing to time
        assert one == knob.heuristic(problem[:-1] + (1,))


def test_tuner_stores_embedding_entries(db):
    results = tune.tune(WORKLOAD, quick=True, select="embedding.*", min_time=0, out=None)
    names = {r.knob for r in results}
    assert names == {"embedding.forward.prefetch", "embedding.update.prefetch.sgd", "embedding.update.prefetch.adagrad",
                     "embedding.parallel.forward", "embedding.parallel.sgd", "embedding.parallel.adagrad",
                     "embedding.forward.columns"}
    stored = tunedb.entries()
    cls = _knobs.shape_class((ROWS, DIM, POOLING, BATCH, 4, 1))
    for r in results:
        assert stored[r.knob][cls] == r.best
        assert r.best_s is None or r.best_s <= r.heuristic_s
    assert tune.tune(WORKLOAD, quick=True, select="embedding.*", only_missing=True, min_time=0, out=None) == []


def test_runners_share_one_batch_pool_and_position():
    """Runners of one problem draw from one pool beyond the last-level cache and take turns through
    it: a candidate never times the rows the one before it just brought into the caches."""
    problem = (ROWS, DIM, POOLING, BATCH, 4, 1)
    pool, dout = _knobs.draw_batches(problem)
    again, _ = _knobs.draw_batches(problem)
    assert again is pool and dout.shape == (BATCH, DIM)
    nnz = POOLING * BATCH
    assert len(pool) == min(1024, -(-_knobs.pool_bytes() // (nnz * DIM * 4)))
    assert _knobs.pool_bytes() >= 2 * host_target().l3
    assert all(b[0].shape == (nnz,) and 0 <= b[0].min() and b[0].max() < ROWS for b in pool[:4])
    seen = []
    calls = [lambda k=k: seen.append(k) for k in range(len(pool))]
    first, second = _knobs.cycle(calls, pool), _knobs.cycle(calls, pool)
    first(), second(), first()
    assert seen == [0, 1, 2]
    alone = _knobs.cycle(calls)
    alone()
    assert seen == [0, 1, 2, 0]  # without a pool: its own position


@pytest.mark.parametrize("layout", ["split", "pairs"])
def test_runners_of_a_bf16_problem_share_one_table(layout, db):
    """The kernels hold a SplitBF16Table's halves only: the runners hold the table itself, or each
    candidate would build another (several tables of a large problem at once)."""
    problem = (ROWS, 128, POOLING, BATCH, 2, 1)
    runners = [forward._timed(problem, layout=layout), sgd._timed(problem, layout=layout),
               forward._timed(problem, layout=layout)]
    gc.collect()
    table = _knobs.make_table(problem, layout)
    assert table.layout == layout and all(r.table is table for r in runners)


def test_hint_chooser_times_both_choices_and_keeps_the_faster(monkeypatch):
    """A round runs each prefetch choice ADAPT_TRIES + 1 times in a row and times all but the first
    (the caches as the other choice left them); the one faster per entry (median) runs until the
    next round. Rounds come closer together at first, then every ADAPT_EVERY calls, so a change
    of regime (rows cached, or not) is followed soon."""
    monkeypatch.setattr(forward, "ADAPT_EVERY", 64)
    tries = forward.ADAPT_TRIES
    block = [(0, False)] + [(0, True)] * tries + [(1, False)] + [(1, True)] * tries
    c = forward.HintChooser()
    cost = {0: 2.0, 1: 1.0}
    runs = []
    for call in range(600):
        if call == 300:
            cost = {0: 1.0, 1: 3.0}  # the regime changes: choice 0 is faster from now on
        choice, timed = c.next()
        runs.append((choice, timed))
        if timed:
            c.record(choice, cost[choice] + (5.0 if len(runs) == 2 else 0.0))  # one outlier
    starts = [i for i in range(len(runs) - len(block) + 1) if runs[i:i + len(block)] == block]
    gaps = np.diff(starts)
    assert starts[0] == 0 and all(b >= a for a, b in zip(gaps, gaps[1:])) and gaps.max() == 64
    rounds = {i + k for i in starts for k in range(len(block))}
    assert not any(timed for i, (_, timed) in enumerate(runs) if i not in rounds)  # only rounds are timed
    between = [(i, choice) for i, (choice, _) in enumerate(runs) if i not in rounds]
    assert {choice for i, choice in between if i < 300} == {1}
    switched = next(s for s in starts if s >= 300) + len(block)
    assert {choice for i, choice in between if i >= switched} == {0}


def test_forward_beyond_l2_runs_both_hints_with_the_same_bits(monkeypatch, one_thread):
    """A table beyond L2 gets a HintChooser (one within L2 does not): whichever choice runs, the
    pooled rows are the same bits, and the reference's values."""
    monkeypatch.setenv("JITKERN_CACHE_SIZES", "l2=256K")
    monkeypatch.delenv("JITKERN_NO_TUNE", raising=False)
    monkeypatch.setattr(forward, "ADAPT_EVERY", 8)
    forward._KERNELS.clear()
    big = np.random.default_rng(3).standard_normal((2048, DIM)).astype(np.float32)  # 512 KiB > 256 KiB
    idx = np.random.default_rng(4).integers(0, big.shape[0], POOLING * BATCH)
    off = np.arange(BATCH, dtype=np.int64) * POOLING
    first = embedding_bag_forward(big, idx, off)
    np.testing.assert_allclose(first, reference.embedding_bag_forward(big, idx, off), rtol=1e-5, atol=1e-5)
    for _ in range(7):
        np.testing.assert_array_equal(embedding_bag_forward(big, idx, off).view(np.uint32), first.view(np.uint32))
    _, kernels, chooser = forward._kernels(big.shape[0], DIM, False, 1, idx.shape[0], BATCH)
    assert len(kernels) == 2 and chooser is not None and chooser.calls == 8
    assert forward._kernels(100, DIM, False, 1, idx.shape[0], BATCH)[2] is None  # 25 KiB: within L2
    forward._KERNELS.clear()
