"""mpi4py hybrid parallelism for the DLRM: the distributed model (tables sharded by a plan of
planner.py, each kind run by sharding.py; MLPs data-parallel), over the exchange layer of
exchange.py and the buffers of layout.py; launch.py starts and ends the ranks (communicator,
nodes, fault handling); dist_state.py names its arrays (state_dict, checkpoints). mpi4py is imported only when a communicator is actually used, so
single-process runs never initialise MPI.

The step schedule is the base model's; this model overrides the stages that communicate. Before
the bottom MLP forward: row shards' lookups go to their shards, every piece pools, and the pooled
pieces (after the in-node sums of table-row-wise tables) are posted in one alltoallv, waited for
after the bottom MLP. Their gradients go back by the reverse alltoallv (then the in-node hand-out)
posted before the bottom MLP backward. MLP and cross-network (dcn) gradients go out in buckets as
each layer's are ready (layer_done, interaction_backward): reduce-scattered, each rank updates its
chunk, the new values are allgathered (dense_shard.py); replicated-table gradients are allreduced.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import numpy as np

from ..codegen.knobs import Workload
from ..config import get_config
from ..ops.bf16 import BF16Array
from .costmodel import Network, dense_estimate
from .dense_shard import ShardedUpdate, post_in_buckets
from .dist_state import DistState
from .exchange import CommStat, Exchange
from .launch import comm_from_env, describe_ranks, install_fault_handlers, node_groups
from .layout import ROW_KINDS, Layout
from .model import DLRM, StageTimer, StepContext
from .placement import batch_slices
from .planner import AUTO, ShardingPlan, plan_sharding
from .optimizers import TableOptimizer
from .sharding import ColumnGroup, make_shard

__all__ = ["DistributedDLRM", "comm_from_env"]  # comm_from_env: launch.py's, kept importable from here

PLAN_BATCH = 2048           # the global batch plans are made for unless told


@dataclass
class _DistStep(StepContext):
    """A step's context on one rank: its layout, and the exchanges and gradients in flight."""
    layout: Layout = None
    comm_before: tuple = (0.0, 0.0)     # (hidden, exposed) communication seconds at the start
    grads: list = field(default_factory=list)      # gradients waiting for an allreduce bucket
    updates: list = field(default_factory=list)    # (param, state, grad) waiting for a sharded-update bucket
    alltoall: object = None             # the pooled-pieces exchange in flight
    loss_op: object = None              # the allreduce of the loss parts
    ids_out: dict = field(default_factory=dict)    # table -> my slice's lookups bucketed by shard: (rows, ends)
    ids_in: tuple = None                           # the row shards' lookups received (Layout.ids_stage2)
    row_bags: dict = field(default_factory=dict)   # table -> (offsets, rows) of my row shard's lookups
    replica: dict = field(default_factory=dict)    # table -> (rows, summed gradient) of a replicated table
    loss_parts: np.ndarray = None


def rank_memory_default(comm) -> float:
    """Bytes per rank when none is given: this machine's RAM over the ranks on it (None if unknown)."""
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None
    from mpi4py import MPI
    local = comm.Split_type(MPI.COMM_TYPE_SHARED)
    n = local.Get_size()
    local.Free()
    return 0.9 * ram / n


