"""python -m jitkern bench dist: weak and strong scaling of the hybrid-parallel DLRM, one thread per rank.

Launches `mpiexec -n P` for each P and each table sharding (--sharding: row, column, ... forced on
every table, or auto for the planner; the P=1 run is the same script without MPI) in rounds (each
round launches every run once, in turn), times train_step on the same random batches, and prints
measured step time, samples/s, weak-scaling efficiency / strong-scaling speed-up, communication
exposed and hidden, next to the scaling model's prediction for the same sharding
(jitkern.dlrm.scale) for the link speed measured between the ranks here.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

import numpy as np

from ..config import sleep_idle_workers
from ..dlrm.configs import CONFIGS
from .common import print_table, set_threads

WORKER = [sys.executable, "-m", "jitkern.bench.dist", "--worker"]
SHARDINGS = ("auto", "table", "column", "row", "table_row", "replicate")


def _timed_steps(model, batches, n, comm=None):
    """-> (seconds per step, this thread's CPU seconds per step, losses, this process's CPU
    seconds over wall seconds)."""
    times, cpu, losses = [], [], []
    c0, w0 = time.process_time(), time.perf_counter()
    for i in range(n):
        if comm is not None:
            comm.Barrier()
        t0, u0 = time.perf_counter(), time.thread_time()
        b = batches[i % len(batches)]
        losses.append(model.train_step(b.dense, b.offsets, b.indices, b.labels, 0.01, check=False))
        times.append(time.perf_counter() - t0)
        cpu.append(time.thread_time() - u0)
    # a rank that has its core is busy all the time (MPI waits poll): a share below 1 means
    # another process took the CPU during the measurement
    return times, cpu, losses, (time.process_time() - c0) / (time.perf_counter() - w0)


def worker(args) -> int:
    """Time train_step (a warm model, `steps` steps) and print one JSON line on rank 0."""
    from ..dlrm.launch import comm_from_env
    from ..dlrm.model import DLRM, StageTimer
    from ..dlrm.synth import config_batches

    set_threads(1)
    comm = comm_from_env()
    rank = 0 if comm is None else comm.Get_rank()
    cfg = CONFIGS[args.config]
    sharded = {} if comm is None else dict(sharding=args.sharding, plan_batch=args.batch, plan_pooling=cfg.lookups)
    m = DLRM(**cfg.model_kwargs(), seed=0, comm=comm, **sharded)
    batches = config_batches(cfg, args.batch, 3)
    losses = [m.train_step(b.dense, b.offsets, b.indices, b.labels, 0.01)
              for b in (batches[i % 3] for i in range(args.warmup))]
    m.timer = timer = StageTimer()
    if comm is not None:
        m.exchange.reset_stats()
    times, cpu, more, share = _timed_steps(m, batches, args.steps, comm)
    losses += more
    # each rank's time outside MPI calls per step: how evenly the ranks' work is shared
    busy = [float(np.mean(times))]
    if comm is not None:
        busy = comm.allgather(busy[0] - sum(s.exposed for s in m.exchange.stats.values()) / args.steps)
        times = list(np.max(comm.allgather(times), axis=0))     # a step ends when its last rank does
        cpu = list(np.max(comm.allgather(cpu), axis=0))
        share = min(comm.allgather(share))
    link = (m.exchange.bandwidth, m.exchange.latency * 1e6) if comm is not None else (0.0, 0.0)
    if rank == 0:
        print(json.dumps({"ranks": 1 if comm is None else comm.Get_size(), "batch": args.batch,
                          "kinds": sorted(set(m.plan.kinds())) if comm is not None else [],
                          "steps": args.steps, "warmup": args.warmup, "step": float(np.median(times)),
                          "cpu_step": float(np.median(cpu)), "rank_busy": busy,
                          "losses": losses, "cpu_share": share,
                          "profile": {k: v / args.steps for k, v in timer.seconds.items()},
                          "link_gbs": link[0], "latency_us": link[1],
                          "comm": m.exchange.profile_rows() if comm is not None else []}), flush=True)
    return 0


def dense_worker(args) -> int:
    """Time the model's dense stages (calibration.measure_dense) at each of args.dense_rows rows and print
    {rows: {stage: seconds, ..., "sd": seconds}} as one JSON line."""
    from ..dlrm.calibration import measure_dense

    set_threads(1)
    rows = [int(r) for r in args.dense_rows.split(",")]
    got = measure_dense(CONFIGS[args.config], rows, reps=args.steps)
    print(json.dumps({r: dict(st, sd=st.sd) for r, st in got.items()}), flush=True)
    return 0


def _dense_rows(ranks, batch: int) -> dict:
    """{P: the per-rank batch slices the model needs dense stages at on P ranks}: weak (the batch per
    rank) and strong (the largest of the global batch's P slices)."""
    from ..dlrm.placement import batch_slices
    return {p: sorted({max(hi - lo for lo, hi in batch_slices(b, p)) for b in (batch * p, batch)}) for p in ranks}


def _combine_dense(results: list) -> dict:
    """dense_worker outputs (rounds, and each copy of a round) -> {rows: DenseStages}: each stage's
    (and sd's) median over them."""
    from ..dlrm.calibration import DenseStages

    out = {}
    for rows in results[0]:
        keys = results[0][rows]
        med = {k: float(np.median([r[rows][k] for r in results])) for k in keys}
        out[int(rows)] = st = DenseStages((k, v) for k, v in med.items() if k != "sd")
        st.sd = med["sd"]
    return out


def _combine(results: list) -> dict:
    """One launch's result per round -> the median step over rounds (and the launches' worst cpu
    share); losses, profile and exchange counts from the round whose step is that median."""
    order = sorted(results, key=lambda r: r["step"])
    mid = dict(order[len(order) // 2])
    mid["step"] = float(np.median([r["step"] for r in results]))
    mid["cpu_step"] = float(np.median([r["cpu_step"] for r in results]))
    mid["cpu_share"] = min(r["cpu_share"] for r in results)
    mid["rounds"] = [r["step"] for r in results]
    return mid


def _launch(config, ranks, batch, steps, warmup, timeout, sharding, extra=(), every_rank=False):
    """Run the worker on `ranks` processes -> its last JSON line (every_rank: each process's line)."""
    cmd = WORKER + ["--config", config, "--batch", str(batch), "--steps", str(steps), "--warmup", str(warmup),
                    "--sharding", sharding, *extra]
    if ranks > 1:
        mpiexec = shutil.which("mpiexec", path=os.path.dirname(sys.executable)) or shutil.which("mpiexec")
        if mpiexec is None:
            raise RuntimeError("mpiexec not found: pip install 'jitkern[mpi]'")
        cmd = [mpiexec, "-n", str(ranks)] + cmd
    env = dict(os.environ, NUMBA_NUM_THREADS="1", OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stderr[-2000:]}")
    lines = [line for line in r.stdout.splitlines() if line.startswith("{")]
    return [json.loads(line) for line in lines] if every_rank else json.loads(r.stdout.strip().splitlines()[-1])


def _parse(argv):
    ap = argparse.ArgumentParser(prog="python -m jitkern bench dist", description=__doc__.split("\n")[0])
    ap.add_argument("--config", action="append", help="kaggle, paper-small, ... (default: kaggle and paper-small)")
    ap.add_argument("--sharding", default="row,column",
                    help="comma-separated table shardings to run, each forced on every table (table, column, row, "
                         "table_row, replicate) or auto (the planner)")
    ap.add_argument("--ranks", default="1,2", help="comma-separated rank counts (4 oversubscribes this machine: "
                                                     "correctness only)")
    ap.add_argument("--batch", type=int, default=2048, help="per-rank (weak) and global (strong) batch")
    ap.add_argument("--steps", type=int, default=8, help="timed steps per launch")
    ap.add_argument("--rounds", type=int, default=3,
                    help="rounds; each launches the one-process run and every P-rank job once, in turn")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--timeout", type=int, default=900)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--dense-rows", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if not args.worker:
        unknown = sorted(set(args.config or []) - set(CONFIGS))
        if unknown:
            ap.error(f"unknown config(s) {unknown}; choose from {sorted(CONFIGS)}")
        bad = sorted(set(args.sharding.split(",")) - set(SHARDINGS))
        if bad:
            ap.error(f"unknown sharding(s) {bad}; choose from {SHARDINGS}")
    return args


def _run_rounds(name, ranks, args) -> tuple:
    """-> ({(sharding, P, global batch): the combined result of its launches (the one-process run's
    sharding is None)}, {(P, rows): the model's dense stages on P ranks}). Every measurement is its own launch, in
    turn with the others, so each sees the machine as the others did around it, and no process
    holds more than the model it times."""
    cores = os.cpu_count() or 1
    shardings = args.sharding.split(",")
    launches = [(None, 1, args.batch)] + sorted({(sh, p, args.batch * p if mode == "weak" else args.batch)
                                                 for sh in shardings for p in ranks if p > 1
                                                 for mode in ("weak", "strong")})
    results = {key: [] for key in launches}
    need = _dense_rows(ranks, args.batch)
    dense = {p: [] for p in need}
    for _ in range(args.rounds):
        # the model's dense stages, measured in each round as the runs are (the machine's speed drifts),
        # by as many copies at once as P ranks put on this machine: they share its L3 and memory
        for p, rows in need.items():
            dense[p] += _launch(name, min(p, cores), args.batch, 5, 0, args.timeout, "auto",
                                ("--dense-rows", ",".join(map(str, rows))), every_rank=True)
        for sh, p, batch in launches:
            over = p > cores
            if over and results[(sh, p, batch)]:
                continue  # oversubscribed: correctness only, once
            results[(sh, p, batch)].append(_launch(name, p, batch, 2 if over else args.steps,
                                                   min(args.warmup, 2) if over else args.warmup, args.timeout,
                                                   sh or "auto"))
    return ({key: _combine(r) for key, r in results.items()},
            {(p, rows): st for p, r in dense.items() for rows, st in _combine_dense(r).items()})


def _scaling_rows(name, ranks, runs, link, args, rates, dense_at) -> list:
    """One table row per (sharding, mode, P): measured step, efficiency or speed-up, comm, and the
    model's prediction for the same sharding."""
    from ..dlrm.scale import measure_and_predict

    cores = os.cpu_count() or 1
    rows = []
    set_threads(1)
    base = runs[(None, 1, args.batch)]
    base_step, base_loss = base["step"], base["losses"][0]
    for sh in args.sharding.split(","):
        for mode in ("weak", "strong"):
            # the ranks share this machine: MPI moves their bytes with their own CPUs (no offload)
            preds = measure_and_predict(CONFIGS[name], ranks, mode, bandwidth_gbs=link[0], latency_us=link[1],
                                        per_rank_batch=args.batch, kinds=sh, rates=rates, offload=False,
                                        dense_at=dense_at, log=lambda *a: None)
            for p, pred in zip(ranks, preds):
                run = base if p == 1 else runs[(sh, p, args.batch * p if mode == "weak" else args.batch)]
                step, prof = run["step"], run["profile"]
                over = " (oversubscribed: correctness only)" if p > cores else ""
                loss_ok = np.isclose(run["losses"][0], base_loss, rtol=1e-5) if mode == "strong" else ""
                rows.append([name, "-" if p == 1 else sh, mode, p, run["batch"], f"{step * 1e3:.1f}",
                             f"{run['batch'] / step:,.0f}", f"{base_step / step:.2f}{'' if mode == 'weak' else 'x'}",
                             f"{prof.get('communication', 0) * 1e3:.1f}", f"{prof.get('comm_hidden', 0) * 1e3:.1f}",
                             f"{pred.step * 1e3:.1f}", f"{(pred.step / step - 1) * 100:+.0f}%",
                             f"{run['cpu_step'] * 1e3:.1f}", f"{(pred.step / run['cpu_step'] - 1) * 100:+.0f}%",
                             f"{run['cpu_share']:.2f}", "/".join(f"{b * 1e3:.1f}" for b in run["rank_busy"]),
                             str(loss_ok) + over])
    return rows


def _comm_rows(name, runs) -> list:
    """Per launch and exchange kind: calls, MB, link/exposed/hidden ms, per step."""
    rows = []
    for (sh, p, batch), run in sorted(runs.items(), key=lambda kv: (kv[0][0] or "", kv[0][1:])):
        for kind, calls, mb, wire, exposed, hidden in run["comm"]:
            n = run["steps"]                       # the counters start after the warmup (reset_stats)
            rows.append([name, sh or "-", p, batch, kind, f"{calls / n:.0f}", f"{mb / n:.2f}", f"{wire / n:.2f}",
                         f"{exposed / n:.2f}", f"{hidden / n:.2f}"])
    return rows


def _print_report(rows, comm_rows, spread) -> None:
    print_table(["config", "sharding", "mode", "P", "global B", "ms/step", "samples/s", "eff|speedup",
                 "comm exposed ms", "comm hidden ms", "model ms", "model err", "cpu ms/step", "vs cpu", "cpu share",
                 "busy ms by rank", "loss = P1"], rows)
    print("eff = step(P=1) / step(P) at a fixed per-rank batch; speedup = step(P=1) / step(P) at a fixed global "
          "batch; medians over rounds, each of which launches the one-process run and every P-rank job once, "
          "in turn, so all see the same machine; comm columns are per step on "
          "rank 0; cpu share: the lowest CPU-time / wall-time of a rank while timed (a hint, not proof: "
          "well below 1 usually means other processes took CPU from a rank; rerun on an idle machine); cpu ms/step: "
          "the slowest rank's CPU time per step (its MPI waits poll, so on an idle machine it is the step), and "
          "the model against it (the model's rates are CPU time too); busy ms by rank: each rank's step time "
          "outside MPI calls (uneven: the ranks wait for the busiest).")
    print("ms/step of each round (launch):", *spread, sep="\n")
    if comm_rows:
        print("\nexchanges per step on rank 0 (link ms: bytes and latency on the measured link; exposed: time in "
              "MPI calls, incl. waiting for the other ranks; hidden: link time covered by compute):")
        print_table(["config", "sharding", "P", "global B", "exchange", "calls", "MB sent", "link ms", "exposed ms",
                     "hidden ms"], comm_rows)


def main(argv=None) -> int:
    args = _parse(argv)
    sleep_idle_workers()                 # before the first parallel kernel (inherited by the launches)
    if args.worker:
        args.config = args.config[0]
        return dense_worker(args) if args.dense_rows else worker(args)
    names = args.config or ["kaggle", "paper-small"]
    ranks = sorted({int(x) for x in args.ranks.split(",")} | {1})
    print(f"bench dist: one thread per rank, {os.cpu_count()} CPUs here; per-rank/global batch {args.batch}; "
          f"shardings {args.sharding}")
    from ..dlrm.calibration import measured_rates
    rates = measured_rates()
    rows, comm_rows, spread = [], [], []
    for name in names:
        runs, dense_at = _run_rounds(name, ranks, args)
        spread.append(f"  {name}: " + "; ".join(
            f"{sh or '-'} P={p} B={b}: " + " ".join(f"{t * 1e3:.1f}" for t in r["rounds"])
            for (sh, p, b), r in runs.items()))
        link = next((r for (_, p, _), r in runs.items() if p > 1), {"link_gbs": 10.0, "latency_us": 1.0})
        bw, lat = max(link["link_gbs"], 0.1), link["latency_us"]
        rows += _scaling_rows(name, ranks, runs, (bw, lat), args, rates, dense_at)
        print(f"  {name}: link between ranks {bw:.1f} GB/s, {lat:.1f} us (used by the model)")
        comm_rows += _comm_rows(name, runs)
    _print_report(rows, comm_rows, spread)
    return 0


if __name__ == "__main__":
    sys.exit(main())
