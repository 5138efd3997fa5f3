"""Which layout a SplitBF16Table is built in (split_bf16.LAYOUTS): a per-CPU knob, since it
trades the forward's use of the caches against the update's page walks, which the CPU's caches
and TLB price.

Pairs (lo[r] right after hi[r]) let an update of row r touch one page; split halves, two. Beyond
the TLB's reach every page is a walk: at R=1e7 D=128 on Zen 4 the Split-SGD took 1.47x the fp32
time split and 1.11x as pairs, the forward the same time in both. But a forward reads hi alone,
and on a table the caches could hold, pairs spread its hi lines over twice the sets and the
adjacent-line prefetches fetch lo lines it never reads: at R=3e4 (15 MB) the pairs forward took
1.5x the split one, at R=1e5 1.2x, from R=1e6 (512 MB) on both the same.

That was AMD's core. On an Intel Emerald Rapids split won at every size: forward + Split-SGD at
R=1e7 D=128 pooling 20 2.16-2.40 ms split against 2.49-2.70 ms pairs, on 2 MiB or 4 KiB pages
alike (no walk to save), at R=1e6 1.71-1.76 against 2.19-2.21. Pairs are the heuristic's only
where the prefetchers are AMD's (Target.page_streams 0, the model of the CPU's prefetching we have);
the tuner decides elsewhere.
"""
from __future__ import annotations

from ...codegen.knobs import knob
from ...codegen.target import host_target
from . import forward, sgd
from ._knobs import problems, quick_class, shape_class
from .split_bf16 import LAYOUT_KNOB, LAYOUTS

PAIRS_FROM_L3 = 8  # tables (both halves) beyond this many last-level caches are built as pairs


def _heuristic(problem) -> dict:
    """Pairs for a table of PAIRS_FROM_L3 last-level caches or more on AMD's cores: its rows come
    from memory in either layout (so the forward loses nothing), and its pages are many."""
    rows, dim = problem[0], problem[1]
    t = host_target()
    return {"layout": "pairs" if t.page_streams == 0 and 4 * rows * dim >= PAIRS_FROM_L3 * t.l3 else "split"}


def _candidates(problem, quick):
    return [{"layout": layout} for layout in LAYOUTS]


def _timed(problem, params):
    """A training step's use of one table: the forward of a batch, then its fused Split-SGD."""
    fwd = forward._timed(problem, layout=params["layout"])
    update = sgd._timed(problem, layout=params["layout"])

    def step():
        fwd()
        update()
    return step


LAYOUT = knob(LAYOUT_KNOB, doc="how a SplitBF16Table stores its halves: two arrays, or one of row pairs",
              heuristic=_heuristic, shape_class=shape_class, quick_class=quick_class,
              problems=lambda w: problems(w, itemsizes=(2,)), candidates=_candidates, runner=_timed)
