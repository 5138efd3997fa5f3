"""bf16 code generation: fp32 -> bf16 rounding, bf16 -> fp32 widening, and the vdpbf16ps register tile.

Rounding is round-to-nearest-even on the bits, NaN-preserving: a NaN keeps its sign and payload
high bits and gets the quiet bit (so a signalling NaN whose payload sits in the low half never
becomes inf); denormals round like every other value. One IR emitter (`emit_round`) serves the
scalar intrinsic `round_bf16` and the tile's epilogue, so every kernel rounds identically.
(vcvtne2ps2bf16 is not used: it flushes denormal inputs to zero.)

The tile computes one MR x NR block of C with `vdpbf16ps` (AVX512_BF16), which adds to each fp32
lane the dot product of a pair of bf16 values from each operand, so K is consumed in pairs:

    acc = (load ? Cin[0:MR, 0:NR] : 0) + sum_kp  a_pair[r, kp] . b_pair[kp, 0:NR]
    if epi: acc = relu?(acc + bias?[0:NR])
    Cout[0:MR, 0:NR] = acc (fp32) or round_bf16(acc) (bf16)

A panel: the 32-bit pair (a[r, 2kp], a[r, 2kp+1]) at pa + kp * ak + r * ar (uint16 units), broadcast
to all lanes; a row-major A is read in place (ak = 2, ar = its row length). B panel: k-pair kp at
pb + kp * ldb holds NR columns x 2 k values, (b[2kp, j], b[2kp+1, j]) adjacent, so one zmm covers 16
columns. An odd kc ends with a single k: A's element is loaded alone (its partner is 0) and B's
packed partner must be 0 (padded) or finite.
"""
from __future__ import annotations

from dataclasses import dataclass

from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from .build import jit

# bf16 register tile (MR rows, NR columns) per ISA with a bf16 dot product: MR x NR/16 zmm
# accumulators plus NR/16 B vectors and a broadcast A pair within the 32 zmm registers
TILES_BF16 = {"avx512": (8, 32)}
LANES = 16  # fp32 lanes of a zmm; a B vector holds 2 * LANES bf16 values

_F32 = ir.FloatType()
_I64 = ir.IntType(64)
_I32 = ir.IntType(32)
_I16 = ir.IntType(16)
_I1 = ir.IntType(1)


class _BFloat(ir.Type):
    """LLVM's `bfloat` (llvmlite's IR builder has no type for it)."""

    def __str__(self):
        return "bfloat"

    def __eq__(self, other):
        return isinstance(other, _BFloat)

    def __hash__(self):
        return hash("bfloat")


_BF16 = _BFloat()


def bf16_tile_for(isa: str, has_dot: bool) -> tuple[int, int] | None:
    """(MR, NR) of the vdpbf16ps tile where the target has the bf16 dot product, else None."""
    return TILES_BF16.get(isa) if has_dot else None


def bf16_tile_code(mr: int, nr: int) -> int:
    """A bf16 tile's compile-time shape as one int for `dp_tile` (a literal in njit code)."""
    if nr % LANES or not (0 < mr < 256 and 0 < nr < 256):
        raise ValueError(f"bad bf16 tile {mr}x{nr}")
    return mr | nr << 8


# --------------------------------------------------------------------------- rounding and widening


def _splat(ty, value):
    """A constant of integer type ty (or a vector of it) holding `value` in every lane."""
    if isinstance(ty, ir.VectorType):
        return ir.Constant(ty, [value] * ty.count)
    return ir.Constant(ty, value)


def _like(ty, elem):
    """elem, or a vector of elem with ty's lane count."""
    return ir.VectorType(elem, ty.count) if isinstance(ty, ir.VectorType) else elem


