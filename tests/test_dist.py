"""Hybrid-parallel DLRM: placement properties in process; equivalence and faults under mpiexec.

The MPI runs launch `mpiexec -n P` in a subprocess with a timeout, so a hanging rank fails the
test instead of hanging the suite. Models are tiny; kernels come from numba's disk cache.
"""
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from jitkern.dlrm.launch import EXIT_GRACE_S
from jitkern.dlrm.placement import REPLICATED, batch_slices, place_tables

SCRIPTS = Path(__file__).parent / "mpi_scripts"
MPIEXEC = shutil.which("mpiexec", path=str(Path(sys.executable).parent)) or shutil.which("mpiexec")
needs_mpi = pytest.mark.skipif(MPIEXEC is None, reason="mpiexec not found (pip install jitkern[mpi])")


# --------------------------------------------------------------------------- placement (no MPI)


@given(st.lists(st.integers(1, 10**6), min_size=1, max_size=40), st.integers(1, 9), st.sampled_from([4, 16]))
def test_placement_covers_every_table_once_and_balances(sizes, nranks, dim):
    p = place_tables(sizes, dim, nranks)
    assert len(p.owner) == len(sizes)
    for t, o in enumerate(p.owner):
        small = sizes[t] * dim * 4 <= 1 << 16
        assert (o == REPLICATED) == (small and nranks > 1)
        assert o == REPLICATED or 0 <= o < nranks
    owned = sorted(t for r in range(nranks) for t in p.tables_of(r))
    assert owned == sorted(set(range(len(sizes))) - set(p.replicated))
    # greedy largest-first: no rank exceeds the mean load by more than the largest single table
    placed = [t for t in range(len(sizes)) if p.owner[t] != REPLICATED]
    if placed:
        tb, tl = sum(sizes[t] for t in placed), len(placed)
        cost = lambda t: sizes[t] / tb + 1 / tl
        loads = [sum(cost(t) for t in p.tables_of(r)) for r in range(nranks)]
        assert max(loads) <= sum(loads) / nranks + max(cost(t) for t in placed) + 1e-9


def test_placement_balances_bytes_and_lookups():
    p = place_tables([2000, 2000, 2000, 2000, 10**6, 10**6], 16, 2, lookups=[1, 1, 1, 1, 1, 1])
    assert [len(p.tables_of(r)) for r in range(2)] == [3, 3]
    assert p.owner[4] != p.owner[5]
    assert place_tables([5, 10**6], 16, 1).owner == (0, 0)          # one rank: nothing replicated
    assert "rank 1" in p.describe()


@pytest.mark.parametrize("bad", [dict(nranks=0), dict(dim=0), dict(sizes=[0, 4])])
def test_placement_rejects_bad_arguments(bad):
    args = dict(sizes=[10, 20], dim=16, nranks=2) | bad
    with pytest.raises(ValueError):
        place_tables(**args)


@given(st.integers(0, 1000), st.integers(1, 17))
def test_batch_slices_partition_the_batch(batch, nranks):
    s = batch_slices(batch, nranks)
    assert s[0][0] == 0 and s[-1][1] == batch
    assert all(a[1] == b[0] for a, b in zip(s, s[1:]))
    sizes = [hi - lo for lo, hi in s]
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


def test_single_process_never_imports_mpi4py():
    code = ("import sys, numpy as np; from jitkern.dlrm.model import DLRM; from jitkern.dlrm.launch import comm_from_env;"
            "assert comm_from_env() is None; DLRM([10, 20], 16, [3, 16], [1]);"
            "assert 'mpi4py' not in sys.modules, 'mpi4py imported'")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "OMPI_", "PMIX_"))}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)


# --------------------------------------------------------------------------- under mpiexec


