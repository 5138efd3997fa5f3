"""Scaling model for the hybrid-parallel DLRM: predicted step time and efficiency on P ranks.

    python -m jitkern scale --config mlperf --ranks 64 --bandwidth 12.5 --latency 5

Compute comes from per-op rates measured here, on this CPU, at the shapes one rank of P runs:
the MLPs, interaction and loss on its batch slice (B/P rows), every table's embedding forward
and sparse update at the global batch (each table is timed once; a rank's time is the sum over
the tables the placement gives it). Communication is exact byte counts over a link of the given
bandwidth and per-message latency: the alltoall of pooled embeddings (and its reverse), and
the reduce-scatter + allgather of the MLP (and replicated tables') gradients. Overlap follows
the implementation: the forward alltoall hides behind the bottom MLP forward, the reverse one
behind the bottom MLP backward, the gradient allreduce behind everything after the top MLP
backward.
"""
from __future__ import annotations

import argparse
import dataclasses
import time
from dataclasses import dataclass

import numpy as np

from .. import set_num_threads
from ..config import sleep_idle_workers
from ..report import print_table
from .configs import CONFIGS, ModelConfig, interaction_width
from .placement import REPLICATED, batch_slices, place_tables
from .synth import config_batches

BATCH = 2048


# --------------------------------------------------------------------------- measured rates


@dataclass
class Rates:
    """Measured seconds: dense stages at a batch of `rows`, and embedding fwd+update per table at `batch`."""
    rows: int
    batch: int
    dense_stages: dict          # stage -> seconds per step at `rows` (embedding stages excluded)
    table_seconds: list         # per table: forward + sparse SGD update of `batch` samples


def _median_time(fn, reps):
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def measure_dense(cfg: ModelConfig, rows: int, reps: int = 5) -> dict:
    """Per-stage seconds of a train step at `rows`, tables shrunk to 4 rows (their cost is not wanted)."""
    from .model import DLRM, StageTimer

    tiny = dataclasses.replace(cfg, sizes=(4,) * len(cfg.sizes))
    m = DLRM(**tiny.model_kwargs(), seed=0)
    m.timer = timer = StageTimer()
    b = config_batches(tiny, rows, 1)[0]
    batch = (b.dense, b.offsets, b.indices, b.labels)
    for _ in range(2):
        m.train_step(*batch, 0.01)
    timer.reset()
    for _ in range(reps):
        m.train_step(*batch, 0.01, check=False)
    return {k: v / reps for k, v in timer.seconds.items() if not k.startswith("embedding")}


def measure_tables(cfg: ModelConfig, batch: int, reps: int = 3, cache=None) -> list:
    """Per table: seconds of embedding forward + fused SGD update of `batch` samples (one table at a time)."""
    from .. import ops

    cache = {} if cache is None else cache
    out = []
    k, dim = cfg.lookups, cfg.dim
    rs = np.random.default_rng(1)
    for rows in cfg.sizes:
        key = (rows, dim, k, batch)
        if key not in cache:
            w = np.full((rows, dim), 0.01, np.float32)      # touch every page, as a trained table would
            idx = rs.integers(0, rows, batch * k, dtype=np.int64)
            off = np.arange(batch, dtype=np.int64) * k
            dout = np.full((batch, dim), 1e-3, np.float32)
            pooled = np.empty((batch, dim), np.float32)
            cache[key] = _median_time(lambda: (ops.embedding_bag_forward(w, idx, off, out=pooled),
                                               ops.embedding_bag_sgd_(w, idx, off, dout, 1e-3)), reps)
            del w
        out.append(cache[key])
    return out


# --------------------------------------------------------------------------- the model


@dataclass
class Prediction:
    ranks: int
    batch: int                  # global batch
    compute: float              # seconds, the busiest rank
    alltoall: float             # seconds per direction (busiest rank)
    allreduce: float
    exposed: float              # communication not hidden behind compute
    step: float

    def row(self, base_step: float, weak: bool):
        eff = base_step / self.step if weak else base_step / self.step / self.ranks
        return [self.ranks, self.batch, f"{self.compute * 1e3:.1f}", f"{self.alltoall * 1e3:.2f}",
                f"{self.allreduce * 1e3:.2f}", f"{self.exposed * 1e3:.2f}", f"{self.step * 1e3:.1f}",
                f"{self.batch / self.step:,.0f}", f"{eff:.2f}"]


def mlp_params(cfg: ModelConfig) -> int:
    top = [interaction_width(len(cfg.sizes), cfg.dim, cfg.interaction)] + list(cfg.top)
    return sum(n * m + m for sizes in (cfg.bottom, top) for n, m in zip(sizes[:-1], sizes[1:]))


