"""mpi4py hybrid parallelism for the DLRM: the distributed model (tables model-parallel by
placement.py, MLPs data-parallel), over the exchange layer of exchange.py; launch.py starts and
ends the ranks (communicator, fault handling). mpi4py is imported only when a communicator is
actually used, so single-process runs never initialise MPI.

The step schedule is the base model's; this model overrides the stages that communicate:
pooled embeddings travel by an alltoall posted before the bottom MLP forward and waited for
after it, their gradients by the reverse alltoall posted before the bottom MLP backward; MLP
gradients are allreduced in buckets as each layer's are ready (layer_done).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from .. import ops
from ..codegen.knobs import Workload
from .exchange import CommStat, Exchange
from .launch import comm_from_env, describe_ranks, install_fault_handlers
from .model import DLRM, StageTimer, StepContext
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


def _slice_bags(offsets, indices, lo, hi):
    """The bags of samples lo..hi-1 of one table: (offsets (hi-lo,) from 0, indices view)."""
    start = int(offsets[lo]) if lo < len(offsets) else len(indices)
    end = int(offsets[hi]) if hi < len(offsets) else len(indices)
    return offsets[lo:hi] - start, indices[start:end]


@dataclass
class _DistStep(StepContext):
    """A step's context on one rank: its plan, and the exchanges and gradients in flight."""
    plan: _Plan = None
    comm_before: tuple = (0.0, 0.0)     # (hidden, exposed) communication seconds at the start
    grads: list = field(default_factory=list)      # gradients waiting for an allreduce bucket
    alltoall: object = None             # the embedding exchange in flight
    loss_op: object = None              # the allreduce of the loss parts
    replica_grads: list = field(default_factory=list)


