"""<W x float> vector values for numba kernels: loads, stores, broadcast FMA and a 16 x 16 register
transpose as LLVM vector operations, so accumulators stay in registers. W is any compile-time
constant: LLVM splits a vector wider than the ISA's registers (16 lanes: one zmm, two ymm or four
NEON registers) and W = 1 is plain scalar code. Used by the interaction kernels.
`vget` / `vput` / `vget_addr` / `ptr_like` / `put` take float32 arrays as they are and uint16 arrays
as bf16 bits, widened on load and rounded on store (codegen.simd_bf16's rounding), so one kernel
source serves fp32 and bf16 data.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic, models, overload, register_model

from .simd_bf16 import emit_round, emit_widen, round_bf16

__all__ = ["addr_of", "f32_ptr", "f64_from_bits", "ptr_like", "put", "vadd", "vfma", "vget", "vget_addr", "vhsum4", "vlen", "vload",
           "vload_addr", "vput", "vsplat", "vstore", "vtranspose16", "vzero"]


class _F32Vec(types.Type):
    """An LLVM <n x float> SSA value (lives in a register)."""

    def __init__(self, n):
        self.n = n
        super().__init__(name=f"f32x{n}")


@register_model(_F32Vec)
class _F32VecModel(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, ir.VectorType(ir.FloatType(), fe_type.n))


def _width(w):
    return w.literal_value if isinstance(w, types.IntegerLiteral) else None


def _elem_ptr(context, builder, arrty, arr, idx, n):
    """Pointer to arr.flat[idx] as a <n x float>* (arr C-contiguous float32)."""
    data = context.make_array(arrty)(context, builder, arr).data
    p = builder.gep(data, [idx])
    return builder.bitcast(p, ir.PointerType(ir.VectorType(ir.FloatType(), n)))


@intrinsic
def vload(typingctx, arr, idx, w):
    """arr.flat[idx: idx + w] as a vector (w a compile-time constant)."""
    n = _width(w)
    if n is None or not isinstance(arr, types.Array) or arr.dtype != types.float32:
        return None

    def codegen(context, builder, sig, args):
        p = _elem_ptr(context, builder, sig.args[0], args[0], args[1], n)
        return builder.load(p, align=4)
    return _F32Vec(n)(arr, idx, w), codegen


@intrinsic
def vload_addr(typingctx, addr, w):
    """The w floats at byte address addr as a vector."""
    n = _width(w)
    if n is None or not isinstance(addr, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        p = builder.inttoptr(args[0], ir.PointerType(ir.VectorType(ir.FloatType(), n)))
        return builder.load(p, align=4)
    return _F32Vec(n)(addr, w), codegen


@intrinsic
def vstore(typingctx, arr, idx, v):
    """arr.flat[idx: idx + n] = v."""
    if not isinstance(v, _F32Vec) or not isinstance(arr, types.Array) or arr.dtype != types.float32:
        return None

    def codegen(context, builder, sig, args):
        p = _elem_ptr(context, builder, sig.args[0], args[0], args[1], v.n)
        builder.store(args[2], p, align=4)
        return context.get_dummy_value()
    return types.none(arr, idx, v), codegen


@intrinsic
def vsplat(typingctx, x, w):
    """A vector of w copies of the float32 x."""
    n = _width(w)
    if n is None or x != types.float32:
        return None

    def codegen(context, builder, sig, args):
        vt = ir.VectorType(ir.FloatType(), n)
        undef = ir.Constant(vt, ir.Undefined)
        v = builder.insert_element(undef, args[0], ir.Constant(ir.IntType(32), 0))
        return builder.shuffle_vector(v, undef, ir.Constant(ir.VectorType(ir.IntType(32), n), [0] * n))
    return _F32Vec(n)(x, w), codegen


@intrinsic
def vzero(typingctx, w):
    n = _width(w)
    if n is None:
        return None

    def codegen(context, builder, sig, args):
        return ir.Constant(ir.VectorType(ir.FloatType(), n), [0.0] * n)
    return _F32Vec(n)(w), codegen


@intrinsic
def vfma(typingctx, a, b, c):
    """a * b + c, fused."""
    if not (isinstance(a, _F32Vec) and a == b == c):
        return None

    def codegen(context, builder, sig, args):
        vt = args[0].type
        fnty = ir.FunctionType(vt, [vt] * 3)
        fma = cgutils.get_or_insert_function(builder.module, fnty, f"llvm.fma.v{a.n}f32")
        return builder.call(fma, args)
    return a(a, b, c), codegen


@intrinsic
def vadd(typingctx, a, b):
    if not (isinstance(a, _F32Vec) and a == b):
        return None

    def codegen(context, builder, sig, args):
        return builder.fadd(*args)
    return a(a, b), codegen


@intrinsic
def vhsum4(typingctx, a, b, c, d):
    """The 4-lane vector [sum(a), sum(b), sum(c), sum(d)] of four vectors' lane sums: halves added
    until 4 lanes remain, then two rounds of pairwise sums (x86: vextract/vadd, then vhaddps)."""
    if not (isinstance(a, _F32Vec) and a == b == c == d) or a.n & (a.n - 1):
        return None  # power-of-two widths

    def codegen(context, builder, sig, args):
        i32 = ir.IntType(32)

        def shuffle(u, v, lanes):
            return builder.shuffle_vector(u, v, ir.Constant(ir.VectorType(i32, len(lanes)), lanes))

        def pair_sums(u, v):  # [u0 + u1, u2 + u3, v0 + v1, v2 + v3] of two 4-lane vectors
            return builder.fadd(shuffle(u, v, [0, 2, 4, 6]), shuffle(u, v, [1, 3, 5, 7]))
        vs, m = list(args), a.n
        if m == 1:
            r = ir.Constant(ir.VectorType(ir.FloatType(), 4), ir.Undefined)
            for k, v in enumerate(vs):
                r = builder.insert_element(r, builder.extract_element(v, ir.Constant(i32, 0)), ir.Constant(i32, k))
            return r
        while m > 4:
            m //= 2
            vs = [builder.fadd(shuffle(v, v, list(range(m))), shuffle(v, v, list(range(m, 2 * m)))) for v in vs]
        if m == 2:  # [a0, a1, b0, b1] and [c0, c1, d0, d1]: one round of pair sums
            return pair_sums(shuffle(vs[0], vs[1], [0, 1, 2, 3]), shuffle(vs[2], vs[3], [0, 1, 2, 3]))
        return pair_sums(pair_sums(vs[0], vs[1]), pair_sums(vs[2], vs[3]))
    return _F32Vec(4)(a, b, c, d), codegen


@intrinsic
def vlen(typingctx, v):
    """The lane count of v, as a compile-time constant."""
    if not isinstance(v, _F32Vec):
        return None

    def codegen(context, builder, sig, args):
        return ir.Constant(ir.IntType(64), v.n)
    return types.int64(v), codegen


@intrinsic
def vtranspose16(typingctx, rowaddr, r0, coff, out, o0, ostride):
    """out.flat[o0 + c * ostride: + 16] = column c of the 16 x 16 block whose row q is the 16 floats
    at byte address rowaddr[r0 + q] + coff: 16 loads, a 4-stage butterfly of 64 two-input
    shuffles (stage h swaps the off-diagonal h x h blocks), 16 stores."""
    if not (isinstance(rowaddr, types.Array) and isinstance(out, types.Array) and out.dtype == types.float32):
        return None

    def codegen(context, builder, sig, args):
        addrs, r0_, coff_, out_, o0_, ostride_ = args
        vt = ir.VectorType(ir.FloatType(), 16)
        base = context.make_array(sig.args[0])(context, builder, addrs).data
        rows = []
        for q in range(16):
            a = builder.load(builder.gep(base, [builder.add(r0_, ir.Constant(r0_.type, q))]))
            rows.append(builder.load(builder.inttoptr(builder.add(a, coff_), vt.as_pointer()), align=4))
        for h in (8, 4, 2, 1):
            new = list(rows)
            for i in range(16):
                if i & h == 0:
                    mi = [c if c & h == 0 else 16 + c - h for c in range(16)]
                    mj = [c + h if c & h == 0 else 16 + c for c in range(16)]
                    for k, m in ((i, mi), (i + h, mj)):
                        mask = ir.Constant(ir.VectorType(ir.IntType(32), 16), m)
                        new[k] = builder.shuffle_vector(rows[i], rows[i + h], mask)
            rows = new
        data = context.make_array(sig.args[3])(context, builder, out_).data
        for c in range(16):
            off = builder.add(o0_, builder.mul(ir.Constant(o0_.type, c), ostride_))
            builder.store(rows[c], builder.bitcast(builder.gep(data, [off]), vt.as_pointer()), align=4)
        return context.get_dummy_value()
    return types.none(rowaddr, types.int64, types.int64, out, types.int64, types.int64), codegen


@intrinsic
def addr_of(typingctx, arr):
    """The byte address of arr's first element."""
    if not isinstance(arr, types.Array):
        return None

    def codegen(context, builder, sig, args):
        return builder.ptrtoint(context.make_array(sig.args[0])(context, builder, args[0]).data, ir.IntType(64))
    return types.int64(arr), codegen


