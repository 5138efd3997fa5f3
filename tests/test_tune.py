"""Per-CPU knobs and the tuning DB (keying, atomic store, corrupt/stale handling), the GEMM
blocking heuristic under other CPUs' caches, the tuner, and `jitkern info`."""
import importlib
import json

import numpy as np
import pytest

from jitkern import info, tuning
from jitkern.codegen import host_target, knobs, tune, tunedb
from jitkern.codegen.simd import short_rows
from jitkern.codegen.target import detected_target, page_streams_of
from jitkern.config import CACHE_PRESETS, PRESET_PAGE_STREAMS, parse_cache_sizes
from jitkern.ops import linear_backward, linear_forward
from jitkern.ops import reference as ref
from jitkern.ops.gemm_kernel import tail_tiles

G = importlib.import_module("jitkern.ops.gemm")
GB = importlib.import_module("jitkern.ops.gemm_knobs")
CACHES = [None, *sorted(CACHE_PRESETS)]  # the host's, then the CPUs we stand in for


@pytest.fixture
def db(tmp_path, monkeypatch):
    path = tmp_path / "tune.json"
    monkeypatch.setenv("JITKERN_TUNE_DB", str(path))
    monkeypatch.delenv("JITKERN_NO_TUNE", raising=False)
    yield path


@pytest.fixture(params=CACHES, ids=lambda c: c or "host")
def caches(request, monkeypatch):
    """Run under the host's caches and each preset CPU's (JITKERN_CACHE_SIZES)."""
    if request.param:
        monkeypatch.setenv("JITKERN_CACHE_SIZES", request.param)
    else:
        monkeypatch.delenv("JITKERN_CACHE_SIZES", raising=False)
    return host_target()


def test_pow2_class_buckets():
    assert knobs.pow2_class(2048, 1000, 13) == "2048x1024x16"
    assert knobs.pow2_class(1, 2, 3) == "1x2x4"
    assert knobs.pow2_class(1025) == knobs.pow2_class(2048)


def test_store_and_lookup_round_trip(db):
    assert tunedb.lookup("k", "8x8x8") is None and not db.exists()
    tunedb.store("k", "8x8x8", {"mc": 16, "kc": 32})
    tunedb.store("k", "16x8x8", {"mc": 24, "kc": 64})
    assert tunedb.lookup("k", "8x8x8") == {"mc": 16, "kc": 32}
    saved = json.loads(db.read_text())
    assert saved["format"] == tunedb.FORMAT
    assert saved["targets"][tunedb.db_key()]["k"]["16x8x8"] == {"mc": 24, "kc": 64}
    assert host_target().key in tunedb.db_key() and "numba-" in tunedb.db_key()
    assert not list(db.parent.glob(".tune-*"))  # the temporary file was renamed into place


def test_corrupt_db_warns_and_is_ignored(db):
    db.write_text("{not json")
    with pytest.warns(RuntimeWarning, match="ignoring unreadable tuning DB"):
        assert tunedb.lookup("k", "8x8x8") is None
    tunedb.store("k", "8x8x8", {"mc": 8, "kc": 8})  # a store replaces the corrupt file
    assert tunedb.lookup("k", "8x8x8") == {"mc": 8, "kc": 8}


def test_stale_old_format_and_no_tune_are_ignored(db, monkeypatch):
    db.write_text(json.dumps({"format": tunedb.FORMAT, "targets": {
        "other-cpu|jitkern-0.0|numba-0.0": {"k": {"8x8x8": {"mc": 8, "kc": 8}}}}}))
    assert tunedb.lookup("k", "8x8x8") is None
    db.write_text(json.dumps({"format": 1, "targets": {tunedb.db_key(): {"k": {"8x8x8": {"mc": 8}}}}}))
    assert tunedb.lookup("k", "8x8x8") is None
    tunedb.store("k", "8x8x8", {"mc": 16, "kc": 16})
    monkeypatch.setenv("JITKERN_NO_TUNE", "1")
    assert tunedb.lookup("k", "8x8x8") is None


