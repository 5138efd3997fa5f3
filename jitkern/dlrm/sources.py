"""The trainer's batch sources, built from its flags: the reference's random generator, jitkern's
learnable synthetic data, Criteo data in any format the trainer reads (found as the reference
finds it, preprocessed on first use), and background preparation of batches (--num-workers).

A batch source has len(src) batches per epoch and src.batches(epoch, start) yielding them from
batch `start` (resuming regenerates exactly what an uninterrupted run would have seen).
"""
from __future__ import annotations

import math
import os
import queue
import threading
from pathlib import Path

import numpy as np

from . import preflight
from .batch import Batch
from .data import iterate_batches, load_preprocessed, make_batch, preprocess, table_sizes
from .data.layout import is_dataset_dir
from .data.readers import CriteoDataset, load_mlperf_bin
from .data.refdata import ReferencePaths, ReferenceSplits, load_reordered_days, write_mlperf_bins
from .synth import Gaussian, RandomData, SyntheticData


class Rows:
    """Rows `rows` (an index array) of a row source (ndarray or memmap), gathered per slice."""

    def __init__(self, src, rows):
        self.src, self.rows = src, np.asarray(rows, np.int64)
        self.shape = (len(self.rows), *src.shape[1:])
        self.dtype = src.dtype

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, key):
        return np.asarray(self.src[self.rows[key]])


def take_rows(ds: CriteoDataset, rows) -> CriteoDataset:
    """The dataset's rows `rows`, in that order (sources that gather: arrays and memory maps)."""
    if not all(isinstance(a, np.ndarray) for a in (ds.dense, ds.sparse, ds.labels)):
        raise ValueError(f"{ds.source}: this format is read in file order only (no --data-randomize day, "
                         "no --data-sub-sample-rate)")
    return CriteoDataset(Rows(ds.dense, rows), Rows(ds.sparse, rows), Rows(ds.labels, rows),
                         ds._cardinalities, ds.split, ds.source, ds.meta)


def sub_sample(ds: CriteoDataset, rate: float, seed: int) -> CriteoDataset:
    """--data-sub-sample-rate: each negative sample dropped with probability `rate` (seeded per split)."""
    labels = np.asarray(ds.labels[:])
    u = np.random.default_rng([seed, 0x5AB, len(labels)]).random(len(labels))
    keep = np.flatnonzero((labels > 0) | (u >= rate))
    return take_rows(ds, keep)


def day_shuffled(ds: CriteoDataset, seed: int) -> CriteoDataset:
    """--data-randomize day for jitkern's layout: the rows of each day permuted, days in order."""
    a, b = ds.meta.get("splits", {}).get(ds.split, (0, len(ds)))
    bounds = ds.meta.get("day_offsets", [a, b])
    rng = np.random.default_rng([seed, 0xDA7])
    parts = [rng.permutation(np.arange(max(lo, a), min(hi, b))) for lo, hi in zip(bounds[:-1], bounds[1:])
             if min(hi, b) > max(lo, a)]
    return take_rows(ds, np.concatenate(parts) - a if parts else np.zeros(0, np.int64))


class DatasetData:
    """A CriteoDataset as the trainer's batch source: batches in order, or block-shuffled per epoch."""

    def __init__(self, ds, batch_size, num_batches, *, shuffle, seed, max_ind_range, name=""):
        self.ds, self.batch_size, self.shuffle, self.seed = ds, batch_size, shuffle, seed
        self.max_ind_range = max_ind_range if max_ind_range > 0 else None
        full = math.ceil(len(ds) / batch_size)
        if full == 0:
            raise ValueError(f"{name or ds.source}: the {ds.split} split is empty")
        self.num_batches = min(num_batches, full) if num_batches > 0 else full
        self.num_dense = ds.dense.shape[1]
        self.embedding_sizes = table_sizes(ds, self.max_ind_range)

    def __len__(self):
        return self.num_batches

    def batches(self, epoch=0, start=0):
        it = iterate_batches(self.ds, self.batch_size, shuffle=self.shuffle, seed=self.seed + epoch,
                             max_ind_range=self.max_ind_range, drop_last=False)
        for i, b in enumerate(it):
            if i >= self.num_batches:
                return
            if i >= start:
                yield b


