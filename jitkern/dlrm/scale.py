"""Scaling model for the hybrid-parallel DLRM: planned sharding, predicted step time and efficiency on P ranks.

    python -m jitkern scale --config paper-small --ranks 64 --bandwidth 12.5 --latency 2
    python -m jitkern scale --config mlperf-full --ranks 8 --rank-memory-gb 24 --plan-only

Compute comes from rates measured here, on this CPU, in CPU time of the measuring thread (one
kernel thread per rank: other processes on the machine do not inflate them), at the shapes one
rank of P runs: the MLPs, interaction and loss on its batch slice (B/P rows); each table piece's
embedding forward and sparse update at its own shape (rows, width, lookups) for the whole global
batch (replicated tables: the slice's lookups, then the touched rows' update); copies, NumPy calls
and bucketing from small measurements. The step-time cost model (costmodel.py) adds exact message
sizes over a link of the given bandwidth and per-message latency and the overlap the
implementation has. The planner (planner.py) chooses each table's sharding with that model; the
whole-table placement (placement.py, tiny tables replicated) and every sharding kind forced on all
tables are predicted under the same rates for comparison.
"""
from __future__ import annotations

import argparse
import dataclasses
import time
from dataclasses import dataclass, field

import numpy as np

from .. import set_num_threads
from ..codegen.tune import cache_evictor
from ..config import sleep_idle_workers
from ..report import print_table
from .configs import CONFIGS, ModelConfig, interaction_width
from .costmodel import Network, Rates, dense_estimate, dense_seconds, estimate, sync_wait
from .placement import batch_slices, place_tables
from .planner import AUTO, plan_load, plan_sharding, whole_table_plan

BATCH = 2048
MEASURE_BYTES = 1 << 30      # table pieces up to this size are timed; larger ones use the analytic rates


# --------------------------------------------------------------------------- measured rates


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
    """Seconds per dense stage (the median over timed steps), with `sd`: the standard deviation of
    the steps' dense seconds, which sets how long ranks wait for each other (costmodel.sync_wait)."""
    sd = 0.0


def measure_dense(cfg: ModelConfig, rows, reps: int = 5) -> DenseStages | dict:
    """Per-stage seconds of a train step at `rows` (one size, or several: -> {rows: stages}), tables
    shrunk to 4 rows (their cost is not wanted). Each stage's median of `reps` steps (a measured
    step is a typical one, not the luckiest: the sum of per-stage minima fell 3-7% short of it);
    several sizes are timed in turns, so every size sees the machine as the others do. Before each
    timed step, as many bytes stream through the caches as one rank's tables move in a step at
    that slice (table_traffic): the MLPs' weights find the caches as the lookups left them."""
    from ..codegen.target import host_target
    from .model import DLRM, StageTimer

    sizes = sorted({int(r) for r in np.atleast_1d(rows)})
    tiny = dataclasses.replace(cfg, sizes=(4,) * len(cfg.sizes))
    m = DLRM(**tiny.model_kwargs(), seed=0)
    m.timer = timer = StageTimer(CLOCK)
    batches = {}
    for r in sizes:
        b = config_batch(tiny, r)
        batches[r] = (b.dense, b.offsets, b.indices, b.labels)
        for _ in range(2):
            m.train_step(*batches[r], 0.01)
    seen = {r: {} for r in sizes}
    llc = max(host_target().l3, 1 << 20)
    evict = {r: cache_evictor(min(table_traffic(cfg, r), 2 * llc)) for r in sizes}
    for _ in range(reps):
        for r in sizes:
            evict[r]()
            timer.reset()
            m.train_step(*batches[r], 0.01, check=False)
            for k, v in timer.seconds.items():
                if not k.startswith("embedding"):
                    seen[r].setdefault(k, []).append(v)
    best = {}
    for r in sizes:
        best[r] = DenseStages((k, float(np.median(v))) for k, v in seen[r].items())
        best[r].sd = float(np.std(np.sum(list(seen[r].values()), axis=0)))
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


# --------------------------------------------------------------------------- the model


