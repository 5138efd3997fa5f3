"""Criteo data pipeline: raw parsing, preprocessing, every reader's layout, the batch loader, bad data."""
import collections
import gzip
import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jitkern.dlrm.data import (LayoutError, RawDataError, iterate_batches, load_mlperf_bin, load_preprocessed,
                               load_torchrec, main, parse_chunk, preprocess, read_raw, table_sizes,
                               write_preprocessed)
from jitkern.dlrm.data.layout import kaggle_days
from jitkern.dlrm.data.rawgen import raw_block

SAMPLE = Path(__file__).parent / "data" / "criteo_kaggle_sample.txt"


def ref_parse(text: str):
    """Plain-Python parse of raw lines: labels, transformed dense, cat values, empty flags."""
    labels, dense, cats, empty = [], [], [], []
    for line in text.splitlines():
        f = line.split("\t")
        assert len(f) == 40
        labels.append(float(f[0]))
        dense.append([max(int(x), 0) if x else 0 for x in f[1:14]])
        cats.append([int(x, 16) if x else 0 for x in f[14:]])
        empty.append([x == "" for x in f[14:]])
    d = np.log(np.array(dense, np.float32) + np.float32(1))
    return (np.array(labels, np.float32), d, np.array(cats, np.uint32), np.array(empty, bool))


def empty_bits(chunk):
    return ((chunk.empty[:, None] >> np.arange(26, dtype=np.uint32)) & 1).astype(bool)


def sample_lines():
    return SAMPLE.read_text().splitlines()


def write_lines(path, lines, newline="\n"):
    Path(path).write_bytes(newline.join(lines).encode() + newline.encode())
    return path


# ---- raw parsing ----------------------------------------------------------------------------

def test_sample_rows_parse_like_python():
    c = read_raw(SAMPLE)
    labels, dense, cats, empty = ref_parse(SAMPLE.read_text())
    assert c.n_lines == 100 and c.n_bad == 0 and c.labels.sum() == 29
    np.testing.assert_array_equal(c.labels, labels)
    np.testing.assert_array_equal(c.dense, dense)      # same float32 ops: bit-identical
    np.testing.assert_array_equal(c.cats, cats)
    np.testing.assert_array_equal(empty_bits(c), empty)
    assert empty.any() and (dense == 0).any()          # the sample exercises empty fields


def test_transform_values_on_known_row():
    row = "1\t\t-3\t0\t1\t12345\t2\t3\t4\t5\t6\t7\t8\t9" + "\t0000000a" * 25 + "\tFFFFFFFF"
    c = parse_chunk(np.frombuffer(row.encode(), np.uint8))
    expect = np.log(np.float32([0, 0, 0, 1, 12345, 2, 3, 4, 5, 6, 7, 8, 9]) + np.float32(1))
    np.testing.assert_array_equal(c.dense[0], expect)
    assert c.dense[0, 3] == np.float32(np.log(np.float32(2)))
    assert c.cats[0, 0] == 10 and c.cats[0, 25] == 0xFFFFFFFF and c.empty[0] == 0 and c.labels[0] == 1


@pytest.mark.parametrize("chunk", [97, 1000, 1 << 20])
def test_chunking_and_crlf_do_not_change_rows(tmp_path, chunk):
    whole = read_raw(SAMPLE)
    crlf = write_lines(tmp_path / "crlf.txt", sample_lines(), "\r\n")
    for path in (SAMPLE, crlf):
        c = read_raw(path, chunk_bytes=chunk)
        for a in ("labels", "dense", "cats", "empty"):
            np.testing.assert_array_equal(getattr(c, a), getattr(whole, a))


def test_synthetic_generator_parses_like_python():
    text = raw_block(np.random.default_rng(3), 400).decode()
    c = parse_chunk(np.frombuffer(text.encode(), np.uint8))
    labels, dense, cats, empty = ref_parse(text)
    assert "\t-1\t" in text                            # negatives present, clipped to 0
    np.testing.assert_array_equal(c.dense, dense)
    np.testing.assert_array_equal(c.cats, cats)
    np.testing.assert_array_equal(empty_bits(c), empty)


