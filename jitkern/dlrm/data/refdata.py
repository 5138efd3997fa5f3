"""The reference DLRM's processed Criteo files, and its way of finding them from the flags.

dlrm_s_pytorch.py turns --raw-data-file (kaggle: train.txt; terabyte: the prefix `day` of
day_0 .. day_23) into files beside it, named from that path:

    <dir>/<name>_day_count.npz         total_per_file: rows per day (7 for kaggle, 24 terabyte)
    <dir>/<name>_fea_count.npz         counts: rows per table
    <dir>/kaggleAdDisplayChallenge_processed.npz | terabyte_processed.npz
                                       X_int (N, 13), X_cat (N, 26), y (N,), counts (26,)
    <dir>/<npz>_{d}_reordered.npz      --memory-map: one day's X_int, X_cat, y (shuffled across days)

(<name>: the raw file's name up to its first dot for kaggle, whole for terabyte; <npz>:
<name>_day for kaggle, <name> for terabyte). Splits: train = every day but the last, test = the
first half (rounded up) of the last day, val = the rest. --data-randomize total permutes the
training rows once, day permutes within each day, both with the run's seeded NumPy stream, which
the model's initialisation continues (as the reference's global np.random): `ReferenceSplits`
draws exactly those numbers.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .layout import LayoutError
from .raw import N_DENSE, N_SPARSE
from .readers import CriteoDataset, _dense_from_raw

DAYS = {"kaggle": 7, "terabyte": 24}
OUT_NAME = {"kaggle": "kaggleAdDisplayChallenge_processed", "terabyte": "terabyte_processed"}


@dataclass(frozen=True)
class ReferencePaths:
    """The files the reference derives from --data-set, --raw-data-file and --processed-data-file."""
    data_set: str
    raw: str
    processed: str

    @property
    def days(self) -> int:
        return DAYS[self.data_set]

    @property
    def _dir_name(self):
        parts = self.raw.split("/")
        d_path = "/".join(parts[:-1]) + "/"
        name = parts[-1].split(".")[0] if self.data_set == "kaggle" else parts[-1]
        return d_path, name

    @property
    def day_count(self) -> str:
        d_path, name = self._dir_name
        return f"{d_path}{name}_day_count.npz"

    @property
    def fea_count(self) -> str:
        d_path, name = self._dir_name
        return f"{d_path}{name}_fea_count.npz"

    def reordered(self, day: int) -> str:
        d_path, name = self._dir_name
        return f"{d_path}{name + '_day' if self.data_set == 'kaggle' else name}_{day}_reordered.npz"

    @property
    def default_processed(self) -> str:
        """Where the reference writes the processed file when it preprocesses (whatever --processed-data-file says)."""
        return self._dir_name[0] + OUT_NAME[self.data_set] + ".npz"

    @property
    def jitkern_dir(self) -> Path:
        """Where jitkern preprocesses the raw data on first use: beside the processed file it would read."""
        p = Path(self.processed or self.default_processed)
        return p.with_name(p.name.split(".")[0] + ".jitkern")

    def raw_files(self) -> list:
        """The raw logs: the kaggle file, or the terabyte prefix's day_0 .. day_23."""
        if self.data_set == "kaggle":
            return [self.raw]
        return [f"{self.raw}_{d}" for d in range(self.days)]

    def memory_map_ready(self) -> bool:
        return all(os.path.exists(self.reordered(d)) for d in range(self.days))


def read_day_count(path) -> np.ndarray:
    """Rows per day from a reference *_day_count.npz."""
    try:
        with np.load(path) as z:
            counts = np.asarray(z["total_per_file"], np.int64)
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: missing (the reference's rows per day, written with its processed "
                                "file; --raw-data-file names it)") from None
    except (KeyError, ValueError, OSError) as e:
        raise LayoutError(f"{path}: not a reference *_day_count.npz ({type(e).__name__}: {e})") from None
    if counts.ndim != 1 or len(counts) < 2 or (counts < 0).any():
        raise LayoutError(f"{path}: total_per_file must list >= 2 non-negative day sizes, got {counts}")
    return counts


