"""Embedding-bag forward: out[b] = the pooled (summed, weighted or mean) rows of bag b.

Layouts follow torch.nn.functional.embedding_bag: weight (R, D) float32 (or a SplitBF16Table),
flat indices (nnz,) int32/int64, offsets (B,) int64 bag starts (or (B+1,) with
include_last_offset=True); bag b is indices[offsets[b]:offsets[b+1]], the last runs to nnz.

Parallel over chunks of bags; for common widths D (SPECIALISED_D) the row loop is one
<D x float> operation on a register-resident accumulator, other widths run a generic runtime-D
kernel; chunks of one-row unweighted bags are copied instead. Random row reads are
latency-bound, so rows are prefetched some entries ahead. Knobs:
the prefetch distance and hint, the work from which the forward goes parallel, and how bf16
rows are widened.
"""
from __future__ import annotations

import functools
import time

import numpy as np
from numba import prange

from ...codegen import KernelSpec, get_kernel, host_target, jit, kernel_factory, num_threads, tunedb
from ...codegen.knobs import knob
from ...codegen.prefetch import HINTS
from ...codegen.rowvec import WIDEN_SCHEMES, row_copy, row_set_from, stack_f32
from ...config import choice_token, get_config
from .._check import float_array
from ._knobs import (
    NEVER,
    call_problem,
    columns_candidates,
    columns_heuristic,
    crossover,
    cycle,
    draw_batches,
    make_table,
    numba_threads,
    on_threads,
    problems,
    quick_class,
    shape_class,
    widen_heuristic,
)
from ._rows import add_row, bag_end, d_class, madd_row, prefetch_distance, prefetch_lines, straddles
from ._validate import check_bag_args, check_bags, check_offsets, check_table, outside, raise_bag_error

SERIAL_WORK = 1 << 14  # nnz * D up to which a call runs on the calling thread even with several threads
_CHUNKS = 64           # bag chunks of the parallel forward
NONE = -2              # copy_bags: the bags are not all one row long
# strict IEEE (no contraction of a multiply and an add into an FMA): whether LLVM contracts depends
# on the ISA and the widening scheme, and the pooled sums' last bits would with it
_STRICT = frozenset()

# ----------------------------------------------------------------------------- kernels


