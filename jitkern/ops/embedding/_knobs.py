"""What every embedding knob is posed, and the inputs its runner or search times.

A problem is one table of a Workload at one thread count: (rows, dim, pooling, batch,
itemsize, threads), itemsize 4 for float32 tables and 2 for SplitBF16Table (bf16 rows). The
choices depend on the table (rows, width, itemsize) and the threads only: shape classes and
heuristics read those, while pooling and batch size the batches a runner times. So an op
memoises its choices per table and thread count, and the first call's pooling and batch stand
in for later calls'.
"""
from __future__ import annotations

import weakref

import numpy as np

from ...codegen.knobs import numba_threads, on_threads, pow2_class  # noqa: F401  (the runners' thread helpers)
from ...codegen.target import VECTOR_REGISTERS, VECTOR_WIDTH, host_target, target_isa
from ._rows import NO_PSW, d_class, empty_table
from .split_bf16 import SplitBF16Table, layout_for

NEVER = 1 << 62           # a work threshold no call reaches
_INDEX_BYTES = 128 << 20  # index memory a batch pool may hold (it caps the pool of narrow rows)
_MAX_BATCHES = 1024       # and batches (each a few Python objects, and a partial per runner)


def problems(workload, itemsizes=(4, 2)):
    """The problems of a Workload's tables of the given itemsizes, at each of its thread counts."""
    for rows, dim, pooling, batch, itemsize in workload.tables:
        if itemsize in itemsizes:
            for threads in workload.threads:
                yield int(rows), int(dim), int(pooling), int(batch), int(itemsize), int(threads)


def widen_heuristic(problem) -> dict:
    """How the forward widens bf16 rows (codegen.rowvec). AVX2: by parity (the even elements a
    32-bit shift, the odd ones a mask: no shuffle; the sum lands in parity order, put back once
    per bag), while the accumulator and its two temporaries fit in AVX2's 16 registers; a D=128
    accumulator fills them, and zero-extending loads (shift) then spill least (Zen 3: D=64,
    R=1e7, 2.2x the fp32 forward by parity vs 1.9x by shift; D=128 in cache, parity spilled
    0.42x vs shift 1.15x). AVX-512BW: interleaving with zeros (shuffle), one permute per register
    (measured on Zen 4)."""
    isa = target_isa()
    if isa == "avx512":
        return {"scheme": "shuffle"}
    dim = problem[1]
    fits = isa == "avx2" and dim <= VECTOR_WIDTH["avx2"] * (16 - 4)
    return {"scheme": "parity" if fits else "shift"}


def columns_heuristic(problem) -> dict:
    """In how many column blocks the forward pools a bag (each pass over the bag's rows sums
    D / cols columns; the rows are cached after the first): the fewest, a power of two, whose
    accumulator takes at most half the vector registers, the rest holding the rows' loads and
    their widening. A D=128 accumulator fills AVX2's 16 registers, and its spills cut the misses
    in flight (Zen 3, R=1e7, pooling 20, ns per row: bf16 70 -> 55, fp32 129 -> 111 in two blocks)."""
    isa = target_isa()
    dc, vw = d_class(problem[1]), VECTOR_WIDTH.get(isa, 1)
    cols = 1
    while vw > 1 and dc and dc // cols > vw * VECTOR_REGISTERS[isa] // 2 and dc // (2 * cols) >= vw:
        cols *= 2
    return {"cols": cols}


