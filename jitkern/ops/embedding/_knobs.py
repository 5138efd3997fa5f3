"""What every embedding knob is posed, and the inputs its runner or search times.

A problem is one table of a Workload at one thread count: (rows, dim, pooling, batch,
itemsize, threads), itemsize 4 for float32 tables and 2 for SplitBF16Table (bf16 rows). The
choices depend on the table (rows, width, itemsize) and the threads only: shape classes and
heuristics read those, while pooling and batch size the batches a runner times. So an op
memoises its choices per table and thread count, and the first call's pooling and batch stand
in for later calls'.
"""
from __future__ import annotations

import contextlib
import weakref

import numba
import numpy as np

from ...codegen.knobs import pow2_class
from ...codegen.target import host_target
from ._rows import NO_PSW, empty_table
from .split_bf16 import SplitBF16Table

NEVER = 1 << 62           # a work threshold no call reaches
_BATCH_BYTES = 64 << 20   # row bytes a runner's batches touch together: beyond the caches, as in training
_MAX_BATCHES = 64


def problems(workload, itemsizes=(4, 2)):
    """The problems of a Workload's tables of the given itemsizes, at each of its thread counts."""
    for rows, dim, pooling, batch, itemsize in workload.tables:
        if itemsize in itemsizes:
            for threads in workload.threads:
                yield int(rows), int(dim), int(pooling), int(batch), int(itemsize), int(threads)


def shape_class(problem) -> str:
    """Tables of similar size (rows to a power of two) and equal width, itemsize and threads."""
    rows, dim, _, _, itemsize, threads = problem
    return f"{pow2_class(rows)}x{dim}x{itemsize}B/t{threads}"


def quick_class(problem) -> str:
    """The quick tune's coarser grouping: tables held by the same cache level (or by none), of
    equal width, itemsize and threads. The choices follow where the rows come from."""
    rows, dim, _, _, itemsize, threads = problem
    t, nbytes = host_target(), rows * dim * itemsize
    level = next((name for name, size in (("l1", t.l1d), ("l2", t.l2), ("l3", t.l3)) if nbytes <= size), "dram")
    return f"{level}x{dim}x{itemsize}B/t{threads}"


def call_problem(rows, dim, nnz, nbags, itemsize, threads) -> tuple:
    """The problem one call poses (pooling: the mean bag size)."""
    return rows, dim, max(1, nnz // max(nbags, 1)), nbags, itemsize, threads


_TABLES = weakref.WeakValueDictionary()  # (rows, dim, itemsize) -> a table some runner still holds


def make_table(problem):
    """A (rows, dim) table of the problem's itemsize with every page touched (a float32 ndarray, or
    a SplitBF16Table for itemsize 2). Shared while a runner holds it: the tuner keeps a problem's
    runners until its last candidate is timed, so a large table is built once per problem."""
    rows, dim, _, _, itemsize, _ = problem
    key = (rows, dim, itemsize)
    table = _TABLES.get(key)
    if table is not None:
        return table
    if itemsize == 2:
        hi, lo = empty_table(rows, dim, np.uint16), empty_table(rows, dim, np.uint16)
        hi.fill(0x3C23)  # the high half of float32(0.01)
        lo.fill(0xD70A)  # and its low half: exactly float32(0.01)
        table = SplitBF16Table(hi, lo)
    else:
        table = empty_table(rows, dim)
        table.fill(0.01)
    _TABLES[key] = table
    return table


def draw_batches(problem, nbags=None, seed=0):
    """Batches of nbags (default: the problem's batch) bags of `pooling` uniform rows, as many as
    touch ~64 MiB of rows together (so a table beyond the caches is read from memory), and a
    dout (nbags, dim) float32: ([bags], dout), bags as the kernels take them."""
    rows, dim, pooling, batch, itemsize, _ = problem
    nbags = batch if nbags is None else nbags
    nnz = nbags * pooling
    count = int(min(_MAX_BATCHES, max(1, -(-_BATCH_BYTES // max(nnz * dim * itemsize, 1)))))
    rng = np.random.default_rng(seed)
    offsets = np.arange(nbags, dtype=np.int64) * pooling
    bags = [(rng.integers(0, rows, nnz), offsets, NO_PSW, False, False) for _ in range(count)]
    return bags, rng.standard_normal((nbags, dim)).astype(np.float32)


def cycle(calls):
    """A callable that makes the next of `calls` each time (a new batch per call, as in training)."""
    state = [0]

    def call():
        k = state[0]
        state[0] = k + 1 if k + 1 < len(calls) else 0
        return calls[k]()
    return call


@contextlib.contextmanager
def numba_threads(n: int):
    """Run the block with n numba threads (at most numba's pool), then restore the setting."""
    before = numba.get_num_threads()
    numba.set_num_threads(max(1, min(n, numba.config.NUMBA_NUM_THREADS)))
    try:
        yield
    finally:
        numba.set_num_threads(before)


def on_threads(threads: int, call):
    """`call` run with `threads` numba threads (a runner's timed callable for a parallel kernel)."""
    def run():
        with numba_threads(threads):
            call()
    return run


def crossover(timer, sizes, run):
    """(last, first): of the ascending `sizes`, the first at which run(size, True) (parallel) times
    faster than run(size, False) (serial), and the size before it (None where there is none)."""
    last = None
    for size in sizes:
        if timer(run(size, True)) < timer(run(size, False)):
            return last, size
        last = size
    return last, None