def load_reference_npz(path):
    """(X_int (N, 13), X_cat (N, 26), y (N,), counts (26,)) of a reference processed .npz."""
    try:
        with np.load(path) as z:
            arrays = [np.asarray(z[k]) for k in ("X_int", "X_cat", "y", "counts")]
    except KeyError as e:
        raise LayoutError(f"{path}: not a reference processed .npz (no {e})") from None
    except (ValueError, OSError) as e:
        raise LayoutError(f"{path}: unreadable .npz ({type(e).__name__}: {e})") from None
    x_int, x_cat, y, counts = arrays
    x_cat = x_cat.astype(np.int64)                 # the reference writes it as float64; its loader truncates
    n = len(y)
    if x_int.shape != (n, N_DENSE) or x_cat.shape != (n, N_SPARSE) or counts.shape != (N_SPARSE,):
        raise LayoutError(f"{path}: X_int {x_int.shape}, X_cat {x_cat.shape}, y {y.shape}, counts {counts.shape}: "
                          f"expected (N, {N_DENSE}), (N, {N_SPARSE}), (N,), ({N_SPARSE},)")
    return x_int, x_cat, y.reshape(n), counts


class ReferenceSplits:
    """The train/test/val rows of the reference's processed .npz in the reference's order.

    rs: the run's NumPy stream (RandomState(seed)): the permutations are drawn from it as the
    reference draws them building its train and then its test dataset, so rs is left where the
    reference's model initialisation starts."""

    def __init__(self, npz, day_count, randomize: str, rs: np.random.RandomState):
        self.x_int, self.x_cat, self.y, self.counts = load_reference_npz(npz)
        per_day = read_day_count(day_count)
        if per_day.sum() != len(self.y):
            raise LayoutError(f"{day_count}: {per_day.sum()} rows over its days, but {npz} holds {len(self.y)}")
        bounds = np.concatenate([[0], np.cumsum(per_day)])
        days = [np.arange(a, b) for a, b in zip(bounds[:-1], bounds[1:])]
        test, val = np.array_split(days[-1], 2)
        self.order = {"test": test, "val": val}
        for split in ("train", "test"):             # the reference builds both datasets, drawing each time
            train = [rs.permutation(d) if randomize == "day" else d for d in days[:-1]]
            train = np.concatenate(train)
            if randomize == "total":
                train = rs.permutation(train)
            self.order.setdefault("train", train)
        self.source = str(npz)

    def dataset(self, split: str) -> CriteoDataset:
        rows = self.order[split]
        dense = _dense_from_raw(self.x_int[rows])
        labels = self.y[rows].astype(np.float32)
        return CriteoDataset(dense, self.x_cat[rows], labels, [int(c) for c in self.counts], split, self.source,
                             {"format": "reference-npz"})


def load_reordered_days(paths: ReferencePaths, split: str) -> CriteoDataset:
    """--memory-map: the reference's per-day *_reordered.npz (train: all days but the last, read in
    day order; test/val: halves of the last day) and the table sizes of *_fea_count.npz."""
    days = range(paths.days - 1) if split == "train" else [paths.days - 1]
    parts = []
    for d in days:
        with np.load(paths.reordered(d)) as z:
            parts.append((np.asarray(z["X_int"]), np.asarray(z["X_cat"]), np.asarray(z["y"]).reshape(-1)))
    x_int, x_cat, y = (np.concatenate([p[k] for p in parts]) for k in range(3))
    x_cat = x_cat.astype(np.int64)
    if split != "train":
        first = (len(y) + 1) // 2
        rows = slice(0, first) if split == "test" else slice(first, len(y))
        x_int, x_cat, y = x_int[rows], x_cat[rows], y[rows]
    with np.load(paths.fea_count) as z:
        counts = [int(c) for c in z["counts"]]
    return CriteoDataset(_dense_from_raw(x_int), x_cat, y.astype(np.float32), counts, split,
                         paths.reordered(days[0]), {"format": "reference-reordered"})


def write_mlperf_bins(paths: ReferencePaths, prefix: str) -> None:
    """The reference's --mlperf-bin-loader files from its reordered days: PREFIX_train.bin (days
    0 .. 22) and PREFIX_{test,val}.bin (halves of day 23), int32 records (label, 13 dense, 26 ids)."""
    for split in ("train", "test", "val"):
        days = range(paths.days - 1) if split == "train" else [paths.days - 1]
        tmp = f"{prefix}_{split}.bin.tmp-{os.getpid()}"
        with open(tmp, "wb") as f:
            for d in days:
                with np.load(paths.reordered(d)) as z:
                    rec = np.concatenate([np.asarray(z["y"]).reshape(-1, 1), z["X_int"], z["X_cat"]], axis=1)
                rec = rec.astype(np.int32)
                if split != "train":
                    first = (len(rec) + 1) // 2
                    rec = rec[:first] if split == "test" else rec[first:]
                f.write(rec.tobytes())
        os.replace(tmp, f"{prefix}_{split}.bin")
