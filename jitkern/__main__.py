"""python -m jitkern {train,bench,tune,info,preprocess,scale} ..."""
from __future__ import annotations

import importlib
import sys

# subcommand -> (module, function, one-line help); modules are imported only when used
COMMANDS = {
    "train": ("jitkern.dlrm.cli", "main", "train DLRM (same flags as examples/dlrm_numba.py)"),
    "bench": ("jitkern.bench", "main", "benchmarks: gemm, embedding, interaction, dlrm, dist, data"),
    "tune": ("jitkern.tuning", "main", "tune every per-CPU knob for this CPU, store the choices in the tuning DB"),
    "info": ("jitkern.info", "main", "target CPU key, threading layer, cache dir, tuned entries"),
    "preprocess": ("jitkern.dlrm.data", "main", "Criteo raw logs -> memory-mapped binary"),
    "scale": ("jitkern.dlrm.scale", "main", "predict multi-rank step time and efficiency"),
}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: python -m jitkern COMMAND [args]\n\ncommands:")
        for name, (_, _, text) in COMMANDS.items():
            print(f"  {name:<11} {text}")
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"jitkern: unknown command {name!r}; try: {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    module, func, _ = COMMANDS[name]
    rc = getattr(importlib.import_module(module), func)(rest)
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
