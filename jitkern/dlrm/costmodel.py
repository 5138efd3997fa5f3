"""The step-time cost model of the hybrid-parallel DLRM, per table sharding: the seconds each rank
computes, the bytes each exchange moves and the bytes each rank holds. The planner (planner.py)
chooses shardings with it; `python -m jitkern scale` (scale.py) predicts step times with it,
from rates measured on the CPU at hand.

One step on rank r (see dist.py for the schedule it models):

    compute_r = dense stages at r's batch slice (the dense update at 1/P: it is sharded)
                + its table pieces' lookups and updates
                + the per-sample work of every sharding (bucketing lookups for row shards,
                  summing partial pools, assembling column blocks, packing gradients)
    ids       = row shards' lookups sent to their shards (two alltoallvs: lengths, then rows),
                exposed minus the pooling r does while they travel
    alltoall  = pooled pieces (and, in reverse, their gradients), behind the bottom MLP
    node      = table-row-wise partial pools summed inside a node (and their gradients back)
    allreduce = MLP and replicated-table gradients, behind the backward (the MLPs' as a
                reduce-scatter of gradients and an allgather of updated weights: the same bytes)

and the step is the slowest rank's compute plus the exposed communication.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .placement import batch_slices

KINDS = ("table", "column", "row", "table_row", "replicate")
FWD_SHARE = 0.5              # the forward's share of a table's lookup + update time
GRAD_ITEM = 8                # bytes per lookup sent to a row shard (int64 row)


@dataclass(frozen=True)
class Network:
    """Links between ranks: bandwidth in GB/s per rank and latency in microseconds per message
    between nodes; inside a node `node_bandwidth` (0: the same). ranks_per_node: 0 for one node.
    offload: the link moves bytes without the ranks' CPUs (an RDMA NIC), so transfers can run
    behind compute; False for ranks sharing one machine's memory (MPI without a progress
    thread: each byte is copied by a rank inside an MPI call, so no link time is hidden)."""
    bandwidth: float = 12.5
    latency: float = 2.0
    ranks_per_node: int = 0
    node_bandwidth: float = 0.0
    offload: bool = True

    def __post_init__(self):
        if not self.bandwidth > 0 or self.latency < 0 or self.node_bandwidth < 0 or self.ranks_per_node < 0:
            raise ValueError(f"network needs bandwidth > 0, latency >= 0, node_bandwidth >= 0, "
                             f"ranks_per_node >= 0, got {self}")

    def nodes(self, nranks: int) -> tuple:
        """The ranks of each node: contiguous blocks of ranks_per_node ranks (one node if 0)."""
        k = self.ranks_per_node if 0 < self.ranks_per_node < nranks else nranks
        return tuple(tuple(range(lo, min(lo + k, nranks))) for lo in range(0, nranks, k))


# per-lookup nanoseconds of embedding forward + fused SGD update, (row width in floats, table in
# the caches, table in DRAM), measured on one Zen 4 core (1 thread, 65536 lookups, random rows);
# widths without a specialised kernel (4, 8) take the generic one
DEFAULT_LOOKUP_NS = ((4, 26.0, 35.0), (8, 32.0, 35.0), (16, 6.4, 13.0), (32, 10.0, 33.0),
                     (64, 36.0, 57.0), (128, 60.0, 220.0))


@dataclass(frozen=True)
class Rates:
    """What compute costs on a CPU: lookups per table piece, op calls, copies, bucketing.

    lookup_ns: ((width, ns cached, ns from DRAM), ...) per lookup (forward + update); tables up to
    cache_bytes count as cached. call_us: an embedding op call's fixed cost; np_us: a NumPy call's
    on a block (with the view lookup around it); block_us: a block op's (ops.scatter_blocks: all
    of a table's pieces in one call); copy_gbs: block copies and sums; bucket_ns, bucket_us: per
    lookup and per table, sorting a slice's lookups by row shard; fixed_us: per
    table and step, what a sharding's code costs beyond the terms above (the Python around the
    calls), by kind, for a rank holding a piece and for one only receiving (calibration.py measures it).
    """
    lookup_ns: tuple = DEFAULT_LOOKUP_NS
    cache_bytes: int = 8 << 20
    call_us: float = 6.0
    np_us: float = 1.0
    block_us: float = 5.0
    copy_gbs: float = 10.0
    bucket_ns: float = 12.0
    bucket_us: float = 30.0
    fixed_us: tuple = ()         # ((kind, us on a rank holding a piece, us on a rank only receiving), ...)

    def lookup_seconds(self, width: int, table_bytes: int) -> float:
        """Seconds per lookup at this row width in a table of this size (interpolated by width)."""
        col = 1 if table_bytes <= self.cache_bytes else 2
        pts = sorted(self.lookup_ns)
        exact = [p[col] for p in pts if p[0] == width]
        if exact:
            return exact[0] * 1e-9
        ws = np.array([p[0] for p in pts], float)
        ns = np.array([p[col] for p in pts], float)
        return float(np.interp(width, ws, ns, right=ns[-1] * width / ws[-1])) * 1e-9

    def table_seconds(self, rows: int, width: int, nnz, bags: int):
        """Forward + fused update of `nnz` lookups in `bags` bags of a (rows, width) fp32 piece."""
        return 2 * self.call_us * 1e-6 + nnz * self.lookup_seconds(width, rows * width * 4)

    def copy(self, nbytes, calls: int = 1):
        return nbytes / (self.copy_gbs * 1e9) + calls * self.np_us * 1e-6

    def blocks(self, nbytes, calls: int = 1):
        """Block ops moving nbytes in all."""
        return nbytes / (self.copy_gbs * 1e9) + calls * self.block_us * 1e-6

    def bucket(self, nnz):
        return nnz * self.bucket_ns * 1e-9 + self.bucket_us * 1e-6

    def fixed(self, kind: str) -> tuple:
        """(seconds per step on a rank holding a piece, on a rank only receiving) of one table."""
        for k, hold, recv in self.fixed_us:
            if k == kind:
                return hold * 1e-6, recv * 1e-6
        return 0.0, 0.0


_ARRAYS = ("comp", "pre", "send", "recv", "ids", "node", "mem")


@dataclass
class Load:
    """Per-rank accumulators of (part of) a plan, one entry per rank; loads add and subtract."""
    nranks: int
    comp: np.ndarray = None     # seconds of embedding-related compute
    pre: np.ndarray = None      # of which done before the row shards' lookups must have arrived
    send: np.ndarray = None     # bytes of pooled pieces sent per direction (to other ranks)
    recv: np.ndarray = None
    ids: np.ndarray = None      # bytes of lookups sent to row shards
    node: np.ndarray = None     # bytes moved inside a node per direction (table-row-wise)
    mem: np.ndarray = None      # bytes held: table pieces and their optimizer state
    allreduce: float = 0.0      # bytes summed across ranks (MLP and replicated tables)

    def __post_init__(self):
        for name in _ARRAYS:
            if getattr(self, name) is None:
                setattr(self, name, np.zeros(self.nranks))

    def _combine(self, other: "Load", sign: float) -> "Load":
        return Load(self.nranks, *(getattr(self, n) + sign * getattr(other, n) for n in _ARRAYS),
                    self.allreduce + sign * other.allreduce)

    def __add__(self, other: "Load") -> "Load":
        return self._combine(other, 1.0)

    def __sub__(self, other: "Load") -> "Load":
        return self._combine(other, -1.0)


@dataclass(frozen=True)
class TableLoad:
    """What the cost model needs of one table: rows, dim, lookups per sample, state bytes per row."""
    rows: int
    dim: int
    pooling: float
    state_row_bytes: int = 0     # optimizer state per row (row-wise Adagrad: 4)
    state_elem_bytes: int = 0    # per element (element-wise Adagrad: 4)

    def piece_bytes(self, rows: int, width: int) -> int:
        return rows * width * (4 + self.state_elem_bytes) + rows * self.state_row_bytes


def add_table(load: Load, table: TableLoad, sharding, batch: int, rates: Rates) -> float:
    """Add one table's sharding (a planner.TableSharding) to `load`; -> the seconds it adds to its
    busiest holder's compute (the plan's per-table estimate)."""
    kind = sharding.kind
    slices = batch_slices(batch, load.nranks)
    b = np.array([hi - lo for lo, hi in slices], float)
    D, R, k = table.dim, table.rows, table.pooling
    nnz = batch * k
    hold, recv = rates.fixed(kind)
    if kind == "replicate":
        load.comp += hold
        return _add_replicated(load, table, b, batch, rates) + hold
    load.comp += recv
    holder_s = []
    for j, s in enumerate(sharding.ranks):
        r0, r1, c0, c1 = sharding.region(j, R, D)
        rows, width = r1 - r0, c1 - c0
        share = rows / R
        t = rates.table_seconds(rows, width, nnz * share, batch)
        # the pieces sent and the gradients gathered: a block op each (table_row sends to its node
        # by a NumPy copy per sample owner); row kinds concatenate every rank's lookups
        work = t + rates.blocks(2 * batch * width * 4, 2 if kind != "table_row" else 1)
        if kind == "table_row":
            work += rates.copy(0, load.nranks)
        if kind in ("row", "table_row"):   # the received lookups and lengths: a block op and a take
            work += rates.copy(nnz * share * GRAD_ITEM, 3) + rates.blocks(0, 1) + rates.copy(0, 1)
        else:
            load.pre[s] += FWD_SHARE * t
        if kind == "table_row":     # the forwarder's sum of the node's partial pools
            work += rates.copy(batch * D * 4, 2 * len(sharding.ranks))
            load.node[s] += (len(sharding.ranks) - 1) / len(sharding.ranks) * batch * D * 4
        work += hold - recv
        load.comp[s] += work
        load.mem[s] += table.piece_bytes(rows, width)
        holder_s.append(work + recv)
    _add_pieces(load, sharding, b, D)
    _add_receivers(load, sharding, b, k, D, rates)
    return max(holder_s)


def _add_pieces(load: Load, sharding, b: np.ndarray, D: int) -> None:
    """Bytes of the pooled pieces (and their gradients, the same in reverse) between ranks."""
    kind, S = sharding.kind, list(sharding.ranks)
    B = b.sum()
    if kind == "table_row":                      # one block per sample owner, from its forwarder
        for q in range(load.nranks):
            f = sharding.forwarder(q)
            if f != q:
                load.send[f] += b[q] * D * 4
                load.recv[q] += b[q] * D * 4
        return
    widths = np.array([c1 - c0 for _, _, c0, c1 in (sharding.region(j, 1, D) for j in range(len(S)))], float)
    for s, w in zip(S, widths):
        load.send[s] += (B - b[s]) * w * 4
        load.recv[s] -= b[s] * w * 4             # its own piece stays local
    load.recv += b * widths.sum() * 4


def _add_receivers(load: Load, sharding, b: np.ndarray, pooling: float, D: int, rates: Rates) -> None:
    """Every sample owner's share: assemble or sum the pieces, pack the gradients, bucket lookups."""
    kind, k = sharding.kind, len(sharding.ranks)
    if kind == "table":
        load.comp += rates.copy(b * D * 4)
    elif kind == "column":
        load.comp += rates.copy(2 * b * D * 4, 2 * k)
    else:
        # bucketing my slice's lookups, their lengths into the send buffer and the rows (a block op)
        sends = rates.bucket(b * pooling) + rates.copy(0, 2) + rates.blocks(b * pooling * GRAD_ITEM, 1)
        if kind == "row":   # sum k partial pools, send the gradient to k shards: a block op each
            load.comp += sends + rates.blocks(2 * k * b * D * 4, 2) + rates.copy(0, 2)
        else:               # table_row: the gradient to one forwarder
            load.comp += sends + rates.copy(b * D * 4, 3)
        load.ids += b * pooling * GRAD_ITEM + k * b * GRAD_ITEM


