"""Fused embedding-bag SGD: the backward and the SGD step in one pass, on fp32 tables or BF16
Split-SGD tables (exact fp32 SGD on the halves, split_bf16.py).

SGD needs no coalescing: applying every entry's scaled gradient to its row one by one, in
position order, is exactly np.add.at's result (the reference), and each row is read and written
once per occurrence, with its row prefetched some entries ahead. With several threads (large
batches on tables beyond the caches) the rows are owned by parts: a multiplicative hash of a
row's 16-row block picks its part, each thread applies its part's entries in position order,
so results are bit-identical for any thread count. Knobs: the prefetch distance, the work and
table size from which threads pay, and how the Split-SGD joins and splits the bf16 halves.
"""
from __future__ import annotations

import functools

import numpy as np
from numba import prange

from ...codegen import KernelSpec, get_kernel, jit, kernel_factory, num_threads, tunedb
from ...codegen.knobs import knob
from ...codegen.rowvec import SPLIT_SCHEMES, in_lanes, row_to_lanes, stack_f32
from ...config import choice_token
from .._check import finite, float_array, no_overlap
from ._knobs import (
    NEVER,
    call_problem,
    crossover,
    cycle,
    draw_batches,
    make_table,
    numba_threads,
    on_threads,
    problems,
    quick_class,
    shape_class,
    split_heuristic,
)
from ._rows import (
    GOLDEN,
    L2,
    LO32,
    bag_end,
    bag_size,
    d_class,
    entry_scale,
    madd_row,
    prefetch_row,
    scratch,
    sgd_row,
    split_sgd_row,
    straddles,
)
from ._validate import MAX_NNZ, check_bag_args, check_table, raise_bag_error, validate_bags

SGD_PREFETCH = 32              # entries ahead whose rows are prefetched
PARALLEL_MIN_WORK = 1 << 16    # nnz * D below which the update runs on the calling thread
PARALLEL_MIN_TABLE = 16 << 20  # table bytes below which it does too: rows then come from the caches
OWNER_BLOCK = 4                # log2 of the rows per ownership block: 16, whole lines of an aligned table
_NO_LO = np.empty((0, 0), np.uint16)
_NO_SCRATCH = np.empty(0, np.int64)
_NO_LANES = np.empty(0, np.float32)
_LR = 0.01                     # the learning rate runners and searches time

# ----------------------------------------------------------------------------- kernels


@jit(inline="always")
def _owner(r, nparts):
    """The part that owns row r: a multiplicative hash of its 16-row block, reduced to [0, nparts)."""
    h = (np.uint64(r >> OWNER_BLOCK) * GOLDEN) >> np.uint64(32)
    return np.int64((h * np.uint64(nparts)) >> np.uint64(32))


@jit(inline="always")
def _list_owned(t, nparts, bags, nbags, mine):
    """List the entries part t owns in mine as (bag << 32) | position, in position order
    (branch-free); returns their count."""
    indices, offsets, _, _, last = bags
    n = indices.shape[0]
    m = 0
    b = 0
    end = bag_end(offsets, 0, nbags, n, last) if nbags else n
    for j in range(n):
        while j >= end:  # the bag holding entry j (empty bags are stepped over)
            b += 1
            end = bag_end(offsets, b, nbags, n, last)
        mine[m] = (np.int64(b) << 32) | j
        m += _owner(indices[j], nparts) == t
    return m


