"""Criteo raw text logs -> NumPy arrays, chunk by chunk, with a byte-level numba parser.

A raw line is 40 tab-separated fields: label (0/1), I1..I13 integers (may be negative or
empty), C1..C26 categoricals of up to 8 hex digits (may be empty). Files may be gzip'ed
(detected by magic bytes, not by name). Lines end in LF or CRLF; the last may lack one.
"""
from __future__ import annotations

import gzip
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ...codegen.build import jit

N_DENSE = 13
N_SPARSE = 26
N_FIELDS = 1 + N_DENSE + N_SPARSE
FIELD_NAMES = ("label",) + tuple(f"I{i}" for i in range(1, N_DENSE + 1)) + \
    tuple(f"C{i}" for i in range(1, N_SPARSE + 1))

# error codes written by the kernel, per line
OK, BAD_CHAR, BAD_LABEL, TOO_MANY_FIELDS, TOO_FEW_FIELDS, TOO_LONG = range(6)
_REASONS = {
    BAD_CHAR: "unexpected character {char!r} (dense fields are integers, categoricals hex)",
    BAD_LABEL: "label must be 0 or 1",
    TOO_MANY_FIELDS: f"more than {N_FIELDS} tab-separated fields",
    TOO_FEW_FIELDS: f"expected {N_FIELDS} tab-separated fields, found {{nfields}}",
    TOO_LONG: "value too long (dense: at most 18 digits, categorical: at most 8 hex digits)",
}
DEFAULT_CHUNK_BYTES = 16 << 20
MAX_LINE_BYTES = 64 << 20      # a longer "line" means the input is not a Criteo text file


_HEX_VALUE = np.full(256, -1, np.int64)     # byte -> hex digit value, -1 if not a hex digit
for _i, _c in enumerate(b"0123456789abcdef"):
    _HEX_VALUE[_c] = _HEX_VALUE[ord(chr(_c).upper())] = _i


class RawDataError(ValueError):
    """A malformed raw line: names the file, the 1-based line number and the field."""


@jit(inline="always")
def _parse_line(buf, pos, r, labels, dense, cats):
    """Parse the line at pos into row r; -> (position where it stopped: its end or the bad byte,
    error code, field reached, empty mask (bit j set when C(j+1) is empty))."""
    n = buf.shape[0]
    f, acc, digits, neg = 0, 0, 0, False        # the current field, its value so far
    mask = np.uint32(0)
    code = OK
    while True:
        c = buf[pos] if pos < n else 10
        end = c == 10 or (c == 13 and (pos + 1 >= n or buf[pos + 1] == 10))
        if c == 9 or end:
            if end and f != N_FIELDS - 1:
                code = TOO_FEW_FIELDS
                break
            if f == 0:
                if digits != 1 or acc > 1:
                    code = BAD_LABEL
                    break
                labels[r] = acc
            elif f <= 13:
                dense[r, f - 1] = 0.0 if (neg or digits == 0) else np.float32(acc)
                if neg and digits == 0:
                    code = BAD_CHAR
                    break
            else:
                cats[r, f - 14] = acc
                if digits == 0:
                    mask |= np.uint32(1) << np.uint32(f - 14)
            if end:
                break
            f += 1
            if f >= N_FIELDS:
                code = TOO_MANY_FIELDS
                break
            acc, digits, neg = 0, 0, False
        elif f <= 13:                      # label and dense fields: decimal
            if c >= 48 and c <= 57:
                acc = acc * 10 + (c - 48)
                digits += 1
                if digits > 18:
                    code = TOO_LONG
                    break
            elif c == 45 and digits == 0 and not neg and f > 0:
                neg = True
            else:
                code = BAD_CHAR
                break
        else:                              # categoricals: hex
            h = _HEX_VALUE[c]
            if h < 0:
                code = BAD_CHAR
                break
            acc = acc * 16 + h
            digits += 1
            if digits > 8:
                code = TOO_LONG
                break
        pos += 1
    return pos, code, f, mask


@jit()
def _parse_lines(buf, labels, dense, cats, empty, err, err_field, err_pos):
    # buf: (n,) uint8, whole lines; labels: (R,) f32; dense: (R, 13) f32 (max(x, 0), untransformed);
    # cats: (R, 26) u32; empty: (R,) u32 bit j set when C(j+1) is empty; err/err_field/err_pos: (R,)
    # One pass over the bytes; a bad line is flagged and skipped to its newline. Returns #lines.
    n = buf.shape[0]
    pos = 0
    r = 0
    while pos < n:
        pos, code, f, mask = _parse_line(buf, pos, r, labels, dense, cats)
        err[r] = code
        err_field[r] = f
        err_pos[r] = pos
        empty[r] = mask
        while pos < n and buf[pos] != 10:      # to the end of this line (bad lines stop early)
            pos += 1
        pos += 1
        r += 1
    return r


