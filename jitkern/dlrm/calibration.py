"""Rates of the cost model measured on this CPU, at the shapes one rank of P runs: the dense
stages (MLPs, interaction, loss) of a train step at a batch slice, each table piece's embedding
forward and sparse update at its own shape, and small fixed costs (copies, NumPy calls, block
ops, bucketing, the code around each sharding's calls). `python -m jitkern scale` and `bench dist`
predict step times from them (scale.py, costmodel.py).
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

import numpy as np

from ..codegen.tune import cache_evictor
from .configs import ModelConfig
from .costmodel import Rates

MEASURE_BYTES = 1 << 30      # table pieces up to this size are timed; larger ones use the analytic rates


# Rates are this thread's CPU time (kernels run on one thread here): what the work costs on a core
# of its own, even where other processes share the machine; fixed costs the fastest of several
# calls, stages and table pieces their median (the model predicts a typical step).
CLOCK = time.thread_time


def _cpu_seconds(fn, reps, before=None, pick=min):
    """pick (default: the fastest) of `reps` timed calls after one untimed, in CPU seconds of this
    thread; before: called untimed ahead of each."""
    fn()
    times = []
    for _ in range(reps):
        if before is not None:
            before()
        t0 = CLOCK()
        fn()
        times.append(CLOCK() - t0)
    return float(pick(times))


class DenseStages(dict):
    """Seconds per dense stage (the median over timed steps), with the spread of the steps' dense
    seconds (step_spread), which sets how long ranks wait for each other (costmodel.sync_wait):
    `sd` as given, or from the timed steps (`steps`: each step's dense seconds but the dense
    update's, `updates`: the update's) by spread(nranks)."""
    sd = 0.0
    steps = updates = None

    def spread(self, nranks: int = 1) -> float:
        """The spread of one rank's dense seconds on nranks ranks: each updates 1/nranks of the MLPs
        (dense_shard.py), so the update's own variation counts at that share."""
        if self.steps is None:
            return self.sd
        return step_spread(self.steps + self.updates / nranks)


def step_spread(seconds) -> float:
    """The standard deviation of step times, estimated from their median absolute deviation
    (x 1.4826, the factor that makes it sigma for normal data): sync_wait models ranks' normal
    step-to-step variation, and on a shared machine one step of 7 slowed by another tenant would
    otherwise set it (np.std of such a sample swung 0.3-7 ms at 32 rows between runs)."""
    x = np.asarray(seconds, float)
    if x.size < 2:
        return 0.0
    return float(1.4826 * np.median(np.abs(x - np.median(x))))


# Steps timed per size at least, where they fit in SPREAD_SECONDS: the spread (and so the sync
# wait) from 7 steps of a 7 ms step ranged 0.06-0.54 ms between blocks of one run, from 31 0.16-0.30
SPREAD_STEPS = 31
SPREAD_SECONDS = 1.0


def measure_dense(cfg: ModelConfig, rows, reps: int = 5) -> DenseStages | dict:
    """Per-stage seconds of a train step at `rows` (one size, or several: -> {rows: stages}), tables
    shrunk to 4 rows (their cost is not wanted). Each stage's median of `reps` steps (a measured
    step is a typical one, not the luckiest: the sum of per-stage minima fell 3-7% short of it),
    or of up to SPREAD_STEPS where they take under SPREAD_SECONDS (small slices: their spread
    needs the samples); several sizes are timed in turns, so every size sees the machine as the
    others do. Before each timed step, as many bytes stream through the caches as one rank's
    tables move in a step at that slice (table_traffic): the MLPs' weights find the caches as the
    lookups left them."""
    from ..codegen.target import host_target
    from .model import DLRM, StageTimer

    sizes = sorted({int(r) for r in np.atleast_1d(rows)})
    tiny = dataclasses.replace(cfg, sizes=(4,) * len(cfg.sizes))
    m = DLRM(**tiny.model_kwargs(), seed=0)
    m.timer = timer = StageTimer(CLOCK)
    llc = max(host_target().l3, 1 << 20)
    evict = {r: cache_evictor(min(table_traffic(cfg, r), 2 * llc)) for r in sizes}
    batches, steps = {}, {}
    for r in sizes:
        b = config_batch(tiny, r)
        batches[r] = (b.dense, b.offsets, b.indices, b.labels)
        m.train_step(*batches[r], 0.01)
        t0 = time.perf_counter()
        evict[r]()
        m.train_step(*batches[r], 0.01)
        steps[r] = max(reps, min(SPREAD_STEPS, int(SPREAD_SECONDS / max(time.perf_counter() - t0, 1e-6))))
    seen = {r: {} for r in sizes}
    for i in range(max(steps.values())):
        for r in sizes:
            if i >= steps[r]:
                continue
            evict[r]()
            timer.reset()
            m.train_step(*batches[r], 0.01, check=False)
            for k, v in timer.seconds.items():
                if not k.startswith("embedding"):
                    seen[r].setdefault(k, []).append(v)
    best = {}
    for r in sizes:
        best[r] = st = DenseStages((k, float(np.median(v))) for k, v in seen[r].items())
        per_step = {k: np.asarray(v) for k, v in seen[r].items()}
        st.updates = per_step.pop("dense_upd", np.zeros(steps[r]))
        st.steps = np.sum(list(per_step.values()), axis=0)
        st.sd = st.spread(1)
    return best if np.ndim(rows) else best[sizes[0]]


