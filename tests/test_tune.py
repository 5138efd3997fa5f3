"""Tuning DB (keying, atomic store, corrupt/stale handling), heuristics, and `jitkern info`."""
import importlib
import json

import numpy as np
import pytest

from jitkern import info
from jitkern.codegen import host_target, tune
from jitkern.ops import linear_backward, linear_forward
from jitkern.ops import reference as ref

G = importlib.import_module("jitkern.ops.gemm")


@pytest.fixture
def db(tmp_path, monkeypatch):
    path = tmp_path / "tune.json"
    monkeypatch.setenv("JITKERN_TUNE_DB", str(path))
    monkeypatch.delenv("JITKERN_NO_TUNE", raising=False)
    G.clear_block_cache()
    yield path
    G.clear_block_cache()


def test_shape_class_buckets_to_powers_of_two():
    assert tune.shape_class(2048, 1000, 13) == "2048x1024x16"
    assert tune.shape_class(1, 2, 3) == "1x2x4"
    assert tune.shape_class(1025) == tune.shape_class(2048)


def test_store_and_lookup_round_trip(db):
    assert tune.lookup("op", "8x8x8") is None and not db.exists()
    tune.store("op", "8x8x8", {"mc": 16, "kc": 32})
    tune.store("op", "16x8x8", {"mc": 24, "kc": 64})
    assert tune.lookup("op", "8x8x8") == {"mc": 16, "kc": 32}
    saved = json.loads(db.read_text())
    assert saved["targets"][tune.db_key()]["op"]["16x8x8"] == {"mc": 24, "kc": 64}
    assert host_target().key in tune.db_key() and "numba-" in tune.db_key()
    assert not list(db.parent.glob(".tune-*"))  # the temporary file was renamed into place


def test_corrupt_db_warns_and_is_ignored(db):
    db.write_text("{not json")
    with pytest.warns(RuntimeWarning, match="ignoring unreadable tuning DB"):
        assert tune.lookup("op", "8x8x8") is None
    tune.store("op", "8x8x8", {"mc": 8, "kc": 8})  # a store replaces the corrupt file
    assert tune.lookup("op", "8x8x8") == {"mc": 8, "kc": 8}


def test_stale_entries_and_no_tune_are_ignored(db, monkeypatch):
    db.write_text(json.dumps({"format": tune.FORMAT, "targets": {
        "other-cpu|jitkern-0.0|numba-0.0": {"op": {"8x8x8": {"mc": 8, "kc": 8}}}}}))
    assert tune.lookup("op", "8x8x8") is None
    tune.store("op", "8x8x8", {"mc": 16, "kc": 16})
    monkeypatch.setenv("JITKERN_NO_TUNE", "1")
    assert tune.lookup("op", "8x8x8") is None


def test_heuristic_and_thread_shaping():
    mr, nr, _ = G.tile_shape()
    h = tune.heuristic_gemm_blocks(2048, 1024, 1000, mr, nr)
    assert h["mc"] % mr == 0 and h["kc"] % 4 == 0 and 64 <= h["kc"] <= 512
    for threads in (1, 2, 3):
        mc, kc, nc = tune.gemm_blocks("x", 2048, 1024, 1000, mr, nr, threads)
        nib, njb = -(-2048 // mc), -(-1024 // nc)
        assert mc % mr == 0 and nc % nr == 0 and kc >= 1
        assert (nib * njb) % threads == 0 or nib * njb >= 4 * threads
    mc, kc, nc = tune.gemm_blocks("x", 64, 512, 2048, mr, nr, 2)  # one row block: columns get split
    assert -(-512 // nc) >= 2 and kc < 2048


def test_tuned_small_blocks_drive_multi_pass_gemm(db):
    """Tiny tuned blocks force many row blocks and K passes through the same kernel."""
    mr, nr, _ = G.tile_shape()
    n, k, m = 50, 70, 37
    tune.store("linear_forward", tune.shape_class(n, m, k), {"mc": mr, "kc": 8})
    tune.store("linear_dw", tune.shape_class(m, k, n), {"mc": mr, "kc": 12})
    G.clear_block_cache()
    assert G._blocks("linear_forward", n, m, k, G._isa(""), 1)[:2] == (mr, 8)
    rng = np.random.default_rng(0)
    x, w, b = (rng.standard_normal(s, dtype=np.float32) for s in ((n, k), (m, k), (m,)))
    y = linear_forward(x, w, b, activation="relu")
    np.testing.assert_allclose(y, ref.linear_forward(x, w, b, activation="relu"), rtol=1e-4, atol=1e-4)
    dy = rng.standard_normal((n, m), dtype=np.float32)
    for got, want in zip(linear_backward(dy, x, w, y, activation="relu"),
                         ref.linear_backward(dy, x, w, y, activation="relu")):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_tuner_stores_entries_and_info_lists_them(db, capsys):
    best = tune.tune_gemm(layers=((9, 20),), batch=16, quick=True, out=lambda *_: None, min_time=0.0)
    assert {op for op, _ in best} == {"linear_forward", "linear_dx", "linear_dw"}
    assert tune.entries()["linear_dx"]  # stored under this CPU's key
    assert info.main([]) == 0
    text = capsys.readouterr().out
    assert host_target().key in text and str(db) in text and "linear_dw" in text
    assert tune.main(["--quick", "--only", "7->5", "--batch", "8"]) == 0
    with pytest.raises(SystemExit):
        tune.main(["bad"])
