"""Row-vector intrinsics for embedding kernels: whole-row <n x float> ops with compile-time n.

With D a compile-time constant, the accumulator lives in a stack array of D floats that LLVM
promotes to vector registers, and each row is added by one <D x float> operation (a heap
array would be kept in memory: LLVM cannot prove it does not alias the table). Rows may be
float32 or bf16 bits (uint16, moved into the high half on load by a widening scheme, a
compile-time constant: SHUFFLE interleaves the bits with zeros, SHIFT zero-extends and shifts;
the same bits either way, the faster depends on the CPU's shuffle and extend units). The
Split-SGD update may also keep rows in lane order (UNPACK<w>: see lane_order), its fp32
operand permuted to match by row_to_lanes.
"""
from __future__ import annotations

from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

_F32 = ir.FloatType()
SHUFFLE, SHIFT, PARITY = 0, 1, 2          # bf16 widening schemes
# PARITY widens the even elements of a row by a 32-bit shift, the odd ones by a mask: no shuffle,
# the row lands in parity order (evens, then odds), which row_set_from undoes once per bag
WIDEN_SCHEMES = {"shuffle": SHUFFLE, "shift": SHIFT, "parity": PARITY}
# Split-SGD schemes: UNPACK<w> joins the halves with 16-bit unpacks within 128-bit lanes and
# splits them with 32->16-bit packs, which undo each other, on vectors of w floats
SPLIT_SCHEMES = {"shuffle": SHUFFLE, "shift": SHIFT, "unpack8": 8, "unpack16": 16}


@intrinsic
def stack_f32(typingctx, n):
    """A (1, n) float32 scratch array with compile-time n, on the stack (promoted to registers)."""
    if not isinstance(n, types.IntegerLiteral):
        return None
    size = max(n.literal_value, 1)
    arrty = types.Array(types.float32, 2, "C")

    def codegen(context, builder, sig, args):
        ptr = cgutils.alloca_once(builder, _F32, size=size)
        ary = context.make_array(arrty)(context, builder)
        intp = context.get_value_type(types.intp)
        context.populate_array(ary, data=ptr, shape=[ir.Constant(intp, 1), ir.Constant(intp, size)],
                               strides=[ir.Constant(intp, 4 * size), ir.Constant(intp, 4)],
                               itemsize=ir.Constant(intp, 4), meminfo=None)
        return ary._getvalue()
    return arrty(n), codegen


def _is_table(a, dtypes=(types.float32, types.uint16)):
    """A 2-D array of dense rows (the row ops load and store whole vectors): C-contiguous, or of
    any layout for uint16 bf16 halves (a pairs SplitBF16Table's halves are row-strided views, whose
    elements SplitBF16Table checks are adjacent)."""
    return (isinstance(a, types.Array) and a.ndim == 2 and a.dtype in dtypes
            and (a.layout == "C" or a.dtype == types.uint16))


def _row_ptr(context, builder, aryty, ary, rowty, row):
    a = context.make_array(aryty)(context, builder, ary)
    stride0 = cgutils.unpack_tuple(builder, a.strides, 2)[0]
    return cgutils.pointer_add(builder, a.data, builder.mul(context.cast(builder, row, rowty, types.intp), stride0))


def parity_order(n: int) -> list:
    """The element of a row of n that position p of a PARITY-widened row holds (n even)."""
    return [*range(0, n, 2), *range(1, n, 2)]


