"""python -m jitkern bench embedding [--threads N] [--quick] [--quantized]: embedding-bag forward and fused SGD.

Per table size R and width D, one table is allocated and shared by every implementation (torch
sees it through torch.from_numpy): by default as jitkern and its DLRM allocate tables
(ops.empty_table: 64-byte aligned like torch's own tensors, on huge pages where the OS offers
them), with --alloc numpy as np.full does (16-byte aligned, 4 KiB pages). Each timing loop
takes the next of several pre-drawn batches per call, as training does (together they touch
twice the last-level cache in rows, 96 MiB at least: from memory, not from a cache the previous
call warmed; --same-batch repeats one). Then for each index draw (uniform pooling 1 and 20,
Zipf-skewed pooling 20) the forward and the update are timed against NumPy and, when importable,
torch.
Rows/s count looked-up (forward) or updated (SGD) index entries; GB/s counts the table bytes those
rows move (read for forward, read + write for updates), next to this machine's copy bandwidth.
--quantized times the 8- and 4-bit row-wise quantized forward instead (bench_quantized).
"""
from __future__ import annotations

import argparse

import numpy as np

from .. import ops
from ..ops import SplitBF16Table
from ..ops.embedding._knobs import pool_bytes
from .common import copy_bandwidth_gbs, do_bench, print_table, set_threads, torch_or_none

LR = 0.01


def draw_batch(rng, num_rows, batch, pooling, dist):
    """indices (B * pooling,) int64 and offsets (B,) int64: uniform rows, or Zipf(1.1)-skewed ones."""
    nnz = batch * pooling
    if dist == "zipf":
        ranks = rng.zipf(1.1, nnz) - 1
        # scatter the hot ranks over the table (a fixed odd multiplier permutes Z/RZ for odd-free R)
        idx = (ranks % num_rows) * 2654435761 % num_rows
    else:
        idx = rng.integers(0, num_rows, nnz)
    return idx.astype(np.int64), np.arange(batch, dtype=np.int64) * pooling


def _numpy_forward(w, idx, off):
    return np.add.reduceat(w.take(idx, axis=0), off, axis=0)


def _numpy_add_at_sgd(w, idx, off, dout, pooling):
    np.add.at(w, idx, np.repeat(dout * np.float32(-LR), pooling, axis=0))


def _bench_table(rng, num_rows, dim, batch, dists, torch, rows_out, notes, alloc="jitkern", same_batch=False):
    if alloc == "numpy":
        w = np.full((num_rows, dim), 0.01, np.float32)
    else:
        w = ops.empty_table(num_rows, dim)
        w.fill(0.01)  # touch every page: no zero-page reads
    split = SplitBF16Table.from_float32(w) if dim == 128 else None
    tw = torch.from_numpy(w) if torch else None
    for pooling, dist in dists:
        n = 1 if same_batch else _pool_size(batch * pooling * dim * 4, batch * pooling)
        pool = [draw_batch(rng, num_rows, batch, pooling, dist) for _ in range(n)]
        idx, off = pool[0]
        nnz = len(idx)
        dout = rng.standard_normal((batch, dim)).astype(np.float32)
        case = f"R={num_rows:.0e} D={dim} {dist} p={pooling}"
        fwd_bytes, upd_bytes = nnz * dim * 4, 2 * nnz * dim * 4
        out = np.empty((batch, dim), np.float32)

        def each(make):
            """One call per pooled batch, taken in turn."""
            return _cycle([make(i, o) for i, o in pool])

        runs = [("forward", "jitkern", fwd_bytes,
                 each(lambda i, o: lambda: ops.embedding_bag_forward(w, i, o, out=out))),
                ("forward", "numpy take+reduceat", fwd_bytes, each(lambda i, o: lambda: _numpy_forward(w, i, o)))]
        if split is not None:
            runs.append(("forward", "jitkern bf16", fwd_bytes // 2,
                         each(lambda i, o: lambda: ops.embedding_bag_forward(split, i, o, out=out))))
        if torch:
            runs.append(("forward", "torch embedding_bag", fwd_bytes, each(
                lambda i, o: (lambda ti, to: lambda: torch.nn.functional.embedding_bag(ti, tw, to, mode="sum"))(
                    torch.from_numpy(i), torch.from_numpy(o)))))
        runs.append(("sgd update", "jitkern fused", upd_bytes,
                     each(lambda i, o: lambda: ops.embedding_bag_sgd_(w, i, o, dout, LR))))
        if split is not None:
            runs.append(("sgd update", "jitkern fused bf16", upd_bytes,
                         each(lambda i, o: lambda: ops.embedding_bag_sgd_(split, i, o, dout, LR))))
        runs.append(("sgd update", "numpy add.at", upd_bytes,
                     each(lambda i, o: lambda: _numpy_add_at_sgd(w, i, o, dout, pooling))))
        if torch:
            runs.append(("sgd update", "torch sparse bwd+SGD.step", upd_bytes,
                         each(lambda i, o: _torch_step(torch, tw, i, o, dout))))
        if dist == "uniform" and pooling > 1:
            notes.append(f"{case}: fused SGD bit-identical over 3 runs: {_deterministic(w, idx, off, dout)}")
        base, timed = {}, {}
        for _, impl, _, fn in runs:  # every impl once through the whole pool before any is timed:
            for _ in pool:           # the first pass pays the rows' first trip from DRAM (and, with a
                fn()                 # large L3, leaves them there for whoever runs next)
        for _ in range(ROUNDS):      # interleaved rounds, the best median of each: a load burst hits all alike
            for op, impl, nbytes, fn in runs:
                t = do_bench(fn, warmup=2, min_reps=5, min_time=0.3 / ROUNDS)
                if impl not in timed or t.median < timed[impl].median:
                    timed[impl] = t
        for op, impl, nbytes, fn in runs:
            t = timed[impl]
            base.setdefault(op, {})[impl] = t.median
            rows_out.append([case, op, impl, f"{t.median * 1e3:.3f}", t.spread(), f"{nnz / t.median / 1e6:.1f}",
                             f"{nbytes / t.median / 1e9:.2f}", "", ""])
        for row in rows_out[-len(runs):]:
            mine = base[row[1]][row[2]]
            numpy_t = base[row[1]]["numpy take+reduceat" if row[1] == "forward" else "numpy add.at"]
            ref = base[row[1]].get("torch embedding_bag" if row[1] == "forward" else "torch sparse bwd+SGD.step")
            row[-2] = f"{(ref or numpy_t) / mine:.2f}x"
            row[-1] = f"{numpy_t / mine:.1f}x" if row[2].startswith("jitkern") else ""


