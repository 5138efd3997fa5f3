"""Readers: jitkern's layout, the reference DLRM's MLPerf .bin files, TorchRec's per-day .npy files.

Each gives a `CriteoDataset` whose `dense`, `sparse`, `labels` are row sources: a memory map
(jitkern's layout) or a `RowView` that converts slices on access (MLPerf, TorchRec), so no
reader loads a file into memory. Slicing `src[a:b]` always gives an ndarray of the final dtype.
"""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from .layout import SPLITS, LayoutError, day_splits, open_layout
from .raw import N_DENSE, N_FIELDS, N_SPARSE, transform_dense

MLPERF_RECORD = np.dtype("<i4")      # 40 int32 per record: label, 13 raw dense, 26 ids (160 bytes)


class RowView:
    """Rows [start, stop) of the concatenation of `parts` (arrays, same row shape), each slice
    passed through `convert` -> ndarray. Supports len, shape, dtype and basic slicing."""

    def __init__(self, parts, convert, dtype, start: int = 0, stop: int | None = None):
        self.parts, self.convert, self.dtype = list(parts), convert, np.dtype(dtype)
        self.bounds = np.concatenate([[0], np.cumsum([len(p) for p in self.parts])]).astype(np.int64)
        total = int(self.bounds[-1])
        self.start, self.stop = start, total if stop is None else stop
        self.shape = (self.stop - self.start, *self.parts[0].shape[1:])

    def __len__(self):
        return self.shape[0]

    def __getitem__(self, key):
        if not isinstance(key, slice) or key.step not in (None, 1):
            raise TypeError(f"RowView takes contiguous slices only, got {key!r}")
        a, b, _ = key.indices(len(self))
        a, b = self.start + a, self.start + max(a, b)
        pieces = []
        for k in range(len(self.parts)):
            lo, hi = max(a, self.bounds[k]), min(b, self.bounds[k + 1])
            if lo < hi:
                pieces.append(self.parts[k][lo - self.bounds[k]:hi - self.bounds[k]])
        if not pieces:
            return np.zeros((0, *self.shape[1:]), self.dtype)
        return self.convert(pieces[0] if len(pieces) == 1 else np.concatenate(pieces))

    def rows(self, start: int, stop: int) -> "RowView":
        return RowView(self.parts, self.convert, self.dtype, self.start + start, self.start + stop)

    def __array__(self, dtype=None, copy=None):
        a = self[:]
        return a if dtype is None else a.astype(dtype)


class CriteoDataset:
    """One split: dense (N, 13) float32, sparse (N, 26) int ids, labels (N,) float32 row sources, and
    cardinalities (26 ints: ids of table j are < cardinalities[j]; may be computed on first use)."""

    def __init__(self, dense, sparse, labels, cardinalities, split="train", source="", meta=None):
        self.dense, self.sparse, self.labels = dense, sparse, labels
        self._cardinalities = cardinalities        # a list, or a callable computing it (a scan)
        self.split, self.source, self.meta = split, source, meta or {}

    @property
    def cardinalities(self) -> list:
        if callable(self._cardinalities):
            self._cardinalities = self._cardinalities()
        return self._cardinalities

    def __len__(self):
        return len(self.labels)

    def __repr__(self):
        return f"CriteoDataset({self.meta.get('format', '?')} {self.source!r}, split={self.split!r}, rows={len(self)})"


def _check_split(split):
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")


def _dense_from_raw(x):
    """Raw integer dense values -> float32 log(max(x, 0) + 1), the reference's transform."""
    return transform_dense(np.maximum(x, 0).astype(np.float32))


def _as_float32(x):
    return np.asarray(x, dtype=np.float32).reshape(len(x))


def _as_int32(x):
    return np.asarray(x, dtype=np.int32)


def load_layout(path, split: str = "train") -> CriteoDataset:
    """One split of a jitkern preprocessed directory (memory maps, zero copy)."""
    _check_split(split)
    meta, arrays = open_layout(path)
    a, b = meta["splits"][split]
    return CriteoDataset(arrays["dense"][a:b], arrays["sparse"][a:b], arrays["labels"][a:b],
                         list(meta["cardinalities"]), split, str(path), meta)


