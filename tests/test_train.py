"""The trainer: LR schedule, data generators, learning, resume exactness, checkpoints, the CLI."""
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from jitkern.dlrm.cli import main
from jitkern.dlrm.model import DLRM
from jitkern.dlrm.synth import RandomData, SyntheticData, random_batch
from jitkern.dlrm.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from jitkern.dlrm.train import LRSchedule, TrainOptions, Trainer, state_from_meta

ROOT = Path(__file__).resolve().parents[1]
SIZES = [10, 20, 40, 80]
ARCH = dict(embedding_sizes=SIZES, embedding_dim=16, bottom_mlp=[13, 32, 16], top_mlp=[16, 1])
TINY_CLI = ["--arch-embedding-size", "10-20-40-80", "--arch-sparse-feature-size", "16", "--arch-mlp-bot",
            "13-32-16", "--arch-mlp-top", "16-1", "--mini-batch-size", "64", "--threads", "1", "--progress", "off"]


# --------------------------------------------------------------------------- LR schedule


class ReferenceLRPolicy:
    """dlrm_s_pytorch.py's LRPolicyScheduler as torch drives it (the constructor takes one step)."""

    def __init__(self, base, warmup, decay_start, decay_steps):
        self.base, self.w, self.s, self.n = base, warmup, decay_start, decay_steps
        self.step_count = 0
        self.step()

    def get_lr(self):
        c = self.step_count
        if c < self.w:
            self.last_lr = self.base * (1.0 - (self.w - c) / self.w)
            return self.last_lr
        if self.s <= c < self.s + self.n:
            self.last_lr = max(0.0000001, self.base * ((self.n - (c - self.s)) / self.n) ** 2)
            return self.last_lr
        return self.last_lr if self.n > 0 else self.base    # AttributeError where the reference has one

    def step(self):
        self.step_count += 1
        self.lr = self.get_lr()


@given(st.integers(0, 6), st.integers(0, 8), st.integers(0, 6))
def test_lr_schedule_equals_the_reference_policy(warmup, gap, decay_steps):
    sched = LRSchedule(0.3, warmup, warmup + gap, decay_steps)
    try:
        ref = ReferenceLRPolicy(0.3, warmup, warmup + gap, decay_steps)
    except AttributeError:
        assume(False)                       # the reference crashes on this schedule; we use the base rate
    for step in range(30):
        assert sched(step) == ref.lr, step
        try:
            ref.step()
        except AttributeError:
            return


def test_lr_schedule_errors_and_shape():
    with pytest.raises(ValueError, match="warmup .* must finish before the decay"):
        LRSchedule(0.1, 10, 5, 3)
    with pytest.raises(ValueError, match="finite"):
        LRSchedule(float("inf"))
    s = LRSchedule(1.0, 4, 6, 4)
    assert [round(s(i), 4) for i in range(12)] == [0.25, 0.5, 0.75, 0.75, 0.75, 1.0, 0.5625, 0.25, 0.0625,
                                                   0.0625, 0.0625, 0.0625]


# --------------------------------------------------------------------------- data


def reference_random_batch(ra, m_den, ln_emb, n, k, fixed):
    """dlrm_s_pytorch.py's generate_random_input_batch + output batch, transcribed (per-sample loop)."""
    x = ra.rand(n, m_den).astype(np.float32)
    offsets, indices = [], []
    for size in ln_emb:
        off, idx, offset = [], [], 0
        for _ in range(n):
            if fixed:
                g = np.int64(k)
            else:
                r = ra.random(1)
                g = np.int64(np.round(max([1.0], r * min(size, k))))
            group = np.unique(np.round(ra.random(g) * (size - 1)).astype(np.int64))
            off.append(offset)
            idx += group.tolist()
            offset += group.size
        offsets.append(off)
        indices.append(np.array(idx, np.int64))
    return x, np.array(offsets), indices, ra.rand(n, 1).astype(np.float32)


@pytest.mark.parametrize("fixed", [False, True])
def test_random_data_draws_exactly_what_the_reference_draws(fixed):
    a, b = np.random.RandomState(5), np.random.RandomState(5)
    for sizes, k in (([4, 3, 2], 10), ([1000, 7, 1], 5), ([50], 1)):
        x, off, idx, y = reference_random_batch(a, 4, sizes, 37, k, fixed)
        got = random_batch(b, sizes, 4, 37, k, fixed)
        np.testing.assert_array_equal(got.dense, x)
        np.testing.assert_array_equal(got.offsets, off)
        for i, j in zip(got.indices, idx):
            np.testing.assert_array_equal(i, j)
        np.testing.assert_array_equal(got.labels, y[:, 0])


