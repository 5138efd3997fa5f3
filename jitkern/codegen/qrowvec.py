"""Intrinsics for row-wise quantized embedding rows (FBGEMM's fused layout) in njit code.

A row of a uint8 table holds its quantized values followed by a per-row scale and bias: 8-bit
rows D bytes then float32 scale, bias; 4-bit rows ceil(D/2) bytes (element 2k in the low
nibble of byte k, 2k + 1 in the high one) then float16 scale, bias. A value dequantizes to
scale * q + bias. The accumulate step is FBGEMM's own, acc = fma(scale, q, acc + bias), so that
pooled results round exactly as torch's quantized embedding bags do.
"""
from __future__ import annotations

from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

from .rowvec import _is_table, _row_ptr

_F32 = ir.FloatType()
_I8, _I16, _I32 = ir.IntType(8), ir.IntType(16), ir.IntType(32)


def _fma(builder, a, b, c):
    """llvm.fma on floats or float vectors: one rounding, whatever the target (a libcall without FMA)."""
    ty = a.type
    name = f"llvm.fma.v{ty.count}f32" if isinstance(ty, ir.VectorType) else "llvm.fma.f32"
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ty, [ty, ty, ty]), name)
    return builder.call(fn, [a, b, c])


def _half_to_float(builder, h):
    """float16 bits (i16 or <n x i16>) -> the float32 of equal value, with integer ops (no F16C needed)
    and no float32 denormal on the way (so a DAZ flag set by someone else cannot zero a tiny scale):
    normal halves by rebiasing the exponent bits, subnormal ones as m * 2**-24. (Inf/NaN come out finite.)"""
    vec = isinstance(h.type, ir.VectorType)

    def const(ty, v):
        return ir.Constant(ir.VectorType(ty, h.type.count), [v] * h.type.count) if vec else ir.Constant(ty, v)
    i32 = ir.VectorType(_I32, h.type.count) if vec else _I32
    f32 = ir.VectorType(_F32, h.type.count) if vec else _F32
    w = builder.zext(h, i32)
    normal = builder.add(builder.shl(builder.and_(w, const(_I32, 0x7FFF)), const(_I32, 13)),
                         const(_I32, (127 - 15) << 23))
    mant = builder.and_(w, const(_I32, 0x3FF))
    sub = builder.bitcast(builder.fmul(builder.sitofp(mant, f32), const(_F32, 2.0 ** -24)), i32)
    is_sub = builder.icmp_unsigned("==", builder.and_(w, const(_I32, 0x7C00)), const(_I32, 0))
    sign = builder.shl(builder.and_(w, const(_I32, 0x8000)), const(_I32, 16))
    return builder.bitcast(builder.or_(builder.select(is_sub, sub, normal), sign), f32)


def _byte_ptr(context, builder, aryty, ary, rowty, row, offty, off):
    base = _row_ptr(context, builder, aryty, ary, rowty, row)
    return cgutils.pointer_add(builder, base, context.cast(builder, off, offty, types.intp))


@intrinsic
def fma_f32(typingctx, a, b, c):
    """a * b + c in float32 with one rounding (llvm.fma)."""
    if not all(isinstance(x, (types.Float, types.Integer)) for x in (a, b, c)):
        return None

    def codegen(context, builder, sig, args):
        vals = [context.cast(builder, v, t, types.float32) for v, t in zip(args, sig.args)]
        return _fma(builder, *vals)
    return types.float32(a, b, c), codegen


@intrinsic
def row_scale_bias(typingctx, table, r, offset, bits):
    """(scale, bias) of row r of a quantized uint8 table, stored `offset` bytes into the row:
    float32 pair for bits == 8, float16 pair (returned as float32) for bits == 4; unaligned loads."""
    if not (_is_table(table, (types.uint8,)) and isinstance(r, types.Integer) and isinstance(offset, types.Integer)
            and isinstance(bits, types.IntegerLiteral) and bits.literal_value in (4, 8)):
        return None
    half = bits.literal_value == 4
    retty = types.UniTuple(types.float32, 2)

    def codegen(context, builder, sig, args):
        tty, rty, oty, _ = sig.args
        ptr = _byte_ptr(context, builder, tty, args[0], rty, args[1], oty, args[2])
        if half:
            pair = _half_to_float(builder, builder.load(builder.bitcast(ptr, ir.VectorType(_I16, 2).as_pointer()),
                                                        align=1))
        else:
            pair = builder.load(builder.bitcast(ptr, ir.VectorType(_F32, 2).as_pointer()), align=1)
        vals = [builder.extract_element(pair, ir.Constant(_I32, k)) for k in (0, 1)]
        return context.make_tuple(builder, retty, vals)
    return retty(table, r, offset, bits), codegen


