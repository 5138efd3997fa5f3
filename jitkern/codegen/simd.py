"""FMA register-tile microkernels: LLVM IR emitted with llvmlite, inlined into njit drivers.

The GEMM microkernel computes one MR x NR tile of C from packed panels:

    acc = (load ? C[0:MR, 0:NR] : 0) + sum_k  ap[0:MR, k] (outer) bp[k, 0:NR]
    if epi: acc = relu?(acc + bias?[0:NR])        (use_bias / relu: runtime flags)
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

import hashlib
from pathlib import Path

from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from .target import VECTOR_WIDTH

# register tile (MR rows, NR columns) per ISA: the accumulators plus the NR/width B vectors and a
# broadcast A value must fit in the register file (32 zmm / 16 ymm / 32 NEON q registers).
# "scalar" emits width-1 vectors: plain scalar FMAs that LLVM may still SLP-vectorise.
TILES = {"avx512": (8, 32), "avx2": (6, 16), "neon": (8, 12), "scalar": (4, 4)}

# numba's disk cache keys a kernel on its own file and closure values only, so drivers that inline
# fma_tile close over this tag: editing this file then invalidates their cached machine code.
SOURCE_TAG = int(hashlib.sha1(Path(__file__).read_bytes()).hexdigest()[:8], 16)

_F32 = ir.FloatType()
_I64 = ir.IntType(64)
_I32 = ir.IntType(32)
_I1 = ir.IntType(1)


def tile_for(isa: str) -> tuple[int, int, int]:
    """(MR, NR, vector width) of the register tile used on `isa`."""
    return (*TILES[isa], VECTOR_WIDTH[isa])


def _vector_fn(module, name, vec):
    fn = module.globals.get(name)
    if fn is None:
        fn = ir.Function(module, ir.FunctionType(vec, [vec, vec, vec]), name=name)
    return fn


def _emit_tile_function(module, mr: int, nr: int, vw: int):
    """Define (once per LLVM module) the always-inline tile function; return it."""
    name = f"jitkern_tile_{mr}x{nr}_v{vw}"
    fn = module.globals.get(name)
    if fn is not None:
        return fn
    vec = ir.VectorType(_F32, vw)
    fp, vp = _F32.as_pointer(), vec.as_pointer()
    nv = nr // vw
    fnty = ir.FunctionType(ir.VoidType(), [_I64, fp, _I64, _I64, fp, _I64, fp, _I64, _I1, _I1, fp, _I1, _I1])
    fn = ir.Function(module, fnty, name=name)
    fn.linkage = "internal"
    fn.attributes.add("alwaysinline")
    fn.attributes.add("nounwind")
    kc, pa, ak, ar, pb, ldb, pc, ldc, load, epi, pbias, use_bias, relu = fn.args
    for p in (pa, pb, pc, pbias):
        p.add_attribute("noalias")
    fma = _vector_fn(module, f"llvm.fma.v{vw}f32", vec)
    zero = ir.Constant(vec, [0.0] * vw)
    bmask = ir.Constant(ir.VectorType(_I32, vw), [0] * vw)

    entry = fn.append_basic_block("entry")
    b_load = fn.append_basic_block("load_c")
    b_head = fn.append_basic_block("k_head")
    b_body = fn.append_basic_block("k_body")
    b_tail = fn.append_basic_block("k_done")
    b_epi = fn.append_basic_block("epilogue")
    b_store = fn.append_basic_block("store")
    bld = ir.IRBuilder(entry)

    def cptr(r, v):
        off = bld.add(bld.mul(ir.Constant(_I64, r), ldc), ir.Constant(_I64, v * vw))
        return bld.bitcast(bld.gep(pc, [off]), vp)

    roff = [bld.mul(ir.Constant(_I64, r), ar) for r in range(mr)]  # row offsets, loop-invariant
    bld.cbranch(load, b_load, b_head)
    bld.position_at_end(b_load)
    loaded = [[bld.load(cptr(r, v), align=4) for v in range(nv)] for r in range(mr)]
    bld.branch(b_head)

    # K loop: accumulators are loop-carried phis, so they stay in registers
    bld.position_at_end(b_head)
    k = bld.phi(_I64, name="k")
    k.add_incoming(ir.Constant(_I64, 0), entry)
    k.add_incoming(ir.Constant(_I64, 0), b_load)
    acc = [[bld.phi(vec) for _ in range(nv)] for _ in range(mr)]
    for r in range(mr):
        for v in range(nv):
            acc[r][v].add_incoming(zero, entry)
            acc[r][v].add_incoming(loaded[r][v], b_load)
    bld.cbranch(bld.icmp_signed("<", k, kc), b_body, b_tail)

    bld.position_at_end(b_body)
    bbase = bld.mul(k, ldb)
    bvec = [bld.load(bld.bitcast(bld.gep(pb, [bld.add(bbase, ir.Constant(_I64, v * vw))]), vp), align=4)
            for v in range(nv)]
    abase = bld.mul(k, ak)
    new = []
    for r in range(mr):
        a = bld.load(bld.gep(pa, [bld.add(abase, roff[r])]), align=4)
        ab = bld.shuffle_vector(bld.insert_element(ir.Constant(vec, ir.Undefined), a, ir.Constant(_I32, 0)),
                                ir.Constant(vec, ir.Undefined), bmask)
        new.append([bld.call(fma, [ab, bvec[v], acc[r][v]]) for v in range(nv)])
    k_next = bld.add(k, ir.Constant(_I64, 1))
    for r in range(mr):
        for v in range(nv):
            acc[r][v].add_incoming(new[r][v], b_body)
    k.add_incoming(k_next, b_body)
    bld.branch(b_head)

    bld.position_at_end(b_tail)
    bld.cbranch(epi, b_epi, b_store)

    # epilogue on the registers: per-column bias, then ReLU that keeps NaN (x < 0 -> 0, else x).
    # The flags are runtime values (this runs once per tile, so a select costs nothing); the
    # bias pointer must be valid for NR floats even when use_bias is false.
    bld.position_at_end(b_epi)
    bias = [bld.load(bld.bitcast(bld.gep(pbias, [ir.Constant(_I64, v * vw)]), vp), align=4)
            for v in range(nv)]
    done = [[bld.select(use_bias, bld.fadd(acc[r][v], bias[v]), acc[r][v]) for v in range(nv)]
            for r in range(mr)]
    done = [[bld.select(relu, bld.select(bld.fcmp_ordered("<", x, zero), zero, x), x) for x in row]
            for row in done]
    bld.branch(b_store)

    bld.position_at_end(b_store)
    outs = [[bld.phi(vec) for _ in range(nv)] for _ in range(mr)]
    for r in range(mr):
        for v in range(nv):
            outs[r][v].add_incoming(acc[r][v], b_tail)
            outs[r][v].add_incoming(done[r][v], b_epi)
    for r in range(mr):
        for v in range(nv):
            bld.store(outs[r][v], cptr(r, v), align=4)
    bld.ret_void()
    return fn


def tile_code(mr: int, nr: int, vw: int) -> int:
    """Pack a tile's compile-time shape into one int for `fma_tile` (a literal in njit code)."""
    if nr % vw or not (0 < mr < 256 and 0 < nr < 256 and 0 < vw < 256):
        raise ValueError(f"bad tile {mr}x{nr} for vector width {vw}")
    return mr | nr << 8 | vw << 16


