"""Scaling model for the hybrid-parallel DLRM: planned sharding, predicted step time and efficiency on P ranks.

    python -m jitkern scale --config paper-small --ranks 64 --bandwidth 12.5 --latency 2
    python -m jitkern scale --config mlperf-full --ranks 8 --rank-memory-gb 24 --plan-only

Compute comes from rates measured here, on this CPU, in CPU time of the measuring thread (one
kernel thread per rank: other processes on the machine do not inflate them), at the shapes one
rank of P runs: the MLPs, interaction and loss on its batch slice (B/P rows); each table piece's
embedding forward and sparse update at its own shape (rows, width, lookups) for the whole global
batch (replicated tables: the slice's lookups, then the touched rows' update); copies, NumPy calls
and bucketing from small measurements (calibration.py). The step-time cost model (costmodel.py) adds exact message
sizes over a link of the given bandwidth and per-message latency and the overlap the
implementation has. The planner (planner.py) chooses each table's sharding with that model; the
whole-table placement (placement.py, tiny tables replicated) and every sharding kind forced on all
tables are predicted under the same rates for comparison.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass

from .. import set_num_threads
from ..config import sleep_idle_workers
from ..report import print_table
from .calibration import measure_dense, measured_rates
from .configs import CONFIGS, ModelConfig, interaction_width
from .costmodel import Network, Rates, dense_estimate, dense_seconds, estimate, sync_wait
from .placement import batch_slices, place_tables
from .planner import AUTO, plan_load, plan_sharding, whole_table_plan

BATCH = 2048


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
    spread = getattr(dense, "spread", None)        # DenseStages; a plain estimate has none
    wait = sync_wait(spread(plan.nranks) if spread else 0.0, plan.nranks)
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
    {rows: DenseStages} measured already (rows not in it are measured here); a (P, rows) key, measured
    with P copies running at once as P ranks sharing one machine do, serves P before a rows key."""
    rates = rates or measured_rates()
    network = Network(bandwidth_gbs, latency_us, offload=offload)
    dense_at, preds = dict(dense_at or {}), []
    for p in ranks_list:
        batch = per_rank_batch * p if mode == "weak" else per_rank_batch
        b = max(hi - lo for lo, hi in batch_slices(batch, p))
        log(f"  measuring {mode} P={p}: dense stages at {b} rows, table pieces at {batch} samples ...")
        key = (p, b) if (p, b) in dense_at else b
        if key not in dense_at:
            dense_at[key] = measure_dense(cfg, b, reps)
        if p == 1:
            preds.append(one_process(cfg, batch, dense_at[key], rates))
            continue
        plan = make_plan(cfg, p, batch, kinds=kinds, dense=dense_at[key], rates=rates, network=network)
        preds.append(predict_plan(kinds, plan, cfg, batch, dense_at[key], rates, network))
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
