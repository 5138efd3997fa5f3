"""Generated DLRM data: the reference's `random` generator and a learnable `synthetic` data set.

Both are batch sources for the trainer: `len(src)` batches per epoch, `src.batches(epoch, start)`
yields Batch objects from batch `start` of that epoch (resuming mid-epoch regenerates exactly
what an uninterrupted run would have seen).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .batch import Batch


def _offsets_from_sizes(sizes):
    off = np.zeros(len(sizes), np.int64)
    np.cumsum(sizes[:-1], out=off[1:])
    return off


def _unique_per_bag(values, bag_of, num_bags):
    """Sorted unique values within each bag (bags given by bag id per value) -> (indices, sizes)."""
    if len(values) == num_bags and np.array_equal(bag_of, np.arange(num_bags)):   # one value per bag
        return values, np.ones(num_bags, np.int64)
    order = np.lexsort((values, bag_of))
    v, g = values[order], bag_of[order]
    keep = np.ones(len(v), bool)
    keep[1:] = (v[1:] != v[:-1]) | (g[1:] != g[:-1])
    return v[keep], np.bincount(g[keep], minlength=num_bags)


def random_sparse(rs: np.random.RandomState, rows: int, n: int, k: int, fixed: bool):
    """One table's lookups as the reference draws them: (offsets (n,), indices) int64.

    Per sample: a bag size (k, or round(max(1, r * min(rows, k))) for r ~ U[0,1)), then that many
    uniform draws r -> round(r * (rows - 1)), deduplicated and sorted; consumes exactly the
    reference's random numbers, in the same order, without its per-sample Python loop.
    """
    if fixed:
        vals = np.round(rs.random_sample(n * k) * (rows - 1)).astype(np.int64)
        bag_of = np.repeat(np.arange(n), k)
    else:
        m = min(rows, k)
        if m == 1:                                     # every bag has one index: r * 1 < 1 rounds up to 1
            draws = rs.random_sample(2 * n)
            starts, sizes = np.arange(0, 2 * n, 2), np.ones(n, np.int64)
        else:
            state = rs.get_state()
            ahead = rs.random_sample(n * (m + 1))       # enough for any bag sizes
            sizes_at = np.round(np.maximum(1.0, ahead * m)).astype(np.int64).tolist()
            starts, pos = [], 0
            for _ in range(n):                         # a bag's size decides where the next begins
                starts.append(pos)
                pos += 1 + sizes_at[pos]
            rs.set_state(state)
            draws = rs.random_sample(pos)              # the same numbers, leaving rs where the reference would
            starts = np.asarray(starts, np.int64)
            sizes = np.asarray([sizes_at[s] for s in starts.tolist()], np.int64)
        bag_of = np.repeat(np.arange(n), sizes)
        first = np.repeat(starts + 1, sizes)
        within = np.arange(len(bag_of)) - np.repeat(_offsets_from_sizes(sizes), sizes)
        vals = np.round(draws[first + within] * (rows - 1)).astype(np.int64)
    indices, sizes = _unique_per_bag(vals, bag_of, n)
    return _offsets_from_sizes(sizes), indices


@dataclass(frozen=True)
class Gaussian:
    """The reference's --rand-data-dist gaussian: ids drawn from N(mu, sigma), clipped to [low, high],
    deduplicated as floats, then truncated to ints (so a bag may repeat an id); mu -1: the middle."""
    low: float = 0.0
    high: float = 1.0
    mu: float = -1.0
    sigma: float = 1.0

    @property
    def mean(self) -> float:
        return (self.high + self.low) / 2.0 if self.mu == -1 else self.mu

    def bag(self, rs, size: int) -> np.ndarray:
        return np.unique(np.clip(rs.normal(self.mean, self.sigma, size), self.low, self.high)).astype(np.int64)


def gaussian_sparse(rs, rows: int, n: int, k: int, fixed: bool, dist: Gaussian):
    """One table's lookups as the reference draws gaussian ids: (offsets (n,), indices) int64. A
    bag's size draw and its normals interleave on the stream, so this goes sample by sample."""
    bags = []
    for _ in range(n):
        size = k if fixed else int(np.round(max(1.0, rs.random_sample(1)[0] * min(rows, k))))
        bags.append(dist.bag(rs, size))
    sizes = np.array([len(b) for b in bags], np.int64)
    return _offsets_from_sizes(sizes), np.concatenate(bags) if bags else np.zeros(0, np.int64)


