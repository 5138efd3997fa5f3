"""python -m jitkern bench NAME [args]: op and end-to-end benchmarks, one module per NAME."""
from __future__ import annotations

import importlib
import sys

from ..config import sleep_idle_workers

BENCHES = ("gemm", "embedding", "interaction", "ops", "dlrm", "dist", "data")


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in BENCHES:
        print(f"usage: python -m jitkern bench {{{','.join(BENCHES)}}} [args]", file=sys.stderr)
        return 2
    sleep_idle_workers()  # every bench: before any kernel starts numba's thread pool
    mod = importlib.import_module(f"jitkern.bench.{argv[0]}")
    return int(mod.main(argv[1:]) or 0)
