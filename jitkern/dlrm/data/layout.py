"""jitkern's preprocessed Criteo layout: three .npy arrays, a meta.json, a completion marker.

    DIR/dense.npy    (N, 13) float32   log(max(x, 0) + 1) of I1..I13, empty -> 0
    DIR/sparse.npy   (N, 26) int32     ids of C1..C26, in [0, cardinalities[j])
    DIR/labels.npy   (N,)    float32   0 or 1
    DIR/meta.json    format, version, rows, per-array dtype/shape, splits (row ranges),
                     day offsets, cardinalities, categorical encoding, sources, statistics
    DIR/COMPLETE     written last, with meta.json's crc32; a directory without it is never read

Rows keep file order, so every split is one contiguous row range `[start, stop)` and a
split is a slice of the same memory maps (no copies): Kaggle's train.txt is cut into 7
days (the first `N % 7` days one row longer) and Terabyte's day files are days; train is
every day but the last; the last day's first ceil(n/2) rows are "test", the rest "val"
(as the reference dlrm_data_pytorch.py). The directory is written as DIR.tmp-<host>-<pid> and
renamed into place, so an interrupted run never leaves a DIR that looks complete.
"""
from __future__ import annotations

import glob
import json
import os
import re
import shutil
import socket
import zlib
from pathlib import Path

import numpy as np

from .raw import N_DENSE, N_SPARSE

FORMAT = "jitkern-criteo"
VERSION = 1
MARKER = "COMPLETE"
SPLITS = ("train", "val", "test")
ARRAYS = {  # name -> (dtype, row shape)
    "dense": (np.dtype("<f4"), (N_DENSE,)),
    "sparse": (np.dtype("<i4"), (N_SPARSE,)),
    "labels": (np.dtype("<f4"), ()),
}
HEADER_BYTES = 128     # fixed-size .npy v1 header, so rows can be appended before N is known


class LayoutError(ValueError):
    """A preprocessed directory or binary file that is incomplete or inconsistent."""


def npy_header(dtype, shape) -> bytes:
    """A .npy v1.0 header padded to exactly 128 bytes (numpy reads any 64-aligned padding)."""
    d = {"descr": np.lib.format.dtype_to_descr(np.dtype(dtype)), "fortran_order": False,
         "shape": tuple(int(s) for s in shape)}
    body = repr(d).encode("latin1")
    pad = HEADER_BYTES - 10 - len(body) - 1
    if pad < 0:
        raise ValueError(f"shape {shape} too long for a fixed .npy header")
    return b"\x93NUMPY\x01\x00" + (HEADER_BYTES - 10).to_bytes(2, "little") + body + b" " * pad + b"\n"


class NpyAppender:
    """Append rows to a .npy file whose row count is only known at the end (header rewritten on close)."""

    def __init__(self, path, dtype, row_shape):
        self.path, self.dtype, self.row_shape, self.rows = Path(path), np.dtype(dtype), tuple(row_shape), 0
        self.f = open(self.path, "wb")
        self.f.write(npy_header(self.dtype, (0,) + self.row_shape))

    def append(self, a: np.ndarray) -> None:
        a = np.ascontiguousarray(a, dtype=self.dtype)
        if a.shape[1:] != self.row_shape:
            raise ValueError(f"{self.path.name}: rows of shape {a.shape[1:]}, expected {self.row_shape}")
        self.f.write(a.data)
        self.rows += a.shape[0]

    def close(self) -> None:
        self.f.seek(0)
        self.f.write(npy_header(self.dtype, (self.rows,) + self.row_shape))
        self.f.close()


def is_dataset_dir(path) -> bool:
    """Whether `path` is a directory holding a jitkern dataset and nothing else (what --overwrite
    may replace): its COMPLETE marker or a meta.json of this format, no other files."""
    d = Path(path)
    if not d.is_dir() or d.is_symlink():
        return False
    names = set(os.listdir(d))
    if not names <= {MARKER, "meta.json", "empty_mask.tmp", *(f"{k}.npy" for k in ARRAYS)}:
        return False
    if MARKER in names:
        return True
    try:
        return json.loads((d / "meta.json").read_text()).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def _stale_work_dirs(out: Path, host: str):
    """Work directories next to `out` (OUT.tmp-HOST-PID, OUT.old-HOST-PID) left on this host by
    processes that are gone: a killed run's. Other hosts' and live processes' are never listed,
    nor a replaced dataset (.old-) while `out` is missing (killed between the two renames)."""
    kinds = ("tmp", "old") if out.exists() else ("tmp",)
    for p in out.parent.glob(f"{glob.escape(out.name)}.*-{glob.escape(host)}-*"):
        kind, _, rest = p.name[len(out.name) + 1:].partition("-")
        his_host, _, pid = rest.rpartition("-")
        if kind in kinds and his_host == host and pid.isdigit() and not _alive(int(pid)):
            yield p


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:          # another user's live process
        return True
    return True


