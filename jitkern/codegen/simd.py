"""FMA register-tile microkernels: LLVM IR emitted with llvmlite, inlined into njit drivers.

The GEMM microkernel computes one MR x NR tile of C from packed panels:

    acc = (load ? C[0:MR, 0:NR] : 0) + sum_k  ap[0:MR, k] (outer) bp[k, 0:NR]
    if epi: acc = relu?(acc + bias?[0:NR])        (use_bias / relu: runtime flags)
            then by the mask mode, M and Mb laid out as C (M float32, Mb bytes):
            MASK_F32:  acc = acc where M[0:MR, 0:NR] > 0 else +0.0  (a ReLU's backward by its output)
            MASK_BYTE: acc = acc where Mb[0:MR, 0:NR] != 0 else +0.0 (by a mask MASK_OUT wrote)
            MASK_OUT:  Mb[0:MR, 0:NR] = acc > 0                     (the mask of this ReLU's output)
    C[0:MR, 0:NR] = acc

ap is an A micro-panel with element (r, k) at k * ak + r * ar (packed k-major: ak = MR, ar = 1;
or A read in place with its own strides); bp a B micro-panel, k-major with row stride
ldb (NR when packed, or B's own row stride when B is read in place); C is addressed through a
flat array with row stride ldc. The MR x NR accumulators live in
vector registers for the whole K loop, so C is loaded and stored once per call. Vector width
comes from the target ISA (16 floats AVX-512, 8 AVX2, 4 NEON); with ISA "scalar" (unknown
hosts, or JITKERN_ISA=scalar) the same IR is emitted with width-1 vectors, i.e. portable scalar
code that LLVM lowers (and may auto-vectorise) for any CPU.
"""
from __future__ import annotations

import platform
from dataclasses import dataclass

from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from .build import jit
from .target import VECTOR_WIDTH

# register tile (MR rows, NR columns) per ISA: the accumulators plus the NR/width B vectors and a
# broadcast A value must fit in the register file (32 zmm / 16 ymm / 32 NEON q registers).
# "scalar" emits width-1 vectors: plain scalar FMAs that LLVM may still SLP-vectorise.
TILES = {"avx512": (8, 32), "avx2": (6, 16), "neon": (8, 12), "scalar": (4, 4)}
# rows of the short tile (same NR) that ends a row block whose height leaves a remainder of them
# (gemm_kernel.tail_tiles): as many accumulators as the FMA pipes keep in flight (two pipes of
# four cycles: 8 vectors, 4 x 16 on AVX2), so a 32-row C runs as 4 x 6 + 2 x 4 rows, not 6 x 6
SHORT_ROWS = {"avx512": 4, "avx2": 4, "neon": 4, "scalar": 2}

_F32 = ir.FloatType()
_I64 = ir.IntType(64)
_I32 = ir.IntType(32)
_I8 = ir.IntType(8)
_I1 = ir.IntType(1)

# the tile's mask modes (see the module doc)
NO_MASK, MASK_F32, MASK_BYTE, MASK_OUT = 0, 1, 2, 3
# a bit or'ed into the mask mode: C's vectors are stored non-temporally (straight to memory, no
# read of the lines first); C's tile rows must then be aligned to the vector width, and the caller
# orders the stores with store_fence() before other threads read C
STREAM = 4


def tile_for(isa: str) -> tuple[int, int, int]:
    """(MR, NR, vector width) of the register tile used on `isa`."""
    return (*TILES[isa], VECTOR_WIDTH[isa])


def short_rows(isa: str) -> int:
    """Rows of `isa`'s short tail tile (SHORT_ROWS)."""
    return SHORT_ROWS[isa]


def tile_code(mr: int, nr: int, vw: int) -> int:
    """Pack a tile's compile-time shape into one int for `fma_tile` (a literal in njit code)."""
    if nr % vw or not (0 < mr < 256 and 0 < nr < 256 and 0 < vw < 256):
        raise ValueError(f"bad tile {mr}x{nr} for vector width {vw}")
    return mr | nr << 8 | vw << 16


