"""Fuzzing the readers of untrusted bytes: the raw Criteo parser, the preprocessed dataset readers
and the checkpoint readers. Malformed lines, truncated and bit-flipped files must give a clear
error or a correct result: never a crash, a hang or a silently wrong row.

Budget: the hypothesis profile's (tests/conftest.py; JITKERN_HYPOTHESIS_PROFILE=thorough for 10x).
"""
import gzip
import re
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jitkern.dlrm.data import LayoutError, RawDataError, load_preprocessed, parse_chunk, read_raw, write_preprocessed
from jitkern.dlrm.data.layout import HEADER_BYTES
from jitkern.dlrm.dist_checkpoint import ShardedCheckpointError
from jitkern.dlrm.dist_checkpoint import save_checkpoint as save_sharded
from jitkern.dlrm.model import DLRM
from jitkern.dlrm.synth import SyntheticData
from jitkern.dlrm.checkpoint import CheckpointError, load_checkpoint, model_arch, save_checkpoint

CHEAP = settings(max_examples=4 * settings.default.max_examples)     # a few ms an example: 4x the profile's
ARCH = dict(embedding_sizes=[10, 20, 40, 80], embedding_dim=16, bottom_mlp=[13, 32, 16], top_mlp=[16, 1])


# --------------------------------------------------------------------------- raw lines


def ref_line(line: bytes):
    """The documented grammar in plain Python: (label, 13 dense ints, 26 cats, 26 empty flags) of
    one line (without its newline), or None where the parser must reject it."""
    if line.endswith(b"\r"):
        line = line[:-1]
    f = line.split(b"\t")
    if len(f) != 40 or f[0] not in (b"0", b"1"):
        return None
    dense = []
    for x in f[1:14]:
        m = re.fullmatch(rb"(-?)([0-9]{1,18})", x)
        if x and m is None:
            return None
        dense.append(0 if not x or m.group(1) else int(m.group(2)))
    if not all(x == b"" or re.fullmatch(rb"[0-9a-fA-F]{1,8}", x) for x in f[14:]):
        return None
    return int(f[0]), dense, [int(x, 16) if x else 0 for x in f[14:]], [x == b"" for x in f[14:]]


def ref_parse(buf: bytes):
    """[(1-based line number, parsed or None)] of a whole buffer."""
    lines = buf.split(b"\n")
    if lines[-1] == b"":
        lines.pop()
    return [(i + 1, ref_line(line)) for i, line in enumerate(lines)]


def expected_rows(parsed):
    good = [p for _, p in parsed if p is not None]
    dense = np.array([p[1] for p in good], np.int64).reshape(-1, 13).astype(np.float32)
    return (np.array([p[0] for p in good], np.float32), np.log(dense + np.float32(1)),
            np.array([p[2] for p in good], np.uint32).reshape(-1, 26),
            np.array([p[3] for p in good], bool).reshape(-1, 26))


def assert_rows(chunk, parsed):
    labels, dense, cats, empty = expected_rows(parsed)
    np.testing.assert_array_equal(chunk.labels, labels)
    np.testing.assert_array_equal(chunk.dense, dense)
    np.testing.assert_array_equal(chunk.cats, cats)
    np.testing.assert_array_equal((chunk.empty[:, None] >> np.arange(26, dtype=np.uint32)) & 1, empty)
    assert chunk.n_lines == len(parsed) and chunk.n_bad == sum(p is None for _, p in parsed)


_digits = st.text("0123456789", min_size=1, max_size=19)
_dense = st.one_of(st.just(""), _digits, _digits.map(lambda d: "-" + d), st.just("-"))
_hex = st.one_of(st.just(""), st.text("0123456789abcdefABCDEF", min_size=1, max_size=9))
_good = st.builds(lambda l, d, c: "\t".join([l, *d, *c]).encode(), st.sampled_from("01"),
                  st.lists(_dense, min_size=13, max_size=13), st.lists(_hex, min_size=26, max_size=26))
_byte = st.one_of(st.sampled_from(list(b"\t\r\n-x \x00\xff9Fg")), st.integers(0, 255))


@st.composite
def raw_line(draw):
    """A line as written, then perhaps damaged: a byte replaced, inserted or deleted, a field
    dropped or added."""
    line = draw(_good)
    kind = draw(st.sampled_from(["keep", "keep", "replace", "insert", "delete", "drop field", "add field"]))
    i = draw(st.integers(0, len(line)))
    if kind == "replace" and i < len(line):
        line = line[:i] + bytes([draw(_byte)]) + line[i + 1:]
    elif kind == "insert":
        line = line[:i] + bytes([draw(_byte)]) + line[i:]
    elif kind == "delete":
        line = line[:i] + line[i + 1:]
    elif kind in ("drop field", "add field"):
        f = line.split(b"\t")
        j = draw(st.integers(0, len(f) - 1))
        f = f[:j] + f[j + 1:] if kind == "drop field" else f[:j] + [draw(_hex).encode()] + f[j:]
        line = b"\t".join(f)
    return line