BAD_CASES = [  # (edit of line 37's fields, field named in the message)
    (lambda f: f[:39], "line 37: line: expected 40"),
    (lambda f: f + ["1"], "line 37: line: more than 40"),
    (lambda f: f[:3] + ["12a"] + f[4:], "line 37: field 4 (I3)"),
    (lambda f: f[:20] + ["zz00ff00"] + f[21:], "line 37: field 21 (C7)"),
    (lambda f: f[:30] + ["123456789"] + f[31:], "line 37: field 31 (C17): value too long"),
    (lambda f: ["2"] + f[1:], "line 37: field 1 (label): label must be 0 or 1"),
    (lambda f: f[:5] + ["-"] + f[6:], "line 37: field 6 (I5)"),
]


@pytest.mark.parametrize("edit,message", BAD_CASES)
def test_bad_line_is_named_or_skipped(tmp_path, edit, message):
    lines = sample_lines()
    lines[36] = "\t".join(edit(lines[36].split("\t")))
    path = write_lines(tmp_path / "bad.txt", lines)
    with pytest.raises(RawDataError, match="bad.txt: " + message.replace("(", r"\(").replace(")", r"\)")):
        read_raw(path, chunk_bytes=1000)                  # line 37 is in a later chunk
    c = read_raw(path, skip_bad_lines=True, chunk_bytes=1000)
    good = read_raw(SAMPLE)
    assert c.n_bad == 1 and c.n_lines == 100
    np.testing.assert_array_equal(c.cats, np.delete(good.cats, 36, axis=0))


def test_blank_line_and_corrupt_gzip(tmp_path):
    lines = sample_lines()
    path = write_lines(tmp_path / "blank.txt", lines[:5] + [""] + lines[5:])
    with pytest.raises(RawDataError, match="line 6: line: expected 40 .* found 1"):
        read_raw(path)
    gz = tmp_path / "x.gz"
    gz.write_bytes(gzip.compress(SAMPLE.read_bytes())[:-200])
    with pytest.raises(RawDataError, match="x.gz: corrupt or truncated gzip"):
        read_raw(gz)


def test_runaway_line_is_an_error(tmp_path, monkeypatch):
    import jitkern.dlrm.data.raw as raw
    monkeypatch.setattr(raw, "MAX_LINE_BYTES", 5000)
    path = tmp_path / "binary.dat"
    path.write_bytes(SAMPLE.read_bytes()[:300].replace(b"\n", b" ") * 30)
    with pytest.raises(RawDataError, match="binary.dat: line 1: no newline in"):
        read_raw(path, chunk_bytes=1000)


# ---- preprocessing ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def sample_out(tmp_path_factory):
    out = tmp_path_factory.mktemp("pp") / "freq"
    return out, preprocess([SAMPLE], out, min_frequency=2)


def test_kaggle_days_and_split_sizes(sample_out):
    out, meta = sample_out
    assert kaggle_days(100) == [15, 15, 14, 14, 14, 14, 14]
    assert meta["splits"] == {"train": [0, 86], "test": [86, 93], "val": [93, 100]}
    sizes = {s: len(load_preprocessed(out, s)) for s in ("train", "val", "test")}
    assert sizes == {"train": 86, "test": 7, "val": 7}
    c = read_raw(SAMPLE)
    val = load_preprocessed(out, "val")
    np.testing.assert_array_equal(val.dense, c.dense[93:])
    np.testing.assert_array_equal(val.labels, c.labels[93:])


def test_frequency_threshold_ids(tmp_path, sample_out):
    c = read_raw(SAMPLE)
    miss = empty_bits(c)
    for f, out in ((2, sample_out[0]), (1, tmp_path / "f1"), (5, tmp_path / "f5")):
        if f != 2:
            preprocess([SAMPLE], out, min_frequency=f)
        ds = load_preprocessed(out, "train")
        sparse = np.concatenate([load_preprocessed(out, s).sparse for s in ("train", "test", "val")])
        for j in range(26):
            counts = collections.Counter(c.cats[~miss[:, j], j].tolist())
            frequent = sorted((v for v in counts if counts[v] >= f), key=lambda v: (-counts[v], v))
            want = {v: 2 + i for i, v in enumerate(frequent)}
            expect = [0 if miss[r, j] else want.get(int(c.cats[r, j]), 1) for r in range(100)]
            np.testing.assert_array_equal(sparse[:, j], expect)
            assert ds.cardinalities[j] == 2 + len(frequent)


