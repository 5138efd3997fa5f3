"""The bf16 GEMM driver: C (M, N) = epilogue(op(A) @ op(B)) for bf16 A and B, fp32 accumulation, C fp32 or bf16.

Two paths, chosen per spec (`native`, a closure constant, so the other path's branches are pruned
before typing):
  native (AVX512_BF16): B packed into k-pair-interleaved NR-wide panels, A read in place when
    row-major (its pairs are adjacent) or packed k-pair-interleaved; the vdpbf16ps tile
    (codegen.simd_bf16.dp_tile) fuses bias, ReLU and the bf16 rounding of C into its registers.
  widening (no bf16 dot product, or one slower than the fp32 FMAs: the gemm.bf16.dot knob): A and
    B widened to fp32 while packing, the fp32 FMA tile (codegen.simd.fma_tile); a bf16 C is
    rounded from the fp32 tile right after its last K pass.
Blocking follows the fp32 driver (ops/gemm_kernel.py): B packed once, each C block one parallel
task with its K passes in a fixed order, so results are bit-identical run to run and for any
thread count. A bf16 C keeps its partial sums in an fp32 block per task between K passes.
Everything here works in elements of the flat arrays; bf16 values travel as their uint16 bits.
The packing loops are in ops/gemm_bf16_pack.py; the tile choice (knob gemm.bf16.dot) is here.
"""
from __future__ import annotations

import functools

import numpy as np
from numba import prange

from ..codegen import KernelSpec, get_kernel, host_target, jit, kernel_factory, target_isa, tunedb, uidx as _u
from ..codegen.knobs import knob
from ..codegen.peaks import bf16_peak_gflops, fma_peak_gflops
from ..codegen.simd import NO_MASK, fma_tile, tile_code, tile_dims, tile_for
from ..codegen.simd_bf16 import bf16_tile_code, bf16_tile_dims, bf16_tile_for, dp_tile, round_bf16
from ..config import choice_token
from .gemm_bf16_pack import pair_pack_a_block, pair_pack_b_columns, pair_pack_b_rows, widen_pack_a_block, widen_pack_b
from .gemm_blocking import split_for_threads
from .gemm_kernel import NO_BYTES
from .gemm_pack import prefetch_c
from .workspace import thread_buffer


# --------------------------------------------------------------------------- tiles


@jit(inline="always")
def _edge_dp(code, kcb, a_op, b_op, cin, cout, bias_op, flags, scratch, cut):
    """A native tile with only rows x cols inside C: computed whole in scratch = (fp32 tile, tile of
    cout's dtype), the valid part copied out; cut = (rows, cols); the rest as dp_tile's."""
    _, nr = bf16_tile_dims(code)
    ftile, otile = scratch
    rows, cols = cut
    cf, cio, cld = cin
    of, oo, old = cout
    if flags[0]:
        for r in range(rows):
            for q in range(cols):
                ftile[_u(r * nr + q)] = cf[_u(cio + r * cld + q)]
    dp_tile(code, kcb, a_op, b_op, (ftile, 0, nr), (otile, 0, nr), bias_op, flags)
    for r in range(rows):
        for q in range(cols):
            of[_u(oo + r * old + q)] = otile[_u(r * nr + q)]