def predict(cfg: ModelConfig, ranks: int, batch: int, dense: dict, table_seconds: list, table_batch: int, *,
            bandwidth_gbs: float, latency_us: float) -> Prediction:
    """Step time on `ranks` ranks for a global `batch`, from measured rates (see the module doc).

    dense: per-stage seconds at the per-rank batch; table_seconds: per table at table_batch rows.
    """
    D, k = cfg.dim, cfg.lookups
    lookups = [k] * len(cfg.sizes)
    pl = place_tables(cfg.sizes, D, ranks, lookups)
    b = max(hi - lo for lo, hi in batch_slices(batch, ranks))
    scale_t = batch / table_batch
    rep = [t for t, o in enumerate(pl.owner) if o == REPLICATED]
    emb = max(sum(table_seconds[t] for t in pl.tables_of(r)) for r in range(ranks)) * scale_t
    emb += sum(table_seconds[t] for t in rep) * b / table_batch
    compute = sum(dense.values()) + emb
    bw, lat = bandwidth_gbs * 1e9, latency_us * 1e-6
    a2a = ar = 0.0
    if ranks > 1:
        # busiest rank: sends its tables' rows of everyone else's slice, receives its slice of the rest
        send = max(len(pl.tables_of(r)) * (batch - b) for r in range(ranks)) * D * 4
        recv = b * (len(cfg.sizes) - len(rep) - min(len(pl.tables_of(r)) for r in range(ranks))) * D * 4
        a2a = (ranks - 1) * lat + max(send, recv) / bw
        n = (mlp_params(cfg) + sum(cfg.sizes[t] for t in rep) * D) * 4
        ar = 2 * (ranks - 1) * lat + 2 * (ranks - 1) / ranks * n / bw
    # forward: the alltoall runs behind the bottom MLP. Backward: the reverse alltoall and the
    # gradient allreduce share the link from the top MLP's first gradient on; the alltoall must
    # be done before the embedding update, the allreduce before the dense update.
    fwd = max(a2a - dense.get("bottom_fwd", 0.0), 0.0)
    top_layers = len(cfg.top)
    behind = (dense.get("top_bwd", 0.0) * (top_layers - 1) / top_layers + dense.get("interaction", 0.0) / 2
              + dense.get("bottom_bwd", 0.0) + emb / 2)
    bwd = max(a2a - dense.get("bottom_bwd", 0.0), a2a + ar - behind, 0.0)
    return Prediction(ranks, batch, compute, a2a, ar, fwd + bwd, compute + fwd + bwd)


def measure_and_predict(cfg: ModelConfig, ranks_list, mode: str, *, bandwidth_gbs: float, latency_us: float,
                        per_rank_batch: int = BATCH, reps: int = 5, log=print) -> list:
    """Predictions for each P in ranks_list; mode 'weak' (per-rank batch fixed) or 'strong' (global fixed)."""
    cache, dense_at = {}, {}
    preds = []
    for p in ranks_list:
        batch = per_rank_batch * p if mode == "weak" else per_rank_batch
        b = max(hi - lo for lo, hi in batch_slices(batch, p))
        log(f"  measuring {mode} P={p}: dense stages at {b} rows, tables at {batch} samples ...")
        if b not in dense_at:
            dense_at[b] = measure_dense(cfg, b, reps)
        dense = dense_at[b]
        tables = measure_tables(cfg, batch, cache=cache)
        preds.append(predict(cfg, p, batch, dense, tables, batch, bandwidth_gbs=bandwidth_gbs,
                             latency_us=latency_us))
    return preds


HEADERS = ["P", "global B", "compute ms", "a2a ms/dir", "allreduce ms", "exposed ms", "step ms", "samples/s",
           "efficiency"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jitkern scale", description=__doc__.split("\n")[0])
    ap.add_argument("--config", choices=sorted(CONFIGS), default="mlperf")
    ap.add_argument("--ranks", type=int, default=64, help="predict for this many ranks (and 1 as the base)")
    ap.add_argument("--bandwidth", type=float, default=12.5, help="per-rank link bandwidth, GB/s")
    ap.add_argument("--latency", type=float, default=5.0, help="per-message latency, microseconds")
    ap.add_argument("--mode", choices=("strong", "weak", "both"), default="both")
    ap.add_argument("--batch", type=int, default=BATCH, help="global batch (strong) / per-rank batch (weak)")
    ap.add_argument("--threads", type=int, default=1, help="threads per rank for the measured rates")
    args = ap.parse_args(argv)
    if args.ranks < 1 or args.bandwidth <= 0 or args.latency < 0 or args.batch < 1 or args.threads < 1:
        ap.error("--ranks, --batch and --threads must be >= 1, --bandwidth > 0, --latency >= 0")
    sleep_idle_workers()                 # before the first parallel kernel starts the thread pool
    set_num_threads(args.threads)
    cfg = CONFIGS[args.config]
    print(f"scaling model: {args.config}, {args.bandwidth} GB/s, {args.latency} us per message, "
          f"{args.threads} thread(s) per rank, rates measured on this CPU")
    ranks = sorted({1, args.ranks})
    for mode in (("strong", "weak") if args.mode == "both" else (args.mode,)):
        preds = measure_and_predict(cfg, ranks, mode, bandwidth_gbs=args.bandwidth, latency_us=args.latency,
                                    per_rank_batch=args.batch)
        print(f"{mode} scaling ({'global' if mode == 'strong' else 'per-rank'} batch {args.batch}):")
        print_table(HEADERS, [p.row(preds[0].step, mode == "weak") for p in preds])
    return 0
