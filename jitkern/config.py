"""Every environment knob of jitkern, read in one place.

JITKERN_DEBUG       0 (default) quiet; 1 log spec choice and kernel-cache hits; 2 add timings
JITKERN_CACHE_DIR   where the tuning DB lives (default: $XDG_CACHE_HOME/jitkern or ~/.cache/jitkern)
JITKERN_TUNE_DB     path of the tuning DB file (default: <cache dir>/tune.json)
JITKERN_NO_DISK_CACHE  1 disables numba's on-disk kernel cache
JITKERN_ISA         force an ISA for generated code: auto (default), avx512, avx2, neon, scalar
JITKERN_NO_TUNE     1 ignores the tuning DB (heuristic block sizes only)
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path

ISA_CHOICES = ("auto", "avx512", "avx2", "neon", "scalar")


@dataclass(frozen=True)
class Config:
    debug: int
    cache_dir: Path
    tune_db: Path
    disk_cache: bool
    isa: str
    use_tuning: bool


def _flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


_KNOBS = ("JITKERN_DEBUG", "JITKERN_CACHE_DIR", "JITKERN_TUNE_DB", "JITKERN_NO_DISK_CACHE",
          "JITKERN_ISA", "JITKERN_NO_TUNE", "XDG_CACHE_HOME", "HOME")


def get_config() -> Config:
    """The configuration from the environment as it is now (a dict lookup when unchanged)."""
    return _config_for(tuple(os.environ.get(k) for k in _KNOBS))


@functools.lru_cache(maxsize=8)
def _config_for(_env_values: tuple) -> Config:
    try:
        debug = int(os.environ.get("JITKERN_DEBUG", "0") or 0)
    except ValueError:
        raise ValueError(f"JITKERN_DEBUG must be an integer, got {os.environ['JITKERN_DEBUG']!r}") from None
    base = os.environ.get("JITKERN_CACHE_DIR")
    if base:
        cache_dir = Path(base).expanduser()
    else:
        xdg = os.environ.get("XDG_CACHE_HOME")
        cache_dir = (Path(xdg) if xdg else Path.home() / ".cache") / "jitkern"
    tune_db = Path(os.environ.get("JITKERN_TUNE_DB") or cache_dir / "tune.json").expanduser()
    isa = (os.environ.get("JITKERN_ISA") or "auto").strip().lower()
    if isa not in ISA_CHOICES:
        raise ValueError(f"JITKERN_ISA must be one of {ISA_CHOICES}, got {isa!r}")
    return Config(
        debug=debug,
        cache_dir=cache_dir,
        tune_db=tune_db,
        disk_cache=not _flag("JITKERN_NO_DISK_CACHE"),
        isa=isa,
        use_tuning=not _flag("JITKERN_NO_TUNE"),
    )


def sleep_idle_workers() -> None:
    """Make numba's idle OpenMP workers sleep rather than spin (OMP_WAIT_POLICY=PASSIVE, unless
    the user chose a policy); effective only before the threading layer starts.

    Measured here: spinning workers made 2-thread steps 10-30x slower than 1-thread ones on a
    shared box (they steal the core the working thread needs), and the 2-thread fused embedding
    update 4x slower even on an idle 2-core VM; sleeping costs a few microseconds per region."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
