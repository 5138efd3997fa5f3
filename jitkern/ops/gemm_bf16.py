"""bf16 GEMM family: GEMM and linear forward/backward on BF16Array operands, with their blocking knobs.

ops.gemm's public ops hand calls with BF16Array operands here. Operands are bf16, accumulation is
fp32 in registers, outputs are fp32 or bf16 (rounded once from the fp32 accumulator, after the
fused bias + ReLU epilogue). Backward: one pass masks dy (ReLU), rounds it to bf16 for both GEMMs
and sums the unrounded masked dy into db; dw and db are fp32 (for the Split-SGD update), dx fp32
or bf16. The driver is ops/gemm_bf16_kernel.py: vdpbf16ps where the target has AVX512_BF16 and
the gemm.bf16.dot knob keeps it (not clearly slower than the fp32 FMAs), bf16 widened to fp32 for
the fp32 tile elsewhere.
"""
from __future__ import annotations

import numpy as np

from ..codegen import host_target
from ..codegen.knobs import knob, on_threads, pow2_class
from . import _check
from .bf16 import BF16Array
from .gemm_blocking import BlockChoices, dw_variant, layer_problems, split_for_threads
from .gemm_blocking import round_to as _round_to
from .gemm_bf16_kernel import bf16_tile, gemm_bf16_into, grad_buffer
from .gemm_passes import relu_grad, relu_mask_into, transpose_into
from .workspace import transposed_buffer

VARIANTS = ("gemm", "linear_forward", "linear_dx", "linear_dw", "linear_dwt")
OUT_DTYPES = (None, "float32", "bfloat16")


# --------------------------------------------------------------------------- blocking knobs