def _decode(code: int):
    return code & 255, code >> 8 & 255, code >> 16 & 255


@jit(inline="always")
def tile_dims(code):
    """(MR, NR) of a tile_code in njit code: constants once LLVM folds the literal code."""
    return code & 255, code >> 8 & 255


# --------------------------------------------------------------------------- the tile function


@dataclass
class _Tile:
    """What the emitters of one tile function share: builder, shape, C addressing, llvm.fma."""
    bld: ir.IRBuilder
    mr: int
    nv: int              # vectors per tile row: NR / vw
    vw: int
    pc: ir.Argument      # C's first element
    ldc: ir.Argument     # C's row stride
    fma: ir.Function

    @property
    def vec(self):
        return ir.VectorType(_F32, self.vw)

    def c_ptr(self, r, v, base=None):
        """Pointer to the v-th vector of row r of C (or of a matrix laid out as C from `base`)."""
        bld = self.bld
        off = bld.add(bld.mul(ir.Constant(_I64, r), self.ldc), ir.Constant(_I64, v * self.vw))
        return bld.bitcast(bld.gep(self.pc if base is None else base, [off]), self.vec.as_pointer())

    def byte_ptr(self, r, v, base):
        """Pointer to the v-th vector of row r of a byte matrix laid out as C from `base`."""
        bld = self.bld
        off = bld.add(bld.mul(ir.Constant(_I64, r), self.ldc), ir.Constant(_I64, v * self.vw))
        return bld.bitcast(bld.gep(base, [off]), ir.VectorType(_I8, self.vw).as_pointer())

    def grid(self, make):
        """[[make(r, v) for each vector v of row r] for each row r]."""
        return [[make(r, v) for v in range(self.nv)] for r in range(self.mr)]


def _declare(module, name, vw):
    """The tile function fn(kc, pa, ak, ar, pb, ldb, pc, ldc, load, epi, pbias, use_bias, relu,
    pmask, pmaskb, mask_mode), always inlined, its pointers noalias; and llvm.fma on <vw x float>."""
    fp, vec = _F32.as_pointer(), ir.VectorType(_F32, vw)
    fnty = ir.FunctionType(ir.VoidType(), [_I64, fp, _I64, _I64, fp, _I64, fp, _I64, _I1, _I1, fp, _I1, _I1,
                                           fp, _I8.as_pointer(), _I64])
    fn = ir.Function(module, fnty, name=name)
    fn.linkage = "internal"
    fn.attributes.add("alwaysinline")
    fn.attributes.add("nounwind")
    for i in (1, 4, 6, 10):  # pa, pb, pc, pbias
        fn.args[i].add_attribute("noalias")
    fma = module.globals.get(f"llvm.fma.v{vw}f32")
    if fma is None:
        fma = ir.Function(module, ir.FunctionType(vec, [vec, vec, vec]), name=f"llvm.fma.v{vw}f32")
    return fn, fma


