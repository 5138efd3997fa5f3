"""Measured peaks of this core: the float32 FMA throughput at the target ISA's vector width and
the bf16 dot-product (vdpbf16ps) throughput, each from register-only loops of independent chains,
timed in this thread's CPU time (the fastest of several runs: load can only hide a peak). The
bench layer reports stages against them; the bf16 GEMM compares them to choose its tile."""
from __future__ import annotations

import time

import numpy as np

from . import vec as V
from .build import jit
from .simd_bf16 import dp_peak_loop
from .target import host_target


@jit()
def _fma_loop16(x, n):
    # 8 independent 16-lane FMA chains: 8 zmm accumulators keep two 512-bit FMA pipes busy
    c0 = c1 = c2 = c3 = c4 = c5 = c6 = c7 = V.vzero(16)
    m = V.vsplat(x, 16)
    for _ in range(n):
        c0, c1, c2, c3 = V.vfma(m, c0, m), V.vfma(m, c1, m), V.vfma(m, c2, m), V.vfma(m, c3, m)
        c4, c5, c6, c7 = V.vfma(m, c4, m), V.vfma(m, c5, m), V.vfma(m, c6, m), V.vfma(m, c7, m)
    out = np.empty(16, np.float32)
    V.vstore(out, 0, V.vadd(V.vadd(V.vadd(c0, c1), V.vadd(c2, c3)), V.vadd(V.vadd(c4, c5), V.vadd(c6, c7))))
    return out[0]


@jit()
def _fma_loop8(x, n):
    # 12 independent 8-lane chains: enough for two FMA pipes of latency <= 6 within 16 ymm registers
    # (16 lanes in ymm halves would need 17 registers and spill)
    c0 = c1 = c2 = c3 = c4 = c5 = c6 = c7 = c8 = c9 = c10 = c11 = V.vzero(8)
    m = V.vsplat(x, 8)
    for _ in range(n):
        c0, c1, c2, c3 = V.vfma(m, c0, m), V.vfma(m, c1, m), V.vfma(m, c2, m), V.vfma(m, c3, m)
        c4, c5, c6, c7 = V.vfma(m, c4, m), V.vfma(m, c5, m), V.vfma(m, c6, m), V.vfma(m, c7, m)
        c8, c9, c10, c11 = V.vfma(m, c8, m), V.vfma(m, c9, m), V.vfma(m, c10, m), V.vfma(m, c11, m)
    out = np.empty(8, np.float32)
    s = V.vadd(V.vadd(V.vadd(c0, c1), V.vadd(c2, c3)), V.vadd(V.vadd(c4, c5), V.vadd(c6, c7)))
    V.vstore(out, 0, V.vadd(s, V.vadd(V.vadd(c8, c9), V.vadd(c10, c11))))
    return out[0]


def _fastest(loop, x, n, reps):
    """The fastest of `reps` runs of loop(x, n) after one untimed, in this thread's CPU time: a peak,
    which load can only hide."""
    loop(x, n)
    best = float("inf")
    for _ in range(reps):
        t0 = time.thread_time()
        loop(x, n)
        best = min(best, time.thread_time() - t0)
    return best


def fma_peak_gflops(n=2_000_000, reps=7):
    """This core's measured float32 FMA throughput (2 flops per lane per FMA), in GFLOP/s, at the
    target ISA's vector width: the fastest of `reps` runs (_fastest)."""
    loop, flops = (_fma_loop16, 8 * 16 * 2 * n) if host_target().vector_width >= 16 else (_fma_loop8, 12 * 8 * 2 * n)
    return flops / _fastest(loop, np.float32(0.5), n, reps) / 1e9


@jit()
def _dp_loop(x, n):
    # 12 independent vdpbf16ps chains (AVX512_BF16 only)
    return dp_peak_loop(n, x)


def bf16_peak_gflops(n=2_000_000, reps=7):
    """This core's measured bf16 dot-product throughput in GFLOP/s (vdpbf16ps: 16 lanes x 2 products,
    2 flops each), timed as the FMA peak is (_fastest), or None where the target has no bf16 dot
    product."""
    if not host_target().has("avx512bf16"):
        return None
    return 12 * 16 * 4 * n / _fastest(_dp_loop, np.float32(0.5), n, reps) / 1e9
