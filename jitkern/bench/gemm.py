"""python -m jitkern bench gemm [--threads N]: linear forward/backward vs NumPy on the DLRM MLP shapes.

Forward baseline: NumPy `np.maximum(x @ w.T + b, 0)`; backward baseline: the masked gradient,
`g @ w`, `g.T @ x` and `g.sum(0)`. Both run in this process on the same inputs; the ratio is
NumPy time / jitkern time (> 1: jitkern is faster).
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from ..config import omp_wait_setting
from .common import blas_description, do_bench, print_table, set_threads

# (in, out) of the DLRM MLP layers, as in the issue
SHAPES = ((13, 512), (512, 256), (256, 64), (256, 128), (479, 1024), (1024, 1024), (1024, 512),
          (512, 256), (367, 512), (100, 1024))


def _numpy_forward(x, w, b):
    return np.maximum(x @ w.T + b, 0)


def _numpy_backward(dy, x, w, y):
    g = np.where(y > 0, dy, 0)
    return g @ w, g.T @ x, g.sum(axis=0)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m jitkern bench gemm", description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=None, help="threads for jitkern and the BLAS (default: all)")
    p.add_argument("--batch", type=int, default=2048, help="batch size N (default 2048)")
    p.add_argument("--min-time", type=float, default=0.4, help="seconds per measurement (default 0.4)")
    args = p.parse_args(argv)
    t_start = time.perf_counter()
    import numba

    from ..codegen import host_target
    from ..ops import linear_backward, linear_forward

    set_threads(args.threads)
    t_import = time.perf_counter() - t_start
    target = host_target()
    print(f"target {target.key} isa={target.isa} threads={numba.get_num_threads()} "
          f"{omp_wait_setting()}  {blas_description()}")
    rng = np.random.default_rng(0)
    rows, fwd_ratios, bwd_ratios = [], [], []
    t_first = None
    for kin, kout in SHAPES:
        n = args.batch
        x = rng.standard_normal((n, kin), dtype=np.float32)
        w = (rng.standard_normal((kout, kin), dtype=np.float32) / np.sqrt(kin)).astype(np.float32)
        b = rng.standard_normal(kout, dtype=np.float32)
        t0 = time.perf_counter()
        y = linear_forward(x, w, b, activation="relu")
        dy = rng.standard_normal(y.shape, dtype=np.float32)
        linear_backward(dy, x, w, y, activation="relu")
        if t_first is None:
            t_first = time.perf_counter() - t0
        flops = 2.0 * n * kin * kout
        out = np.empty_like(y)
        tf = do_bench(lambda: linear_forward(x, w, b, activation="relu", out=out), min_time=args.min_time)
        nf = do_bench(lambda: _numpy_forward(x, w, b), min_time=args.min_time)
        tb = do_bench(lambda: linear_backward(dy, x, w, y, activation="relu"), min_time=args.min_time)
        nb = do_bench(lambda: _numpy_backward(dy, x, w, y), min_time=args.min_time)
        fwd_ratios.append(nf.median / tf.median)
        bwd_ratios.append(nb.median / tb.median)
        rows.append((f"{kin}->{kout}", f"{flops / tf.median / 1e9:.1f} {tf.spread()}",
                     f"{flops / nf.median / 1e9:.1f}", f"{fwd_ratios[-1]:.2f}",
                     f"{2 * flops / tb.median / 1e9:.1f} {tb.spread()}", f"{2 * flops / nb.median / 1e9:.1f}",
                     f"{bwd_ratios[-1]:.2f}"))
    print_table(("K->M (N=%d)" % args.batch, "fwd GF/s", "numpy", "ratio", "bwd GF/s", "numpy", "ratio"), rows)
    print(f"median ratio  forward {statistics.median(fwd_ratios):.2f}   backward {statistics.median(bwd_ratios):.2f}")
    print(f"start-up: import {t_import:.2f} s, first forward+backward (compile or disk-cache load) {t_first:.2f} s")
    return 0
