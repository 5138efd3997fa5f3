"""The codegen core: target detection, specs, memoised builder, on-disk cache across processes."""
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from jitkern.codegen import KernelSpec, get_kernel, host_target, jit, kernel_factory
from jitkern.codegen.rowvec import row_copy
from jitkern.codegen.simd import MASK_BYTE, MASK_F32, MASK_OUT, fma_tile, tile_code
from jitkern.codegen.target import VECTOR_WIDTH


def test_target_detects_something_sane():
    t = host_target()
    assert t.name and t.arch
    assert t.l1d >= 4096 and t.l2 >= t.l1d and t.l3 >= t.l2 // 4
    assert t.cores >= 1
    assert t.isa in VECTOR_WIDTH and t.vector_width == VECTOR_WIDTH[t.isa]
    assert t.key.startswith(t.arch) and t.feature_hash in t.key
    if t.arch in ("x86_64", "amd64"):
        assert ("avx2" in t.features) == (t.detected_isa in ("avx2", "avx512"))


def test_isa_override_can_only_lower(monkeypatch):
    t = host_target()
    monkeypatch.setenv("JITKERN_ISA", "scalar")
    assert t.isa == "scalar" and t.vector_width == 1
    other = "neon" if t.detected_isa != "neon" else "avx512"
    monkeypatch.setenv("JITKERN_ISA", other)
    with pytest.raises(ValueError, match="JITKERN_ISA"):
        t.isa
    monkeypatch.setenv("JITKERN_ISA", "bogus")
    with pytest.raises(ValueError, match="JITKERN_ISA"):
        t.isa


def test_spec_is_order_independent_and_hashable():
    a = KernelSpec.make("op", mr=4, nr=16)
    b = KernelSpec.make("op", nr=16, mr=4)
    assert a == b and hash(a) == hash(b)
    assert a["mr"] == 4 and a.get("kc") is None
    assert a.replace(mr=6)["mr"] == 6 and a["mr"] == 4
    with pytest.raises(KeyError):
        a["kc"]
    with pytest.raises(TypeError):
        KernelSpec.make("op", bad=[1, 2])


@kernel_factory("_test_scale")
def _scale_factory(spec):
    factor = spec["factor"]

    @jit()
    def scale(x, out):
        for i in range(x.shape[0]):
            out[i] = x[i] * factor
    return scale


def test_builder_memoises_and_specialises():
    s2, s3 = KernelSpec.make("_test_scale", factor=2.0), KernelSpec.make("_test_scale", factor=3.0)
    assert get_kernel(s2) is get_kernel(KernelSpec.make("_test_scale", factor=2.0))
    x = np.arange(5, dtype=np.float32)
    out = np.empty_like(x)
    get_kernel(s2)(x, out)
    np.testing.assert_array_equal(out, x * 2)
    get_kernel(s3)(x, out)
    np.testing.assert_array_equal(out, x * 3)
    with pytest.raises(KeyError, match="no kernel factory"):
        get_kernel(KernelSpec.make("_no_such_op"))


_PROBE_MODULE = textwrap.dedent("""
    from jitkern.codegen import KernelSpec, get_kernel, jit, kernel_factory

    @kernel_factory("_cache_probe")
    def factory(spec):
        k = spec["k"]

        @jit()
        def scale(x):
            return x * k

        @jit()
        def f(x):  # calls a compiled closure, as the kernels do (the embedding forward, ...)
            return scale(x)
        return f

    def run(k=7):
        f = get_kernel(KernelSpec.make("_cache_probe", k=k))
        assert f(3.0) == 3.0 * k, (k, f(3.0))
        symbol = next(iter(f.overloads.values())).fndesc.mangled_name
        return sum(f.stats.cache_hits.values()), sum(f.stats.cache_misses.values()), symbol
""")