def replicated_rows(rows: int, nnz: float) -> float:
    """Rows whose gradients a replicated table sums across ranks: all of them when a batch
    touches many (dense exchange), else the expected distinct rows of nnz uniform draws."""
    if nnz * 4 >= rows:
        return float(rows)
    return rows * -math.expm1(-nnz / rows)


def _add_replicated(load: Load, table: TableLoad, b: np.ndarray, batch: int, rates: Rates) -> float:
    D, R, k = table.dim, table.rows, table.pooling
    touched = replicated_rows(R, batch * k)
    fwd = FWD_SHARE * rates.table_seconds(R, D, b * k, batch)
    bwd = fwd + rates.copy(2 * touched * D * 4, 4)              # coalesce, scatter into the sum buffer
    apply = (1 - FWD_SHARE) * rates.table_seconds(R, D, touched, int(touched))
    scan = 0.0 if touched == R else rates.bucket(batch * k)     # the batch's distinct rows
    work = fwd + bwd + apply + scan
    load.comp += work
    load.pre += fwd
    load.mem += table.piece_bytes(R, D) + touched * D * 4
    load.allreduce += touched * D * 4
    return float(np.max(work))


DENSE_GFLOPS = 60.0           # a rough single-core GEMM rate, for dense stages not measured


def dense_estimate(bottom, top, rows: int, gflops: float = DENSE_GFLOPS, cross=None) -> dict:
    """Seconds per dense stage at `rows` rows from the MLPs' FLOPs (bottom: [n_dense, ..., D], top:
    [input width, ..., 1]): a stand-in where the stages are not measured (the overlap needs them).
    cross: (layers, rank) of a dcn model: its cross layers' 6 GEMMs of 2 * rows * n * r FLOPs each
    (2 forward, 4 backward) are the interaction stage."""
    def flops(sizes):
        return 2.0 * rows * sum(n * m for n, m in zip(sizes[:-1], sizes[1:]))
    rate = gflops * 1e9
    out = {"bottom_fwd": flops(bottom) / rate, "top_fwd": flops(top) / rate,
           "bottom_bwd": 2 * flops(bottom) / rate, "top_bwd": 2 * flops(top) / rate}
    if cross is not None:
        out["interaction"] = 6 * 2.0 * rows * top[0] * cross[1] * cross[0] / rate
    return out


