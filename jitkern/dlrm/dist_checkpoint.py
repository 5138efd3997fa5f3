"""Sharded checkpoints of the hybrid-parallel DLRM: each rank writes its own table pieces, with a manifest.

A checkpoint is a directory:

    PATH/manifest.json                        format, arch, meta, and per array: shape, crc32, and
                                              for a table its pieces (file, rows, cols, crc32)
    PATH/gen-<id>/emb.<t>.weight.r<a>-<b>.c<c>-<d>.npy   rows a..b-1, columns c..d-1 of table t,
                                              written by the rank holding them (replicas: rank 0)
    PATH/gen-<id>/state.emb.<t>.weight.r<a>-<b>.c<c>-<d>.npy   the table optimizer's state of that
                                              piece (element-wise: the same rows and columns; per
                                              row: rows a..b-1, cols 0-1, once per row range)
    PATH/gen-<id>/<name>.npy                  MLP arrays and their optimizer state (state.<name>),
                                              written by rank 0

Array names are one process's checkpoint_arrays names, so either side loads the other's.

Every file is written to a temporary name, fsynced and renamed; rank 0 writes the manifest last,
after every rank has reported its files, and only then deletes older generations. A save
interrupted anywhere (a failing or killed rank) leaves the manifest pointing at the previous,
complete generation, or no manifest at all: never a checkpoint that looks valid and is not.
Loading reads the manifest and assembles each region this rank holds from the pieces that cover
it, so the rank count and the sharding may differ from the ones that saved (one process too: a
plain DLRM loads it). Version 1 checkpoints (whole tables per file) load as one piece per table.
"""
from __future__ import annotations

import json
import os
import shutil
import time
import zlib

import numpy as np

from .atomic import atomic_write, fsync_dir

FORMAT = "jitkern-dlrm-sharded"
VERSION = 2
READABLE = (1, 2)
MANIFEST = "manifest.json"


class ShardedCheckpointError(ValueError):
    """A directory that is not a complete sharded checkpoint, or one for another architecture."""


def _crc(a: np.ndarray) -> int:
    return zlib.crc32(memoryview(np.ascontiguousarray(a)).cast("B"))


def _write_array(path: str, a: np.ndarray) -> dict:
    """Atomically write one .npy file; -> its manifest entry (without the file name)."""
    with atomic_write(path) as f:
        np.lib.format.write_array(f, np.ascontiguousarray(a), allow_pickle=False)
    return {"shape": list(a.shape), "dtype": str(a.dtype), "crc32": _crc(a)}


def _local_files(model, gen: str):
    """(file name relative to the checkpoint, array name, region or None, array) this rank writes."""
    comm = getattr(model, "comm", None)
    rank = 0 if comm is None else comm.Get_rank()
    for t, region in sorted(model.table_regions().items()):
        if not model.saves_region(t):
            continue
        arrays = [(f"emb.{t}.weight", region, model.read_region(t))]
        state = model.table_state(t)
        if state is not None and (state.ndim == 2 or region[2] == 0):   # per-row state: once per row range
            arrays.append((f"state.emb.{t}.weight", region if state.ndim == 2 else region[:2] + (0, 1), state))
        for name, (r0, r1, c0, c1), a in arrays:
            yield os.path.join(gen, f"{name}.r{r0}-{r1}.c{c0}-{c1}.npy"), name, (r0, r1, c0, c1), a
    if rank == 0:
        for name, a in {**model.mlp_state_dict(), **model.dense_state_dict()}.items():
            yield os.path.join(gen, f"{name}.npy"), name, None, a


def _merge(parts: list, shapes: dict) -> dict:
    """Every rank's file entries -> the manifest's arrays (tables: pieces sorted by rows, cols)."""
    arrays = {}
    for part in parts:
        for name, region, entry in part:
            if region is None:
                arrays[name] = entry
            else:
                e = arrays.setdefault(name, {"shape": list(shapes[name]), "dtype": "float32", "pieces": []})
                e["pieces"].append(dict(entry, rows=list(region[:2]), cols=list(region[2:])))
    for e in arrays.values():
        if "pieces" in e:
            e["pieces"].sort(key=lambda p: (p["rows"], p["cols"]))
    return arrays


def save_checkpoint(path: str, model, meta: dict, arch: dict) -> None:
    """Collective (every rank calls it): write model and meta (JSON-able) as a sharded checkpoint."""
    comm = getattr(model, "comm", None)
    rank = 0 if comm is None else comm.Get_rank()
    gen = f"gen-{time.time_ns():x}" if rank == 0 else None
    if rank == 0:
        os.makedirs(os.path.join(path, gen), exist_ok=False)
    if comm is not None:
        gen = comm.bcast(gen, root=0)
    entries = []
    for rel, name, region, a in _local_files(model, gen):
        entries.append((name, region, dict(_write_array(os.path.join(path, rel), a), file=rel)))
    fsync_dir(os.path.join(path, gen))
    parts = [entries] if comm is None else comm.gather(entries, root=0)
    if rank == 0:
        manifest = {"format": FORMAT, "version": VERSION, "ranks": 1 if comm is None else comm.Get_size(),
                    "arch": arch, "meta": meta, "arrays": _merge(parts, model.checkpoint_shapes())}
        with atomic_write(os.path.join(path, MANIFEST), "w") as f:
            json.dump(manifest, f)
        for old in os.listdir(path):          # earlier generations and leftovers of failed saves
            if old.startswith("gen-") and old != gen:
                shutil.rmtree(os.path.join(path, old), ignore_errors=True)
    if comm is not None:
        comm.Barrier()


