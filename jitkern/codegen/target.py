"""The CPU code generation targets: name, ISA features, cache sizes, threads.

`host_target()` is the detected host with the JITKERN_ISA / JITKERN_CACHE_SIZES overrides applied,
so one process can stand in for another CPU: JITKERN_ISA=avx2 with JITKERN_CACHE_SIZES=zen3 on a
Zen 4 host generates AVX2 code and sizes blocks for a Zen 3's caches. `pin_numba_cpu()` makes
numba's own loops follow a lowered ISA too (it must run before numba builds its first function).
"""
from __future__ import annotations

import functools
import hashlib
import os
import platform
import warnings
from dataclasses import dataclass, replace
from pathlib import Path

from ..config import choice_token, get_config

# floats per SIMD register for each ISA we emit vector code for
VECTOR_WIDTH = {"avx512": 16, "avx2": 8, "neon": 4, "scalar": 1}
# and SIMD registers per core: what a kernel can keep resident before LLVM spills to the stack
VECTOR_REGISTERS = {"avx512": 32, "avx2": 16, "neon": 32, "scalar": 16}
# LLVM features that belong to each lowered ISA's absence: masked out when JITKERN_ISA lowers it
_AVX512_PREFIX = "avx512"


@dataclass(frozen=True)
class Target:
    name: str                 # LLVM CPU name, e.g. "znver4", "skylake-avx512", "neoverse-n1"
    arch: str                 # platform.machine(): "x86_64", "aarch64", ...
    features: frozenset       # enabled LLVM features without the "+": {"avx2", "fma", ...}
    l1d: int                  # bytes, per core
    l2: int                   # bytes, per core
    l3: int                   # bytes, shared
    cores: int                # CPUs this process may run on
    cache_override: bool = False  # caches from JITKERN_CACHE_SIZES, not the host's
    # 4 KiB-page streams the L2 prefetcher follows at once, 0 where no such limit was seen: Intel's
    # streamer tracks 32 pages (a GEMM storing 512 C rows at once lost 28% to 16 rows on a Xeon),
    # while AMD's Zen 3 and Zen 4 stored taller strips faster (12 -> 288 rows: +7-12%)
    page_streams: int = 32

    @property
    def detected_isa(self) -> str:
        f = self.features
        if "avx512f" in f and "fma" in f:
            return "avx512"
        if "avx2" in f and "fma" in f:
            return "avx2"
        if "neon" in f or self.arch in ("aarch64", "arm64"):
            return "neon"
        return "scalar"

    @property
    def isa(self) -> str:
        """The ISA generated code targets: detected, or JITKERN_ISA if it forces a lower one."""
        return effective_isa(get_config().isa, self.detected_isa)

    @property
    def vector_width(self) -> int:
        return VECTOR_WIDTH[self.isa]

    def has(self, feature: str) -> bool:
        """Whether generated code may use `feature` (e.g. "avx512bf16") under the current ISA."""
        isa = self.isa
        if isa == "scalar" and feature not in ("neon",):
            return False
        if isa != "avx512" and feature.startswith(_AVX512_PREFIX):
            return False
        return feature in self.features

    @property
    def feature_hash(self) -> str:
        return hashlib.sha256(",".join(sorted(self.features)).encode()).hexdigest()[:12]

    @property
    def key(self) -> str:
        """Stable identity of this target for tuning entries: CPU name + feature hash, and the
        forced ISA and stand-in caches when set (an emulated CPU's entries never serve the host)."""
        key = f"{self.arch}-{self.name}-{self.feature_hash}"
        if self.isa != self.detected_isa:
            key += f"-isa={self.isa}"
        if self.cache_override:
            key += f"-caches={self.l1d >> 10}K,{self.l2 >> 10}K,{self.l3 >> 10}K"
        return key


def effective_isa(forced: str, detected: str) -> str:
    if forced == "auto":
        return detected
    if forced != "scalar" and forced != detected and not (forced == "avx2" and detected == "avx512"):
        raise ValueError(f"JITKERN_ISA={forced} is not supported by this CPU ({detected})")
    return forced


def _read_cache_sizes() -> tuple[int, int, int]:
    """Data/unified cache sizes per level from sysfs; conservative defaults where missing."""
    sizes = {1: 32 << 10, 2: 1 << 20, 3: 8 << 20}
    base = Path("/sys/devices/system/cpu/cpu0/cache")
    for idx in sorted(base.glob("index*")) if base.exists() else []:
        try:
            level = int((idx / "level").read_text())
            kind = (idx / "type").read_text().strip()
            text = (idx / "size").read_text().strip().upper()
        except (OSError, ValueError):
            continue
        if kind == "Instruction" or not text:
            continue
        mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1], 1)
        try:
            sizes[level] = int(text.rstrip("KMG")) * mult
        except ValueError:
            continue
    return sizes[1], sizes[2], sizes.get(3, sizes[2])


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


