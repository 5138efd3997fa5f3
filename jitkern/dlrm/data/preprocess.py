"""`python -m jitkern preprocess`: Criteo raw logs -> the memory-mapped layout of layout.py.

Streaming, in chunks of whole lines (memory bounded by the chunk, plus the value counts of
frequency mode). Categorical encodings (id 0 is always "empty"):
  hash       (--max-ind-range M alone): id = 1 + (hash % (M - 1)); cardinality M per table
  frequency  (default; --min-frequency F, default 1): pass 1 counts every value, pass 2 maps
             values seen >= F times to ids 2, 3, ... by descending count (ties: smaller hash
             first), the rest to the shared id 1; cardinality 2 + #frequent values. With
             --max-ind-range too, hashes are reduced modulo M before counting.
Counts are taken over all rows (train, val and test), as the reference's dictionaries are.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import time
from pathlib import Path

import numpy as np

from ..interrupt import Interrupted, raising_signals
from .layout import ARRAYS, HEADER_BYTES, AtomicDir, NpyAppender, base_meta, kaggle_days, write_meta
from .idmap import IdTable
from .raw import DEFAULT_CHUNK_BYTES, N_SPARSE, RawDataError, iter_chunks, parse_chunk

_BITS = np.arange(N_SPARSE, dtype=np.uint32)


def empty_mask(empty: np.ndarray) -> np.ndarray:
    """(R,) uint32 bit masks -> (R, 26) bool, True where the categorical was empty."""
    return ((empty[:, None] >> _BITS) & np.uint32(1)).astype(bool)


def hash_ids(cats: np.ndarray, empty: np.ndarray, max_ind_range: int) -> np.ndarray:
    """Hash mode: (R, 26) uint32 values -> int32 ids, 0 for empty, else 1 + v % (M - 1)."""
    ids = (cats % np.uint32(max_ind_range - 1)).astype(np.int32) + 1
    ids[empty_mask(empty)] = 0
    return ids


def _merge_counts(runs):
    """Merge (sorted unique values, counts) runs into one."""
    vals = np.concatenate([v for v, _ in runs])
    cnts = np.concatenate([c for _, c in runs])
    order = np.argsort(vals, kind="stable")
    vals, cnts = vals[order], cnts[order]
    starts = np.flatnonzero(np.concatenate([[True], vals[1:] != vals[:-1]]))
    return vals[starts], np.add.reduceat(cnts, starts) if len(vals) else cnts


class FrequencyCounter:
    """Exact per-table value counts from chunks: sorted runs merged when they outgrow the total
    (an LSM-style merge: O(n log n) overall, memory O(distinct values) per table)."""

    def __init__(self, n_tables: int = N_SPARSE):
        self.main = [(np.zeros(0, np.uint32), np.zeros(0, np.int64)) for _ in range(n_tables)]
        self.pending = [[] for _ in range(n_tables)]

    def add(self, cats: np.ndarray, empty: np.ndarray) -> None:
        miss = empty_mask(empty)
        for j in range(len(self.main)):
            v, c = np.unique(cats[~miss[:, j], j], return_counts=True)
            self.pending[j].append((v, c.astype(np.int64)))
            if sum(len(p[0]) for p in self.pending[j]) > max(len(self.main[j][0]), 1 << 20):
                self._flush(j)

    def _flush(self, j):
        if self.pending[j]:
            self.main[j] = _merge_counts([self.main[j], *self.pending[j]])
            self.pending[j] = []

    def table(self, j):
        """(sorted unique values, counts) of table j."""
        self._flush(j)
        return self.main[j]


def frequency_ids(vals, counts, min_frequency: int):
    """The values counted >= min_frequency, in id order (descending count, ties by value), and
    their ids 2, 3, ...; every other value gets RARE_ID. Returns (keys, ids, cardinality)."""
    freq = np.flatnonzero(counts >= min_frequency)
    keys = vals[freq[np.lexsort((vals[freq], -counts[freq]))]]
    return keys, 2 + np.arange(len(keys), dtype=np.int32), 2 + len(keys)


def _remap_in_place(path, n_rows, mask_path, counter, min_frequency, rows_per_chunk=1 << 18):
    """Pass 2: rewrite sparse.npy's raw values as frequency ids, chunk by chunk, through file I/O
    (not a memmap, so resident memory stays bounded by the chunk)."""
    tables, cards = [], []
    for j in range(N_SPARSE):
        keys, ids, card = frequency_ids(*counter.table(j), min_frequency)
        counter.main[j] = None                      # the counts are no longer needed
        tables.append(IdTable(keys, ids))
        cards.append(card)
    row_bytes = N_SPARSE * 4
    with open(path, "r+b") as f, open(mask_path, "rb") as fm:
        for r0 in range(0, n_rows, rows_per_chunk):
            r = min(rows_per_chunk, n_rows - r0)
            f.seek(HEADER_BYTES + r0 * row_bytes)
            raw = np.fromfile(f, np.uint32, r * N_SPARSE).reshape(r, N_SPARSE)
            empty = np.fromfile(fm, np.uint32, r)
            out = np.empty((r, N_SPARSE), np.int32)
            for j in range(N_SPARSE):
                tables[j].map_column(raw, empty, j, out)
            f.seek(HEADER_BYTES + r0 * row_bytes)
            f.write(out.data)
    return cards


def _pass1(raw_files, tmp, mask_path, counter, max_ind_range, skip_bad_lines, chunk_bytes, bar, sources):
    """Parse every file into tmp's .npy files: final ids (hash mode, mask_path None) or raw values
    counted into `counter` with their empty masks in mask_path. Returns (rows, raw text bytes)."""
    writers = {k: NpyAppender(tmp / f"{k}.npy", dt, shp) for k, (dt, shp) in ARRAYS.items()}
    mask_f = open(mask_path, "wb") if mask_path else None
    raw_bytes = 0
    try:
        for path in raw_files:
            rows0, lines, bad, done = writers["labels"].rows, 0, 0, 0
            for buf, first, disk_pos in iter_chunks(path, chunk_bytes):
                ch = parse_chunk(buf, path=path, first_line=first, skip_bad_lines=skip_bad_lines)
                writers["dense"].append(ch.dense)
                writers["labels"].append(ch.labels)
                if mask_f is None:
                    writers["sparse"].append(hash_ids(ch.cats, ch.empty, int(max_ind_range)))
                else:
                    if max_ind_range is not None:
                        ch.cats %= np.uint32(max_ind_range)
                    counter.add(ch.cats, ch.empty)
                    writers["sparse"].append(ch.cats.view(np.int32))
                    mask_f.write(ch.empty.data)
                lines += ch.n_lines
                bad += ch.n_bad
                raw_bytes += buf.size
                bar.update(disk_pos - done, writers["labels"].rows, raw_bytes)
                done = disk_pos
            sources.append({"path": str(path), "lines": lines, "rows": writers["labels"].rows - rows0,
                            "bad_lines_skipped": bad})
        for w in writers.values():
            w.close()
    finally:
        for w in writers.values():
            w.f.close()
        if mask_f is not None:
            mask_f.close()
    return writers["labels"].rows, raw_bytes


def _check_days(day_rows, days, sources) -> None:
    """Every split non-empty: each day has rows, the last day at least 2 (its halves are test and
    val). days: the kaggle --days (None: terabyte, one file per day)."""
    if days is not None:
        if day_rows[-1] < 2:
            n = sum(day_rows)
            raise RawDataError(f"days={days} (--days): the data has {n} rows, too few for {days} days with "
                               f"non-empty train, test and val splits (at most {n // 2} days)")
        return
    for rows, src in zip(day_rows, sources):
        if rows < (2 if src is sources[-1] else 1):
            raise RawDataError(f"{src['path']}: {rows} row(s): every day needs rows, and the last day at least "
                               "2 (its halves are the test and val splits)")


def day_order(paths):
    """Terabyte day files in day order: by N when every name is day_N[.ext] (a shell glob sorts
    day_10 before day_2), else as given."""
    days = [re.fullmatch(r"day_(\d+)(\..*)?", p.name) for p in paths]
    return sorted(paths, key=lambda p: int(p.name[4:].split(".")[0])) if all(days) else list(paths)


def preprocess(raw_files, out, *, dataset: str = "kaggle", days: int = 7, max_ind_range=None,
               min_frequency=None, skip_bad_lines: bool = False, overwrite: bool = False,
               chunk_bytes: int = DEFAULT_CHUNK_BYTES, progress: bool = False) -> dict:
    """Preprocess raw Criteo logs into `out` (see layout.py); returns meta.json's contents."""
    raw_files = [Path(p) for p in raw_files]
    if not raw_files:
        raise ValueError("raw_files: need at least one raw file")
    if dataset not in ("kaggle", "terabyte"):
        raise ValueError(f"dataset must be 'kaggle' or 'terabyte', got {dataset!r}")
    if dataset == "terabyte" and len(raw_files) < 2:
        raise ValueError("dataset='terabyte' takes one file per day (at least 2: the last is test/val)")
    if dataset == "kaggle" and days < 2:
        raise ValueError(f"days must be >= 2, got {days}")
    if max_ind_range is not None and not 2 <= int(max_ind_range) <= 2**31 - 1:
        raise ValueError(f"max_ind_range must be in [2, 2**31 - 1], got {max_ind_range}")
    if min_frequency is not None and int(min_frequency) < 1:
        raise ValueError(f"min_frequency must be >= 1, got {min_frequency}")
    for p in raw_files:
        if not p.is_file():
            raise FileNotFoundError(f"raw file not found: {p}")
        if p.stat().st_size == 0:
            raise RawDataError(f"{p}: empty raw file (no rows)")
    if dataset == "terabyte":
        raw_files = day_order(raw_files)
    hashing = max_ind_range is not None and min_frequency is None
    min_frequency = 1 if min_frequency is None else int(min_frequency)

    t0 = time.perf_counter()
    bar = _Progress(sum(p.stat().st_size for p in raw_files), progress)
    counter = None if hashing else FrequencyCounter()
    sources = []
    with AtomicDir(out, overwrite=overwrite) as tmp:
        mask_path = tmp / "empty_mask.tmp"
        try:
            n, raw_bytes = _pass1(raw_files, tmp, None if hashing else mask_path, counter, max_ind_range,
                                  skip_bad_lines, chunk_bytes, bar, sources)
        finally:
            bar.close()
        if n == 0:
            raise RawDataError(f"no rows in {', '.join(map(str, raw_files))}")
        if hashing:
            cards = [int(max_ind_range)] * N_SPARSE
            categorical = {"mode": "hash", "max_ind_range": int(max_ind_range), "empty_id": 0,
                           "formula": "1 + hash % (max_ind_range - 1)"}
        else:
            cards = _remap_in_place(tmp / "sparse.npy", n, mask_path, counter, min_frequency)
            os.unlink(mask_path)
            categorical = {"mode": "frequency", "min_frequency": min_frequency, "empty_id": 0,
                           "rare_id": 1, "max_ind_range": max_ind_range,
                           "order": "descending count, ties by hash value"}
        day_rows = kaggle_days(n, days) if dataset == "kaggle" else [s["rows"] for s in sources]
        _check_days(day_rows, days if dataset == "kaggle" else None, sources)
        secs = time.perf_counter() - t0
        stats = {"seconds": round(secs, 3), "raw_bytes": raw_bytes, "mb_per_s": round(raw_bytes / secs / 1e6, 2),
                 "rows_per_s": round(n / secs), "bad_lines_skipped": sum(s["bad_lines_skipped"] for s in sources)}
        meta = base_meta(n, day_rows, cards, categorical, dataset=dataset, sources=sources, stats=stats)
        write_meta(tmp, meta)
    return meta


