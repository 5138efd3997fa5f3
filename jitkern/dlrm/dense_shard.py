"""The data-parallel parameters' update, sharded over ranks (ZeRO stage 1's schedule).

Each bucket of gradients is reduce-scattered as the allreduce's first half does; each rank then
applies the dense optimizer to its chunk of the summed gradient alone, and the updated values
are allgathered in place of the summed gradients. The bytes on the link are the allreduce's
(plus the optimizer state for Adagrad), while the update's work per rank falls from every
parameter to 1/P of them. Elementwise optimizers give each element the same operations on the
same summed gradient as the unsharded update, so every rank ends with the same bits as before.
"""
from __future__ import annotations

import numpy as np

from ..ops.bf16 import BF16Array
from .model_state import SplitWeight

BUCKET_BYTES = 1 << 20      # gradients travel in buckets of about this size


def post_in_buckets(pending, items, nbytes, post, final=False):
    """Post items as they appear: one of a bucket's worth or more alone (in place: no packing
    copy), smaller ones gathered in `pending` until they fill a bucket, or `final` flushes it."""
    for item in items:
        if nbytes(item) >= BUCKET_BYTES:
            post([item])
        else:
            pending.append(item)
    if pending and (final or sum(map(nbytes, pending)) >= BUCKET_BYTES):
        post(list(pending))
        pending.clear()


class _Param:
    """One parameter of a bucket: flat views of its fp32 values or Split halves, its state, its
    gradient, and where it sits in the bucket's concatenation."""
    __slots__ = ("p", "state", "grad", "off", "size")

    def __init__(self, p, state, grad, off):
        self.p, self.state, self.grad, self.off, self.size = p, state, grad, off, grad.size

    def update(self, opt, a, b, g, lr):
        """The optimizer on elements a:b of this parameter, g their summed gradient."""
        s = None if self.state is None else self.state.reshape(-1)[a:b]
        if isinstance(self.p, SplitWeight):
            hi, lo = self.p.hi.bits.reshape(-1)[a:b], self.p.lo.reshape(-1)[a:b]
            piece = SplitWeight.__new__(SplitWeight)
            piece.hi, piece.lo = BF16Array(hi), lo
            piece.step(opt, s, g, lr)
        else:
            opt.step(self.p.reshape(-1)[a:b], s, g, lr)

    def values(self, a, b):
        """Its fp32 values a:b (joined from the Split halves for a bf16 weight)."""
        if isinstance(self.p, SplitWeight):
            bits = (self.p.hi.bits.reshape(-1)[a:b].astype(np.uint32) << 16) | self.p.lo.reshape(-1)[a:b]
            return bits.view(np.float32)
        return self.p.reshape(-1)[a:b]

    def store(self, flat):
        """Take its values from the gathered flat fp32 array (the slice at its offset)."""
        v = flat[self.off:self.off + self.size]
        if isinstance(self.p, SplitWeight):
            bits = v.view(np.uint32)
            self.p.hi.bits.reshape(-1)[:] = bits >> 16
            self.p.lo.reshape(-1)[:] = bits & 0xFFFF
        else:
            self.p.reshape(-1)[:] = v


class ShardedUpdate:
    """Posts buckets of (parameter, optimizer state, gradient) triples on an Exchange; the dense
    optimizer `opt` and the step's lr are applied to this rank's chunk when its sums are in."""

    def __init__(self, exchange, opt):
        self.exchange, self.opt = exchange, opt

    def post(self, name, items, lr):
        """Reduce-scatter the gradients, update my chunk, allgather values (and Adagrad state)."""
        ex = self.exchange
        MPI, P, rank = ex.MPI, ex.size, ex.rank
        F = MPI.FLOAT
        params, off = [], 0
        for p, state, grad in items:
            params.append(_Param(p, state, grad, off))
            off += grad.size
        n = off
        single = len(params) == 1 and params[0].grad.flags.c_contiguous
        flat = params[0].grad.reshape(-1) if single else np.concatenate([q.grad.reshape(-1) for q in params])
        base, extra = divmod(n, P)
        counts = np.array([base + (r < extra) for r in range(P)], np.int64)
        displs = np.concatenate(([0], np.cumsum(counts)[:-1])).astype(np.int64)
        lo, hi = int(displs[rank]), int(displs[rank] + counts[rank])
        chunk = np.empty(hi - lo, np.float32)
        with_state = any(q.state is not None for q in params)
        # the gathered values land in the gradient buffer (its sums are used up by then)
        mine = [(q, max(lo, q.off) - q.off, min(hi, q.off + q.size) - q.off) for q in params
                if q.off < hi and q.off + q.size > lo]

        def update_and_gather():
            for q, a, b in mine:
                q.update(self.opt, a, b, chunk[q.off + a - lo:q.off + b - lo], lr)
            send = np.concatenate([q.values(a, b) for q, a, b in mine]) if mine else chunk[:0]
            return ex.comm2.Iallgatherv([send, F], [flat, (counts, displs), F])

        stages = [lambda: ex.comm.Ireduce_scatter([flat, F], [chunk, F], counts, MPI.SUM), update_and_gather]
        gathered_state = np.empty(n if with_state else 0, np.float32)
        if with_state:
            def gather_state():
                send = np.concatenate([_state(q)[a:b] for q, a, b in mine]) if mine else chunk[:0]
                return ex.comm2.Iallgatherv([send, F], [gathered_state, (counts, displs), F])
            stages.append(gather_state)

        def finish():
            for q in params:
                q.store(flat)
                if q.state is not None:
                    q.state.reshape(-1)[:] = gathered_state[q.off:q.off + q.size]

        nbytes = (2 + with_state) * 4 * n * (P - 1) // P
        return ex.post_stages(name, stages, (2 + with_state) * (P - 1), nbytes, finish)


def _state(q):
    return q.state.reshape(-1)
