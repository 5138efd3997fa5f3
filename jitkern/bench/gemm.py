"""python -m jitkern bench gemm [--threads N] [--precision {fp32,bf16}]: linear forward/backward on the DLRM MLP shapes.

fp32: against NumPy. Forward baseline: NumPy `np.maximum(x @ w.T + b, 0)`; backward baseline: the
masked gradient, `g @ w`, `g.T @ x` and `g.sum(0)`. Both run in this process on the same inputs;
the ratio is NumPy time / jitkern time (> 1: jitkern is faster).
bf16: jitkern's bf16 layers (BF16Array operands, bf16 y and dx as a bf16 model passes them on, fp32
dw and db) against its fp32 layers, each stage's GFLOP/s as a share of this core's measured bf16
dot-product peak (a vdpbf16ps loop; the fp32 FMA peak where bf16 is widened to fp32).
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


def _layer(rng, n, kin, kout):
    """x (n, kin), w (kout, kin), b (kout,) float32 of one MLP layer."""
    x = rng.standard_normal((n, kin), dtype=np.float32)
    w = (rng.standard_normal((kout, kin), dtype=np.float32) / np.sqrt(kin)).astype(np.float32)
    return x, w, rng.standard_normal(kout, dtype=np.float32)


def _bf16_table(args):
    """The bf16 layers against the fp32 ones, with each one's share of its peak."""
    import numba

    from .interaction import bf16_peak_gflops, fma_peak_gflops
    from ..ops import BF16Array, linear_backward, linear_forward

    threads = numba.get_num_threads()
    fp32_peak = max(fma_peak_gflops() for _ in range(3))
    measured = [bf16_peak_gflops() for _ in range(3)]
    bf16_peak = max(measured) if measured[0] else fp32_peak
    print(f"bf16 dot product: {'vdpbf16ps (avx512bf16)' if measured[0] else 'none: bf16 widened to fp32'}; "
          f"this core's measured peaks: fp32 FMA {fp32_peak:.0f} GFLOP/s, bf16 {bf16_peak:.0f} GFLOP/s"
          + (f"; shares below of {threads} x these" if threads > 1 else ""))
    rng = np.random.default_rng(0)
    rows, speedups = [], []
    for kin, kout in SHAPES:
        n = args.batch
        x, w, b = _layer(rng, n, kin, kout)
        xb, wb = BF16Array.from_float32(x), BF16Array.from_float32(w)
        y, yb = np.empty((n, kout), np.float32), BF16Array(np.empty((n, kout), np.uint16))
        linear_forward(x, w, b, activation="relu", out=y)
        linear_forward(xb, wb, b, activation="relu", out=yb)
        dy = rng.standard_normal((n, kout), dtype=np.float32)
        dyb = BF16Array.from_float32(dy)
        fns = {"f32 fwd": lambda: linear_forward(x, w, b, activation="relu", out=y),
               "bf16 fwd": lambda: linear_forward(xb, wb, b, activation="relu", out=yb),
               "f32 bwd": lambda: linear_backward(dy, x, w, y, activation="relu"),
               "bf16 bwd": lambda: linear_backward(dyb, xb, wb, yb, activation="relu", dx_dtype="bfloat16")}
        t = {name: do_bench(fn, min_time=args.min_time) for name, fn in fns.items()}
        flops = 2.0 * n * kin * kout
        gf = {name: (flops if "fwd" in name else 2 * flops) / t[name].median / 1e9 for name in t}
        speedups.append((t["f32 fwd"].median + t["f32 bwd"].median) / (t["bf16 fwd"].median + t["bf16 bwd"].median))
        rows.append((f"{kin}->{kout}", f"{gf['f32 fwd']:.1f}", f"{gf['bf16 fwd']:.1f} {t['bf16 fwd'].spread()}",
                     f"{gf['bf16 fwd'] / bf16_peak / threads:.0%}", f"{gf['f32 bwd']:.1f}",
                     f"{gf['bf16 bwd']:.1f} {t['bf16 bwd'].spread()}", f"{gf['bf16 bwd'] / bf16_peak / threads:.0%}",
                     f"{speedups[-1]:.2f}x"))
    print_table(("K->M (N=%d)" % args.batch, "fp32 fwd GF/s", "bf16 fwd GF/s", "of peak", "fp32 bwd GF/s",
                 "bf16 bwd GF/s", "of peak", "bf16 speed-up"), rows)
    print(f"median bf16 speed-up (forward + backward) {statistics.median(speedups):.2f}x")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m jitkern bench gemm", description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=None, help="threads for jitkern and the BLAS (default: all)")
    p.add_argument("--batch", type=int, default=2048, help="batch size N (default 2048)")
    p.add_argument("--min-time", type=float, default=0.4, help="seconds per measurement (default 0.4)")
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32",
                   help="fp32: against NumPy (default); bf16: bf16 layers against fp32 ones and the bf16 peak")
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
    if args.precision == "bf16":
        _bf16_table(args)
        return 0
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
