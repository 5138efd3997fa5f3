"""Criteo data as the reference's users have it: its bench scripts' command lines run unchanged
(a small raw Kaggle file, or 24 small Terabyte day files, preprocessed on first use), its
processed .npz and per-day reordered files are read, and jitkern's own reading options
(--data-randomize, --data-sub-sample-rate, --mlperf-bin-loader, --num-workers) keep their
promises."""
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from jitkern.dlrm.cli import main
from jitkern.dlrm.data import load_preprocessed
from jitkern.dlrm.data.rawgen import write_raw
from jitkern.dlrm.data.refdata import ReferencePaths, ReferenceSplits
from jitkern.dlrm.sources import Prefetched, day_shuffled, sub_sample
from jitkern.dlrm.synth import RandomData, SyntheticData

DATA = Path(__file__).parent / "data"
SMALL_MLP = ["--arch-mlp-bot=13-16", "--arch-sparse-feature-size=16", "--arch-mlp-top=8-1"]
# bench/dlrm_s_criteo_kaggle.sh and dlrm_s_criteo_terabyte.sh, as written (only the MLP sizes and
# the batch counts made small: --print-freq=1024 would print once at the end of each epoch)
KAGGLE_SH = ("--arch-sparse-feature-size=16 --arch-mlp-bot=13-512-256-64-16 --arch-mlp-top=512-256-1 "
             "--data-generation=dataset --data-set=kaggle --raw-data-file=./input/train.txt "
             "--processed-data-file=./input/kaggleAdDisplayChallenge_processed.npz --loss-function=bce "
             "--round-targets=True --learning-rate=0.1 --mini-batch-size=128 --print-freq=1024 --print-time "
             "--test-mini-batch-size=16384 --test-num-workers=16").split()
TERABYTE_SH = ("--arch-sparse-feature-size=64 --arch-mlp-bot=13-512-256-64 --arch-mlp-top=512-512-256-1 "
               "--max-ind-range=10000000 --data-generation=dataset --data-set=terabyte --raw-data-file=./input/day "
               "--processed-data-file=./input/terabyte_processed.npz --loss-function=bce --round-targets=True "
               "--learning-rate=0.1 --mini-batch-size=2048 --print-freq=1024 --print-time "
               "--test-mini-batch-size=16384 --test-num-workers=16").split()


def _run(argv, capsys):
    code = main(argv + ["--progress", "off"])
    out = capsys.readouterr()
    assert code == 0, out.err
    return out.out


def test_kaggle_script_runs_unchanged_preprocessing_on_first_use(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "input").mkdir()
    shutil.copy(DATA / "criteo_kaggle_sample.txt", tmp_path / "input" / "train.txt")
    first = _run(KAGGLE_SH, capsys)
    assert "preprocessing 1 file(s) into input/kaggleAdDisplayChallenge_processed.jitkern (first use)" in first
    assert re.search(r"Finished training it 1/1 of epoch 0, loss \S+, \S+ ms/it", first)
    assert re.search(r"Testing at it 1/1: .*\(7 samples\)", first)
    made = (tmp_path / "input" / "kaggleAdDisplayChallenge_processed.jitkern" / "meta.json").stat().st_mtime_ns
    second = _run(KAGGLE_SH, capsys)                   # reads what the first run wrote
    assert "first use" not in second and "Finished training it 1/1 of epoch 0" in second
    assert (tmp_path / "input" / "kaggleAdDisplayChallenge_processed.jitkern" / "meta.json").stat().st_mtime_ns == made


def test_terabyte_script_runs_unchanged_on_24_day_files(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "input").mkdir()
    for d in range(24):
        write_raw(tmp_path / "input" / f"day_{d}", 40 + d, seed=d)
    out = _run(TERABYTE_SH + ["--num-batches=2", "--mini-batch-size=64"], capsys)
    assert "preprocessing 24 file(s) into input/terabyte_processed.jitkern (first use)" in out
    assert "Finished training it 2/2 of epoch 0" in out
    assert re.search(r"Testing at it 2/2: .*\(32 samples\)", out)       # the first half of day 23: 63 rows


