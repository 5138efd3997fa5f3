"""Table shardings at run time: this rank's part of one table, one small class per kind, one interface.

    init(rs)               consume the table's share of the one-process init stream; keep my region
    bucket(st)             row kinds: send my slice's lookups to the shards holding their rows
    lookup(st)             forward: pool what this rank sends (replicate: my slice's own rows)
    assemble(st)           -> ly (b, D): my slice's pooled rows from the pieces received
    grad(st, dly)          backward: my slice's pooled gradient (b, D) into the pieces sent back
    update(st)             apply my piece's update through the table optimizer (the one seam)
    read() / write(block)  the fp32 rows and columns of my region (state_dict and checkpoints)

`st` is the step (dist._DistStep): the global batch's lookups, the learning rate and the exchange
layout of this batch size (layout.Layout), whose views the pieces travel in.

Against one process (same seed, same global batch, any table optimizer of optimizers.py), the
weights and the tables' optimizer state are
- table, column: bit-identical (every bag is pooled, and every row updated, in the same order; a
  column piece keeps the state of its columns (element-wise Adagrad) or of its rows, the per-row
  sums of squares summed over the column group (row-wise Adagrad))
- row, table_row: updates bit-identical given the same pooled gradient; a bag whose lookups fall
  into several shards is pooled as a sum of partial sums (in shard order), which reorders its
  float sums: within 1e-6 relative (bit-identical with one lookup per bag)
- replicate: the gradients of each rank's samples are summed across ranks and then applied once
  per row, where one process applies them lookup by lookup (SGD) or sums them in position order
  (Adagrad): within 1e-6 relative
The data-parallel dense parameters (MLPs, cross network) take the allreduced gradient, whose sums
are ordered differently: within 1e-6 relative by SGD. Adagrad's step lr g / (sqrt(state) + eps)
is normalised by the gradient itself, so an element whose gradient is within a few orders of eps
of zero takes the rounding of its reordered sums relative to eps (up to lr |dg| / eps a step);
in training that reaches the tables' pooled gradients too: all but such rare elements (1e-4 of
them in the tests) within 1e-6, those within 1e-2 lr, the optimizer state within 1e-5 relative.
"""
from __future__ import annotations

import os

import numpy as np

from .. import ops
from ..ops.blocks import bucket_by_shard
from ..ops.embedding import empty_table
from .optimizers import TableOptimizer

INIT_CHUNK = 1 << 16        # rows drawn per call: as DLRM._init_table, so the streams match


# --------------------------------------------------------------------------- column groups


class ColumnGroup:
    """The ranks holding one table's column pieces, for row updates that need the whole row
    (optimizers.RowwiseAdagrad's update(..., group=)).
    progress: called while waiting, so that the model's other exchanges in flight move on (a
    member blocked here must not hold up the exchanges its peers still wait for)."""

    def __init__(self, comm, dim: int, progress=None):
        self.comm, self.dim, self.progress = comm, int(dim), progress

    def sum(self, partial: np.ndarray) -> np.ndarray:
        """Every member's `partial` (U,) float64, summed in piece order (the same on every member)."""
        parts = np.empty((self.comm.Get_size(), len(partial)), np.float64)
        req = self.comm.Iallgather(np.ascontiguousarray(partial), parts)
        while not req.Test():
            if self.progress is not None:
                self.progress()
            os.sched_yield()
        total = parts[0].copy()
        for p in parts[1:]:
            total += p
        return total


# --------------------------------------------------------------------------- shards


def slice_bags(offsets, indices, lo, hi):
    """The bags of samples lo..hi-1 of one table: (offsets (hi-lo,) from 0, indices view)."""
    start = int(offsets[lo]) if lo < len(offsets) else len(indices)
    end = int(offsets[hi]) if hi < len(offsets) else len(indices)
    return offsets[lo:hi] - start, indices[start:end]


class Scratch:
    """Grow-only named buffers, reused step after step (fresh NumPy temporaries of a batch's size
    cost more in page faults than the arithmetic on them)."""

    def __init__(self):
        self._bufs: dict = {}

    def __call__(self, name, n: int, dtype=np.int64) -> np.ndarray:
        buf = self._bufs.get(name)
        if buf is None or buf.size < n or buf.dtype != dtype:
            buf = self._bufs[name] = np.empty(max(n, 1), dtype)
        return buf[:n]


