"""Feature interaction: dot (pairwise dots of the F = T+1 vectors) and cat, forward and backward.

The dot kernels (ops/interaction_kernel.py) work on one sample at a time; here: argument checks,
the views they read in place, the split of the batch over threads (bit-identical for any thread
count), and the per-CPU knobs: W (`interaction.lanes`: 16 on every vector ISA by default, i.e. one
zmm, two ymm or four NEON registers; 1 for JITKERN_ISA=scalar), the forward's scheme
(`interaction.forward`), how many samples ahead rows are hinted (`interaction.prefetch`) and the
fewest samples per thread (`interaction.parallel`). Kernels take F and D as literals for the DLRM shapes (_SPECIALISED) and
read them from the arguments otherwise: one generic kernel serves any shape.
"""
from __future__ import annotations

import functools
import os
import weakref
from concurrent.futures import ThreadPoolExecutor

import numba
import numpy as np
from numba import literal_unroll

from ..codegen import KernelSpec, get_kernel, host_target, jit, num_threads
from ..codegen.knobs import knob, memo_choices, pow2_class
from ..codegen.vec import addr_of
from . import _check, interaction_kernel  # noqa: F401  (registers the dot kernels' factories)
from .bf16 import BF16Array
from .workspace import LINE, staggered_blocks

# (F, D) classes the DLRM benchmarks and models use get kernels with F and D as literals
_SPECIALISED = {(27, 16), (27, 64), (27, 128), (9, 64)}


# --------------------------------------------------------------------------- arguments and dispatch


def _element(name, a, bf16, ndim):
    """An input array as the kernels read it: float32, or the uint16 bits of a BF16Array (no copy)."""
    if bf16:
        if not isinstance(a, BF16Array) or a.ndim != ndim:
            _check.bf16_array(name, a, ndim=ndim)  # raises, naming the element
        return a.bits
    if not isinstance(a, np.ndarray) or a.dtype != np.float32 or a.ndim != ndim:
        _check.float_array(name, a, ndim=ndim)  # raises, naming the element
    return a


