"""bf16 GEMM family against the references: rounding, GEMM / linear forward / backward on BF16Array
operands, on the host's paths (vdpbf16ps where it has AVX512_BF16, and the widening path the
gemm.bf16.dot knob can pick instead) and the widening path of AVX2 (JITKERN_ISA=avx2).

Inputs are bf16 values (kernel and reference see the same ones); products of two bf16 values are
exact in fp32, so the kernel differs from the float64 reference only by its fp32 accumulation
(bounded as in test_gemm.py, from K) and, for a bf16 result, by one rounding of each side (half a
bf16 ulp, 2**-8 relative, each). vdpbf16ps treats denormal inputs and results as zero: that is
below the bounds' absolute floor.
"""
import importlib
import tempfile

import numba
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from jitkern.codegen import host_target
from jitkern.codegen.knobs import Workload
from jitkern.codegen.peaks import bf16_peak_gflops, fma_peak_gflops
from jitkern.ops import BF16Array, gemm, linear_backward, linear_forward
from jitkern.ops import reference as ref
from isa_switch import bf16_dot, bf16_path

K = importlib.import_module("jitkern.ops.gemm_bf16_kernel")
EPS = np.finfo(np.float32).eps
U_BF16 = 2.0 ** -8  # bf16 unit roundoff: half an ulp, relative
dims = st.one_of(st.integers(1, 200), st.sampled_from([1, 2, 7, 13, 31, 33, 97, 127, 129]))
out_dtypes = st.sampled_from([None, "bfloat16"])

# the host's ISA with each bf16 tile it can run (the gemm.bf16.dot knob forced), and AVX2's widening
HOST = ["host-native", "host-widened"] if host_target().has("avx512bf16") else ["host"]
ISAS = HOST + (["avx2"] if host_target().detected_isa in ("avx2", "avx512") else [])
TMP = tempfile.mkdtemp(prefix="jitkern-bf16-dot-")


def bf16(rng, *shape):
    return BF16Array.from_float32(rng.standard_normal(shape, dtype=np.float32))


def values(x):
    return (x.to_float32() if isinstance(x, BF16Array) else x).astype(np.float64)


def assert_close(got, want, scale, k):
    """got within fp32 accumulation error of a length-k reduction of terms bounded by `scale`, plus
    for a bf16 result one bf16 rounding on each side (of values at most |want| + that error)."""
    assert type(got) is type(want) and got.shape == want.shape
    acc = 2 * (k + 4) * EPS * scale + 1e-30
    g, w = values(got), values(want)
    bound = acc + 2 * U_BF16 * (np.abs(w) + acc) if isinstance(want, BF16Array) else acc
    err = np.abs(g - w)
    assert np.all(err <= bound), f"max err {err.max()} > bound {bound.ravel()[np.argmax(err)]}"


# --------------------------------------------------------------------------- rounding

# (float32 bits, bf16 bits) that pin the rounding down: ties to even, carries, NaN, inf, denormals
ROUNDING = [
    (0x00000000, 0x0000), (0x80000000, 0x8000),                        # +-0
    (0x3F800000, 0x3F80), (0x3F808000, 0x3F80), (0x3F818000, 0x3F82),  # exact; ties to even down, up
    (0x3F807FFF, 0x3F80), (0x3F808001, 0x3F81), (0xBF818000, 0xBF82),  # below / above a tie; negative
    (0x3FFF8000, 0x4000), (0x7F7F0000, 0x7F7F), (0x7F7F7FFF, 0x7F7F),  # carry into the exponent; max bf16
    (0x7F7F8000, 0x7F80), (0x7F7FFFFF, 0x7F80), (0xFF7FFFFF, 0xFF80),  # past max bf16: +-inf (RNE overflow)
    (0x7F800000, 0x7F80), (0xFF800000, 0xFF80),                        # +-inf
    (0x7FC00000, 0x7FC0), (0xFFC00001, 0xFFC0), (0x7FFFFFFF, 0x7FFF),  # quiet NaNs keep sign and payload
    (0x7F800001, 0x7FC0), (0x7F80FFFF, 0x7FC0), (0xFFA00000, 0xFFE0),  # signalling NaNs: quieted, never inf
    (0x00008000, 0x0000), (0x00018000, 0x0002), (0x00008001, 0x0001),  # denormals round like any value
    (0x00007FFF, 0x0000), (0x807FFFFF, 0x8080), (0x007F8000, 0x0080),  # ... and round up to the smallest normal
]


