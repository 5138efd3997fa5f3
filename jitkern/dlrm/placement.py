"""Embedding-table placement for hybrid parallel DLRM: whole tables on ranks, tiny ones replicated.

Pure Python (no MPI), so it is testable and usable by the scaling model without a communicator.
"""
from __future__ import annotations

from dataclasses import dataclass

REPLICATED = -1
# Tables of at most this many bytes are replicated on every rank: a dense allreduce of their
# gradient costs less than carrying them through the alltoall (which costs ~B*D*4 bytes per
# table and direction, independent of the table size).
REPLICATE_BYTES = 1 << 16


@dataclass(frozen=True)
class Placement:
    """owner[t] is the rank holding table t, or REPLICATED (-1) for a table on every rank."""
    nranks: int
    owner: tuple
    sizes: tuple          # rows per table
    dim: int
    lookups: tuple        # indices per sample per table (the load the forward and update see)

    def tables_of(self, rank: int) -> tuple:
        """The tables rank owns (not counting replicated ones), ascending."""
        return tuple(t for t, o in enumerate(self.owner) if o == rank)

    @property
    def replicated(self) -> tuple:
        return tuple(t for t, o in enumerate(self.owner) if o == REPLICATED)

    def bytes_of(self, rank: int, itemsize: int = 4) -> int:
        return sum(self.sizes[t] for t in self.tables_of(rank)) * self.dim * itemsize

    def lookups_of(self, rank: int) -> int:
        """Indices per global-batch sample that rank gathers for its own tables."""
        return sum(self.lookups[t] for t in self.tables_of(rank))

    def describe(self, itemsize: int = 4) -> str:
        """A few lines: tables, MB and lookups per rank, and the replicated tables."""
        lines = [f"table placement over {self.nranks} ranks (greedy largest-first, bytes + lookups):"]
        for r in range(self.nranks):
            tabs = self.tables_of(r)
            lines.append(f"  rank {r}: {len(tabs):3d} tables {self.bytes_of(r, itemsize) / 1e6:10.1f} MB "
                         f"{self.lookups_of(r):6d} lookups/sample  {list(tabs)}")
        if self.replicated:
            lines.append(f"  replicated on every rank (gradients allreduced): {list(self.replicated)}")
        return "\n".join(lines)


def place_tables(sizes, dim: int, nranks: int, lookups=None, *, itemsize: int = 4,
                 replicate_bytes: int = REPLICATE_BYTES) -> Placement:
    """Greedy largest-first: each table goes to the rank with the least combined load.

    sizes: rows per table; lookups: indices per sample per table (default 1 each).
    The load of a rank is its share of all table bytes plus its share of all lookups, so both
    memory and per-step gather/update work are balanced. With nranks == 1 nothing is replicated.
    """
    sizes = tuple(int(s) for s in sizes)
    if nranks < 1:
        raise ValueError(f"nranks must be >= 1, got {nranks}")
    if dim < 1:
        raise ValueError(f"dim must be >= 1, got {dim}")
    if any(s < 1 for s in sizes):
        raise ValueError(f"sizes must all be >= 1, got {list(sizes)}")
    lookups = tuple(1 for _ in sizes) if lookups is None else tuple(int(x) for x in lookups)
    if len(lookups) != len(sizes):
        raise ValueError(f"lookups has {len(lookups)} entries for {len(sizes)} tables")
    if any(x < 0 for x in lookups):
        raise ValueError(f"lookups must be >= 0, got {list(lookups)}")
    owner = [0] * len(sizes)
    if nranks > 1:
        placed = []
        for t, rows in enumerate(sizes):
            if rows * dim * itemsize <= replicate_bytes:
                owner[t] = REPLICATED
            else:
                placed.append(t)
        total_bytes = sum(sizes[t] for t in placed) or 1
        total_lookups = sum(lookups[t] for t in placed) or 1

        def cost(t):
            return sizes[t] / total_bytes + lookups[t] / total_lookups

        load = [0.0] * nranks
        count = [0] * nranks
        for t in sorted(placed, key=lambda t: (-cost(t), t)):
            r = min(range(nranks), key=lambda r: (load[r], count[r], r))
            owner[t] = r
            load[r] += cost(t)
            count[r] += 1
    return Placement(nranks, tuple(owner), sizes, int(dim), lookups)


def batch_slices(batch: int, nranks: int) -> list:
    """(lo, hi) rows of the global batch each rank runs the MLPs on; the first B % P get one more."""
    base, extra = divmod(int(batch), nranks)
    bounds, lo = [], 0
    for r in range(nranks):
        hi = lo + base + (1 if r < extra else 0)
        bounds.append((lo, hi))
        lo = hi
    return bounds