def per_table(k, t: int) -> int:
    """Table t's lookups per sample: k itself, or its t-th entry (multi-hot sizes)."""
    return k if isinstance(k, (int, np.integer)) else k[t]


def pareto_ids(rs, rows: int, size: int) -> np.ndarray:
    """Heavy-tailed ids: Pareto(a=0.25) draws modulo rows (the multi-hot "pareto" distribution of
    MLPerf's DLRM-DCNv2); draws past 2**62 are clipped so the cast is defined."""
    return np.minimum(rs.pareto(0.25, size), 2.0 ** 62).astype(np.int64) % rows


def random_batch(rs, embedding_sizes, num_dense, n, k, fixed, round_targets=False, dist=None) -> Batch:
    """The reference's generate_random_input_batch + generate_random_output_batch, from rs
    (dist: None for uniform ids, "pareto" (fixed pooling, no deduplication), or Gaussian; k: lookups
    per sample, one for all tables or one per table)."""
    dense = rs.rand(n, num_dense).astype(np.float32)
    offsets = np.empty((len(embedding_sizes), n), np.int64)
    indices = []
    for t, rows in enumerate(embedding_sizes):
        kt = per_table(k, t)
        if dist is None:
            offsets[t], idx = random_sparse(rs, rows, n, kt, fixed)
        elif dist == "pareto":
            offsets[t], idx = np.arange(0, n * kt, kt, dtype=np.int64), pareto_ids(rs, rows, n * kt)
        else:
            offsets[t], idx = gaussian_sparse(rs, rows, n, kt, fixed, dist)
        indices.append(idx)
    labels = rs.rand(n, 1).astype(np.float32)
    if round_targets:
        labels = np.round(labels).astype(np.float32)
    return Batch(dense, offsets, indices, labels.reshape(n))


class RandomData:
    """The reference's `random` data: one NumPy stream, reseeded at the start of every epoch."""

    def __init__(self, embedding_sizes, num_dense, batch_size, num_batches, *, num_indices_per_lookup=10,
                 fixed=False, seed=123, round_targets=False, data_size=None, dist=None):
        self.dist = dist
        self.embedding_sizes = list(embedding_sizes)
        self.num_dense = num_dense
        self.batch_size = batch_size
        self.num_batches = num_batches
        self.k, self.fixed, self.seed, self.round_targets = num_indices_per_lookup, fixed, seed, round_targets
        # like the reference's data_size: the last batch may be short
        self.data_size = data_size if data_size is not None else batch_size * num_batches

    def __len__(self):
        return self.num_batches

    def batches(self, epoch: int = 0, start: int = 0):
        rs = np.random.RandomState(self.seed)
        for i in range(self.num_batches):
            n = min(self.batch_size, self.data_size - i * self.batch_size)
            b = random_batch(rs, self.embedding_sizes, self.num_dense, n, self.k, self.fixed, self.round_targets,
                             self.dist)
            if i >= start:                      # earlier batches are drawn only to advance the stream
                yield b


