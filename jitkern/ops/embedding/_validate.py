"""Argument checks of the embedding ops: tables, bag arrays, sizes, and the bag values (offsets
order, index range) that the kernels check themselves before they write anything (the serial
forward checks each index as it reads its row: it writes only its output).
"""
from __future__ import annotations

import numpy as np

from ...codegen import jit
from .._check import F32, I64, choice, float_array, index_array
from ._rows import NO_PSW
from .split_bf16 import SplitBF16Table

MODES = ("sum", "mean")
MAX_ROWS, MAX_NNZ = 1 << 32, (1 << 31) - 1  # the sparse paths pack a row and a position in one int64


@jit(inline="always")
def check_offsets(bags, nbags):
    """(code, position, value) of the first problem of the bags' offsets, code 0 if none: what
    check_bags finds before it looks at the indices."""
    indices, offsets, _, _, last = bags
    nnz = indices.shape[0]
    if nbags > 0 and offsets[0] != 0:
        return 1, 0, offsets[0]
    decreasing = False
    for b in range(1, offsets.shape[0]):  # branch-free reductions first (they vectorise); positions on failure
        decreasing |= offsets[b] < offsets[b - 1]
    if decreasing:
        for b in range(1, offsets.shape[0]):
            if offsets[b] < offsets[b - 1]:
                return 2, b, offsets[b]
    n_off = offsets.shape[0]
    if n_off > 0 and offsets[n_off - 1] > nnz:
        return 3, n_off - 1, offsets[n_off - 1]
    if last and n_off > 0 and offsets[n_off - 1] != nnz:
        return 4, n_off - 1, offsets[n_off - 1]
    if nbags == 0 and nnz > 0:
        return 5, 0, nnz
    return 0, 0, 0


@jit(inline="always")
def outside(r, num_rows):
    """Whether index r is outside a table of num_rows rows (negative ones wrap to huge values)."""
    return np.uint64(np.int64(r)) >= np.uint64(num_rows)


@jit(inline="always")
def check_bags(bags, nbags, num_rows):
    """(code, position, value) of the first problem of the bags, code 0 if none: the offsets
    (check_offsets), then the first index outside the table (code 6)."""
    code, pos, value = check_offsets(bags, nbags)
    if code:
        return code, pos, value
    indices = bags[0]
    nnz = indices.shape[0]
    bad = False
    for j in range(nnz):
        bad |= outside(indices[j], num_rows)
    if bad:
        for j in range(nnz):
            if outside(indices[j], num_rows):
                return 6, j, np.int64(indices[j])
    return 0, 0, 0


@jit()
def validate_bags(bags, nbags, num_rows):
    """check_bags as a call of its own: inlined next to a serial gather loop it made LLVM compile
    that loop into slower code."""
    return check_bags(bags, nbags, num_rows)


def raise_bag_error(code, pos, val, table, num_rows, nnz):
    """Raise the error check_bags found (code != 0), naming the table argument `table`."""
    if code == 1:
        raise ValueError(f"offsets[0] must be 0, got {val}")
    if code == 2:
        raise ValueError(f"offsets must be non-decreasing: offsets[{pos}] = {val} < offsets[{pos - 1}]")
    if code == 3:
        raise ValueError(f"offsets[{pos}] = {val} is beyond the number of indices ({nnz})")
    if code == 4:
        raise ValueError(f"with include_last_offset the last offset must equal len(indices) = {nnz}, got {val}")
    if code == 5:
        raise ValueError(f"offsets defines no bags but indices has {nnz} entries")
    raise IndexError(f"indices[{pos}] = {val} is out of range for {table} with {num_rows} rows")


def check_table(weight, name="weight", *, writeable=False, bf16_ok=True):
    """(rows array, is_bf16): the float32 (R, D) table or the `hi` half of a SplitBF16Table.

    Never copied: a table is large, and the updates write it in place."""
    if isinstance(weight, SplitBF16Table):
        if not bf16_ok:
            raise TypeError(f"{name} must be a float32 ndarray here; SplitBF16Table is supported by "
                            "embedding_bag_forward and embedding_bag_sgd_ only")
        if writeable and not (weight.hi.flags.writeable and weight.lo.flags.writeable):
            raise ValueError(f"{name} halves must be writeable (updated in place)")
        return weight.hi, True
    if not isinstance(weight, np.ndarray) or weight.dtype != F32:
        raise TypeError(f"{name} must be a float32 ndarray or SplitBF16Table, "
                        f"got {getattr(weight, 'dtype', type(weight).__name__)}")
    if weight.ndim != 2:
        raise ValueError(f"{name} must be 2-D (R, D), got shape {weight.shape}")
    f = weight.flags
    if not (f.c_contiguous and f.aligned):
        raise ValueError(f"{name} must be C-contiguous and aligned")
    if writeable and not f.writeable:
        raise ValueError(f"{name} must be writeable (updated in place)")
    return weight, False


def check_bag_args(indices, offsets, mode, per_sample_weights, include_last_offset):
    """(bags, nbags) from the bag arguments, their types and shapes checked (see _rows for bags).
    Their values (offsets order, index range) are checked by the kernels before they write anything."""
    choice("mode", mode, MODES)
    indices = index_array("indices", indices)
    offsets = index_array("offsets", offsets)
    if offsets.dtype != I64:
        offsets = offsets.astype(np.int64)
    last = bool(include_last_offset)
    if last and offsets.shape[0] == 0:
        raise ValueError("with include_last_offset, offsets must have B + 1 >= 1 entries")
    nbags = offsets.shape[0] - 1 if last else offsets.shape[0]
    if per_sample_weights is None:
        psw = NO_PSW
    else:
        psw = float_array("per_sample_weights", per_sample_weights, shape=(indices.shape[0],))
    return (indices, offsets, psw, mode == "mean", last), nbags


def check_sparse_sizes(num_rows, nnz):
    """Rows and positions share one int64 word in the grouped (backward, Adagrad) paths."""
    if num_rows > MAX_ROWS or nnz > MAX_NNZ:
        raise ValueError(f"embedding updates support up to 2**32 rows and 2**31 indices, got {num_rows} rows, "
                         f"{nnz} indices")
