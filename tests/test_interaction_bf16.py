"""Dot interaction on bf16 inputs (BF16Array x and ly, bf16 dz, bf16 z) against the references.

The kernels widen every bf16 value they gather and run the fp32 code, so on bf16 inputs they give
bit for bit what they give on the widened float32 inputs; against the float64 reference they differ
by fp32 accumulation (bounded from D or F), and a bf16 z by one rounding on each side.
"""
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from jitkern.ops import (BF16Array, interaction_cat_backward, interaction_cat_forward, interaction_dot_backward,
                         interaction_dot_forward)
from jitkern.ops import reference as ref

EPS = np.finfo(np.float32).eps
U_BF16 = 2.0 ** -8


def bf16(rng, *shape):
    return BF16Array.from_float32(rng.standard_normal(shape, dtype=np.float32))


def widened(ly):
    return [a.to_float32() for a in ly] if isinstance(ly, list) else ly.to_float32()


def magnitudes(x, ly, dz, self_interaction):
    """Per-element sums of |terms|: of z's dots (and x's copy), and of dT = S @ T (+ dz's copy of x)."""
    t = np.abs(ref._stack_values(x, ly))
    b, f, d = t.shape
    li, lj = ref.interaction_pairs(f, self_interaction)
    z = np.concatenate([t[:, 0], (t @ t.transpose(0, 2, 1))[:, li, lj]], axis=1)
    s = np.zeros((b, f, f))
    np.add.at(s, (slice(None), li, lj), np.abs(ref._values(dz))[:, d:])
    dt = (s + s.transpose(0, 2, 1)) @ t
    dt[:, 0] += np.abs(ref._values(dz))[:, :d]
    return z, dt[:, 0], dt[:, 1:]


def assert_close(got, want, scale, k):
    """fp32 accumulation of k terms bounded by scale; a bf16 result also rounded on each side."""
    acc = 2 * (k + 4) * EPS * scale + 1e-30
    g, w = [v.to_float32() if isinstance(v, BF16Array) else v for v in (got, want)]
    bound = acc + 2 * U_BF16 * (np.abs(w) + acc) if isinstance(want, BF16Array) else acc
    assert np.all(np.abs(g.astype(np.float64) - w) <= bound)


@given(b=st.integers(1, 40), t=st.sampled_from([1, 3, 8, 26]), d=st.sampled_from([1, 13, 16, 64, 128]),
       stacked=st.booleans(), self_interaction=st.booleans(), z_bf16=st.booleans(), dz_bf16=st.booleans(),
       seed=st.integers(0, 99))
def test_dot_interaction_on_bf16_inputs(b, t, d, stacked, self_interaction, z_bf16, dz_bf16, seed):
    rng = np.random.default_rng(seed)
    x = bf16(rng, b, d)
    ly = bf16(rng, b, t, d) if stacked else [bf16(rng, b, d) for _ in range(t)]
    out_dtype = "bfloat16" if z_bf16 else None
    z = interaction_dot_forward(x, ly, self_interaction=self_interaction, out_dtype=out_dtype)
    z32 = interaction_dot_forward(x.to_float32(), widened(ly), self_interaction=self_interaction)
    assert isinstance(z, BF16Array) == z_bf16
    if z_bf16:
        np.testing.assert_array_equal(z.bits, BF16Array.from_float32(z32).bits)  # rounded once, from fp32
    else:
        np.testing.assert_array_equal(z, z32)
    dz = rng.standard_normal(z32.shape, dtype=np.float32)
    dz = BF16Array.from_float32(dz) if dz_bf16 else dz
    zmag, dxmag, dlymag = magnitudes(x, ly, dz, self_interaction)
    assert_close(z, ref.interaction_dot_forward(x, ly, self_interaction=self_interaction, out_dtype=out_dtype), zmag, d)

    dx, dly = interaction_dot_backward(dz, x, ly, self_interaction=self_interaction)
    dz32 = dz.to_float32() if dz_bf16 else dz
    dx32, dly32 = interaction_dot_backward(dz32, x.to_float32(), widened(ly), self_interaction=self_interaction)
    np.testing.assert_array_equal(dx, dx32)
    np.testing.assert_array_equal(dly, dly32)
    rdx, rdly = ref.interaction_dot_backward(dz, x, ly, self_interaction=self_interaction)
    assert_close(dx, rdx, dxmag, 2 * (t + 1) + 1)
    assert_close(dly, rdly, dlymag, 2 * (t + 1))


def test_bf16_and_float32_inputs_do_not_mix():
    rng = np.random.default_rng(0)
    x, ly = bf16(rng, 4, 16), [bf16(rng, 4, 16) for _ in range(3)]
    with pytest.raises(TypeError, match=r"ly\[1\] must be a BF16Array"):
        interaction_dot_forward(x, [ly[0], ly[1].to_float32(), ly[2]])
    with pytest.raises(TypeError, match=r"ly\[0\] must be a numpy.ndarray"):
        interaction_dot_forward(x.to_float32(), ly)
    with pytest.raises(TypeError, match="ly must be a BF16Array"):
        interaction_dot_forward(x, np.zeros((4, 3, 16), np.uint16))  # bare bits are not bf16
    with pytest.raises(ValueError, match="out_dtype"):
        interaction_dot_forward(x, ly, out_dtype="float16")
    with pytest.raises(TypeError, match=r"ly\[2\] must be a BF16Array"):
        interaction_cat_forward(x, [ly[0], ly[1], ly[2].to_float32()])
    with pytest.raises(ValueError, match="dz must have shape"):
        interaction_cat_backward(BF16Array(np.zeros((4, 63), np.uint16)), x, ly)


@given(b=st.integers(0, 40), t=st.integers(0, 9), d=st.sampled_from([1, 13, 16, 128]), stacked=st.booleans(),
       dz_bf16=st.booleans(), seed=st.integers(0, 99))
def test_cat_interaction_on_bf16_inputs(b, t, d, stacked, dz_bf16, seed):
    # cat moves values: a bf16 z holds the inputs' bits exactly, and the gradients are dz's values
    rng = np.random.default_rng(seed)
    x = bf16(rng, b, d)
    x.bits[:1, :1] = 0x7FC1                       # a NaN payload travels untouched
    ly = bf16(rng, b, t, d) if stacked else [bf16(rng, b, d) for _ in range(t)]
    z = interaction_cat_forward(x, ly)
    assert isinstance(z, BF16Array) and z.shape == (b, d * (t + 1))
    parts = [x.bits] + ([ly.bits[:, i] for i in range(t)] if stacked else [a.bits for a in ly])
    np.testing.assert_array_equal(z.bits, np.concatenate(parts, axis=1) if b else z.bits)
    stack = ly if stacked else BF16Array(np.stack([a.bits for a in ly], axis=1) if t else np.zeros((b, 0, d), np.uint16))
    want = ref.interaction_cat_forward(x, stack)
    np.testing.assert_array_equal(z.to_float32(), want.to_float32())
    dz = bf16(rng, *z.shape) if dz_bf16 else rng.standard_normal(z.shape, dtype=np.float32)
    for got, exp in zip(interaction_cat_backward(dz, x, ly), ref.interaction_cat_backward(dz, x, stack)):
        assert got.dtype == np.float32
        np.testing.assert_array_equal(got, exp)
