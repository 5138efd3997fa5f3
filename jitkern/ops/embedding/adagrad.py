"""Fused embedding-bag row-wise Adagrad: the backward and the update in one pass.

"Coalesce, then update": Adagrad's state takes the square of a row's whole gradient, so a row's
occurrences are summed first (scaled dout rows, in position order) and the row is updated
once; the order is fixed by the data alone, so results are bit-identical run to run, path to
path and for any thread count. The occurrences are grouped (grouping.py):

- hashed, when a batch touches few rows of the table (the usual case): after linking, a
  forward pass visits the list heads, sums each list's gradient in registers and updates the
  row, prefetching rows and their state ahead. With several threads the pass is cut into
  position ranges, one per thread: a row is updated by the range holding its head only.
- sorted, for dense or skewed batches: applying the updates in row order streams through the
  table, and the hash lists of a skewed batch would be walked entry by entry.

Knobs: the prefetch distances of the update and the linking pass, and the number of indices
from which the hashed update uses every thread. The element-wise Adagrad (adagrad_exact.py) runs
on these paths and knobs with its own row update (build(spec, exact=True), update(..., op)).
"""
from __future__ import annotations

import functools

import numpy as np
from numba import prange

from ...codegen import KernelSpec, get_kernel, jit, kernel_factory, num_threads, tunedb
from ...codegen.knobs import knob
from ...codegen.rowvec import stack_f32
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
)
from ._rows import (
    L2,
    adagrad_exact_row,
    adagrad_row,
    bag_size,
    d_class,
    entry_scale,
    madd_row,
    prefetch_row,
    prefetch_state_entry,
    prefetch_state_row,
    scratch,
    straddles,
)
from ._validate import check_bag_args, check_sparse_sizes, check_table, raise_bag_error, validate_bags
from .grouping import group_gradient, link_rows, list_heads, sample_repeats, sorted_groups

UPDATE_PREFETCH = 32     # entries (or row groups) ahead whose rows and state the update prefetches
LINK_PREFETCH = 32       # entries ahead whose rows the linking pass prefetches
HASHED_MAX_DENSITY = 8   # hashed grouping while nnz * this <= rows (sparse batches); sorted beyond
SORTED_REPEATS = 0.2     # sorted grouping once this share of a sample repeats rows (skewed batches)
SORTED_MIN_NNZ = 8192    # below this many indices the hashed grouping always runs
LIST_REPEATS = 16        # gather the list heads first once more than 1 entry in this many repeats a row
PARALLEL_MIN_NNZ = 8192  # up to this many indices the hashed update runs on the calling thread
_LR, _EPS = 0.01, 1e-8   # what runners and searches time

# ----------------------------------------------------------------------------- hashed path


def _row_ops(exact):
    """(update a row, prefetch its state) of row-wise (state (R,)) or element-wise (exact: (R, D)) Adagrad."""
    return (adagrad_exact_row, prefetch_state_row) if exact else (adagrad_row, prefetch_state_entry)


@functools.lru_cache(maxsize=None)
def _walker(DC, PF, listed, exact=False):
    """The update loop for compile-time width DC (0: runtime D) and prefetch distance PF: over a
    list of heads (listed), or over the entries j0 <= j < j0 + len(heads) that head a list (heads
    then only gives the count). Copies for unscaled and scaled (per-sample weights or mean)
    entries, so the common one tests nothing per entry. target = (table, state); exact: the
    element-wise update."""
    update_row, prefetch_state = _row_ops(exact)

    @jit(inline="always")
    def loop(heads, j0, unit, scaled, bags, dout, lr, eps, target, scratch):
        indices, offsets, psw, mean, last = bags  # once: see entry_scale
        table, state = target
        nbags, n = dout.shape[0], indices.shape[0]
        D = DC if DC else dout.shape[1]
        nxt, ebag, head = scratch[4 * n:5 * n], scratch[5 * n:6 * n], scratch[6 * n:7 * n]
        acc = stack_f32(DC) if DC else np.empty((1, D), np.float32)
        one = np.float32(1.0)
        m = heads.shape[0]
        tail, stail = straddles(table, D * 4), straddles(state, D * 4)
        for i in range(m):
            if i + PF < m:  # rows are prefetched (the reads miss in DRAM); unlisted, a
                r = indices[heads[i + PF]] if listed else indices[j0 + i + PF]  # repeat's row at times
                prefetch_row(table, r, D * 4, tail, L2)
                prefetch_state(state, r, D * 4, stail)  # its Adagrad state: another miss per row otherwise
            j = heads[i] if listed else j0 + i
            if listed or head[j]:
                k = j
                for d in range(DC if DC else D):  # from +0.0, as grouping.group_gradient
                    acc[0, d] = 0.0
                while k >= 0:  # the list, in ascending position; most lists have one entry
                    b = k if unit else ebag[k]
                    sc = entry_scale(psw, k, mean, bag_size(offsets, b, nbags, n, last)) if scaled else one
                    madd_row(acc, 0, dout, b, sc, D, DC, False)
                    k = nxt[k]
                update_row(table, state, indices[j], acc, 0, lr, eps, D, DC)

    @jit(fastmath=frozenset())
    def walk(heads, j0, unit, bags, dout, lr, eps, target, scratch):
        if listed and (bags[3] or bags[2].shape[0] > 0):  # scaled entries are always listed (see _applier)
            loop(heads, j0, unit, True, bags, dout, lr, eps, target, scratch)
        elif listed or not unit:
            loop(heads, j0, unit, False, bags, dout, lr, eps, target, scratch)
        else:  # one-hot bags, unscaled: the common case, nothing tested per entry but the head
            loop(heads, j0, True, False, bags, dout, lr, eps, target, scratch)
    return walk


