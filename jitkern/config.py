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


IDLE_SPIN = "10000"  # libgomp spins before an idle worker sleeps: ~0.3 ms here


def sleep_idle_workers() -> None:
    """Let numba's idle OpenMP workers spin briefly, then sleep (GOMP_SPINCOUNT=IDLE_SPIN), unless
    the user set OMP_WAIT_POLICY or GOMP_SPINCOUNT; effective only before the threading layer starts.

    Both extremes cost on a 2-core box. libgomp's default spin (300k, milliseconds) made 2-thread
    steps 10-30x slower on a busy machine: the spinning worker takes the core the working thread
    needs. Sleeping at once (OMP_WAIT_POLICY=PASSIVE, the setting before) costs ~50 us to wake the
    workers for every parallel region, against ~1.5 us while they spin: more than many kernels
    take. Measured, kaggle DLRM at 2 threads: idle machine 42.5 ms/step passive, 38-39 bounded;
    with two CPU hogs running, 104-123 passive, 88-123 bounded (no worse)."""
    if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
        os.environ["GOMP_SPINCOUNT"] = IDLE_SPIN


def omp_wait_setting() -> str:
    """The idle-worker setting in effect, for benchmark headers."""
    for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"):
        if k in os.environ:
            return f"{k}={os.environ[k]}"
    return "libgomp default spin"