def table_traffic(cfg: ModelConfig, rows: int) -> int:
    """Bytes of table rows one rank moves through its caches in a step with a batch slice of
    `rows` rows, the tables evenly shared: each of the slice's lookups read in the forward and read
    and written again by the update (whatever the sharding, P ranks together look up P slices)."""
    return int(rows * sum(cfg.pooling) * cfg.dim * 4 * 2)


def config_batch(cfg: ModelConfig, rows: int):
    from .synth import config_batches
    return config_batches(cfg, rows, 1)[0]


def time_piece(rows: int, width: int, nnz: int, bags: int, reps: int = 3) -> float:
    """Seconds of embedding forward + fused SGD update of nnz random lookups in `bags` bags of a
    (rows, width) fp32 piece (every page touched, as a trained table's; fresh rows every call),
    with its rows from DRAM but the calls themselves warm: timed after evicting the caches, less
    what the eviction adds to the same calls with no lookups. A step's other stages push tables
    out of the caches, not the interpreter, the dispatch and the per-bag buffers (the eviction
    cost those ~0.2 ms per call, 10x a small table's own time)."""
    from .. import ops
    from ..ops.embedding import empty_table

    rs = np.random.default_rng(1)
    w = empty_table(rows, width)
    w.fill(0.01)
    batches = iter([rs.integers(0, rows, nnz, dtype=np.int64) for _ in range(reps + 1)])
    off = np.arange(bags, dtype=np.int64) * nnz // max(bags, 1)
    none, no_off = np.empty(0, np.int64), np.zeros(bags, np.int64)
    dout = np.full((bags, width), 1e-3, np.float32)
    pooled = np.empty((bags, width), np.float32)

    def calls(idx, offsets):
        ops.embedding_bag_forward(w, idx, offsets, out=pooled)
        ops.embedding_bag_sgd_(w, idx, offsets, dout, 1e-3)
    evict = cache_evictor()
    full = _cpu_seconds(lambda: calls(next(batches), off), reps, evict, pick=np.median)
    cold = _cpu_seconds(lambda: calls(none, no_off), reps, evict, pick=np.median)
    warm = _cpu_seconds(lambda: calls(none, no_off), reps, pick=np.median)
    return max(full - cold + warm, warm)


def _round(x: float, digits: int = 2) -> int:
    """x to `digits` significant digits (nearby shapes share a measurement)."""
    if x < 10 ** digits:
        return int(round(x))
    scale = 10 ** (int(np.floor(np.log10(x))) - digits + 1)
    return int(round(x / scale) * scale)


@dataclass(frozen=True)
class MeasuredRates(Rates):
    """Rates whose table-piece times are measured at the piece's own shape (pieces up to
    MEASURE_BYTES; larger ones use the analytic per-lookup rates)."""
    cache: dict = field(default_factory=dict, compare=False, hash=False, repr=False)

    def table_seconds(self, rows, width, nnz, bags):
        if np.ndim(nnz) > 0:
            per = [self.table_seconds(rows, width, n, bags) for n in np.ravel(nnz)]
            return np.array(per).reshape(np.shape(nnz))
        if rows * width * 4 > MEASURE_BYTES:
            return super().table_seconds(rows, width, nnz, bags)
        key = (_round(rows), int(width), _round(max(float(nnz), 1.0)), _round(max(int(bags), 1)))
        if key not in self.cache:
            self.cache[key] = time_piece(*key)
        return self.cache[key]


