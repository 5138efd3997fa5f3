"""Embedding bags: pooled-gather forward, coalesced sparse backward, fused race-free updates.

Layouts follow torch.nn.functional.embedding_bag: weight (R, D) float32 (or a SplitBF16Table),
flat indices (nnz,) int32/int64, offsets (B,) int64 bag starts (or (B+1,) with
include_last_offset=True); bag b is indices[offsets[b]:offsets[b+1]], the last runs to nnz.

Forward: parallel over bags; the row loop is specialised for common widths D (a compile-time
constant lets LLVM unroll it into whole vectors) with a generic runtime-D kernel otherwise, and
rows PREFETCH positions ahead are prefetched, since random row reads are latency-bound.

Backward and the fused updates share one plan: a stable LSD radix sort of the (row, position)
pairs groups duplicates, the sorted groups are cut into one contiguous range per thread (row
ownership: a thread owns every occurrence of its rows, so no atomics), and each thread sums
a row's gradient once, in position order, then writes/updates that row once ("coalesce, then
update"). The result does not depend on the thread count, let alone on timing.
"""
from __future__ import annotations

import functools
import math
import operator

import numba
import numpy as np
from llvmlite import ir
from numba import prange
from numba.core import cgutils, types
from numba.extending import intrinsic

from ..codegen import KernelSpec, get_kernel, jit, kernel_factory
from ..codegen.prefetch import prefetch, prefetch_write
from .optim import SplitBF16Table, as_float32, as_uint32, widen

SPECIALISED_D = (16, 32, 64, 128)  # widths that get a compile-time-D kernel
PREFETCH = 16                      # rows (forward) / row groups (updates) prefetched ahead
_RADIX_BITS = 12                   # digit width of the radix sort (4096-entry histogram)
_MODES = ("sum", "mean")
_UPDATES = ("grad", "sgd", "sgd_bf16", "adagrad")

# ----------------------------------------------------------------------------- row-vector intrinsics
# With D a compile-time constant, the accumulator lives in a stack array of D floats that LLVM
# promotes to vector registers, and each row is added by one <D x float> operation (a heap
# array would be kept in memory: LLVM cannot prove it does not alias the table).


@intrinsic
def stack_f32(typingctx, n):
    """A float32 scratch array of compile-time length n on the stack (promoted to registers)."""
    if not isinstance(n, types.IntegerLiteral):
        return None
    size = max(n.literal_value, 1)
    arrty = types.Array(types.float32, 1, "C")

    def codegen(context, builder, sig, args):
        ptr = cgutils.alloca_once(builder, ir.FloatType(), size=size)
        ary = context.make_array(arrty)(context, builder)
        intp = context.get_value_type(types.intp)
        context.populate_array(ary, data=ptr, shape=[ir.Constant(intp, size)], strides=[ir.Constant(intp, 4)],
                               itemsize=ir.Constant(intp, 4), meminfo=None)
        return ary._getvalue()
    return arrty(n), codegen


@intrinsic
def row_axpy(typingctx, acc, table, r, scale, n):
    """acc[:n] += scale * table[r, :n] as one <n x float> operation (table float32, or uint16 bf16 bits)."""
    if not (isinstance(n, types.IntegerLiteral) and isinstance(acc, types.Array) and isinstance(table, types.Array)
            and table.ndim == 2 and table.dtype in (types.float32, types.uint16) and acc.dtype == types.float32):
        return None
    size = n.literal_value
    bf16 = table.dtype == types.uint16

    def codegen(context, builder, sig, args):
        if size == 0:  # the generic kernel's never-taken branch
            return context.get_dummy_value()
        accv, tabv, rv, sv, _ = args
        a = context.make_array(sig.args[0])(context, builder, accv)
        t = context.make_array(sig.args[1])(context, builder, tabv)
        stride0 = cgutils.unpack_tuple(builder, t.strides, 2)[0]
        row = context.cast(builder, rv, sig.args[2], types.intp)
        fvec = ir.VectorType(ir.FloatType(), size)
        src = cgutils.pointer_add(builder, t.data, builder.mul(row, stride0))
        if bf16:
            ivec = ir.VectorType(ir.IntType(16), size)
            raw = builder.load(builder.bitcast(src, ivec.as_pointer()), align=2)
            wide = builder.shl(builder.zext(raw, ir.VectorType(ir.IntType(32), size)),
                               ir.Constant(ir.VectorType(ir.IntType(32), size), [16] * size))
            w = builder.bitcast(wide, fvec)
        else:
            w = builder.load(builder.bitcast(src, fvec.as_pointer()), align=4)
        s = context.cast(builder, sv, sig.args[3], types.float32)
        splat = builder.insert_element(ir.Constant(fvec, ir.Undefined), s, ir.Constant(ir.IntType(32), 0))
        splat = builder.shuffle_vector(splat, ir.Constant(fvec, ir.Undefined),
                                       ir.Constant(ir.VectorType(ir.IntType(32), size), [0] * size))
        dst = builder.bitcast(a.data, fvec.as_pointer())
        builder.store(builder.fadd(builder.load(dst, align=4), builder.fmul(w, splat)), dst, align=4)
        return context.get_dummy_value()
    return types.none(acc, table, r, scale, n), codegen


