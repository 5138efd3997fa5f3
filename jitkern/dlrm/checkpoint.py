"""Single-file DLRM checkpoints: the format, atomic writes, full verification before loading.

A checkpoint file is

    magic (16 bytes) | every array, each padded to 64 bytes | JSON header | end record

The header holds the architecture, the caller's meta (training state) and, per array, its name,
dtype, shape, offset and crc32; the end record (marker, data bytes, header bytes, the header's
crc32) lets a reader find the header from the file's end and reject a truncated file. The magic
is written last, so a file cut short anywhere never reads as a checkpoint. A hybrid-parallel
model saves a directory of shards instead (dist_checkpoint.py); load_checkpoint reads either.
"""
from __future__ import annotations

import json
import math
import os
import struct
import zlib

import numpy as np

from .atomic import atomic_write
from .model import DLRM

_MAGIC = b"JITKERN-DLRM-CK2"           # 16 bytes: format name and version
_MAGIC_V1 = b"JITKERN-DLRM-CK1"        # read too: its end record has no header checksum
_END = b"JITKERN-DLRM-END"
_ALIGN = 64
_TAIL = {_MAGIC: "<QQI", _MAGIC_V1: "<QQ"}      # after _END: data bytes, header bytes[, header crc32]


class CheckpointError(ValueError):
    """A file that is not a complete jitkern DLRM checkpoint, or one for another architecture."""


def arch_dict(embedding_sizes, embedding_dim, bottom_mlp, top_mlp, interaction="dot", self_interaction=False,
              **extras) -> dict:
    """The architecture a checkpoint records (top_mlp without its derived input width); extras:
    model.arch_extras() (the optimizer and table tricks, where not plain SGD tables)."""
    return {"embedding_sizes": [int(r) for r in embedding_sizes], "embedding_dim": int(embedding_dim),
            "bottom_mlp": [int(n) for n in bottom_mlp], "top_mlp": [int(n) for n in top_mlp],
            "interaction": interaction, "self_interaction": bool(self_interaction), **extras}


def model_arch(model: DLRM) -> dict:
    return arch_dict(model.embedding_sizes, model.embedding_dim, model.bottom_mlp, model.top_mlp[1:],
                     model.interaction, model.self_interaction, **model.arch_extras())


