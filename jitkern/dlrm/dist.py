"""mpi4py hybrid parallelism for the DLRM: exchange layer, fault handling, the distributed model.

Tables are model-parallel (placement.py), MLPs data-parallel. mpi4py is imported only when a
communicator is actually used, so single-process runs never initialise MPI.
"""
from __future__ import annotations

import atexit
import os
import socket
import sys
import time
from dataclasses import dataclass

import numpy as np

from .. import ops
from . import model as _model
from . import peer_watch
from .placement import REPLICATE_BYTES, REPLICATED, batch_slices, place_tables

# Environment variables that launchers set for every rank, and that hold the world size.
_WORLD_SIZE_VARS = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_SIZE")


def comm_from_env():
    """COMM_WORLD when this process was started by mpiexec with more than one rank, else None.

    Looks at the launcher's environment first so that a plain `python script.py` never imports
    mpi4py (importing mpi4py.MPI initialises MPI).
    """
    for var in _WORLD_SIZE_VARS:
        value = os.environ.get(var)
        if value:
            try:
                size = int(value)
            except ValueError:
                continue
            if size > 1:
                from mpi4py import MPI
                install_fault_handlers(MPI.COMM_WORLD)
                return MPI.COMM_WORLD
            return None
    return None


# --------------------------------------------------------------------------- faults

_FAULT_STATE = {}
EXIT_GRACE_S = 10.0      # how long a rank at exit waits for the others before aborting the job
ABORT_DRAIN_S = 0.2      # how long a failing rank lets its stderr be forwarded before aborting


def describe_ranks() -> str:
    """'rank 0: pid 123 on host, ...' for the ranks of the communicator with fault handlers."""
    peers = _FAULT_STATE.get("peers", [])
    return "ranks: " + ", ".join(f"{r}=pid {pid} on {h}" for r, (h, pid) in enumerate(peers))


def install_fault_handlers(comm) -> None:
    """Make any failure end every rank promptly, non-zero, naming the failing rank.

    - An uncaught exception on a rank prints `jitkern: rank R of P failed: ...` and calls
      comm.Abort(1), which makes mpiexec kill all ranks (no rank is left waiting in a collective).
    - A rank killed by a signal (or dying in native code): mpiexec (MPICH's hydra) kills every
      other rank at once; a watcher process per host (peer_watch.py) prints
      `jitkern: rank R of P (pid N on HOST) died ...`. For ranks on hosts without pidfds,
      `describe_ranks` (printed by rank 0 at start) maps the pid mpiexec reports to a rank.
    - A rank that exits without an exception (sys.exit, return) while others still run: an
      atexit guard aborts after EXIT_GRACE_S instead of hanging in MPI_Finalize.
    Idempotent; a communicator of size 1 needs nothing.
    """
    if comm.Get_size() <= 1 or _FAULT_STATE.get("installed"):
        return
    rank, size = comm.Get_rank(), comm.Get_size()
    peers = comm.allgather((socket.gethostname(), os.getpid()))
    _FAULT_STATE.update(installed=True, rank=rank, size=size, peers=peers)
    peer_watch.start(rank, size, peers)

    previous_hook = sys.excepthook

    def excepthook(kind, value, tb):
        # the naming line first: mpiexec may drop a dying rank's last output while it tears
        # the job down, and a short pause lets its I/O forwarding drain before the abort
        peer_watch.disarm()  # the others are about to be killed: this rank has said what happened
        sys.stderr.write(f"jitkern: rank {rank} of {size} failed: {kind.__name__}: {value}; aborting all ranks\n")
        sys.stderr.flush()
        previous_hook(kind, value, tb)
        sys.stderr.flush()
        time.sleep(ABORT_DRAIN_S)
        comm.Abort(1)

    sys.excepthook = excepthook
    # its own communicator: the exit barrier must never match a collective the others are in
    atexit.register(_exit_together, comm.Dup())