def _load_row(builder, ptr, dtype, n, scheme=SHUFFLE):
    """<n x float> from a float32 row, or from a uint16 row of bf16 bits (moved into the high half;
    PARITY: in parity_order)."""
    if dtype == types.uint16 and scheme == PARITY and n % 2 == 0:
        i32v = ir.VectorType(ir.IntType(32), n // 2)
        pairs = builder.load(builder.bitcast(ptr, i32v.as_pointer()), align=2)
        even = builder.shl(pairs, ir.Constant(i32v, [16] * (n // 2)))
        odd = builder.and_(pairs, ir.Constant(i32v, [0xFFFF0000] * (n // 2)))
        both = builder.shuffle_vector(even, odd, ir.Constant(ir.VectorType(ir.IntType(32), n), list(range(n))))
        return builder.bitcast(both, ir.VectorType(_F32, n))
    if dtype == types.uint16:
        scheme = SHIFT if scheme == PARITY else scheme
        raw = builder.load(builder.bitcast(ptr, ir.VectorType(ir.IntType(16), n).as_pointer()), align=2)
        return builder.bitcast(_join_halves(builder, ir.Constant(ir.VectorType(ir.IntType(16), n), [0] * n), raw,
                                            n, scheme), ir.VectorType(_F32, n))
    return builder.load(builder.bitcast(ptr, ir.VectorType(_F32, n).as_pointer()), align=4)


def lane_width(n: int, width: int) -> int:
    """The vector width an UNPACK<width> row of n uses: the widest that pairs of vectors tile (0:
    none, the row is not made of whole 128-bit lanes; such rows join and split by SHIFT)."""
    while width > 4 and n % (2 * width):
        width //= 2
    return width if n % (2 * width) == 0 else 0


def in_lanes(n: int, scheme: int) -> bool:
    """Whether Split-SGD scheme `scheme` keeps rows of n in lane order (else: row order, SHIFT's
    or SHUFFLE's way)."""
    return scheme in SPLIT_SCHEMES.values() and scheme not in (SHUFFLE, SHIFT) and n > 0 and lane_width(n, scheme) > 0


def lane_order(n: int, width: int) -> list:
    """The element of a row of n that position p of an UNPACK<width> joined row holds.

    A 16-bit unpack of two vectors of `width` halves interleaves them within each 128-bit lane:
    of every 2 * width elements, the low unpack holds the even groups of 4 and the high one the
    odd groups. The 32->16-bit pack of those two vectors restores row order, so only the fp32
    operand is permuted to match."""
    width = lane_width(n, width)
    order = []
    for c in range(0, n, 2 * width):
        for half in (0, 1):
            order += [c + 4 * (2 * (r // 4) + half) + r % 4 for r in range(width)]
    return order


def _join_halves(builder, lo, hi, n, scheme):
    """<n x i32> (hi << 16) | lo from two <n x i16> vectors (UNPACK<w>: in lane_order)."""
    if scheme not in (SHUFFLE, SHIFT):
        order = lane_order(n, scheme)
        lanes = ir.VectorType(ir.IntType(32), 2 * n)
        both = builder.shuffle_vector(lo, hi, ir.Constant(lanes, [v for e in order for v in (e, n + e)]))
        return builder.bitcast(both, ir.VectorType(ir.IntType(32), n))
    if scheme == SHIFT:
        i32v = ir.VectorType(ir.IntType(32), n)
        high = builder.shl(builder.zext(hi, i32v), ir.Constant(i32v, [16] * n))
        return builder.or_(high, builder.zext(lo, i32v))
    lanes = ir.VectorType(ir.IntType(32), 2 * n)  # element m: 16-bit lanes 2m (lo) and 2m + 1 (hi)
    both = builder.shuffle_vector(lo, hi, ir.Constant(lanes, [k // 2 + (n if k % 2 else 0) for k in range(2 * n)]))
    return builder.bitcast(both, ir.VectorType(ir.IntType(32), n))


def _split_halves(builder, bits, n, scheme):
    """(hi, lo) <n x i16> halves of <n x i32> bits (UNPACK<w>: bits in lane_order, halves in row order)."""
    i16v = ir.VectorType(ir.IntType(16), n)
    if scheme not in (SHUFFLE, SHIFT):
        i32v = ir.VectorType(ir.IntType(32), n)
        where = {e: p for p, e in enumerate(lane_order(n, scheme))}
        mask = ir.Constant(ir.VectorType(ir.IntType(32), n), [2 * where[e] for e in range(n)])
        # zero upper halves, then the low words: the pattern of an unsigned-saturating pack
        halves = [builder.bitcast(v, ir.VectorType(ir.IntType(16), 2 * n))
                  for v in (builder.lshr(bits, ir.Constant(i32v, [16] * n)),
                            builder.and_(bits, ir.Constant(i32v, [0xFFFF] * n)))]
        return tuple(builder.shuffle_vector(h, h, mask) for h in halves)
    if scheme == SHIFT:
        i32v = ir.VectorType(ir.IntType(32), n)
        return builder.trunc(builder.lshr(bits, ir.Constant(i32v, [16] * n)), i16v), builder.trunc(bits, i16v)
    lanes = builder.bitcast(bits, ir.VectorType(ir.IntType(16), 2 * n))
    halves = ir.VectorType(ir.IntType(32), n)
    return (builder.shuffle_vector(lanes, lanes, ir.Constant(halves, [2 * k + 1 for k in range(n)])),
            builder.shuffle_vector(lanes, lanes, ir.Constant(halves, [2 * k for k in range(n)])))


def _scheme(widen, schemes=WIDEN_SCHEMES):
    """The scheme of a compile-time `widen` argument, or None if it is not one of `schemes`."""
    if isinstance(widen, types.IntegerLiteral) and widen.literal_value in schemes.values():
        return widen.literal_value
    return None


def _splat(context, builder, value, valty, n):
    vec = ir.VectorType(_F32, n)
    one = builder.insert_element(ir.Constant(vec, ir.Undefined), context.cast(builder, value, valty, types.float32),
                                 ir.Constant(ir.IntType(32), 0))
    return builder.shuffle_vector(one, ir.Constant(vec, ir.Undefined),
                                  ir.Constant(ir.VectorType(ir.IntType(32), n), [0] * n))


def _col_ptr(context, builder, aryty, ary, rowty, row, col, colty):
    """Pointer to ary[row, col] of a C-contiguous 2-D array."""
    base = _row_ptr(context, builder, aryty, ary, rowty, row)
    elem = context.get_value_type(aryty.dtype).as_pointer()
    return builder.gep(builder.bitcast(base, elem), [context.cast(builder, col, colty, types.intp)])


def _row_op(accumulate):
    """dst[i, :n] (+)= scale * src[j, c:c + n] as whole <n x float> operations (plain IEEE mul and
    add)."""
    def impl(typingctx, dst, i, src, j, c, scale, n, widen):
        if not (isinstance(n, types.IntegerLiteral) and _is_table(dst, (types.float32,)) and _is_table(src)
                and isinstance(c, types.Integer) and isinstance(scale, (types.Float, types.Integer))
                and _scheme(widen) is not None):
            return None
        size, scheme = n.literal_value, _scheme(widen)

        def codegen(context, builder, sig, args):
            if size == 0:  # the generic kernel's never-taken branch
                return context.get_dummy_value()
            dsty, ity, srcty, jty, cty, sty = sig.args[:6]
            dptr = builder.bitcast(_row_ptr(context, builder, dsty, args[0], ity, args[1]),
                                   ir.VectorType(_F32, size).as_pointer())
            src = _col_ptr(context, builder, srcty, args[2], jty, args[3], args[4], cty)
            val = builder.fmul(_load_row(builder, src, srcty.dtype, size, scheme),
                               _splat(context, builder, args[5], sty, size))
            if accumulate:
                val = builder.fadd(builder.load(dptr, align=4), val)
            builder.store(val, dptr, align=4)
            return context.get_dummy_value()
        return types.none(dst, i, src, j, c, scale, n, widen), codegen
    return impl


row_axpy = intrinsic(_row_op(accumulate=True))
row_axpy.__doc__ = """dst[i, :n] += scale * src[j, c:c + n] (src float32, or bf16 bits widened by scheme `widen`); n and
widen compile-time constants."""
row_set = intrinsic(_row_op(accumulate=False))
row_set.__doc__ = """dst[i, :n] = scale * src[j, c:c + n] (src float32, or bf16 bits widened by scheme `widen`); n and
widen compile-time constants."""


@intrinsic
def row_copy(typingctx, dst, i, src, j, n):
    """dst[i, :n] = +0.0 + src[j, :n] (src float32, or uint16 bf16 bits widened into the high half):
    a one-row sum, -0.0 made +0.0 as a sum from +0.0 makes it. n a compile-time constant, 16
    elements at a time, each chunk stored before the next is loaded: a whole <n x float> value
    would be held in (and, for wide rows, spilled from) the vector registers, and a plain loop
    gets an aliasing check."""
    if not (isinstance(n, types.IntegerLiteral) and _is_table(dst, (types.float32,)) and _is_table(src)):
        return None
    size = n.literal_value

    def codegen(context, builder, sig, args):
        dsty, ity, srcty, jty = sig.args[:4]
        item = ir.IntType(16) if srcty.dtype == types.uint16 else _F32
        drow = builder.bitcast(_row_ptr(context, builder, dsty, args[0], ity, args[1]), _F32.as_pointer())
        srow = builder.bitcast(_row_ptr(context, builder, srcty, args[2], jty, args[3]), item.as_pointer())
        c = 0
        while c < size:
            chunk = min(16, size - c)
            at = ir.Constant(ir.IntType(64), c)
            v = _load_row(builder, builder.gep(srow, [at]), srcty.dtype, chunk, SHIFT)
            v = builder.fadd(ir.Constant(ir.VectorType(_F32, chunk), [0.0] * chunk), v)
            builder.store(v, builder.bitcast(builder.gep(drow, [at]), ir.VectorType(_F32, chunk).as_pointer()), align=4)
            c += chunk
        return context.get_dummy_value()
    return types.none(dst, i, src, j, n), codegen


@intrinsic
def row_split_axpy(typingctx, hi, lo, i, src, j, scale, n, widen):
    """BF16 Split-SGD on one row: w = the float32 whose halves are hi[i, :n] and lo[i, :n];
    w += scale * src[j, :n] (plain IEEE mul and add); hi[i], lo[i] = w's halves again. All as
    <n x ...> vector operations; n and the scheme joining and splitting the halves (`widen`)
    compile-time constants. With an UNPACK scheme src[j] is in lane order (row_to_lanes): the
    caller permutes each source row once, not once per update it feeds."""
    if not (isinstance(n, types.IntegerLiteral) and _is_table(hi, (types.uint16,)) and _is_table(lo, (types.uint16,))
            and _is_table(src, (types.float32,)) and isinstance(scale, (types.Float, types.Integer))
            and _scheme(widen, SPLIT_SCHEMES) is not None):
        return None
    size, scheme = n.literal_value, _scheme(widen, SPLIT_SCHEMES)
    if not in_lanes(size, scheme) and scheme not in (SHUFFLE, SHIFT):
        scheme = SHIFT
    # UNPACK<w> works one pair of vectors at a time, stored before the next is loaded: a whole
    # row's operands at once would not fit in the registers
    chunk = size if scheme in (SHUFFLE, SHIFT) else 2 * lane_width(size, scheme)

    def codegen(context, builder, sig, args):
        if size == 0:  # the generic kernel's never-taken branch
            return context.get_dummy_value()
        hity, loty, ity, srcty, jty, sty = sig.args[:6]
        i16p, f32p = ir.IntType(16).as_pointer(), _F32.as_pointer()
        hrow = builder.bitcast(_row_ptr(context, builder, hity, args[0], ity, args[2]), i16p)
        lrow = builder.bitcast(_row_ptr(context, builder, loty, args[1], ity, args[2]), i16p)
        srow = builder.bitcast(_row_ptr(context, builder, srcty, args[3], jty, args[4]), f32p)
        scale = _splat(context, builder, args[5], sty, chunk)
        i16v = ir.VectorType(ir.IntType(16), chunk).as_pointer()
        for c in range(0, size, chunk):
            at = ir.Constant(ir.IntType(64), c)
            hptr, lptr = (builder.bitcast(builder.gep(row, [at]), i16v) for row in (hrow, lrow))
            joined = _join_halves(builder, builder.load(lptr, align=2), builder.load(hptr, align=2), chunk, scheme)
            src = _load_row(builder, builder.gep(srow, [at]), types.float32, chunk)
            out = builder.bitcast(builder.fadd(builder.bitcast(joined, ir.VectorType(_F32, chunk)),
                                               builder.fmul(src, scale)), ir.VectorType(ir.IntType(32), chunk))
            new_hi, new_lo = _split_halves(builder, out, chunk, scheme)
            builder.store(new_hi, hptr, align=2)
            builder.store(new_lo, lptr, align=2)
        return context.get_dummy_value()
    return types.none(hi, lo, i, src, j, scale, n, widen), codegen


@intrinsic
def row_set_from(typingctx, dst, i, c, src, j, scale, n, widen):
    """dst[i, c:c + n] = scale * src[j, :n] for a src row in the order bf16 widening `widen` left it
    (PARITY: parity_order, put back in row order; else unchanged); n and widen compile-time."""
    if not (isinstance(n, types.IntegerLiteral) and _is_table(dst, (types.float32,)) and isinstance(c, types.Integer)
            and _is_table(src, (types.float32,)) and isinstance(scale, (types.Float, types.Integer))
            and _scheme(widen) is not None):
        return None
    size, scheme = n.literal_value, _scheme(widen)
    where = {e: p for p, e in enumerate(parity_order(size))}
    back = [where[e] for e in range(size)] if scheme == PARITY and size % 2 == 0 else None

    def codegen(context, builder, sig, args):
        if size == 0:
            return context.get_dummy_value()
        dsty, ity, cty, srcty, jty, sty = sig.args[:6]
        v = _load_row(builder, _row_ptr(context, builder, srcty, args[3], jty, args[4]), types.float32, size)
        if back:
            v = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(ir.IntType(32), size), back))
        dptr = builder.bitcast(_col_ptr(context, builder, dsty, args[0], ity, args[1], args[2], cty),
                               ir.VectorType(_F32, size).as_pointer())
        builder.store(builder.fmul(v, _splat(context, builder, args[5], sty, size)), dptr, align=4)
        return context.get_dummy_value()
    return types.none(dst, i, c, src, j, scale, n, widen), codegen


@intrinsic
def row_to_lanes(typingctx, dst, i, src, j, scale, n, widen):
    """dst[i, :n] = scale * src[j, :n] in the lane order of Split-SGD scheme `widen` (unchanged for
    SHUFFLE and SHIFT); n and widen compile-time constants (a constant scale of 1 folds away)."""
    if not (isinstance(n, types.IntegerLiteral) and _is_table(dst, (types.float32,))
            and _is_table(src, (types.float32,)) and isinstance(scale, (types.Float, types.Integer))
            and _scheme(widen, SPLIT_SCHEMES) is not None):
        return None
    size, scheme = n.literal_value, _scheme(widen, SPLIT_SCHEMES)
    order = lane_order(size, scheme) if in_lanes(size, scheme) else None
    chunk = 2 * lane_width(size, scheme) if order else size

    def codegen(context, builder, sig, args):
        if size == 0:
            return context.get_dummy_value()
        dsty, ity, srcty, jty, sty = sig.args[:5]
        drow, srow = (builder.bitcast(_row_ptr(context, builder, ty, a, rty, r), _F32.as_pointer())
                      for ty, a, rty, r in ((dsty, args[0], ity, args[1]), (srcty, args[2], jty, args[3])))
        factor = _splat(context, builder, args[4], sty, chunk)
        for c in range(0, size, chunk):
            at = ir.Constant(ir.IntType(64), c)
            v = builder.fmul(_load_row(builder, builder.gep(srow, [at]), types.float32, chunk), factor)
            if order:
                v = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(ir.IntType(32), chunk), order[:chunk]))
            builder.store(v, builder.bitcast(builder.gep(drow, [at]), ir.VectorType(_F32, chunk).as_pointer()), align=4)
        return context.get_dummy_value()
    return types.none(dst, i, src, j, scale, n, widen), codegen


@intrinsic
def row_sum_squares(typingctx, x, i, n):
    """sum(x[i, :n] ** 2) in float64 (n a compile-time constant): widened and squared as one
    <n x double> vector, then summed pairwise, halves first (an order fixed by n)."""
    if not (isinstance(n, types.IntegerLiteral) and _is_table(x, (types.float32,))):
        return None
    size = n.literal_value

    def codegen(context, builder, sig, args):
        f64 = ir.DoubleType()
        if size == 0:  # the generic kernel's never-taken branch
            return ir.Constant(f64, 0.0)
        xty, ity, _ = sig.args
        v = builder.fpext(_load_row(builder, _row_ptr(context, builder, xty, args[0], ity, args[1]), types.float32,
                                    size), ir.VectorType(f64, size))
        v = builder.fmul(v, v)
        width, extra = size, []
        while width > 1:
            if width % 2:  # an odd tail element waits to be added last
                extra.append(builder.extract_element(v, ir.Constant(ir.IntType(32), width - 1)))
                width -= 1
            half = width // 2
            lo = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(ir.IntType(32), half), list(range(half))))
            hi = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(ir.IntType(32), half),
                                                          list(range(half, width))))
            v, width = builder.fadd(lo, hi), half
        total = builder.extract_element(v, ir.Constant(ir.IntType(32), 0))
        for e in reversed(extra):
            total = builder.fadd(total, e)
        return total
    return types.float64(x, i, n), codegen
