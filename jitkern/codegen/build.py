"""Spec -> compiled kernel: the one door through which every op gets its code.

An op module registers a factory per op name with `@kernel_factory("op")`; the factory reads
the spec's parameters and returns an njit function whose block sizes, epilogue, width etc. are
closure constants, so LLVM sees them as literals. `get_kernel(spec)` memoises per process, and
numba's on-disk cache (keyed on the closure constants) lets a second process skip compilation.
"""
from __future__ import annotations

import functools
import logging
import time
from typing import Callable

import numba
import numpy as np

from ..config import debug_level, get_config
from . import cache
from .spec import KernelSpec

log = logging.getLogger("jitkern")

# IEEE-preserving fast-math: allow FMA contraction and reassociation (vectorised reductions),
# but keep NaN/inf semantics so bad data propagates instead of being optimised away.
FASTMATH = frozenset({"contract", "reassoc", "nsz"})

_FACTORIES: dict[str, Callable[[KernelSpec], Callable]] = {}


def _first_num_threads() -> int:
    """numba.get_num_threads(), which launches the threading layer; its C getter serves from then on."""
    global _get_threads
    from numba.np.ufunc import parallel
    n = numba.get_num_threads()
    _get_threads = getattr(parallel, "_get_num_threads", numba.get_num_threads)
    return n


_get_threads = _first_num_threads


def num_threads() -> int:
    """numba.get_num_threads() (this thread's setting), through the threading layer's C getter: the
    public call takes a process lock each time (~0.65 us), a share of every small op's call."""
    return _get_threads()


def kernel_factory(op: str):
    """Register `factory(spec) -> njit function` as the builder for `op`."""
    def register(factory):
        if op in _FACTORIES and _FACTORIES[op] is not factory:
            raise ValueError(f"a kernel factory for {op!r} is already registered")
        _FACTORIES[op] = factory
        return factory
    return register


def jit(*, parallel: bool = False, fastmath=FASTMATH, inline: str = "never", nrt: bool = True):
    """numba.njit with jitkern's defaults: on-disk cache (unless disabled; stamped by every kernel
    source file, see cache.py), nogil, no bounds checks. nrt=False compiles without numba's
    runtime: the function may allocate nothing, and its loops then carry no reference counts
    (atomic calls numba emits for arrays handed to inlined helpers, which it does not always
    prune)."""
    cache.install()
    disk = get_config().disk_cache
    extra = {} if nrt else {"_nrt": False}
    decorate = numba.njit(cache=disk, parallel=parallel, fastmath=set(fastmath), nogil=True,
                          error_model="numpy", boundscheck=False, inline=inline, **extra)

    def build(fn):
        setattr(fn, cache.JIT_MARK, True)  # stamped by jitkern's sources wherever it is defined
        disp = decorate(fn)
        if disk:
            disp._cache = cache.StableKeyCache(disp.py_func)
        return disp
    return build


@jit(inline="always")
def uidx(i):
    """An index as unsigned: numba then skips the negative-index wraparound, whose selects turn
    contiguous copy loops into gathers and scatters and cost a shift, an and and an add per load."""
    return np.uint64(i)


def setup_logging() -> None:
    """Send jitkern's log to stderr when JITKERN_DEBUG is set (idempotent)."""
    level = get_config().debug
    if level > 0 and not log.handlers:
        h = logging.StreamHandler()
        h.setFormatter(logging.Formatter("[jitkern] %(message)s"))
        log.addHandler(h)
        log.setLevel(logging.DEBUG)


class _Logged:
    """Debug-only wrapper: reports on first call whether numba compiled or loaded from disk."""

    def __init__(self, spec: KernelSpec, disp):
        self.spec, self.disp, self.calls = spec, disp, 0

    def __call__(self, *args):
        t0 = time.perf_counter()
        out = self.disp(*args)
        dt = time.perf_counter() - t0
        self.calls += 1
        if self.calls == 1:
            hits = sum(self.disp.stats.cache_hits.values())
            how = "loaded from disk cache" if hits else "compiled"
            log.debug("%s: %s in %.3f s", self.spec, how, dt)
        elif get_config().debug >= 2:
            log.debug("%s: %.3f ms", self.spec, dt * 1e3)
        return out

    def __getattr__(self, name):
        return getattr(self.disp, name)


@functools.lru_cache(maxsize=None)
def _build(spec: KernelSpec):
    try:
        factory = _FACTORIES[spec.op]
    except KeyError:
        raise KeyError(f"no kernel factory registered for op {spec.op!r}") from None
    return factory(spec)


def get_kernel(spec: KernelSpec):
    """The compiled kernel for `spec` (memoised; compiled lazily at first call)."""
    if not debug_level():  # the hot path: one environment lookup
        return _build(spec)
    setup_logging()
    before = _build.cache_info().hits
    disp = _build(spec)
    if _build.cache_info().hits > before:
        log.debug("%s: in-process cache hit", spec)
    else:
        log.debug("%s: chosen", spec)
    return _Logged(spec, disp)