def read_manifest(path: str) -> dict:
    """The manifest of a sharded checkpoint; ShardedCheckpointError if missing, foreign or incomplete."""
    try:
        with open(os.path.join(path, MANIFEST)) as f:
            manifest = json.load(f)
    except FileNotFoundError:
        raise ShardedCheckpointError(f"{path}: no {MANIFEST} (not a sharded checkpoint, or its first save "
                                     "did not finish)") from None
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise ShardedCheckpointError(f"{path}: corrupt {MANIFEST}") from None
    if manifest.get("format") != FORMAT or manifest.get("version") not in READABLE:
        raise ShardedCheckpointError(f"{path}: not a {FORMAT} v{'/v'.join(map(str, READABLE))} checkpoint")
    return manifest


def _pieces(entry: dict, shape: tuple) -> list:
    """A table's pieces; a version 1 entry (the whole table in one file) is one piece."""
    if "pieces" in entry:
        return entry["pieces"]
    return [dict(entry, rows=[0, shape[0]], cols=[0, shape[1]])]


def _open(path: str, entry: dict, shape: tuple, what: str) -> np.ndarray:
    """A memory map of one file, checked against its manifest entry (shape, dtype, checksum)."""
    try:
        a = np.load(os.path.join(path, entry["file"]), mmap_mode="r", allow_pickle=False)
    except Exception as err:     # NumPy's header parser raises whatever its tokenizer and literal_eval do
        raise ShardedCheckpointError(f"{path}: cannot read {entry['file']} ({type(err).__name__}: {err})") from None
    if a.shape != tuple(shape) or a.dtype != np.float32 or _crc(a) != entry["crc32"]:
        raise ShardedCheckpointError(f"{path}: {entry['file']} ({what}) is corrupt (shape, dtype or checksum mismatch)")
    return a


def _table_of(name: str):
    """The table whose rows array `name` is sharded with (a table, or its optimizer state), else None."""
    if name.startswith("state."):
        name = name[len("state."):]
    return int(name.split(".")[1]) if name.startswith("emb.") else None


def _piece_shape(rows, cols, ndim: int) -> tuple:
    """A piece's shape: (rows, cols), or (rows,) for per-row state (its cols are [0, 1])."""
    return (rows[1] - rows[0], cols[1] - cols[0])[:ndim]


def _needed(path: str, arrays: dict, shapes: dict, regions: dict) -> dict:
    """name -> [(piece entry, its rows, its cols)] of the files this rank reads."""
    out = {}
    for name, shape in shapes.items():
        t = _table_of(name)
        if t is None:
            out[name] = [(arrays[name], None, None)]
            continue
        region = regions.get(t)
        if region is None:
            continue
        width = shape[1] if len(shape) == 2 else 1
        pieces = _pieces(arrays[name], (shape[0], width))
        if sum((p["rows"][1] - p["rows"][0]) * (p["cols"][1] - p["cols"][0]) for p in pieces) != shape[0] * width:
            raise ShardedCheckpointError(f"{path}: the pieces of {name} do not cover it")
        r0, r1, c0, c1 = region if len(shape) == 2 else region[:2] + (0, 1)
        out[name] = [(p, p["rows"], p["cols"]) for p in pieces
                     if p["rows"][0] < r1 and p["rows"][1] > r0 and p["cols"][0] < c1 and p["cols"][1] > c0]
    return out


def _assemble(path: str, pieces: list, region: tuple, ndim: int) -> np.ndarray:
    """The fp32 block of `region` from the (already checked) pieces that cover it; ndim 1: of per-row
    state, rows r0..r1 only."""
    r0, r1, c0, c1 = region if ndim == 2 else region[:2] + (0, 1)
    block = np.empty((r1 - r0, c1 - c0), np.float32)
    for p, (a0, a1), (b0, b1) in pieces:
        a = np.load(os.path.join(path, p["file"]), mmap_mode="r", allow_pickle=False)
        a = a if ndim == 2 else a[:, None]
        lo, hi, cl, ch = max(a0, r0), min(a1, r1), max(b0, c0), min(b1, c1)
        block[lo - r0:hi - r0, cl - c0:ch - c0] = a[lo - a0:hi - a0, cl - b0:ch - b0]
    return block if ndim == 2 else block[:, 0]


def load_checkpoint(path: str, model, arch: dict) -> dict:
    """Load the regions this rank holds (every rank calls it; any rank count and sharding), with the
    optimizer state of the tables and dense parameters; -> meta. Every file it needs is checked
    before anything is loaded."""
    manifest = read_manifest(path)
    if manifest["arch"] != arch:
        diff = [k for k in arch if manifest["arch"].get(k) != arch[k]]
        raise ShardedCheckpointError(f"{path}: checkpoint is for another architecture (differs in {', '.join(diff)})")
    shapes = model.checkpoint_shapes()
    arrays = manifest["arrays"]
    if set(arrays) != set(shapes):
        raise ShardedCheckpointError(f"{path}: checkpoint arrays do not match the model's parameters")
    regions = model.table_regions()
    needed = _needed(path, arrays, shapes, regions)
    whole = {}
    for name, pieces in needed.items():          # first pass: every file checked, nothing loaded yet
        for p, rows, cols in pieces:
            shape = shapes[name] if rows is None else _piece_shape(rows, cols, len(shapes[name]))
            a = _open(path, p, shape, name)
            if rows is None:
                whole[name] = a
    for name, pieces in needed.items():
        t = _table_of(name)
        if t is None:
            continue
        block = _assemble(path, pieces, regions[t], len(shapes[name]))
        if name.startswith("state."):
            np.copyto(model.table_state(t), block)
        else:
            model.write_region(t, block)
    model.load_local({k: np.asarray(v) for k, v in whole.items()})
    return manifest["meta"]