class BinBatches(DatasetData):
    """--mlperf-bin-loader: the .bin file's batches of exactly batch_size records (the last may be
    short), in file order or, with --mlperf-bin-shuffle, in an order permuted per epoch."""

    def batches(self, epoch=0, start=0):
        order = np.arange(math.ceil(len(self.ds) / self.batch_size))
        if self.shuffle:
            order = np.random.default_rng([self.seed, epoch]).permutation(order)
        for i in range(start, self.num_batches):
            a = int(order[i]) * self.batch_size
            b = min(a + self.batch_size, len(self.ds))
            yield make_batch(self.ds.dense[a:b], self.ds.sparse[a:b], self.ds.labels[a:b], self.max_ind_range)


# --------------------------------------------------------------------------- finding the data


def _processed_kind(path: str) -> str:
    p = Path(path)
    if p.suffix == ".npz" and p.is_file():
        return "reference-npz"
    return "any"


def _first_use(paths: ReferencePaths, args, log) -> Path:
    """The raw data preprocessed into jitkern's layout beside the processed file (once)."""
    out = paths.jitkern_dir
    if is_dataset_dir(out):
        return out
    if not args.raw_data_file and not args.processed_data_file:
        raise preflight.PreflightError("--data-generation dataset needs --processed-data-file (or --raw-data-file "
                                       "to preprocess on first use); make one with `python -m jitkern preprocess "
                                       "--raw FILE --out DIR`")
    if not args.raw_data_file:
        raise preflight.PreflightError(
            f"--processed-data-file {args.processed_data_file}: not found, and no --raw-data-file to preprocess")
    raws = paths.raw_files()
    for f in raws:
        preflight.check_raw_file(f)
    log(f"Reading raw data={args.raw_data_file}: preprocessing {len(raws)} file(s) into {out} (first use)")
    preprocess(raws, out, dataset=args.data_set, days=paths.days)
    return out


def dataset_splits(args, rs, log=print):
    """(train, test) CriteoDatasets from the data flags, as the reference resolves them; `rs`: the
    run's NumPy stream (the reference's own files draw their permutations from it)."""
    paths = ReferencePaths(args.data_set, args.raw_data_file, args.processed_data_file)
    if args.mlperf_bin_loader and args.mlperf_logging and args.memory_map and args.data_set == "terabyte":
        parts = args.processed_data_file.split("/")
        prefix = "/".join(parts[:-1]) + "/" + parts[-1].split(".")[0]
        if not all(os.path.exists(f"{prefix}_{s}.bin") for s in ("train", "test")) and paths.memory_map_ready():
            write_mlperf_bins(paths, prefix)
        if all(os.path.exists(f"{prefix}_{s}.bin") for s in ("train", "test")):
            counts = args.raw_data_file + "_fea_count.npz"        # where the reference reads them
            return tuple(load_mlperf_bin(prefix, s, counts) for s in ("train", "test")) + ("bin",)
    if args.memory_map and paths.memory_map_ready():
        return load_reordered_days(paths, "train"), load_reordered_days(paths, "test"), "reference"
    if args.processed_data_file and os.path.exists(args.processed_data_file):
        if _processed_kind(args.processed_data_file) == "reference-npz":
            splits = ReferenceSplits(args.processed_data_file, paths.day_count, args.data_randomize, rs)
            return splits.dataset("train"), splits.dataset("test"), "reference"
        return (load_preprocessed(args.processed_data_file, "train"),
                load_preprocessed(args.processed_data_file, "test"), "jitkern")
    out = _first_use(paths, args, log)
    return load_preprocessed(out, "train"), load_preprocessed(out, "test"), "jitkern"


def _reordered(train, test, kind, args):
    """Randomisation and sub-sampling jitkern applies when it reads (the reference's files come ordered)."""
    if kind == "jitkern" and args.data_randomize == "day":
        train = day_shuffled(train, args.numpy_rand_seed)
    if args.data_sub_sample_rate > 0:
        train = sub_sample(train, args.data_sub_sample_rate, args.numpy_rand_seed)
        test = sub_sample(test, args.data_sub_sample_rate, args.numpy_rand_seed + 1)
    return train, test