def emit_round(bld: ir.IRBuilder, v):
    """bf16 bits (i16, or <n x i16>) of float v (or <n x float>): RNE, NaN quieted and kept."""
    i32 = _like(v.type, _I32)
    bits = bld.bitcast(v, i32)
    hi = bld.lshr(bits, _splat(i32, 16))
    odd = bld.and_(hi, _splat(i32, 1))
    rounded = bld.lshr(bld.add(bld.add(bits, _splat(i32, 0x7FFF)), odd), _splat(i32, 16))
    quiet = bld.or_(hi, _splat(i32, 0x40))
    res = bld.select(bld.fcmp_unordered("uno", v, v), quiet, rounded)
    return bld.trunc(res, _like(v.type, _I16))


def emit_widen(bld: ir.IRBuilder, h):
    """float (or <n x float>) value of bf16 bits h (i16, or <n x i16>): exact."""
    i32 = _like(h.type, _I32)
    return bld.bitcast(bld.shl(bld.zext(h, i32), _splat(i32, 16)), _like(h.type, _F32))


@intrinsic
def round_bf16(typingctx, x):
    """The bf16 bits (uint16) nearest to float32 x, ties to even, NaN kept NaN (njit only)."""
    if x != types.float32:
        return None

    def codegen(context, builder, sig, args):
        return emit_round(builder, args[0])
    return types.uint16(x), codegen


@intrinsic
def widen_bf16(typingctx, h):
    """The float32 value of bf16 bits h (uint16) (njit only)."""
    if h != types.uint16:
        return None

    def codegen(context, builder, sig, args):
        return emit_widen(builder, args[0])
    return types.float32(h), codegen


# --------------------------------------------------------------------------- the tile function


def _dpbf16(module):
    name = "llvm.x86.avx512bf16.dpbf16ps.512"
    fn = module.globals.get(name)
    if fn is None:
        vf, vb = ir.VectorType(_F32, LANES), ir.VectorType(_BF16, 2 * LANES)
        fn = ir.Function(module, ir.FunctionType(vf, [vf, vb, vb]), name=name)
    return fn


@dataclass
class _Tile:
    """What the emitters of one tile function share: builder, shape, vdpbf16ps."""
    bld: ir.IRBuilder
    mr: int
    nv: int              # zmm vectors per tile row: NR / 16
    dp: ir.Function

    vec = ir.VectorType(_F32, LANES)
    pair_vec = ir.VectorType(_BF16, 2 * LANES)

    def grid(self, make):
        return [[make(r, v) for v in range(self.nv)] for r in range(self.mr)]

    def ptr(self, base, off, ty):
        """base + off (elements of base's type) as a pointer to ty."""
        return self.bld.bitcast(self.bld.gep(base, [off]), ty.as_pointer())

    def broadcast_pair(self, word):
        """An i32 (two bf16) in every lane, as <32 x bfloat>."""
        bld, i32v = self.bld, ir.VectorType(_I32, LANES)
        undef = ir.Constant(i32v, ir.Undefined)
        x = bld.insert_element(undef, word, ir.Constant(_I32, 0))
        x = bld.shuffle_vector(x, undef, ir.Constant(i32v, [0] * LANES))
        return bld.bitcast(x, self.pair_vec)

    def step(self, acc, a_words, pb_at):
        """acc[r][v] += a pair r . B vector v (pb_at: pointer to the k pair's first B element)."""
        bvec = [self.bld.load(self.ptr(pb_at, ir.Constant(_I64, v * 2 * LANES), self.pair_vec), align=2)
                for v in range(self.nv)]
        out = []
        for r in range(self.mr):
            a = self.broadcast_pair(a_words[r])
            out.append([self.bld.call(self.dp, [acc[r][v], a, bvec[v]]) for v in range(self.nv)])
        return out


def _phis(t: _Tile, incoming):
    """Accumulator phis joining `incoming` = [(predecessor block, accumulators)]."""
    acc = t.grid(lambda r, v: t.bld.phi(t.vec))
    for block, values in incoming:
        for r in range(t.mr):
            for v in range(t.nv):
                acc[r][v].add_incoming(values[r][v], block)
    return acc