# ----------------------------------------------------------------------------- validation


@jit()
def _check_bags(indices, offsets, nbags, num_rows, last):
    """(code, position, value) of the first problem, code 0 if none; reads each input once."""
    nnz = indices.shape[0]
    if nbags > 0 and offsets[0] != 0:
        return 1, 0, offsets[0]
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
    lo, hi = np.int64(0), np.int64(num_rows - 1)
    for j in range(nnz):
        r = np.int64(indices[j])
        if r < lo or r > hi:
            return 6, j, r
    return 0, 0, 0


def _raise_bag_error(code, pos, val, table, num_rows, nnz):
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


def _as_index_array(name, a):
    if not isinstance(a, np.ndarray):
        raise TypeError(f"{name} must be a numpy array of int32 or int64, got {type(a).__name__}")
    if a.dtype != np.int64 and a.dtype != np.int32:
        raise TypeError(f"{name} must have dtype int32 or int64, got {a.dtype}")
    if a.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {a.shape}")
    return a if a.flags.c_contiguous else np.ascontiguousarray(a)


def _as_float_array(name, a, shape):
    if not isinstance(a, np.ndarray) or a.dtype != np.float32:
        raise TypeError(f"{name} must be a float32 numpy array, got {getattr(a, 'dtype', type(a).__name__)}")
    if a.shape != shape:
        raise ValueError(f"{name} must have shape {shape}, got {a.shape}")
    return a if a.flags.c_contiguous else np.ascontiguousarray(a)


def _check_table(weight, name="weight", *, writeable=False, bf16_ok=True):
    """(rows array, is_bf16): the float32 (R, D) table or the `hi` half of a SplitBF16Table."""
    if isinstance(weight, SplitBF16Table):
        if not bf16_ok:
            raise TypeError(f"{name} must be a float32 ndarray here; SplitBF16Table is supported by "
                            "embedding_bag_forward and embedding_bag_sgd_ only")
        if writeable and not (weight.hi.flags.writeable and weight.lo.flags.writeable):
            raise ValueError(f"{name} halves must be writeable (updated in place)")
        return weight.hi, True
    if not isinstance(weight, np.ndarray) or weight.dtype != np.float32:
        raise TypeError(f"{name} must be a float32 ndarray or SplitBF16Table, "
                        f"got {getattr(weight, 'dtype', type(weight).__name__)}")
    if weight.ndim != 2:
        raise ValueError(f"{name} must be 2-D (R, D), got shape {weight.shape}")
    if not weight.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous")
    if writeable and not weight.flags.writeable:
        raise ValueError(f"{name} must be writeable (updated in place)")
    return weight, False


def _check_common(indices, offsets, num_rows, mode, per_sample_weights, include_last_offset, table):
    """Validate the bag description; returns (indices, offsets, nbags, psw or empty, mean flag)."""
    if mode not in _MODES:
        raise ValueError(f"mode must be one of {_MODES}, got {mode!r}")
    indices = _as_index_array("indices", indices)
    offsets = _as_index_array("offsets", offsets)
    if offsets.dtype != np.int64:
        offsets = offsets.astype(np.int64)
    last = bool(include_last_offset)
    if last and offsets.shape[0] == 0:
        raise ValueError("with include_last_offset, offsets must have B + 1 >= 1 entries")
    nbags = offsets.shape[0] - 1 if last else offsets.shape[0]
    nnz = indices.shape[0]
    if per_sample_weights is None:
        psw = np.empty(0, np.float32)
    else:
        psw = _as_float_array("per_sample_weights", per_sample_weights, (nnz,))
    code, pos, val = _check_bags(indices, offsets, nbags, num_rows, last)
    if code:
        _raise_bag_error(code, pos, val, table, num_rows, nnz)
    return indices, offsets, nbags, psw, mode == "mean"


def _finite(name, x):
    try:
        x = float(x)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a real number, got {type(x).__name__}") from None
    if not math.isfinite(x):
        raise ValueError(f"{name} must be finite, got {x}")
    return x