def _emit_k_loop(t: _Tile, blocks, init, kc, a, b):
    """acc += a[:, k] (outer) b[k, :] for k < kc, from `init` = [(predecessor block, accumulators)].

    Accumulators are loop-carried phis, so they stay in registers. a = (row pointers, k stride),
    b = (pb, ldb); blocks = (head, body, exit). Returns the accumulators as seen in the exit block.
    Each A element is addressed from its row's loop-invariant pointer: row addresses derived from
    one another would chain MR dependent adds per k, as long as the FMAs of that k on AVX2.
    """
    b_head, b_body, b_exit = blocks
    rows, ak = a
    pb, ldb = b
    bld, vec, vw = t.bld, t.vec, t.vw
    bld.position_at_end(b_head)
    k = bld.phi(_I64, name="k")
    for block, _ in init:
        k.add_incoming(ir.Constant(_I64, 0), block)
    acc = t.grid(lambda r, v: bld.phi(vec))
    for block, values in init:
        for r in range(t.mr):
            for v in range(t.nv):
                acc[r][v].add_incoming(values[r][v], block)
    bld.cbranch(bld.icmp_signed("<", k, kc), b_body, b_exit)

    bld.position_at_end(b_body)
    bbase = bld.mul(k, ldb)
    bvec = [bld.load(bld.bitcast(bld.gep(pb, [bld.add(bbase, ir.Constant(_I64, v * vw))]), vec.as_pointer()),
                     align=4) for v in range(t.nv)]
    abase = bld.mul(k, ak)
    undef, bmask = ir.Constant(vec, ir.Undefined), ir.Constant(ir.VectorType(_I32, vw), [0] * vw)
    new = []
    for r in range(t.mr):
        x = bld.load(bld.gep(rows[r], [abase]), align=4)
        xs = bld.shuffle_vector(bld.insert_element(undef, x, ir.Constant(_I32, 0)), undef, bmask)
        new.append([bld.call(t.fma, [xs, bvec[v], acc[r][v]]) for v in range(t.nv)])
    k_next = bld.add(k, ir.Constant(_I64, 1))
    for r in range(t.mr):
        for v in range(t.nv):
            acc[r][v].add_incoming(new[r][v], b_body)
    k.add_incoming(k_next, b_body)
    bld.branch(b_head)
    return acc


def _emit_epilogue(t: _Tile, acc, pbias, use_bias, relu, blocks):
    """Per-column bias, then ReLU that keeps NaN (x < 0 -> 0, else x), on the registers, each step
    behind one branch on its runtime flag (LLVM turns a select per accumulator on a flag from
    memory into a branch per accumulator). blocks = (bias, relu check, relu, done): the builder is
    in the block to branch from, and ends in `done` with the values returned. The bias pointer
    must be valid for NR floats even without use_bias."""
    b_bias, b_check, b_relu, b_done = blocks
    bld, vec, vw = t.bld, t.vec, t.vw
    zero = ir.Constant(vec, [0.0] * vw)
    come = bld.block
    bld.cbranch(use_bias, b_bias, b_check)
    bld.position_at_end(b_bias)
    bias = [bld.load(bld.bitcast(bld.gep(pbias, [ir.Constant(_I64, v * vw)]), vec.as_pointer()), align=4)
            for v in range(t.nv)]
    added = t.grid(lambda r, v: bld.fadd(acc[r][v], bias[v]))
    bld.branch(b_check)
    bld.position_at_end(b_check)
    biased = _join(t, [(come, acc), (b_bias, added)])
    bld.cbranch(relu, b_relu, b_done)
    bld.position_at_end(b_relu)
    cut = [[bld.select(bld.fcmp_ordered("<", x, zero), zero, x) for x in row] for row in biased]
    bld.branch(b_done)
    bld.position_at_end(b_done)
    return _join(t, [(b_check, biased), (b_relu, cut)])


def _join(t: _Tile, incoming):
    """Phis, in the current block, of the accumulators arriving from [(predecessor, values)]."""
    bld = t.bld
    out = t.grid(lambda r, v: bld.phi(t.vec))
    for block, values in incoming:
        for r in range(t.mr):
            for v in range(t.nv):
                out[r][v].add_incoming(values[r][v], block)
    return out


def _emit_mask(t: _Tile, acc, pmask, byte):
    """acc where the mask tile (C's layout, from pmask) is > 0 (an ordered compare: a NaN output
    masks too, as ops' relu_keep), or where the byte mask tile is nonzero (byte: pmask is bytes, a
    quarter of the lines to read), else +0.0: a ReLU's backward."""
    bld, vec, vw = t.bld, t.vec, t.vw
    zero = ir.Constant(vec, [0.0] * vw)
    if byte:
        none = ir.Constant(ir.VectorType(_I8, vw), [0] * vw)
        keep = t.grid(lambda r, v: bld.icmp_unsigned("!=", bld.load(t.byte_ptr(r, v, pmask), align=1), none))
    else:
        keep = t.grid(lambda r, v: bld.fcmp_ordered(">", bld.load(t.c_ptr(r, v, pmask), align=4), zero))
    return [[bld.select(keep[r][v], acc[r][v], zero) for v in range(t.nv)] for r in range(t.mr)]


