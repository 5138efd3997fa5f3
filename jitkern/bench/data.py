"""python -m jitkern bench data [--rows N] [--batch-size B]: the Criteo pipeline's speed.

1. Generates a raw Kaggle-format file of N lines (default 1,000,000; cached in --workdir).
2. Runs `python -m jitkern preprocess` on it in a child process pinned to one thread, in
   frequency mode (two passes) and hash mode (one pass): raw-text MB/s, rows/s, and the
   child's peak RSS (from wait4).
3. Times producing one batch from the output (sequential and block-shuffled) and compares it
   with one training step of the `kaggle` DLRM configuration (jitkern.dlrm.configs).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ..dlrm.configs import CONFIGS
from .common import do_bench, print_table, set_threads


def run_preprocess(raw, out, extra=()):
    """Run the CLI in a child (one thread); returns (wall seconds, CPU seconds, peak RSS bytes, meta)."""
    from ..dlrm.data.layout import read_meta

    env = dict(os.environ, NUMBA_NUM_THREADS="1", OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "jitkern", "preprocess", "--raw", str(raw), "--out", str(out),
           "--quiet", "--overwrite", *extra]
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(p.pid, 0)
    wall = time.perf_counter() - t0
    p.returncode = os.waitstatus_to_exitcode(status)
    if p.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed with exit code {p.returncode}")
    rss = usage.ru_maxrss * (1 if sys.platform == "darwin" else 1024)
    return wall, usage.ru_utime + usage.ru_stime, rss, read_meta(out)


def batch_timer(ds, batch_size, **kw):
    """A callable producing the next batch (restarting the iterator at the end)."""
    from ..dlrm.data import iterate_batches

    state = {"it": iterate_batches(ds, batch_size, drop_last=True, **kw)}

    def next_batch():
        try:
            return next(state["it"])
        except StopIteration:
            state["it"] = iterate_batches(ds, batch_size, drop_last=True, **kw)
            return next(state["it"])
    return next_batch


def kaggle_step_time(ds, batch, max_ind_range):
    """(Timing of one kaggle DLRM train_step on `batch`, a note on its tables)."""
    from ..dlrm.model import DLRM

    cfg = CONFIGS["kaggle"]
    sizes = [max(k, c) for k, c in zip(cfg.sizes, ds.cardinalities)]
    if max_ind_range:
        sizes = [min(s, max_ind_range) for s in sizes]
    model = DLRM(sizes, cfg.dim, list(cfg.bottom), list(cfg.top), seed=0)
    t = do_bench(lambda: model.train_step(batch.dense, batch.offsets, batch.indices, batch.labels, 0.01),
                 warmup=2, min_reps=5, min_time=1.0)
    return t, f"{sum(sizes):,} embedding rows"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jitkern bench data", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=1_000_000, help="raw lines to generate")
    ap.add_argument("--batch-size", type=int, default=2048)
    ap.add_argument("--workdir", default=None, help="where the raw file and outputs go (default: a temp dir)")
    ap.add_argument("--max-ind-range", type=int, default=0,
                    help="cap the kaggle model's tables (0: Kaggle's full sizes, ~2.2 GB)")
    ap.add_argument("--no-model", action="store_true", help="skip the DLRM step")
    ap.add_argument("--threads", type=int, default=None, help="threads for the DLRM step")
    a = ap.parse_args(argv)
    from ..dlrm.data import load_preprocessed, read_raw
    from ..dlrm.data.rawgen import write_raw

    work = Path(a.workdir or tempfile.mkdtemp(prefix="jitkern-bench-data-"))
    work.mkdir(parents=True, exist_ok=True)
    raw = work / f"raw_{a.rows}.txt"
    if not raw.exists():
        t0 = time.perf_counter()
        write_raw(raw.with_suffix(".part"), a.rows, seed=0).rename(raw)
        print(f"generated {raw} ({raw.stat().st_size / 1e6:.0f} MB) in {time.perf_counter() - t0:.1f} s")
    with open(raw, "rb") as f:          # compile (or load) the parser once, so children reuse the cache
        (work / "head.txt").write_bytes(b"".join(f.readline() for _ in range(10)))
    read_raw(work / "head.txt")

    rows = []
    for mode, extra in (("frequency (2 passes)", ()), ("hash (1 pass)", ("--max-ind-range", "10000000"))):
        out = work / ("out_freq" if not extra else "out_hash")
        wall, cpu, rss, meta = run_preprocess(raw, out, extra)
        s = meta["stats"]
        rows.append([mode, f"{meta['rows']:,}", f"{s['raw_bytes'] / 1e6:.0f}", f"{s['mb_per_s']:.1f}",
                     f"{s['rows_per_s']:,}", f"{s['raw_bytes'] / wall / 1e6:.1f}",
                     f"{s['raw_bytes'] / cpu / 1e6:.1f}", f"{rss / 2**20:.0f}"])
    print("\npreprocess (one thread; MB/s of raw text; 'incl. start' counts interpreter start and imports;"
          " 'per CPU-s' divides by the child's CPU time, which other load on the machine inflates less)")
    print_table(["mode", "rows", "MB", "MB/s", "rows/s", "MB/s incl. start", "MB per CPU-s", "peak RSS MiB"],
                rows)

    set_threads(a.threads)
    ds = load_preprocessed(work / "out_freq", "train")
    timings = []
    for name, kw in (("sequential", {}), ("shuffled (block 65536)", {"shuffle": True, "seed": 0})):
        t = do_bench(batch_timer(ds, a.batch_size, **kw), warmup=3, min_reps=50, min_time=0.5, max_reps=2000)
        timings.append((name, t))
    step, note = (None, "--no-model") if a.no_model else \
        kaggle_step_time(ds, batch_timer(ds, a.batch_size, max_ind_range=a.max_ind_range or None)(),
                         a.max_ind_range or None)
    print(f"\nbatch of {a.batch_size} from the memory-mapped output"
          + (f" vs one kaggle DLRM train_step ({step.median * 1e3:.1f} ms {step.spread()}, {note})"
             if step else f" (no DLRM step timed: {note})"))
    head = ["batch", "ms/batch", "spread"] + (["% of kaggle step"] if step else [])
    print_table(head, [[n, f"{t.median * 1e3:.3f}", t.spread()] +
                       ([f"{t.median / step.median * 100:.3g}"] if step else []) for n, t in timings])
    print(f"\nworkdir: {work}")
    return 0
