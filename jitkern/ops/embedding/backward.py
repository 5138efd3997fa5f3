"""Embedding-bag backward: the coalesced sparse gradient of the table, one row per distinct index.

A row's gradient is the sum of its occurrences' scaled dout rows (per-sample weight, over the
bag size for mean), added in position order: bit-identical run to run and for any thread
count. The rows come out sorted (the radix-sorted grouping, grouping.sorted_groups), and each
thread sums a contiguous range of row groups.
"""
from __future__ import annotations

import functools
import operator

import numpy as np
from numba import prange

from ...codegen import KernelSpec, get_kernel, jit, kernel_factory
from ...codegen.rowvec import stack_f32
from .._check import float_array
from ._rows import d_class, madd_row
from ._validate import check_bag_args, check_sparse_sizes
from .grouping import group_gradient, sorted_groups


@kernel_factory("embedding_bag_backward")
def _backward_factory(spec):
    DC = spec["D"]

    @jit(parallel=True, fastmath=frozenset())  # strict IEEE: the sums round as the updates' do
    def backward(groups, dout, drows):
        # groups: grouping.sorted_groups, dout: (B, D) float32, drows: (U, D) float32 out; part t
        # (one thread's) sums the row groups parts[t]:parts[t+1]
        parts = groups[4]
        D = DC if DC else dout.shape[1]
        for t in prange(parts.shape[0] - 1):
            acc = stack_f32(DC) if DC else np.empty((1, D), np.float32)
            for g in range(parts[t], parts[t + 1]):
                group_gradient(acc, dout, groups, g, D, DC)
                madd_row(drows, g, acc, 0, np.float32(1.0), D, DC, True)
    return backward


@functools.lru_cache(maxsize=None)
def _kernel(dim):
    """get_kernel, memoised: it reads the environment (JITKERN_DEBUG) on every call."""
    return get_kernel(KernelSpec.make("embedding_bag_backward", D=d_class(dim)))


def embedding_bag_backward(indices, offsets, dout, num_rows, *, mode="sum", per_sample_weights=None,
                           include_last_offset=False):
    """Coalesced sparse gradient; dout: (B, D) -> rows (U,) sorted unique int64, drows (U, D) float32."""
    num_rows = operator.index(num_rows)
    if num_rows < 0:
        raise ValueError(f"num_rows must be >= 0, got {num_rows}")
    bags, nbags = check_bag_args(indices, offsets, mode, per_sample_weights, include_last_offset)
    dout = float_array("dout", dout, ndim=2)
    dout = float_array("dout", dout, shape=(nbags, dout.shape[1]))
    check_sparse_sizes(num_rows, bags[0].shape[0])
    groups = sorted_groups(bags, nbags, num_rows, "num_rows")
    rows, group = groups[0], groups[3]
    D = dout.shape[1]
    drows = np.empty((group.shape[0] - 1, D), np.float32)
    if drows.shape[0] and D:
        _kernel(D)(groups, dout, drows)
    return rows[group[:-1]], drows