@st.composite
def raw_text(draw):
    lines = draw(st.lists(raw_line(), min_size=0, max_size=8))
    eol = draw(st.sampled_from([b"\n", b"\r\n"]))
    return eol.join(lines) + (eol if lines and draw(st.booleans()) else b"")


@given(raw_text(), st.integers(1, 300))
def test_raw_parser_rejects_or_parses_exactly(buf, chunk_bytes):
    parsed = ref_parse(buf)
    whole = np.frombuffer(buf, np.uint8)
    assert_rows(parse_chunk(whole, skip_bad_lines=True), parsed)
    bad = [n for n, p in parsed if p is None]
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "raw.txt"
        path.write_bytes(buf)
        if bad:
            with pytest.raises(RawDataError, match=rf"raw.txt: line {bad[0]}: "):
                read_raw(path, chunk_bytes=chunk_bytes)
        else:
            assert_rows(read_raw(path, chunk_bytes=chunk_bytes), parsed)
        assert_rows(read_raw(path, chunk_bytes=chunk_bytes, skip_bad_lines=True), parsed)


@pytest.fixture(scope="module")
def sample_gz():
    text = (Path(__file__).parent / "data" / "criteo_kaggle_sample.txt").read_bytes()[:6000]
    text = text[:text.rfind(b"\n") + 1]
    return gzip.compress(text, mtime=0), parse_chunk(np.frombuffer(text, np.uint8))


@CHEAP
@given(st.data())
def test_truncated_or_bit_flipped_gzip_is_an_error_or_the_same_rows(sample_gz, data):
    blob, rows = sample_gz
    blob = _damage(data, blob)
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "raw.gz"
        path.write_bytes(blob)
        try:
            got = read_raw(path, chunk_bytes=data.draw(st.integers(64, 4096)))
        except RawDataError as e:
            assert "raw.gz" in str(e)
            return
    if not blob:                                      # truncated to nothing: an empty file, no rows
        assert got.n_lines == 0
        return
    for a in ("labels", "dense", "cats", "empty"):
        np.testing.assert_array_equal(getattr(got, a), getattr(rows, a))


# --------------------------------------------------------------------------- damage


def _damage(data, blob: bytes, lo: int = 0) -> bytes:
    """blob truncated, or with 1-3 bits flipped at or after byte `lo`."""
    if data.draw(st.booleans(), label="truncate"):
        return blob[:data.draw(st.integers(0, len(blob) - 1), label="length")]
    out = bytearray(blob)
    for _ in range(data.draw(st.integers(1, 3), label="flips")):
        out[data.draw(st.integers(lo, len(out) - 1), label="byte")] ^= 1 << data.draw(st.integers(0, 7), label="bit")
    return bytes(out)


def _copy_damaged(data, src: Path, dst: Path, names) -> tuple:
    """Copy a directory, damaging one of `names`; -> (name, original bytes, damaged bytes)."""
    shutil.copytree(src, dst)
    name = data.draw(st.sampled_from(sorted(names)), label="file")
    blob = (dst / name).read_bytes()
    bad = _damage(data, blob)
    (dst / name).write_bytes(bad)
    return name, blob, bad


# --------------------------------------------------------------------------- datasets


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    rng = np.random.default_rng(1)
    dense = np.log1p(rng.integers(0, 500, (60, 13))).astype(np.float32)
    sparse = rng.integers(0, 9, (60, 26)).astype(np.int32)
    labels = rng.integers(0, 2, 60).astype(np.float32)
    d = write_preprocessed(tmp_path_factory.mktemp("ds") / "d", dense, sparse, labels, [9] * 26, [40, 20])
    return d, {"dense": dense, "sparse": sparse, "labels": labels}


def _read_all(d):
    out = {}
    for split in ("train", "test", "val"):
        ds = load_preprocessed(d, split)
        out[split] = {"dense": ds.dense[:], "sparse": ds.sparse[:], "labels": ds.labels[:]}
    return out


def _payload_flip(blob: bytes, bad: bytes, data_offset: int) -> bool:
    """Bits flipped only in an .npy file's data (its header intact)."""
    return len(bad) == len(blob) and bad[:data_offset] == blob[:data_offset]


