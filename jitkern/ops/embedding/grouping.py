"""Grouping a batch's entries by table row, for the backward and the row-wise Adagrad update.

Both compute "coalesce, then update": a row's gradient is the sum of its occurrences' scaled
dout rows, added in position order, so the order is fixed by the data alone. Two ways to find
each row's occurrences:

- hashed linking (sparse batches): one reverse pass over the entries inserts each row into an
  open-addressing table and threads its occurrences into a linked list headed by its first
  occurrence (link_rows); an update then walks the heads. Nothing is sorted.
- radix sorting (the backward, whose rows come out sorted, and dense or skewed batches): a
  stable LSD radix sort of (row, position) pairs groups each row's occurrences in position
  order; the groups are cut into contiguous row ranges that prange hands to the threads
  (sorted_groups), so each row has one owner and no atomics are needed.
"""
from __future__ import annotations

import numpy as np

from ...codegen import jit
from ._rows import GOLDEN, L2, LO32, bag_end, madd_row, prefetch_row, scratch, straddles
from ._validate import check_bags, raise_bag_error

RADIX_BITS = 12  # digit width of the radix sort (4096-entry histogram)
_CHUNKS = 64     # row-group parts of the sorted grouping

# ----------------------------------------------------------------------------- hashed linking


@jit(inline="always")
def _slot_bits(n):
    """log2 of the hash table for n distinct rows at most: the first power of two >= 2 n."""
    bits = 1
    while (np.int64(1) << bits) < 2 * n:
        bits += 1
    return bits


@jit(inline="always")
def _insert(slots, bits, r, j, nxt, head):
    """Entry j (row r) joins its row's list, found through slots[:2**bits].

    Entries arrive in descending position and each is pushed at the front, so a row's list runs
    in ascending position from its head, its first occurrence. A slot holds (row << 32) | head:
    one load per probe. head[j] is 1 while j heads its list, nxt[j] the next entry or -1."""
    hmask = np.uint64((np.int64(1) << bits) - 1)
    h = (np.uint64(r) * GOLDEN) >> np.uint64(64 - bits)
    while True:
        v = slots[h]
        if v == -1 or (v >> 32) & LO32 == r:
            break
        h = (h + np.uint64(1)) & hmask
    slots[h] = (r << 32) | j
    head[j] = 1
    if v == -1:
        nxt[j] = -1
    else:
        nxt[j] = v & LO32
        head[v & LO32] = 0


@jit(inline="always")
def scratch_views(scratch, n):
    """In scratch (>= 7 n int64): slots (4n,), then nxt, ebag and head (n,) per entry."""
    return scratch[:4 * n], scratch[4 * n:5 * n], scratch[5 * n:6 * n], scratch[6 * n:7 * n]


@jit(inline="always")
def _one_per_bag(offsets, nbags, n):
    """Whether bag b is exactly entry b for every b (a branch-free reduction that vectorises)."""
    if nbags != n:
        return False
    same = True
    for b in range(nbags):
        same &= offsets[b] == b
    return same


@jit()
def link_rows(bags, nbags, table, row_bytes, link, scratch):
    """Thread every entry into its row's list (one reverse pass; see _insert), noting each entry's
    bag in ebag (tracked backwards from the last bag). Returns whether entry j is bag j for all j.

    Each entry's table row is prefetched `link` entries before it is linked (row_bytes 0: none),
    so the rows come in from memory while this pass hashes, not during the update walk."""
    indices, offsets = bags[0], bags[1]
    n = indices.shape[0]
    slots, nxt, ebag, head = scratch_views(scratch, n)
    bits = _slot_bits(min(n, table.shape[0]))
    slots[:np.int64(1) << bits] = -1
    unit = _one_per_bag(offsets, nbags, n)
    tail = straddles(table, row_bytes)
    pf = link if row_bytes > 0 else n
    if unit:  # one-hot features, the common case: no bag to track or note
        for k in range(n):
            j = n - 1 - k
            if j >= pf:
                prefetch_row(table, indices[j - pf], row_bytes, tail, L2)
            _insert(slots, bits, np.int64(indices[j]), j, nxt, head)
        return unit
    b, s = nbags, n
    for k in range(n):
        j = n - 1 - k
        if j >= pf:
            prefetch_row(table, indices[j - pf], row_bytes, tail, L2)
        while j < s:
            b -= 1
            s = offsets[b]
        ebag[j] = b
        _insert(slots, bits, np.int64(indices[j]), j, nxt, head)
    return unit


@jit()
def list_heads(j0, j1, scratch, n):
    """Gather the entries in [j0, j1) that head a list (branch-free) into the slots, free once the
    lists are linked; returns the list."""
    head = scratch[6 * n:7 * n]
    heads = scratch[j0:j1]
    m = 0
    for j in range(j0, j1):
        heads[m] = j
        m += head[j]
    return heads[:m]