def _mpiexec(n, script, *args, timeout=120):
    """Run the script on n ranks; -> (CompletedProcess, wall-clock time.time() at its end)."""
    cmd = [MPIEXEC, "-n", str(n), sys.executable, str(SCRIPTS / script), *map(str, args)]
    env = dict(os.environ, NUMBA_NUM_THREADS="1", OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    return r, time.time()


@needs_mpi
@pytest.mark.parametrize("ranks, interaction, self_interaction, precision, optimizer",
                         [(2, "dot", 0, "fp32", "sgd"), (3, "cat", 1, "fp32", "sgd"), (2, "dot", 0, "bf16", "sgd"),
                          (3, "dot", 0, "bf16-all", "sgd"), (2, "cat", 0, "bf16-all", "sgd"), (3, "dcn", 0, "fp32", "sgd"),
                          (2, "dcn", 0, "fp32", "adagrad"), (2, "dcn", 0, "bf16-all", "sgd")])
def test_ranks_match_one_process(ranks, interaction, self_interaction, precision, optimizer):
    # B = 67 is prime: uneven slices for 2 and 3 ranks; 3 ranks own 1 or 2 tables (uneven);
    # a last step of B = 2 leaves a rank of 3 without rows. bf16-all: bf16 MLPs and interaction
    # (Split-SGD weights updated from the allreduced fp32 gradients). dcn + adagrad: MLPerf's DLRM-DCNv2
    # (Adagrad on the MLPs and the cross network, element-wise Adagrad tables); dcn in bf16 (its cross
    # layers on Split pairs too)
    r, _ = _mpiexec(ranks, "equivalence.py", 67, 4, interaction, self_interaction, precision, optimizer)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["ranks"] == ranks
    owners = out["placement"]
    assert all(o in owners for o in range(ranks))
    assert REPLICATED in owners                                 # bf16 split tables are replicated too
    np.testing.assert_allclose(out["losses_dist"], out["losses_single"], rtol=1e-6)
    _check_weights(out, optimizer)
    if optimizer != "sgd":      # bf16 tables train by SGD only (as in one process); qr runs in one process
        assert len(out["refused"]) == 2, out["refused"]
        assert out["refused"][0].startswith("ValueError: bf16 Split-SGD tables take SGD only")
        assert out["refused"][1].startswith("NotImplementedError: under MPI the DLRM trains plain tables")
    assert out["probs_err"] < 1e-6
    assert out["load_probs_err"] < 1e-6
    assert out["replicas_identical"]
    assert "died without an error" not in r.stderr  # a normal end is never reported as a death


@needs_mpi
@pytest.mark.parametrize("ranks, optimizer", [(2, "sgd"), (3, "adagrad")])
def test_sharded_update_equals_the_allreduced_update(ranks, optimizer):
    # each rank updates its chunk of the summed gradients and the values are gathered: the same
    # bits as every rank updating everything after an allreduce (fp32 and Split weights, state)
    r, _ = _mpiexec(ranks, "sharded_update.py", optimizer)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out == dict(ranks=ranks, same_weights=True, same_state=True, moved=True, replicas_identical=True), out


@needs_mpi
@pytest.mark.parametrize("mode", ["raise", "kill", "exit"])
def test_failing_rank_ends_every_rank_promptly(mode):
    r, end = _mpiexec(3, "fault.py", mode, 1, timeout=90)
    assert r.returncode != 0
    assert "finished" not in r.stdout
    failed_at = float(re.search(r"rank 1 failing at ([0-9.]+)", r.stdout).group(1))
    # an exception or a kill ends the job in about a second; an early exit after the grace period
    limit = 1 + (EXIT_GRACE_S if mode == "exit" else 0) + 5
    assert end - failed_at < limit, (end - failed_at, r.stderr[-2000:])
    if mode != "kill":  # a rank that said why it ends is not reported again as a silent death
        assert "died without an error" not in r.stderr
    if mode == "exit":
        assert "rank 1 of 3 is exiting but other ranks did not finish" in r.stderr
    elif mode == "raise":
        assert "rank 1 of 3 failed: RuntimeError: injected failure" in r.stderr
    else:
        # the survivors on its host name the killed rank; our start-up line maps every pid to its rank.
        # Where mpiexec killed another before the watcher looked, it names both, never one by guess
        pids = dict(re.findall(r"(\d)=pid (\d+)", r.stdout.split("ranks: ", 1)[1].splitlines()[0]))
        named = re.search(r"jitkern: (?:rank (\d) of 3 \(pid (\d+)|one of ranks ([\d, ]+) of 3 \(pids ([\d, ]+)) on "
                          r"\S+\) died without an error", r.stderr)
        assert named, r.stderr[-2000:]
        ranks = (named.group(1) or named.group(3)).split(", ")
        assert "1" in ranks and (named.group(2) or named.group(4)).split(", ") == [pids[x] for x in ranks], r.stderr


def _resumed_error(stdout):
    """checkpoint.py load's "resumed max error": the loaded model's weights and Adagrad state after
    2 more steps against the saver's."""
    return float(re.search(r"resumed max error (\S+)", stdout).group(1))


@needs_mpi
def test_sharded_checkpoint_loads_with_other_rank_counts_and_survives_a_failed_save(tmp_path):
    # an Adagrad model (element-wise tables): parameters and optimizer state are saved by 2 ranks,
    # load exactly on 3, 2 and 1, and training resumes: bit for bit on the rank count that saved,
    # within the sharding contract (sharding.py) on others; the file one process saves from it
    # loads on 2 ranks and resumes bit for bit too
    ck, one_file = tmp_path / "ck", tmp_path / "one.ck"
    r, _ = _mpiexec(2, "checkpoint.py", "save", ck)
    assert r.returncode == 0, r.stderr[-2000:]
    r, _ = _mpiexec(3, "checkpoint.py", "load", ck)
    assert r.returncode == 0 and "loaded step 2 max error 0.0;" in r.stdout, r.stderr[-2000:]
    assert _resumed_error(r.stdout) < 1e-6, r.stdout
    r, _ = _mpiexec(2, "checkpoint.py", "load", ck)
    assert r.returncode == 0 and "loaded step 2 max error 0.0; resumed max error 0.0" in r.stdout, r.stderr[-2000:]
    one = subprocess.run([sys.executable, str(SCRIPTS / "checkpoint.py"), "load", str(ck), str(one_file)],
                         capture_output=True, text=True, timeout=120)
    assert "loaded step 2 max error 0.0;" in one.stdout, one.stderr[-2000:]
    assert _resumed_error(one.stdout) < 1e-6, one.stdout
    assert one_file.is_file()
    r, _ = _mpiexec(2, "checkpoint.py", "load", one_file)
    assert r.returncode == 0 and "loaded step 2 max error 0.0; resumed max error 0.0" in r.stdout, r.stderr[-2000:]
    # a save that dies half-way leaves the previous complete checkpoint in force
    r, _ = _mpiexec(2, "checkpoint.py", "save", ck, "fail")
    assert r.returncode != 0 and "injected failure during save" in r.stderr
    r, _ = _mpiexec(3, "checkpoint.py", "load", ck)
    assert r.returncode == 0 and "loaded step 2 max error 0.0;" in r.stdout, r.stderr[-2000:]


def test_sharded_checkpoint_without_manifest_is_an_error(tmp_path):
    from jitkern.dlrm.dist_checkpoint import ShardedCheckpointError, read_manifest
    (tmp_path / "gen-1").mkdir()
    with pytest.raises(ShardedCheckpointError, match="no manifest.json"):
        read_manifest(str(tmp_path))
    (tmp_path / "manifest.json").write_text('{"format": "other"}')
    with pytest.raises(ShardedCheckpointError, match="not a"):
        read_manifest(str(tmp_path))


def _watch(size, ranks, lines, procs):
    """Run the peer watcher over {rank: (pid, read end)} of `lines`, then kill `procs` and close the
    read ends."""
    from jitkern.dlrm import peer_watch
    try:
        return subprocess.run([sys.executable, "-I", peer_watch.__file__, str(size), "hostA"]
                              + [f"{r}:{pid}:{fd}" for r, (pid, fd) in ranks.items()],
                              capture_output=True, text=True, timeout=20, pass_fds=[rd for rd, _ in lines])
    finally:
        for p in procs:
            if p is not None:
                p.kill()
                p.wait()
        for rd, _ in lines:
            os.close(rd)


@pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="pidfds are Linux-only")
@pytest.mark.parametrize("goodbye", [False, True])
@pytest.mark.parametrize("by", ["line", "pid"])
def test_peer_watcher_names_the_rank_that_ends_silently(goodbye, by):
    # "line": rank 1's life line closes as it ends; "pid": a child it forked keeps the line open,
    # so only its pidfd tells that it ended
    from jitkern.dlrm import peer_watch

    lines = [os.pipe(), os.pipe()]
    holder = subprocess.Popen(["sleep", "30"], pass_fds=[lines[1][1]]) if by == "pid" else None
    short = subprocess.Popen(["sleep", "0.3"], pass_fds=[lines[1][1]])
    long = subprocess.Popen(["sleep", "30"], pass_fds=[lines[0][1]])
    if goodbye:
        os.write(lines[1][1], peer_watch.GOODBYE)
    for _, w in lines:
        os.close(w)
    r = _watch(2, {0: (long.pid, lines[0][0]), 1: (short.pid, lines[1][0])}, lines, (long, short, holder))
    assert r.returncode == 0, r.stderr
    said = f"jitkern: rank 1 of 2 (pid {short.pid} on hostA) died without an error"
    assert (said in r.stderr) != goodbye, r.stderr
    assert "rank 0" not in r.stderr


@pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="pidfds are Linux-only")
def test_peer_watcher_orders_ends_by_life_line_not_by_process_exit():
    # rank 1's line closes first while its process lingers (as a large process tears down its
    # memory after closing its files); rank 0 then ends completely: rank 1 is the one named

    lines = [os.pipe(), os.pipe()]
    first = subprocess.Popen(["sleep", "30"])                               # rank 1: lingers
    second = subprocess.Popen(["sleep", "5"], pass_fds=[lines[0][1]])        # rank 0: ends later, at once
    for _, w in lines:
        os.close(w)                                                         # rank 1's line: closed now
    r = _watch(2, {0: (second.pid, lines[0][0]), 1: (first.pid, lines[1][0])}, lines, (first, second))
    assert r.returncode == 0, r.stderr
    assert f"jitkern: rank 1 of 2 (pid {first.pid} on hostA) died without an error" in r.stderr, r.stderr
    assert "one of ranks" not in r.stderr


@pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="pidfds are Linux-only")
def test_peer_watcher_names_every_rank_that_ended_before_it_looked():
    # both ranks gone, lines closed, by the time the watcher starts (a busy host): no one of them
    # can be told to have gone first, so the report names both, neither alone

    lines = [os.pipe(), os.pipe()]
    procs = [subprocess.Popen(["true"]), subprocess.Popen(["true"])]
    for p in procs:
        p.wait()
    for _, w in lines:
        os.close(w)
    r = _watch(3, {0: (procs[0].pid, lines[0][0]), 2: (procs[1].pid, lines[1][0])}, lines, ())
    assert r.returncode == 0, r.stderr
    said = (f"jitkern: one of ranks 0, 2 of 3 (pids {procs[0].pid}, {procs[1].pid} on hostA, which ended before "
            "this watcher saw which went first) died without an error (killed by a signal?)")
    assert said in r.stderr and "jitkern: rank " not in r.stderr, r.stderr