@intrinsic
def f64_from_bits(typingctx, bits):
    """The float64 whose IEEE bit pattern is the integer `bits` (a bitcast: vectorises, unlike a
    round trip through memory)."""
    if not isinstance(bits, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        return builder.bitcast(context.cast(builder, args[0], sig.args[0], types.int64), ir.DoubleType())
    return types.float64(bits), codegen


@intrinsic
def f32_ptr(typingctx, addr):
    """The byte address addr as a float32* (for numba.carray views of the caller's arrays)."""
    if not isinstance(addr, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        return builder.inttoptr(args[0], ir.PointerType(ir.FloatType()))
    return types.CPointer(types.float32)(addr), codegen


# --------------------------------------------------------------------------- float32 or bf16 data

_ELEMS = {types.float32: ir.FloatType(), types.uint16: ir.IntType(16)}


def _elem_of(ty):
    """LLVM element type of an array type (or of `like`) holding float32 or bf16 bits, else None."""
    return _ELEMS.get(ty.dtype) if isinstance(ty, types.Array) else None


def _as_float(builder, value, elem):
    return emit_widen(builder, value) if elem == ir.IntType(16) else value


@intrinsic
def vget(typingctx, arr, idx, w):
    """arr.flat[idx: idx + w] as a float vector; arr float32, or uint16 bf16 bits (widened)."""
    n, elem = _width(w), _elem_of(arr)
    if n is None or elem is None:
        return None

    def codegen(context, builder, sig, args):
        data = context.make_array(sig.args[0])(context, builder, args[0]).data
        p = builder.bitcast(builder.gep(data, [args[1]]), ir.PointerType(ir.VectorType(elem, n)))
        return _as_float(builder, builder.load(p, align=2), elem)
    return _F32Vec(n)(arr, idx, w), codegen


@intrinsic
def vget_addr(typingctx, like, addr, w):
    """The w elements of like's dtype (float32, or uint16 bf16 bits) at byte address addr, as a float vector."""
    n, elem = _width(w), _elem_of(like)
    if n is None or elem is None or not isinstance(addr, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        p = builder.inttoptr(args[1], ir.PointerType(ir.VectorType(elem, n)))
        return _as_float(builder, builder.load(p, align=2), elem)
    return _F32Vec(n)(like, addr, w), codegen


@intrinsic
def vput(typingctx, arr, idx, v):
    """arr.flat[idx: idx + n] = v; arr float32, or uint16 (v rounded to bf16 bits)."""
    elem = _elem_of(arr)
    if not isinstance(v, _F32Vec) or elem is None:
        return None

    def codegen(context, builder, sig, args):
        data = context.make_array(sig.args[0])(context, builder, args[0]).data
        p = builder.bitcast(builder.gep(data, [args[1]]), ir.PointerType(ir.VectorType(elem, v.n)))
        builder.store(emit_round(builder, args[2]) if elem == ir.IntType(16) else args[2], p, align=2)
        return context.get_dummy_value()
    return types.none(arr, idx, v), codegen


@intrinsic
def ptr_like(typingctx, like, addr):
    """The byte address addr as a pointer to like's dtype (for numba.carray views)."""
    if _elem_of(like) is None or not isinstance(addr, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        return builder.inttoptr(args[1], ir.PointerType(_elem_of(like)))
    return types.CPointer(like.dtype)(like, addr), codegen


def put(arr, i, v):
    """arr[i] = float32 v; into a uint16 array as bf16 bits (rounded) (njit only)."""
    raise NotImplementedError("put is callable from njit code only")


@overload(put, inline="always")
def _put_impl(arr, i, v):
    if _elem_of(arr) is None:
        return None
    if arr.dtype == types.uint16:
        def put_bf16(arr, i, v):
            arr[i] = round_bf16(np.float32(v))
        return put_bf16

    def put_f32(arr, i, v):
        arr[i] = v
    return put_f32