def columns_candidates(problem, quick):
    """Whole vectors per block; the quick tune the heuristic's and its neighbours."""
    dc, vw = d_class(problem[1]), VECTOR_WIDTH.get(target_isa(), 1)
    every = [c for c in (1, 2, 4) if dc and dc % c == 0 and dc // c >= vw] or [1]
    if not quick:
        return [{"cols": c} for c in every]
    mine = columns_heuristic(problem)["cols"]
    return [{"cols": c} for c in every if mine // 2 <= c <= 2 * mine]


def split_heuristic(problem) -> dict:
    """How the Split-SGD joins and splits bf16 halves: as the forward widens with AVX-512BW; with
    AVX2 by 16-bit unpacks and packs within 128-bit lanes, which undo each other, so only dout's
    row is permuted, once per bag (Zen 3, D=128, fp32 SGD time x1.16 vs x2.20 by zero-extending
    in cache, x1.01 vs x1.84-1.98 at R=1e7)."""
    return {"scheme": {"avx512": "shuffle", "avx2": "unpack8"}.get(target_isa(), "shift")}


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


_TABLES = weakref.WeakValueDictionary()  # (rows, dim, itemsize, layout) -> a table some runner still holds


def make_table(problem, layout=None):
    """A (rows, dim) table of the problem's itemsize with every page touched (a float32 ndarray, or
    a SplitBF16Table for itemsize 2, in `layout`, default the layout knob's choice). Shared while
    a runner holds it: the tuner keeps a problem's runners until its last candidate is timed, so
    a large table is built once per problem."""
    rows, dim, _, _, itemsize, _ = problem
    if itemsize == 2 and layout is None:
        layout = layout_for(rows, dim, problem[5])
    key = (rows, dim, itemsize, layout)
    table = _TABLES.get(key)
    if table is not None:
        return table
    if itemsize == 2:
        table = SplitBF16Table.empty(rows, dim, layout)
        table.hi.fill(0x3C23)  # the high half of float32(0.01)
        table.lo.fill(0xD70A)  # and its low half: exactly float32(0.01)
    else:
        table = empty_table(rows, dim)
        table.fill(0.01)
    _TABLES[key] = table
    return table


def pool_bytes() -> int:
    """Row bytes a batch pool touches in all: twice the last-level cache (64 MiB at least), so
    that rows come from memory when a batch comes round again, as in training."""
    return max(64 << 20, 2 * host_target().l3)


class Batches(list):
    """A pool of batches shared by every runner of a problem, with one shared position: candidates
    timed in turn take the next batches, never the rows the previous candidate just cached."""
    __slots__ = ("at", "dout", "__weakref__")


_POOLS = weakref.WeakValueDictionary()  # (rows, dim, pooling, itemsize, nbags, seed) -> Batches


def draw_batches(problem, nbags=None, seed=0):
    """Batches of nbags (default: the problem's batch) bags of `pooling` uniform rows, as many as
    touch pool_bytes() of rows together (so a table beyond the caches is read from memory), and a
    dout (nbags, dim) float32: (Batches of bags as the kernels take them, dout). Shared while a
    runner holds it (see Batches)."""
    rows, dim, pooling, batch, itemsize, _ = problem
    nbags = batch if nbags is None else nbags
    key = (rows, dim, pooling, itemsize, nbags, seed)
    pool = _POOLS.get(key)
    if pool is None:
        nnz = nbags * pooling
        most = max(1, min(_MAX_BATCHES, _INDEX_BYTES // max(nnz * 8, 1)))
        count = int(min(most, max(1, -(-pool_bytes() // max(nnz * dim * itemsize, 1)))))
        rng = np.random.default_rng(seed)
        offsets = np.arange(nbags, dtype=np.int64) * pooling
        flat = rng.integers(0, rows, count * nnz)  # one draw: per-batch calls cost more than the numbers
        pool = _POOLS[key] = Batches((flat[k * nnz:(k + 1) * nnz], offsets, NO_PSW, False, False)
                                     for k in range(count))
        pool.at, pool.dout = [0], rng.standard_normal((nbags, dim)).astype(np.float32)
    return pool, pool.dout


def cycle(calls, batches=None, table=None):
    """A callable that makes the next of `calls` each time (a new batch per call, as in training);
    with `batches` (the Batches the calls were made from) the position is the pool's, shared.
    `table`: the make_table table the calls read, held while the callable lives (calls on a
    SplitBF16Table hold its halves only, and without it the next runner would build another)."""
    state = [0] if batches is None else batches.at

    def call():
        k = state[0]
        state[0] = k + 1 if k + 1 < len(calls) else 0
        return calls[k]()
    call.batches = batches  # keeps a shared pool alive as long as its runners
    call.table = table
    return call


def crossover(timer, sizes, run):
    """(last, first): of the ascending `sizes`, the first at which run(size, True) (parallel) times
    faster than run(size, False) (serial), and the size before it (None where there is none)."""
    last = None
    for size in sizes:
        if timer(run(size, True)) < timer(run(size, False)):
            return last, size
        last = size
    return last, None