@functools.lru_cache(maxsize=None)
def _applier(DC, PF, exact=False):
    """apply(j0, j1, ...): update the rows whose first occurrence is in [j0, j1); shared by the
    serial and parallel kernels."""
    walk_listed = _walker(DC, PF, True, exact)
    walk_range = _walker(DC, PF, False, exact)

    @jit(fastmath=frozenset())  # strict IEEE: every path rounds identically
    def apply(j0, j1, unit, bags, dout, lr, eps, target, scratch):
        # walk the entries, testing each for a list head, or, when many repeat a row (the test then
        # mispredicts often), list the heads first. Scaled entries (per-sample weights, mean)
        # always take the listed walk: one loop copy fewer to compile. The walks are functions of
        # their own: inlined here or in a prange body they compiled into slower code, and slowly.
        n = bags[0].shape[0]
        scaled = bags[3] or bags[2].shape[0] > 0
        if scaled or ((j1 - j0) - scratch[6 * n + j0:6 * n + j1].sum()) * LIST_REPEATS > j1 - j0:
            walk_listed(list_heads(j0, j1, scratch, n), 0, unit, bags, dout, lr, eps, target, scratch)
        else:
            walk_range(scratch[j0:j1], j0, unit, bags, dout, lr, eps, target, scratch)
    return apply


def _hashed_kernel(apply):
    @jit(fastmath=frozenset())
    def hashed(bags, dout, lr, eps, target, scratch, nparts, link):
        # dout: (B, D) float32, target: (table (R, D) float32, state (R,) float32), scratch: (>= 7 nnz,)
        # int64, link: the linking pass's prefetch distance
        code, bad, value = validate_bags(bags, dout.shape[0], target[0].shape[0])
        if code:
            return code, bad, value
        unit = link_rows(bags, dout.shape[0], target[0], dout.shape[1] * 4, link, scratch)
        # lr arrives as a Python float: converting here costs less than np.float32() in the wrapper
        apply(0, bags[0].shape[0], unit, bags, dout, np.float32(lr), eps, target, scratch)
        return 0, 0, 0
    return hashed


