"""Per-CPU knobs: every choice that depends on the CPU, declared once, next to its kernel.

A knob names a choice (GEMM blocks of one op variant, an embedding prefetch distance, a work
threshold for going parallel, ...). Its declaration says, for a *problem* (a small hashable
tuple the op module defines, e.g. (m, n, k, threads)):

- `heuristic(problem) -> params`: the choice without a tuning entry, from the target's caches
  and vector width (codegen.target.host_target());
- `candidates(problem, quick) -> [params]`: what the tuner times;
- `shape_class(problem) -> str`: which tuned entry serves the problem (similar shapes share one);
- `problems(workload) -> [problem]`: the problems a workload (the shapes a model runs) poses;
- `runner(problem, params) -> fn()`: a callable running the kernel with that choice, inputs
  built outside it, for the tuner to time;
- or, instead of candidates + runner, `search(problem, quick, timer) -> params` for choices
  found by a search of their own (the work at which threads start to pay);
- optionally `quick_class(problem) -> str`: a coarser grouping for the quick tune, which times
  one problem per quick class and stores its choice for every shape class in it.

`choose(problem)` is what a kernel wrapper calls: the tuned entry for its shape class if one
exists (tuning DB, codegen/tunedb.py), else the heuristic; memoised per problem and per
setting of the knobs the choice depends on (JITKERN_ISA, JITKERN_CACHE_SIZES, the DB).
The tuner (codegen/tune.py) enumerates `registered()`: it imports no op; the ops register
their knobs when imported.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable, Iterable

import numba

from ..config import choice_token
from . import tunedb

_REGISTRY: dict[str, "Knob"] = {}


@dataclass(frozen=True)
class Workload:
    """The shapes a model runs, in op-neutral terms: what the tuner tunes for.

    linears: (batch, in, out) of each fully connected layer (forward and backward are derived);
    tables: (rows, dim, pooling, batch, itemsize) of each embedding table;
    interactions: (batch, features, dim) of each feature interaction;
    threads: the thread counts the model runs with;
    precisions: the GEMM precisions its linear layers run in ("fp32", "bf16").
    """
    linears: tuple = ()
    tables: tuple = ()
    interactions: tuple = ()
    threads: tuple = (1,)
    precisions: tuple = ("fp32",)

    def merged(self, other: "Workload") -> "Workload":
        def union(a, b):
            return tuple(dict.fromkeys(tuple(a) + tuple(b)))
        return Workload(union(self.linears, other.linears), union(self.tables, other.tables),
                        union(self.interactions, other.interactions), union(self.threads, other.threads),
                        union(self.precisions, other.precisions))


@dataclass(eq=False)
class Knob:
    name: str
    heuristic: Callable
    shape_class: Callable
    problems: Callable[[Workload], Iterable]
    candidates: Callable | None = None
    runner: Callable | None = None
    search: Callable | None = None
    doc: str = ""
    quick_class: Callable | None = None
    _memo: dict = field(default_factory=dict, repr=False)

    def __post_init__(self):
        if self.search is None and (self.candidates is None or self.runner is None):
            raise ValueError(f"knob {self.name!r} needs candidates and runner, or search")

    def tuned(self, problem) -> dict | None:
        """The tuning DB's entry for problem's shape class (None: none, or tuning disabled)."""
        return tunedb.lookup(self.name, self.shape_class(problem))

    def choose(self, problem) -> dict:
        """The params to run `problem` with: tuned if the DB has them, else the heuristic."""
        key = (problem, choice_token(), tunedb.generation())
        got = self._memo.get(key)
        if got is None:
            if len(self._memo) > 4096:
                self._memo.clear()
            got = self.tuned(problem) or dict(self.heuristic(problem))
            self._memo[key] = got
        return got


def knob(name: str, *, heuristic, shape_class, problems, candidates=None, runner=None, search=None,
         doc: str = "", quick_class=None) -> Knob:
    """Declare (register) a knob; re-declaring the same name replaces it (module reloads)."""
    k = Knob(name, heuristic, shape_class, problems, candidates, runner, search, doc, quick_class)
    _REGISTRY[name] = k
    return k


def registered() -> dict[str, Knob]:
    """name -> Knob of every declared knob (the op modules imported so far)."""
    return dict(_REGISTRY)


def get(name: str) -> Knob:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(f"no knob named {name!r}; declared: {sorted(_REGISTRY)}") from None


def memo_choices(fn):
    """fn(*key) memoised per key, configuration (choice_token) and tuning-DB generation: for what
    an op derives from knob choices on every call (blocks, a kernel), so a tuned or forced choice
    takes effect at once while the calls between pay a dict lookup. Bounded: cleared at 4096."""
    memo: dict = {}

    def chosen(*key):
        full = (key, choice_token(), tunedb.generation())
        got = memo.get(full)
        if got is None:
            if len(memo) > 4096:
                memo.clear()
            got = memo[full] = fn(*key)
        return got
    chosen.cache_clear = memo.clear
    return chosen


def pow2_class(*dims: int) -> str:
    """Bucket dims to powers of two ("2048x1024x16"): one tuned entry serves similar shapes."""
    return "x".join(str(1 << max(0, int(d) - 1).bit_length()) for d in dims)


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
    """`call` run with `threads` numba threads: a runner's timed callable times the problem's thread
    count, not whatever numba is set to (a one-thread entry timed on two favours split blocks)."""
    def run():
        with numba_threads(threads):
            return call()
    return run