def build_dataset(args, test_bs, rs, log=print):
    """(train, test) batch sources over Criteo data."""
    try:
        train, test, kind = dataset_splits(args, rs, log)
        train, test = _reordered(train, test, kind, args)
        common = dict(seed=args.numpy_rand_seed, max_ind_range=args.max_ind_range)
        if kind == "bin":
            return (BinBatches(train, args.mini_batch_size, args.num_batches, shuffle=args.mlperf_bin_shuffle, **common),
                    BinBatches(test, test_bs, args.num_test_batches, shuffle=False, **common))
        block_shuffle = kind == "jitkern" and args.data_randomize == "total"
        return _expanded(args, DatasetData(train, args.mini_batch_size, args.num_batches, shuffle=block_shuffle, **common),
                         DatasetData(test, test_bs, args.num_test_batches, shuffle=False, **common))
    except preflight.PreflightError:
        raise
    except (ValueError, OSError) as e:
        raise type(e)(f"--processed-data-file: {e}") from None


def multi_hot_sizes(args, num_tables: int):
    """--multi-hot-sizes as one int >= 1 per table, or None when not given."""
    if not args.multi_hot_sizes:
        return None
    try:
        sizes = [int(v) for v in args.multi_hot_sizes.replace(",", "-").split("-")]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise preflight.PreflightError(f"--multi-hot-sizes takes lookups >= 1 per table, got {args.multi_hot_sizes!r}")
    if len(sizes) != num_tables:
        raise preflight.PreflightError(f"--multi-hot-sizes gives {len(sizes)} sizes for {num_tables} tables")
    return sizes


_EXPANSION_MEMORY = 0.25   # share of this machine's memory the multi-hot lookup tables may take


class MultiHotExpansion:
    """MLPerf DLRM-DCNv2's one-hot -> multi-hot expansion of Criteo batches, on the fly: id r of
    table t becomes the bag [r, m_t[r, 0], ..., m_t[r, k_t - 2]], the (rows, k_t - 1) table m_t drawn
    as its materialisation script draws it (legacy NumPy seeded 0, tables in order; uniform ids, or
    Pareto(0.25) draws cast to int32 modulo rows)."""

    def __init__(self, source, sizes, dist: str):
        self.source = source
        rows = source.embedding_sizes
        need = 8 * sum(r * k for r, k in zip(rows, sizes))
        have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        if need > _EXPANSION_MEMORY * have:
            raise preflight.PreflightError(f"--multi-hot-sizes: the expansion tables need {need / 2**30:.1f} GiB, "
                                           f"more than a quarter of this machine's {have / 2**30:.0f} GiB; cap the "
                                           "tables (--max-ind-range)")
        rs = np.random.RandomState(0)
        self.tables = []
        for r, k in zip(rows, sizes):
            if dist == "pareto":
                with np.errstate(invalid="ignore"):
                    extra = rs.pareto(a=0.25, size=(r, k - 1)).astype(np.int32) % r
            else:
                extra = rs.randint(0, r, size=(r, k - 1))
            self.tables.append(np.concatenate([np.arange(r)[:, None], extra], axis=1).astype(np.int64))

    def __getattr__(self, name):
        return getattr(self.source, name)

    def __len__(self):
        return len(self.source)

    def expand(self, b: Batch) -> Batch:
        n = b.size
        offsets = np.empty_like(b.offsets)
        indices = []
        for t, (idx, table) in enumerate(zip(b.indices, self.tables)):
            if len(idx) != n:
                raise ValueError(f"--multi-hot-sizes expands one-hot data; table {t} has {len(idx)} ids for "
                                 f"{n} samples")
            offsets[t] = np.arange(0, n * table.shape[1], table.shape[1])
            indices.append(table[idx].reshape(-1))
        return Batch(b.dense, offsets, indices, b.labels)

    def batches(self, epoch: int = 0, start: int = 0):
        for b in self.source.batches(epoch, start):
            yield self.expand(b)


def _expanded(args, train, test):
    """The dataset's sources, expanded to --multi-hot-sizes where given."""
    sizes = multi_hot_sizes(args, len(train.embedding_sizes))
    if sizes is None:
        return train, test
    return (MultiHotExpansion(train, sizes, args.multi_hot_distribution_type),
            MultiHotExpansion(test, sizes, args.multi_hot_distribution_type))