ROUNDS = 5              # interleaved timing rounds per case (the same time in all: more turns, not more reps)
POOL_BYTES = 96 << 20   # table bytes the batches of one timing loop touch in all at least
INDEX_BYTES = 256 << 20  # index memory a pool may hold (it caps the pools of narrow rows)


def _pool_size(batch_bytes: int, nnz: int) -> int:
    """How many batches each timing loop cycles through: training sees a new batch every step, so
    rows should come from memory, not from a cache the previous call warmed. Their rows cover as
    many bytes as the tuner's pools (ops.embedding._knobs.pool_bytes: twice the last-level
    cache), 96 MiB at least."""
    want = max(POOL_BYTES, pool_bytes())
    return int(min(max(1, INDEX_BYTES // (16 * nnz)), max(4, -(-want // batch_bytes))))


def _cycle(fns):
    state = [0]

    def call():
        k = state[0]
        state[0] = k + 1 if k + 1 < len(fns) else 0
        return fns[k]()
    return call


def _deterministic(w, idx, off, dout, repeats=3):
    """Whether repeated fused SGD updates from the same start give bit-identical rows."""
    rows = np.unique(idx)
    start = w[rows]
    results = []
    for _ in range(repeats):
        w[rows] = start
        ops.embedding_bag_sgd_(w, idx, off, dout, LR)
        results.append(w[rows].view(np.uint32).copy())
    return all(np.array_equal(r, results[0]) for r in results[1:])


def _torch_step(torch, tw, idx, off, dout):
    """Backward of a sparse-gradient embedding_bag plus SGD.step on the shared table (graph kept)."""
    param = torch.nn.Parameter(tw, requires_grad=True)
    opt = torch.optim.SGD([param], lr=LR)
    out = torch.nn.functional.embedding_bag(torch.from_numpy(idx), param, torch.from_numpy(off),
                                            mode="sum", sparse=True)
    tdout = torch.from_numpy(dout)

    def step():
        out.backward(tdout, retain_graph=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m jitkern bench embedding", description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=1, help="threads for jitkern, NumPy and torch (default 1)")
    p.add_argument("--quick", action="store_true", help="R=1e6, D=16 and 128 only")
    p.add_argument("--rows", type=float, nargs="+", help="table sizes R (default 1e6 1e7)")
    p.add_argument("--dims", type=int, nargs="+", help="widths D (default 16 64 128)")
    p.add_argument("--batch", type=int, default=2048)
    p.add_argument("--no-torch", action="store_true", help="skip the torch baselines")
    p.add_argument("--alloc", choices=("jitkern", "numpy"), default="jitkern",
                   help="table memory: ops.empty_table (default) or np.full")
    p.add_argument("--same-batch", action="store_true",
                   help="one batch per case, repeated (its rows stay cached between calls), "
                        "instead of a new one per call")
    p.add_argument("--quantized", action="store_true",
                   help="8- and 4-bit quantized bag forward against torch's quantized ops (D 64 128 by default)")
    args = p.parse_args(argv)
    set_threads(args.threads)
    torch = None if args.no_torch else torch_or_none()
    if args.quantized:
        return bench_quantized(args, torch)
    rows = [int(r) for r in (args.rows or ([1e6] if args.quick else [1e6, 1e7]))]
    dims = args.dims or ([16, 128] if args.quick else [16, 64, 128])
    dists = [(1, "uniform"), (20, "uniform"), (20, "zipf")]
    bw = copy_bandwidth_gbs()
    batches = "one batch repeated" if args.same_batch else "a new batch per call"
    with_torch = "yes" if torch else ("skipped" if args.no_torch else "not installed")
    print(f"embedding bags: B={args.batch}, threads={args.threads}, tables from {args.alloc}, {batches}, "
          f"copy bandwidth {bw:.1f} GB/s, torch {with_torch}; ratio = baseline time / this time "
          "(baseline: torch when present, else NumPy); vs numpy: NumPy time / this time")
    rng = np.random.default_rng(0)
    table, notes = [], []
    for r in rows:
        for d in dims:
            _bench_table(rng, r, d, args.batch, dists, torch, table, notes, args.alloc, args.same_batch)
    print_table(["case", "op", "impl", "ms", "spread", "Mrows/s", "GB/s", "ratio", "vs numpy"], table)
    print(f"threads={args.threads}:", *notes, sep="\n  ")
    return 0


def _quantized_table(rng, num_rows, dim, bits):
    """A packed table of random values with valid per-row scales and biases (no fp32 table first:
    one of 1e7 x 128 floats would take 5 GB)."""
    from ..ops.embedding.quantized import QuantizedTable, q_bytes, quantize_rowwise, row_bytes
    data = ops.empty_table(num_rows, row_bytes(dim, bits), np.uint8)
    step = 1 << 20
    block = quantize_rowwise(rng.standard_normal((step, dim), dtype=np.float32), bits).data
    nq = q_bytes(dim, bits)
    for r in range(0, num_rows, step):
        n = min(step, num_rows - r)
        data[r:r + n, :nq] = rng.integers(0, 256, (n, nq), dtype=np.uint8)
        data[r:r + n, nq:] = block[:n, nq:]
    return QuantizedTable(data, bits, dim)


def _torch_quantized(torch, table, bits):
    op = torch.ops.quantized.embedding_bag_byte_rowwise_offsets if bits == 8 else \
        torch.ops.quantized.embedding_bag_4bit_rowwise_offsets
    tw = torch.from_numpy(table.data)
    return lambda i, o: (lambda ti, to: lambda: op(tw, ti, to, False, 0, False, None, None, False))(
        torch.from_numpy(i), torch.from_numpy(o))


QUANT_ROUNDS = 5  # timing rounds per quantized case, jitkern and torch in turn


def _best_of_rounds(runs, rounds=QUANT_ROUNDS):
    """{impl: Timing of its fastest round}: the impls are timed in turn each round, so on a shared
    machine both see the same load, and a burst of someone else's work spoils one round, not a side."""
    best = {}
    for _ in range(rounds):
        for impl, fn in runs:
            t = do_bench(fn, warmup=2, min_reps=5, min_time=0.06)
            if impl not in best or t.median < best[impl].median:
                best[impl] = t
    return best


def _quantized_case(args, torch, rng, qt, pooling, table):
    """Time one (table, pooling) case; appends a row per impl to `table`."""
    r, d = qt.shape
    nbytes = args.batch * pooling * qt.data.shape[1]
    pool = [draw_batch(rng, r, args.batch, pooling, "uniform")
            for _ in range(1 if args.same_batch else _pool_size(nbytes, args.batch * pooling))]
    out = np.empty((args.batch, d), np.float32)
    runs = [("jitkern", _cycle([(lambda i, o: lambda: ops.embedding_bag_quantized_forward(qt, i, o, out=out))(i, o)
                                for i, o in pool]))]
    if torch:
        make = _torch_quantized(torch, qt, qt.bits)
        runs.append(("torch", _cycle([make(i, o) for i, o in pool])))
    times = _best_of_rounds(runs)
    for impl, t in times.items():
        ratio = f"{times['torch'].median / t.median:.2f}x" if torch and impl == "jitkern" else ""
        table.append([f"R={r:.0e} D={d} {qt.bits}-bit p={pooling}", impl, f"{t.median * 1e3:.3f}", t.spread(),
                      f"{args.batch * pooling / t.median / 1e6:.1f}", f"{nbytes / t.median / 1e9:.2f}", ratio])


def bench_quantized(args, torch) -> int:
    """Quantized bag forward (sum), jitkern against torch's quantized ops, a new batch per call."""
    rows = [int(r) for r in (args.rows or ([1e6] if args.quick else [1e6, 1e7]))]
    dims = args.dims or [64, 128]
    print(f"quantized embedding bags: B={args.batch}, threads={args.threads}, "
          f"{'one batch repeated' if args.same_batch else 'a new batch per call'}, "
          f"torch {'yes' if torch else 'no'}; each impl's fastest of {QUANT_ROUNDS} alternating rounds "
          "(median and spread within it); ratio = torch time / jitkern time")
    rng = np.random.default_rng(0)
    table = []
    for r in rows:
        for d in dims:
            for bits in (8, 4):
                qt = _quantized_table(rng, r, d, bits)
                for pooling in (1, 20):
                    _quantized_case(args, torch, rng, qt, pooling, table)
                del qt
    print_table(["case", "impl", "ms", "spread", "Mrows/s", "GB/s", "ratio"], table)
    return 0