def bucket(offsets, indices, bounds, scratch=None, name="rows"):
    """Sort one table's lookups of some bags by row shard, keeping each shard's in position order.

    offsets: (b,) int64 from 0, indices: (n,) int64, bounds: (k+1,) even row bounds (planner's
    ceil(j R / k), so the shard of row i is i * k // R) -> (lengths (k, b): lookups of each bag
    in each shard, rows (n,): rows minus their shard's first row, grouped by shard, ends (k+1,)).
    scratch: a Scratch for the temporaries; the rows land in its buffer `name`.
    """
    scratch = scratch or Scratch()
    b, n, k = len(offsets), len(indices), len(bounds) - 1
    lengths = scratch("bucket_lengths", k * b).reshape(k, b)
    rows, ends = scratch(name, n), scratch((name, "ends"), k + 1)
    return bucket_by_shard(offsets, indices, np.asarray(bounds, np.int64), lengths, rows, ends,
                           scratch("bucket_shard", n, np.int32))


class Shard:
    """This rank's part of table t under `spec` (a planner.TableSharding); the base holds whole rows
    and columns of its region and pools them for the whole global batch (table-wise)."""
    kind = "table"

    def __init__(self, t: int, spec, rows: int, dim: int, rank: int, *, precision="fp32",
                 optimizer: TableOptimizer | None = None, group: ColumnGroup | None = None):
        self.t, self.spec, self.rows, self.dim, self.rank = t, spec, int(rows), int(dim), rank
        self.precision = precision
        self.optimizer = optimizer or TableOptimizer()
        self.group = group
        self.piece = spec.piece_of(rank)
        self.region = spec.region(self.piece, self.rows, self.dim) if self.piece is not None else None
        self.weight = self.state = None

    @property
    def held(self) -> bool:
        return self.piece is not None

    @property
    def width(self) -> int:
        return self.region[3] - self.region[2]

    # ---- parameters
    def init(self, rs) -> None:
        """Draw the whole table's init numbers in order (one process's stream), keep my region."""
        R, D = self.rows, self.dim
        if not self.held:
            for r0 in range(0, R, INIT_CHUNK):
                rs.random_sample((min(R, r0 + INIT_CHUNK) - r0) * D)
            return
        a0, a1, c0, c1 = self.region
        w = empty_table(a1 - a0, c1 - c0)
        bound = np.sqrt(1.0 / R)
        for r0 in range(0, R, INIT_CHUNK):
            r1 = min(R, r0 + INIT_CHUNK)
            if r1 <= a0 or r0 >= a1:
                rs.random_sample((r1 - r0) * D)
                continue
            chunk = rs.uniform(low=-bound, high=bound, size=(r1 - r0, D))
            lo, hi = max(r0, a0), min(r1, a1)
            w[lo - a0:hi - a0] = chunk[lo - r0:hi - r0, c0:c1]
        self.weight = ops.SplitBF16Table.from_float32(w) if self.precision == "bf16" else w
        self.state = self.optimizer.state(*w.shape)

    def write(self, block) -> None:
        """Set my region from an fp32 (rows, width) block."""
        if self.precision == "bf16":
            self.weight = ops.SplitBF16Table.from_float32(np.ascontiguousarray(block, np.float32))
        else:
            if self.weight is None:
                self.weight = empty_table(*block.shape)
            np.copyto(self.weight, block)
        if self.state is None:
            self.state = self.optimizer.state(*self.weight.shape)

    def read(self) -> np.ndarray:
        """My region as fp32: the live table (fp32) or the joined halves (bf16)."""
        return self.weight if isinstance(self.weight, np.ndarray) else self.weight.to_float32()

    def nbytes(self) -> int:
        """Bytes of my region's weights (as one process's parameter_bytes counts them: no optimizer state)."""
        if self.weight is None:
            return 0
        w = self.weight
        return w.nbytes if isinstance(w, np.ndarray) else w.hi.nbytes + w.lo.nbytes

    # ---- step
    def bucket(self, st) -> None:
        """Row kinds only: send my slice's lookups to the shards holding their rows."""

    def lookup(self, st) -> None:
        """Pool the whole global batch from my region and send each rank its slice's rows."""
        lay = st.layout
        pooled = lay.scratch(self.width)
        ops.embedding_bag_forward(self.weight, st.indices[self.t], st.offsets[self.t], out=pooled)
        self.send_partial(st, pooled)

    def send_partial(self, st, pooled) -> None:
        """Each peer's rows of the pooled (batch, width) into its piece of the send buffer."""
        lay = st.layout
        ops.scatter_blocks(pooled, lay.fwd_send, lay.send_offsets(self.t), lay.starts, lay.stops)

    def assemble(self, st) -> np.ndarray:
        return st.layout.fwd_in[self.spec.ranks[0], self.t]

    def grad(self, st, dly) -> None:
        st.layout.bwd_out[self.spec.ranks[0], self.t][...] = dly

    def gathered_grad(self, st) -> np.ndarray:
        """The pooled gradient (B, width) of the whole batch for my region, from every rank's piece."""
        lay = st.layout
        return ops.gather_blocks(lay.bwd_recv, lay.send_offsets(self.t), lay.starts, lay.stops, lay.dout(self.width))

    def update(self, st) -> None:
        t = self.t
        self.optimizer.update(self.weight, self.state, st.indices[t], st.offsets[t], self.gathered_grad(st),
                              st.lr, group=self.group)