def test_hash_mode_is_deterministic_and_documented(tmp_path):
    c = read_raw(SAMPLE)
    a = preprocess([SAMPLE], tmp_path / "a", max_ind_range=1000)
    preprocess([SAMPLE], tmp_path / "b", max_ind_range=1000, chunk_bytes=512)
    for name in ("dense.npy", "sparse.npy", "labels.npy"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    ids = np.concatenate([load_preprocessed(tmp_path / "a", s).sparse for s in ("train", "test", "val")])
    np.testing.assert_array_equal(ids, np.where(empty_bits(c), 0, 1 + c.cats.astype(np.int64) % 999))
    assert a["cardinalities"] == [1000] * 26 and a["categorical"]["mode"] == "hash"


def test_gzip_and_terabyte_days(tmp_path):
    lines = sample_lines()
    gz = tmp_path / "day_0.gz"
    gz.write_bytes(gzip.compress(("\n".join(lines[:60]) + "\n").encode()))
    d1 = write_lines(tmp_path / "day_1", lines[60:])
    meta = preprocess([d1, gz], tmp_path / "tb", dataset="terabyte", max_ind_range=50)  # day order by name
    assert meta["splits"] == {"train": [0, 60], "test": [60, 80], "val": [80, 100]}
    plain = preprocess([SAMPLE], tmp_path / "plain", max_ind_range=50)
    for name in ("dense.npy", "sparse.npy", "labels.npy"):
        assert (tmp_path / "tb" / name).read_bytes() == (tmp_path / "plain" / name).read_bytes()
    assert plain["splits"]["train"] == [0, 86]


def test_failed_run_leaves_nothing_and_existing_dir_is_kept(tmp_path):
    lines = sample_lines()
    lines[50] = "garbage"
    bad = write_lines(tmp_path / "bad.txt", lines)
    with pytest.raises(RawDataError, match="line 51"):
        preprocess([bad], tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.txt"]
    meta = preprocess([bad], tmp_path / "out", skip_bad_lines=True)
    assert meta["rows"] == 99 and meta["stats"]["bad_lines_skipped"] == 1
    with pytest.raises(FileExistsError, match="exists"):
        preprocess([SAMPLE], tmp_path / "out")
    assert preprocess([SAMPLE], tmp_path / "out", overwrite=True)["rows"] == 100


def test_cli(tmp_path, capsys):
    assert main(["--raw", str(SAMPLE), "--out", str(tmp_path / "o"), "--quiet", "--min-frequency", "3"]) == 0
    out = capsys.readouterr().out
    assert "100 rows" in out and "MB/s" in out and "train 86" in out
    assert main(["--raw", str(tmp_path / "missing.txt"), "--out", str(tmp_path / "p"), "--quiet"]) == 1
    assert "raw file not found" in capsys.readouterr().err
    with pytest.raises(ValueError, match="max_ind_range"):
        preprocess([SAMPLE], tmp_path / "q", max_ind_range=1)


# ---- readers: every layout round-trips exactly ------------------------------------------------

def make_arrays(n, seed=0):
    rng = np.random.default_rng(seed)
    raw_dense = rng.integers(-2, 5000, (n, 13)).astype(np.int32)
    sparse = rng.integers(0, 1000, (n, 26)).astype(np.int32)
    labels = rng.integers(0, 2, n).astype(np.int32)
    return raw_dense, sparse, labels


def log1p32(x):
    return np.log(np.maximum(x, 0).astype(np.float32) + np.float32(1))


def write_mlperf(prefix, split, raw_dense, sparse, labels):
    recs = np.concatenate([labels[:, None], raw_dense, sparse], axis=1).astype("<i4")
    recs.tofile(f"{prefix}_{split}.bin")


def write_torchrec(dir_, day, dense, sparse, labels):
    np.save(Path(dir_) / f"day_{day}_dense.npy", dense.astype(np.float32))
    np.save(Path(dir_) / f"day_{day}_sparse.npy", sparse.astype(np.int32))
    np.save(Path(dir_) / f"day_{day}_labels.npy", labels.astype(np.int32).reshape(-1, 1))


def test_layout_round_trip(tmp_path):
    raw_dense, sparse, labels = make_arrays(301)
    dense = log1p32(raw_dense)
    write_preprocessed(tmp_path / "d", dense, sparse, labels, [1000] * 26, [100, 100, 101])
    for split, (a, b) in {"train": (0, 200), "test": (200, 251), "val": (251, 301)}.items():
        ds = load_preprocessed(tmp_path / "d", split)
        assert isinstance(ds.dense, np.memmap) and len(ds) == b - a
        np.testing.assert_array_equal(ds.dense, dense[a:b])
        np.testing.assert_array_equal(ds.sparse, sparse[a:b])
        np.testing.assert_array_equal(ds.labels, labels[a:b])
    assert ds.cardinalities == [1000] * 26


def test_mlperf_bin_round_trip(tmp_path):
    prefix = tmp_path / "terabyte_processed"
    parts = {s: make_arrays(n, seed) for s, n, seed in (("train", 257, 1), ("val", 40, 2), ("test", 41, 3))}
    for s, arrs in parts.items():
        write_mlperf(prefix, s, *arrs)
    for s, (raw_dense, sparse, labels) in parts.items():
        for path in (f"{prefix}_train.bin", prefix):       # a sibling file, or the prefix
            ds = load_preprocessed(path, s)
            assert len(ds) == len(labels)
            np.testing.assert_array_equal(ds.dense[:], log1p32(raw_dense))
            np.testing.assert_array_equal(ds.sparse[:], sparse)
            np.testing.assert_array_equal(ds.labels[:], labels.astype(np.float32))
            np.testing.assert_array_equal(ds.dense[5:9], log1p32(raw_dense[5:9]))
    assert ds.cardinalities == [int(m) + 1 for m in parts["test"][1].max(axis=0)]
    np.savez(f"{prefix}_fea_count.npz", counts=np.arange(26) + 1000)
    assert load_mlperf_bin(prefix, "val").cardinalities == list(range(1000, 1026))


def test_torchrec_round_trip(tmp_path):
    days = [make_arrays(n, seed) for n, seed in ((50, 4), (61, 5), (33, 6))]
    days[1][1][3, 7] = -5                                 # a raw hash >= 2**31 stored as int32
    for d, (raw_dense, sparse, labels) in enumerate(days):
        write_torchrec(tmp_path, d, log1p32(raw_dense), sparse, labels)
    dense = np.concatenate([log1p32(a[0]) for a in days])
    sparse = np.concatenate([a[1] for a in days]).view(np.uint32).astype(np.int64)
    labels = np.concatenate([a[2] for a in days]).astype(np.float32)
    for split, (a, b) in {"train": (0, 111), "test": (111, 128), "val": (128, 144)}.items():
        ds = load_torchrec(tmp_path, split)
        np.testing.assert_array_equal(ds.dense[:], dense[a:b])
        np.testing.assert_array_equal(ds.sparse[:], sparse[a:b])
        np.testing.assert_array_equal(ds.labels[:], labels[a:b])
    np.testing.assert_array_equal(load_preprocessed(tmp_path, "train").sparse[45:60], sparse[45:60])
    assert ds.cardinalities[7] == 2**32 - 5 + 1


# ---- corrupted inputs ---------------------------------------------------------------------------

def test_truncated_or_inconsistent_files_are_clear_errors(tmp_path, sample_out):
    import shutil
    d = tmp_path / "d"
    shutil.copytree(sample_out[0], d)
    npy = d / "sparse.npy"
    npy.write_bytes(npy.read_bytes()[:-4])
    with pytest.raises(LayoutError, match=r"sparse.npy: .*\(truncated\)"):
        load_preprocessed(d)
    shutil.rmtree(d)
    shutil.copytree(sample_out[0], d)
    meta = json.loads((d / "meta.json").read_text())
    meta["rows"] = 101
    (d / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(LayoutError, match="does not match rows=101|outside"):
        load_preprocessed(d)
    (d / "COMPLETE").unlink()
    with pytest.raises(LayoutError, match="incomplete"):
        load_preprocessed(d, "val")
    with pytest.raises(ValueError, match="split must be one of"):
        load_preprocessed(sample_out[0], "validation")
    write_mlperf(tmp_path / "p", "train", *make_arrays(10))
    b = tmp_path / "p_train.bin"
    b.write_bytes(b.read_bytes()[:-100])
    with pytest.raises(LayoutError, match="not a whole number of 160-byte records"):
        load_preprocessed(b)
    t = tmp_path / "tr"
    t.mkdir()
    for day, n in enumerate((10, 12)):
        write_torchrec(t, day, *make_arrays(n)[:2], np.zeros(n + day))
    with pytest.raises(LayoutError, match="day_1_dense.npy: shape"):
        load_preprocessed(t)


# ---- loader ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def small_ds(tmp_path_factory):
    raw_dense, sparse, labels = make_arrays(400, 9)
    out = tmp_path_factory.mktemp("ld") / "d"
    write_preprocessed(out, log1p32(raw_dense), sparse, labels, [1000] * 26, [397, 3])
    return load_preprocessed(out, "train")


@settings(max_examples=25)
@given(bs=st.integers(1, 150), block=st.integers(1, 200), shuffle=st.booleans(), drop=st.booleans(),
       seed=st.integers(0, 3))
def test_batches_cover_every_row_once(small_ds, bs, block, shuffle, drop, seed):
    n = len(small_ds)
    batches = list(iterate_batches(small_ds, bs, shuffle=shuffle, seed=seed, block_size=block, drop_last=drop))
    sizes = [b.size for b in batches]
    assert all(s == bs for s in sizes[:-1]) and sum(sizes) == (n // bs * bs if drop else n)
    # labels carry no identity; the first dense column plus sparse ids do
    key = lambda d, s: np.concatenate([d.view(np.int32), s], axis=1).astype(np.int64)
    got = key(np.concatenate([b.dense for b in batches]), np.stack([np.concatenate([b.indices[t] for b in
                                                                                 batches]) for t in range(26)], 1))
    want = key(np.asarray(small_ds.dense), np.asarray(small_ds.sparse))
    if not shuffle:
        np.testing.assert_array_equal(got, want[:len(got)])
    else:
        rows = {r.tobytes() for r in got}
        assert len(rows) == len(got) and rows <= {r.tobytes() for r in want}
    b = batches[0]
    assert b.offsets.shape == (26, b.size) and b.offsets.dtype == np.int64
    assert (b.offsets == np.arange(b.size)).all()
    assert all(i.dtype == np.int64 and i.flags.c_contiguous and i.shape == (b.size,) for i in b.indices)
    assert b.dense.dtype == np.float32 and b.dense.flags.c_contiguous and b.labels.shape == (b.size,)


def test_shuffle_is_seeded_and_modulo_applies(small_ds):
    one = [b.labels for b in iterate_batches(small_ds, 64, shuffle=True, seed=1, block_size=128)]
    two = [b.labels for b in iterate_batches(small_ds, 64, shuffle=True, seed=1, block_size=128)]
    first = lambda s: next(iterate_batches(small_ds, 64, shuffle=True, seed=s, block_size=128)).indices[0]
    assert all((a == b).all() for a, b in zip(one, two)) and not (first(1) == first(2)).all()
    b = next(iterate_batches(small_ds, 50, max_ind_range=7))
    np.testing.assert_array_equal(b.indices[3], np.asarray(small_ds.sparse[:50, 3]) % 7)
    assert table_sizes(small_ds, 7) == [7] * 26 and table_sizes(small_ds) == [1000] * 26
    with pytest.raises(ValueError, match="batch_size"):
        next(iterate_batches(small_ds, 0))


def test_loader_reads_other_layouts(tmp_path):
    raw_dense, sparse, labels = make_arrays(70)
    write_mlperf(tmp_path / "k", "train", raw_dense, sparse, labels)
    ds = load_preprocessed(tmp_path / "k_train.bin")
    batches = list(iterate_batches(ds, 32, block_size=20))
    np.testing.assert_array_equal(np.concatenate([b.dense for b in batches]), log1p32(raw_dense))
    np.testing.assert_array_equal(np.concatenate([b.indices[25] for b in batches]), sparse[:, 25])


@settings(max_examples=20)
@given(n=st.integers(0, 3000), seed=st.integers(0, 2**16))
def test_id_table_matches_a_dict(n, seed):
    from jitkern.dlrm.data.idmap import RARE_ID, IdTable
    rng = np.random.default_rng(seed)
    pool = np.unique(np.concatenate([rng.integers(0, 2**32, 2 * n + 2, dtype=np.uint64),
                                     [0, 2**32 - 1]]).astype(np.uint32))
    keys = rng.permutation(pool)[:n]
    ids = (2 + rng.permutation(n)).astype(np.int32)
    raw = rng.choice(pool, (500, 3)).astype(np.uint32)
    empty = rng.integers(0, 8, 500).astype(np.uint32)
    out = np.full((500, 3), -7, np.int32)
    table = IdTable(keys, ids)
    want = dict(zip(keys.tolist(), ids.tolist()))
    for j in range(3):
        table.map_column(raw, empty, j, out)
        expect = [0 if e >> j & 1 else want.get(v, RARE_ID) for v, e in zip(raw[:, j].tolist(), empty.tolist())]
        np.testing.assert_array_equal(out[:, j], expect)