def test_rounding_cases():
    src = np.array([s for s, _ in ROUNDING], np.uint32).view(np.float32)
    want = np.array([d for _, d in ROUNDING], np.uint16)
    np.testing.assert_array_equal(BF16Array.from_float32(src).bits, want)
    np.testing.assert_array_equal(ref.bf16_round(src).view(np.uint32) >> 16, want)
    assert np.all(ref.bf16_round(src).view(np.uint32) & 0xFFFF == 0)


def test_rounding_matches_reference_on_random_bits():
    bits = np.random.default_rng(0).integers(0, 1 << 32, size=1 << 18, dtype=np.uint64).astype(np.uint32)
    x = bits.view(np.float32)
    got = BF16Array.from_float32(x)  # parallel conversion
    np.testing.assert_array_equal(got.bits, ref.bf16_round(x).view(np.uint32) >> 16)
    np.testing.assert_array_equal(BF16Array.from_float32(x[:999]).bits, got.bits[:999])  # serial
    back = got.to_float32()
    np.testing.assert_array_equal(np.isnan(back), np.isnan(x))
    finite = np.isfinite(x) & np.isfinite(back)
    # nearest: within half a bf16 ulp of x (an ulp is 2**-7 of the binade's start; denormals: 2**-133)
    ulp = np.maximum(np.exp2(np.floor(np.log2(np.abs(x[finite].astype(np.float64)) + 1e-300)) - 7), 2.0 ** -133)
    assert np.all(np.abs(back[finite].astype(np.float64) - x[finite]) <= ulp / 2)


@pytest.mark.parametrize("path", ISAS)
def test_epilogue_rounds_like_the_reference(path):
    """C = 0 + bias, rounded by the GEMM's epilogue: bit for bit the reference's rounding (NaN included)."""
    bias = np.array([s for s, _ in ROUNDING], np.uint32).view(np.float32)
    bias = np.concatenate([bias, np.random.default_rng(1).standard_normal(40, dtype=np.float32)])
    x = BF16Array(np.zeros((3, 5), np.uint16))
    w = BF16Array(np.zeros((len(bias), 5), np.uint16))
    with bf16_path(path, TMP):
        for act in (None, "relu"):
            y = linear_forward(x, w, bias, activation=act, out_dtype="bfloat16")
            want = ref.linear_forward_bf16(x, w, bias, activation=act, out_dtype="bfloat16")
            np.testing.assert_array_equal(y.bits, want.bits)


# --------------------------------------------------------------------------- GEMM and linear


@pytest.mark.parametrize("path", ISAS)
@given(m=dims, n=dims, k=dims, ta=st.booleans(), tb=st.booleans(), out_dtype=out_dtypes,
       scaled=st.booleans(), seed=st.integers(0, 99))
def test_gemm_matches_reference(path, m, n, k, ta, tb, out_dtype, scaled, seed):
    rng = np.random.default_rng(seed)
    a = bf16(rng, *((k, m) if ta else (m, k)))
    b = bf16(rng, *((n, k) if tb else (k, n)))
    alpha, beta = (-0.5, 1.5) if scaled else (1.0, 0.0)
    c = rng.standard_normal((m, n), dtype=np.float32)
    out = BF16Array.from_float32(c) if out_dtype else c.copy()
    with bf16_path(path, TMP):
        got = gemm(a, b, out, trans_a=ta, trans_b=tb, alpha=alpha, beta=beta)
    assert got is out
    want = ref.gemm_bf16(a, b, BF16Array.from_float32(c) if out_dtype else c, trans_a=ta, trans_b=tb,
                         alpha=alpha, beta=beta)
    opa, opb = np.abs(values(a)), np.abs(values(b))
    scale = abs(alpha) * ((opa.T if ta else opa) @ (opb.T if tb else opb)) + abs(beta) * np.abs(values(out))
    assert_close(got, want, scale, k)


@pytest.mark.parametrize("path", ISAS)
@given(n=dims, k=dims, m=dims, bias=st.sampled_from([None, "float32", "bfloat16"]),
       act=st.sampled_from([None, "relu"]), out_dtype=out_dtypes, seed=st.integers(0, 99))