def _hashed_parallel_kernel(apply):
    @jit(parallel=True, fastmath=frozenset())
    def hashed_parallel(bags, dout, lr, eps, target, scratch, nparts, link):
        # the entries cut into nparts position ranges, one per thread: a row is updated by the range
        # holding its first occurrence only, so no two threads touch one. Linking stays serial and
        # prefetches nothing: rows this core fetched would have to move to the core that updates them.
        code, bad, value = validate_bags(bags, dout.shape[0], target[0].shape[0])
        if code:
            return code, bad, value
        n = bags[0].shape[0]
        unit = link_rows(bags, dout.shape[0], target[0], 0, link, scratch)
        lr32 = np.float32(lr)
        for t in prange(nparts):
            apply(t * n // nparts, (t + 1) * n // nparts, unit, bags, dout, lr32, eps, target, scratch)
        return 0, 0, 0
    return hashed_parallel


# ----------------------------------------------------------------------------- sorted path


def _sorted_kernel(DC, PF, exact=False):
    update_row, prefetch_state = _row_ops(exact)

    @jit(parallel=True, fastmath=frozenset())
    def update(groups, dout, lr, eps, target):
        # groups: grouping.sorted_groups; part t (one thread's) owns the row groups parts[t]:parts[t+1]
        rows, group, parts = groups[0], groups[3], groups[4]
        table, state = target
        D = DC if DC else dout.shape[1]
        ngroups = group.shape[0] - 1
        tail, stail = straddles(table, D * 4), straddles(state, D * 4)
        lr32 = np.float32(lr)
        for t in prange(parts.shape[0] - 1):
            acc = stack_f32(DC) if DC else np.empty((1, D), np.float32)
            for g in range(parts[t], parts[t + 1]):
                if g + PF < ngroups:  # a hint only: may touch the next part's rows
                    prefetch_row(table, rows[group[g + PF]], D * 4, tail, L2)
                    prefetch_state(state, rows[group[g + PF]], D * 4, stail)
                group_gradient(acc, dout, groups, g, D, DC)
                update_row(table, state, rows[group[g]], acc, 0, lr32, eps, D, DC)
    return update


def build(spec, exact):
    """The kernel of spec's width, prefetch distance and path; exact: element-wise Adagrad."""
    DC, PF, path = spec["D"], spec["pf"], spec["path"]
    if path == "sorted":
        return _sorted_kernel(DC, PF, exact)
    apply = _applier(DC, PF, exact)
    return _hashed_parallel_kernel(apply) if path == "hashed-parallel" else _hashed_kernel(apply)


@kernel_factory("embedding_bag_adagrad")
def _adagrad_factory(spec):
    return build(spec, False)


def _update_path(nnz: int, num_rows: int, threads: int, repeats: float, min_nnz: int) -> str:
    """'hashed', 'hashed-parallel' or 'sorted' for an update of nnz indices into num_rows rows,
    `repeats` the share of a sample of them that repeats a row (grouping.sample_repeats), min_nnz
    the parallel knob's threshold.

    Hashed is faster than sorted up to ~1 index per HASHED_MAX_DENSITY rows; skewed batches sort
    better, since hashing walks their long lists entry by entry."""
    if nnz > SORTED_MIN_NNZ and (nnz * HASHED_MAX_DENSITY > num_rows or repeats >= SORTED_REPEATS):
        return "sorted"
    return "hashed-parallel" if threads > 1 and nnz > min_nnz else "hashed"


def _run(kernels, path, bags, nbags, dout, lr, eps, target, threads, link, table_name="weight"):
    """Run the update of one batch on `path` with kernels {path: kernel}."""
    w = target[0]
    if path == "sorted":
        groups = sorted_groups(bags, nbags, w.shape[0], table_name)
        if groups[3].shape[0] > 1 and w.shape[1]:
            kernels[path](groups, dout, lr, eps, target)
        return
    nnz = bags[0].shape[0]
    code, pos, val = kernels[path](bags, dout, lr, eps, target, scratch(nnz, 7), threads, link)
    if code:  # found before anything was written
        raise_bag_error(code, pos, val, table_name, w.shape[0], nnz)


# ----------------------------------------------------------------------------- knobs

_PATHS = ("hashed", "hashed-parallel", "sorted")


def _all_kernels(dim, distance, op="embedding_bag_adagrad"):
    return {path: get_kernel(KernelSpec.make(op, D=d_class(dim), pf=int(distance), path=path)) for path in _PATHS}


def _timed(problem, prefetch, parallel):
    """The update of the problem's batches with these choices, inputs built here (untimed)."""
    rows, dim, _, _, _, threads = problem
    target = (make_table(problem), np.zeros(rows, np.float32))
    batches, dout = draw_batches(problem)
    nnz = batches[0][0].shape[0]
    path = _update_path(nnz, rows, threads, 0.0, parallel["min_nnz"])  # uniform batches: no repeats
    kernels = _all_kernels(dim, prefetch["distance"])
    call = cycle([functools.partial(_run, kernels, path, bags, len(bags[1]), dout, _LR, _EPS, target, threads,
                                    int(prefetch["link"])) for bags in batches], batches)
    return call if path == "hashed" else on_threads(threads, call)


def _prefetch_candidates(problem, quick):
    if quick:  # the linking distance is a runtime argument: these compile nothing new
        return [{"distance": UPDATE_PREFETCH, "link": link} for link in (LINK_PREFETCH, 16, 64)]
    return [{"distance": d, "link": link} for d in (8, 16, 32, 64) for link in (8, 16, 32, 64)]


def _parallel_search(problem, quick, timer):
    """Time the hashed update on one thread and in `threads` position ranges at a few batch sizes;
    serial up to the last size before the parallel one wins."""
    rows, dim, pooling, _, _, threads = problem
    if threads == 1:  # nothing to time: the hashed update takes one thread
        return PARALLEL.heuristic(problem)
    target = (make_table(problem), np.zeros(rows, np.float32))
    prefetch = PREFETCH.choose(problem)
    kernels = _all_kernels(dim, prefetch["distance"])

    def run(nbags, parallel):
        batches, dout = draw_batches(problem, nbags)
        path = "hashed-parallel" if parallel else "hashed"
        return cycle([functools.partial(_run, kernels, path, bags, nbags, dout, _LR, _EPS, target, threads,
                                        int(prefetch["link"])) for bags in batches], batches)

    sizes = (64, 512, 4096) if quick else (16, 64, 256, 1024, 4096, 16384)
    with numba_threads(threads):
        last, first = crossover(timer, sizes, run)
    if first is None:
        return {"min_nnz": NEVER}
    return {"min_nnz": 0 if last is None else last * pooling}


PREFETCH = knob("embedding.update.prefetch.adagrad",
                doc="entries the row-wise Adagrad prefetches ahead: in its update and in its linking pass",
                heuristic=lambda p: {"distance": UPDATE_PREFETCH, "link": LINK_PREFETCH},
                shape_class=shape_class, quick_class=quick_class,
                problems=lambda w: problems(w, itemsizes=(4,)), candidates=_prefetch_candidates,
                runner=lambda p, params: _timed(p, params, PARALLEL.choose(p)))
PARALLEL = knob("embedding.parallel.adagrad", doc="indices up to which the hashed Adagrad runs on the calling thread",
                heuristic=lambda p: {"min_nnz": PARALLEL_MIN_NNZ}, shape_class=shape_class, quick_class=quick_class,
                problems=lambda w: problems(w, itemsizes=(4,)), search=_parallel_search)


# ----------------------------------------------------------------------------- op

_KERNELS: dict = {}  # as forward._KERNELS


def _kernels(rows, dim, threads, nnz, nbags, op="embedding_bag_adagrad"):
    """(parallel threshold, linking distance, {path: kernel}) of a table at a thread count,
    memoised as forward._kernels; op: the kernels' (element-wise Adagrad's shares the knobs)."""
    token = (choice_token(), tunedb.generation())
    key = (rows, dim, threads, op)
    got = _KERNELS.get(key)
    if got is None or got[0] != token:
        problem = call_problem(rows, dim, nnz, nbags, 4, threads)
        prefetch = PREFETCH.choose(problem)
        got = _KERNELS[key] = (token, (PARALLEL.choose(problem)["min_nnz"], int(prefetch["link"]),
                                       _all_kernels(dim, prefetch["distance"], op)))
    return got[1]


def embedding_bag_adagrad_(weight, state, indices, offsets, dout, lr, eps=1e-8, *, mode="sum",
                           per_sample_weights=None, include_last_offset=False):
    """In place, fused row-wise Adagrad; weight: (R, D), state: (R,) float32. Returns weight."""
    w, _ = check_table(weight, writeable=True, bf16_ok=False)
    R, D = w.shape
    state = float_array("state", state, shape=(R,), copy=False, writeable=True)
    lr = finite("lr", lr)
    eps = finite("eps", eps, minimum=0.0, dtype=np.float64)  # applied in float64
    bags, nbags = check_bag_args(indices, offsets, mode, per_sample_weights, include_last_offset)
    dout = float_array("dout", dout, shape=(nbags, D))
    # the update writes rows and state while it reads dout and the per-sample weights
    no_overlap("state", state, w, what="weight")
    no_overlap("dout", dout, w, state, what="weight or state (the arrays the update writes)")
    no_overlap("per_sample_weights", bags[2], w, state, what="weight or state (the arrays the update writes)")
    update(bags, nbags, dout, lr, eps, (w, state))
    return weight


def update(bags, nbags, dout, lr, eps, target, op="embedding_bag_adagrad"):
    """The checked update of target = (table, state) by op's kernels, on the path the batch calls for."""
    w = target[0]
    R, D = w.shape
    nnz = bags[0].shape[0]
    check_sparse_sizes(R, nnz)
    threads = num_threads()
    min_nnz, link, kernels = _kernels(R, D, threads, nnz, nbags, op)
    sample = sample_repeats(bags[0], scratch(nnz, 7)) if nnz > SORTED_MIN_NNZ else 0.0
    _run(kernels, _update_path(nnz, R, threads, sample, min_nnz), bags, nbags, dout, lr, eps, target, threads, link)