class _Progress:
    """A tqdm bar over disk bytes with rows/s and raw MB/s, or nothing."""

    def __init__(self, total, enabled):
        self.bar, self.t0 = None, time.perf_counter()
        if enabled:
            from tqdm import tqdm
            self.bar = tqdm(total=total, unit="B", unit_scale=True, desc="preprocess", file=sys.stderr)

    def update(self, disk_bytes, rows, raw_bytes):
        if self.bar is not None:
            dt = max(time.perf_counter() - self.t0, 1e-9)
            self.bar.set_postfix_str(f"{rows / dt:,.0f} rows/s {raw_bytes / dt / 1e6:.1f} MB/s raw", refresh=False)
            self.bar.update(disk_bytes)

    def close(self):
        if self.bar is not None:
            self.bar.close()


def main(argv=None) -> int:
    """python -m jitkern preprocess --raw FILES --out DIR [...]"""
    ap = argparse.ArgumentParser(prog="python -m jitkern preprocess", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--raw", nargs="+", required=True, help="raw log files (plain or .gz), in day order")
    ap.add_argument("--out", required=True, help="output directory (written atomically)")
    ap.add_argument("--dataset", choices=("kaggle", "terabyte"), default="kaggle",
                    help="kaggle: files form one stream cut into --days days; terabyte: one file per day")
    ap.add_argument("--days", type=int, default=7, help="days to cut a kaggle stream into (default 7)")
    ap.add_argument("--max-ind-range", type=int, default=None, help="hash categoricals into this many ids")
    ap.add_argument("--min-frequency", type=int, default=None,
                    help="frequency mode: values seen fewer times share one id (default 1)")
    ap.add_argument("--skip-bad-lines", action="store_true", help="skip and count malformed lines")
    ap.add_argument("--overwrite", action="store_true",
                    help="replace an existing output directory if it holds a jitkern dataset (nothing else)")
    ap.add_argument("--chunk-mb", type=float, default=DEFAULT_CHUNK_BYTES / 2**20, help="read chunk size")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    a = ap.parse_args(argv)
    try:
        with raising_signals():         # SIGTERM unwinds as Ctrl-C does: the work directory is removed
            meta = preprocess(a.raw, a.out, dataset=a.dataset, days=a.days, max_ind_range=a.max_ind_range,
                              min_frequency=a.min_frequency, skip_bad_lines=a.skip_bad_lines,
                              overwrite=a.overwrite, chunk_bytes=int(a.chunk_mb * 2**20), progress=not a.quiet)
    except Interrupted as e:
        print(f"preprocess: interrupted ({e}); {a.out} not written", file=sys.stderr)
        return e.exit_code
    except (ValueError, FileNotFoundError, FileExistsError) as e:
        print(f"preprocess: error: {e}", file=sys.stderr)
        return 1
    s = meta["stats"]
    sp = meta["splits"]
    print(f"preprocess: {meta['rows']:,} rows from {len(a.raw)} file(s), {s['raw_bytes'] / 1e6:.1f} MB raw text "
          f"in {s['seconds']:.2f} s: {s['mb_per_s']:.1f} MB/s, {s['rows_per_s']:,} rows/s; "
          f"bad lines skipped: {s['bad_lines_skipped']}")
    print("  splits: " + ", ".join(f"{k} {b - a_:,}" for k, (a_, b) in sp.items()))
    print(f"  categorical: {meta['categorical']['mode']}, cardinalities {meta['cardinalities']}")
    print(f"  wrote {a.out}")
    return 0