def ring_rows(dim: int) -> int:
    """dout rows an UNPACK Split-SGD holds in lane order at a time: 16 KiB, half of any L1."""
    return max(8, 4096 // max(dim, 1))


@functools.lru_cache(maxsize=None)
def _loops(DC, PF, BF16, SCHEME, scaled):
    """(serial, owned) update loops for compile-time width DC (0: runtime D): the whole batch, or the
    entries of one ownership part. `scaled`: per-sample weights or mean (else nothing per entry
    is multiplied: g is dout's row itself). target = (table, lo): the fp32 table and an empty lo,
    or the bf16 halves (BF16). With an UNPACK scheme (LANES) the updates read dout's rows in lane
    order from a ring of RING rows in `lanes` (RING * DC floats per part), refilled as the bags
    advance: permuting once per bag, apart from the update loop, keeps that loop as short as
    the fp32 one (in it, the permutes made a DRAM-bound update 1.8x slower, not 1.1x)."""
    ITEM = 2 if BF16 else 4
    LANES = bool(BF16) and in_lanes(DC, SCHEME)
    RING = ring_rows(DC)
    # unscaled entries update by the ring's rows as filled: -lr * dout[b], multiplied once per bag,
    # not once per entry (the same product, so the same bits); scaled ones need dout itself
    PRESCALED = LANES and not scaled

    @jit(inline="always")
    def prefetch_rows(target, r, D, tails):
        prefetch_row(target[0], r, D * ITEM, tails[0], L2)
        if BF16:
            prefetch_row(target[1], r, D * ITEM, tails[1], L2)

    @jit(inline="always")
    def update_row(target, r, g, a, lr, D):
        if BF16:  # a closure constant: the other kind's branch is pruned before typing
            split_sgd_row(target[0], target[1], r, g, a, lr, D, DC, SCHEME)
        else:
            sgd_row(target[0], r, g, a, lr, D, DC)

    @jit(inline="always")
    def apply_entry(target, r, j, b, offsets, psw, mean, last, n, nbags, src, a, lr, acc, D):
        # the bags' fields, unpacked by the caller once (see entry_scale); bag b's dout row is src[a]
        if scaled:  # g = scale * dout[b], rounded once, as the reference computes it
            sc = entry_scale(psw, j, mean, bag_size(offsets, b, nbags, n, last))
            madd_row(acc, 0, src, a, sc, D, DC, True)
            update_row(target, r, acc, 0, lr, D)
        elif PRESCALED:  # src[a] is -lr * g already: w + 1 * src[a] (the multiply folds away)
            update_row(target, r, src, a, np.float32(-1.0), D)
        else:
            update_row(target, r, src, a, lr, D)

    @jit(inline="always")
    def source(dout, lanes, t):
        # the rows the updates read: dout itself, or part t's ring
        if LANES:
            return lanes[t * RING * DC:(t + 1) * RING * DC].reshape((RING, DC))
        return dout

    @jit(inline="always")
    def advance(src, first, b, dout, lr):
        # the ring's first bag once bag b is due: refilled from b when b is past it
        if LANES:
            if b >= first + RING:
                scale = -lr if PRESCALED else np.float32(1.0)
                for k in range(min(RING, dout.shape[0] - b)):
                    row_to_lanes(src, k, dout, b + k, scale, DC, SCHEME)
                return b
        return first

    @jit(fastmath=frozenset())  # strict IEEE: bit-identical to the reference's np.add.at
    def serial(bags, dout, lr, target, lanes):
        indices, offsets, psw, mean, last = bags
        nbags, n = dout.shape[0], indices.shape[0]
        D = DC if DC else dout.shape[1]
        acc = stack_f32(DC) if DC else np.empty((1, D), np.float32)
        tails = (straddles(target[0], D * ITEM), straddles(target[1], D * ITEM))
        far = np.uint64(max(n - 1, 0))
        src = source(dout, lanes, 0)
        first = -RING if LANES else 0
        for b in range(nbags):
            first = advance(src, first, b, dout, lr)
            for j in range(offsets[b], bag_end(offsets, b, nbags, n, last)):
                u = np.uint64(j)  # validated, non-negative: unsigned indexing skips wraparound code
                prefetch_rows(target, indices[min(u + np.uint64(PF), far)], D, tails)
                apply_entry(target, indices[u], j, b, offsets, psw, mean, last, n, nbags, src, b - first, lr, acc, D)

    @jit(fastmath=frozenset())
    def owned(t, nparts, bags, dout, lr, target, scratch, lanes):
        # part t: list its entries, then apply them, prefetching rows PF listed entries ahead.
        # Every part reads all entries: one parallel region. Its entries' bags only increase.
        indices, offsets, psw, mean, last = bags
        nbags, n = dout.shape[0], indices.shape[0]
        D = DC if DC else dout.shape[1]
        mine = scratch[t * n:(t + 1) * n]
        m = _list_owned(t, nparts, bags, nbags, mine)
        acc = stack_f32(DC) if DC else np.empty((1, D), np.float32)
        tails = (straddles(target[0], D * ITEM), straddles(target[1], D * ITEM))
        src = source(dout, lanes, t)
        first = -RING if LANES else 0
        for i in range(m):
            if i + PF < m:
                prefetch_rows(target, indices[mine[i + PF] & LO32], D, tails)
            j, b = mine[i] & LO32, mine[i] >> 32
            first = advance(src, first, b, dout, lr)
            apply_entry(target, indices[j], j, b, offsets, psw, mean, last, n, nbags, src, b - first, lr, acc, D)
    return serial, owned


def _serial_kernel(plain, scaled):
    @jit(fastmath=frozenset())
    def serial(bags, dout, lr, target, scratch, nparts, lanes):
        # dout: (B, D) float32; target: (table (R, D) float32, empty lo), or the bf16 hi bits and
        # their low halves lo, (R, D) uint16 each; scratch: (nparts * nnz,) int64 (parallel only);
        # lanes: (nparts * ring_rows * D,) float32 for rings of dout rows in lane order, or empty
        code, bad, value = validate_bags(bags, dout.shape[0], target[0].shape[0])
        if code:
            return code, bad, value
        lr32 = np.float32(lr)  # lr arrives as a Python float: converting here is cheaper than in the wrapper
        if bags[3] or bags[2].shape[0] > 0:
            scaled(bags, dout, lr32, target, lanes)
        else:
            plain(bags, dout, lr32, target, lanes)
        return 0, 0, 0
    return serial


def _parallel_kernel(plain, scaled):
    @jit(parallel=True, fastmath=frozenset())
    def parallel(bags, dout, lr, target, scratch, nparts, lanes):
        code, bad, value = validate_bags(bags, dout.shape[0], target[0].shape[0])
        if code:
            return code, bad, value
        lr32 = np.float32(lr)
        is_scaled = bags[3] or bags[2].shape[0] > 0
        for t in prange(nparts):
            if is_scaled:
                scaled(t, nparts, bags, dout, lr32, target, scratch, lanes)
            else:
                plain(t, nparts, bags, dout, lr32, target, scratch, lanes)
        return 0, 0, 0
    return parallel


def _in_lanes(bf16, dim, scheme) -> bool:
    """Whether the update of this table takes dout in lane order (an UNPACK scheme's vector rows)."""
    return bool(bf16) and in_lanes(d_class(dim), SPLIT_SCHEMES[scheme])


def _lanes(dout, wanted, nparts):
    """The float32 scratch of nparts rings of dout rows in lane order, if the update takes them."""
    dim = dout.shape[1]
    return scratch(ring_rows(dim) * dim, nparts, np.float32) if wanted else _NO_LANES


@kernel_factory("embedding_bag_sgd")
def _sgd_factory(spec):
    DC, PF, BF16, SCHEME = spec["D"], spec["pf"], spec["bf16"], SPLIT_SCHEMES[spec["widen"]]
    serial_plain, owned_plain = _loops(DC, PF, BF16, SCHEME, False)
    serial_scaled, owned_scaled = _loops(DC, PF, BF16, SCHEME, True)
    if spec["parallel"]:
        return _parallel_kernel(owned_plain, owned_scaled)
    return _serial_kernel(serial_plain, serial_scaled)


def _spec(dim, bf16, parallel, prefetch, widen) -> KernelSpec:
    dc = d_class(dim)
    scheme = widen["scheme"] if bf16 and dc else "shuffle"  # only the vector rows of bf16 tables join halves
    return KernelSpec.make("embedding_bag_sgd", D=dc, pf=int(prefetch["distance"]), bf16=bf16, parallel=parallel,
                           widen=scheme)


def _parts(nnz: int, dim: int, table_bytes: int, threads: int, parallel: dict) -> int:
    """How many ownership parts an update of nnz rows of width dim is cut into (1: serial).

    Threads pay off where rows come from DRAM (each core then keeps its own misses in flight);
    for small tables or batches each part's pass over all entries costs more than it saves."""
    if nnz * max(dim, 1) < parallel["min_work"] or table_bytes < parallel["min_table"]:
        return 1
    return threads


# ----------------------------------------------------------------------------- knobs


def _target(table):
    """The kernels' (table, lo) of an fp32 table or a SplitBF16Table."""
    return (table, _NO_LO) if isinstance(table, np.ndarray) else (table.hi, table.lo)


def _timed(problem, prefetch=None, widen=None, layout=None):
    """The fused SGD of the problem's batches with these choices (None: the knobs'), on a table of
    `layout` (bf16; None: the knob's), inputs built here (untimed)."""
    rows, dim, _, _, itemsize, threads = problem
    prefetch, widen = prefetch or PREFETCH.choose(problem), widen or WIDEN.choose(problem)
    table = make_table(problem, layout)
    target = _target(table)
    batches, dout = draw_batches(problem)
    nnz = batches[0][0].shape[0]
    nparts = _parts(nnz, dim, rows * dim * 4, threads, PARALLEL.choose(problem))
    kern = get_kernel(_spec(dim, itemsize == 2, nparts > 1, prefetch, widen))
    work = np.empty(nnz * nparts, np.int64) if nparts > 1 else _NO_SCRATCH
    lanes = _lanes(dout, _in_lanes(itemsize == 2, dim, widen["scheme"]), nparts)
    call = cycle([functools.partial(kern, bags, dout, _LR, target, work, nparts, lanes) for bags in batches],
                 batches, table)
    return call if nparts == 1 else on_threads(threads, call)


def _prefetch_candidates(problem, quick):
    if quick:
        return [{"distance": d} for d in (SGD_PREFETCH, SGD_PREFETCH // 2, SGD_PREFETCH * 2)]
    return [{"distance": d} for d in (8, 16, 24, 32, 48, 64)]


def _split_candidates(problem, quick):
    """Every scheme; the quick tune the heuristic's and the other family's for the vector width."""
    if not quick:
        return [{"scheme": s} for s in SPLIT_SCHEMES]
    mine = split_heuristic(problem)["scheme"]
    other = {"shuffle": "unpack16", "unpack16": "shuffle"}.get(mine, "unpack8" if mine == "shift" else "shift")
    return [{"scheme": mine}, {"scheme": other}]


def _parallel_search(problem, quick, timer):
    """Time the serial update and the one in `threads` ownership parts at a few batch sizes, on the
    problem's table; parallel from the first size at which it wins (the table size is the class's)."""
    _, dim, pooling, _, itemsize, threads = problem
    if threads == 1:  # nothing to time: _parts gives one part
        return PARALLEL.heuristic(problem)
    target = _target(make_table(problem))
    prefetch, widen = PREFETCH.choose(problem), WIDEN.choose(problem)
    kernels = {par: get_kernel(_spec(dim, itemsize == 2, par, prefetch, widen)) for par in (False, True)}

    def run(nbags, parallel):
        batches, dout = draw_batches(problem, nbags)
        nparts = threads if parallel else 1
        work = np.empty(nbags * pooling * nparts, np.int64)
        lanes = _lanes(dout, _in_lanes(itemsize == 2, dim, widen["scheme"]), nparts)
        calls = [functools.partial(kernels[parallel], bags, dout, _LR, target, work, nparts, lanes)
                 for bags in batches]
        return cycle(calls, batches)

    sizes = (64, 512, 4096) if quick else (16, 64, 256, 1024, 4096, 16384)
    with numba_threads(threads):
        _, first = crossover(timer, sizes, run)
    return {"min_work": NEVER if first is None else first * pooling * dim, "min_table": 0}


PREFETCH = knob("embedding.update.prefetch.sgd", doc="rows the fused SGD and Split-SGD prefetch ahead",
                heuristic=lambda p: {"distance": SGD_PREFETCH}, shape_class=shape_class, quick_class=quick_class,
                problems=problems,
                candidates=_prefetch_candidates, runner=lambda p, params: _timed(p, params, WIDEN.choose(p)))
PARALLEL = knob("embedding.parallel.sgd",
                doc="work (nnz * D) and table bytes from which the fused SGD uses every thread",
                heuristic=lambda p: {"min_work": PARALLEL_MIN_WORK, "min_table": PARALLEL_MIN_TABLE},
                shape_class=shape_class, quick_class=quick_class, problems=problems, search=_parallel_search)
WIDEN = knob("embedding.bf16.widen.sgd", doc="how the Split-SGD joins and splits the bf16 halves (codegen.rowvec)",
             heuristic=split_heuristic, shape_class=shape_class, quick_class=quick_class,
             problems=lambda w: problems(w, itemsizes=(2,)),
             candidates=_split_candidates,
             runner=lambda p, params: _timed(p, PREFETCH.choose(p), params))


# ----------------------------------------------------------------------------- op

_KERNELS: dict = {}  # as forward._KERNELS


def _kernels(rows, dim, bf16, threads, nnz, nbags):
    """(parallel choice, serial kernel, parallel kernel, whether they take dout in lane order) of a
    table at a thread count, memoised as forward._kernels."""
    token = (choice_token(), tunedb.generation())
    key = (rows, dim, bf16, threads)
    got = _KERNELS.get(key)
    if got is None or got[0] != token:
        problem = call_problem(rows, dim, nnz, nbags, 2 if bf16 else 4, threads)
        prefetch, widen = PREFETCH.choose(problem), WIDEN.choose(problem)
        got = _KERNELS[key] = (token, (PARALLEL.choose(problem), get_kernel(_spec(dim, bf16, False, prefetch, widen)),
                                       get_kernel(_spec(dim, bf16, True, prefetch, widen)),
                                       _in_lanes(bf16, dim, widen["scheme"])))
    return got[1]


def _not_in_table(weight, w, bags, dout):
    """The update writes rows while it reads dout and the per-sample weights: neither may lie in the
    table (either bf16 half included)."""
    memory = (w, weight.lo) if w is not weight else (w,)
    what = "weight (the table the update writes)"
    no_overlap("dout", dout, *memory, what=what)
    no_overlap("per_sample_weights", bags[2], *memory, what=what)


def embedding_bag_sgd_(weight, indices, offsets, dout, lr, *, mode="sum", per_sample_weights=None,
                       include_last_offset=False):
    """In place, fused: weight[indices[j]] -= lr * g_j for every entry j in order (np.add.at's
    result; "coalesce, then update" to float rounding). weight: (R, D) float32 or SplitBF16Table,
    indices: (nnz,) int32|int64, offsets: (B,)|(B+1,) int64, dout: (B, D) float32. Returns weight."""
    w, bf16 = check_table(weight, writeable=True)
    lr = finite("lr", lr)
    bags, nbags = check_bag_args(indices, offsets, mode, per_sample_weights, include_last_offset)
    R, D = w.shape
    dout = float_array("dout", dout, shape=(nbags, D))
    _not_in_table(weight, w, bags, dout)
    nnz = bags[0].shape[0]
    if nnz > MAX_NNZ:  # a position and a bag share one int64 word
        raise ValueError(f"embedding_bag_sgd_ supports up to 2**31 - 1 indices, got {nnz}")
    threads = num_threads()
    parallel, serial_kernel, parallel_kernel, lanes_order = _kernels(R, D, bf16, threads, nnz, nbags)
    nparts = _parts(nnz, D, w.size * 4, threads, parallel)  # bytes a row update touches: fp32, or both bf16 halves
    target = (w, weight.lo if bf16 else _NO_LO)
    lanes = _lanes(dout, lanes_order, nparts)
    if nparts > 1:
        code, pos, val = parallel_kernel(bags, dout, lr, target, scratch(nnz, nparts), nparts, lanes)
    else:
        code, pos, val = serial_kernel(bags, dout, lr, target, _NO_SCRATCH, nparts, lanes)
    if code:  # found before anything was written
        raise_bag_error(code, pos, val, "weight", R, nnz)
    return weight
