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

from .model_state import SplitWeight, copy_into

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
    """One parameter of a bucket: the parameter (an fp32 array or a SplitWeight), its optimizer
    state, its gradient, and where it sits in the bucket's concatenation."""
    __slots__ = ("p", "state", "grad", "off", "size")

    def __init__(self, p, state, grad, off):
        self.p, self.state, self.grad, self.off, self.size = p, state, grad, off, grad.size

    def flat(self, a=0, b=None):
        """Elements a:b of the parameter, flat: an array view, or a SplitWeight of views."""
        return self.p.flat(a, b) if isinstance(self.p, SplitWeight) else self.p.reshape(-1)[a:b]


class ShardedUpdate:
    """Posts buckets of (parameter, optimizer state, gradient) triples on an Exchange; step(p,
    state, grad, lr), the model's dense optimizer step (fp32 arrays and SplitWeights), is applied
    with the step's lr to this rank's chunk when its sums are in."""

    def __init__(self, exchange, step):
        self.exchange, self.step = exchange, step

    def post(self, name, items, lr):
        """Reduce-scatter the gradients, update my chunk, allgather values (and Adagrad state)."""
        ex = self.exchange
        params, off = [], 0
        for p, state, grad in items:
            params.append(_Param(p, state, grad, off))
            off += grad.size
        flat, chunk, parts, F, scatter = ex.scatter_sum([q.grad for q in params])
        counts, displs = parts
        lo, hi = int(displs[ex.rank]), int(displs[ex.rank] + counts[ex.rank])
        # (parameter, its first and last element in my chunk), the parameters my chunk touches
        mine = [(q, max(lo, q.off) - q.off, min(hi, q.off + q.size) - q.off) for q in params
                if q.off < hi and q.off + q.size > lo]
        states = any(q.state is not None for q in params)

        def gather(values, out):
            send = np.concatenate([values(q, a, b) for q, a, b in mine]) if mine else chunk[:0]
            return ex.comm2.Iallgatherv([send, F], [out, parts, F])

        def update_and_gather():  # the gathered values land in flat, whose sums are used up
            for q, a, b in mine:
                s = None if q.state is None else q.state.reshape(-1)[a:b]
                self.step(q.flat(a, b), s, chunk[q.off + a - lo:q.off + b - lo], lr)
            return gather(lambda q, a, b: _fp32(q.flat(a, b)), flat)

        gathered_state = np.empty(off if states else 0, np.float32)
        stages = [scatter, update_and_gather]
        if states:
            stages.append(lambda: gather(lambda q, a, b: q.state.reshape(-1)[a:b], gathered_state))

        def finish():
            for q in params:
                copy_into(q.flat(), flat[q.off:q.off + q.size])
                if q.state is not None:
                    q.state.reshape(-1)[:] = gathered_state[q.off:q.off + q.size]

        P = ex.size
        nbytes = (2 + states) * 4 * off * (P - 1) // P
        return ex.post_stages(name, stages, (2 + states) * (P - 1), nbytes, finish)


def _fp32(p):
    """fp32 values of an array or a SplitWeight (joined)."""
    return p.to_float32() if isinstance(p, SplitWeight) else p
