"""Sharded checkpoints of the hybrid-parallel DLRM: each rank writes its own tables, with a manifest.

A checkpoint is a directory:

    PATH/manifest.json          format, arch, meta, and per array: file, shape, crc32
    PATH/gen-<id>/emb.<t>.npy   one file per table, written by the rank that owns it
    PATH/gen-<id>/<name>.npy    MLP arrays and replicated tables, written by rank 0

Every file is written to a temporary name, fsynced and renamed; rank 0 writes the manifest last,
after every rank has reported its files, and only then deletes older generations. A save
interrupted anywhere (a failing or killed rank) leaves the manifest pointing at the previous,
complete generation, or no manifest at all: never a checkpoint that looks valid and is not.
Loading reads the manifest and takes only the arrays this rank holds, so the rank count may
differ from the one that saved (1 included: a plain DLRM loads it too).
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
VERSION = 1
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


def _local_arrays(model) -> dict:
    """name -> array this rank writes: its tables; on rank 0 also the MLPs and replicated tables."""
    comm = getattr(model, "comm", None)
    rank = 0 if comm is None else comm.Get_rank()
    owner = getattr(getattr(model, "placement", None), "owner", None)
    out = {}
    for t, w in enumerate(model.emb):
        if w is None:
            continue
        mine = owner is None or owner[t] == rank or (owner[t] < 0 and rank == 0)
        if mine:
            out[f"emb.{t}.weight"] = w if isinstance(w, np.ndarray) else w.to_float32()
    if rank == 0:
        out.update(model.mlp_state_dict())
    return out


def save_checkpoint(path: str, model, meta: dict, arch: dict) -> None:
    """Collective (every rank calls it): write model and meta (JSON-able) as a sharded checkpoint."""
    comm = getattr(model, "comm", None)
    rank = 0 if comm is None else comm.Get_rank()
    gen = f"gen-{time.time_ns():x}" if rank == 0 else None
    if rank == 0:
        os.makedirs(os.path.join(path, gen), exist_ok=False)
    if comm is not None:
        gen = comm.bcast(gen, root=0)
    entries = {}
    for name, a in _local_arrays(model).items():
        rel = os.path.join(gen, f"{name}.npy")
        entries[name] = dict(_write_array(os.path.join(path, rel), a), file=rel)
    fsync_dir(os.path.join(path, gen))
    parts = [entries] if comm is None else comm.gather(entries, root=0)
    if rank == 0:
        arrays = {k: v for part in parts for k, v in part.items()}
        manifest = {"format": FORMAT, "version": VERSION, "ranks": 1 if comm is None else comm.Get_size(),
                    "arch": arch, "meta": meta, "arrays": arrays}
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
    if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise ShardedCheckpointError(f"{path}: not a {FORMAT} v{VERSION} checkpoint")
    return manifest


def load_checkpoint(path: str, model, arch: dict) -> dict:
    """Load the arrays this rank holds (every rank calls it; any rank count); returns meta."""
    manifest = read_manifest(path)
    if manifest["arch"] != arch:
        diff = [k for k in arch if manifest["arch"].get(k) != arch[k]]
        raise ShardedCheckpointError(f"{path}: checkpoint is for another architecture (differs in {', '.join(diff)})")
    shapes = model.state_shapes()
    arrays = manifest["arrays"]
    if set(arrays) != set(shapes):
        raise ShardedCheckpointError(f"{path}: checkpoint arrays do not match the model's parameters")
    wanted = {name for name in shapes if not name.startswith("emb.") or model.emb[int(name.split(".")[1])] is not None}
    loaded = {}
    for name in sorted(wanted):
        e = arrays[name]
        try:
            a = np.load(os.path.join(path, e["file"]), mmap_mode="r", allow_pickle=False)
        except Exception as err:     # NumPy's header parser raises whatever its tokenizer and literal_eval do
            raise ShardedCheckpointError(f"{path}: cannot read {e['file']} ({type(err).__name__}: {err})") from None
        if a.shape != shapes[name] or a.dtype != np.float32 or _crc(a) != e["crc32"]:
            raise ShardedCheckpointError(f"{path}: {e['file']} is corrupt (shape, dtype or checksum mismatch)")
        loaded[name] = a
    model.load_local({k: np.asarray(v) for k, v in loaded.items()})
    return manifest["meta"]
