"""python -m jitkern bench interaction [--threads N] [--batch B]: dot interaction forward + backward.

Baselines measured in the same run: NumPy (batched matmul + tril gather, and the scatter + two
matmuls backward) and, when importable, PyTorch autograd on the reference DLRM's
`interact_features` (cat + bmm + tril gather). jitkern takes ly as the list of T (B, D) arrays the
embedding bags produce, as the torch baseline does. GFLOP/s count the useful work only:
2*B*P*D forward + 4*B*P*D backward.
"""
from __future__ import annotations

import argparse

import numpy as np

from ..codegen.peaks import fma_peak_gflops
from ..ops import interaction as K
from ..ops.reference import interaction_pairs
from .common import blas_description, do_bench, print_table, set_threads, torch_or_none

SHAPES = ((26, 16), (26, 64), (26, 128), (8, 64))  # (T, D): DLRM Criteo Kaggle/Terabyte-like, small


def numpy_dot_forward_backward(x, ly, dz):
    """The NumPy baseline: stacked batched matmul + tril gather, scatter + two matmuls back."""
    b, d = x.shape
    t = np.concatenate([x[:, None, :], np.stack(ly, axis=1)], axis=1)  # (B, F, D)
    li, lj = interaction_pairs(t.shape[1])
    zz = np.matmul(t, t.transpose(0, 2, 1))
    z = np.concatenate([x, zz[:, li, lj]], axis=1)
    dzz = np.zeros_like(zz)
    dzz[:, li, lj] = dz[:, d:]
    dt = np.matmul(dzz, t) + np.matmul(dzz.transpose(0, 2, 1), t)
    dx = dt[:, 0] + dz[:, :d]
    return z, dx, dt[:, 1:]


def torch_interact_features(torch, x, ly):
    """The reference DLRM's dot interaction (dlrm_s_pytorch.py, interact_features), unchanged."""
    (batch_size, d) = x.shape
    T = torch.cat([x] + ly, dim=1).view((batch_size, -1, d))
    Z = torch.bmm(T, torch.transpose(T, 1, 2))
    _, ni, nj = Z.shape
    li = torch.tensor([i for i in range(ni) for j in range(i)])
    lj = torch.tensor([j for i in range(nj) for j in range(i)])
    Zflat = Z[:, li, lj]
    return torch.cat([x] + [Zflat], dim=1)


def _torch_step(torch, x, ly, dz):
    xt = torch.from_numpy(x).requires_grad_()
    lyt = [torch.from_numpy(a).requires_grad_() for a in ly]
    dzt = torch.from_numpy(dz)

    def step():
        xt.grad = None
        for a in lyt:
            a.grad = None
        torch_interact_features(torch, xt, lyt).backward(dzt)
    return step


def _best_of(rounds, fns):
    """Per name, the lowest median over `rounds` interleaved timing rounds (robust to load bursts)."""
    best = {}
    for _ in range(rounds):
        for name, fn in fns.items():
            t = do_bench(fn, warmup=1, min_reps=3, min_time=0.15)
            if name not in best or t.median < best[name].median:
                best[name] = t
    return best


def run(batch, threads, shapes=SHAPES, rounds=3):
    torch = torch_or_none()
    rng = np.random.default_rng(0)
    rows = []
    for n in threads:
        set_threads(n)
        for T, D in shapes:
            x = rng.standard_normal((batch, D), dtype=np.float32)
            ly = [rng.standard_normal((batch, D), dtype=np.float32) for _ in range(T)]
            P = K.num_pairs(T + 1)
            dz = rng.standard_normal((batch, D + P), dtype=np.float32)
            fns = {"fwd": lambda: K.interaction_dot_forward(x, ly),
                   "bwd": lambda: K.interaction_dot_backward(dz, x, ly),
                   "numpy": lambda: numpy_dot_forward_backward(x, ly, dz)}
            if torch is not None:
                fns["torch"] = _torch_step(torch, x, ly, dz)
            t = _best_of(rounds, fns)
            ours = t["fwd"].median + t["bwd"].median
            row = [T, D, n, f"{t['fwd'].median * 1e3:.2f}", f"{t['bwd'].median * 1e3:.2f}", f"{ours * 1e3:.2f}",
                   f"{6.0 * batch * P * D / ours / 1e9:.1f}", f"{t['numpy'].median * 1e3:.2f}",
                   f"{t['numpy'].median / ours:.1f}x"]
            if torch is not None:
                row += [f"{t['torch'].median * 1e3:.2f}", f"{t['torch'].median / ours:.1f}x"]
            rows.append(row)
    headers = ["T", "D", "thr", "fwd ms", "bwd ms", "jitkern ms", "GFLOP/s", "numpy ms", "vs numpy"]
    if torch is not None:
        headers += ["torch ms", "vs torch"]
    return headers, rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jitkern bench interaction", description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=None, help="run only this thread count (default: 1 and 2)")
    ap.add_argument("--batch", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds; the best median is kept")
    args = ap.parse_args(argv)
    torch = torch_or_none()
    print(f"dot interaction forward + backward, B={args.batch}, ly as T x (B, D) float32, "
          f"best of {args.rounds} interleaved rounds; "
          f"{blas_description()}; torch: {torch.__version__ if torch else 'not installed'}")
    set_threads(1)
    print(f"this core's measured FMA peak: {fma_peak_gflops():.0f} GFLOP/s (1 thread)")
    headers, rows = run(args.batch, [args.threads] if args.threads else [1, 2], rounds=args.rounds)
    print_table(headers, rows)
    return 0
