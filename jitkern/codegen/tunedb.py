"""The tuning DB: tuned knob choices on disk, per target and library versions.

Layout (JSON at get_config().tune_db): {"format": 2, "targets": {db_key: {knob: {shape_class:
params}}}}, db_key = the target's key (CPU name, feature hash, forced ISA, stand-in caches) +
jitkern + numba versions, so entries measured on another CPU or with other versions are never
used. A corrupt file is ignored with a warning; writes go through a temporary file and
os.replace, so readers never see half a file. A DB of an older format is ignored.
"""
from __future__ import annotations

import functools
import json
import os
import tempfile
import warnings
from pathlib import Path

from ..config import get_config
from .target import host_target

FORMAT = 2
_GENERATION = [0]  # bumped by every store in this process: memoised choices are keyed by it


def db_key() -> str:
    """Identity of tuning entries: target key, jitkern and numba versions."""
    import numba

    from .. import __version__
    return f"{host_target().key}|jitkern-{__version__}|numba-{numba.__version__}"


def generation() -> int:
    return _GENERATION[0]


def _empty() -> dict:
    return {"format": FORMAT, "targets": {}}


@functools.lru_cache(maxsize=8)
def _load(path: str, mtime_ns: int) -> dict:
    try:
        with open(path) as f:
            db = json.load(f)
        if not isinstance(db, dict) or not isinstance(db.get("targets"), dict):
            raise ValueError("unexpected layout")
        return db if db.get("format") == FORMAT else _empty()
    except (OSError, ValueError) as e:
        warnings.warn(f"jitkern: ignoring unreadable tuning DB {path}: {e}", RuntimeWarning, stacklevel=4)
        return _empty()


def _db() -> dict:
    path = get_config().tune_db
    try:
        mtime = path.stat().st_mtime_ns
    except OSError:
        return _empty()
    return _load(str(path), mtime)


def entries() -> dict:
    """{knob: {shape_class: params}} tuned for this target and these library versions."""
    found = _db()["targets"].get(db_key(), {})
    return found if isinstance(found, dict) else {}


def lookup(knob: str, shape_cls: str) -> dict | None:
    """Tuned params for (knob, shape class), or None (no entry, tuning disabled, or stale DB)."""
    if not get_config().use_tuning:
        return None
    got = entries().get(knob, {}).get(shape_cls)
    return dict(got) if isinstance(got, dict) else None


def store(knob: str, shape_cls: str, params: dict) -> None:
    """Record tuned params for (knob, shape class) under this target's key, atomically."""
    store_many([(knob, shape_cls, params)])


def store_many(items) -> None:
    """Record several (knob, shape_cls, params) at once: one read and one atomic write."""
    path = get_config().tune_db
    path.parent.mkdir(parents=True, exist_ok=True)
    db = json.loads(json.dumps(_db()))  # a deep copy we may modify
    db["format"] = FORMAT
    mine = db["targets"].setdefault(db_key(), {})
    for knob, shape_cls, params in items:
        mine.setdefault(knob, {})[shape_cls] = dict(params)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tune-", suffix=".json")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(db, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _GENERATION[0] += 1
