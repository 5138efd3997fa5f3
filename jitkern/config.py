"""Every environment knob of jitkern, read in one place (nothing else reads JITKERN_*).

JITKERN_DEBUG          0 (default) quiet; 1 log spec choice and kernel-cache hits; 2 add timings
JITKERN_CACHE_DIR      where the tuning DB lives (default: $XDG_CACHE_HOME/jitkern or ~/.cache/jitkern)
JITKERN_TUNE_DB        path of the tuning DB file (default: <cache dir>/tune.json)
JITKERN_NO_DISK_CACHE  1 disables numba's on-disk kernel cache
JITKERN_ISA            generate code for a lower ISA than the host's: auto (default), avx512, avx2,
                       neon, scalar. Read once per process for numba's own loops (see codegen.target)
JITKERN_CACHE_SIZES    stand in for another CPU's caches: a preset (zen3, zen4, skylake, skylake-sp,
                       sapphire-rapids), which brings that CPU's L2 prefetcher model too, or sizes such as
                       "l1d=32K,l2=512K,l3=32M" (missing levels keep the host's)
JITKERN_NO_TUNE        1 ignores the tuning DB (heuristic choices only)
JITKERN_RANKS_PER_NODE ranks per node for sharding plans (default: MPI's shared-memory split)
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path

ISA_CHOICES = ("auto", "avx512", "avx2", "neon", "scalar")

# (L1d, L2 per core, L3 shared) of CPUs whose caches tests and benchmarks stand in for
CACHE_PRESETS = {
    "zen3": (32 << 10, 512 << 10, 32 << 20),
    "zen4": (32 << 10, 1 << 20, 32 << 20),
    "skylake": (32 << 10, 256 << 10, 8 << 20),          # client Skylake (AVX2)
    "skylake-sp": (32 << 10, 1 << 20, 22 << 20),        # Skylake-SP / Cascade Lake (AVX-512)
    "sapphire-rapids": (48 << 10, 2 << 20, 105 << 20),  # Sapphire / Emerald Rapids (AVX-512, AMX)
}
# and the 4 KiB-page streams their L2 prefetchers follow at once (codegen.target.Target.page_streams)
PRESET_PAGE_STREAMS = {"zen3": 0, "zen4": 0, "skylake": 32, "skylake-sp": 32, "sapphire-rapids": 32}


@dataclass(frozen=True)
class Config:
    debug: int
    cache_dir: Path
    tune_db: Path
    disk_cache: bool
    isa: str
    cache_sizes: tuple | None   # (l1d, l2, l3) override, None where a level keeps the host's
    page_streams: int | None    # a preset CPU's Target.page_streams, None: the host's
    use_tuning: bool
    ranks_per_node: int         # 0: from MPI


def _flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


_KNOBS = ("JITKERN_DEBUG", "JITKERN_CACHE_DIR", "JITKERN_TUNE_DB", "JITKERN_NO_DISK_CACHE",
          "JITKERN_ISA", "JITKERN_CACHE_SIZES", "JITKERN_NO_TUNE", "JITKERN_RANKS_PER_NODE",
          "XDG_CACHE_HOME", "HOME")
# the knobs a per-CPU choice depends on: memoised choices are keyed by their values
CHOICE_KNOBS = ("JITKERN_ISA", "JITKERN_CACHE_SIZES", "JITKERN_NO_TUNE", "JITKERN_TUNE_DB", "JITKERN_CACHE_DIR")


# Kernel wrappers consult the configuration on every call: os.environ.get decodes and re-encodes
# each key (~1-2 us), so read CPython's underlying bytes dict where it exists (~0.1 us).
_RAW = getattr(os.environ, "_data", None)
if not (isinstance(_RAW, dict) and os.name == "posix"):
    _RAW = None
_KNOB_KEYS = tuple(k.encode() for k in _KNOBS) if _RAW is not None else _KNOBS
_CHOICE_KEYS = tuple(k.encode() for k in CHOICE_KNOBS) if _RAW is not None else CHOICE_KNOBS
_DEBUG_KEY = b"JITKERN_DEBUG" if _RAW is not None else "JITKERN_DEBUG"
_ENV = _RAW if _RAW is not None else os.environ


def get_config() -> Config:
    """The configuration from the environment as it is now (a dict lookup when unchanged)."""
    return _config_for(tuple(map(_ENV.get, _KNOB_KEYS)))


def choice_token() -> tuple:
    """The values of the knobs that per-CPU choices depend on (cheap: a few dict lookups)."""
    return tuple(map(_ENV.get, _CHOICE_KEYS))  # map, not a generator: a third of the cost


def debug_level() -> int:
    """JITKERN_DEBUG as an int, in one environment lookup (the kernel-dispatch hot path)."""
    v = _ENV.get(_DEBUG_KEY)
    return 0 if v in (None, "", "0", b"", b"0") else get_config().debug


def _size(text: str, what: str) -> int:
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(t[-1:], 1)
    try:
        n = int(float(t.rstrip("KMG")) * mult)
    except ValueError:
        n = 0
    if n <= 0:
        raise ValueError(f"JITKERN_CACHE_SIZES: {what} must be a size such as 32K or 1M, got {text!r}")
    return n


def parse_cache_sizes(text: str | None) -> tuple | None:
    """JITKERN_CACHE_SIZES -> (l1d, l2, l3) with None for levels not given; None if unset."""
    if not text or not text.strip():
        return None
    text = text.strip().lower()
    if text in CACHE_PRESETS:
        return CACHE_PRESETS[text]
    if "=" not in text:
        raise ValueError(f"JITKERN_CACHE_SIZES must be one of {sorted(CACHE_PRESETS)} or like "
                         f"'l1d=32K,l2=512K,l3=32M', got {text!r}")
    sizes = {"l1d": None, "l2": None, "l3": None}
    for part in text.split(","):
        key, _, value = part.partition("=")
        key = key.strip()
        if key not in sizes:
            raise ValueError(f"JITKERN_CACHE_SIZES: unknown level {key!r} (use l1d, l2, l3)")
        sizes[key] = _size(value, key)
    return sizes["l1d"], sizes["l2"], sizes["l3"]


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
    caches = os.environ.get("JITKERN_CACHE_SIZES")
    rpn = (os.environ.get("JITKERN_RANKS_PER_NODE") or "0").strip()
    if not rpn.isdigit():
        raise ValueError(f"JITKERN_RANKS_PER_NODE must be a positive integer, got {rpn!r}")
    return Config(
        debug=debug,
        cache_dir=cache_dir,
        tune_db=tune_db,
        disk_cache=not _flag("JITKERN_NO_DISK_CACHE"),
        isa=isa,
        cache_sizes=parse_cache_sizes(caches),
        page_streams=PRESET_PAGE_STREAMS.get((caches or "").strip().lower()),
        use_tuning=not _flag("JITKERN_NO_TUNE"),
        ranks_per_node=int(rpn),
    )


IDLE_SPIN = "10000"  # libgomp spins before an idle worker sleeps: ~0.3 ms on a 2.6 GHz core


def sleep_idle_workers() -> None:
    """Let numba's idle OpenMP workers spin briefly, then sleep (GOMP_SPINCOUNT=IDLE_SPIN), unless
    the user set OMP_WAIT_POLICY or GOMP_SPINCOUNT. Call it from a program's entry point, before
    the first parallel kernel starts the threading layer (it has no effect after).

    Both extremes cost on a 2-core box: libgomp's default spin (milliseconds) lets an idle worker
    take the core the working thread needs; sleeping at once costs ~50 us to wake the workers for
    every parallel region, more than many kernels take."""
    if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
        os.environ["GOMP_SPINCOUNT"] = IDLE_SPIN


def omp_wait_setting() -> str:
    """The idle-worker setting in effect, for benchmark headers."""
    for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"):
        if k in os.environ:
            return f"{k}={os.environ[k]}"
    return "libgomp default spin"