def test_linear_forward_matches_reference(path, n, k, m, bias, act, out_dtype, seed):
    rng = np.random.default_rng(seed)
    x, w = bf16(rng, n, k), bf16(rng, m, k)
    b = None if bias is None else rng.standard_normal(m, dtype=np.float32)
    if bias == "bfloat16":
        b = BF16Array.from_float32(b)
    with bf16_path(path, TMP):
        got = linear_forward(x, w, b, activation=act, out_dtype=out_dtype)
    want = ref.linear_forward_bf16(x, w, b, activation=act, out_dtype=out_dtype)
    scale = np.abs(values(x)) @ np.abs(values(w)).T + (0 if b is None else np.abs(values(b)))
    assert_close(got, want, scale, k)
    if act == "relu":
        assert (values(got) >= 0).all()


@pytest.mark.parametrize("path", ISAS)
@given(n=dims, k=dims, m=dims, act=st.sampled_from([None, "relu"]), grads=st.sampled_from(["float32", "bfloat16"]),
       dx_dtype=out_dtypes, need_dx=st.booleans(), outs=st.booleans(), seed=st.integers(0, 99))
def test_linear_backward_matches_reference(path, n, k, m, act, grads, dx_dtype, need_dx, outs, seed):
    rng = np.random.default_rng(seed)
    x, w = bf16(rng, n, k), bf16(rng, m, k)
    b = rng.standard_normal(m, dtype=np.float32)
    y = ref.linear_forward_bf16(x, w, b, activation=act, out_dtype=grads)
    dy = rng.standard_normal((n, m), dtype=np.float32)
    if grads == "bfloat16":
        dy = BF16Array.from_float32(dy)
    given_dx = given_dw = None
    if outs:  # caller-given buffers, NaN-filled: every element must be written
        given_dw = np.full((m, k), np.nan, np.float32)
        if need_dx:
            given_dx = (BF16Array(np.full((n, k), 0x7FC0, np.uint16)) if dx_dtype == "bfloat16"
                        else np.full((n, k), np.nan, np.float32))
    with bf16_path(path, TMP):
        dx, dw, db = linear_backward(dy, x, w, y, activation=act, need_dx=need_dx, dx_dtype=dx_dtype,
                                     out_dx=given_dx, out_dw=given_dw)
    rdx, rdw, rdb = ref.linear_backward_bf16(dy, x, w, y, activation=act, need_dx=need_dx, dx_dtype=dx_dtype)
    if outs:
        assert dw is given_dw and dx is given_dx
    g = np.abs(ref.bf16_round(values(dy).astype(np.float32)).astype(np.float64))  # |the GEMMs' operand|
    assert (dx is None) == (not need_dx)
    if need_dx:
        assert_close(dx, rdx, g @ np.abs(values(w)), m)
    assert dw.dtype == db.dtype == np.float32 and dw.flags.c_contiguous
    assert_close(dw, rdw, g.T @ np.abs(values(x)), n)
    assert_close(db, rdb, np.abs(values(dy)).sum(axis=0), n)


@pytest.mark.parametrize("path", ISAS)
@given(n=dims, k=dims, m=dims, dx_dtype=out_dtypes, seed=st.integers(0, 99))
def test_input_relu_masks_bf16_dx_exactly(path, n, k, m, dx_dtype, seed):
    # x a bf16 ReLU output (+0.0, -0.0 and a NaN among its units): dx = the unmasked dx, +0.0 where x <= 0
    rng = np.random.default_rng(seed)
    xf = np.maximum(rng.standard_normal((n, k), dtype=np.float32), np.float32(0.0))
    xf[rng.random((n, k)) < 0.1] = np.float32(-0.0)
    xf.flat[rng.integers(0, n * k)] = np.nan
    x, w = BF16Array.from_float32(xf), bf16(rng, m, k)
    dy = rng.standard_normal((n, m), dtype=np.float32)
    with bf16_path(path, TMP):
        dx, dw, db = linear_backward(dy, x, w, dx_dtype=dx_dtype, input_relu=True)
        pdx, pdw, pdb = linear_backward(dy, x, w, dx_dtype=dx_dtype)
    bits = lambda a: getattr(a, "bits", a).view(np.uint16 if dx_dtype == "bfloat16" else np.uint32)  # noqa: E731
    want = np.where(values(x) > 0, bits(pdx), 0).astype(bits(pdx).dtype)
    np.testing.assert_array_equal(bits(dx), want)
    np.testing.assert_array_equal(dw, pdw)
    np.testing.assert_array_equal(db, pdb)


