"""Issue 18, "fail before the work, never after it": preflight of --save-model and friends,
--overwrite that replaces only a dataset, nonsense values, graceful SIGINT/SIGTERM with exact
resume (one process and MPI), rank-prefixed MPI error lines, stale preprocess work directories.

The subprocess runs use a tiny model (kernels come from numba's disk cache); MPI runs go through
`mpiexec` with a timeout, as tests/test_dist.py does.
"""
import os
import queue
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from jitkern.dlrm.cli import main
from jitkern.dlrm.data import main as preprocess_main
from jitkern.dlrm.data import preprocess
from jitkern.dlrm.model import DLRM
from jitkern.dlrm.synth import SyntheticData
from jitkern.dlrm.checkpoint import load_checkpoint
from jitkern.dlrm.train import TrainOptions, Trainer, state_from_meta

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "tests" / "data" / "criteo_kaggle_sample.txt"
MPIEXEC = shutil.which("mpiexec", path=str(Path(sys.executable).parent)) or shutil.which("mpiexec")
needs_mpi = pytest.mark.skipif(MPIEXEC is None, reason="mpiexec not found (pip install jitkern[mpi])")
SIZES = [10, 20, 40, 80]
ARCH = dict(embedding_sizes=SIZES, embedding_dim=16, bottom_mlp=[13, 32, 16], top_mlp=[16, 1])
TINY = ["--arch-embedding-size", "10-20-40-80", "--arch-sparse-feature-size", "16", "--arch-mlp-bot", "13-32-16",
        "--arch-mlp-top", "16-1", "--mini-batch-size", "64", "--threads", "1", "--progress", "off"]
# under MPI: two tables big enough to be placed on ranks (alltoall), two replicated
MPI_TINY = ["--arch-embedding-size", "10-3000-40-5000", "--arch-sparse-feature-size", "16", "--arch-mlp-bot",
            "13-32-16", "--arch-mlp-top", "16-1", "--mini-batch-size", "64", "--threads", "1", "--progress", "off"]