@dataclass
class Prediction:
    label: str
    ranks: int
    batch: int                  # global batch
    compute: float              # seconds, the busiest rank
    alltoall: float             # seconds per direction
    allreduce: float
    exposed: float              # communication not hidden behind compute
    step: float

    def row(self, base_step: float, weak: bool):
        eff = base_step / self.step if weak else base_step / self.step / self.ranks
        return [self.label, self.ranks, self.batch, f"{self.compute * 1e3:.1f}", f"{self.alltoall * 1e3:.2f}",
                f"{self.allreduce * 1e3:.2f}", f"{self.exposed * 1e3:.2f}", f"{self.step * 1e3:.1f}",
                f"{self.batch / self.step:,.0f}", f"{eff:.2f}"]


HEADERS = ["plan", "P", "global B", "compute ms", "a2a ms/dir", "allreduce ms", "exposed ms", "step ms",
           "samples/s", "efficiency"]


def mlp_params(cfg: ModelConfig) -> int:
    """The data-parallel (allreduced) parameters: the MLPs', and a dcn model's cross network."""
    top = [interaction_width(len(cfg.sizes), cfg.dim, cfg.interaction)] + list(cfg.top)
    cross = cfg.dcn_layers * (2 * cfg.dcn_rank + 1) * top[0] if cfg.interaction == "dcn" else 0
    return cross + sum(n * m + m for sizes in (cfg.bottom, top) for n, m in zip(sizes[:-1], sizes[1:]))


def one_process(cfg: ModelConfig, batch: int, dense: dict, rates: Rates) -> Prediction:
    """One process: the dense stages plus every table's lookups and update at the whole batch."""
    emb = sum(rates.table_seconds(r, cfg.dim, batch * cfg.lookups, batch) for r in cfg.sizes)
    step = sum(dense.values()) + emb
    return Prediction("one process", 1, batch, step, 0.0, 0.0, 0.0, step)


def predict_plan(label: str, plan, cfg: ModelConfig, batch: int, dense: dict, rates: Rates,
                 network: Network) -> Prediction:
    """The cost model's step on plan.nranks ranks for a global `batch`, with `dense` at the slice."""
    load = plan_load(plan, cfg.lookups, batch, rates)
    est = estimate(load, plan.kinds(), dense, 4 * mlp_params(cfg), network, len(cfg.top))
    wait = sync_wait(getattr(dense, "sd", 0.0), plan.nranks)
    return Prediction(label, plan.nranks, batch, est.compute, est.alltoall, est.allreduce, est.exposed + wait,
                      est.step + wait)


def make_plan(cfg: ModelConfig, ranks: int, batch: int, *, kinds=AUTO, dense=None, rates=None, network=None,
              memory=None):
    """The planner's plan for cfg on `ranks` ranks (kinds: "auto", a kind, or one per table)."""
    return plan_sharding(cfg.sizes, cfg.dim, cfg.lookups, batch, ranks, memory, network, kinds=kinds,
                         rates=rates, dense=dense, mlp_bytes=4 * mlp_params(cfg), top_layers=len(cfg.top))


def predictions(cfg: ModelConfig, ranks: int, batch: int, dense: dict, rates: Rates, network: Network, *,
                kinds=(), memory=None) -> tuple:
    """-> (planned plan, [Prediction]) at `ranks` for a global `batch`: the planned sharding, the
    whole-table placement and each kind in `kinds` forced on every table."""
    plan = make_plan(cfg, ranks, batch, dense=dense, rates=rates, network=network, memory=memory)
    preds = [predict_plan("planned", plan, cfg, batch, dense, rates, network)]
    whole = whole_table_plan(place_tables(cfg.sizes, cfg.dim, ranks, [cfg.lookups] * len(cfg.sizes)))
    preds.append(predict_plan("whole tables", whole, cfg, batch, dense, rates, network))
    for kind in kinds:
        try:
            forced = make_plan(cfg, ranks, batch, kinds=kind, dense=dense, rates=rates, network=network, memory=memory)
        except ValueError:
            continue                      # does not fit the memory limit
        preds.append(predict_plan(f"all {kind}", forced, cfg, batch, dense, rates, network))
    return plan, preds


