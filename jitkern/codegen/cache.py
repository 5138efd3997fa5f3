"""numba's on-disk cache, made safe and effective for kernels built from helpers in several modules.

- Stale code: numba stamps a cached function with its own source file only, so a kernel in
  ops/embedding/adagrad.py that inlines `prefetch_row` from ops/embedding/_rows.py would keep its
  old machine code when only _rows.py changed. For jitkern's functions the stamp is the hash of every
  source file kernels draw code from (ops/ and codegen/) plus the function's own file: editing
  any of them recompiles what could depend on it (more compiling while jitkern itself is being
  edited, none for an installed copy). So is every function decorated with codegen.jit elsewhere
  (a user's or a test's kernel inlining jitkern's intrinsics). `install()` puts these locators first (idempotent).
- Missed entries: numba keys a closure on the pickled values of its cells, and a dispatcher
  pickles with a per-process uuid, so every factory kernel that calls another compiled closure
  (the embedding forward and updates) was compiled afresh in every process. `StableKeyCache`
  describes such cells by module, name, bytecode and (recursively) closure instead.
- Symbol clashes: a compiled function's symbol carries numba's per-process function id, counted
  from 1 in every process. Two variants of one factory closure (same qualname), compiled by
  different processes (MPI ranks, earlier runs), could get the same symbol; once both were loaded
  from the cache into one process, calls bound to whichever same-named (linkonce_odr) definition
  came first: another variant's code, writing rows of the wrong width. `install()` starts the
  count at a random 62-bit point per process, so symbols from different processes never meet.
"""
from __future__ import annotations

import functools
import hashlib
import itertools
import secrets
from pathlib import Path

from numba.core import caching
from numba.core.bytecode import FunctionIdentity
from numba.core.dispatcher import Dispatcher
from numba.core.serialize import dumps

PACKAGE = Path(__file__).resolve().parent.parent       # jitkern/
KERNEL_SOURCES = ("ops", "codegen")                    # where kernels and their inlined helpers live


@functools.lru_cache(maxsize=None)
def _kernel_sources(package: Path) -> bytes:
    h = hashlib.sha256()
    for p in sorted(p for sub in KERNEL_SOURCES for p in (package / sub).rglob("*.py")):
        h.update(str(p.relative_to(package)).encode())
        h.update(p.read_bytes())
    return h.digest()


def source_stamp(package: Path = PACKAGE, own_file: str = "") -> bytes:
    """sha256 over the kernel source files under `package` (ops/, codegen/) and `own_file`."""
    h = hashlib.sha256(_kernel_sources(package))
    if own_file:
        h.update(Path(own_file).read_bytes())
    return h.digest()


JIT_MARK = "_jitkern_jit"  # set by codegen.jit: functions outside the package that may inline its helpers


def _ours(py_file) -> bool:
    try:
        return Path(py_file).resolve().is_relative_to(PACKAGE)
    except (OSError, ValueError):
        return False


def _package_stamped(base):
    """A subclass of numba locator `base` that claims jitkern's functions and stamps them as above."""
    class Locator(base):
        def get_source_stamp(self):
            return source_stamp(PACKAGE, str(Path(self._py_file).resolve()))

        @classmethod
        def from_function(cls, py_func, py_file):
            claimed = _ours(py_file) or getattr(py_func, JIT_MARK, False)
            return super().from_function(py_func, py_file) if claimed else None

    Locator.__name__ = Locator.__qualname__ = "Jitkern" + base.__name__
    return Locator


_LOCATORS = tuple(_package_stamped(b) for b in (caching.UserProvidedCacheLocator, caching.InTreeCacheLocator,
                                                caching.UserWideCacheLocator))


def _process_unique_ids() -> None:
    """Count numba's function ids from a random point of this process (see the module docstring)."""
    if not getattr(FunctionIdentity, "_jitkern_random_ids", False):
        FunctionIdentity._unique_ids = itertools.count(secrets.randbits(62))
        FunctionIdentity._jitkern_random_ids = True


def install() -> None:
    """Put jitkern's locators first in numba's search order (their own conditions still apply:
    NUMBA_CACHE_DIR first, then a writable __pycache__, then the user-wide cache dir), and make
    compiled symbols unique across processes."""
    _process_unique_ids()
    classes = caching.CacheImpl._locator_classes
    if classes[:len(_LOCATORS)] != list(_LOCATORS):
        classes[:0] = [c for c in _LOCATORS if c not in classes]


def _plain(option):
    """An option value as a string independent of the process (sets print in hash order)."""
    return str(sorted(map(str, option))) if isinstance(option, (set, frozenset)) else str(option)


def _stable(value):
    """A closure cell's value as a per-process-stable description (dispatchers), else itself."""
    if isinstance(value, Dispatcher):
        f = value.py_func
        options = sorted((k, _plain(v)) for k, v in value.targetoptions.items())
        return ("dispatcher", f.__module__, f.__qualname__, f.__code__.co_code, options,
                tuple(_stable(c.cell_contents) for c in (f.__closure__ or ())))
    return value


class StableKeyCache(caching.FunctionCache):
    """numba's function cache with closure cells keyed by _stable (see the module docstring)."""

    def _index_key(self, sig, codegen):
        closure = self._py_func.__closure__
        cells = dumps(tuple(_stable(c.cell_contents) for c in closure)) if closure is not None else b""
        digest = lambda b: hashlib.sha256(b).hexdigest()  # noqa: E731
        return sig, codegen.magic_tuple(), (digest(self._py_func.__code__.co_code), digest(cells))
