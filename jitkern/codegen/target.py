"""The host CPU as code generation sees it: name, ISA features, cache sizes, threads."""
from __future__ import annotations

import functools
import hashlib
import os
import platform
from dataclasses import dataclass
from pathlib import Path

from ..config import get_config

# floats per SIMD register for each ISA we emit vector code for
VECTOR_WIDTH = {"avx512": 16, "avx2": 8, "neon": 4, "scalar": 1}


@dataclass(frozen=True)
class Target:
    name: str                 # LLVM CPU name, e.g. "znver4", "skylake-avx512", "neoverse-n1"
    arch: str                 # platform.machine(): "x86_64", "aarch64", ...
    features: frozenset       # enabled LLVM features without the "+": {"avx2", "fma", ...}
    l1d: int                  # bytes, per core
    l2: int                   # bytes, per core
    l3: int                   # bytes, shared
    cores: int                # CPUs this process may run on

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
        forced = get_config().isa
        if forced == "auto":
            return self.detected_isa
        if forced != "scalar" and forced != self.detected_isa and not (
            forced == "avx2" and self.detected_isa == "avx512"
        ):
            raise ValueError(f"JITKERN_ISA={forced} is not supported by this CPU ({self.detected_isa})")
        return forced

    @property
    def vector_width(self) -> int:
        return VECTOR_WIDTH[self.isa]

    @property
    def feature_hash(self) -> str:
        return hashlib.sha256(",".join(sorted(self.features)).encode()).hexdigest()[:12]

    @property
    def key(self) -> str:
        """Stable identity of this CPU for tuning entries: name + feature hash."""
        return f"{self.arch}-{self.name}-{self.feature_hash}"


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
def host_target() -> Target:
    """Detect the host once per process (CPU features do not change under us)."""
    import llvmlite.binding as llvm

    name = llvm.get_host_cpu_name() or "generic"
    try:
        flat = llvm.get_host_cpu_features().flatten()
        feats = frozenset(f[1:] for f in flat.split(",") if f.startswith("+"))
    except RuntimeError:  # llvmlite cannot read features on some hosts
        feats = frozenset()
    l1d, l2, l3 = _read_cache_sizes()
    return Target(name=name, arch=platform.machine().lower(), features=feats,
                  l1d=l1d, l2=l2, l3=l3, cores=_cpu_count())