class DistributedDLRM(DistState, DLRM, comm_variant=True):
    """The DLRM over an MPI communicator: tables sharded by a plan, MLPs data-parallel.

    sharding: "auto" (the planner), one kind for every table ("table", "column", "row",
    "table_row", "replicate"), one ("auto" or a kind) per table, or a planner.ShardingPlan.
    rank_memory: bytes per rank the plan must fit (default: this machine's RAM over its ranks);
    network: a costmodel.Network for the planner; plan_batch, plan_pooling: the global batch and
    lookups per sample the plan is made for. Every rank calls every method with the same arguments
    (the same global batch); results (loss, probabilities, state_dict) are the same on every rank.
    Built by DLRM(..., comm=comm, ...). Contract with one process: see sharding.py.
    """

    def __init__(self, *args, comm=None, sharding=AUTO, rank_memory=None, network=None, plan_batch=PLAN_BATCH,
                 plan_pooling=1, **kwargs):
        if comm is None:
            raise ValueError("DistributedDLRM needs comm= (an mpi4py communicator)")
        self.rank, self.nranks = comm.Get_rank(), comm.Get_size()
        install_fault_handlers(comm)
        self.exchange = Exchange(comm)
        self._layouts: dict[int, Layout] = {}
        self._request = dict(sharding=sharding, rank_memory=rank_memory, network=network, batch=plan_batch,
                             pooling=plan_pooling)
        super().__init__(*args, comm=comm, **kwargs)

    # ------------------------------------------------------------------ construction

    def _make_plan(self) -> ShardingPlan:
        """The plan, made on rank 0 and broadcast (a planning error is raised on every rank)."""
        req = self._request
        nodes = node_groups(self.comm, get_config().ranks_per_node)
        if isinstance(req["sharding"], ShardingPlan):
            plan = req["sharding"]
            if (plan.sizes, plan.dim, plan.nranks) != (tuple(self.embedding_sizes), self.embedding_dim, self.nranks):
                raise ValueError(f"the sharding plan is for {len(plan.sizes)} tables of D={plan.dim} over "
                                 f"{plan.nranks} ranks, not this model's {self.num_tables} tables of "
                                 f"D={self.embedding_dim} over {self.nranks} ranks")
            return plan
        memory = req["rank_memory"]
        if memory is None:
            memory = rank_memory_default(self.comm)
        plan = err = None
        if self.rank == 0:
            try:
                b = -(-req["batch"] // self.nranks)
                plan = plan_sharding(self.embedding_sizes, self.embedding_dim, req["pooling"], req["batch"],
                                     self.nranks, memory, req["network"] or Network(), kinds=req["sharding"],
                                     nodes=nodes, mlp_bytes=self._mlp_bytes(), top_layers=len(self.top_mlp) - 1,
                                     dense=dense_estimate(self.bottom_mlp, self.top_mlp, b, cross=self._cross_shape()),
                                     optimizer=self.table_opt.name)
            except ValueError as e:
                err = str(e)
        plan, err = self.comm.bcast((plan, err), root=0)
        if err is not None:
            raise ValueError(err)
        return plan

    def _table_optimizer(self) -> TableOptimizer:
        """The optimizer every table piece updates through: the model's (optimizer=, table_optimizer=)."""
        return self.table_opt

    def _column_group(self, t: int, spec, opt: TableOptimizer):
        """For a column-sharded table whose optimizer needs whole rows: the communicator of its
        column pieces (created by its members only, in table order), else None."""
        if spec.kind != "column" or not opt.needs_group or self.rank not in spec.ranks:
            return None
        return ColumnGroup(self.comm.Create_group(self.comm.group.Incl(list(spec.ranks)), t), self.embedding_dim,
                           self.exchange.progress)

    def _cross_shape(self):
        return (self.dcn_layers, self.dcn_rank) if self.interaction == "dcn" else None

    def _mlp_bytes(self) -> int:
        """Bytes of the data-parallel parameters: the MLPs and the cross network (dcn)."""
        cross = 4 * self.dcn_layers * (2 * self.dcn_rank + 1) * self.top_mlp[0] if self.interaction == "dcn" else 0
        return cross + sum(4 * (n * m + m) for sizes in (self.bottom_mlp, self.top_mlp)
                           for n, m in zip(sizes[:-1], sizes[1:]))

    def _init_parameters(self, rs):
        # The plan needs the validated sizes, which the base __init__ has set by now. Every rank
        # draws every table's init numbers in order (one process's stream) and keeps its pieces:
        # the MLPs' init, drawn after the tables, then match too.
        self.plan = self._make_plan()
        opt = self._table_optimizer()
        self.shards = [make_shard(t, spec, rows, self.embedding_dim, self.rank, precision=self.embedding_precision,
                                  optimizer=opt, group=self._column_group(t, spec, opt))
                       for t, (spec, rows) in enumerate(zip(self.plan.tables, self.embedding_sizes))]
        for shard in self.shards:
            shard.init(rs)
        self._held = [s for s in self.shards if s.held and s.kind != "replicate"]
        self._replicas = [s for s in self.shards if s.kind == "replicate"]
        self._init_dense(rs)                           # drawn where one process draws it
        self._sharded = ShardedUpdate(self.exchange, self._step)

    def _init_table_state(self):
        """None here: each piece holds the optimizer state of its region (Shard.init)."""

    @property
    def emb(self) -> list:
        """Per table, this rank's piece of it (None where it holds none)."""
        return [s.weight for s in self.shards]

    def describe(self) -> str:
        """The sharding plan and the rank -> pid map (printed by the trainer's rank 0 at start)."""
        return self.plan.describe() + ("\n" + describe_ranks() if self.nranks > 1 else "")

    def parameter_bytes(self) -> int:
        dense = sum(a.nbytes for a in self.bot_w + self.bot_b + self.top_w + self.top_b)
        dense += sum(a.nbytes for a in self.cross_v + self.cross_w + self.cross_b)
        return dense + sum(s.nbytes() for s in self.shards)

    def workload(self, batch: int, threads=(1,), *, pooling: int = 1) -> Workload:
        """This rank's kernel shapes: the MLPs and the interaction on its slice of `batch`, its
        pieces on all rows (their share of the lookups), the replicated tables on its slice."""
        b = max(hi - lo for lo, hi in batch_slices(batch, self.nranks))
        mine = super().workload(b, threads, pooling=pooling)
        tables = []
        for s in self.shards:
            if s.held:
                r0, r1, c0, c1 = s.region
                k = max(1, round(pooling * (r1 - r0) / s.rows))
                tables.append((r1 - r0, c1 - c0, k, b if s.kind == "replicate" else batch, self.table_itemsize))
        return Workload(mine.linears, tuple(dict.fromkeys(tables)), mine.interactions, mine.threads, mine.precisions)

    # ------------------------------------------------------------------ stages

    def _layout(self, batch: int) -> Layout:
        lay = self._layouts.get(batch)
        if lay is None:
            if len(self._layouts) >= 2:
                self._layouts.pop(next(iter(self._layouts)))
            lay = self._layouts[batch] = Layout(self.plan, self.rank, batch)
        return lay

    def step_context(self, dense, offsets, indices, labels=None, lr=None) -> _DistStep:
        """This rank's slice of the rows for the MLPs, the whole batch for its pieces."""
        before = self._comm_totals()
        lay = self._layout(dense.shape[0])
        rows = slice(lay.lo, lay.hi)
        return _DistStep(dense[rows], offsets, indices, None if labels is None else labels[rows], lr,
                         self._buffers_for(lay.b), layout=lay, comm_before=before,
                         loss_parts=np.zeros(self.nranks, np.float64))

    def embedding_forward_start(self, ctx: _DistStep) -> None:
        """Send the row shards' lookups, pool every piece (the others' while those travel), then
        post the pooled pieces' alltoall, to travel during the bottom MLP forward."""
        lay = ctx.layout
        with self.timer("embedding_fwd"):
            ids = self._post_ids(ctx) if lay.has_rows else None
            for s in self._held + self._replicas:
                if s.kind not in ROW_KINDS:
                    s.lookup(ctx)
            if ids is not None:
                self.exchange.wait(ids)
                for s in self._held:
                    if s.kind in ROW_KINDS:
                        s.lookup(ctx)
        ctx.alltoall = self._post_pooled(ctx)

    def _post_ids(self, ctx: _DistStep):
        """Bucket my slice's lookups of every row-sharded table; post lengths, then the rows."""
        lay = ctx.layout
        for s in self.shards:
            if s.kind in ROW_KINDS:
                s.bucket(ctx)

        def rows():
            send, sc, recv, rc, ctx.ids_in = lay.ids_stage2(ctx.ids_out)
            return send, sc, recv, rc

        return self.exchange.ialltoallv("alltoall_ids", lay.ids_send, lay.ids_send_counts, lay.ids_recv,
                                        lay.ids_recv_counts, then=rows)

    def _post_pooled(self, ctx: _DistStep):
        lay = ctx.layout
        main = (lay.fwd_send, lay.send_counts, lay.fwd_recv, lay.recv_counts)
        if not lay.has_node:
            return self.exchange.ialltoallv("alltoall_fwd", *main)

        def summed():
            for s in self._held:
                if s.kind == "table_row":
                    s.forward_sums(ctx)
            return main

        return self.exchange.ialltoallv("alltoall_fwd", lay.node_send, lay.node_send_counts, lay.node_recv,
                                        lay.node_recv_counts, then=summed)

    def embedding_forward(self, ctx: _DistStep) -> list:
        """My slice's pooled rows of every table, once the alltoall is in: T arrays (b, D)."""
        self.exchange.wait(ctx.alltoall)
        with self.timer("embedding_fwd"):
            ly = [s.assemble(ctx) for s in self.shards]
            if self.precision == "bf16":            # what the bf16 interaction reads
                return [BF16Array.from_float32(piece, out=out) for piece, out in zip(ly, ctx.buf.ly16)]
            return ly

    def loss_forward(self, ctx: _DistStep, logits):
        """My slice's loss; in training, post the allreduce of every rank's share of the global loss."""
        loss, probs = super().loss_forward(ctx, logits)
        if ctx.labels is not None:
            ctx.loss_parts[self.rank] = loss * ctx.layout.b
            ctx.loss_op = self.exchange.iallreduce("allreduce_loss", [ctx.loss_parts])
        return loss, probs

    def loss_backward(self, ctx: _DistStep, probs):
        """dloss/dlogits of the global mean: the op divides by my b, the global mean by B."""
        return super().loss_backward(ctx, probs) * np.float32(ctx.layout.b / ctx.layout.batch)

    def _post_grads(self, pending, arrays, final=False):
        """Allreduce gradients (replicated tables') in buckets (dense_shard.post_in_buckets)."""
        post = lambda b: self.exchange.iallreduce("allreduce_grads", b)
        post_in_buckets(pending, arrays, lambda a: a.nbytes, post, final)
        self.exchange.progress()

    def _post_dense(self, ctx: _DistStep, items, final=False):
        """(param, state, grad) triples in buckets (dense_shard.post_in_buckets), each bucket's
        update sharded over the ranks instead of applied whole on every rank."""
        post = lambda b: self._sharded.post("allreduce_grads", b, ctx.lr)
        post_in_buckets(ctx.updates, items, lambda i: i[2].nbytes, post, final)
        self.exchange.progress()

    def layer_done(self, ctx: _DistStep, mlp, grads):
        """Between MLP layers: let posted exchanges progress; in backward, bucket the layer's
        parameters for their sharded update (the bottom MLP's first layer is the last to finish: it
        flushes the buckets, the replicated tables' gradients too)."""
        if grads is None:
            self.exchange.progress()
            return
        l, dw, db = grads
        prefix, ws, bs = ("bot", self.bot_w, self.bot_b) if mlp == "bottom" else ("top", self.top_w, self.top_b)
        state = self.opt_state.get
        final = mlp == "bottom" and l == 0
        self._post_dense(ctx, [(ws[l], state(f"{prefix}.{l}.weight"), dw), (bs[l], state(f"{prefix}.{l}.bias"), db)],
                         final=final)
        if final:
            self._post_grads(ctx.grads, [], final=True)

    def interaction_backward(self, ctx: _DistStep, dz, x, ly):
        """The base stage, then the cross network's parameters (dcn) join the update buckets."""
        out = super().interaction_backward(ctx, dz, x, ly)
        for l, grads in enumerate(ctx.cross_grads or ()):
            params = (self.cross_v[l], self.cross_w[l], self.cross_b[l])
            self._post_dense(ctx, [(p, self.opt_state.get(f"cross.{l}.{n}"), g) for n, p, g in zip("vwb", params, grads)])
        return out

    def embedding_backward_start(self, ctx: _DistStep, dly) -> None:
        """Post the reverse alltoall (my slice's gradient pieces to their holders; then, for
        table-row-wise tables, from each forwarder to its node's shards), then the replicated
        tables' summed gradients, bucketed with the MLP's: all travel during the bottom MLP backward."""
        lay = ctx.layout
        with self.timer("interaction"):
            for s in self.shards:
                if s.kind != "replicate":
                    s.grad(ctx, dly[:, s.t])
        main = (lay.bwd_send, lay.recv_counts, lay.bwd_recv, lay.send_counts)
        then = None
        if lay.has_node:
            def then():
                for s in self._held:
                    if s.kind == "table_row":
                        s.forward_grads(ctx)
                return lay.node_bwd_send, lay.node_recv_counts, lay.node_bwd_recv, lay.node_send_counts
        ctx.alltoall = self.exchange.ialltoallv("alltoall_bwd", *main, then=then)
        with self.timer("embedding_upd"):
            self._post_grads(ctx.grads, [s.grad(ctx, dly[:, s.t]) for s in self._replicas])

    def embedding_update(self, ctx: _DistStep, dly) -> None:
        """Each piece's update with the gradients of all B rows, which the reverse exchange brings."""
        self.exchange.wait(ctx.alltoall)
        with self.timer("embedding_upd"):
            for s in self._held:
                s.update(ctx)
                self.exchange.progress()

    def dense_update(self, ctx: _DistStep, bot_grads, top_grads) -> None:
        """Once every exchange is in (the MLPs' and cross network's sharded updates with them):
        the replicated tables' updates."""
        with self.timer("dense_upd"):
            self.exchange.wait_all()
        with self.timer("embedding_upd"):
            for s in self._replicas:
                s.update(ctx)

    def step_loss(self, ctx: _DistStep, loss) -> float:
        """The global batch-mean loss, the same on every rank."""
        self.exchange.wait(ctx.loss_op)
        self._account_comm(ctx.comm_before)
        return float(ctx.loss_parts.sum() / ctx.layout.batch)

    def forward_result(self, ctx: _DistStep, probs):
        """The whole batch's probabilities on every rank, gathered from the slices."""
        lay = ctx.layout
        counts = np.array([hi - lo for lo, hi in lay.slices], np.int64)
        displs = np.array([lo for lo, _ in lay.slices], np.int64)
        out = np.empty(lay.batch, np.float32)
        t0 = time.perf_counter()
        self.comm.Allgatherv(probs, [out, (counts, displs), self.exchange.MPI.FLOAT])
        self.exchange.stats.setdefault("allgather_probs", CommStat()).exposed += time.perf_counter() - t0
        self._account_comm(ctx.comm_before)
        return out

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
