"""The GEMM's per-CPU knobs: cache blocks per op variant (heuristic from the target's caches and
register tile, tuner candidates and runners) and the non-temporal store threshold, with the block
lookup the ops run through (`run_blocked`). The layout knobs (forward and weight gradient computed
transposed) stay in ops/gemm.py beside the code they choose between."""
from __future__ import annotations

import functools

import numpy as np

from ..codegen import host_target, target_isa
from ..codegen.knobs import knob, on_threads, pow2_class
from ..codegen.simd import short_rows, tile_for
from .gemm_blocking import BlockChoices, forward_transposed, layer_problems, split_for_threads
from .gemm_blocking import round_to as _round_to
from .gemm_kernel import STREAM_KNOB, STREAM_MAX_K, gemm_into, stream_heuristic, tail_tiles
from .gemm_pack import b_in_place
from .workspace import empty_aligned


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
    in one K pass, 95 in passes of 256 rows, on Zen 4). Where the L2 prefetchers follow only page
    streams (Target.page_streams, Intel's), nothing but the sweep's hints brings B's rows read in
    place, by any number of row tiles: such rows stay within a quarter of L2, and each row tile's
    share of the next panel's hints within page_streams rows (Emerald Rapids, 4 KiB rows: a dwt of
    100 x 1024 x 2048 ran at 104 GF/s with kc = 512, 162 with 128; a 32-row dx of 1024 x 1024 at
    81 and 138; 13 x 512 x 2048, 2 KiB rows, at 71-78 and 96-101 with 64-128); A's columns too
    stay within a quarter of L2 there (AVX2 dw 512 x 13 x 2048: 55 with 512, 58 with 256).
    kc is then split evenly over K.

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
    Except where B (k, n) is beyond half of L2: then the driver packs it one K pass at a time
    (gemm_kernel's by-pass packing), each pass of as many rows as PASS_ROW_BYTES-long rows half
    of L2 holds (a 32-row dx of 1024 x 1024 on Zen 3: 4 passes, 10% faster than one)."""
    t = host_target()
    mr, nr, _ = tile_for(t.isa)
    kc0 = min(512, max(128, (2 * t.l1d) // (nr * 4) // 16 * 16))
    one_panel_dw = variant in ("linear_dw", "linear_dwt") and n <= nr  # A's columns read in place
    forward = variant in ("linear_forward", "linear_forward_t")  # B transposed: packed
    in_place_b = b_in_place(forward, m, n, mr, nr)
    strided_b = in_place_b and m > 2 * mr
    hinted_b = in_place_b and t.page_streams > 0
    reach = t.l2 // 4 if t.page_streams else t.l2  # of L2, for rows reread a stride apart
    for reread, row_floats in ((one_panel_dw, m), (strided_b or hinted_b, n)):  # kc rows of A's columns, of B
        if reread:
            kc0 = min(kc0, max(64, reach // (row_floats * 4) // 16 * 16))
    if hinted_b:  # each row tile hints kc / tiles of the next panel's rows
        kc0 = min(kc0, max(64, t.page_streams * sum(tail_tiles(m, mr, short_rows(t.isa))) // 16 * 16))
    whole = _round_to(m, mr)

    def one_block(kc):  # all rows' A block in 3/4 of L2, all of C in half
        return whole * kc * 4 <= t.l2 * 3 // 4 and m * n * 4 <= t.l2 // 2

    if not (one_panel_dw or strided_b or hinted_b) and k * 4 <= PAGE and one_block(k):
        if not (forward or in_place_b) and k * n * 4 > t.l2 // 2:
            passes = -(-k // max(16, t.l2 // 2 // PASS_ROW_BYTES))
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
PASS_ROW_BYTES = 1024  # sizes the K passes of a packed B beyond half of L2 (heuristic_blocks)


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
def tuning_inputs(ta: bool, tb: bool, m: int, n: int, k: int):
    """Random operands and an output for one tuning problem, made once for all its candidates."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((k, m) if ta else (m, k), dtype=np.float32)
    b = rng.standard_normal((n, k) if tb else (k, n), dtype=np.float32)
    return a, b, np.empty((m, n), np.float32)


def _runner(variant):
    def runner(problem, params):
        m, n, k, threads = problem
        ta, tb = variant in ("linear_dw", "linear_dwt"), variant in ("linear_forward", "linear_forward_t")
        a, b, c = tuning_inputs(ta, tb, m, n, k)
        blocks = shape_blocks(params, m, n, k, threads)
        return on_threads(threads, lambda: gemm_into(a, b, c, ta, tb, blocks))
    return runner


def forward_transposed_heuristic(batch: int, out: int, k: int) -> bool:
    return forward_transposed(batch, out, k, tile_shape()[1], host_target().l2)


BLOCKS = {v: knob(f"gemm.blocks.{v}", doc=f"(mc, kc) cache blocks of {v}",
                  heuristic=lambda p, v=v: heuristic_blocks(v, *p),
                  shape_class=lambda p: f"{pow2_class(*p[:3])}t{p[3]}",
                  problems=layer_problems(v, lambda: tile_shape()[:2], transposed=forward_transposed_heuristic),
                  candidates=_candidates, runner=_runner(v))
          for v in VARIANTS}


blocks_for = BlockChoices(BLOCKS, shape_blocks)


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


def run_blocked(a, b, c, ta, tb, op, **kw):
    """gemm_into with the blocks of `op` for this shape and thread count."""
    return blocks_for.run(gemm_into, a, b, c, ta, tb, op, **kw)
