"""python -m jitkern bench ops [--threads N] [--scale F]: the optimizer, cross-layer, sigmoid,
per-sample-weight, block and row-shard ops against NumPy doing the same work, in this process on the
same inputs.

Baselines: the same float32 work written in vectorised NumPy (the cross layer's GEMMs through
NumPy's BLAS; the embedding update through np.add.at, as ops/reference.py coalesces; the bf16
cross layer against the fp32 NumPy layer, as NumPy has no bf16 GEMM). The ratio is NumPy time /
jitkern time (> 1: jitkern is faster). Shapes are the
MLPerf DLRM-DCNv2's: n = 27 * 128, rank 512, batch 2048, tables of 1M rows at D = 128 with 4
lookups a sample; --scale shrinks them for a quick look.
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from .common import blas_description, do_bench, print_table, set_threads


def _cross_numpy(x0, xl, v, w, b, dxn):
    """The cross layer's forward and backward in NumPy + BLAS (what the op computes)."""
    u = xl @ v.T
    yb = u @ w.T + b
    x_next = x0 * yb + xl
    dy = dxn * x0
    du = dy @ w
    return x_next, dxn * yb, dxn + du @ v, du.T @ xl, dy.T @ u, dy.sum(0)


def _adagrad_numpy(p, st, g, lr, eps):
    st += g * g
    p -= lr * g / (np.sqrt(st) + eps)


def _split_sgd_numpy(hi, lo, g, lr):
    w = ((hi.bits.astype(np.uint32) << 16) | lo).view(np.float32)
    w -= np.float32(lr) * g
    bits = w.view(np.uint32)
    hi.bits[...], lo[...] = bits >> 16, bits & 0xFFFF


def _adagrad_exact_numpy(table, state, idx, off, dout, lr, eps=1e-8):
    bag = np.repeat(np.arange(len(off)), np.diff(np.append(off, len(idx))))
    rows, inv = np.unique(idx, return_inverse=True)
    g = np.zeros((len(rows), table.shape[1]), np.float32)
    np.add.at(g, inv, dout[bag])
    state[rows] += g * g
    table[rows] -= lr * g / (np.sqrt(state[rows]) + eps)


def _psw_numpy(table, idx, off, dout):
    bag = np.repeat(np.arange(len(off)), np.diff(np.append(off, len(idx))))
    return np.einsum("ij,ij->i", dout[bag], table[idx])


