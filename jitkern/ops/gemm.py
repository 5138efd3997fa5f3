"""GEMM family: GEMM, linear forward/backward and batch-reduce GEMM.

The public ops check their arguments (ops/_check.py), pick cache blocks (one knob per op
variant, ops/gemm_knobs.py: tuned, or the heuristic from the target's caches) and run the one
blocked driver in ops/gemm_kernel.py, which fuses the bias + ReLU epilogue into the register
tile. Backward: one ReLU-gradient pass (mask + bias gradient) feeds both GEMMs a plain operand;
a layer without dx on a narrow input (an MLP's first) masks dy straight into the GEMM tile's
panels instead (ops/weight_grad.py). Calls with BF16Array operands run the bf16 GEMM family
(ops/gemm_bf16.py). The layout knobs below choose whether a forward or a weight gradient is
computed transposed.
"""
from __future__ import annotations

import numpy as np

from ..codegen import num_threads
from ..codegen.knobs import knob, on_threads, pow2_class
from . import _check, gemm_bf16
from .bf16 import BF16Array
from .gemm_blocking import dw_variant
from .gemm_kernel import write_mask
from .gemm_knobs import forward_transposed_heuristic, run_blocked, tile_shape, tuning_inputs
from .gemm_passes import relu_grad, transpose_into
from .workspace import grad_buffer, transposed_buffer
from .weight_grad import masked_grad_fits, masked_weight_grad


# --------------------------------------------------------------------------- layout knobs

def _fp32_layers(order):
    """problems(workload): order(batch, in, out) + (threads,) for each fp32 linear layer."""
    def problems(w):
        if "fp32" in w.precisions:
            for batch, kin, kout in w.linears:
                for threads in w.threads:
                    yield order(batch, kin, kout) + (threads,)
    return problems


def _layout_runner(problem, params):
    batch, out, k, threads = problem
    x, w, y = tuning_inputs(False, True, batch, out, k)
    bias = np.zeros(out, np.float32)
    return on_threads(threads, lambda: _forward(x, w, bias, y, True, params["transposed"]))


def _dw_layout_runner(problem, params):
    out, k, batch, threads = problem
    g, x, dw = tuning_inputs(True, False, out, k, batch)
    return on_threads(threads, lambda: _weight_grad(g, x, dw, params["transposed"]))


# problem (out, in, batch, threads), as linear_dw's blocks; classed by the exact widths, whose
# remainders against the register tile decide the layout (13 and 16 wide inputs differ)
DW_LAYOUT = knob("gemm.layout.linear_dw", doc="linear_backward's dw = g.T @ x, or dw.T = x.T @ g transposed",
                 heuristic=lambda p: {"transposed": dw_variant(p[0], p[1], *tile_shape()[:2]) == "linear_dwt"},
                 shape_class=lambda p: f"{p[0]}x{p[1]}x{pow2_class(p[2])}t{p[3]}",
                 problems=_fp32_layers(lambda batch, kin, kout: (kout, kin, batch)),
                 candidates=lambda p, quick: [{"transposed": False}, {"transposed": True}], runner=_dw_layout_runner)


# problem (batch, out, in, threads), as linear_forward's blocks
FORWARD_LAYOUT = knob("gemm.layout.linear_forward", doc="linear_forward as y = x @ w.T or as y.T = w @ x.T",
                      heuristic=lambda p: {"transposed": forward_transposed_heuristic(*p[:3])},
                      shape_class=lambda p: f"{pow2_class(*p[:3])}t{p[3]}",
                      problems=_fp32_layers(lambda batch, kin, kout: (batch, kout, kin)),
                      candidates=lambda p, quick: [{"transposed": False}, {"transposed": True}] if p[0] > 1 else
                      [{"transposed": False}], runner=_layout_runner)


# --------------------------------------------------------------------------- validation