class TableShard(Shard):
    """table: the whole table on one rank. Bit-identical to one process."""


class ColumnShard(Shard):
    """column: D split into column blocks; my block pooled for the whole batch; the sample owners
    put the blocks side by side. Bit-identical to one process (each element sums the same terms
    in the same order)."""
    kind = "column"

    def assemble(self, st) -> np.ndarray:
        lay = st.layout
        ly = lay.ly_buffer(self.t)
        for s, c0, c1 in self.spec.pieces(lay.rank, self.dim):
            ly[:, c0:c1] = lay.fwd_in[s, self.t]
        return ly

    def grad(self, st, dly) -> None:
        lay = st.layout
        for s, c0, c1 in self.spec.pieces(lay.rank, self.dim):
            lay.bwd_out[s, self.t][...] = dly[:, c0:c1]


class RowShard(Shard):
    """row: row ranges on k ranks. Each sample owner buckets its slice's lookups by shard and sends
    them (bucket); each shard pools the partial sums of its rows for the whole batch (lookup); the
    sample owners add the k partial sums up in shard order (assemble). Updates are bit-identical
    to one process given the same pooled gradient (each row takes its lookups in position order);
    pooled sums are within 1e-6 relative (bit-identical with one lookup per bag)."""
    kind = "row"

    def bucket(self, st) -> None:
        lay, t = st.layout, self.t
        off, idx = slice_bags(st.offsets[t], st.indices[t], lay.lo, lay.hi)
        lengths, rows, ends = bucket(off, idx, self.spec.bounds, lay.int_scratch, ("rows", t))
        lay.bucketed_lengths(t, lengths)
        st.ids_out[t] = (rows, ends)

    def lookups(self, st):
        """(offsets (B,), rows) of the whole batch's lookups into my rows, from every rank's slice."""
        lay, t = st.layout, self.t
        rows, lengths = lay.lookups_of(t, st.ids_in)
        off = lay.int_scratch(("offsets", t), lay.batch)
        off[:1] = 0
        np.cumsum(lengths[:-1], out=off[1:])
        st.row_bags[t] = (off, rows)
        return off, rows

    def lookup(self, st) -> None:
        lay = st.layout
        off, rows = self.lookups(st)
        pooled = lay.scratch(self.dim)
        ops.embedding_bag_forward(self.weight, rows, off, out=pooled)
        self.send_partial(st, pooled)

    def assemble(self, st) -> np.ndarray:
        lay, ranks = st.layout, tuple(self.spec.ranks)
        if len(ranks) == 1:
            return lay.fwd_in[ranks[0], self.t]
        return ops.sum_blocks(lay.fwd_recv, lay.recv_offsets(self.t, ranks), lay.ly_buffer(self.t))

    def grad(self, st, dly) -> None:
        lay = st.layout
        k = len(self.spec.ranks)
        ops.scatter_blocks(dly, lay.bwd_send, lay.recv_offsets(self.t, tuple(self.spec.ranks)), np.zeros(k, np.int64),
                           np.full(k, lay.b, np.int64))

    def update(self, st) -> None:
        off, rows = st.row_bags[self.t]
        self.optimizer.update(self.weight, self.state, rows, off, self.gathered_grad(st), st.lr, group=self.group)