def multi_hot_batches(embedding_sizes, pooling, num_dense, batch_size: int, num_batches: int, seed: int = 0) -> list:
    """Random batches with a fixed number of lookups per table and sample (pooling[t]), ids uniform
    with repeats kept, as MLPerf's multi-hot data (--multi_hot_distribution_type uniform)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(num_batches):
        n = batch_size
        dense = rng.random((n, num_dense), dtype=np.float32)
        offsets = np.stack([np.arange(n, dtype=np.int64) * k for k in pooling])
        indices = [rng.integers(0, rows, n * k, dtype=np.int64) for rows, k in zip(embedding_sizes, pooling)]
        labels = (rng.random(n) < 0.5).astype(np.float32)
        out.append(Batch(dense, offsets, indices, labels))
    return out


def config_batches(cfg, batch_size: int, num_batches: int, seed: int = 0) -> list:
    """The benchmarks' batches for a configs.ModelConfig: the reference's generator with a fixed
    pooling of cfg.lookups indices per table and sample (duplicates within a bag merged), or the
    multi-hot batches of cfg.multi_hot."""
    if cfg.multi_hot:
        return multi_hot_batches(cfg.sizes, cfg.multi_hot, cfg.bottom[0], batch_size, num_batches, seed)
    src = RandomData(cfg.sizes, cfg.bottom[0], batch_size, num_batches, num_indices_per_lookup=cfg.lookups,
                     fixed=True, seed=seed)
    return list(src.batches())


class Teacher:
    """A hidden random DLRM-like scorer: dense linear term + per-row biases + pairwise row dots."""

    RANK = 4
    MAX_ROWS = 4096       # teacher rows per table; larger tables share them by index modulo

    def __init__(self, embedding_sizes, num_dense, seed, scale=4.0, shift=-1.0):
        rng = np.random.default_rng([seed, 0x7EAC])
        self.a = rng.standard_normal(num_dense) * np.sqrt(12.0 / num_dense)   # (d - 0.5) has variance 1/12
        self.bias = [rng.standard_normal(min(r, self.MAX_ROWS)) for r in embedding_sizes]
        self.vec = [rng.standard_normal((min(r, self.MAX_ROWS), self.RANK)) for r in embedding_sizes]
        self.scale, self.shift = scale, shift

    def logits(self, dense, offsets, indices):
        t_count = len(indices)
        terms = [(dense.astype(np.float64) - 0.5) @ self.a]
        bias = np.zeros(len(dense))
        vecs = []
        for t, idx in enumerate(indices):
            sizes = np.diff(np.append(offsets[t], len(idx)))
            rows = idx % len(self.bias[t])
            bias += np.add.reduceat(self.bias[t][rows], offsets[t]) / sizes
            vecs.append(np.add.reduceat(self.vec[t][rows], offsets[t], axis=0) / sizes[:, None])
        terms.append(bias / np.sqrt(t_count))
        if t_count > 1:
            # sum over table pairs t < s of <v_t, v_s> = (|sum_t v_t|^2 - sum_t |v_t|^2) / 2
            total = sum(vecs)
            pairs = ((total * total).sum(axis=1) - sum((v * v).sum(axis=1) for v in vecs)) / 2
            terms.append(pairs / np.sqrt(self.RANK * t_count * (t_count - 1) / 2))
        return self.scale * sum(terms) / np.sqrt(len(terms)) + self.shift


class SyntheticData:
    """Learnable data: uniform features, clicks drawn from a hidden Teacher's probabilities.

    Batch `i` of epoch `e` of split `split` depends only on (seed, split, e, i), so any batch can
    be regenerated; train and test splits share the teacher and differ in their samples.
    """

    SPLITS = {"train": 0, "test": 1}

    def __init__(self, embedding_sizes, num_dense, batch_size, num_batches, *, num_indices_per_lookup=1,
                 fixed=True, seed=123, split="train", pareto=False):
        if split not in self.SPLITS:
            raise ValueError(f"split must be one of {tuple(self.SPLITS)}, got {split!r}")
        self.embedding_sizes = list(embedding_sizes)
        self.num_dense, self.batch_size, self.num_batches = num_dense, batch_size, num_batches
        self.k, self.fixed, self.seed, self.split = num_indices_per_lookup, fixed, seed, split
        self.pareto = pareto  # ids Pareto-distributed (multi-hot "pareto") instead of uniform
        self.teacher = Teacher(self.embedding_sizes, num_dense, seed)

    def __len__(self):
        return self.num_batches

    def batch(self, epoch: int, i: int) -> Batch:
        rng = np.random.default_rng([self.seed, self.SPLITS[self.split], epoch, i])
        n = self.batch_size
        dense = rng.random((n, self.num_dense), np.float32)
        offsets = np.empty((len(self.embedding_sizes), n), np.int64)
        indices = []
        for t, rows in enumerate(self.embedding_sizes):
            k = per_table(self.k, t)
            sizes = np.full(n, k, np.int64) if self.fixed else rng.integers(1, k + 1, n)
            offsets[t] = _offsets_from_sizes(sizes)
            m = int(sizes.sum())
            indices.append(pareto_ids(rng, rows, m) if self.pareto else rng.integers(0, rows, m, dtype=np.int64))
        p = 1.0 / (1.0 + np.exp(-self.teacher.logits(dense, offsets, indices)))
        labels = (rng.random(n) < p).astype(np.float32)
        return Batch(dense, offsets, indices, labels)

    def batches(self, epoch: int = 0, start: int = 0):
        for i in range(start, self.num_batches):
            yield self.batch(epoch, i)