def _operand(name, x, trans, rows=False):
    """A 2-D float32 operand and its transposition flag; an F-ordered view flips the flag, no copy.
    With `rows`, any view with contiguous rows (_check.row_strided) or columns is taken as it is."""
    if isinstance(x, np.ndarray) and x.ndim == 2 and not x.flags.c_contiguous and x.T.flags.c_contiguous:
        return _check.float_array(name, x.T, ndim=2), not trans
    if rows and isinstance(x, np.ndarray) and x.ndim == 2 and not _check.row_strided(x) and _check.row_strided(x.T):
        return _check.float_array(name, x.T, ndim=2, rows=True), not trans
    return _check.float_array(name, x, ndim=2, rows=rows), trans


def _activation(activation) -> bool:
    return _check.choice("activation", activation, (None, "relu")) == "relu"


# --------------------------------------------------------------------------- public ops


def _fp32_only(name, dtype):
    if _check.choice(name, dtype, gemm_bf16.OUT_DTYPES) == "bfloat16":
        raise ValueError(f"{name}='bfloat16' needs BF16Array operands")


def gemm(a, b, out=None, *, trans_a=False, trans_b=False, alpha=1.0, beta=0.0, out_dtype=None):
    """out = alpha * op(a) @ op(b) + beta * out; a: (M, K) or (K, M), b: (K, N) or (N, K) float32.

    Views whose rows (or columns) are contiguous, as slices of a wider array's columns, are read and
    written in place at their row strides (BLAS's leading dimensions): no copy. With BF16Array a
    and b: bf16 operands, fp32 accumulation, out float32 or bf16 (out_dtype).
    """
    if isinstance(a, BF16Array) or isinstance(b, BF16Array):
        return gemm_bf16.gemm(a, b, out, trans_a=trans_a, trans_b=trans_b, alpha=alpha, beta=beta,
                              out_dtype=out_dtype)
    _fp32_only("out_dtype", out_dtype)
    a, ta = _operand("a", a, bool(trans_a), rows=True)
    b, tb = _operand("b", b, bool(trans_b), rows=True)
    alpha, beta = _check.real("alpha", alpha), _check.real("beta", beta)
    m, ka = (a.shape[1], a.shape[0]) if ta else a.shape
    kb, n = (b.shape[1], b.shape[0]) if tb else b.shape
    if ka != kb:
        raise ValueError(f"inner dimensions differ: op(a) is {m}x{ka} but op(b) is {kb}x{n}")
    if out is None:
        out, beta = np.empty((m, n), np.float32), 0.0
    else:
        _check.output("out", out, (m, n), a, b, rows=True)
    return run_blocked(a, b, out, ta, tb, "gemm", alpha=alpha, beta=beta)


def _bytes_fp32_only(x, w, **masks):
    for name, v in masks.items():
        if v is not None and (isinstance(x, BF16Array) or isinstance(w, BF16Array)):
            raise ValueError(f"{name} is for float32 layers; with BF16Array operands leave it None")


def linear_forward(x, w, b=None, *, activation=None, out=None, out_dtype=None, out_mask=None):
    """y = act(x @ w.T + b); x: (N, K), w: (M, K), b: (M,) float32 -> y: (N, M).

    out_mask (activation="relu" only): a C-contiguous (N, M) bool array, written with y > 0 in the
    GEMM's epilogue: the mask linear_backward(x_mask=) of the layer reading y takes in place of y,
    a quarter of its bytes. With BF16Array x and w: bf16 operands, fp32 accumulation and epilogue,
    y float32 or bf16 (out_dtype).
    """
    _bytes_fp32_only(x, w, out_mask=out_mask)
    if isinstance(x, BF16Array) or isinstance(w, BF16Array):
        return gemm_bf16.linear_forward(x, w, b, activation=activation, out=out, out_dtype=out_dtype)
    _fp32_only("out_dtype", out_dtype)
    relu = _activation(activation)
    if out_mask is not None and not relu:
        raise ValueError("out_mask is the mask of a ReLU's output: it needs activation='relu'")
    x, w = _check.float_array("x", x, ndim=2), _check.float_array("w", w, ndim=2)
    n, k = x.shape
    m = w.shape[0]
    if w.shape[1] != k:
        raise ValueError(f"w must have shape (M, {k}) to match x {x.shape}, got {w.shape}")
    if b is not None:
        b = _check.float_array("b", b, ndim=1, shape=(m,))
    y = np.empty((n, m), np.float32) if out is None else _check.output("out", out, (n, m), x, w)
    if out_mask is not None:
        out_mask = _check.output("out_mask", out_mask, (n, m), x, w, y, dtype=np.bool_)
    return forward_layer(x, w, b, y, relu, out_mask)