@given(st.data())
def test_damaged_dataset_is_an_error_or_reads_what_is_stored(dataset, data):
    src, arrays = dataset
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp) / "d"
        name, blob, bad = _copy_damaged(data, src, d, ["dense.npy", "sparse.npy", "labels.npy", "meta.json", "COMPLETE"])
        try:
            got = _read_all(d)
        except LayoutError as e:
            assert str(d) in str(e)
            return
    expect = dict(arrays)                             # any other damage read without an error: nothing differs
    if name.endswith(".npy") and _payload_flip(blob, bad, HEADER_BYTES):
        key = name[:-4]                               # values flipped in place: those values, nothing shifted
        expect[key] = np.frombuffer(bad[HEADER_BYTES:], arrays[key].dtype).reshape(arrays[key].shape)
    for split, (a, b) in {"train": (0, 40), "test": (40, 50), "val": (50, 60)}.items():
        for k, v in expect.items():
            np.testing.assert_array_equal(got[split][k], v[a:b], err_msg=f"{name} {split} {k}")


def _write_torchrec(d: Path, rng):
    for day, n in enumerate((30, 20)):
        np.save(d / f"day_{day}_dense.npy", np.log1p(rng.integers(0, 500, (n, 13))).astype(np.float32))
        np.save(d / f"day_{day}_sparse.npy", rng.integers(0, 9, (n, 26)).astype(np.int32))
        np.save(d / f"day_{day}_labels.npy", rng.integers(0, 2, (n, 1)).astype(np.int32))


@pytest.fixture(scope="module")
def torchrec(tmp_path_factory):
    d = tmp_path_factory.mktemp("tr")
    _write_torchrec(d, np.random.default_rng(2))
    return d, _read_all(d)


@given(st.data())
def test_damaged_torchrec_files_are_an_error_or_read_what_is_stored(torchrec, data):
    src, original = torchrec
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp) / "d"
        name, blob, bad = _copy_damaged(data, src, d, [p.name for p in src.iterdir()])
        try:
            got = _read_all(d)
        except LayoutError as e:
            assert str(d) in str(e)
            return
    kind = name.split("_")[2][:-4]                    # day_<d>_<kind>.npy
    offset = len(blob) - np.load(src / name).nbytes   # where its data starts
    for split in got:                                 # only a payload flip may change values, of its array only
        for k in got[split]:
            assert got[split][k].shape == original[split][k].shape, (name, split, k)
            if k != kind or not _payload_flip(blob, bad, offset):
                np.testing.assert_array_equal(got[split][k], original[split][k], err_msg=f"{name} {split} {k}")


# --------------------------------------------------------------------------- checkpoints


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    m = DLRM(**ARCH, seed=3)
    for b in SyntheticData(ARCH["embedding_sizes"], 13, 16, 2, seed=0).batches():
        m.train_step(b.dense, b.offsets, b.indices, b.labels, 0.1)
    d = tmp_path_factory.mktemp("ck")
    meta = {"state": {"step": 2, "losses": [[2, 0.5]]}, "note": "x" * 40}
    save_checkpoint(str(d / "ck.bin"), m, meta)
    save_sharded(str(d / "sharded"), m, meta, model_arch(m))
    return d, meta, {k: v.copy() for k, v in m.state_dict().items()}


def _load_or_error(path, errors):
    """(meta, state) loaded into a fresh model, or None after a clear error (model untouched)."""
    m = DLRM(**ARCH, seed=11)
    fresh = {k: v.copy() for k, v in m.state_dict().items()}
    try:
        meta = load_checkpoint(str(path), m)
    except errors as e:
        assert str(path) in str(e)
        for k, v in m.state_dict().items():
            np.testing.assert_array_equal(v, fresh[k], err_msg=f"{k} changed by a failed load")
        return None
    return meta, m.state_dict()


def _assert_same(loaded, meta, state):
    got_meta, got = loaded
    assert got_meta == meta
    for k, v in state.items():
        np.testing.assert_array_equal(got[k], v, err_msg=k)


@CHEAP
@given(st.data())
def test_damaged_checkpoint_file_is_an_error_or_loads_exactly(checkpoint, data):
    d, meta, state = checkpoint
    blob = (d / "ck.bin").read_bytes()
    header = blob.rfind(b'{"arch"')                  # half the flips in the JSON header (~15 % of the file)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "ck.bin"
        path.write_bytes(_damage(data, blob, data.draw(st.sampled_from([0, header]), label="from")))
        loaded = _load_or_error(path, CheckpointError)
    if loaded is not None:                            # flips in alignment padding: nothing read changed
        _assert_same(loaded, meta, state)


@given(st.data())
def test_damaged_checkpoint_shard_is_an_error_or_loads_exactly(checkpoint, data):
    d, meta, state = checkpoint
    shards = sorted(str(p.relative_to(d / "sharded")) for p in (d / "sharded").rglob("*.npy"))
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "sharded"
        _copy_damaged(data, d / "sharded", path, shards)
        loaded = _load_or_error(path, ShardedCheckpointError)
    if loaded is not None:
        _assert_same(loaded, meta, state)
