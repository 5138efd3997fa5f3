"""Software prefetch for njit code: `prefetch(arr, i, byte_offset)` / `prefetch_write(...)` hint
that the cache line holding `byte_offset` bytes past arr[i] (row i of a 2-D array) will be read
(or written) soon; `prefetch_l2(...)` asks for it in L2 only, `prefetch_nta(...)` as a
non-temporal read (used once: kept out of the outer caches where the CPU can). `prefetch_at(arr,
i, byte_offset, locality)` takes the locality as a compile-time constant (a kernel's hint knob;
`HINTS` names them).

Random row gathers (embedding bags) are latency-bound: issuing the loads of rows a few
iterations ahead overlaps their cache misses, and prefetching into L2 keeps more of those
misses in flight than prefetching into L1 (see prefetch_l2). The hint is emitted as LLVM's
`llvm.prefetch` intrinsic, which every backend accepts (it lowers to nothing where the ISA has
no prefetch); if the intrinsic cannot be declared at all, the call compiles to a no-op.
"""
from __future__ import annotations

from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

_I8P = ir.IntType(8).as_pointer()
_I32 = ir.IntType(32)


def _declare(module):
    """The llvm.prefetch declaration (opaque-pointer name first, typed-pointer name as fallback)."""
    fnty = ir.FunctionType(ir.VoidType(), [_I8P, _I32, _I32, _I32])
    for name in ("llvm.prefetch.p0", "llvm.prefetch.p0i8"):
        try:
            return cgutils.get_or_insert_function(module, fnty, name)
        except Exception:  # pragma: no cover - an llvmlite that cannot declare it: no-op
            continue
    return None


# hint name -> llvm.prefetch locality: L1 (x86 prefetcht0), L2 (prefetcht1), non-temporal (prefetchnta)
HINTS = {"l1": 3, "l2": 2, "nta": 0}


def _is_row_ref(arr, i, byte_offset):
    return (isinstance(arr, types.Array) and isinstance(i, types.Integer)
            and isinstance(byte_offset, types.Integer) and arr.ndim >= 1)


def _emit(context, builder, sig, args, rw, locality):
    """llvm.prefetch of the address byte_offset bytes into arr[i]."""
    arrval, idx, off = args[:3]
    fn = _declare(builder.module)
    if fn is None:  # pragma: no cover
        return context.get_dummy_value()
    ary = context.make_array(sig.args[0])(context, builder, arrval)
    first = context.cast(builder, idx, sig.args[1], types.intp)
    extra = context.cast(builder, off, sig.args[2], types.intp)
    strides = cgutils.unpack_tuple(builder, ary.strides, sig.args[0].ndim)
    # data + i * stride0 + byte_offset (no bounds check: a hint may point anywhere)
    ptr = cgutils.pointer_add(builder, ary.data, builder.add(builder.mul(first, strides[0]), extra),
                              return_type=_I8P)
    builder.call(fn, [ptr, ir.Constant(_I32, rw), ir.Constant(_I32, locality), ir.Constant(_I32, 1)])
    return context.get_dummy_value()


def _make(rw: int, locality: int = 3):
    def impl(typingctx, arr, i, byte_offset):
        if not _is_row_ref(arr, i, byte_offset):
            return None

        def codegen(context, builder, sig, args):
            return _emit(context, builder, sig, args, rw, locality)

        return types.none(arr, i, byte_offset), codegen
    return impl


prefetch = intrinsic(_make(rw=0))
prefetch.__doc__ = "Hint: the line byte_offset bytes into arr[i] will be read soon (no other effect)."
prefetch_write = intrinsic(_make(rw=1))
prefetch_write.__doc__ = "Hint: the line byte_offset bytes into arr[i] will be written soon (no other effect)."
prefetch_l2 = intrinsic(_make(rw=0, locality=2))
prefetch_l2.__doc__ = """Hint: the line byte_offset bytes into arr[i] will be read soon; fetch it into L2 (x86
prefetcht1, AArch64 PLDL2KEEP). For many independent misses: an L1 prefetch holds one of the L1's
few fill buffers until its line arrives, and those cap how many misses a core keeps in flight; L2
tracks more."""
prefetch_nta = intrinsic(_make(rw=0, locality=0))
prefetch_nta.__doc__ = "Hint: the line byte_offset bytes into arr[i] will be read soon, once (x86 prefetchnta)."


@intrinsic
def prefetch_at(typingctx, arr, i, byte_offset, locality):
    """Hint: the line byte_offset bytes into arr[i] will be read soon; `locality` a compile-time
    constant of HINTS (3: L1, 2: L2, 0: non-temporal)."""
    if not (_is_row_ref(arr, i, byte_offset) and isinstance(locality, types.IntegerLiteral)
            and locality.literal_value in HINTS.values()):
        return None
    level = locality.literal_value

    def codegen(context, builder, sig, args):
        return _emit(context, builder, sig, args, 0, level)

    return types.none(arr, i, byte_offset, locality), codegen
