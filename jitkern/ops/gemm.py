"""GEMM family: GEMM, linear forward/backward and batch-reduce GEMM, with their blocking knobs.

The public ops check their arguments (ops/_check.py), pick cache blocks (one knob per op
variant: tuned, or the heuristic from the target's caches) and run the one blocked driver in
ops/gemm_kernel.py, which fuses the bias + ReLU epilogue into the register tile. Backward: one
ReLU-gradient pass (mask + bias gradient) feeds both GEMMs a plain operand; a layer without dx
on a narrow input (an MLP's first) masks dy straight into the GEMM tile's panels instead
(ops/weight_grad.py). Calls with BF16Array operands run the bf16 GEMM family (ops/gemm_bf16.py).
"""
from __future__ import annotations

import functools

import numpy as np

from ..codegen import host_target, num_threads, target_isa
from ..codegen.knobs import knob, on_threads, pow2_class
from ..codegen.simd import tile_for
from . import _check, gemm_bf16
from .bf16 import BF16Array
from .gemm_blocking import BlockChoices, dw_variant, forward_transposed, layer_problems, split_for_threads
from .gemm_blocking import round_to as _round_to
from .gemm_kernel import STREAM_KNOB, STREAM_MAX_K, gemm_into, stream_heuristic, write_mask
from .gemm_pack import b_in_place, slab_mode
from .gemm_passes import relu_grad, transpose_into
from .workspace import empty_aligned, grad_buffer, transposed_buffer
from .weight_grad import masked_grad_fits, masked_weight_grad


def tile_shape(isa: str | None = None) -> tuple[int, int, int]:
    """(MR, NR, vector width) the GEMM uses on `isa` (default: the current target ISA)."""
    return tile_for(isa or target_isa())


# --------------------------------------------------------------------------- blocking knobs

VARIANTS = ("gemm", "linear_forward", "linear_forward_t", "linear_dx", "linear_dw", "linear_dwt", "batch_reduce_gemm")