def test_cache_override_parses_and_keys_entries_apart(monkeypatch):
    assert parse_cache_sizes("zen3") == CACHE_PRESETS["zen3"]
    assert parse_cache_sizes("l2=512K, l3=32M") == (None, 512 << 10, 32 << 20)
    for bad in ("l4=1M", "l2=lots", "haswell"):
        with pytest.raises(ValueError, match="JITKERN_CACHE_SIZES"):
            parse_cache_sizes(bad)
    monkeypatch.delenv("JITKERN_CACHE_SIZES", raising=False)  # the host as it is, whatever the suite runs under
    monkeypatch.delenv("JITKERN_ISA", raising=False)
    host = host_target()
    host_key = host.key
    monkeypatch.setenv("JITKERN_CACHE_SIZES", "l2=512K")
    t = host_target()
    assert t.l2 == 512 << 10 and t.l1d == host.l1d and t.cache_override and t.key != host_key
    monkeypatch.delenv("JITKERN_CACHE_SIZES")
    if host.detected_isa == "avx512":
        assert host.has("avx512f")
        monkeypatch.setenv("JITKERN_ISA", "avx2")
        assert host_target().key != host_key and "isa=avx2" in host_target().key
        assert not host_target().has("avx512f") and host_target().has("fma")


def test_heuristic_and_thread_shaping(caches):
    """Blocks fit the (stand-in) caches, and threads get even work: split by rows where there are
    enough row blocks, by columns too where there are not (the expectation follows the model)."""
    t = caches
    mr, nr, _ = GB.tile_shape()
    h = GB.heuristic_blocks("linear_forward", 2048, 1024, 1000)
    assert h["mc"] % mr == 0 and h["kc"] % 4 == 0 and 64 <= h["kc"] <= 512
    assert h["mc"] * h["kc"] * 4 <= max(t.l2 // 4, mr * h["kc"] * 4)  # the A block in a quarter of L2
    for threads in (1, 2, 3):
        mc, kc, nc = GB.shape_blocks(h, 2048, 1024, 1000, threads)
        nib, njb = -(-2048 // mc), -(-1024 // nc)
        assert mc % mr == 0 and nc % nr == 0 and kc >= 1
        assert (nib * njb) % threads == 0 or nib * njb >= 4 * threads
    m, n, k = 64, 512, 2048
    h = GB.heuristic_blocks("linear_forward", m, n, k)
    mc, kc, nc = GB.shape_blocks(h, m, n, k, 2)
    nib, njb = -(-m // mc), -(-n // nc)
    assert kc < k and nib * njb >= 2 and (nib * njb) % 2 == 0
    if -(-m // GB._round_to(h["mc"], mr)) < 4:   # fewer row blocks than 2 per thread: columns split
        assert njb >= 2
    m, n, k = 1024, nr, 1024                     # one column panel (a small batch run transposed): rows split
    for threads in (2, 3):
        mc, kc, nc = GB.shape_blocks(GB.heuristic_blocks("linear_forward_t", m, n, k), m, n, k, threads)
        assert -(-n // nc) == 1 and -(-m // mc) >= threads


@pytest.mark.parametrize("variant,m,n,k", [("linear_forward", 2048, 512, 13), ("linear_forward", 2048, 1024, 100),
                                           ("linear_dx", 2048, 256, 64), ("linear_dx", 2048, 512, 256),
                                           ("linear_forward", 2048, 1024, 1024), ("linear_dwt", 13, 512, 2048),
                                           ("linear_dw", 64, 256, 2048), ("linear_dx", 32, 479, 1024),
                                           ("linear_dw", 512, 13, 2048)])
def test_heuristic_strided_streams(caches, variant, m, n, k):
    """The heuristic keeps strided rows within the prefetchers' reach: where they follow a limited
    number of pages (page_streams, Intel's), a column panel's strip of C rows spans at most
    max(kc/2, page_streams) pages of 4 KiB (and a short K's strip no fewer) unless it is one
    register tile high or the whole of C sits in half of L2; without the limit (AMD's) the strip
    is as tall as a quarter of L2 holds of the A block's rows; B read in place by
    more than two row tiles gives K passes of at most the rows of L2 (or 64), even where one pass
    would do, by one or two a long K loop all the same, except where the prefetchers follow page
    streams: then B read in place by any number of row tiles takes passes of at most the rows of a
    quarter of L2 and page_streams rows of hints per row tile; A's columns read in place (a C of
    one column panel) at most the rows of L2 (a quarter there); a block is never taller than C."""
    mr, _, _ = GB.tile_shape()
    h = GB.heuristic_blocks(variant, m, n, k)
    mc, kc = h["mc"], h["kc"]
    assert mc % mr == 0 and mr <= mc <= GB._round_to(m, mr) and kc % 4 == 0
    rows_per_page = max(1, 4096 // (n * 4))
    whole_c = mc == GB._round_to(m, mr) and m * n * 4 <= caches.l2 // 2
    streams = caches.page_streams
    l2_rows = (caches.l2 // 4) // (max(kc, 128) * 4)  # the A block's rows in a quarter of L2
    if not whole_c and mc > mr and streams:
        assert -(-mc // rows_per_page) <= max(1, kc // 2, streams)
    if mc < GB._round_to(m, mr) and kc < 2 * max(streams, 32):  # a short K loop: still a strip of page_streams
        assert mc >= min((streams * rows_per_page if streams else l2_rows) - mr, l2_rows - mr, 512 // mr * mr)
    tb = variant.startswith("linear_forward")
    b_in_place = GB.b_in_place(tb, m, n, mr, GB.tile_shape()[1])
    reach = caches.l2 // 4 if streams else caches.l2  # of L2 for rows reread a stride apart
    if b_in_place and k > 64 and (m > 2 * mr or streams):
        assert kc <= max(64, reach // (n * 4))
    if b_in_place and k > 64 and streams:  # a row tile's share of the next panel's hints
        assert kc <= max(64, streams * sum(tail_tiles(m, mr, short_rows(caches.isa))))
    if b_in_place and m <= 2 * mr and k >= 512 and not streams:
        assert kc >= 256
    if variant in ("linear_dw", "linear_dwt") and n <= GB.tile_shape()[1] and k > 64:  # A's columns in place
        assert kc <= max(64, reach // (m * 4))  # their kc rows fit L2 even in the fewest sets


def test_page_streams_follow_the_cpu(monkeypatch):
    """The prefetcher model comes with the CPU: detected from its name, or from a preset stand-in;
    it decides how tall a short K loop's C strip is (a 32-row batch's weight gradient)."""
    assert page_streams_of("znver3") == page_streams_of("znver4") == 0
    assert page_streams_of("skylake-avx512") == page_streams_of("haswell") == page_streams_of("neoverse-n1") == 32
    strips = {}
    for preset in ("zen3", "skylake-sp"):
        monkeypatch.setenv("JITKERN_CACHE_SIZES", preset)
        assert host_target().page_streams == PRESET_PAGE_STREAMS[preset]
        strips[preset] = GB.heuristic_blocks("linear_dw", 1024, 1024, 32)["mc"]
    assert strips["skylake-sp"] <= 32 < strips["zen3"]  # 4 KiB C rows: a row a page
    monkeypatch.setenv("JITKERN_CACHE_SIZES", "l2=512K")  # sizes alone keep the host's prefetcher
    assert host_target().page_streams == detected_target().page_streams


def test_a_small_c_takes_one_k_pass(caches):
    """One block holding all of a small C (a small batch's dx) takes K in one pass while A's rows
    are at most a page long and B is packed within half of L2 (or read in place by at most two row
    tiles, where no page-limited prefetcher leaves it to the sweep's hints); a B packed beyond that
    goes in K passes of PASS_ROW_BYTES-long rows in half of L2; a longer K, a C too tall for one
    block, or B's rows reread in place keep passes of the rows L2 holds (a quarter of it on Intel)."""
    mr, nr, _ = GB.tile_shape()
    kmax = GB.PAGE // 4
    for m, n, k in ((32, 1024, kmax), (32, 479, kmax), (12, 512, kmax // 2 + 4), (2 * mr, 1024, kmax),
                    (32, 512, 128)):
        h = GB.heuristic_blocks("linear_dx", m, n, k)
        whole = GB._round_to(m, mr)
        in_place = GB.b_in_place(False, m, n, mr, nr)
        reread = in_place and (m > 2 * mr or caches.page_streams > 0)  # by several tiles, or hinted
        by_pass = not in_place and k * n * 4 > caches.l2 // 2
        if whole * k * 4 <= caches.l2 * 3 // 4 and m * n * 4 <= caches.l2 // 2 and by_pass:
            rows = caches.l2 // 2 // GB.PASS_ROW_BYTES
            # passes of at most that many rows (kc rounded up to whole vectors' worth of 4), the fewest
            assert h["mc"] == whole and h["kc"] <= rows + 3 and -(-k // h["kc"]) == -(-k // rows), (m, n, k, h)
        elif whole * k * 4 <= caches.l2 * 3 // 4 and m * n * 4 <= caches.l2 // 2 and not reread:
            assert h == {"mc": whole, "kc": k}, (m, n, k, h)
        elif reread:
            reach = caches.l2 // 4 if caches.page_streams else caches.l2
            assert h["mc"] == whole and h["kc"] <= min(k, max(64, reach // (n * 4))), (m, n, k, h)
        else:
            assert caches.l2 < 512 << 10, "Zen 3's and Zen 4's caches hold these blocks"
    assert GB.heuristic_blocks("linear_dx", 32, 1024, 2 * kmax)["kc"] < 2 * kmax
    assert GB.heuristic_blocks("linear_dx", 2048, 1024, kmax)["kc"] <= 512


@pytest.mark.parametrize("threads", [1, 2])
def test_gemm_runners_time_the_problems_thread_count(monkeypatch, threads):
    """A tuning entry for t threads is timed on t threads whatever numba is set to: a one-thread
    entry timed on two would favour blocks that split the work."""
    import numba
    B = importlib.import_module("jitkern.ops.gemm_bf16")
    seen = []
    for mod, name in ((GB, "gemm_into"), (B, "gemm_bf16_into")):
        real = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, _real=real, **kw: (seen.append(numba.get_num_threads()),
                                                                     _real(*a, **kw))[1])
    want = min(threads, numba.config.NUMBA_NUM_THREADS)
    other = 2 if want == 1 else 1
    knob_runs = [(GB.BLOCKS["linear_dw"], (64, 256, 96, threads)), (G.FORWARD_LAYOUT, (8, 64, 32, threads)),
                 (G.DW_LAYOUT, (64, 13, 96, threads)),
                 (B.BLOCKS["linear_forward"], (16, 64, 32, threads))]
    before = numba.get_num_threads()
    numba.set_num_threads(min(other, numba.config.NUMBA_NUM_THREADS))
    try:
        for kn, problem in knob_runs:
            seen.clear()
            kn.runner(problem, kn.heuristic(problem))()
            assert seen and set(seen) == {want}, (kn.name, seen)
        assert numba.get_num_threads() == min(other, numba.config.NUMBA_NUM_THREADS)  # restored
    finally:
        numba.set_num_threads(before)


def test_choice_follows_db_and_environment(db, monkeypatch):
    kn = GB.BLOCKS["linear_forward"]
    p = (300, 200, 100, 1)
    heur = kn.choose(p)
    assert heur == GB.heuristic_blocks("linear_forward", *p)
    tunedb.store(kn.name, kn.shape_class(p), {"mc": 12, "kc": 40})
    assert kn.choose(p) == {"mc": 12, "kc": 40}  # a store in this process is seen at once
    monkeypatch.setenv("JITKERN_NO_TUNE", "1")
    assert kn.choose(p) == heur
    monkeypatch.setenv("JITKERN_CACHE_SIZES", "skylake")
    assert kn.choose(p) == GB.heuristic_blocks("linear_forward", *p)


def test_tuned_small_blocks_drive_multi_pass_gemm(db):
    """Tiny tuned blocks force many row blocks and K passes through the same kernel."""
    mr, nr, _ = GB.tile_shape()
    n, k, m = 50, 70, 37
    fwd, dw = GB.BLOCKS["linear_forward"], GB.BLOCKS[G.dw_variant(m, k, mr, nr)]
    tunedb.store(fwd.name, fwd.shape_class((n, m, k, 1)), {"mc": mr, "kc": 8})
    tunedb.store(dw.name, dw.shape_class((m, k, n, 1)), {"mc": mr, "kc": 12})
    assert GB.blocks_for("linear_forward", n, m, k, 1)[:2] == (mr, 8)
    rng = np.random.default_rng(0)
    x, w, b = (rng.standard_normal(s, dtype=np.float32) for s in ((n, k), (m, k), (m,)))
    y = linear_forward(x, w, b, activation="relu")
    np.testing.assert_allclose(y, ref.linear_forward(x, w, b, activation="relu"), rtol=1e-4, atol=1e-4)
    dy = rng.standard_normal((n, m), dtype=np.float32)
    for got, want in zip(linear_backward(dy, x, w, y, activation="relu"),
                         ref.linear_backward(dy, x, w, y, activation="relu")):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_tuner_stores_entries_and_info_lists_them(db, capsys):
    work = knobs.Workload(linears=((16, 9, 20),))
    results = tune.tune(work, quick=True, select="gemm.*", out=None, min_time=0.0)
    names = {r.knob for r in results}
    assert {"gemm.blocks.linear_forward", "gemm.blocks.linear_dx"} <= names
    assert names & {"gemm.blocks.linear_dw", "gemm.blocks.linear_dwt"}
    assert all(r.best_s <= r.heuristic_s for r in results)
    assert tunedb.entries()["gemm.blocks.linear_dx"]  # stored under this CPU's key
    # tuned once: a second pass with only_missing times nothing
    assert tune.tune(work, quick=True, select="gemm.*", only_missing=True, out=None, min_time=0.0) == []
    assert info.main([]) == 0
    text = capsys.readouterr().out
    assert host_target().key in text and str(db) in text and "gemm.blocks.linear_dx" in text
    assert tuning.main(["--quick", "--only", "7->5", "--batch", "8", "--knob", "gemm.*"]) == 0
    assert tuning.main(["--quick", "--only", "7->5", "--batch", "8", "--knob", "gemm.bf16.*", "--precision", "bf16"]) == 0
    assert "gemm.bf16.blocks.linear_forward" in tunedb.entries()
    assert "embedding.bf16.layout" not in tunedb.entries()
    # a bf16 config's tables are bf16 (Split-SGD) tables, as the model's own --autotune tunes them
    assert tuning.main(["--quick", "--config", "tiny", "--batch", "8", "--knob", "embedding.bf16.layout",
                        "--precision", "bf16"]) == 0
    assert "embedding.bf16.layout" in tunedb.entries()
    assert tuning.main(["--list"]) == 0 and "gemm.blocks.linear_forward" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        tuning.main(["bad"])


def test_quick_tune_times_one_table_per_cache_level(db):
    """A quick tune times one table per cache level that holds it (and width, itemsize, threads)
    and stores the choice for every shape class of that level; the full tune times each class."""
    t = host_target()
    row_bytes = 16 * 4
    in_l1 = [r for r in (4, 16, 64) if r * row_bytes <= t.l1d]
    in_l2 = [r for r in (t.l2 // row_bytes // 2, t.l2 // row_bytes // 4) if r * row_bytes > t.l1d]
    work = knobs.Workload(tables=tuple((r, 16, 1, 64, 4) for r in in_l1 + in_l2), threads=(1,))
    name = "embedding.update.prefetch.sgd"
    quick = tune.tune(work, quick=True, select=name, out=None, min_time=0.0)
    assert len(quick) == bool(in_l1) + bool(in_l2)
    classes = {f"{knobs.pow2_class(r)}x16x4B/t1" for r in in_l1 + in_l2}
    assert set(tunedb.entries()[name]) == classes
    assert len(tune.tune(work, quick=False, select=name, out=None, min_time=0.0)) == len(classes)


def test_bf16_gemm_blocks_are_tuned_for_bf16_layers_only():
    from jitkern.dlrm.configs import CONFIGS
    fp32, bf16 = knobs.get("gemm.blocks.linear_forward"), knobs.get("gemm.bf16.blocks.linear_forward")
    work = knobs.Workload(linears=((16, 9, 20),))
    assert list(fp32.problems(work)) and not list(bf16.problems(work))
    work = CONFIGS["tiny"].workload(64, precision="bf16")
    assert work.precisions == ("bf16",) and list(bf16.problems(work)) and not list(fp32.problems(work))
    assert work.merged(knobs.Workload()).precisions == ("bf16", "fp32")


def test_candidates_are_timed_in_interleaved_rounds(monkeypatch):
    """Each candidate is timed once per round, rounds interleaved, and keeps its median round: a
    candidate lucky in one round (c) loses to one unlucky in one round (b)."""
    clock, log = [0.0], []
    monkeypatch.setattr(tune.time, "perf_counter", lambda: clock[0])
    costs = {"a": [5, 3, 3, 3], "b": [5, 9, 1, 1], "c": [5, 0.5, 4, 4]}  # warm-up, then one call per round

    def runner(problem, params):
        name, calls = params["x"], [0]

        def run():
            log.append(name)
            clock[0] += costs[name][calls[0]]
            calls[0] += 1
        return run
    k = knobs.Knob("test.rounds", lambda p: {"x": "a"}, lambda p: "all", lambda w: [()],
                   lambda p, quick: [{"x": x} for x in "abc"], runner, None, "", None)
    r = tune.tune_problem(k, (), quick=True, min_time=0.0)
    assert tune.ROUNDS == 3 and log == ["a", "a", "b", "b", "c", "c"] + ["a", "b", "c"] * 2
    assert r.best == {"x": "b"} and (r.heuristic_s, r.best_s, r.best_other_s) == (3, 1, 1)