def _emit_pairs(t: _Tile, blocks, init, npairs, a, b):
    """acc += the k pairs kp < npairs, from `init` = [(predecessor block, accumulators)];
    a = (pa, ak, row offsets), b = (pb, ldb), blocks = (head, body, exit). Returns the exit's acc."""
    b_head, b_body, b_exit = blocks
    pa, ak, roff = a
    pb, ldb = b
    bld = t.bld
    bld.position_at_end(b_head)
    kp = bld.phi(_I64, name="kp")
    for block, _ in init:
        kp.add_incoming(ir.Constant(_I64, 0), block)
    acc = _phis(t, init)
    bld.cbranch(bld.icmp_signed("<", kp, npairs), b_body, b_exit)
    bld.position_at_end(b_body)
    abase = bld.mul(kp, ak)
    words = [bld.load(t.ptr(pa, bld.add(abase, roff[r]), _I32), align=2) for r in range(t.mr)]
    new = t.step(acc, words, bld.gep(pb, [bld.mul(kp, ldb)]))
    for r in range(t.mr):
        for v in range(t.nv):
            acc[r][v].add_incoming(new[r][v], b_body)
    kp.add_incoming(bld.add(kp, ir.Constant(_I64, 1)), b_body)
    bld.branch(b_head)
    return acc


def _emit_odd_k(t: _Tile, acc, npairs, a, b):
    """acc += the last, unpaired k: A's element zero-extended to a pair (partner 0)."""
    pa, ak, roff = a
    pb, ldb = b
    bld = t.bld
    abase = bld.mul(npairs, ak)
    words = [bld.zext(bld.load(bld.gep(pa, [bld.add(abase, roff[r])]), align=2), _I32) for r in range(t.mr)]
    return t.step(acc, words, bld.gep(pb, [bld.mul(npairs, ldb)]))


def _emit_epilogue(t: _Tile, acc, pbias, use_bias, relu):
    """Per-column bias, then ReLU that keeps NaN (x < 0 -> 0, else x); runtime flags."""
    bld = t.bld
    zero = ir.Constant(t.vec, [0.0] * LANES)
    bias = [bld.load(t.ptr(pbias, ir.Constant(_I64, v * LANES), t.vec), align=4) for v in range(t.nv)]
    done = t.grid(lambda r, v: bld.select(use_bias, bld.fadd(acc[r][v], bias[v]), acc[r][v]))
    return [[bld.select(relu, bld.select(bld.fcmp_ordered("<", x, zero), zero, x), x) for x in row] for row in done]


def _emit_store(t: _Tile, acc, pc, ldc, out_bf16):
    """Cout = acc, as fp32 or rounded to bf16."""
    bld = t.bld
    for r in range(t.mr):
        row = bld.mul(ir.Constant(_I64, r), ldc)
        for v in range(t.nv):
            off = bld.add(row, ir.Constant(_I64, v * LANES))
            if out_bf16:
                bld.store(emit_round(bld, acc[r][v]), t.ptr(pc, off, ir.VectorType(_I16, LANES)), align=2)
            else:
                bld.store(acc[r][v], t.ptr(pc, off, t.vec), align=4)


def _declare(module, name, out_bf16):
    """fn(kc, pa, ak, ar, pb, ldb, pcin, ldcin, pcout, ldcout, load, epi, pbias, use_bias, relu)."""
    fp, hp = _F32.as_pointer(), _I16.as_pointer()
    args = [_I64, hp, _I64, _I64, hp, _I64, fp, _I64, hp if out_bf16 else fp, _I64, _I1, _I1, fp, _I1, _I1]
    fn = ir.Function(module, ir.FunctionType(ir.VoidType(), args), name=name)
    fn.linkage = "internal"
    fn.attributes.add("alwaysinline")
    fn.attributes.add("nounwind")
    for i in (1, 4, 12):  # pa, pb, pbias (Cin and Cout may be the same memory)
        fn.args[i].add_attribute("noalias")
    return fn