def test_random_data_epochs_restart_the_stream_and_resume_mid_epoch():
    src = RandomData([30, 5], 3, 16, 5, num_indices_per_lookup=4, seed=9)
    full = list(src.batches(0))
    assert len(full) == 5
    again = list(src.batches(1, start=3))
    for x, y in zip(full[3:], again):
        np.testing.assert_array_equal(x.dense, y.dense)
        np.testing.assert_array_equal(x.indices[0], y.indices[0])


def test_synthetic_data_is_deterministic_per_batch_and_splits_differ():
    tr = SyntheticData(SIZES, 13, 32, 4, num_indices_per_lookup=3, fixed=False, seed=1)
    te = SyntheticData(SIZES, 13, 32, 4, num_indices_per_lookup=3, fixed=False, seed=1, split="test")
    a, b = tr.batch(0, 2), list(tr.batches(0, start=2))[0]
    np.testing.assert_array_equal(a.dense, b.dense)
    np.testing.assert_array_equal(a.labels, b.labels)
    assert not np.array_equal(a.dense, te.batch(0, 2).dense)
    assert not np.array_equal(a.dense, tr.batch(1, 2).dense)
    assert all(len(i) >= 32 and i.max() < r for i, r in zip(a.indices, SIZES))


# --------------------------------------------------------------------------- training


def _trainer(model, num_batches, tmp=None, test_freq=-1, state=None, **opts):
    train = SyntheticData(SIZES, 13, 64, num_batches, num_indices_per_lookup=2, fixed=False, seed=4)
    test = SyntheticData(SIZES, 13, 512, 4, num_indices_per_lookup=2, fixed=False, seed=4, split="test")
    o = TrainOptions(lr=opts.pop("lr", 0.5), test_freq=test_freq, print_freq=0, progress=False,
                     save_model=str(tmp) if tmp else "", **opts)
    return Trainer(model, train, test, o, log=lambda msg: None, state=state)


def test_synthetic_training_raises_auc():
    model = DLRM(**ARCH, seed=0)
    tr = _trainer(model, 400, test_freq=400)
    tr.train_data.batch_size = 128
    state = tr.run()
    first, last = state.evals[0]["auc"], state.evals[-1]["auc"]
    assert state.evals[0]["step"] == 0 and 0.35 < first < 0.65
    assert last > 0.75, [e["auc"] for e in state.evals]