def _load_q(builder, ptr, n, four_bit):
    """<n x float> of the quantized values at ptr: n bytes, or for 4-bit n / 2 bytes whose low nibbles
    (the even elements) come first and high nibbles (the odd ones) after (see qrow_fma)."""
    if not four_bit:
        raw = builder.load(builder.bitcast(ptr, ir.VectorType(_I8, n).as_pointer()), align=1)
        return builder.uitofp(raw, ir.VectorType(_F32, n))
    m = n // 2
    vw = ir.VectorType(_I32, m)
    raw = builder.zext(builder.load(builder.bitcast(ptr, ir.VectorType(_I8, m).as_pointer()), align=1), vw)
    lo = builder.and_(raw, ir.Constant(vw, [15] * m))
    hi = builder.lshr(raw, ir.Constant(vw, [4] * m))
    both = builder.shuffle_vector(lo, hi, ir.Constant(ir.VectorType(_I32, n), list(range(n))))
    return builder.sitofp(both, ir.VectorType(_F32, n))


def _acc_ptr(context, builder, accty, acc, n):
    return builder.bitcast(_row_ptr(context, builder, accty, acc, types.intp, context.get_constant(types.intp, 0)),
                           ir.VectorType(_F32, n).as_pointer())


def _splat(builder, value, n):
    vec = ir.VectorType(_F32, n)
    one = builder.insert_element(ir.Constant(vec, ir.Undefined), value, ir.Constant(_I32, 0))
    return builder.shuffle_vector(one, ir.Constant(vec, ir.Undefined), ir.Constant(ir.VectorType(_I32, n), [0] * n))


def _qrow_args_ok(acc, n, bits):
    return (isinstance(n, types.IntegerLiteral) and isinstance(bits, types.IntegerLiteral)
            and bits.literal_value in (4, 8) and _is_table(acc, (types.float32,))
            and not (bits.literal_value == 4 and n.literal_value % 2))


@intrinsic
def qrow_fma(typingctx, acc, table, r, scale, bias, n, bits):
    """acc[0, :n] = fma(scale, q, acc[0, :n] + bias) over row r's n quantized values q, as whole
    <n x float> operations; n (even for 4-bit) a compile-time constant.

    4-bit rows accumulate in "split" order, even elements first, odd ones after: the nibbles then
    need no interleaving per row, only the pooled result once (qrow_store)."""
    if not (_qrow_args_ok(acc, n, bits) and _is_table(table, (types.uint8,)) and isinstance(r, types.Integer)
            and isinstance(scale, types.Float) and isinstance(bias, types.Float)):
        return None
    size, four = n.literal_value, bits.literal_value == 4

    def codegen(context, builder, sig, args):
        if size == 0:  # the generic kernel's never-taken branch
            return context.get_dummy_value()
        accty, tty, rty, sty, bty = sig.args[:5]
        aptr = _acc_ptr(context, builder, accty, args[0], size)
        q = _load_q(builder, _row_ptr(context, builder, tty, args[1], rty, args[2]), size, four)
        s = _splat(builder, context.cast(builder, args[3], sty, types.float32), size)
        b = _splat(builder, context.cast(builder, args[4], bty, types.float32), size)
        builder.store(_fma(builder, s, q, builder.fadd(builder.load(aptr, align=4), b)), aptr, align=4)
        return context.get_dummy_value()
    return types.none(acc, table, r, scale, bias, n, bits), codegen


@intrinsic
def qrow_store(typingctx, out, i, acc, scale, n, bits):
    """out[i, :n] = acc[0, :n] * scale, acc in qrow_fma's order for `bits` (4-bit: re-interleaved)."""
    if not (_qrow_args_ok(acc, n, bits) and _is_table(out, (types.float32,)) and isinstance(i, types.Integer)
            and isinstance(scale, types.Float)):
        return None
    size, four = n.literal_value, bits.literal_value == 4

    def codegen(context, builder, sig, args):
        if size == 0:  # the generic kernel's never-taken branch
            return context.get_dummy_value()
        outty, ity, accty, sty, _, _ = sig.args
        v = builder.load(_acc_ptr(context, builder, accty, args[2], size), align=4)
        if four:
            m = size // 2
            v = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, size),
                                                         [k // 2 + (m if k % 2 else 0) for k in range(size)]))
        v = builder.fmul(v, _splat(builder, context.cast(builder, args[3], sty, types.float32), size))
        dst = builder.bitcast(_row_ptr(context, builder, outty, args[0], ity, args[1]),
                              ir.VectorType(_F32, size).as_pointer())
        builder.store(v, dst, align=4)
        return context.get_dummy_value()
    return types.none(out, i, acc, scale, n, bits), codegen
