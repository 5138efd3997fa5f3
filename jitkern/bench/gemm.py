"""python -m jitkern bench gemm [--threads N] [--tune] [--precision {fp32,bf16}] [--cold]: linear
forward/backward on the DLRM MLP shapes.

fp32: against NumPy. Forward baseline: NumPy `np.maximum(x @ w.T + b, 0)`; backward baseline: the
masked gradient, `g @ w`, `g.T @ x` and `g.sum(0)`. Both run in this process on the same inputs;
the ratio is NumPy time / jitkern time (> 1: jitkern is faster).
bf16: jitkern's bf16 layers (BF16Array operands, bf16 y and dx as a bf16 model passes them on, fp32
dw and db) against its fp32 layers, each stage's GFLOP/s as a share of this core's measured bf16
dot-product peak (a vdpbf16ps loop; the fp32 FMA peak where bf16 is widened to fp32).

--cold streams twice the last-level cache through before each timed call (jitkern's and NumPy's
alike), so every operand comes from DRAM, as a layer's input does inside a training step; without
it, repeated calls find their operands in the caches.

--tune also times, for every GEMM those layers run (forward or its transposed form, dx, and dw or dwt, as
the layout knobs' heuristics pick them for the batch), the blocking
knob's heuristic against each candidate of the full tuning grid, and prints the heuristic's rate,
the best other candidate's and their time ratio (> 1: a candidate beats the heuristic).
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from ..codegen.tune import best_time
from ..config import omp_wait_setting
from .common import blas_description, cache_evictor, do_bench, print_table, set_threads

# (in, out) of the DLRM MLP layers, as in the issue
SHAPES = ((13, 512), (512, 256), (256, 64), (256, 128), (479, 1024), (1024, 1024), (1024, 512),
          (512, 256), (367, 512), (100, 1024))


def _numpy_forward(x, w, b):
    return np.maximum(x @ w.T + b, 0)


def _numpy_backward(dy, x, w, y, need_dx=True):
    g = np.where(y > 0, dy, 0)
    return g @ w if need_dx else None, g.T @ x, g.sum(axis=0)


def _thread_time_of(fn, min_time: float, min_reps: int = 3) -> float:
    """Fastest call of fn in the calling thread's CPU time (one-thread kernels run on it), over at
    least `min_reps` calls and `min_time` seconds of them."""
    best, total, reps = float("inf"), 0.0, 0
    while reps < min_reps or total < min_time:
        t0 = time.thread_time()
        fn()
        t = time.thread_time() - t0
        best, total, reps = min(best, t), total + t, reps + 1
    return best


def _timer(threads: int, min_time: float):
    return (lambda fn: _thread_time_of(fn, min_time)) if threads == 1 else (lambda fn: best_time(fn, min_time))


def _fastest(runs, timer, rounds: int) -> list[float]:
    """Per run, its fastest time over `rounds` interleaved rounds (a load burst hits all alike)."""
    times = [float("inf")] * len(runs)
    for _ in range(rounds):
        for i, fn in enumerate(runs):
            times[i] = min(times[i], timer(fn))
    return times


def tune_rows(batch: int, threads: int, rounds: int = 2, finalists: int = 3, min_time: float = 0.02):
    """Per GEMM of the SHAPES' layers: (variant, m x n x k, heuristic, its GFLOP/s, best other
    candidate of the full grid (one running other blocks than the heuristic's), its GFLOP/s, time
    ratio heuristic / best other). Every candidate is timed in `rounds` interleaved rounds; the
    heuristic and the `finalists` fastest others are then timed again, twice as long, and those
    fresh times decide: the fastest of many noisy first timings is biased low (it is the one whose
    noise was kindest), which would flatter the field against the heuristic."""
    from ..codegen.knobs import get
    from ..ops.gemm import DW_LAYOUT, FORWARD_LAYOUT
    from ..ops.gemm_knobs import shape_blocks
    timer = _timer(threads, min_time)
    problems = {}
    for kin, kout in SHAPES:  # the variants the layout knobs' heuristics run (a small batch: transposed)
        if FORWARD_LAYOUT.heuristic((batch, kout, kin, threads))["transposed"]:
            problems[("linear_forward_t", (kout, batch, kin, threads))] = None
        else:
            problems[("linear_forward", (batch, kout, kin, threads))] = None
        problems[("linear_dx", (batch, kin, kout, threads))] = None
        if DW_LAYOUT.heuristic((kout, kin, batch, threads))["transposed"]:
            problems[("linear_dwt", (kin, kout, batch, threads))] = None
        else:
            problems[("linear_dw", (kout, kin, batch, threads))] = None
    rows = []
    for variant, problem in problems:
        knob = get(f"gemm.blocks.{variant}")
        heur = dict(knob.heuristic(problem))
        blocks = lambda c: shape_blocks(c, *problem)  # noqa: E731  (candidates that run the same blocks are one point)
        seen = {blocks(heur)}
        cands = [heur]
        for c in knob.candidates(problem, False):
            if blocks(c) not in seen:
                seen.add(blocks(c))
                cands.append(dict(c))
        runs = [knob.runner(problem, c) for c in cands]
        for fn in runs:
            fn()
        first = _fastest(runs, timer, rounds)
        final = [0] + sorted(range(1, len(cands)), key=first.__getitem__)[:finalists]
        again = _fastest([runs[i] for i in final], timer, 2 * rounds)
        best = min(range(1, len(final)), key=again.__getitem__)
        m, n, k, _ = problem
        gf = lambda t: 2.0 * m * n * k / t / 1e9  # noqa: E731
        rows.append((variant, f"{m}x{n}x{k}", heur, gf(again[0]), cands[final[best]], gf(again[best]),
                     again[0] / again[best]))
    return rows


def _print_tune(rows) -> None:
    fmt = lambda p: f"mc={p['mc']},kc={p['kc']}"  # noqa: E731
    print_table(("GEMM", "m x n x k", "heuristic", "GF/s", "best other", "GF/s", "heur/best"),
                [(v, shape, fmt(h), f"{hg:.1f}", fmt(b), f"{bg:.1f}", f"{r:.2f}")
                 for v, shape, h, hg, b, bg, r in rows])
    worst = max(rows, key=lambda r: r[-1])
    print(f"heuristic within 10% of the best other candidate on {sum(r[-1] <= 1.1 for r in rows)}/{len(rows)} "
          f"GEMMs; worst {worst[0]} {worst[1]} {worst[-1]:.2f}")


def _layer(rng, n, kin, kout):
    """x (n, kin), w (kout, kin), b (kout,) float32 of one MLP layer."""
    x = rng.standard_normal((n, kin), dtype=np.float32)
    w = (rng.standard_normal((kout, kin), dtype=np.float32) / np.sqrt(kin)).astype(np.float32)
    return x, w, rng.standard_normal(kout, dtype=np.float32)


def _bf16_table(args):
    """The bf16 layers against the fp32 ones, with each one's share of its peak."""
    import numba

    from ..codegen.peaks import bf16_peak_gflops, fma_peak_gflops
    from ..ops import BF16Array, linear_backward, linear_forward
    from ..ops.gemm_bf16_kernel import bf16_tile

    threads = numba.get_num_threads()
    fp32_peak = max(fma_peak_gflops() for _ in range(3))
    measured = [bf16_peak_gflops() for _ in range(3)]
    native = bf16_tile()[0]  # the widened tile runs at the FMA peak, whatever the dot product's
    bf16_peak = max(measured) if native else fp32_peak
    print(f"bf16 dot product: {'vdpbf16ps (avx512bf16)' if native else 'not used: bf16 widened to fp32'}"
          + (f" (vdpbf16ps measured {max(measured):.0f} GFLOP/s)" if measured[0] and not native else "") + "; "
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
        t = {name: do_bench(fn, min_time=args.min_time, before=args.before) for name, fn in fns.items()}
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


def _print_first_layer(rng, n, bench):
    """The first layer's backward as a DLRM runs it (no dx; narrow inputs take the fused route)."""
    kin, kout = SHAPES[0]
    x = rng.standard_normal((n, kin), dtype=np.float32)
    w = rng.standard_normal((kout, kin), dtype=np.float32)
    y = np.maximum(rng.standard_normal((n, kout), dtype=np.float32), 0)
    dy = rng.standard_normal((n, kout), dtype=np.float32)
    from ..ops import linear_backward
    tb = bench(lambda: linear_backward(dy, x, w, y, activation="relu", need_dx=False))
    nb = bench(lambda: _numpy_backward(dy, x, w, y, need_dx=False))
    flops = 2.0 * n * kin * kout
    print(f"first layer {kin}->{kout} backward without dx: {flops / tb.median / 1e9:.1f} GF/s {tb.spread()}, "
          f"numpy {flops / nb.median / 1e9:.1f}, ratio {nb.median / tb.median:.2f}")


def _print_relu_masks(rng, n, bench):
    """The byte ReLU masks (linear_forward out_mask / linear_backward x_mask) against masking by the
    fp32 activation itself, on the DLRM layers whose dx is masked (kaggle's bottom MLP)."""
    from ..ops import linear_backward, linear_forward
    rows = []
    for kin, kout in ((512, 256), (256, 64)):
        x = np.maximum(rng.standard_normal((n, kin), dtype=np.float32), 0)
        w = rng.standard_normal((kout, kin), dtype=np.float32)
        dy = rng.standard_normal((n, kout), dtype=np.float32)
        h = rng.standard_normal((n, 367), dtype=np.float32)       # the layer that wrote x: h -> x
        wh = rng.standard_normal((kin, 367), dtype=np.float32)
        x_mask, dx, dw, y = np.empty(x.shape, np.bool_), np.empty_like(x), np.empty_like(w), np.empty_like(x)
        f_plain = bench(lambda: linear_forward(h, wh, activation="relu", out=y))
        f_mask = bench(lambda: linear_forward(h, wh, activation="relu", out=y, out_mask=x_mask))
        np.greater(x, 0, out=x_mask)
        by_x = bench(lambda: linear_backward(dy, x, w, input_relu=True, out_dx=dx, out_dw=dw))
        by_mask = bench(lambda: linear_backward(dy, x, w, input_relu=True, out_dx=dx, out_dw=dw, x_mask=x_mask))
        ref = bench(lambda: (np.where(x > 0, dy @ w, np.float32(0)), dy.T @ x, dy.sum(axis=0)))
        rows.append((f"{kin}->{kout}", f"{by_x.median * 1e3:.3f}", f"{by_mask.median * 1e3:.3f}",
                     f"{by_x.median / by_mask.median:.2f}", f"{ref.median / by_mask.median:.2f}",
                     f"{f_mask.median / f_plain.median:.2f}"))
    print_table(("ReLU masks (N=%d)" % n, "bwd ms, by x", "by x_mask", "speed-up", "vs numpy",
                 "fwd time, with / without out_mask"), rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m jitkern bench gemm", description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=None, help="threads for jitkern and the BLAS (default: all)")
    p.add_argument("--batch", type=int, default=2048, help="batch size N (default 2048)")
    p.add_argument("--min-time", type=float, default=0.4, help="seconds per measurement (default 0.4)")
    p.add_argument("--tune", action="store_true",
                   help="also time each GEMM's blocking heuristic against the full tuning grid")
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32",
                   help="fp32: against NumPy (default); bf16: bf16 layers against fp32 ones and the bf16 peak")
    p.add_argument("--cold", action="store_true",
                   help="evict the caches before each timed call: operands from DRAM, as inside a training step")
    args = p.parse_args(argv)
    args.before = cache_evictor() if args.cold else None
    t_start = time.perf_counter()
    import numba

    from ..codegen import host_target
    from ..ops import linear_backward, linear_forward

    set_threads(args.threads)
    t_import = time.perf_counter() - t_start
    target = host_target()
    # one thread: jitkern and the BLAS both run on this thread, so its CPU time is their time
    clock = time.thread_time if numba.get_num_threads() == 1 else time.perf_counter
    print(f"target {target.key} isa={target.isa} threads={numba.get_num_threads()} "
          f"{omp_wait_setting()}  {blas_description()}  clock={clock.__name__}"
          + ("  operands cold (caches evicted before each call)" if args.cold else ""))
    if args.precision == "bf16":
        _bf16_table(args)
        return 0
    rng = np.random.default_rng(0)
    rows, fwd_ratios, bwd_ratios = [], [], []

    def bench(fn):
        return do_bench(fn, min_time=args.min_time, clock=clock, before=args.before)

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
        tf = bench(lambda: linear_forward(x, w, b, activation="relu", out=out))
        nf = bench(lambda: _numpy_forward(x, w, b))
        tb = bench(lambda: linear_backward(dy, x, w, y, activation="relu"))
        nb = bench(lambda: _numpy_backward(dy, x, w, y))
        fwd_ratios.append(nf.median / tf.median)
        bwd_ratios.append(nb.median / tb.median)
        rows.append((f"{kin}->{kout}", f"{flops / tf.median / 1e9:.1f} {tf.spread()}",
                     f"{flops / nf.median / 1e9:.1f}", f"{fwd_ratios[-1]:.2f}",
                     f"{2 * flops / tb.median / 1e9:.1f} {tb.spread()}", f"{2 * flops / nb.median / 1e9:.1f}",
                     f"{bwd_ratios[-1]:.2f}"))
    print_table(("K->M (N=%d)" % args.batch, "fwd GF/s", "numpy", "ratio", "bwd GF/s", "numpy", "ratio"), rows)
    print(f"median ratio  forward {statistics.median(fwd_ratios):.2f}   backward {statistics.median(bwd_ratios):.2f}")
    _print_first_layer(rng, args.batch, bench)
    _print_relu_masks(rng, args.batch, bench)
    print(f"start-up: import {t_import:.2f} s, first forward+backward (compile or disk-cache load) {t_first:.2f} s")
    if args.tune:
        _print_tune(tune_rows(args.batch, numba.get_num_threads()))
    return 0
