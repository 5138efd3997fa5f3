"""The sorted grouping of the embedding backward and fused updates (ops/embedding_update.py).

A stable LSD radix sort of (row, position) pairs groups each row's occurrences in position
order; the groups are cut into contiguous row ranges that prange hands to the threads (row
ownership: no atomics). Used for the backward, whose rows come out sorted, and for dense
batches, where applying the updates in row order streams through the table.
"""
from __future__ import annotations

import numpy as np
from numba import prange

from ..codegen import jit
from ..codegen.prefetch import prefetch_l2
from ..codegen.rowvec import stack_f32
from .embedding import _apply_row, _bag_end, _check_bags, _madd_row, _prefetch_row, _straddles

RADIX_BITS = 12  # digit width of the radix sort (4096-entry histogram)
_LO32 = (1 << 32) - 1


@jit()
def plan(indices, offsets, psw, nbags, num_rows, last, mean, nparts, work, fwork):
    """Sort (row, position) pairs by row (stable LSD radix sort) and cut the groups of equal rows
    into nparts contiguous ranges of about equal length.

    Returns the (code, position, value) of _check_bags, then in sorted order rows (nnz,), the bag
    (nnz,) and the scale (nnz,) float32 (per-sample weight / bag size for mean) of each entry, so
    the update reads them sequentially, then group (U + 1,) the start of each group of equal
    rows and parts (nparts + 1,) the group cuts. work (6, nnz + 1) int64 and fwork (nnz + 1,)
    float32 are scratch the results are views of.
    """
    nnz = indices.shape[0]
    code, bad, value = _check_bags(indices, offsets, nbags, num_rows, last)
    if code:
        none = np.empty(0, np.int64)
        return (code, bad, value), none, none, np.empty(0, np.float32), none, none
    bag_of = work[0, :nnz]
    inv_len = np.ones(nbags, np.float32)
    for b in range(nbags):
        s, e = offsets[b], _bag_end(offsets, b, nbags, nnz, last)
        if mean and e > s:
            inv_len[b] = np.float32(1.0) / np.float32(e - s)
        for j in range(s, e):
            bag_of[j] = b
    nbits = 0
    while (np.int64(1) << nbits) < num_rows:
        nbits += 1
    npass = max(1, (nbits + RADIX_BITS - 1) // RADIX_BITS)
    digit = (nbits + npass - 1) // npass
    mask = (np.int64(1) << digit) - 1
    # the histograms of every pass in one read of the indices
    count = np.zeros((npass, (np.int64(1) << digit) + 1), np.int64)
    for j in range(nnz):
        r = np.int64(indices[j])
        for p in range(npass):
            count[p, ((r >> (p * digit)) & mask) + 1] += 1
    for p in range(npass):
        for k in range(1, count.shape[1]):
            count[p, k] += count[p, k - 1]
    # Each entry moves as one word, (row << 32) | position: half the traffic of separate row and
    # position arrays. Rows < 2**32 (the wrapper checks); bit 63 may make the word negative, so a
    # digit is read from the row recovered with a mask (a shift alone would drag the sign in).
    keys, keys2 = work[1, :nnz], work[3, :nnz]
    for j in range(nnz):  # pass 0 scatters straight from the indices, later passes ping-pong
        r = np.int64(indices[j])
        k = r & mask
        t = count[0, k]
        count[0, k] = t + 1
        keys[t] = (r << 32) | j
    for p in range(1, npass):
        shift = p * digit
        for j in range(nnz):
            key = keys[j]
            k = (((key >> 32) & _LO32) >> shift) & mask
            t = count[p, k]
            count[p, k] = t + 1
            keys2[t] = key
        keys, keys2 = keys2, keys
    # unpack in one sweep: rows, group starts, and each entry's bag and scale
    rows, starts, sbag, sscale = work[2, :nnz], work[4], work[5, :nnz], fwork[:nnz]
    has_psw = psw.shape[0] > 0
    ngroups = 0
    for k in range(nnz):
        key = keys[k]
        r = (key >> 32) & _LO32
        j = key & _LO32
        rows[k] = r
        if k == 0 or r != rows[k - 1]:
            starts[ngroups] = k
            ngroups += 1
        b = bag_of[j]
        sbag[k] = b
        sscale[k] = (psw[j] if has_psw else np.float32(1.0)) * inv_len[b]
    starts[ngroups] = nnz
    group = starts[:ngroups + 1]
    parts = np.empty(nparts + 1, np.int64)
    for t in range(nparts + 1):
        parts[t] = np.searchsorted(group, t * nnz // nparts)  # first group starting at or after the cut
    parts[nparts] = ngroups
    return (code, bad, value), rows, sbag, sscale, group, parts


def sorted_update(DC, PF, GRAD):
    @jit(parallel=True, fastmath=frozenset())
    def update(rows, sbag, sscale, group, parts, dout, lr, eps, table, state, drows):
        # table: (R, D) float32 weight, state: (R,) its Adagrad state; drows: (U, D) output of the
        # gradient (GRAD). Part t (one thread's) owns the row groups parts[t]:parts[t+1].
        D = DC if DC else dout.shape[1]
        ngroups = group.shape[0] - 1
        tail = _straddles(table, D * 4)
        for t in prange(parts.shape[0] - 1):
            acc = stack_f32(DC) if DC else np.empty((1, D), np.float32)
            g0, g1 = parts[t], parts[t + 1]
            for g in range(g0, g1):
                if not GRAD and g + PF < ngroups:  # a hint only: may touch the next part's rows
                    _prefetch_row(table, rows[group[g + PF]], D * 4, tail)
                    prefetch_l2(state, rows[group[g + PF]], 0)
                # the coalesced gradient of this row: its occurrences in position order
                for k in range(group[g], group[g + 1]):
                    _madd_row(acc, 0, dout, sbag[k], sscale[k], D, DC, k == group[g])
                r = rows[group[g]]
                if GRAD:
                    _madd_row(drows, g, acc, 0, np.float32(1.0), D, DC, True)
                else:
                    _apply_row(table, table, state, r, acc, 0, lr, eps, D, DC, False, False)  # Adagrad
    return update