ENV = dict(os.environ, NUMBA_NUM_THREADS="1", OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")


def _train_cmd(*argv, ranks=1):
    cmd = [sys.executable, "-m", "jitkern", "train", *map(str, argv)]
    return [MPIEXEC, "-n", str(ranks), *cmd] if ranks > 1 else cmd


def _run(*argv, ranks=1, timeout=120):
    """(CompletedProcess, seconds from launch to exit) of a trainer run."""
    t0 = time.perf_counter()
    r = subprocess.run(_train_cmd(*argv, ranks=ranks), capture_output=True, text=True, timeout=timeout,
                       env=ENV, cwd=ROOT)
    return r, time.perf_counter() - t0


@pytest.fixture
def unwritable(tmp_path):
    """A directory no file can be created in (root writes through permissions: sysfs then)."""
    if os.geteuid() == 0:
        if not os.path.isdir("/sys/kernel"):
            pytest.skip("no read-only location for root")
        yield Path("/sys/kernel")
        return
    d = tmp_path / "ro"
    d.mkdir()
    d.chmod(0o555)
    yield d
    d.chmod(0o755)


def _states_equal(a: DLRM, b: DLRM):
    for (k, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        np.testing.assert_array_equal(x, y, err_msg=k)


def _loaded(path, arch=ARCH):
    m = DLRM(**arch, seed=99)
    return m, state_from_meta(load_checkpoint(str(path), m))


# --------------------------------------------------------------------------- 1: --save-model preflight


def test_save_model_in_missing_directories_is_created(tmp_path, capsys):
    ck = tmp_path / "no" / "such" / "dir" / "m.ckpt"
    assert main(TINY + ["--num-batches", "3", "--test-freq", "0", "--save-model", str(ck)]) == 0
    _, state = _loaded(ck)
    assert state.step == 3


def test_unwritable_save_model_fails_at_launch_naming_the_flag(unwritable):
    r, secs = _run(*TINY, "--num-batches", "400", "--test-freq", "0", "--save-model", unwritable / "m.ckpt")
    assert r.returncode == 2 and "--save-model" in r.stderr and "cannot write" in r.stderr, r.stderr
    assert "Finished training" not in r.stdout and "Testing" not in r.stdout
    assert secs < 5, secs


@pytest.mark.parametrize("existing", ["directory", "foreign file"])
def test_save_model_over_something_else_is_refused_before_training(tmp_path, capsys, existing):
    target = tmp_path / "target"
    if existing == "directory":
        target.mkdir()
    else:
        target.write_text("precious\n")
    assert main(TINY + ["--num-batches", "3", "--save-model", str(target)]) == 2
    out, err = capsys.readouterr()
    assert f"--save-model {target}" in err and err.count("\n") == 1 and out == "", err
    assert existing == "directory" or target.read_text() == "precious\n"


@needs_mpi
def test_save_model_under_mpi_fails_fast_when_unwritable_or_not_a_shard_directory(tmp_path, unwritable):
    # (that it creates missing directories: the resume test below saves into one)
    r, secs = _run(*MPI_TINY, "--num-batches", "400", "--test-freq", "0", "--save-model", unwritable / "ck", ranks=2)
    assert r.returncode == 2 and "--save-model" in r.stderr and "cannot write" in r.stderr, r.stderr[-2000:]
    assert "Finished training" not in r.stdout and secs < 5, (secs, r.stdout)
    one_file = tmp_path / "one.ckpt"                     # a one-process checkpoint: not what MPI writes
    assert main(TINY + ["--num-batches", "2", "--save-model", str(one_file)]) == 0
    r, _ = _run(*MPI_TINY, "--num-batches", "2", "--save-model", one_file, ranks=2)
    assert r.returncode == 2 and "directory of shards" in r.stderr, r.stderr[-2000:]


def test_load_model_and_raw_data_file_are_checked_before_any_work(tmp_path, capsys):
    ck = tmp_path / "m.ckpt"
    assert main(TINY + ["--num-batches", "2", "--save-model", str(ck)]) == 0
    capsys.readouterr()
    wider = [a if a != "16-1" else "8-1" for a in TINY]
    assert main(wider + ["--load-model", str(ck)]) == 2
    out, err = capsys.readouterr()
    assert f"--load-model {ck}: checkpoint is for another architecture (differs in top_mlp)" in err and out == "", err
    raw = tmp_path / "raw.txt"
    raw.write_text("1\t2\tx\n")
    assert main(TINY + ["--data-generation", "dataset", "--raw-data-file", str(raw)]) == 2
    out, err = capsys.readouterr()
    assert f"--raw-data-file: {raw}: line 1:" in err and out == "", err


# --------------------------------------------------------------------------- 2: --overwrite


def test_overwrite_replaces_only_a_jitkern_dataset(tmp_path, capsys):
    d = tmp_path / "d"
    d.mkdir()
    (d / "notes.txt").write_text("precious\n")
    assert preprocess_main(["--raw", str(SAMPLE), "--out", str(d), "--overwrite", "--quiet"]) == 1
    err = capsys.readouterr().err
    assert str(d) in err and "not a jitkern dataset" in err, err
    assert (d / "notes.txt").read_text() == "precious\n" and sorted(os.listdir(d)) == ["notes.txt"]
    ds = tmp_path / "ds"
    assert preprocess_main(["--raw", str(SAMPLE), "--out", str(ds), "--quiet"]) == 0
    assert preprocess_main(["--raw", str(SAMPLE), "--out", str(ds), "--overwrite", "--quiet", "--days", "5"]) == 0
    (ds / "notes.txt").write_text("mine\n")               # a dataset with someone's file in it: kept too
    assert preprocess_main(["--raw", str(SAMPLE), "--out", str(ds), "--overwrite", "--quiet"]) == 1
    assert (ds / "notes.txt").read_text() == "mine\n"


# --------------------------------------------------------------------------- 5: nonsense values


def _criteo_dir(tmp_path):
    from jitkern.dlrm.data import write_preprocessed
    rng = np.random.default_rng(0)
    return str(write_preprocessed(tmp_path / "criteo", rng.random((300, 13), dtype=np.float32),
                                  rng.integers(0, 7, (300, 26)).astype(np.int32),
                                  (rng.random(300) < 0.3).astype(np.float32), [7] * 26, [200, 100]))


@pytest.mark.parametrize("argv,message", [
    (["--nepochs", "-1"], "--nepochs must be >= 1"),
    (["--nepochs", "0"], "--nepochs must be >= 1"),
    (["--max-ind-range", "1"], "--max-ind-range must be -1 (off) or >= 2"),
    (["--max-ind-range", "0"], "--max-ind-range must be -1 (off) or >= 2"),
    (["--learning-rate", "1e39"], "learning rate must be finite"),
])
def test_nonsense_values_are_errors_before_any_work(tmp_path, capsys, argv, message):
    data = ["--data-generation", "dataset", "--processed-data-file", _criteo_dir(tmp_path), "--arch-mlp-bot",
            "13-16", "--arch-mlp-top", "4-1", "--num-batches", "0"] if "--max-ind-range" in argv else []
    assert main(TINY + data + argv) == 2
    out, err = capsys.readouterr()
    assert message in err and err.count("\n") == 1 and out == "", (out, err)


def test_an_empty_split_is_an_error_naming_the_data_flag(tmp_path, capsys):
    from jitkern.dlrm.data import write_preprocessed
    rng = np.random.default_rng(0)
    d = write_preprocessed(tmp_path / "d", rng.random((50, 13), dtype=np.float32), np.zeros((50, 26), np.int32),
                           np.zeros(50, np.float32), [3] * 26, [50, 0])                # no test rows
    argv = ["--data-generation", "dataset", "--processed-data-file", str(d), "--arch-mlp-bot", "13-16"]
    assert main(TINY + argv) == 2
    out, err = capsys.readouterr()
    assert f"--processed-data-file: {d}: the test split is empty" in err and out == "", err


def test_preprocess_days_beyond_the_data_is_an_error(tmp_path, capsys):
    out = tmp_path / "o"
    assert preprocess_main(["--raw", str(SAMPLE), "--out", str(out), "--days", "5000", "--quiet"]) == 1
    err = capsys.readouterr().err
    assert "--days" in err and "100 rows" in err and "at most 50 days" in err, err
    assert os.listdir(tmp_path) == []                                   # nothing written, no work dir left
    assert preprocess([SAMPLE], out, days=50)["splits"]["val"] == [99, 100]       # the most days that fit


@pytest.mark.parametrize("lr", [-1.0, float("nan"), 1e39])
def test_train_step_checks_lr_as_the_cli_does(lr):
    m = DLRM(**ARCH, seed=0)
    b = SyntheticData(SIZES, 13, 16, 1, seed=0).batch(0, 0)
    before = {k: v.copy() for k, v in m.state_dict().items()}
    with pytest.raises(ValueError, match="lr must be finite and >= 0"):
        m.train_step(b.dense, b.offsets, b.indices, b.labels, lr)
    for k, v in m.state_dict().items():
        np.testing.assert_array_equal(v, before[k], err_msg=k)


# --------------------------------------------------------------------------- 6: interrupts


class _Prefetching:
    """A batch source that reads ahead on a thread (as a prefetching loader does)."""

    def __init__(self, src, ahead=3):
        self.src, self.ahead = src, ahead

    def __len__(self):
        return len(self.src)

    def batches(self, epoch=0, start=0):
        q = queue.Queue(self.ahead)

        def fill():
            for b in self.src.batches(epoch, start):
                q.put(b)
            q.put(None)

        threading.Thread(target=fill, daemon=True).start()
        while (b := q.get()) is not None:
            yield b


class _SignalledModel(DLRM):
    """Sends itself `signum` in the middle of training step `at` (1-based)."""

    def train_step(self, *args, **kwargs):
        self.steps = getattr(self, "steps", 0) + 1
        if self.steps == self.at:
            os.kill(os.getpid(), self.signum)
        return super().train_step(*args, **kwargs)


def _trainer(model, ck=None, state=None, num_batches=9):
    src = SyntheticData(SIZES, 13, 32, num_batches, num_indices_per_lookup=2, fixed=False, seed=4)
    test = SyntheticData(SIZES, 13, 64, 2, num_indices_per_lookup=2, fixed=False, seed=4, split="test")
    opts = TrainOptions(lr=0.3, warmup_steps=2, decay_start_step=5, decay_steps=8, nepochs=2, print_freq=4,
                        test_freq=7, save_model=str(ck) if ck else "", progress=False)
    return Trainer(model, _Prefetching(src), test, opts, log=lambda msg: None, state=state)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_interrupted_training_saves_and_resumes_exactly(tmp_path, signum):
    from jitkern.dlrm.interrupt import Interrupted
    straight = DLRM(**ARCH, seed=1)
    full = _trainer(straight).run()
    rng = random.Random(signum)
    for at in sorted(rng.sample(range(1, 18), 3)) + [18]:     # 18 steps: 2 epochs of 9; 18 is the last
        ck = tmp_path / f"ck{at}"
        m = _SignalledModel(**ARCH, seed=1)
        m.at, m.signum = at, signum
        with pytest.raises(Interrupted) as e:
            _trainer(m, ck).run()
        assert (e.value.step, e.value.saved, e.value.exit_code) == (at, str(ck), 128 + signum)
        resumed, state = _loaded(ck)
        assert state.step == at
        done = _trainer(resumed, state=state).run()
        _states_equal(resumed, straight)
        assert done.losses == full.losses and done.step == full.step, at


def _wait_for_line(proc, pattern, lines):
    """Read proc's stdout until a line matches; -> the match (None at EOF)."""
    for line in proc.stdout:
        lines.append(line)
        m = re.search(pattern, line)
        if m:
            return m
    return None


def _interrupted_run(argv, ranks, at, send):
    """Start a run, send SIGINT (by `send(proc, stdout_lines)`) once iteration `at` was printed."""
    proc = subprocess.Popen(_train_cmd(*argv, ranks=ranks), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=ENV, cwd=ROOT)
    lines = []
    try:
        assert _wait_for_line(proc, rf"Finished training it {at}/", lines), "".join(lines)
        send(proc, lines)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    return proc.returncode, "".join(lines) + out, err


def test_sigint_cli_saves_prints_one_line_and_resumes_exactly(tmp_path, capsys):
    argv = TINY + ["--num-batches", "200", "--print-freq", "1", "--test-freq", "70", "--learning-rate", "0.2"]
    at = random.randrange(5, 80)
    ck, resumed, straight = tmp_path / "ck", tmp_path / "resumed", tmp_path / "straight"
    rc, out, err = _interrupted_run(argv + ["--save-model", ck], 1, at, lambda p, _: p.send_signal(signal.SIGINT))
    assert rc == 130 and "Traceback" not in err, err
    m = re.fullmatch(rf"interrupted \(SIGINT\) at iteration (\d+); checkpoint saved to {re.escape(str(ck))}\n", err)
    assert m and int(m.group(1)) >= at, err
    assert main(argv + ["--load-model", str(ck), "--save-model", str(resumed)]) == 0
    assert main(argv + ["--save-model", str(straight)]) == 0
    a, sa = _loaded(resumed)
    b, sb = _loaded(straight)
    _states_equal(a, b)
    assert sa.losses == sb.losses and sa.step == sb.step == 200


@needs_mpi
def test_sigint_to_one_rank_stops_every_rank_at_the_same_step_and_resumes_exactly(tmp_path):
    arch = dict(ARCH, embedding_sizes=[10, 3000, 40, 5000])
    argv = MPI_TINY + ["--num-batches", "100", "--print-freq", "1", "--test-freq", "0"]
    at = random.randrange(5, 40)
    ck, resumed, straight = tmp_path / "ck", tmp_path / "resumed", tmp_path / "no" / "such" / "straight"

    def signal_rank_1(proc, lines):             # only rank 1: rank 0 learns of it by the vote
        pid = int(re.search(r"ranks: 0=pid \d+ on \S+, 1=pid (\d+)", "".join(lines)).group(1))
        os.kill(pid, signal.SIGINT)

    rc, out, err = _interrupted_run(argv + ["--save-model", ck], 2, at, signal_rank_1)
    assert rc == 130 and "Traceback" not in err, err[-3000:]
    m = re.search(r"\[rank 0\] interrupted \(SIGINT\) at iteration (\d+); checkpoint saved to", err)
    assert m and int(m.group(1)) >= at and err.count("interrupted") == 1, err[-3000:]
    _, state = _loaded(ck, arch)
    assert state.step == int(m.group(1))
    r, _ = _run(*argv, "--load-model", ck, "--save-model", resumed, ranks=2)
    assert r.returncode == 0, r.stderr[-3000:]
    r, _ = _run(*argv, "--save-model", straight, ranks=2)          # missing directories are created
    assert r.returncode == 0 and (straight / "manifest.json").is_file(), r.stderr[-3000:]
    (a, sa), (b, sb) = _loaded(resumed, arch), _loaded(straight, arch)
    _states_equal(a, b)
    assert sa.losses == sb.losses and sa.step == sb.step == 100


# --------------------------------------------------------------------------- 6: MPI lines, stale work dirs


def test_rank_lines_are_whole_and_prefixed_one_write_each(monkeypatch):
    from jitkern.dlrm.launch import write_lines

    class Writes(list):
        def write(self, s):
            self.append(s)

        def flush(self):
            self.append(None)

    for k in [k for k in os.environ if k.startswith(("PMI_", "OMPI_", "PMIX_"))]:
        monkeypatch.delenv(k)
    w = Writes()
    write_lines("one\ntwo\n", w)
    assert w == ["one\n", None, "two\n", None]
    monkeypatch.setenv("PMI_SIZE", "2")
    monkeypatch.setenv("PMI_RANK", "1")
    w = Writes()
    write_lines("Traceback (most recent call last):\n  File x\nValueError: bad", w)
    assert w == ["[rank 1] Traceback (most recent call last):\n", None, "[rank 1]   File x\n", None,
                 "[rank 1] ValueError: bad\n", None]


@needs_mpi
def test_every_line_of_a_two_rank_failure_carries_one_rank_prefix():
    r, _ = _run(*MPI_TINY, "--nepochs", "0", ranks=2)
    assert r.returncode == 2
    lines = [s for s in r.stderr.splitlines() if s.strip()]
    assert len(lines) >= 2 and {s[:9] for s in lines} == {"[rank 0] ", "[rank 1] "}, r.stderr
    assert all(len(re.findall(r"\[rank \d\]", s)) == 1 and s.count("dlrm: error:") == 1 for s in lines), r.stderr


def test_stale_work_dirs_of_dead_processes_on_this_host_are_removed(tmp_path):
    out = tmp_path / "out"
    host = socket.gethostname()
    gone = subprocess.Popen(["true"])
    gone.wait()
    live = subprocess.Popen(["sleep", "60"])
    names = {"dead": f"out.tmp-{host}-{gone.pid}", "dead_old": f"out.old-{host}-{gone.pid}",
             "live": f"out.tmp-{host}-{live.pid}", "other_host": f"out.tmp-{host}x-{gone.pid}",
             "other_out": f"out2.tmp-{host}-{gone.pid}"}
    try:
        (tmp_path / names["dead_old"]).mkdir()        # killed between its two renames: out is missing,
        preprocess([SAMPLE], out, days=5)              # so the replaced dataset is kept
        assert (tmp_path / names["dead_old"]).is_dir()
        for n in names.values():
            (tmp_path / n).mkdir(exist_ok=True)
        preprocess([SAMPLE], out, overwrite=True)
        left = sorted(p.name for p in tmp_path.iterdir())
    finally:
        live.kill()
        live.wait()
    assert left == sorted(["out", names["live"], names["other_host"], names["other_out"]])


def test_killed_preprocess_leaves_a_work_dir_that_the_next_run_removes(tmp_path):
    raw = tmp_path / "raw.txt"
    raw.write_bytes((SAMPLE.read_bytes().rstrip(b"\n") + b"\n") * 1000)   # 100k rows: caught while working
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "jitkern", "preprocess", "--raw", str(raw), "--out", str(out), "--quiet"]
    proc = subprocess.Popen(cmd, env=ENV, cwd=ROOT, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not (work := list(tmp_path.glob("out.tmp-*"))) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)
    assert work and work[0].is_dir(), "the run ended before its work directory was seen"
    assert preprocess([raw], out)["rows"] == 100_000
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "raw.txt"]


def test_sigterm_during_preprocess_removes_its_work_dir(tmp_path, capsys, monkeypatch):
    pp = sys.modules["jitkern.dlrm.data.preprocess"]        # the module (the package exports a function so named)
    real = pp.parse_chunk

    def parse_and_get_killed(*a, **k):
        os.kill(os.getpid(), signal.SIGTERM)
        return real(*a, **k)

    monkeypatch.setattr(pp, "parse_chunk", parse_and_get_killed)
    assert preprocess_main(["--raw", str(SAMPLE), "--out", str(tmp_path / "o"), "--quiet"]) == 143
    err = capsys.readouterr().err
    assert err == f"preprocess: interrupted (SIGTERM); {tmp_path / 'o'} not written\n", err
    assert os.listdir(tmp_path) == []