@functools.lru_cache(maxsize=None)
def _pooler(DC, PF, LOC, SCHEME, ITEM, COLS, STEP=64):
    """pool(weight, bags, out, b0, b1) for compile-time width DC (0: runtime D), prefetch distance PF,
    locality LOC and line step STEP (_rows.prefetch_lines), bf16 widening scheme SCHEME, ITEM bytes
    per table element, and COLS column blocks: each bag is pooled COLS times, DC // COLS columns at
    a time, so that the accumulator and its operands fit in the vector registers (a bag's rows are
    cached after the first block)."""
    W = DC // COLS
    COPY = bool(DC)  # one-row bags of vector-width tables are copied, bf16 rows widened (copy_bags)

    @jit(inline="always", fastmath=_STRICT)
    def pool_bag(acc, weight, indices, psw, s, e, D, c, weighted, fetch):
        """acc[0] = +0.0 plus psw[j] * weight[indices[j], c:c + W] over j in [s, e), in order; -1, or
        the first j whose index is outside the table (its row not read). If `fetch` (the first
        column block), each index is checked and PF entries' whole rows ahead are prefetched. From +0.0, as the reference's and torch's sums (a
        bag of -0.0 rows sums to +0.0), and with no first-row case in the loop: a per-row select
        of "set or add" made LLVM shuffle the accumulator's registers (or keep it on the stack) on
        every row, 1.3x the time of a bag whose rows are cached. Takes the arrays, not the bags
        tuple: unpacking a tuple here costs NRT reference counts (atomic calls) per bag, 2-7x the
        whole gather at pooling 1 in serially compiled code."""
        for d in range(W if W else D):
            acc[0, d] = 0.0
        far, rows = np.uint64(indices.shape[0] - 1), weight.shape[0]
        tail = straddles(weight, D * ITEM)
        for j in range(s, e):
            u = np.uint64(j)  # non-negative: unsigned indexing skips numba's wraparound code
            r = indices[u]
            if fetch:
                if outside(r, rows):
                    return j
                prefetch_lines(weight, indices[min(u + np.uint64(PF), far)], D * ITEM, tail, LOC, STEP)
            add_row(acc, 0, weight, r, c, psw[u] if weighted else np.float32(1.0), W if W else D, W, False, SCHEME)
        return -1

    @jit(inline="always", fastmath=_STRICT)
    def copy_bags(weight, indices, offsets, out, b0, b1, D, last):
        """If bags b0 <= b < b1 hold one row each (offsets step by one), copy each bag's row to out[b]
        (its sum and its mean are +0.0 plus the row: row_copy) and return -1, or the position of the
        first index outside the table; NONE if they do not. A loop of its own: a plain copy, with no
        accumulator between load and store and few live values, gathers a pooling-1 batch 1.2-1.3x
        faster than the pooling loop. Only for unweighted bags of vector-width rows."""
        nbags, nnz = out.shape[0], indices.shape[0]
        if not COPY or b1 <= b0:
            return NONE
        first = offsets[b0]
        if bag_end(offsets, b1 - 1, nbags, nnz, last) != first + (b1 - b0):
            return NONE
        for b in range(b0 + 1, b1):
            if offsets[b] != first + (b - b0):
                return NONE
        far, rows = np.uint64(nnz - 1), weight.shape[0]
        tail = straddles(weight, D * ITEM)
        u = np.uint64(first)
        for b in range(b0, b1):
            r = indices[u]
            if outside(r, rows):
                return np.int64(u)
            prefetch_lines(weight, indices[min(u + np.uint64(PF), far)], D * ITEM, tail, LOC, STEP)
            row_copy(out, b, weight, r, DC)
            u += np.uint64(1)
        return -1

    @jit(inline="always", fastmath=_STRICT)
    def pool_bags(weight, bags, out, b0, b1, D, weighted):
        """out[b] = the pooled rows of bag b for b0 <= b < b1, weighted by psw or not; -1, or the
        position of the first index outside the table (out's bags before its bag written). The
        weighted and the unweighted caller each get their own accumulator: one shared by both loops
        kept part of it on the stack in both (the weighted loop needs a register more than the
        vector file has)."""
        indices, offsets, psw, mean, last = bags
        nbags, nnz = out.shape[0], indices.shape[0]
        acc = stack_f32(W) if DC else np.empty((1, D), np.float32)
        for b in range(b0, b1):
            s, e = offsets[b], bag_end(offsets, b, nbags, nnz, last)
            for h in range(COLS):
                c = h * W
                bad = pool_bag(acc, weight, indices, psw, s, e, D, c, weighted, h == 0)
                if bad >= 0:
                    return bad
                if e > s:
                    inv = np.float32(1.0) / np.float32(e - s) if mean else np.float32(1.0)
                    if DC:  # the sum is in the order the widening left it
                        row_set_from(out, b, c, acc, 0, inv, W, SCHEME)
                    else:
                        madd_row(out, b, acc, 0, inv, D, DC, True)
                else:
                    for d in range(c, c + (W if W else D)):
                        out[b, d] = 0.0
        return -1

    @jit(inline="always", fastmath=_STRICT)
    def pool(weight, bags, out, b0, b1):
        """out[b] = the pooled rows of bag b, for the bags b0 <= b < b1 (one work unit of the forward);
        -1, or the position of the first index outside the table: each is checked where its row is
        read (a pass over the indices first evicted a cached table's rows: 1.1x the time)."""
        indices, offsets, psw, _, last = bags
        D = DC if DC else out.shape[1]
        if psw.shape[0] == 0:
            done = copy_bags(weight, indices, offsets, out, b0, b1, D, last)
            if done != NONE:
                return done
        if psw.shape[0] > 0:  # two copies of the row loop, so the common unweighted one has no per-row test
            return pool_bags(weight, bags, out, b0, b1, D, True)
        return pool_bags(weight, bags, out, b0, b1, D, False)
    return pool