@jit()
def sample_repeats(indices, slots):
    """The share of 1024 evenly spaced entries (all, if fewer) whose row an earlier one of them
    had: a ~3 us estimate of how skewed a batch is. slots: >= 4096 int64 scratch."""
    n = indices.shape[0]
    s = min(n, 1024)
    slots[:4096] = -1
    repeats = 0
    for k in range(s):
        r = np.int64(indices[k * n // s])
        h = (np.uint64(r) * GOLDEN) >> np.uint64(52)
        while True:
            v = slots[h]
            if v == -1 or v == r:
                break
            h = (h + np.uint64(1)) & np.uint64(4095)
        repeats += v == r
        slots[h] = r
    return repeats / max(s, 1)


# ----------------------------------------------------------------------------- radix sorting


@jit(inline="always")
def _bag_of_entries(bags, nbags, bag_of):
    """bag_of[j] = the bag of entry j; returns each bag's scale (nbags,): 1 / its size for mean, else 1."""
    indices, offsets, _, mean, last = bags
    nnz = indices.shape[0]
    inv_len = np.ones(nbags, np.float32)
    for b in range(nbags):
        s, e = offsets[b], bag_end(offsets, b, nbags, nnz, last)
        if mean and e > s:
            inv_len[b] = np.float32(1.0) / np.float32(e - s)
        for j in range(s, e):
            bag_of[j] = b
    return inv_len


@jit(inline="always")
def _radix_sort(indices, num_rows, keys, keys2):
    """Stable LSD radix sort of the entries by row, as (row << 32) | position words; returns the
    sorted words (keys or keys2, whichever the last pass wrote).

    One word per entry moves half the bytes of separate row and position arrays. Rows < 2**32
    (the wrapper checks); bit 63 may make a word negative, so a digit is read from the row
    recovered with a mask (a shift alone would drag the sign in)."""
    nnz = indices.shape[0]
    nbits = 0
    while (np.int64(1) << nbits) < num_rows:
        nbits += 1
    npass = max(1, (nbits + RADIX_BITS - 1) // RADIX_BITS)
    digit = (nbits + npass - 1) // npass
    mask = (np.int64(1) << digit) - 1
    count = np.zeros((npass, (np.int64(1) << digit) + 1), np.int64)
    for j in range(nnz):  # the histograms of every pass in one read of the indices
        r = np.int64(indices[j])
        for p in range(npass):
            count[p, ((r >> (p * digit)) & mask) + 1] += 1
    for p in range(npass):
        for k in range(1, count.shape[1]):
            count[p, k] += count[p, k - 1]
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
            k = (((key >> 32) & LO32) >> shift) & mask
            t = count[p, k]
            count[p, k] = t + 1
            keys2[t] = key
        keys, keys2 = keys2, keys
    return keys


@jit(inline="always")
def _unpack(keys, bag_of, inv_len, psw, rows, starts, sbag, sscale):
    """From the sorted words, in one sweep: rows, group starts (returns their count), and each
    entry's bag and scale."""
    has_psw = psw.shape[0] > 0
    ngroups = 0
    for k in range(keys.shape[0]):
        key = keys[k]
        r = (key >> 32) & LO32
        j = key & LO32
        rows[k] = r
        if k == 0 or r != rows[k - 1]:
            starts[ngroups] = k
            ngroups += 1
        b = bag_of[j]
        sbag[k] = b
        sscale[k] = (psw[j] if has_psw else np.float32(1.0)) * inv_len[b]
    starts[ngroups] = keys.shape[0]
    return ngroups


@jit()
def _sort_groups(bags, nbags, num_rows, nparts, work, fwork):
    """Sort (row, position) pairs by row and cut the groups of equal rows into nparts contiguous
    ranges of about equal length.

    Returns the (code, position, value) of check_bags, then in sorted order rows (nnz,), the bag
    (nnz,) and the scale (nnz,) float32 (per-sample weight / bag size for mean) of each entry, so
    an update reads them sequentially, then group (U + 1,) the start of each group of equal rows
    and parts (nparts + 1,) the group cuts. work (6, nnz + 1) int64 and fwork (nnz + 1,) float32
    are scratch the results are views of.
    """
    indices, psw = bags[0], bags[2]
    nnz = indices.shape[0]
    code, bad, value = check_bags(bags, nbags, num_rows)
    if code:
        none = np.empty(0, np.int64)
        return (code, bad, value), none, none, np.empty(0, np.float32), none, none
    bag_of = work[0, :nnz]
    inv_len = _bag_of_entries(bags, nbags, bag_of)
    keys = _radix_sort(indices, num_rows, work[1, :nnz], work[3, :nnz])
    rows, starts, sbag, sscale = work[2, :nnz], work[4], work[5, :nnz], fwork[:nnz]
    ngroups = _unpack(keys, bag_of, inv_len, psw, rows, starts, sbag, sscale)
    group = starts[:ngroups + 1]
    parts = np.empty(nparts + 1, np.int64)
    for t in range(nparts + 1):
        parts[t] = np.searchsorted(group, t * nnz // nparts)  # first group starting at or after the cut
    parts[nparts] = ngroups
    return (code, bad, value), rows, sbag, sscale, group, parts


def sorted_groups(bags, nbags, num_rows, table_name):
    """groups = (rows, sbag, sscale, group, parts) of the sorted grouping (see _sort_groups), in
    per-thread scratch; raises the bag error naming `table_name` if the bags are invalid."""
    nnz = bags[0].shape[0]
    n = nnz + 1
    buf = scratch(n, 7)
    work, fwork = buf[:6 * n].reshape(6, n), buf[6 * n:7 * n].view(np.float32)[:n]
    err, rows, sbag, sscale, group, parts = _sort_groups(bags, nbags, num_rows, max(1, min(_CHUNKS, nnz)), work,
                                                         fwork)
    if err[0]:
        raise_bag_error(*err, table_name, num_rows, nnz)
    return rows, sbag, sscale, group, parts


@jit(inline="always")
def group_gradient(acc, dout, groups, g, D, DC):
    """acc[0] = the coalesced gradient of row group g: +0.0 plus its occurrences' scaled dout rows,
    added in position order (from +0.0 as the reference's sums, with no first-entry case in the
    loop: see forward.pool_bag)."""
    sbag, sscale, group = groups[1], groups[2], groups[3]
    for d in range(DC if DC else D):
        acc[0, d] = 0.0
    for k in range(group[g], group[g + 1]):
        madd_row(acc, 0, dout, sbag[k], sscale[k], D, DC, False)