@dataclass
class Chunk:
    """Parsed rows of one chunk of a raw file (good rows only)."""
    labels: np.ndarray     # (R,) float32
    dense: np.ndarray      # (R, 13) float32, log(max(x, 0) + 1)
    cats: np.ndarray       # (R, 26) uint32 raw hash values (0 where empty)
    empty: np.ndarray      # (R,) uint32, bit j set when categorical j is empty
    n_lines: int           # lines read, bad ones included
    n_bad: int             # lines skipped as malformed


def transform_dense(x: np.ndarray) -> np.ndarray:
    """The reference's dense transform, in place on float32 x >= 0: log(x + 1) in float32."""
    x += np.float32(1)
    return np.log(x, out=x)


def parse_chunk(buf: np.ndarray, *, path="<buffer>", first_line: int = 1,
                skip_bad_lines: bool = False) -> Chunk:
    """Parse whole lines in buf ((n,) uint8); raise RawDataError on the first bad line unless skipping."""
    if buf.dtype != np.uint8 or buf.ndim != 1:
        raise TypeError(f"buf must be a 1-d uint8 array, got {buf.dtype} with shape {buf.shape}")
    cap = int(np.count_nonzero(buf == 10)) + 1
    labels = np.empty(cap, np.float32)
    dense = np.empty((cap, N_DENSE), np.float32)
    cats = np.empty((cap, N_SPARSE), np.uint32)
    empty = np.empty(cap, np.uint32)
    err = np.empty(cap, np.int8)
    err_field = np.empty(cap, np.int8)
    err_pos = np.empty(cap, np.int64)
    n = _parse_lines(buf, labels, dense, cats, empty, err, err_field, err_pos) if buf.size else 0
    bad = np.flatnonzero(err[:n])
    if bad.size and not skip_bad_lines:
        i = int(bad[0])
        raise RawDataError(_describe(buf, path, first_line + i, int(err[i]), int(err_field[i]),
                                     int(err_pos[i])))
    keep = slice(0, n)
    if bad.size:
        keep = np.flatnonzero(err[:n] == OK)
    out = Chunk(labels[keep], dense[keep], cats[keep], empty[keep], n, int(bad.size))
    transform_dense(out.dense)
    return out


def _describe(buf, path, line_no, code, field, pos) -> str:
    char = chr(buf[pos]) if pos < buf.size else "<end>"
    reason = _REASONS[code].format(char=char, nfields=field + 1)
    where = f"field {field + 1} ({FIELD_NAMES[field]})" if code in (BAD_CHAR, BAD_LABEL, TOO_LONG) else "line"
    return f"{path}: line {line_no}: {where}: {reason}"


def open_raw(path):
    """Open a raw log for binary reading; gzip is detected from the magic bytes."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"raw file not found: {path}")
    f = open(path, "rb")
    magic = f.read(2)
    f.seek(0)
    return gzip.GzipFile(fileobj=f, mode="rb") if magic == b"\x1f\x8b" else f


def iter_chunks(path, chunk_bytes: int = DEFAULT_CHUNK_BYTES):
    """Yield (buf (n,) uint8 of whole lines, first line number, compressed bytes read so far)."""
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
    line = 1
    carry = b""
    with open_raw(path) as f:
        disk = getattr(f, "fileobj", f)
        try:
            while True:
                block = f.read(chunk_bytes)
                data = carry + block if carry else block
                if not block:
                    if data:
                        yield np.frombuffer(data, np.uint8), line, disk.tell()
                    return
                cut = data.rfind(b"\n") + 1
                if cut == 0:             # a line longer than one chunk: keep reading
                    if len(data) > MAX_LINE_BYTES:
                        raise RawDataError(f"{path}: line {line}: no newline in {len(data):,} bytes "
                                           "(not a Criteo text log?)")
                    carry = data
                    continue
                carry = data[cut:]
                buf = np.frombuffer(data, np.uint8, count=cut)
                yield buf, line, disk.tell()
                line += int(np.count_nonzero(buf == 10))
        except (EOFError, gzip.BadGzipFile, zlib.error) as e:
            raise RawDataError(f"{path}: corrupt or truncated gzip stream: {e}") from None


def read_raw(path, *, skip_bad_lines: bool = False, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Chunk:
    """A whole (small) raw file parsed into one Chunk; for tests and inspection, not for big files."""
    parts = [parse_chunk(b, path=path, first_line=l, skip_bad_lines=skip_bad_lines)
             for b, l, _ in iter_chunks(path, chunk_bytes)]
    if not parts:
        return parse_chunk(np.zeros(0, np.uint8), path=path)
    return Chunk(np.concatenate([p.labels for p in parts]), np.concatenate([p.dense for p in parts]),
                 np.concatenate([p.cats for p in parts]), np.concatenate([p.empty for p in parts]),
                 sum(p.n_lines for p in parts), sum(p.n_bad for p in parts))