def save_checkpoint(path: str, model: DLRM, meta: dict) -> None:
    """Write model parameters and `meta` (JSON-able) atomically: temp file, fsync, rename."""
    if getattr(model, "comm", None) is not None:     # hybrid parallel: a directory, each rank its tables
        from .dist_checkpoint import save_checkpoint as save_sharded
        return save_sharded(path, model, meta, model_arch(model))
    sd = model.checkpoint_arrays()
    entries, offset = [], 0
    for name, a in sd.items():
        entries.append({"name": name, "dtype": str(a.dtype), "shape": list(a.shape), "offset": offset,
                        "nbytes": a.nbytes})
        offset += -(-a.nbytes // _ALIGN) * _ALIGN
    header = {"arch": model_arch(model), "meta": meta, "arrays": entries, "data_bytes": offset}
    with atomic_write(path) as f:
        crcs = []
        # header is written twice: a placeholder now, the one with checksums at the end
        f.write(b"\0" * 16)
        for a in sd.values():
            mv = memoryview(np.ascontiguousarray(a)).cast("B")
            crcs.append(zlib.crc32(mv))
            f.write(mv)
            f.write(b"\0" * (-(-a.nbytes // _ALIGN) * _ALIGN - a.nbytes))
        for e, c in zip(entries, crcs):
            e["crc32"] = c
        blob = json.dumps(header).encode()
        f.write(blob)
        f.write(_END + struct.pack(_TAIL[_MAGIC], offset, len(blob), zlib.crc32(blob)))
        f.seek(0)
        f.write(_MAGIC)


def _read_header_blob(path: str, f, size: int) -> bytes:
    """The header's JSON bytes, after checking magic, end record, sizes and (v2) its checksum."""
    magic = f.read(16)
    if magic not in _TAIL:
        raise CheckpointError(f"{path}: not a jitkern DLRM checkpoint (bad magic)")
    tail = len(_END) + struct.calcsize(_TAIL[magic])
    if size < 16 + tail:
        raise CheckpointError(f"{path}: truncated checkpoint ({size} bytes)")
    f.seek(size - tail)
    end = f.read(tail)
    if end[:len(_END)] != _END:
        raise CheckpointError(f"{path}: truncated or corrupt checkpoint (no end marker)")
    data_bytes, hlen, *crc = struct.unpack(_TAIL[magic], end[len(_END):])
    if 16 + data_bytes + hlen + tail != size:
        raise CheckpointError(f"{path}: truncated or corrupt checkpoint (size {size} does not match)")
    f.seek(16 + data_bytes)
    blob = f.read(hlen)
    if crc and zlib.crc32(blob) != crc[0]:
        raise CheckpointError(f"{path}: checksum mismatch in the header (corrupt checkpoint)")
    return blob


def _check_header(path: str, header) -> dict:
    """The parsed header if it has the structure save_checkpoint writes, else CheckpointError."""
    try:
        ok = isinstance(header["arch"], dict) and isinstance(header["meta"], dict)
        for e in header["arrays"]:
            ok = ok and isinstance(e["name"], str) and isinstance(e["dtype"], str) and \
                all(isinstance(v, int) and v >= 0 for v in [e["offset"], e["nbytes"], e["crc32"], *e["shape"]]) \
                and e["offset"] + e["nbytes"] <= header["data_bytes"]
    except (KeyError, TypeError):
        ok = False
    if not ok:
        raise CheckpointError(f"{path}: corrupt checkpoint header")
    return header


def is_checkpoint_file(path) -> bool:
    """Whether `path` is a file that starts as a jitkern DLRM checkpoint does (any version)."""
    try:
        with open(path, "rb") as f:
            return f.read(16) in _TAIL
    except OSError:
        return False


def read_checkpoint_header(path: str) -> dict:
    """The checkpoint's header (arch, meta, array table); CheckpointError if foreign or truncated."""
    if os.path.isdir(path):                          # a sharded checkpoint (saved by several ranks)
        from .dist_checkpoint import read_manifest
        return read_manifest(path)
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            header = json.loads(_read_header_blob(path, f, size))
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no such checkpoint") from None
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        raise CheckpointError(f"{path}: corrupt checkpoint header") from None
    return _check_header(path, header)


def load_checkpoint(path: str, model: DLRM) -> dict:
    """Verify the checkpoint fully (arch, shapes, checksums), then load it into `model`; returns meta."""
    if os.path.isdir(path):                          # sharded: any rank count loads its own arrays
        from .dist_checkpoint import load_checkpoint as load_sharded
        return load_sharded(path, model, model_arch(model))
    header = read_checkpoint_header(path)
    arch = model_arch(model)
    if header["arch"] != arch:
        diff = [k for k in {**header["arch"], **arch} if header["arch"].get(k) != arch.get(k)]
        raise CheckpointError(f"{path}: checkpoint is for another architecture (differs in {', '.join(diff)})")
    shapes = model.checkpoint_shapes()
    entries = {e["name"]: e for e in header["arrays"]}
    if set(entries) != set(shapes):
        raise CheckpointError(f"{path}: checkpoint arrays do not match the model's parameters")
    for name, e in entries.items():
        if tuple(e["shape"]) != shapes[name] or e["dtype"] != "float32" or e["nbytes"] != 4 * math.prod(shapes[name]):
            raise CheckpointError(f"{path}: {name} is {e['dtype']} {e['shape']}, expected float32 {shapes[name]}")
    with open(path, "rb") as f:
        for name, e in entries.items():             # first pass: checksums, before touching the model
            f.seek(16 + e["offset"])
            crc, left = 0, e["nbytes"]
            while left:
                chunk = f.read(min(left, 1 << 24))
                crc = zlib.crc32(chunk, crc)
                left = left - len(chunk) if chunk else 0    # a short file ends the loop; the checksum differs
            if crc != e["crc32"]:
                raise CheckpointError(f"{path}: checksum mismatch in {name} (corrupt checkpoint)")
        sd = model.checkpoint_arrays()               # live arrays: read straight into the parameters
        for name, e in entries.items():
            f.seek(16 + e["offset"])
            f.readinto(memoryview(sd[name]).cast("B"))
    if model.embedding_precision != "fp32" or model.precision != "fp32" or getattr(model, "comm", None) is not None:
        model.load_state_dict(sd)                    # re-split the arrays read as fp32; take each rank's pieces
    return header["meta"]