@pytest.mark.parametrize("path", ISAS + ["scalar"])
@given(m=st.integers(1, 70), n=st.integers(1, 70), k=st.integers(0, 61), ta=st.booleans(), tb=st.booleans(),
       out_bf16=st.booleans(), mc=st.integers(1, 3), kc=st.sampled_from([2, 4, 6, 64]), nc=st.integers(1, 2),
       epi=st.booleans(), seed=st.integers(0, 99))
def test_driver_blocks_and_passes(path, m, n, k, ta, tb, out_bf16, mc, kc, nc, epi, seed):
    """The driver with small blocks: several K passes (odd k: an odd last pass), edge tiles, fp32
    partial sums of a bf16 C, k = 0."""
    if path == "scalar" and out_bf16:
        out_bf16 = False  # the scalar path's bf16 C is the avx2 path's code: one compile saved
    rng = np.random.default_rng(seed)
    a, b = bf16(rng, *((k, m) if ta else (m, k))), bf16(rng, *((n, k) if tb else (k, n)))
    bias = rng.standard_normal(n, dtype=np.float32) if epi else None
    c = np.empty((m, n), np.uint16 if out_bf16 else np.float32)
    with bf16_path(path, TMP):
        _, mr, nr, _ = K.bf16_tile()
        K.gemm_bf16_into(a.bits, b.bits, c, ta, tb, (mc * mr, kc, nc * nr), bias=bias, relu=epi)
    got = BF16Array(c) if out_bf16 else c
    x, w = (BF16Array(np.ascontiguousarray(a.bits.T)) if ta else a), (b if tb else BF16Array(np.ascontiguousarray(b.bits.T)))
    want = ref.linear_forward_bf16(x, w, bias, activation="relu" if epi else None,
                                   out_dtype="bfloat16" if out_bf16 else None)
    scale = np.abs(values(x)) @ np.abs(values(w)).T + (np.abs(bias) if epi else 0)
    assert_close(got, want, scale, k)


def test_dot_knob_picks_the_tile(tmp_path):
    """gemm.bf16.dot: the vdpbf16ps tile only where the target has it, either tile where the knob
    says so, and a heuristic that follows the measured peaks (vdpbf16ps kept unless clearly slower
    than the fp32 FMAs)."""
    if not host_target().has("avx512bf16"):
        assert K.bf16_tile()[0] is False and list(K.DOT.problems(Workload(precisions=("bf16",)))) == []
        return
    for native in (True, False):
        with bf16_dot(native, str(tmp_path)):
            assert K.bf16_tile()[0] is native
            assert K.bf16_tile("avx2")[0] is False
    ratio = bf16_peak_gflops(200_000, 3) / fma_peak_gflops(200_000, 3)
    if abs(ratio - K.DOT_MARGIN) > 0.15:  # far from the margin: load cannot flip it
        assert K.DOT.heuristic(K.DOT_PROBLEM) == {"native": ratio >= K.DOT_MARGIN}


def test_results_are_deterministic_across_thread_counts():
    rng = np.random.default_rng(3)
    x, w, b = bf16(rng, 700, 333), bf16(rng, 130, 333), rng.standard_normal(130, dtype=np.float32)
    dy = bf16(rng, 700, 130)
    before = numba.get_num_threads()
    try:
        runs = []
        for threads in sorted({1, numba.config.NUMBA_NUM_THREADS}) * 2:
            numba.set_num_threads(threads)
            y = linear_forward(x, w, b, activation="relu", out_dtype="bfloat16")
            dx, dw, db = linear_backward(dy, x, w, y, activation="relu", dx_dtype="bfloat16")
            runs.append((y.bits, dx.bits, dw, db))
    finally:
        numba.set_num_threads(before)
    for other in runs[1:]:
        for got, first in zip(other, runs[0]):
            np.testing.assert_array_equal(got, first)


def test_nan_and_inf_propagate():
    rng = np.random.default_rng(2)
    xf = rng.standard_normal((20, 50), dtype=np.float32)
    xf[3, 7], xf[5, 1] = np.nan, np.inf
    x, w, b = BF16Array.from_float32(xf), bf16(rng, 40, 50), rng.standard_normal(40, dtype=np.float32)
    for path in ISAS:
        with bf16_path(path, TMP):
            y = linear_forward(x, w, b, activation="relu", out_dtype="bfloat16").to_float32()
        want = ref.linear_forward_bf16(x, w, b, activation="relu", out_dtype="bfloat16").to_float32()
        assert np.isnan(y[3]).all()  # relu(NaN) stays NaN, and rounding keeps it NaN
        np.testing.assert_array_equal(np.isnan(y), np.isnan(want))
        np.testing.assert_array_equal(np.isinf(y), np.isinf(want))