def heuristic_blocks(variant: str, m: int, n: int, k: int, threads: int = 1) -> dict:
    """(mc, kc) from the target's caches, as the fp32 GEMM's heuristic (ops/gemm_knobs.py) in bytes: a
    kc x NR B micro-panel of about twice L1 (2 bytes a value natively, 4 once widened), the
    mc x kc A block in an eighth of L2. kc is then split evenly over K, in whole k pairs."""
    t = host_target()
    native, mr, nr, _ = bf16_tile()
    item = 2 if native else 4
    kc0 = min(2048 if native else 512, max(128, (2 * t.l1d) // (nr * item) // 16 * 16))
    passes = max(1, -(-k // kc0))
    kc = _round_to(-(-k // passes), 4)
    mc = max(mr, min(288, (t.l2 // 8) // (kc * item) // mr * mr))
    return {"mc": mc, "kc": kc}


def shape_blocks(params: dict, m: int, n: int, k: int, threads: int) -> tuple[int, int, int]:
    """(mc, kc, nc) for C (m x n) += A (m x k) B (k x n) from chosen (mc, kc), shaped as the fp32
    GEMM's (ops/gemm_knobs.shape_blocks) for the bf16 tile; kc even unless it covers all of k."""
    _, mr, nr, _ = bf16_tile()
    mc, kc = _round_to(int(params["mc"]), mr), max(2, int(params["kc"]) // 2 * 2)
    return split_for_threads(mc, kc, m, n, k, threads, (mr, nr))


def _candidates(problem, quick):
    _, mr, _, _ = bf16_tile()
    kcs = (256, 512, 1024) if quick else (128, 256, 384, 512, 768, 1024, 2048)
    mcs = (mr * 6, mr * 12, mr * 24) if quick else (mr * 4, mr * 6, mr * 9, mr * 12, mr * 18, mr * 24, mr * 48)
    return [{"mc": mc, "kc": kc} for kc in kcs for mc in mcs]


def _runner(variant):
    def runner(problem, params):
        m, n, k, threads = problem
        ta, tb = variant in ("linear_dw", "linear_dwt"), variant == "linear_forward"
        rng = np.random.default_rng(0)
        a = BF16Array.from_float32(rng.standard_normal((k, m) if ta else (m, k), dtype=np.float32)).bits
        b = BF16Array.from_float32(rng.standard_normal((n, k) if tb else (k, n), dtype=np.float32)).bits
        c = np.empty((m, n), np.uint16 if variant == "linear_forward" else np.float32)
        blocks = shape_blocks(params, m, n, k, threads)
        return on_threads(threads, lambda: gemm_bf16_into(a, b, c, ta, tb, blocks))
    return runner


BLOCKS = {v: knob(f"gemm.bf16.blocks.{v}", doc=f"(mc, kc) cache blocks of bf16 {v}",
                  heuristic=lambda p, v=v: heuristic_blocks(v, *p),
                  shape_class=lambda p: f"{pow2_class(*p[:3])}t{p[3]}",
                  problems=layer_problems(v, lambda: bf16_tile()[1:3], "bf16"), candidates=_candidates, runner=_runner(v))
          for v in VARIANTS}

blocks_for = BlockChoices(BLOCKS, shape_blocks)


def _run(a, b, c, ta, tb, op, **kw):
    """gemm_bf16_into with the blocks of `op` for this shape and thread count."""
    return blocks_for.run(gemm_bf16_into, a, b, c, ta, tb, op, **kw)


# --------------------------------------------------------------------------- arguments


def _operand(name, x, trans):
    """The C-contiguous bits of a 2-D BF16Array and its transposition flag (an F-ordered view flips
    the flag, no copy)."""
    if isinstance(x, BF16Array) and x.ndim == 2 and not x.bits.flags.c_contiguous and x.bits.T.flags.c_contiguous:
        return _check.bf16_array(name, BF16Array(x.bits.T), ndim=2), not trans
    return _check.bf16_array(name, x, ndim=2), trans


def _values(name, x, shape):
    """float32 values of a float32 array or a BF16Array of `shape` (small operands: bias)."""
    if isinstance(x, BF16Array):
        return BF16Array(_check.bf16_array(name, x, shape=shape)).to_float32()
    return _check.float_array(name, x, shape=shape)


def _grad_operand(name, x, shape):
    """A float32 array or the bits of a BF16Array (dy, y of the backward), C-contiguous."""
    if isinstance(x, BF16Array):
        return _check.bf16_array(name, x, ndim=2, shape=shape)
    return _check.float_array(name, x, ndim=2, shape=shape)


def _output(name, out, out_dtype, shape, *inputs):
    """(array the kernel writes: float32 or uint16 bits, what to return) for out / out_dtype."""
    dtype = _check.choice(f"{name}_dtype", out_dtype, OUT_DTYPES)
    if out is None:
        if dtype == "bfloat16":
            res = BF16Array(np.empty(shape, np.uint16))
            return res.bits, res
        arr = np.empty(shape, np.float32)
        return arr, arr
    if isinstance(out, BF16Array):
        if dtype == "float32":
            raise ValueError(f"{name}_dtype is float32 but {name} is a BF16Array")
        return _check.output(name, out.bits, shape, *inputs, dtype=np.uint16), out
    if dtype == "bfloat16":
        raise ValueError(f"{name}_dtype is bfloat16 but {name} is not a BF16Array")
    return _check.output(name, out, shape, *inputs), out


# --------------------------------------------------------------------------- ops (via ops.gemm)


def gemm(a, b, out=None, *, trans_a=False, trans_b=False, alpha=1.0, beta=0.0, out_dtype=None):
    """out = alpha * op(a) @ op(b) + beta * out; a, b: BF16Array, out: float32 or BF16Array (out_dtype)."""
    a, ta = _operand("a", a, bool(trans_a))
    b, tb = _operand("b", b, bool(trans_b))
    alpha, beta = _check.real("alpha", alpha), _check.real("beta", beta)
    m, ka = (a.shape[1], a.shape[0]) if ta else a.shape
    kb, n = (b.shape[1], b.shape[0]) if tb else b.shape
    if ka != kb:
        raise ValueError(f"inner dimensions differ: op(a) is {m}x{ka} but op(b) is {kb}x{n}")
    target, res = _output("out", out, out_dtype, (m, n), a, b)
    if alpha == 1.0 and (beta == 0.0 or out is None):
        _run(a, b, target, ta, tb, "gemm")
        return res
    # scaled: the fp32 product, then alpha * p + beta * out in fp32, rounded once if out is bf16
    p = _run(a, b, np.empty((m, n), np.float32), ta, tb, "gemm")
    p *= np.float32(alpha)
    if out is not None and beta != 0.0:
        p += np.float32(beta) * (out.to_float32() if isinstance(out, BF16Array) else target)
    if target.dtype == np.uint16:
        BF16Array.from_float32(p, out=BF16Array(target))
    else:
        target[...] = p
    return res


def linear_forward(x, w, b=None, *, activation=None, out=None, out_dtype=None):
    """y = act(x @ w.T + b); x: (N, K), w: (M, K) BF16Array, b: (M,) float32 or BF16Array -> y (N, M)
    float32 or BF16Array (out_dtype="bfloat16", or out a BF16Array)."""
    relu = _check.choice("activation", activation, (None, "relu")) == "relu"
    x, w = _check.bf16_array("x", x, ndim=2), _check.bf16_array("w", w, ndim=2)
    n, k = x.shape
    m = w.shape[0]
    if w.shape[1] != k:
        raise ValueError(f"w must have shape (M, {k}) to match x {x.shape}, got {w.shape}")
    if b is not None:
        b = _values("b", b, (m,))
    target, res = _output("out", out, out_dtype, (n, m), x, w)
    _run(x, w, target, False, True, "linear_forward", bias=b, relu=relu)
    return res


def linear_backward(dy, x, w, y=None, *, activation=None, need_dx=True, dx_dtype=None, out_dx=None, out_dw=None,
                    input_relu=False):
    """Gradients of linear_forward on bf16 operands; dy, y: (N, M) float32 or BF16Array, x: (N, K),
    w: (M, K) BF16Array -> dx (N, K) float32 or BF16Array (dx_dtype), dw (M, K) float32, db (M,) float32;
    out_dx (of dx's type), out_dw: caller-given outputs; input_relu: dx masked by x > 0 (as fp32
    linear_backward's).

    The GEMMs read dy (masked by y > 0 with activation='relu') rounded to bf16; db sums it unrounded.
    """
    relu = _check.choice("activation", activation, (None, "relu")) == "relu"
    dx_dtype = _check.choice("dx_dtype", dx_dtype, OUT_DTYPES)
    x, w = _check.bf16_array("x", x, ndim=2), _check.bf16_array("w", w, ndim=2)
    dy = _grad_operand("dy", dy, None)
    n, m = dy.shape
    k = x.shape[1]
    if x.shape[0] != n:
        raise ValueError(f"x must have {n} rows like dy {dy.shape}, got {x.shape}")
    if w.shape != (m, k):
        raise ValueError(f"w must have shape ({m}, {k}) for dy {dy.shape} and x {x.shape}, got {w.shape}")
    if relu:
        if y is None:
            raise ValueError("y (the forward output) is required with activation='relu'")
        y = _grad_operand("y", y, dy.shape)
    if out_dx is not None and not need_dx:
        raise ValueError("out_dx is given but need_dx is False")
    given_dx = getattr(out_dx, "bits", out_dx)
    dw = np.empty((m, k), np.float32) if out_dw is None else _check.output("out_dw", out_dw, (m, k), dy, y, x, w,
                                                                            given_dx)
    db = np.empty(m, np.float32)
    write_g = relu or dy.dtype != np.uint16
    g = grad_buffer(n * m).reshape(n, m) if write_g else dy
    if n * m:
        relu_grad(dy, y if relu else dy, g, db, (relu, write_g))
    else:
        db[:] = 0.0
    dx = None
    if need_dx:
        target, dx = _output("dx", out_dx, dx_dtype, (n, k), dy, y, x, w)
        _run(g, w, target, False, False, "linear_dx")
        if input_relu:
            relu_mask_into(target, x)
    _, mr, nr, _ = bf16_tile()
    if dw_variant(m, k, mr, nr) == "linear_dwt":
        transpose_into(_run(x, g, transposed_buffer(k * m).reshape(k, m), True, False, "linear_dwt"), dw)
    else:
        _run(g, x, dw, True, False, "linear_dw")
    return dx, dw, db