def _parallel_kernel(pool):
    @jit(parallel=True, fastmath=_STRICT)
    def forward(weight, bags, nchunks, out):
        # weight: (R, D) float32 or bf16 bits uint16, out: (B, D) float32; contiguous chunks of
        # bags, spread over the threads by prange (independent of the thread count)
        nbags = out.shape[0]
        code, bad, value = check_bags(bags, nbags, weight.shape[0])  # all first: a prange loop cannot stop
        if code:
            return code, bad, value
        for c in prange(nchunks):
            pool(weight, bags, out, c * nbags // nchunks, (c + 1) * nbags // nchunks)
        return 0, 0, 0
    return forward


def _serial_kernel(pool, DC):
    @jit(fastmath=_STRICT, nrt=not DC)  # the vector kernels allocate nothing (see codegen.build.jit)
    def pool_all(weight, bags, out):
        return pool(weight, bags, out, 0, out.shape[0])

    @jit(fastmath=_STRICT)
    def forward_serial(weight, bags, nchunks, out):
        # the same on the calling thread: starting a parallel region costs more than a small call
        code, bad, value = check_offsets(bags, out.shape[0])
        if code:
            return code, bad, value
        bad = pool_all(weight, bags, out)
        if bad >= 0:
            return 6, bad, np.int64(bags[0][bad])
        return 0, 0, 0
    return forward_serial


@kernel_factory("embedding_bag_forward")
def _forward_factory(spec):
    # bytes per table element: a constant, so prefetch loops unroll
    pool = _pooler(spec["D"], spec["pf"], HINTS[spec["hint"]], WIDEN_SCHEMES[spec["widen"]],
                   2 if spec["bf16"] else 4, spec["cols"], spec["pstep"])
    return _serial_kernel(pool, spec["D"]) if spec["serial"] else _parallel_kernel(pool)


def _spec(dim, bf16, serial, prefetch, widen, cols=1) -> KernelSpec:
    dc = d_class(dim)
    scheme = widen["scheme"] if bf16 and dc else "shuffle"  # only the vector rows of bf16 tables widen
    step = prefetch.get("step", 64)  # entries tuned before the step was a choice have none
    return KernelSpec.make("embedding_bag_forward", D=dc, bf16=bf16, pf=int(prefetch["distance"]),
                           hint=prefetch["hint"], pstep=step if step in (64, 128) else 64, widen=scheme, serial=serial,
                           cols=cols if dc and cols > 0 and dc % cols == 0 else 1)  # a DB entry never drops columns


# ----------------------------------------------------------------------------- knobs


def _prefetch_heuristic(problem):
    """Rows ahead as _rows.prefetch_distance. Into L1 for a table within L2: its rows are cached,
    so an L1 fill buffer is held briefly and the loads then hit L1. Into L2 beyond: the rows may
    come from DRAM, and an L1 prefetch holds one of the L1's few fill buffers until its line
    arrives, which caps the misses in flight (a larger last-level cache may be shared with
    other cores and processes, so it does not decide)."""
    rows, dim, _, _, itemsize, _ = problem
    distance = prefetch_distance(dim * itemsize) if d_class(dim) else 16  # one generic kernel per dtype
    return {"distance": distance, "hint": "l1" if rows * dim * itemsize <= host_target().l2 else "l2"}


def _prefetch_candidates(problem, quick):
    h = _prefetch_heuristic(problem)
    # one line of each 128-byte pair (step 128; rows of one line have no pair): on Zen 3 at pooling
    # 20 it won 3-10% on fp32 rows and lost 16% on bf16 D=128 and at pooling 1, so a tuned choice only
    pairs = problem[1] * problem[4] > 64
    if quick:
        d = h["distance"]
        return [h, {"distance": d // 2, "hint": "l2"}, {"distance": 2 * d, "hint": h["hint"]},
                {"distance": d, "hint": "l1"}, {"distance": d, "hint": "nta"}] + ([{**h, "step": 128}] if pairs else [])
    return ([{"distance": d, "hint": hint} for hint in HINTS for d in (8, 16, 24, 32, 48, 64)]
            + [{"distance": d, "hint": hint, "step": 128} for hint in ("l1", "l2") for d in (8, 16, 32) if pairs])


def _timed(problem, prefetch=None, widen=None, cols=None, layout=None):
    """The forward of the problem's batches with these choices (None: the knobs'), on a table of
    `layout` (bf16; None: the knob's), inputs built here (untimed)."""
    _, dim, _, batch, itemsize, threads = problem
    table = make_table(problem, layout)
    w = table.hi if itemsize == 2 else table
    batches, _ = draw_batches(problem)
    serial = batches[0][0].shape[0] * dim <= PARALLEL.choose(problem)["serial_max_work"]
    kern = get_kernel(_spec(dim, itemsize == 2, serial, prefetch or PREFETCH.choose(problem),
                            widen or WIDEN.choose(problem), (cols or COLUMNS.choose(problem))["cols"]))
    out = np.empty((batch, dim), np.float32)
    call = cycle([functools.partial(kern, w, bags, min(_CHUNKS, batch), out) for bags in batches], batches, table)
    return call if serial else on_threads(threads, call)


def _parallel_heuristic(problem):
    """On the calling thread up to SERIAL_WORK (starting threads costs more than a small call), or
    always with one thread."""
    threads = problem[5]
    return {"serial_max_work": NEVER if threads == 1 else SERIAL_WORK}


def _parallel_search(problem, quick, timer):
    """Time the serial and the parallel kernel at a few batch sizes; serial up to the last size
    before the parallel one wins."""
    _, dim, pooling, _, itemsize, threads = problem
    if threads == 1:
        return _parallel_heuristic(problem)
    table = make_table(problem)
    w = table.hi if itemsize == 2 else table
    prefetch, widen, cols = PREFETCH.choose(problem), WIDEN.choose(problem), COLUMNS.choose(problem)["cols"]
    kernels = {serial: get_kernel(_spec(dim, itemsize == 2, serial, prefetch, widen, cols)) for serial in (True, False)}

    def run(nbags, parallel):
        batches, _ = draw_batches(problem, nbags)
        out = np.empty((nbags, dim), np.float32)
        return cycle([functools.partial(kernels[not parallel], w, bags, min(_CHUNKS, nbags), out) for bags in batches],
                     batches)

    sizes = (16, 128, 1024, 8192) if quick else (16, 64, 256, 1024, 4096, 16384)
    with numba_threads(threads):
        last, first = crossover(timer, sizes, run)
    if first is None:
        return {"serial_max_work": NEVER}
    return {"serial_max_work": -1 if last is None else last * pooling * dim}


PREFETCH = knob("embedding.forward.prefetch", doc="rows the forward prefetches ahead, and into which cache",
                heuristic=_prefetch_heuristic, shape_class=shape_class, quick_class=quick_class, problems=problems,
                candidates=_prefetch_candidates, runner=lambda p, params: _timed(p, prefetch=params))
PARALLEL = knob("embedding.parallel.forward", doc="work (nnz * D) up to which the forward runs on the calling thread",
                heuristic=_parallel_heuristic, shape_class=shape_class, quick_class=quick_class, problems=problems,
                search=_parallel_search)


def _widen_candidates(problem, quick):
    """Every scheme; the quick tune the heuristic's and one other (shift, or parity beside it)."""
    if not quick:
        return [{"scheme": s} for s in WIDEN_SCHEMES]
    mine = widen_heuristic(problem)["scheme"]
    return [{"scheme": mine}, {"scheme": "parity" if mine == "shift" else "shift"}]


WIDEN = knob("embedding.bf16.widen.forward", doc="how the forward widens bf16 rows to fp32 (codegen.rowvec)",
             heuristic=widen_heuristic, shape_class=shape_class, quick_class=quick_class,
             problems=lambda w: problems(w, itemsizes=(2,)),
             candidates=_widen_candidates,
             runner=lambda p, params: _timed(p, widen=params))
COLUMNS = knob("embedding.forward.columns", doc="column blocks a bag is pooled in (the accumulator's share of the "
               "vector registers)", heuristic=columns_heuristic, shape_class=shape_class, quick_class=quick_class,
               problems=problems, candidates=columns_candidates, runner=lambda p, params: _timed(p, cols=params))


# ----------------------------------------------------------------------------- op

_KERNELS: dict = {}  # table key -> (token, choices): one entry per table shape and thread count
ADAPT_EVERY = 512    # calls between two rounds that time both prefetch choices of a table
ADAPT_TRIES = 3      # calls of each choice a round times (after one untimed call of it)


class HintChooser:
    """Which of two prefetch choices a table's forward runs: 0, the knobs' (tuned or heuristic),
    or 1, the other hint. The rows of a table beyond L2 may come from DRAM (a new batch's rows:
    best prefetched far ahead into L2) or from the caches (hot rows: best near, into L1), and
    only the calls can tell: a round runs each choice ADAPT_TRIES + 1 times in a row and times
    all but the first (which finds the caches as the other choice left them: alternating calls
    measured each choice partly by the other), and the faster per entry (median) runs until the
    next round. Rounds come 16, 32, 64, ... calls apart, then every ADAPT_EVERY: the first calls
    find the rows colder than later ones will. Prefetches change no bit of the result, only its
    speed."""
    __slots__ = ("pick", "calls", "start", "gap", "times")

    def __init__(self):
        self.pick, self.calls, self.start, self.gap, self.times = 0, 0, 0, 4 * (ADAPT_TRIES + 1), ([], [])

    def next(self) -> tuple[int, bool]:
        """(choice to run, whether to time it and report it to record())."""
        c = self.calls
        self.calls = c + 1
        k = c - self.start
        if k < 2 * (ADAPT_TRIES + 1):
            return k // (ADAPT_TRIES + 1), k % (ADAPT_TRIES + 1) != 0
        if k + 1 >= self.gap:  # the last call before the next round
            self.start, self.gap = c + 1, min(2 * self.gap, ADAPT_EVERY)
        return self.pick, False

    def record(self, choice: int, seconds_per_entry: float) -> None:
        times = self.times
        times[choice].append(seconds_per_entry)
        if len(times[0]) >= ADAPT_TRIES and len(times[1]) >= ADAPT_TRIES:
            self.pick = int(np.median(times[1]) < np.median(times[0]))
            self.times = ([], [])


def _other_hint(prefetch, row_bytes):
    """The alternative a HintChooser tries: into L2 at the heuristic's distance, or into L1 at half
    of it (an L1 prefetch holds a fill buffer until its line arrives: fewer in flight)."""
    far = prefetch_distance(row_bytes)
    if prefetch["hint"] == "l1":
        return {**prefetch, "distance": far, "hint": "l2"}
    return {**prefetch, "distance": max(far // 2, 8), "hint": "l1"}


def _kernels(rows, dim, bf16, threads, nnz, nbags):
    """(serial_max_work, [(serial kernel, parallel kernel) per prefetch choice], HintChooser or
    None) of a table at a thread count: the knobs' choices, memoised per table and thread count
    and made again when a setting they depend on changes (choice_token(), tunedb.generation(),
    as gemm_blocking.BlockChoices): the DLRM calls once per table per step. Tables within L2 (their
    rows are cached: into L1 is right) and the generic kernel have one choice; so does
    JITKERN_NO_TUNE (the heuristics' choices only)."""
    token = (choice_token(), tunedb.generation())
    key = (rows, dim, bf16, threads)
    got = _KERNELS.get(key)
    if got is None or got[0] != token:
        itemsize = 2 if bf16 else 4
        problem = call_problem(rows, dim, nnz, nbags, itemsize, threads)
        prefetch, widen, cols = PREFETCH.choose(problem), WIDEN.choose(problem), COLUMNS.choose(problem)["cols"]
        choices = [prefetch]
        if get_config().use_tuning and d_class(dim) and rows * dim * itemsize > host_target().l2:
            choices.append(_other_hint(prefetch, dim * itemsize))
        kernels = [tuple(get_kernel(_spec(dim, bf16, serial, c, widen, cols)) for serial in (True, False))
                   for c in choices]
        got = _KERNELS[key] = (token, (PARALLEL.choose(problem)["serial_max_work"], kernels,
                                       HintChooser() if len(kernels) > 1 else None))
    return got[1]


def embedding_bag_forward(weight, indices, offsets, *, mode="sum", per_sample_weights=None,
                          include_last_offset=False, out=None):
    """Pooled rows per bag; weight: (R, D) float32 or SplitBF16Table, indices: (nnz,), offsets: (B,) -> (B, D).

    An index outside the table raises IndexError naming it; `out`'s bags before its bag may be
    written by then (the table never is)."""
    w, bf16 = check_table(weight)
    R, D = w.shape
    bags, nbags = check_bag_args(indices, offsets, mode, per_sample_weights, include_last_offset)
    if out is None:
        dest = out = np.empty((nbags, D), np.float32)
    else:  # a strided out (one table's slice of a (B, T, D) buffer, say) is pooled into a copy
        dest = float_array("out", out, shape=(nbags, D), writeable=True)
    nnz = bags[0].shape[0]
    serial_max_work, kernels, chooser = _kernels(R, D, bf16, num_threads(), nnz, nbags)
    choice, timed = chooser.next() if chooser is not None else (0, False)
    kern = kernels[choice][0 if nnz * D <= serial_max_work else 1]
    if timed:
        t0 = time.perf_counter()
        code, pos, val = kern(w, bags, min(_CHUNKS, nbags), dest)
        chooser.record(choice, (time.perf_counter() - t0) / max(nnz, 1))
    else:
        code, pos, val = kern(w, bags, min(_CHUNKS, nbags), dest)
    if code:  # bad offsets before anything is written; an index outside the table as its bag is pooled
        raise_bag_error(code, pos, val, "weight", R, nnz)
    if dest is not out:
        np.copyto(out, dest)
    return out