def _probe(tmp_path, code):
    """Run `code` in a fresh process that can import the probe module, on one disk cache: stdout lines."""
    (tmp_path / "cachedmod.py").write_text(_PROBE_MODULE)
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               NUMBA_CACHE_DIR=str(tmp_path / "nbcache"))
    done = subprocess.run([sys.executable, "-c", "import cachedmod\n" + code], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return [line.split() for line in done.stdout.splitlines()]


def test_second_process_loads_from_disk_cache(tmp_path):
    """A closure-specialised kernel compiled in one process is loaded, not compiled, in the next."""
    first = _probe(tmp_path, "print(*cachedmod.run())")
    second = _probe(tmp_path, "print(*cachedmod.run())")
    assert first[0][:2] == ["0", "1"]   # compiled
    assert second[0][:2] == ["1", "0"]  # loaded from disk
    assert first[0][2] == second[0][2]  # the same code


def test_cached_variants_from_other_processes_keep_their_own_code(tmp_path):
    """Variants of one factory closure compiled by different processes (MPI ranks, earlier runs)
    get different symbols, so one process that loads both from the cache runs each one's own code.
    With numba's function ids counted from 1 in every process, both would be the first function
    compiled, share one symbol, and the second loaded would call the first one's code."""
    (seven,), (nine,) = _probe(tmp_path, "print(*cachedmod.run(7))"), _probe(tmp_path, "print(*cachedmod.run(9))")
    assert seven[1] == nine[1] == "1" and seven[2] != nine[2]
    both = _probe(tmp_path, "print(*cachedmod.run(7)); print(*cachedmod.run(9))")  # run() checks each result
    assert [line[:2] for line in both] == [["1", "0"], ["1", "0"]]


def test_debug_logging_reports_choice_and_cache(monkeypatch, caplog):
    monkeypatch.setenv("JITKERN_DEBUG", "1")
    spec = KernelSpec.make("_test_scale", factor=5.0)
    with caplog.at_level("DEBUG", logger="jitkern"):
        k = get_kernel(spec)
        x = np.ones(3, np.float32)
        k(x, np.empty_like(x))
        get_kernel(spec)
    text = caplog.text
    assert str(spec) in text and ("compiled" in text or "disk cache" in text) and "in-process cache hit" in text


def test_kernel_cache_stamp_covers_every_kernel_source(tmp_path):
    # numba stamps a cached function with its own file only; jitkern's kernels inline helpers from
    # other modules, so their stamp hashes all of ops/ and codegen/ (and the function's own file)
    from jitkern.codegen import cache
    from jitkern.ops.embedding import grouping

    for sub, name in (("ops", "a.py"), ("codegen", "b.py"), ("bench", "c.py")):
        (tmp_path / sub).mkdir()
        (tmp_path / sub / name).write_text("x = 1\n")
    own = tmp_path / "bench" / "c.py"
    stamp = cache.source_stamp(tmp_path, str(own))
    (tmp_path / "codegen" / "b.py").write_text("x = 2\n")
    cache._kernel_sources.cache_clear()
    assert cache.source_stamp(tmp_path, str(own)) != stamp      # a helper module changed
    stamp = cache.source_stamp(tmp_path, str(own))
    own.write_text("x = 3\n")
    assert cache.source_stamp(tmp_path, str(own)) != stamp      # the function's own file changed
    cache._kernel_sources.cache_clear()
    # jitkern's functions get these locators; others keep numba's
    locator = grouping.link_rows._cache._impl._locator
    assert type(locator).__name__.startswith("Jitkern")
    assert locator.get_source_stamp() == cache.source_stamp(cache.PACKAGE, grouping.__file__)
    # so do functions decorated with codegen.jit outside the package (they inline its intrinsics)
    locator = _copy_rows24._cache._impl._locator
    assert locator.get_source_stamp() == cache.source_stamp(cache.PACKAGE, __file__)


_TILE = tile_code(4, 8, 4)  # a 4 x 8 tile of <4 x float> vectors: valid on every CPU


@jit()
def _one_tile(a, b, c, bias, mask, maskb, geo, flags):
    kc, aoff, ak, ar, boff, ldb, coff, ldc = geo
    fma_tile(_TILE, kc, (a, aoff, ak, ar), (b, boff, ldb), (c, coff, ldc), (bias, 3), flags, (mask, maskb, coff))


def test_fma_tile_strides_offsets_and_epilogue():
    """One register tile against NumPy: A read through (k, row) strides, B and C through row strides
    at offsets, for every (load, epi, use_bias, relu) and mask mode; integer values, so exact. A
    float mask (C's layout) keeps C where it is > 0 (NaN masks too), a byte mask where nonzero;
    MASK_OUT writes C > 0 as bytes 1 / 0 and leaves the bytes around the tile alone."""
    mr, nr, kc = 4, 8, 5
    rng = np.random.default_rng(0)
    lda, ldb, ldc = 9, nr + 5, nr + 2
    a = rng.integers(-4, 5, 2 + mr * lda).astype(np.float32)       # A[r, k] at 2 + r * lda + k
    b = rng.integers(-4, 5, 7 + kc * ldb).astype(np.float32)       # B[k, j] at 7 + k * ldb + j
    c0 = rng.integers(-9, 10, 1 + mr * ldc).astype(np.float32)     # C[r, j] at 1 + r * ldc + j
    bias = rng.integers(-9, 10, 3 + nr).astype(np.float32)
    A = a[2:2 + mr * lda].reshape(mr, lda)[:, :kc].astype(np.float64)
    B = b[7:7 + kc * ldb].reshape(kc, ldb)[:, :nr]
    mask = rng.integers(-1, 2, c0.size).astype(np.float32)
    mask[5] = np.nan
    keep = mask[1:1 + mr * ldc].reshape(mr, ldc)[:, :nr] > 0
    bytes0 = (mask > 0) * rng.integers(1, 256, c0.size).astype(np.uint8)   # any nonzero byte keeps
    for flags in np.ndindex(2, 2, 2, 2, 4):
        load, epi, use_bias, relu = (bool(f) for f in flags[:4])
        mode = flags[4]
        c, maskb = c0.copy(), bytes0.copy()
        _one_tile(a, b, c, bias, mask, maskb, (kc, 2, 1, lda, 7, ldb, 1, ldc), (load, epi, use_bias, relu, mode))
        want = A @ B + (c0[1:1 + mr * ldc].reshape(mr, ldc)[:, :nr] if load else 0)
        if epi:
            want = want + (bias[3:] if use_bias else 0)
            want = np.maximum(want, 0) if relu else want
            want = np.where(keep, want, 0.0) if mode in (MASK_F32, MASK_BYTE) else want
        got = c[1:1 + mr * ldc].reshape(mr, ldc)
        np.testing.assert_array_equal(got[:, :nr], want, err_msg=str(flags))
        np.testing.assert_array_equal(got[:, nr:], c0[1:1 + mr * ldc].reshape(mr, ldc)[:, nr:])  # untouched
        want_b = bytes0.copy()
        if epi and mode == MASK_OUT:
            want_b[1:1 + mr * ldc].reshape(mr, ldc)[:, :nr] = want > 0
        np.testing.assert_array_equal(maskb, want_b, err_msg=str(flags))
        assert c[0] == c0[0]


@jit()
def _copy_rows24(dst, src, pairs):
    for k in range(pairs.shape[0]):
        row_copy(dst, pairs[k, 0], src, pairs[k, 1], 24)  # a 64-byte chunk and a 32-byte rest


def test_row_copy_moves_exactly_one_row_of_any_width():
    rng = np.random.default_rng(3)
    src = rng.standard_normal((7, 32)).astype(np.float32)
    dst = np.full((5, 30), np.nan, np.float32)
    pairs = np.array([[0, 6], [3, 0], [4, 2]], np.int64)
    _copy_rows24(dst, src, pairs)
    want = np.full((5, 30), np.nan, np.float32)
    for i, j in pairs:
        want[i, :24] = src[j, :24]
    np.testing.assert_array_equal(dst, want)  # columns 24+ and the other rows untouched (NaN == NaN here)