@functools.lru_cache(maxsize=None)
def _kernel(op, **params):
    """get_kernel, memoised here too: its per-call config read costs ~20 us, and the DLRM calls
    these ops once per table per step (JITKERN_DEBUG logs the first choice of each spec only)."""
    return get_kernel(KernelSpec.make(op, **params))


def _d_class(d: int) -> int:
    """The compile-time width for D, or 0 for the generic runtime-D kernel."""
    return d if d in SPECIALISED_D else 0


# ----------------------------------------------------------------------------- forward


@jit(inline="always")
def _bag_end(offsets, b, nbags, nnz, last):
    return offsets[b + 1] if (last or b + 1 < nbags) else nnz


@kernel_factory("embedding_bag_forward")
def _forward_factory(spec):
    DC, PF = spec["D"], spec["pf"]  # spec["bf16"] only tells the weight dtype apart in the cache key

    @jit(parallel=True)
    def forward(weight, indices, offsets, psw, mean, last, nchunks, out):
        # weight: (R, D) float32 or bf16 bits uint16, indices: (nnz,), offsets: (B,)|(B+1,), out: (B, D)
        nbags = out.shape[0]
        D = DC if DC else out.shape[1]
        nnz = indices.shape[0]
        row_bytes = D * weight.itemsize
        has_psw = psw.shape[0] > 0
        for c in prange(nchunks):
            acc = stack_f32(DC) if DC else np.empty(D, np.float32)
            b0, b1 = c * nbags // nchunks, (c + 1) * nbags // nchunks
            jstop = _bag_end(offsets, b1 - 1, nbags, nnz, last)
            for b in range(b0, b1):
                s, e = offsets[b], _bag_end(offsets, b, nbags, nnz, last)
                for d in range(D):
                    acc[d] = 0.0
                for j in range(s, e):
                    if j + PF < jstop:
                        ahead = indices[j + PF]
                        for k in range(0, row_bytes, 64):
                            prefetch(weight, ahead, k)
                        prefetch(weight, ahead, row_bytes - 1)
                    r = indices[j]
                    sc = psw[j] if has_psw else np.float32(1.0)
                    if DC:
                        row_axpy(acc, weight, r, sc, DC)
                    else:
                        for d in range(D):
                            acc[d] += widen(weight[r, d]) * sc
                if mean and e > s:
                    inv = np.float32(1.0) / np.float32(e - s)
                    for d in range(D):
                        acc[d] *= inv
                for d in range(D):
                    out[b, d] = acc[d]
    return forward


def embedding_bag_forward(weight, indices, offsets, *, mode="sum", per_sample_weights=None,
                          include_last_offset=False, out=None):
    """Pooled rows per bag; weight: (R, D) float32 or SplitBF16Table, indices: (nnz,), offsets: (B,) -> (B, D)."""
    w, bf16 = _check_table(weight)
    R, D = w.shape
    indices, offsets, nbags, psw, mean = _check_common(
        indices, offsets, R, mode, per_sample_weights, include_last_offset, "weight")
    if out is None:
        out = np.empty((nbags, D), np.float32)
    else:
        if not isinstance(out, np.ndarray) or out.dtype != np.float32:
            raise TypeError(f"out must be a float32 ndarray, got {getattr(out, 'dtype', type(out).__name__)}")
        if out.shape != (nbags, D) or not out.flags.c_contiguous or not out.flags.writeable:
            raise ValueError(f"out must be a writeable C-contiguous ({nbags}, {D}) array, got shape {out.shape}")
    if nbags == 0:
        return out
    if D == 0:
        return out
    kern = _kernel("embedding_bag_forward", D=_d_class(D), bf16=bf16, pf=PREFETCH)
    # one chunk of bags per thread (numba.get_num_threads inside a kernel defeats its disk cache)
    kern(w, indices, offsets, psw, mean, bool(include_last_offset), min(numba.get_num_threads(), nbags), out)
    return out


# ----------------------------------------------------------------------------- sparse plan