def _emit_mask_out(t: _Tile, acc, pmaskb):
    """Mb = acc > 0 as bytes 1 / 0 (NaN: 0), C's layout from pmaskb: the mask MASK_BYTE reads."""
    bld, vw = t.bld, t.vw
    zero, byte = ir.Constant(t.vec, [0.0] * vw), ir.VectorType(_I8, vw)
    for r in range(t.mr):
        for v in range(t.nv):
            bld.store(bld.zext(bld.fcmp_ordered(">", acc[r][v], zero), byte), t.byte_ptr(r, v, pmaskb), align=1)


def _emit_store(t: _Tile, incoming, stream, blocks):
    """C = the accumulators arriving from `incoming` = [(predecessor block, accumulators)]; if
    `stream`, by aligned non-temporal stores. blocks = (plain stores, streaming stores, exit)."""
    bld = t.bld
    outs = _join(t, incoming)
    b_plain, b_stream, b_exit = blocks
    bld.cbranch(stream, b_stream, b_plain)
    nontemporal = bld.module.add_metadata([ir.Constant(_I32, 1)])
    for block, nt in ((b_plain, False), (b_stream, True)):
        bld.position_at_end(block)
        for r in range(t.mr):
            for v in range(t.nv):
                st = bld.store(outs[r][v], t.c_ptr(r, v), align=4 * t.vw if nt else 4)
                if nt:
                    st.set_metadata("nontemporal", nontemporal)
        bld.branch(b_exit)
    bld.position_at_end(b_exit)


