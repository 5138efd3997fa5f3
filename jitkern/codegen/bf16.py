"""bf16 bit intrinsics for njit code: float32 <-> uint32 bit casts, the float32 value of a
table element that is float32 or bf16 bits (uint16, the high half of a float32), and the ReLU
mask as a bit select.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba.core import types
from numba.extending import intrinsic, overload


@intrinsic
def as_float32(typingctx, bits):
    """The float32 whose bits are the low 32 bits of an integer (njit only)."""
    if not isinstance(bits, types.Integer) or bits.bitwidth < 32:
        return None

    def codegen(context, builder, sig, args):
        low = builder.trunc(args[0], ir.IntType(32)) if sig.args[0].bitwidth > 32 else args[0]
        return builder.bitcast(low, ir.FloatType())
    return types.float32(bits), codegen


@intrinsic
def as_uint32(typingctx, value):
    """Reinterpret a float32 as the uint32 with the same bits (njit only)."""
    if value != types.float32:
        return None

    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.IntType(32))
    return types.uint32(value), codegen


def widen(x):
    """float32 value of a table element: float32 as is, uint16 as the bf16 it holds (njit only)."""
    raise NotImplementedError("widen is callable from njit code only")


@overload(widen, inline="always")
def _widen_impl(x):
    if x == types.uint16:
        return lambda x: as_float32(np.uint32(x) << np.uint32(16))
    if x == types.float32:
        return lambda x: x
    return None



def relu_keep(v, y):
    """v where y > 0, else +0.0 (NaN y included), float32 (njit only); y: the ReLU's output,
    float32 or bf16 bits, or a byte mask (bool, uint8: nonzero keeps). Bit arithmetic: written as a
    conditional over bf16 data, LLVM leaves the loop scalar with a branch per element on AVX2
    (18x slower there)."""
    raise NotImplementedError("relu_keep is callable from njit code only")


@overload(relu_keep, inline="always")
def _relu_keep_impl(v, y):
    if v != types.float32:
        return None
    if y in (types.float32, types.uint16):
        return lambda v, y: as_float32(as_uint32(v) & (np.uint32(0) - np.uint32(widen(y) > 0)))
    if y == types.boolean:
        return lambda v, y: as_float32(as_uint32(v) & (np.uint32(0) - np.uint32(y)))
    if y in (types.uint8, types.int8):
        return lambda v, y: as_float32(as_uint32(v) & (np.uint32(0) - np.uint32(y != 0)))
    return None