class AtomicDir:
    """Context manager: yields a temporary directory that becomes `out` (with a COMPLETE marker
    recording meta.json's checksum) on success. The work directories carry the host and pid
    (OUT.tmp-HOST-PID), so stale ones of killed runs on this host are removed at the next start
    even on a filesystem other nodes share. overwrite=True replaces only a jitkern dataset."""

    def __init__(self, out, *, overwrite: bool = False):
        self.out = Path(out)
        self.host = socket.gethostname()
        self.tmp = self.out.with_name(f"{self.out.name}.tmp-{self.host}-{os.getpid()}")
        if self.out.exists() or self.out.is_symlink():
            if not overwrite:
                raise FileExistsError(f"output directory {self.out} exists (pass overwrite=True / --overwrite)")
            if not is_dataset_dir(self.out):
                raise FileExistsError(f"output directory {self.out} is not a jitkern dataset (no {MARKER} or "
                                      "meta.json, or other files in it): not replacing it; remove it yourself "
                                      "or choose another --out")
        self.overwrite = overwrite

    def __enter__(self) -> Path:
        self.out.parent.mkdir(parents=True, exist_ok=True)
        for stale in _stale_work_dirs(self.out, self.host):
            shutil.rmtree(stale, ignore_errors=True)
        shutil.rmtree(self.tmp, ignore_errors=True)
        self.tmp.mkdir()
        return self.tmp

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            return False
        (self.tmp / MARKER).write_text(_marker_text(self.tmp))
        old = None
        if self.out.exists():
            old = self.out.with_name(f"{self.out.name}.old-{self.host}-{os.getpid()}")
            os.rename(self.out, old)
        os.rename(self.tmp, self.out)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        return False


def _marker_text(dir_: Path) -> str:
    meta = dir_ / "meta.json"
    return f"ok meta.json crc32 {zlib.crc32(meta.read_bytes()):08x}\n" if meta.exists() else "ok\n"


def _check_marker(d: Path) -> None:
    """COMPLETE present, and meta.json's checksum as it records (a bare "ok": an older dataset)."""
    try:
        text = (d / MARKER).read_text()
    except FileNotFoundError:
        raise LayoutError(f"{d} is incomplete (no {MARKER} marker): an interrupted preprocess? run it again") from None
    except (OSError, UnicodeDecodeError) as e:
        raise LayoutError(f"{d / MARKER}: unreadable: {e}") from None
    if text == "ok\n":
        return
    m = re.fullmatch(r"ok meta\.json crc32 ([0-9a-f]{8})\n", text)
    if m is None:
        raise LayoutError(f"{d / MARKER}: corrupt completion marker")
    try:
        crc = zlib.crc32((d / "meta.json").read_bytes())
    except OSError as e:
        raise LayoutError(f"{d / 'meta.json'}: unreadable: {e}") from None
    if crc != int(m.group(1), 16):
        raise LayoutError(f"{d / 'meta.json'}: checksum mismatch (corrupt or edited meta.json)")


def day_splits(day_rows) -> dict:
    """Split row ranges from rows per day: train = all days but the last; test/val halve the last."""
    day_rows = [int(r) for r in day_rows]
    if len(day_rows) < 2:
        raise ValueError(f"need at least 2 days to split into train and test/val, got {len(day_rows)}")
    start = sum(day_rows[:-1])
    n = start + day_rows[-1]
    mid = start + (day_rows[-1] + 1) // 2
    return {"train": [0, start], "test": [start, mid], "val": [mid, n]}


def kaggle_days(n_rows: int, days: int = 7) -> list:
    """Rows per day when one file is cut into `days` days (the reference: the first n % days get one more)."""
    q, r = divmod(int(n_rows), days)
    return [q + (d < r) for d in range(days)]


def write_meta(dir_, meta: dict) -> None:
    with open(Path(dir_) / "meta.json", "w") as f:
        json.dump(meta, f, indent=1)
        f.write("\n")


def base_meta(n_rows: int, day_rows, cardinalities, categorical: dict, **extra) -> dict:
    """meta.json contents for N rows with the given per-day rows, cardinalities and encoding."""
    offsets = np.concatenate([[0], np.cumsum(day_rows)]).astype(int).tolist()
    return {
        "format": FORMAT, "version": VERSION, "rows": int(n_rows),
        "arrays": {k: {"file": f"{k}.npy", "dtype": dt.str, "shape": [int(n_rows), *shp]}
                   for k, (dt, shp) in ARRAYS.items()},
        "day_offsets": offsets,
        "splits": day_splits(day_rows),
        "dense_transform": "float32 log(max(x, 0) + 1); empty -> 0",
        "cardinalities": [int(c) for c in cardinalities],
        "categorical": categorical,
        **extra,
    }


