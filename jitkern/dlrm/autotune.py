"""Quick-tune the per-CPU knobs for one model's own shapes (the trainer's --autotune).

Entries the tuning DB already holds are not timed again, so a second run with the same shapes
on this CPU times nothing. Under MPI, rank 0 tunes the union of every rank's shapes while the
others wait without spinning (a spinning rank would take a core from the timed kernels).
"""
from __future__ import annotations

import time

from ..codegen import tune


def _threads() -> int:
    import numba
    return numba.get_num_threads()


def tune_for(model, batch: int, *, pooling: int = 1, quick: bool = True, threads=None, out=None) -> list:
    """Tune the knobs for `model`'s shapes at `batch` where the DB has no entry yet; -> the results."""
    work = model.workload(batch, threads=(threads or _threads(),), pooling=pooling)
    return tune.tune(work, quick=quick, only_missing=True, out=out)


def tune_for_ranks(model, batch: int, comm, *, pooling: int = 1) -> int:
    """Collective: rank 0 tunes every rank's shapes; -> the number of entries tuned, on every rank."""
    works = comm.gather(model.workload(batch, threads=(_threads(),), pooling=pooling), root=0)
    tuned = 0
    if comm.Get_rank() == 0:
        work = works[0]
        for w in works[1:]:
            work = work.merged(w)
        tuned = len(tune.tune(work, quick=True, only_missing=True, out=None))
    req = comm.Ibarrier()
    while not req.Test():
        time.sleep(0.005)
    return comm.bcast(tuned, root=0)