def measure_and_predict(cfg: ModelConfig, ranks_list, mode: str, *, bandwidth_gbs: float, latency_us: float,
                        per_rank_batch: int = BATCH, reps: int = 5, kinds="auto", rates=None, offload=True,
                        dense_at=None, log=print) -> list:
    """Predictions for each P in ranks_list (mode 'weak': per-rank batch fixed, 'strong': global
    fixed) of the plan made with `kinds` ("auto": the planner; or a kind for every table);
    offload: costmodel.Network.offload (False: the ranks share this machine's memory); dense_at:
    {rows: DenseStages} measured already (rows not in it are measured here)."""
    rates = rates or measured_rates()
    network = Network(bandwidth_gbs, latency_us, offload=offload)
    dense_at, preds = dict(dense_at or {}), []
    for p in ranks_list:
        batch = per_rank_batch * p if mode == "weak" else per_rank_batch
        b = max(hi - lo for lo, hi in batch_slices(batch, p))
        log(f"  measuring {mode} P={p}: dense stages at {b} rows, table pieces at {batch} samples ...")
        if b not in dense_at:
            dense_at[b] = measure_dense(cfg, b, reps)
        if p == 1:
            preds.append(one_process(cfg, batch, dense_at[b], rates))
            continue
        plan = make_plan(cfg, p, batch, kinds=kinds, dense=dense_at[b], rates=rates, network=network)
        preds.append(predict_plan(kinds, plan, cfg, batch, dense_at[b], rates, network))
    return preds


def _parse(argv):
    ap = argparse.ArgumentParser(prog="python -m jitkern scale", description=__doc__.split("\n")[0])
    ap.add_argument("--config", choices=sorted(CONFIGS), default="mlperf")
    ap.add_argument("--ranks", type=int, default=64, help="predict for this many ranks (and 1 as the base)")
    ap.add_argument("--bandwidth", type=float, default=12.5, help="per-rank link bandwidth, GB/s")
    ap.add_argument("--latency", type=float, default=5.0, help="per-message latency, microseconds")
    ap.add_argument("--ranks-per-node", type=int, default=0, help="ranks per node (0: one node holds them all)")
    ap.add_argument("--node-bandwidth", type=float, default=0.0, help="link bandwidth inside a node, GB/s "
                    "(0: --bandwidth)")
    ap.add_argument("--rank-memory-gb", type=float, default=0.0, help="memory per rank the plan must fit (0: no limit)")
    ap.add_argument("--mode", choices=("strong", "weak", "both"), default="both")
    ap.add_argument("--batch", type=int, default=BATCH, help="global batch (strong) / per-rank batch (weak)")
    ap.add_argument("--threads", type=int, default=1, help="threads per rank for the measured rates")
    ap.add_argument("--plan-only", action="store_true", help="print the planned sharding and each rank's memory for "
                    "--ranks and the global --batch, from the default rates (dense stages from the MLPs' FLOPs); "
                    "nothing measured or allocated")
    args = ap.parse_args(argv)
    if (args.ranks < 1 or args.bandwidth <= 0 or args.latency < 0 or args.batch < 1 or args.threads < 1
            or args.rank_memory_gb < 0 or args.ranks_per_node < 0 or args.node_bandwidth < 0):
        ap.error("--ranks, --batch and --threads must be >= 1, --bandwidth > 0, --latency, --rank-memory-gb, "
                 "--ranks-per-node and --node-bandwidth >= 0")
    return args


def _cross(cfg: ModelConfig):
    """(layers, rank) of a dcn config's cross network, else None."""
    return (cfg.dcn_layers, cfg.dcn_rank) if cfg.interaction == "dcn" else None


