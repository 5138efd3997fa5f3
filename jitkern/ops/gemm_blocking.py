"""Blocking arithmetic shared by the fp32 and bf16 GEMM families (ops/gemm.py, ops/gemm_bf16.py):
rounding to the register tile, the weight-gradient variant, the split of cache blocks over threads
and the GEMMs a workload's linear layers pose, and the per-call memo of chosen blocks. Pure Python:
no kernel here."""
from __future__ import annotations

from ..codegen import num_threads
from ..codegen.knobs import memo_choices


def round_to(x: int, m: int) -> int:
    """x rounded up to a multiple of m, at least m."""
    return max(m, (x + m - 1) // m * m)


def _lane_use(m: int, n: int, mr: int, nr: int) -> float:
    """Fraction of the register tile's lanes an (m, n) C keeps busy (1 for an empty C: no tiles)."""
    if m == 0 or n == 0:
        return 1.0
    return m / (-(-m // mr) * mr) * n / (-(-n // nr) * nr)


def dw_variant(m: int, k: int, mr: int, nr: int) -> str:
    """linear_backward's weight gradient (m out, k in): dw = g.T @ x ("linear_dw"), or
    dw.T = x.T @ g ("linear_dwt") when that fills the register tiles better (13 -> 512: 0.81 vs
    0.41 of the lanes); at equal use dw is the faster of the two, and it still is at a few percent
    fewer lanes (AVX2, 256 -> 64 at 0.977x dwt's lanes: dw 15-20% faster; AVX-512, 367 -> 512 at
    0.96x: a tie). The heuristic of the tuned knob gemm.layout.linear_dw (ops/gemm.py)."""
    return "linear_dwt" if _lane_use(k, m, mr, nr) > 1.03 * _lane_use(m, k, mr, nr) else "linear_dw"


def forward_transposed(batch: int, out: int, k: int, nr: int, l2: int) -> bool:
    """The heuristic for linear_forward's layout: y.T = w @ x.T ("linear_forward_t", then
    transposed with the epilogue) instead of y = x @ w.T when packing x and transposing y move at
    most half the floats that packing w does (a small batch: w is used by few rows, so its copy
    costs as much as the FMAs), and the batch fills half of an NR-wide tile or w is too large for
    half of L2 (its copy then comes from farther away). Not for one row (the matrix-vector kernel)."""
    return batch > 1 and batch * (k + out) * 2 <= out * k and (2 * batch >= nr or 8 * out * k >= l2)


def split_for_threads(mc: int, kc: int, m: int, n: int, k: int, threads: int, tile: tuple) -> tuple[int, int, int]:
    """(mc, kc, nc) for C (m x n) += A (m x k) B (k x n) from chosen (mc, kc) (mc already a multiple
    of MR): one K pass where a second would be a sliver; row blocks evened out over `threads`, and
    the columns split too where there are fewer than two row blocks per thread (the rows, where C
    is a single column panel). tile = (MR, NR)."""
    mr, nr = tile
    if k <= kc * 5 // 4:  # one pass over K beats a full pass plus a sliver
        kc = max(k, 1)
    nib = -(-m // mc)
    if threads > 1:
        nib = round_to(nib, threads) if nib >= threads else nib
        mc = round_to(-(-m // nib), mr)
        nib = -(-m // mc)
    nc = round_to(n, nr)
    if nib < 2 * threads and threads > 1:  # too few row blocks: split the columns too
        njb = -(-2 * threads // nib)
        nc = round_to(-(-n // njb), nr)
        if nib * -(-n // nc) < threads:    # one column panel (a transposed small batch): rows after all
            mc = round_to(-(-m // threads), mr)
    return mc, kc, nc


def layer_problems(variant: str, tile, precision: str = "fp32", transposed=None):
    """problems(workload): the (m, n, k, threads) GEMMs of `variant` that a workload's linear layers
    run in `precision` (none if they run in another); tile() -> (MR, NR) of the family's register
    tile (read when the problems are asked for); transposed(batch, out, in) -> whether the family
    runs that forward as linear_forward_t (None: it has no such variant)."""
    def problems(w):
        if precision not in w.precisions:
            return
        mr, nr = tile()
        for batch, kin, kout in w.linears:
            for threads in w.threads:
                if variant in ("linear_forward", "linear_forward_t"):
                    t = transposed is not None and transposed(batch, kout, kin)
                    if (variant == "linear_forward_t") == t:
                        yield (kout, batch, kin, threads) if t else (batch, kout, kin, threads)
                elif variant == "linear_dx":
                    yield batch, kin, kout, threads
                elif variant == dw_variant(kout, kin, mr, nr):
                    yield (kout, kin, batch, threads) if variant == "linear_dw" else (kin, kout, batch, threads)
    return problems


class BlockChoices:
    """blocks_for(variant, m, n, k, threads) -> (mc, kc, nc) for one call: the family's knob choice
    (tuned or heuristic) shaped for the threads by `shape`, memoised per call shape, configuration
    and tuning-DB generation (codegen.knobs.memo_choices: a GEMM call asks for its blocks every time)."""

    def __init__(self, knobs: dict, shape):
        self.knobs, self.shape = knobs, shape
        self._chosen = memo_choices(lambda v, m, n, k, t: shape(knobs[v].choose((m, n, k, t)), m, n, k, t))

    def __call__(self, variant: str, m: int, n: int, k: int, threads: int) -> tuple[int, int, int]:
        return self._chosen(variant, m, n, k, threads)

    def run(self, driver, a, b, c, ta, tb, variant, **kw):
        """driver(a, b, c, ta, tb, blocks, **kw) with the blocks of `variant` for this shape on the
        current thread count; an empty C returns at once."""
        m, n = c.shape
        if m == 0 or n == 0:
            return c
        k = a.shape[0] if ta else a.shape[1]
        return driver(a, b, c, ta, tb, self(variant, m, n, k, num_threads()), **kw)
