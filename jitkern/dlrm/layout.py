"""The exchange layout of one global batch size on one rank, for a sharding plan: the buffers the
pooled pieces, their gradients, the row shards' lookups and the in-node sums travel in, and the
views each sharding reads and writes (reused by every step with that batch size).

Alltoallv buffers hold, per peer, the pieces for that peer in table order; a piece of table t
between this rank and peer p is a contiguous (rows, width) view: fwd_out[p, t] (sent to p),
fwd_in[p, t] (received from p), and their mirrors for the gradients, bwd_out and bwd_in.
"""
from __future__ import annotations

import numpy as np

from ..ops.blocks import copy_segments
from .placement import batch_slices
from .sharding import Scratch

ROW_KINDS = ("row", "table_row")


def _pack(parts, dtype=np.float32):
    """parts: per peer, [(key, shape)] in order -> (flat buffer, element counts per peer,
    {(peer, key): view})."""
    counts = np.array([sum(int(np.prod(shape)) for _, shape in p) for p in parts], np.int64)
    flat = np.empty(int(counts.sum()), dtype)
    views, o = {}, 0
    for peer, p in enumerate(parts):
        for key, shape in p:
            n = int(np.prod(shape))
            views[peer, key] = flat[o:o + n].reshape(shape)
            o += n
    return flat, counts, views