# --------------------------------------------------------------------------- sharding under mpiexec


def _sharding(n, *modes, ranks_per_node=0, timeout=400):
    env = dict(os.environ, JITKERN_RANKS_PER_NODE=str(ranks_per_node))
    cmd = [MPIEXEC, "-n", str(n)] if n > 1 else []
    cmd += [sys.executable, str(SCRIPTS / "sharding.py"), *map(str, modes)]
    env.update(NUMBA_NUM_THREADS="1", OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def _check_contract(out):
    """sharding.py's contract: table and column bit-identical; row kinds: updates bit-identical,
    pooled sums within 1e-6 relative (bit-identical with one lookup per bag); replicate: within 1e-6.
    The same for the tables' optimizer state (key "<precision>[+<table optimizer>] <kind> ...")."""
    for label in {k.split()[0] for k in out}:
        kinds = {k.split()[1] for k in out if k.startswith(label + " ") and k.endswith("table_err")}
        assert kinds == {"table", "column", "row", "table_row", "replicate"}, label
    for key, value in out.items():
        if not key.endswith("err"):
            assert out[key] == [key.split()[1]]             # "kinds": the plan has the kind asked for
            continue
        kind = key.split()[1]
        exact = key.endswith(("table_err", "state_err")) or "pooling 1" in key
        if kind in ("table", "column") or (kind in ("row", "table_row") and exact):
            assert value == 0.0, (key, value)
        else:
            assert value < 1e-6, (key, value)


def _check_weights(res, case):
    """Against one process: SGD within 1e-6. Adagrad (sharding.py): all but rare elements (a
    gradient within a few orders of eps, whose rounding its step takes relative to eps) within
    1e-6, those within 1e-2 lr; the state (sums of squared gradients) within 1e-5 relative."""
    if not res["stateful"]:
        assert res["weight_err"] < 1e-6, (case, res)
        return
    assert res["weight_outliers"] <= 1e-4 * res["weight_size"], (case, res)
    assert res["weight_err"] < 1e-2 * res["lr"], (case, res)
    assert res["state_rel"] < 1e-5 and res["load_state_exact"], (case, res)


def _check_training(out, cases):
    for case in cases:
        res = out[case]
        kind = case.split()[1]
        assert set(res["kinds"]) == (set(MIXED_KINDS) if kind == "mixed" else {kind}), res["kinds"]
        assert res["loss_rel"] < 1e-6, (case, res)
        _check_weights(res, case)
        assert res["probs_err"] < 1e-6 and res["load_probs_err"] < 1e-6, (case, res)
        assert res["replicas_identical"], case


MIXED_KINDS = ("table", "column", "row", "table_row", "replicate")


def _contract_keys(out):
    return {k: v for k, v in out.items() if "pooling" in k or k.endswith((" table_err", " state_err", " kinds"))}


@needs_mpi
@pytest.mark.parametrize("ranks, modes", [(2, ("contract", "contract-fp32=adagrad", "train")),
                                          (3, ("contract-fp32", "contract-fp32=rowwise_adagrad", "train-mixed=adagrad"))])
def test_every_sharding_matches_one_process(ranks, modes):
    # every kind (and a mixed plan) against one process, with SGD and both Adagrads on the tables
    # (row-wise Adagrad sums each row's squares over 3 uneven column pieces); B = 67 gives uneven
    # slices, a last step of B = 2 leaves ranks without rows; 3 ranks split D = 16 into uneven
    # column blocks
    out = _sharding(ranks, *modes)
    assert out["ranks"] == ranks
    contract = _contract_keys(out)
    assert {k.split()[0] for k in contract} == ({"fp32", "bf16", "fp32+adagrad"} if ranks == 2 else
                                                {"fp32", "fp32+rowwise_adagrad"})
    _check_contract(contract)
    cases = [k for k in out if isinstance(out[k], dict)]
    if ranks == 3:
        assert set(cases) == {"fp32 mixed", "bf16 mixed", "fp32+adagrad mixed", "fp32+rwsadagrad mixed"}
    _check_training(out, cases)


@needs_mpi
def test_table_row_sharding_over_emulated_nodes_and_checkpoints_across_rank_counts(tmp_path):
    # 4 ranks as 2 nodes of 2: table-row-wise tables sum their partial pools inside a node first;
    # the mixed plan's checkpoint (row, column, table_row pieces) loads exactly at 2 ranks
    # (every table row-wise: other pieces) and in one process, and trains on
    ck = tmp_path / "ck"
    out = _sharding(4, "contract-fp32", "train-mixed", f"save={ck}", ranks_per_node=2)
    _check_contract(_contract_keys(out))
    _check_training(out, ["fp32 mixed", "bf16 mixed"])
    trw = [r for k, r in zip(out["fp32 mixed"]["kinds"], out["fp32 mixed"]["ranks"]) if k == "table_row"]
    assert trw and all(r in ([0, 1], [2, 3]) for r in trw)        # one node's ranks
    assert set(out["saved_kinds"]) == set(MIXED_KINDS)
    for n in (2, 1):        # row-wise Adagrad state too; the next step as the 4 ranks took it
        res = _sharding(n, f"load={ck}")
        assert res["step"] == 2 and res["load_err"] == 0.0 and np.isfinite(res["loss_after"]), res
        assert res["after_rel"] < 1e-5, res


@needs_mpi
def test_trainer_splits_a_table_larger_than_rank_memory():
    # table 1 (20000 x 16 fp32, 1.28 MB) cannot be whole within 1 MB per rank: it is split
    # row-wise; the plan is printed at start and training runs (by the reference's row-wise Adagrad)
    cmd = [MPIEXEC, "-n", "2", sys.executable, "-m", "jitkern", "train", "--arch-embedding-size", "100-20000-300",
           "--rank-memory-gb", "0.001", "--num-batches", "6", "--mini-batch-size", "64", "--test-freq", "-1",
           "--print-freq", "3", "--threads", "1", "--progress", "off", "--optimizer", "rwsadagrad"]
    env = dict(os.environ, NUMBA_NUM_THREADS="1", OMP_NUM_THREADS="1")
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "sharding plan over 2 ranks" in r.stdout
    assert re.search(r"^\s+1\s+20,000\s+1\.3 MB\s+row\s+0,1\s", r.stdout, re.M), r.stdout
    assert "done: 6 iterations" in r.stdout and "optimizer='adagrad/rowwise_adagrad'" in r.stdout