def _decode(code: int):
    return code & 255, code >> 8 & 255, code >> 16 & 255


# One module-level intrinsic whose tile shape arrives as a literal int: numba's disk cache keys a
# caller on its bytecode and closure values, so drivers must close over plain ints (tile_code),
# never over per-process objects such as intrinsics (whose pickles differ between processes).
@intrinsic(prefer_literal=True)
def fma_tile(typingctx, code, kc, ap, aoff, ak, ar, bp, boff, ldb, c, coff, ldc, load, epi, bias, biasoff,
             use_bias, relu):
    """fma_tile(code, kc, ap, aoff, ak, ar, bp, boff, ldb, c, coff, ldc, load, epi, bias, biasoff, use_bias, relu).

    All arrays are flat float32; code = tile_code(...) must be a compile-time constant.
    """
    if not isinstance(code, types.IntegerLiteral):
        return None
    mr, nr, vw = _decode(code.literal_value)
    sig = types.void(code, kc, ap, aoff, ak, ar, bp, boff, ldb, c, coff, ldc, load, epi, bias, biasoff,
                     use_bias, relu)

    def codegen(context, builder, signature, args):
        _, kc_, ap_, aoff_, ak_, ar_, bp_, boff_, ldb_, c_, coff_, ldc_, load_, epi_, bias_, biasoff_, ub_, relu_ = args
        tys = signature.args

        def ptr(i, arr, off):
            data = context.make_array(tys[i])(context, builder, arr).data
            return builder.gep(data, [context.cast(builder, off, tys[i + 1], types.int64)])

        def cast(i, v, to):
            return context.cast(builder, v, tys[i], to)

        fn = _emit_tile_function(builder.module, mr, nr, vw)
        builder.call(fn, [cast(1, kc_, types.int64), ptr(2, ap_, aoff_), cast(4, ak_, types.int64),
                          cast(5, ar_, types.int64), ptr(6, bp_, boff_), cast(8, ldb_, types.int64),
                          ptr(9, c_, coff_), cast(11, ldc_, types.int64), cast(12, load_, types.boolean),
                          cast(13, epi_, types.boolean), ptr(14, bias_, biasoff_), cast(16, ub_, types.boolean),
                          cast(17, relu_, types.boolean)])
        return context.get_dummy_value()
    return sig, codegen
