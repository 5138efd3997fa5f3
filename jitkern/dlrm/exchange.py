"""Non-blocking alltoallv / allreduce for the hybrid-parallel DLRM, with progress calls and
per-exchange timing (bytes, link time, time exposed in MPI calls, link time hidden by compute).
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass

import numpy as np


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
        self._types = {np.dtype(np.float32): MPI.FLOAT, np.dtype(np.float64): MPI.DOUBLE,
                       np.dtype(np.int64): MPI.INT64_T}
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

    def _alltoallv(self, comm, send, send_counts, recv, recv_counts):
        """-> (post function, bytes sent to other ranks, link seconds) of one alltoallv."""
        T = self._types[send.dtype]
        sd = np.concatenate(([0], np.cumsum(send_counts)[:-1])).astype(np.int64)
        rd = np.concatenate(([0], np.cumsum(recv_counts)[:-1])).astype(np.int64)
        sc, rc = np.asarray(send_counts, np.int64), np.asarray(recv_counts, np.int64)
        post = lambda: comm.Ialltoallv([send, (sc, sd), T], [recv, (rc, rd), T])
        item = send.dtype.itemsize
        nbytes = int(sc.sum() - sc[self.rank]) * item
        messages = int(np.count_nonzero(sc) - (sc[self.rank] > 0))
        wire = self._wire(max(messages, 1), max(nbytes, int(rc.sum() - rc[self.rank]) * item))
        return post, nbytes, wire

    def ialltoallv(self, name, send, send_counts, recv, recv_counts, then=None) -> _Op:
        """Post: send[displ_q : displ_q + send_counts[q]] -> rank q, received likewise by source
        (float32, float64 or int64). then: None, or a function called once this exchange is in,
        returning (send, send_counts, recv, recv_counts) of a second alltoallv posted next (what
        the first carried may decide its sizes or contents)."""
        post, nbytes, wire = self._alltoallv(self.comm, send, send_counts, recv, recv_counts)
        stages = [post]
        if then is not None:
            def second():
                post2, nbytes2, wire2 = self._alltoallv(self.comm2, *then())
                st = self.stats[name]
                st.nbytes += nbytes2
                st.wire += wire2
                op.wire += wire2
                return post2()
            stages.append(second)
        op = _Op(name, stages, wire)
        return self._start(op, nbytes)

    def post_stages(self, name, stages, messages: int, nbytes: int, finish=None) -> _Op:
        """Post a caller-built collective: `stages`, functions each posting one non-blocking call
        (the first on `comm`, later ones on `comm2`) when the previous is in; finish() at the end."""
        return self._start(_Op(name, stages, self._wire(messages, nbytes), finish), nbytes)

    def scatter_sum(self, arrays):
        """The reduce-scatter half of a sum over ranks of float32 (or float64) arrays, concatenated
        (no copy for one contiguous array): -> (flat, chunk, (counts, displs), MPI type, post), where
        post() posts the sum of this rank's chunk of flat into chunk (the first stage of an op)."""
        MPI = self.MPI
        F = MPI.DOUBLE if arrays[0].dtype == np.float64 else MPI.FLOAT
        single = len(arrays) == 1 and arrays[0].flags.c_contiguous
        flat = arrays[0].reshape(-1) if single else np.concatenate([a.reshape(-1) for a in arrays])
        base, extra = divmod(flat.size, self.size)
        counts = np.array([base + (r < extra) for r in range(self.size)], np.int64)
        displs = np.concatenate(([0], np.cumsum(counts)[:-1])).astype(np.int64)
        chunk = np.empty(int(counts[self.rank]), flat.dtype)
        return flat, chunk, (counts, displs), F, lambda: self.comm.Ireduce_scatter([flat, F], [chunk, F], counts, MPI.SUM)

    def iallreduce(self, name, arrays) -> _Op:
        """Post a sum over ranks of float32 (or float64) arrays, in place, identical on every rank.

        Reduce-scatter then allgather: each element is summed once, on one rank, so replicas can
        never drift apart by rounding (a plain allreduce does not promise that for P > 2).
        """
        flat, chunk, parts, F, post = self.scatter_sum(arrays)
        packed = not np.may_share_memory(flat, arrays[0])   # a concatenation: copied back at the end
        stages = [post, lambda: self.comm2.Iallgatherv([chunk, F], [flat, parts, F])]

        def finish():
            if packed:
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
