"""python -m jitkern info: what code generation sees on this machine, and what it has tuned."""
from __future__ import annotations

import argparse


def describe() -> list[tuple[str, str]]:
    """(label, value) lines: target, ISA, caches, threading, cache dir, tuning DB and its entries."""
    import numba

    from . import __version__
    from . import ops  # noqa: F401  (declares the knobs)
    from .codegen import knobs, target
    from .codegen.simd import tile_for
    from .codegen.tunedb import db_key, entries
    from .config import get_config
    from .ops.gemm_bf16_kernel import bf16_tile

    cfg, t = get_config(), target.host_target()
    mr, nr, vw = tile_for(t.isa)
    native, bmr, bnr, _ = bf16_tile()
    try:
        layer = numba.threading_layer()
    except ValueError:  # no parallel kernel has run yet: say what numba would pick
        layer = f"not started (configured: {numba.config.THREADING_LAYER})"
    lines = [
        ("jitkern", __version__),
        ("numba", numba.__version__),
        ("target key", t.key),
        ("cpu", f"{t.name} ({t.arch})"),
        ("isa", f"{t.isa} (detected {t.detected_isa}), {vw} floats/vector, GEMM tile {mr}x{nr}"),
        ("numba compiles for", target.numba_cpu_name()),
        ("bf16 dot product", f"yes (avx512bf16): bf16 GEMMs on a vdpbf16ps {bmr}x{bnr} tile" if native else
         ("yes (avx512bf16), slower here than the fp32 FMAs (gemm.bf16.dot): " if t.has("avx512bf16") else "no: ")
         + "bf16 GEMM operands are widened to fp32 for the fp32 tile (bf16 saves memory and bandwidth "
         "here, not FLOPs)"),
        ("caches", f"L1d {t.l1d >> 10} KiB, L2 {t.l2 >> 10} KiB, L3 {t.l3 >> 20} MiB"
         + (" (JITKERN_CACHE_SIZES)" if t.cache_override else "")),
        ("threading layer", layer),
        ("threads", f"{numba.get_num_threads()} of {t.cores} cpus"),
        ("numba cache dir", numba.config.CACHE_DIR or "(next to the sources, __pycache__)"),
        ("disk cache", "on" if cfg.disk_cache else "off (JITKERN_NO_DISK_CACHE)"),
        ("cache dir", str(cfg.cache_dir)),
        ("tune DB", f"{cfg.tune_db}" + ("" if cfg.tune_db.exists() else " (not created yet)")
         + ("" if cfg.use_tuning else " [ignored: JITKERN_NO_TUNE]")),
        ("tune key", db_key()),
    ]
    tuned = entries()
    count = sum(len(v) for v in tuned.values())
    lines.append(("knobs declared", str(len(knobs.registered()))))
    lines.append(("tuned entries", str(count) if count else "none (heuristic choices)"))
    for name in sorted(tuned):
        for cls, params in sorted(tuned[name].items()):
            lines.append((f"  {name}", f"{cls}: {params}"))
    return lines


def main(argv=None) -> int:
    argparse.ArgumentParser(prog="python -m jitkern info", description=__doc__).parse_args(argv)
    lines = describe()
    width = max(len(k) for k, _ in lines)
    for k, v in lines:
        print(f"{k:<{width}}  {v}")
    return 0