def _exit_together(comm) -> None:
    """At interpreter exit, wait (bounded) for every rank to get here too; abort if they do not.

    A rank that leaves early (sys.exit, a return from main) would otherwise sit in MPI_Finalize
    while the others wait in a collective for it: a hang. Normal runs end within moments of
    each other, since the last steps, evaluation and checkpoint are collective.
    """
    peer_watch.disarm()  # past this barrier the others may exit at any moment, normally
    req = comm.Ibarrier()
    deadline = time.monotonic() + EXIT_GRACE_S
    while not req.Test():
        if time.monotonic() > deadline:
            rank, size = comm.Get_rank(), comm.Get_size()
            sys.stderr.write(f"jitkern: rank {rank} of {size} is exiting but other ranks did not finish "
                             f"within {EXIT_GRACE_S:.0f} s (one exited early or is stuck); aborting all ranks\n")
            sys.stderr.flush()
            comm.Abort(1)
        time.sleep(0.01)


# --------------------------------------------------------------------------- exchange


def measure_link(comm, nbytes: int = 4 << 20, reps: int = 5):
    """(GB/s, seconds per message) of a ring exchange r -> r+1, the slowest rank's view."""
    from mpi4py import MPI
    r, p = comm.Get_rank(), comm.Get_size()
    res = []
    for n in (nbytes // 4, 1):
        data, out = np.ones(n, np.float32), np.empty(n, np.float32)
        times = []
        for _ in range(reps):
            comm.Barrier()
            t0 = MPI.Wtime()
            comm.Sendrecv(data, dest=(r + 1) % p, recvbuf=out, source=(r - 1) % p)
            times.append(MPI.Wtime() - t0)
        res.append(comm.allreduce(float(np.median(times)), op=MPI.MAX))
    big, lat = res
    return nbytes / max(big - lat, 1e-9) / 1e9, lat


@dataclass
class CommStat:
    """One kind of exchange: bytes sent, its cost on the measured link, time spent in MPI calls."""
    count: int = 0
    nbytes: int = 0
    wire: float = 0.0       # seconds the transfers take on the link (latency + bytes / bandwidth)
    exposed: float = 0.0    # seconds the rank spent inside MPI calls for it (post, Test, Wait)
    hidden: float = 0.0     # sum over ops of max(wire - exposed, 0): transfer time compute covered


class _Op:
    """A posted non-blocking exchange; `stages` run one after another (e.g. reduce-scatter, allgather)."""
    __slots__ = ("name", "req", "stages", "done", "finish", "wire", "exposed")

    def __init__(self, name, stages, wire, finish=None):
        self.name, self.stages, self.finish, self.wire = name, list(stages), finish, wire
        self.req, self.done, self.exposed = None, False, 0.0


class Exchange:
    """Non-blocking alltoallv / allreduce on one communicator, with progress calls and timing.

    MPICH progresses non-blocking operations only inside MPI calls, so the model calls
    progress() between layers. Hidden time per op: its link time (from the link measured at
    start) minus the time this rank spent in MPI calls for it.
    """

    def __init__(self, comm):
        from mpi4py import MPI
        self.MPI = MPI
        self.comm = comm
        self.comm2 = comm.Dup()          # second stages of two-stage collectives (see _advance)
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.stats: dict[str, CommStat] = {}
        self._pending: list[_Op] = []
        # the link, to tell how much transfer time the overlap hid (MPI cannot say)
        self.bandwidth, self.latency = measure_link(comm) if self.size > 1 else (np.inf, 0.0)

    def _wire(self, messages: int, nbytes: int) -> float:
        return messages * self.latency + nbytes / (self.bandwidth * 1e9)

    # ---- posting
    def _start(self, op: _Op, nbytes: int) -> _Op:
        st = self.stats.setdefault(op.name, CommStat())
        st.count += 1
        st.nbytes += nbytes
        st.wire += op.wire
        t0 = time.perf_counter()
        op.req = op.stages.pop(0)()     # first stages: program order, the same on every rank
        op.exposed = time.perf_counter() - t0
        st.exposed += op.exposed
        self._pending.append(op)
        return op

    def ialltoallv(self, name, send, send_counts, recv, recv_counts) -> _Op:
        """Post: send[displ_q : displ_q + send_counts[q]] -> rank q, received likewise by source."""
        F = self.MPI.FLOAT
        sd = np.concatenate(([0], np.cumsum(send_counts)[:-1])).astype(np.int64)
        rd = np.concatenate(([0], np.cumsum(recv_counts)[:-1])).astype(np.int64)
        sc, rc = np.asarray(send_counts, np.int64), np.asarray(recv_counts, np.int64)
        post = lambda: self.comm.Ialltoallv([send, (sc, sd), F], [recv, (rc, rd), F])
        nbytes = int(sc.sum() - sc[self.rank]) * 4
        wire = self._wire(self.size - 1, max(nbytes, int(rc.sum() - rc[self.rank]) * 4))
        return self._start(_Op(name, [post], wire), nbytes)

    def iallreduce(self, name, arrays) -> _Op:
        """Post a sum over ranks of float32 (or float64) arrays, in place, identical on every rank.

        Reduce-scatter then allgather: each element is summed once, on one rank, so replicas can
        never drift apart by rounding (a plain allreduce does not promise that for P > 2).
        """
        MPI = self.MPI
        F = MPI.DOUBLE if arrays[0].dtype == np.float64 else MPI.FLOAT
        single = len(arrays) == 1 and arrays[0].flags.c_contiguous
        flat = arrays[0].reshape(-1) if single else np.concatenate([a.reshape(-1) for a in arrays])
        n = flat.size
        base, extra = divmod(n, self.size)
        counts = np.array([base + (r < extra) for r in range(self.size)], np.int64)
        displs = np.concatenate(([0], np.cumsum(counts)[:-1])).astype(np.int64)
        chunk = np.empty(int(counts[self.rank]), flat.dtype)
        stages = [lambda: self.comm.Ireduce_scatter([flat, F], [chunk, F], counts, MPI.SUM),
                  lambda: self.comm2.Iallgatherv([chunk, F], [flat, (counts, displs), F])]

        def finish():
            if not single:
                o = 0
                for a in arrays:
                    a.reshape(-1)[:] = flat[o:o + a.size]
                    o += a.size

        nbytes = 2 * flat.nbytes * (self.size - 1) // self.size
        return self._start(_Op(name, stages, self._wire(2 * (self.size - 1), nbytes), finish), nbytes)

    # ---- completion
    # Collectives must be posted in the same order on every rank. First stages are posted in
    # program order on `comm`; later stages go to `comm2` strictly in the order the ops were
    # posted (an op's next stage waits for every earlier op's), whatever each rank's Test saw.
    def _advance(self, op: _Op, wait: bool, may_post: bool) -> bool:
        """Test (or Wait for) op's current stage; post its next one if allowed. True when done."""
        st = self.stats[op.name]
        t0 = time.perf_counter()
        while True:
            if op.req is None:                  # next stage not yet posted
                if not may_post:
                    break
                op.req = op.stages.pop(0)()
            if wait:
                # Test + yield instead of Wait: MPICH's Wait spins, which on a shared or
                # oversubscribed machine takes the CPU from the rank being waited for
                while not op.req.Test():
                    os.sched_yield()
            elif not op.req.Test():
                break
            op.req = None
            if not op.stages:
                op.done = True
                if op.finish:
                    op.finish()
                break
        spent = time.perf_counter() - t0
        st.exposed += spent
        op.exposed += spent
        if op.done:
            st.hidden += max(op.wire - op.exposed, 0.0)
        return op.done

    def _run(self, upto: _Op | None) -> None:
        """Progress every pending op in posting order; Wait for everything up to `upto`."""
        may_post, waiting, left = True, upto is not None, []
        for op in self._pending:
            if not self._advance(op, waiting, may_post):
                left.append(op)
                may_post = may_post and not op.stages and op.req is not None
            if op is upto:
                waiting = False
        self._pending = left

    def progress(self) -> None:
        """Let every posted exchange move on (call between layers)."""
        if self._pending:
            self._run(None)

    def wait(self, op: _Op) -> None:
        """Block until op is complete (earlier ops are completed first; collectives are ordered)."""
        if not op.done:
            self._run(op)

    def wait_all(self) -> None:
        if self._pending:
            self._run(self._pending[-1])

    def reset_stats(self) -> None:
        self.stats.clear()

    def profile_rows(self) -> list:
        """(name, calls, MB sent, ms on the link, ms exposed, ms hidden) per exchange kind."""
        return [(name, st.count, st.nbytes / 1e6, st.wire * 1e3, st.exposed * 1e3, st.hidden * 1e3)
                for name, st in self.stats.items()]


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