def build_generated(args, sizes, num_dense, test_bs):
    """(train, test) batch sources for --data-generation random or synthetic."""
    if args.num_batches <= 0 and not (args.data_generation == "random" and args.data_size > 0):
        raise ValueError("--num-batches must be > 0 for generated data (or give --data-size with random)")
    n_train = args.num_batches or math.ceil(args.data_size / args.mini_batch_size)
    n_test = args.num_test_batches or max(4, math.ceil(n_train * args.mini_batch_size / test_bs / 10))
    k, fixed, seed = args.num_indices_per_lookup, args.num_indices_per_lookup_fixed, args.numpy_rand_seed
    if k < 1:
        raise ValueError(f"--num-indices-per-lookup must be >= 1, got {k}")
    multi = multi_hot_sizes(args, len(sizes))
    pareto = multi is not None and args.multi_hot_distribution_type == "pareto"
    if multi is not None:
        k, fixed = multi, True
    if args.data_generation == "random":
        dist = None if args.rand_data_dist == "uniform" else \
            Gaussian(args.rand_data_min, args.rand_data_max, args.rand_data_mu, args.rand_data_sigma)
        dist = "pareto" if pareto else dist
        # held out: the same generator on another seed (the reference reuses the training seed)
        common = dict(num_indices_per_lookup=k, fixed=fixed, round_targets=args.round_targets, dist=dist)
        data_size = args.data_size if args.num_batches == 0 else None
        train = RandomData(sizes, num_dense, args.mini_batch_size, n_train, seed=seed, data_size=data_size, **common)
        test = RandomData(sizes, num_dense, test_bs, n_test, seed=seed + 1, **common)
        return train, test
    common = dict(num_indices_per_lookup=k, fixed=fixed, seed=seed, pareto=pareto)
    return (SyntheticData(sizes, num_dense, args.mini_batch_size, n_train, split="train", **common),
            SyntheticData(sizes, num_dense, test_bs, n_test, split="test", **common))


# --------------------------------------------------------------------------- background preparation


class Prefetched:
    """A batch source whose batches are prepared ahead on `workers` background threads, handed out
    in order: the same batches as the source's, so resuming stays exact. Sources with random
    access (batch(epoch, i)) are spread over the threads; others run on one."""

    def __init__(self, source, workers: int):
        self.source, self.workers = source, max(1, int(workers))

    def __len__(self):
        return len(self.source)

    def __getattr__(self, name):
        return getattr(self.source, name)

    def batches(self, epoch=0, start=0):
        depth = 2 * self.workers
        q: queue.Queue = queue.Queue(maxsize=depth)
        stop = threading.Event()
        threads = [threading.Thread(target=self._produce, args=(epoch, start, k, q, stop), daemon=True)
                   for k in range(self._threads())]
        for t in threads:
            t.start()
        try:
            yield from self._collect(q, start, len(threads))
        finally:
            stop.set()
            for t in threads:
                while t.is_alive():
                    _drain(q)
                    t.join(0.01)

    def _threads(self) -> int:
        return self.workers if hasattr(self.source, "batch") else 1

    def _produce(self, epoch, start, k, q, stop):
        """Thread k: batches i = start + k, start + k + n, ... (random access), or all of them in order."""
        try:
            if hasattr(self.source, "batch"):
                n = self._threads()
                items = ((i, self.source.batch(epoch, i)) for i in range(start + k, len(self.source), n))
            else:
                items = enumerate(self.source.batches(epoch, start), start)
            for item in items:
                while not stop.is_set():
                    try:
                        q.put(item, timeout=0.05)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return
            q.put((None, None))
        except BaseException as e:            # handed to the consumer, which raises it
            q.put((None, e))

    def _collect(self, q, start, nthreads):
        pending, done, nxt = {}, 0, start
        while done < nthreads or pending:
            if nxt in pending:
                yield pending.pop(nxt)
                nxt += 1
                continue
            if done == nthreads:
                return
            i, b = q.get()
            if i is None:
                if isinstance(b, BaseException):
                    raise b
                done += 1
            else:
                pending[i] = b


def _drain(q):
    try:
        while True:
            q.get_nowait()
    except queue.Empty:
        pass


def prefetched(source, workers: int):
    """`source` with its batches prepared on `workers` background threads (0: as it is)."""
    return Prefetched(source, workers) if workers > 0 else source
