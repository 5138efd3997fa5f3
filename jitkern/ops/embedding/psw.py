"""Gradient of an embedding bag with respect to its per-sample weights (learned weighted pooling).

For out[b] = sum_j psw[j] * weight[indices[j]] over bag b's entries (divided by the bag size in
mean mode): dpsw[j] = dot(dout[b], weight[indices[j]]) (over the bag size for mean), as torch's
_embedding_bag_per_sample_weights_backward. Each dot is accumulated in float64, in column
order: the result does not depend on the thread count.
"""
from __future__ import annotations

import numpy as np
from numba import prange

from ...codegen import KernelSpec, get_kernel, jit, kernel_factory
from .._check import float_array
from ._rows import bag_end
from ._validate import check_bag_args, check_table, raise_bag_error, validate_bags

_CHUNKS = 64                   # bag chunks spread over the threads


@jit(inline="always")
def _bag_dots(weight, indices, offsets, mean, last, dout, b, nbags, out):
    """out[j] for the entries j of bag b (the bags' fields, not the tuple: see entry_scale)."""
    s, e = offsets[b], bag_end(offsets, b, nbags, indices.shape[0], last)
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
    def psw_backward(weight, bags, dout, chunks, out):
        # weight: (R, D) f32; bags as check_bag_args gives them; dout (B, D) f32; out (nnz,) f32
        nbags = dout.shape[0]
        code, pos, val = validate_bags(bags, nbags, weight.shape[0])
        if code:
            return code, pos, val
        indices, offsets, _, mean, last = bags
        step = (nbags + chunks - 1) // max(chunks, 1)
        for c in prange(chunks):
            for b in range(c * step, min(nbags, (c + 1) * step)):
                _bag_dots(weight, indices, offsets, mean, last, dout, b, nbags, out)
        return 0, 0, 0
    return psw_backward


def embedding_bag_per_sample_weights_backward(weight, indices, offsets, dout, *, mode="sum",
                                              include_last_offset=False):
    """dloss/dpsw (nnz,) float32 of embedding_bag_forward with per_sample_weights; weight: (R, D)
    float32 (the table before its update), indices: (nnz,), offsets: (B,)|(B+1,), dout: (B, D)."""
    w, _ = check_table(weight, bf16_ok=False)
    bags, nbags = check_bag_args(indices, offsets, mode, None, include_last_offset)
    dout = float_array("dout", dout, shape=(nbags, w.shape[1]))
    nnz = bags[0].shape[0]
    out = np.zeros(nnz, np.float32)
    kern = get_kernel(KernelSpec.make("embedding_bag_psw_backward"))
    code, pos, val = kern(w, bags, dout, min(_CHUNKS, max(nbags, 1)), out)
    if code:
        raise_bag_error(code, pos, val, "weight", w.shape[0], nnz)
    return out