def dense_seconds(dense: dict, nranks: int) -> float:
    """One rank's dense stages (seconds per stage at its batch slice): all of them, but the dense
    update at 1/P, since each rank updates its 1/P of the MLPs (dense_shard.py)."""
    return sum(dense.values()) - dense.get("dense_upd", 0.0) * (1 - 1 / nranks)


def expected_max_normal(n: int) -> float:
    """E[max of n independent standard normals] (0 for n = 1; 0.56 for 2, 1.03 for 4, 2.34 for 64)."""
    if n <= 1:
        return 0.0
    x = np.linspace(-8.0, 8.0, 4001)
    cdf = 0.5 * (1.0 + np.vectorize(math.erf)(x / math.sqrt(2.0)))
    pdf = np.exp(-x * x / 2) / math.sqrt(2 * math.pi)
    return float(np.sum(x * n * pdf * cdf ** (n - 1)) * (x[1] - x[0]))


def sync_wait(sd: float, nranks: int) -> float:
    """Seconds a step loses waiting for the slowest of `nranks` ranks: each rank's compute varies
    from step to step (standard deviation sd), and a collective ends only when the last rank
    arrives, on average expected_max_normal(P) * sd after the typical one. One such wait per step
    (ranks that drift between collectives lose more: this is the least of it)."""
    return sd * expected_max_normal(nranks)