def test_missing_processed_file_without_raw_names_the_flag(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code = main(["--data-generation=dataset", "--processed-data-file=./nothing.npz"])
    assert code == 2
    assert "--processed-data-file ./nothing.npz: not found, and no --raw-data-file" in capsys.readouterr().err
    assert main(["--data-generation=dataset"]) == 2
    assert "--data-generation dataset needs --processed-data-file" in capsys.readouterr().err


def test_reference_splits_draw_the_reference_permutations():
    npz = DATA / "reference_kaggle" / "kaggleAdDisplayChallenge_processed.npz"
    counts = DATA / "reference_kaggle" / "train_day_count.npz"
    for randomize in ("total", "day", "none"):
        rs = np.random.RandomState(5)
        s = ReferenceSplits(npz, counts, randomize, rs)
        after = rs.random_sample()
        # the reference: train then test dataset, each drawing its permutations from np.random
        ref = np.random.RandomState(5)
        days = [np.arange(a, b) for a, b in zip([0, 15, 30, 44, 58, 72, 86], [15, 30, 44, 58, 72, 86, 100])]
        drawn = []
        for _ in ("train", "test"):
            train = np.concatenate([ref.permutation(d) if randomize == "day" else d for d in days[:-1]])
            drawn.append(ref.permutation(train) if randomize == "total" else train)
        want = drawn[0]
        assert np.array_equal(s.order["train"], want), randomize
        assert np.array_equal(s.order["test"], np.arange(86, 93)) and np.array_equal(s.order["val"], np.arange(93, 100))
        assert after == ref.random_sample()                  # the model's init continues the same stream
        train = s.dataset("train")
        assert len(train) == 86 and train.dense.dtype == np.float32 and train.sparse.dtype == np.int64


def test_memory_map_reads_the_reordered_days(tmp_path, capsys, monkeypatch):
    z = np.load(DATA / "reference_kaggle" / "kaggleAdDisplayChallenge_processed.npz")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "input").mkdir()
    bounds = [0, 15, 30, 44, 58, 72, 86, 100]
    for d in range(7):
        rows = slice(bounds[d], bounds[d + 1])
        np.savez_compressed(tmp_path / "input" / f"train_day_{d}_reordered.npz", X_int=z["X_int"][rows],
                            X_cat=z["X_cat"][rows], y=z["y"][rows])
    np.savez_compressed(tmp_path / "input" / "train_fea_count.npz", counts=z["counts"])
    paths = ReferencePaths("kaggle", "./input/train.txt", "")
    assert paths.memory_map_ready()
    out = _run(["--data-generation=dataset", "--raw-data-file=./input/train.txt", "--memory-map", *SMALL_MLP,
                "--mini-batch-size=40", "--test-freq=-1"], capsys)
    assert "Finished training it 3/3 of epoch 0" in out and "(7 samples)" in out


def test_mlperf_bin_loader_reads_and_shuffles_bins(tmp_path, capsys, monkeypatch):
    pytest.importorskip("mlperf_logging")
    z = np.load(DATA / "reference_kaggle" / "kaggleAdDisplayChallenge_processed.npz")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "input").mkdir()
    for d in range(24):
        rows = slice(4 * d, 4 * d + 4)
        np.savez_compressed(tmp_path / "input" / f"day_{d}_reordered.npz", X_int=z["X_int"][rows],
                            X_cat=z["X_cat"][rows], y=z["y"][rows])
    np.savez_compressed(tmp_path / "input" / "day_fea_count.npz", counts=z["counts"])
    argv = ["--data-generation=dataset", "--data-set=terabyte", "--raw-data-file=./input/day",
            "--processed-data-file=./input/terabyte_processed.npz", "--memory-map", "--mlperf-logging",
            "--mlperf-bin-loader", "--mlperf-bin-shuffle", *SMALL_MLP, "--mini-batch-size=8", "--test-freq=-1"]
    out = _run(argv, capsys)
    assert (tmp_path / "input" / "terabyte_processed_train.bin").stat().st_size == 92 * 40 * 4
    assert "Finished training it 12/12 of epoch 0" in out and ":::MLLOG" in out


def test_sub_sampling_and_day_shuffle(tmp_path):
    write_raw(tmp_path / "raw.txt", 700, seed=3)
    from jitkern.dlrm.data import preprocess
    preprocess([tmp_path / "raw.txt"], tmp_path / "pp", days=7)
    train = load_preprocessed(tmp_path / "pp", "train")
    labels = np.asarray(train.labels[:])
    sub = sub_sample(train, 0.75, seed=1)
    kept = np.asarray(sub.labels[:])
    assert (kept > 0).sum() == (labels > 0).sum()                     # positives all kept
    neg = (labels == 0).sum()
    assert 0.15 * neg < (kept == 0).sum() < 0.35 * neg
    shuffled = day_shuffled(train, seed=2)
    rows = shuffled.dense.rows
    assert sorted(rows.tolist()) == list(range(len(train)))
    assert (rows[:100] < 100).all() and not np.array_equal(rows[:100], np.arange(100))   # within day 0


@pytest.mark.parametrize("source", ["random", "synthetic"])
def test_prefetched_batches_are_the_sources_and_resume_exactly(source):
    if source == "random":
        src = RandomData([50, 60], 13, 16, 9, num_indices_per_lookup=3, seed=4)
    else:
        src = SyntheticData([50, 60], 13, 16, 9, num_indices_per_lookup=3, seed=4)
    for workers in (1, 3):
        pre = Prefetched(src, workers)
        assert len(pre) == 9
        for start in (0, 4):
            for a, b in zip(src.batches(1, start), pre.batches(1, start)):
                assert np.array_equal(a.dense, b.dense) and np.array_equal(a.labels, b.labels)
                assert all(np.array_equal(x, y) for x, y in zip(a.indices, b.indices))
            assert len(list(pre.batches(1, start))) == 9 - start
        it = pre.batches(0, 0)                               # abandoned early: its threads stop
        next(it)
        it.close()


def test_prefetched_errors_reach_the_trainer():
    class Broken:
        def __len__(self):
            return 3

        def batches(self, epoch=0, start=0):
            yield from ()
            raise ValueError("bad row 7")

    with pytest.raises(ValueError, match="bad row 7"):
        list(Prefetched(Broken(), 2).batches())


def test_num_workers_training_equals_serial(capsys):
    argv = ["--data-generation=random", "--arch-embedding-size=40-50", *SMALL_MLP, "--mini-batch-size=16",
            "--num-batches=6", "--print-freq=2", "--num-indices-per-lookup=3", "--test-freq=-1"]
    assert _run(argv, capsys).splitlines()[1:-1] == \
        [ln for ln in _run(argv + ["--num-workers=2"], capsys).splitlines()[1:-1]]
