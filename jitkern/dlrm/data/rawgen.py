"""Synthetic raw Criteo logs (same text layout as Kaggle's train.txt) for tests and benchmarks.

Vectorised: each block of rows is rendered into a fixed-width byte matrix (one slot per
field, unused bytes 0) and the zero bytes are dropped, so a million lines take ~1-2 s.
Dense values are log-normal counts (some empty, a few negative); categoricals are Zipf draws
over Kaggle-sized vocabularies, scrambled into 8-hex-digit hashes, some empty.
"""
from __future__ import annotations

import gzip as _gzip
from pathlib import Path

import numpy as np

from ..configs import KAGGLE_TABLES as KAGGLE_CARDINALITIES  # reference DLRM, no --max-ind-range
from .raw import N_DENSE, N_SPARSE

_HEX = np.frombuffer(b"0123456789abcdef", np.uint8)
_DIGITS = 7              # dense slot: '-' + up to 6 digits


def _render_dense(v, empty):
    """(R,) int64 values -> (R, 7) bytes, right-aligned, 0-padded with NUL (dropped later)."""
    r = len(v)
    out = np.zeros((r, _DIGITS), np.uint8)
    a = np.abs(v)
    nd = np.maximum(1, np.floor(np.log10(np.maximum(a, 1))).astype(int) + 1)
    for k in range(_DIGITS - 1):
        digit = (a // 10 ** k) % 10
        out[:, _DIGITS - 1 - k] = np.where(k < nd, 48 + digit, 0)
    neg = np.flatnonzero(v < 0)
    out[neg, _DIGITS - 1 - nd[neg]] = 45
    out[empty] = 0
    return out


def _render_hex(h, empty):
    """(R,) uint32 hashes -> (R, 8) lowercase hex bytes (all NUL where empty)."""
    shifts = np.arange(28, -1, -4, dtype=np.uint32)
    out = _HEX[(h[:, None] >> shifts) & np.uint32(15)]
    out[empty] = 0
    return out


def raw_block(rng, n: int, cardinalities=KAGGLE_CARDINALITIES) -> bytes:
    """n synthetic raw lines (each ending in a newline) as bytes."""
    cols = [np.where(rng.random(n) < 0.26, 49, 48).astype(np.uint8)[:, None]]
    for j in range(N_DENSE):
        v = np.floor(np.exp(rng.normal(1.5 + 0.3 * j, 1.6, n))).astype(np.int64).clip(max=999_999)
        if j == 1:
            v[rng.random(n) < 0.05] = -1
        cols += [np.full((n, 1), 9, np.uint8), _render_dense(v, rng.random(n) < 0.05 + 0.03 * j)]
    for j in range(N_SPARSE):
        card = cardinalities[j]
        idx = (rng.zipf(1.15, n) - 1) % card
        h = ((idx.astype(np.uint64) * np.uint64(2654435761) + np.uint64(0x9E3779B9 * (j + 1))) %
             np.uint64(2**32)).astype(np.uint32)
        cols += [np.full((n, 1), 9, np.uint8), _render_hex(h, rng.random(n) < 0.02 * (j % 5))]
    cols.append(np.full((n, 1), 10, np.uint8))
    m = np.concatenate(cols, axis=1)
    return m[m != 0].tobytes()


def write_raw(path, n_rows: int, *, seed: int = 0, gzip: bool = False, block: int = 100_000) -> Path:
    """Write n_rows synthetic raw lines to path (gzip'ed when gzip=True); returns the path."""
    rng = np.random.default_rng(seed)
    path = Path(path)
    opener = _gzip.open if gzip else open
    with opener(path, "wb") as f:
        for a in range(0, n_rows, block):
            f.write(raw_block(rng, min(block, n_rows - a)))
    return path