def _states_equal(a, b):
    for (k, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        np.testing.assert_array_equal(x, y, err_msg=k)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_resume_is_bit_exact(tmp_path, precision):
    sched = dict(warmup_steps=3, decay_start_step=6, decay_steps=5)
    straight = DLRM(**ARCH, seed=1, embedding_precision=precision)
    _trainer(straight, 12, **sched).run()

    ck = tmp_path / "ck.bin"
    first = DLRM(**ARCH, seed=1, embedding_precision=precision)
    _trainer(first, 7, ck, test_freq=4, **sched).run()          # saves at 4 and at the end (7)
    assert not [p for p in os.listdir(tmp_path) if p != "ck.bin"]  # no temp files left
    resumed = DLRM(**ARCH, seed=99, embedding_precision=precision)  # different init: all comes from the file
    state = state_from_meta(load_checkpoint(str(ck), resumed))
    assert state.step == 7
    tr = _trainer(resumed, 12, state=state, **sched)
    tr.run()
    assert tr.state.step == 12
    _states_equal(resumed, straight)


def test_checkpoint_errors_leave_the_model_unchanged(tmp_path):
    m = DLRM(**ARCH, seed=1)
    ck = tmp_path / "ck.bin"
    save_checkpoint(str(ck), m, {"state": {}})
    blob = ck.read_bytes()
    other = DLRM(**ARCH, seed=2)
    before = {k: v.copy() for k, v in other.state_dict().items()}

    (tmp_path / "trunc.bin").write_bytes(blob[:len(blob) // 2])
    with pytest.raises(CheckpointError, match="truncated"):
        load_checkpoint(str(tmp_path / "trunc.bin"), other)
    (tmp_path / "foreign.bin").write_bytes(b"PK\x03\x04" + bytes(200))
    with pytest.raises(CheckpointError, match="not a jitkern DLRM checkpoint"):
        load_checkpoint(str(tmp_path / "foreign.bin"), other)
    bad = bytearray(blob)
    bad[100] ^= 0xFF                                                # inside the first table's bytes
    (tmp_path / "flipped.bin").write_bytes(bytes(bad))
    with pytest.raises(CheckpointError, match="checksum mismatch in emb.0.weight"):
        load_checkpoint(str(tmp_path / "flipped.bin"), other)
    wider = DLRM(**{**ARCH, "top_mlp": [17, 1]}, seed=1)
    with pytest.raises(CheckpointError, match="another architecture .*top_mlp"):
        load_checkpoint(str(ck), wider)
    with pytest.raises(CheckpointError, match="no such checkpoint"):
        load_checkpoint(str(tmp_path / "missing.bin"), other)
    for k, v in other.state_dict().items():
        np.testing.assert_array_equal(v, before[k])
    load_checkpoint(str(ck), other)
    _states_equal(other, m)


class _RecordingModel(DLRM):
    """A DLRM that records the learning rate of every step."""

    def train_step(self, dense, offsets, indices, labels, lr, **kw):
        self.lrs = getattr(self, "lrs", []) + [lr]
        return super().train_step(dense, offsets, indices, labels, lr, **kw)


def test_trainer_follows_schedule_and_auc_threshold():
    m = _RecordingModel(**ARCH, seed=0)
    tr = _trainer(m, 5, lr=0.2, warmup_steps=2, decay_start_step=3, decay_steps=2, nepochs=2)
    tr.run()
    assert m.lrs == [tr.schedule(s) for s in range(10)] and m.lrs[0] == pytest.approx(0.1)
    m = _RecordingModel(**ARCH, seed=0)
    tr = _trainer(m, 50, test_freq=2, mlperf_auc_threshold=0.01)     # any AUC reaches it
    state = tr.run()
    assert state.step == 2 and len(m.lrs) == 2


class _BadSource:
    """Two good batches, then one with an index out of range for table 2."""

    def __init__(self):
        self.src = SyntheticData(SIZES, 13, 16, 3, seed=0)

    def __len__(self):
        return 3

    def batches(self, epoch=0, start=0):
        for i, b in enumerate(self.src.batches(epoch, start)):
            if i == 2:
                b.indices[2][5] = 40
            yield b


def test_bad_batch_names_batch_table_and_sample():
    tr = _trainer(DLRM(**ARCH, seed=0), 3)
    tr.train_data = _BadSource()
    with pytest.raises(IndexError, match=r"batch 2 of epoch 0: table 2: index 40 of sample 5 .*\[0, 40\)"):
        tr.run()


# --------------------------------------------------------------------------- command line


@pytest.mark.parametrize("argv,message", [
    (["--arch-mlp-bot", "13-32-4"], "bottom_mlp output 4 != embedding_dim 16"),
    (["--arch-embedding-size", "10-x"], "--arch-embedding-size must be dash-separated integers"),
    (["--lr-num-warmup-steps", "10", "--lr-decay-start-step", "5", "--lr-num-decay-steps", "2"],
     "must finish before the decay"),
    (["--data-generation", "dataset"], "needs --processed-data-file"),
    (["--num-indices-per-lookup", "0"], "--num-indices-per-lookup must be >= 1"),
])
def test_cli_bad_input_is_one_line(capsys, argv, message):
    assert main(TINY_CLI + argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


def test_cli_errors_raise_only_in_debug_mode(capsys, monkeypatch):
    bad = TINY_CLI + ["--arch-mlp-bot", "13-32-4"]
    monkeypatch.setenv("JITKERN_DEBUG", "0")                     # 0 is off
    assert main(bad) == 2 and "embedding_dim 16" in capsys.readouterr().err
    monkeypatch.setenv("JITKERN_DEBUG", "1")
    with pytest.raises(ValueError, match="embedding_dim 16"):
        main(bad)


def test_cli_save_resume_inference_profile(tmp_path, capsys):
    ck = str(tmp_path / "m.ck")
    assert main(TINY_CLI + ["--num-batches", "6", "--save-model", ck, "--profile", "--test-freq", "3"]) == 0
    out = capsys.readouterr().out
    assert "embedding_upd" in out and "ms/step" in out and "samples/s" in out
    assert main(TINY_CLI + ["--num-batches", "9", "--load-model", ck, "--save-model", ck]) == 0
    out = capsys.readouterr().out
    assert "resumed from" in out and "at iteration 6" in out and "done: 3 iterations" in out
    assert main(TINY_CLI + ["--load-model", ck, "--inference-only"]) == 0
    assert "Testing at it 9" in capsys.readouterr().out
    (tmp_path / "junk").write_bytes(b"hello")
    assert main(TINY_CLI + ["--load-model", str(tmp_path / "junk")]) == 2
    assert "not a jitkern DLRM checkpoint" in capsys.readouterr().err


def test_cli_plot_without_matplotlib_fails_before_training(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert main(TINY_CLI + ["--num-batches", "2", "--plot", str(tmp_path / "c.png")]) == 2
    out, err = capsys.readouterr()
    assert "--plot" in err and "matplotlib is not installed" in err and err.count("\n") == 1, err
    assert out == ""                                      # found before any work: no model was built
    assert not (tmp_path / "c.png").exists()


def _criteo_dir(tmp_path, bad_row=None):
    """A tiny preprocessed Criteo directory: 400 train rows, 100 test, 100 val; ids < 7."""
    from jitkern.dlrm.data import write_preprocessed

    rng = np.random.default_rng(0)
    sparse = rng.integers(0, 7, (600, 26)).astype(np.int32)
    if bad_row is not None:
        sparse[bad_row, 3] = 9                                   # beyond its table's 7 rows
    dense = rng.random((600, 13), dtype=np.float32)
    labels = (rng.random(600) < 0.3).astype(np.float32)
    return str(write_preprocessed(tmp_path / "criteo", dense, sparse, labels, [7] * 26, [400, 200]))


CRITEO_CLI = ["--data-generation", "dataset", "--arch-sparse-feature-size", "16", "--arch-mlp-bot", "13-16",
              "--arch-mlp-top", "4-1", "--mini-batch-size", "64", "--threads", "1", "--progress", "off",
              "--num-batches", "0"]


def test_cli_trains_on_a_preprocessed_dataset(tmp_path, capsys):
    d = _criteo_dir(tmp_path)
    assert main(CRITEO_CLI + ["--processed-data-file", d, "--max-ind-range", "5"]) == 0
    out = capsys.readouterr().out
    assert "7 batches of 64" in out and "(100 samples)" in out and "done: 7 iterations, 400 samples" in out
    bad = _criteo_dir(tmp_path / "bad", bad_row=70)
    assert main(CRITEO_CLI + ["--processed-data-file", bad, "--data-randomize", "none"]) == 2
    err = capsys.readouterr().err
    assert "batch 1 of epoch 0: table 3: index 9 of sample 6" in err, err


def test_cli_default_run():
    """The README's main command: no flags, finishes, reports loss, AUC and samples/s."""
    res = subprocess.run([sys.executable, str(ROOT / "examples" / "dlrm_numba.py")], capture_output=True,
                         text=True, timeout=300, cwd=ROOT)
    assert res.returncode == 0, res.stderr
    last = res.stdout.strip().splitlines()[-1]
    assert "samples/s" in last and "AUC" in last and "test loss" in last
    auc = float(last.split("AUC ")[1].split(",")[0])
    assert auc > 0.75, res.stdout


def test_cli_autotune_tunes_once_then_finds_every_entry(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("JITKERN_TUNE_DB", str(tmp_path / "tune.json"))
    argv = TINY_CLI + ["--arch-mlp-bot", "13-16", "--arch-mlp-top", "1", "--num-batches", "2", "--autotune"]
    assert main(argv) == 0
    line = [s for s in capsys.readouterr().out.splitlines() if s.startswith("autotune:")]
    assert len(line) == 1 and "autotune: tuned" in line[0], line
    assert (tmp_path / "tune.json").exists()
    assert main(argv) == 0
    line = [s for s in capsys.readouterr().out.splitlines() if s.startswith("autotune:")]
    assert line == [f"autotune: every knob entry for this model's shapes was found in {tmp_path / 'tune.json'}"]