def open_mlperf_bin(path) -> np.memmap:
    """The records of an MLPerf .bin file as an (N, 40) int32 memory map (whole records checked)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"MLPerf binary not found: {path}")
    size = path.stat().st_size
    rec = N_FIELDS * MLPERF_RECORD.itemsize
    if size % rec:
        raise LayoutError(f"{path}: {size} bytes is not a whole number of {rec}-byte records "
                          f"(truncated? {size // rec} whole records, {size % rec} bytes left over)")
    if size == 0:
        return np.zeros((0, N_FIELDS), MLPERF_RECORD)
    return np.memmap(path, dtype=MLPERF_RECORD, mode="r", shape=(size // rec, N_FIELDS))


def _mlperf_paths(path, split):
    """(file for split, prefix): accepts PREFIX_{split}.bin, or PREFIX itself."""
    p = Path(path)
    m = re.fullmatch(r"(.*)_(train|val|test)\.bin", p.name)
    prefix = p.with_name(m.group(1)) if m else (p.with_suffix("") if p.suffix == ".bin" else p)
    f = p.with_name(f"{m.group(1)}_{split}.bin") if m else (p if p.suffix == ".bin" else
                                                            Path(f"{p}_{split}.bin"))
    return f, prefix


def _scan_cardinalities(sparse, chunk=1 << 20):
    """max id + 1 per table, read in chunks (for files that do not record their cardinalities)."""
    top = np.zeros(N_SPARSE, np.int64)
    for a in range(0, len(sparse), chunk):
        s = np.asarray(sparse[a:a + chunk])
        if len(s):
            top = np.maximum(top, s.view(np.uint32).max(axis=0) if s.dtype == np.int32 else s.max(axis=0))
    return [int(t) + 1 for t in top]


def load_mlperf_bin(path, split: str = "train", counts_file=None) -> CriteoDataset:
    """The reference DLRM's MLPerf binary PREFIX_{train,val,test}.bin (path: any of them or PREFIX; a
    .bin not named so is read for every split). Cardinalities from counts_file (default
    PREFIX_fea_count.npz) 'counts' when present, else max id + 1 of this file, scanned on first
    use of ds.cardinalities."""
    _check_split(split)
    f, prefix = _mlperf_paths(path, split)
    recs = open_mlperf_bin(f)
    labels = RowView([recs[:, 0]], _as_float32, np.float32)
    dense = RowView([recs[:, 1:1 + N_DENSE]], _dense_from_raw, np.float32)
    sparse = RowView([recs[:, 1 + N_DENSE:]], _as_int32, np.int32)
    counts = Path(counts_file or f"{prefix}_fea_count.npz")
    if counts.is_file():
        with np.load(counts) as z:
            cards = [int(c) for c in z["counts"]]
        if len(cards) != N_SPARSE:
            raise LayoutError(f"{counts}: 'counts' has {len(cards)} entries, expected {N_SPARSE}")
    else:
        cards = lambda: _scan_cardinalities(sparse)
    return CriteoDataset(dense, sparse, labels, cards, split, str(f), {"format": "mlperf-bin"})


def load_torchrec(path, split: str = "train") -> CriteoDataset:
    """TorchRec's per-day day_{d}_{dense,sparse,labels}.npy (dense already transformed by TorchRec;
    sparse int32 values read as unsigned). Days sorted by d; splits as jitkern's layout.
    Cardinalities (max id + 1 over all days) are scanned on first use of ds.cardinalities."""
    _check_split(split)
    d = Path(path)
    days = sorted(int(m.group(1)) for p in d.glob("day_*_labels.npy")
                  if (m := re.fullmatch(r"day_(\d+)_labels\.npy", p.name)))
    if len(days) < 2:
        raise LayoutError(f"{d}: need day_<d>_{{dense,sparse,labels}}.npy for at least 2 days, found {days}")
    parts = {"dense": [], "sparse": [], "labels": []}
    for day in days:
        arrs = {}
        for k in parts:
            f = d / f"day_{day}_{k}.npy"
            if not f.is_file():
                raise LayoutError(f"{f}: missing (day {day} has a labels file)")
            try:
                arrs[k] = np.load(f, mmap_mode="r", allow_pickle=False)
            except Exception as e:   # NumPy's header parser raises whatever its tokenizer and literal_eval do
                raise LayoutError(f"{f}: unreadable or truncated: {type(e).__name__}: {e}") from None
            a = arrs[k]
            if getattr(a, "offset", 0) + a.nbytes != f.stat().st_size:     # np.load checks only "enough"
                raise LayoutError(f"{f}: {f.stat().st_size} bytes, not a header and {a.dtype} {a.shape} "
                                  "(corrupt header or trailing bytes)")
        n = len(arrs["labels"])
        want = {"dense": (n, N_DENSE), "sparse": (n, N_SPARSE)}
        for k, shp in want.items():
            if arrs[k].shape != shp:
                raise LayoutError(f"{d / f'day_{day}_{k}.npy'}: shape {arrs[k].shape}, expected {shp} "
                                  f"(labels have {n} rows)")
        if arrs["labels"].size != n:
            raise LayoutError(f"{d / f'day_{day}_labels.npy'}: shape {arrs['labels'].shape}, expected (N,) or (N, 1)")
        for k in parts:
            parts[k].append(arrs[k])
    dense = RowView(parts["dense"], lambda x: np.asarray(x, np.float32), np.float32)
    sparse = RowView(parts["sparse"], lambda x: np.asarray(x).astype(np.uint32, copy=False).astype(np.int64),
                     np.int64)
    labels = RowView([p.reshape(-1) for p in parts["labels"]], _as_float32, np.float32)
    a, b = day_splits([len(p) for p in parts["labels"]])[split]
    return CriteoDataset(dense.rows(a, b), sparse.rows(a, b), labels.rows(a, b),
                         lambda: _scan_cardinalities(sparse), split, str(d), {"format": "torchrec-npy", "days": days})


def load_preprocessed(path, split: str = "train") -> CriteoDataset:
    """One split ("train", "val", "test") of: a jitkern preprocessed dir, an MLPerf .bin file (or its
    prefix), or a TorchRec per-day .npy dir."""
    _check_split(split)
    p = Path(path)
    if p.is_dir():
        if (p / "meta.json").exists() or (p / "COMPLETE").exists():
            return load_layout(p, split)
        if any(p.glob("day_*_labels.npy")):
            return load_torchrec(p, split)
        raise LayoutError(f"{p}: neither a jitkern preprocessed dir (meta.json) nor TorchRec day_*.npy files")
    if p.suffix == ".bin" or Path(f"{p}_{split}.bin").is_file():
        return load_mlperf_bin(p, split)
    raise FileNotFoundError(f"no preprocessed data at {p} (a directory, a .bin file or a .bin prefix)")


__all__ = ["CriteoDataset", "RowView", "load_preprocessed", "load_layout", "load_mlperf_bin",
           "load_torchrec", "open_mlperf_bin"]