def forward_layer(x, w, b, y, relu, out_mask=None):
    """linear_forward into y without the argument checks, for a caller whose arrays are valid by
    construction (a model's step buffers): float32, C-contiguous, shapes that match, y and
    out_mask apart from the inputs. The checks cost about what a 32-row layer's call does."""
    n, m = y.shape
    return _forward(x, w, b, y, relu, FORWARD_LAYOUT.choose((n, m, x.shape[1], num_threads()))["transposed"],
                    out_mask)


def _forward(x, w, b, y, relu, transposed, out_mask=None):
    """y = relu?(x @ w.T + b) on validated arrays, directly or as y.T = w @ x.T: the same FMA
    chain per element either way, so both layouts give identical bits. out_mask: y > 0 written."""
    n, m = y.shape
    if not transposed or n * m == 0:
        return run_blocked(x, w, y, False, True, "linear_forward", bias=b, relu=relu, mask_out=out_mask)
    yt = run_blocked(w, x, transposed_buffer(m * n).reshape(m, n), False, True, "linear_forward_t")
    transpose_into(yt, y, b, relu)
    return y if out_mask is None else write_mask(y, out_mask)


def linear_backward(dy, x, w, y=None, *, activation=None, need_dx=True, dx_dtype=None, out_dx=None, out_dw=None,
                    input_relu=False, x_mask=None):
    """Gradients of linear_forward; dy, y: (N, M), x: (N, K), w: (M, K) -> dx (N, K), dw (M, K), db (M,).

    need_dx=False skips dx (returned as None): the first layer's input gradient is never used.
    input_relu=True: x is a ReLU's output, and dx comes back as the gradient at that ReLU's input
    (+0.0 where x <= 0), masked in the GEMM's epilogue; the layer below then takes it with
    activation=None, and no pass over memory masks it. x_mask (with input_relu): the bool mask x > 0
    that linear_forward(out_mask=) wrote with x, read in place of x (a quarter of the bytes).
    out_dx, out_dw: caller-given outputs
    (buffers reused step after step: fresh multi-MB arrays cost a page fault per 4 KiB on every
    call). With BF16Array x and w: bf16 GEMMs; dw, db float32, dx float32 or bf16 (dx_dtype).
    """
    if input_relu and not need_dx:
        raise ValueError("input_relu=True masks dx, but need_dx is False")
    if x_mask is not None and not input_relu:
        raise ValueError("x_mask is the mask of x as a ReLU's output: it needs input_relu=True")
    _bytes_fp32_only(x, w, x_mask=x_mask)
    if isinstance(x, BF16Array) or isinstance(w, BF16Array):
        return gemm_bf16.linear_backward(dy, x, w, y, activation=activation, need_dx=need_dx, dx_dtype=dx_dtype,
                                         out_dx=out_dx, out_dw=out_dw, input_relu=input_relu)
    _fp32_only("dx_dtype", dx_dtype)
    relu = _activation(activation)
    dy, x, w = (_check.float_array(name, v, ndim=2) for name, v in (("dy", dy), ("x", x), ("w", w)))
    n, m = dy.shape
    k = x.shape[1]
    if x.shape[0] != n:
        raise ValueError(f"x must have {n} rows like dy {dy.shape}, got {x.shape}")
    if w.shape != (m, k):
        raise ValueError(f"w must have shape ({m}, {k}) for dy {dy.shape} and x {x.shape}, got {w.shape}")
    if relu:
        if y is None:
            raise ValueError("y (the forward output) is required with activation='relu'")
        y = _check.float_array("y", y, ndim=2, shape=dy.shape)
    if x_mask is not None:
        x_mask = _check.float_array("x_mask", x_mask, ndim=2, shape=x.shape, dtype=np.bool_)
    dx, dw = _grad_outputs((n, k) if need_dx else None, (m, k), out_dx, out_dw, dy, x, w, y)
    return backward_layer(dy, x, w, y if relu else None, dx, dw, input_relu, x_mask)