def test_empty_dimensions():
    z = BF16Array(np.zeros((0, 5), np.uint16))
    assert gemm(z, BF16Array(np.zeros((5, 3), np.uint16))).shape == (0, 3)
    out = gemm(BF16Array(np.zeros((4, 0), np.uint16)), BF16Array(np.zeros((0, 3), np.uint16)), out_dtype="bfloat16")
    np.testing.assert_array_equal(out.to_float32(), np.zeros((4, 3)))
    y = linear_forward(BF16Array(np.zeros((4, 0), np.uint16)), BF16Array(np.zeros((3, 0), np.uint16)),
                       np.full(3, -1, np.float32), activation="relu")
    np.testing.assert_array_equal(y, np.zeros((4, 3)))
    dx, dw, db = linear_backward(np.ones((0, 3), np.float32), BF16Array(np.zeros((0, 2), np.uint16)),
                                 BF16Array(np.zeros((3, 2), np.uint16)))
    assert dx.shape == (0, 2) and (dw == 0).all() and (db == 0).all()


def test_bf16_array_wrapper():
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    a = BF16Array.from_float32(x)
    assert a.shape == (3, 4) and a.dtype == "bfloat16" and a.nbytes == 24 and len(a) == 3
    np.testing.assert_array_equal(a.to_float32(), x)
    np.testing.assert_array_equal(a[1:].to_float32(), x[1:])
    np.testing.assert_array_equal(a.reshape(4, 3).to_float32(), x.reshape(4, 3))
    # a transposed (F-ordered) operand flips the transposition, no copy; a strided view is copied
    xt = BF16Array(np.ascontiguousarray(a.bits.T).T)
    np.testing.assert_array_equal(gemm(xt, a.reshape(4, 3)), x @ x.reshape(4, 3))
    np.testing.assert_array_equal(gemm(a[:, ::2], BF16Array.from_float32(x[:, ::2].T.copy())), x[:, ::2] @ x[:, ::2].T)
    with pytest.raises(TypeError, match="bits must be a uint16"):
        BF16Array(np.zeros(3, np.int16))
    with pytest.raises(TypeError, match="x must be a float32"):
        BF16Array.from_float32(np.zeros(3))
    with pytest.raises(ValueError, match="out must be"):
        BF16Array.from_float32(x, out=BF16Array(np.zeros(3, np.uint16)))


def test_validation_names_the_argument():
    a = BF16Array(np.zeros((4, 3), np.uint16))
    f32 = np.ones((4, 3), np.float32)
    with pytest.raises(TypeError, match="b must be a BF16Array"):
        gemm(a, f32.T)
    with pytest.raises(TypeError, match="a must have dtype float32, got uint16"):
        gemm(a.bits, f32.T)  # bare bits are never taken for bf16
    with pytest.raises(ValueError, match="inner dimensions"):
        gemm(a, a)
    with pytest.raises(ValueError, match="out_dtype='bfloat16' needs BF16Array"):
        gemm(f32, f32.T, out_dtype="bfloat16")
    with pytest.raises(ValueError, match="out_dtype must be one of"):
        gemm(a, a, trans_b=True, out_dtype="float16")
    with pytest.raises(ValueError, match="out_dtype is float32 but out is a BF16Array"):
        gemm(a, a, BF16Array(np.zeros((4, 4), np.uint16)), trans_b=True, out_dtype="float32")
    with pytest.raises(ValueError, match="out must not overlap"):
        sq = BF16Array(np.zeros((4, 4), np.uint16))
        gemm(sq, sq, sq)
    with pytest.raises(ValueError, match="out must have shape"):
        linear_forward(a, a, out=BF16Array(np.zeros((3, 3), np.uint16)))
    with pytest.raises(TypeError, match="w must be a BF16Array"):
        linear_forward(a, f32)
    with pytest.raises(ValueError, match="y .*required"):
        linear_backward(np.ones((4, 4), np.float32), a, BF16Array(np.zeros((4, 3), np.uint16)), activation="relu")
    with pytest.raises(ValueError, match="dx_dtype='bfloat16' needs BF16Array"):
        linear_backward(np.ones((4, 4), np.float32), f32, np.ones((4, 3), np.float32), dx_dtype="bfloat16")