def write_preprocessed(out, dense, sparse, labels, cardinalities, day_rows, *,
                       categorical=None, overwrite: bool = False) -> Path:
    """Write arrays already in memory as a preprocessed directory (tests, conversions)."""
    n = len(labels)
    with AtomicDir(out, overwrite=overwrite) as tmp:
        for name, a in (("dense", dense), ("sparse", sparse), ("labels", labels)):
            dt, shp = ARRAYS[name]
            a = np.asarray(a)
            if a.shape != (n, *shp):
                raise ValueError(f"{name} must have shape {(n, *shp)}, got {a.shape}")
            np.save(tmp / f"{name}.npy", a.astype(dt, copy=False))
        write_meta(tmp, base_meta(n, day_rows, cardinalities, categorical or {"mode": "given"}))
    return Path(out)


def read_meta(dir_) -> dict:
    """meta.json of a complete preprocessed directory, checked for format and internal consistency."""
    d = Path(dir_)
    if not d.is_dir():
        raise FileNotFoundError(f"preprocessed directory not found: {d}")
    if not (d / MARKER).exists():
        raise LayoutError(f"{d} is incomplete (no {MARKER} marker): an interrupted preprocess? run it again")
    try:
        meta = json.loads((d / "meta.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise LayoutError(f"{d / 'meta.json'}: unreadable: {e}") from None
    if not isinstance(meta, dict):
        raise LayoutError(f"{d / 'meta.json'}: not a JSON object")
    if meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise LayoutError(f"{d / 'meta.json'}: format {meta.get('format')!r} version {meta.get('version')!r}, "
                          f"expected {FORMAT!r} version {VERSION}")
    try:
        n = int(meta["rows"])
        cards = [int(c) for c in meta["cardinalities"]]
        splits = {k: tuple(int(x) for x in meta["splits"][k]) for k in SPLITS}
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise LayoutError(f"{d / 'meta.json'}: missing or malformed entry: {e}") from None
    if len(cards) != N_SPARSE or min(cards) < 1:
        raise LayoutError(f"{d / 'meta.json'}: cardinalities must be {N_SPARSE} ints >= 1, got {cards}")
    for k, (a, b) in splits.items():
        if not 0 <= a <= b <= n:
            raise LayoutError(f"{d / 'meta.json'}: split {k!r} range [{a}, {b}) outside 0..{n}")
    return meta


def open_npy(path, dtype, shape) -> np.memmap:
    """Memory-map a .npy file, checking its header and its size against the expected dtype and shape."""
    path = Path(path)
    if not path.is_file():
        raise LayoutError(f"{path}: missing")
    with open(path, "rb") as f:
        try:
            version = np.lib.format.read_magic(f)
            read = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                    else np.lib.format.read_array_header_2_0)
            hdr = read(f)
        except Exception as e:       # NumPy's header parser raises whatever its tokenizer and literal_eval do
            raise LayoutError(f"{path}: not a valid .npy file: {type(e).__name__}: {e}") from None
        offset = f.tell()
    got_shape, fortran, got_dtype = hdr
    if fortran or got_dtype != np.dtype(dtype) or tuple(got_shape) != tuple(shape):
        raise LayoutError(f"{path}: holds {got_dtype} {tuple(got_shape)}, meta.json says {np.dtype(dtype)} "
                          f"{tuple(shape)}")
    need = offset + int(np.prod(shape)) * np.dtype(dtype).itemsize
    size = path.stat().st_size
    if size != need:
        raise LayoutError(f"{path}: {size} bytes, expected {need} for {tuple(shape)} {np.dtype(dtype)} "
                          f"({'truncated' if size < need else 'trailing bytes'})")
    if need == offset:
        return np.zeros(shape, dtype)
    return np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=tuple(shape))


def open_layout(dir_) -> tuple[dict, dict]:
    """(meta, {"dense", "sparse", "labels": read-only memmaps of all rows}) of a preprocessed dir;
    meta.json's checksum is checked last, after the checks that can say what is inconsistent."""
    meta = read_meta(dir_)
    arrays = {}
    for name, (dt, shp) in ARRAYS.items():
        try:
            spec = meta.get("arrays", {}).get(name, {})
            file, want = str(spec.get("file", f"{name}.npy")), spec.get("shape")
            want = None if want is None else tuple(int(n) for n in want)
        except (AttributeError, TypeError, ValueError):
            raise LayoutError(f"{Path(dir_) / 'meta.json'}: malformed arrays.{name}") from None
        shape = (int(meta["rows"]), *shp)
        if want is not None and want != shape:
            raise LayoutError(f"{Path(dir_) / 'meta.json'}: arrays.{name}.shape {list(want)} does not "
                              f"match rows={meta['rows']}")
        arrays[name] = open_npy(Path(dir_) / file, dt, shape)
    _check_marker(Path(dir_))
    return meta, arrays

