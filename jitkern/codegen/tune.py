"""The tuner: times each declared knob's candidates on this CPU and stores the fastest.

It knows no op: it enumerates codegen.knobs.registered() (the op modules declare their knobs
when imported) and asks each for the problems of a Workload, its candidates and a runner.
The command line (`python -m jitkern tune`) and `jitkern.tune_for(model)` live in
jitkern/tuning.py, above the ops.
"""
from __future__ import annotations

import fnmatch
import time
from dataclasses import dataclass

import numpy as np

from . import knobs as K
from . import tunedb
from .target import host_target


def cache_evictor(nbytes: int | None = None):
    """-> a function that streams through twice the last-level cache (at least 64 MB), as a training
    step's other stages do: whatever it timed next finds its operands in DRAM."""
    if nbytes is None:
        nbytes = max(64 << 20, 2 * host_target().l3)
    buf = np.ones(nbytes // 4, np.float32)

    def evict():
        buf.__iadd__(1.0)
    return evict


def best_time(fn, min_time: float = 0.05, max_reps: int = 1000, *, min_reps: int = 3, warm: bool = True) -> float:
    """The fastest of at least min_reps repeated calls (after one warm-up call unless `warm` is
    False): robust against other load."""
    if warm:
        fn()
    best, t0 = float("inf"), time.perf_counter()
    for rep in range(max_reps):
        t1 = time.perf_counter()
        fn()
        t2 = time.perf_counter()
        best = min(best, t2 - t1)
        if rep + 1 >= min_reps and t2 - t0 >= min_time:
            break
    return best


@dataclass
class Result:
    knob: str
    shape_class: str
    problem: tuple
    heuristic: dict
    heuristic_s: float | None       # None for searched knobs
    best: dict
    best_s: float | None
    best_other_s: float | None      # fastest candidate other than the heuristic's own point

    @property
    def heuristic_ratio(self) -> float | None:
        """Heuristic time / best other candidate's time (> 1: a candidate beats the heuristic)."""
        if self.heuristic_s is None or not self.best_other_s:
            return None
        return self.heuristic_s / self.best_other_s


def _same(a: dict, b: dict) -> bool:
    return {k: a[k] for k in sorted(a)} == {k: b.get(k) for k in sorted(a)} and set(a) == set(b)


def tune_problem(knob: K.Knob, problem, *, quick: bool, min_time: float) -> Result:
    """Time (or search) one problem's choices; the best is returned, not stored.

    Candidates are timed in ROUNDS interleaved rounds and each keeps its median round: timed one
    after another, a memory-bound candidate's time says as much about the neighbours' load at that
    moment as about itself."""
    heur = dict(knob.heuristic(problem))
    cls = knob.shape_class(problem)
    if knob.search is not None:
        best = dict(knob.search(problem, quick, lambda fn: best_time(fn, min_time)))
        return Result(knob.name, cls, problem, heur, None, best, None, None)
    cands = [heur] + [dict(c) for c in knob.candidates(problem, quick) if not _same(c, heur)]
    runners = [knob.runner(problem, c) for c in cands]  # all kept to the end: they may share inputs
    # one warm-up call and one timed call per round at least: as many calls as one timing of 3
    rounds = [[best_time(run, min_time / ROUNDS, min_reps=1, warm=not r) for run in runners] for r in range(ROUNDS)]
    times = [float(np.median(col)) for col in zip(*rounds)]
    k = int(np.argmin(times))
    other_s = min(times[1:]) if len(times) > 1 else None
    return Result(knob.name, cls, problem, heur, times[0], cands[k], times[k], other_s)


ROUNDS = 3                                   # interleaved rounds each candidate is timed in
QUICK_MIN_TIME, FULL_MIN_TIME = 0.02, 0.05   # seconds each choice is timed for (at least 3 calls)


def plan(knob: K.Knob, workload: K.Workload, *, quick: bool, only_missing: bool = False) -> list:
    """[(problem to time, [shape classes its choice is stored for])]: one problem per shape class
    (the first met), or in a quick tune one per quick class where the knob declares them (its
    smallest problem: the quickest to set up)."""
    coarse = quick and knob.quick_class is not None
    groups: dict = {}
    for problem in knob.problems(workload):
        if only_missing and knob.tuned(problem) is not None:
            continue
        cls = knob.shape_class(problem)
        entry = groups.setdefault(knob.quick_class(problem) if coarse else cls, [problem, []])
        if coarse:
            entry[0] = min(entry[0], problem)
        if cls not in entry[1]:
            entry[1].append(cls)
    return [tuple(entry) for entry in groups.values()]


def tune(workload: K.Workload, *, quick: bool = False, select: str = "*", only_missing: bool = False,
         min_time: float | None = None, out=print) -> list[Result]:
    """Tune every registered knob matching `select` (a glob) for the problems of `workload` (see
    plan); store the winners; return the results."""
    if min_time is None:
        min_time = QUICK_MIN_TIME if quick else FULL_MIN_TIME
    results = []
    for name, knob in sorted(K.registered().items()):
        if not fnmatch.fnmatch(name, select):
            continue
        for problem, classes in plan(knob, workload, quick=quick, only_missing=only_missing):
            r = tune_problem(knob, problem, quick=quick, min_time=min_time)
            for cls in classes:
                tunedb.store(name, cls, r.best)
            results.append(r)
            if out is not None:
                out(describe(r) + (f"  (also for {', '.join(classes[1:])})" if len(classes) > 1 else ""))
    return results


def describe(r: Result) -> str:
    if r.heuristic_s is None:
        return f"{r.knob:<28} {r.shape_class:<22} searched: {r.best} (heuristic {r.heuristic})"
    ratio = r.heuristic_ratio
    vs = f"heuristic/best-other {ratio:.2f}" if ratio else "no other candidate"
    return (f"{r.knob:<28} {r.shape_class:<22} best {r.best} {r.best_s * 1e6:9.1f} us  "
            f"heuristic {r.heuristic} {r.heuristic_s * 1e6:9.1f} us  ({vs})")