class TableRowShard(RowShard):
    """table_row: row-wise over one node's ranks. The partial sums of rank q's samples go to the
    node rank forwarder(q) inside the node, which adds them up (in shard order) and sends one
    block to q; q's gradient comes back to the forwarder, which hands it to the node's shards.
    The same contract as row."""
    kind = "table_row"

    def send_partial(self, st, pooled) -> None:
        lay = st.layout
        for i in self.spec.ranks:
            out = lay.node_out[i, self.t]
            for (lo, hi), (a, b) in zip(lay.node_slices[i], lay.node_rows[i]):
                out[a:b] = pooled[lo:hi]

    def forward_sums(self, st) -> None:
        """On the forwarder: my ranks' sums of the node's partial pools into the pieces they get."""
        lay, t = st.layout, self.t
        parts = [lay.node_in[s, t] for s in self.spec.ranks]
        acc = lay.node_sum(t)
        np.copyto(acc, parts[0])
        for p in parts[1:]:
            np.add(acc, p, out=acc)
        for q, (a, b) in zip(lay.node_owned, lay.node_rows[lay.rank]):
            lay.fwd_out[q, t][...] = acc[a:b]

    def assemble(self, st) -> np.ndarray:
        return st.layout.fwd_in[self.spec.forwarder(st.layout.rank), self.t]

    def grad(self, st, dly) -> None:
        st.layout.bwd_out[self.spec.forwarder(st.layout.rank), self.t][...] = dly

    def forward_grads(self, st) -> None:
        """On the forwarder: the gradients of my ranks' samples, to every shard of the node."""
        lay, t = st.layout, self.t
        for s in self.spec.ranks:
            out = lay.node_bwd_out[s, t]
            for q, (a, b) in zip(lay.node_owned, lay.node_rows[lay.rank]):
                out[a:b] = lay.bwd_in[q, t]

    def gathered_grad(self, st) -> np.ndarray:
        lay = st.layout
        dout = lay.dout(self.dim)
        for i in self.spec.ranks:
            src = lay.node_bwd_in[i, self.t]
            for (lo, hi), (a, b) in zip(lay.node_slices[i], lay.node_rows[i]):
                dout[lo:hi] = src[a:b]
        return dout


class ReplicatedShard(Shard):
    """replicate: the table on every rank. Each rank pools its own slice; the gradients of each
    rank's samples are summed across ranks (over the rows the batch touches, or every row when it
    touches many: the same choice on every rank) and every replica applies the same update.
    Pooling is bit-identical to one process; the update applies each row's summed gradient once
    where one process applies it lookup by lookup: within 1e-6 relative."""
    kind = "replicate"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._arange = np.arange(self.rows, dtype=np.int64)     # every row; one bag per row

    def lookup(self, st) -> None:
        lay, t = st.layout, self.t
        off, idx = slice_bags(st.offsets[t], st.indices[t], lay.lo, lay.hi)
        ops.embedding_bag_forward(self.weight, idx, off, out=lay.ly_buffer(t))

    def assemble(self, st) -> np.ndarray:
        return st.layout.ly_buffer(self.t)

    def touched(self, st):
        """The rows whose gradients are summed: None for every row, else the batch's distinct rows."""
        idx = st.indices[self.t]
        return None if len(idx) * 4 >= self.rows else np.unique(idx)

    def grad(self, st, dly) -> np.ndarray:
        """-> my slice's gradient rows, scattered into the buffer the ranks sum (rows x D)."""
        lay, t = st.layout, self.t
        off, idx = slice_bags(st.offsets[t], st.indices[t], lay.lo, lay.hi)
        rows, drows = ops.embedding_bag_backward(idx, off, dly, self.rows)
        touched = self.touched(st)
        buf = lay.replica_grad(t, self.rows if touched is None else len(touched), self.dim)
        buf.fill(0.0)
        buf[rows if touched is None else np.searchsorted(touched, rows)] = drows
        st.replica[t] = (touched, buf)
        return buf

    def update(self, st) -> None:
        """Every replica applies the summed gradient, one bag per row, to the rows the batch touches
        (summed for every row, a stateful optimizer takes only those: as in one process, the others
        keep their state, and Adagrad's step on a zero gradient is not a no-op when eps and state are 0)."""
        touched, grad = st.replica[self.t]
        rows = self._arange if touched is None else touched
        if touched is None and self.state is not None:
            rows = np.unique(st.indices[self.t])
            grad = grad[rows]
        self.optimizer.update(self.weight, self.state, rows, self._arange[:len(rows)], grad, st.lr)


SHARDS = {"table": TableShard, "column": ColumnShard, "row": RowShard, "table_row": TableRowShard,
          "replicate": ReplicatedShard}


def make_shard(t: int, spec, rows: int, dim: int, rank: int, **kwargs) -> Shard:
    return SHARDS[spec.kind](t, spec, rows, dim, rank, **kwargs)