@functools.lru_cache(maxsize=1)
def detected_target() -> Target:
    """The host as detected, without overrides (once per process: CPU features do not change)."""
    import llvmlite.binding as llvm

    name = llvm.get_host_cpu_name() or "generic"
    try:
        flat = llvm.get_host_cpu_features().flatten()
        feats = frozenset(f[1:] for f in flat.split(",") if f.startswith("+"))
    except RuntimeError:  # llvmlite cannot read features on some hosts
        feats = frozenset()
    l1d, l2, l3 = _read_cache_sizes()
    return Target(name=name, arch=platform.machine().lower(), features=feats,
                  l1d=l1d, l2=l2, l3=l3, cores=_cpu_count(), page_streams=page_streams_of(name))


_AMD_CPUS = ("znver", "bdver", "btver")  # LLVM's names of AMD's cores since 2011


def page_streams_of(cpu_name: str) -> int:
    """Target.page_streams of an LLVM CPU name: 0 for AMD's, 32 (Intel's streamer) for any other,
    a limit that costs a CPU without it less than its absence costs one with it."""
    return 0 if cpu_name.startswith(_AMD_CPUS) else 32


@functools.lru_cache(maxsize=16)
def _with_caches(base: Target, sizes, page_streams=None) -> Target:
    if page_streams is not None:
        base = replace(base, page_streams=page_streams)
    if sizes is None:
        return base
    l1d, l2, l3 = (s if s is not None else h for s, h in zip(sizes, (base.l1d, base.l2, base.l3)))
    return replace(base, l1d=l1d, l2=l2, l3=l3, cache_override=True)


_TARGET_BY_TOKEN: dict = {}
_ISA_BY_TOKEN: dict = {}


def host_target() -> Target:
    """The target code is generated for: the detected host with JITKERN_CACHE_SIZES applied
    (JITKERN_ISA acts through Target.isa). Memoised per choice_token(): kernel wrappers ask on
    every call, where reading the configuration costs ~2 us."""
    token = choice_token()
    target = _TARGET_BY_TOKEN.get(token)
    if target is None:
        config = get_config()
        target = _TARGET_BY_TOKEN[token] = _with_caches(detected_target(), config.cache_sizes, config.page_streams)
    return target


def target_isa() -> str:
    """host_target().isa in a few dict lookups: kernel wrappers ask on every call, where building
    the target and its configuration cost ~2 us."""
    token = choice_token()
    isa = _ISA_BY_TOKEN.get(token)
    if isa is None:
        isa = _ISA_BY_TOKEN[token] = host_target().isa
    return isa


# --------------------------------------------------------------------------- numba's own loops

_PINNED: dict = {}


def numba_cpu_for(isa: str, host: Target) -> str | None:
    """The LLVM CPU name numba should compile for when JITKERN_ISA lowers the ISA (None: the host)."""
    if isa == host.detected_isa:
        return None
    if isa == "avx2":  # the AVX2 member of the host's family: its scheduling model, no AVX-512
        return "znver3" if host.name.startswith("znver") else "haswell"
    if isa == "scalar":
        return "generic"
    return None


def pin_numba_cpu() -> str | None:
    """Make numba compile for the CPU that JITKERN_ISA names (e.g. znver3 on a Zen 4 under
    JITKERN_ISA=avx2), so that its own loops are as AVX2-only as jitkern's IR. Effective only
    before numba creates its CPU target (the first njit decoration in the process): called when
    jitkern.codegen is imported. Returns the CPU name pinned, or None for the host."""
    if "cpu" in _PINNED:
        return _PINNED["cpu"]
    import numba
    from numba.core.registry import cpu_target

    host = detected_target()
    try:
        isa = effective_isa(get_config().isa, host.detected_isa)
    except ValueError:
        isa = host.detected_isa  # reported by Target.isa where it matters
    cpu = numba_cpu_for(isa, host)
    _PINNED["cpu"] = cpu
    if cpu is None or numba.config.CPU_NAME is not None:  # the host, or the user pinned numba already
        return numba.config.CPU_NAME
    if "_toplevel_target_context" in cpu_target.__dict__:
        warnings.warn(f"JITKERN_ISA={isa}: numba compiled code before jitkern was imported, so its own loops "
                      "keep the host's ISA (import jitkern first for a faithful emulation)", RuntimeWarning,
                      stacklevel=2)
        _PINNED["cpu"] = None
        return None
    numba.config.CPU_NAME = cpu
    numba.config.CPU_FEATURES = ""  # the CPU name's own feature set, not the host's
    return cpu


def numba_cpu_name() -> str:
    """The CPU numba compiles its loops for in this process."""
    import llvmlite.binding as llvm
    import numba
    return numba.config.CPU_NAME or llvm.get_host_cpu_name()