def _features(x, ly, bf16_ok=True):
    """Validate x (B, D) and ly ((B, T, D) or T x (B, D)) -> x, keep-alive list, addrs, stride, T.

    The kernels read feature t of sample b at byte address addrs[t] + itemsize * b * stride, so a
    list whose arrays share one row stride (separate (B, D) arrays, or column blocks of one (B, T*D)
    array) is read in place, without stacking. x and ly are all float32 or (bf16_ok) all BF16Array;
    x is returned as an array of float32 values or bf16 bits.
    """
    bf16 = bf16_ok and isinstance(x, BF16Array)
    x = _check.bf16_array("x", x, ndim=2) if bf16 else _check.float_array("x", x, ndim=2)
    B, D = x.shape
    item = x.itemsize
    if isinstance(ly, (list, tuple)):
        if ly and not bf16 and all(type(a) is np.ndarray and a.dtype == x.dtype and a.ndim == 2 for a in ly):
            addrs, row = _uniform_rows(tuple(ly), B, D)
            if row > 0:  # every element (B, D), one row stride, unit element stride: read in place
                return x, ly, addrs, (row // item if B > 1 else D), len(ly)
        parts = []
        for t, a in enumerate(ly):
            a = _element(f"ly[{t}]", a, bf16, 2)
            if a.shape != (B, D):
                raise ValueError(f"ly[{t}] must have shape (B, D) = {(B, D)} like x, got {a.shape}")
            parts.append(a)
        rows = {a.strides[0] for a in parts}
        if len(rows) != 1 or any(a.strides[1] != item for a in parts) or min(rows) <= 0 or min(rows) % item:
            parts = [np.ascontiguousarray(a) for a in parts]
            rows = {item * D}
        addrs = np.array([a.ctypes.data for a in parts], np.int64)
        return x, parts, addrs, (rows.pop() // item if B > 1 else D), len(parts)
    ly = _check.bf16_array("ly", ly, ndim=3) if bf16 else _check.float_array("ly", ly, ndim=3)
    if ly.shape[0] != B or ly.shape[2] != D:
        raise ValueError(f"ly must have shape (B, T, D) with B, D = {B}, {D} from x, got {ly.shape}")
    T = ly.shape[1]
    addrs = ly.ctypes.data + item * D * np.arange(T, dtype=np.int64)
    return x, [ly], addrs, T * D, T


@jit()
def _uniform_rows(parts, B, D):
    """(byte address of each 2-D array of the tuple, their common row stride in bytes) if every one
    is (B, D) with unit element stride and all share one positive row stride, else (addresses, -1).
    One compiled call in place of a ctypes lookup per array (~1.3 us each, 26 a call in a DLRM); it
    compiles once per tuple length and mix of layouts (~0.5-1 s, then from numba's disk cache)."""
    addrs = np.empty(len(parts), np.int64)
    row = parts[0].strides[0]
    ok = row > 0 and row % parts[0].itemsize == 0
    t = 0
    for a in literal_unroll(parts):  # any mix of layouts: the tables' views need not share one
        addrs[t] = addr_of(a)
        ok = ok and a.shape[0] == B and a.shape[1] == D and a.strides[1] == a.itemsize and a.strides[0] == row
        t += 1
    return addrs, row if ok else -1


@functools.lru_cache(maxsize=None)
def _pool(workers, pid):
    # keyed by pid: a forked child must not submit to its parent's (absent) worker threads
    return ThreadPoolExecutor(workers, thread_name_prefix="jitkern-interaction")


def _over_batch(kernel, B, n, *args):
    """kernel(b0, b1, *args) on n contiguous batch slices, one per thread (kernels are nogil).

    Every sample is computed by the same code whatever the split, so results are bit-identical
    for any thread count. Serial kernels driven from Python threads compile faster than numba
    parfors, which keeps the per-shape-class compile cost low.
    """
    if n == 1:
        kernel(0, B, *args)
        return
    cuts = [B * k // n for k in range(n + 1)]
    futures = [_pool(n - 1, os.getpid()).submit(kernel, cuts[k], cuts[k + 1], *args) for k in range(1, n)]
    kernel(0, cuts[1], *args)
    for f in futures:
        f.result()


def _spec(op, F, D, W, ahead):
    F_, D_ = (F, D) if (F, D) in _SPECIALISED else (0, 0)
    return KernelSpec.make(op, F=F_, D=D_, W=W, ahead=ahead)


@memo_choices
def _chosen(op, B, F, D, threads):
    """(kernel, batch slices) of op for this call shape: at a small batch the choosing costs more
    than the kernel, and the DLRM asks twice a step."""
    n = 1
    if threads > 1:
        n = max(1, min(threads, B // PARALLEL.choose((B, F, D, threads))["min_per_thread"]))
    return get_kernel(_kernel_spec(op, (B, F, D))), n


def _kernel_spec(op, problem, *, ahead=None, scheme=None, lanes=None):
    """The spec of op's kernel for problem (B, F, D): the knobs' choices, but the ahead / scheme /
    lanes given."""
    B, F, D = problem
    ahead = PREFETCH.choose(problem)["ahead"] if ahead is None else ahead
    if op == "interaction_dot_forward" and (scheme or FORWARD.choose(problem)["scheme"]) == "pairs":
        return _pairs_spec(F, ahead)
    return _spec(op, F, D, LANES.choose(problem)["lanes"] if lanes is None else lanes, ahead)


def _pairs_spec(F, ahead):
    # the pairs kernel reads D from its arguments (interaction_kernel: a literal D spills its tile)
    literal = any(f == F for f, _ in _SPECIALISED)
    return KernelSpec.make("interaction_dot_forward_pairs", F=F if literal else 0, W=host_target().vector_width,
                           ahead=ahead)


def _run(op, B, F, D, *args):
    """op's kernel for F features of width D, over the batch, with the lanes and thread split the
    knobs choose."""
    kernel, n = _chosen(op, B, F, D, num_threads())
    _over_batch(kernel, B, n, *args)


# --------------------------------------------------------------------------- knobs


def _example(B, F, D):
    """Inputs of a (B, F, D) dot interaction: x (B, D), ly as F - 1 (B, D) arrays, dz (B, D + P)."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((B, D), dtype=np.float32)
    ly = [rng.standard_normal((B, D), dtype=np.float32) for _ in range(F - 1)]
    return x, ly, rng.standard_normal((B, D + num_pairs(F)), dtype=np.float32)


def _dot_pass(B, F, D, W):
    """fn(n): forward then backward of an example (B, F, D) interaction with W lanes, split over n
    threads (inputs and outputs built here, outside the timed calls)."""
    x, ly, dz = _example(B, F, D)
    x, keep, addrs, stride, _ = _features(x, ly)
    z = np.empty((B, D + num_pairs(F)), np.float32)
    dx, dly = np.empty((B, D), np.float32), np.empty((F - 1, B, D), np.float32)
    fwd = get_kernel(_kernel_spec("interaction_dot_forward", (B, F, D), scheme="transpose", lanes=W))
    bwd = get_kernel(_kernel_spec("interaction_dot_backward", (B, F, D), lanes=W))

    def run(n, keep=keep):
        _over_batch(fwd, B, n, x, addrs, stride, 0, z)
        _over_batch(bwd, B, n, dz, x, addrs, stride, 0, dx, dly)
    return run


def _lanes_heuristic(problem):
    # 16 lanes on every vector ISA: on AVX2 (2 x 8) and NEON (4 x 4) LLVM splits each value into
    # registers, so the 4-row tile keeps 8 / 16 independent FMA chains, enough to hide latency
    vw = host_target().vector_width
    return {"lanes": 1 if vw == 1 else max(16, vw)}


def _lanes_runner(problem, params):
    run = _dot_pass(*problem, params["lanes"])
    return lambda: run(1)


LANES = knob("interaction.lanes", doc="vector lanes of the dot interaction kernels (native width or 16)",
             heuristic=_lanes_heuristic, shape_class=lambda p: pow2_class(*p[1:]),
             problems=lambda w: w.interactions,
             candidates=lambda p, quick: [{"lanes": w} for w in sorted({host_target().vector_width, 16})],
             runner=_lanes_runner)


def _forward_heuristic(problem):
    # pairs where a row spans 4 vectors or more: measured on Zen 3 (AVX2), F = 27, it takes 0.75x
    # the transposed scheme's time at D = 64 and 128 and 1.0x at D = 16 (two vectors per row)
    B, F, D = problem
    vw = host_target().vector_width
    return {"scheme": "pairs" if vw > 1 and D >= 4 * vw else "transpose"}


def _forward_runner(problem, params):
    B, F, D = problem
    x, ly, _ = _example(B, F, D)
    x, keep, addrs, stride, _ = _features(x, ly)
    z = np.empty((B, D + num_pairs(F)), np.float32)
    kernel = get_kernel(_kernel_spec("interaction_dot_forward", problem, scheme=params["scheme"]))
    return lambda keep=keep: kernel(0, B, x, addrs, stride, 0, z)


FORWARD = knob("interaction.forward", doc="the dot interaction's forward scheme: 4 x W blocks of the transposed "
               "sample, or 3 x 4 tiles of row-pair dot products (pairs)",
               heuristic=_forward_heuristic, shape_class=lambda p: pow2_class(*p[1:]),
               problems=lambda w: w.interactions,
               candidates=lambda p, quick: [{"scheme": "transpose"}] + ([{"scheme": "pairs"}] if host_target().vector_width > 1 else []),
               runner=_forward_runner)

def _prefetch_heuristic(problem):
    # hints where a sample's row is one line: each table's stream then advances a line a sample,
    # too slowly for the hardware streamer (Zen 4, kaggle's D = 16: the step's interaction 3.6 ->
    # 3.3 ms). Rows of several lines it follows, and 27 hints a line only cost (Zen 3, D = 64 and
    # 128: 10-15% slower with them)
    B, F, D = problem
    return {"ahead": 2 if 4 * D <= LINE else 0}


class _Sets(list):
    """Input sets of one problem, shared by its candidates' runners with one position: a candidate
    timed next takes the next sets, never the ones the previous candidate just cached."""
    __slots__ = ("at", "__weakref__")


_SETS = weakref.WeakValueDictionary()  # problem -> _Sets some runner still holds


def _input_sets(problem):
    """Enough (x, ly keep-alive, addrs, stride, dz, (z, dx, dly)) sets of a (B, F, D) interaction to
    fill twice the last-level cache, every page written (no page faults in timed calls)."""
    sets = _SETS.get(problem)
    if sets is None:
        B, F, D = problem
        P = num_pairs(F)
        per_set = 4 * B * (2 * F * D + 2 * (D + P))
        sets = _SETS[problem] = _Sets()
        sets.at = 0
        for _ in range(max(2, -(-2 * host_target().l3 // per_set))):
            ly = staggered_blocks(F - 1, (B, D))
            ly[...] = 0.25
            x, keep, addrs, stride, _ = _features(np.full((B, D), 0.5, np.float32), list(ly))
            out = (np.full((B, D + P), 0.0, np.float32), np.full((B, D), 0.0, np.float32),
                   np.full((F - 1, B, D), 0.0, np.float32))
            sets.append((x, keep, addrs, stride, np.full((B, D + P), 0.125, np.float32), out))
    return sets


def _cold_runner(problem, params):
    """fn(): forward then backward of a (B, F, D) interaction with rows hinted params["ahead"] samples
    on, each call on the next input set (_input_sets), so that every call finds its operands in
    DRAM as a training step's interaction does."""
    B = problem[0]
    sets = _input_sets(problem)
    fwd = get_kernel(_kernel_spec("interaction_dot_forward", problem, ahead=params["ahead"]))
    bwd = get_kernel(_kernel_spec("interaction_dot_backward", problem, ahead=params["ahead"]))

    def run(sets=sets):
        x, _, addrs, stride, dz, (z, dx, dly) = sets[sets.at]
        sets.at = (sets.at + 1) % len(sets)
        fwd(0, B, x, addrs, stride, 0, z)
        bwd(0, B, dz, x, addrs, stride, 0, dx, dly)
    return run


PREFETCH = knob("interaction.prefetch", doc="samples ahead whose rows the dot interaction kernels hint into L2 (0: none)",
                heuristic=_prefetch_heuristic, shape_class=lambda p: pow2_class(*p[1:]),
                problems=lambda w: w.interactions,
                candidates=lambda p, quick: [{"ahead": a} for a in ((0, 2) if quick else (0, 1, 2, 4))],
                runner=_cold_runner)

_MIN_PER_THREAD = 32  # fewest samples worth handing to another thread: a hand-off costs tens of us
_PER_THREAD = (8, 16, 32, 64, 128, 256)  # samples per thread the search tries


def _parallel_search(problem, quick, timer):
    """The fewest samples per thread at which two threads beat one on twice that many samples."""
    B, F, D, threads = problem
    if min(threads, numba.config.NUMBA_NUM_THREADS) < 2:
        return {"min_per_thread": _MIN_PER_THREAD}  # one thread: nothing to split
    W = LANES.choose((B, F, D))["lanes"]
    for per in _PER_THREAD[1:-1] if quick else _PER_THREAD:
        run = _dot_pass(2 * per, F, D, W)
        if timer(lambda: run(2)) < timer(lambda: run(1)):
            return {"min_per_thread": per}
    return {"min_per_thread": 2 * _PER_THREAD[-1]}


PARALLEL = knob("interaction.parallel", doc="fewest samples per thread of the interaction kernels",
                heuristic=lambda p: {"min_per_thread": _MIN_PER_THREAD},
                shape_class=lambda p: f"{pow2_class(*p[1:3])}t{p[3]}",
                problems=lambda w: ((*i, t) for i in w.interactions for t in w.threads),
                search=_parallel_search)


# --------------------------------------------------------------------------- public wrappers


def num_pairs(num_features, self_interaction=False):
    """P: the number of pairwise dots of num_features vectors (with the diagonal if self_interaction)."""
    return num_features * (num_features + (1 if self_interaction else -1)) // 2


def interaction_dot_forward(x, ly, *, self_interaction=False, out_dtype=None):
    """z = [x, lower-triangle dots of [x, ly_0..]]; x: (B, D), ly: (B, T, D) or T x (B, D) -> (B, D + P).

    Pairs (i, j), j < i (j <= i with self_interaction), i ascending then j ascending, as the
    reference DLRM; only the triangle is computed and written. x and ly float32, or all BF16Array
    (widened, dots accumulated in fp32); z float32, or a BF16Array with out_dtype="bfloat16".
    """
    bf16_out = _check.choice("out_dtype", out_dtype, (None, "float32", "bfloat16")) == "bfloat16"
    x, keep, addrs, stride, T = _features(x, ly)
    B, D = x.shape
    z = np.empty((B, D + num_pairs(T + 1, self_interaction)), np.uint16 if bf16_out else np.float32)
    _run("interaction_dot_forward", B, T + 1, D, x, addrs, stride, int(bool(self_interaction)), z)
    del keep  # the arrays addrs points into: alive until the kernels are done
    return BF16Array(z) if bf16_out else z


def interaction_dot_backward(dz, x, ly, *, self_interaction=False):
    """Gradients of interaction_dot_forward: dz (B, D + P) float32 or BF16Array -> dx (B, D), dly (B, T, D)
    float32 (a view of a (T, B, D) array)."""
    x, keep, addrs, stride, T = _features(x, ly)
    B, D = x.shape
    dz = _check.bf16_array("dz", dz, ndim=2) if isinstance(dz, BF16Array) else _check.float_array("dz", dz, ndim=2)
    want = (B, D + num_pairs(T + 1, self_interaction))
    if dz.shape != want:
        raise ValueError(f"dz must have shape (B, D + P) = {want}, got {dz.shape}")
    dx = np.empty((B, D), np.float32)
    dly = np.empty((T, B, D), np.float32)  # returned as a (B, T, D) view: dly[:, t] is contiguous, so
    #                                        the per-table embedding updates take it without a copy
    _run("interaction_dot_backward", B, T + 1, D, dz, x, addrs, stride, int(bool(self_interaction)), dx, dly)
    del keep  # the arrays addrs points into: alive until the kernels are done
    return dx, dly.transpose(1, 0, 2)


def interaction_cat_forward(x, ly):
    """z = [x, ly_0, ..., ly_{T-1}] per sample; x: (B, D), ly: (B, T, D) or T x (B, D) -> (B, D * (T + 1)).

    float32 inputs give a float32 z; BF16Array inputs a BF16Array z (their bits, copied exactly).
    """
    bf16 = isinstance(x, BF16Array)
    x, keep, _, _, T = _features(x, ly)
    B, D = x.shape
    z = np.empty((B, T + 1, D), x.dtype)
    z[:, 0] = x
    if isinstance(ly, (list, tuple)):
        for t, a in enumerate(keep):
            z[:, t + 1] = a
    else:
        z[:, 1:] = keep[0]
    z = z.reshape(B, (T + 1) * D)
    return BF16Array(z) if bf16 else z


def interaction_cat_backward(dz, x, ly):
    """Gradients of interaction_cat_forward: dz (B, D * (T + 1)) float32 or BF16Array -> dx (B, D),
    dly (B, T, D) float32 (x and ly give only the shapes: float32 or BF16Array)."""
    x, _, _, _, T = _features(x, ly)
    B, D = x.shape
    if isinstance(dz, BF16Array):
        _check.bf16_array("dz", dz, ndim=2)
        dz = dz.to_float32()
    else:
        dz = _check.float_array("dz", dz, ndim=2)
    if dz.shape != (B, D * (T + 1)):
        raise ValueError(f"dz must have shape (B, D * (T + 1)) = {(B, D * (T + 1))}, got {dz.shape}")
    dz = dz.reshape(B, T + 1, D)
    return dz[:, 0].copy(), dz[:, 1:].copy()