def calibrate() -> dict:
    """The cost model's small rates on this CPU: an embedding op's, a NumPy block copy's (views
    looked up as the shardings do) and a block op's fixed cost, block copy bandwidth, bucketing
    lookups by row shard (per lookup and per call)."""
    from .. import ops
    from .sharding import Scratch, bucket

    views = {(q, 0): np.zeros((32, 64), np.float32) for q in range(4)}
    src = np.ones((128, 64), np.float32)
    np_us = _cpu_seconds(lambda: [views[q, 0].__setitem__(Ellipsis, src[32 * q:32 * q + 32])
                                  for _ in range(25) for q in range(4)], 5) / 100 * 1e6
    flat = np.zeros(128 * 64, np.float32)
    offs, starts = np.arange(4, dtype=np.int64) * 32 * 64, np.arange(4, dtype=np.int64) * 32
    stops = starts + 1         # one row per block: the call's fixed cost
    block_us = _cpu_seconds(lambda: [ops.scatter_blocks(src, flat, offs, starts, stops) for _ in range(50)],
                            5) / 50 * 1e6
    w, one = np.ones((4, 16), np.float32), np.zeros(1, np.int64)
    call_us = _cpu_seconds(lambda: [ops.embedding_bag_forward(w, one, one) for _ in range(100)], 5) / 100 * 1e6
    big, dst = np.ones((8192, 512), np.float32), np.empty((8192, 512), np.float32)   # 16 MB: past the L2s
    copy_gbs = big.nbytes / _cpu_seconds(lambda: np.copyto(dst, big), 10) / 1e9
    rs, scratch = np.random.default_rng(0), Scratch()
    bounds = tuple(-(-j * 1_000_000 // 8) for j in range(9))
    n, b = 1 << 18, 1 << 13
    idx = rs.integers(0, 1_000_000, n, dtype=np.int64)
    big_s = _cpu_seconds(lambda: bucket(np.arange(b, dtype=np.int64) * (n // b), idx, bounds, scratch), 5)
    small = np.arange(32, dtype=np.int64)
    bucket_us = _cpu_seconds(lambda: [bucket(small, small * 1000, bounds, scratch) for _ in range(20)], 5) / 20 * 1e6
    return dict(np_us=np_us, block_us=block_us, call_us=call_us, copy_gbs=copy_gbs, bucket_us=bucket_us,
                bucket_ns=max(big_s - bucket_us * 1e-6, 0.0) / n * 1e9)


def _one_table_step(kind: str, hold: bool):
    """-> (step function, plan): rank 0's per-step work for one small table of `kind` on 3 ranks,
    holding a piece (or, hold=False, only receiving), the other ranks' pieces stood in by zeros."""
    from types import SimpleNamespace

    from .layout import ROW_KINDS, Layout
    from .planner import ShardingPlan, TableSharding
    from .sharding import make_shard

    R, D, B, P = 512, 16, 12, 3
    ranks = (0, 1) if hold else (1, 2)
    spec = {"table": TableSharding.table(ranks[0]), "column": TableSharding.column(ranks, D),
            "row": TableSharding.row(ranks, R), "table_row": TableSharding.row(ranks, R, "table_row"),
            "replicate": TableSharding.replicate(P)}[kind]
    plan = ShardingPlan((R,), D, P, (spec,))
    lay = Layout(plan, 0, B)
    for buf in (lay.fwd_recv, lay.bwd_recv, lay.node_recv, lay.node_bwd_recv):
        buf.fill(0.0)
    shard = make_shard(0, spec, R, D, 0)
    shard.init(np.random.RandomState(0))
    rs = np.random.default_rng(0)
    st = SimpleNamespace(layout=lay, offsets=np.arange(B, dtype=np.int64)[None] * 2, lr=0.01,
                         indices=[rs.integers(0, R, 2 * B, dtype=np.int64)], ids_out={}, ids_in=None, row_bags={},
                         replica={})
    dly = np.zeros((lay.b, D), np.float32)

    def step():
        if kind in ROW_KINDS:
            shard.bucket(st)
            for q in range(P):                 # every sample owner sends what mine does
                if (q, 0) in lay.ids_len_in:
                    lay.ids_len_in[q, 0][...] = lay.ids_len_out[0, 0]
            _, _, _, _, st.ids_in = lay.ids_stage2(st.ids_out)
            rows, ends = st.ids_out[0]
            recv, starts, sizes = st.ids_in
            for a, n in zip(starts.tolist(), sizes.tolist()):
                recv[a:a + n] = rows[ends[0]:ends[0] + n]
        if shard.held:
            shard.lookup(st)
        if kind == "table_row" and lay.node_owned:
            shard.forward_sums(st)
        shard.assemble(st)
        shard.grad(st, dly)
        if kind == "table_row" and lay.node_owned:
            shard.forward_grads(st)
        if shard.held:
            shard.update(st)
    return step, plan


def calibrate_fixed(rates: Rates) -> tuple:
    """fixed_us for Rates: per kind, what one table's step costs a rank beyond the cost model's
    other terms (the code around the calls), holding a piece and only receiving: measured on a
    small table, minus the model's estimate of the same work."""
    from .costmodel import Load, TableLoad, add_table

    out = []
    for kind in ("table", "column", "row", "table_row", "replicate"):
        extra = []
        for hold in (True, False):
            if kind == "replicate" and not hold:
                extra.append(0.0)
                continue
            step, plan = _one_table_step(kind, hold)
            measured = _cpu_seconds(step, 20)
            load = Load(plan.nranks)
            add_table(load, TableLoad(plan.sizes[0], plan.dim, 2.0), plan.tables[0], 12, rates)
            extra.append(max(measured - float(load.comp[0]), 0.0) * 1e6)
        out.append((kind, *extra))
    return tuple(out)


def measured_rates() -> MeasuredRates:
    rates = MeasuredRates(**calibrate())
    return dataclasses.replace(rates, fixed_us=calibrate_fixed(rates))
