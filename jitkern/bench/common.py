"""Shared benchmark machinery: thread control, timing with spread, machine facts, tables."""
from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass

import numpy as np

from ..codegen.tune import cache_evictor  # noqa: F401  (the benchmarks' --cold)
from ..report import print_table  # noqa: F401  (the benchmarks' tables)


def set_threads(n: int | None) -> dict:
    """Use n threads in numba kernels and in the BLAS (and torch, if imported). Returns BLAS info."""
    import numba
    from threadpoolctl import threadpool_info, threadpool_limits

    if n is not None:
        numba.set_num_threads(min(n, numba.config.NUMBA_NUM_THREADS))
        threadpool_limits(n)
        try:
            import torch
            torch.set_num_threads(n)
        except ImportError:
            pass
    blas = [i for i in threadpool_info() if i.get("user_api") == "blas"]
    return blas[0] if blas else {}


def blas_description() -> str:
    """Which BLAS NumPy runs and, for OpenBLAS, which core type it picked."""
    info = set_threads(None)
    if not info:
        return "BLAS: unknown"
    env = {k: os.environ[k] for k in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE") if k in os.environ}
    return (f"BLAS: {info.get('internal_api')} {info.get('version')} core={info.get('architecture')} "
            f"threads={info.get('num_threads')}" + (f" env={env}" if env else ""))


def torch_or_none():
    try:
        import torch
        return torch
    except ImportError:
        return None


@dataclass
class Timing:
    median: float   # seconds
    p10: float
    p90: float
    reps: int

    def spread(self) -> str:
        return f"±{(self.p90 - self.p10) / 2 / self.median * 100:.0f}%" if self.median else ""


def do_bench(fn, *, warmup: int = 2, min_reps: int = 5, min_time: float = 0.5,
             max_reps: int = 200, warmup_time: float = 0.02, clock=time.perf_counter, before=None) -> Timing:
    """Median and 10/90th percentiles of fn() time on `clock` (wall time by default; the calling
    thread's CPU time, time.thread_time, for work that runs on it alone, is robust to other load);
    runs at least min_reps and min_time (wall); before: called untimed ahead of each timed call
    (e.g. a cache_evictor()).

    Warm-up: at least `warmup` calls and `warmup_time` seconds, so that a microsecond op timed
    right after a big copy finds its caches and clocks settled."""
    n, t_warm = 0, time.perf_counter() + warmup_time
    while n < warmup or time.perf_counter() < t_warm:
        fn()
        n += 1
    times = []
    start = time.perf_counter()
    while len(times) < max_reps and (len(times) < min_reps or time.perf_counter() - start < min_time):
        if before is not None:
            before()
        t0 = clock()
        fn()
        times.append(clock() - t0)
    times.sort()
    q = lambda f: times[min(len(times) - 1, int(f * len(times)))]
    return Timing(statistics.median(times), q(0.1), q(0.9), len(times))


def copy_bandwidth_gbs(nbytes: int = 256 << 20) -> float:
    """This machine's single-stream memory copy bandwidth (read + write bytes / s), in GB/s."""
    a = np.ones(nbytes // 4, np.float32)
    b = np.empty_like(a)
    t = do_bench(lambda: np.copyto(b, a), warmup=1, min_reps=3, min_time=0.3)
    return 2 * a.nbytes / t.median / 1e9
