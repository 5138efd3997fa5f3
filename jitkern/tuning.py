"""python -m jitkern tune: time every per-CPU knob's candidates for a workload and store the best.

    python -m jitkern tune                      # the DLRM configs' shapes (kaggle, mlperf, paper-small)
    python -m jitkern tune --quick              # a small candidate set (seconds)
    python -m jitkern tune --precision bf16     # a bf16 model's GEMM blocks and bf16 tables' knobs too
    python -m jitkern tune --config kaggle --batch 2048 --knob 'gemm.*' 479,1024

Entries are stored in the tuning DB under this CPU's key (see `python -m jitkern info`); kernels
use them from then on, and fall back to their heuristics for shapes not tuned.
`tune_for(model)` does the quick tune for one model's own shapes (the trainer's --autotune).
"""
from __future__ import annotations

import argparse
import time

from . import ops  # noqa: F401  (importing the ops declares their knobs)
from .codegen import knobs, tune, tunedb
from .config import get_config
from .dlrm.autotune import tune_for  # noqa: F401  (jitkern.tuning.tune_for, the public name)
from .dlrm.configs import CONFIGS

DEFAULT_CONFIGS = ("kaggle", "mlperf", "paper-small")


def _threads() -> int:
    import numba
    return numba.get_num_threads()


def _layer(text: str):
    try:
        kin, kout = (int(v) for v in text.replace("->", ",").split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"layer must look like IN,OUT or IN->OUT (e.g. 479,1024), got {text!r}") from None
    if kin < 1 or kout < 1:
        raise argparse.ArgumentTypeError(f"layer sizes must be positive, got {text!r}")
    return kin, kout


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m jitkern tune", description=__doc__.split("\n\n")[0])
    p.add_argument("layers", nargs="*", type=_layer, help="extra linear layers to tune, as IN,OUT or 'IN->OUT'")
    p.add_argument("--config", action="append", choices=sorted(CONFIGS),
                   help=f"DLRM configs whose shapes to tune (repeatable; default {', '.join(DEFAULT_CONFIGS)})")
    p.add_argument("--only", action="store_true", help="tune only the layers given, no DLRM config")
    p.add_argument("--batch", type=int, default=2048, help="batch size (default 2048)")
    p.add_argument("--threads", type=int, default=0, help="thread count to tune for (default: numba's)")
    p.add_argument("--quick", action="store_true", help="a small candidate set")
    p.add_argument("--precision", action="append", choices=("fp32", "bf16"),
                   help="model precisions to tune (repeatable; default fp32: what the DLRM configs run); "
                        "bf16: bf16 GEMMs and bf16 (Split-SGD) tables")
    p.add_argument("--knob", default="*", help="tune only knobs matching this glob (e.g. 'gemm.*')")
    p.add_argument("--list", action="store_true", help="list the declared knobs and exit")
    args = p.parse_args(argv)
    if args.batch < 1 or args.threads < 0:
        p.error("--batch must be >= 1 and --threads >= 0")
    if args.list:
        for name, k in sorted(knobs.registered().items()):
            print(f"{name:<32} {k.doc}")
        return 0
    threads = (args.threads or _threads(),)
    precisions = tuple(dict.fromkeys(args.precision or ("fp32",)))
    work = knobs.Workload(linears=tuple((args.batch, i, o) for i, o in args.layers), threads=threads,
                          precisions=precisions)
    if not (args.only and args.layers):
        for name in args.config or DEFAULT_CONFIGS:
            for precision in precisions:  # a bf16 model's tables are bf16 too (DLRM(precision="bf16"))
                itemsize = 2 if precision == "bf16" else 4
                work = work.merged(CONFIGS[name].workload(args.batch, threads, itemsize, precision=precision))
    print(f"tuning for {tunedb.db_key()} -> {get_config().tune_db}")
    t0 = time.perf_counter()
    results = tune.tune(work, quick=args.quick, select=args.knob)
    print(f"{len(results)} entries stored in {time.perf_counter() - t0:.1f} s")
    return 0
