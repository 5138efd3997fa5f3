"""mpi4py hybrid parallelism for the DLRM: the distributed model (tables model-parallel by
placement.py, MLPs data-parallel), over the exchange layer of exchange.py; launch.py starts and
ends the ranks (communicator, fault handling). mpi4py is imported only when a communicator is
actually used, so single-process runs never initialise MPI.
"""
from __future__ import annotations

import time

import numpy as np

from .. import ops
from . import model as _model
from .exchange import CommStat, Exchange
from .launch import comm_from_env, describe_ranks, install_fault_handlers
from .placement import REPLICATE_BYTES, REPLICATED, batch_slices, place_tables

__all__ = ["DistributedDLRM", "comm_from_env"]  # comm_from_env: launch.py's, kept importable from here


# --------------------------------------------------------------------------- the model

BUCKET_BYTES = 1 << 20      # MLP gradients are allreduced in buckets of about this size
_SKIP_CHUNK = 1 << 16       # rows drawn at a time when skipping another rank's table's init


class _Plan:
    """Per global batch size: slices, counts and the exchange buffers (reused every step).

    Alltoall blocks are (tables, rows, D) so that every embedding call writes, and the
    interaction reads, contiguous (rows, D) arrays: the forward needs no copy at all.
    """

    def __init__(self, m: "DistributedDLRM", batch: int):
        P, r, D = m.nranks, m.rank, m.embedding_dim
        self.batch = batch
        self.slices = batch_slices(batch, P)
        self.lo, self.hi = self.slices[r]
        self.b = self.hi - self.lo
        rows = [hi - lo for lo, hi in self.slices]
        n_own = len(m.owned)
        tabs_of = [m.placement.tables_of(s) for s in range(P)]
        # forward: (my tables, rows of slice q) go to rank q; from rank s come (its tables, my rows)
        self.own_counts = [n_own * rows[q] * D for q in range(P)]
        self.slice_counts = [len(tabs_of[s]) * self.b * D for s in range(P)]
        self.fwd_send = np.empty(sum(self.own_counts), np.float32)
        self.fwd_recv = np.empty(sum(self.slice_counts), np.float32)
        self.bwd_send = np.empty_like(self.fwd_recv)      # the reverse: my slice's dly to each owner
        self.bwd_recv = np.empty_like(self.fwd_send)      # my tables' gradients, all B rows
        self.fwd_send_blocks = self._blocks(self.fwd_send, [(n_own, n) for n in rows], D)
        self.bwd_recv_blocks = self._blocks(self.bwd_recv, [(n_own, n) for n in rows], D)
        fwd_recv_blocks = self._blocks(self.fwd_recv, [(len(t), self.b) for t in tabs_of], D)
        self.bwd_send_blocks = self._blocks(self.bwd_send, [(len(t), self.b) for t in tabs_of], D)
        self.tables_of = tabs_of
        self.replica_ly = np.empty((len(m.replicated), self.b, D), np.float32)
        # ly[t]: my slice's pooled rows of table t, (b, D) contiguous, wherever they arrive
        self.ly = [None] * m.num_tables
        for s in range(P):
            for k, t in enumerate(tabs_of[s]):
                self.ly[t] = fwd_recv_blocks[s][k]
        for k, t in enumerate(m.replicated):
            self.ly[t] = self.replica_ly[k]
        self.dout = np.empty((batch, D), np.float32)      # one table's gradient rows, gathered
        self.loss_parts = np.zeros(P, np.float64)
        self.probs = np.empty(batch, np.float32)

    @staticmethod
    def _blocks(flat, shapes, D):
        out, o = [], 0
        for n_tables, n_rows in shapes:
            n = n_tables * n_rows * D
            out.append(flat[o:o + n].reshape(n_tables, n_rows, D))
            o += n
        return out


def _into(out, result):
    """The op's result in `out` (ops that honour out= return it; copy otherwise)."""
    if result is not out:
        np.copyto(out, result)
    return out


def _slice_bags(offsets, indices, lo, hi):
    """The bags of samples lo..hi-1 of one table: (offsets (hi-lo,) from 0, indices view)."""
    start = int(offsets[lo]) if lo < len(offsets) else len(indices)
    end = int(offsets[hi]) if hi < len(offsets) else len(indices)
    return offsets[lo:hi] - start, indices[start:end]


