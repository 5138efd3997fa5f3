"""Sharding plans for the hybrid-parallel DLRM: one sharding per table, chosen by the step-time
cost model (costmodel.py) under a per-rank memory limit. Pure Python: no MPI, nothing allocated.

    plan = plan_sharding(sizes, dim, pooling, batch, ranks, memory_per_rank, network)
    print(plan.describe())

Kinds (sharding.py implements them):
    table      the whole table on one rank, which pools it for the whole global batch
    column     D split into k column blocks on k ranks, each pooling its block for the whole batch
    row        rows split into k ranges on k ranks; each pools its rows' partial sums, which the
               sample owners add up
    table_row  row-wise over the ranks of one node; the partial sums are added inside the node
               before they cross to other nodes
    replicate  on every rank, data-parallel: each pools its own samples; gradients are summed

The planner searches locally from a few starting plans (none placed, whole tables, all row-wise,
row-wise over groups of ranks):
largest table first, each table takes the sharding (and ranks) that gives the whole plan the
lowest predicted step time, then the least total work, until no table changes; the best plan
found wins. A table too large for one rank's memory can only be split.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..report import format_table
from .costmodel import KINDS, Load, Network, Rates, TableLoad, add_table, estimate

OPTIMIZER_STATE = {"sgd": (0, 0), "rowwise_adagrad": (4, 0), "adagrad": (0, 4)}   # bytes per row, per element
AUTO = "auto"
STEP_TOLERANCE = 0.005       # plans within this share of the best predicted step count as equally fast


def _even(n: int, k: int) -> tuple:
    """k + 1 bounds splitting n into k near-equal ranges: ceil(j n / k), so that the piece of an
    index i is i * k // n exactly."""
    return tuple(-(-j * n // k) for j in range(k + 1))


@dataclass(frozen=True)
class TableSharding:
    """One table's sharding: its kind, the ranks holding its pieces (in piece order; every rank for
    replicate) and the piece bounds (rows for row/table_row, columns for column, else empty)."""
    kind: str
    ranks: tuple
    bounds: tuple = ()

    @classmethod
    def table(cls, rank: int) -> "TableSharding":
        return cls("table", (int(rank),))

    @classmethod
    def replicate(cls, nranks: int) -> "TableSharding":
        return cls("replicate", tuple(range(nranks)))

    @classmethod
    def row(cls, ranks, rows: int, kind: str = "row") -> "TableSharding":
        ranks = tuple(int(r) for r in ranks)
        return cls(kind, ranks, _even(rows, len(ranks)))

    @classmethod
    def column(cls, ranks, dim: int) -> "TableSharding":
        ranks = tuple(int(r) for r in ranks)
        k = len(ranks)
        granule = 4 if dim % (4 * k) == 0 else 1
        return cls("column", ranks, tuple(granule * c for c in _even(dim // granule, k)))

    def region(self, j: int, rows: int, dim: int) -> tuple:
        """(r0, r1, c0, c1) of piece j."""
        if self.kind == "column":
            return 0, rows, self.bounds[j], self.bounds[j + 1]
        if self.kind in ("row", "table_row"):
            return self.bounds[j], self.bounds[j + 1], 0, dim
        return 0, rows, 0, dim

    def piece_of(self, rank: int):
        """The piece `rank` holds, or None."""
        return self.ranks.index(rank) if rank in self.ranks else None

    def forwarder(self, q: int) -> int:
        """table_row: the node rank that sums the node's partial pools of rank q's samples."""
        return self.ranks[q % len(self.ranks)]

    def pieces(self, q: int, dim: int) -> list:
        """[(sending rank, c0, c1)] of the pooled pieces rank q receives, in order."""
        if self.kind == "replicate":
            return []
        if self.kind == "table_row":
            return [(self.forwarder(q), 0, dim)]
        return [(s, *self.region(j, 1, dim)[2:]) for j, s in enumerate(self.ranks)]

    def check(self, t: int, rows: int, dim: int, nranks: int) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"table {t}: sharding kind must be one of {KINDS}, got {self.kind!r}")
        if not self.ranks or len(set(self.ranks)) != len(self.ranks) or not all(0 <= r < nranks for r in self.ranks):
            raise ValueError(f"table {t}: ranks must be distinct ranks in [0, {nranks}), got {self.ranks}")
        n = {"column": dim, "row": rows, "table_row": rows}.get(self.kind)
        if self.kind == "table" and len(self.ranks) != 1 or self.kind == "replicate" and len(self.ranks) != nranks:
            need = "1 rank" if self.kind == "table" else "every rank"
            raise ValueError(f"table {t}: a {self.kind} sharding needs {need}")
        if n is not None and (len(self.bounds) != len(self.ranks) + 1 or self.bounds[0] != 0 or self.bounds[-1] != n
                              or any(a >= b for a, b in zip(self.bounds, self.bounds[1:]))):
            raise ValueError(f"table {t}: {self.kind} bounds must rise from 0 to {n} in {len(self.ranks)} "
                             f"non-empty pieces, got {self.bounds}")

    def describe_ranks(self) -> str:
        r = self.ranks
        if len(r) > 2 and r == tuple(range(r[0], r[-1] + 1)):
            return f"{r[0]}-{r[-1]}"
        return ",".join(map(str, r))


@dataclass(frozen=True)
class ShardingPlan:
    """One TableSharding per table over `nranks` ranks; estimates: seconds each table adds to its
    busiest holder; memory: bytes of table pieces and optimizer state per rank; step: the predicted
    step seconds (estimates, memory and step are empty/0 for a plan given by hand)."""
    sizes: tuple
    dim: int
    nranks: int
    tables: tuple
    estimates: tuple = ()
    memory: tuple = ()
    step: float = 0.0
    with_dense: bool = False     # whether `step` includes the dense stages (the planner was given them)

    def __post_init__(self):
        if len(self.tables) != len(self.sizes):
            raise ValueError(f"a plan needs one sharding per table: {len(self.tables)} for {len(self.sizes)} tables")
        for t, (s, rows) in enumerate(zip(self.tables, self.sizes)):
            s.check(t, rows, self.dim, self.nranks)

    def held(self, rank: int) -> list:
        """[(table, piece)] that `rank` holds."""
        return [(t, s.piece_of(rank)) for t, s in enumerate(self.tables) if s.piece_of(rank) is not None]

    def kinds(self) -> tuple:
        return tuple(s.kind for s in self.tables)

    def describe(self, itemsize: int = 4) -> str:
        """The plan as a table (table, rows, bytes, type, ranks, est. ms) and the memory per rank."""
        rows = []
        for t, (s, r) in enumerate(zip(self.tables, self.sizes)):
            est = f"{self.estimates[t] * 1e3:.2f}" if self.estimates else "-"
            rows.append([t, f"{r:,}", _bytes(r * self.dim * itemsize), s.kind, s.describe_ranks(), est])
        lines = [f"sharding plan over {self.nranks} ranks:",
                 format_table(["table", "rows", "bytes", "type", "ranks", "est. ms"], rows)]
        if self.memory:
            lines.append("memory per rank (tables + optimizer state): " + ", ".join(
                f"{r}: {_bytes(m)}" for r, m in enumerate(self.memory)) if self.nranks <= 16 else
                f"memory per rank (tables + optimizer state): max {_bytes(max(self.memory))}, "
                f"min {_bytes(min(self.memory))}")
        if self.step:
            lines.append(f"predicted step: {self.step * 1e3:.2f} ms"
                         + ("" if self.with_dense else " (tables and communication; the dense stages not included)"))
        return "\n".join(lines)


def _bytes(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


def whole_table_plan(placement) -> ShardingPlan:
    """placement.place_tables' whole-table placement (tiny tables replicated) as a plan."""
    P = placement.nranks
    tables = tuple(TableSharding.replicate(P) if o < 0 else TableSharding.table(o) for o in placement.owner)
    return ShardingPlan(placement.sizes, placement.dim, P, tables)


# --------------------------------------------------------------------------- the planner


@dataclass
class _Problem:
    loads: tuple          # TableLoad per table
    batch: int
    nranks: int
    nodes: tuple          # ranks per node
    limit: float          # bytes per rank for table pieces and state
    network: Network
    rates: Rates
    dense: dict
    mlp_bytes: int
    top_layers: int
    deltas: dict = field(default_factory=dict)     # (table, sharding) -> its Load

    def delta(self, t: int, s: TableSharding):
        """(Load, est. seconds on the busiest holder) of table t under sharding s alone."""
        key = (t, s)
        if key not in self.deltas:
            load = Load(self.nranks)
            est = add_table(load, self.loads[t], s, self.batch, self.rates)
            self.deltas[key] = (load, est)
        return self.deltas[key]

    def score(self, load: Load, kinds) -> tuple:
        """(predicted step, total work): the plan with the lower pair is better."""
        est = estimate(load, kinds, self.dense, self.mlp_bytes, self.network, self.top_layers)
        bw = self.network.bandwidth * 1e9
        return est.step, float(load.comp.sum() + (load.send.sum() + load.ids.sum() + load.node.sum()) / bw)


def _column_splits(dim: int, nranks: int) -> list:
    return [k for k in (2, 4, 8, 16, 32, 64, 128) if k <= nranks and dim % k == 0 and dim // k >= 4]


def _row_splits(rows: int, nranks: int) -> list:
    ks = {k for k in (2, 4, 8, 16, 32, 64, 128, 256, 512) if k < nranks} | {nranks}
    return sorted(k for k in ks if 2 <= k <= rows)


def _least_loaded(load: Load, k: int) -> tuple:
    order = sorted(range(load.nranks), key=lambda r: (load.comp[r], load.mem[r], r))
    return tuple(sorted(order[:k]))


def _candidates(t: int, kind: str, load: Load, pb: _Problem, forced: bool):
    """The shardings of `kind` worth trying for table t, given the load of the other tables."""
    rows, dim, P = pb.loads[t].rows, pb.loads[t].dim, pb.nranks
    if kind == "table":
        need = pb.loads[t].piece_bytes(rows, dim)
        fits = [r for r in range(P) if load.mem[r] + need <= pb.limit] or list(range(P))
        yield TableSharding.table(min(fits, key=lambda r: (load.comp[r], load.mem[r], r)))
    elif kind == "replicate":
        yield TableSharding.replicate(P)
    elif kind == "column":
        ks = _column_splits(dim, P)
        for k in (ks[-1:] if forced else ks):
            yield TableSharding.column(_least_loaded(load, k), dim)
    elif kind == "row":
        ks = _row_splits(rows, P)
        for k in (ks[-1:] if forced else ks):
            yield TableSharding.row(_least_loaded(load, k), rows)
    elif kind == "table_row" and (forced or len(pb.nodes) > 1):
        for node in sorted(pb.nodes, key=lambda n: (sum(load.comp[r] for r in n), n)):
            if 1 <= len(node) <= rows:
                yield TableSharding.row(node, rows, "table_row")


def _improve(chosen: list, order, options, pb: _Problem, passes: int = 4) -> list:
    """Local search: each table in turn takes its best sharding given all the others, until no
    table changes (or `passes` rounds); unplaced tables (None) are placed on the first round."""
    chosen = list(chosen)
    total = Load(pb.nranks)
    for t, s in enumerate(chosen):
        if s is not None:
            total = total + pb.delta(t, s)[0]
    for _ in range(passes):
        changed = False
        for t in order:
            base = total - pb.delta(t, chosen[t])[0] if chosen[t] is not None else total
            others = [s.kind for u, s in enumerate(chosen) if s is not None and u != t]
            found = []
            for pref, kind in enumerate(options[t]):
                for cand in _candidates(t, kind, base, pb, len(options[t]) == 1):
                    trial = base + pb.delta(t, cand)[0]
                    if not (trial.mem > pb.limit).any():
                        found.append((*pb.score(trial, others + [cand.kind]), pref, cand != chosen[t], cand, trial))
            if not found:
                return None
            # the simplest kind (then the least work, then the current choice) among those within
            # STEP_TOLERANCE of the best predicted step
            fastest = min(f[0] for f in found)
            best = min((f for f in found if f[0] <= fastest * (1 + STEP_TOLERANCE)), key=lambda f: (f[2], f[1], f[3]))
            best = (None, best[4], best[5])
            if best[1] != chosen[t]:
                chosen[t], total, changed = best[1], best[2], True
        if not changed:
            break
    return chosen


def _starts(options, order, pb: _Problem) -> list:
    """Initial plans for the local search: none placed (greedy), whole tables where allowed, every
    table row-wise over all ranks where allowed, and row-wise over groups of k ranks, the tables
    (largest first) taking consecutive groups in turn. One table at a time never reaches the group
    plans from the others: moving one table off a plan balanced over all ranks to k of them
    overloads those k until the other tables move too."""
    starts = [[None] * len(options)]
    for kind in ("table", "row"):
        plan = []
        for t in range(len(options)):
            allowed = kind in options[t] or len(options[t]) == 1
            k = kind if allowed else options[t][0]
            plan.append(next(iter(_candidates(t, k, Load(pb.nranks), pb, True)), None) if allowed else None)
        if any(s is not None for s in plan):
            starts.append(plan)
    P = pb.nranks
    for k in (k for k in (2, 4, 8, 16, 32, 64, 128, 256) if k < P):
        plan, at = [None] * len(options), 0
        for t in order:
            if "row" in options[t] and k <= pb.loads[t].rows:
                plan[t] = TableSharding.row(sorted((at + j) % P for j in range(k)), pb.loads[t].rows)
                at = (at + k) % P
        if sum(s is not None for s in plan) > 1:
            starts.append(plan)
    return starts


def _kinds_per_table(kinds, n: int) -> list:
    if isinstance(kinds, str):
        kinds = [kinds] * n
    kinds = list(kinds)
    if len(kinds) != n:
        raise ValueError(f"kinds must name one sharding per table ({n}), got {len(kinds)}")
    for k in kinds:
        if k != AUTO and k not in KINDS:
            raise ValueError(f"sharding kind must be {AUTO!r} or one of {KINDS}, got {k!r}")
    return kinds


def plan_sharding(sizes, dim, pooling=1, batch=2048, ranks=1, memory_per_rank=None, network=None, *,
                  kinds=AUTO, nodes=None, rates=None, dense=None, mlp_bytes=0, top_layers=3,
                  optimizer="sgd") -> ShardingPlan:
    """One sharding per table for `ranks` ranks, chosen by the step-time cost model.

    sizes: rows per table; dim: D; pooling: lookups per sample (one number or one per table);
    batch: the global batch; memory_per_rank: bytes per rank for tables, optimizer state and the
    MLPs (None: no limit); network: a costmodel.Network (default 12.5 GB/s, 2 us). kinds: "auto",
    one kind for every table, or one ("auto" or a kind) per table; nodes: the ranks of each node
    (default: network.ranks_per_node); rates: costmodel.Rates (default: Zen 4 figures); dense:
    seconds per dense stage at the per-rank batch (for the overlap; default none); mlp_bytes: MLP
    parameter bytes; optimizer: "sgd", "rowwise_adagrad" or "adagrad" (its state counts as memory).
    """
    sizes = tuple(int(s) for s in sizes)
    if not sizes or min(sizes) < 1 or int(dim) < 1 or int(ranks) < 1 or int(batch) < 1:
        raise ValueError(f"plan_sharding needs tables of >= 1 rows, dim, ranks and batch >= 1; got sizes "
                         f"{list(sizes)[:5]}, dim {dim}, ranks {ranks}, batch {batch}")
    if optimizer not in OPTIMIZER_STATE:
        raise ValueError(f"optimizer must be one of {sorted(OPTIMIZER_STATE)}, got {optimizer!r}")
    P, D = int(ranks), int(dim)
    pooling = [float(pooling)] * len(sizes) if isinstance(pooling, (int, float)) else [float(k) for k in pooling]
    if len(pooling) != len(sizes):
        raise ValueError(f"pooling must be one number or one per table ({len(sizes)}), got {len(pooling)}")
    network = network or Network()
    per_row, per_elem = OPTIMIZER_STATE[optimizer]
    loads = tuple(TableLoad(r, D, k, per_row, per_elem) for r, k in zip(sizes, pooling))
    limit = float("inf") if memory_per_rank is None else float(memory_per_rank) - 2 * mlp_bytes
    pb = _Problem(loads, int(batch), P, tuple(nodes) if nodes else network.nodes(P), limit, network,
                  rates or Rates(), dict(dense or {}), int(mlp_bytes), int(top_layers))
    wanted = _kinds_per_table(kinds, len(sizes))
    # a table that cannot be whole on one rank is split by rows, which scales to any number of ranks
    options = [["table"] if P == 1 else [w] if w != AUTO else list(KINDS) if l.piece_bytes(l.rows, D) <= limit
               else ["row", "table_row"] for w, l in zip(wanted, loads)]
    work = [pb.rates.table_seconds(sizes[t], D, batch * pooling[t], batch) for t in range(len(sizes))]
    order = sorted(range(len(sizes)), key=lambda t: (-work[t], t))
    plans = [p for p in (_improve(s, order, options, pb) for s in _starts(options, order, pb))
             if p is not None and not (_plan_load(p, pb).mem > limit).any()]
    if not plans:
        raise ValueError(f"the tables do not fit: no plan over {P} ranks keeps every rank within "
                         f"{_bytes(limit)} of table memory ({_bytes(sum(l.piece_bytes(l.rows, D) for l in loads))} "
                         "in all); use more ranks or more memory per rank")
    best = min(plans, key=lambda c: (_total_score(c, pb), plans.index(c)))
    total = _plan_load(best, pb)
    step = estimate(total, [s.kind for s in best], pb.dense, pb.mlp_bytes, network, pb.top_layers).step
    return ShardingPlan(sizes, D, P, tuple(best), tuple(pb.delta(t, s)[1] for t, s in enumerate(best)),
                        tuple(float(m) for m in total.mem), step, bool(pb.dense))


def _plan_load(chosen, pb: _Problem) -> Load:
    total = Load(pb.nranks)
    for t, s in enumerate(chosen):
        total = total + pb.delta(t, s)[0]
    return total


def _total_score(chosen, pb: _Problem) -> tuple:
    return pb.score(_plan_load(chosen, pb), [s.kind for s in chosen])


def plan_load(plan: ShardingPlan, pooling, batch: int, rates: Rates, optimizer: str = "sgd") -> Load:
    """The cost model's per-rank load of a whole plan (what scale.py predicts from)."""
    pooling = [float(pooling)] * len(plan.sizes) if isinstance(pooling, (int, float)) else list(pooling)
    per_row, per_elem = OPTIMIZER_STATE[optimizer]
    load = Load(plan.nranks)
    for t, s in enumerate(plan.tables):
        add_table(load, TableLoad(plan.sizes[t], plan.dim, pooling[t], per_row, per_elem), s, batch, rates)
    return load