def plan_only(cfg: ModelConfig, args, network: Network) -> int:
    """Plan cfg for --ranks at the global --batch from the default rates; print it and the memory."""
    memory = args.rank_memory_gb * 1e9 or None
    b = max(hi - lo for lo, hi in batch_slices(args.batch, args.ranks))
    top = [interaction_width(len(cfg.sizes), cfg.dim, cfg.interaction)] + list(cfg.top)
    plan = make_plan(cfg, args.ranks, args.batch, network=network, memory=memory,
                     dense=dense_estimate(cfg.bottom, top, b, cross=_cross(cfg)))
    mlp = 4 * mlp_params(cfg)
    print(plan.describe())
    print(f"per rank: tables and optimizer state max {max(plan.memory) / 1e9:.2f} GB + MLP weights and gradients "
          f"{2 * mlp / 1e6:.1f} MB, of {memory / 1e9:.1f} GB" if memory else "")
    total = sum(cfg.sizes) * cfg.dim * 4
    print(f"all tables: {total / 1e9:.1f} GB of fp32 ({len(cfg.sizes)} tables, largest "
          f"{max(cfg.sizes) * cfg.dim * 4 / 1e9:.1f} GB); nothing was allocated")
    return 0


def report_mode(cfg: ModelConfig, mode: str, args, rates: Rates, network: Network, dense_at: dict) -> None:
    """The one-process base, the planned sharding, the whole-table placement and every kind forced,
    at --ranks; then the planner's gain and its plan."""
    P = args.ranks
    batch = args.batch * P if mode == "weak" else args.batch
    b = max(hi - lo for lo, hi in batch_slices(batch, P))
    print(f"  measuring {mode}: table pieces at {batch} samples ...", flush=True)
    base = one_process(cfg, args.batch, dense_at[args.batch], rates)
    dense = dense_at[b]
    kinds = ("table", "column", "row", "replicate") + (("table_row",) if args.ranks_per_node else ())
    plan, preds = predictions(cfg, P, batch, dense, rates, network, kinds=kinds,
                              memory=args.rank_memory_gb * 1e9 or None)
    print(f"{mode} scaling ({'global' if mode == 'strong' else 'per-rank'} batch {args.batch}):")
    print_table(HEADERS, [p.row(base.step, mode == "weak") for p in [base] + preds])
    planned, whole = preds[0], preds[1]
    dense_s = dense_seconds(dense, P)
    bound = base.step / dense_s / (P if mode == "strong" else 1)
    print(f"planned vs whole tables at {P} ranks: {whole.step / planned.step:.2f}x samples/s; the dense stages "
          f"alone take {dense_s * 1e3:.1f} ms at {b} rows per rank: efficiency <= {bound:.2f} even "
          "with free tables and communication")
    print(plan.describe())


def main(argv=None) -> int:
    args = _parse(argv)
    cfg = CONFIGS[args.config]
    network = Network(args.bandwidth, args.latency, args.ranks_per_node, args.node_bandwidth)
    if args.plan_only:
        return plan_only(cfg, args, network)
    sleep_idle_workers()                 # before the first parallel kernel starts the thread pool
    set_num_threads(args.threads)
    rates = measured_rates()
    print(f"scaling model: {args.config}, {args.bandwidth} GB/s, {args.latency} us per message, "
          f"{args.threads} thread(s) per rank, rates measured on this CPU (NumPy block op {rates.np_us:.2f} us, block op {rates.block_us:.1f} us, "
          f"embedding op {rates.call_us:.1f} us, copies {rates.copy_gbs:.1f} GB/s, "
          f"bucketing {rates.bucket_us:.0f} us + "
          f"{rates.bucket_ns:.1f} ns per lookup)")
    modes = ("strong", "weak") if args.mode == "both" else (args.mode,)
    rows = {args.batch} | {max(hi - lo for lo, hi in batch_slices(args.batch, args.ranks))} if "strong" in modes \
        else {args.batch}
    print(f"  measuring the dense stages at {sorted(rows)} rows ...", flush=True)
    dense_at = measure_dense(cfg, sorted(rows), reps=7)
    for mode in modes:
        report_mode(cfg, mode, args, rates, network, dense_at)
    return 0