def _cases(rng, s):
    from .. import ops
    f32 = np.float32
    n, r, bsz = int(3456 * s) or 1, int(512 * s) or 1, int(2048 * s) or 1
    x0, xl, dxn = (rng.standard_normal((bsz, n), dtype=f32) for _ in range(3))
    v, w = (rng.standard_normal(sh, dtype=f32) / 30 for sh in ((r, n), (n, r)))
    b = rng.standard_normal(n, dtype=f32)
    x_next, u = ops.cross_layer_forward(x0, xl, v, w, b)

    keep = np.empty((bsz, n), f32)

    def jk_cross(x0=x0, xl=xl, v=v, w=w):  # y + b kept for the backward, as the DLRM and NumPy do
        xn, uu = ops.cross_layer_forward(x0, xl, v, w, b, out_y=keep)
        ops.cross_layer_backward(dxn, x0, xl, uu, v, w, b, y=keep)

    x0h, xlh, vh, wh = (ops.BF16Array.from_float32(a) for a in (x0, xl, v, w))

    size = max(1, int((4 << 20) * s))
    p, st, g = (rng.standard_normal(size, dtype=f32) for _ in range(3))
    st = np.abs(st)
    hi, lo = ops.split_float32(p)
    rows, dim, lookups = int(1_000_000 * s) or 1, 128, 4
    table, state = rng.standard_normal((rows, dim), dtype=f32), np.zeros((rows, dim), f32)
    idx = rng.integers(0, rows, bsz * lookups)
    off = np.arange(bsz, dtype=np.int64) * lookups
    dout = rng.standard_normal((bsz, dim), dtype=f32)
    logits = rng.standard_normal((bsz, 1024), dtype=f32)
    # a pooled table's 64 per-peer pieces in and out of a message buffer (64 ranks, D = 64)
    peers, piece, width = 64, max(1, bsz // 64), 64
    pooled = rng.standard_normal((peers * piece, width), dtype=f32)
    msg = np.empty(peers * piece * width, f32)
    at = np.arange(peers, dtype=np.int64) * piece * width
    starts = np.arange(peers, dtype=np.int64) * piece
    views = [msg[o:o + piece * width].reshape(piece, width) for o in at]
    summed = np.empty((piece, width), f32)

    def np_scatter():
        for q in range(peers):
            views[q][...] = pooled[q * piece:(q + 1) * piece]

    def np_sum():
        np.add(views[0], views[1], out=summed)
        for v in views[2:]:
            np.add(summed, v, out=summed)

    # a row-sharded table's lookups: one slice's bucketed by 64 shards, and a shard's segments
    # gathered from 64 peers (paper-small at 64 ranks: 32 samples x 100 lookups, 1M rows)
    from ..ops import blocks, reference
    nb, per, nrows = max(1, bsz // 64), 100, int(1_000_000 * s) or 64
    b_off = np.arange(nb, dtype=np.int64) * per
    b_idx = rng.integers(0, nrows, nb * per)
    bounds = -(-np.arange(peers + 1) * nrows // peers)
    b_out = (np.empty((peers, nb), np.int64), np.empty(nb * per, np.int64), np.empty(peers + 1, np.int64),
             np.empty(nb * per, np.int32))
    seg_src = rng.integers(0, nrows, peers * 50)
    seg_at, seg_len = np.arange(peers, dtype=np.int64) * 50, np.full(peers, 50, np.int64)
    segs = np.empty(peers * 50, np.int64)
    seg_views = [seg_src[a:a + n] for a, n in zip(seg_at, seg_len)]
    return [
        (f"cross layer fwd+bwd {bsz}x{n} r{r}", jk_cross, lambda: _cross_numpy(x0, xl, v, w, b, dxn)),
        (f"cross layer bf16 fwd+bwd {bsz}x{n} r{r} (vs fp32 NumPy)", lambda: jk_cross(x0h, xlh, vh, wh),
         lambda: _cross_numpy(x0, xl, v, w, b, dxn)),
        (f"adagrad_ {size:,}", lambda: ops.adagrad_(p, st, g, 1e-6, 1e-8), lambda: _adagrad_numpy(p, st, g, 1e-6, 1e-8)),
        (f"split_sgd_ {size:,}", lambda: ops.split_sgd_(hi, lo, g, 1e-6),
         lambda: _split_sgd_numpy(hi, lo, g, 1e-6)),
        (f"embedding_bag_adagrad_exact_ R={rows:,} D={dim} nnz={idx.size:,}",
         lambda: ops.embedding_bag_adagrad_exact_(table, state, idx, off, dout, 1e-6),
         lambda: _adagrad_exact_numpy(table, state, idx, off, dout, 1e-6)),
        (f"embedding_bag_per_sample_weights_backward nnz={idx.size:,}",
         lambda: ops.embedding_bag_per_sample_weights_backward(table, idx, off, dout),
         lambda: _psw_numpy(table, idx, off, dout)),
        (f"scatter_blocks {peers} blocks of {piece}x{width}",
         lambda: ops.scatter_blocks(pooled, msg, at, starts, starts + piece), np_scatter),
        (f"sum_blocks {peers} blocks of {piece}x{width}", lambda: ops.sum_blocks(msg, at, summed), np_sum),
        (f"bucket_by_shard {nb * per:,} lookups, {peers} shards",
         lambda: blocks.bucket_by_shard(b_off, b_idx, bounds, *b_out),
         lambda: reference.bucket_by_shard(b_off, b_idx, bounds)),
        (f"copy_segments {peers} segments of 50 int64", lambda: blocks.copy_segments(seg_src, seg_at, seg_len, segs),
         lambda: np.concatenate(seg_views, out=segs)),
        (f"sigmoid_forward {bsz}x1024", lambda: ops.sigmoid_forward(logits),
         lambda: 1.0 / (1.0 + np.exp(-logits))),
    ]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m jitkern bench ops", description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=None, help="threads for jitkern and the BLAS (default: all)")
    p.add_argument("--scale", type=float, default=1.0, help="shrink every shape by this factor (default 1)")
    p.add_argument("--min-time", type=float, default=0.3, help="seconds per measurement (default 0.3)")
    args = p.parse_args(argv)
    if not 0 < args.scale <= 1:
        p.error("--scale must be in (0, 1]")
    set_threads(args.threads)
    print(blas_description())
    rows = []
    t0 = time.perf_counter()
    for name, jk, npy in _cases(np.random.default_rng(0), args.scale):
        tj, tn = do_bench(jk, min_time=args.min_time), do_bench(npy, min_time=args.min_time, min_reps=3)
        rows.append((name, f"{tj.median * 1e3:.3f} {tj.spread()}", f"{tn.median * 1e3:.3f}", f"{tn.median / tj.median:.2f}"))
    print_table(("op", "jitkern ms", "numpy ms", "ratio"), rows)
    print(f"total {time.perf_counter() - t0:.1f} s")
    return 0
