"""Per-CPU tuning: block sizes from a JSON tuning DB, else from cache-size heuristics.

DB layout (JSON, at get_config().tune_db): {"format": 1, "targets": {db_key: {op: {shape_class:
params}}}} where db_key = host_target().key + jitkern + numba versions, so entries measured on
another CPU or with other library versions are never used. A corrupt file is ignored with a
warning; writes go through a temporary file and os.replace, so readers never see half a file.

`python -m jitkern tune [IN,OUT ...] [--batch N] [--quick] [--only]` times candidate (MC, KC)
for the GEMMs of the DLRM MLP layers (forward, backward-data, backward-weight) and stores the fastest.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import tempfile
import time
import warnings
from pathlib import Path

from ..config import get_config
from .target import host_target

FORMAT = 1
# the DLRM default MLP layers as (in, out): bottom 13-512-256-64, top 479-1024-1024-512-256-1, and
# the other widths the benchmark times
DLRM_LAYERS = ((13, 512), (512, 256), (256, 64), (256, 128), (479, 1024), (1024, 1024), (1024, 512),
               (367, 512), (100, 1024))


def db_key() -> str:
    """Identity of tuning entries: CPU name + feature hash, jitkern and numba versions."""
    import numba

    from .. import __version__
    return f"{host_target().key}|jitkern-{__version__}|numba-{numba.__version__}"


def shape_class(*dims: int) -> str:
    """Bucket dims to powers of two ("2048x1024x64"): one tuned entry serves similar shapes."""
    return "x".join(str(1 << max(0, int(d) - 1).bit_length()) for d in dims)


@functools.lru_cache(maxsize=8)
def _load(path: str, mtime_ns: int) -> dict:
    try:
        with open(path) as f:
            db = json.load(f)
        if not isinstance(db, dict) or db.get("format") != FORMAT or not isinstance(db.get("targets"), dict):
            raise ValueError("unexpected layout")
        return db
    except (OSError, ValueError) as e:
        warnings.warn(f"jitkern: ignoring unreadable tuning DB {path}: {e}", RuntimeWarning, stacklevel=3)
        return {"format": FORMAT, "targets": {}}


def _db() -> dict:
    path = get_config().tune_db
    try:
        mtime = path.stat().st_mtime_ns
    except OSError:
        return {"format": FORMAT, "targets": {}}
    return _load(str(path), mtime)


def entries() -> dict:
    """{op: {shape_class: params}} tuned for this CPU and these library versions."""
    found = _db()["targets"].get(db_key(), {})
    return found if isinstance(found, dict) else {}


def lookup(op: str, shape_cls: str) -> dict | None:
    """Tuned params for (op, shape class), or None (no entry, tuning disabled, or stale DB)."""
    if not get_config().use_tuning:
        return None
    got = entries().get(op, {}).get(shape_cls)
    return dict(got) if isinstance(got, dict) else None


def store(op: str, shape_cls: str, params: dict) -> None:
    """Record tuned params for (op, shape class) under this CPU's key, atomically."""
    path = get_config().tune_db
    path.parent.mkdir(parents=True, exist_ok=True)
    db = json.loads(json.dumps(_db()))  # a deep copy we may modify
    db["targets"].setdefault(db_key(), {}).setdefault(op, {})[shape_cls] = dict(params)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tune-", suffix=".json")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(db, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _round_to(x: int, m: int) -> int:
    return max(m, (x + m - 1) // m * m)


def heuristic_gemm_blocks(m: int, n: int, k: int, mr: int, nr: int) -> dict:
    """(mc, kc) from cache sizes. kc: a kc x NR B micro-panel of about twice L1 -- the tile kernel
    streams it in order, so the prefetcher keeps up, and long K loops amortise the C tile's
    load/store (measured: kc 512 beats 128 by ~10% on znver4). mc: the mc x kc A block in an
    eighth of L2, leaving room for B panels. kc is then split evenly over K."""
    t = host_target()
    kc0 = min(512, max(128, (2 * t.l1d) // (nr * 4) // 16 * 16))
    passes = max(1, -(-k // kc0))
    kc = _round_to(-(-k // passes), 4)
    mc = max(mr, min(288, (t.l2 // 8) // (kc * 4) // mr * mr))
    return {"mc": mc, "kc": kc}


def gemm_blocks(op: str, m: int, n: int, k: int, mr: int, nr: int, threads: int,
                params: dict | None = None) -> tuple[int, int, int]:
    """(mc, kc, nc) for a C (m x n) += A (m x k) B (k x n) GEMM: `params`, else the tuned entry,
    else the heuristic; then mc and nc are shaped to give `threads` threads even work.
    """
    params = params or lookup(op, shape_class(m, n, k)) or heuristic_gemm_blocks(m, n, k, mr, nr)
    mc, kc = _round_to(int(params["mc"]), mr), max(1, int(params["kc"]))
    if k <= kc * 5 // 4:  # one pass over K beats a full pass plus a sliver
        kc = max(k, 1)
    nib = -(-m // mc)
    if threads > 1:
        nib = _round_to(nib, threads) if nib >= threads else nib
        mc = _round_to(-(-m // nib), mr)
        nib = -(-m // mc)
    nc = _round_to(n, nr)
    if nib < 2 * threads and threads > 1:  # too few row blocks: split the columns too
        njb = -(-2 * threads // nib)
        nc = _round_to(-(-n // njb), nr)
    return mc, kc, nc


# --------------------------------------------------------------------------- the tuner


def _gemm_problems(layers, batch):
    """(op, m, n, k, trans_a, trans_b) of each layer's forward, backward-data, backward-weight GEMM."""
    for kin, kout in layers:
        yield "linear_forward", batch, kout, kin, False, True
        yield "linear_dx", batch, kin, kout, False, False
        yield "linear_dw", kout, kin, batch, True, False


def _candidates(quick: bool, mr: int):
    kcs = (128, 256, 512) if quick else (96, 128, 192, 256, 384, 512)
    mcs = (mr * 6, mr * 12, mr * 24) if quick else (mr * 4, mr * 6, mr * 9, mr * 12, mr * 18, mr * 24)
    return [{"mc": mc, "kc": kc} for kc in kcs for mc in mcs]


def tune_gemm(layers=DLRM_LAYERS, batch: int = 2048, quick: bool = False, out=print,
              min_time: float = 0.05) -> dict:
    """Time candidate blocks for each layer's GEMMs, store the best per shape class; return them."""
    import importlib

    import numpy as np

    G = importlib.import_module("jitkern.ops.gemm")  # the module, not ops.gemm the function

    rng = np.random.default_rng(0)
    best_all = {}
    seen = set()
    for op, m, n, k, ta, tb in _gemm_problems(layers, batch):
        cls = shape_class(m, n, k)
        if (op, cls) in seen:
            continue
        seen.add((op, cls))
        a = rng.standard_normal((k, m) if ta else (m, k), dtype=np.float32)
        b = rng.standard_normal((n, k) if tb else (k, n), dtype=np.float32)
        c = np.empty((m, n), np.float32)
        timings = []
        for cand in [None] + _candidates(quick, G.tile_shape()[0]):
            run = lambda: G._gemm_into(a, b, c, ta, tb, blocks=cand)
            run()
            best, t0 = float("inf"), time.perf_counter()
            for rep in range(1000):  # the fastest rep: robust against other load on the machine
                t1 = time.perf_counter()
                run()
                best = min(best, time.perf_counter() - t1)
                if rep >= 2 and t1 - t0 >= min_time:
                    break
            timings.append((best, cand))
        dt, cand = min(timings, key=lambda t: t[0])
        heur = timings[0][0]
        if cand is None:
            cand = heuristic_gemm_blocks(m, n, k, *G.tile_shape()[:2])
        store(op, cls, cand)
        best_all[(op, cls)] = cand
        out(f"{op:<15} {m:>5}x{n:>5}x{k:>5} [{cls}]  best {cand}  {2 * m * n * k / dt / 1e9:7.1f} GFLOP/s "
            f"(heuristic {2 * m * n * k / heur / 1e9:.1f})")
    G.clear_block_cache()
    return best_all


def _parse_layer(text: str):
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
    p.add_argument("layers", nargs="*", type=_parse_layer,
                   help="extra layers to tune besides DLRM's, as IN,OUT or 'IN->OUT' (quote the >)")
    p.add_argument("--batch", type=int, default=2048, help="batch size of the layer GEMMs (default 2048)")
    p.add_argument("--quick", action="store_true", help="fewer candidates")
    p.add_argument("--only", action="store_true", help="tune only the layers given, not the DLRM defaults")
    args = p.parse_args(argv)
    layers = tuple(args.layers) if args.only and args.layers else DLRM_LAYERS + tuple(args.layers)
    print(f"tuning for {db_key()} -> {get_config().tune_db}")
    tune_gemm(layers, args.batch, args.quick)
    return 0