def _emit_tile_function(module, mr: int, nr: int, out_bf16: bool):
    """Define (once per LLVM module) the always-inline bf16 tile function; return it."""
    name = f"jitkern_dptile_{mr}x{nr}_{'bf16' if out_bf16 else 'f32'}"
    fn = module.globals.get(name)
    if fn is not None:
        return fn
    fn = _declare(module, name, out_bf16)
    kc, pa, ak, ar, pb, ldb, pcin, ldcin, pcout, ldcout, load, epi, pbias, use_bias, relu = fn.args
    names = ("entry", "load_c", "k_head", "k_body", "k_done", "odd", "tail", "epilogue", "store")
    entry, b_load, b_head, b_body, b_done, b_odd, b_tail, b_epi, b_store = (fn.append_basic_block(n) for n in names)
    t = _Tile(ir.IRBuilder(entry), mr, nr // LANES, _dpbf16(module))
    bld = t.bld
    roff = [bld.mul(ir.Constant(_I64, r), ar) for r in range(mr)]  # row offsets, loop-invariant
    npairs = bld.lshr(kc, ir.Constant(_I64, 1))
    bld.cbranch(load, b_load, b_head)
    bld.position_at_end(b_load)
    loaded = t.grid(lambda r, v: bld.load(
        t.ptr(pcin, bld.add(bld.mul(ir.Constant(_I64, r), ldcin), ir.Constant(_I64, v * LANES)), t.vec), align=4))
    bld.branch(b_head)
    zero = t.grid(lambda r, v: ir.Constant(t.vec, [0.0] * LANES))
    acc = _emit_pairs(t, (b_head, b_body, b_done), [(entry, zero), (b_load, loaded)], npairs,
                      (pa, ak, roff), (pb, ldb))
    bld.position_at_end(b_done)
    bld.cbranch(bld.trunc(kc, _I1), b_odd, b_tail)
    bld.position_at_end(b_odd)
    odd = _emit_odd_k(t, acc, npairs, (pa, ak, roff), (pb, ldb))
    bld.branch(b_tail)
    bld.position_at_end(b_tail)
    acc = _phis(t, [(b_done, acc), (b_odd, odd)])
    bld.cbranch(epi, b_epi, b_store)
    bld.position_at_end(b_epi)
    done = _emit_epilogue(t, acc, pbias, use_bias, relu)
    bld.branch(b_store)
    bld.position_at_end(b_store)
    _emit_store(t, _phis(t, [(b_tail, acc), (b_epi, done)]), pcout, ldcout, out_bf16)
    bld.ret_void()
    return fn


# --------------------------------------------------------------------------- the numba intrinsics


def _is_operand(ty, dtypes, strides: int) -> bool:
    """ty is the type of an (array, offset, *strides) tuple: flat array of one of dtypes, integers."""
    return (isinstance(ty, types.BaseTuple) and len(ty) == 2 + strides and isinstance(ty.types[0], types.Array)
            and ty.types[0].dtype in dtypes and all(isinstance(x, types.Integer) for x in ty.types[1:]))


def _operand(context, builder, ty, value):
    """(pointer to array[offset], [strides as int64]) of an (array, offset, *strides) tuple."""
    parts = [builder.extract_value(value, i) for i in range(len(ty))]
    ints = [context.cast(builder, v, t, types.int64) for v, t in zip(parts[1:], ty.types[1:])]
    data = context.make_array(ty.types[0])(context, builder, parts[0]).data
    return builder.gep(data, [ints[0]]), ints[1:]


_U16, _F32S = (types.uint16,), (types.float32,)


# a module-level intrinsic taking the tile shape as a literal int: drivers close over plain ints
# only, so numba's disk cache finds them in a new process (see simd.fma_tile)
@intrinsic(prefer_literal=True)
def dp_tile(typingctx, code, kc, a, b, cin, cout, bias, flags):
    """dp_tile(code, kc, a, b, cin, cout, bias, flags): one bf16 MR x NR tile (see the module doc).

    a = (uint16 array, offset, pair stride, row stride), b = (uint16 array, offset, pair-row stride),
    cin = (float32 array, offset, row stride), cout = (float32 or uint16 array, offset, row stride),
    bias = (float32 array, offset); flags = (load, epi, use_bias, relu); code = bf16_tile_code(...).
    """
    if not isinstance(code, types.IntegerLiteral) or not isinstance(kc, types.Integer):
        return None
    if not (_is_operand(a, _U16, 2) and _is_operand(b, _U16, 1) and _is_operand(cin, _F32S, 1)
            and _is_operand(cout, _U16 + _F32S, 1) and _is_operand(bias, _F32S, 0)):
        return None
    if not (isinstance(flags, types.BaseTuple) and len(flags) == 4
            and all(isinstance(f, types.Boolean) for f in flags.types)):
        return None
    mr, nr = code.literal_value & 255, code.literal_value >> 8 & 255
    out_bf16 = cout.types[0].dtype == types.uint16

    def codegen(context, builder, signature, args):
        _, kc_, a_, b_, cin_, cout_, bias_, flags_ = args
        tys = signature.args
        pa, (ak, ar) = _operand(context, builder, tys[2], a_)
        pb, (ldb,) = _operand(context, builder, tys[3], b_)
        pcin, (ldcin,) = _operand(context, builder, tys[4], cin_)
        pcout, (ldcout,) = _operand(context, builder, tys[5], cout_)
        pbias, () = _operand(context, builder, tys[6], bias_)
        fl = [context.cast(builder, builder.extract_value(flags_, i), ty, types.boolean)
              for i, ty in enumerate(tys[7].types)]
        fn = _emit_tile_function(builder.module, mr, nr, out_bf16)
        builder.call(fn, [context.cast(builder, kc_, tys[1], types.int64), pa, ak, ar, pb, ldb,
                          pcin, ldcin, pcout, ldcout, fl[0], fl[1], pbias, fl[2], fl[3]])
        return context.get_dummy_value()
    return types.void(code, kc, a, b, cin, cout, bias, flags), codegen


@intrinsic
def dp_peak_loop(typingctx, n, x):
    """12 independent vdpbf16ps chains run n times on x's bits; returns a lane (keeps the loop live).
    The bf16 dot-product peak: 12 * n instructions of 16 lanes x 2 products x 2 flops."""
    if not isinstance(n, types.Integer) or x != types.float32:
        return None

    def codegen(context, builder, sig, args):
        t = _Tile(builder, 12, 1, _dpbf16(builder.module))
        count = context.cast(builder, args[0], sig.args[0], types.int64)
        word = builder.bitcast(args[1], _I32)
        pre = builder.block
        head, body, done = (builder.append_basic_block(s) for s in ("dp_head", "dp_body", "dp_done"))
        builder.branch(head)
        builder.position_at_end(head)
        i = builder.phi(_I64)
        i.add_incoming(ir.Constant(_I64, 0), pre)
        acc = [builder.phi(t.vec) for _ in range(12)]
        for a in acc:
            a.add_incoming(ir.Constant(t.vec, [0.0] * LANES), pre)
        builder.cbranch(builder.icmp_signed("<", i, count), body, done)
        builder.position_at_end(body)
        pair = t.broadcast_pair(word)
        for a in acc:
            a.add_incoming(builder.call(t.dp, [a, pair, pair]), body)
        i.add_incoming(builder.add(i, ir.Constant(_I64, 1)), body)
        builder.branch(head)
        builder.position_at_end(done)
        total = acc[0]
        for a in acc[1:]:
            total = builder.fadd(total, a)
        return builder.extract_element(total, ir.Constant(_I32, 0))
    return types.float32(n, x), codegen


@jit(inline="always")
def bf16_tile_dims(code):
    """(MR, NR) of a bf16_tile_code in njit code."""
    return code & 255, code >> 8 & 255