@jit(inline="always")
def _sweep_dp(code, a_src, b_src, acc, out, scratch, blk, kpass, geo, flags):
    """One K pass of one C block with the native tile. a_src = (flat A, packed A block), b_src =
    (packed B, bias zero-padded to whole panels); acc: where partial sums live between K passes,
    out: C (each (flat array, offset of the block's first element, row stride)); the last pass reads
    acc and writes out. blk = (i0, mcb, j0, ncb), kpass = (p0, kcb), geo = (k, ps); scratch = (fp32
    tile, tile of C's dtype); flags = (load, last, use_bias, relu, a_inplace)."""
    mr, nr = bf16_tile_dims(code)
    aflat, ap = a_src
    bp, biasp = b_src
    af, ao, ald = acc
    of, oo, old = out
    i0, mcb, j0, ncb = blk
    p0, kcb = kpass
    k, ps = geo
    load, last, use_bias, relu, a_inplace = flags
    tflags = (load, last, use_bias, relu)
    kcp = (kcb + 1) // 2 * 2
    for jp in range(j0 // nr, (j0 + ncb + nr - 1) // nr):
        jj = jp * nr
        nrem = min(nr, j0 + ncb - jj)
        b_op = (bp, jp * ps + p0 * nr, 2 * nr)
        for ip in range((mcb + mr - 1) // mr):
            ii = i0 + ip * mr
            mrem = min(mr, i0 + mcb - ii)
            a_op = (aflat, ii * k + p0, 2, k) if a_inplace and mrem == mr else (ap, ip * kcp * mr, 2 * mr, 2)
            t_acc = (af, ao + (ii - i0) * ald + jj - j0, ald)
            t_out = (of, oo + (ii - i0) * old + jj - j0, old)
            whole = mrem == mr and nrem == nr
            if whole and last:
                prefetch_c(of, t_out[1], old, mr, nr * of.itemsize)
            elif whole:
                prefetch_c(af, t_acc[1], ald, mr, nr * 4)
            if last and whole:
                dp_tile(code, kcb, a_op, b_op, t_acc, t_out, (biasp, jj), tflags)
            elif last:
                _edge_dp(code, kcb, a_op, b_op, t_acc, t_out, (biasp, jj), tflags, scratch, (mrem, nrem))
            elif whole:
                dp_tile(code, kcb, a_op, b_op, t_acc, t_acc, (biasp, jj), tflags)
            else:
                _edge_dp(code, kcb, a_op, b_op, t_acc, t_acc, (biasp, jj), tflags, (scratch[0], scratch[0]),
                         (mrem, nrem))


@jit(inline="always")
def _sweep_fma(code, ap, b_src, c_op, scratch, blk, kpass, geo, flags):
    """One K pass of one C block with the fp32 tile on widened panels: C (c_op = (flat fp32, offset of
    the block's first element, row stride)) accumulates in place; `scratch` takes edge tiles."""
    mr, nr = tile_dims(code)
    bp, biasp = b_src
    cf, co, ld = c_op
    i0, mcb, j0, ncb = blk
    p0, kcb = kpass
    k, ps = geo
    load = flags[0]
    tflags = (flags[0], flags[1], flags[2], flags[3], NO_MASK)  # (load, last: the epilogue, use_bias, relu, mask)
    for jp in range(j0 // nr, (j0 + ncb + nr - 1) // nr):
        jj = jp * nr
        nrem = min(nr, j0 + ncb - jj)
        b_op = (bp, jp * ps + p0 * nr, nr)
        for ip in range((mcb + mr - 1) // mr):
            ii = i0 + ip * mr
            mrem = min(mr, i0 + mcb - ii)
            a_op = (ap, ip * kcb * mr, mr, 1)
            off = co + (ii - i0) * ld + jj - j0
            if mrem == mr and nrem == nr:
                prefetch_c(cf, off, ld, mr, nr * 4)
                fma_tile(code, kcb, a_op, b_op, (cf, off, ld), (biasp, jj), tflags, (biasp, NO_BYTES, 0))
            else:
                if load:
                    for r in range(mrem):
                        for q in range(nrem):
                            scratch[_u(r * nr + q)] = cf[_u(off + r * ld + q)]
                fma_tile(code, kcb, a_op, b_op, (scratch, 0, nr), (biasp, jj), tflags, (biasp, NO_BYTES, 0))
                for r in range(mrem):
                    for q in range(nrem):
                        cf[_u(off + r * ld + q)] = scratch[_u(r * nr + q)]


@jit(inline="always")
def _round_block(cf, part, blk, n, nc):
    """C[block] = bf16 of the fp32 block `part` (row stride nc)."""
    i0, mcb, j0, ncb = blk
    for r in range(mcb):
        for q in range(ncb):
            cf[_u((i0 + r) * n + j0 + q)] = round_bf16(part[_u(r * nc + q)])


# --------------------------------------------------------------------------- the driver


@kernel_factory("gemm_bf16")
def _gemm_bf16_factory(spec: KernelSpec):
    # compile-time: the tile shape, the path and C's dtype (their branches pruned before typing)
    MR, NR = spec["mr"], spec["nr"]
    NATIVE, OUT_BF16 = spec["native"], spec["out_bf16"]
    CODE = bf16_tile_code(MR, NR) if NATIVE else tile_code(MR, NR, spec["vw"])

    @jit(parallel=True)
    def gemm_bf16_kernel(a, b, c, bias, ws, part, dims, blocks, flags):
        # a: (m, k) or (k, m) if ta, uint16; b: (k, n) or (n, k) if tb, uint16; c: (m, n) float32,
        # or uint16 if OUT_BF16; bias: (n,) float32 if use_bias; ws: packing scratch (uint16
        # natively, float32 widening); part: fp32 partial blocks (mc * nc per task) for a bf16 C;
        # dims = (m, n, k); blocks = (mc, kc, nc), kc even unless it is all of k;
        # flags = (ta, tb, use_bias, relu)
        m, n, k = dims
        mc, kc, nc = blocks
        ta, tb, use_bias, relu = flags
        npan = (n + NR - 1) // NR
        ps = ((k + 1) // 2 * 2 * NR + 32) if NATIVE else (k * NR + 16)  # + one line: no 4K aliasing
        bsize = npan * ps
        bp, bflat, aflat, cf = ws[:bsize], b.reshape(b.size), a.reshape(a.size), c.reshape(m * n)
        if NATIVE and not tb:
            bp32 = bp.view(np.uint32)
            for kb in prange(((k + 1) // 2 + 31) // 32):
                pair_pack_b_rows(bp32, bflat, kb, (n, k, ps), NR)
        elif NATIVE:
            for p in prange(npan):
                pair_pack_b_columns(bp, bflat, p, (n, k, ps), NR)
        else:
            for p in prange(npan):
                widen_pack_b(bp, bflat, p, (n, k, ps), tb, NR)
        biasp = np.zeros(npan * NR, np.float32)
        if use_bias:
            biasp[:n] = bias
        nib, njb = (m + mc - 1) // mc, (n + nc - 1) // nc
        npc = max(1, (k + kc - 1) // kc)
        apsize = (mc + MR - 1) // MR * MR * ((max(kc, 1) + 1) // 2 * 2)
        for t in prange(nib * njb):
            ib = t // njb
            i0, j0 = ib * mc, (t - ib * njb) * nc
            blk = (i0, min(mc, m - i0), j0, min(nc, n - j0))
            ap = ws[bsize + t * apsize:bsize + (t + 1) * apsize]
            if OUT_BF16:  # partial sums between K passes: an fp32 block of this task's own
                acc = (part[t * mc * nc:(t + 1) * mc * nc], 0, nc)
            else:
                acc = (cf, i0 * n + j0, n)
            scratch = (np.empty(MR * NR, np.float32), np.empty(MR * NR, c.dtype))
            for pi in range(npc):
                kpass = (pi * kc, min(kc, k - pi * kc))
                fl = (pi > 0, pi == npc - 1, use_bias, relu, not ta)
                if NATIVE:
                    pair_pack_a_block(ap, aflat, blk, kpass, (m, k), ta, MR)
                    _sweep_dp(CODE, (aflat, ap), (bp, biasp), acc, (cf, i0 * n + j0, n), scratch, blk, kpass,
                              (k, ps), fl)
                else:
                    widen_pack_a_block(ap, aflat, blk, kpass, (m, k), ta, MR)
                    _sweep_fma(CODE, ap, (bp, biasp), acc, scratch[0], blk, kpass, (k, ps), fl)
            if OUT_BF16 and not NATIVE:
                _round_block(cf, acc[0], blk, n, nc)
    return gemm_bf16_kernel


# --------------------------------------------------------------------------- dispatch


_TILES: dict = {}


def bf16_tile(isa: str | None = None, native: bool | None = None) -> tuple[bool, int, int, int]:
    """(native, MR, NR, vector width) of the bf16 GEMM on `isa` (default: the current target's):
    the vdpbf16ps tile where the target has AVX512_BF16 and the gemm.bf16.dot knob picks it, else
    the fp32 tile on widened panels; native: force the choice (where the target has the dot
    product). Memoised per configuration and tuning-DB generation: every bf16 GEMM call asks."""
    key = (isa, native, choice_token(), tunedb.generation())
    got = _TILES.get(key)
    if got is None:
        got = _TILES[key] = _bf16_tile(isa, native)
    return got


def _bf16_tile(isa, native):
    t = host_target()
    isa = isa or t.isa
    has_dot = t.has("avx512bf16") and isa == t.isa
    if native is None:
        native = has_dot and DOT.choose(DOT_PROBLEM)["native"]
    tile = bf16_tile_for(isa, has_dot and native)
    if tile is not None:
        return True, tile[0], tile[1], 16
    return (False, *tile_for(isa))


@functools.lru_cache(maxsize=None)
def _kernel(isa: str, out_bf16: bool, tile: tuple):
    native, mr, nr, vw = tile
    return get_kernel(KernelSpec.make("gemm_bf16", dtype="bfloat16", mr=mr, nr=nr, vw=vw, native=int(native),
                                      out_bf16=int(out_bf16)))


# --------------------------------------------------------------------------- the dot-product knob

DOT_PROBLEM = (2048, 512, 512)   # (m, n, k) of the GEMM the tuner times both tiles on
DOT_MARGIN = 0.75                # the dot product is kept unless its peak is below this share of FMA's


@functools.lru_cache(maxsize=None)
def _dot_pays(key: str) -> bool:
    """Whether this core's measured vdpbf16ps peak is at least DOT_MARGIN of its fp32 FMA peak
    (short register-only probes, about a millisecond each, once per target). Zen 4 runs the dot
    product at twice the FMA rate; an Intel core with two 512-bit FMA ports at half of it, where
    widened operands feed the fp32 tile faster."""
    dot = bf16_peak_gflops(200_000, 3)
    return dot is not None and dot >= DOT_MARGIN * fma_peak_gflops(200_000, 3)


def _dot_heuristic(problem):
    return {"native": _dot_pays(host_target().key)}


def _dot_problems(workload):
    t = host_target()
    if "bf16" in workload.precisions and t.has("avx512bf16") and target_isa() == t.isa:
        yield DOT_PROBLEM


def _dot_runner(problem, params):
    m, n, k = problem
    rng = np.random.default_rng(0)
    a = (rng.standard_normal((m, k), dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)
    b = (rng.standard_normal((n, k), dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)
    c = np.empty((m, n), np.float32)
    native, mr, nr, _ = bf16_tile(None, params["native"])
    blocks = split_for_threads(12 * mr, k if native else min(k, 512), m, n, k, 1, (mr, nr))
    return lambda: gemm_bf16_into(a, b, c, False, True, blocks, native=params["native"])


DOT = knob("gemm.bf16.dot", doc="bf16 GEMMs on the vdpbf16ps tile (native) or widened to fp32 for the FMA tile",
           heuristic=_dot_heuristic, shape_class=lambda p: "all", problems=_dot_problems,
           candidates=lambda p, quick: [{"native": True}, {"native": False}], runner=_dot_runner)


def grad_buffer(size: int) -> np.ndarray:
    """This thread's uint16 buffer for the masked bf16 output gradient (consumed before
    linear_backward returns): multi-MB buffers allocated per call would pay their page faults."""
    return thread_buffer("grad16", np.uint16, size)


_DUMMY_F32 = np.zeros(1, np.float32)


def gemm_bf16_into(a, b, c, ta, tb, blocks, *, bias=None, relu=False, native=None):
    """Run the driver on validated C-contiguous uint16 bf16 bits a, b with blocks = (mc, kc, nc);
    c: float32, or uint16 for bf16 bits, (m, n), written and returned; native: force the tile
    (bf16_tile)."""
    m, n = c.shape
    if m == 0 or n == 0:
        return c
    k = a.shape[0] if ta else a.shape[1]
    isa = target_isa()
    out_bf16 = c.dtype == np.uint16
    tile = bf16_tile(isa, native)
    native, mr, nr, _ = tile
    mc, kc, nc = blocks
    tasks = -(-m // mc) * -(-n // nc)
    kcp = (max(kc, 1) + 1) // 2 * 2
    if native:
        ws = thread_buffer("ws16", np.uint16, -(-n // nr) * ((k + 1) // 2 * 2 * nr + 32) + tasks * -(-mc // mr) * mr * kcp)
    else:
        ws = thread_buffer("ws32", np.float32, -(-n // nr) * (k * nr + 16) + tasks * -(-mc // mr) * mr * kcp)
    part = thread_buffer("part", np.float32, tasks * mc * nc) if out_bf16 else _DUMMY_F32
    _kernel(isa, out_bf16, tile)(a, b, c, _DUMMY_F32 if bias is None else bias, ws, part, (m, n, k), (mc, kc, nc),
                           (bool(ta), bool(tb), bias is not None, bool(relu)))
    return c