class Layout:
    """Buffers and views of one global batch size on `rank` under `plan` (a planner.ShardingPlan)."""

    def __init__(self, plan, rank: int, batch: int):
        P, D = plan.nranks, plan.dim
        self.rank, self.nranks, self.batch, self.dim = rank, P, batch, D
        self.slices = batch_slices(batch, P)
        self.lo, self.hi = self.slices[rank]
        self.b = self.hi - self.lo
        rows = [hi - lo for lo, hi in self.slices]
        send = [[] for _ in range(P)]        # pieces this rank sends to q (forward)
        recv = [[] for _ in range(P)]        # pieces it receives from s
        for t, spec in enumerate(plan.tables):
            for q in range(P):
                send[q] += [(t, (rows[q], c1 - c0)) for s, c0, c1 in spec.pieces(q, D) if s == rank]
            for s, c0, c1 in spec.pieces(rank, D):
                recv[s].append((t, (self.b, c1 - c0)))
        self.fwd_send, self.send_counts, self.fwd_out = _pack(send)
        self.fwd_recv, self.recv_counts, self.fwd_in = _pack(recv)
        self.bwd_recv, _, self.bwd_in = _pack(send)          # the gradients travel the other way
        self.bwd_send, _, self.bwd_out = _pack(recv)
        self._ids(plan, rows)
        self._node(plan, rows)
        self._scratch = np.empty(batch * D, np.float32)
        self._dout = np.empty(batch * D, np.float32)
        self._ly: dict = {}
        self._replica: dict = {}
        self._offsets: dict = {}
        self.int_scratch = Scratch()
        # each peer's rows of the global batch, as the block ops (ops.scatter_blocks, ...) take them
        self.starts = np.array([lo for lo, _ in self.slices], np.int64)
        self.stops = np.array([hi for _, hi in self.slices], np.int64)

    def _ids(self, plan, rows) -> None:
        """Stage one of the row shards' lookups: the per-bag lengths, a fixed layout."""
        P, me = self.nranks, self.rank
        rowwise = [t for t, s in enumerate(plan.tables) if s.kind in ROW_KINDS]
        self.has_rows = bool(rowwise)
        send = [[(t, (self.b,)) for t in rowwise if q in plan.tables[t].ranks] for q in range(P)]
        recv = [[(t, (rows[q],)) for t in rowwise if me in plan.tables[t].ranks] for q in range(P)]
        self.ids_send, self.ids_send_counts, self.ids_len_out = _pack(send, np.int64)
        self.ids_recv, self.ids_recv_counts, self.ids_len_in = _pack(recv, np.int64)
        # Stage two moves P x T segments of rows per step; its bookkeeping is index arrays fixed
        # here, so that a step costs a few NumPy calls however many ranks and tables there are.
        # Send segment i: my lookups of one table for the shard at position j of its ranks (a slice
        # of that table's bucketed rows), in the send buffer's order (peer by peer, table by table).
        self.row_tables = rowwise
        segs = [(q, t, plan.tables[t].ranks.index(q)) for q in range(P) for t, _ in send[q]]
        self._send_peer = np.array([q for q, _, _ in segs], np.int64)
        # per row table: its segments' places in the send order and their shard positions
        self._send_of = [(np.array([i for i, (_, u, _) in enumerate(segs) if u == t], np.int64),
                          np.array([j for _, u, j in segs if u == t], np.int64)) for t in rowwise]
        # where each shard's lengths go in ids_send: (k, b) element indices per row table
        base = self.ids_send.ctypes.data
        self._len_out = {t: np.array([(self.ids_len_out[q, t].ctypes.data - base) // 8 for q in plan.tables[t].ranks],
                                     np.int64)[:, None] + np.arange(self.b) for t in rowwise}
        # receive segment i: the rows sample owner q sends me for table t, in the receive order
        rsegs = [(q, t) for q in range(P) for t, _ in recv[q]]
        base = self.ids_recv.ctypes.data
        starts = np.array([(self.ids_len_in[q, t].ctypes.data - base) // 8 for q, t in rsegs], np.int64)
        self._recv_peer = np.array([q for q, _ in rsegs], np.int64)
        self._recv_len = (starts, starts + np.array([rows[q] for q, _ in rsegs], np.int64))
        index = {key: i for i, key in enumerate(rsegs)}
        held = [t for t in rowwise if me in plan.tables[t].ranks]
        self._recv_of = {t: np.array([index[q, t] for q in range(P)], np.int64) for t in held}
        # table t's per-bag lengths from every sample owner, in sample order, as ids_recv indices
        self._len_in = {t: np.concatenate([starts[i] + np.arange(rows[q]) for q, i in enumerate(self._recv_of[t])])
                        for t in held}

    def _node(self, plan, rows) -> None:
        """The in-node sums of table-row-wise tables: my node's ranks and the samples each forwards."""
        P, me, D = self.nranks, self.rank, self.dim
        mine = [t for t, s in enumerate(plan.tables) if s.kind == "table_row" and me in s.ranks]
        self.has_node = any(s.kind == "table_row" for s in plan.tables)
        members = {plan.tables[t].ranks for t in mine}
        if len(members) > 1:
            raise ValueError(f"rank {me} is in table-row-wise groups {sorted(members)}: a rank's "
                             "table-row-wise tables must all use the ranks of its node")
        group = next(iter(members), ())
        self.node_slices, self.node_rows, self.node_owned = {}, {}, []
        for i in group:
            owned = [q for q in range(P) if plan.tables[mine[0]].forwarder(q) == i]
            ends = np.cumsum([0] + [rows[q] for q in owned])
            self.node_slices[i] = [self.slices[q] for q in owned]
            self.node_rows[i] = list(zip(ends[:-1].tolist(), ends[1:].tolist()))
            if i == me:
                self.node_owned = owned
        n = {i: (self.node_rows[i][-1][1] if self.node_rows[i] else 0) for i in group}
        send = [[(t, (n[q], D)) for t in mine] if q in group else [] for q in range(P)]
        recv = [[(t, (n[me], D)) for t in mine] if q in group else [] for q in range(P)]
        self.node_send, self.node_send_counts, self.node_out = _pack(send)
        self.node_recv, self.node_recv_counts, self.node_in = _pack(recv)
        self.node_bwd_recv, _, self.node_bwd_in = _pack(send)
        self.node_bwd_send, _, self.node_bwd_out = _pack(recv)
        self._node_sum = np.empty((n.get(me, 0), D), np.float32)

    # ---- where pieces sit in the flat buffers (one block op moves all of a table's pieces)
    def _where(self, key, views, flat, peers, t) -> np.ndarray:
        got = self._offsets.get(key)
        if got is None:
            base = flat.ctypes.data
            got = self._offsets[key] = np.array([(views[q, t].ctypes.data - base) // 4 for q in peers], np.int64)
        return got

    def send_offsets(self, t: int) -> np.ndarray:
        """Element offsets of fwd_out[q, t] in fwd_send for every peer q: also those of bwd_in[q, t]
        in bwd_recv (the same layout)."""
        return self._where(("send", t), self.fwd_out, self.fwd_send, range(self.nranks), t)

    def recv_offsets(self, t: int, sources) -> np.ndarray:
        """Element offsets of fwd_in[s, t] in fwd_recv for s in `sources` (a tuple): also those of
        bwd_out[s, t] in bwd_send."""
        return self._where(("recv", t, sources), self.fwd_in, self.fwd_recv, sources, t)

    # ---- per-step scratch
    def scratch(self, width: int) -> np.ndarray:
        """(batch, width) for a piece's pooled rows (each user is done with it before the next)."""
        return self._scratch[:self.batch * width].reshape(self.batch, width)

    def dout(self, width: int) -> np.ndarray:
        """(batch, width) for a piece's gathered gradient."""
        return self._dout[:self.batch * width].reshape(self.batch, width)

    def ly_buffer(self, t: int) -> np.ndarray:
        """(b, D) of table t's pooled rows of my slice, where they are assembled rather than received."""
        buf = self._ly.get(t)
        if buf is None:
            buf = self._ly[t] = np.empty((self.b, self.dim), np.float32)
        return buf

    def node_sum(self, t: int) -> np.ndarray:
        return self._node_sum

    def replica_grad(self, t: int, rows: int, dim: int) -> np.ndarray:
        """(rows, dim) for a replicated table's summed gradient (grown as needed, kept)."""
        buf = self._replica.get(t)
        if buf is None or buf.size < rows * dim:
            buf = self._replica[t] = np.empty(max(rows * dim, 1), np.float32)
        return buf[:rows * dim].reshape(rows, dim)

    def bucketed_lengths(self, t: int, lengths: np.ndarray) -> None:
        """Stage one: table t's bucketed per-bag lengths (k, b) (sharding.bucket) into the buffer
        that sends each shard its row."""
        self.ids_send[self._len_out[t]] = lengths

    def ids_stage2(self, bucketed: dict):
        """Stage two of the row shards' lookups, once the lengths are in: (send buffer, send counts,
        receive buffer, receive counts, what lookups_of reads). bucketed: {t: (rows, ends)} of every
        row-sharded table (sharding.bucket: my slice's lookups grouped by shard)."""
        P = self.nranks
        lens = np.empty(len(self._send_peer), np.int64)
        for t, (places, js) in zip(self.row_tables, self._send_of):
            ends = bucketed[t][1]
            lens[places] = ends[js + 1] - ends[js]
        at = np.zeros(len(lens), np.int64)
        np.cumsum(lens[:-1], out=at[1:])
        send = self.int_scratch("ids_send", int(lens.sum()))
        for t, (places, js) in zip(self.row_tables, self._send_of):
            rows, ends = bucketed[t]
            copy_segments(rows, ends[js], lens[places], send, at[places])
        send_counts = np.bincount(self._send_peer, weights=lens, minlength=P).astype(np.int64)
        total = np.zeros(len(self.ids_recv) + 1, np.int64)
        np.cumsum(self.ids_recv, out=total[1:])
        lo, hi = self._recv_len
        sizes = total[hi] - total[lo]
        recv_counts = np.bincount(self._recv_peer, weights=sizes, minlength=P).astype(np.int64)
        starts = np.zeros(len(sizes), np.int64)
        np.cumsum(sizes[:-1], out=starts[1:])
        recv = self.int_scratch("ids_recv", int(sizes.sum()))
        return send, send_counts, recv, recv_counts, (recv, starts, sizes)

    def lookups_of(self, t: int, received):
        """(rows, per-bag lengths) of the whole batch's lookups into my shard of table t, in sample
        order, from stage two's `received` (in this layout's scratch, until table t's next step)."""
        recv, starts, sizes = received
        segs = self._recv_of[t]
        lens = sizes[segs]
        rows = copy_segments(recv, starts[segs], lens, self.int_scratch(("bags", t), int(lens.sum())))
        return rows, np.take(self.ids_recv, self._len_in[t], out=self.int_scratch("lengths", self.batch))