class DistributedDLRM(_model.DLRM):
    """The DLRM over an MPI communicator: tables model-parallel, MLPs data-parallel.

    Every rank calls every method with the same arguments (the same global batch); results
    (loss, probabilities, state_dict) are the same on every rank. Built by DLRM(..., comm=comm).
    """

    def __init__(self, *args, comm=None, **kwargs):
        if comm is None:
            raise ValueError("DistributedDLRM needs comm= (an mpi4py communicator)")
        self.rank, self.nranks = comm.Get_rank(), comm.Get_size()
        install_fault_handlers(comm)
        self.exchange = Exchange(comm)
        self._plans: dict[int, _Plan] = {}
        self._replica_grads: dict[int, np.ndarray] = {}
        self._bucket: list | None = None   # gradients waiting for an allreduce bucket (backward only)
        super().__init__(*args, comm=comm, **kwargs)

    # ------------------------------------------------------------------ construction

    def _init_parameters(self, rs):
        # The placement needs the validated sizes, which the base __init__ has set by now.
        # bf16 split tables have no dense SGD op, so they are never replicated
        replicate = REPLICATE_BYTES if self.embedding_precision == "fp32" else 0
        self.placement = place_tables(self.embedding_sizes, self.embedding_dim, self.nranks,
                                      replicate_bytes=replicate)
        self.owned = self.placement.tables_of(self.rank)
        self.replicated = self.placement.replicated
        local = set(self.owned) | set(self.replicated)
        # Every rank draws every table's init numbers in order (same stream as one process)
        # and keeps only its own: the MLPs' init, drawn after the tables, then match too.
        self.emb = [self._init_table(rs, rows) if t in local else self._skip_table(rs, rows)
                    for t, rows in enumerate(self.embedding_sizes)]
        self.bot_w, self.bot_b = self._init_mlp(rs, self.bottom_mlp)
        self.top_w, self.top_b = self._init_mlp(rs, self.top_mlp)

    def _skip_table(self, rs, rows):
        for r0 in range(0, rows, _SKIP_CHUNK):
            rs.random_sample((min(rows, r0 + _SKIP_CHUNK) - r0) * self.embedding_dim)
        return None

    def describe(self) -> str:
        """The placement and the rank -> pid map (printed by the trainer's rank 0 at start)."""
        return self.placement.describe() + ("\n" + describe_ranks() if self.nranks > 1 else "")

    def parameter_bytes(self) -> int:
        """Bytes of the parameters this rank holds (its tables, the replicated ones, the MLPs)."""
        dense = sum(a.nbytes for a in self.bot_w + self.bot_b + self.top_w + self.top_b)
        return dense + sum((w.nbytes if isinstance(w, np.ndarray) else w.hi.nbytes + w.lo.nbytes) for w in self.emb if w is not None)

    # ------------------------------------------------------------------ state (collective)

    def state_dict(self) -> dict:
        """Collective: the full model on every rank (each table broadcast from its owner)."""
        sd = {}
        for t, w in enumerate(self.emb):
            owner = self.placement.owner[t]
            if w is not None:
                full = w if isinstance(w, np.ndarray) else w.to_float32()
            else:
                full = np.empty((self.embedding_sizes[t], self.embedding_dim), np.float32)
            if owner != REPLICATED:
                self.comm.Bcast(full, root=owner)
            sd[f"emb.{t}.weight"] = full
        for prefix, ws, bs in (("bot", self.bot_w, self.bot_b), ("top", self.top_w, self.top_b)):
            for l, (w, b) in enumerate(zip(ws, bs)):
                sd[f"{prefix}.{l}.weight"] = w
                sd[f"{prefix}.{l}.bias"] = b
        return sd

    def load_state_dict(self, sd: dict) -> None:
        """Load a full model given on every rank: each rank keeps its tables and the MLPs."""
        shapes = self.state_shapes()
        if set(shapes) != set(sd):
            missing, extra = sorted(set(shapes) - set(sd)), sorted(set(sd) - set(shapes))
            raise KeyError(f"state_dict does not match this model: missing {missing[:5]}, unexpected {extra[:5]}")
        for name, shape in shapes.items():
            a = sd[name]
            if not isinstance(a, np.ndarray) or a.dtype != np.float32 or a.shape != shape:
                raise ValueError(f"state_dict[{name!r}] must be a float32 array of shape {shape}, got "
                                 f"{getattr(a, 'dtype', type(a).__name__)} {getattr(a, 'shape', '')}")
        self.load_local({k: v for k, v in sd.items() if not k.startswith("emb.") or
                         self.emb[int(k.split(".")[1])] is not None})

    def load_local(self, sd: dict) -> None:
        """Copy the given (already checked) arrays into this rank's parameters; tables it lacks are ignored."""
        for name, a in sd.items():
            kind, idx, what = name.split(".")
            if kind == "emb":
                t = int(idx)
                if isinstance(self.emb[t], np.ndarray):
                    np.copyto(self.emb[t], a)
                elif self.emb[t] is not None:
                    self.emb[t] = ops.SplitBF16Table.from_float32(a)
            else:
                ws, bs = (self.bot_w, self.bot_b) if kind == "bot" else (self.top_w, self.top_b)
                np.copyto((ws if what == "weight" else bs)[int(idx)], a)

    # ------------------------------------------------------------------ stages

    def _plan(self, batch: int) -> _Plan:
        plan = self._plans.get(batch)
        if plan is None:
            if len(self._plans) >= 2:
                self._plans.pop(next(iter(self._plans)))
            plan = self._plans[batch] = _Plan(self, batch)
        return plan

    def embedding_forward(self, offsets, indices, plan):
        """My tables on every rank's slice into the send blocks; replicated tables on my slice."""
        with self.timer("embedding_fwd"):
            for q, (lo, hi) in enumerate(plan.slices):
                block = plan.fwd_send_blocks[q]
                for k, t in enumerate(self.owned):
                    off, idx = _slice_bags(offsets[t], indices[t], lo, hi)
                    _into(block[k], ops.embedding_bag_forward(self.emb[t], idx, off, out=block[k]))
            for k, t in enumerate(self.replicated):
                off, idx = _slice_bags(offsets[t], indices[t], plan.lo, plan.hi)
                out = plan.replica_ly[k]
                _into(out, ops.embedding_bag_forward(self.emb[t], idx, off, out=out))

    def _post_grads(self, pending, arrays, final=False):
        """Allreduce gradients as they appear: a bucket's worth or more alone and in place (no
        packing copy), smaller ones packed together until they fill a bucket."""
        for a in arrays:
            if a.nbytes >= BUCKET_BYTES:
                self.exchange.iallreduce("allreduce_grads", [a])
            else:
                pending.append(a)
        if pending and (final or sum(a.nbytes for a in pending) >= BUCKET_BYTES):
            self.exchange.iallreduce("allreduce_grads", list(pending))
            pending.clear()
        self.exchange.progress()

    def top_backward(self, dlogits, z, buf, pending):
        """Top MLP backward, each layer's gradients queued for the allreduce as soon as they exist."""
        return self._with_bucket(pending, super().top_backward, dlogits, z, buf)

    def layer_done(self, mlp, grads):
        """Between MLP layers: let posted exchanges progress; in backward, bucket the layer's grads
        (the bottom MLP's first layer is the last to finish: it flushes the bucket)."""
        if grads is None:
            self.exchange.progress()
        else:
            l, dw, db = grads
            self._post_grads(self._bucket, [dw, db], final=mlp == "bottom" and l == 0)

    def bottom_backward(self, dx, dense, buf, pending):
        return self._with_bucket(pending, super().bottom_backward, dx, dense, buf)

    def _with_bucket(self, pending, stage, *args):
        self._bucket = pending
        try:
            return stage(*args)
        finally:
            self._bucket = None

    def _replica_backward(self, offsets, indices, dly, plan):
        """Dense gradients (R, D) of the replicated tables from my slice (summed over ranks later)."""
        grads = []
        for t in self.replicated:
            off, idx = _slice_bags(offsets[t], indices[t], plan.lo, plan.hi)
            rows, drows = ops.embedding_bag_backward(idx, off, dly[:, t], self.embedding_sizes[t])
            g = self._replica_grads.get(t)
            if g is None:
                g = self._replica_grads[t] = np.empty((self.embedding_sizes[t], self.embedding_dim), np.float32)
            g.fill(0.0)
            g[rows] = drows
            grads.append(g)
        return grads

    def embedding_update(self, offsets, indices, plan, lr):
        """Sparse SGD of my tables with the gradients of all B rows (received by the reverse alltoall)."""
        with self.timer("embedding_upd"):
            for k, t in enumerate(self.owned):
                for (lo, hi), block in zip(plan.slices, plan.bwd_recv_blocks):
                    plan.dout[lo:hi] = block[k]
                ops.embedding_bag_sgd_(self.emb[t], indices[t], offsets[t], plan.dout, lr)
                self.exchange.progress()

    def _account_comm(self, before):
        """Profile rows: time in MPI calls (exposed) and link time the overlap hid behind compute."""
        if not isinstance(self.timer, _model.StageTimer):
            return
        hidden, exposed = self._comm_totals()
        self.timer.add("communication", exposed - before[1])
        self.timer.add("comm_hidden", hidden - before[0])

    def _comm_totals(self):
        stats = self.exchange.stats.values()
        return sum(s.hidden for s in stats), sum(s.exposed for s in stats)

    # ------------------------------------------------------------------ public API (collective)

    def _forward_slice(self, dense, offsets, indices, plan):
        """Forward of my slice: returns (x, ly, z, logits, buf)."""
        ex = self.exchange
        buf = self._buffers_for(plan.b)
        self.embedding_forward(offsets, indices, plan)
        a2a = ex.ialltoallv("alltoall_fwd", plan.fwd_send, plan.own_counts, plan.fwd_recv, plan.slice_counts)
        x = self.bottom_forward(dense[plan.lo:plan.hi], buf)
        ex.wait(a2a)
        ly = plan.ly                     # T arrays (b, D): the interaction takes the list as is
        z = self.interaction_forward(x, ly)
        logits = self.top_forward(z, buf)
        return x, ly, z, logits, buf

    def forward(self, dense, offsets, indices, *, check=True):
        """Collective: click probabilities (B,) of the global batch, on every rank."""
        if check:
            self.check_batch(dense, offsets, indices)
        before = self._comm_totals()
        plan = self._plan(dense.shape[0])
        _, _, _, logits, buf = self._forward_slice(dense, offsets, indices, plan)
        _, probs = self.loss_forward(logits, buf.zero_labels)
        counts = np.array([hi - lo for lo, hi in plan.slices], np.int64)
        displs = np.array([lo for lo, _ in plan.slices], np.int64)
        t0 = time.perf_counter()
        self.comm.Allgatherv(probs, [plan.probs, (counts, displs), self.exchange.MPI.FLOAT])
        self.exchange.stats.setdefault("allgather_probs", CommStat()).exposed += time.perf_counter() - t0
        self._account_comm(before)
        return plan.probs.copy()

    def train_step(self, dense, offsets, indices, labels, lr, *, check=True) -> float:
        """Collective: one SGD step on the global batch; returns the global batch-mean loss on every rank."""
        lr = self._check_step(dense, offsets, indices, labels, lr, check)
        ex = self.exchange
        before = self._comm_totals()
        plan = self._plan(dense.shape[0])
        lo, hi = plan.lo, plan.hi
        x, ly, z, logits, buf = self._forward_slice(dense, offsets, indices, plan)
        my_labels = labels[lo:hi]
        loss, probs = self.loss_forward(logits, my_labels)
        plan.loss_parts[:] = 0.0
        plan.loss_parts[self.rank] = loss * plan.b
        loss_op = ex.iallreduce("allreduce_loss", [plan.loss_parts])
        # dloss/dlogits of the global mean: the op divides by my b, the global mean by B
        dlogits = self.loss_backward(probs, my_labels) * np.float32(plan.b / plan.batch)
        pending = []
        dz, top_grads = self.top_backward(dlogits, z, buf, pending)
        dx, dly = self.interaction_backward(dz, x, ly)
        with self.timer("interaction"):
            for tabs, block in zip(plan.tables_of, plan.bwd_send_blocks):
                for k, t in enumerate(tabs):
                    block[k] = dly[:, t]
        a2a = ex.ialltoallv("alltoall_bwd", plan.bwd_send, plan.slice_counts, plan.bwd_recv, plan.own_counts)
        with self.timer("embedding_upd"):
            replica_grads = self._replica_backward(offsets, indices, dly, plan)
        pending.extend(replica_grads)
        bot_grads = self.bottom_backward(dx, dense[lo:hi], buf, pending)
        ex.wait(a2a)
        self.embedding_update(offsets, indices, plan, lr)
        ex.wait_all()
        self.dense_update(bot_grads, top_grads, lr)
        with self.timer("embedding_upd"):
            for t, g in zip(self.replicated, replica_grads):
                ops.sgd_(self.emb[t], g, lr)
        ex.wait(loss_op)
        self._account_comm(before)
        return float(plan.loss_parts.sum() / plan.batch)