@dataclass(frozen=True)
class StepEstimate:
    """Seconds of one step: the slowest rank's compute, each exchange's link time, what is exposed."""
    compute: float
    alltoall: float
    ids: float
    node: float
    allreduce: float
    exposed: float

    @property
    def step(self) -> float:
        return self.compute + self.exposed


def estimate(load: Load, kinds, dense: dict, mlp_bytes: int, network: Network, top_layers: int = 3) -> StepEstimate:
    """The step time of a plan's load (`kinds`: the sharding kinds it uses), given the dense
    stages' seconds at the per-rank batch."""
    kinds = set(kinds)
    P = load.nranks
    bw, lat = network.bandwidth * 1e9, network.latency * 1e-6
    dense_s = dense_seconds(dense, P)
    emb = float(load.comp.max())
    a2a = ids = node = ar = 0.0
    ids_exposed = 0.0
    if P > 1:
        a2a = (P - 1) * lat + max(load.send.max(), load.recv.max()) / bw
        if kinds & {"row", "table_row"}:
            ids = 2 * (P - 1) * lat + load.ids.max() / bw
            ids_exposed = float(np.max(np.maximum(ids - load.pre, 0.0) + load.comp)) - emb
        if "table_row" in kinds:
            nb = (network.node_bandwidth or network.bandwidth) * 1e9
            k = network.ranks_per_node if 0 < network.ranks_per_node < P else P
            node = (k - 1) * lat + load.node.max() / nb
        ar = 2 * (P - 1) * lat + 2 * (P - 1) / P * (mlp_bytes + load.allreduce) / bw
    if not network.offload:             # every transfer is the ranks' own copying: all exposed
        return StepEstimate(dense_s + emb, a2a, ids, node, ar, ids + 2 * (a2a + node) + ar)
    # forward: the pooled alltoall (and in-node sums) travel behind the bottom MLP. Backward: the
    # reverse exchanges and the allreduce share the link from the top MLP's first gradient on;
    # the exchanges must be in before the table updates, the allreduce before the dense update
    fwd = max(a2a + node - dense.get("bottom_fwd", 0.0), 0.0)
    behind = (dense.get("top_bwd", 0.0) * (top_layers - 1) / max(top_layers, 1)
              + dense.get("interaction", 0.0) / 2 + dense.get("bottom_bwd", 0.0) + emb / 2)
    bwd = max(a2a + node - dense.get("bottom_bwd", 0.0), a2a + node + ar - behind, 0.0)
    return StepEstimate(dense_s + emb, a2a, ids, node, ar, max(ids_exposed, 0.0) + fwd + bwd)