def _emit_tile_function(module, mr: int, nr: int, vw: int):
    """Define (once per LLVM module) the always-inline tile function; return it.

    Three K loops, picked per call: A's rows adjacent (ar = 1: a packed micro-panel, or a
    transposed A read in place; one pointer, constant row offsets), A's rows read in place
    (ak = 1: a pointer per row, constant k offsets), and any other strides."""
    name = f"jitkern_tile_{mr}x{nr}_v{vw}"
    fn = module.globals.get(name)
    if fn is not None:
        return fn
    fn, fma = _declare(module, name, vw)
    kc, pa, ak, ar, pb, ldb, pc, ldc, load, epi, pbias, use_bias, relu, pmask, pmaskb, mode_bits = fn.args
    names = ("entry", "load_c", "k_pick", "k_pick2", "kp_head", "kp_body", "kr_head", "kr_body", "kg_head",
             "kg_body", "k_done", "epilogue", "bias", "relu_check", "relu", "epilogue_done", "mask", "mask_b",
             "mask_out", "store", "store_plain", "store_stream", "done")
    (entry, b_load, b_pick, b_pick2, bp_head, bp_body, br_head, br_body, bg_head, bg_body, b_tail, b_epi,
     b_bias, b_check, b_relu, b_epi_done, b_mask, b_maskb, b_mask_out, b_store, *b_stores) = (
        fn.append_basic_block(n) for n in names)
    t = _Tile(ir.IRBuilder(entry), mr, nr // vw, vw, pc, ldc, fma)
    bld = t.bld
    mask_mode = bld.and_(mode_bits, ir.Constant(_I64, STREAM - 1))
    stream = bld.icmp_signed("!=", bld.and_(mode_bits, ir.Constant(_I64, STREAM)), ir.Constant(_I64, 0))
    fp, one = _F32.as_pointer(), ir.Constant(_I64, 1)
    opaque = ir.InlineAsm(ir.FunctionType(fp, [fp]), "", "=r,0")
    # loop-invariant row pointers, opaque: loop strength reduction would otherwise derive each row's
    # address from the previous row's, a chain of MR dependent adds per k (as long as the FMAs on AVX2)
    rows = [bld.call(opaque, [bld.gep(pa, [bld.mul(ir.Constant(_I64, r), ar)])]) for r in range(mr)]
    bld.cbranch(load, b_load, b_pick)
    bld.position_at_end(b_load)
    loaded = t.grid(lambda r, v: bld.load(t.c_ptr(r, v), align=4))
    bld.branch(b_pick)
    bld.position_at_end(b_pick)
    start = _join(t, [(entry, t.grid(lambda r, v: ir.Constant(t.vec, [0.0] * vw))), (b_load, loaded)])
    consecutive = [bld.gep(pa, [ir.Constant(_I64, r)]) for r in range(mr)]
    bld.cbranch(bld.icmp_signed("==", ar, one), bp_head, b_pick2)
    bld.position_at_end(b_pick2)
    bld.cbranch(bld.icmp_signed("==", ak, one), br_head, bg_head)
    ends = []
    for head, body, pick, a in ((bp_head, bp_body, b_pick, (consecutive, ak)),
                                (br_head, br_body, b_pick2, (rows, one)), (bg_head, bg_body, b_pick2, (rows, ak))):
        acc = _emit_k_loop(t, (head, body, b_tail), [(pick, start)], kc, a, (pb, ldb))
        ends.append((head, acc))
    bld.position_at_end(b_tail)
    acc = _join(t, ends)
    bld.cbranch(epi, b_epi, b_store)
    bld.position_at_end(b_epi)
    done = _emit_epilogue(t, acc, pbias, use_bias, relu, (b_bias, b_check, b_relu, b_epi_done))
    # branches, not selects: a mask is not touched unless used
    modes = bld.switch(mask_mode, b_store)
    for mode, block in ((MASK_F32, b_mask), (MASK_BYTE, b_maskb), (MASK_OUT, b_mask_out)):
        modes.add_case(ir.Constant(_I64, mode), block)
    bld.position_at_end(b_mask)
    masked = _emit_mask(t, done, pmask, False)
    bld.branch(b_store)
    bld.position_at_end(b_maskb)
    masked_b = _emit_mask(t, done, pmaskb, True)
    bld.branch(b_store)
    bld.position_at_end(b_mask_out)
    _emit_mask_out(t, done, pmaskb)
    bld.branch(b_store)
    bld.position_at_end(b_store)
    _emit_store(t, [(b_tail, acc), (b_epi_done, done), (b_mask, masked), (b_maskb, masked_b), (b_mask_out, done)],
                stream, b_stores)
    bld.ret_void()
    return fn


# --------------------------------------------------------------------------- the numba intrinsic

_OPERANDS = {"a": 2, "b": 1, "c": 1, "bias": 0}  # strides after (array, offset)


def _is_operand(ty, strides: int) -> bool:
    """ty is the type of an (array, offset, *strides) tuple: flat float32 array, integers."""
    return (isinstance(ty, types.BaseTuple) and len(ty) == 2 + strides and isinstance(ty.types[0], types.Array)
            and ty.types[0].dtype == types.float32 and all(isinstance(x, types.Integer) for x in ty.types[1:]))


def _is_mask(ty) -> bool:
    """ty is the type of a (float32 array, uint8 array, offset) tuple."""
    return (isinstance(ty, types.BaseTuple) and len(ty) == 3 and all(isinstance(a, types.Array) for a in ty.types[:2])
            and ty.types[0].dtype == types.float32 and ty.types[1].dtype == types.uint8
            and isinstance(ty.types[2], types.Integer))


def _element(context, builder, arr_ty, arr, off_ty, off):
    """Pointer to flat array arr[off]."""
    data = context.make_array(arr_ty)(context, builder, arr).data
    return builder.gep(data, [context.cast(builder, off, off_ty, types.int64)])


def _operand(context, builder, ty, value):
    """(pointer to array[offset], [strides as int64]) of an (array, offset, *strides) tuple."""
    parts = [builder.extract_value(value, i) for i in range(len(ty))]
    ints = [context.cast(builder, v, t, types.int64) for v, t in zip(parts[2:], ty.types[2:])]
    return _element(context, builder, ty.types[0], parts[0], ty.types[1], parts[1]), ints


@intrinsic
def store_fence(typingctx):
    """Order this thread's earlier non-temporal (STREAM) stores before its later stores: at the end
    of a task, so that threads reading C after the parallel loop see them (x86's locked operations,
    which the loop's join uses, need not order them)."""
    def codegen(context, builder, signature, args):
        if platform.machine().lower() in ("x86_64", "amd64", "i686", "x86"):
            fn = builder.module.globals.get("llvm.x86.sse.sfence")
            if fn is None:
                fn = ir.Function(builder.module, ir.FunctionType(ir.VoidType(), []), name="llvm.x86.sse.sfence")
            builder.call(fn, [])
        else:
            builder.fence("seq_cst")
        return context.get_dummy_value()
    return types.void(), codegen


# One module-level intrinsic whose tile shape arrives as a literal int: numba's disk cache keys a
# caller on its bytecode and closure values, so drivers must close over plain ints (tile_code),
# never over per-process objects such as intrinsics (whose pickles differ between processes).
@intrinsic(prefer_literal=True)
def fma_tile(typingctx, code, kc, a, b, c, bias, flags, mask):
    """fma_tile(code, kc, a, b, c, bias, flags, mask): one MR x NR register tile of C (see the
    module doc).

    a = (array, offset, k stride, row stride), b = (array, offset, row stride), c = (array, offset,
    row stride), bias = (array, offset): flat float32 arrays and integers; mask = (flat float32
    M, flat uint8 Mb, offset: C's, the row stride c's); flags = (load, epi, use_bias, relu)
    booleans and the mask mode (an integer, | STREAM for non-temporal stores of C); code =
    tile_code(...) must be a compile-time constant.
    """
    operands = {"a": a, "b": b, "c": c, "bias": bias}
    if not isinstance(code, types.IntegerLiteral) or not isinstance(kc, types.Integer):
        return None
    if not (all(_is_operand(operands[k], n) for k, n in _OPERANDS.items()) and _is_mask(mask)):
        return None
    if not (isinstance(flags, types.BaseTuple) and len(flags) == 5
            and all(isinstance(f, types.Boolean) for f in flags.types[:4]) and isinstance(flags[4], types.Integer)):
        return None
    mr, nr, vw = _decode(code.literal_value)

    def codegen(context, builder, signature, args):
        _, kc_, a_, b_, c_, bias_, flags_, mask_ = args
        tys = signature.args
        pa, (ak, ar) = _operand(context, builder, tys[2], a_)
        pb, (ldb,) = _operand(context, builder, tys[3], b_)
        pc, (ldc,) = _operand(context, builder, tys[4], c_)
        pbias, () = _operand(context, builder, tys[5], bias_)
        off = builder.extract_value(mask_, 2)
        pmask, pmaskb = (_element(context, builder, tys[7][i], builder.extract_value(mask_, i), tys[7][2], off)
                         for i in (0, 1))
        load, epi, use_bias, relu = (context.cast(builder, builder.extract_value(flags_, i), tys[6][i], types.boolean)
                                     for i in range(4))
        mode = context.cast(builder, builder.extract_value(flags_, 4), tys[6][4], types.int64)
        fn = _emit_tile_function(builder.module, mr, nr, vw)
        builder.call(fn, [context.cast(builder, kc_, tys[1], types.int64), pa, ak, ar, pb, ldb, pc, ldc,
                          load, epi, pbias, use_bias, relu, pmask, pmaskb, mode])
        return context.get_dummy_value()
    return types.void(code, kc, a, b, c, bias, flags, mask), codegen
