"""Gradient of an embedding bag with respect to its per-sample weights (learned weighted pooling).

For out[b] = sum_j psw[j] * weight[indices[j]] over bag b's entries (divided by the bag size in
mean mode): dpsw[j] = dot(dout[b], weight[indices[j]]) (over the bag size for mean), as torch's
_embedding_bag_per_sample_weights_backward. Each dot is accumulated in float64, in column
order: the result does not depend on the thread count.
"""
from __future__ import annotations

import numpy as np
from numba import prange

from ..codegen import KernelSpec, get_kernel, jit, kernel_factory
from .embedding import _as_float_array, _bag_end, _check_common, _check_table, _raise_bag_error, _validate_bags

_CHUNKS = 64                   # bag chunks spread over the threads


@jit(inline="always")
def _bag_dots(weight, indices, offsets, dout, mean, last, b, nbags, out):
    """out[j] for the entries j of bag b."""
    nnz = indices.shape[0]
    s, e = offsets[b], _bag_end(offsets, b, nbags, nnz, last)
    scale = 1.0 / (e - s) if (mean and e > s) else 1.0
    for j in range(s, e):
        r = indices[j]
        acc = 0.0
        for d in range(weight.shape[1]):
            acc += np.float64(dout[b, d]) * np.float64(weight[r, d])
        out[j] = acc * scale


@kernel_factory("embedding_bag_psw_backward")
def _psw_factory(spec):
    @jit(parallel=True)
    def psw_backward(weight, indices, offsets, dout, mean, last, chunks, out):
        # weight: (R, D) f32; indices (nnz,); offsets (B,)|(B+1,); dout (B, D) f32; out (nnz,) f32
        nbags = dout.shape[0]
        code, pos, val = _validate_bags(indices, offsets, nbags, weight.shape[0], last)
        if code:
            return code, pos, val
        step = (nbags + chunks - 1) // max(chunks, 1)
        for c in prange(chunks):
            for b in range(c * step, min(nbags, (c + 1) * step)):
                _bag_dots(weight, indices, offsets, dout, mean, last, b, nbags, out)
        return 0, 0, 0
    return psw_backward


def embedding_bag_per_sample_weights_backward(weight, indices, offsets, dout, *, mode="sum",
                                              include_last_offset=False):
    """dloss/dpsw (nnz,) float32 of embedding_bag_forward with per_sample_weights; weight: (R, D)
    float32 (the table before its update), indices: (nnz,), offsets: (B,)|(B+1,), dout: (B, D)."""
    w, _ = _check_table(weight, bf16_ok=False)
    indices, offsets, nbags, _, mean = _check_common(indices, offsets, mode, None, include_last_offset)
    dout = _as_float_array("dout", dout, (nbags, w.shape[1]))
    out = np.zeros(indices.shape[0], np.float32)
    kern = get_kernel(KernelSpec.make("embedding_bag_psw_backward"))
    code, pos, val = kern(w, indices, offsets, dout, mean, bool(include_last_offset), min(_CHUNKS, max(nbags, 1)), out)
    if code:
        _raise_bag_error(code, pos, val, "weight", w.shape[0], indices.shape[0])
    return out