def backward_layer(dy, x, w, y, dx, dw, input_relu=False, x_mask=None):
    """linear_backward into dx (None: not wanted) and dw without the argument checks, for a caller
    whose arrays are valid by construction (as forward_layer's); y: the ReLU's output, or None for
    no activation. -> (dx, dw, db)."""
    relu = y is not None
    n, m = dy.shape
    k = x.shape[1]
    db = np.empty(m, np.float32)
    if dx is None and n * m and masked_grad_fits(k, tile_shape()[0]):
        return None, *masked_weight_grad(dy, x, y if relu else dy, relu, dw, db)
    g = grad_buffer(n * m).reshape(n, m) if relu and n * m else dy
    if n * m:
        relu_grad(dy, y if relu else _NO_Y, g, db, (relu, False))
    else:
        db[:] = 0.0
    if dx is not None:
        run_blocked(g, w, dx, False, False, "linear_dx", mask=(x if x_mask is None else x_mask) if input_relu else None)
    return dx, _weight_grad(g, x, dw, DW_LAYOUT.choose((m, k, n, num_threads()))["transposed"]), db


def _weight_grad(g, x, dw, transposed):
    """dw = g.T @ x on validated arrays, directly or as dw.T = x.T @ g then transposed (the same
    FMA chain per element either way: identical bits)."""
    m, k = dw.shape
    if transposed:
        return transpose_into(run_blocked(x, g, transposed_buffer(k * m).reshape(k, m), True, False, "linear_dwt"), dw)
    return run_blocked(g, x, dw, True, False, "linear_dw")


def _grad_outputs(dx_shape, dw_shape, out_dx, out_dw, *inputs):
    """(dx, dw) float32 arrays to write: the caller's (checked) or new; dx None when dx_shape is."""
    dx = out_dx
    if dx_shape is None:
        if out_dx is not None:
            raise ValueError("out_dx is given but need_dx is False")
    elif out_dx is None:
        dx = np.empty(dx_shape, np.float32)
    else:
        _check.output("out_dx", out_dx, dx_shape, *inputs)
    if out_dw is None:
        return dx, np.empty(dw_shape, np.float32)
    return dx, _check.output("out_dw", out_dw, dw_shape, *inputs, dx)


_NO_Y = np.zeros((1, 1), np.float32)  # relu_grad's y when there is no ReLU (never read)


def batch_reduce_gemm(a, b, out=None, *, alpha=1.0, beta=0.0):
    """out = alpha * sum_i a[i] @ b[i] + beta * out; a: (nb, M, K), b: (nb, K, N) float32 -> (M, N)."""
    a, b = _check.float_array("a", a, ndim=3), _check.float_array("b", b, ndim=3)
    alpha, beta = _check.real("alpha", alpha), _check.real("beta", beta)
    nb, m, k = a.shape
    if b.shape[0] != nb or b.shape[1] != k:
        raise ValueError(f"b must have shape ({nb}, {k}, N) to match a {a.shape}, got {b.shape}")
    n = b.shape[2]
    if out is None:
        out, beta = np.empty((m, n), np.float32), 0.0
    else:
        _check.output("out", out, (m, n), a, b)
    # the batch folds into one long reduction: [a_0 | a_1 | ...] (M, nb*K) @ [b_0; b_1; ...] (nb*K, N)
    a_cat = np.ascontiguousarray(a.transpose(1, 0, 2)).reshape(m, nb * k)
    return run_blocked(a_cat, b.reshape(nb * k, n), out, False, False, "batch_reduce_gemm", alpha=alpha, beta=beta)