def heuristic_blocks(variant: str, m: int, n: int, k: int, threads: int = 1) -> dict:
    """(mc, kc) from the target's caches and register tile.

    kc: a kc x NR B micro-panel of about twice L1 (at most 512): the tile streams it in order,
    so the prefetcher keeps up from L2, and a long K loop amortises the C tile's load and store
    per pass. Where B is read in place by more than two row tiles, the later tiles reread its kc
    rows' lines from L2 (one or two tiles read each row at most twice: a dwt of 13 x 1024 x 2048
    ran at 35 GF/s with kc = 64, 71 with 256-512), and where A's columns are (a C of one column panel), the next row tiles
    reread the lines of those kc rows: either way they must stay in L2 even when their stride maps
    them to the same sets (kc x the row stride <= L2: dx 32 x 1024 x 1024 from L3 ran at 66 GF/s
    in one K pass, 95 in passes of 256 rows, on Zen 4). kc is then split evenly over K.

    mc: the mc x kc A block (packed, or rows read in place) in a quarter of L2, which it shares
    with the B micro-panels and C: it is reused over every column panel of its C block. A sweep
    over one column panel stores a strip of mc C rows, each a stream the prefetchers must pick up
    within a tile's K loop: where they follow a limited number of pages (Target.page_streams),
    the strip spans at most kc/2 pages, so a short K loop gets a short strip, but never fewer
    than that number (a K of 13 ran 8-19% slower on strips of a few rows); elsewhere it is as
    tall as the A block. One block takes all rows where they fit in 3/4 of L2 and all of C in
    half of L2 (B's panels then pass through once per K pass, not once per row block),
    or where A is read transposed in place (linear_dw/dwt with n <= NR): there is no A block to
    keep, and all of B's one panel streams through once per C block.

    One K pass where one block holds all of C (small m: each B row is read once per column panel
    whatever kc is), each of A's rows is at most a 4 KiB page long and B is packed: passes would
    only add the C tiles' reload and store. A K of 2048 in one pass lost 10-40% on both tiles.
    Except where B (k, n) is beyond half of L2: then each task packs its columns of B one pass at
    a time (gemm_pack.slab_mode), and the passes give that slab rows of SLAB_ROW floats."""
    t = host_target()
    mr, nr, _ = tile_for(t.isa)
    kc0 = min(512, max(128, (2 * t.l1d) // (nr * 4) // 16 * 16))
    one_panel_dw = variant in ("linear_dw", "linear_dwt") and n <= nr  # A's columns read in place
    strided_b = b_in_place(variant in ("linear_forward", "linear_forward_t"), m, n, mr, nr) and m > 2 * mr
    for reread, row_floats in ((one_panel_dw, m), (strided_b, n)):  # kc rows of A's columns, of B
        if reread:
            kc0 = min(kc0, max(64, t.l2 // (row_floats * 4) // 16 * 16))
    whole = _round_to(m, mr)

    def one_block(kc):  # all rows' A block in 3/4 of L2, all of C in half
        return whole * kc * 4 <= t.l2 * 3 // 4 and m * n * 4 <= t.l2 // 2

    if not (one_panel_dw or strided_b) and k * 4 <= PAGE and one_block(k):
        slab = variant not in ("linear_forward", "linear_forward_t") and slab_mode(False, m, n, whole, mr, nr)
        if slab and k * n * 4 > t.l2 // 2:
            # B beyond half of L2 is packed a slab per pass (gemm_pack.slab_mode) with rows of
            # SLAB_ROW floats: passes of as many rows as that slab has in half of L2
            passes = -(-k // max(16, t.l2 // 2 // (SLAB_ROW * 4)))
            return {"mc": whole, "kc": _round_to(-(-k // passes), 4)}
        return {"mc": whole, "kc": _round_to(k, 4)}
    passes = max(1, -(-k // kc0))
    kc = _round_to(-(-k // passes), 4)
    if one_block(kc) or one_panel_dw:
        return {"mc": whole, "kc": kc}
    mc = (t.l2 // 4) // (max(kc, 128) * 4)
    if t.page_streams:
        mc = min(mc, _rows_in_pages(max(kc // 2, t.page_streams), n * 4))
    return {"mc": max(mr, min(mc // mr * mr, 512 // mr * mr, whole)), "kc": kc}


PAGE = 4096         # bytes of a page, the span of the hardware prefetchers' streams
SLAB_ROW = 256      # floats of a B slab's row (gemm_kernel.slab_columns): 1 KiB runs to read and hint


def _rows_in_pages(pages: int, row_bytes: int) -> int:
    """How many rows of row_bytes bytes (consecutive in memory) span `pages` 4 KiB pages."""
    return max(1, pages) * max(1, 4096 // max(row_bytes, 1))


def shape_blocks(params: dict, m: int, n: int, k: int, threads: int, isa: str | None = None) -> tuple[int, int, int]:
    """(mc, kc, nc) for a C (m x n) += A (m x k) B (k x n) GEMM from chosen (mc, kc): mc and nc are
    shaped so that `threads` threads get even work."""
    mr, nr, _ = tile_shape(isa)
    mc, kc = _round_to(int(params["mc"]), mr), max(1, int(params["kc"]))
    return split_for_threads(mc, kc, m, n, k, threads, (mr, nr))


def _candidates(problem, quick):
    mr, _, _ = tile_shape()
    kcs = (128, 256, 512) if quick else (96, 128, 192, 256, 384, 512)
    mcs = (mr * 6, mr * 12, mr * 24) if quick else (mr * 4, mr * 6, mr * 9, mr * 12, mr * 18, mr * 24, mr * 48)
    m, _, k, _ = problem
    one_pass = [{"mc": _round_to(m, mr), "kc": _round_to(k, 4)}] if k > kcs[-1] and k * 4 <= PAGE else []
    return [{"mc": mc, "kc": kc} for kc in kcs for mc in mcs] + one_pass


@functools.lru_cache(maxsize=1)
def _inputs(ta: bool, tb: bool, m: int, n: int, k: int):
    """Random operands and an output for one tuning problem, made once for all its candidates."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((k, m) if ta else (m, k), dtype=np.float32)
    b = rng.standard_normal((n, k) if tb else (k, n), dtype=np.float32)
    return a, b, np.empty((m, n), np.float32)


def _runner(variant):
    def runner(problem, params):
        m, n, k, threads = problem
        ta, tb = variant in ("linear_dw", "linear_dwt"), variant in ("linear_forward", "linear_forward_t")
        a, b, c = _inputs(ta, tb, m, n, k)
        blocks = shape_blocks(params, m, n, k, threads)
        return on_threads(threads, lambda: gemm_into(a, b, c, ta, tb, blocks))
    return runner


def _transposed_heuristic(batch: int, out: int, k: int) -> bool:
    return forward_transposed(batch, out, k, tile_shape()[1], host_target().l2)


BLOCKS = {v: knob(f"gemm.blocks.{v}", doc=f"(mc, kc) cache blocks of {v}",
                  heuristic=lambda p, v=v: heuristic_blocks(v, *p),
                  shape_class=lambda p: f"{pow2_class(*p[:3])}t{p[3]}",
                  problems=layer_problems(v, lambda: tile_shape()[:2], transposed=_transposed_heuristic),
                  candidates=_candidates, runner=_runner(v))
          for v in VARIANTS}


blocks_for = BlockChoices(BLOCKS, shape_blocks)


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
    x, w, y = _inputs(False, True, batch, out, k)
    bias = np.zeros(out, np.float32)
    return on_threads(threads, lambda: _forward(x, w, bias, y, True, params["transposed"]))


def _dw_layout_runner(problem, params):
    out, k, batch, threads = problem
    g, x, dw = _inputs(True, False, out, k, batch)
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
                      heuristic=lambda p: {"transposed": _transposed_heuristic(*p[:3])},
                      shape_class=lambda p: f"{pow2_class(*p[:3])}t{p[3]}",
                      problems=_fp32_layers(lambda batch, kin, kout: (batch, kout, kin)),
                      candidates=lambda p, quick: [{"transposed": False}, {"transposed": True}] if p[0] > 1 else
                      [{"transposed": False}], runner=_layout_runner)


def _stream_problems(w):
    """The write-bound (m, n, k, threads) GEMMs of a workload's fp32 layers whose C is beyond L2: a
    forward on at most STREAM_MAX_K inputs, a weight gradient of a batch of at most STREAM_MAX_K rows."""
    if "fp32" not in w.precisions:
        return
    big = lambda m, n: 4 * m * n > host_target().l2
    for batch, kin, kout in w.linears:
        for threads in w.threads:
            if kin <= STREAM_MAX_K and big(batch, kout):
                yield batch, kout, kin, threads
            if batch <= STREAM_MAX_K and big(kout, kin):
                yield kout, kin, batch, threads


def _stream_runner(problem, params):
    """A (m, n, k) GEMM into a fresh C per call (a rotation of Cs twice the last-level cache in all,
    as a training step's outputs are), streamed if k <= params["max_k"]."""
    m, n, k, threads = problem
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((m, k), dtype=np.float32), rng.standard_normal((k, n), dtype=np.float32)
    cs = [empty_aligned((m, n)) for _ in range(max(2, -(-2 * host_target().l3 // max(4 * m * n, 1))))]
    for c in cs:
        c.fill(0.0)  # pages faulted in before the timing
    blocks = shape_blocks(heuristic_blocks("gemm", m, n, k, threads), m, n, k, threads)
    stream, turn = k <= params["max_k"], [0]

    def call():
        i = turn[0]
        turn[0] = (i + 1) % len(cs)
        gemm_into(a, b, cs[i], False, False, blocks, stream=stream)
    return on_threads(threads, call)


STREAMING = knob(STREAM_KNOB, doc="the largest K at which a write-bound GEMM stores C non-temporally (0: never)",
                 heuristic=stream_heuristic, shape_class=lambda p: f"t{p[3]}", problems=_stream_problems,
                 candidates=lambda p, quick: [{"max_k": 0}, {"max_k": STREAM_MAX_K}], runner=_stream_runner)


def _run(a, b, c, ta, tb, op, **kw):
    """gemm_into with the blocks of `op` for this shape and thread count."""
    m, n = c.shape
    if m == 0 or n == 0:
        return c
    k = a.shape[0] if ta else a.shape[1]
    return gemm_into(a, b, c, ta, tb, blocks_for(op, m, n, k, num_threads()), **kw)


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
    return _run(a, b, out, ta, tb, "gemm", alpha=alpha, beta=beta)


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
        return _run(x, w, y, False, True, "linear_forward", bias=b, relu=relu, mask_out=out_mask)
    yt = _run(w, x, transposed_buffer(m * n).reshape(m, n), False, True, "linear_forward_t")
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
        _run(g, w, dx, False, False, "linear_dx", mask=(x if x_mask is None else x_mask) if input_relu else None)
    return dx, _weight_grad(g, x, dw, DW_LAYOUT.choose((m, k, n, num_threads()))["transposed"]), db


def _weight_grad(g, x, dw, transposed):
    """dw = g.T @ x on validated arrays, directly or as dw.T = x.T @ g then transposed (the same
    FMA chain per element either way: identical bits)."""
    m, k = dw.shape
    if transposed:
        return transpose_into(_run(x, g, transposed_buffer(k * m).reshape(k, m), True, False, "linear_dwt"), dw)
    return _run(g, x, dw, True, False, "linear_dw")


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
    return _run(a_cat, b.reshape(nb * k, n), out, False, False, "batch_reduce_gemm", alpha=alpha, beta=beta)