class DistributedDLRM(DLRM, comm_variant=True):
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

    def workload(self, batch: int, threads=(1,), *, pooling: int = 1) -> Workload:
        """This rank's kernel shapes: the MLPs and the interaction on its slice of `batch`, its own
        tables on all rows, the replicated ones on its slice."""
        b = max(hi - lo for lo, hi in batch_slices(batch, self.nranks))
        mine = super().workload(b, threads, pooling=pooling)
        tables = [(self.embedding_sizes[t], self.embedding_dim, pooling, rows, self.table_itemsize)
                  for ts, rows in ((self.owned, batch), (self.replicated, b)) for t in ts]
        return Workload(mine.linears, tuple(dict.fromkeys(tables)), mine.interactions, mine.threads)

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
        sd.update(self.mlp_state_dict())
        return sd

    # ------------------------------------------------------------------ stages

    def _plan(self, batch: int) -> _Plan:
        plan = self._plans.get(batch)
        if plan is None:
            if len(self._plans) >= 2:
                self._plans.pop(next(iter(self._plans)))
            plan = self._plans[batch] = _Plan(self, batch)
        return plan

    def step_context(self, dense, offsets, indices, labels=None, lr=None) -> _DistStep:
        """This rank's slice of the rows for the MLPs, the whole batch for its tables."""
        before = self._comm_totals()
        plan = self._plan(dense.shape[0])
        rows = slice(plan.lo, plan.hi)
        return _DistStep(dense[rows], offsets, indices, None if labels is None else labels[rows], lr,
                         self._buffers_for(plan.b), plan=plan, comm_before=before)

    def embedding_forward_start(self, ctx: _DistStep) -> None:
        """My tables on every rank's slice into the send blocks, replicated tables on my slice;
        then post the alltoall, to travel during the bottom MLP forward."""
        plan = ctx.plan
        with self.timer("embedding_fwd"):
            for q, (lo, hi) in enumerate(plan.slices):
                block = plan.fwd_send_blocks[q]
                for k, t in enumerate(self.owned):
                    off, idx = _slice_bags(ctx.offsets[t], ctx.indices[t], lo, hi)
                    ops.embedding_bag_forward(self.emb[t], idx, off, out=block[k])
            for k, t in enumerate(self.replicated):
                off, idx = _slice_bags(ctx.offsets[t], ctx.indices[t], plan.lo, plan.hi)
                ops.embedding_bag_forward(self.emb[t], idx, off, out=plan.replica_ly[k])
        ctx.alltoall = self.exchange.ialltoallv("alltoall_fwd", plan.fwd_send, plan.own_counts,
                                                plan.fwd_recv, plan.slice_counts)

    def embedding_forward(self, ctx: _DistStep) -> list:
        """My slice's pooled rows of every table, once the alltoall is in: T arrays (b, D)."""
        self.exchange.wait(ctx.alltoall)
        return ctx.plan.ly               # the interaction takes the list as is

    def loss_forward(self, ctx: _DistStep, logits):
        """My slice's loss; in training, post the allreduce of every rank's share of the global loss."""
        loss, probs = super().loss_forward(ctx, logits)
        if ctx.labels is not None:
            plan = ctx.plan
            plan.loss_parts[:] = 0.0
            plan.loss_parts[self.rank] = loss * plan.b
            ctx.loss_op = self.exchange.iallreduce("allreduce_loss", [plan.loss_parts])
        return loss, probs

    def loss_backward(self, ctx: _DistStep, probs):
        """dloss/dlogits of the global mean: the op divides by my b, the global mean by B."""
        return super().loss_backward(ctx, probs) * np.float32(ctx.plan.b / ctx.plan.batch)

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

    def layer_done(self, ctx: _DistStep, mlp, grads):
        """Between MLP layers: let posted exchanges progress; in backward, bucket the layer's grads
        (the bottom MLP's first layer is the last to finish: it flushes the bucket)."""
        if grads is None:
            self.exchange.progress()
        else:
            l, dw, db = grads
            self._post_grads(ctx.grads, [dw, db], final=mlp == "bottom" and l == 0)

    def embedding_backward_start(self, ctx: _DistStep, dly) -> None:
        """Post the reverse alltoall (my slice's dly to each table's owner), then the replicated
        tables' dense gradients, bucketed with the MLP's: both travel during the bottom MLP backward."""
        plan = ctx.plan
        with self.timer("interaction"):
            for tabs, block in zip(plan.tables_of, plan.bwd_send_blocks):
                for k, t in enumerate(tabs):
                    block[k] = dly[:, t]
        ctx.alltoall = self.exchange.ialltoallv("alltoall_bwd", plan.bwd_send, plan.slice_counts,
                                                plan.bwd_recv, plan.own_counts)
        with self.timer("embedding_upd"):
            ctx.replica_grads = self._replica_backward(ctx, dly)
        ctx.grads.extend(ctx.replica_grads)

    def _replica_backward(self, ctx: _DistStep, dly):
        """Dense gradients (R, D) of the replicated tables from my slice (summed over ranks later)."""
        grads = []
        for t in self.replicated:
            off, idx = _slice_bags(ctx.offsets[t], ctx.indices[t], ctx.plan.lo, ctx.plan.hi)
            rows, drows = ops.embedding_bag_backward(idx, off, dly[:, t], self.embedding_sizes[t])
            g = self._replica_grads.get(t)
            if g is None:
                g = self._replica_grads[t] = np.empty((self.embedding_sizes[t], self.embedding_dim), np.float32)
            g.fill(0.0)
            g[rows] = drows
            grads.append(g)
        return grads

    def embedding_update(self, ctx: _DistStep, dly) -> None:
        """Sparse SGD of my tables with the gradients of all B rows, which the reverse alltoall
        brings (`dly`, my slice's, went out in embedding_backward_start)."""
        plan = ctx.plan
        self.exchange.wait(ctx.alltoall)
        with self.timer("embedding_upd"):
            for k, t in enumerate(self.owned):
                for (lo, hi), block in zip(plan.slices, plan.bwd_recv_blocks):
                    plan.dout[lo:hi] = block[k]
                ops.embedding_bag_sgd_(self.emb[t], ctx.indices[t], ctx.offsets[t], plan.dout, ctx.lr)
                self.exchange.progress()

    def dense_update(self, ctx: _DistStep, bot_grads, top_grads) -> None:
        """Once every gradient allreduce is in: SGD of the MLPs, then of the replicated tables."""
        self.exchange.wait_all()
        super().dense_update(ctx, bot_grads, top_grads)
        with self.timer("embedding_upd"):
            for t, g in zip(self.replicated, ctx.replica_grads):
                ops.sgd_(self.emb[t], g, ctx.lr)

    def step_loss(self, ctx: _DistStep, loss) -> float:
        """The global batch-mean loss, the same on every rank."""
        self.exchange.wait(ctx.loss_op)
        self._account_comm(ctx.comm_before)
        return float(ctx.plan.loss_parts.sum() / ctx.plan.batch)

    def forward_result(self, ctx: _DistStep, probs):
        """The whole batch's probabilities on every rank, gathered from the slices."""
        plan = ctx.plan
        counts = np.array([hi - lo for lo, hi in plan.slices], np.int64)
        displs = np.array([lo for lo, _ in plan.slices], np.int64)
        t0 = time.perf_counter()
        self.comm.Allgatherv(probs, [plan.probs, (counts, displs), self.exchange.MPI.FLOAT])
        self.exchange.stats.setdefault("allgather_probs", CommStat()).exposed += time.perf_counter() - t0
        self._account_comm(ctx.comm_before)
        return plan.probs.copy()

    def _account_comm(self, before):
        """Profile rows: time in MPI calls (exposed) and link time the overlap hid behind compute."""
        if not isinstance(self.timer, StageTimer):
            return
        hidden, exposed = self._comm_totals()
        self.timer.add("communication", exposed - before[1])
        self.timer.add("comm_hidden", hidden - before[0])

    def _comm_totals(self):
        stats = self.exchange.stats.values()
        return sum(s.hidden for s in stats), sum(s.exposed for s in stats)