@jit()
def _plan(indices, offsets, nbags, num_rows, last, nparts):
    """Sort (row, position) pairs by row (stable LSD radix sort) and cut the groups of equal rows
    into nparts contiguous ranges of about equal length.

    Returns rows (nnz,) sorted, pos (nnz,) positions in that order, bag_of (nnz,) bag of each
    position, group (U + 1,) start of each group of equal rows, parts (nparts + 1,) group cuts.
    """
    nnz = indices.shape[0]
    bag_of = np.empty(nnz, np.int64)
    for b in range(nbags):
        for j in range(offsets[b], _bag_end(offsets, b, nbags, nnz, last)):
            bag_of[j] = b
    rows = np.empty(nnz, np.int64)
    pos = np.empty(nnz, np.int64)
    for j in range(nnz):
        rows[j] = indices[j]
        pos[j] = j
    nbits = 0
    while (np.int64(1) << nbits) < num_rows:
        nbits += 1
    if nnz > 1 and nbits > 0:
        rows2, pos2 = np.empty(nnz, np.int64), np.empty(nnz, np.int64)
        npass = (nbits + _RADIX_BITS - 1) // _RADIX_BITS
        digit = (nbits + npass - 1) // npass
        mask = (np.int64(1) << digit) - 1
        count = np.empty((np.int64(1) << digit) + 1, np.int64)
        for p in range(npass):
            shift = p * digit
            count[:] = 0
            for j in range(nnz):
                count[((rows[j] >> shift) & mask) + 1] += 1
            for k in range(1, count.shape[0]):
                count[k] += count[k - 1]
            for j in range(nnz):
                k = (rows[j] >> shift) & mask
                t = count[k]
                count[k] = t + 1
                rows2[t] = rows[j]
                pos2[t] = pos[j]
            rows, rows2 = rows2, rows
            pos, pos2 = pos2, pos
    ngroups = 0
    for j in range(nnz):
        if j == 0 or rows[j] != rows[j - 1]:
            ngroups += 1
    group = np.empty(ngroups + 1, np.int64)
    g = 0
    for j in range(nnz):
        if j == 0 or rows[j] != rows[j - 1]:
            group[g] = j
            g += 1
    group[ngroups] = nnz
    parts = np.empty(nparts + 1, np.int64)
    for t in range(nparts + 1):
        parts[t] = np.searchsorted(group, t * nnz // nparts)  # first group starting at or after the cut
    parts[nparts] = ngroups
    return rows, pos, bag_of, group, parts


@jit(inline="always")
def _gather_grad(acc, D, DC, rows_pos, k0, k1, bag_of, dout, psw, inv_len):
    """acc[:D] = sum over occurrences k0..k1 of (scale * dout[bag]), in position order."""
    for d in range(D):
        acc[d] = 0.0
    has_psw = psw.shape[0] > 0
    for k in range(k0, k1):
        j = rows_pos[k]
        b = bag_of[j]
        sc = psw[j] if has_psw else np.float32(1.0)
        sc *= inv_len[b]
        if DC:
            row_axpy(acc, dout, b, sc, DC)
        else:
            for d in range(D):
                acc[d] += dout[b, d] * sc


@kernel_factory("embedding_bag_update")
def _update_factory(spec):
    DC, PF, kind = spec["D"], spec["pf"], spec["kind"]
    GRAD, SGD, BF16, ADAGRAD = (kind == k for k in _UPDATES)

    @jit(parallel=True, fastmath=frozenset())  # strict IEEE: bf16 and fp32 SGD round identically
    def update(rows, pos, bag_of, group, parts, dout, psw, inv_len, lr, eps, table, lo, state, drows):
        # table: (R, D) float32 weight, or bf16 hi bits with lo the low halves; state: (R,) Adagrad;
        # drows: (U, D) output of kind "grad". Thread t owns the row groups parts[t]:parts[t+1].
        D = DC if DC else dout.shape[1]
        row_bytes = D * table.itemsize
        for t in prange(parts.shape[0] - 1):
            acc = stack_f32(DC) if DC else np.empty(D, np.float32)
            g0, g1 = parts[t], parts[t + 1]
            for g in range(g0, g1):
                if not GRAD and g + PF < g1:
                    ahead = rows[group[g + PF]]
                    for k in range(0, row_bytes, 64):
                        prefetch_write(table, ahead, k)
                    prefetch_write(table, ahead, row_bytes - 1)
                    if BF16:
                        for k in range(0, row_bytes, 64):
                            prefetch_write(lo, ahead, k)
                _gather_grad(acc, D, DC, pos, group[g], group[g + 1], bag_of, dout, psw, inv_len)
                r = rows[group[g]]
                if GRAD:
                    for d in range(D):
                        drows[g, d] = acc[d]
                elif SGD:
                    for d in range(D):
                        table[r, d] = table[r, d] - lr * acc[d]
                elif BF16:
                    for d in range(D):
                        w = as_float32((np.uint32(table[r, d]) << np.uint32(16)) | np.uint32(lo[r, d]))
                        bits = as_uint32(w - lr * acc[d])
                        table[r, d] = np.uint16(bits >> np.uint32(16))
                        lo[r, d] = np.uint16(bits & np.uint32(0xFFFF))
                else:
                    ss = 0.0
                    for d in range(D):
                        ss += np.float64(acc[d]) * np.float64(acc[d])
                    s_new = np.float32(state[r] + ss / D)
                    state[r] = s_new
                    step = np.float32(lr / (math.sqrt(np.float64(s_new)) + eps))
                    for d in range(D):
                        table[r, d] = table[r, d] - step * acc[d]
    return update


def _sparse_update(kind, table, lo, state, indices, offsets, dout, num_rows, lr, eps, mode,
                   per_sample_weights, include_last_offset, table_name):
    """Validate, plan and run one sparse kernel; returns (rows, drows) for kind "grad"."""
    if not isinstance(dout, np.ndarray) or dout.dtype != np.float32 or dout.ndim != 2:
        raise TypeError(f"dout must be a 2-D float32 ndarray, got "
                        f"{getattr(dout, 'dtype', type(dout).__name__)} {getattr(dout, 'shape', '')}")
    D = dout.shape[1] if table is None else table.shape[1]
    indices, offsets, nbags, psw, mean = _check_common(
        indices, offsets, num_rows, mode, per_sample_weights, include_last_offset, table_name)
    dout = _as_float_array("dout", dout, (nbags, D))
    nthreads = numba.get_num_threads()
    rows, pos, bag_of, group, parts = _plan(indices, offsets, nbags, num_rows, bool(include_last_offset),
                                            max(1, min(nthreads, indices.shape[0])))
    ngroups = group.shape[0] - 1
    if mean:
        ends = np.append(offsets[1:nbags], indices.shape[0]) if not include_last_offset else offsets[1:]
        lens = ends - offsets[:nbags]
        inv_len = (np.float32(1.0) / np.maximum(lens, 1).astype(np.float32)).astype(np.float32)
    else:
        inv_len = np.ones(nbags, np.float32)
    drows = np.empty((ngroups, D) if kind == "grad" else (0, D), np.float32)
    if ngroups and D:
        dummy2 = np.empty((0, D), np.uint16)
        kern = _kernel("embedding_bag_update", D=_d_class(D), pf=PREFETCH, kind=kind)
        kern(rows, pos, bag_of, group, parts, dout, psw, inv_len, np.float32(lr), np.float64(eps),
             table if table is not None else drows, lo if lo is not None else dummy2,
             state if state is not None else np.empty(0, np.float32), drows)
    if kind == "grad":
        return rows[group[:-1]], drows
    return None


def embedding_bag_backward(indices, offsets, dout, num_rows, *, mode="sum", per_sample_weights=None,
                           include_last_offset=False):
    """Coalesced sparse gradient; dout: (B, D) -> rows (U,) sorted unique int64, drows (U, D) float32."""
    num_rows = operator.index(num_rows)
    if num_rows < 0:
        raise ValueError(f"num_rows must be >= 0, got {num_rows}")
    return _sparse_update("grad", None, None, None, indices, offsets, dout, num_rows, 0.0, 0.0, mode,
                          per_sample_weights, include_last_offset, "num_rows")


def embedding_bag_sgd_(weight, indices, offsets, dout, lr, *, mode="sum", per_sample_weights=None,
                       include_last_offset=False):
    """In place, fused: weight[rows] -= lr * drows (coalesce, then update). Returns weight."""
    w, bf16 = _check_table(weight, writeable=True)
    lr = _finite("lr", lr)
    _sparse_update("sgd_bf16" if bf16 else "sgd", w, weight.lo if bf16 else None, None, indices, offsets,
                   dout, w.shape[0], lr, 0.0, mode, per_sample_weights, include_last_offset, "weight")
    return weight


def embedding_bag_adagrad_(weight, state, indices, offsets, dout, lr, eps=1e-8, *, mode="sum",
                           per_sample_weights=None, include_last_offset=False):
    """In place, fused row-wise Adagrad; weight: (R, D), state: (R,) float32. Returns weight."""
    w, _ = _check_table(weight, writeable=True, bf16_ok=False)
    if not isinstance(state, np.ndarray) or state.dtype != np.float32:
        raise TypeError(f"state must be a float32 ndarray, got {getattr(state, 'dtype', type(state).__name__)}")
    if state.shape != (w.shape[0],) or not state.flags.c_contiguous or not state.flags.writeable:
        raise ValueError(f"state must be a writeable contiguous ({w.shape[0]},) array, got shape {state.shape}")
    lr = _finite("lr", lr)
    eps = _finite("eps", eps)
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    _sparse_update("adagrad", w, None, state, indices, offsets, dout, w.shape[0], lr, eps, mode,
                   per_sample_weights, include_last_offset, "weight")
    return weight
